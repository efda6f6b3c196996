// indexer_score_precision "fp8_mma" on the GPU (spec/config.md sections 1-2, indexer.md section 3;
// docs/precision.md): the scores against the fp64 reference of the same E4M3 keys and queries
// within the documented bound, on random, wide-range and cancelling data; one form in every
// scorer (head widths of 8 / 16 / 32 query vectors, decode and prefill of the same rows, ICP,
// decode CP, the gather and local_score prefill: the same bits); selections exact on the scores the
// kernel computed; the refusals. The CPU cannot emulate the FP8 tensor cores' accumulation, so
// every bit-for-bit comparison here is between GPU paths, and the CPU checks the bound.
#include "gpu_util.hpp"
#include "indexcp/error.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>

#include "cuda/kernels.cuh"
#include "indexcp/tp_group.hpp"

using namespace gpu;

namespace {

constexpr ScorePrecision kF8 = ScorePrecision::kFp8Mma;

/// The bound docs/precision.md states for a fp8_mma block score s of keys and queries whose fp64
/// score is ref: |s - ref| <= 2^-5 * S + one fp32 rounding of ref, S = the largest sum_d |q_d k_d|
/// among the block's tokens (4 k32 steps x 32 terms, each truncated below the 13th significant bit
/// of its step's largest term, the accumulator included: 4 * 32 * 2^-12 = 2^-5).
double fp8_tol(double bound, double ref) { return std::ldexp(1.0, -5) * bound + std::fabs(ref) * std::ldexp(1.0, -23); }

enum class Data { kRandom, kWideRange, kCancelling, kOutlier };
const char* name_of(Data d) {
  return d == Data::kRandom ? "random" : d == Data::kWideRange ? "wide-range" : d == Data::kCancelling ? "cancelling" : "outlier";
}

struct Scene {
  Requests req;
  std::vector<float> keys;
  std::vector<int64_t> slots;
};

// kWideRange: every key element scaled by 2^e, e uniform in [-8, 8] (NVFP4 groups and E4M3 bytes
// at both ends of their range within one vector). kCancelling: dims (2i, 2i + 1) of a key are
// equal, and the queries below give them opposite signs, so the products nearly cancel.
// kOutlier: one outlier channel per 32 dims in the first k32 step (dims 0, 32, 64, 96: +-16 in the
// keys, 16 in the queries) and small values elsewhere (keys x 1/16), so that the accumulator is
// large before the small products of the later steps arrive (truncated against it).
Scene make_scene(const std::vector<int32_t>& lens, int32_t P, uint32_t seed, Data data) {
  Scene s;
  s.req = make_requests(lens, P, seed);
  make_keys(s.req, seed + 1, s.keys, s.slots);
  std::mt19937 rng(seed + 2);
  if (data == Data::kWideRange)
    for (auto& k : s.keys) k = std::ldexp(k, static_cast<int>(rng() % 17) - 8);
  if (data == Data::kCancelling)
    for (size_t i = 0; i + 1 < s.keys.size(); i += 2) s.keys[i + 1] = s.keys[i];
  if (data == Data::kOutlier)
    for (size_t i = 0; i < s.keys.size(); ++i)
      s.keys[i] = i % 32 == 0 ? ((rng() & 1) ? 16.0f : -16.0f) : s.keys[i] / 16.0f;
  return s;
}

std::vector<uint8_t> make_queries(int64_t rows, int32_t H, uint32_t seed, Data data) {
  auto q = make_q(rows, H, seed);
  std::mt19937 rng(seed + 3);
  if (data == Data::kWideRange)
    for (auto& b : q) b = e4m3_encode(std::ldexp(e4m3_decode(b), static_cast<int>(rng() % 9) - 4));
  if (data == Data::kCancelling)  // q[2i + 1] = -q[2i] (+ a small E4M3 perturbation now and then)
    for (size_t i = 0; i + 1 < q.size(); i += 2) {
      const float v = e4m3_decode(q[i]);
      q[i + 1] = e4m3_encode(-v * (rng() % 8 == 0 ? 1.125f : 1.0f));
    }
  if (data == Data::kOutlier)
    for (size_t i = 0; i < q.size(); i += 32) q[i] = e4m3_encode(16.0f);
  return q;
}

std::vector<float> decode_scores_of(const cuda::DeviceCache& c, const DecodeBatch& b, int32_t h0, int32_t nh,
                                    ScorePrecision prec, KRounding mode = KRounding::kE4m3) {
  const int64_t mb = static_cast<int64_t>(b.max_pages) * c.layout().blocks_per_page();
  DevArr<float> sc(static_cast<size_t>(b.rows()) * nh * mb);
  cuda::decode_scores(c, 0, b, h0, nh, mode, sc.get(), nullptr, true, prec);
  return sc.host();
}

// Whether the GEMM-shaped scorer can run: the build has its sm_90a code and the GPU is compute
// capability 9.0 (launch_score then takes it by default in both modes).
#ifndef INDEXCP_BUILD_SM90A
#define INDEXCP_BUILD_SM90A 0
#endif
bool gemm_scorer_here() {
  int dev = 0, major = 0, minor = 0;
  EXPECT_EQ(cudaGetDevice(&dev), cudaSuccess);
  EXPECT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), cudaSuccess);
  EXPECT_EQ(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), cudaSuccess);
  return INDEXCP_BUILD_SM90A && major == 9 && minor == 0;
}

