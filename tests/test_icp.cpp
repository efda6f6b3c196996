// The in-process communicator and indexer context parallelism (indexer.md section 5).
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "indexcp/error.hpp"
#include "indexcp/tp_group.hpp"
#include "util.hpp"

using namespace indexcp;
using namespace testutil;

TEST(InProcessComm, AllGatherAndAllToAll) {
  for (int W : {1, 2, 3, 8}) {
    std::vector<std::vector<int32_t>> gathered(W), a2a(W);
    run_ranks(W, [&](int rank, Communicator& comm) {
      ASSERT_EQ(comm.world(), W);
      ASSERT_EQ(comm.rank(), rank);
      for (int round = 0; round < 3; ++round) {
        std::vector<int32_t> mine = {rank * 10 + round, -rank};
        gathered[rank].assign(2 * W, 0);
        comm.all_gather(mine.data(), gathered[rank].data(), 2 * sizeof(int32_t), nullptr);
        std::vector<int32_t> send(W);
        for (int p = 0; p < W; ++p) send[p] = rank * 100 + p;
        a2a[rank].assign(W, 0);
        comm.all_to_all(send.data(), a2a[rank].data(), sizeof(int32_t), nullptr);
        for (int p = 0; p < W; ++p) {
          EXPECT_EQ(gathered[rank][2 * p], p * 10 + round);
          EXPECT_EQ(gathered[rank][2 * p + 1], -p);
          EXPECT_EQ(a2a[rank][p], p * 100 + rank);
        }
      }
      EXPECT_EQ(comm.bytes_sent(), 3u * (8 + 4 * W));
    });
  }
}

TEST(InProcessComm, AFailingRankAbortsTheOthersInsteadOfHanging) {
  std::atomic<int> aborted{0};
  try {
    run_ranks(4, [&](int rank, Communicator& comm) {
      if (rank == 2) throw Error(ErrorCode::kInvalidArgument, "rank 2 refuses its input");
      int32_t x = rank, y[4];
      try {
        comm.all_gather(&x, y, sizeof x, nullptr);
      } catch (const Error&) {
        ++aborted;
        throw;
      }
    });
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 2 refuses"), std::string::npos) << e.what();
  }
  EXPECT_EQ(aborted.load(), 3);
  EXPECT_THROW(InProcessGroup(0), Error);
}


class IcpVsReplicated : public ::testing::TestWithParam<std::tuple<int32_t, int32_t, KvDtype, KRounding>> {};

TEST_P(IcpVsReplicated, BitIdenticalSelections) {
  const auto [P, W, dt, mode] = GetParam();
  const auto req = make_requests({3000, 0, 129, 2560 + 33, 4000}, P, 7u * P + W);
  std::vector<float> keys;
  std::vector<int64_t> slots;
  make_keys(req, 17u + W, keys, slots);
  const auto rep = make_shards(dt, req, 1, keys, slots);
  const auto shards = make_shards(dt, req, W, keys, slots);
  const int32_t H = 4, Q = 4;
  const auto q = make_q(static_cast<int64_t>(req.seq_lens.size()) * Q, H, 5u + P);
  const DecodeBatch b = decode_batch(req, q, H, Q);
  SelectionParams sel;
  std::vector<int32_t> ref(b.rows() * H * sel.topk);
  decode_select(rep[0], 0, b, 0, H, sel, mode, ref.data());
  EXPECT_EQ(icp_all_heads(shards, 0, b, sel, mode), ref);
  EXPECT_EQ(icp_all_heads(rep, 0, b, sel, mode, /*decode_cp=*/true, W), ref);
  // and against the plain brute force (once per page size and dtype: it is slow)
  if (W == 2 && mode == KRounding::kExact) EXPECT_EQ(ref, brute_force(rep[0], 0, req, decode_rows(b, req.num_pages, P), q, H, sel, mode));
}

INSTANTIATE_TEST_SUITE_P(All, IcpVsReplicated,
                         ::testing::Combine(::testing::Values(128, 256), ::testing::Values(2, 4, 8),
                                            ::testing::Values(KvDtype::kNvfp4, KvDtype::kFp8),
                                            ::testing::Values(KRounding::kE4m3, KRounding::kExact)));

