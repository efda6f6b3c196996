// The plan / run API of one rank on the GPU (include/indexcp/plan.hpp, cuda.hpp): decode and
// prefill plans against the existing CUDA entry points (bit for bit: the same kernels) and the
// CPU plans (exact keys: equal; random keys: the near-tie rule of compare_selections), the split
// exchange with the test's own all-gather, capture in cudaStreamCaptureModeGlobal and replay
// with new metadata, the step signature, and the host-side refusals.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <functional>
#include <random>
#include <string>
#include <vector>

#include "gpu_util.hpp"
#include "indexcp/plan.hpp"

namespace {

using namespace gpu;

cuda::Stream S(cudaStream_t s) { return reinterpret_cast<cuda::Stream>(s); }

enum class Mode { kReplicated, kSharded, kDecodeCp };
const char* name_of(Mode m) { return m == Mode::kReplicated ? "replicated" : m == Mode::kSharded ? "sharded" : "decode_cp"; }

ResolvedConfig config(KvDtype dt, int32_t P, int32_t W, int32_t H, int32_t Q, Mode m,
                      PrefillCp pcp = PrefillCp::kGather, int64_t budget_mib = 256) {
  AttentionConfig a;
  a.kv_dtype = dt;
  a.cache_sharding = m == Mode::kSharded;
  a.decode_cp = m == Mode::kDecodeCp;
  a.prefill_cp = pcp;
  a.prefill_gather_budget_mib = budget_mib;
  EngineParams e;
  e.tp = W;
  e.page_size = P;
  e.heads = H;
  e.query_len = Q;
  return resolve_config(a, e);
}

DeviceDecodeBatch dev_batch(const DevDecode& d) {
  DeviceDecodeBatch b;
  b.q = d.b.q;
  b.block_table = d.b.block_table;
  b.seq_lens = d.b.seq_lens;
  b.num_requests = d.b.num_requests;
  return b;
}

// A scene: requests, keys, q, the rank caches of a config on the device (and on the host).
struct Scene {
  ResolvedConfig cfg;
  Requests req;
  std::vector<float> keys;
  std::vector<int64_t> slots;
  std::vector<uint8_t> q;
  std::vector<cuda::DeviceCache> dev;  // W shards, or one replicated cache
  std::vector<IndexCache> host;
  int32_t W = 1, H = 4, Q = 1;
  Scene(const ResolvedConfig& c, const std::vector<int32_t>& lens, uint32_t seed, bool exact) : cfg(c) {
    W = c.engine.tp;
    H = c.engine.heads;
    Q = c.engine.query_len;
    req = make_requests(lens, c.engine.page_size, seed);
    if (exact) {
      exact_keys(req, seed + 1, keys, slots);
      q = int_q(static_cast<int64_t>(lens.size()) * Q, H, seed + 2);
    } else {
      make_keys(req, seed + 1, keys, slots);
      q = make_q(static_cast<int64_t>(lens.size()) * Q, H, seed + 2);
    }
    dev = device_shards(c.kv_dtype, req, c.shards, keys, slots);
    host = make_shards(c.kv_dtype, req, c.shards, keys, slots);
  }
  const cuda::DeviceCache& dcache(int32_t r) const { return dev[cfg.shards > 1 ? r : 0]; }
  const IndexCache& hcache(int32_t r) const { return host[cfg.shards > 1 ? r : 0]; }
};

// Every rank's plan run through the in-process device group; out[r] = rank r's owned heads.
std::vector<std::vector<int32_t>> run_plans(const Scene& s, const DecodeLimits& lim, const DevDecode& d) {
  std::vector<std::vector<int32_t>> outs(static_cast<size_t>(s.W));
  cuda::run_device_ranks(s.W, [&](int r, Communicator& comm, cuda::Stream st) {
    cuda::DecodePlan plan(s.cfg, r, lim);
    DevArr<uint8_t> ws(plan.workspace_bytes());
    ws.fill_bytes(0);  // the exchange copies whole records (initcheck)
    DevArr<int32_t> out(static_cast<size_t>(d.b.rows()) * plan.num_heads() * lim.sel.topk);
    DevArr<uint32_t> status(1);
    plan.run(s.dcache(r), 0, dev_batch(d), ws.get(), plan.workspace_bytes(), out.get(), &comm, status.get(), st);
    cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(st));
    outs[r] = out.host();
    if (plan.path() != DecodePath::kReplicated) EXPECT_EQ(status.host()[0], 0u) << "rank " << r;
  });
  return outs;
}

