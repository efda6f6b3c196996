// The meeting point of W ranks simulated as W threads of one process, shared by the host group
// (InProcessGroup, src/comm/inprocess.cpp) and the device group (cuda::DeviceGroup,
// src/cuda/device_group.cu). A collective is two meetings: `enter` publishes the rank's send pointer and
// byte count and waits for every rank, then every rank reads the others' buffers, then `leave`
// waits again so that no rank reuses its send buffer while a peer still reads it.
//
// The contract a collective keeps here (docs/decisions.md): ranks that call different collectives
// or pass different byte counts get an Error on EVERY rank, naming the call and two ranks' sizes
// (the group sees all of them, so the check costs nothing); a rank that returns from run_ranks /
// run_device_ranks while another waits in a collective (it made fewer calls) ends that wait with
// an Error naming both; abort() ends every pending and future wait with "communicator aborted".
//
// Lifetime (docs/decisions.md, "A group destroyed while ranks wait"): a rank holds a Use for the
// whole of a collective, from before enter to its last touch of the group's memory (the device
// group's events are used after leave). close(), called by the destructor and by the groups'
// destructors before they free anything else, aborts and then waits until no rank holds a Use, so
// a group destroyed while a rank still waits in a collective ends that wait with an Error instead
// of freeing the mutex, the condition variable or the events under it. A rank waiting in leave is
// not released by the abort (see leave); it is released when its peers arrive, which every rank
// that passed enter does.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

#include "indexcp/error.hpp"

namespace indexcp::detail {

class RankBarrier {
 public:
  explicit RankBarrier(int world)
      : world_(world), ptrs_(static_cast<size_t>(world), nullptr), sizes_(static_cast<size_t>(world), 0),
        calls_(static_cast<size_t>(world), nullptr) {}

  ~RankBarrier() { close(); }
  RankBarrier(const RankBarrier&) = delete;
  RankBarrier& operator=(const RankBarrier&) = delete;

  int world() const { return world_; }

  /// A rank's hold on the group for one collective (see the lifetime note above).
  class Use {
   public:
    explicit Use(RankBarrier& b) : b_(b) {
      std::lock_guard<std::mutex> lk(b_.mu_);
      ++b_.users_;
    }
    ~Use() {
      std::lock_guard<std::mutex> lk(b_.mu_);
      if (--b_.users_ == 0) b_.cv_.notify_all();
    }
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;

   private:
    RankBarrier& b_;
  };

  /// The first meeting of a collective: throws Error when the group was aborted, a rank has
  /// departed, or the ranks disagree on the call or its byte count (every rank throws the same
  /// message). After it returns, ptr(p) is rank p's send pointer until leave().
  void enter(int rank, const char* call, const void* send, std::size_t bytes) {
    std::unique_lock<std::mutex> lk(mu_);
    check_usable(rank, call);
    ptrs_[rank] = send;
    sizes_[rank] = bytes;
    calls_[rank] = call;
    const uint64_t gen = generation_;
    if (++arrived_ == world_) {
      verdict_ = agreement();
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lk, [&] { return generation_ != gen || aborted_ || departed_ >= 0; });
      if (generation_ == gen) {  // woken by an abort or a departure: leave the meeting
        --arrived_;
        check_usable(rank, call);
      }
    }
    if (!verdict_.empty()) throw Error(ErrorCode::kInvalidArgument, verdict_);
  }

  const void* ptr(int p) const { return ptrs_[static_cast<size_t>(p)]; }

  /// The second meeting: not abortable (every rank passed enter and only copies memory before it
  /// arrives; a rank leaving early would free a send buffer a slower rank may still read).
  void leave() {
    std::unique_lock<std::mutex> lk(mu_);
    const uint64_t gen = generation_;
    if (++arrived_ == world_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lk, [&] { return generation_ != gen; });
  }

  void abort() {
    std::lock_guard<std::mutex> lk(mu_);
    aborted_ = true;
    cv_.notify_all();
  }

  /// abort(), then waits until no rank holds a Use: afterwards the group's memory may be freed.
  void close() {
    std::unique_lock<std::mutex> lk(mu_);
    aborted_ = true;
    cv_.notify_all();
    cv_.wait(lk, [&] { return users_ == 0; });
  }

  /// Ranks holding a Use now (tests).
  int users() {
    std::lock_guard<std::mutex> lk(mu_);
    return users_;
  }

  /// Rank `rank` returned from its function without an error: a collective that another rank
  /// waits in, or enters later, can never complete.
  void depart(int rank) {
    std::lock_guard<std::mutex> lk(mu_);
    if (departed_ < 0) departed_ = rank;
    cv_.notify_all();
  }

 private:
  void check_usable(int rank, const char* call) const {
    if (aborted_) throw Error(ErrorCode::kRuntime, "communicator aborted (another rank failed)");
    if (departed_ >= 0)
      throw Error(ErrorCode::kRuntime, "rank " + std::to_string(departed_) + " returned without making the " +
                                           call + " that rank " + std::to_string(rank) +
                                           " waits in (the ranks made different collective calls)");
  }

  // "" when every rank made the same call with the same byte count, else the message (called by
  // the last rank to arrive, under the lock: every rank then reads the same verdict).
  std::string agreement() const {
    for (int p = 1; p < world_; ++p) {
      if (std::string(calls_[p]) != calls_[0])
        return std::string("the ranks made different collective calls: rank 0 ") + calls_[0] + ", rank " +
               std::to_string(p) + " " + calls_[p];
      if (sizes_[p] != sizes_[0])
        return std::string(calls_[0]) + ": the ranks passed different byte counts: rank 0 " + std::to_string(sizes_[0]) +
               " bytes, rank " + std::to_string(p) + " " + std::to_string(sizes_[p]) +
               " bytes (every rank of a collective must move the same bytes)";
    }
    return {};
  }

  const int world_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  int departed_ = -1;
  int users_ = 0;
  std::string verdict_;
  std::vector<const void*> ptrs_;
  std::vector<std::size_t> sizes_;
  std::vector<const char*> calls_;
};

}  // namespace indexcp::detail
