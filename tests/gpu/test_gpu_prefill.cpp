// GPU FP8 staging (C07), replicated / gather / local_score prefill, prefill == decode on the
// same keys, and the CUDA TpIndexer against the CPU one.
#include <bit>
#include <cmath>
#include <cstring>

#include "gpu_util.hpp"
#include "indexcp/config.hpp"
#include "indexcp/error.hpp"
#include "indexcp/tp_group.hpp"

using namespace gpu;

namespace {

PrefillBatch host_prefill(const PrefillScene& s) {
  PrefillBatch b;
  b.q = s.q.data();
  b.heads = s.heads;
  b.block_table = s.req.block_table.data();
  b.num_requests = static_cast<int32_t>(s.req.seq_lens.size());
  b.max_pages = s.req.max_pages;
  b.seq_lens = s.req.seq_lens.data();
  b.query_start = s.qs.data();
  return b;
}

}  // namespace

TEST(GpuStage, StagingEqualsCpuOnShards) {
  REQUIRE_GPU();
  for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8})
    for (int32_t P : {128, 256})
      for (int32_t W : {1, 2, 4, 8}) {
        auto req = make_requests({2000, 513}, P, 5u + W);
        std::vector<float> keys;
        std::vector<int64_t> slots;
        make_keys(req, 6u + P, keys, slots);
        auto host = make_shards(dt, req, W, keys, slots);
        auto dev = device_shards(dt, req, W, keys, slots);
        std::vector<int32_t> pages;
        for (int i = 0; i < 40; ++i) pages.push_back(static_cast<int32_t>((i * 7) % req.num_pages));
        DevArr<int32_t> dp(pages);
        for (int32_t r = 0; r < W; ++r) {
          const int32_t R = P / W;
          std::vector<uint8_t> ref(pages.size() * R * 128);
          stage_fp8(host[r], 0, pages.data(), static_cast<int64_t>(pages.size()), ref.data());
          DevArr<uint8_t> out(ref.size());
          cuda::stage_fp8(dev[r], 0, dp.get(), static_cast<int64_t>(pages.size()), out.get(), nullptr);
          EXPECT_EQ(out.host(), ref) << to_string(dt) << " P" << P << " W" << W << " rank " << r;
        }
      }
}

// C07: 65,535, 65,536 and 131,073 stock pages staged in one call, every page equal to the CPU's.
TEST(GpuCases, C07_MoreThan65535PagesInOneCall) {
  REQUIRE_GPU();
  const int64_t distinct = 1024;
  const PageLayout l = make_page_layout(KvDtype::kNvfp4, 128, 1);
  IndexCache host(l, distinct, 1, 0);
  std::mt19937 rng(7);
  for (int64_t i = 0; i < host.size_bytes(); ++i) host.data()[i] = static_cast<uint8_t>(rng());
  for (int64_t p = 0; p < distinct; ++p)  // valid scale bytes (no E4M3 NaN)
    for (int32_t j = 0; j < 128 * 8; ++j) {
      uint8_t& b = host.page_ptr(0, p)[128 * 64 + j];
      if ((b & 0x7f) == 0x7f) b = 0x7e;
    }
  cuda::DeviceCache dev(l, distinct, 1, 0);
  dev.upload(host);
  std::vector<uint8_t> ref(static_cast<size_t>(distinct) * 128 * 128);
  std::vector<int32_t> all(distinct);
  for (int32_t i = 0; i < distinct; ++i) all[i] = i;
  stage_fp8(host, 0, all.data(), distinct, ref.data());
  for (int64_t n : {int64_t{65535}, int64_t{65536}, int64_t{131073}}) {
    std::vector<int32_t> pages(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) pages[i] = static_cast<int32_t>((i * 2654435761u) % distinct);
    DevArr<int32_t> dp(pages);
    DevArr<uint8_t> out(static_cast<size_t>(n) * 128 * 128);
    out.fill_bytes(0xEE);
    cuda::stage_fp8(dev, 0, dp.get(), n, out.get(), nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const auto o = out.host();
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(std::memcmp(o.data() + i * 128 * 128, ref.data() + static_cast<int64_t>(pages[i]) * 128 * 128, 128 * 128), 0)
          << n << " pages: page " << i << " differs";
  }
}

TEST(GpuPrefill, ReplicatedMatchesCpu) {
  REQUIRE_GPU();
  for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8})
    for (int32_t P : {128, 256})
      for (bool exact : {true, false}) {
        auto s = prefill_scene(P, 31u + P, exact);
        auto host = make_shards(dt, s.req, 1, s.keys, s.slots);
        auto dev = device_shards(dt, s.req, 1, s.keys, s.slots);
        DevPrefill d(s);
        const PrefillBatch hb = host_prefill(s);
        SelectionParams sel;
        std::vector<int32_t> cpu(s.qs.back() * s.heads * 16);
        prefill_select(host[0], 0, hb, 0, s.heads, sel, cpu.data());
        DevArr<int32_t> out(cpu.size());
        cuda::prefill_select(dev[0], 0, d.b, 0, s.heads, sel, out.get(), nullptr);
        const auto g = out.host();
        if (exact) {
          EXPECT_EQ(g, cpu) << to_string(dt) << " P" << P;
        } else {
          const auto rows = prefill_rows(hb, s.req.num_pages, P);
          compare_selections(g, cpu, ref_scores(host[0], s.req, rows, s.q, s.heads, KRounding::kE4m3), rows, s.heads, 16,
                             "prefill " + to_string(dt));
        }
      }
}