// The existing per-rank entry points (icp_decode, decode_cp_replicated, decode_select).
std::vector<std::vector<int32_t>> run_existing(const Scene& s, const SelectionParams& sel, const DevDecode& d) {
  std::vector<std::vector<int32_t>> outs(static_cast<size_t>(s.W));
  cuda::run_device_ranks(s.W, [&](int r, Communicator& comm, cuda::Stream st) {
    int32_t h0, nh;
    owned_heads(s.H, s.W, r, &h0, &nh);
    DevArr<int32_t> out(static_cast<size_t>(d.b.rows()) * nh * sel.topk);
    if (s.cfg.sharding)
      cuda::icp_decode(comm, s.dcache(r), 0, d.b, sel, s.cfg.k_rounding, out.get(), st, true, s.cfg.p256_stock_decode);
    else if (s.cfg.decode_cp)
      cuda::decode_cp_replicated(comm, s.dcache(r), 0, d.b, sel, s.cfg.k_rounding, out.get(), st);
    else
      cuda::decode_select(s.dcache(r), 0, d.b, h0, nh, sel, s.cfg.k_rounding, out.get(), st);
    cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(st));
    outs[r] = out.host();
  });
  return outs;
}

// The CPU plans on the host caches.
std::vector<std::vector<int32_t>> run_cpu_plans(const Scene& s, const DecodeLimits& lim) {
  std::vector<std::vector<int32_t>> outs(static_cast<size_t>(s.W));
  const DecodeBatch hb = host_batch(s.req, s.q, s.H, s.Q);
  run_ranks(s.W, [&](int r, Communicator& comm) {
    DecodePlan plan(s.cfg, r, lim);
    std::vector<uint8_t> ws(plan.workspace_bytes() + 16);
    void* w = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.data()) + 15) / 16 * 16);
    std::vector<int32_t> out(static_cast<size_t>(hb.rows()) * plan.num_heads() * lim.sel.topk);
    DeviceDecodeBatch b{hb.q, hb.block_table, hb.seq_lens, hb.num_requests};
    plan.run(s.hcache(r), 0, b, w, plan.workspace_bytes(), out.data(), &comm);
    outs[r] = out;
  });
  return outs;
}

DecodeLimits limits_of(const Scene& s, int32_t max_requests, int32_t K = 16, int32_t init = 0) {
  DecodeLimits l;
  l.max_requests = max_requests;
  l.max_pages = s.req.max_pages;
  l.query_len = s.Q;
  l.heads = s.H;
  l.sel.topk = K;
  l.sel.init_blocks = init;
  return l;
}

// Plans equal the existing entry points bit for bit, every path, both dtypes, both page sizes,
// W = 1, 2, 4, Q = 1 and 3, a batch below the plan's maximum, and padded requests.
TEST(GpuPlan, DecodeEqualsTheExistingEntryPointsBitForBit) {
  REQUIRE_GPU();
  int cases = 0;
  for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8})
    for (int32_t P : {128, 256})
      for (int32_t W : {1, 2, 4})
        for (Mode m : {Mode::kReplicated, Mode::kSharded, Mode::kDecodeCp}) {
          if (W == 1 && m != Mode::kReplicated) continue;
          for (int32_t Q : {1, 3}) {
            const ResolvedConfig c = config(dt, P, W, 4, Q, m);
            Scene s(c, {3000, 0, 130, 5000, 2100}, 17u + cases, false);
            const std::string tag = to_string(dt) + " P" + std::to_string(P) + " W" + std::to_string(W) + " " +
                                    name_of(m) + " Q" + std::to_string(Q);
            SelectionParams sel;
            sel.topk = 16;
            sel.init_blocks = 1;
            const DecodeLimits lim = limits_of(s, 8, sel.topk, sel.init_blocks);  // 5 of 8 requests
            DevDecode d(s.req, s.q, s.H, s.Q);
            const auto got = run_plans(s, lim, d);
            const auto want = run_existing(s, sel, d);
            for (int32_t r = 0; r < W; ++r) {
              EXPECT_EQ(got[r], want[r]) << tag << " rank " << r;
              // the padded request (seq_len 0) selects nothing
              int32_t h0, nh;
              owned_heads(4, W, r, &h0, &nh);
              for (int32_t i = 0; i < Q; ++i)
                for (int32_t k = 0; k < nh * 16; ++k) ASSERT_EQ(got[r][(1 * Q + i) * nh * 16 + k], -1) << tag;
            }
            ++cases;
          }
        }
  EXPECT_EQ(cases, 2 * 2 * (1 + 3 + 3) * 2);
}

