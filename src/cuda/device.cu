// The device: whether one is visible, its name, the device rule, one-time setup (cuda.hpp).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common.cuh"
#include "core/batch.hpp"
#include "indexcp/cuda.hpp"
#include "kernels.cuh"
#include "launches.cuh"
#include "plan.cuh"
#include "comm/rank_barrier.hpp"
#include "boundary.cuh"

namespace indexcp::cuda {

using namespace detail;

bool available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

std::string device_name() {
  int dev = 0;
  INDEXCP_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp p;
  INDEXCP_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  return p.name;
}

void require_supported_device() {
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  static std::mutex mu;
  static std::vector<int8_t> known;  // per device: 0 unknown, 1 supported, -1 refused
  {
    std::lock_guard<std::mutex> lk(mu);
    if (dev < static_cast<int>(known.size()) && known[dev] == 1) return;
  }
  int major = 0, minor = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "cudaDeviceGetAttribute");
  check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), "cudaDeviceGetAttribute");
  if (major != 9 || minor != 0) {
    cudaDeviceProp p;
    const std::string name = cudaGetDeviceProperties(&p, dev) == cudaSuccess ? p.name : "?";
    throw Error(ErrorCode::kUnsupported, device_support_message(dev, name, major, minor));
  }
  std::lock_guard<std::mutex> lk(mu);
  if (static_cast<int>(known.size()) <= dev) known.resize(dev + 1, 0);
  known[dev] = 1;
}

void prepare_device() {
  require_supported_device();
  ensure_tables();
}

}  // namespace indexcp::cuda
