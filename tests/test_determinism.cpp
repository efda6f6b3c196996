// Determinism (issue 8): the same inputs give identical cache bytes, block scores and selections
// across repeated runs, across OpenMP thread counts (omp_set_num_threads 1, 2, 4; run_ranks gives
// each rank max_threads / W of them) and across the scheduling of the W rank threads (each
// configuration is repeated several times, so the ranks interleave differently), for insert,
// replicated decode, ICP decode, decode CP and gather prefill (several chunks).
#include <gtest/gtest.h>
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "indexcp/icp.hpp"
#include "util.hpp"

using namespace indexcp;
using namespace testutil;

namespace {

constexpr int kThreadCounts[] = {1, 2, 4};
constexpr int kRepeats = 3;

// Restores the OpenMP thread count when a test ends.
struct ThreadsGuard {
  int saved = omp_get_max_threads();
  ~ThreadsGuard() { omp_set_num_threads(saved); }
};

// Every output of one configuration, as bytes.
struct Outputs {
  std::vector<uint8_t> replicated_cache;
  std::vector<std::vector<uint8_t>> shard_caches;
  std::vector<float> scores;  // replicated decode block scores, all heads
  std::vector<int32_t> decode, icp, decode_cp, gather;
  int64_t gather_chunks = 0;
};

struct Workload {
  KvDtype dt;
  int32_t P, W;
  Requests req;
  std::vector<float> keys;
  std::vector<int64_t> slots;
  std::vector<uint8_t> q_dec, q_pre;
  std::vector<int32_t> query_start;
  SelectionParams sel;
  int32_t H = 4, Q = 2;
};

Workload make_setup(KvDtype dt, int32_t P, int32_t W) {
  Workload s{dt, P, W, make_requests({2100, 900, 0, 1530}, P, 17), {}, {}, {}, {}, {}, {}};
  make_keys(s.req, 23, s.keys, s.slots);
  // a skipped token and a reordered batch: the slot mapping need not be sorted
  std::swap(s.slots[3], s.slots[2000]);
  std::swap_ranges(s.keys.begin() + 3 * 128, s.keys.begin() + 4 * 128, s.keys.begin() + 2000 * 128);
  s.slots[10] = -1;
  s.sel.topk = 8;
  s.sel.init_blocks = 1;
  s.q_dec = make_q(static_cast<int64_t>(s.req.seq_lens.size()) * s.Q, s.H, 31);
  s.query_start = {0, 40, 45, 45, 173};
  s.q_pre = make_q(s.query_start.back(), s.H, 37);
  return s;
}

Outputs run_once(const Workload& s) {
  Outputs o;
  const int32_t B = static_cast<int32_t>(s.req.seq_lens.size());
  const int64_t n = static_cast<int64_t>(s.slots.size());
  IndexCache repl(make_page_layout(s.dt, s.P, 1), s.req.num_pages, 1, 0);
  insert_keys(repl, 0, s.keys.data(), s.slots.data(), n);
  o.replicated_cache.assign(repl.data(), repl.data() + repl.size_bytes());
  std::vector<IndexCache> shards;
  for (int32_t r = 0; r < s.W; ++r) {
    shards.emplace_back(make_page_layout(s.dt, s.P, s.W), s.req.num_pages, 1, r);
    insert_keys(shards.back(), 0, s.keys.data(), s.slots.data(), n);
    o.shard_caches.emplace_back(shards.back().data(), shards.back().data() + shards.back().size_bytes());
  }
  const DecodeBatch db{s.q_dec.data(), s.H, s.req.block_table.data(), B, s.req.max_pages, s.req.seq_lens.data(), s.Q};
  const auto rows = decode_rows(db, s.req.num_pages, s.P);
  o.scores = score_blocks(repl, 0, rows, db.block_table, db.max_pages, db.q, s.H, 0, s.H, KRounding::kE4m3).score;
  o.decode.assign(static_cast<size_t>(db.rows()) * s.H * s.sel.topk, -7);
  decode_select(repl, 0, db, 0, s.H, s.sel, KRounding::kE4m3, o.decode.data());
  o.icp = icp_all_heads(shards, 0, db, s.sel, KRounding::kE4m3);
  std::vector<IndexCache> one;
  one.push_back(std::move(repl));
  o.decode_cp = icp_all_heads(one, 0, db, s.sel, KRounding::kE4m3, /*decode_cp=*/true, s.W);

  const PrefillBatch pb{s.q_pre.data(), s.H, s.req.block_table.data(), B, s.req.max_pages, s.req.seq_lens.data(),
                        s.query_start.data()};
  const int64_t rows_pre = pb.rows();
  std::vector<std::vector<int32_t>> per(static_cast<size_t>(s.W));
  std::vector<int64_t> chunks(static_cast<size_t>(s.W));
  const int64_t budget = 3 * gather_unit_bytes(shards[0].layout());  // several chunks
  run_ranks(s.W, [&](int rank, Communicator& comm) {
    int32_t h0, nh;
    owned_heads(s.H, s.W, rank, &h0, &nh);
    per[rank].assign(static_cast<size_t>(rows_pre) * nh * s.sel.topk, -7);
    chunks[rank] = prefill_gather(comm, shards[rank], 0, pb, s.sel, budget, per[rank].data()).chunks;
  });
  for (const auto& p : per) o.gather.insert(o.gather.end(), p.begin(), p.end());
  o.gather_chunks = chunks[0];
  return o;
}

void expect_same(const Outputs& a, const Outputs& b, const std::string& what) {
  EXPECT_TRUE(a.replicated_cache == b.replicated_cache) << what << ": replicated cache bytes differ";
  EXPECT_TRUE(a.shard_caches == b.shard_caches) << what << ": shard cache bytes differ";
  ASSERT_EQ(a.scores.size(), b.scores.size()) << what;
  EXPECT_EQ(std::memcmp(a.scores.data(), b.scores.data(), a.scores.size() * sizeof(float)), 0)
      << what << ": block scores differ (bitwise)";
  EXPECT_TRUE(a.decode == b.decode) << what << ": replicated decode selections differ";
  EXPECT_TRUE(a.icp == b.icp) << what << ": ICP decode selections differ";
  EXPECT_TRUE(a.decode_cp == b.decode_cp) << what << ": decode CP selections differ";
  EXPECT_TRUE(a.gather == b.gather) << what << ": gather prefill selections differ";
  EXPECT_EQ(a.gather_chunks, b.gather_chunks) << what;
}

class Determinism : public ::testing::TestWithParam<std::tuple<KvDtype, int32_t, int32_t>> {};

TEST_P(Determinism, SameBytesAndSelectionsAcrossRunsThreadsAndRankScheduling) {
  const auto [dt, P, W] = GetParam();
  const ThreadsGuard guard;
  const Workload s = make_setup(dt, P, W);
  omp_set_num_threads(1);
  const Outputs ref = run_once(s);
  // the paths agree with each other too (sharding never changes the selection)
  EXPECT_TRUE(ref.icp == ref.decode);
  EXPECT_TRUE(ref.decode_cp == ref.decode);
  EXPECT_GT(ref.gather_chunks, 1);
  for (int t : kThreadCounts)
    for (int rep = 0; rep < kRepeats; ++rep) {
      omp_set_num_threads(t);
      const Outputs o = run_once(s);
      expect_same(ref, o, "threads " + std::to_string(t) + ", repeat " + std::to_string(rep));
      if (::testing::Test::HasFailure()) return;
    }
}

INSTANTIATE_TEST_SUITE_P(All, Determinism,
                         ::testing::Values(std::make_tuple(KvDtype::kNvfp4, 128, 2), std::make_tuple(KvDtype::kNvfp4, 256, 4),
                                           std::make_tuple(KvDtype::kFp8, 128, 4), std::make_tuple(KvDtype::kFp8, 256, 2)),
                         [](const auto& info) {
                           return to_string(std::get<0>(info.param)) + "_P" + std::to_string(std::get<1>(info.param)) +
                                  "_W" + std::to_string(std::get<2>(info.param));
                         });

}  // namespace
