// Timing harness of `indexcp bench` (see harness.cuh and bench.hpp for the method).
#include "bench/harness.cuh"

#include <cublasLt.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>

#include "core/json_util.hpp"
#include "indexcp/cuda.hpp"
#include "indexcp/error.hpp"
#include "indexcp/formats.hpp"
#include "core/knobs.hpp"

namespace indexcp::bench {

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(ErrorCode::kRuntime, std::string(what) + " failed: " + cudaGetErrorString(e));
}

Stat stats(std::vector<double> v) {
  Stat s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.samples = static_cast<int>(v.size());
  s.min = v.front();
  s.max = v.back();
  s.median = v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  return s;
}

Combined combine(const std::vector<Stat>& runs) {
  Combined c;
  c.first = runs.front();
  for (const Stat& s : runs) c.medians.push_back(s.median);
  const auto [lo, hi] = std::minmax_element(c.medians.begin(), c.medians.end());
  c.agree = *hi - *lo <= 0.02 * *lo;
  c.median = c.agree ? std::accumulate(c.medians.begin(), c.medians.end(), 0.0) / c.medians.size() : c.medians.front();
  return c;
}

json timing_fields(const Combined& c) {
  json j = {{"median_us", c.median}, {"min_us", c.first.min}, {"max_us", c.first.max}, {"samples", c.first.samples}};
  if (c.medians.size() > 1) {
    j["repeat_medians_us"] = c.medians;
    j["repeats_agree_2pct"] = c.agree;
  }
  return j;
}

