// Inputs found by review to crash or to escape the error convention: each must now be an
// indexcp::Error naming the problem, with nothing written.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "indexcp/capacity.hpp"
#include "indexcp/error.hpp"
#include "indexcp/tp_group.hpp"
#include "util.hpp"

using namespace indexcp;
using namespace testutil;

namespace {
template <class Fn>
void expect_error(Fn&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one naming " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "a non-indexcp exception escaped: " << e.what();
  }
}

ResolvedConfig tp2(bool sharding) {
  AttentionConfig c;
  c.kv_dtype = KvDtype::kNvfp4;
  c.cache_sharding = sharding;
  EngineParams e;
  e.tp = 2;
  return resolve_config(c, e);
}
}  // namespace

TEST(Robustness, PrefillWithNullQueryStartIsAnError) {
  for (bool sharding : {false, true}) {
    auto tp = make_tp_indexer("cpu", tp2(sharding), 4);
    std::vector<uint8_t> q(128 * 4);
    std::vector<int32_t> bt = {0, 1}, lens = {200};
    PrefillBatch b;
    b.q = q.data();
    b.block_table = bt.data();
    b.num_requests = 1;
    b.max_pages = 2;
    b.seq_lens = lens.data();
    b.query_start = nullptr;
    EXPECT_EQ(b.rows(), 0);
    expect_error([&] { tp->prefill(b, {}); }, "query_start is null");
    b.num_requests = -1;
    expect_error([&] { tp->prefill(b, {}); }, "num_requests");
  }
}

TEST(Robustness, DecodeWithNegativeQueryLenIsAnError) {
  auto tp = make_tp_indexer("cpu", tp2(true), 4);
  std::vector<uint8_t> q(128 * 4);
  std::vector<int32_t> bt = {0}, lens = {100};
  DecodeBatch b{q.data(), 4, bt.data(), 1, 1, lens.data(), -1};
  EXPECT_EQ(b.rows(), 0);
  expect_error([&] { tp->decode(b, {}); }, "query_len");
}

TEST(Robustness, ScoreBlocksRefusesRowsBeyondTheBlockTable) {
  const auto req = make_requests({256}, 128, 1);
  std::vector<float> keys;
  std::vector<int64_t> slots;
  make_keys(req, 2, keys, slots);
  const auto caches = make_shards(KvDtype::kFp8, req, 1, keys, slots);
  const auto q = make_q(1, 1, 3);
  const std::vector<QueryRow> rows = {{0, 128 * 40}};
  expect_error([&] { score_blocks(caches[0], 0, rows, req.block_table.data(), 1, q.data(), 1, 0, 1, KRounding::kE4m3); },
               "beyond max_pages");
  // the second row (local block 3) reads block 2, whose page id is bad; the first row does not
  std::vector<int32_t> bad_bt = {0, 1, 99, 0};
  const std::vector<QueryRow> rows2 = {{0, 200}, {0, 400}};
  expect_error([&] { score_blocks(caches[0], 0, rows2, bad_bt.data(), 4, q.data(), 1, 0, 1, KRounding::kE4m3); },
               "block_table[0][2] = 99");
  // caller-built scores that are too small for the rows
  BlockScores s;
  s.rows = 1;
  s.heads = 1;
  s.max_blocks = 2;
  s.score.assign(2, 0.0f);
  s.valid.assign(2, 1);
  std::vector<int32_t> out(16, 7);
  expect_error([&] { select_topk(s, rows, {}, out.data()); }, "beyond scores.max_blocks");
  std::vector<Candidate> cands(15);
  expect_error([&] { publish_candidates(s, rows, {}, cands.data()); }, "beyond scores.max_blocks");
  for (int32_t v : out) EXPECT_EQ(v, 7);
}

TEST(Robustness, HugeBlockTablesGiveAnErrorNotAnAllocationFailure) {
  const auto req = make_requests({256}, 128, 1);
  std::vector<float> keys;
  std::vector<int64_t> slots;
  make_keys(req, 2, keys, slots);
  const auto caches = make_shards(KvDtype::kNvfp4, req, 1, keys, slots);
  const auto q = make_q(1, 4, 3);
  std::vector<int32_t> lens = {1};
  const int32_t max_pages = 1 << 30;
  // only the first entry is read (seq_len 1): a pointer to one page id is enough
  std::vector<int32_t> bt = {0};
  DecodeBatch b{q.data(), 4, bt.data(), 1, max_pages, lens.data(), 1};
  std::vector<int32_t> out(4 * 16);
  expect_error([&] { decode_select(caches[0], 0, b, 0, 4, {}, KRounding::kE4m3, out.data()); }, "exceed 2^31 entries");
}

TEST(Robustness, IndexQThatBecomesNaNAfterRmsNormIsRefused) {
  std::vector<float> q(128, 1.0f), w(128, 0.0f);
  q[5] = INFINITY;
  std::vector<uint8_t> out(128, 0x11);
  KeyPreprocess pre;
  pre.norm_weight = w.data();
  expect_error([&] { quantize_queries(q.data(), 1, 1, pre, out.data()); }, "NaN after RMSNorm");
  for (uint8_t v : out) EXPECT_EQ(v, 0x11);
}

TEST(Robustness, KvConnectorIsRefusedOnlyWhenTheCacheIsReallySharded) {
  AttentionConfig c;
  c.kv_dtype = KvDtype::kNvfp4;
  c.cache_sharding = true;
  EngineParams e;
  e.tp = 2;
  e.kv_connector = true;
  expect_error([&] { resolve_config(c, e); }, "KV connector");
  c.decode_cp = true;  // sharding yields to decode CP: the cache stays replicated
  const auto r = resolve_config(c, e);
  EXPECT_FALSE(r.sharding);
  EXPECT_TRUE(r.decode_cp);
  c.decode_cp = false;
  e.tp = 1;  // sharding is a no-op at TP1
  EXPECT_FALSE(resolve_config(c, e).sharding);
}

TEST(Robustness, CapacityReportsTheEffectiveSharding) {
  const auto m = ModelDesc::builtin("minimax-m3");
  const auto bf16 = plan_capacity(m, int64_t{1} << 36, KvDtype::kNvfp4, KvDtype::kBf16, 2, 128);
  EXPECT_FALSE(bf16.on.sharding);
  EXPECT_EQ(bf16.on.tokens, bf16.off.tokens);
  const auto fp4 = plan_capacity(m, int64_t{1} << 36, KvDtype::kNvfp4, KvDtype::kNvfp4, 2, 128);
  EXPECT_TRUE(fp4.on.sharding);
  EXPECT_GT(fp4.on.tokens, fp4.off.tokens);
}

TEST(Robustness, AbortedGroupRefusesCollectives) {
  InProcessGroup g(2);
  g.abort();
  int32_t x = 1, y[2];
  expect_error([&] { g.comm(0).all_gather(&x, y, 4, nullptr); }, "aborted");
}
