// Inputs found by review to crash or to escape the error convention: each must now be an
// indexcp::Error naming the problem, with nothing written.
#include <gtest/gtest.h>

#include <climits>
#include <cmath>
#include <string>

#include "indexcp/capacity.hpp"
#include "indexcp/error.hpp"
#include "indexcp/npy.hpp"
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

// ---- inputs found by a probe of the public API (session 10); nothing stored may change

namespace {
// One request of 300 tokens in a replicated NVFP4 cache of P128 pages, and the cache's bytes.
struct Stored {
  Requests req = make_requests({300}, 128, 1);
  std::vector<float> keys;
  std::vector<int64_t> slots;
  std::vector<IndexCache> caches;
  Stored() {
    make_keys(req, 2, keys, slots);
    caches = make_shards(KvDtype::kNvfp4, req, 1, keys, slots);
  }
  std::vector<uint8_t> bytes() const { return {caches[0].data(), caches[0].data() + caches[0].size_bytes()}; }
};
}  // namespace

TEST(Robustness, HeadRangesNearInt32MaxAreRefused) {
  const Stored st;
  const auto& req = st.req;
  const auto& caches = st.caches;
  const auto q = make_q(1, 4, 3);
  const DecodeBatch b = decode_batch(req, q, 4, 1);
  std::vector<int32_t> out(16 * 4, 7);
  // h0 + nh wrapped in int32 and passed the check: an out-of-bounds read followed
  expect_error([&] { decode_select(caches[0], 0, b, INT32_MAX, 1, {}, KRounding::kE4m3, out.data()); },
               "head range [2147483647, 2147483648) is outside the 4 heads");
  const std::vector<QueryRow> rows = {{0, 299}};
  expect_error([&] { score_blocks(caches[0], 0, rows, req.block_table.data(), req.max_pages, q.data(), 4, 1, INT32_MAX,
                                  KRounding::kE4m3); },
               "head range");
  std::vector<Candidate> cands(4 * 15);
  expect_error([&] { merge_candidates(cands.data(), 1, rows, 4, INT32_MAX, 1, {}, out.data()); }, "head range");
  for (int32_t v : out) EXPECT_EQ(v, 7);
}

TEST(Robustness, EnumValuesOutsideTheEnumeratorsAreRefused) {
  expect_error([&] { make_page_layout(static_cast<KvDtype>(7), 128, 2); }, "dtype = 7 is not a KvDtype");
  PageLayout l = make_page_layout(KvDtype::kNvfp4, 128, 1);
  l.dtype = static_cast<KvDtype>(5);
  expect_error([&] { IndexCache c(l, 4, 1); }, "dtype = 5");

  Stored st;
  const auto& req = st.req;
  auto& caches = st.caches;
  const std::vector<uint8_t> before = st.bytes();
  const auto q = make_q(1, 4, 3);
  const DecodeBatch b = decode_batch(req, q, 4, 1);
  std::vector<int32_t> out(16 * 4, 7);
  for (int m : {2, 200, -1})
    expect_error([&] { decode_select(caches[0], 0, b, 0, 4, {}, static_cast<KRounding>(m), out.data()); },
                 "mode = " + std::to_string(m) + " is not a KRounding");
  float k[128];
  expect_error([&] { read_row_khat(caches[0], 0, 0, 0, static_cast<KRounding>(2), k); }, "mode = 2");
  expect_error([&] { read_row_khat(caches[0], 0, 0, 0, KRounding::kE4m3, nullptr); }, "out is null");
  for (int32_t v : out) EXPECT_EQ(v, 7);
  EXPECT_EQ(st.bytes(), before);

  // a hand-built AttentionConfig: the same rules as from_json
  EngineParams e;
  e.tp = 2;
  AttentionConfig a;
  a.k_rounding = static_cast<KRounding>(2);
  expect_error([&] { resolve_config(a, e); }, "indexer_k_rounding = 2");
  a = AttentionConfig{};
  a.kv_dtype = static_cast<KvDtype>(5);
  expect_error([&] { resolve_config(a, e); }, "indexer_kv_dtype = 5");
  a = AttentionConfig{};
  a.prefill_cp = static_cast<PrefillCp>(9);
  expect_error([&] { resolve_config(a, e); }, "indexer_prefill_cp = 9");
  for (int64_t mib : {int64_t{0}, int64_t{-5}, int64_t{1} << 43, (int64_t{1} << 44) + 256}) {
    a = AttentionConfig{};
    a.prefill_gather_budget_mib = mib;
    expect_error([&] { resolve_config(a, e); }, "indexer_prefill_gather_budget_mib = " + std::to_string(mib));
  }
  const auto m = ModelDesc::builtin("minimax-m3");
  expect_error([&] { plan_capacity(m, 1 << 30, static_cast<KvDtype>(5), KvDtype::kFp8, 2, 128); }, "kv_dtype = 5");
  expect_error([&] { plan_capacity(m, 1 << 30, KvDtype::kFp8, static_cast<KvDtype>(-1), 2, 128); }, "index_dtype = -1");
}

