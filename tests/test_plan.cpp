// The CPU backend's decode and prefill plans and the helpers they share with the CUDA plans
// (include/indexcp/plan.hpp): every plan's output equals the per-rank CPU functions it replaces
// bit for bit (icp_decode, decode_cp_replicated, decode_select, prefill_gather,
// prefill_local_score, prefill_select), the split publish / merge equals run, ranks that ran
// different steps get -1 and status 1, every refusal names its argument.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "indexcp/config.hpp"
#include "indexcp/plan.hpp"
#include "util.hpp"

namespace {

using namespace indexcp;
using namespace testutil;

#define EXPECT_ERROR_NAMES(stmt, ...)                                      \
  do {                                                                     \
    const std::string msg_ = error_of([&] { stmt; });                      \
    for (const std::string& s_ : std::vector<std::string>{__VA_ARGS__})    \
      EXPECT_NE(msg_.find(s_), std::string::npos) << "expected \"" << s_ << "\" in: " << msg_; \
  } while (0)


ResolvedConfig make_config(KvDtype dt, int32_t tp, int32_t P, bool sharding, bool decode_cp,
                           KRounding mode = KRounding::kE4m3, PrefillCp pcp = PrefillCp::kGather,
                           int64_t budget_mib = 256, int32_t heads = 4) {
  AttentionConfig a;
  a.kv_dtype = dt;
  a.cache_sharding = sharding;
  a.decode_cp = decode_cp;
  a.k_rounding = mode;
  a.prefill_cp = pcp;
  a.prefill_gather_budget_mib = budget_mib;
  EngineParams e;
  e.tp = tp;
  e.page_size = P;
  e.heads = heads;
  return resolve_config(a, e);
}

// The block table of `r` re-laid with `width` entries per request; entries past a request's pages
// hold a large garbage id (they must be ignored).
std::vector<int32_t> widen(const Requests& r, int32_t width) {
  const size_t B = r.seq_lens.size();
  std::vector<int32_t> t(B * width, 0x3fffffff);
  for (size_t b = 0; b < B; ++b) {
    const int32_t np = (r.seq_lens[b] + r.page_size - 1) / r.page_size;
    for (int32_t i = 0; i < np; ++i) t[b * width + i] = r.block_table[b * r.max_pages + i];
  }
  return t;
}

// Random request lengths: some padded (0), one short (fewer blocks than K), the rest long.
std::vector<int32_t> random_lens(std::mt19937& rng, int32_t B, int32_t Q, int32_t max_len) {
  std::uniform_int_distribution<int32_t> len(Q, max_len);
  std::vector<int32_t> lens(B);
  for (int32_t b = 0; b < B; ++b) lens[b] = len(rng);
  lens[1 % B] = 0;                                   // a padded request
  if (B > 2) lens[2] = std::max(Q, 3 * 128 + 5);     // n <= K: every visible block
  if (B > 3) lens[3] = 2048;                         // a block boundary
  return lens;
}

// The caches the config needs: W shards, or one replicated cache.
std::vector<IndexCache> caches_for(const ResolvedConfig& rc, const Requests& req, const std::vector<float>& keys,
                                   const std::vector<int64_t>& slots, int32_t layers, int32_t layer) {
  return make_shards(rc.kv_dtype, req, rc.sharding ? rc.engine.tp : 1, keys, slots, layers, layer);
}
const IndexCache& cache_of(const ResolvedConfig& rc, const std::vector<IndexCache>& caches, int rank) {
  return caches[rc.sharding ? static_cast<size_t>(rank) : 0];
}

// The per-rank CPU functions the decode plan replaces: each rank's output [rows, owned heads, K].
std::vector<std::vector<int32_t>> reference_decode(const ResolvedConfig& rc, const std::vector<IndexCache>& caches,
                                                   int32_t layer, const DecodeBatch& hb, const SelectionParams& sel) {
  const int32_t W = rc.engine.tp;
  std::vector<std::vector<int32_t>> ref(W);
  run_ranks(W, [&](int rank, Communicator& comm) {
    int32_t h0, nh;
    owned_heads(hb.heads, W, rank, &h0, &nh);
    ref[rank].assign(static_cast<size_t>(hb.rows()) * nh * sel.topk, -9);
    if (rc.sharding)
      icp_decode(comm, caches[rank], layer, hb, sel, rc.k_rounding, ref[rank].data());
    else if (rc.decode_cp)
      decode_cp_replicated(comm, caches[0], layer, hb, sel, rc.k_rounding, ref[rank].data());
    else
      decode_select(caches[0], layer, hb, h0, nh, sel, rc.k_rounding, ref[rank].data());
  });
  return ref;
}

struct RankRun {
  std::vector<int32_t> out;
  uint32_t status = 77;
  size_t bytes_sent = 0;
};

// DecodePlan::run on every rank (one plan and workspace per rank, reused for every batch).
std::vector<std::vector<RankRun>> run_decode_plans(const ResolvedConfig& rc, const DecodeLimits& limits,
                                                   const std::vector<IndexCache>& caches, int32_t layer,
                                                   const std::vector<DeviceDecodeBatch>& batches) {
  const int32_t W = rc.engine.tp;
  std::vector<std::vector<RankRun>> res(W, std::vector<RankRun>(batches.size()));
  run_ranks(W, [&](int rank, Communicator& comm) {
    const DecodePlan plan(rc, rank, limits);
    Buffer ws(plan.workspace_bytes());
    for (size_t i = 0; i < batches.size(); ++i) {
      RankRun& r = res[rank][i];
      const size_t before = comm.bytes_sent();
      r.out.assign(static_cast<size_t>(batches[i].num_requests) * limits.query_len * plan.num_heads() *
                       limits.sel.topk, -9);
      plan.run(cache_of(rc, caches, rank), layer, batches[i], ws.p, ws.size, r.out.data(), &comm, &r.status);
      r.bytes_sent = comm.bytes_sent() - before;
    }
  });
  return res;
}

StepSignature read_signature(const uint8_t* record, const ExchangeLayout& x) {
  StepSignature s;
  std::memcpy(&s, record + x.signature_offset, sizeof s);
  return s;
}

// An independent formulation of the step signature hash (64-bit products reduced by hand).
uint32_t reference_hash(const int32_t* v, int64_t n) {
  uint64_t sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint64_t k = ((static_cast<uint64_t>(i) * 2654435769ull) & 0xffffffffull) ^ static_cast<uint32_t>(v[i]);
    k ^= k >> 16;
    k = (k * 2246822507ull) & 0xffffffffull;
    k ^= k >> 13;
    k = (k * 3266489909ull) & 0xffffffffull;
    k ^= k >> 16;
    sum += k;
  }
  return static_cast<uint32_t>(sum & 0xffffffffull);
}

// ---------------------------------------------------------------------------------------------
// Decode: run = the per-rank functions; the split form = run; padding; a second, smaller step.

using DecodeParam = std::tuple<int32_t /*tp*/, int32_t /*P*/, KvDtype, int /*0 off, 1 sharding, 2 decode_cp, 3 both*/,
                               int32_t /*Q*/>;
class PlanDecode : public ::testing::TestWithParam<DecodeParam> {};