// A prefill batch over a decode batch's arrays (the same q, block table and seq_lens), with the
// given query_start (device or host, as the batch's other pointers).
PrefillBatch prefill_over(const DecodeBatch& b, const int32_t* query_start) {
  PrefillBatch pb;
  pb.q = b.q;
  pb.heads = b.heads;
  pb.block_table = b.block_table;
  pb.num_requests = b.num_requests;
  pb.max_pages = b.max_pages;
  pb.seq_lens = b.seq_lens;
  pb.query_start = query_start;
  return pb;
}

// The resolved config of a TP group (resolve_config; Error on a refused combination).
ResolvedConfig resolved(KvDtype dt, bool sharding, PrefillCp prefill_cp, ScorePrecision prec, int32_t W, int32_t P,
                        int32_t H, int32_t Q) {
  AttentionConfig ac;
  ac.kv_dtype = dt;
  ac.cache_sharding = sharding;
  ac.prefill_cp = prefill_cp;
  ac.score_precision = prec;
  EngineParams ep;
  ep.tp = W;
  ep.page_size = P;
  ep.heads = H;
  ep.query_len = Q;
  return resolve_config(ac, ep);
}

}  // namespace

// The scores of the mode against the fp64 reference of the same k_hat and queries: within
// fp8_tol everywhere, and (so that the test fails if the mode never ran) different from the fp32
// mode's scores somewhere. The measured largest error / sum |q k| is printed for docs/precision.md.
class GpuFp8MmaScores : public ::testing::TestWithParam<std::tuple<KvDtype, int32_t, Data>> {};

TEST_P(GpuFp8MmaScores, WithinTheDocumentedBoundOfFp64) {
  REQUIRE_GPU();
  const auto [dt, P, data] = GetParam();
  const int32_t H = 4, Q = 4;
  auto s = make_scene({2100, 700, 4100, 130}, P, 90u + P + static_cast<uint32_t>(data), data);
  auto dev = device_shards(dt, s.req, 1, s.keys, s.slots);
  auto host = make_shards(dt, s.req, 1, s.keys, s.slots);
  const int64_t rows = static_cast<int64_t>(s.req.seq_lens.size()) * Q;
  const auto q = make_queries(rows, H, 7u + P, data);
  DevDecode d(s.req, q, H, Q);
  const auto qrows = decode_rows(host_batch(s.req, q, H, Q), s.req.num_pages, P);
  const auto ref = ref_scores(host[0], s.req, qrows, q, H, KRounding::kE4m3);
  const auto f8 = decode_scores_of(dev[0], d.b, 0, H, kF8);
  const auto f32 = decode_scores_of(dev[0], d.b, 0, H, ScorePrecision::kFp32);
  ASSERT_EQ(f8.size(), ref.score.size());
  int64_t checked = 0, differ_from_fp32 = 0, over = 0;
  std::string first;
  std::vector<double> rel;
  for (size_t i = 0; i < f8.size(); ++i) {
    if (std::isinf(ref.score[i])) {
      ASSERT_TRUE(std::isinf(f8[i]) && f8[i] < 0) << "index " << i << ": a score where none is due";
      continue;
    }
    const double err = std::fabs(f8[i] - ref.score[i]);
    if (err > fp8_tol(ref.absmax[i], ref.score[i]) && over++ == 0)
      first = "index " + std::to_string(i) + ": fp8_mma " + std::to_string(f8[i]) + ", fp64 " +
              std::to_string(ref.score[i]) + ", sum|qk| " + std::to_string(ref.absmax[i]);
    rel.push_back(ref.absmax[i] > 0 ? err / ref.absmax[i] : (err > 0 ? INFINITY : 0.0));
    differ_from_fp32 += bits_of({f8[i]})[0] != bits_of({f32[i]})[0];
    ++checked;
  }
  ASSERT_GT(checked, rows * H * 4);
  if (data == Data::kWideRange)  // (the mode ran: on wide ranges its accumulation rounds differently)
    EXPECT_GT(differ_from_fp32, 0) << "fp8_mma scores equal the fp32 mode's everywhere: did the mode run?";
  std::sort(rel.begin(), rel.end());
  std::cout << "[fp8_mma bound] " << to_string(dt) << " P" << P << " " << name_of(data) << ": " << checked
            << " scores, max |err| / sum|qk| = " << rel.back() << ", p99 = " << rel[rel.size() * 99 / 100]
            << ", differ from fp32 mode: " << differ_from_fp32 << "\n";
  EXPECT_EQ(over, 0) << over << " scores outside 2^-5 sum|qk| (" << name_of(data) << "); first at " << first;
}

INSTANTIATE_TEST_SUITE_P(All, GpuFp8MmaScores,
                         ::testing::Combine(::testing::Values(KvDtype::kNvfp4, KvDtype::kFp8), ::testing::Values(128, 256),
                                            ::testing::Values(Data::kRandom, Data::kWideRange, Data::kCancelling,
                                                              Data::kOutlier)));

// One form in every scorer: the heads scored 1, 2 and 4 at a time (8, 16, 32 query vectors per CTA; 16 to 128 with Q = 16 and 8 heads),
// on replicated caches and on shards (general scorer), give the same bits; decode and prefill of
// the same rows give the same bits (in the fp32 mode too); ICP and decode CP equal replicated; the selection equals the
// CPU's select_topk on the kernel's own scores.
class GpuFp8MmaForm : public ::testing::TestWithParam<std::tuple<KvDtype, int32_t, int32_t>> {};

