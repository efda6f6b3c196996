// The collectives' contract in the in-process group (comm.hpp, src/comm/rank_barrier.hpp): ranks
// that disagree on a collective's byte count or call get an Error on every rank (no crash, no
// read out of bounds: these run under ASan in CI), a rank that returns while another waits ends
// the wait with an Error, and the group keeps working after a refused collective. The lifetime
// of the rank barrier both simulated groups (host and device) share: destroyed while a rank waits
// in a collective, it ends that wait before it frees anything; an abort does not release a rank
// from leave while a peer may still read its send buffer.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/rank_barrier.hpp"

#include "indexcp/comm.hpp"
#include "indexcp/error.hpp"
#include "indexcp/icp.hpp"
#include "util.hpp"

using namespace indexcp;
using namespace testutil;

namespace {

// Runs fn on W ranks; returns each rank's Error message ("" when it did not throw).
std::vector<std::string> rank_errors(int W, const std::function<void(int, Communicator&)>& fn) {
  std::vector<std::string> msg(static_cast<size_t>(W));
  std::vector<ErrorCode> code(static_cast<size_t>(W), ErrorCode::kRuntime);
  run_ranks(W, [&](int r, Communicator& comm) {
    try {
      fn(r, comm);
    } catch (const Error& e) {
      msg[r] = e.what();
    }
  });
  return msg;
}

}  // namespace

TEST(Collectives, DifferentByteCountsAreRefusedOnEveryRank) {
  for (int W : {2, 3}) {
    const auto msg = rank_errors(W, [&](int r, Communicator& comm) {
      std::vector<uint8_t> send(r == W - 1 ? 0 : 1920, 7), recv(1920 * W);
      comm.all_gather(r == W - 1 ? nullptr : send.data(), recv.data(), send.size(), nullptr);
    });
    for (int r = 0; r < W; ++r) {
      EXPECT_NE(msg[r].find("all_gather: the ranks passed different byte counts: rank 0 1920 bytes, rank " +
                            std::to_string(W - 1) + " 0 bytes"),
                std::string::npos)
          << "rank " << r << ": " << msg[r];
    }
  }
}

