// In-process communicator: W ranks as W threads of one process (host buffers).
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <system_error>
#include <mutex>
#include <omp.h>
#include <thread>
#include <vector>

#include "indexcp/comm.hpp"
#include "indexcp/error.hpp"
#include "rank_barrier.hpp"
#include "rank_threads.hpp"

namespace indexcp {

struct InProcessGroup::State {
  explicit State(int w) : world(w), barrier(w) {}
  int world;
  detail::RankBarrier barrier;
  std::vector<std::unique_ptr<Communicator>> comms;
};

namespace {

class InProcessComm final : public Communicator {
 public:
  InProcessComm(InProcessGroup::State* s, int rank) : s_(s), rank_(rank) {}
  int rank() const override { return rank_; }
  int world() const override { return s_->world; }
  std::size_t bytes_sent() const override { return sent_; }

  void all_gather(const void* send, void* recv, std::size_t bytes, void*) override {
    const detail::RankBarrier::Use use(s_->barrier);
    s_->barrier.enter(rank_, "all_gather", send, bytes);
    for (int p = 0; p < s_->world; ++p)
      if (bytes) std::memcpy(static_cast<char*>(recv) + p * bytes, s_->barrier.ptr(p), bytes);
    s_->barrier.leave();
    sent_ += bytes;
  }

  void all_to_all(const void* send, void* recv, std::size_t bytes, void*) override {
    const detail::RankBarrier::Use use(s_->barrier);
    s_->barrier.enter(rank_, "all_to_all", send, bytes);
    for (int p = 0; p < s_->world; ++p)
      if (bytes)
        std::memcpy(static_cast<char*>(recv) + p * bytes, static_cast<const char*>(s_->barrier.ptr(p)) + rank_ * bytes,
                    bytes);
    s_->barrier.leave();
    sent_ += bytes * s_->world;
  }

 private:
  InProcessGroup::State* s_;
  int rank_;
  std::size_t sent_ = 0;
};

}  // namespace

InProcessGroup::InProcessGroup(int world) {
  INDEXCP_REQUIRE(world >= 1 && world <= 64, "world = " + std::to_string(world) + " must be in 1..64");
  state_ = std::make_unique<State>(world);
  for (int r = 0; r < world; ++r) state_->comms.push_back(std::make_unique<InProcessComm>(state_.get(), r));
}

InProcessGroup::~InProcessGroup() { state_->barrier.close(); }

int InProcessGroup::world() const { return state_->world; }

Communicator& InProcessGroup::comm(int r) {
  INDEXCP_REQUIRE(r >= 0 && r < state_->world, "rank = " + std::to_string(r) + " is out of range");
  return *state_->comms[static_cast<size_t>(r)];
}

void InProcessGroup::abort() { state_->barrier.abort(); }

void InProcessGroup::depart(int r) {
  INDEXCP_REQUIRE(r >= 0 && r < state_->world, "rank = " + std::to_string(r) + " is out of range");
  state_->barrier.depart(r);
}

void run_ranks(int world, const std::function<void(int, Communicator&)>& fn) {
  InProcessGroup group(world);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
  // Share the cores among the ranks: each rank's parallel regions get cores / world threads, so
  // W ranks never oversubscribe the machine (OpenMP threads spin at barriers).
  const int per_rank = std::max(1, omp_get_max_threads() / world);
  detail::run_rank_threads(
      world, "run_ranks",
      [&](int r) {
        omp_set_num_threads(per_rank);
        try {
          fn(r, group.comm(r));
          group.depart(r);  // peers still waiting in a collective get an Error
        } catch (...) {
          errors[static_cast<size_t>(r)] = std::current_exception();
          group.abort();
        }
      },
      [&] { group.abort(); });
  rethrow_rank_errors(errors);
}

void rethrow_rank_errors(const std::vector<std::exception_ptr>& errors) {
  std::exception_ptr first;
  for (const auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const Error& err) {
      if (std::string(err.what()).find("communicator aborted") == std::string::npos) std::rethrow_exception(e);
      if (!first) first = e;
    } catch (...) {
      std::rethrow_exception(e);
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace indexcp
