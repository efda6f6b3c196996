// An engine's decode loop on ONE GPU, written against the plan / run API (docs/embedding.md
// sections 7-11): two TP ranks of an ICP group (sharded NVFP4 index cache) simulated in one
// process, each with its own cache pool, plan, workspace and statuses, as two engine processes
// would have them. One decode step of every layer is captured in ONE CUDA graph and replayed with
// new seq_lens, block table, q and keys written into the same device buffers, and the selections
// are checked against the CPU reference plans on the first and last step.
//
//   ./build/example_engine_step [--layers N] [--steps S] [--show-diffs N]
//   (defaults: 4 layers, 5 steps; --show-diffs prints N selections that differ from the CPU's)
//
// Exit 0 on success (and when no GPU is visible: the example then prints why and does nothing),
// 1 on a failed check or an error.
#include "indexcp/version.hpp"  // INDEXCP_CUDA_BACKEND

#if INDEXCP_CUDA_BACKEND
#include <cuda_runtime.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <vector>

#include "indexcp/comm.hpp"
#include "indexcp/config.hpp"
#include "indexcp/cuda.hpp"
#include "indexcp/plan.hpp"

#if INDEXCP_CUDA_BACKEND

namespace {

using namespace indexcp;

// ---- the engine's fixed shapes --------------------------------------------------------------

constexpr int32_t kWorld = 2;          // TP ranks, simulated in this process
constexpr int32_t kHeads = 4;          // index heads H (each rank merges H / W = 2 of them)
constexpr int32_t kPageSize = 128;     // P, the engine's --block-size
constexpr int32_t kQueryLen = 1;       // Q: plain decode, one new token per request
constexpr int32_t kMaxRequests = 8;    // the captured graph's batch (padded with seq_len 0)
constexpr int32_t kMaxTokens = 8192;   // the longest request the graph serves
constexpr int32_t kMaxPages = kMaxTokens / kPageSize;  // block-table width
constexpr int64_t kNumPages = int64_t{kMaxRequests} * kMaxPages;  // pool pages: never runs out
constexpr int32_t kPrefillTokens = 300;  // prompt length of a request admitted mid-run
constexpr int32_t kDim = 128;

// The engine's attention config as it would come from its model config, and its parameters.
ResolvedConfig resolve() {
  const AttentionConfig a =
      AttentionConfig::from_json(R"({"indexer_kv_dtype":"nvfp4","indexer_cache_sharding":"on"})");
  EngineParams e;
  e.tp = kWorld;
  e.page_size = kPageSize;
  e.heads = kHeads;
  e.query_len = kQueryLen;
  return resolve_config(a, e);
}

DecodeLimits decode_limits() {
  DecodeLimits l;
  l.max_requests = kMaxRequests;
  l.max_pages = kMaxPages;
  l.query_len = kQueryLen;
  l.heads = kHeads;  // sel: the default top-16 (15 ranked blocks + the local block)
  return l;
}

// ---- small helpers --------------------------------------------------------------------------

void cuda_check(cudaError_t e, const char* call, int line) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "engine_step: %s failed at line %d: %s\n", call, line, cudaGetErrorString(e));
  std::exit(1);
}
#define CK(call) cuda_check((call), #call, __LINE__)

// Every cudaMalloc of the example (setup only, never inside the capture), zero-filled, freed at
// exit. An engine has its own allocator; the library allocates nothing in a step.
struct DeviceMemory {
  std::vector<void*> blocks;
  template <class T>
  T* alloc(size_t count) {
    void* p = nullptr;
    const size_t bytes = std::max<size_t>(count * sizeof(T), 1);
    CK(cudaMalloc(&p, bytes));  // 256-byte aligned: enough for every pointer the library checks
    CK(cudaMemset(p, 0, bytes));
    blocks.push_back(p);
    return static_cast<T*>(p);
  }
  ~DeviceMemory() {
    for (void* p : blocks) cudaFree(p);
  }
};

template <class T>
void upload(T* dev, const std::vector<T>& host, cudaStream_t st) {
  // pageable source: the copy is staged before cudaMemcpyAsync returns, so `host` may change next
  CK(cudaMemcpyAsync(dev, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, st));
}