// Prefill scores E4M3 keys: on an NVFP4 cache its selection of the last Q rows of each request
// equals decode's with E4M3 rounding, bit for bit (the same dot products).
TEST(GpuPrefill, PrefillEqualsDecodeOnTheSameKeys) {
  REQUIRE_GPU();
  for (int32_t P : {128, 256}) {
    auto req = make_requests({3000, 700, 2300}, P, 71);
    std::vector<float> keys;
    std::vector<int64_t> slots;
    make_keys(req, 72, keys, slots);
    auto dev = device_shards(KvDtype::kNvfp4, req, 1, keys, slots);
    const int32_t Q = 8, H = 4;
    const auto q = make_q(3 * Q, H, 73);
    DevDecode dd(req, q, H, Q);
    DevArr<int32_t> dec(3 * Q * H * 16), pre(3 * Q * H * 16);
    cuda::decode_select(dev[0], 0, dd.b, 0, H, SelectionParams{}, KRounding::kE4m3, dec.get(), nullptr);
    std::vector<int32_t> qs = {0, Q, 2 * Q, 3 * Q};
    DevArr<int32_t> dqs(qs);
    PrefillBatch pb;
    pb.q = dd.q.get();
    pb.heads = H;
    pb.block_table = dd.bt.get();
    pb.num_requests = 3;
    pb.max_pages = req.max_pages;
    pb.seq_lens = dd.sl.get();
    pb.query_start = dqs.get();
    cuda::prefill_select(dev[0], 0, pb, 0, H, SelectionParams{}, pre.get(), nullptr);
    EXPECT_EQ(pre.host(), dec.host()) << "P" << P;
  }
}

// gather and local_score prefill on shards equal the replicated GPU prefill bit for bit, for every
// (P, W), with budgets that force many chunks; the gather's stats equal the CPU's.
TEST(GpuPrefill, GatherAndLocalScoreEqualReplicated) {
  REQUIRE_GPU();
  for (int32_t P : {128, 256})
    for (int32_t W : {2, 4, 8})
      for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8}) {
        auto s = prefill_scene(P, 81u + W, false);
        auto repl = device_shards(dt, s.req, 1, s.keys, s.slots);
        auto shards = device_shards(dt, s.req, W, s.keys, s.slots);
        auto host = make_shards(dt, s.req, W, s.keys, s.slots);
        DevPrefill d(s);
        SelectionParams sel;
        const size_t n = static_cast<size_t>(s.qs.back()) * s.heads * 16;
        DevArr<int32_t> ref(n);
        cuda::prefill_select(repl[0], 0, d.b, 0, s.heads, sel, ref.get(), nullptr);
        const auto r = ref.host();
        const int64_t unit = gather_unit_bytes(shards[0].layout());
        for (int64_t budget : {unit, unit * 5, int64_t{256} << 20}) {
          std::vector<std::vector<int32_t>> per(W);
          std::vector<GatherStats> gst(W), cst(W);
          cuda::run_device_ranks(W, [&](int rank, Communicator& comm, cuda::Stream st) {
            int32_t h0, nh;
            owned_heads(s.heads, W, rank, &h0, &nh);
            DevArr<int32_t> o(static_cast<size_t>(s.qs.back()) * nh * 16);
            gst[rank] = cuda::prefill_gather(comm, shards[rank], 0, d.b, sel, budget, o.get(), st);
            per[rank] = o.host();
          });
          const bool with_cpu = dt == KvDtype::kFp8 && budget == unit * 5;  // stats do not depend on dtype
          if (with_cpu)
            run_ranks(W, [&](int rank, Communicator& comm) {
              int32_t h0, nh;
              owned_heads(s.heads, W, rank, &h0, &nh);
              std::vector<int32_t> o(static_cast<size_t>(s.qs.back()) * nh * 16);
              cst[rank] = prefill_gather(comm, host[rank], 0, host_prefill(s), sel, budget, o.data());
            });
          for (int32_t rank = 0; rank < W; ++rank) {
            if (with_cpu) {
              EXPECT_EQ(gst[rank].reserved_bytes, cst[rank].reserved_bytes);
              EXPECT_EQ(gst[rank].chunks, cst[rank].chunks);
              EXPECT_EQ(gst[rank].pages, cst[rank].pages);
              EXPECT_EQ(gst[rank].gathered_bytes, cst[rank].gathered_bytes);
            }
            int32_t h0, nh;
            owned_heads(s.heads, W, rank, &h0, &nh);
            for (int64_t row = 0; row < s.qs.back(); ++row)
              for (int32_t hh = 0; hh < nh; ++hh)
                for (int k = 0; k < 16; ++k)
                  ASSERT_EQ(per[rank][(row * nh + hh) * 16 + k], r[(row * s.heads + h0 + hh) * 16 + k])
                      << "gather P" << P << " W" << W << " budget " << budget << " rank " << rank << " row " << row;
          }
        }
        std::vector<std::vector<int32_t>> per(W);
        cuda::run_device_ranks(W, [&](int rank, Communicator& comm, cuda::Stream st) {
          int32_t h0, nh;
          owned_heads(s.heads, W, rank, &h0, &nh);
          DevArr<int32_t> o(static_cast<size_t>(s.qs.back()) * nh * 16);
          cuda::prefill_local_score(comm, shards[rank], 0, d.b, sel, o.get(), st);
          per[rank] = o.host();
        });
        for (int32_t rank = 0; rank < W; ++rank) {
          int32_t h0, nh;
          owned_heads(s.heads, W, rank, &h0, &nh);
          for (int64_t row = 0; row < s.qs.back(); ++row)
            for (int32_t hh = 0; hh < nh; ++hh)
              for (int k = 0; k < 16; ++k)
                ASSERT_EQ(per[rank][(row * nh + hh) * 16 + k], r[(row * s.heads + h0 + hh) * 16 + k])
                    << "local_score P" << P << " W" << W << " rank " << rank << " row " << row;
        }
      }
}