TEST_P(GpuFp8MmaForm, EveryScorerGivesTheSameBits) {
  REQUIRE_GPU();
  const auto [dt, P, W] = GetParam();
  const int32_t H = 4, Q = 8;
  auto s = make_scene({5000, 129, 0, 3100, 640}, P, 40u + P + W, Data::kRandom);
  auto repl = device_shards(dt, s.req, 1, s.keys, s.slots);
  auto shards = device_shards(dt, s.req, W, s.keys, s.slots);
  const int64_t rows = static_cast<int64_t>(s.req.seq_lens.size()) * Q;
  const auto q = make_q(rows, H, 11u + W);
  DevDecode d(s.req, q, H, Q);
  const int64_t mb = static_cast<int64_t>(s.req.max_pages) * P / 128;

  // head widths, replicated and on rank 0's shard: with Q = 8 rows per request and 4 heads 8, 16
  // and 32 vectors per CTA; with Q = 16 and 8 heads 16 .. 128 (the wide tiles m64n64 and m64n128
  // that the prefill uses): the same heads get the same bits
  for (const auto [Qw, Hw] : {std::pair<int32_t, int32_t>{Q, H}, {16, 8}}) {
    const int64_t rows_w = static_cast<int64_t>(s.req.seq_lens.size()) * Qw;
    const auto q_w = make_q(rows_w, Hw, 11u + W + (Qw == Q ? 0 : 2));
    DevDecode d_w(s.req, q_w, Hw, Qw);
    for (const cuda::DeviceCache* c : {&repl[0], &shards[0]}) {
      const auto all = bits_of(decode_scores_of(*c, d_w.b, 0, Hw, kF8));
      for (int32_t nh = 1; nh < Hw; nh *= 2)
        for (int32_t h0 = 0; h0 < Hw; h0 += nh) {
          const auto part = bits_of(decode_scores_of(*c, d_w.b, h0, nh, kF8));
          int64_t differ = 0;
          for (int64_t r = 0; r < rows_w; ++r)
            for (int32_t hh = 0; hh < nh; ++hh)
              for (int64_t b = 0; b < mb; ++b) differ += part[(r * nh + hh) * mb + b] != all[(r * Hw + h0 + hh) * mb + b];
          EXPECT_EQ(differ, 0) << (c == &repl[0] ? "replicated" : "shard") << ", Q " << Qw << ": heads " << h0 << ".."
                               << h0 + nh - 1 << " scored " << nh << " at a time differ from all " << Hw << " at once";
        }
    }
  }

  // decode and prefill of the same rows, in both modes: query_start in steps of Q, the same
  // seq_lens and q
  for (const ScorePrecision prec : {kF8, ScorePrecision::kFp32}) {
    const auto dec = bits_of(decode_scores_of(repl[0], d.b, 0, H, prec));
    std::vector<int32_t> qs(s.req.seq_lens.size() + 1);
    for (size_t b = 0; b <= s.req.seq_lens.size(); ++b) qs[b] = static_cast<int32_t>(b) * Q;
    DevArr<int32_t> dqs(qs);
    const PrefillBatch pb = prefill_over(d.b, dqs.get());
    DevArr<float> ps(static_cast<size_t>(rows) * H * mb);
    cuda::prefill_scores(repl[0], 0, pb, rows, Q, 0, H, ps.get(), nullptr, prec);
    CUDA_OK(cudaDeviceSynchronize());
    const auto pre = bits_of(ps.host());
    int64_t differ = 0;
    for (size_t i = 0; i < pre.size(); ++i) differ += pre[i] != dec[i];
    EXPECT_EQ(differ, 0) << "prefill scores of the decode rows differ from the decode scores (" << to_string(prec) << ")";
  }

  // selections: exact on the kernel's scores, and ICP / decode CP equal replicated
  const SelectionParams sel;
  const size_t n = static_cast<size_t>(rows) * H * sel.topk;
  DevArr<int32_t> o_rep(n);
  cuda::decode_select(repl[0], 0, d.b, 0, H, sel, KRounding::kE4m3, o_rep.get(), nullptr, true, kF8);
  const auto r = o_rep.host();
  {
    BlockScores bs;
    bs.rows = rows;
    bs.heads = H;
    bs.max_blocks = mb;
    bs.score = decode_scores_of(repl[0], d.b, 0, H, kF8);
    bs.valid.assign(bs.score.size(), 1);
    std::vector<int32_t> cpu(n);
    select_topk(bs, decode_rows(host_batch(s.req, q, H, Q), s.req.num_pages, P), sel, cpu.data());
    EXPECT_EQ(r, cpu) << "the GPU selection differs from select_topk on the GPU's own fp8_mma scores";
  }
  const cuda::DecodeShape shape = decode_shape(d.b.num_requests, s.req.max_pages, Q, H, KRounding::kE4m3, kF8);
  std::vector<const cuda::DeviceCache*> cs;
  for (auto& c : shards) cs.push_back(&c);
  DevArr<int32_t> o_icp(n), o_cp(n), o_step(n);
  o_icp.fill_bytes(0x7f);
  o_cp.fill_bytes(0x7f);
  cuda::DecodeStep(cs, W, 0, shape, cuda::DecodePath::kIcp).run(d.b, o_icp.get(), nullptr);
  cuda::DecodeStep({&repl[0]}, W, 0, shape, cuda::DecodePath::kDecodeCp).run(d.b, o_cp.get(), nullptr);
  cuda::DecodeStep({&repl[0]}, W, 0, shape, cuda::DecodePath::kReplicated).run(d.b, o_step.get(), nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(o_icp.host(), r) << "ICP differs from replicated (fp8_mma)";
  EXPECT_EQ(o_cp.host(), r) << "decode CP differs from replicated (fp8_mma)";
  EXPECT_EQ(o_step.host(), r) << "the replicated DecodeStep differs from decode_select (fp8_mma)";
}

INSTANTIATE_TEST_SUITE_P(All, GpuFp8MmaForm,
                         ::testing::Values(std::make_tuple(KvDtype::kNvfp4, 128, 2), std::make_tuple(KvDtype::kNvfp4, 128, 4),
                                           std::make_tuple(KvDtype::kNvfp4, 256, 2), std::make_tuple(KvDtype::kNvfp4, 256, 8),
                                           std::make_tuple(KvDtype::kFp8, 128, 2), std::make_tuple(KvDtype::kFp8, 256, 4)));

// The gather and local_score prefill in fp8_mma mode equal the replicated prefill of the mode bit
// for bit (the gather scores the shards' rows staged to FP8: the same E4M3 bytes, the same form).
TEST(GpuFp8Mma, GatherAndLocalScorePrefillEqualReplicated) {
  REQUIRE_GPU();
  for (int32_t P : {128, 256})
    for (int32_t W : {2, 4})
      for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8}) {
        auto s = prefill_scene(P, 61u + W, false);
        auto repl = device_shards(dt, s.req, 1, s.keys, s.slots);
        auto shards = device_shards(dt, s.req, W, s.keys, s.slots);
        DevPrefill d(s);
        const SelectionParams sel;
        const int64_t rows = s.qs.back();
        DevArr<int32_t> ref(static_cast<size_t>(rows) * s.heads * sel.topk);
        cuda::prefill_select(repl[0], 0, d.b, 0, s.heads, sel, ref.get(), nullptr, kF8);
        const auto r = ref.host();
        const int64_t unit = gather_unit_bytes(shards[0].layout());
        for (const bool gather : {true, false}) {
          std::vector<std::vector<int32_t>> per(W);
          cuda::run_device_ranks(W, [&](int rank, Communicator& comm, cuda::Stream st) {
            int32_t h0, nh;
            owned_heads(s.heads, W, rank, &h0, &nh);
            DevArr<int32_t> o(static_cast<size_t>(rows) * nh * sel.topk);
            if (gather) cuda::prefill_gather(comm, shards[rank], 0, d.b, sel, unit * 3, o.get(), st, kF8);
            else cuda::prefill_local_score(comm, shards[rank], 0, d.b, sel, o.get(), st, kF8);
            per[rank] = o.host();
          });
          for (int32_t rank = 0; rank < W; ++rank) {
            int32_t h0, nh;
            owned_heads(s.heads, W, rank, &h0, &nh);
            for (int64_t row = 0; row < rows; ++row)
              for (int32_t hh = 0; hh < nh; ++hh)
                for (int k = 0; k < sel.topk; ++k)
                  ASSERT_EQ(per[rank][(row * nh + hh) * sel.topk + k], r[(row * s.heads + h0 + hh) * sel.topk + k])
                      << (gather ? "gather" : "local_score") << " " << to_string(dt) << " P" << P << " W" << W
                      << " rank " << rank << " row " << row;
          }
        }
      }
}

