// The CUDA backend's device rule (include/indexcp/cuda.hpp, require_supported_device), as plain
// C++ so that the CPU-only build and its tests have it too.
#include <string>

#include "indexcp/cuda.hpp"

namespace indexcp::cuda {

std::string device_support_message(int device, const std::string& name, int major, int minor) {
  if (major == 9 && minor == 0) return "";
  return "the CUDA backend of indexcp is built for sm_90a (Hopper, compute capability 9.0: H100, H200, GH200); "
         "device " + std::to_string(device) + " (" + name + ") has compute capability " + std::to_string(major) +
         "." + std::to_string(minor) + " (select a Hopper device with CUDA_VISIBLE_DEVICES, or use the cpu backend)";
}

}  // namespace indexcp::cuda