// The CUDA TpIndexer (what `indexcp run --backend cuda` and replay drive) against the CPU one on
// exact data: identical selections on every path.
TEST(GpuTpIndexer, EqualsCpuOnEveryPath) {
  REQUIRE_GPU();
  struct Cfg {
    std::string json;
    int32_t tp, P;
  };
  const std::vector<Cfg> cfgs = {
      {R"({"indexer_kv_dtype": "nvfp4", "indexer_cache_sharding": "on"})", 2, 128},
      {R"({"indexer_kv_dtype": "nvfp4", "indexer_cache_sharding": "on", "indexer_prefill_cp": "local_score"})", 4, 256},
      {R"({"indexer_kv_dtype": "nvfp4", "indexer_cache_sharding": "on"})", 2, 256},
      {R"({"indexer_kv_dtype": "fp8", "indexer_cache_sharding": "off"})", 2, 128},
      {R"({"indexer_kv_dtype": "fp8", "indexer_decode_cp": true})", 2, 128},
      {R"({"indexer_kv_dtype": "nvfp4", "indexer_k_rounding": "exact", "indexer_cache_sharding": "on"})", 8, 128},
  };
  for (const auto& c : cfgs) {
    EngineParams e;
    e.tp = c.tp;
    e.page_size = c.P;
    e.heads = 4;
    e.query_len = 8;
    const ResolvedConfig rc = resolve_config(AttentionConfig::from_json(c.json), e);
    auto s = prefill_scene(c.P, 101, true);
    auto cpu = make_cpu_tp_indexer(rc, s.req.num_pages);
    auto gpu = make_tp_indexer("cuda", rc, s.req.num_pages);
    EXPECT_EQ(gpu->backend(), "cuda");
    EXPECT_EQ(gpu->cache_bytes_per_rank(), cpu->cache_bytes_per_rank());
    cpu->insert(s.keys.data(), s.slots.data(), static_cast<int64_t>(s.slots.size()));
    gpu->insert(s.keys.data(), s.slots.data(), static_cast<int64_t>(s.slots.size()));
    SelectionParams sel;
    const auto q = int_q(static_cast<int64_t>(s.req.seq_lens.size()) * 8, 4, 5);
    const DecodeBatch db = host_batch(s.req, q, 4, 8);
    StepStats st;
    EXPECT_EQ(gpu->decode(db, sel, &st), cpu->decode(db, sel)) << c.json << " tp " << c.tp << " decode";
    EXPECT_GT(st.wall_us, 0);
    const PrefillBatch pb = host_prefill(s);
    EXPECT_EQ(gpu->prefill(pb, sel), cpu->prefill(pb, sel)) << c.json << " tp " << c.tp << " prefill";
    if (!rc.sharding) {
      const auto gs = gpu->decode_scores(db), cs = cpu->decode_scores(db);
      ASSERT_EQ(gs.size(), cs.size());
      EXPECT_EQ(gs, cs) << "exact data: scores identical";
    }
    // refusals: same messages as the CPU
    auto bad = s.slots;
    bad[3] = bad[4];
    std::string cm, gm;
    try { cpu->insert(s.keys.data(), bad.data(), static_cast<int64_t>(bad.size())); } catch (const Error& e) { cm = e.what(); }
    try { gpu->insert(s.keys.data(), bad.data(), static_cast<int64_t>(bad.size())); } catch (const Error& e) { gm = e.what(); }
    EXPECT_FALSE(gm.empty());
    EXPECT_EQ(gm, cm);
  }
}

