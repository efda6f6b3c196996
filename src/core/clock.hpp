// indexcp: the one clock of the library's and the tools' host timings (the steady clock; device
// work is timed with CUDA events, src/bench/harness.cuh).
#pragma once

#include <chrono>

namespace indexcp::detail {

/// Seconds since an arbitrary fixed point of the steady clock.
inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
/// The same in microseconds.
inline double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace indexcp::detail