// With exact keys and integer queries every score is exact on both backends: the CUDA plan equals
// the CPU plan; with random keys they agree under the near-tie rule.
TEST(GpuPlan, DecodeEqualsTheCpuPlan) {
  REQUIRE_GPU();
  for (Mode m : {Mode::kReplicated, Mode::kSharded, Mode::kDecodeCp})
    for (int32_t P : {128, 256}) {
      const ResolvedConfig c = config(KvDtype::kNvfp4, P, 2, 4, 2, m);
      Scene s(c, {2600, 4100, 2}, 5u + P, true);
      const DecodeLimits lim = limits_of(s, 3);
      DevDecode d(s.req, s.q, s.H, s.Q);
      const auto g = run_plans(s, lim, d);
      const auto h = run_cpu_plans(s, lim);
      for (int32_t r = 0; r < 2; ++r) EXPECT_EQ(g[r], h[r]) << name_of(m) << " P" << P << " rank " << r;
    }
  const ResolvedConfig c = config(KvDtype::kNvfp4, 128, 2, 4, 1, Mode::kSharded);
  Scene s(c, {3000, 6000}, 99u, false);
  const DecodeLimits lim = limits_of(s, 2);
  DevDecode d(s.req, s.q, s.H, s.Q);
  const auto g = run_plans(s, lim, d);
  const auto h = run_cpu_plans(s, lim);
  // the whole selection from the owner ranks, compared with the near-tie rule against exact scores
  std::vector<int32_t> ga(2 * 4 * 16), ha(ga.size());
  for (int32_t r = 0; r < 2; ++r)
    for (int32_t row = 0; row < 2; ++row)
      for (int32_t hh = 0; hh < 2; ++hh)
        for (int32_t k = 0; k < 16; ++k) {
          ga[(row * 4 + r * 2 + hh) * 16 + k] = g[r][(row * 2 + hh) * 16 + k];
          ha[(row * 4 + r * 2 + hh) * 16 + k] = h[r][(row * 2 + hh) * 16 + k];
        }
  const auto rows = decode_rows(host_batch(s.req, s.q, 4, 1), s.req.num_pages, 128);
  IndexCache repl(make_page_layout(KvDtype::kNvfp4, 128, 1), s.req.num_pages, 1, 0);
  insert_keys(repl, 0, s.keys.data(), s.slots.data(), static_cast<int64_t>(s.slots.size()));
  const RefScores ref = ref_scores(repl, s.req, rows, s.q, 4, c.k_rounding);
  EXPECT_EQ(compare_selections(ga, ha, ref, rows, 4, 16, "random keys, sharded plan"), 0);
}

// The split exchange: publish on every rank into the test's send buffers, the test's own
// all-gather (device copies), merge: equals the built-in exchange. Then the same three steps of
// all ranks captured in ONE graph (cudaStreamCaptureModeGlobal), replayed with other seq_lens,
// another block table and a padded request: equals eager, and the graph has no allocation node.
TEST(GpuPlan, SplitExchangeAndGraphReplayEqualEager) {
  REQUIRE_GPU();
  for (Mode m : {Mode::kSharded, Mode::kDecodeCp, Mode::kReplicated}) {
    const int32_t W = 2, H = 4, Q = 2;
    const ResolvedConfig c = config(KvDtype::kNvfp4, 256, W, H, Q, m);
    Scene s(c, {4000, 2500, 7000, 300}, 41u, false);
    const DecodeLimits lim = limits_of(s, 4);
    DevDecode d(s.req, s.q, H, Q);
    const auto want = run_plans(s, lim, d);
    cudaStream_t st;
    CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    std::vector<cuda::DecodePlan> plans;
    std::vector<DevArr<uint8_t>> ws;
    std::vector<DevArr<int32_t>> out;
    for (int32_t r = 0; r < W; ++r) {
      plans.emplace_back(c, r, lim);
      ws.emplace_back(plans[r].workspace_bytes());
      ws.back().fill_bytes(0);
      out.emplace_back(static_cast<size_t>(4 * Q) * plans[r].num_heads() * 16);
    }
    const size_t rec = plans[0].exchange_bytes();
    DevArr<uint8_t> sends(rec * W + 8), recv(rec * W + 8);
    sends.fill_bytes(0);
    DevArr<uint32_t> status(W);
    DeviceDecodeBatch b = dev_batch(d);
    auto step = [&] {
      for (int32_t r = 0; r < W; ++r) {
        if (plans[r].path() == DecodePath::kReplicated) {
          plans[r].run(s.dcache(r), 0, b, ws[r].get(), ws[r].size(), out[r].get(), nullptr, nullptr, S(st));
          continue;
        }
        plans[r].publish(s.dcache(r), 0, b, ws[r].get(), ws[r].size(), sends.get() + r * rec, S(st));
      }
      if (plans[0].path() == DecodePath::kReplicated) return;
      // the engine's all-gather (here: the records side by side already, copied to recv)
      cudaMemcpyAsync(recv.get(), sends.get(), rec * W, cudaMemcpyDeviceToDevice, st);
      for (int32_t r = 0; r < W; ++r) plans[r].merge(b, recv.get(), out[r].get(), status.get() + r, S(st));
    };
    step();
    CUDA_OK(cudaStreamSynchronize(st));
    for (int32_t r = 0; r < W; ++r) EXPECT_EQ(out[r].host(), want[r]) << name_of(m) << " split, rank " << r;
    if (m != Mode::kReplicated) EXPECT_EQ(status.host(), std::vector<uint32_t>(W, 0u));

    cudaGraph_t g = nullptr;
    CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    step();
    CUDA_OK(cudaStreamEndCapture(st, &g));
    EXPECT_FALSE(graph_has_alloc_node(g)) << name_of(m);
    cudaGraphExec_t ge = nullptr;
    CUDA_OK(cudaGraphInstantiate(&ge, g, 0));
    // new metadata in the same buffers: other lengths (one padded), another block table
    Requests r2 = make_requests({6100, 0, 1900, 6900}, 256, 77u);
    r2.num_pages = s.req.num_pages;
    ASSERT_LE(r2.max_pages, s.req.max_pages);
    std::vector<int32_t> bt2(s.req.block_table.size(), -1);
    for (size_t i = 0; i < 4; ++i)
      for (int32_t p = 0; p < r2.max_pages; ++p) {
        const int32_t v = r2.block_table[i * r2.max_pages + p];
        bt2[i * s.req.max_pages + p] = v < 0 ? -1 : v % static_cast<int32_t>(s.req.num_pages);
      }
    Requests r3 = s.req;
    r3.seq_lens = r2.seq_lens;
    r3.block_table = bt2;
    const auto q2 = make_q(4 * Q, H, 1234u);
    d.bt.upload(bt2);
    d.sl.upload(r3.seq_lens);
    d.q.upload(q2);
    CUDA_OK(cudaGraphLaunch(ge, st));
    CUDA_OK(cudaStreamSynchronize(st));
    DevDecode d3(r3, q2, H, Q);
    const auto want3 = run_plans(s, lim, d3);
    for (int32_t r = 0; r < W; ++r) EXPECT_EQ(out[r].host(), want3[r]) << name_of(m) << " graph replay, rank " << r;
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    CUDA_OK(cudaStreamDestroy(st));
  }
}

