// `indexcp bench step`: one rank's decode step across all sparse layers of a model (57 for
// MiniMax-M3), captured as one CUDA graph, sharding off (replicated stock scorer + top-k per
// layer) against sharding on (ICP per layer: score all heads over the rank's rows, publish,
// merge). Method: bench.hpp. The layers hold copies of layer 0's keys (distinct memory, so
// every layer is read from HBM).
#include <algorithm>
#include <cstdio>
#include <memory>

#include "bench/harness.cuh"
#include "indexcp/cuda.hpp"
#include "indexcp/error.hpp"

namespace indexcp::bench {

bool step(const StepOptions& o) {
  validate(o);
  const int32_t P = o.page_size, W = o.tp, H = o.heads, Q = o.query_len, NL = o.layers, ctx = o.context;
  const int32_t max_req = *std::max_element(o.requests.begin(), o.requests.end());
  const int32_t max_pages = (ctx + P - 1) / P;
  const int64_t num_pages = static_cast<int64_t>(max_req) * max_pages;
  const PageLayout lr = make_page_layout(KvDtype::kNvfp4, P, 1), ls = make_page_layout(KvDtype::kNvfp4, P, W);
  const int64_t need = num_pages * NL * (lr.page_stride + W * ls.page_stride);
  Device dev(false);
  size_t free_b = 0, total_b = 0;
  ck(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  INDEXCP_REQUIRE(need < static_cast<int64_t>(free_b) * 9 / 10,
                  "--layers x --requests x --context need " + std::to_string(need >> 20) +
                      " MiB of index cache (replicated + shards), more than the GPU's " + std::to_string(free_b >> 20) +
                      " MiB free");
  const cudaStream_t st = dev.stream();
  const auto sst = reinterpret_cast<cuda::Stream>(st);
  std::printf("device %s: copy bandwidth %.0f GB/s\n", dev.name().c_str(), dev.copy_bandwidth_gbs());
  std::printf("decode step over %d sparse layers, one rank of TP%d (simulated), P = %d, context %d, Q = %d, H = %d, NVFP4\n",
              NL, W, P, ctx, Q, H);
  const auto bt = shuffled_block_table(num_pages, 99u);
  DeviceBuffer<int32_t> bt_dev(bt);
  cuda::DeviceCache repl(lr, num_pages, NL, 0);
  std::vector<std::unique_ptr<cuda::DeviceCache>> shards;
  for (int32_t r = 0; r < W; ++r) shards.push_back(std::make_unique<cuda::DeviceCache>(ls, num_pages, NL, r));
  {
    std::vector<cuda::DeviceCache*> all{&repl};
    for (auto& sh : shards) all.push_back(sh.get());
    fill_caches(all, 0, max_req, ctx, bt_dev.get(), max_pages, P, 0x5151ull, st);
    for (int32_t l = 1; l < NL; ++l) {
      ck(cudaMemcpyAsync(repl.layer_ptr(l), repl.layer_ptr(0), repl.layer_stride(), cudaMemcpyDeviceToDevice, st), "cudaMemcpyAsync");
      for (auto& s : shards)
        ck(cudaMemcpyAsync(s->layer_ptr(l), s->layer_ptr(0), s->layer_stride(), cudaMemcpyDeviceToDevice, st), "cudaMemcpyAsync");
    }
    ck(cudaStreamSynchronize(st), "cudaStreamSynchronize");
  }
  std::printf("%-5s %-14s %12s %12s %10s %14s %s\n", "reqs", "sharding", "step us", "per layer", "GB read", "cache B/token",
              "sel==repl");
  Progress prog(static_cast<int>(o.requests.size()) * 2, o.run.progress);
  json results = json::array();
  for (const int32_t B : o.requests) {
    std::vector<int32_t> seq(static_cast<size_t>(B), ctx);
    DeviceBuffer<int32_t> seq_dev(seq);
    const auto qh = random_q(static_cast<size_t>(B) * Q * H * 128, 31337u + B);
    DeviceBuffer<uint8_t> q_dev(qh);
    DecodeBatch b;
    b.q = q_dev.get();
    b.heads = H;
    b.block_table = bt_dev.get();
    b.num_requests = B;
    b.max_pages = max_pages;
    b.seq_lens = seq_dev.get();
    b.query_len = Q;
    cuda::DecodeShape shape;
    shape.max_requests = B;
    shape.max_pages = max_pages;
    shape.query_len = Q;
    shape.heads = H;
    std::vector<std::unique_ptr<cuda::DecodeStep>> rep, icp;
    std::vector<const cuda::DeviceCache*> cs;
    for (auto& s : shards) cs.push_back(s.get());
    for (int32_t l = 0; l < NL; ++l) {
      rep.push_back(std::make_unique<cuda::DecodeStep>(std::vector<const cuda::DeviceCache*>{&repl}, W, l, shape,
                                                       cuda::DecodePath::kReplicated));
      icp.push_back(std::make_unique<cuda::DecodeStep>(cs, W, l, shape, cuda::DecodePath::kIcp));
    }
    const size_t nsel = static_cast<size_t>(B) * Q * H * shape.sel.topk;
    DeviceBuffer<int32_t> o_rep(nsel * NL), o_icp(nsel * NL);
    // correctness: every layer's full step (all ranks), sharded == replicated
    for (int32_t l = 0; l < NL; ++l) {
      rep[l]->run(b, o_rep.get() + l * nsel, sst);
      icp[l]->run(b, o_icp.get() + l * nsel, sst);
    }
    ck(cudaStreamSynchronize(st), "cudaStreamSynchronize");
    const bool eq = o_rep.host() == o_icp.host();
    int64_t bytes_rep = 0, bytes_icp = 0;
    for (int32_t l = 0; l < NL; ++l) {
      bytes_rep += rep[l]->bytes_read(0, seq);
      bytes_icp += icp[l]->bytes_read(0, seq);
    }
    Graph g_rep(dev.capture([&] {
      for (int32_t l = 0; l < NL; ++l) {
        rep[l]->enqueue_score(0, b, sst);
        rep[l]->enqueue_select(0, b, o_rep.get() + l * nsel, sst);
      }
    }));
    Graph g_icp(dev.capture([&] {
      for (int32_t l = 0; l < NL; ++l) {
        icp[l]->enqueue_score(0, b, sst);
        icp[l]->enqueue_publish(0, b, sst);
        icp[l]->enqueue_select(0, b, o_icp.get() + l * nsel, sst);
      }
    }));
    std::vector<Stat> r_rep, r_icp;
    for (int i = 0; i < o.run.repeats; ++i) {
      r_rep.push_back(dev.time_graph(g_rep.e, o.run.replays));
      prog.step("B" + std::to_string(B) + " sharding off");
      r_icp.push_back(dev.time_graph(g_icp.e, o.run.replays));
      prog.step("B" + std::to_string(B) + " sharding on");
    }
    const Combined c_rep = combine(r_rep), c_icp = combine(r_icp);
    for (int k = 0; k < 2; ++k) {
      const bool on = k == 1;
      const Combined& c = on ? c_icp : c_rep;
      const int64_t bytes = on ? bytes_icp : bytes_rep;
      const int64_t per_token = (on ? ls : lr).page_bytes() / P;
      const double floor_us = bytes / (dev.copy_bandwidth_gbs() * 1e3);
      json j = {{"variant", on ? "step_sharding_on" : "step_sharding_off"}, {"tp", W}, {"page_size", P}, {"requests", B},
                {"context", ctx}, {"query_len", Q}, {"heads", H}, {"layers", NL}, {"kv_dtype", "nvfp4"},
                {"bytes_read", bytes}, {"floor_us", floor_us}, {"bandwidth_fraction", floor_us / c.median},
                {"per_layer_us", c.median / NL}, {"index_bytes_per_token_per_layer", per_token},
                {"index_cache_bytes_per_rank", (on ? shards[0]->size_bytes() : repl.size_bytes())},
                {"selections_equal_replicated", eq}};
      j.update(timing_fields(c));
      if (on) j["ratio_to_sharding_off"] = c.median / c_rep.median;
      results.push_back(j);
      std::printf("%-5d %-14s %12.1f %12.1f %10.2f %14lld %s%s\n", B, on ? "on (ICP)" : "off (replicated)", c.median,
                  c.median / NL, bytes / 1e9, static_cast<long long>(per_token), eq ? "yes" : "NO",
                  c.agree ? "" : "  (repeats disagree > 2%)");
    }
  }
  json rec = record_header("step", o.run, dev,
                           "one GPU, TP" + std::to_string(W) + " ranks simulated, rank 0 timed; the " + std::to_string(NL) +
                               "-layer step one CUDA graph");
  rec["results"] = results;
  write_record(rec, o.run);
  bool all_eq = true;
  for (const auto& r : results) all_eq = all_eq && r["selections_equal_replicated"].get<bool>();
  return all_eq;
}

}  // namespace indexcp::bench