// The GEMM-shaped scorer of E4M3 keys (src/cuda/score/gemm8.cuh: 256 query vectors per CTA; in
// fp8_mma FP8 keys copied straight into the wgmma operand or NVFP4 keys expanded into it, the
// queries as A; in fp32 keys and queries converted to fp16 in shared memory) gives the bits of
// the tile scorer (score_kernel) in both modes for every entry of prefill_scores on FP8 and
// NVFP4 caches of P = 128 and 256 (the gather's staged rows:
// GatherAndLocalScorePrefillEqualReplicated): random data, 5 requests (one of 700 rows, whose
// slices end on every side of a block boundary, one empty), 4 and 2 heads (2,800 and 1,400 vectors:
// the last CTA of a request half or wholly past its vectors), the first request alone with one head
// (130 vectors: one CTA, half of it past them), the in-CTA and the global work plan,
// the persistent grid (a CTA's share crosses slices: 1 CTA for all, 3, or one per multiprocessor;
// with the producer, the first two segments planned in the prologue and the rest at a CTA barrier,
// or, INDEXCP_SCORE_G8_PLAN_AHEAD=0, every one at a barrier) and
// the grid of CTAs per slice (1 or 3 per slice, or the default), and NVFP4 scale bytes with the sign bit
// set (the default launch); and it is the kernel that ran (by default in both modes; compute
// capability 9.0, a build with sm_90a code). In fp8_mma both forms: with the producer warpgroup (the
// default: a third warpgroup fills the stages) and without it (INDEXCP_SCORE_G8_PRODUCER=0).
TEST(GpuFp8Mma, GemmScorerEqualsTheTileScorer) {
  REQUIRE_GPU();
  const bool sm90a = gemm_scorer_here();
  for (const ScorePrecision prec : {kF8, ScorePrecision::kFp32})
  for (KvDtype dt : {KvDtype::kFp8, KvDtype::kNvfp4})
  for (int32_t P : {128, 256})
  for (const bool neg : {false, true}) {
    if (neg && dt != KvDtype::kNvfp4) continue;
    auto s = prefill_scene(P, 91u + P, false);
    std::vector<cuda::DeviceCache> dev_c;
    if (!neg) {
      dev_c = device_shards(dt, s.req, 1, s.keys, s.slots);
    } else {  // NVFP4 scale bytes with the sign bit set (as in GpuNegScale): one (token, group) in five
      auto host = make_shards(dt, s.req, 1, s.keys, s.slots);
      const PageLayout& L = host[0].layout();
      for (int64_t page = 0; page < host[0].num_pages(); ++page)
        for (int32_t j = 0; j < L.rows(); ++j)
          for (int gi = 0; gi < 8; ++gi)
            if (((page * P + j) * 8 + gi) * 2654435761u % 5 == 0) host[0].page_ptr(0, page)[L.row_scale_offset(j) + gi] ^= 0x80;
      dev_c.emplace_back(L, host[0].num_pages(), 1, 0);
      dev_c[0].upload(host[0]);
    }
    DevPrefill d(s);
    const int64_t mb = static_cast<int64_t>(s.req.max_pages) * P / 128;
    struct Case {
      int32_t h0, nh, nreq;
    };
    for (const Case c : {Case{0, 4, 5}, Case{1, 2, 5}, Case{2, 1, 1}})
      for (const char* plan : {"", "kernel"})
        for (const char* ctas : {"", "1", "3"})
          for (const char* persist : {"", "0"})
          for (const char* ahead : {"", "0"}) {
            if ((neg || c.nreq == 1) && (*plan || *ctas || *persist || *ahead)) continue;  // the default launch only
            if (*ahead && (*plan || *persist || prec != kF8)) continue;  // (the persistent in-CTA plan's, fp8_mma's producer form)
            const int32_t h0 = c.h0, nh = c.nh;
            PrefillBatch batch = d.b;
            batch.num_requests = c.nreq;
            int32_t max_rows = 1;
            for (int32_t b = 0; b < c.nreq; ++b) max_rows = std::max(max_rows, s.qs[b + 1] - s.qs[b]);
            const int64_t nrows = s.qs[c.nreq];
            const char* knob = prec == kF8 ? "INDEXCP_SCORE_GEMM8" : "INDEXCP_SCORE_GEMM16";
            ScopedEnv gemm_env(knob), plan_env("INDEXCP_SCORE_PLAN"), ctas_env("INDEXCP_SCORE_CTAS"),
                persist_env("INDEXCP_SCORE_G8_PERSISTENT"), ahead_env("INDEXCP_SCORE_G8_PLAN_AHEAD");
            plan_env.set(plan);
            ctas_env.set(ctas);
            persist_env.set(persist);
            ahead_env.set(ahead);
            const std::string where = std::string(prec == kF8 ? "fp8_mma " : "fp32 ") + to_string(dt) + " P" +
                                      std::to_string(P) + " heads " + std::to_string(h0) + ".." +
                                      std::to_string(h0 + nh - 1) + " requests " + std::to_string(c.nreq) + " plan '" +
                                      plan + "' ctas '" + ctas + "' persistent '" + persist + "' plan ahead '" +
                                      ahead + "'" +
                                      (neg ? " negative scales" : "");
            DevArr<float> out(static_cast<size_t>(nrows) * nh * mb);
            // run 0: the GEMM-shaped scorer (the default: in fp8_mma with its producer warpgroup), 1:
            // the tile scorer, 2 (fp8_mma): the GEMM-shaped scorer without the producer warpgroup
            // (INDEXCP_SCORE_G8_PRODUCER=0)
            ScopedEnv prod_env("INDEXCP_SCORE_G8_PRODUCER");
            std::vector<uint32_t> got[3];
            const int runs = prec == kF8 ? 3 : 2;
            for (int run = 0; run < runs; ++run) {
              const bool tiles = run == 1;
              gemm_env.set(tiles ? "0" : "");  // the default in both modes
              prod_env.set(run == 2 ? "0" : "");
              out.fill_bytes(0x7f);  // (prefill_scores writes -inf where the scorer writes nothing)
              cuda::prefill_scores(dev_c[0], 0, batch, nrows, max_rows, h0, nh, out.get(), nullptr, prec);
              const std::string ran = cuda::detail::last_score_kernel();
              CUDA_OK(cudaDeviceSynchronize());
              EXPECT_EQ(ran, tiles || !sm90a ? "tiles" : prec != kF8 ? "gemm16" : run == 2 ? "gemm8" : "gemm8p")
                  << where << " run " << run;
              got[run] = bits_of(out.host());
              int64_t unwritten = 0;
              for (const uint32_t x : got[run]) unwritten += x == 0x7f7f7f7fu;
              EXPECT_EQ(unwritten, 0) << where << " run " << run << ": entries neither scored nor filled";
            }
            for (int run = 0; run < runs; run += 2) {
              int64_t differ = 0, scored = 0;
              for (size_t i = 0; i < got[run].size(); ++i) {
                differ += got[run][i] != got[1][i];
                scored += got[run][i] != 0xff800000u;  // not -inf
              }
              EXPECT_EQ(differ, 0) << where << ": the GEMM-shaped scorer" << (run == 2 ? " without its producer warpgroup" : "")
                                   << " differs from the tile scorer";
              EXPECT_GT(scored, c.nreq == 1 ? 100 : 1000) << where << " run " << run;
            }
          }
  }
}