TEST(Icp, ExchangedBytesAreWTimesKMinusOneTimesEightPerRowAndHead) {
  const auto req = make_requests({3000, 2100}, 128, 3);
  std::vector<float> keys;
  std::vector<int64_t> slots;
  make_keys(req, 4, keys, slots);
  const int32_t W = 2, H = 4, Q = 8;
  const auto shards = make_shards(KvDtype::kNvfp4, req, W, keys, slots);
  const auto q = make_q(2 * Q, H, 6);
  const DecodeBatch b = decode_batch(req, q, H, Q);
  SelectionParams sel;
  run_ranks(W, [&](int rank, Communicator& comm) {
    std::vector<int32_t> out(b.rows() * 2 * sel.topk);
    icp_decode(comm, shards[rank], 0, b, sel, KRounding::kE4m3, out.data());
    // each rank publishes rows * H * (K-1) records of 8 bytes; the all-gather delivers W times that
    EXPECT_EQ(comm.bytes_sent(), static_cast<size_t>(b.rows()) * H * (sel.topk - 1) * 8);
  });
}

TEST(Icp, GatherMovesOneHundredTwentyEightBytesPerToken) {
  for (int32_t P : {128, 256}) {
    const auto req = make_requests({3000, 1000}, P, 8);
    std::vector<float> keys;
    std::vector<int64_t> slots;
    make_keys(req, 9, keys, slots);
    const int32_t W = 2, H = 4;
    const auto shards = make_shards(KvDtype::kNvfp4, req, W, keys, slots);
    const auto rep = make_shards(KvDtype::kNvfp4, req, 1, keys, slots);
    std::vector<int32_t> qs = {0, 64, 64 + 100};
    const auto q = make_q(qs.back(), H, 10);
    const PrefillBatch b = prefill_batch(req, q, H, qs);
    SelectionParams sel;
    std::vector<int32_t> ref(qs.back() * H * 16);
    prefill_select(rep[0], 0, b, 0, H, sel, ref.data());
    std::vector<std::vector<int32_t>> out(W);
    std::vector<GatherStats> st(W);
    run_ranks(W, [&](int rank, Communicator& comm) {
      out[rank].assign(qs.back() * 2 * 16, -5);
      st[rank] = prefill_gather(comm, shards[rank], 0, b, sel, 1 << 20, out[rank].data());
      // pages covering the historical blocks: request 0 local max 23 blocks, request 1 7 blocks
      const int64_t blocks = (2999 / 128) + (999 / 128);
      const int64_t pages = P == 128 ? blocks : (2999 / 128 + 1) / 2 + (999 / 128 + 1) / 2;
      EXPECT_EQ(st[rank].pages, pages);
      EXPECT_EQ(st[rank].gathered_bytes, pages * P * 128);
      EXPECT_EQ(comm.bytes_sent(), static_cast<size_t>(pages * P / W * 128));
    });
    for (int rank = 0; rank < W; ++rank)
      for (int64_t r = 0; r < qs.back(); ++r)
        for (int h = 0; h < 2; ++h)
          for (int k = 0; k < 16; ++k)
            ASSERT_EQ(out[rank][(r * 2 + h) * 16 + k], ref[(r * H + rank * 2 + h) * 16 + k]);
  }
}

TEST(TpIndexer, CpuGroupMatchesReplicatedForEveryPath) {
  const auto req = make_requests({2600, 900}, 256, 12);
  std::vector<float> keys;
  std::vector<int64_t> slots;
  make_keys(req, 13, keys, slots);
  const auto q = make_q(2 * 8, 4, 14);
  const DecodeBatch b = decode_batch(req, q, 4, 8);
  SelectionParams sel;
  std::vector<int32_t> base;
  for (const char* cfg_json : {R"({"indexer_kv_dtype":"nvfp4"})",
                               R"({"indexer_kv_dtype":"nvfp4","indexer_cache_sharding":"on"})",
                               R"({"indexer_kv_dtype":"nvfp4","indexer_decode_cp":true})"}) {
    EngineParams e;
    e.tp = 4;
    e.page_size = 256;
    e.query_len = 8;
    const auto rc = resolve_config(AttentionConfig::from_json(cfg_json), e);
    auto tp = make_tp_indexer("cpu", rc, req.num_pages);
    tp->insert(keys.data(), slots.data(), static_cast<int64_t>(slots.size()));
    StepStats st;
    const auto got = tp->decode(b, sel, &st);
    if (base.empty()) base = got;
    EXPECT_EQ(got, base) << cfg_json;
    EXPECT_GT(st.wall_us, 0);
    if (rc.sharding) EXPECT_EQ(tp->cache_bytes_per_rank(), req.num_pages * 256 / 4 * 72);
  }
  EXPECT_THROW(make_tp_indexer("gpu", resolve_config({}, {}), 4), Error);
}