TEST(Collectives, DifferentCallsAreRefusedOnEveryRank) {
  const auto msg = rank_errors(2, [&](int r, Communicator& comm) {
    std::vector<uint8_t> send(16, 1), recv(32);
    if (r == 0) comm.all_gather(send.data(), recv.data(), 8, nullptr);
    else comm.all_to_all(send.data(), recv.data(), 8, nullptr);
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(msg[r].find("different collective calls: rank 0 all_gather, rank 1 all_to_all"), std::string::npos) << msg[r];
}

TEST(Collectives, TheGroupWorksAfterARefusedCollective) {
  std::vector<std::vector<int32_t>> got(2);
  const auto msg = rank_errors(2, [&](int r, Communicator& comm) {
    int32_t mine = 10 + r;
    std::vector<int32_t> recv(2, 0);
    try {
      comm.all_gather(&mine, recv.data(), r == 0 ? 4 : 8, nullptr);
      ADD_FAILURE() << "the mismatched all_gather returned on rank " << r;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    }
    comm.all_gather(&mine, recv.data(), 4, nullptr);
    got[r] = recv;
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(msg[r], "");
    EXPECT_EQ(got[r], (std::vector<int32_t>{10, 11}));
  }
}

TEST(Collectives, ARankThatReturnsEndsItsPeersWait) {
  // rank 1 returns without calling; rank 0 waits in all_gather: it must get an Error, not hang
  for (int W : {2, 4}) {
    const auto msg = rank_errors(W, [&](int r, Communicator& comm) {
      if (r == 1) return;
      int32_t v = r;
      std::vector<int32_t> recv(W);
      comm.all_gather(&v, recv.data(), sizeof v, nullptr);
    });
    for (int r = 0; r < W; ++r) {
      if (r == 1) continue;
      EXPECT_NE(msg[r].find("rank 1 returned without making the all_gather that rank " + std::to_string(r) + " waits in"),
                std::string::npos)
          << "W = " << W << " rank " << r << ": " << msg[r];
    }
  }
}

// The cases a new user hit with icp_decode on the CPU backend (issue: ranks that disagree).
TEST(Collectives, IcpDecodeRanksThatDisagreeGetAnError) {
  const int32_t W = 2, H = 4, P = 128;
  const Requests req = make_requests({3000, 2000}, P, 5u);
  std::vector<float> keys;
  std::vector<int64_t> slots;
  make_keys(req, 6u, keys, slots);
  const auto shards = make_shards(KvDtype::kNvfp4, req, W, keys, slots);
  const auto q = make_q(2, H, 7u);
  SelectionParams sel;
  struct Case {
    const char* what;
    int32_t requests[2];  // per rank
    bool rank1_returns;
  };
  for (const Case c : {Case{"one request vs zero", {1, 0}, false}, Case{"two requests vs one", {2, 1}, false},
                       Case{"rank 1 returns", {2, 2}, true}}) {
    const auto msg = rank_errors(W, [&](int r, Communicator& comm) {
      if (c.rank1_returns && r == 1) return;
      DecodeBatch b = decode_batch(req, q, H, 1);
      b.num_requests = c.requests[r];
      std::vector<int32_t> out(static_cast<size_t>(std::max(1, b.num_requests)) * 2 * sel.topk);
      icp_decode(comm, shards[r], 0, b, sel, KRounding::kE4m3, out.data());
    });
    for (int r = 0; r < W; ++r) {
      if (c.rank1_returns && r == 1) continue;
      EXPECT_FALSE(msg[r].empty()) << c.what << ": rank " << r << " returned without an error";
      EXPECT_TRUE(msg[r].find("all_gather") != std::string::npos) << c.what << ": " << msg[r];
    }
  }
}

// ---- the barrier's lifetime (src/comm/rank_barrier.hpp; docs/decisions.md)

namespace {

// Waits (up to 20 s) until `pred` holds.
template <class Pred>
bool eventually(Pred pred) {
  for (int i = 0; i < 20000 && !pred(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return pred();
}

}  // namespace

TEST(RankBarrierLifetime, DestroyedWhileARankWaitsInEnterEndsTheWaitFirst) {
  // What ~InProcessGroup and ~DeviceGroup do (close) when a rank still waits: without close the
  // rank would wait on a freed condition variable (ASan: heap-use-after-free, or a hang).
  auto barrier = std::make_unique<detail::RankBarrier>(2);
  detail::RankBarrier* const b = barrier.get();  // (the thread never reads the unique_ptr the test resets)
  std::atomic<bool> inside{false};
  std::string what;
  int x = 1;
  std::thread rank0([&what, &inside, &x, b] {
    const detail::RankBarrier::Use use(*b);
    inside = true;
    try {
      b->enter(0, "all_gather", &x, sizeof x);
      what = "returned";
    } catch (const Error& e) {
      what = e.what();
    }
  });
  ASSERT_TRUE(eventually([&] { return inside.load(); }));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // (let it reach the wait; correct either way)
  barrier.reset();  // close(): abort, then wait until rank 0 has let go
  rank0.join();
  EXPECT_NE(what.find("communicator aborted"), std::string::npos) << what;
}

TEST(RankBarrierLifetime, CloseWaitsForEveryUse) {
  detail::RankBarrier barrier(2);
  std::atomic<bool> closed{false};
  auto use = std::make_unique<detail::RankBarrier::Use>(barrier);
  EXPECT_EQ(barrier.users(), 1);
  std::thread closer([&] {
    barrier.close();
    closed = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(closed.load()) << "close() returned while a rank held a Use";
  use.reset();
  closer.join();
  EXPECT_TRUE(closed.load());
  EXPECT_EQ(barrier.users(), 0);
  int x = 0;
  try {
    barrier.enter(0, "all_gather", &x, sizeof x);
    ADD_FAILURE() << "enter on a closed barrier returned";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("communicator aborted"), std::string::npos) << e.what();
  }
}

TEST(RankBarrierLifetime, AbortDoesNotReleaseARankFromLeave) {
  // Both ranks passed enter; rank 0 waits in leave while rank 1 may still read rank 0's send
  // buffer. An abort must not let rank 0 return (and free the buffer) before rank 1 arrives.
  detail::RankBarrier barrier(2);
  int a = 1, b = 2;
  std::atomic<bool> left0{false};
  std::thread rank0([&] {
    barrier.enter(0, "all_gather", &a, sizeof a);
    barrier.leave();
    left0 = true;
  });
  barrier.enter(1, "all_gather", &b, sizeof b);
  EXPECT_EQ(*static_cast<const int*>(barrier.ptr(0)), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // rank 0 reaches leave
  barrier.abort();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(left0.load()) << "the abort released rank 0 from leave while rank 1 still read its buffer";
  EXPECT_EQ(*static_cast<const int*>(barrier.ptr(0)), 1);  // rank 1 reads rank 0's buffer
  barrier.leave();
  rank0.join();
  EXPECT_TRUE(left0.load());
}

TEST(RankBarrierLifetime, AGroupDestroyedAfterAFailedRankIsSafe) {
  // run_ranks: rank 1 fails before the collective rank 0 and 2 wait in; the group aborts, every
  // rank thread is joined before the group is destroyed (ASan checks the rest).
  for (int rep = 0; rep < 20; ++rep) {
    std::atomic<int> aborted{0};
    try {
      run_ranks(3, [&](int r, Communicator& comm) {
        if (r == 1) throw Error(ErrorCode::kInvalidArgument, "rank 1 failed");
        int x = r, y[3];
        try {
          comm.all_gather(&x, y, sizeof x, nullptr);
        } catch (const Error& e) {
          if (std::string(e.what()).find("communicator aborted") != std::string::npos) ++aborted;
          throw;
        }
      });
      ADD_FAILURE() << "run_ranks returned";
    } catch (const Error& e) {
      EXPECT_STREQ(e.what(), "rank 1 failed");
    }
    EXPECT_EQ(aborted.load(), 2);  // ranks 0 and 2, whether they entered before the abort or after
  }
}
