// indexcp_bench_decode: the decode indexer table of spec/bench.md section 1 on one GPU, both TP
// ranks simulated on it (each rank's share is real data of real size).
//
// Per configuration (requests x context x page size, TP2, Q = 8, H = 4, NVFP4, E4M3 rounding):
//   replicated_stock        rank 0: stock scorer over all pages for its 2 heads + exact top-k
//   replicated_stock_score  the scorer alone (the bandwidth target of issue 4)
//   icp_general             rank 0: general scorer, all 4 heads over its rows, + publish + merge
//   icp_general_score       its scorer alone
//   icp_stock               (P256 only) the same with the stock scorer on the shard pages
// Each timed sequence is captured as its own CUDA graph; L2 is flushed (a memset larger than L2)
// before every replay, outside the timed region; median of --replays replays; the whole table
// runs twice and the medians are averaged when they agree within 2% (else both are reported).
// The copy bandwidth (device-to-device cudaMemcpy, bytes read + written) is measured in the same
// run. Writes a JSON record (bench.md section 3) to --out.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "indexcp/cuda.hpp"
#include "indexcp/error.hpp"

using namespace indexcp;
using nlohmann::json;

#define CK(call)                                                                                  \
  do {                                                                                            \
    cudaError_t e_ = (call);                                                                      \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(2);                                                                               \
    }                                                                                             \
  } while (0)

namespace {

// Deterministic pseudo-normal keys: sum of 4 uniforms from a hash, scaled to unit variance.
__global__ void gen_keys(float* k, int64_t n_vals, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n_vals;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t x = (static_cast<uint64_t>(i) + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    float s = 0.0f;
    for (int j = 0; j < 4; ++j) {
      x ^= x >> 30;
      x *= 0xBF58476D1CE4E5B9ull;
      x ^= x >> 27;
      x *= 0x94D049BB133111EBull;
      x ^= x >> 31;
      s += static_cast<float>(x >> 40) * (1.0f / 16777216.0f);
    }
    k[i] = (s - 2.0f) * 1.7320508f;
  }
}

__global__ void gen_slots(int64_t* slots, int64_t t0, int64_t n, int32_t ctx, const int32_t* bt, int32_t max_pages,
                          int32_t P) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = t0 + i;
    const int64_t b = t / ctx, p = t % ctx;
    slots[i] = static_cast<int64_t>(bt[b * max_pages + p / P]) * P + p % P;
  }
}

struct Timer {
  std::vector<cudaEvent_t> a, b;
  explicit Timer(int n) : a(n), b(n) {
    for (int i = 0; i < n; ++i) {
      CK(cudaEventCreate(&a[i]));
      CK(cudaEventCreate(&b[i]));
    }
  }
  ~Timer() {
    for (auto e : a) cudaEventDestroy(e);
    for (auto e : b) cudaEventDestroy(e);
  }
};

struct Stat {
  double median = 0, min = 0, max = 0;
  int samples = 0;
};

Stat stats(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  Stat s;
  s.samples = static_cast<int>(v.size());
  s.min = v.front();
  s.max = v.back();
  s.median = v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  return s;
}

// Replays `exec` n times with an L2 flush before each, timing only the graph.
Stat time_graph(cudaGraphExec_t exec, cudaStream_t st, void* flush, size_t flush_bytes, int n) {
  Timer t(n);
  for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(exec, st));  // warm-up
  for (int i = 0; i < n; ++i) {
    CK(cudaMemsetAsync(flush, i & 0xff, flush_bytes, st));
    CK(cudaEventRecord(t.a[i], st));
    CK(cudaGraphLaunch(exec, st));
    CK(cudaEventRecord(t.b[i], st));
  }
  CK(cudaStreamSynchronize(st));
  std::vector<double> us(n);
  for (int i = 0; i < n; ++i) {
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, t.a[i], t.b[i]));
    us[i] = ms * 1000.0;
  }
  return stats(us);
}