// Rank indexers (make_cuda_rank_indexer, as under `indexcp launch`) on a DeviceGroup of one GPU:
// they check first that the ranks were given the same config and cache size (config.hpp,
// RankAgreement), naming what differs on every rank; ranks that agree equal the simulated group.
TEST(GpuTpIndexer, RankIndexersAgreeFirstThenEqualTheSimulatedGroup) {
  REQUIRE_GPU();
  EngineParams e;
  e.tp = 2;
  e.page_size = 128;
  e.query_len = 8;
  const ResolvedConfig rc =
      resolve_config(AttentionConfig::from_json(R"({"indexer_kv_dtype": "nvfp4", "indexer_cache_sharding": "on"})"), e);
  auto s = prefill_scene(128, 203, true);
  const int64_t n = static_cast<int64_t>(s.slots.size());
  const auto q = int_q(static_cast<int64_t>(s.req.seq_lens.size()) * 8, 4, 7);
  const DecodeBatch db = host_batch(s.req, q, 4, 8);
  SelectionParams sel;
  auto sim = make_tp_indexer("cuda", rc, s.req.num_pages);
  sim->insert(s.keys.data(), s.slots.data(), n);
  const auto want = sim->decode(db, sel);
  std::vector<std::vector<int32_t>> got(2);
  std::vector<int64_t> bytes(2);
  cuda::run_device_ranks(2, [&](int r, Communicator& comm, cuda::Stream) {
    auto ix = make_cuda_rank_indexer(rc, s.req.num_pages, comm);
    bytes[r] = ix->cache_bytes_per_rank();
    ix->insert(s.keys.data(), s.slots.data(), n);
    got[r] = ix->decode(db, sel);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(got[r], want) << "rank " << r;
    EXPECT_EQ(bytes[r], sim->cache_bytes_per_rank());
  }
  // rank 1 started with another page size: neither rank makes its cache, both say what differs
  e.page_size = 256;
  const ResolvedConfig rc256 = resolve_config(rc.requested, e);
  std::vector<std::string> msg(2);
  cuda::run_device_ranks(2, [&](int r, Communicator& comm, cuda::Stream) {
    try {
      make_cuda_rank_indexer(r == 0 ? rc : rc256, s.req.num_pages, comm);
    } catch (const Error& err) {
      msg[r] = err.what();
    }
  });
  for (int r = 0; r < 2; ++r)
    for (const char* needle : {"disagree on page_size", "rank 0 has 128", "rank 1 has 256"})
      EXPECT_NE(msg[r].find(needle), std::string::npos) << "rank " << r << ": '" << msg[r] << "'";
  // the check on its own, on the ranks' streams: another cache size
  cuda::run_device_ranks(2, [&](int r, Communicator& comm, cuda::Stream st) {
    msg[r].clear();
    try {
      cuda::check_rank_agreement(comm, rc, r == 0 ? 40 : 41, st);
    } catch (const Error& err) {
      msg[r] = err.what();
    }
  });
  for (int r = 0; r < 2; ++r) EXPECT_NE(msg[r].find("num_pages"), std::string::npos) << "rank " << r << ": '" << msg[r] << "'";
  cuda::run_device_ranks(2, [&](int, Communicator& comm, cuda::Stream st) { cuda::check_rank_agreement(comm, rc, 40, st); });
}

// prefill_scores (the capturable scorer of prefill): on exact data its block scores equal the
// CPU's score_blocks bit for bit (E4M3 keys), -Inf where no score exists, eagerly and replayed
// from a CUDA graph; refusals name the argument.
TEST(GpuPrefill, PrefillScoresEqualCpuAndReplayFromAGraph) {
  REQUIRE_GPU();
  for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8})
    for (int32_t P : {128, 256}) {
      auto s = prefill_scene(P, 57u + P, true);
      auto host = make_shards(dt, s.req, 1, s.keys, s.slots);
      auto dev = device_shards(dt, s.req, 1, s.keys, s.slots);
      DevPrefill d(s);
      const PrefillBatch hb = host_prefill(s);
      const auto rows = prefill_rows(hb, s.req.num_pages, P);
      const int32_t h0 = 1, nh = 2;
      const BlockScores ref = score_blocks(host[0], 0, rows, s.req.block_table.data(), s.req.max_pages, s.q.data(),
                                           s.heads, h0, nh, KRounding::kE4m3);
      const int32_t max_rows = max_rows_of(s.qs);
      const int64_t nrows = s.qs.back();
      DevArr<float> out(static_cast<size_t>(nrows) * nh * ref.max_blocks);
      // Every query slice of a CTA (8 NT vectors) scores only the blocks historical for its last
      // row (score/schedule.cuh, Slice): 128 vectors per CTA (the default here: 700 rows x 2
      // heads), 8 and 32 (slices of 4 and 16 rows, which end on every side of a block boundary of
      // the 700-row request), and the plan in global memory, which does not cap the slices.
      std::vector<float> g;
      for (const char* variant : {"", "max_nt=1", "max_nt=4", "plan=kernel"}) {
        ScopedEnv max_nt("INDEXCP_SCORE_MAX_NT"), plan_env("INDEXCP_SCORE_PLAN");
        max_nt.set(std::strcmp(variant, "max_nt=1") == 0 ? "1" : std::strcmp(variant, "max_nt=4") == 0 ? "4" : "");
        plan_env.set(std::strcmp(variant, "plan=kernel") == 0 ? "kernel" : "");
        out.fill_bytes(0x7f);
        cuda::prefill_scores(dev[0], 0, d.b, nrows, max_rows, h0, nh, out.get(), nullptr);
        CUDA_OK(cudaDeviceSynchronize());
        g = out.host();
        ASSERT_EQ(g.size(), ref.score.size());
        int64_t valid = 0;
        for (size_t i = 0; i < g.size(); ++i) {
          if (ref.valid[i]) {
            ++valid;
            ASSERT_EQ(g[i], ref.score[i]) << to_string(dt) << " P" << P << " " << variant << " entry " << i;
          } else {
            ASSERT_TRUE(std::isinf(g[i]) && g[i] < 0)
                << to_string(dt) << " P" << P << " " << variant << " entry " << i << " = " << g[i];
          }
        }
        EXPECT_GT(valid, 1000);
      }
      // the same from a CUDA graph, after the output was overwritten
      cudaStream_t st;
      CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      cuda::prefill_scores(dev[0], 0, d.b, nrows, max_rows, h0, nh, out.get(), reinterpret_cast<cuda::Stream>(st));
      CUDA_OK(cudaStreamEndCapture(st, &graph));
      CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
      out.fill_bytes(0);
      CUDA_OK(cudaDeviceSynchronize());
      CUDA_OK(cudaGraphLaunch(exec, st));
      CUDA_OK(cudaStreamSynchronize(st));
      EXPECT_EQ(out.host(), g) << "graph replay differs from the eager call";
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      cudaStreamDestroy(st);
    }
  auto s = prefill_scene(128, 5, true);
  auto dev = device_shards(KvDtype::kNvfp4, s.req, 1, s.keys, s.slots);
  auto shards = device_shards(KvDtype::kNvfp4, s.req, 2, s.keys, s.slots);
  DevPrefill d(s);
  DevArr<float> out(1 << 20);
  auto expect_msg = [](auto&& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one naming " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_msg([&] { cuda::prefill_scores(shards[0], 0, d.b, 10, 1, 0, 4, out.get(), nullptr); }, "sharded");
  expect_msg([&] { cuda::prefill_scores(dev[0], 0, d.b, -1, 1, 0, 4, out.get(), nullptr); }, "rows");
  expect_msg([&] { cuda::prefill_scores(dev[0], 0, d.b, 10, 0, 0, 4, out.get(), nullptr); }, "max_rows_per_request");
  expect_msg([&] { cuda::prefill_scores(dev[0], 0, d.b, 10, 1, 3, 2, out.get(), nullptr); }, "h");
  expect_msg([&] { cuda::prefill_scores(dev[0], 3, d.b, 10, 1, 0, 4, out.get(), nullptr); }, "layer");
}

