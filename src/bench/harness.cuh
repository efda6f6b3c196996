// Internal to `indexcp bench`: timing harness (graph capture, L2 flush, medians), device ceilings
// (copy bandwidth, FP8 matrix rate), progress display, common record fields, data generation.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/bench.hpp"
#include "cuda/device_buffer.cuh"
#include "indexcp/comm.hpp"
#include "indexcp/cuda.hpp"

namespace indexcp::bench {

using nlohmann::json;

/// Throws indexcp::Error(kRuntime) naming `what` when e is not cudaSuccess.
void ck(cudaError_t e, const char* what);

struct Stat {
  double median = 0, min = 0, max = 0;
  int samples = 0;
};
Stat stats(std::vector<double> v);

/// Repeated medians of one cell: averaged when within 2%, else the first (and `agree` false).
struct Combined {
  double median = 0;
  bool agree = true;
  std::vector<double> medians;
  Stat first;
};
Combined combine(const std::vector<Stat>& runs);
/// The common result fields of a combined cell (median_us, min_us, max_us, samples, repeats).
json timing_fields(const Combined& c);

/// The GPU, its stream, the L2 flush buffer and the ceilings measured in this run.
class Device {
 public:
  /// measure_matrix: also time the FP8 and fp16 dense GEMM rates (cuBLASLt, 8192^3).
  explicit Device(bool measure_matrix = true);
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  cudaStream_t stream() const { return st_; }
  double copy_bandwidth_gbs() const { return copy_bw_; }
  double fp8_tflops() const { return fp8_tflops_; }  ///< 0 when it could not be measured
  const std::string& fp8_note() const { return fp8_note_; }
  double fp16_tflops() const { return fp16_tflops_; }  ///< the fp16 dense rate; 0 when it could not be measured
  const std::string& fp16_note() const { return fp16_note_; }
  /// The timing method's own cost (us): the median replay, timed as every cell is (L2 flushed,
  /// events around the launch), of a graph holding one empty kernel of one thread. Part of every
  /// cell's median; reported beside it, not subtracted (docs/decisions.md, "The graph launch in
  /// the bench records").
  double graph_launch_us() const { return graph_launch_us_; }
  std::string name() const;
  /// Flushes L2 (memset of flush_bytes() on the stream).
  void flush_l2(int i);
  size_t flush_bytes() const { return flush_bytes_; }

  /// Captures fn()'s work on stream() into an executable graph.
  template <class Fn>
  cudaGraphExec_t capture(Fn&& fn) {
    cudaGraphExec_t e = nullptr;
    const cudaGraph_t g = capture_graph(fn);
    const cudaError_t r = cudaGraphInstantiate(&e, g, 0);
    cudaGraphDestroy(g);
    ck(r, "cudaGraphInstantiate");
    return e;
  }
  /// As capture(), and *part: an executable graph of only the kernel nodes of the captured graph
  /// whose function name contains `name_part`, one after another in the order of
  /// cudaGraphGetNodes, with their captured arguments (so they read what the whole graph's last
  /// replay left in memory: replay the whole one first). *count: the matching nodes; none gives
  /// *part = nullptr.
  template <class Fn>
  cudaGraphExec_t capture_with_part(Fn&& fn, const char* name_part, cudaGraphExec_t* part, int* count) {
    cudaGraphExec_t e = nullptr;
    const cudaGraph_t g = capture_graph(fn);
    try {
      ck(cudaGraphInstantiate(&e, g, 0), "cudaGraphInstantiate");
      *part = kernel_nodes_graph(g, name_part, count);
    } catch (...) {
      if (e) cudaGraphExecDestroy(e);
      cudaGraphDestroy(g);
      throw;
    }
    cudaGraphDestroy(g);
    return e;
  }
  /// Replays `exec` n times (after 3 warm-ups), L2 flushed before each, only the graph timed.
  /// With `comm` (graphs holding collectives of a multi-process group) the waits go through
  /// comm->synchronize, whose watchdog bounds them when a peer dies.
  Stat time_graph(cudaGraphExec_t exec, int n, Communicator* comm = nullptr);
  /// Times fn() n times with events recorded on stream() around it (fn may synchronize).
  template <class Fn>
  Stat time_eager(Fn&& fn, int n) {
    for (int i = 0; i < 2; ++i) fn();
    std::vector<double> us;
    us.reserve(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      flush_l2(i);
      ck(cudaEventRecord(a_, st_), "cudaEventRecord");
      fn();
      ck(cudaEventRecord(b_, st_), "cudaEventRecord");
      ck(cudaEventSynchronize(b_), "cudaEventSynchronize");
      float ms = 0;
      ck(cudaEventElapsedTime(&ms, a_, b_), "cudaEventElapsedTime");
      us.push_back(ms * 1000.0);
    }
    return stats(us);
  }