namespace {

double measure_copy_bandwidth(cudaStream_t st) {
  const size_t bytes = size_t{2} << 30;
  void *a = nullptr, *b = nullptr;
  ck(cudaMalloc(&a, bytes), "cudaMalloc (copy bandwidth source)");
  ck(cudaMalloc(&b, bytes), "cudaMalloc (copy bandwidth destination)");
  ck(cudaMemsetAsync(a, 1, bytes, st), "cudaMemsetAsync");
  cudaEvent_t e0, e1;
  ck(cudaEventCreate(&e0), "cudaEventCreate");
  ck(cudaEventCreate(&e1), "cudaEventCreate");
  std::vector<double> v;
  for (int i = 0; i < 23; ++i) {
    ck(cudaEventRecord(e0, st), "cudaEventRecord");
    ck(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, st), "cudaMemcpyAsync");
    ck(cudaEventRecord(e1, st), "cudaEventRecord");
    ck(cudaEventSynchronize(e1), "cudaEventSynchronize");
    float ms = 0;
    ck(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
    if (i >= 3) v.push_back(2.0 * bytes / (ms * 1e-3) / 1e9);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(a);
  cudaFree(b);
  return stats(v).median;
}

// A dense GEMM, M = N = K = 8192, through cuBLASLt (fp32 accumulation): fp16 = false, E4M3 x E4M3
// -> bf16 (the device's FP8 matrix rate); fp16 = true, fp16 x fp16 -> fp16 (the fp16 dense rate,
// the ceiling of the fp32-mode prefill scorer's fp16 MMA). In TFLOP/s; 0 with a note when
// cuBLASLt offers no algorithm.
double measure_matrix_tflops(bool fp16, cudaStream_t st, std::string* note) {
  const int64_t n = 8192;
  const size_t eb = fp16 ? 2 : 1;  // bytes per A / B element
  const cudaDataType_t ab = fp16 ? CUDA_R_16F : CUDA_R_8F_E4M3, dt = fp16 ? CUDA_R_16F : CUDA_R_16BF;
  cublasLtHandle_t h = nullptr;
  if (cublasLtCreate(&h) != CUBLAS_STATUS_SUCCESS) {
    *note = "cublasLtCreate failed";
    return 0;
  }
  void *A = nullptr, *B = nullptr, *D = nullptr, *ws = nullptr;
  const size_t ws_bytes = size_t{64} << 20;
  ck(cudaMalloc(&A, n * n * eb), "cudaMalloc (GEMM A)");
  ck(cudaMalloc(&B, n * n * eb), "cudaMalloc (GEMM B)");
  ck(cudaMalloc(&D, n * n * 2), "cudaMalloc (GEMM D)");
  ck(cudaMalloc(&ws, ws_bytes), "cudaMalloc (cublasLt workspace)");
  ck(cudaMemsetAsync(A, 0x30, n * n * eb, st), "cudaMemsetAsync");  // E4M3 0.5; fp16 0x3030 = 0.13
  ck(cudaMemsetAsync(B, 0x30, n * n * eb, st), "cudaMemsetAsync");
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  double tflops = 0;
  bool ok = cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS;
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;  // FP8 needs the "TN" form
  ok = ok && cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)) == CUBLAS_STATUS_SUCCESS;
  ok = ok && cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)) == CUBLAS_STATUS_SUCCESS;
  ok = ok && cublasLtMatrixLayoutCreate(&la, ab, n, n, n) == CUBLAS_STATUS_SUCCESS;
  ok = ok && cublasLtMatrixLayoutCreate(&lb, ab, n, n, n) == CUBLAS_STATUS_SUCCESS;
  ok = ok && cublasLtMatrixLayoutCreate(&ld, dt, n, n, n) == CUBLAS_STATUS_SUCCESS;
  ok = ok && cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS;
  ok = ok && cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                  sizeof(ws_bytes)) == CUBLAS_STATUS_SUCCESS;
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  ok = ok && cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, ld, ld, pref, 1, &heur, &found) == CUBLAS_STATUS_SUCCESS &&
       found > 0;
  if (!ok) {
    *note = fp16 ? "cuBLASLt offered no fp16 GEMM algorithm" : "cuBLASLt offered no FP8 GEMM algorithm";
  } else {
    const float alpha = 1.0f, beta = 0.0f;
    cudaEvent_t e0, e1;
    ck(cudaEventCreate(&e0), "cudaEventCreate");
    ck(cudaEventCreate(&e1), "cudaEventCreate");
    std::vector<double> v;
    for (int i = 0; i < 23 && ok; ++i) {
      ck(cudaEventRecord(e0, st), "cudaEventRecord");
      ok = cublasLtMatmul(h, op, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &heur.algo, ws, ws_bytes, st) ==
           CUBLAS_STATUS_SUCCESS;
      ck(cudaEventRecord(e1, st), "cudaEventRecord");
      ck(cudaEventSynchronize(e1), "cudaEventSynchronize");
      float ms = 0;
      ck(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
      if (i >= 3) v.push_back(2.0 * n * n * n / (ms * 1e-3) / 1e12);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    if (ok) {
      tflops = stats(v).median;
      *note = fp16 ? "cuBLASLt fp16 x fp16 -> fp16, fp32 accumulate, 8192^3, median of 20"
                   : "cuBLASLt E4M3 x E4M3 -> bf16, fp32 accumulate, 8192^3, median of 20";
    } else {
      *note = "cublasLtMatmul failed";
    }
  }
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  if (ld) cublasLtMatrixLayoutDestroy(ld);
  if (lb) cublasLtMatrixLayoutDestroy(lb);
  if (la) cublasLtMatrixLayoutDestroy(la);
  if (op) cublasLtMatmulDescDestroy(op);
  cublasLtDestroy(h);
  cudaFree(A);
  cudaFree(B);
  cudaFree(D);
  cudaFree(ws);
  return tflops;
}

__global__ void empty_kernel() {}

std::string driver_version() {
  std::ifstream f("/proc/driver/nvidia/version");
  std::string line;
  if (std::getline(f, line)) {
    // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  Thu ..."
    std::istringstream ss(line);
    std::string w;
    while (ss >> w)
      if (!w.empty() && std::isdigit(static_cast<unsigned char>(w[0])) && w.find('.') != std::string::npos) return w;
  }
  int v = 0;
  cudaDriverGetVersion(&v);
  return "cuda-driver-api " + std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

}  // namespace

Device::Device(bool measure_matrix) {
  if (!cuda::available())
    throw Error(ErrorCode::kUnsupported, "no CUDA GPU is visible: `indexcp bench` needs one");
  ck(cudaStreamCreateWithFlags(&st_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  ck(cudaEventCreate(&a_), "cudaEventCreate");
  ck(cudaEventCreate(&b_), "cudaEventCreate");
  int dev = 0, l2 = 0;
  ck(cudaGetDevice(&dev), "cudaGetDevice");
  ck(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev), "cudaDeviceGetAttribute");
  flush_bytes_ = std::max<size_t>(size_t{256} << 20, static_cast<size_t>(l2) * 4);
  ck(cudaMalloc(&flush_, flush_bytes_), "cudaMalloc (L2 flush buffer)");
  copy_bw_ = measure_copy_bandwidth(st_);
  if (measure_matrix) {
    fp8_tflops_ = measure_matrix_tflops(false, st_, &fp8_note_);
    fp16_tflops_ = measure_matrix_tflops(true, st_, &fp16_note_);
  }
  cudaGraphExec_t empty = capture([&] {
    empty_kernel<<<1, 1, 0, st_>>>();
    ck(cudaGetLastError(), "empty kernel launch");
  });
  graph_launch_us_ = time_graph(empty, 200).median;
  cudaGraphExecDestroy(empty);
}

Device::~Device() {
  if (flush_) cudaFree(flush_);
  if (a_) cudaEventDestroy(a_);
  if (b_) cudaEventDestroy(b_);
  if (st_) cudaStreamDestroy(st_);
}

std::string Device::name() const { return cuda::device_name(); }

void Device::flush_l2(int i) { ck(cudaMemsetAsync(flush_, i & 0xff, flush_bytes_, st_), "cudaMemsetAsync (L2 flush)"); }

cudaGraphExec_t Device::kernel_nodes_graph(cudaGraph_t g, const char* name_part, int* count) {
  *count = 0;
  size_t n = 0;
  ck(cudaGraphGetNodes(g, nullptr, &n), "cudaGraphGetNodes");
  std::vector<cudaGraphNode_t> nodes(n);
  if (n > 0) ck(cudaGraphGetNodes(g, nodes.data(), &n), "cudaGraphGetNodes");
  cudaGraph_t part = nullptr;
  ck(cudaGraphCreate(&part, 0), "cudaGraphCreate");
  struct Owned {  // destroys the new graph on every way out (it is instantiated below first)
    cudaGraph_t g;
    ~Owned() { cudaGraphDestroy(g); }
  } owned{part};
  cudaGraphNode_t prev = nullptr;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    ck(cudaGraphNodeGetType(node, &type), "cudaGraphNodeGetType");
    if (type != cudaGraphNodeTypeKernel) continue;
    cudaKernelNodeParams kp{};
    ck(cudaGraphKernelNodeGetParams(node, &kp), "cudaGraphKernelNodeGetParams");
    const char* name = nullptr;
    if (cudaFuncGetName(&name, kp.func) != cudaSuccess || name == nullptr) {
      cudaGetLastError();
      continue;
    }
    if (std::strstr(name, name_part) == nullptr) continue;
    cudaGraphNode_t added = nullptr;
    ck(cudaGraphAddKernelNode(&added, part, prev ? &prev : nullptr, prev ? 1 : 0, &kp), "cudaGraphAddKernelNode");
    prev = added;
    ++*count;
  }
  cudaGraphExec_t e = nullptr;
  if (*count > 0) ck(cudaGraphInstantiate(&e, part, 0), "cudaGraphInstantiate");
  return e;
}

void MirrorComm::all_gather(const void* send, void* recv, std::size_t bytes, void* stream) {
  const auto st = static_cast<cudaStream_t>(stream);
  for (int p = 0; p < world_; ++p)
    ck(cudaMemcpyAsync(static_cast<uint8_t*>(recv) + p * bytes, send, bytes, cudaMemcpyDeviceToDevice, st),
       "cudaMemcpyAsync (MirrorComm::all_gather)");
  sent_ += bytes;
}

void MirrorComm::all_to_all(const void* send, void* recv, std::size_t bytes, void* stream) {
  const auto st = static_cast<cudaStream_t>(stream);
  ck(cudaMemcpyAsync(recv, send, world_ * bytes, cudaMemcpyDeviceToDevice, st), "cudaMemcpyAsync (MirrorComm::all_to_all)");
  sent_ += world_ * bytes;
}

Stat Device::time_graph(cudaGraphExec_t exec, int n, Communicator* comm) {
  for (int i = 0; i < 3; ++i) ck(cudaGraphLaunch(exec, st_), "cudaGraphLaunch");
  if (comm) comm->synchronize(st_);
  std::vector<cudaEvent_t> ev(2 * static_cast<size_t>(n));
  for (auto& e : ev) ck(cudaEventCreate(&e), "cudaEventCreate");
  for (int i = 0; i < n; ++i) {
    flush_l2(i);
    ck(cudaEventRecord(ev[2 * i], st_), "cudaEventRecord");
    ck(cudaGraphLaunch(exec, st_), "cudaGraphLaunch");
    ck(cudaEventRecord(ev[2 * i + 1], st_), "cudaEventRecord");
  }
  if (comm) comm->synchronize(st_);
  ck(cudaStreamSynchronize(st_), "cudaStreamSynchronize");
  std::vector<double> us(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    float ms = 0;
    ck(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]), "cudaEventElapsedTime");
    us[i] = ms * 1000.0;
  }
  for (auto e : ev) cudaEventDestroy(e);
  return stats(us);
}

