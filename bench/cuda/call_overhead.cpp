// The C++ calls that python/bench/op_overhead.py times through the Python package, with the same
// shapes and the same method, so that the package's per-call overhead can be read as a difference:
// one small decode step (insert one key per request, the Q cast, the decode plan's run) of the
// CUDA backend, each call enqueued on the legacy default stream (the stream torch's ops use when
// none is set). Per call two figures: "stream" = (200 back-to-back calls, then a stream
// synchronize) / 200, what op_overhead.py reports; "host" = the same loop's time before the
// synchronize / 200, the time the host spends in the call (both medians of 5 repeats). And the
// step captured in a CUDA graph, replayed. Prints one JSON object; --out FILE writes it too.
//
//   build/bench/bench_call_overhead [--requests 8] [--seq-len 4096] [--iters 200] [--repeats 5] [--out FILE]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "indexcp/cache.hpp"
#include "indexcp/cache_view.hpp"
#include "indexcp/config.hpp"
#include "indexcp/cuda.hpp"
#include "indexcp/layout.hpp"
#include "indexcp/plan.hpp"
#include "indexcp/version.hpp"

using namespace indexcp;

namespace {

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "bench_call_overhead: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

template <class T>
T* dev_alloc(size_t n) {
  void* p = nullptr;
  ck(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)), "cudaMalloc");
  ck(cudaMemset(p, 0, std::max<size_t>(n, 1) * sizeof(T)), "cudaMemset");
  return static_cast<T*>(p);
}