 private:
  /// fn()'s work on stream(), captured (the caller destroys the graph).
  template <class Fn>
  cudaGraph_t capture_graph(Fn& fn) {
    cudaGraph_t g = nullptr;
    ck(cudaStreamBeginCapture(st_, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    try {
      fn();
    } catch (...) {  // leave the stream usable: end the capture, drop the partial graph
      if (cudaStreamEndCapture(st_, &g) == cudaSuccess && g) cudaGraphDestroy(g);
      cudaGetLastError();
      throw;
    }
    ck(cudaStreamEndCapture(st_, &g), "cudaStreamEndCapture");
    return g;
  }
  static cudaGraphExec_t kernel_nodes_graph(cudaGraph_t g, const char* name_part, int* count);
  cudaStream_t st_ = nullptr;
  cudaEvent_t a_ = nullptr, b_ = nullptr;
  void* flush_ = nullptr;
  size_t flush_bytes_ = 0;
  double copy_bw_ = 0, fp8_tflops_ = 0, fp16_tflops_ = 0, graph_launch_us_ = 0;
  std::string fp8_note_, fp16_note_;
};

/// Rank `rank` of `world` ranks simulated on one GPU, for timing one rank's plan as one graph:
/// all_gather copies this rank's `bytes` into every rank's slot of recv, all_to_all block p to
/// block p (cudaMemcpyAsync device to device on the stream: the bytes a real exchange delivers, on
/// one GPU; NVLink / NCCL time is not measured, and the other ranks' data is this rank's).
class MirrorComm : public Communicator {
 public:
  MirrorComm(int rank, int world) : rank_(rank), world_(world) {}
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  void all_gather(const void* send, void* recv, std::size_t bytes, void* stream) override;
  void all_to_all(const void* send, void* recv, std::size_t bytes, void* stream) override;
  std::size_t bytes_sent() const override { return sent_; }

 private:
  int rank_, world_;
  std::size_t sent_ = 0;
};

/// Fields every record has (bench.md section 3) plus the method and the ceilings.
json record_header(const std::string& benchmark, const RunOptions& o, const Device& d, const std::string& method);
/// Writes the record to o.out (when set) and says so on stdout.
void write_record(const json& rec, const RunOptions& o);

/// "[k/n] what  (elapsed, ~left)" lines on stderr; one line rewritten in place on a terminal.
class Progress {
 public:
  Progress(int total, bool enabled);
  ~Progress();
  void step(const std::string& what);

 private:
  int total_, done_ = 0;
  bool enabled_, tty_;
  std::chrono::steady_clock::time_point t0_;
};

/// Deterministic pseudo-normal fp32 keys (sum of 4 hashed uniforms, unit variance), n values.
void fill_keys(float* dev, int64_t n, uint64_t seed, cudaStream_t st);
/// Slots of tokens t0 .. t0+n-1 of requests laid out request-major with `ctx` tokens each, through
/// the block table bt [requests][max_pages] (device).
void fill_slots(int64_t* dev, int64_t t0, int64_t n, int32_t ctx, const int32_t* bt, int32_t max_pages, int32_t P,
                cudaStream_t st);
/// Inserts the keys of `requests` requests of `ctx` tokens each (fill_keys with seed + token
/// index, slots through the block table bt [requests][max_pages], device) into layer `layer` of
/// every cache, in chunks of 1M tokens; synchronizes.
void fill_caches(const std::vector<cuda::DeviceCache*>& caches, int32_t layer, int32_t requests, int32_t ctx,
                 const int32_t* bt, int32_t max_pages, int32_t P, uint64_t seed, cudaStream_t st);
/// A shuffled page pool [requests * max_pages] (seeded), as a block table.
std::vector<int32_t> shuffled_block_table(int64_t num_pages, uint32_t seed);
/// E4M3 bytes of standard-normal q values.
std::vector<uint8_t> random_q(size_t n, uint32_t seed);

/// The benchmark's error texts for DeviceBuffer (cuda/device_buffer.cuh).
struct BenchBufferErrors {
  static void check(cudaError_t e, const char* what) { ck(e, what); }
  static constexpr const char* kMalloc = "cudaMalloc";
  static constexpr const char* kUpload = "cudaMemcpy";
  static constexpr const char* kDownload = "cudaMemcpy";
  static constexpr bool kAllocateEmpty = true;
};
/// Device buffer owned by the benchmark (freed on scope exit).
template <class T>
using DeviceBuffer = cuda::detail::BasicDeviceBuffer<T, BenchBufferErrors>;

/// RAII for an executable graph.
struct Graph {
  cudaGraphExec_t e = nullptr;
  explicit Graph(cudaGraphExec_t x) : e(x) {}
  ~Graph() {
    if (e) cudaGraphExecDestroy(e);
  }
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  Graph(Graph&& o) noexcept : e(o.e) { o.e = nullptr; }
};

}  // namespace indexcp::bench