json record_header(const std::string& benchmark, const RunOptions& o, const Device& d, const std::string& method) {
  int rt = 0;
  cudaRuntimeGetVersion(&rt);
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%d", std::gmtime(&now));
  std::string rev = o.git_rev;
  if (rev.empty() && ::indexcp::detail::knob_env("INDEXCP_GIT_REV")) rev = ::indexcp::detail::knob_env("INDEXCP_GIT_REV");
  if (rev.empty()) rev = "unknown";
  json j = {{"benchmark", benchmark},
            {"device", d.name()},
            {"num_gpus", 1},
            {"processes", 1},
            {"cuda", std::to_string(rt / 1000) + "." + std::to_string((rt % 1000) / 10)},
            {"driver", driver_version()},
            {"git_rev", rev},
            {"date", date},
            {"command", o.command},
            {"copy_bandwidth_gbs", d.copy_bandwidth_gbs()},
            {"method", method + "; L2 flushed (memset of " + std::to_string(d.flush_bytes() >> 20) +
                           " MB) before every replay, outside the timing; median of " + std::to_string(o.replays) +
                           " replays; table run " + std::to_string(o.repeats) +
                           " times, medians averaged when within 2%"}};
  j["graph_launch_us"] = d.graph_launch_us();
  j["graph_launch_note"] = "median replay of a graph of one empty kernel, timed as the cells are (part of every median_us)";
  if (d.fp8_tflops() > 0) j["fp8_matrix_tflops"] = d.fp8_tflops();
  if (!d.fp8_note().empty()) j["fp8_matrix_note"] = d.fp8_note();
  if (d.fp16_tflops() > 0) j["fp16_matrix_tflops"] = d.fp16_tflops();
  if (!d.fp16_note().empty()) j["fp16_matrix_note"] = d.fp16_note();
  return j;
}