// prefill_scores gives -Inf where no score exists: the blocks that are not historical, and the
// historical blocks of block-table entries outside [0, num_pages), which prefill_scores does not
// validate and every scorer skips. With two such entries (one -1, one past num_pages) every entry
// equals the run with the valid table, except those blocks' historical entries, which are -Inf;
// in both precision modes, through the default scorer (the GEMM-shaped one where the request is
// long enough) and the tile scorer, out prefilled with a byte pattern each time so that an entry
// nobody writes shows.
TEST(GpuPrefill, PrefillScoresOutOfRangePageIdsGiveNegInf) {
  REQUIRE_GPU();
  for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8})
    for (int32_t P : {128, 256}) {
      auto s = prefill_scene(P, 91u + P, true);
      auto dev = device_shards(dt, s.req, 1, s.keys, s.slots);
      DevPrefill d(s);
      const int32_t h0 = 1, nh = 2, mp = s.req.max_pages;
      const int64_t mb = static_cast<int64_t>(mp) * P / 128, nrows = s.qs.back();
      const int32_t max_rows = max_rows_of(s.qs);
      // request 0 (3,000 tokens, rows at 2,870..2,999): logical page 5 -> -1; request 1 (700
      // tokens, rows at 0..699): logical page 1 -> num_pages + 3
      const int32_t bad[2][2] = {{0, 5}, {1, 1}};
      std::vector<int32_t> bt = s.req.block_table;
      bt[static_cast<size_t>(bad[0][0]) * mp + bad[0][1]] = -1;
      bt[static_cast<size_t>(bad[1][0]) * mp + bad[1][1]] = static_cast<int32_t>(s.req.num_pages) + 3;
      DevArr<int32_t> bt_bad(bt);
      PrefillBatch b_bad = d.b;
      b_bad.block_table = bt_bad.get();
      DevArr<float> out(static_cast<size_t>(nrows) * nh * mb);
      for (const ScorePrecision prec : {ScorePrecision::kFp32, ScorePrecision::kFp8Mma})
        for (const bool tiles : {false, true}) {
          ScopedEnv knob(prec == ScorePrecision::kFp8Mma ? "INDEXCP_SCORE_GEMM8" : "INDEXCP_SCORE_GEMM16");
          knob.set(tiles ? "0" : "");
          const std::string where = to_string(dt) + " P" + std::to_string(P) +
                                    (prec == ScorePrecision::kFp8Mma ? " fp8_mma" : " fp32") + (tiles ? " tiles" : " default");
          std::vector<uint32_t> got[2];
          for (int run = 0; run < 2; ++run) {
            out.fill_bytes(run == 0 ? 0x7f : 0x3c);
            cuda::prefill_scores(dev[0], 0, run == 0 ? d.b : b_bad, nrows, max_rows, h0, nh, out.get(), nullptr, prec);
            CUDA_OK(cudaDeviceSynchronize());
            got[run] = bits_of(out.host());
          }
          int64_t neg = 0, scored = 0;
          for (size_t b = 0; b + 1 < s.qs.size(); ++b)
            for (int32_t r = s.qs[b]; r < s.qs[b + 1]; ++r) {
              const int32_t pos = s.req.seq_lens[b] - (s.qs[b + 1] - s.qs[b]) + (r - s.qs[b]);
              const int64_t olim = pos < 0 ? 0 : pos / 128;
              for (int32_t h = 0; h < nh; ++h)
                for (int64_t j = 0; j < mb; ++j) {
                  const size_t i = (static_cast<size_t>(r) * nh + h) * mb + j;
                  bool in_bad = false;
                  for (const auto& e : bad)
                    in_bad |= e[0] == static_cast<int32_t>(b) && j * 128 / P == e[1];
                  if (j >= olim) {
                    ASSERT_EQ(got[0][i], 0xff800000u) << where << " row " << r << " block " << j << ": not historical";
                    ASSERT_EQ(got[1][i], 0xff800000u) << where << " row " << r << " block " << j << ": not historical";
                  } else if (in_bad) {
                    ASSERT_EQ(got[1][i], 0xff800000u) << where << " row " << r << " block " << j << ": out-of-range page";
                    ++neg;
                  } else {
                    ASSERT_EQ(got[1][i], got[0][i]) << where << " row " << r << " block " << j;
                    ASSERT_NE(got[0][i], 0xff800000u) << where << " row " << r << " block " << j << ": historical";
                    ++scored;
                  }
                }
            }
          EXPECT_GT(neg, 100) << where;  // (request 0: 130 rows x 2 heads x P / 128 blocks, request 1 more)
          EXPECT_GT(scored, 1000) << where;
        }
    }
}

