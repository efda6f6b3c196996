// `indexcp bench decode` and `indexcp bench topk`: the decode indexer table of spec/bench.md
// section 1 (method: bench.hpp). One GPU, the W TP ranks simulated on it; every cell times rank 0
// (each rank's share is real data of real size).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>

#include "bench/harness.cuh"
#include "core/json_util.hpp"
#include "indexcp/cuda.hpp"
#include "indexcp/plan.hpp"
#include "indexcp/error.hpp"
#include "indexcp/nccl.hpp"
#include "indexcp/npy.hpp"
#include "indexcp/rendezvous.hpp"
#include "core/knobs.hpp"

namespace indexcp::bench {
namespace {

void mkdirs(const std::string& p) {
  std::error_code ec;
  std::filesystem::create_directories(p, ec);
  if (ec) throw Error(ErrorCode::kInvalidArgument, "--dump " + p + ": cannot create the directory: " + ec.message());
}

// One page size's caches: a replicated cache and W shards holding the keys of max_req requests of
// max_ctx tokens each (pages scattered over the pool by a shuffled block table).
struct Pool {
  int32_t P = 128, max_pages = 0;
  std::vector<int32_t> bt;
  std::unique_ptr<DeviceBuffer<int32_t>> bt_dev;
  std::unique_ptr<cuda::DeviceCache> repl;
  std::vector<std::unique_ptr<cuda::DeviceCache>> shards;
};

// only_rank >= 0: build only that rank's shard (shards[0] is then rank only_rank's).
std::unique_ptr<Pool> build_pool(KvDtype dt, int32_t P, int32_t W, int32_t max_req, int32_t max_ctx, cudaStream_t st,
                                 int32_t only_rank = -1) {
  auto L = std::make_unique<Pool>();
  L->P = P;
  L->max_pages = (max_ctx + P - 1) / P;
  const int64_t num_pages = static_cast<int64_t>(max_req) * L->max_pages;
  L->bt = shuffled_block_table(num_pages, static_cast<uint32_t>(P));
  L->bt_dev = std::make_unique<DeviceBuffer<int32_t>>(L->bt);
  L->repl = std::make_unique<cuda::DeviceCache>(make_page_layout(dt, P, 1), num_pages, 1, 0);
  for (int32_t r = 0; r < W; ++r)
    if (only_rank < 0 || r == only_rank)
      L->shards.push_back(std::make_unique<cuda::DeviceCache>(make_page_layout(dt, P, W), num_pages, 1, r));
  std::vector<cuda::DeviceCache*> all{L->repl.get()};
  for (auto& sh : L->shards) all.push_back(sh.get());
  fill_caches(all, 0, max_req, max_ctx, L->bt_dev->get(), L->max_pages, P, 0x1234567ull, st);
  return L;
}

void dump_pool(const std::string& dir, const Pool& L) {
  mkdirs(dir);
  const auto& l = L.repl->layout();
  std::vector<uint8_t> bytes(static_cast<size_t>(L.repl->layer_stride()));
  ck(cudaMemcpy(bytes.data(), L.repl->layer_ptr(0), bytes.size(), cudaMemcpyDeviceToHost), "cudaMemcpy (dump)");
  npy::save(dir + "/pages.npy", npy::Dtype::kUint8, {L.repl->num_pages(), l.page_stride}, bytes.data());
  const int64_t reqs = static_cast<int64_t>(L.bt.size()) / L.max_pages;
  npy::save(dir + "/block_table.npy", {reqs, L.max_pages}, L.bt.data());
}

// One cell of the table: B requests of ctx tokens each through the pool's block table, random
// E4M3 q (seeded by the cell), the batch validated, and the DecodeShape of its steps.
struct Cell {
  std::vector<int32_t> seq;
  std::vector<uint8_t> qh;
  DeviceBuffer<int32_t> seq_dev;
  DeviceBuffer<uint8_t> q_dev;
  DecodeBatch b;
  cuda::DecodeShape shape;
  Cell(const Pool& L, int32_t B, int32_t ctx, int32_t Q, int32_t H, KRounding mode, ScorePrecision prec)
      : seq(static_cast<size_t>(B), ctx),
        qh(random_q(static_cast<size_t>(B) * Q * H * 128, static_cast<uint32_t>(B * 7919 + ctx))),
        seq_dev(seq),
        q_dev(qh) {
    b.q = q_dev.get();
    b.heads = H;
    b.block_table = L.bt_dev->get();
    b.num_requests = B;
    b.max_pages = L.max_pages;
    b.seq_lens = seq_dev.get();
    b.query_len = Q;
    cuda::validate_decode_batch(b, L.repl->num_pages(), L.P);
    shape.max_requests = B;
    shape.max_pages = L.max_pages;
    shape.query_len = Q;
    shape.heads = H;
    shape.mode = mode;
    shape.precision = prec;
  }
};

struct Variant {
  std::string name;
  Graph graph;
  int64_t bytes;
  bool eq;
};

}  // namespace

bool decode_processes(const DecodeOptions& o, const RankEnv& env);

bool decode(const DecodeOptions& o) {
  validate(o);
  if (const auto env = rank_env_from_env(); env && env->world > 1 && !o.topk_only) return decode_processes(o, *env);
  const KvDtype dt = o.kv_dtype == "fp8" ? KvDtype::kFp8 : KvDtype::kNvfp4;
  const KRounding mode = o.k_rounding == "exact" ? KRounding::kExact : KRounding::kE4m3;
  const ScorePrecision prec = parse_score_precision(o.score_precision, "--score-precision");
  const int32_t W = o.tp, H = o.heads, Q = o.query_len;
  const int32_t max_req = *std::max_element(o.requests.begin(), o.requests.end());
  const int32_t max_ctx = *std::max_element(o.contexts.begin(), o.contexts.end());
  const int64_t pool_bytes = int64_t{2} * max_req * int64_t{max_ctx} * (dt == KvDtype::kNvfp4 ? 72 : 128);
  Device dev;
  size_t free_b = 0, total_b = 0;
  ck(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  INDEXCP_REQUIRE(pool_bytes < static_cast<int64_t>(free_b) * 9 / 10,
                  "--requests x --contexts need " + std::to_string(pool_bytes >> 20) + " MiB of index cache (replicated + shards), more than the GPU's " +
                      std::to_string(free_b >> 20) + " MiB free");

  const cudaStream_t st = dev.stream();
  const auto sst = reinterpret_cast<cuda::Stream>(st);
  std::printf("device %s: copy bandwidth %.0f GB/s (read + write), FP8 matrix rate %.0f TFLOP/s\n", dev.name().c_str(),
              dev.copy_bandwidth_gbs(), dev.fp8_tflops());
  std::printf("graph launch (a graph of one empty kernel, timed as every cell; part of each median): %.1f us\n",
              dev.graph_launch_us());
  std::printf("%s: TP%d simulated on one GPU, rank 0 timed, Q = %d, H = %d, %s (%s rounding), %s scores, K = 16\n",
              o.topk_only ? "top-k selection" : "decode indexer", W, Q, H, o.kv_dtype.c_str(), o.k_rounding.c_str(),
              o.score_precision.c_str());
  std::printf("%-5s %-4s %-7s %-24s %10s %10s %9s %8s %s\n", "P", "reqs", "context", "variant", "median us", "MB read",
              "floor us", "of floor", "sel==repl");
  int cells = 0;
  for (int P : o.pages) cells += static_cast<int>(o.requests.size() * o.contexts.size()) * (P == 256 && W == 2 && !o.topk_only ? 5 : 4);
  Progress prog(cells, o.run.progress);

  json results = json::array();
  for (const int32_t P : o.pages) {
    auto L = build_pool(dt, P, W, max_req, max_ctx, st);
    const std::string pdir = o.dump.empty() ? "" : o.dump + "/P" + std::to_string(P);
    if (!pdir.empty()) dump_pool(pdir, *L);
    for (const int32_t B : o.requests)
      for (const int32_t ctx : o.contexts) {
        const Cell cell(*L, B, ctx, Q, H, mode, prec);
        const std::vector<int32_t>& seq = cell.seq;
        const std::vector<uint8_t>& qh = cell.qh;
        const DecodeBatch& b = cell.b;
        const cuda::DecodeShape& shape = cell.shape;
        cuda::DecodeStep rep({L->repl.get()}, W, 0, shape, cuda::DecodePath::kReplicated);
        std::vector<const cuda::DeviceCache*> cs;
        for (auto& s : L->shards) cs.push_back(s.get());
        cuda::DecodeStep icp_gen(cs, W, 0, shape, cuda::DecodePath::kIcp, false);
        std::unique_ptr<cuda::DecodeStep> icp_stock;
        if (P == 256 && W == 2) icp_stock = std::make_unique<cuda::DecodeStep>(cs, W, 0, shape, cuda::DecodePath::kIcp, true);
        // Correctness of the cell first: the whole step of every path, all heads, compared.
        const size_t nsel = static_cast<size_t>(B) * Q * H * shape.sel.topk;
        DeviceBuffer<int32_t> o_rep(nsel), o_icp(nsel), o_stk(nsel);
        rep.run(b, o_rep.get(), sst);
        icp_gen.run(b, o_icp.get(), sst);
        if (icp_stock) icp_stock->run(b, o_stk.get(), sst);
        ck(cudaStreamSynchronize(st), "cudaStreamSynchronize");
        const auto h_rep = o_rep.host();
        const bool eq_gen = h_rep == o_icp.host();
        const bool eq_stk = !icp_stock || h_rep == o_stk.host();
        // fp8_mma: the share of (row, head) selections that differ from the fp32 mode's
        double differ_fp32 = -1;
        if (prec != ScorePrecision::kFp32) {
          cuda::DecodeShape s32 = shape;
          s32.precision = ScorePrecision::kFp32;
          DeviceBuffer<int32_t> o32(nsel);
          cuda::DecodeStep(std::vector<const cuda::DeviceCache*>{L->repl.get()}, W, 0, s32, cuda::DecodePath::kReplicated)
              .run(b, o32.get(), sst);
          ck(cudaStreamSynchronize(st), "cudaStreamSynchronize");
          const auto h32 = o32.host();
          const int64_t lists = static_cast<int64_t>(nsel) / shape.sel.topk;
          int64_t differ = 0;
          for (int64_t i = 0; i < lists; ++i)
            differ += !std::equal(h_rep.begin() + i * shape.sel.topk, h_rep.begin() + (i + 1) * shape.sel.topk,
                                  h32.begin() + i * shape.sel.topk);
          differ_fp32 = static_cast<double>(differ) / static_cast<double>(lists);
        }
        if (!pdir.empty()) {
          const std::string cdir = pdir + "/B" + std::to_string(B) + "_ctx" + std::to_string(ctx);
          mkdirs(cdir);
          int32_t h0, nh;
          owned_heads(H, W, 0, &h0, &nh);
          const int64_t rows = static_cast<int64_t>(B) * Q, K = shape.sel.topk;
          std::vector<int32_t> mine(static_cast<size_t>(rows * nh * K));
          for (int64_t r = 0; r < rows; ++r)
            for (int32_t h = 0; h < nh; ++h)
              std::copy_n(h_rep.begin() + (r * H + h0 + h) * K, K, mine.begin() + (r * nh + h) * K);
          npy::save(cdir + "/q.npy", npy::Dtype::kUint8, {rows, H, 128}, qh.data());
          npy::save(cdir + "/selected.npy", {rows, nh, K}, mine.data());
          std::ofstream(cdir + "/meta.json")
              << json{{"page_size", P}, {"requests", B}, {"context", ctx}, {"query_len", Q}, {"heads", H},
                      {"owned_heads", nh}, {"owned_head0", h0}, {"topk", K}, {"init_blocks", shape.sel.init_blocks},
                      {"local_blocks", shape.sel.local_blocks}, {"kv_dtype", o.kv_dtype}, {"k_rounding", o.k_rounding},
                      {"score_precision", o.score_precision},
                      {"tp", W}}
                     .dump(2)
              << "\n";
        }
        int32_t h0, nh;
        owned_heads(H, W, 0, &h0, &nh);
        const int64_t rows = static_cast<int64_t>(B) * Q;
        const int64_t hist_blocks = (ctx - 1) / 128;  // upper bound of a row's historical blocks
        std::vector<Variant> vs;
        auto add = [&](const std::string& name, int64_t bytes, bool eq, auto&& fn) {
          vs.push_back({name, Graph(dev.capture(fn)), bytes, eq});
        };
        if (!o.topk_only) {
          add("replicated_stock", rep.bytes_read(0, seq), true, [&] {
            rep.enqueue_score(0, b, sst);
            rep.enqueue_select(0, b, o_rep.get(), sst);
          });
          add("replicated_stock_score", rep.bytes_read(0, seq), true, [&] { rep.enqueue_score(0, b, sst); });
          add("icp_general", icp_gen.bytes_read(0, seq), eq_gen, [&] {
            icp_gen.enqueue_score(0, b, sst);
            icp_gen.enqueue_publish(0, b, sst);
            icp_gen.enqueue_select(0, b, o_icp.get(), sst);
          });
          add("icp_general_score", icp_gen.bytes_read(0, seq), eq_gen, [&] { icp_gen.enqueue_score(0, b, sst); });
          if (icp_stock)
            add("icp_stock", icp_stock->bytes_read(0, seq), eq_stk, [&] {
              icp_stock->enqueue_score(0, b, sst);
              icp_stock->enqueue_publish(0, b, sst);
              icp_stock->enqueue_select(0, b, o_stk.get(), sst);
            });
        } else {
          // bytes: the block scores read (fp32 per row, head and historical block)
          add("replicated_select", rows * nh * hist_blocks * 4, true, [&] { rep.enqueue_select(0, b, o_rep.get(), sst); });
          add("icp_publish", rows * H * hist_blocks * 4, eq_gen, [&] { icp_gen.enqueue_publish(0, b, sst); });
          add("icp_merge", rows * nh * W * shape.sel.ranked() * 8, eq_gen, [&] { icp_gen.enqueue_select(0, b, o_icp.get(), sst); });
          add("icp_publish_merge", rows * H * hist_blocks * 4 + rows * nh * W * shape.sel.ranked() * 8, eq_gen, [&] {
            icp_gen.enqueue_publish(0, b, sst);
            icp_gen.enqueue_select(0, b, o_icp.get(), sst);
          });
        }
        std::map<std::string, std::vector<Stat>> runs;
        for (int rep_i = 0; rep_i < o.run.repeats; ++rep_i)
          for (auto& v : vs) runs[v.name].push_back(dev.time_graph(v.graph.e, o.run.replays));
        double rep_us = 0;
        for (auto& v : vs) {
          const Combined c = combine(runs[v.name]);
          if (v.name == "replicated_stock") rep_us = c.median;
          const double floor_us = v.bytes / (dev.copy_bandwidth_gbs() * 1e3);
          json j = {{"variant", v.name}, {"tp", W}, {"page_size", P}, {"requests", B}, {"context", ctx}, {"query_len", Q},
                    {"heads", H}, {"owned_heads", nh}, {"kv_dtype", o.kv_dtype}, {"k_rounding", o.k_rounding},
                    {"score_precision", o.score_precision}, {"bytes_read", v.bytes}, {"floor_us", floor_us},
                    {"bandwidth_fraction", v.bytes ? floor_us / c.median : 0.0},
                    {"selections_equal_replicated", v.eq}};
          j.update(timing_fields(c));
          if (differ_fp32 >= 0) j["selections_differing_from_fp32"] = differ_fp32;
          if ((v.name == "icp_general" || v.name == "icp_stock") && rep_us > 0) j["ratio_to_replicated_stock"] = c.median / rep_us;
          results.push_back(j);
          std::printf("%-5d %-4d %-7d %-24s %10.1f %10.1f %9.1f %7.1f%% %s%s\n", P, B, ctx, v.name.c_str(), c.median,
                      v.bytes / 1e6, floor_us, v.bytes ? 100.0 * floor_us / c.median : 0.0, v.eq ? "yes" : "NO",
                      c.agree ? "" : "  (repeats disagree > 2%)");
          prog.step("P" + std::to_string(P) + " B" + std::to_string(B) + " ctx " + std::to_string(ctx) + " " + v.name);
        }
        std::fflush(stdout);
      }
  }
  json rec = record_header(o.topk_only ? "topk" : "decode", o.run, dev,
                           "one GPU, TP" + std::to_string(W) +
                               " ranks simulated (rank 0 timed, each rank's share real data of real size); each timed "
                               "sequence a CUDA graph");
  rec["results"] = results;
  write_record(rec, o.run);
  bool all_eq = true;
  for (const auto& r : results) all_eq = all_eq && r["selections_equal_replicated"].get<bool>();
  return all_eq;
}

// ---------------------------------------------------------------------------------------------
// One rank of a real multi-process group (under `indexcp launch --tp W`, one GPU per process):
// ICP decode through the NCCL communicator (score all heads over this rank's rows, publish, NCCL
// all-gather of the candidates, merge), the all-gather alone (the exchange's share), and the
// replicated stock path of this rank's heads on the same GPU, all as CUDA graphs with the method
// of bench.hpp. Every rank checks its ICP selection against the replicated one computed on its
// own GPU. Rank 0 prints the table and writes the record ("processes": W, "num_gpus": W) with
// every rank's medians. NOT YET RUN on a machine with two or more GPUs (issue 5).

namespace {

int64_t shard_bytes(const PageLayout& l, int32_t rank, int32_t seq_len) {
  if (seq_len <= 0) return 0;
  const int64_t max_local = (static_cast<int64_t>(seq_len) - 1) / kBlockTokens;
  int64_t bytes = 0;
  for (int64_t blk = 0; blk < max_local; ++blk) {
    int64_t lp;
    int32_t first, count;
    l.block_rows_on_rank(blk, rank, &lp, &first, &count);
    bytes += static_cast<int64_t>(count) * (l.page_bytes() / l.rows());
  }
  return bytes;
}

// All ranks' values of `v` (one double per rank), through the communicator.
std::vector<double> gather_doubles(Communicator& comm, const std::vector<double>& v, cudaStream_t st) {
  const int W = comm.world();
  DeviceBuffer<double> send(v.size()), recv(v.size() * W);
  ck(cudaMemcpyAsync(send.get(), v.data(), v.size() * sizeof(double), cudaMemcpyHostToDevice, st), "cudaMemcpyAsync");
  comm.all_gather(send.get(), recv.get(), v.size() * sizeof(double), st);
  comm.synchronize(st);
  return recv.host();
}

}  // namespace

bool decode_processes(const DecodeOptions& o, const RankEnv& env) {
  INDEXCP_REQUIRE(o.tp == env.world, "--tp = " + std::to_string(o.tp) + " differs from the group's world size (INDEXCP_WORLD = " +
                                         std::to_string(env.world) + ")");
  INDEXCP_REQUIRE(o.dump.empty(), "--dump is not supported with several processes");
  // no GPU: say so now, not after the rendezvous timeout of a group that can never form
  if (!cuda::available()) throw Error(ErrorCode::kUnsupported, "no CUDA GPU is visible: `indexcp bench` needs one");
  auto comm = nccl::make_communicator(env);  // also makes env.device the current device
  const KvDtype dt = o.kv_dtype == "fp8" ? KvDtype::kFp8 : KvDtype::kNvfp4;
  const KRounding mode = o.k_rounding == "exact" ? KRounding::kExact : KRounding::kE4m3;
  const ScorePrecision prec = parse_score_precision(o.score_precision, "--score-precision");
  const int32_t W = o.tp, H = o.heads, Q = o.query_len, r = env.rank;
  const bool lead = r == 0;
  const int32_t max_req = *std::max_element(o.requests.begin(), o.requests.end());
  const int32_t max_ctx = *std::max_element(o.contexts.begin(), o.contexts.end());
  Device dev;
  const cudaStream_t st = dev.stream();
  const auto sst = reinterpret_cast<cuda::Stream>(st);
  int32_t h0, nh;
  owned_heads(H, W, r, &h0, &nh);
  if (lead) {
    std::printf("device %s: copy bandwidth %.0f GB/s (rank 0)\n", dev.name().c_str(), dev.copy_bandwidth_gbs());
    std::printf("decode indexer: TP%d across %d processes (one GPU each, NCCL %s), Q = %d, H = %d, %s (%s rounding)\n", W,
                W, nccl::version().c_str(), Q, H, o.kv_dtype.c_str(), o.k_rounding.c_str());
    std::printf("%-5s %-4s %-7s %-24s %10s %10s %s\n", "P", "reqs", "context", "variant", "rank 0 us", "max rank us",
                "sel==repl (all ranks)");
  }
  Progress prog(static_cast<int>(o.pages.size() * o.requests.size() * o.contexts.size()) * 3, o.run.progress && lead);
  json results = json::array();
  bool all_eq = true;
  for (const int32_t P : o.pages) {
    auto L = build_pool(dt, P, W, max_req, max_ctx, st, r);
    const cuda::DeviceCache& shard = *L->shards.at(0);
    for (const int32_t B : o.requests)
      for (const int32_t ctx : o.contexts) {
        const Cell cell(*L, B, ctx, Q, H, mode, prec);
        const std::vector<int32_t>& seq = cell.seq;
        const DecodeBatch& b = cell.b;
        const cuda::DecodeShape& shape = cell.shape;
        SelectionParams sel = shape.sel;
        const int64_t rows = static_cast<int64_t>(B) * Q, K = sel.topk;
        // replicated path of all heads on this GPU (the W ranks of the step simulated here)
        cuda::DecodeStep rep({L->repl.get()}, W, 0, shape, cuda::DecodePath::kReplicated);
        DeviceBuffer<int32_t> o_rep(static_cast<size_t>(rows * H * K)), o_icp(static_cast<size_t>(rows * nh * K));
        rep.run(b, o_rep.get(), sst);
        cuda::icp_decode(*comm, shard, 0, b, sel, mode, o_icp.get(), sst, false, true, prec);
        comm->synchronize(st);
        const auto h_rep = o_rep.host(), h_icp = o_icp.host();
        bool eq = true;
        for (int64_t i = 0; i < rows && eq; ++i)
          for (int32_t h = 0; h < nh && eq; ++h)
            eq = std::equal(h_icp.begin() + (i * nh + h) * K, h_icp.begin() + (i * nh + h + 1) * K,
                            h_rep.begin() + (i * H + h0 + h) * K);
        // the exchange alone: this rank's record (candidates + step signature), all-gathered
        const size_t xbytes = exchange_layout(rows, H, sel).record_bytes;
        DeviceBuffer<uint8_t> xs(xbytes), xr(xbytes * W);
        ck(cudaMemset(xs.get(), 0, xbytes), "cudaMemset");
        Graph g_rep(dev.capture([&] {
          rep.enqueue_score(r, b, sst);
          rep.enqueue_select(r, b, o_rep.get(), sst);
        }));
        Graph g_icp(dev.capture([&] { cuda::icp_decode(*comm, shard, 0, b, sel, mode, o_icp.get(), sst, false, true, prec); }));
        Graph g_x(dev.capture([&] { comm->all_gather(xs.get(), xr.get(), xbytes, sst); }));
        struct V {
          const char* name;
          const Graph* g;
          int64_t bytes;
        };
        const int64_t icp_bytes = static_cast<int64_t>(B) * shard_bytes(shard.layout(), r, ctx);
        const V vs[] = {{"replicated_stock", &g_rep, rep.bytes_read(r, seq)},
                        {"icp_nccl", &g_icp, icp_bytes},
                        {"icp_nccl_exchange", &g_x, 0}};
        double icp_med = 0;
        for (const V& v : vs) {
          std::vector<Stat> runs;
          for (int k = 0; k < o.run.repeats; ++k) runs.push_back(dev.time_graph(v.g->e, o.run.replays, comm.get()));
          comm->synchronize(st);
          const Combined c = combine(runs);
          const auto all = gather_doubles(*comm, {c.median, eq ? 1.0 : 0.0}, st);
          std::vector<double> meds;
          bool eq_all = true;
          for (int k = 0; k < W; ++k) {
            meds.push_back(all[2 * k]);
            eq_all = eq_all && all[2 * k + 1] == 1.0;
          }
          all_eq = all_eq && eq_all;
          if (std::string(v.name) == "icp_nccl") icp_med = c.median;
          const double floor_us = v.bytes / (dev.copy_bandwidth_gbs() * 1e3);
          json j = {{"variant", v.name}, {"tp", W}, {"page_size", P}, {"requests", B}, {"context", ctx}, {"query_len", Q},
                    {"heads", H}, {"owned_heads", nh}, {"kv_dtype", o.kv_dtype}, {"k_rounding", o.k_rounding},
                    {"bytes_read", v.bytes}, {"floor_us", floor_us},
                    {"bandwidth_fraction", v.bytes ? floor_us / c.median : 0.0}, {"per_rank_median_us", meds},
                    {"selections_equal_replicated", eq_all}};
          j.update(timing_fields(c));
          if (std::string(v.name) == "icp_nccl_exchange") {
            j["bytes_sent_per_rank"] = static_cast<int64_t>(xbytes);
            if (icp_med > 0) j["share_of_icp_nccl"] = c.median / icp_med;
          }
          results.push_back(j);
          if (lead)
            std::printf("%-5d %-4d %-7d %-24s %10.1f %10.1f %s\n", P, B, ctx, v.name, c.median,
                        *std::max_element(meds.begin(), meds.end()), eq_all ? "yes" : "NO");
          prog.step("P" + std::to_string(P) + " B" + std::to_string(B) + " ctx " + std::to_string(ctx) + " " + v.name);
        }
      }
  }
  // this rank's own results for the launcher's merged report ($INDEXCP_REPORT_DIR/rank<r>.json)
  if (const char* dir = ::indexcp::detail::knob_env("INDEXCP_REPORT_DIR"); dir && *dir) {
    std::ofstream f(std::string(dir) + "/rank" + std::to_string(r) + ".json");
    f << indexcp::detail::dump_text(json{{"rank", r}, {"device", dev.name()}, {"cuda_device", env.device}, {"results", results}})
      << "\n";
  }
  if (lead) {
    json rec = record_header("decode", o.run, dev,
                             "TP" + std::to_string(W) + " across " + std::to_string(W) +
                                 " processes, one GPU each, NCCL all-gather of the candidates; rank 0 timed (every "
                                 "rank's medians in per_rank_median_us); each timed sequence a CUDA graph");
    rec["processes"] = W;
    rec["num_gpus"] = W;
    rec["nccl"] = nccl::version();
    rec["results"] = results;
    write_record(rec, o.run);
  }
  comm->synchronize(st);
  comm->finalize();
  return all_eq;
}

}  // namespace indexcp::bench
