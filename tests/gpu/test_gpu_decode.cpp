// GPU decode: scores against an fp64 reference of the dequantized keys, selections against the
// CPU (identical, or near ties), exact selection on the GPU's own scores, sharded == replicated
// bit for bit at every (P, W), cases C03, C04, C05, C08, C09, C10, and CUDA-graph replay.
#include "gpu_util.hpp"
#include "indexcp/error.hpp"

#include <cstdlib>
#include <limits>

#include "cuda/kernels.cuh"

using namespace gpu;

namespace {

struct Scene {
  Requests req;
  std::vector<float> keys;
  std::vector<int64_t> slots;
};

Scene scene(const std::vector<int32_t>& lens, int32_t P, uint32_t seed, bool exact = false) {
  Scene s;
  s.req = make_requests(lens, P, seed);
  if (exact) exact_keys(s.req, seed + 1, s.keys, s.slots);
  else make_keys(s.req, seed + 1, s.keys, s.slots);
  return s;
}

// Selection computed on the host (CPU select_topk) from the GPU's own scores: the GPU's
// selection kernels must reproduce it exactly (no approximation anywhere).
std::vector<int32_t> select_from_scores(const std::vector<float>& sc, const std::vector<QueryRow>& rows, int32_t nh,
                                        int64_t max_blocks, const SelectionParams& sel) {
  BlockScores bs;
  bs.rows = static_cast<int64_t>(rows.size());
  bs.heads = nh;
  bs.max_blocks = max_blocks;
  bs.score = sc;
  bs.valid.assign(sc.size(), 1);
  std::vector<int32_t> out(rows.size() * nh * sel.topk);
  select_topk(bs, rows, sel, out.data());
  return out;
}

// One decode step (DecodeStep, one stream) over `caches` (one per rank, or one replicated
// cache): the selections on the host, int32 [rows, heads, K]. *stock, when given, is whether
// rank 0 used the stock scorer.
std::vector<int32_t> step_selections(const std::vector<cuda::DeviceCache>& caches, int32_t W,
                                     const cuda::DecodeShape& shape, cuda::DecodePath path, const DecodeBatch& b,
                                     bool p256_stock = true, bool* stock = nullptr) {
  std::vector<const cuda::DeviceCache*> cs;
  for (const auto& c : caches) cs.push_back(&c);
  DevArr<int32_t> out(static_cast<size_t>(b.rows()) * b.heads * shape.sel.topk);
  out.fill_bytes(0x7f);
  cuda::DecodeStep step(cs, W, 0, shape, path, p256_stock);
  if (stock != nullptr) *stock = step.uses_stock_scorer(0);
  step.run(b, out.get(), nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return out.host();
}

}  // namespace

class GpuDecode : public ::testing::TestWithParam<std::tuple<KvDtype, int32_t, int32_t, int32_t, KRounding>> {};

TEST_P(GpuDecode, ScoresWithinToleranceAndSelectionsMatch) {
  REQUIRE_GPU();
  const auto [dt, P, Q, H, mode] = GetParam();
  auto s = scene({2100, 0, 300, 4000, 17}, P, 11u + P + Q + H);
  auto host = make_shards(dt, s.req, 1, s.keys, s.slots);
  auto dev = device_shards(dt, s.req, 1, s.keys, s.slots);
  const int64_t rows = static_cast<int64_t>(s.req.seq_lens.size()) * Q;
  const auto q = make_q(rows, H, 99u + H);
  DevDecode d(s.req, q, H, Q);
  const DecodeBatch hb = host_batch(s.req, q, H, Q);
  const auto qrows = decode_rows(hb, s.req.num_pages, P);
  SelectionParams sel;
  const int64_t mb = static_cast<int64_t>(s.req.max_pages) * P / 128;
  // scores
  DevArr<float> sc(static_cast<size_t>(rows) * H * mb);
  cuda::decode_scores(dev[0], 0, d.b, 0, H, mode, sc.get(), nullptr);
  const auto gs = sc.host();
  const auto ref = ref_scores(host[0], s.req, qrows, q, H, mode);
  int64_t checked = 0;
  double worst = 0;
  for (size_t i = 0; i < gs.size(); ++i) {
    if (std::isinf(ref.score[i])) {
      ASSERT_TRUE(std::isinf(gs[i]) && gs[i] < 0) << "a score exists where none should, index " << i;
      continue;
    }
    const double tol = score_tol(ref.absmax[i], ref.score[i]);
    ASSERT_LE(std::fabs(gs[i] - ref.score[i]), tol) << "score " << i << " gpu " << gs[i] << " ref " << ref.score[i];
    worst = std::max(worst, std::fabs(gs[i] - ref.score[i]) / std::max(1e-30, ref.absmax[i]));
    ++checked;
  }
  EXPECT_GT(checked, 0);
  RecordProperty("worst_relative_error", std::to_string(worst));
  // selections, all heads and a head range
  DevArr<int32_t> out(static_cast<size_t>(rows) * H * sel.topk);
  out.fill_bytes(0x7f);
  cuda::decode_select(dev[0], 0, d.b, 0, H, sel, mode, out.get(), nullptr);
  const auto g = out.host();
  EXPECT_EQ(g, select_from_scores(gs, qrows, H, mb, sel)) << "GPU selection differs from the exact selection of its own scores";
  std::vector<int32_t> cpu(g.size());
  decode_select(host[0], 0, hb, 0, H, sel, mode, cpu.data());
  compare_selections(g, cpu, ref, qrows, H, sel.topk, "decode");
  if (H > 1) {
    DevArr<int32_t> part(static_cast<size_t>(rows) * 1 * sel.topk);
    cuda::decode_select(dev[0], 0, d.b, H - 1, 1, sel, mode, part.get(), nullptr);
    const auto p = part.host();
    for (int64_t r = 0; r < rows; ++r)
      for (int k = 0; k < sel.topk; ++k) ASSERT_EQ(p[r * sel.topk + k], g[(r * H + H - 1) * sel.topk + k]);
  }
}

INSTANTIATE_TEST_SUITE_P(All, GpuDecode,
                         ::testing::Combine(::testing::Values(KvDtype::kNvfp4, KvDtype::kFp8), ::testing::Values(128, 256),
                                            ::testing::Values(1, 8, 16), ::testing::Values(1, 2, 4),
                                            ::testing::Values(KRounding::kE4m3, KRounding::kExact)));

// Keys and queries whose dot products are exact in fp32: GPU selections equal the CPU's exactly,
// ties (frequent with integer data) resolved to the lower block id, for every path.
TEST(GpuDecode, ExactDataSelectionsEqualCpuIncludingTies) {
  REQUIRE_GPU();
  for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8})
    for (int32_t P : {128, 256}) {
      auto s = scene({5000, 2100, 129, 0, 3000}, P, 7u + P, true);
      auto host = make_shards(dt, s.req, 1, s.keys, s.slots);
      auto dev = device_shards(dt, s.req, 1, s.keys, s.slots);
      const int32_t Q = 4, H = 4;
      const int64_t rows = static_cast<int64_t>(s.req.seq_lens.size()) * Q;
      const auto q = int_q(rows, H, 8);
      DevDecode d(s.req, q, H, Q);
      const DecodeBatch hb = host_batch(s.req, q, H, Q);
      for (KRounding mode : {KRounding::kE4m3, KRounding::kExact})
        for (int init : {0, 2}) {
          SelectionParams sel;
          sel.init_blocks = init;
          std::vector<int32_t> cpu(static_cast<size_t>(rows) * H * sel.topk);
          decode_select(host[0], 0, hb, 0, H, sel, mode, cpu.data());
          DevArr<int32_t> out(cpu.size());
          cuda::decode_select(dev[0], 0, d.b, 0, H, sel, mode, out.get(), nullptr);
          EXPECT_EQ(out.host(), cpu) << to_string(dt) << " P" << P << " init " << init;
        }
    }
}