TEST_P(PlanDecode, RunAndTheSplitFormEqualThePerRankFunctions) {
  const auto [tp, P, dt, cp, Q] = GetParam();
  const uint32_t seed = 1000u * tp + 10u * P + 3u * static_cast<uint32_t>(dt) + 17u * cp + Q;
  std::mt19937 rng(seed);
  const KRounding mode = dt == KvDtype::kNvfp4 && Q == 4 ? KRounding::kExact : KRounding::kE4m3;
  const int32_t H = tp == 4 && P == 256 ? 2 : tp == 2 && P == 256 ? 8 : 4;  // W > H, W < H, W = H
  const ResolvedConfig rc = make_config(dt, tp, P, cp & 1, cp & 2, mode, PrefillCp::kGather, 256, H);
  const int32_t W = tp;
  const std::string tag = "tp " + std::to_string(tp) + " P " + std::to_string(P) + " " + to_string(dt) + " cp " +
                          std::to_string(cp) + " Q " + std::to_string(Q) + " path " + to_string(decode_path(rc));
  SCOPED_TRACE(tag);
  const int32_t B = 6;
  const auto req = make_requests(random_lens(rng, B, Q, 2600), P, seed);
  std::vector<float> keys;
  std::vector<int64_t> slots;
  make_keys(req, seed + 1, keys, slots);
  const int32_t layers = 2, layer = 1;
  const auto caches = caches_for(rc, req, keys, slots, layers, layer);

  DecodeLimits limits;
  limits.max_requests = B + 3;           // more than the batch
  limits.max_pages = req.max_pages + 2;  // a wider block table than needed
  limits.query_len = Q;
  limits.heads = H;
  limits.sel.topk = P == 128 ? 16 : 8;
  limits.sel.init_blocks = P == 128 ? 0 : 2;
  const auto table = widen(req, limits.max_pages);
  const auto q = make_q(static_cast<int64_t>(B) * Q, H, seed + 2);

  // step 1: the whole batch; step 2: its first B - 2 requests with other lengths (same buffers)
  std::vector<int32_t> lens2(req.seq_lens.begin(), req.seq_lens.begin() + B - 2);
  for (auto& l : lens2)
    if (l > Q + 200) l -= 200;
  DecodeBatch hb1;
  hb1.q = q.data();
  hb1.heads = H;
  hb1.block_table = table.data();
  hb1.num_requests = B;
  hb1.max_pages = limits.max_pages;
  hb1.seq_lens = req.seq_lens.data();
  hb1.query_len = Q;
  DecodeBatch hb2 = hb1;
  hb2.num_requests = B - 2;
  hb2.seq_lens = lens2.data();
  const std::vector<DeviceDecodeBatch> dbs = {{q.data(), table.data(), req.seq_lens.data(), B},
                                              {q.data(), table.data(), lens2.data(), B - 2},
                                              {nullptr, nullptr, nullptr, 0}};
  const auto ref1 = reference_decode(rc, caches, layer, hb1, limits.sel);
  const auto ref2 = reference_decode(rc, caches, layer, hb2, limits.sel);
  const auto got = run_decode_plans(rc, limits, caches, layer, dbs);

  const DecodePlan plan0(rc, 0, limits);
  const bool exchanges = plan0.path() != DecodePath::kReplicated;
  EXPECT_EQ(plan0.path(), decode_path(rc));
  EXPECT_EQ(plan0.world(), W);
  for (int rank = 0; rank < W; ++rank) {
    EXPECT_EQ(got[rank][0].out, ref1[rank]) << "rank " << rank << ", step 1";
    EXPECT_EQ(got[rank][1].out, ref2[rank]) << "rank " << rank << ", step 2";
    EXPECT_TRUE(got[rank][2].out.empty());
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(got[rank][i].status, 0u) << "rank " << rank << ", step " << i + 1;
      // every step moves the same bytes, whatever its batch
      EXPECT_EQ(got[rank][i].bytes_sent, exchanges ? plan0.exchange_bytes() : 0u) << "step " << i + 1;
    }
    // the padded request's rows select nothing
    int32_t h0, nh;
    owned_heads(H, W, rank, &h0, &nh);
    for (int64_t row = 1 * Q; row < 2 * Q; ++row)
      for (int64_t k = 0; k < nh * limits.sel.topk; ++k)
        ASSERT_EQ(got[rank][0].out[row * nh * limits.sel.topk + k], -1) << "padded row " << row;
  }
  // sizes
  const ExchangeLayout x = plan0.exchange();
  if (exchanges) {
    const ExchangeLayout want = exchange_layout(limits.max_rows(), H, limits.sel);
    EXPECT_EQ(x.record_bytes, want.record_bytes);
    EXPECT_EQ(x.candidate_bytes, static_cast<size_t>(limits.max_rows()) * H * limits.sel.ranked() * 8);
    EXPECT_EQ(plan0.exchange_bytes(), x.record_bytes);
    EXPECT_GE(plan0.workspace_bytes(), plan0.exchange_bytes() * (1 + W));
    EXPECT_EQ(plan0.workspace_bytes() % 16, 0u);
  } else {
    EXPECT_EQ(plan0.exchange_bytes(), 0u);
    EXPECT_EQ(plan0.workspace_bytes(), 0u);
    EXPECT_NE(error_of([&] {
                Buffer ws(16), send(16);
                plan0.publish(caches[0], layer, dbs[0], ws.p, 16, send.p);
              }).find("exchanges nothing"),
              std::string::npos);
    return;
  }

  // the split form: publish on every rank, concatenate the records here, merge = run
  const size_t X = plan0.exchange_bytes();
  for (size_t step = 0; step < 2; ++step) {
    const DecodeBatch& hb = step == 0 ? hb1 : hb2;
    Buffer recv(X * W, 0xEE);
    for (int rank = 0; rank < W; ++rank) {
      const DecodePlan plan(rc, rank, limits);
      Buffer ws(plan.workspace_bytes()), send(X, 0xCD);
      plan.publish(cache_of(rc, caches, rank), layer, dbs[step], ws.p, ws.size, send.p);
      // the candidates are publish_candidates of the rank's scores, in the record's first rows
      const auto rows = decode_rows(hb, req.num_pages, P);
      const BlockFilter filter = plan.path() == DecodePath::kIcp ? BlockFilter{} : BlockFilter{W, rank};
      const auto scores = score_blocks(cache_of(rc, caches, rank), layer, rows, hb.block_table, hb.max_pages, hb.q,
                                       H, 0, H, mode, filter);
      std::vector<Candidate> mine(rows.size() * H * limits.sel.ranked());
      publish_candidates(scores, rows, limits.sel, mine.data());
      ASSERT_EQ(0, std::memcmp(send.p, mine.data(), mine.size() * sizeof(Candidate))) << "rank " << rank;
      for (size_t i = mine.size() * sizeof(Candidate); i < x.candidate_bytes; ++i)
        ASSERT_EQ(send.p[i], 0xCD) << "rows past the step's rows must be left untouched (byte " << i << ")";
      const StepSignature s = read_signature(send.p, x);
      const uint32_t want[16] = {0x53504349u, 1u, static_cast<uint32_t>(hb.num_requests), static_cast<uint32_t>(Q),
                                 static_cast<uint32_t>(H), static_cast<uint32_t>(limits.sel.ranked()),
                                 static_cast<uint32_t>(limits.max_pages), static_cast<uint32_t>(limits.max_rows()),
                                 reference_hash(hb.seq_lens, hb.num_requests), 0, 0, 0, 0, 0, 0, 0};
      for (int i = 0; i < 16; ++i) EXPECT_EQ(s.v[i], want[i]) << "signature word " << i;
      std::memcpy(recv.p + rank * X, send.p, X);
    }
    for (int rank = 0; rank < W; ++rank) {
      const DecodePlan plan(rc, rank, limits);
      std::vector<int32_t> out(static_cast<size_t>(hb.rows()) * plan.num_heads() * limits.sel.topk, -9);
      uint32_t status = 77;
      plan.merge(dbs[step], recv.p, out.data(), &status);
      EXPECT_EQ(status, 0u);
      EXPECT_EQ(out, got[rank][step].out) << "merge of the split form, rank " << rank << ", step " << step + 1;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, PlanDecode,
                         ::testing::Combine(::testing::Values(1, 2, 4), ::testing::Values(128, 256),
                                            ::testing::Values(KvDtype::kNvfp4, KvDtype::kFp8),
                                            ::testing::Values(0, 1, 2, 3), ::testing::Values(1, 4)));

// A moved plan runs like the original.
TEST(PlanDecode, MovedPlansRun) {
  const ResolvedConfig rc = make_config(KvDtype::kNvfp4, 2, 128, true, false);
  const auto req = make_requests({2000, 900}, 128, 5);
  std::vector<float> keys;
  std::vector<int64_t> slots;
  make_keys(req, 6, keys, slots);
  const auto shards = make_shards(KvDtype::kNvfp4, req, 2, keys, slots);
  const auto q = make_q(2, 4, 7);
  DecodeLimits limits;
  limits.max_requests = 2;
  limits.max_pages = req.max_pages;
  const DecodeBatch hb = decode_batch(req, q, 4, 1);
  const auto ref = reference_decode(rc, shards, 0, hb, limits.sel);
  run_ranks(2, [&](int rank, Communicator& comm) {
    DecodePlan a(rc, rank, limits);
    DecodePlan b(std::move(a));
    DecodePlan c(make_config(KvDtype::kNvfp4, 2, 128, false, false), rank, limits);
    c = std::move(b);
    EXPECT_EQ(c.path(), DecodePath::kIcp);
    Buffer ws(c.workspace_bytes());
    std::vector<int32_t> out(2 * 2 * 16);
    c.run(shards[rank], 0, {q.data(), req.block_table.data(), req.seq_lens.data(), 2}, ws.p, ws.size, out.data(),
          &comm);
    EXPECT_EQ(out, ref[rank]);
  });
}

// ---------------------------------------------------------------------------------------------
// Ranks that ran different steps: every output -1, status 1, the message names the call.

TEST(PlanDecode, RanksWithDifferentStepsGetMinusOneAndStatusOne) {
  for (const bool decode_cp : {false, true}) {
    const ResolvedConfig rc = make_config(KvDtype::kNvfp4, 2, 128, !decode_cp, decode_cp);
    const auto req = make_requests({3000, 1500, 2200}, 128, 21);
    std::vector<float> keys;
    std::vector<int64_t> slots;
    make_keys(req, 22, keys, slots);
    const auto caches = caches_for(rc, req, keys, slots, 1, 0);
    const int32_t Q = 2, H = 4;
    const auto q = make_q(3 * Q, H, 23);
    DecodeLimits limits;
    limits.max_requests = 4;
    limits.max_pages = req.max_pages;
    limits.query_len = Q;
    std::vector<int32_t> other = req.seq_lens;
    other[1] -= 1;  // still valid: a rank that saw another length
    const DeviceDecodeBatch same{q.data(), req.block_table.data(), req.seq_lens.data(), 3};
    const DeviceDecodeBatch diff_len{q.data(), req.block_table.data(), other.data(), 3};
    const DeviceDecodeBatch fewer{q.data(), req.block_table.data(), req.seq_lens.data(), 2};
    const auto check_all_minus_one = [&](const std::vector<int32_t>& out, uint32_t status, const std::string& what) {
      EXPECT_EQ(status, 1u) << what;
      for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], -1) << what << " at " << i;
    };
    // split form: rank 1 published another step
    for (const DeviceDecodeBatch* b1 : {&diff_len, &fewer}) {
      const DecodePlan p0(rc, 0, limits), p1(rc, 1, limits);
      const size_t X = p0.exchange_bytes();
      Buffer recv(2 * X), ws(p0.workspace_bytes());
      p0.publish(cache_of(rc, caches, 0), 0, same, ws.p, ws.size, recv.p);
      p1.publish(cache_of(rc, caches, 1), 0, *b1, ws.p, ws.size, recv.p + X);
      std::vector<int32_t> out0(3 * Q * 2 * 16, 5), out1(static_cast<size_t>(b1->num_requests) * Q * 2 * 16, 5);
      uint32_t s0 = 0, s1 = 0;
      p0.merge(same, recv.p, out0.data(), &s0);
      p1.merge(*b1, recv.p, out1.data(), &s1);
      check_all_minus_one(out0, s0, "rank 0");
      check_all_minus_one(out1, s1, "rank 1");
      // and a record whose reserved signature word differs is a disagreement too
      if (b1 == &fewer) {
        p1.publish(cache_of(rc, caches, 1), 0, same, ws.p, ws.size, recv.p + X);
        p0.merge(same, recv.p, out0.data(), &s0);
        EXPECT_EQ(s0, 0u);
        recv.p[X + p0.exchange().signature_offset + 60] ^= 1;  // v[15]
        p0.merge(same, recv.p, out0.data(), &s0);
        check_all_minus_one(out0, s0, "reserved word");
      }
    }
    // run through the communicator: both ranks move the same bytes and get -1 (no hang)
    run_ranks(2, [&](int rank, Communicator& comm) {
      const DecodePlan plan(rc, rank, limits);
      Buffer ws(plan.workspace_bytes());
      const DeviceDecodeBatch& b = rank == 0 ? same : diff_len;
      std::vector<int32_t> out(3 * Q * 2 * 16, 5);
      uint32_t status = 0;
      plan.run(cache_of(rc, caches, rank), 0, b, ws.p, ws.size, out.data(), &comm, &status);
      check_all_minus_one(out, status, "run, rank " + std::to_string(rank));
    });
  }
  const std::string m = step_status_message(1, "DecodePlan::run");
  EXPECT_EQ(m.rfind("DecodePlan::run: ", 0), 0u) << m;
  EXPECT_NE(m.find("step signatures differ"), std::string::npos) << m;
  EXPECT_NE(m.find("-1"), std::string::npos) << m;
  EXPECT_EQ(step_status_message(0, "x"), "");
  const std::string m2 = step_status_message(2, "PrefillPlan::run");
  EXPECT_EQ(m2.rfind("PrefillPlan::run: ", 0), 0u) << m2;
  EXPECT_NE(m2.find("extents.gather_units"), std::string::npos) << m2;
  EXPECT_NE(step_status_message(9, "f").find("9"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// Refusals name their argument.

TEST(PlanDecode, RefusalsNameTheirArgument) {
  const ResolvedConfig rc = make_config(KvDtype::kNvfp4, 2, 128, true, false);
  DecodeLimits limits;
  limits.max_requests = 8;
  limits.max_pages = 8;
  // the constructor
  EXPECT_ERROR_NAMES(DecodePlan(rc, -1, limits), "rank = -1");
  EXPECT_ERROR_NAMES(DecodePlan(rc, 2, limits), "rank = 2", "tp = 2");
  const auto with = [&](auto f) {
    DecodeLimits l = limits;
    f(l);
    return l;
  };
  EXPECT_ERROR_NAMES(DecodePlan(rc, 0, with([](DecodeLimits& l) { l.max_requests = 0; })), "limits.max_requests = 0");
  EXPECT_ERROR_NAMES(DecodePlan(rc, 0, with([](DecodeLimits& l) { l.max_requests = (1 << 20) + 1; })),
                     "limits.max_requests");
  EXPECT_ERROR_NAMES(DecodePlan(rc, 0, with([](DecodeLimits& l) { l.max_pages = 0; })), "limits.max_pages = 0");
  EXPECT_ERROR_NAMES(DecodePlan(rc, 0, with([](DecodeLimits& l) { l.max_pages = (1 << 24) + 1; })),
                     "limits.max_pages");
  EXPECT_ERROR_NAMES(DecodePlan(rc, 0, with([](DecodeLimits& l) { l.query_len = 0; })), "limits.query_len = 0");
  EXPECT_ERROR_NAMES(DecodePlan(rc, 0, with([](DecodeLimits& l) { l.query_len = 17; })), "limits.query_len = 17");
  EXPECT_ERROR_NAMES(DecodePlan(rc, 0, with([](DecodeLimits& l) { l.heads = 0; })), "limits.heads = 0");
  EXPECT_ERROR_NAMES(DecodePlan(rc, 0, with([](DecodeLimits& l) { l.heads = 65; })), "limits.heads = 65");
  EXPECT_ERROR_NAMES(DecodePlan(make_config(KvDtype::kNvfp4, 4, 128, true, false), 0,
                                with([](DecodeLimits& l) { l.heads = 6; })),
                     "limits.heads = 6", "tp = 4");
  EXPECT_ERROR_NAMES(DecodePlan(rc, 0, with([](DecodeLimits& l) { l.sel.topk = 1; })), "limits.sel.topk = 1");
  EXPECT_ERROR_NAMES(DecodePlan(rc, 0, with([](DecodeLimits& l) { l.sel.init_blocks = 15; })),
                     "limits.sel.init_blocks = 15");
  ResolvedConfig edited = rc;
  edited.sharding = false;
  EXPECT_ERROR_NAMES(DecodePlan(edited, 0, limits), "ResolvedConfig.sharding");

  // run
  const auto req = make_requests({700, 300}, 128, 31);
  std::vector<float> keys;
  std::vector<int64_t> slots;
  make_keys(req, 32, keys, slots);
  const auto shards = make_shards(KvDtype::kNvfp4, req, 2, keys, slots, 2, 0);
  const auto rep = make_shards(KvDtype::kNvfp4, req, 1, keys, slots);
  const auto fp8 = make_shards(KvDtype::kFp8, req, 2, keys, slots);
  const auto p256 = make_shards(KvDtype::kNvfp4, make_requests({700, 300}, 256, 31), 2, {}, {});
  const auto q = make_q(8, 4, 33);
  const auto table = widen(req, limits.max_pages);
  const DeviceDecodeBatch good{q.data(), table.data(), req.seq_lens.data(), 2};
  InProcessGroup group(2);
  Communicator& c0 = group.comm(0);
  Communicator& c1 = group.comm(1);
  const DecodePlan plan(rc, 0, limits);
  Buffer ws(plan.workspace_bytes());
  std::vector<int32_t> out(8 * 2 * 16);
  const auto run = [&](const CacheView& cache, int32_t layer, DeviceDecodeBatch b, void* w, size_t wb, int32_t* o,
                       Communicator* comm) { plan.run(cache, layer, b, w, wb, o, comm); };
  const auto nreq = [&](int32_t n) {
    DeviceDecodeBatch b = good;
    b.num_requests = n;
    return b;
  };
  EXPECT_ERROR_NAMES(run(shards[0], 0, nreq(9), ws.p, ws.size, out.data(), &c0),
                     "num_requests = 9 exceeds the plan's limits.max_requests = 8");
  EXPECT_ERROR_NAMES(run(shards[0], 0, nreq(-1), ws.p, ws.size, out.data(), &c0), "num_requests = -1");
  DeviceDecodeBatch b = good;
  b.q = nullptr;
  EXPECT_ERROR_NAMES(run(shards[0], 0, b, ws.p, ws.size, out.data(), &c0), "q is null");
  b = good;
  b.seq_lens = nullptr;
  EXPECT_ERROR_NAMES(run(shards[0], 0, b, ws.p, ws.size, out.data(), &c0), "seq_lens is null");
  b = good;
  b.block_table = nullptr;
  EXPECT_ERROR_NAMES(run(shards[0], 0, b, ws.p, ws.size, out.data(), &c0), "block_table is null");
  EXPECT_ERROR_NAMES(run(shards[0], 0, good, ws.p, ws.size, nullptr, &c0), "out is null");
  EXPECT_ERROR_NAMES(run(shards[0], 0, good, nullptr, ws.size, out.data(), &c0), "workspace is null");
  EXPECT_ERROR_NAMES(run(shards[0], 0, good, ws.p, ws.size - 1, out.data(), &c0),
                     "workspace_bytes = " + std::to_string(ws.size - 1),
                     "workspace_bytes() = " + std::to_string(ws.size));
  EXPECT_ERROR_NAMES(run(shards[0], 0, good, ws.p + 8, ws.size, out.data(), &c0), "workspace", "16-byte");
  EXPECT_ERROR_NAMES(run(shards[0], 0, good, ws.p, ws.size, out.data(), nullptr), "comm is null");
  EXPECT_ERROR_NAMES(run(shards[0], 0, good, ws.p, ws.size, out.data(), &c1), "comm is rank 1", "plan is rank 0");
  run_ranks(1, [&](int, Communicator& solo) {
    EXPECT_ERROR_NAMES(run(shards[0], 0, good, ws.p, ws.size, out.data(), &solo), "comm has world = 1", "tp = 2");
  });
  // the cache
  EXPECT_ERROR_NAMES(run(shards[1], 0, good, ws.p, ws.size, out.data(), &c0), "cache is rank 1", "rank 0");
  EXPECT_ERROR_NAMES(run(rep[0], 0, good, ws.p, ws.size, out.data(), &c0), "cache", "shards 1", "shards 2");
  EXPECT_ERROR_NAMES(run(fp8[0], 0, good, ws.p, ws.size, out.data(), &c0), "cache", "fp8", "nvfp4");
  EXPECT_ERROR_NAMES(run(p256[0], 0, good, ws.p, ws.size, out.data(), &c0), "cache", "page_size 256",
                     "page_size 128");
  EXPECT_ERROR_NAMES(run(shards[0], 2, good, ws.p, ws.size, out.data(), &c0), "layer = 2");
  EXPECT_ERROR_NAMES(run(CacheView{}, 0, good, ws.p, ws.size, out.data(), &c0), "cache is an empty view");
  const CacheView dev = make_cache_view(shards[0].layout(), const_cast<uint8_t*>(shards[0].data()),
                                        shards[0].num_pages(), 1, 0, 0, MemoryLocation::kDevice);
  EXPECT_ERROR_NAMES(run(dev, 0, good, ws.p, ws.size, out.data(), &c0), "cache is a device view");
  EXPECT_ERROR_NAMES(plan.check_cache(rep[0], 0), "cache");
  EXPECT_NO_THROW(plan.check_cache(shards[0], 1));
  // the batch's own checks (decode_rows)
  std::vector<int32_t> bad_table = table;
  bad_table[1] = 99;
  b = good;
  b.block_table = bad_table.data();
  EXPECT_ERROR_NAMES(run(shards[0], 0, b, ws.p, ws.size, out.data(), &c0), "block_table[0][1] = 99");
  // publish / merge
  EXPECT_ERROR_NAMES(plan.publish(shards[0], 0, good, ws.p, ws.size, nullptr), "send is null");
  EXPECT_ERROR_NAMES(plan.publish(shards[0], 0, good, ws.p, ws.size, ws.p + 4), "send", "8-byte");
  EXPECT_ERROR_NAMES(plan.publish(shards[0], 0, nreq(9), ws.p, ws.size, ws.p), "num_requests = 9");
  EXPECT_ERROR_NAMES(plan.publish(shards[0], 0, good, ws.p, 16, ws.p), "workspace_bytes = 16");
  EXPECT_ERROR_NAMES(plan.merge(good, nullptr, out.data()), "recv is null");
  EXPECT_ERROR_NAMES(plan.merge(good, ws.p, nullptr), "out is null");
  EXPECT_ERROR_NAMES(plan.merge(nreq(9), ws.p, out.data()), "num_requests = 9");
  // a valid call of the same arguments succeeds (the refusals above are not vacuous)
  run_ranks(2, [&](int rank, Communicator& comm) {
    const DecodePlan p(rc, rank, limits);
    Buffer w(p.workspace_bytes());
    std::vector<int32_t> o(8 * 2 * 16);
    uint32_t status = 9;
    p.run(shards[rank], 0, good, w.p, w.size, o.data(), &comm, &status);
    EXPECT_EQ(status, 0u);
  });
  // replicated plans take no comm and no workspace
  const ResolvedConfig rrc = make_config(KvDtype::kNvfp4, 2, 128, false, false);
  const DecodePlan rplan(rrc, 1, limits);
  EXPECT_EQ(rplan.workspace_bytes(), 0u);
  uint32_t status = 9;
  EXPECT_NO_THROW(rplan.run(rep[0], 0, good, nullptr, 0, out.data(), nullptr, &status));
  EXPECT_EQ(status, 0u);
  EXPECT_ERROR_NAMES(rplan.merge(good, ws.p, out.data()), "exchanges nothing");
}

// ---------------------------------------------------------------------------------------------
// The paths, the hash, the exchange layout.

TEST(PlanPaths, EachConfigRunsThePathThePolicyGives) {
  int checked = 0;
  for (const KvDtype dt : {KvDtype::kBf16, KvDtype::kFp8, KvDtype::kNvfp4})
    for (const int32_t tp : {1, 2, 4, 8})
      for (const int32_t P : {128, 256})
        for (const bool sharding : {false, true})
          for (const bool dcp : {false, true})
            for (const PrefillCp pcp : {PrefillCp::kGather, PrefillCp::kLocalScore}) {
              ResolvedConfig rc;
              try {
                rc = make_config(dt, tp, P, sharding, dcp, KRounding::kE4m3, pcp, 256, 8);
              } catch (const Error&) {
                EXPECT_TRUE(sharding && dt == KvDtype::kBf16);
                continue;
              }
              // the policy: decode CP wins over sharding, both are no-ops at tp = 1
              const bool eff_sharding = sharding && tp > 1 && !dcp, eff_dcp = dcp && tp > 1;
              const DecodePath dp = eff_sharding ? DecodePath::kIcp : eff_dcp ? DecodePath::kDecodeCp
                                                                              : DecodePath::kReplicated;
              const PrefillPath pp = !eff_sharding ? PrefillPath::kReplicated
                                     : pcp == PrefillCp::kGather ? PrefillPath::kGather
                                                                 : PrefillPath::kLocalScore;
              EXPECT_EQ(decode_path(rc), dp);
              EXPECT_EQ(prefill_path(rc), pp);
              EXPECT_EQ(DecodePlan(rc, tp - 1, DecodeLimits{1, 1, 1, 8, {}}).path(), dp);
              EXPECT_EQ(PrefillPlan(rc, tp - 1, PrefillLimits{1, 1, 1, 8, {}}).path(), pp);
              ++checked;
            }
  EXPECT_EQ(checked, 3 * 4 * 2 * 2 * 2 * 2 - 1 * 4 * 2 * 2 * 2);  // bf16 + sharding is refused
  EXPECT_STREQ(to_string(DecodePath::kReplicated), "replicated");
  EXPECT_STREQ(to_string(DecodePath::kIcp), "icp");
  EXPECT_STREQ(to_string(DecodePath::kDecodeCp), "decode_cp");
  EXPECT_STREQ(to_string(PrefillPath::kReplicated), "replicated");
  EXPECT_STREQ(to_string(PrefillPath::kGather), "gather");
  EXPECT_STREQ(to_string(PrefillPath::kLocalScore), "local_score");
}

TEST(PlanSignature, HashMatchesAnIndependentComputation) {
  std::mt19937 rng(77);
  std::uniform_int_distribution<int32_t> any(INT32_MIN, INT32_MAX);
  for (int64_t n : {0, 1, 2, 7, 100, 5000}) {
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (auto& x : v) x = n % 2 ? any(rng) : static_cast<int32_t>(rng() % 100000);
    EXPECT_EQ(step_signature_hash(v.data(), n), reference_hash(v.data(), n)) << n;
    uint32_t sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += step_signature_term(i, v[i]);
    EXPECT_EQ(step_signature_hash(v.data(), n), sum);
    if (n > 1) {  // a change of one value, or of the order, changes the hash
      auto w = v;
      w[1] += 1;
      EXPECT_NE(step_signature_hash(w.data(), n), step_signature_hash(v.data(), n));
      w = v;
      std::swap(w[0], w[1]);
      if (w[0] != w[1]) EXPECT_NE(step_signature_hash(w.data(), n), step_signature_hash(v.data(), n));
    }
  }
  EXPECT_EQ(step_signature_hash(nullptr, 0), 0u);
  EXPECT_EQ(step_signature_fmix32(0), 0u);
}

TEST(PlanSignature, ExchangeLayout) {
  SelectionParams sel;
  sel.topk = 16;
  sel.init_blocks = 2;
  const ExchangeLayout x = exchange_layout(5, 4, sel);
  EXPECT_EQ(x.rows, 5);
  EXPECT_EQ(x.heads, 4);
  EXPECT_EQ(x.ranked, 13);
  EXPECT_EQ(x.candidate_bytes, 5u * 4 * 13 * 8);
  EXPECT_EQ(x.signature_offset, x.candidate_bytes);
  EXPECT_EQ(x.record_bytes, x.candidate_bytes + 64);
  EXPECT_EQ(exchange_layout(0, 1, sel).record_bytes, 64u);
}

// ---------------------------------------------------------------------------------------------
// Prefill

struct PrefillSetup {
  Requests req;
  std::vector<int32_t> table, query_start;
  std::vector<uint8_t> q;
};

// Requests with random chunks: a full prefill, chunks of continued requests, a request with no
// tokens in this chunk, a padded one (seq_len 0).
PrefillSetup make_prefill(std::mt19937& rng, int32_t B, int32_t P, int32_t width_extra, int32_t H, int32_t max_len,
                          int32_t max_chunk) {
  std::uniform_int_distribution<int32_t> len(1, max_len);
  std::vector<int32_t> lens(B);
  for (auto& l : lens) l = len(rng);
  if (B > 1) lens[1] = 0;
  if (B > 3) lens[3] = std::min(lens[3], 700);  // the request prefilled whole (all its rows)
  if (B > 4) lens[4] = 128 * (1 + lens[4] / 128);  // ends at a block boundary
  PrefillSetup s;
  s.req = make_requests(lens, P, static_cast<uint32_t>(rng()));
  s.table = widen(s.req, s.req.max_pages + width_extra);
  s.req.max_pages += width_extra;
  s.req.block_table = s.table;  // Requests::slot reads the wide table
  s.query_start = {0};
  for (int32_t b = 0; b < B; ++b) {
    int32_t t = std::min<int32_t>(lens[b], std::uniform_int_distribution<int32_t>(1, max_chunk)(rng));
    if (b == 0) t = std::min(lens[b], max_chunk);
    if (b == 2) t = 0;  // no tokens of this request in the chunk
    if (b == 3) t = lens[b];  // the whole request
    s.query_start.push_back(s.query_start.back() + t);
  }
  s.q = make_q(s.query_start.back(), H, static_cast<uint32_t>(rng()));
  return s;
}

PrefillBatch host_prefill(const PrefillSetup& s, int32_t H) {
  PrefillBatch b;
  b.q = s.q.data();
  b.heads = H;
  b.block_table = s.table.data();
  b.num_requests = static_cast<int32_t>(s.req.seq_lens.size());
  b.max_pages = s.req.max_pages;
  b.seq_lens = s.req.seq_lens.data();
  b.query_start = s.query_start.data();
  return b;
}

DevicePrefillBatch device_prefill(const PrefillSetup& s) {
  return {s.q.data(), s.table.data(), s.req.seq_lens.data(), s.query_start.data(),
          static_cast<int32_t>(s.req.seq_lens.size())};
}

using PrefillParam = std::tuple<int32_t /*tp*/, int32_t /*P*/, KvDtype, int /*0 replicated, 1 gather, 2 local_score*/>;
class PlanPrefill : public ::testing::TestWithParam<PrefillParam> {};

TEST_P(PlanPrefill, RunEqualsThePerRankFunctions) {
  const auto [tp, P, dt, variant] = GetParam();
  const uint32_t seed = 7000u + 100u * tp + P + 11u * static_cast<uint32_t>(dt) + 3u * variant;
  std::mt19937 rng(seed);
  const int32_t H = tp == 4 && P == 128 ? 2 : 4;
  const ResolvedConfig rc = make_config(dt, tp, P, variant != 0, false, KRounding::kExact,
                                        variant == 2 ? PrefillCp::kLocalScore : PrefillCp::kGather, 1, H);
  const int32_t W = tp;
  SCOPED_TRACE("tp " + std::to_string(tp) + " P " + std::to_string(P) + " " + to_string(dt) + " path " +
               to_string(prefill_path(rc)));
  const int32_t B = 6;
  const PrefillSetup s = make_prefill(rng, B, P, 1, H, 6000, 200);
  std::vector<float> keys;
  std::vector<int64_t> slots;
  make_keys(s.req, seed + 1, keys, slots);
  const int32_t layers = 2, layer = 1;
  const auto caches = caches_for(rc, s.req, keys, slots, layers, layer);
  const PrefillBatch hb = host_prefill(s, H);
  SelectionParams sel;
  sel.topk = P == 128 ? 12 : 8;
  sel.init_blocks = 1;
  PrefillLimits limits;
  limits.max_requests = B + 1;
  limits.max_pages = s.req.max_pages;
  limits.max_rows = s.query_start.back() + 50;
  limits.heads = H;
  limits.sel = sel;
  const int64_t rows = s.query_start.back();

  // the reference on each rank
  std::vector<std::vector<int32_t>> ref(W);
  std::vector<GatherStats> stats(W);
  run_ranks(W, [&](int rank, Communicator& comm) {
    int32_t h0, nh;
    owned_heads(H, W, rank, &h0, &nh);
    ref[rank].assign(static_cast<size_t>(rows) * nh * sel.topk, -9);
    if (!rc.sharding)
      prefill_select(caches[0], layer, hb, h0, nh, sel, ref[rank].data());
    else if (rc.prefill_cp == PrefillCp::kGather)
      stats[rank] = prefill_gather(comm, caches[rank], layer, hb, sel, rc.prefill_gather_budget_bytes, ref[rank].data());
    else
      prefill_local_score(comm, caches[rank], layer, hb, sel, ref[rank].data());
  });

  const PrefillExtents ext = prefill_extents(hb, P);
  EXPECT_EQ(ext.rows, rows);
  int32_t max_t = 1;
  for (int32_t b = 0; b < B; ++b) max_t = std::max(max_t, s.query_start[b + 1] - s.query_start[b]);
  EXPECT_EQ(ext.max_rows_per_request, max_t);

  const PrefillPlan plan0(rc, 0, limits);
  EXPECT_EQ(plan0.path(), prefill_path(rc));
  if (plan0.path() == PrefillPath::kGather) {
    EXPECT_EQ(ext.gather_units, stats[0].pages);
    EXPECT_EQ(plan0.gather_chunks(ext), stats[0].chunks);
    EXPECT_GT(stats[0].chunks, 1) << "the test means to cover several chunks";
    const PageLayout l = make_page_layout(dt, P, W);
    EXPECT_EQ(plan0.units_per_chunk(),
              std::min<int64_t>(rc.prefill_gather_budget_bytes / gather_unit_bytes(l),
                                static_cast<int64_t>(limits.max_requests) * limits.max_pages));
    EXPECT_EQ(plan0.exchange_bytes(), static_cast<size_t>(plan0.units_per_chunk()) * l.rows() * 128);
  } else if (plan0.path() == PrefillPath::kLocalScore) {
    EXPECT_EQ(plan0.exchange_bytes(), exchange_layout(limits.max_rows, H, sel).record_bytes);
  } else {
    EXPECT_EQ(plan0.exchange_bytes(), 0u);
    EXPECT_EQ(plan0.workspace_bytes(), 0u);
  }

  // the plan on each rank: the exact extents, then too few gather units
  PrefillExtents fewer = ext;
  fewer.gather_units = std::max<int64_t>(0, ext.gather_units - 1);
  std::vector<RankRun> got(W), short_units(W);
  run_ranks(W, [&](int rank, Communicator& comm) {
    const PrefillPlan plan(rc, rank, limits);
    Buffer ws(plan.workspace_bytes());
    got[rank].out.assign(static_cast<size_t>(rows) * plan.num_heads() * sel.topk, -9);
    plan.run(cache_of(rc, caches, rank), layer, device_prefill(s), ext, ws.p, ws.size, got[rank].out.data(), &comm,
             &got[rank].status);
    got[rank].bytes_sent = comm.bytes_sent();
    short_units[rank].out.assign(got[rank].out.size(), -9);
    plan.run(cache_of(rc, caches, rank), layer, device_prefill(s), fewer, ws.p, ws.size, short_units[rank].out.data(),
             &comm, &short_units[rank].status);
    short_units[rank].bytes_sent = comm.bytes_sent() - got[rank].bytes_sent;
  });
  const int32_t R = P / rc.shards;
  for (int rank = 0; rank < W; ++rank) {
    EXPECT_EQ(got[rank].out, ref[rank]) << "rank " << rank;
    EXPECT_EQ(got[rank].status, 0u);
    if (plan0.path() == PrefillPath::kGather) {
      EXPECT_EQ(got[rank].bytes_sent, static_cast<size_t>(stats[rank].pages) * R * 128);
      ASSERT_GT(ext.gather_units, 0);
      EXPECT_EQ(short_units[rank].status, 2u);
      EXPECT_EQ(short_units[rank].bytes_sent, 0u);
      for (size_t i = 0; i < short_units[rank].out.size(); ++i) ASSERT_EQ(short_units[rank].out[i], -1) << i;
    } else {
      EXPECT_EQ(got[rank].bytes_sent, plan0.exchange_bytes());
      EXPECT_EQ(short_units[rank].status, 0u);  // gather_units bounds the gather only
      EXPECT_EQ(short_units[rank].out, ref[rank]);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, PlanPrefill,
                         ::testing::Combine(::testing::Values(1, 2, 4), ::testing::Values(128, 256),
                                            ::testing::Values(KvDtype::kNvfp4, KvDtype::kFp8),
                                            ::testing::Values(0, 1, 2)));

// prefill_extents = the gather's own counts for random batches; gather_chunks = its chunks.
TEST(PlanPrefill, ExtentsEqualTheGathersCountsForRandomBatches) {
  std::mt19937 rng(99);
  for (int trial = 0; trial < 12; ++trial) {
    const int32_t P = trial % 2 ? 256 : 128, W = 2, H = 2;
    const int64_t budget_mib = 1 + trial % 3;
    const ResolvedConfig rc = make_config(KvDtype::kNvfp4, W, P, true, false, KRounding::kE4m3, PrefillCp::kGather,
                                          budget_mib, H);
    const int32_t B = 1 + static_cast<int32_t>(rng() % 7) + (trial < 4 ? 5 : 0);
    const PrefillSetup s = make_prefill(rng, B, P, static_cast<int32_t>(rng() % 3), H, 1 + rng() % 9000, 40);
    const auto shards = make_shards(KvDtype::kNvfp4, s.req, W, {}, {});  // keys do not matter here
    const PrefillBatch hb = host_prefill(s, H);
    const PrefillExtents ext = prefill_extents(hb, P);
    // an independent count: pages of each request's historical blocks, for requests in the chunk
    int64_t units = 0;
    for (int32_t b = 0; b < B; ++b) {
      const int32_t t = s.query_start[b + 1] - s.query_start[b], len = s.req.seq_lens[b];
      if (t == 0) continue;
      const int64_t hist_blocks = (len - 1) / 128;
      units += (hist_blocks * 128 + P - 1) / P;
    }
    EXPECT_EQ(ext.gather_units, units);
    PrefillLimits limits;
    limits.max_requests = B;
    limits.max_pages = s.req.max_pages;
    limits.max_rows = std::max(1, s.query_start.back());
    limits.heads = H;
    std::vector<GatherStats> st(W);
    run_ranks(W, [&](int rank, Communicator& comm) {
      std::vector<int32_t> out(static_cast<size_t>(s.query_start.back()) * 1 * 16);
      st[rank] = prefill_gather(comm, shards[rank], 0, hb, limits.sel, rc.prefill_gather_budget_bytes, out.data());
    });
    EXPECT_EQ(ext.gather_units, st[0].pages) << "trial " << trial;
    const PrefillPlan plan(rc, 0, limits);
    EXPECT_EQ(plan.gather_chunks(ext), st[0].chunks) << "trial " << trial;
    // limits.max_gather_units bounds the chunk (and so the workspace); the run is the same
    limits.max_gather_units = std::max<int64_t>(1, ext.gather_units);
    const int64_t unit = gather_unit_bytes(make_page_layout(KvDtype::kNvfp4, P, W));
    std::vector<std::vector<int32_t>> want(W), got(W);
    run_ranks(W, [&](int rank, Communicator& comm) {
      const PrefillPlan p(rc, rank, limits);
      EXPECT_EQ(p.units_per_chunk(), std::min(rc.prefill_gather_budget_bytes / unit, limits.max_gather_units));
      EXPECT_LE(p.workspace_bytes(), plan.workspace_bytes());
      EXPECT_EQ(p.gather_chunks(ext), st[0].chunks);
      Buffer ws(p.workspace_bytes());
      want[rank].assign(static_cast<size_t>(ext.rows) * p.num_heads() * 16, -9);
      got[rank] = want[rank];
      prefill_gather(comm, shards[rank], 0, hb, limits.sel, rc.prefill_gather_budget_bytes, want[rank].data());
      uint32_t status = 9;
      p.run(shards[rank], 0, device_prefill(s), ext, ws.p, ws.size, got[rank].data(), &comm, &status);
      EXPECT_EQ(status, 0u);
      PrefillExtents more = ext;
      more.gather_units = limits.max_gather_units + 1;
      EXPECT_ERROR_NAMES(p.run(shards[rank], 0, device_prefill(s), more, ws.p, ws.size, got[rank].data(), &comm),
                         "extents.gather_units", "limits.max_gather_units");
    });
    EXPECT_EQ(got, want) << "trial " << trial;
  }
  {
    const ResolvedConfig rc = make_config(KvDtype::kFp8, 2, 128, true, false);
    PrefillLimits l;
    l.max_requests = 3;
    l.max_pages = 5;
    l.max_gather_units = -1;
    EXPECT_ERROR_NAMES(PrefillPlan(rc, 0, l), "limits.max_gather_units = -1");
    l.max_gather_units = 16;
    EXPECT_ERROR_NAMES(PrefillPlan(rc, 0, l), "limits.max_gather_units = 16", "15");
    l.max_gather_units = 15;
    EXPECT_NO_THROW(PrefillPlan(rc, 0, l));
  }
  // its refusals: the metadata checks of prefill_rows, without q
  std::vector<int32_t> lens = {300, 200}, qs = {0, 10, 5}, table = {0, 1, 2, 3, 4, 5};
  PrefillBatch b;
  b.q = nullptr;
  b.block_table = table.data();
  b.num_requests = 2;
  b.max_pages = 3;
  b.seq_lens = lens.data();
  b.query_start = qs.data();
  EXPECT_ERROR_NAMES(prefill_extents(b, 128), "query_start[2]");
  qs = {0, 10, 20};
  EXPECT_NO_THROW(prefill_extents(b, 128));
  lens[1] = 5;
  EXPECT_ERROR_NAMES(prefill_extents(b, 128), "seq_lens[1] = 5");
  lens[1] = 400;
  EXPECT_ERROR_NAMES(prefill_extents(b, 128), "seq_lens[1] = 400", "max_pages = 3");
  lens[1] = 200;
  table[4] = -1;
  EXPECT_ERROR_NAMES(prefill_extents(b, 128), "block_table[1][1] = -1");
  EXPECT_ERROR_NAMES(prefill_extents(b, 100), "page_size = 100");
}

TEST(PlanPrefill, RefusalsNameTheirArgument) {
  const ResolvedConfig rc = make_config(KvDtype::kNvfp4, 2, 128, true, false, KRounding::kE4m3,
                                        PrefillCp::kLocalScore);
  PrefillLimits limits;
  limits.max_requests = 4;
  limits.max_pages = 4;
  limits.max_rows = 1000;
  const auto with = [&](auto f) {
    PrefillLimits l = limits;
    f(l);
    return l;
  };
  EXPECT_ERROR_NAMES(PrefillPlan(rc, 5, limits), "rank = 5");
  EXPECT_ERROR_NAMES(PrefillPlan(rc, 0, with([](PrefillLimits& l) { l.max_rows = 0; })), "limits.max_rows = 0");
  EXPECT_ERROR_NAMES(PrefillPlan(rc, 0, with([](PrefillLimits& l) { l.max_rows = (int64_t{1} << 31) + 1; })),
                     "limits.max_rows");
  EXPECT_ERROR_NAMES(PrefillPlan(rc, 0, with([](PrefillLimits& l) { l.max_requests = 0; })), "limits.max_requests");
  EXPECT_ERROR_NAMES(PrefillPlan(rc, 0, with([](PrefillLimits& l) { l.max_pages = -3; })), "limits.max_pages = -3");
  EXPECT_ERROR_NAMES(PrefillPlan(rc, 0, with([](PrefillLimits& l) { l.heads = 3; })), "limits.heads = 3");
  EXPECT_ERROR_NAMES(PrefillPlan(rc, 0, with([](PrefillLimits& l) { l.sel.local_blocks = 2; })),
                     "limits.sel.local_blocks = 2");

  std::mt19937 rng(5);
  const PrefillSetup s = make_prefill(rng, 4, 128, 0, 4, 500, 20);
  limits.max_pages = s.req.max_pages;
  const auto shards = make_shards(KvDtype::kNvfp4, s.req, 2, {}, {});
  const PrefillPlan plan(rc, 0, limits);
  Buffer ws(plan.workspace_bytes());
  const int64_t rows = s.query_start.back();
  std::vector<int32_t> out(static_cast<size_t>(rows) * 2 * 16);
  const PrefillExtents ext = prefill_extents(host_prefill(s, 4), 128);
  InProcessGroup group(2);
  Communicator& c0 = group.comm(0);
  const DevicePrefillBatch good = device_prefill(s);
  const auto run = [&](DevicePrefillBatch b, PrefillExtents e, void* w, size_t wb, int32_t* o, Communicator* c) {
    plan.run(shards[0], 0, b, e, w, wb, o, c);
  };
  DevicePrefillBatch b = good;
  b.num_requests = 5;
  EXPECT_ERROR_NAMES(run(b, ext, ws.p, ws.size, out.data(), &c0),
                     "num_requests = 5 exceeds the plan's limits.max_requests = 4");
  b = good;
  b.query_start = nullptr;
  EXPECT_ERROR_NAMES(run(b, ext, ws.p, ws.size, out.data(), &c0), "query_start is null");
  b = good;
  b.q = nullptr;
  EXPECT_ERROR_NAMES(run(b, ext, ws.p, ws.size, out.data(), &c0), "q is null");
  PrefillExtents e = ext;
  e.rows = 1001;
  EXPECT_ERROR_NAMES(run(good, e, ws.p, ws.size, out.data(), &c0), "extents.rows = 1001", "limits.max_rows = 1000");
  e.rows = ext.rows - 1;
  EXPECT_ERROR_NAMES(run(good, e, ws.p, ws.size, out.data(), &c0), "extents.rows", "query_start[num_requests]");
  e = ext;
  e.max_rows_per_request = 0;
  EXPECT_ERROR_NAMES(run(good, e, ws.p, ws.size, out.data(), &c0), "extents.max_rows_per_request = 0");
  e.max_rows_per_request = ext.max_rows_per_request - 1;
  if (e.max_rows_per_request >= 1)
    EXPECT_ERROR_NAMES(run(good, e, ws.p, ws.size, out.data(), &c0), "extents.max_rows_per_request");
  e = ext;
  e.gather_units = -1;
  EXPECT_ERROR_NAMES(run(good, e, ws.p, ws.size, out.data(), &c0), "extents.gather_units = -1");
  EXPECT_EQ(plan.gather_chunks(e), 0);
  EXPECT_ERROR_NAMES(run(good, ext, ws.p, ws.size, nullptr, &c0), "out is null");
  EXPECT_ERROR_NAMES(run(good, ext, ws.p, 8, out.data(), &c0), "workspace_bytes = 8");
  EXPECT_ERROR_NAMES(run(good, ext, ws.p, ws.size, out.data(), nullptr), "comm is null");
  EXPECT_ERROR_NAMES(run(good, ext, ws.p, ws.size, out.data(), &group.comm(1)), "comm is rank 1");
  EXPECT_ERROR_NAMES(plan.run(shards[1], 0, good, ext, ws.p, ws.size, out.data(), &c0), "cache is rank 1");
  // a chunk of no requests, and one of requests without rows (q may then be null), run: every
  // rank still exchanges its record
  std::vector<int32_t> no_rows(s.query_start.size(), 0);
  DevicePrefillBatch empty = good;
  empty.q = nullptr;
  empty.query_start = no_rows.data();
  run_ranks(2, [&](int rank, Communicator& comm) {
    const PrefillPlan p(rc, rank, limits);
    Buffer w(p.workspace_bytes());
    uint32_t status = 9;
    p.run(shards[rank], 0, DevicePrefillBatch{}, PrefillExtents{}, w.p, w.size, nullptr, &comm, &status);
    EXPECT_EQ(status, 0u);
    status = 9;
    p.run(shards[rank], 0, empty, PrefillExtents{}, w.p, w.size, nullptr, &comm, &status);
    EXPECT_EQ(status, 0u);
    EXPECT_EQ(comm.bytes_sent(), 2 * p.exchange_bytes());
  });
}

// local_score: ranks with different chunks get -1 and status 1.
TEST(PlanPrefill, LocalScoreRanksWithDifferentChunksGetMinusOne) {
  const ResolvedConfig rc = make_config(KvDtype::kFp8, 2, 256, true, false, KRounding::kE4m3,
                                        PrefillCp::kLocalScore);
  std::mt19937 rng(8);
  const PrefillSetup s = make_prefill(rng, 4, 256, 0, 4, 3000, 30);
  std::vector<float> keys;
  std::vector<int64_t> slots;
  make_keys(s.req, 9, keys, slots);
  const auto shards = make_shards(KvDtype::kFp8, s.req, 2, keys, slots);
  PrefillSetup s1 = s;  // rank 1: the same rows, one token moved from request 3 to request 0
  ASSERT_LT(s.query_start[1], s.req.seq_lens[0]);
  ASSERT_GT(s.query_start[4] - s.query_start[3], 1);
  for (int i = 1; i <= 3; ++i) s1.query_start[i] += 1;
  const auto ext = prefill_extents(host_prefill(s, 4), 256);
  PrefillLimits limits;
  limits.max_requests = 4;
  limits.max_pages = s.req.max_pages;
  limits.max_rows = ext.rows + 10;
  ASSERT_EQ(prefill_extents(host_prefill(s1, 4), 256).rows, ext.rows);
  run_ranks(2, [&](int rank, Communicator& comm) {
    const PrefillPlan plan(rc, rank, limits);
    Buffer ws(plan.workspace_bytes());
    std::vector<int32_t> out(static_cast<size_t>(ext.rows) * 2 * 16, 5);
    uint32_t status = 0;
    plan.run(shards[rank], 0, device_prefill(rank == 0 ? s : s1), ext, ws.p, ws.size, out.data(), &comm, &status);
    EXPECT_EQ(status, 1u);
    for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], -1) << i;
  });
}

}  // namespace