// The persistent GEMM-shaped scorer's plans at the sizes GemmScorerEqualsTheTileScorer does not
// reach (fp8_mma, NVFP4 P128, the producer form, 2 of 4 heads): batches of 385 and 1,024 requests
// (the prologue's plan of two slices at once, plan_block2, in 2 and 3 passes of the CTA's 384
// threads; 1,024 is the most whose second plan fits the table), 1,025 (no second plan: the barrier
// at the second segment), each request 130 rows (260 vectors: a share of the grid crosses from
// slice 0 into slice 1, and at 1 CTA one share takes both), and one request of 49,200 rows (385
// slices: the share is found in more than one scan of the CTA's threads). Each run (the default
// grid, 1 CTA, and INDEXCP_SCORE_G8_PLAN_AHEAD=0) gives the tile scorer's bits for every entry.
TEST(GpuFp8Mma, GemmScorerPlansManyRequestsAndSlices) {
  REQUIRE_GPU();
  if (!gemm_scorer_here()) GTEST_SKIP() << "the GEMM-shaped scorer needs compute capability 9.0 and sm_90a code";
  const int32_t P = 128, h0 = 1, nh = 2;  // (of the scene's 4 heads)
  struct Case {
    int32_t nreq, rows, seq;
  };
  for (const Case c : {Case{385, 130, 200}, Case{1024, 130, 200}, Case{1025, 130, 200}, Case{1, 49200, 49200}}) {
    PrefillScene s;
    s.req = make_requests(std::vector<int32_t>(static_cast<size_t>(c.nreq), c.seq), P, 7u + static_cast<uint32_t>(c.nreq));
    make_keys(s.req, 8u + static_cast<uint32_t>(c.nreq), s.keys, s.slots);
    auto dev = device_shards(KvDtype::kNvfp4, s.req, 1, s.keys, s.slots);
    s.qs.resize(static_cast<size_t>(c.nreq) + 1);
    for (int32_t b = 0; b <= c.nreq; ++b) s.qs[static_cast<size_t>(b)] = b * c.rows;  // each request's last rows
    const int64_t nrows = s.qs.back();
    s.q = make_q(nrows, s.heads, 9u + static_cast<uint32_t>(c.nreq));
    const DevPrefill d(s);
    const PrefillBatch& batch = d.b;
    const int64_t mb = static_cast<int64_t>(s.req.max_pages) * P / 128;
    DevArr<float> out(static_cast<size_t>(nrows) * nh * mb);
    ScopedEnv gemm_env("INDEXCP_SCORE_GEMM8"), ctas_env("INDEXCP_SCORE_CTAS"), ahead_env("INDEXCP_SCORE_G8_PLAN_AHEAD");
    auto run = [&](const char* gemm, const char* ctas, const char* ahead) {
      gemm_env.set(gemm);
      ctas_env.set(ctas);
      ahead_env.set(ahead);
      out.fill_bytes(0x7f);
      cuda::prefill_scores(dev[0], 0, batch, nrows, c.rows, h0, nh, out.get(), nullptr, kF8);
      const std::string ran = cuda::detail::last_score_kernel();
      const cudaError_t e = cudaDeviceSynchronize();
      EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
      EXPECT_EQ(ran, std::strcmp(gemm, "0") == 0 ? "tiles" : "gemm8p") << c.nreq << " requests";
      return bits_of(out.host());
    };
    const std::vector<uint32_t> tiles = run("0", "", "");
    int64_t scored = 0;
    for (const uint32_t x : tiles) scored += x != 0xff800000u && x != 0x7f7f7f7fu;  // neither -inf nor unwritten
    EXPECT_GT(scored, static_cast<int64_t>(c.nreq) * 100) << c.nreq << " requests";
    for (const auto& [ctas, ahead] : std::vector<std::pair<const char*, const char*>>{{"", ""}, {"1", ""}, {"", "0"}, {"1", "0"}}) {
      const std::vector<uint32_t> got = run("", ctas, ahead);
      int64_t differ = 0;
      for (size_t i = 0; i < got.size(); ++i) differ += got[i] != tiles[i];
      EXPECT_EQ(differ, 0) << c.nreq << " requests of " << c.rows << " rows, ctas '" << ctas << "' plan ahead '" << ahead
                           << "': the GEMM-shaped scorer differs from the tile scorer";
    }
  }
}