// Block scores that differ by about one part in a million (and exact ties): FP8 keys with
// k[0] = 4, k[1] = e4m3 value v_b, q[0] = 1, q[1] = 2^-9, every other element 0: block b scores
// exactly 4 + v_b * 2^-9 in fp32 on every backend.
TEST(GpuDecode, SelectionIsExactAtOnePartPerMillion) {
  REQUIRE_GPU();
  const int32_t P = 128, nblocks = 300;
  Requests req = make_requests({nblocks * 128 + 5}, P, 3);
  std::mt19937 rng(4);
  std::vector<float> keys;
  std::vector<int64_t> slots;
  for (int64_t p = 0; p < req.seq_lens[0]; ++p) {
    std::vector<float> k(128, 0.0f);
    if (p % 128 == 77) {
      k[0] = 4.0f;
      k[1] = e4m3_decode(static_cast<uint8_t>(1 + rng() % 12));  // 2^-9 .. 1.5 * 2^-7: many ties
    }
    keys.insert(keys.end(), k.begin(), k.end());
    slots.push_back(req.slot(0, p));
  }
  std::vector<uint8_t> q(128, 0);
  q[0] = e4m3_encode(1.0f);
  q[1] = 0x01;  // 2^-9
  auto host = make_shards(KvDtype::kFp8, req, 1, keys, slots);
  SelectionParams sel;
  std::vector<int32_t> cpu(sel.topk);
  const DecodeBatch hb = host_batch(req, q, 1, 1);
  decode_select(host[0], 0, hb, 0, 1, sel, KRounding::kE4m3, cpu.data());
  for (int32_t W : {1, 2, 4}) {
    auto dev = device_shards(KvDtype::kFp8, req, W, keys, slots);
    DevDecode d(req, q, 1, 1);
    if (W == 1) {
      DevArr<int32_t> out(sel.topk);
      cuda::decode_select(dev[0], 0, d.b, 0, 1, sel, KRounding::kE4m3, out.get(), nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      EXPECT_EQ(out.host(), cpu) << "W = 1";
    } else {
      EXPECT_EQ(step_selections(dev, W, decode_shape(1, req.max_pages, 1, 1), cuda::DecodePath::kIcp, d.b), cpu)
          << "W = " << W;
    }
  }
}

// The select kernels on block scores built to break them, against the CPU's select_topk: rows of
// 1 to 512 visible blocks in scores of 512 blocks per row (the warp kernel's 512 instance: the
// trivial rows, its register path up to 256 candidates and the edges, the staged path beyond) and
// of 1 to 1,024 in scores of 1,024 (the 1,024 instance, whose register path takes every row of
// at most 64 survivors and K <= 33);
// scores random, on a few values (plateaus wider than the 64 sorted survivors), all equal,
// ascending, descending, with NaN, -0.0 / +0.0, +-Inf and subnormals, and lane-major ascending
// (block b scores 32 (b % 32) + b / 32: more than 64 keys above the lane maxima's bound, distinct
// at the boundary); K = 2, 8, 16 (0, 1 or 2 forced
// sink blocks), 24 and 33 (23 and 32 ranked slots) and 40 (more than 32: the staged path). Each
// through the warp kernel with the register path on, on in the 512 instance only
// (INDEXCP_SELECT_REGS=512) and off, and the CTA kernel (the instance checked). The entries past
// a row's visible blocks hold +Inf, the highest key, and must not be read: a kernel that read one
// would select it (NaN, the lowest key, would almost never change a selection). The CPU's
// select_topk reads only the candidates init .. local-1, all visible, so the expected selections
// do not depend on them.
// The warp kernel also reports each problem's path (SelectLaunch::paths: a second launch, which
// runs the instance's twin that writes them and must select the same), since a register path
// that always gave up would still select right, only slower: the trivial path for rows of at most
// K visible blocks; the staged path where the register path is off or cannot hold the problem
// (more than 32 kRegKeys candidates: 256 in the 512 instance, 1,024 in the 1,024 one; or more
// than 32 ranked slots); elsewhere the register path or its fallback to the staged path, and
// select_in_registers falls back exactly when more than 64 keys are >= its bound t0, the kk-th
// largest of the 32 lane maxima (kk = K - 1 - init ranked slots). So:
//   - all equal scores (pattern 2): every lane that holds a candidate has the one key as its
//     maximum, and at least kk lanes hold one (nc > kk), so t0 is that key and all nc candidates
//     survive: the register path exactly when nc <= 64, the fallback beyond;
//   - random scores (pattern 0), at most 23 ranked slots (K <= 24): for iid scores, m candidates
//     per lane, a fraction p of the keys lies above t0 where 32 (1 - (1 - p)^m) = kk, so about
//     nc p = -32 ln(1 - kk / 32) survive, whatever the row's length: 20 for kk = 15 (sd below 3),
//     41 for kk = 23 (sd below 6; about 1 row in 5,000 of 1,000 candidates has more than 64, in a
//     simulation), so nearly every such problem must take the register path, and at least 90%
//     leaves room for other draws (this data: all of them, at most 51 survivors). K = 33 (kk =
//     32: t0 is the smallest lane maximum) takes it for a quarter to a half of the rows here, so
//     it is not checked.
TEST(GpuSelect, RowsEqualCpuOnAdversarialScores) {
  REQUIRE_GPU();
  const int32_t nh = 2;
  int64_t checked = 0, expected = 0;
  for (const int64_t max_blocks : {512, 1024}) {  // the warp kernel's 512 and 1,024 instances
    std::vector<int64_t> nvis = {1,   2,   3,   15,  16,  17,  18,  19,  20,  31,  33,  34,  35,  47, 64,
                                 65,  66,  67,  96,  100, 129, 200, 254, 255, 256, 257, 258, 259, 260, 261,
                                 262, 300, 384, 511, 512};
    if (max_blocks > 512) nvis.insert(nvis.end(), {513, 600, 777, 1000, 1022, 1023, 1024});
    const std::string inst = max_blocks > 512 ? "warp1024" : "warp512";
    const int64_t rows = static_cast<int64_t>(nvis.size());
    std::vector<QueryRow> qr;
    std::vector<int32_t> seq_lens;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = (nvis[r] - 1) * kBlockTokens + (r * 37) % kBlockTokens;
      qr.push_back(QueryRow{static_cast<int32_t>(r), pos});
      seq_lens.push_back(static_cast<int32_t>(pos + 1));  // decode, Q = 1: the row sits at seq_len - 1
    }
    DevArr<int32_t> d_seq(seq_lens);
    const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
    const float specials[] = {nan, -0.0f, 0.0f, -inf, inf, 1e-45f, -1e-45f, 1.0f, -1.0f, 2.0f};
    const int patterns = 8;
    const std::vector<std::pair<int32_t, int32_t>> sels = {{16, 0}, {16, 1}, {16, 2}, {2, 0}, {8, 0}, {24, 0}, {33, 0}, {40, 3}};
    for (int pattern = 0; pattern < patterns; ++pattern) {
      std::mt19937 rng(100u + static_cast<uint32_t>(pattern));
      std::normal_distribution<float> normal(0.0f, 1.0f);
      std::vector<float> sc(static_cast<size_t>(rows) * nh * max_blocks, inf);  // past the visible blocks: +Inf
      for (int64_t r = 0; r < rows; ++r)
        for (int32_t h = 0; h < nh; ++h)
          for (int64_t b = 0; b < nvis[r]; ++b) {
            float v = 0.0f;
            switch (pattern) {
              case 0: v = normal(rng); break;                                       // random
              case 1: v = static_cast<float>(static_cast<int>(rng() % 4)) - 1.0f; break;  // plateaus
              case 2: v = 0.5f; break;                                              // all equal
              case 3: v = specials[rng() % 10]; break;                              // NaN, zeros, infinities
              case 4: v = static_cast<float>(b); break;                             // ascending
              case 5: v = -static_cast<float>(b); break;                            // descending
              case 6: v = static_cast<float>(32 * (b % 32) + b / 32); break;        // lane-major ascending
              default: v = static_cast<float>(static_cast<int>(rng() % 24)); break;  // ties at the boundary
            }
            sc[(r * nh + h) * max_blocks + b] = v;
          }
      DevArr<float> d_sc(sc);
      for (const auto& [topk, init] : sels) {
        SelectionParams sel;
        sel.topk = topk;
        sel.init_blocks = init;
        const std::vector<int32_t> cpu = select_from_scores(sc, qr, nh, max_blocks, sel);
        for (const char* kernel : {"warp", "warp-512", "warp-noregs", "cta"}) {
          ScopedEnv e1("INDEXCP_SELECT"), e2("INDEXCP_SELECT_REGS"), e3("INDEXCP_SELECT_STAGED");
          e3.set("");  // the smallest instance max_blocks allows
          e1.set(std::strcmp(kernel, "cta") == 0 ? "cta" : "warp");
          e2.set(std::strcmp(kernel, "warp-noregs") == 0 ? "0" : std::strcmp(kernel, "warp-512") == 0 ? "512" : "1");
          const bool regs = std::strcmp(kernel, "warp") == 0 || (std::strcmp(kernel, "warp-512") == 0 && max_blocks <= 512);
          const std::string want = std::strcmp(kernel, "cta") == 0 ? "cta" : regs ? inst + "-regs" : inst;
          // paths: SelectLaunch::paths (null: the production instance; else its twin that writes them)
          auto launch = [&](uint8_t* paths) -> std::vector<int32_t> {
            DevArr<int32_t> out(cpu.size());
            out.fill_bytes(0x7f);
            cuda::detail::SelectLaunch L;
            L.rows = cuda::detail::RowsView{d_seq.get(), nullptr, static_cast<int32_t>(rows), 1, rows};
            L.scores = d_sc.get();
            L.max_blocks = max_blocks;
            L.nh = nh;
            L.sel = sel;
            L.out = out.get();
            L.out_heads = nh;
            L.paths = paths;
            cuda::detail::launch_select(L, nullptr);
            const cudaError_t e = cudaDeviceSynchronize();  // (CUDA_OK returns void)
            EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
            EXPECT_EQ(std::string(cuda::detail::last_select_kernel()), want) << kernel;
            return out.host();
          };
          const std::vector<int32_t> got = launch(nullptr);
          for (int64_t r = 0; r < rows; ++r)
            for (int32_t h = 0; h < nh; ++h) {
              const size_t o = static_cast<size_t>((r * nh + h) * topk);
              EXPECT_TRUE(std::equal(cpu.begin() + o, cpu.begin() + o + topk, got.begin() + o))
                  << "max_blocks " << max_blocks << " pattern " << pattern << " K " << topk << " init " << init << " "
                  << kernel << " row " << r << " (" << nvis[r] << " visible blocks) head " << h;
              ++checked;
            }
          // the paths (see above), from the same launch with SelectLaunch::paths, which runs the warp
          // kernel instance's twin that writes them (the same selections); the CTA kernel writes none
          using cuda::detail::SelectPath;
          DevArr<uint8_t> paths(static_cast<size_t>(rows) * nh);
          paths.fill_bytes(0xff);  // (not written: 0xff)
          EXPECT_EQ(launch(paths.get()), got) << "the launch with the paths selects differently, max_blocks " << max_blocks
                                              << " pattern " << pattern << " K " << topk << " init " << init << " " << kernel;
          const std::vector<uint8_t> path = paths.host();
          const bool warp = std::strcmp(kernel, "cta") != 0;
          const int32_t kk = topk - 1 - init;                        // ranked slots
          const int64_t reg_cands = max_blocks > 512 ? 1024 : 256;  // 32 kRegKeys of the instance
          int64_t tried = 0, in_regs = 0, regs_reported = 0;
          for (int64_t r = 0; r < rows; ++r)
            for (int32_t h = 0; h < nh; ++h) {
              const int p = path[static_cast<size_t>(r * nh + h)];
              const int64_t nc = nvis[r] - 1 - init;  // candidates
              auto where = [&] {  // (built only when an expectation fails)
                return "max_blocks " + std::to_string(max_blocks) + " pattern " + std::to_string(pattern) + " K " +
                       std::to_string(topk) + " init " + std::to_string(init) + " " + kernel + " row " + std::to_string(r) +
                       " (" + std::to_string(nvis[r]) + " visible blocks) head " + std::to_string(h) + ": path " +
                       std::to_string(p);
              };
              regs_reported += p == static_cast<int>(SelectPath::kRegisters);
              if (!warp) {
                EXPECT_EQ(p, 0xff) << where();
              } else if (nvis[r] <= topk) {
                EXPECT_EQ(p, static_cast<int>(SelectPath::kTrivial)) << where();
              } else if (!regs || kk > 32 || nc > reg_cands) {
                EXPECT_EQ(p, static_cast<int>(SelectPath::kStaged)) << where();
              } else {
                EXPECT_TRUE(p == static_cast<int>(SelectPath::kRegisters) || p == static_cast<int>(SelectPath::kRegistersFellBack))
                    << where();
                ++tried;
                in_regs += p == static_cast<int>(SelectPath::kRegisters);
                if (pattern == 2) {  // all equal: nc survivors
                  EXPECT_EQ(p, static_cast<int>(nc <= 64 ? SelectPath::kRegisters : SelectPath::kRegistersFellBack)) << where();
                }
              }
            }
          if (!regs) {
            EXPECT_EQ(regs_reported, 0) << kernel << " max_blocks " << max_blocks;
          } else if (kk <= 32) {
            EXPECT_GT(tried, 0) << kernel << " max_blocks " << max_blocks << " K " << topk;
            if (pattern == 0 && topk <= 24 && tried > 0) {
              EXPECT_GE(static_cast<double>(in_regs) / static_cast<double>(tried), 0.9)
                  << in_regs << " of " << tried << " random-score problems took the register path, " << kernel
                  << " max_blocks " << max_blocks << " K " << topk << " init " << init;
            }
          }
        }
      }
    }
    expected += patterns * static_cast<int64_t>(sels.size()) * 4 * rows * nh;
  }
  EXPECT_EQ(checked, expected);
}