template <class T>
T* dev_copy(const std::vector<T>& v) {
  T* p = dev_alloc<T>(v.size());
  ck(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  return p;
}

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Timing {
  double stream_us, host_us;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

Timing timed(const std::function<void()>& fn, int iters, int repeats, cudaStream_t st) {
  fn();
  ck(cudaStreamSynchronize(st), "cudaStreamSynchronize");
  std::vector<double> stream, host;
  for (int r = 0; r < repeats; ++r) {
    const double t0 = now_us();
    for (int i = 0; i < iters; ++i) fn();
    const double t1 = now_us();
    ck(cudaStreamSynchronize(st), "cudaStreamSynchronize");
    const double t2 = now_us();
    host.push_back((t1 - t0) / iters);
    stream.push_back((t2 - t0) / iters);
  }
  return {median(stream), median(host)};
}

std::string fmt2(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f", v);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  int32_t R = 8, seq_len = 4096;
  int iters = 200, repeats = 5;
  std::string out_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_call_overhead: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--requests") R = std::atoi(next().c_str());
    else if (a == "--seq-len") seq_len = std::atoi(next().c_str());
    else if (a == "--iters") iters = std::atoi(next().c_str());
    else if (a == "--repeats") repeats = std::atoi(next().c_str());
    else if (a == "--out") out_path = next();
    else {
      std::fprintf(stderr, "bench_call_overhead: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (R < 1 || R > 4096 || seq_len < 1 || iters < 1 || repeats < 1) {
    std::fprintf(stderr, "bench_call_overhead: --requests 1..4096, --seq-len, --iters and --repeats >= 1\n");
    return 2;
  }
  if (!cuda::available()) {
    std::printf("bench_call_overhead: no GPU visible, skipped\n");
    return 0;
  }
  const int32_t H = 4, Q = 1, P = 128;
  const int32_t pages_per_req = (seq_len + P - 1) / P;
  const int64_t pages = static_cast<int64_t>(R) * pages_per_req;
  const PageLayout layout = make_page_layout(KvDtype::kNvfp4, P, 1);
  uint8_t* cache_mem = dev_alloc<uint8_t>(static_cast<size_t>(cache_layer_bytes(layout, pages)));
  const CacheView view = make_cache_view(layout, cache_mem, pages, 1, 0, 0, MemoryLocation::kDevice);
  cuda::prepare_device();
  EngineParams ep;
  ep.tp = 1;
  ep.heads = H;
  ep.query_len = Q;
  const ResolvedConfig rc = resolve_config(AttentionConfig::from_json(R"({"indexer_kv_dtype": "nvfp4"})"), ep);
  DecodeLimits lim;
  lim.max_requests = R;
  lim.max_pages = pages_per_req;
  lim.query_len = Q;
  lim.heads = H;
  const cuda::DecodePlan plan(rc, 0, lim);

  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<float> keys_h(static_cast<size_t>(R) * 128), q_h(static_cast<size_t>(R) * Q * H * 128);
  for (auto& x : keys_h) x = nd(rng);
  for (auto& x : q_h) x = nd(rng);
  std::vector<int64_t> slots_h(static_cast<size_t>(R));
  for (int32_t r = 0; r < R; ++r) slots_h[r] = static_cast<int64_t>(r) * pages_per_req * P + seq_len - 1;
  std::vector<int32_t> bt_h(static_cast<size_t>(pages)), seq_h(static_cast<size_t>(R), seq_len);
  for (int64_t i = 0; i < pages; ++i) bt_h[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  float* keys = dev_copy(keys_h);
  float* q32 = dev_copy(q_h);
  int64_t* slots = dev_copy(slots_h);
  int32_t* bt = dev_copy(bt_h);
  int32_t* seq = dev_copy(seq_h);
  uint8_t* q8 = dev_alloc<uint8_t>(q_h.size());
  InsertStatus* status = reinterpret_cast<InsertStatus*>(dev_alloc<uint8_t>(sizeof(InsertStatus)));
  const size_t iws_bytes = std::max<size_t>(cuda::insert_workspace_bytes(R), 16);
  uint8_t* iws = dev_alloc<uint8_t>(iws_bytes);
  const size_t ws_bytes = std::max<size_t>(plan.workspace_bytes(), 16);
  uint8_t* ws = dev_alloc<uint8_t>(ws_bytes);
  int32_t* out = dev_alloc<int32_t>(static_cast<size_t>(R) * Q * plan.num_heads() * 16);
  DeviceDecodeBatch batch;
  batch.q = q8;
  batch.block_table = bt;
  batch.seq_lens = seq;
  batch.num_requests = R;

  cudaStream_t legacy = nullptr;  // torch's current stream when none is set
  const cuda::Stream st = reinterpret_cast<cuda::Stream>(legacy);
  const auto insert = [&] { cuda::insert_keys_async(view, 0, keys, slots, R, InsertOptions{}, iws, iws_bytes, status, st); };
  const auto qcast = [&] { cuda::quantize_queries_async(q32, static_cast<int64_t>(R) * Q, H, KeyPreprocess{}, q8, status, st); };
  const auto run = [&] { plan.run(view, 0, batch, ws, ws_bytes, out, nullptr, nullptr, st); };
  const auto step = [&] {
    insert();
    qcast();
    run();
  };
  ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");

  std::string json = "{\n \"benchmark\": \"call_overhead\",\n \"indexcp\": \"" + std::string(version()) +
                     "\",\n \"device\": \"" + cuda::device_name() + "\",\n \"requests\": " + std::to_string(R) +
                     ",\n \"seq_len\": " + std::to_string(seq_len) + ",\n \"heads\": " + std::to_string(H) +
                     ",\n \"iters\": " + std::to_string(iters) + ",\n \"repeats\": " + std::to_string(repeats) +
                     ",\n \"unit\": \"microseconds per call (median of the repeats)\"";
  for (const auto& [name, fn] : std::vector<std::pair<std::string, std::function<void()>>>{
           {"cxx.insert_keys_async", insert}, {"cxx.quantize_queries_async", qcast}, {"cxx.DecodePlan.run", run},
           {"cxx.step (3 calls)", step}}) {
    const Timing t = timed(fn, iters, repeats, legacy);
    json += ",\n \"" + name + "\": {\"stream\": " + fmt2(t.stream_us) + ", \"host\": " + fmt2(t.host_us) + "}";
  }
  {  // the step as a graph (captured on a stream of its own: the legacy stream cannot capture)
    cudaStream_t cs = nullptr;
    ck(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking), "cudaStreamCreate");
    const cuda::Stream cst = reinterpret_cast<cuda::Stream>(cs);
    cudaGraph_t g = nullptr;
    cudaGraphExec_t ge = nullptr;
    ck(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    cuda::insert_keys_async(view, 0, keys, slots, R, InsertOptions{}, iws, iws_bytes, status, cst);
    cuda::quantize_queries_async(q32, static_cast<int64_t>(R) * Q, H, KeyPreprocess{}, q8, status, cst);
    plan.run(view, 0, batch, ws, ws_bytes, out, nullptr, nullptr, cst);
    ck(cudaStreamEndCapture(cs, &g), "cudaStreamEndCapture");
    ck(cudaGraphInstantiate(&ge, g, 0), "cudaGraphInstantiate");
    const Timing t = timed([&] { ck(cudaGraphLaunch(ge, cs), "cudaGraphLaunch"); }, iters, repeats, cs);
    json += ",\n \"cxx.graph replay of the step (3 calls)\": {\"stream\": " + fmt2(t.stream_us) +
            ", \"host\": " + fmt2(t.host_us) + "}";
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    cudaStreamDestroy(cs);
  }
  json += "\n}\n";
  std::fputs(json.c_str(), stdout);
  if (!out_path.empty()) {
    std::ofstream f(out_path);
    f << json;
    if (!f) {
      std::fprintf(stderr, "bench_call_overhead: cannot write %s\n", out_path.c_str());
      return 1;
    }
  }
  return 0;
}