void write_record(const json& rec, const RunOptions& o) {
  if (o.out.empty()) return;
  std::string path = o.out;
  if (path == "auto") {  // <benchmark>-<device>-<date>.json (bench.md section 3): "NVIDIA H100 80GB HBM3" -> "h100"
    std::istringstream words(rec.value("device", std::string("gpu")));
    std::string dev = "gpu", w;
    while (words >> w)
      if (w != "NVIDIA") {
        dev = w;
        break;
      }
    for (char& c : dev) c = std::isalnum(static_cast<unsigned char>(c)) ? static_cast<char>(std::tolower(c)) : '-';
    path = rec.value("benchmark", std::string("bench")) + "-" + dev + "-" + rec.value("date", std::string("today")) + ".json";
  }
  std::ofstream f(path);
  if (!f) throw Error(ErrorCode::kInvalidArgument, "--out " + path + ": cannot open for writing");
  f << indexcp::detail::dump_text(rec, 2) << "\n";
  if (!f) throw Error(ErrorCode::kRuntime, "--out " + path + ": write failed");
  std::printf("wrote %s\n", path.c_str());
}

Progress::Progress(int total, bool enabled)
    : total_(total), enabled_(enabled), tty_(isatty(2) != 0), t0_(std::chrono::steady_clock::now()) {}