// Sharded == replicated bit for bit on the GPU, for every (P, W), NVFP4 (both roundings) and FP8,
// through DecodeStep (one stream) and through the threaded device communicator; decode CP too.
class GpuIcp : public ::testing::TestWithParam<std::tuple<int32_t, int32_t, KvDtype, KRounding>> {};

TEST_P(GpuIcp, ShardedEqualsReplicatedBitForBit) {
  REQUIRE_GPU();
  const auto [P, W, dt, mode] = GetParam();
  if (P / W < 16) GTEST_SKIP() << "P/W < 16 rows is not a valid shard";
  const int32_t H = 4, Q = 8;
  auto s = scene({3000, 129, 0, 5000, 9, 640}, P, 50u + P + W);
  auto repl = device_shards(dt, s.req, 1, s.keys, s.slots);
  auto shards = device_shards(dt, s.req, W, s.keys, s.slots);
  const int64_t rows = static_cast<int64_t>(s.req.seq_lens.size()) * Q;
  const auto q = make_q(rows, H, 61u + W);
  DevDecode d(s.req, q, H, Q);
  const cuda::DecodeShape shape = decode_shape(d.b.num_requests, s.req.max_pages, Q, H, mode);
  const size_t n = static_cast<size_t>(rows) * H * shape.sel.topk;
  DevArr<int32_t> o_rep(n), o_icp(n), o_cp(n), o_gen(n);
  o_rep.fill_bytes(0x7f);
  o_icp.fill_bytes(0x7f);
  cuda::DecodeStep rep({&repl[0]}, W, 0, shape, cuda::DecodePath::kReplicated);
  rep.run(d.b, o_rep.get(), nullptr);
  std::vector<const cuda::DeviceCache*> cs;
  for (auto& c : shards) cs.push_back(&c);
  cuda::DecodeStep icp(cs, W, 0, shape, cuda::DecodePath::kIcp, true);
  icp.run(d.b, o_icp.get(), nullptr);
  cuda::DecodeStep cp({&repl[0]}, W, 0, shape, cuda::DecodePath::kDecodeCp);
  cp.run(d.b, o_cp.get(), nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  const auto r = o_rep.host();
  EXPECT_EQ(o_icp.host(), r) << "ICP (DecodeStep) differs from replicated";
  EXPECT_EQ(o_cp.host(), r) << "decode CP differs from replicated";
  if (P == 256 && W == 2) {  // the general scorer on stock shard pages gives the same bits
    cuda::DecodeStep gen(cs, W, 0, shape, cuda::DecodePath::kIcp, false);
    EXPECT_TRUE(icp.uses_stock_scorer(0));
    EXPECT_FALSE(gen.uses_stock_scorer(0));
    gen.run(d.b, o_gen.get(), nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(o_gen.host(), r) << "general scorer at P256/W2 differs";
  }
  // the per-rank API through the threaded device communicator
  std::vector<std::vector<int32_t>> per(W);
  cuda::run_device_ranks(W, [&](int rank, Communicator& comm, cuda::Stream st) {
    int32_t h0, nh;
    owned_heads(H, W, rank, &h0, &nh);
    DevArr<int32_t> o(static_cast<size_t>(rows) * nh * shape.sel.topk);
    cuda::icp_decode(comm, shards[rank], 0, d.b, shape.sel, mode, o.get(), st, rank == 0);
    cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(st));
    per[rank] = o.host();
  });
  for (int32_t rank = 0; rank < W; ++rank) {
    int32_t h0, nh;
    owned_heads(H, W, rank, &h0, &nh);
    for (int64_t row = 0; row < rows; ++row)
      for (int32_t hh = 0; hh < nh; ++hh)
        for (int k = 0; k < shape.sel.topk; ++k)
          ASSERT_EQ(per[rank][(row * nh + hh) * shape.sel.topk + k], r[(row * H + h0 + hh) * shape.sel.topk + k])
              << "icp_decode rank " << rank << " row " << row << " head " << h0 + hh;
  }
}

INSTANTIATE_TEST_SUITE_P(All, GpuIcp,
                         ::testing::Combine(::testing::Values(128, 256), ::testing::Values(1, 2, 4, 8),
                                            ::testing::Values(KvDtype::kNvfp4, KvDtype::kFp8),
                                            ::testing::Values(KRounding::kE4m3, KRounding::kExact)));

// Long requests scored by one CTA (INDEXCP_SCORE_CTAS=1, set for this test only): each warp runs
// about 60 pairs of one request, so its chunk table (src/cuda/score.cu) rolls over many windows,
// with 1, 2 and 4 chunks per half-stage (P128 at W = 2, 4, 8). ICP must equal replicated bit for
// bit, and replicated must select like the CPU.
TEST(GpuIcp, ChunkTableWindowsRollOverInLongRequests) {
  REQUIRE_GPU();
  struct OneCta {
    OneCta() { setenv("INDEXCP_SCORE_CTAS", "1", 1); }
    ~OneCta() { unsetenv("INDEXCP_SCORE_CTAS"); }
  } one_cta;
  const int32_t P = 128, H = 4, Q = 8;
  const KRounding mode = KRounding::kE4m3;
  auto s = scene({60000, 33000}, P, 901u);
  auto host = make_shards(KvDtype::kNvfp4, s.req, 1, s.keys, s.slots);
  auto repl = device_shards(KvDtype::kNvfp4, s.req, 1, s.keys, s.slots);
  const int64_t rows = static_cast<int64_t>(s.req.seq_lens.size()) * Q;
  const auto q = make_q(rows, H, 17u);
  DevDecode d(s.req, q, H, Q);
  const DecodeBatch hb = host_batch(s.req, q, H, Q);
  const auto qrows = decode_rows(hb, s.req.num_pages, P);
  const cuda::DecodeShape shape = decode_shape(d.b.num_requests, s.req.max_pages, Q, H, mode);
  const auto r = step_selections(repl, 2, shape, cuda::DecodePath::kReplicated, d.b);
  std::vector<int32_t> cpu(r.size());
  decode_select(host[0], 0, hb, 0, H, shape.sel, mode, cpu.data());
  compare_selections(r, cpu, ref_scores(host[0], s.req, qrows, q, H, mode), qrows, H, shape.sel.topk, "long requests");
  for (const int32_t W : {2, 4, 8})
    EXPECT_EQ(step_selections(device_shards(KvDtype::kNvfp4, s.req, W, s.keys, s.slots), W, shape,
                              cuda::DecodePath::kIcp, d.b),
              r)
        << "ICP with one scorer CTA differs from replicated, W " << W;
}

// A head's scores must not depend on which heads share its launch. The scorer takes 8 to 128
// query vectors per CTA (Q x the heads scored: 8, 16, 32 with Q = 8 and 4 heads; 16 .. 128 with
// Q = 16 and 8 heads), and the sm_90a code multiplies 8 with mma.sync and 16 to 128 with wgmma
// m64n16 .. m64n128 (src/cuda/score.cu; 16 on NVFP4 stock pages with mma.sync), so this pins that all
// of them compute every 16-product step to the same bits: sharded == replicated depends on it wherever the ranks of a configuration score different
// head counts (replicated TP4 ranks score 1 head of Q = 8, ICP ranks all 4). Random data, so
// nearly every fp32 addition rounds; every score (and every -Inf) is compared bit for bit, on
// replicated caches and on shards (the general scorer with 1 and 2 chunks per half-stage).
class GpuHeadWidth : public ::testing::TestWithParam<std::tuple<KvDtype, KRounding, int32_t, int32_t>> {};

TEST_P(GpuHeadWidth, HeadScoresDoNotDependOnTheHeadsScoredWithThem) {
  REQUIRE_GPU();
  const auto [dt, mode, P, W] = GetParam();
  auto s = scene({9000, 300, 20000, 4100, 129}, P, 31u + P + W);
  auto dev = device_shards(dt, s.req, W, s.keys, s.slots);
  for (const auto [Q, H] : {std::pair<int32_t, int32_t>{8, 4}, {16, 8}}) {
    const int64_t rows = static_cast<int64_t>(s.req.seq_lens.size()) * Q;
    const auto q = make_q(rows, H, 7u + W + Q);
    DevDecode d(s.req, q, H, Q);
    const int64_t mb = static_cast<int64_t>(s.req.max_pages) * P / 128;
    auto bits_of = [&](const cuda::DeviceCache& c, int32_t h0, int32_t nh) {
      DevArr<float> sc(static_cast<size_t>(rows) * nh * mb);
      cuda::decode_scores(c, 0, d.b, h0, nh, mode, sc.get(), nullptr);
      const auto v = sc.host();
      std::vector<uint32_t> b(v.size());
      std::memcpy(b.data(), v.data(), v.size() * sizeof(float));
      return b;
    };
    for (int32_t rank = 0; rank < W; ++rank) {
      const auto all = bits_of(dev[rank], 0, H);  // Q x H vectors per CTA
      int64_t finite = 0;
      for (const uint32_t b : all) finite += (b & 0x7f800000u) != 0x7f800000u;
      EXPECT_GT(finite, rows * H * 8) << "too few scores to compare, rank " << rank;
      for (int32_t nh = 1; nh < H; nh *= 2) {  // Q, 2 Q, .. H Q / 2 vectors per CTA
        for (int32_t h0 = 0; h0 < H; h0 += nh) {
          const auto part = bits_of(dev[rank], h0, nh);
          int64_t differ = 0, first = -1;
          for (int64_t r = 0; r < rows; ++r)
            for (int32_t hh = 0; hh < nh; ++hh)
              for (int64_t blk = 0; blk < mb; ++blk)
                if (part[(r * nh + hh) * mb + blk] != all[(r * H + h0 + hh) * mb + blk]) {
                  if (first < 0) first = (r * H + h0 + hh) * mb + blk;
                  ++differ;
                }
          EXPECT_EQ(differ, 0) << "Q " << Q << ", rank " << rank << ": heads " << h0 << ".." << h0 + nh - 1 << " scored "
                               << nh << " at a time differ from all " << H << " at once in " << differ
                               << " scores; first at index " << first << " of the [rows, heads, blocks] array";
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, GpuHeadWidth,
                         ::testing::Values(std::make_tuple(KvDtype::kNvfp4, KRounding::kE4m3, 128, 1),
                                           std::make_tuple(KvDtype::kNvfp4, KRounding::kE4m3, 256, 1),
                                           std::make_tuple(KvDtype::kNvfp4, KRounding::kE4m3, 128, 2),
                                           std::make_tuple(KvDtype::kNvfp4, KRounding::kE4m3, 128, 4),
                                           std::make_tuple(KvDtype::kNvfp4, KRounding::kE4m3, 256, 2),
                                           std::make_tuple(KvDtype::kNvfp4, KRounding::kExact, 128, 1),
                                           std::make_tuple(KvDtype::kNvfp4, KRounding::kExact, 256, 2),
                                           std::make_tuple(KvDtype::kFp8, KRounding::kE4m3, 128, 1),
                                           std::make_tuple(KvDtype::kFp8, KRounding::kE4m3, 128, 4)));

// NVFP4 scale bytes with the sign bit set (the quantizer never writes them; a cache filled by
// other software may hold them): every scorer must treat the scale as the signed E4M3 value it
// is, like the CPU. Each shard flips the same logical (token, group) scales, so ICP must still
// equal replicated bit for bit. Scores: H = 1 / 2 / 4 with Q = 8 are 8 / 16 / 32 query vectors per
// CTA (8: the mma.sync tile; 16, 32: the wgmma tiles on sm_90a, 16 by mma.sync on the replicated
// (stock) pages; with E4M3 rounding every one takes
// the scale's sign from the k_hat table, form.hpp, with exact rounding from the decoded scale);
// the replicated step at W = 2 with H = 2 scores 8 vectors
// per rank, checked through its selections. P128 with W = 2, 4 takes the general scorer with 1
// and 2 chunks per half-stage; P256 with W = 2 runs ICP with both the general and the stock
// scorer. ctest also runs this suite with INDEXCP_SCORE_CTAS=1 (tests/CMakeLists.txt), where the
// warpgroup meets placeholders late.
class GpuNegScale : public ::testing::TestWithParam<std::tuple<int32_t, KRounding>> {};

TEST_P(GpuNegScale, NegativeScaleBytesScoreLikeTheCpu) {
  REQUIRE_GPU();
  const auto [P, mode] = GetParam();
  auto s = scene({2600, 130, 0, 4100}, P, 77u + P);
  // flip the scale sign of roughly one (token, group) in five, keyed by the logical slot
  auto flip = [&](IndexCache& c) {
    const PageLayout& L = c.layout();
    for (int64_t page = 0; page < c.num_pages(); ++page)
      for (int32_t j = 0; j < L.rows(); ++j) {
        const int64_t token = page * P + L.offset_of_local_row(c.rank(), j);
        for (int gi = 0; gi < 8; ++gi)
          if ((token * 8 + gi) * 2654435761u % 5 == 0) c.page_ptr(0, page)[L.row_scale_offset(j) + gi] ^= 0x80;
      }
  };
  auto host = make_shards(KvDtype::kNvfp4, s.req, 1, s.keys, s.slots);
  flip(host[0]);
  std::vector<cuda::DeviceCache> repl;
  repl.emplace_back(host[0].layout(), host[0].num_pages(), 1, 0);
  repl[0].upload(host[0]);
  for (const int32_t H : {1, 2, 4}) {
    const int32_t Q = 8;
    const int64_t rows = static_cast<int64_t>(s.req.seq_lens.size()) * Q;
    const auto q = make_q(rows, H, 5u + H);
    DevDecode d(s.req, q, H, Q);
    const DecodeBatch hb = host_batch(s.req, q, H, Q);
    const auto qrows = decode_rows(hb, s.req.num_pages, P);
    const int64_t mb = static_cast<int64_t>(s.req.max_pages) * P / 128;
    DevArr<float> sc(static_cast<size_t>(rows) * H * mb);
    cuda::decode_scores(repl[0], 0, d.b, 0, H, mode, sc.get(), nullptr);
    const auto gs = sc.host();
    const auto ref = ref_scores(host[0], s.req, qrows, q, H, mode);
    int64_t checked = 0;
    for (size_t i = 0; i < gs.size(); ++i) {
      if (std::isinf(ref.score[i])) continue;
      ASSERT_LE(std::fabs(gs[i] - ref.score[i]), score_tol(ref.absmax[i], ref.score[i]))
          << "H " << H << " score " << i << " gpu " << gs[i] << " ref " << ref.score[i];
      ++checked;
    }
    EXPECT_GT(checked, 0);
    if (H == 1) continue;  // scores only: 8 vectors per CTA, the mma.sync tile
    const cuda::DecodeShape shape = decode_shape(d.b.num_requests, s.req.max_pages, Q, H, mode);
    const auto r = step_selections(repl, 2, shape, cuda::DecodePath::kReplicated, d.b);
    std::vector<int32_t> cpu(r.size());
    decode_select(host[0], 0, hb, 0, H, shape.sel, mode, cpu.data());
    compare_selections(r, cpu, ref, qrows, H, shape.sel.topk, "negative scales");
    for (const int32_t W : {2, 4}) {
      auto hs = make_shards(KvDtype::kNvfp4, s.req, W, s.keys, s.slots);
      std::vector<cuda::DeviceCache> shards;
      for (auto& h : hs) {
        flip(h);
        shards.emplace_back(h.layout(), h.num_pages(), 1, h.rank());
        shards.back().upload(h);
      }
      for (const bool p256_stock : {false, true}) {  // P256 / W2: the general and the stock scorer
        if (p256_stock && !(P == 256 && W == 2)) continue;
        bool stock = !p256_stock;
        EXPECT_EQ(step_selections(shards, W, shape, cuda::DecodePath::kIcp, d.b, p256_stock, &stock), r)
            << "ICP with negative scales differs from replicated, H " << H << " W " << W
            << (p256_stock ? " (stock scorer)" : " (general scorer)");
        EXPECT_EQ(stock, p256_stock);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, GpuNegScale,
                         ::testing::Combine(::testing::Values(128, 256), ::testing::Values(KRounding::kE4m3, KRounding::kExact)));

// ---- cases ------------------------------------------------------------------------------------

TEST(GpuCases, C03_TiePlateau) {
  REQUIRE_GPU();
  Requests req = make_requests({301 * 128 + 3}, 128, 5);
  std::vector<float> keys(static_cast<size_t>(req.seq_lens[0]) * 128, 0.0f);
  std::vector<int64_t> slots;
  for (int64_t p = 0; p < req.seq_lens[0]; ++p) slots.push_back(req.slot(0, p));
  const auto q = make_q(1, 1, 9);
  SelectionParams sel;
  for (int variant = 0; variant < 2; ++variant) {
    if (variant == 1)
      for (int b : {40, 7, 299, 150}) keys[(static_cast<size_t>(b) * 128 + 3) * 128] = 1.0f;  // 4 higher blocks
    auto dev = device_shards(KvDtype::kNvfp4, req, 1, keys, slots);
    DevDecode d(req, q, 1, 1);
    DevArr<int32_t> out(sel.topk);
    // q[0] must be positive for the 4 blocks to score higher; force it
    std::vector<uint8_t> qq = q;
    qq[0] = e4m3_encode(1.0f);
    d.q.upload(qq);
    cuda::decode_select(dev[0], 0, d.b, 0, 1, sel, KRounding::kE4m3, out.get(), nullptr);
    std::vector<int32_t> expect;
    if (variant == 0) {
      for (int i = 0; i < 15; ++i) expect.push_back(i);
    } else {  // the 4 higher blocks (7, 40, 150, 299) plus the 11 lowest ids of the rest
      expect = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 40, 150, 299};
    }
    expect.push_back(301);
    std::sort(expect.begin(), expect.end());
    EXPECT_EQ(out.host(), expect) << "variant " << variant;
  }
}

TEST(GpuCases, C04_FewerBlocksThanK) {
  REQUIRE_GPU();
  std::vector<int32_t> lens;
  for (int64_t pos : {0, 127, 128, 1919, 1920, 2047, 2048}) lens.push_back(static_cast<int32_t>(pos + 1));
  auto s = scene(lens, 128, 3);
  auto dev = device_shards(KvDtype::kNvfp4, s.req, 1, s.keys, s.slots);
  const auto q = make_q(static_cast<int64_t>(lens.size()), 2, 4);
  DevDecode d(s.req, q, 2, 1);
  SelectionParams sel;
  DevArr<int32_t> out(lens.size() * 2 * 16);
  cuda::decode_select(dev[0], 0, d.b, 0, 2, sel, KRounding::kE4m3, out.get(), nullptr);
  const auto o = out.host();
  for (size_t i = 0; i < lens.size(); ++i)
    for (int h = 0; h < 2; ++h) {
      const int64_t pos = lens[i] - 1, n = pos / 128 + 1;
      const int32_t* r = o.data() + (i * 2 + h) * 16;
      int valid = 0;
      for (int k = 0; k < 16; ++k) valid += r[k] >= 0;
      EXPECT_EQ(valid, std::min<int64_t>(16, n)) << "pos " << pos;
      if (n <= 16)
        for (int k = 0; k < 16; ++k) EXPECT_EQ(r[k], k < n ? k : -1) << "pos " << pos;
      EXPECT_EQ(r[valid - 1], n - 1);
    }
}

TEST(GpuCases, C05_FutureStaysInvisible) {
  REQUIRE_GPU();
  for (int32_t P : {128, 256}) {
    // a request whose pages already hold keys far beyond the query positions (huge dot products)
    Requests req = make_requests({4096}, P, 8);
    std::vector<float> keys;
    std::vector<int64_t> slots;
    std::mt19937 rng(9);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (int64_t p = 0; p < 4096; ++p) {
      for (int d = 0; d < 128; ++d) keys.push_back(p >= 1028 ? 100.0f : nd(rng));
      slots.push_back(req.slot(0, p));
    }
    std::vector<int32_t> lens = {1028};  // decode positions 1020..1027 (Q = 8)
    Requests view = req;
    view.seq_lens = lens;
    for (int32_t W : {1, 2}) {
      auto dev = device_shards(KvDtype::kNvfp4, req, W, keys, slots);
      std::vector<uint8_t> q(8 * 128, e4m3_encode(1.0f));
      DevDecode d(view, q, 1, 8);
      std::vector<int32_t> o(8 * 16);
      DevArr<int32_t> out(o.size());
      if (W == 1) {
        cuda::decode_select(dev[0], 0, d.b, 0, 1, SelectionParams{}, KRounding::kE4m3, out.get(), nullptr);
      } else {
        const cuda::DecodeShape shape = decode_shape(1, view.max_pages, 8, 1);
        cuda::DecodeStep step(std::vector<const cuda::DeviceCache*>{&dev[0], &dev[1]}, 2, 0, shape, cuda::DecodePath::kIcp);
        step.run(d.b, out.get(), nullptr);
        CUDA_OK(cudaDeviceSynchronize());
      }
      o = out.host();
      for (int i = 0; i < 8; ++i) {
        const int32_t local = (1020 + i) / 128;
        EXPECT_EQ(local, i < 4 ? 7 : 8);
        int32_t mx = -1;
        for (int k = 0; k < 16; ++k) mx = std::max(mx, o[i * 16 + k]);
        EXPECT_EQ(mx, local) << "row " << i << " P" << P << " W" << W;
      }
    }
  }
}

TEST(GpuCases, C08_RanksThatOwnNothing) {
  REQUIRE_GPU();
  std::vector<int32_t> lens;
  for (int32_t t : {1, 31, 33, 127, 129, 200}) {
    lens.push_back(t);
    lens.push_back(2560 + t);
  }
  auto s = scene(lens, 128, 77);
  auto repl = device_shards(KvDtype::kNvfp4, s.req, 1, s.keys, s.slots);
  auto shards = device_shards(KvDtype::kNvfp4, s.req, 4, s.keys, s.slots);
  // no rank wrote a key it does not own: every shard equals the CPU's shard byte for byte
  auto host = make_shards(KvDtype::kNvfp4, s.req, 4, s.keys, s.slots);
  for (int r = 0; r < 4; ++r) {
    IndexCache back(host[r].layout(), s.req.num_pages, 1, r);
    shards[r].download(back);
    EXPECT_EQ(std::memcmp(back.data(), host[r].data(), static_cast<size_t>(back.size_bytes())), 0) << "rank " << r;
  }
  const int32_t H = 4;
  const auto q = make_q(static_cast<int64_t>(lens.size()), H, 78);
  DevDecode d(s.req, q, H, 1);
  const cuda::DecodeShape shape = decode_shape(d.b.num_requests, s.req.max_pages, 1, H);
  const size_t n = lens.size() * H * 16;
  DevArr<int32_t> a(n), b(n);
  cuda::DecodeStep rep({&repl[0]}, 4, 0, shape, cuda::DecodePath::kReplicated);
  cuda::DecodeStep icp({&shards[0], &shards[1], &shards[2], &shards[3]}, 4, 0, shape, cuda::DecodePath::kIcp);
  rep.run(d.b, a.get(), nullptr);
  icp.run(d.b, b.get(), nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(b.host(), a.host());
}

TEST(GpuCases, C09_PaddedBatchesGiveMinusOne) {
  REQUIRE_GPU();
  for (int32_t B : {32, 64}) {
    Requests req = make_requests(std::vector<int32_t>(B, 0), 128, 1);
    req.max_pages = 40;
    req.block_table.assign(static_cast<size_t>(B) * 40, -1);
    auto repl = device_shards(KvDtype::kNvfp4, req, 1, {}, {});
    auto shards = device_shards(KvDtype::kNvfp4, req, 2, {}, {});
    const int32_t H = 4, Q = 8;
    const auto q = make_q(static_cast<int64_t>(B) * Q, H, 2);
    DevDecode d(req, q, H, Q);
    const cuda::DecodeShape shape = decode_shape(B, 40, Q, H);
    const size_t n = static_cast<size_t>(B) * Q * H * 16;
    for (auto path : {cuda::DecodePath::kReplicated, cuda::DecodePath::kIcp, cuda::DecodePath::kDecodeCp}) {
      std::vector<const cuda::DeviceCache*> cs = {&repl[0]};
      if (path == cuda::DecodePath::kIcp) cs = {&shards[0], &shards[1]};
      cuda::DecodeStep step(cs, 2, 0, shape, path);
      DevArr<int32_t> out(n);
      out.fill_bytes(0x11);
      step.run(d.b, out.get(), nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      for (int32_t v : out.host()) ASSERT_EQ(v, -1);
    }
    DevArr<int32_t> out(n);
    cuda::decode_select(repl[0], 0, d.b, 0, H, SelectionParams{}, KRounding::kE4m3, out.get(), nullptr);
    for (int32_t v : out.host()) ASSERT_EQ(v, -1);
  }
}

TEST(GpuCases, C10_ShortSpeculativeSteps) {
  REQUIRE_GPU();
  auto s = scene({129}, 128, 12);
  auto dev = device_shards(KvDtype::kFp8, s.req, 1, s.keys, s.slots);
  const auto q = make_q(3, 1, 13);
  DevDecode d(s.req, q, 1, 3);
  DevArr<int32_t> out(3 * 16);
  cuda::decode_select(dev[0], 0, d.b, 0, 1, SelectionParams{}, KRounding::kE4m3, out.get(), nullptr);
  const auto o = out.host();
  // positions 126, 127, 128: local blocks 0, 0, 1
  EXPECT_EQ(o[0], 0);
  EXPECT_EQ(o[1], -1);
  EXPECT_EQ(o[16], 0);
  EXPECT_EQ(o[32], 0);
  EXPECT_EQ(o[33], 1);
  EXPECT_EQ(o[34], -1);
  auto s16 = scene({16}, 128, 14);
  auto dev16 = device_shards(KvDtype::kFp8, s16.req, 1, s16.keys, s16.slots);
  const auto q16 = make_q(16, 1, 15);
  DevDecode d16(s16.req, q16, 1, 16);
  DevArr<int32_t> o16(16 * 16);
  cuda::decode_select(dev16[0], 0, d16.b, 0, 1, SelectionParams{}, KRounding::kE4m3, o16.get(), nullptr);
  const auto h16 = o16.host();
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(h16[i * 16], 0);
    EXPECT_EQ(h16[i * 16 + 1], -1);
  }
  // seq_len 2 with query length 3 is refused, naming seq_lens[0]
  Requests bad = s.req;
  bad.seq_lens = {2};
  DevDecode db(bad, q, 1, 3);
  try {
    cuda::decode_select(dev[0], 0, db.b, 0, 1, SelectionParams{}, KRounding::kE4m3, out.get(), nullptr);
    ADD_FAILURE() << "accepted seq_len 2 with query_len 3";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("seq_lens[0]"), std::string::npos) << e.what();
  }
}

TEST(GpuDecode, BadArgumentsAreRefusedWithTheArgumentNamed) {
  REQUIRE_GPU();
  auto s = scene({1000}, 128, 41);
  auto dev = device_shards(KvDtype::kNvfp4, s.req, 1, s.keys, s.slots);
  auto q = make_q(4, 4, 42);
  DevDecode d(s.req, q, 4, 4);
  DevArr<int32_t> out(4 * 4 * 16);
  auto expect_error = [&](DecodeBatch b, const std::string& needle, int32_t h0 = 0, int32_t nh = 4) {
    try {
      cuda::decode_select(dev[0], 0, b, h0, nh, SelectionParams{}, KRounding::kE4m3, out.get(), nullptr);
      ADD_FAILURE() << "accepted; expected an error naming " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  DecodeBatch x = d.b;
  x.query_len = 17;
  expect_error(x, "query_len");
  x = d.b;
  x.heads = 0;
  expect_error(x, "heads");
  expect_error(d.b, "head range", 3, 2);
  auto bt = s.req.block_table;
  bt[3] = static_cast<int32_t>(s.req.num_pages);
  d.bt.upload(bt);
  expect_error(d.b, "block_table[0][3]");
  d.bt.upload(s.req.block_table);
  auto qn = q;
  qn[5 * 128 + 7] = 0xFF;
  d.q.upload(qn);
  expect_error(d.b, "q holds a NaN byte at row 1, head 1, dim 7");
  d.q.upload(q);
  try {
    cuda::decode_select(dev[0], 3, d.b, 0, 4, SelectionParams{}, KRounding::kE4m3, out.get(), nullptr);
    ADD_FAILURE() << "accepted layer 3";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layer"), std::string::npos);
  }
  auto shards = device_shards(KvDtype::kNvfp4, s.req, 2, s.keys, s.slots);
  try {
    cuda::decode_select(shards[0], 0, d.b, 0, 4, SelectionParams{}, KRounding::kE4m3, out.get(), nullptr);
    ADD_FAILURE() << "accepted a shard";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cache is sharded"), std::string::npos);
  }
  // a KRounding that is none of the enumerators: refused by name, and decode_scores' output is not
  // touched (its -Inf fill used to run before the check)
  const int64_t ns = 4 * 4 * static_cast<int64_t>(s.req.max_pages);
  DevArr<float> sc(static_cast<size_t>(ns));
  sc.upload(std::vector<float>(static_cast<size_t>(ns), 7.0f));
  for (int m : {2, -1}) {
    try {
      cuda::decode_scores(dev[0], 0, d.b, 0, 4, static_cast<KRounding>(m), sc.get(), nullptr);
      ADD_FAILURE() << "accepted mode " << m;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("mode = " + std::to_string(m) + " is not a KRounding"), std::string::npos)
          << e.what();
    }
  }
  for (float v : sc.host()) ASSERT_EQ(v, 7.0f);
}

// A decode step captured once in a CUDA graph and replayed with new metadata (seq_lens, block
// table, q) equals eager execution bit for bit; padded requests give -1.
TEST(GpuGraph, ReplayWithChangedMetadataEqualsEager) {
  REQUIRE_GPU();
  const int32_t P = 128, W = 2, H = 4, Q = 8, B = 6;
  auto sA = scene({3000, 129, 5000, 700, 2000, 64}, P, 91);
  // batch B: the same cache, other lengths (two padded requests) and another page order
  auto repl = device_shards(KvDtype::kNvfp4, sA.req, 1, sA.keys, sA.slots);
  auto shards = device_shards(KvDtype::kNvfp4, sA.req, W, sA.keys, sA.slots);
  const int64_t rows = static_cast<int64_t>(B) * Q;
  const auto qA = make_q(rows, H, 92), qB = make_q(rows, H, 93);
  DevDecode d(sA.req, qA, H, Q);
  const cuda::DecodeShape shape = decode_shape(B, sA.req.max_pages, Q, H);
  const size_t n = static_cast<size_t>(rows) * H * 16;
  std::vector<int32_t> lensB = {4999, 0, 2900, 129, 0, 16};
  auto btB = sA.req.block_table;  // request 0 reads request 2's pages and vice versa
  for (int32_t i = 0; i < sA.req.max_pages; ++i) std::swap(btB[0 * sA.req.max_pages + i], btB[2 * sA.req.max_pages + i]);
  for (auto path : {cuda::DecodePath::kIcp, cuda::DecodePath::kReplicated}) {
    std::vector<const cuda::DeviceCache*> cs = {&repl[0]};
    if (path == cuda::DecodePath::kIcp) cs = {&shards[0], &shards[1]};
    cuda::DecodeStep step(cs, W, 0, shape, path);
    DevArr<int32_t> g_out(n), e_out(n);
    cudaStream_t st;
    CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    // restore batch A metadata, capture
    d.q.upload(qA);
    d.sl.upload(sA.req.seq_lens);
    d.bt.upload(sA.req.block_table);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    step.run(d.b, g_out.get(), reinterpret_cast<cuda::Stream>(st));
    CUDA_OK(cudaStreamEndCapture(st, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    // replay on A, compare with eager A
    g_out.fill_bytes(0x33);
    CUDA_OK(cudaGraphLaunch(exec, st));
    CUDA_OK(cudaStreamSynchronize(st));
    step.run(d.b, e_out.get(), reinterpret_cast<cuda::Stream>(st));
    CUDA_OK(cudaStreamSynchronize(st));
    EXPECT_EQ(g_out.host(), e_out.host()) << "replay A";
    // new metadata in the same device buffers, replay, compare with eager B
    d.q.upload(qB);
    d.sl.upload(lensB);
    d.bt.upload(btB);
    g_out.fill_bytes(0x33);
    CUDA_OK(cudaGraphLaunch(exec, st));
    CUDA_OK(cudaStreamSynchronize(st));
    e_out.fill_bytes(0x44);
    step.run(d.b, e_out.get(), reinterpret_cast<cuda::Stream>(st));
    CUDA_OK(cudaStreamSynchronize(st));
    const auto g = g_out.host();
    EXPECT_EQ(g, e_out.host()) << "replay B";
    for (int32_t b : {1, 4})
      for (int64_t r = b * Q; r < (b + 1) * Q; ++r)
        for (int k = 0; k < H * 16; ++k) ASSERT_EQ(g[r * H * 16 + k], -1) << "padded request " << b;
    // and B equals the replicated CPU selection up to near ties
    Requests rB = sA.req;
    rB.seq_lens = lensB;
    rB.block_table = btB;
    auto host = make_shards(KvDtype::kNvfp4, sA.req, 1, sA.keys, sA.slots);
    const DecodeBatch hb = host_batch(rB, qB, H, Q);
    std::vector<int32_t> cpu(n);
    decode_select(host[0], 0, hb, 0, H, SelectionParams{}, KRounding::kE4m3, cpu.data());
    const auto qrows = decode_rows(hb, rB.num_pages, P);
    compare_selections(g, cpu, ref_scores(host[0], rB, qrows, qB, H, KRounding::kE4m3), qrows, H, 16, "graph B");
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(st);
  }
}