// prefill_scores' -Inf at the edges of the work: (a) a first chunk of 100 rows x 4 heads (400 query
// vectors, so the GEMM-shaped scorer runs) has no historical block at all, so no CTA has pairs and
// the whole output must be -Inf; (b) a block table padded past the pages the requests need
// (max_pages + 7, the padding -1 or a large page id, as a caller with a fixed max_pages writes it)
// gives the unpadded run's entries and -Inf in the extra blocks. Both modes, the default scorer
// and the tile scorer, out prefilled with a byte pattern.
TEST(GpuPrefill, PrefillScoresFillShortChunksAndPaddedTables) {
  REQUIRE_GPU();
  for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8})
    for (const ScorePrecision prec : {ScorePrecision::kFp32, ScorePrecision::kFp8Mma})
      for (const bool tiles : {false, true}) {
        ScopedEnv knob(prec == ScorePrecision::kFp8Mma ? "INDEXCP_SCORE_GEMM8" : "INDEXCP_SCORE_GEMM16");
        knob.set(tiles ? "0" : "");
        const std::string where = to_string(dt) + (prec == ScorePrecision::kFp8Mma ? " fp8_mma" : " fp32") +
                                  (tiles ? " tiles" : " default");
        {  // (a)
          PrefillScene s;
          s.req = make_requests({100}, 128, 7u);
          exact_keys(s.req, 8u, s.keys, s.slots);
          s.qs = {0, 100};
          s.q = int_q(100, s.heads, 9u);
          auto dev = device_shards(dt, s.req, 1, s.keys, s.slots);
          DevPrefill d(s);
          const int64_t mb = s.req.max_pages;  // P = 128
          DevArr<float> out(static_cast<size_t>(100) * s.heads * mb);
          out.fill_bytes(0x7f);
          cuda::prefill_scores(dev[0], 0, d.b, 100, 100, 0, s.heads, out.get(), nullptr, prec);
          CUDA_OK(cudaDeviceSynchronize());
          const auto got = bits_of(out.host());
          for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], 0xff800000u) << where << " short chunk, entry " << i;
        }
        {  // (b)
          const int32_t P = 128;
          auto s = prefill_scene(P, 33u, true);
          auto dev = device_shards(dt, s.req, 1, s.keys, s.slots);
          DevPrefill d(s);
          const int32_t h0 = 0, nh = 3, mp = s.req.max_pages, mp2 = mp + 7;
          const int64_t mb = mp, mb2 = mp2, nrows = s.qs.back();
          DevArr<int32_t> bt2_d(padded_block_table(s.req.block_table, s.req.seq_lens.size(), mp, mp2));
          PrefillBatch b2 = d.b;
          b2.block_table = bt2_d.get();
          b2.max_pages = mp2;
          const int32_t max_rows = max_rows_of(s.qs);
          DevArr<float> out(static_cast<size_t>(nrows) * nh * mb), out2(static_cast<size_t>(nrows) * nh * mb2);
          out.fill_bytes(0x7f);
          out2.fill_bytes(0x3c);
          cuda::prefill_scores(dev[0], 0, d.b, nrows, max_rows, h0, nh, out.get(), nullptr, prec);
          cuda::prefill_scores(dev[0], 0, b2, nrows, max_rows, h0, nh, out2.get(), nullptr, prec);
          CUDA_OK(cudaDeviceSynchronize());
          const auto g = bits_of(out.host()), g2 = bits_of(out2.host());
          int64_t scored = 0;
          for (int64_t rh = 0; rh < nrows * nh; ++rh)
            for (int64_t j = 0; j < mb2; ++j) {
              const uint32_t x = g2[static_cast<size_t>(rh * mb2 + j)];
              if (j < mb) {
                ASSERT_EQ(x, g[static_cast<size_t>(rh * mb + j)]) << where << " padded table, (row, head) " << rh << " block " << j;
                scored += x != 0xff800000u;
              } else {
                ASSERT_EQ(x, 0xff800000u) << where << " padded table, (row, head) " << rh << " block " << j;
              }
            }
          EXPECT_GT(scored, 1000) << where;
        }
      }
}

