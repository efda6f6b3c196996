// One host thread per rank, shared by run_ranks (src/comm/inprocess.cpp) and run_device_ranks
// (src/cuda/device_group.cu).
#pragma once

#include <string>
#include <exception>
#include <thread>
#include <vector>

#include "indexcp/error.hpp"

namespace indexcp::detail {

/// Runs rank(r) for r in 0..world-1, each on its own thread, and joins them all. `rank` must not
/// throw (each rank records its own error). When a thread cannot be started, abort() ends the
/// waits of the ranks already started, they are joined, and Error (kRuntime) names `caller` and
/// the rank: the group is never destroyed while one of its threads still runs.
template <class Rank, class Abort>
void run_rank_threads(int world, const char* caller, const Rank& rank, const Abort& abort) {
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    try {
      threads.emplace_back([&rank, r] { rank(r); });
    } catch (const std::exception& e) {  // std::system_error, or std::bad_alloc for the thread's state
      abort();
      for (auto& t : threads) t.join();
      throw Error(ErrorCode::kRuntime, std::string(caller) + " could not start rank " + std::to_string(r) + ": " + e.what());
    }
  }
  for (auto& t : threads) t.join();
}

}  // namespace indexcp::detail