template <class Fn>
cudaGraphExec_t capture(cudaStream_t st, Fn&& fn) {
  cudaGraph_t g;
  cudaGraphExec_t e;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  fn();
  CK(cudaStreamEndCapture(st, &g));
  CK(cudaGraphInstantiate(&e, g, 0));
  CK(cudaGraphDestroy(g));
  return e;
}

double copy_bandwidth_gbs(cudaStream_t st) {
  const size_t bytes = size_t{2} << 30;
  void *a, *b;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMemset(a, 1, bytes));
  Timer t(20);
  for (int i = 0; i < 3; ++i) CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, st));
  for (int i = 0; i < 20; ++i) {
    CK(cudaEventRecord(t.a[i], st));
    CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, st));
    CK(cudaEventRecord(t.b[i], st));
  }
  CK(cudaStreamSynchronize(st));
  std::vector<double> v;
  for (int i = 0; i < 20; ++i) {
    float ms;
    CK(cudaEventElapsedTime(&ms, t.a[i], t.b[i]));
    v.push_back(2.0 * bytes / (ms * 1e-3) / 1e9);
  }
  CK(cudaFree(a));
  CK(cudaFree(b));
  return stats(v).median;
}

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  std::string x;
  while (std::getline(ss, x, ',')) v.push_back(std::atoi(x.c_str()));
  return v;
}

// Caches of one page size filled with keys of max_req requests x max_ctx tokens.
struct Layout {
  int32_t P = 128, max_pages = 0;
  std::vector<int32_t> bt;
  int32_t* bt_dev = nullptr;
  std::unique_ptr<cuda::DeviceCache> repl;
  std::vector<std::unique_ptr<cuda::DeviceCache>> shards;
};