// prefill_scores' -Inf fill at an engine's shapes: an 8,192-row chunk of a 16K-token request, a
// request with no rows this step whose block-table entries are garbage, a 100-row chunk, and 5 rows
// past query_start[num_requests]; page sizes 128 and 256, both modes through the default (GEMM-
// shaped) scorer, and the tile scorer in fp32. Three runs, out prefilled with a byte pattern each
// time: (1) the exact table; (2) the table padded with 512 more entries per request (-1 and a
// huge page id, as a caller with a fixed max_pages writes it): equal to (1) where (1) has a block,
// -Inf beyond; (3) one out-of-range entry inside the long request: (1)'s entries except that
// page's blocks, which are -Inf for every row that sees them. In (1) every entry is a finite score
// (written) below the row's historical limit and -Inf from it on.
TEST(GpuPrefill, PrefillScoresFillAtEngineScale) {
  REQUIRE_GPU();
  for (const int32_t P : {128, 256})
    for (int run = 0; run < 3; ++run) {
      const ScorePrecision prec = run == 1 ? ScorePrecision::kFp8Mma : ScorePrecision::kFp32;
      const bool tiles = run == 2;
      ScopedEnv knob("INDEXCP_SCORE_GEMM16");
      knob.set(tiles ? "0" : "");
      const std::string where = "P" + std::to_string(P) + (prec == ScorePrecision::kFp8Mma ? " fp8_mma" : " fp32") +
                                (tiles ? " tiles" : " default");
      PrefillScene s;
      s.heads = 2;
      s.req = make_requests({16384, 700, 300}, P, 41u);
      exact_keys(s.req, 42u, s.keys, s.slots);
      s.qs = {0, 8192, 8192, 8292};
      const int64_t nrows = 8292 + 5;
      s.q = int_q(nrows, s.heads, 43u);
      auto dev = device_shards(KvDtype::kNvfp4, s.req, 1, s.keys, s.slots);
      const int32_t mp = s.req.max_pages, mp2 = mp + 512, nh = 2;
      for (int32_t lp = 0; lp < mp; ++lp) s.req.block_table[static_cast<size_t>(mp) + lp] = (lp & 1) ? -7 : 1 << 30;
      const int64_t mb = static_cast<int64_t>(mp) * P / 128, mb2 = static_cast<int64_t>(mp2) * P / 128;
      DevPrefill d(s);
      auto scores = [&](const std::vector<int32_t>& bt, int32_t max_pages, int64_t blocks, uint8_t pattern,
                        std::vector<uint32_t>& got) {
        DevArr<int32_t> bt_d(bt);
        PrefillBatch b = d.b;
        b.block_table = bt_d.get();
        b.max_pages = max_pages;
        DevArr<float> out(static_cast<size_t>(nrows) * nh * blocks);
        out.fill_bytes(pattern);
        cuda::prefill_scores(dev[0], 0, b, nrows, 8192, 0, nh, out.get(), nullptr, prec);
        CUDA_OK(cudaDeviceSynchronize());
        got = bits_of(out.host());
      };
      const uint32_t ninf = 0xff800000u;
      // the historical blocks of row r (the CPU's rule, spec/indexer.md section 2)
      auto olim = [&](int64_t r) -> int64_t {
        for (size_t b = 0; b + 1 < s.qs.size(); ++b)
          if (r >= s.qs[b] && r < s.qs[b + 1]) return std::min<int64_t>((s.req.seq_lens[b] - (s.qs[b + 1] - s.qs[b]) + (r - s.qs[b])) / 128, mb);
        return 0;
      };
      std::vector<uint32_t> g1, g2, g3;
      scores(s.req.block_table, mp, mb, 0x7f, g1);
      ASSERT_EQ(g1.size(), static_cast<size_t>(nrows * nh * mb)) << where;
      int64_t scored = 0;
      for (int64_t r = 0; r < nrows; ++r)
        for (int32_t h = 0; h < nh; ++h)
          for (int64_t j = 0; j < mb; ++j) {
            const uint32_t x = g1[static_cast<size_t>((r * nh + h) * mb + j)];
            if (j < olim(r)) {
              ASSERT_TRUE(std::isfinite(std::bit_cast<float>(x))) << where << " row " << r << " head " << h << " block " << j;
              ++scored;
            } else {
              ASSERT_EQ(x, ninf) << where << " row " << r << " head " << h << " block " << j;
            }
          }
      EXPECT_GT(scored, int64_t{8192} * nh * (8192 / 128)) << where;
      scores(padded_block_table(s.req.block_table, 3, mp, mp2), mp2, mb2, 0x3c, g2);
      ASSERT_EQ(g2.size(), static_cast<size_t>(nrows * nh * mb2)) << where;
      for (int64_t rh = 0; rh < nrows * nh; ++rh)
        for (int64_t j = 0; j < mb2; ++j)
          ASSERT_EQ(g2[static_cast<size_t>(rh * mb2 + j)], j < mb ? g1[static_cast<size_t>(rh * mb + j)] : ninf)
              << where << " padded table, (row, head) " << rh << " block " << j;
      std::vector<int32_t> bt3 = s.req.block_table;
      const int32_t bad_lp = 3;
      bt3[bad_lp] = -1;
      scores(bt3, mp, mb, 0x3c, g3);
      ASSERT_EQ(g3.size(), g1.size()) << where;
      const int64_t first = static_cast<int64_t>(bad_lp) * P / 128, last = (static_cast<int64_t>(bad_lp) + 1) * P / 128;
      int64_t dropped = 0;
      for (int64_t r = 0; r < nrows; ++r)
        for (int32_t h = 0; h < nh; ++h)
          for (int64_t j = 0; j < mb; ++j) {
            const size_t i = static_cast<size_t>((r * nh + h) * mb + j);
            const bool gone = r < 8192 && j >= first && j < last && j < olim(r);
            dropped += gone;
            ASSERT_EQ(g3[i], gone ? ninf : g1[i]) << where << " bad entry, row " << r << " head " << h << " block " << j;
          }
      EXPECT_EQ(dropped, int64_t{8192} * nh * (last - first)) << where;  // (every row of the chunk sees page 3)
    }
}