// Decode rows reach the GEMM-shaped scorer too where a request has more than 128 query vectors
// (query_len 16 x 16 heads = 256: one query slice), in both modes, and give the tile scorer's
// bits: decode_scores (rows at different positions of their request) and the decode CP path (a
// block filter: each rank scores blocks b % 2 == rank of the replicated cache), FP8 and NVFP4
// caches, P = 128 and 256.
TEST(GpuFp8Mma, GemmScorerTakesDecodeRowsWithTheTilesBits) {
  REQUIRE_GPU();
  const bool sm90a = gemm_scorer_here();
  const int32_t H = 16, Q = 16, W = 2;
  for (const ScorePrecision prec : {kF8, ScorePrecision::kFp32})
    for (KvDtype dt : {KvDtype::kFp8, KvDtype::kNvfp4})
      for (int32_t P : {128, 256}) {
        auto s = make_scene({3000, 129, 0, 700}, P, 70u + P, Data::kRandom);
        auto repl = device_shards(dt, s.req, 1, s.keys, s.slots);
        const int32_t B = static_cast<int32_t>(s.req.seq_lens.size());
        const auto q = make_q(static_cast<int64_t>(B) * Q, H, 71u);
        DevDecode d(s.req, q, H, Q);
        const cuda::DecodeShape shape = decode_shape(B, s.req.max_pages, Q, H, KRounding::kE4m3, prec);
        const std::string where = std::string(prec == kF8 ? "fp8_mma " : "fp32 ") + to_string(dt) + " P" + std::to_string(P);
        // (fp8_mma: the producer form unless INDEXCP_SCORE_G8_PRODUCER=0, as the ctest entry
        // GpuScoreG8.no_producer runs it)
        const char* prod = std::getenv("INDEXCP_SCORE_G8_PRODUCER");
        const std::string gemm = prec != kF8 ? "gemm16" : prod != nullptr && std::string(prod) == "0" ? "gemm8" : "gemm8p";
        ScopedEnv knob(prec == kF8 ? "INDEXCP_SCORE_GEMM8" : "INDEXCP_SCORE_GEMM16");
        std::vector<uint32_t> sc[2];
        std::vector<int32_t> cp[2];
        for (int tiles = 0; tiles < 2; ++tiles) {
          knob.set(tiles ? "0" : "");  // the default in both modes
          sc[tiles] = bits_of(decode_scores_of(repl[0], d.b, 0, H, prec));
          EXPECT_EQ(std::string(cuda::detail::last_score_kernel()), !tiles && sm90a ? gemm : "tiles") << where;
          DevArr<int32_t> out(static_cast<size_t>(B) * Q * H * shape.sel.topk);
          out.fill_bytes(0x7f);
          cuda::DecodeStep step({&repl[0]}, W, 0, shape, cuda::DecodePath::kDecodeCp);
          step.run(d.b, out.get(), nullptr);
          CUDA_OK(cudaDeviceSynchronize());
          EXPECT_EQ(std::string(cuda::detail::last_score_kernel()), !tiles && sm90a ? gemm : "tiles") << where << " decode CP";
          cp[tiles] = out.host();
        }
        int64_t differ = 0, scored = 0;
        for (size_t i = 0; i < sc[0].size(); ++i) {
          differ += sc[0][i] != sc[1][i];
          scored += sc[0][i] != 0xff800000u;
        }
        EXPECT_EQ(differ, 0) << where << ": decode scores of the GEMM-shaped scorer differ from the tile scorer's";
        EXPECT_GT(scored, 1000) << where;
        EXPECT_EQ(cp[0], cp[1]) << where << ": decode CP selections differ";
      }
}