// Ranks that ran different steps (another seq_len, another num_requests): the merge of every
// rank writes -1 everywhere and status 1; the message names the call.
TEST(GpuPlan, StepSignatureCatchesRanksThatDisagree) {
  REQUIRE_GPU();
  const int32_t W = 2, H = 4, Q = 1;
  const ResolvedConfig c = config(KvDtype::kNvfp4, 128, W, H, Q, Mode::kSharded);
  Scene s(c, {3000, 5000, 2000}, 3u, false);
  const DecodeLimits lim = limits_of(s, 3);
  std::vector<cuda::DecodePlan> plans;
  for (int32_t r = 0; r < W; ++r) plans.emplace_back(c, r, lim);
  const size_t rec = plans[0].exchange_bytes();
  EXPECT_EQ(rec, exchange_layout(3, H, lim.sel).record_bytes);
  EXPECT_EQ(rec, static_cast<size_t>(3) * H * 15 * 8 + kStepSignatureBytes);
  for (int variant = 0; variant < 3; ++variant) {
    DevDecode d0(s.req, s.q, H, Q);
    Requests other = s.req;
    if (variant == 0) other.seq_lens[1] -= 1;  // one token shorter on rank 1
    DevDecode d1(other, s.q, H, Q);
    DeviceDecodeBatch b0 = dev_batch(d0), b1 = dev_batch(d1);
    if (variant == 1) b1.num_requests = 2;  // rank 1 saw one request fewer
    DevArr<uint8_t> ws0(plans[0].workspace_bytes()), ws1(plans[1].workspace_bytes()), recv(rec * W);
    ws0.fill_bytes(0);
    ws1.fill_bytes(0);
    recv.fill_bytes(0);
    DevArr<int32_t> o0(3 * 2 * 16), o1(3 * 2 * 16);
    DevArr<uint32_t> st(2);
    o0.fill_bytes(0x11);
    o1.fill_bytes(0x11);
    plans[0].publish(s.dcache(0), 0, b0, ws0.get(), ws0.size(), recv.get(), nullptr);
    plans[1].publish(s.dcache(1), 0, b1, ws1.get(), ws1.size(), recv.get() + rec, nullptr);
    plans[0].merge(b0, recv.get(), o0.get(), st.get(), nullptr);
    plans[1].merge(b1, recv.get(), o1.get(), st.get() + 1, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const auto h0 = o0.host(), h1 = o1.host();
    const auto hs = st.host();
    if (variant == 2) {  // the same step on both ranks: agreed
      EXPECT_EQ(hs, std::vector<uint32_t>({0u, 0u}));
      continue;
    }
    EXPECT_EQ(hs, std::vector<uint32_t>({1u, 1u})) << "variant " << variant;
    for (int32_t v : h0) ASSERT_EQ(v, -1) << "variant " << variant;
    for (size_t i = 0; i < static_cast<size_t>(b1.num_requests) * 2 * 16; ++i) ASSERT_EQ(h1[i], -1);
    EXPECT_NE(step_status_message(hs[0], "DecodePlan::merge").find("DecodePlan::merge"), std::string::npos);
  }
  // the merge reads only seq_lens: a batch without q and block table merges as the full one
  {
    DevDecode d0(s.req, s.q, H, Q);
    DeviceDecodeBatch b0 = dev_batch(d0), lean = b0;
    lean.q = nullptr;
    lean.block_table = nullptr;
    DevArr<uint8_t> ws0(plans[0].workspace_bytes()), ws1(plans[1].workspace_bytes()), recv(rec * W);
    ws0.fill_bytes(0);
    ws1.fill_bytes(0);
    plans[0].publish(s.dcache(0), 0, b0, ws0.get(), ws0.size(), recv.get(), nullptr);
    plans[1].publish(s.dcache(1), 0, b0, ws1.get(), ws1.size(), recv.get() + rec, nullptr);
    DevArr<int32_t> full(3 * 2 * 16), part(3 * 2 * 16);
    plans[0].merge(b0, recv.get(), full.get(), nullptr, nullptr);
    plans[0].merge(lean, recv.get(), part.get(), nullptr, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(full.host(), part.host());
  }
  // the synchronous per-rank call turns a disagreement into an Error on every rank
  std::vector<std::string> msg(2);
  cuda::run_device_ranks(2, [&](int r, Communicator& comm, cuda::Stream st) {
    Requests mine = s.req;
    if (r == 1) mine.seq_lens[0] -= 1;
    DevDecode d(mine, s.q, H, Q);
    DevArr<int32_t> out(3 * 2 * 16);
    try {
      cuda::icp_decode(comm, s.dcache(r), 0, d.b, lim.sel, c.k_rounding, out.get(), st);
    } catch (const Error& e) {
      msg[r] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) EXPECT_NE(msg[r].find("icp_decode: the ranks of the TP group ran different steps"), std::string::npos) << msg[r];
}

// Host-side refusals name the argument, and a refused call enqueues nothing.
TEST(GpuPlan, RefusalsNameTheArgument) {
  REQUIRE_GPU();
  const ResolvedConfig c = config(KvDtype::kNvfp4, 128, 2, 4, 1, Mode::kSharded);
  Scene s(c, {1000, 2000}, 8u, false);
  const DecodeLimits lim = limits_of(s, 2);
  cuda::DecodePlan plan(c, 0, lim);
  DevArr<uint8_t> ws(plan.workspace_bytes());
  DevArr<int32_t> out(2 * 2 * 16);
  DevDecode d(s.req, s.q, 4, 1);
  DeviceDecodeBatch b = dev_batch(d);
  cuda::DeviceGroup group(2);
  auto run = [&](const CacheView& cache, DeviceDecodeBatch bb, size_t wsb, Communicator* comm) {
    plan.run(cache, 0, bb, ws.get(), wsb, out.get(), comm, nullptr, nullptr);
  };
  DeviceDecodeBatch big = b;
  big.num_requests = 3;
  EXPECT_NE(error_of([&] { run(s.dcache(0), big, ws.size(), &group.comm(0)); }).find("num_requests = 3 exceeds the plan's limits.max_requests = 2"),
            std::string::npos);
  EXPECT_NE(error_of([&] { run(s.dcache(0), b, ws.size() - 1, &group.comm(0)); }).find("workspace_bytes"), std::string::npos);
  EXPECT_NE(error_of([&] { run(s.dcache(1), b, ws.size(), &group.comm(0)); }).find("cache is rank 1's"), std::string::npos);
  EXPECT_NE(error_of([&] { run(s.hcache(0), b, ws.size(), &group.comm(0)); }).find("cache"), std::string::npos);
  EXPECT_NE(error_of([&] { run(s.dcache(0), b, ws.size(), nullptr); }).find("comm is null"), std::string::npos);
  EXPECT_NE(error_of([&] { run(s.dcache(0), b, ws.size(), &group.comm(1)); }).find("comm is rank 1's"), std::string::npos);
  DeviceDecodeBatch nul = b;
  nul.seq_lens = nullptr;
  EXPECT_NE(error_of([&] { run(s.dcache(0), nul, ws.size(), &group.comm(0)); }).find("seq_lens is null"), std::string::npos);
  cuda::DeviceCache fp8(make_page_layout(KvDtype::kFp8, 128, 2), s.req.num_pages, 1, 0);
  EXPECT_NE(error_of([&] { run(fp8, b, ws.size(), &group.comm(0)); }).find("cache has layout fp8"), std::string::npos);
  DecodeLimits bad = lim;
  bad.max_requests = 0;
  EXPECT_NE(error_of([&] { cuda::DecodePlan p(c, 0, bad); }).find("limits.max_requests"), std::string::npos);
  bad = lim;
  bad.heads = 3;
  EXPECT_NE(error_of([&] { cuda::DecodePlan p(c, 0, bad); }), "(no error)");
  EXPECT_NE(error_of([&] { cuda::DecodePlan p(c, 2, lim); }).find("rank = 2"), std::string::npos);
  EXPECT_NE(error_of([&] { cuda::DecodePlan p(c, 0, bad); }).find("limits."), std::string::npos);
  bad = lim;
  bad.max_pages = 1 << 23;  // 2^30 tokens at P = 128: beyond the scorer, refused at construction
  EXPECT_NE(error_of([&] { cuda::DecodePlan p(c, 0, bad); }).find("limits.max_pages"), std::string::npos);
  cuda::DecodePlan repl(config(KvDtype::kNvfp4, 128, 2, 4, 1, Mode::kReplicated), 0, lim);
  EXPECT_NE(error_of([&] { repl.publish(s.dcache(0), 0, b, ws.get(), ws.size(), ws.get(), nullptr); }).find("exchanges nothing"),
            std::string::npos);
  EXPECT_EQ(repl.exchange_bytes(), 0u);
  // nothing was enqueued by the refused calls: the output is still untouched
  out.fill_bytes(0x22);
  EXPECT_THROW(run(s.dcache(0), big, ws.size(), &group.comm(0)), Error);
  CUDA_OK(cudaDeviceSynchronize());
  for (int32_t v : out.host()) ASSERT_EQ(v, 0x22222222);
}

// ---- prefill --------------------------------------------------------------------------------

struct PrefillScene {
  Scene s;
  std::vector<int32_t> qs;
  std::vector<uint8_t> qp;
  PrefillScene(const ResolvedConfig& c, const std::vector<int32_t>& lens, const std::vector<int32_t>& chunk, uint32_t seed)
      : s(c, lens, seed, false) {
    qs.push_back(0);
    for (int32_t t : chunk) qs.push_back(qs.back() + t);
    qp = make_q(qs.back(), s.H, seed + 9);
  }
};

struct DevPrefill {
  DevArr<uint8_t> q;
  DevArr<int32_t> bt, sl, qs;
  PrefillBatch b;
  DevPrefill(const PrefillScene& p) : q(p.qp), bt(p.s.req.block_table), sl(p.s.req.seq_lens), qs(p.qs) {
    b = prefill_batch(p.s.req, p.qp, p.s.H, p.qs);
    b.q = q.get();
    b.block_table = bt.get();
    b.seq_lens = sl.get();
    b.query_start = qs.get();
  }
  DevicePrefillBatch dev() const { return DevicePrefillBatch{b.q, b.block_table, b.seq_lens, b.query_start, b.num_requests}; }
};

// Each prefill path (replicated, gather with one and with several chunks, local_score) equals the
// existing entry point bit for bit; a gather extent below the chunk's units gives status 2 and -1.
TEST(GpuPlan, PrefillEqualsTheExistingEntryPointsBitForBit) {
  REQUIRE_GPU();
  struct V {
    Mode m;
    PrefillCp pcp;
    int64_t budget_mib;
    int32_t P, W;
  };
  for (const V v : {V{Mode::kReplicated, PrefillCp::kGather, 256, 128, 2}, V{Mode::kSharded, PrefillCp::kGather, 256, 128, 2},
                    V{Mode::kSharded, PrefillCp::kGather, 1, 256, 2}, V{Mode::kSharded, PrefillCp::kGather, 1, 128, 4},
                    V{Mode::kSharded, PrefillCp::kLocalScore, 256, 256, 2}, V{Mode::kSharded, PrefillCp::kLocalScore, 256, 128, 4}}) {
    const ResolvedConfig c = config(KvDtype::kNvfp4, v.P, v.W, 4, 1, v.m, v.pcp, v.budget_mib);
    PrefillScene p(c, {9000, 20000, 600, 0}, {700, 300, 600, 0}, 23u + v.P + v.W);
    const std::string tag = std::string(to_string(prefill_path(c))) + " P" + std::to_string(v.P) + " W" +
                            std::to_string(v.W) + " budget " + std::to_string(v.budget_mib) + " MiB";
    DevPrefill d(p);
    const PrefillExtents e = prefill_extents(prefill_batch(p.s.req, p.qp, 4, p.qs), v.P);
    EXPECT_EQ(e.rows, 1600);
    EXPECT_EQ(e.max_rows_per_request, 700);
    PrefillLimits lim;
    lim.max_requests = 6;
    lim.max_pages = p.s.req.max_pages;
    lim.max_rows = 2048;
    lim.heads = 4;
    SelectionParams sel;
    for (int variant = 0; variant < 2; ++variant) {  // 0: exact extents, 1: too few gather units
      if (variant == 1 && prefill_path(c) != PrefillPath::kGather) continue;
      PrefillExtents ee = e;
      if (variant == 1) ee.gather_units = e.gather_units - 1;
      std::vector<std::vector<int32_t>> got(v.W), want(v.W);
      std::vector<uint32_t> stat(v.W, 77u);
      std::vector<int64_t> chunks(v.W);
      cuda::run_device_ranks(v.W, [&](int r, Communicator& comm, cuda::Stream st) {
        cuda::PrefillPlan plan(c, r, lim);
        DevArr<uint8_t> ws(plan.workspace_bytes());
        ws.fill_bytes(0);
        DevArr<int32_t> out(static_cast<size_t>(e.rows) * plan.num_heads() * 16);
        DevArr<uint32_t> status(1);
        plan.run(p.s.dcache(r), 0, d.dev(), ee, ws.get(), ws.size(), out.get(), &comm, status.get(), st);
        cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(st));
        got[r] = out.host();
        stat[r] = status.host()[0];
        chunks[r] = plan.gather_chunks(ee);
        DevArr<int32_t> out2(out.size());
        if (prefill_path(c) == PrefillPath::kGather) {
          const GatherStats gs = cuda::prefill_gather(comm, p.s.dcache(r), 0, d.b, sel, c.prefill_gather_budget_bytes,
                                                      out2.get(), st);
          if (variant == 0) EXPECT_EQ(gs.chunks, chunks[r]) << tag;
          EXPECT_EQ(gs.pages, e.gather_units) << tag;
        } else if (prefill_path(c) == PrefillPath::kLocalScore) {
          cuda::prefill_local_score(comm, p.s.dcache(r), 0, d.b, sel, out2.get(), st);
        } else {
          cuda::prefill_select(p.s.dcache(r), 0, d.b, plan.head_begin(), plan.num_heads(), sel, out2.get(), st);
        }
        want[r] = out2.host();
      });
      for (int32_t r = 0; r < v.W; ++r) {
        if (variant == 0) {
          EXPECT_EQ(got[r], want[r]) << tag << " rank " << r;
          if (prefill_path(c) != PrefillPath::kReplicated) EXPECT_EQ(stat[r], 0u) << tag;
        } else {
          EXPECT_EQ(stat[r], 2u) << tag;
          for (int32_t x : got[r]) ASSERT_EQ(x, -1) << tag;
        }
      }
      if (v.budget_mib == 1 && variant == 0) EXPECT_GT(chunks[0], 1) << tag << ": the test wants several chunks";
    }
  }
}

// The prefill plans on exact keys equal the CPU plans bit for bit (every path; the gather in
// several chunks, its unit lists built on the device). Small enough for racecheck.
TEST(GpuPlan, PrefillEqualsTheCpuPlan) {
  REQUIRE_GPU();
  for (PrefillCp pcp : {PrefillCp::kGather, PrefillCp::kLocalScore})
    for (Mode m : {Mode::kSharded, Mode::kReplicated}) {
      if (m == Mode::kReplicated && pcp == PrefillCp::kLocalScore) continue;
      const ResolvedConfig c = config(KvDtype::kNvfp4, 128, 2, 4, 1, m, pcp, 1);
      Scene s(c, {2700, 900, 3300}, 71u, true);
      std::vector<int32_t> qs = {0, 40, 100, 130};
      const auto qp = int_q(130, 4, 72u);
      const PrefillBatch hb = prefill_batch(s.req, qp, 4, qs);
      const PrefillExtents e = prefill_extents(hb, 128);
      PrefillLimits lim;
      lim.max_requests = 3;
      lim.max_pages = s.req.max_pages;
      lim.max_rows = 130;
      lim.heads = 4;
      DevArr<uint8_t> q(qp);
      DevArr<int32_t> bt(s.req.block_table), sl(s.req.seq_lens), qsd(qs);
      const DevicePrefillBatch db{q.get(), bt.get(), sl.get(), qsd.get(), 3};
      std::vector<std::vector<int32_t>> g(2), h(2);
      cuda::run_device_ranks(2, [&](int r, Communicator& comm, cuda::Stream st) {
        cuda::PrefillPlan plan(c, r, lim);
        DevArr<uint8_t> ws(plan.workspace_bytes());
        ws.fill_bytes(0);
        DevArr<int32_t> out(static_cast<size_t>(130) * plan.num_heads() * 16);
        plan.run(s.dcache(r), 0, db, e, ws.get(), ws.size(), out.get(), &comm, nullptr, st);
        cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(st));
        g[r] = out.host();
      });
      run_ranks(2, [&](int r, Communicator& comm) {
        PrefillPlan plan(c, r, lim);
        std::vector<uint8_t> ws(plan.workspace_bytes() + 16);
        void* w = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.data()) + 15) / 16 * 16);
        h[r].assign(static_cast<size_t>(130) * plan.num_heads() * 16, 0);
        const DevicePrefillBatch hd{hb.q, hb.block_table, hb.seq_lens, hb.query_start, 3};
        plan.run(s.hcache(r), 0, hd, e, w, plan.workspace_bytes(), h[r].data(), &comm);
      });
      for (int r = 0; r < 2; ++r) EXPECT_EQ(g[r], h[r]) << to_string(prefill_path(c)) << " rank " << r;
    }
}