TEST(Robustness, ModelsBuiltInCodeAreValidatedLikeModelFiles) {
  const auto check = [](auto edit, const std::string& needle) {
    ModelDesc m = ModelDesc::builtin("minimax-m3");
    edit(m);
    expect_error([&] { m.validate(); }, needle);
    // plan_capacity divided by zero (kv_heads 0, layers 0) or returned negative tokens
    expect_error([&] { plan_capacity(m, 1 << 30, KvDtype::kFp8, KvDtype::kFp8, 1, 128); }, needle);
  };
  check([](ModelDesc& m) { m.kv_heads = 0; }, "kv_heads = 0");
  check([](ModelDesc& m) { m.kv_heads = -4; }, "kv_heads = -4");
  check([](ModelDesc& m) { m.layers = 0; m.sparse_layers = 0; }, "layers = 0");
  check([](ModelDesc& m) { m.sparse_layers = -1; }, "sparse_layers = -1");
  check([](ModelDesc& m) { m.q_heads = INT32_MAX; }, "q_heads = 2147483647");
  check([](ModelDesc& m) { m.head_dim = 8; }, "head_dim = 8");
  check([](ModelDesc& m) { m.index_dim = 64; }, "index_dim = 64");
  EXPECT_NO_THROW(ModelDesc::builtin("minimax-m3").validate());
}

TEST(Robustness, BlockScoresWhoseSizeWrapsAreRefused) {
  const std::vector<QueryRow> rows = {{0, 5120}};
  BlockScores s;
  s.rows = 1;
  s.heads = 4;
  s.max_blocks = int64_t{1} << 62;  // 1 x 4 x 2^62 wrapped to 0 and matched the empty vectors
  std::vector<int32_t> out(4 * 16, 7);
  expect_error([&] { select_topk(s, rows, {}, out.data()); }, "scores.score / scores.valid must hold");
  std::vector<Candidate> cands(4 * 15);
  expect_error([&] { publish_candidates(s, rows, {}, cands.data()); }, "scores.score / scores.valid must hold");
  s.max_blocks = -1;
  expect_error([&] { select_topk(s, rows, {}, out.data()); }, "scores.max_blocks = -1");
  s.max_blocks = 64;
  s.heads = 0;
  expect_error([&] { select_topk(s, rows, {}, out.data()); }, "scores.heads = 0");
  s.heads = 4;
  s.rows = 2;
  expect_error([&] { select_topk(s, rows, {}, out.data()); }, "scores.rows = 2 does not match rows (1)");
  for (int32_t v : out) EXPECT_EQ(v, 7);
}

