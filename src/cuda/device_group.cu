// cuda::DeviceGroup, the in-process device communicator, and run_device_ranks (cuda.hpp).
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
#include "comm/rank_threads.hpp"
#include "boundary.cuh"

namespace indexcp::cuda {

using namespace detail;

// ---- device communicator ------------------------------------------------------------------

struct DeviceGroup::State {
  explicit State(int w) : world(w), barrier(w) {}
  int world = 1;
  indexcp::detail::RankBarrier barrier;
  std::vector<cudaEvent_t> ready, done;
  std::vector<std::unique_ptr<Communicator>> comms;
};

namespace {

class DeviceComm final : public Communicator {
 public:
  DeviceComm(DeviceGroup::State* s, int rank) : s_(s), rank_(rank) {}
  int rank() const override { return rank_; }
  int world() const override { return s_->world; }
  std::size_t bytes_sent() const override { return sent_; }

  // (the Use spans the events used after leave and the byte count)
  void all_gather(const void* send, void* recv, std::size_t bytes, void* stream) override {
    const indexcp::detail::RankBarrier::Use use(s_->barrier);
    exchange(send, recv, bytes, stream, false);
    sent_ += bytes;
  }
  void all_to_all(const void* send, void* recv, std::size_t bytes, void* stream) override {
    const indexcp::detail::RankBarrier::Use use(s_->barrier);
    exchange(send, recv, bytes, stream, true);
    sent_ += bytes * s_->world;
  }

 private:
  void exchange(const void* send, void* recv, std::size_t bytes, void* stream, bool to_all) {
    const cudaStream_t st = static_cast<cudaStream_t>(stream);
    // 1. my send buffer is complete at this point of my stream
    check(cudaEventRecord(s_->ready[rank_], st), "cudaEventRecord (all_gather ready)");
    s_->barrier.enter(rank_, to_all ? "all_to_all" : "all_gather", send, bytes);
    // 2. copy every rank's block once it is ready (a failing copy still meets the peers below)
    std::exception_ptr failed;
    try {
      for (int p = 0; p < s_->world; ++p) {
        check(cudaStreamWaitEvent(st, s_->ready[p], 0), "cudaStreamWaitEvent (all_gather)");
        if (bytes == 0) continue;
        const char* src = static_cast<const char*>(s_->barrier.ptr(p)) + (to_all ? rank_ * bytes : 0);
        check(cudaMemcpyAsync(static_cast<char*>(recv) + p * bytes, src, bytes, cudaMemcpyDeviceToDevice, st),
              "cudaMemcpyAsync (all_gather)");
      }
      check(cudaEventRecord(s_->done[rank_], st), "cudaEventRecord (all_gather done)");
    } catch (...) {
      failed = std::current_exception();
    }
    s_->barrier.leave();
    if (failed) std::rethrow_exception(failed);
    // 3. no rank reuses its send buffer before every peer has read it
    for (int p = 0; p < s_->world; ++p) check(cudaStreamWaitEvent(st, s_->done[p], 0), "cudaStreamWaitEvent (all_gather)");
  }

  DeviceGroup::State* s_;
  int rank_;
  std::size_t sent_ = 0;
};

}  // namespace

DeviceGroup::DeviceGroup(int world) {
  INDEXCP_REQUIRE(world >= 1 && world <= 64, "world = " + std::to_string(world) + " must be in 1..64");
  state_ = std::make_unique<State>(world);
  state_->ready.resize(static_cast<size_t>(world));
  state_->done.resize(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    check(cudaEventCreateWithFlags(&state_->ready[r], cudaEventDisableTiming), "cudaEventCreate");
    check(cudaEventCreateWithFlags(&state_->done[r], cudaEventDisableTiming), "cudaEventCreate");
    state_->comms.push_back(std::make_unique<DeviceComm>(state_.get(), r));
  }
}

DeviceGroup::~DeviceGroup() {
  state_->barrier.close();  // no rank still uses the events
  for (auto e : state_->ready) cudaEventDestroy(e);
  for (auto e : state_->done) cudaEventDestroy(e);
}

int DeviceGroup::world() const { return state_->world; }

Communicator& DeviceGroup::comm(int r) {
  INDEXCP_REQUIRE(r >= 0 && r < state_->world, "rank = " + std::to_string(r) + " is out of range");
  return *state_->comms[static_cast<size_t>(r)];
}

void DeviceGroup::abort() { state_->barrier.abort(); }

void DeviceGroup::depart(int r) {
  INDEXCP_REQUIRE(r >= 0 && r < state_->world, "rank = " + std::to_string(r) + " is out of range");
  state_->barrier.depart(r);
}

void run_device_ranks(int world, const std::function<void(int, Communicator&, Stream)>& fn) {
  int dev = 0;
  INDEXCP_CUDA_CHECK(cudaGetDevice(&dev));
  DeviceGroup group(world);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
  indexcp::detail::run_rank_threads(
      world, "run_device_ranks",
      [&](int r) {
        cudaStream_t st = nullptr;
        try {
          check(cudaSetDevice(dev), "cudaSetDevice");
          check(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate");
          fn(r, group.comm(r), reinterpret_cast<Stream>(st));
          group.depart(r);  // peers still waiting in a collective get an Error
          check(cudaStreamSynchronize(st), "cudaStreamSynchronize (rank)");
        } catch (...) {
          errors[static_cast<size_t>(r)] = std::current_exception();
          group.abort();
        }
        if (st) {
          cudaStreamSynchronize(st);
          cudaStreamDestroy(st);
        }
      },
      [&] { group.abort(); });
  rethrow_rank_errors(errors);
}

}  // namespace indexcp::cuda
