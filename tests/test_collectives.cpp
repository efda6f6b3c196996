// The collectives' contract in the in-process group (comm.hpp, src/comm/rank_barrier.hpp): ranks
// that disagree on a collective's byte count or call get an Error on every rank (no crash, no
// read out of bounds: these run under ASan in CI), a rank that returns while another waits ends
// the wait with an Error, and the group keeps working after a refused collective.
#include <gtest/gtest.h>

#include <mutex>
#include <string>
#include <vector>

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