std::unique_ptr<Layout> build(int32_t P, int32_t W, int32_t max_req, int32_t max_ctx, cudaStream_t st, double* insert_tok_s) {
  auto L = std::make_unique<Layout>();
  L->P = P;
  L->max_pages = max_ctx / P;
  const int64_t num_pages = static_cast<int64_t>(max_req) * L->max_pages;
  std::vector<int32_t> pool(static_cast<size_t>(num_pages));
  std::iota(pool.begin(), pool.end(), 0);
  std::mt19937 rng(P);
  if (!std::getenv("BENCH_NO_SHUFFLE")) std::shuffle(pool.begin(), pool.end(), rng);
  L->bt = pool;  // [max_req][max_pages]
  CK(cudaMalloc(&L->bt_dev, L->bt.size() * sizeof(int32_t)));
  CK(cudaMemcpy(L->bt_dev, L->bt.data(), L->bt.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  L->repl = std::make_unique<cuda::DeviceCache>(make_page_layout(KvDtype::kNvfp4, P, 1), num_pages, 1, 0);
  for (int32_t r = 0; r < W; ++r)
    L->shards.push_back(std::make_unique<cuda::DeviceCache>(make_page_layout(KvDtype::kNvfp4, P, W), num_pages, 1, r));
  const int64_t total = static_cast<int64_t>(max_req) * max_ctx;
  const int64_t chunk = int64_t{1} << 20;
  float* keys;
  int64_t* slots;
  CK(cudaMalloc(&keys, chunk * 128 * sizeof(float)));
  CK(cudaMalloc(&slots, chunk * sizeof(int64_t)));
  double insert_s = 0;
  int64_t inserted = 0;
  for (int64_t t0 = 0; t0 < total; t0 += chunk) {
    const int64_t n = std::min(chunk, total - t0);
    gen_keys<<<4096, 256, 0, st>>>(keys, n * 128, 0x1234567ull + t0);
    gen_slots<<<1024, 256, 0, st>>>(slots, t0, n, max_ctx, L->bt_dev, L->max_pages, P);
    CK(cudaStreamSynchronize(st));
    const auto a = std::chrono::steady_clock::now();
    cuda::insert_keys(*L->repl, 0, keys, slots, n, InsertOptions{}, reinterpret_cast<cuda::Stream>(st));
    insert_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
    inserted += n;
    for (auto& s : L->shards) cuda::insert_keys(*s, 0, keys, slots, n, InsertOptions{}, reinterpret_cast<cuda::Stream>(st));
  }
  CK(cudaFree(keys));
  CK(cudaFree(slots));
  if (insert_tok_s) *insert_tok_s = inserted / insert_s;
  return L;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> requests = {16, 64}, contexts = {131072, 172032}, pages = {256, 128};
  int replays = 200, repeats = 2;
  std::string out, git_rev = "unknown", driver = "unknown";
  std::string command;
  for (int i = 0; i < argc; ++i) command += (i ? " " : "") + std::string(argv[i]);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(1);
      }
      return argv[++i];
    };
    if (a == "--requests") requests = parse_list(next());
    else if (a == "--contexts") contexts = parse_list(next());
    else if (a == "--pages") pages = parse_list(next());
    else if (a == "--replays") replays = std::atoi(next().c_str());
    else if (a == "--repeats") repeats = std::atoi(next().c_str());
    else if (a == "--out") out = next();
    else if (a == "--git-rev") git_rev = next();
    else if (a == "--driver") driver = next();
    else {
      std::fprintf(stderr,
                   "usage: indexcp_bench_decode [--requests 16,64] [--contexts 131072,172032] [--pages 256,128] "
                   "[--replays 200] [--repeats 2] [--out FILE.json] [--git-rev REV] [--driver VER]\n");
      return 1;
    }
  }
  if (!cuda::available()) {
    std::fprintf(stderr, "no CUDA GPU visible\n");
    return 1;
  }
  const int32_t W = 2, H = 4, Q = 8;
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const double copy_bw = copy_bandwidth_gbs(st);
  int l2 = 0, dev = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
  const size_t flush_bytes = std::max<size_t>(size_t{256} << 20, static_cast<size_t>(l2) * 4);
  void* flush;
  CK(cudaMalloc(&flush, flush_bytes));
  int rt = 0, drv = 0;
  CK(cudaRuntimeGetVersion(&rt));
  CK(cudaDriverGetVersion(&drv));
  std::printf("device %s, copy bandwidth %.0f GB/s (read + write), L2 %d MB, flush %zu MB\n",
              cuda::device_name().c_str(), copy_bw, l2 >> 20, flush_bytes >> 20);

  const int32_t max_req = *std::max_element(requests.begin(), requests.end());
  const int32_t max_ctx = *std::max_element(contexts.begin(), contexts.end());
  json results = json::array();
  double insert_rate = 0;
  for (int32_t P : pages) {
    double rate = 0;
    auto L = build(P, W, max_req, max_ctx, st, &rate);
    insert_rate = std::max(insert_rate, rate);
    for (int32_t B : requests)
      for (int32_t ctx : contexts) {
        // batch: B requests of ctx tokens, the first B rows of the block table
        std::vector<int32_t> seq(static_cast<size_t>(B), ctx);
        int32_t* seq_dev;
        uint8_t* q_dev;
        CK(cudaMalloc(&seq_dev, B * sizeof(int32_t)));
        CK(cudaMemcpy(seq_dev, seq.data(), B * sizeof(int32_t), cudaMemcpyHostToDevice));
        std::vector<uint8_t> q(static_cast<size_t>(B) * Q * H * 128);
        std::mt19937 rng(B + ctx);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        for (auto& x : q) x = e4m3_encode(nd(rng));
        CK(cudaMalloc(&q_dev, q.size()));
        CK(cudaMemcpy(q_dev, q.data(), q.size(), cudaMemcpyHostToDevice));
        DecodeBatch b;
        b.q = q_dev;
        b.heads = H;
        b.block_table = L->bt_dev;
        b.num_requests = B;
        b.max_pages = L->max_pages;
        b.seq_lens = seq_dev;
        b.query_len = Q;
        cuda::DecodeShape shape;
        shape.max_requests = B;
        shape.max_pages = L->max_pages;
        shape.query_len = Q;
        shape.heads = H;
        cuda::DecodeStep rep({L->repl.get()}, W, 0, shape, cuda::DecodePath::kReplicated);
        std::vector<const cuda::DeviceCache*> cs;
        for (auto& s : L->shards) cs.push_back(s.get());
        cuda::DecodeStep icp_gen(cs, W, 0, shape, cuda::DecodePath::kIcp, false);
        std::unique_ptr<cuda::DecodeStep> icp_stock;
        if (P == 256) icp_stock = std::make_unique<cuda::DecodeStep>(cs, W, 0, shape, cuda::DecodePath::kIcp, true);
        // correctness of this configuration: the full step of every path, selections compared
        const size_t nsel = static_cast<size_t>(B) * Q * H * 16;
        int32_t *o_rep, *o_icp, *o_stk;
        CK(cudaMalloc(&o_rep, nsel * 4));
        CK(cudaMalloc(&o_icp, nsel * 4));
        CK(cudaMalloc(&o_stk, nsel * 4));
        const auto sst = reinterpret_cast<cuda::Stream>(st);
        rep.run(b, o_rep, sst);
        icp_gen.run(b, o_icp, sst);
        if (icp_stock) icp_stock->run(b, o_stk, sst);
        CK(cudaStreamSynchronize(st));
        std::vector<int32_t> h_rep(nsel), h_icp(nsel), h_stk(nsel);
        CK(cudaMemcpy(h_rep.data(), o_rep, nsel * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(h_icp.data(), o_icp, nsel * 4, cudaMemcpyDeviceToHost));
        const bool eq_gen = h_rep == h_icp;
        bool eq_stk = true;
        if (icp_stock) {
          CK(cudaMemcpy(h_stk.data(), o_stk, nsel * 4, cudaMemcpyDeviceToHost));
          eq_stk = h_rep == h_stk;
        }
        struct Variant {
          std::string name;
          cudaGraphExec_t exec;
          int64_t bytes;
          bool eq;
        };
        std::vector<Variant> vs;
        vs.push_back({"replicated_stock", capture(st, [&] { rep.enqueue_score(0, b, sst); rep.enqueue_select(0, b, o_rep, sst); }),
                      rep.bytes_read(0, seq), true});
        vs.push_back({"replicated_stock_score", capture(st, [&] { rep.enqueue_score(0, b, sst); }), rep.bytes_read(0, seq), true});
        vs.push_back({"icp_general", capture(st, [&] {
                        icp_gen.enqueue_score(0, b, sst);
                        icp_gen.enqueue_publish(0, b, sst);
                        icp_gen.enqueue_select(0, b, o_icp, sst);
                      }),
                      icp_gen.bytes_read(0, seq), eq_gen});
        vs.push_back({"icp_general_score", capture(st, [&] { icp_gen.enqueue_score(0, b, sst); }), icp_gen.bytes_read(0, seq), eq_gen});
        vs.push_back({"replicated_select", capture(st, [&] { rep.enqueue_select(0, b, o_rep, sst); }), 0, true});
        vs.push_back({"icp_publish", capture(st, [&] { icp_gen.enqueue_publish(0, b, sst); }), 0, eq_gen});
        vs.push_back({"icp_merge", capture(st, [&] { icp_gen.enqueue_select(0, b, o_icp, sst); }), 0, eq_gen});
        vs.push_back({"icp_publish_merge", capture(st, [&] {
                        icp_gen.enqueue_publish(0, b, sst);
                        icp_gen.enqueue_select(0, b, o_icp, sst);
                      }),
                      0, eq_gen});
        if (icp_stock)
          vs.push_back({"icp_stock", capture(st, [&] {
                          icp_stock->enqueue_score(0, b, sst);
                          icp_stock->enqueue_publish(0, b, sst);
                          icp_stock->enqueue_select(0, b, o_stk, sst);
                        }),
                        icp_stock->bytes_read(0, seq), eq_stk});
        std::map<std::string, std::vector<Stat>> runs;
        for (int rep_i = 0; rep_i < repeats; ++rep_i)
          for (auto& v : vs) runs[v.name].push_back(time_graph(v.exec, st, flush, flush_bytes, replays));
        double rep_us = 0;
        for (auto& v : vs) {
          const auto& r = runs[v.name];
          double med = r[0].median;
          bool agree = true;
          if (r.size() > 1) {
            agree = std::fabs(r[0].median - r[1].median) <= 0.02 * std::min(r[0].median, r[1].median);
            med = agree ? 0.5 * (r[0].median + r[1].median) : r[0].median;
          }
          if (v.name == "replicated_stock") rep_us = med;
          json j = {{"variant", v.name}, {"tp", W}, {"page_size", P}, {"requests", B}, {"context", ctx}, {"query_len", Q},
                    {"heads", H}, {"kv_dtype", "nvfp4"}, {"k_rounding", "e4m3"}, {"median_us", med},
                    {"min_us", r[0].min}, {"max_us", r[0].max}, {"samples", r[0].samples}, {"bytes_read", v.bytes},
                    {"bandwidth_fraction", v.bytes ? (v.bytes / (med * 1e-6) / 1e9) / copy_bw : 0.0},
                    {"selections_equal_replicated", v.eq}};
          if (r.size() > 1) {
            j["repeat_medians_us"] = {r[0].median, r[1].median};
            j["repeats_agree_2pct"] = agree;
          }
          if (v.name == "icp_general" || v.name == "icp_stock") j["ratio_to_replicated_stock"] = rep_us > 0 ? med / rep_us : 0.0;
          results.push_back(j);
          std::printf("P%-3d B%-3d ctx %-6d %-24s %9.1f us  %6.1f MB  %5.1f%% of copy bw  eq=%d%s\n", P, B, ctx,
                      v.name.c_str(), med, v.bytes / 1e6, v.bytes ? 100.0 * (v.bytes / (med * 1e-6) / 1e9) / copy_bw : 0.0,
                      static_cast<int>(v.eq), agree ? "" : "  (repeats disagree > 2%)");
          CK(cudaGraphExecDestroy(v.exec));
        }
        CK(cudaFree(o_rep));
        CK(cudaFree(o_icp));
        CK(cudaFree(o_stk));
        CK(cudaFree(seq_dev));
        CK(cudaFree(q_dev));
      }
    CK(cudaFree(L->bt_dev));
  }
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%d", std::gmtime(&now));
  json rec = {{"benchmark", "decode"},
              {"device", cuda::device_name()},
              {"num_gpus", 1},
              {"processes", 1},
              {"cuda", std::to_string(rt / 1000) + "." + std::to_string((rt % 1000) / 10)},
              {"driver", driver},
              {"driver_api", drv},
              {"git_rev", git_rev},
              {"date", date},
              {"command", command},
              {"copy_bandwidth_gbs", copy_bw},
              {"insert_tokens_per_s", insert_rate},
              {"method", "one GPU, both TP ranks simulated; each timed sequence a CUDA graph; L2 flushed (memset of " +
                             std::to_string(flush_bytes >> 20) + " MB) before every replay, outside the timing; median of " +
                             std::to_string(replays) + " replays; table run " + std::to_string(repeats) +
                             " times, medians averaged when within 2%"},
              {"results", results}};
  if (!out.empty()) {
    std::ofstream f(out);
    f << rec.dump(2) << "\n";
    std::printf("wrote %s\n", out.c_str());
  }
  CK(cudaFree(flush));
  CK(cudaStreamDestroy(st));
  return 0;
}