template <class T>
std::vector<T> download(const T* dev, size_t count) {
  std::vector<T> h(count);
  CK(cudaMemcpy(h.data(), dev, count * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// ---- the scheduler's view of the batch (host) ------------------------------------------------

// One slot of the captured batch. A request finishes at `target` tokens; its slot is then padded
// (seq_len 0) for one step and refilled by a new short request, whose prompt is prefilled
// eagerly before the step that first decodes it.
struct Slot {
  int32_t seq_len = 0;  // tokens including this step's (0: padded)
  int32_t target = kMaxTokens;
  bool finished = false;
  std::vector<int32_t> pages;  // physical page of each logical page
};

class Scheduler {
 public:
  explicit Scheduler(uint32_t seed) : rng_(seed) {
    for (int64_t p = 0; p < kNumPages; ++p) free_.push_back(static_cast<int32_t>(p));
    std::shuffle(free_.begin(), free_.end(), rng_);  // an allocator's pages are not in order
    // existing requests (tokens before the first decode step); some cross a page boundary within
    // the first steps (1022, 255, 510), slot 5 finishes after step 2
    const int32_t lens[kMaxRequests] = {4000, 1022, 7000, 255, 3001, 2046, 6143, 510};
    for (int32_t b = 0; b < kMaxRequests; ++b) {
      slots_[b].seq_len = lens[b];
      grow(b);
    }
    slots_[5].target = lens[5] + 2;
  }

  // Moves every slot one decode step on; returns the slots admitted this step (to prefill).
  std::vector<int32_t> advance() {
    std::vector<int32_t> admitted;
    for (int32_t b = 0; b < kMaxRequests; ++b) {
      Slot& s = slots_[b];
      if (s.finished) {  // padded for one step: its pages go back to the pool
        free_.insert(free_.end(), s.pages.begin(), s.pages.end());
        s = Slot{};
        continue;
      }
      if (s.seq_len == 0) {  // a new request: a prompt, then this step's first decode token
        s.seq_len = kPrefillTokens + 1;
        grow(b);
        admitted.push_back(b);
        continue;
      }
      s.seq_len += 1;
      grow(b);  // a new page when the new token crosses a page boundary
    }
    for (Slot& s : slots_)
      if (s.seq_len >= s.target) s.finished = true;  // decodes this step, padded the next
    return admitted;
  }

  int32_t seq_len(int32_t b) const { return slots_[b].seq_len; }
  std::vector<int32_t> seq_lens() const {
    std::vector<int32_t> v(kMaxRequests);
    for (int32_t b = 0; b < kMaxRequests; ++b) v[b] = slots_[b].seq_len;
    return v;
  }
  // int32 [max_requests, max_pages]; entries past a request's pages are never read (-1 here)
  std::vector<int32_t> block_table() const {
    std::vector<int32_t> t(static_cast<size_t>(kMaxRequests) * kMaxPages, -1);
    for (int32_t b = 0; b < kMaxRequests; ++b)
      std::copy(slots_[b].pages.begin(), slots_[b].pages.end(), t.begin() + static_cast<size_t>(b) * kMaxPages);
    return t;
  }
  // The slot of position `pos` of request b: physical page * P + offset.
  int64_t slot(int32_t b, int32_t pos) const {
    return int64_t{slots_[b].pages[pos / kPageSize]} * kPageSize + pos % kPageSize;
  }
  // This step's slot mapping: the new token (position seq_len - 1) of each request, -1 if padded.
  std::vector<int64_t> step_slots() const {
    std::vector<int64_t> v(kMaxRequests, -1);
    for (int32_t b = 0; b < kMaxRequests; ++b)
      if (slots_[b].seq_len > 0) v[b] = slot(b, slots_[b].seq_len - 1);
    return v;
  }
  int32_t pages_in_use() const { return static_cast<int32_t>(kNumPages - static_cast<int64_t>(free_.size())); }

 private:
  void grow(int32_t b) {
    Slot& s = slots_[b];
    while (static_cast<int64_t>(s.pages.size()) * kPageSize < s.seq_len) {
      s.pages.push_back(free_.back());
      free_.pop_back();
    }
  }
  std::mt19937 rng_;
  Slot slots_[kMaxRequests];
  std::vector<int32_t> free_;
};

// ---- one TP rank: its cache pool, plan, workspaces, outputs ----------------------------------

struct Rank {
  int32_t rank = 0;
  PageLayout layout;
  uint8_t* pool = nullptr;   // ONE allocation for every layer, as an engine's KV pool
  int64_t layer_stride = 0;  // bytes between layers
  int64_t layer_bytes = 0;   // bytes one layer's pages span (cache_layer_bytes)
  CacheView cache;
  cuda::DecodePlan plan;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  void* insert_ws = nullptr;
  size_t insert_ws_bytes = 0;
  InsertStatus* insert_status = nullptr;  // sticky; read after each step
  std::vector<int32_t*> out;              // per layer: [max_requests * Q, num_heads(), K]

  Rank(const ResolvedConfig& config, int32_t r, int32_t layers, int64_t max_insert_tokens, DeviceMemory& mem)
      : rank(r), plan(config, r, decode_limits()) {
    // The shard layout the config asks for: this rank keeps P / W rows of every page.
    layout = make_page_layout(config.kv_dtype, config.engine.page_size, config.shards);
    layer_bytes = cache_layer_bytes(layout, kNumPages);
    layer_stride = round_up(layer_bytes, int64_t{1} << 16);  // the allocator's 64 KiB slabs
    pool = mem.alloc<uint8_t>(static_cast<size_t>(layer_stride) * layers);
    cache = make_cache_view(layout, pool, kNumPages, layers, r, layer_stride, MemoryLocation::kDevice);
    plan.check_cache(cache, 0);  // the view matches the plan (layout, rank): fail at start-up
    workspace_bytes = plan.workspace_bytes();
    workspace = mem.alloc<uint8_t>(workspace_bytes);
    insert_ws_bytes = cuda::insert_workspace_bytes(max_insert_tokens);
    insert_ws = mem.alloc<uint8_t>(insert_ws_bytes);
    insert_status = mem.alloc<InsertStatus>(1);  // zero-filled = reset
    const size_t out_ints = static_cast<size_t>(decode_limits().max_rows()) * plan.num_heads() * decode_limits().sel.topk;
    for (int32_t l = 0; l < layers; ++l) out.push_back(mem.alloc<int32_t>(out_ints));
  }
};

// ---- the per-step device buffers (the same on both ranks: TP ranks share the metadata) -------

struct StepBuffers {
  int32_t* seq_lens = nullptr;      // [max_requests]
  int32_t* block_table = nullptr;   // [max_requests, max_pages]
  int64_t* slot_mapping = nullptr;  // [max_requests] this step's new token per request
  float* q = nullptr;               // [layers, rows, H, 128] fp32: the model's index q
  uint8_t* q8 = nullptr;            // [layers, rows, H, 128] E4M3: what the scorer reads
  float* keys = nullptr;            // [layers, max_requests, 128] fp32: this step's new keys
  uint8_t* records = nullptr;       // [W] exchange records: what an all-gather would return
  uint32_t* step_status = nullptr;  // [layers, W] StepStatus of each merge
  InsertStatus* q_status = nullptr; // the Q cast's (on the same stream)
  size_t record_bytes = 0;
};

constexpr int64_t kRows = int64_t{kMaxRequests} * kQueryLen;
constexpr size_t kQPerLayer = static_cast<size_t>(kRows) * kHeads * kDim;
constexpr size_t kKeysPerLayer = static_cast<size_t>(kMaxRequests) * kDim;

StepBuffers make_step_buffers(int32_t layers, size_t record_bytes, DeviceMemory& mem) {
  StepBuffers b;
  b.seq_lens = mem.alloc<int32_t>(kMaxRequests);
  b.block_table = mem.alloc<int32_t>(static_cast<size_t>(kMaxRequests) * kMaxPages);
  b.slot_mapping = mem.alloc<int64_t>(kMaxRequests);
  b.q = mem.alloc<float>(kQPerLayer * layers);
  b.q8 = mem.alloc<uint8_t>(kQPerLayer * layers);
  b.keys = mem.alloc<float>(kKeysPerLayer * layers);
  b.records = mem.alloc<uint8_t>(record_bytes * kWorld);
  b.step_status = mem.alloc<uint32_t>(static_cast<size_t>(layers) * kWorld);
  b.q_status = mem.alloc<InsertStatus>(1);
  b.record_bytes = record_bytes;
  return b;
}

std::vector<float> normal_values(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

// ---- the prefill-like fill and the admission of new requests (eager, outside the graph) -----

// Inserts random keys at the given slots into every layer of every rank (each rank writes the
// rows it owns). Enqueued only: the caller synchronizes when it wants to read the statuses.
void insert_prompt_keys(std::vector<Rank>& ranks, int32_t layers, const std::vector<int64_t>& slots, float* dev_keys,
                        int64_t* dev_slots, std::mt19937& rng, cudaStream_t st) {
  const int64_t n = static_cast<int64_t>(slots.size());
  upload(dev_slots, slots, st);
  for (int32_t l = 0; l < layers; ++l) {
    upload(dev_keys + static_cast<size_t>(l) * n * kDim, normal_values(static_cast<size_t>(n) * kDim, rng), st);
    for (Rank& r : ranks)
      cuda::insert_keys_async(r.cache, l, dev_keys + static_cast<size_t>(l) * n * kDim, dev_slots, n, InsertOptions{},
                              r.insert_ws, r.insert_ws_bytes, r.insert_status, st);
  }
}

// Fails (exit 1) when a status the device wrote reports a refusal or a disagreement.
void check_statuses(const std::vector<Rank>& ranks, const StepBuffers& b, int32_t layers, int step, cudaStream_t st) {
  for (const Rank& r : ranks) {
    const InsertStatus s = cuda::read_status(r.insert_status, st);  // synchronizes st
    if (s.reason != 0) {
      std::fprintf(stderr, "engine_step: step %d, rank %d: insert refused: %s\n", step, r.rank, status_error(s).what());
      std::exit(1);
    }
  }
  const InsertStatus qs = cuda::read_status(b.q_status, st);
  if (qs.reason != 0) {
    std::fprintf(stderr, "engine_step: step %d: Q cast refused: %s\n", step, status_error(qs).what());
    std::exit(1);
  }
  if (step == 0) return;  // the fill: no decode yet
  const auto ss = download(b.step_status, static_cast<size_t>(layers) * kWorld);
  for (size_t i = 0; i < ss.size(); ++i)
    if (ss[i] != 0) {
      std::fprintf(stderr, "engine_step: step %d, layer %zu, rank %zu: %s\n", step, i / kWorld, i % kWorld,
                   step_status_message(ss[i], "DecodePlan::merge").c_str());
      std::exit(1);
    }
}

// ---- one decode step of every layer: what the graph holds -------------------------------------

void enqueue_decode_step(std::vector<Rank>& ranks, const StepBuffers& b, int32_t layers, cudaStream_t st) {
  for (int32_t l = 0; l < layers; ++l) {
    float* q = b.q + kQPerLayer * l;
    uint8_t* q8 = b.q8 + kQPerLayer * l;
    // Index q to E4M3 (every row, padded ones too: their q must be finite). Both simulated ranks
    // read the same q8; two engine processes would each cast their own.
    cuda::quantize_queries_async(q, kRows, kHeads, KeyPreprocess{}, q8, b.q_status, st);
    // This step's new key of each request, into each rank's own rows (slot -1: padded request).
    for (Rank& r : ranks)
      cuda::insert_keys_async(r.cache, l, b.keys + kKeysPerLayer * l, b.slot_mapping, kMaxRequests, InsertOptions{},
                              r.insert_ws, r.insert_ws_bytes, r.insert_status, st);
    DeviceDecodeBatch batch;
    batch.q = q8;
    batch.block_table = b.block_table;
    batch.seq_lens = b.seq_lens;
    batch.num_requests = kMaxRequests;  // the grid shape: fixed in the graph, padding is seq_len 0
    // Each rank scores all heads over its rows and publishes its candidates straight into its
    // record of the shared buffer: the layout an all-gather of the records would produce.
    for (Rank& r : ranks)
      r.plan.publish(r.cache, l, batch, r.workspace, r.workspace_bytes, b.records + b.record_bytes * r.rank, st);
    // (an engine would all-gather here on this stream: ncclAllGather(send, records, bytes, ...))
    for (Rank& r : ranks) r.plan.merge(batch, b.records, r.out[l], b.step_status + l * kWorld + r.rank, st);
  }
}

// ---- the CPU reference ------------------------------------------------------------------------

struct Comparison {
  int64_t compared = 0;  // (row, head) selections of live rows
  int64_t differ = 0;
};

void print_diff(int32_t layer, int32_t rank, int64_t row, int32_t head, int32_t seq_len, const int32_t* gpu,
                const int32_t* cpu, int32_t K) {
  std::printf("\n  layer %d rank %d row %lld head %d (seq_len %d):\n    gpu", layer, rank, static_cast<long long>(row),
              head, seq_len);
  for (int32_t k = 0; k < K; ++k) std::printf(" %d", gpu[k]);
  std::printf("\n    cpu");
  for (int32_t k = 0; k < K; ++k) std::printf(" %d", cpu[k]);
}

// Copies both rank pools back into host caches of the same geometry and runs the CPU plans (the
// reference) on this step's batch; counts the (row, head) selections that differ from the GPU's.
Comparison compare_with_cpu(const ResolvedConfig& config, const std::vector<Rank>& ranks, const StepBuffers& b,
                            int32_t layers, const Scheduler& sched, int64_t show_diffs, cudaStream_t st) {
  CK(cudaStreamSynchronize(st));
  // IndexCache packs its layers (layer stride num_pages * page_stride); the pool has its own
  // stride, so copy layer by layer
  std::vector<IndexCache> host;
  for (const Rank& r : ranks) {
    host.emplace_back(r.layout, kNumPages, layers, r.rank);
    for (int32_t l = 0; l < layers; ++l)
      CK(cudaMemcpy(host.back().page_ptr(l, 0), r.pool + r.layer_stride * l, static_cast<size_t>(r.layer_bytes),
                    cudaMemcpyDeviceToHost));
  }
  const auto q8 = download(b.q8, kQPerLayer * layers);  // the E4M3 q the GPU scored
  const auto seq_lens = sched.seq_lens();
  const auto block_table = sched.block_table();
  const int32_t K = decode_limits().sel.topk;

  std::vector<std::vector<int32_t>> want(kWorld);  // [rank][layer, rows, nh, K]
  run_ranks(kWorld, [&](int rank, Communicator& comm) {
    DecodePlan plan(config, rank, decode_limits());
    struct alignas(16) Chunk { unsigned char bytes[16]; };
    std::vector<Chunk> ws((plan.workspace_bytes() + 15) / 16);
    const size_t per_layer = static_cast<size_t>(kRows) * plan.num_heads() * K;
    want[rank].resize(per_layer * layers);
    for (int32_t l = 0; l < layers; ++l) {
      DeviceDecodeBatch hb;  // on the CPU backend the batch's pointers are host memory
      hb.q = q8.data() + kQPerLayer * l;
      hb.block_table = block_table.data();
      hb.seq_lens = seq_lens.data();
      hb.num_requests = kMaxRequests;
      uint32_t status = 0;
      plan.run(host[rank], l, hb, ws.data(), ws.size() * sizeof(Chunk), want[rank].data() + per_layer * l, &comm,
               &status);
      if (status != 0) throw Error(ErrorCode::kRuntime, step_status_message(status, "indexcp::DecodePlan::run"));
    }
  });

  Comparison c;
  for (const Rank& r : ranks) {
    const int32_t nh = r.plan.num_heads();
    for (int32_t l = 0; l < layers; ++l) {
      const auto got = download(r.out[l], static_cast<size_t>(kRows) * nh * K);
      const int32_t* ref = want[r.rank].data() + got.size() * l;
      for (int64_t row = 0; row < kRows; ++row) {
        if (seq_lens[row / kQueryLen] == 0) {  // padded: both must be all -1
          for (int32_t k = 0; k < nh * K; ++k)
            if (got[row * nh * K + k] != -1) ++c.differ;
          continue;
        }
        for (int32_t h = 0; h < nh; ++h) {
          const size_t at = (static_cast<size_t>(row) * nh + h) * K;
          ++c.compared;
          if (std::equal(got.begin() + at, got.begin() + at + K, ref + at)) continue;
          if (++c.differ <= show_diffs) print_diff(l, r.rank, row, r.plan.head_begin() + h, seq_lens[row / kQueryLen],
                                                   got.data() + at, ref + at, K);
        }
      }
    }
  }
  return c;
}

// ---- the program ------------------------------------------------------------------------------

struct Options {
  int32_t layers = 4;
  int32_t steps = 5;
  int32_t show_diffs = 0;  // print this many differing selections (GPU and CPU ids)
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--layers" && has_value) o.layers = std::atoi(argv[++i]);
    else if (a == "--steps" && has_value) o.steps = std::atoi(argv[++i]);
    else if (a == "--show-diffs" && has_value) o.show_diffs = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--layers N (1..64)] [--steps S (1..1000)] [--show-diffs N]\n", argv[0]);
      std::exit(1);
    }
  }
  if (o.layers < 1 || o.layers > 64 || o.steps < 1 || o.steps > 1000) {
    std::fprintf(stderr, "engine_step: --layers must be in 1..64 and --steps in 1..1000\n");
    std::exit(1);
  }
  return o;
}

int run(const Options& opt) {
  const ResolvedConfig config = resolve();
  std::printf("engine_step: %s, %d layers, %d steps; config: nvfp4, sharded over tp = %d, P = %d, H = %d, "
              "decode path %s\n",
              cuda::device_name().c_str(), opt.layers, opt.steps, kWorld, kPageSize, kHeads,
              to_string(decode_path(config)));
  std::mt19937 rng(2026);
  Scheduler sched(7);

  // Start-up: pools, plans and every buffer (the plans call prepare_device: nothing of the
  // one-time setup is left for the capture).
  DeviceMemory mem;
  std::vector<int64_t> fill_slots;  // every existing token of every request
  for (int32_t b = 0; b < kMaxRequests; ++b)
    for (int32_t pos = 0; pos < sched.seq_len(b); ++pos) fill_slots.push_back(sched.slot(b, pos));
  const int64_t fill_tokens = static_cast<int64_t>(fill_slots.size());
  std::vector<Rank> ranks;
  ranks.reserve(kWorld);
  for (int32_t r = 0; r < kWorld; ++r) ranks.emplace_back(config, r, opt.layers, fill_tokens, mem);
  const StepBuffers bufs = make_step_buffers(opt.layers, ranks[0].plan.exchange_bytes(), mem);
  float* fill_keys = mem.alloc<float>(static_cast<size_t>(fill_tokens) * kDim * opt.layers);
  int64_t* fill_slot_buf = mem.alloc<int64_t>(static_cast<size_t>(fill_tokens));
  CK(cudaDeviceSynchronize());  // the zero fills (legacy stream) before any work on our stream
  std::printf("per rank: cache pool %.1f MiB (%d layers x %lld pages of %lld B), plan workspace %zu B, exchange "
              "record %zu B\n",
              static_cast<double>(ranks[0].layer_stride) * opt.layers / (1 << 20), opt.layers,
              static_cast<long long>(kNumPages), static_cast<long long>(ranks[0].layout.page_bytes()),
              ranks[0].workspace_bytes, bufs.record_bytes);

  cudaStream_t st = nullptr;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));

  // The prefill-like fill: every existing token's key into every layer of both ranks, one wait.
  insert_prompt_keys(ranks, opt.layers, fill_slots, fill_keys, fill_slot_buf, rng, st);
  CK(cudaStreamSynchronize(st));
  check_statuses(ranks, bufs, opt.layers, 0, st);
  std::printf("filled %lld tokens x %d layers on both ranks\n", static_cast<long long>(fill_tokens), opt.layers);

  // Capture one decode step of every layer. Nothing runs now; the graph reads seq_lens, the block
  // table, slots, q and keys from the buffers when it is replayed.
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  enqueue_decode_step(ranks, bufs, opt.layers, st);
  CK(cudaStreamEndCapture(st, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  CK(cudaGraphUpload(exec, st));
  size_t nodes = 0;
  CK(cudaGraphGetNodes(graph, nullptr, &nodes));
  std::printf("captured one decode step: %zu graph nodes\n", nodes);

  cudaEvent_t t0, t1;
  CK(cudaEventCreate(&t0));
  CK(cudaEventCreate(&t1));
  std::vector<float> step_us;
  Comparison total;
  for (int32_t step = 1; step <= opt.steps; ++step) {
    // The scheduler's step: every request grows by one token, finished ones are padded, new
    // ones admitted (their prompt keys inserted eagerly, before the graph, on the same stream).
    const std::vector<int32_t> admitted = sched.advance();
    if (!admitted.empty()) {
      std::vector<int64_t> slots;
      for (int32_t b : admitted)
        for (int32_t pos = 0; pos < sched.seq_len(b) - 1; ++pos) slots.push_back(sched.slot(b, pos));
      insert_prompt_keys(ranks, opt.layers, slots, fill_keys, fill_slot_buf, rng, st);
    }
    // New metadata, q and keys into the SAME buffers the graph reads.
    upload(bufs.seq_lens, sched.seq_lens(), st);
    upload(bufs.block_table, sched.block_table(), st);
    upload(bufs.slot_mapping, sched.step_slots(), st);
    upload(bufs.q, normal_values(kQPerLayer * opt.layers, rng), st);
    upload(bufs.keys, normal_values(kKeysPerLayer * opt.layers, rng), st);

    CK(cudaEventRecord(t0, st));
    CK(cudaGraphLaunch(exec, st));
    CK(cudaEventRecord(t1, st));
    CK(cudaEventSynchronize(t1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, t0, t1));
    step_us.push_back(ms * 1000.0f);

    check_statuses(ranks, bufs, opt.layers, step, st);
    int padded = 0;
    for (int32_t s : sched.seq_lens()) padded += s == 0;
    std::printf("step %d: replay %.1f us (%.1f us per layer, both ranks); %d live requests, %d padded, %d admitted, "
                "%d pages in use; statuses ok",
                step, ms * 1000.0, ms * 1000.0 / opt.layers, kMaxRequests - padded, padded,
                static_cast<int>(admitted.size()), sched.pages_in_use());
    if (step == 1 || step == opt.steps) {
      const Comparison c = compare_with_cpu(config, ranks, bufs, opt.layers, sched, opt.show_diffs, st);
      total.compared += c.compared;
      total.differ += c.differ;
      std::printf("; CPU reference: %lld of %lld (row, head) selections differ", static_cast<long long>(c.differ),
                  static_cast<long long>(c.compared));
    }
    std::printf("\n");
  }

  std::vector<float> sorted = step_us;
  std::sort(sorted.begin(), sorted.end());
  const float median = sorted[sorted.size() / 2];
  const bool ok = total.differ * 100 <= total.compared;  // only near-ties of fp32 scores may differ
  std::printf("engine_step: %s: %d layers x %d steps x %d ranks, median replay %.1f us (%.1f us per layer); "
              "CPU reference %lld of %lld selections differ (limit 1%%)\n",
              ok ? "ok" : "FAILED", opt.layers, opt.steps, kWorld, median, median / static_cast<float>(opt.layers),
              static_cast<long long>(total.differ), static_cast<long long>(total.compared));

  CK(cudaEventDestroy(t0));
  CK(cudaEventDestroy(t1));
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaStreamDestroy(st));
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  if (!indexcp::cuda::available()) {
    std::printf("engine_step: no CUDA GPU visible; this example needs a Hopper GPU (sm_90a), nothing run\n");
    return 0;
  }
  try {
    return run(opt);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "engine_step: %s\n", e.what());
    return 1;
  }
}

#else  // a CPU-only build of the library: cuda.hpp's functions are not defined

int main() {
  std::printf("engine_step: this build of indexcp has no CUDA backend; nothing run\n");
  return 0;
}

#endif