// The plans made from a resolved config carry the mode (DecodePlan, PrefillPlan through the CUDA
// TpIndexer) and the refusals name indexer_score_precision; a refused call writes nothing.
TEST(GpuFp8Mma, ConfigReachesThePlansAndBadModesAreRefused) {
  REQUIRE_GPU();
  const int32_t P = 128, W = 2, H = 4, Q = 4;
  auto s = make_scene({3000, 700}, P, 5u, Data::kRandom);
  auto repl = device_shards(KvDtype::kNvfp4, s.req, 1, s.keys, s.slots);
  const int64_t rows = static_cast<int64_t>(s.req.seq_lens.size()) * Q;
  const auto q = make_q(rows, H, 6u);
  DevDecode d(s.req, q, H, Q);
  const SelectionParams sel;
  const ResolvedConfig rc = resolved(KvDtype::kNvfp4, true, PrefillCp::kGather, kF8, W, P, H, Q);
  // the CUDA TpIndexer (plans from rc) against decode_select in the mode, and the fp32 mode
  auto ix = make_tp_indexer("cuda", rc, s.req.num_pages);
  std::vector<float> keys = s.keys;
  ix->insert(keys.data(), s.slots.data(), static_cast<int64_t>(s.slots.size()), 1.0f);
  const auto got = ix->decode(host_batch(s.req, q, H, Q), sel, nullptr);
  DevArr<int32_t> o8(static_cast<size_t>(rows) * H * sel.topk);
  cuda::decode_select(repl[0], 0, d.b, 0, H, sel, KRounding::kE4m3, o8.get(), nullptr, true, kF8);
  EXPECT_EQ(got, o8.host()) << "the TpIndexer's ICP decode (fp8_mma plans) differs from decode_select in the mode";
  // (that the mode, not fp32, reached every path is pinned by GpuFp8Mma.EveryPathSelectsWhatItsModeScores)
  // refusals: exact rounding with fp8_mma on NVFP4, a precision that is no enumerator
  const int64_t mb = static_cast<int64_t>(s.req.max_pages) * P / 128;
  DevArr<float> sc(static_cast<size_t>(rows) * H * mb);
  sc.upload(std::vector<float>(sc.size(), 7.0f));
  auto refused = [&](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "accepted; expected an error naming " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused([&] { cuda::decode_scores(repl[0], 0, d.b, 0, H, KRounding::kExact, sc.get(), nullptr, true, kF8); },
          "indexer_score_precision = \"fp8_mma\" with indexer_k_rounding = \"exact\"");
  refused([&] {
    cuda::decode_scores(repl[0], 0, d.b, 0, H, KRounding::kE4m3, sc.get(), nullptr, true, static_cast<ScorePrecision>(5));
  }, "indexer_score_precision = 5");
  refused([&] {  // (query_start is not read: the mode is refused first)
    cuda::prefill_scores(repl[0], 0, prefill_over(d.b, d.b.seq_lens), rows, Q, 0, H, sc.get(), nullptr,
                         static_cast<ScorePrecision>(5));
  }, "indexer_score_precision = 5");
  for (float v : sc.host()) ASSERT_EQ(v, 7.0f) << "a refused call wrote its output";
  const cuda::DecodeShape shape = decode_shape(d.b.num_requests, s.req.max_pages, Q, H, KRounding::kExact, kF8);
  refused([&] { cuda::DecodeStep({&repl[0]}, W, 0, shape, cuda::DecodePath::kReplicated); }, "indexer_k_rounding");
  // an FP8 cache ignores the rounding (a note in the config): fp8_mma with kExact is accepted there
  auto f8c = device_shards(KvDtype::kFp8, s.req, 1, s.keys, s.slots);
  DevArr<float> sf(sc.size());
  EXPECT_NO_THROW(cuda::decode_scores(f8c[0], 0, d.b, 0, H, KRounding::kExact, sf.get(), nullptr, true, kF8));
}

// Keys and queries built so that the two modes must select different blocks, which pins that the
// mode reaches every path (a path that silently scored in fp32 would select the other block):
// block 0's tokens score 256 + 96 x 2^-6 = 257.5 (one product of 256 in the first k32 step, the
// small ones in the other three, truncated against the accumulator of 256 on the FP8 tensor
// cores: 256.0), block 1's 256 + 1 = 257.0 in both modes (all in the first step), block 2's 0.
// With top-2 (the query's own block forced) the fp32 mode picks block 0 and fp8_mma block 1, on
// the free functions, DecodeStep (replicated, ICP, decode CP) and the TpIndexer's plans from a
// resolved config (decode: ICP; prefill: gather, local_score, replicated).
TEST(GpuFp8Mma, EveryPathSelectsWhatItsModeScores) {
  REQUIRE_GPU();
  const int32_t P = 128, W = 2, H = 2, L = 3 * 128 + 1;
  auto req = make_requests({L}, P, 3u);
  std::vector<float> keys;
  std::vector<int64_t> slots;
  for (int32_t p = 0; p < L; ++p) {
    const int32_t blk = p / 128;
    for (int dd = 0; dd < 128; ++dd) {
      const bool step0 = (dd % 32) / 8 == 0;  // form8_dim: the first k32 step holds dims 32 j + 0..7
      float v = 0.0f;
      if (blk == 0) v = dd == 0 ? 16.0f : (step0 ? 0.0f : 0.125f);
      if (blk == 1) v = dd == 0 ? 16.0f : (dd == 1 ? 8.0f : 0.0f);
      keys.push_back(v);
    }
    slots.push_back(req.slot(0, p));
  }
  std::vector<uint8_t> q(static_cast<size_t>(H) * 128);
  for (int32_t h = 0; h < H; ++h)
    for (int dd = 0; dd < 128; ++dd) q[h * 128 + dd] = e4m3_encode(dd == 0 ? 16.0f : 0.125f);
  SelectionParams sel;
  sel.topk = 2;
  // [rows = 1, H = 2, K = 2], ascending ids: the chosen block, then the own block 3
  const std::vector<int32_t> pick32 = {0, 3, 0, 3}, pick8 = {1, 3, 1, 3};
  auto dev = device_shards(KvDtype::kFp8, req, 1, keys, slots);
  auto shards = device_shards(KvDtype::kFp8, req, W, keys, slots);
  DevDecode d(req, q, H, 1);
  // the scores themselves: block 0 loses the 1.5 in fp8_mma, within the documented bound
  const auto s32 = decode_scores_of(dev[0], d.b, 0, 1, ScorePrecision::kFp32);
  const auto s8 = decode_scores_of(dev[0], d.b, 0, 1, kF8);
  ASSERT_GE(s8.size(), 3u);
  EXPECT_EQ(s32[0], 257.5f);
  EXPECT_EQ(s32[1], 257.0f);
  EXPECT_LE(std::fabs(s8[1] - 257.0), fp8_tol(256.0 + 1.0, 257.0));
  EXPECT_LT(s8[0], s8[1]) << "fp8_mma: block 0 scored " << s8[0] << ", block 1 " << s8[1];
  EXPECT_LE(std::fabs(s8[0] - 257.5), fp8_tol(256.0 + 1.5, 257.5));
  std::cout << "[fp8_mma outlier] block 0: fp32 " << s32[0] << ", fp8_mma " << s8[0] << " (err / sum|qk| = "
            << std::fabs(s8[0] - 257.5) / 257.5 << ")\n";
  for (const bool f8 : {false, true}) {
    const ScorePrecision prec = f8 ? kF8 : ScorePrecision::kFp32;
    const auto& want = f8 ? pick8 : pick32;
    const std::string m = f8 ? " (fp8_mma)" : " (fp32)";
    DevArr<int32_t> o(static_cast<size_t>(H) * 2);
    cuda::decode_select(dev[0], 0, d.b, 0, H, sel, KRounding::kE4m3, o.get(), nullptr, true, prec);
    EXPECT_EQ(o.host(), want) << "decode_select" << m;
    cuda::DecodeShape shape = decode_shape(1, req.max_pages, 1, H, KRounding::kE4m3, prec);
    shape.sel = sel;
    std::vector<const cuda::DeviceCache*> cs = {&shards[0], &shards[1]};
    for (const auto path : {cuda::DecodePath::kReplicated, cuda::DecodePath::kIcp, cuda::DecodePath::kDecodeCp}) {
      DevArr<int32_t> os(static_cast<size_t>(H) * 2);
      if (path == cuda::DecodePath::kIcp) cuda::DecodeStep(cs, W, 0, shape, path).run(d.b, os.get(), nullptr);
      else cuda::DecodeStep({&dev[0]}, W, 0, shape, path).run(d.b, os.get(), nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      EXPECT_EQ(os.host(), want) << "DecodeStep path " << static_cast<int>(path) << m;
    }
    // the TpIndexer's plans from a resolved config: decode (ICP) and the three prefill paths
    for (const char* cp : {"gather", "local_score", "off"}) {
      const ResolvedConfig rc = resolved(KvDtype::kFp8, std::string(cp) != "off",
                                         std::string(cp) == "local_score" ? PrefillCp::kLocalScore : PrefillCp::kGather,
                                         prec, W, P, H, 1);
      auto ix = make_tp_indexer("cuda", rc, req.num_pages);
      ix->insert(keys.data(), slots.data(), static_cast<int64_t>(slots.size()), 1.0f);
      EXPECT_EQ(ix->decode(host_batch(req, q, H, 1), sel, nullptr), want)
          << "TpIndexer decode, prefill_cp " << cp << m;
      const std::vector<int32_t> qs = {0, 1};
      const PrefillBatch pb = prefill_over(host_batch(req, q, H, 1), qs.data());
      EXPECT_EQ(ix->prefill(pb, sel, nullptr), want) << "TpIndexer prefill " << cp << m;
    }
  }
}