TEST(Robustness, HandEditedResolvedConfigIsRefused) {
  ResolvedConfig rc = tp2(false);
  rc.sharding = true;  // only one cache exists, two ranks would index it
  expect_error([&] { make_cpu_tp_indexer(rc, 4); }, "ResolvedConfig.sharding = true differs from false");
  rc = tp2(true);
  rc.engine.tp = 4;  // shards 2, four ranks
  expect_error([&] { make_cpu_tp_indexer(rc, 4); }, "ResolvedConfig.shards = 2 differs from 4");
  rc = tp2(true);
  rc.k_rounding = static_cast<KRounding>(2);
  expect_error([&] { make_cpu_tp_indexer(rc, 4); }, "ResolvedConfig.k_rounding = 2");
  rc = tp2(true);
  rc.p256_stock_decode = true;  // P128
  expect_error([&] { make_cpu_tp_indexer(rc, 4); }, "ResolvedConfig.p256_stock_decode");
  EXPECT_NO_THROW(make_cpu_tp_indexer(tp2(true), 4));
  EXPECT_NO_THROW(check_resolved_config(tp2(false)));
  EXPECT_NO_THROW(check_resolved_config(ResolvedConfig{}));  // the defaults are resolve_config's for the defaults
}

TEST(Robustness, HugeCountsAreRefusedByName) {
  Stored st;
  const std::vector<uint8_t> before = st.bytes();
  // std::bad_array_new_length escaped; the bf16 variant said "keys is null" (num_tokens * 128 wrapped)
  expect_error([&] { insert_keys(st.caches[0], 0, st.keys.data(), st.slots.data(), INT64_MAX); }, "num_tokens = 9223372036854775807");
  std::vector<uint16_t> kb(128);
  expect_error([&] { insert_keys_bf16(st.caches[0], 0, kb.data(), st.slots.data(), int64_t{1} << 57); }, "num_tokens");
  std::vector<uint8_t> qo(128);
  expect_error([&] { quantize_queries(st.keys.data(), int64_t{1} << 60, 64, {}, qo.data()); }, "num_tokens");
  EXPECT_EQ(st.bytes(), before);
  // a huge num_requests reaches the check of seq_lens[0] (it failed to allocate its rows first)
  std::vector<int32_t> lens = {-1}, bt = {0};
  const auto q = make_q(1, 4, 3);
  DecodeBatch b{q.data(), 4, bt.data(), INT32_MAX, 1, lens.data(), 16};
  expect_error([&] { decode_rows(b, 4, 128); }, "seq_lens[0] = -1 is negative");
  // npy::serialize wrote a header for a shape it had no data for
  expect_error([&] { npy::serialize(npy::Dtype::kFloat32, {int64_t{1} << 62, 4}, nullptr); }, "is too large");
  expect_error([&] { npy::serialize(npy::Dtype::kUint8, std::vector<int64_t>(33, 1), nullptr); }, "33 dimensions");
}

TEST(Robustness, PreprocessParametersAreNamed) {
  Stored st;
  const std::vector<uint8_t> before = st.bytes();
  const std::vector<float> w(128, 0.5f);
  const std::vector<int64_t> pos(st.keys.size() / 128, 0);
  std::vector<uint8_t> qo(st.keys.size());
  for (float eps : {std::nanf(""), -10.0f, INFINITY}) {
    InsertOptions o;
    o.pre.norm_weight = w.data();
    o.pre.eps = eps;
    expect_error([&] { insert_keys(st.caches[0], 0, st.keys.data(), st.slots.data(), 1, o); }, "eps = ");
    expect_error([&] { quantize_queries(st.keys.data(), 1, 1, o.pre, qo.data()); }, "eps = ");
  }
  for (double theta : {0.0, -1.0, std::nan(""), HUGE_VAL}) {
    InsertOptions o;
    o.pre.rope = true;
    o.pre.rope_theta = theta;
    o.pre.positions = pos.data();
    expect_error([&] { insert_keys(st.caches[0], 0, st.keys.data(), st.slots.data(), 1, o); }, "rope_theta = ");
    expect_error([&] { quantize_queries(st.keys.data(), 1, 1, o.pre, qo.data()); }, "rope_theta = ");
  }
  EXPECT_EQ(st.bytes(), before);
}