Progress::~Progress() {
  if (enabled_ && tty_ && done_ > 0) std::fprintf(stderr, "\n");
}

void Progress::step(const std::string& what) {
  ++done_;
  if (!enabled_) return;
  const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  const double left = done_ < total_ ? el / done_ * (total_ - done_) : 0.0;
  char buf[256];
  std::snprintf(buf, sizeof(buf), "[%d/%d] %-60.60s %6.0f s elapsed, ~%.0f s left", done_, total_, what.c_str(), el, left);
  if (tty_)
    std::fprintf(stderr, "\r%s\033[K", buf);
  else
    std::fprintf(stderr, "%s\n", buf);
  std::fflush(stderr);
}

namespace {

__global__ void gen_keys(float* k, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
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

}  // namespace

void fill_keys(float* dev, int64_t n, uint64_t seed, cudaStream_t st) {
  gen_keys<<<4096, 256, 0, st>>>(dev, n, seed);
  ck(cudaGetLastError(), "gen_keys launch");
}

void fill_slots(int64_t* dev, int64_t t0, int64_t n, int32_t ctx, const int32_t* bt, int32_t max_pages, int32_t P,
                cudaStream_t st) {
  gen_slots<<<1024, 256, 0, st>>>(dev, t0, n, ctx, bt, max_pages, P);
  ck(cudaGetLastError(), "gen_slots launch");
}

void fill_caches(const std::vector<cuda::DeviceCache*>& caches, int32_t layer, int32_t requests, int32_t ctx,
                 const int32_t* bt, int32_t max_pages, int32_t P, uint64_t seed, cudaStream_t st) {
  const int64_t total = static_cast<int64_t>(requests) * ctx, chunk = int64_t{1} << 20;
  DeviceBuffer<float> keys(static_cast<size_t>(std::min(total, chunk)) * 128);
  DeviceBuffer<int64_t> slots(static_cast<size_t>(std::min(total, chunk)));
  const auto sst = reinterpret_cast<cuda::Stream>(st);
  for (int64_t t0 = 0; t0 < total; t0 += chunk) {
    const int64_t n = std::min(chunk, total - t0);
    fill_keys(keys.get(), n * 128, seed + t0, st);
    fill_slots(slots.get(), t0, n, ctx, bt, max_pages, P, st);
    for (cuda::DeviceCache* c : caches) cuda::insert_keys(*c, layer, keys.get(), slots.get(), n, ::indexcp::InsertOptions{}, sst);
  }
  ck(cudaStreamSynchronize(st), "cudaStreamSynchronize");
}

std::vector<int32_t> shuffled_block_table(int64_t num_pages, uint32_t seed) {
  std::vector<int32_t> pool(static_cast<size_t>(num_pages));
  std::iota(pool.begin(), pool.end(), 0);
  std::mt19937 rng(seed);
  if (!::indexcp::detail::knob_env("BENCH_NO_SHUFFLE")) std::shuffle(pool.begin(), pool.end(), rng);
  return pool;
}

std::vector<uint8_t> random_q(size_t n, uint32_t seed) {
  std::vector<uint8_t> q(n);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& x : q) x = e4m3_encode(nd(rng));
  return q;
}

}  // namespace indexcp::bench