// The synchronous prefill APIs check q's bytes on the GPU: a NaN byte (0x7F or 0xFF) anywhere,
// the first and the last byte included, is refused with the same message as the CPU reference's
// prefill_rows (row, head, dim of the first one), by prefill_select, validate_prefill_batch and
// prefill_gather, and prefill_select writes nothing.
TEST(GpuPrefill, NaNByteInQIsFoundOnTheGpuWithItsPlace) {
  REQUIRE_GPU();
  auto s = prefill_scene(128, 17u, false);
  auto dev = device_shards(KvDtype::kNvfp4, s.req, 1, s.keys, s.slots);
  auto shards = device_shards(KvDtype::kNvfp4, s.req, 2, s.keys, s.slots);
  const int64_t n = static_cast<int64_t>(s.q.size());
  std::mt19937 rng(19);
  std::vector<int64_t> places = {0, n - 1, n / 2};
  for (int i = 0; i < 5; ++i) places.push_back(static_cast<int64_t>(rng() % n));
  for (const int64_t at : places)
    for (const uint8_t nan : {uint8_t{0x7F}, uint8_t{0xFF}}) {
      auto sn = s;
      sn.q[static_cast<size_t>(at)] = nan;
      if (at != 0) sn.q[0] = 0x38;
      std::string want;
      try {
        (void)prefill_rows(host_prefill(sn), sn.req.num_pages, 128);
        ADD_FAILURE() << "the CPU accepted a NaN byte at " << at;
      } catch (const Error& e) {
        want = e.what();
      }
      ASSERT_NE(want.find("q holds a NaN byte at row"), std::string::npos) << want;
      DevPrefill d(sn);
      DevArr<int32_t> out(static_cast<size_t>(sn.qs.back()) * sn.heads * 16);
      out.fill_bytes(0x5A);
      try {
        cuda::prefill_select(dev[0], 0, d.b, 0, sn.heads, SelectionParams{}, out.get(), nullptr);
        ADD_FAILURE() << "prefill_select accepted a NaN byte at " << at;
      } catch (const Error& e) {
        EXPECT_EQ(std::string(e.what()), want) << at;
        EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      }
      for (int32_t v : out.host()) ASSERT_EQ(v, 0x5A5A5A5A) << "a refused prefill_select wrote its output";
      try {
        (void)cuda::validate_prefill_batch(d.b, sn.req.num_pages, 128);
        ADD_FAILURE() << "validate_prefill_batch accepted a NaN byte at " << at;
      } catch (const Error& e) {
        EXPECT_EQ(std::string(e.what()), want) << at;
      }
      std::vector<std::string> got(2);
      cuda::run_device_ranks(2, [&](int rank, Communicator& comm, cuda::Stream st) {
        DevArr<int32_t> o(static_cast<size_t>(sn.qs.back()) * (sn.heads / 2) * 16);
        try {
          (void)cuda::prefill_gather(comm, shards[rank], 0, d.b, SelectionParams{}, int64_t{256} << 20, o.get(), st);
        } catch (const Error& e) {
          got[rank] = e.what();
        }
      });
      for (int r = 0; r < 2; ++r) EXPECT_EQ(got[r], want) << "prefill_gather rank " << r << ", byte " << at;
    }
}
