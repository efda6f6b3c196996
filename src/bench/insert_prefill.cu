// `indexcp bench insert` and `indexcp bench prefill` (spec/bench.md section 2; method: bench.hpp).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>

#include "bench/harness.cuh"
#include "indexcp/config.hpp"
#include "indexcp/cuda.hpp"
#include "indexcp/plan.hpp"
#include "indexcp/error.hpp"

namespace indexcp::bench {

bool insert(const InsertOptions& o) {
  validate(o);
  Device dev(false);
  const cudaStream_t st = dev.stream();
  const auto sst = reinterpret_cast<cuda::Stream>(st);
  const int32_t P = 128;
  std::printf("device %s: copy bandwidth %.0f GB/s\n", dev.name().c_str(), dev.copy_bandwidth_gbs());
  std::printf("insert: fp32 keys -> cache pages (P = %d, slots scattered over shuffled pages), events around the "
              "synchronous call (validation and duplicate check included)\n",
              P);
  std::printf("%-6s %-10s %-9s %10s %12s %9s %9s\n", "dtype", "cache", "tokens", "median us", "Mtokens/s", "GB/s",
              "of copy");
  Progress prog(static_cast<int>(o.tokens.size() * o.kv_dtypes.size() * 2), o.run.progress);
  json results = json::array();
  const int32_t max_n = *std::max_element(o.tokens.begin(), o.tokens.end());
  DeviceBuffer<float> keys(static_cast<size_t>(max_n) * 128);
  fill_keys(keys.get(), static_cast<int64_t>(max_n) * 128, 0xabcdefull, st);
  for (const auto& dts : o.kv_dtypes) {
    const KvDtype dt = dts == "fp8" ? KvDtype::kFp8 : KvDtype::kNvfp4;
    for (const int32_t n : o.tokens) {
      const int32_t pages = (n + P - 1) / P;
      const auto bt = shuffled_block_table(pages, static_cast<uint32_t>(n));
      DeviceBuffer<int32_t> bt_dev(bt);
      DeviceBuffer<int64_t> slots(static_cast<size_t>(n));
      fill_slots(slots.get(), 0, n, n, bt_dev.get(), pages, P, st);
      for (const int32_t W : {1, o.tp}) {
        cuda::DeviceCache cache(make_page_layout(dt, P, W), pages, 1, 0);
        std::vector<Stat> runs;
        for (int r = 0; r < o.run.repeats; ++r)
          runs.push_back(dev.time_eager([&] { cuda::insert_keys(cache, 0, keys.get(), slots.get(), n, ::indexcp::InsertOptions{}, sst); },
                                        o.run.replays));
        const Combined c = combine(runs);
        const int64_t written = static_cast<int64_t>(n) * cache.layout().page_bytes() / P;  // this rank's share
        const int64_t read = static_cast<int64_t>(n) * (128 * 4 + 8);
        const double gbs = (read + written) / (c.median * 1e3);
        const std::string cname = W == 1 ? "replicated" : "shard 0/" + std::to_string(W);
        json j = {{"variant", W == 1 ? "insert_replicated" : "insert_sharded"}, {"tp", W}, {"page_size", P},
                  {"tokens", n}, {"kv_dtype", dts}, {"bytes_read", read}, {"bytes_written", written},
                  {"tokens_per_s", n / (c.median * 1e-6)}, {"gb_per_s", gbs},
                  {"bandwidth_fraction", gbs / dev.copy_bandwidth_gbs()}};
        j.update(timing_fields(c));
        results.push_back(j);
        std::printf("%-6s %-10s %-9d %10.1f %12.1f %9.1f %8.1f%%\n", dts.c_str(), cname.c_str(), n, c.median,
                    n / c.median, gbs, 100.0 * gbs / dev.copy_bandwidth_gbs());
        prog.step("insert " + dts + " " + cname + " " + std::to_string(n) + " tokens");
        // the engine's form: insert_keys_async (validation on the device, status buffer, caller
        // workspace) captured once in a CUDA graph and replayed
        {
          const size_t wsb = cuda::insert_workspace_bytes(n);
          DeviceBuffer<uint8_t> ws(wsb);
          DeviceBuffer<InsertStatus> status(1);
          cuda::reset_status(status.get(), sst);
          cudaGraphExec_t g = dev.capture([&] {
            cuda::insert_keys_async(cache, 0, keys.get(), slots.get(), n, ::indexcp::InsertOptions{}, ws.get(), wsb, status.get(),
                                    sst);
          });
          std::vector<Stat> aruns;
          for (int r = 0; r < o.run.repeats; ++r) aruns.push_back(dev.time_graph(g, o.run.replays));
          cudaGraphExecDestroy(g);
          if (cuda::read_status(status.get(), sst).reason != 0)
            throw Error(ErrorCode::kRuntime, "bench insert: the asynchronous insert refused its batch");
          const Combined a = combine(aruns);
          json ja = {{"variant", W == 1 ? "insert_async_graph_replicated" : "insert_async_graph_sharded"},
                     {"tp", W}, {"page_size", P}, {"tokens", n}, {"kv_dtype", dts}, {"bytes_read", read},
                     {"bytes_written", written}, {"workspace_bytes", wsb},
                     {"tokens_per_s", n / (a.median * 1e-6)}, {"sync_median_us", c.median},
                     {"speedup_vs_sync", c.median / a.median}};
          ja.update(timing_fields(a));
          results.push_back(ja);
          std::printf("%-6s %-10s %-9d %10.1f %12.1f   async insert in a CUDA graph (%.2fx the synchronous call)\n",
                      dts.c_str(), cname.c_str(), n, a.median, n / a.median, c.median / a.median);
        }
      }
    }
  }
  json rec = record_header("insert", o.run, dev,
                           "one GPU; CUDA events around the synchronous cuda::insert_keys call, and around the "
                           "replay of a CUDA graph holding one cuda::insert_keys_async call (variants insert_async_*)");
  rec["results"] = results;
  write_record(rec, o.run);
  return true;
}

bool prefill(const PrefillOptions& o) {
  validate(o);
  Device dev;
  const cudaStream_t st = dev.stream();
  const auto sst = reinterpret_cast<cuda::Stream>(st);
  const int32_t P = o.page_size, W = o.tp, H = o.heads, B = o.requests, T = o.chunk;
  std::printf("device %s: copy bandwidth %.0f GB/s, FP8 matrix rate %.0f TFLOP/s, fp16 dense rate %.0f TFLOP/s\n",
              dev.name().c_str(), dev.copy_bandwidth_gbs(), dev.fp8_tflops(), dev.fp16_tflops());
  const ScorePrecision prec = parse_score_precision(o.score_precision, "--score-precision");
  std::printf("gather prefill, TP%d simulated, P = %d, %d request(s), chunk of %d new tokens, H = %d, NVFP4, %s scores\n", W,
              P, B, T, H, o.score_precision.c_str());
  Progress prog(static_cast<int>(o.contexts.size()) * 7, o.run.progress);
  auto frac = [](double tf, double rate) { return rate > 0 ? tf / rate : 0.0; };
  json results = json::array();
  for (const int32_t ctx : o.contexts) {
    const int32_t max_pages = (ctx + P - 1) / P;
    const int64_t num_pages = static_cast<int64_t>(B) * max_pages;
    const auto bt = shuffled_block_table(num_pages, static_cast<uint32_t>(ctx));
    DeviceBuffer<int32_t> bt_dev(bt);
    cuda::DeviceCache repl(make_page_layout(KvDtype::kNvfp4, P, 1), num_pages, 1, 0);
    std::vector<std::unique_ptr<cuda::DeviceCache>> shards;
    for (int32_t r = 0; r < W; ++r)
      shards.push_back(std::make_unique<cuda::DeviceCache>(make_page_layout(KvDtype::kNvfp4, P, W), num_pages, 1, r));
    {
      std::vector<cuda::DeviceCache*> all{&repl};
      for (auto& sh : shards) all.push_back(sh.get());
      fill_caches(all, 0, B, ctx, bt_dev.get(), max_pages, P, 0x77ull, st);
    }
    // the batch: every request's last T tokens are the chunk (rows at L-T .. L-1)
    std::vector<int32_t> seq(static_cast<size_t>(B), ctx), qs(static_cast<size_t>(B) + 1);
    for (int32_t b = 0; b <= B; ++b) qs[b] = b * T;
    const auto qh = random_q(static_cast<size_t>(B) * T * H * 128, 4242u + ctx);
    DeviceBuffer<int32_t> seq_dev(seq), qs_dev(qs);
    DeviceBuffer<uint8_t> q_dev(qh);
    PrefillBatch pb;
    pb.q = q_dev.get();
    pb.heads = H;
    pb.block_table = bt_dev.get();
    pb.num_requests = B;
    pb.max_pages = max_pages;
    pb.seq_lens = seq_dev.get();
    pb.query_start = qs_dev.get();
    int32_t h0, nh;
    owned_heads(H, W, 0, &h0, &nh);
    // pages holding historical blocks (decisions.md: the gather stages only those)
    const int64_t max_local = (static_cast<int64_t>(ctx) - 1) / 128;
    const int64_t hist_pages = (max_local * 128 + P - 1) / P;
    std::vector<int32_t> stage_ids;
    for (int32_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < hist_pages; ++i) stage_ids.push_back(bt[static_cast<size_t>(b) * max_pages + i]);
    const int64_t n_stage = static_cast<int64_t>(stage_ids.size());
    const int32_t R = shards[0]->layout().rows();
    DeviceBuffer<int32_t> stage_dev(stage_ids);
    DeviceBuffer<uint8_t> staged(static_cast<size_t>(std::max<int64_t>(n_stage, 1)) * R * 128);
    DeviceBuffer<uint8_t> gathered(static_cast<size_t>(std::max<int64_t>(n_stage, 1)) * W * R * 128);
    const std::string cell = "ctx " + std::to_string(ctx);
    auto push = [&](json j, const Combined& c) {
      j.update({{"tp", W}, {"page_size", P}, {"requests", B}, {"context", ctx}, {"chunk", T}, {"heads", H},
                {"kv_dtype", "nvfp4"}, {"score_precision", o.score_precision}});
      j.update(timing_fields(c));
      results.push_back(j);
    };
    auto repeat = [&](auto&& timer) {
      std::vector<Stat> runs;
      for (int r = 0; r < o.run.repeats; ++r) runs.push_back(timer());
      return combine(runs);
    };
    {  // 1. staging NVFP4 -> FP8 of rank 0's rows
      Graph g(dev.capture([&] { cuda::stage_fp8(*shards[0], 0, stage_dev.get(), n_stage, staged.get(), sst, false); }));
      const Combined c = repeat([&] { return dev.time_graph(g.e, o.run.replays); });
      const int64_t rd = n_stage * shards[0]->layout().page_bytes(), wr = n_stage * R * 128;
      const double gbs = (rd + wr) / (c.median * 1e3);
      push({{"variant", "stage_fp8"}, {"pages", n_stage}, {"bytes_read", rd}, {"bytes_written", wr}, {"gb_per_s", gbs},
            {"bandwidth_fraction", gbs / dev.copy_bandwidth_gbs()}},
           c);
      std::printf("%-8s stage_fp8          %9.1f us  %8.1f GB/s (%4.1f%% of copy bw), %lld pages\n", cell.c_str(), c.median,
                  gbs, 100.0 * gbs / dev.copy_bandwidth_gbs(), static_cast<long long>(n_stage));
      prog.step(cell + " stage_fp8");
    }
    {  // 2. the all-gather, simulated on one GPU: W device-to-device copies of the staged rows
      const size_t part = static_cast<size_t>(n_stage) * R * 128;
      Graph g(dev.capture([&] {
        for (int32_t r = 0; r < W; ++r)
          ck(cudaMemcpyAsync(gathered.get() + r * part, staged.get(), part, cudaMemcpyDeviceToDevice, st), "cudaMemcpyAsync");
      }));
      const Combined c = repeat([&] { return dev.time_graph(g.e, o.run.replays); });
      const double gbs = 2.0 * W * part / (c.median * 1e3);
      push({{"variant", "allgather_simulated"}, {"bytes_received", static_cast<int64_t>(part) * W},
            {"gb_per_s", gbs}, {"bandwidth_fraction", gbs / dev.copy_bandwidth_gbs()},
            {"note", "device-to-device copies on one GPU; NVLink/NCCL time is not measured here"}},
           c);
      std::printf("%-8s allgather (sim.)   %9.1f us  %8.1f GB/s, %.1f MB received per rank\n", cell.c_str(), c.median,
                  gbs, W * part / 1e6);
      prog.step(cell + " all-gather");
    }
    double flops = 0;  // 2 x 128 per (row, head, historical token)
    for (int32_t t = 0; t < T; ++t) flops += 2.0 * 128 * nh * ((static_cast<int64_t>(ctx) - T + t) / 128) * 128.0;
    flops *= B;
    {  // 3. the prefill scorer alone (graph): TFLOP/s against the FP8 matrix rate
      const int64_t mb = static_cast<int64_t>(max_pages) * P / 128;
      DeviceBuffer<float> scores(static_cast<size_t>(B) * T * nh * mb);
      Graph g(dev.capture([&] { cuda::prefill_scores(repl, 0, pb, static_cast<int64_t>(B) * T, T, h0, nh, scores.get(), sst, prec); }));
      const Combined c = repeat([&] { return dev.time_graph(g.e, o.run.replays); });
      const double tf = flops / (c.median * 1e-6) / 1e12;
      push({{"variant", "prefill_score"}, {"owned_heads", nh}, {"flops", flops}, {"tflops", tf},
            {"fp8_matrix_fraction", frac(tf, dev.fp8_tflops())}, {"fp16_matrix_fraction", frac(tf, dev.fp16_tflops())}},
           c);
      std::printf("%-8s prefill scorer     %9.1f us  %8.1f TFLOP/s (%4.1f%% of the FP8 matrix rate, %4.1f%% of fp16)\n",
                  cell.c_str(), c.median, tf, 100.0 * frac(tf, dev.fp8_tflops()), 100.0 * frac(tf, dev.fp16_tflops()));
      prog.step(cell + " prefill scorer");
    }
    {  // 3b. score + select as one graph: the replicated one-rank plan (cuda::PrefillPlan, rank 0's heads)
      AttentionConfig ac;
      ac.kv_dtype = KvDtype::kNvfp4;
      ac.score_precision = prec;
      EngineParams ep;
      ep.tp = W;
      ep.page_size = P;
      ep.heads = H;
      const ResolvedConfig rc = resolve_config(ac, ep);
      PrefillLimits lim;
      lim.max_requests = B;
      lim.max_pages = max_pages;
      lim.max_rows = static_cast<int64_t>(B) * T;
      lim.heads = H;
      cuda::PrefillPlan plan(rc, 0, lim);
      PrefillExtents ex;
      ex.rows = static_cast<int64_t>(B) * T;
      ex.max_rows_per_request = T;
      DevicePrefillBatch db;
      db.q = pb.q;
      db.block_table = pb.block_table;
      db.seq_lens = pb.seq_lens;
      db.query_start = pb.query_start;
      db.num_requests = B;
      DeviceBuffer<uint8_t> ws(std::max<size_t>(plan.workspace_bytes(), 16));
      DeviceBuffer<int32_t> out(static_cast<size_t>(B) * T * plan.num_heads() * 16);
      Graph g(dev.capture([&] {
        plan.run(repl, 0, db, ex, ws.get(), plan.workspace_bytes(), out.get(), nullptr, nullptr, sst);
      }));
      const Combined c = repeat([&] { return dev.time_graph(g.e, o.run.replays); });
      const double tf = flops / (c.median * 1e-6) / 1e12;
      push({{"variant", "prefill_plan_replicated"}, {"owned_heads", plan.num_heads()}, {"flops", flops}, {"tflops", tf},
            {"fp8_matrix_fraction", frac(tf, dev.fp8_tflops())}, {"fp16_matrix_fraction", frac(tf, dev.fp16_tflops())},
            {"note", "score + select of rank 0's heads as one CUDA graph: cuda::PrefillPlan::run, path replicated "
                     "(the same scorer as prefill_score, then the selection)"}},
           c);
      std::printf("%-8s score+select graph %9.1f us  %8.1f TFLOP/s (cuda::PrefillPlan, replicated)\n", cell.c_str(),
                  c.median, tf);
      prog.step(cell + " prefill plan");
    }
    {  // 3c. rank 0's whole gather prefill as one graph (cuda::PrefillPlan, path gather: unit lists,
       // staging, the all-gather through MirrorComm, score, select), and its scorer alone: the
       // score kernel node of that graph replayed by itself
      AttentionConfig ac;
      ac.kv_dtype = KvDtype::kNvfp4;
      ac.score_precision = prec;
      ac.cache_sharding = true;
      ac.prefill_cp = PrefillCp::kGather;
      ac.prefill_gather_budget_mib = o.budget_mib;
      EngineParams ep;
      ep.tp = W;
      ep.page_size = P;
      ep.heads = H;
      const ResolvedConfig rc = resolve_config(ac, ep);
      PrefillBatch hb = pb;  // the host copy of the batch's metadata, for its extents
      hb.q = qh.data();
      hb.block_table = bt.data();
      hb.seq_lens = seq.data();
      hb.query_start = qs.data();
      const PrefillExtents ex = prefill_extents(hb, P);
      PrefillLimits lim;
      lim.max_requests = B;
      lim.max_pages = max_pages;
      lim.max_rows = ex.rows;
      lim.heads = H;
      cuda::PrefillPlan plan(rc, 0, lim);
      DevicePrefillBatch db;
      db.q = pb.q;
      db.block_table = pb.block_table;
      db.seq_lens = pb.seq_lens;
      db.query_start = pb.query_start;
      db.num_requests = B;
      DeviceBuffer<uint8_t> ws(std::max<size_t>(plan.workspace_bytes(), 16));
      DeviceBuffer<int32_t> out(static_cast<size_t>(B) * T * plan.num_heads() * 16);
      MirrorComm comm(0, W);
      cudaGraphExec_t part = nullptr;
      int nscore = 0;
      Graph g(dev.capture_with_part(
          [&] { plan.run(*shards[0], 0, db, ex, ws.get(), plan.workspace_bytes(), out.get(), &comm, nullptr, sst); },
          "score_kernel", &part, &nscore));
      Graph gpart(part);
      const int64_t nchunks = plan.gather_chunks(ex);
      const Combined c = repeat([&] { return dev.time_graph(g.e, o.run.replays); });
      const double tf = flops / (c.median * 1e-6) / 1e12;
      push({{"variant", "prefill_plan_gather"}, {"owned_heads", plan.num_heads()}, {"flops", flops}, {"tflops", tf},
            {"fp8_matrix_fraction", frac(tf, dev.fp8_tflops())}, {"fp16_matrix_fraction", frac(tf, dev.fp16_tflops())},
            {"chunks", nchunks}, {"gather_units", ex.gather_units},
            {"note", "rank 0 of TP" + std::to_string(W) +
                         ": cuda::PrefillPlan::run, path gather, as one CUDA graph (unit lists, FP8 staging, the "
                         "all-gather, score, select); the all-gather is MirrorComm (device-to-device copies of this "
                         "rank's staged rows into every slot on one GPU: NVLink/NCCL time is not measured)"}},
           c);
      std::printf("%-8s gather plan graph  %9.1f us  %8.1f TFLOP/s (cuda::PrefillPlan, gather, rank 0, %lld chunk(s))\n",
                  cell.c_str(), c.median, tf, static_cast<long long>(nchunks));
      // one chunk only: a replay of the score nodes alone reads what the last chunk left in the
      // workspace (its unit list), so with several chunks each node would score the last one's
      // units; the graph above was replayed, so the workspace holds that chunk's data
      if (gpart.e != nullptr && nscore == 1 && nchunks == 1) {
        const Combined cs = repeat([&] { return dev.time_graph(gpart.e, o.run.replays); });
        const double ts = flops / (cs.median * 1e-6) / 1e12;
        push({{"variant", "prefill_gather_score"}, {"owned_heads", plan.num_heads()}, {"flops", flops}, {"tflops", ts},
              {"fp8_matrix_fraction", frac(ts, dev.fp8_tflops())}, {"fp16_matrix_fraction", frac(ts, dev.fp16_tflops())},
              {"kernels", nscore}, {"plan_over_scorer", c.median / cs.median},
              {"note", "the score kernel node(s) of prefill_plan_gather's graph replayed alone (FP8 keys of the "
                       "gathered rows)"}},
             cs);
        std::printf("%-8s gather scorer      %9.1f us  %8.1f TFLOP/s (%4.1f%% of FP8, %4.1f%% of fp16); plan / scorer %.2f\n",
                    cell.c_str(), cs.median, ts, 100.0 * frac(ts, dev.fp8_tflops()), 100.0 * frac(ts, dev.fp16_tflops()),
                    c.median / cs.median);
      } else {
        std::printf("%-8s gather scorer      not timed: %d score kernel node(s) in %lld chunk(s) (one is timed alone)\n",
                    cell.c_str(), nscore,
                    static_cast<long long>(nchunks));
      }
      prog.step(cell + " gather plan");
    }
    {  // 4. prefill_select end to end: validation (host copy of the batch) + scoring + selection
      const size_t nsel = static_cast<size_t>(B) * T * nh * 16;
      DeviceBuffer<int32_t> out(nsel);
      SelectionParams sel;
      const Combined c = repeat([&] {
        return dev.time_eager([&] { cuda::prefill_select(repl, 0, pb, h0, nh, sel, out.get(), sst, prec); }, o.run.replays);
      });
      const double tf = flops / (c.median * 1e-6) / 1e12;
      push({{"variant", "prefill_score_select"}, {"owned_heads", nh}, {"flops", flops}, {"tflops", tf},
            {"fp8_matrix_fraction", frac(tf, dev.fp8_tflops())},
            {"note", "events around the synchronous cuda::prefill_select: the host copy and validation of the batch "
                     "(q included) and the selection count too"}},
           c);
      std::printf("%-8s prefill_select     %9.1f us  %8.1f TFLOP/s (%4.1f%% of the FP8 matrix rate)\n", cell.c_str(),
                  c.median, tf, 100.0 * frac(tf, dev.fp8_tflops()));
      prog.step(cell + " prefill_select");
    }
    {  // 5. the whole budgeted gather prefill, all W ranks (host threads), wall clock
      std::vector<GatherStats> gs(static_cast<size_t>(W));
      std::vector<std::unique_ptr<DeviceBuffer<int32_t>>> outs;
      for (int32_t r = 0; r < W; ++r) outs.push_back(std::make_unique<DeviceBuffer<int32_t>>(static_cast<size_t>(B) * T * H * 16));
      SelectionParams sel;
      const int64_t budget = static_cast<int64_t>(o.budget_mib) << 20;
      std::vector<double> us;
      const int n = std::min(o.run.replays, 20);
      for (int i = 0; i < n + 1; ++i) {
        const auto a = std::chrono::steady_clock::now();
        cuda::run_device_ranks(W, [&](int r, Communicator& comm, cuda::Stream s) {
          gs[r] = cuda::prefill_gather(comm, *shards[r], 0, pb, sel, budget, outs[r]->get(), s, prec);
        });
        const double t = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - a).count();
        if (i > 0) us.push_back(t);
      }
      Combined c;
      c.first = stats(us);
      c.median = c.first.median;
      c.medians = {c.median};
      push({{"variant", "prefill_gather_all_ranks"}, {"budget_bytes", budget}, {"reserved_bytes", gs[0].reserved_bytes},
            {"chunks", gs[0].chunks}, {"pages", gs[0].pages}, {"gathered_bytes", gs[0].gathered_bytes},
            {"note", "wall clock of cuda::run_device_ranks (W host threads, one GPU), median of " + std::to_string(n)}},
           c);
      std::printf("%-8s gather prefill     %9.1f us  wall, all %d ranks; reserved %.1f MiB per rank (budget %d MiB), %lld "
                  "chunk(s)\n",
                  cell.c_str(), c.median, W, gs[0].reserved_bytes / 1048576.0, o.budget_mib,
                  static_cast<long long>(gs[0].chunks));
      prog.step(cell + " gather prefill");
    }
  }
  // The computed prompt line: with --contexts T, 2T, .., nT the chunks of one nT-token prompt, in
  // order; per variant the sum of their medians, times the layers. Computed, not timed as one.
  bool positions = o.contexts.size() >= 2;
  for (size_t i = 0; i < o.contexts.size(); ++i)
    positions = positions && static_cast<int64_t>(o.contexts[i]) == static_cast<int64_t>(T) * static_cast<int64_t>(i + 1);
  if (positions) {
    const int64_t n = static_cast<int64_t>(o.contexts.size());
    for (const char* v : {"prefill_score", "prefill_plan_replicated", "prefill_gather_score", "prefill_plan_gather"}) {
      double sum = 0;
      int64_t found = 0;
      for (const json& r : results)
        if (r.value("variant", "") == v) {
          sum += r.at("median_us").get<double>();
          ++found;
        }
      if (found != n) continue;
      results.push_back({{"variant", "prompt_computed"}, {"of", v}, {"prompt_tokens", n * T}, {"chunks", n}, {"chunk", T},
                         {"layers", o.layers}, {"requests", B}, {"tp", W}, {"page_size", P}, {"kv_dtype", "nvfp4"},
                         {"score_precision", o.score_precision}, {"per_layer_us", sum},
                         {"per_prompt_ms", sum * o.layers / 1e3},
                         {"note", "computed: the sum of the " + std::to_string(n) + " chunk positions' medians of " + v +
                                      " (contexts T .. nT), times the layers; not timed as one run"}});
      std::printf("prompt   %-24s %9.1f ms  computed: %lld-token prompt, %lld chunks of %d, %d layers (%.1f us per layer)\n",
                  v, sum * o.layers / 1e3, static_cast<long long>(n * T), static_cast<long long>(n), T, o.layers, sum);
    }
  }
  json rec = record_header("prefill", o.run, dev,
                           "one GPU, TP" + std::to_string(W) +
                               " ranks simulated; staging, all-gather, the prefill scorer and the replicated and "
                               "gather plans of rank 0 as CUDA graphs (the gather's all-gather through MirrorComm), "
                               "the gather scorer as the score kernel node of that graph alone, prefill_select with "
                               "events around the synchronous call, the whole gather of all ranks by wall clock "
                               "(median of up to 20)");
  rec["results"] = results;
  write_record(rec, o.run);
  return true;
}

}  // namespace indexcp::bench