// A replicated prefill chunk captured in a graph and replayed with another chunk's metadata
// (same extents) equals eager; no allocation node.
TEST(GpuPlan, PrefillGraphReplayEqualsEager) {
  REQUIRE_GPU();
  const ResolvedConfig c = config(KvDtype::kFp8, 128, 1, 4, 1, Mode::kReplicated);
  PrefillScene p(c, {9000, 5000}, {500, 500}, 61u);
  DevPrefill d(p);
  const PrefillExtents e = prefill_extents(prefill_batch(p.s.req, p.qp, 4, p.qs), 128);
  PrefillLimits lim;
  lim.max_requests = 2;
  lim.max_pages = p.s.req.max_pages;
  lim.max_rows = 1000;
  lim.heads = 4;
  cuda::PrefillPlan plan(c, 0, lim);
  DevArr<uint8_t> ws(plan.workspace_bytes());
  DevArr<int32_t> out(1000 * 4 * 16);
  cudaStream_t st;
  CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaGraph_t g = nullptr;
  CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  plan.run(p.s.dcache(0), 0, d.dev(), e, ws.get(), ws.size(), out.get(), nullptr, nullptr, S(st));
  CUDA_OK(cudaStreamEndCapture(st, &g));
  EXPECT_FALSE(graph_has_alloc_node(g));
  cudaGraphExec_t ge = nullptr;
  CUDA_OK(cudaGraphInstantiate(&ge, g, 0));
  // another chunk: both requests 500 tokens further on, new q
  std::vector<int32_t> lens2 = {8000, 4200};
  const auto q2 = make_q(1000, 4, 5u);
  d.sl.upload(lens2);
  d.q.upload(q2);
  CUDA_OK(cudaGraphLaunch(ge, st));
  CUDA_OK(cudaStreamSynchronize(st));
  const auto got = out.host();
  DevArr<int32_t> want(out.size());
  PrefillBatch hb = d.b;
  cuda::prefill_select(p.s.dcache(0), 0, hb, 0, 4, SelectionParams{}, want.get(), S(st));
  EXPECT_EQ(got, want.host());
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  CUDA_OK(cudaStreamDestroy(st));
}

