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

namespace indexcp {

namespace {
class InProcessComm;
}

struct InProcessGroup::State {
  int world;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  bool aborted = false;
  std::vector<const void*> slots;
  std::vector<std::unique_ptr<Communicator>> comms;

  void check_aborted() const {
    if (aborted) throw Error(ErrorCode::kRuntime, "communicator aborted (another rank failed)");
  }
  // Blocking barrier; the caller holds `lk`. An abortable barrier (the first of a collective)
  // gives up when the group is aborted. The second barrier of a collective is not abortable:
  // every rank has passed the first one and only copies memory before arriving, and a rank
  // leaving early would free a send buffer that a slower rank may still be reading.
  void barrier(std::unique_lock<std::mutex>& lk, bool abortable) {
    if (abortable) check_aborted();
    const uint64_t gen = generation;
    if (++arrived == world) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    cv.wait(lk, [&] { return generation != gen || (abortable && aborted); });
    if (abortable && generation == gen) {
      --arrived;  // leave the aborted barrier
      check_aborted();
    }
  }
};

namespace {

class InProcessComm final : public Communicator {
 public:
  InProcessComm(InProcessGroup::State* s, int rank) : s_(s), rank_(rank) {}
  int rank() const override { return rank_; }
  int world() const override { return s_->world; }
  std::size_t bytes_sent() const override { return sent_; }

  void all_gather(const void* send, void* recv, std::size_t bytes, void*) override {
    std::unique_lock<std::mutex> lk(s_->mu);
    s_->slots[rank_] = send;
    s_->barrier(lk, true);
    lk.unlock();
    for (int p = 0; p < s_->world; ++p)
      if (bytes) std::memcpy(static_cast<char*>(recv) + p * bytes, s_->slots[p], bytes);
    lk.lock();
    s_->barrier(lk, false);
    sent_ += bytes;
  }

  void all_to_all(const void* send, void* recv, std::size_t bytes, void*) override {
    std::unique_lock<std::mutex> lk(s_->mu);
    s_->slots[rank_] = send;
    s_->barrier(lk, true);
    lk.unlock();
    for (int p = 0; p < s_->world; ++p)
      if (bytes)
        std::memcpy(static_cast<char*>(recv) + p * bytes,
                    static_cast<const char*>(s_->slots[p]) + rank_ * bytes, bytes);
    lk.lock();
    s_->barrier(lk, false);
    sent_ += bytes * s_->world;
  }

 private:
  InProcessGroup::State* s_;
  int rank_;
  std::size_t sent_ = 0;
};

}  // namespace

InProcessGroup::InProcessGroup(int world) : state_(std::make_unique<State>()) {
  INDEXCP_REQUIRE(world >= 1 && world <= 64, "world = " + std::to_string(world) + " must be in 1..64");
  state_->world = world;
  state_->slots.assign(static_cast<size_t>(world), nullptr);
  for (int r = 0; r < world; ++r) state_->comms.push_back(std::make_unique<InProcessComm>(state_.get(), r));
}

InProcessGroup::~InProcessGroup() = default;

int InProcessGroup::world() const { return state_->world; }

Communicator& InProcessGroup::comm(int r) {
  INDEXCP_REQUIRE(r >= 0 && r < state_->world, "rank = " + std::to_string(r) + " is out of range");
  return *state_->comms[static_cast<size_t>(r)];
}

void InProcessGroup::abort() {
  std::lock_guard<std::mutex> lk(state_->mu);
  state_->aborted = true;
  state_->cv.notify_all();
}

void run_ranks(int world, const std::function<void(int, Communicator&)>& fn) {
  InProcessGroup group(world);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(world));
  // Share the cores among the ranks: each rank's parallel regions get cores / world threads, so
  // W ranks never oversubscribe the machine (OpenMP threads spin at barriers).
  const int per_rank = std::max(1, omp_get_max_threads() / world);
  for (int r = 0; r < world; ++r) {
    try {
      threads.emplace_back([&, r] {
      omp_set_num_threads(per_rank);
      try {
        fn(r, group.comm(r));
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
        group.abort();
      }
      });
    } catch (const std::system_error& e) {  // could not start a thread: stop the others
      group.abort();
      for (auto& t : threads) t.join();
      throw Error(ErrorCode::kRuntime, std::string("run_ranks could not start rank ") + std::to_string(r) + ": " + e.what());
    }
  }
  for (auto& t : threads) t.join();
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
