// Internal helpers of the CUDA backend: error checks, the score order key.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "device_buffer.cuh"
#include "indexcp/error.hpp"
#include "indexcp/formats.hpp"

namespace indexcp::cuda::detail {

/// Throws Error(kRuntime) naming the CUDA call when `e` is not cudaSuccess. The runtime's
/// per-thread last error is cleared first: the failure is reported once, by this exception, and
/// not again by the next launch check of a later, valid call (sticky errors persist regardless).
inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error(ErrorCode::kRuntime, std::string("CUDA: ") + what + " failed: " + cudaGetErrorName(e) +
                                         " (" + cudaGetErrorString(e) + ")");
  }
}
#define INDEXCP_CUDA_CHECK(call) ::indexcp::cuda::detail::check((call), #call)
/// After a kernel launch: reports launch-configuration errors (never waits for the kernel).
#define INDEXCP_CUDA_LAUNCH_CHECK(name) ::indexcp::cuda::detail::check(cudaGetLastError(), name)

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/// Multiprocessor count of the current device (cached per device).
int sm_count();

/// The backend's error texts for DeviceBuffer (device_buffer.cuh).
struct BackendBufferErrors {
  static void check(cudaError_t e, const char* what) { detail::check(e, what); }
  static constexpr const char* kMalloc = "cudaMalloc (workspace)";
  static constexpr const char* kUpload = "cudaMemcpy (upload)";
  static constexpr const char* kDownload = "cudaMemcpy (download)";
  static constexpr bool kAllocateEmpty = false;
};
template <class T>
using DeviceBuffer = BasicDeviceBuffer<T, BackendBufferErrors>;

// ---------------------------------------------------------------------------------------------
// The order of scores (indexer.md section 3) as unsigned keys: higher key = better score.
// NaN -> 0 (below everything), -0.0 and +0.0 -> the same key, -Inf -> 0x007FFFFF.

// Without branches (selects only): the select kernels convert every candidate's score.
__host__ __device__ __forceinline__ uint32_t score_key(float s) {
  uint32_t u = fmt::f32_bits(s);
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  u = u == 0x80000000u ? 0u : u;  // -0.0 == +0.0
  const uint32_t k = u ^ (static_cast<uint32_t>(static_cast<int32_t>(u) >> 31) | 0x80000000u);  // negative: ~u
  return nan ? 0u : k;
}
/// (score desc, id asc) as one unique unsigned 64-bit key (ids >= 0): higher = better.
__host__ __device__ __forceinline__ uint64_t cand_key(float s, int32_t id) {
  return (static_cast<uint64_t>(score_key(s)) << 32) | static_cast<uint64_t>(0xffffffffu - static_cast<uint32_t>(id));
}

}  // namespace indexcp::cuda::detail