// The device group keeps the collectives' contract as the host group does: different byte counts
// are refused on every rank (nothing is copied), and a rank that returns ends its peer's wait.
TEST(GpuCollectives, DeviceGroupRefusesMismatchesAndDepartures) {
  REQUIRE_GPU();
  std::vector<std::string> msg(2);
  cuda::run_device_ranks(2, [&](int r, Communicator& comm, cuda::Stream st) {
    DevArr<uint8_t> send(1920), recv(2 * 1920);
    try {
      comm.all_gather(send.get(), recv.get(), r == 0 ? 1920 : 960, st);
    } catch (const Error& e) {
      msg[r] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(msg[r].find("all_gather: the ranks passed different byte counts: rank 0 1920 bytes, rank 1 960 bytes"),
              std::string::npos)
        << msg[r];
  std::string waited;
  cuda::run_device_ranks(2, [&](int r, Communicator& comm, cuda::Stream st) {
    if (r == 1) return;
    DevArr<uint8_t> send(64), recv(128);
    try {
      comm.all_gather(send.get(), recv.get(), 64, st);
    } catch (const Error& e) {
      waited = e.what();
    }
  });
  EXPECT_NE(waited.find("rank 1 returned without making the all_gather that rank 0 waits in"), std::string::npos) << waited;
}

}  // namespace
