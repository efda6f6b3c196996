// Host API of the CUDA backend (include/indexcp/cuda.hpp): validation at the boundary, workspace,
// and the sequences of kernel launches of each operation.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common.cuh"
#include "cpu/kernels.hpp"
#include "indexcp/cuda.hpp"
#include "kernels.cuh"

namespace indexcp::cuda {

using namespace detail;

namespace {

cudaStream_t cs(Stream s) { return reinterpret_cast<cudaStream_t>(s); }

/// Stream-ordered temporary device memory (cudaMallocAsync / cudaFreeAsync on one stream).
template <class T>
class Tmp {
 public:
  Tmp(size_t n, cudaStream_t s) : s_(s) {
    if (n) check(cudaMallocAsync(reinterpret_cast<void**>(&p_), n * sizeof(T), s), "cudaMallocAsync");
  }
  ~Tmp() {
    if (p_) cudaFreeAsync(p_, s_);
  }
  Tmp(const Tmp&) = delete;
  Tmp& operator=(const Tmp&) = delete;
  T* get() const { return p_; }

 private:
  T* p_ = nullptr;
  cudaStream_t s_;
};

// Device data read back by the validating paths: on the caller's stream, after the caller's own
// writes to it (never on the legacy default stream), then that stream is synchronized.
template <class T>
std::vector<T> to_host(const T* dev, size_t n, const char* what, cudaStream_t st) {
  std::vector<T> h(n);
  if (n) {
    INDEXCP_REQUIRE(dev != nullptr, std::string(what) + " is null");
    check(cudaMemcpyAsync(h.data(), dev, n * sizeof(T), cudaMemcpyDeviceToHost, st), what);
    check(cudaStreamSynchronize(st), what);
  }
  return h;
}

// Every entry point's first cache check: a device view (not a host one), then the layer.
void check_layer(const CacheView& c, int32_t layer, const char* name = "cache") {
  require_supported_device();
  check_cache_view(c, MemoryLocation::kDevice, name);
  check_view_layer(c, layer);
}

void check_not_bf16(const CacheView& c) {
  if (c.layout().dtype == KvDtype::kBf16)
    throw Error(ErrorCode::kUnsupported,
                "indexer_kv_dtype = bf16 is not supported by the CUDA scorers (use fp8 or nvfp4, or the cpu backend)");
}

void check_head_range(int32_t heads, int32_t h0, int32_t nh) {
  INDEXCP_REQUIRE(heads >= 1 && heads <= 64, "heads = " + std::to_string(heads) + " is out of range 1..64");
  cpu::check_head_range(heads, h0, nh);
}

void check_decode_shape(const DecodeBatch& b) {
  INDEXCP_REQUIRE(b.query_len >= 1 && b.query_len <= 16, "query_len = " + std::to_string(b.query_len) + " is out of range 1..16");
  INDEXCP_REQUIRE(b.num_requests >= 0, "num_requests = " + std::to_string(b.num_requests) + " must be >= 0");
  INDEXCP_REQUIRE(b.max_pages >= 0, "max_pages = " + std::to_string(b.max_pages) + " must be >= 0");
  INDEXCP_REQUIRE(b.heads >= 1 && b.heads <= 64, "heads = " + std::to_string(b.heads) + " is out of range 1..64");
  if (b.num_requests > 0) {
    INDEXCP_REQUIRE(b.seq_lens != nullptr, "seq_lens is null");
    INDEXCP_REQUIRE(b.q != nullptr, "q is null");
    INDEXCP_REQUIRE(b.max_pages == 0 || b.block_table != nullptr, "block_table is null");
  }
}

RowsView decode_rows_view(const DecodeBatch& b) {
  RowsView v;
  v.seq_lens = b.seq_lens;
  v.num_requests = b.num_requests;
  v.query_len = b.query_len;
  v.rows = b.rows();
  return v;
}

KeySource key_source(const CacheView& c, int32_t layer) {
  KeySource k;
  k.base = c.layer_ptr(layer);
  k.layout = c.layout();
  k.rank = c.rank();
  k.num_pages = c.num_pages();
  return k;
}

int64_t max_blocks_of(int32_t max_pages, const PageLayout& l) {
  return static_cast<int64_t>(max_pages) * l.blocks_per_page();
}

ScoreLaunch decode_score_launch(const CacheView& c, int32_t layer, const DecodeBatch& b, int32_t h0,
                                int32_t nh, KRounding mode, float* scores, BlockFilter filter, bool stock) {
  check_k_rounding(mode, "mode");
  ScoreLaunch s;
  s.keys = key_source(c, layer);
  s.mode = mode;
  s.stock = stock;
  s.rows = decode_rows_view(b);
  s.block_table = b.block_table;
  s.max_pages = b.max_pages;
  s.max_rows_per_request = b.query_len;
  s.q = b.q;
  s.heads = b.heads;
  s.h0 = h0;
  s.nh = nh;
  s.filter = filter;
  s.scores = scores;
  s.max_blocks = max_blocks_of(b.max_pages, c.layout());
  return s;
}

struct HostPrefill {
  std::vector<int32_t> seq_lens, query_start, block_table;
  std::vector<QueryRow> rows;
  int32_t max_rows_per_request = 1;
};

// The batch's metadata copied to the host and validated there (cpu::prefill_rows_metadata), and
// q's bytes checked on the GPU, where q lives (a prefill chunk's q is MiBs: copying it back and
// scanning it on the host cost the synchronous prefill APIs milliseconds). The same errors, in the
// same order, as prefill_rows on a host copy of the batch.
HostPrefill read_prefill(const PrefillBatch& b, int64_t num_pages, int32_t page_size, cudaStream_t st) {
  INDEXCP_REQUIRE(b.num_requests >= 0, "num_requests = " + std::to_string(b.num_requests) + " must be >= 0");
  INDEXCP_REQUIRE(b.max_pages >= 0, "max_pages = " + std::to_string(b.max_pages) + " must be >= 0");
  INDEXCP_REQUIRE(b.heads >= 1 && b.heads <= 64, "heads = " + std::to_string(b.heads) + " is out of range 1..64");
  HostPrefill h;
  if (b.num_requests > 0) INDEXCP_REQUIRE(b.query_start != nullptr, "query_start is null");
  h.query_start = to_host(b.query_start, static_cast<size_t>(b.num_requests) + 1, "query_start (device to host)", st);
  h.seq_lens = to_host(b.seq_lens, static_cast<size_t>(b.num_requests), "seq_lens (device to host)", st);
  h.block_table = to_host(b.block_table, static_cast<size_t>(b.num_requests) * b.max_pages, "block_table (device to host)", st);
  const int64_t rows = b.num_requests ? h.query_start.back() : 0;
  INDEXCP_REQUIRE(rows >= 0, "query_start[num_requests] = " + std::to_string(rows) + " is negative");
  PrefillBatch hb = b;  // (q stays the device pointer: only tested for null on the host)
  hb.seq_lens = h.seq_lens.data();
  hb.query_start = h.query_start.empty() ? nullptr : h.query_start.data();
  hb.block_table = h.block_table.data();
  if (b.num_requests == 0) {
    static const int32_t zero = 0;
    hb.query_start = &zero;
  }
  h.rows = cpu::prefill_rows_metadata(hb, num_pages, page_size);
  for (int32_t r = 0; r < b.num_requests; ++r)
    h.max_rows_per_request = std::max(h.max_rows_per_request, h.query_start[r + 1] - h.query_start[r]);
  const int64_t n = rows * b.heads * kHeadDim;
  if (n > 0) {
    Tmp<unsigned long long> first(1, st);
    check(cudaMemsetAsync(first.get(), 0xff, sizeof(unsigned long long), st), "cudaMemsetAsync");
    launch_e4m3_nan_check(b.q, n, first.get(), st);
    unsigned long long e = ~0ull;
    check(cudaMemcpyAsync(&e, first.get(), sizeof(e), cudaMemcpyDeviceToHost, st), "cudaMemcpyAsync (q check)");
    check(cudaStreamSynchronize(st), "cudaStreamSynchronize (q check)");
    if (e != ~0ull) cpu::throw_q_nan(static_cast<int64_t>(e), b.heads);
  }
  return h;
}

RowsView prefill_rows_view(const PrefillBatch& b, int64_t rows) {
  RowsView v;
  v.seq_lens = b.seq_lens;
  v.query_start = b.query_start;
  v.num_requests = b.num_requests;
  v.rows = rows;
  return v;
}

// The scorer launch of a replicated prefill (E4M3 keys, whole-page scorer) for heads [h0, h0+nh).
ScoreLaunch prefill_score_launch(const CacheView& cache, int32_t layer, const PrefillBatch& batch, int64_t rows,
                                 int32_t max_rows_per_request, int32_t h0, int32_t nh, float* scores) {
  ScoreLaunch sl;
  sl.keys = key_source(cache, layer);
  sl.mode = KRounding::kE4m3;  // prefill always scores E4M3 keys (indexer.md section 2)
  sl.stock = true;
  sl.rows = prefill_rows_view(batch, rows);
  sl.block_table = batch.block_table;
  sl.max_pages = batch.max_pages;
  sl.max_rows_per_request = max_rows_per_request;
  sl.q = batch.q;
  sl.heads = batch.heads;
  sl.h0 = h0;
  sl.nh = nh;
  sl.scores = scores;
  sl.max_blocks = max_blocks_of(batch.max_pages, cache.layout());
  return sl;
}

void check_group(const Communicator& comm, const CacheView& c, bool sharded) {
  if (sharded) {
    INDEXCP_REQUIRE(c.layout().shards == comm.world(), "shard has shards = " + std::to_string(c.layout().shards) +
                                                   " but the communicator has world = " + std::to_string(comm.world()));
    INDEXCP_REQUIRE(c.rank() == comm.rank(), "shard is rank " + std::to_string(c.rank()) + "'s but the communicator is rank " +
                                         std::to_string(comm.rank()) + "'s");
  } else {
    INDEXCP_REQUIRE(c.layout().shards == 1,
            "cache is sharded (shards = " + std::to_string(c.layout().shards) + "); decode CP needs a replicated cache");
  }
}

// Score all heads over `c` (rows given by `rv`), publish, all-gather, merge owned heads.
void icp_select_device(Communicator& comm, const ScoreLaunch& sl_in, const CacheView& c, const RowsView& rv,
                       const SelectionParams& sel, int32_t* out, cudaStream_t st) {
  const int32_t W = comm.world();
  const int32_t H = sl_in.heads;
  const int32_t kk = sel.ranked();
  const int64_t rows = rv.rows;
  if (rows == 0) return;
  Tmp<float> scores(static_cast<size_t>(rows) * H * sl_in.max_blocks, st);
  Tmp<Candidate> mine(static_cast<size_t>(rows) * H * kk, st);
  Tmp<Candidate> all(static_cast<size_t>(rows) * H * kk * W, st);
  ScoreLaunch sl = sl_in;
  sl.scores = scores.get();
  launch_score(sl, st);
  SelectLaunch pub;
  pub.rows = rv;
  pub.scores = scores.get();
  pub.max_blocks = sl.max_blocks;
  pub.nh = H;
  pub.sel = sel;
  pub.cands = mine.get();
  pub.layout = c.layout();
  pub.rank = c.rank();
  pub.filter = sl.filter;
  launch_select(pub, st);
  comm.all_gather(mine.get(), all.get(), static_cast<size_t>(rows) * H * kk * sizeof(Candidate), st);
  int32_t h0, nh;
  owned_heads(H, W, comm.rank(), &h0, &nh);
  MergeLaunch m;
  m.rows = rv;
  m.cands = all.get();
  m.world = W;
  m.heads = H;
  m.h0 = h0;
  m.nh = nh;
  m.sel = sel;
  m.out = out;
  m.out_heads = nh;
  m.out_h0 = 0;
  launch_merge(m, st);
}

}  // namespace

// ---------------------------------------------------------------------------------------------

bool available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

std::string device_name() {
  int dev = 0;
  INDEXCP_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp p;
  INDEXCP_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  return p.name;
}

void require_supported_device() {
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  static std::mutex mu;
  static std::vector<int8_t> known;  // per device: 0 unknown, 1 supported, -1 refused
  {
    std::lock_guard<std::mutex> lk(mu);
    if (dev < static_cast<int>(known.size()) && known[dev] == 1) return;
  }
  int major = 0, minor = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "cudaDeviceGetAttribute");
  check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), "cudaDeviceGetAttribute");
  if (major != 9 || minor != 0) {
    cudaDeviceProp p;
    const std::string name = cudaGetDeviceProperties(&p, dev) == cudaSuccess ? p.name : "?";
    throw Error(ErrorCode::kUnsupported, device_support_message(dev, name, major, minor));
  }
  std::lock_guard<std::mutex> lk(mu);
  if (static_cast<int>(known.size()) <= dev) known.resize(dev + 1, 0);
  known[dev] = 1;
}

void prepare_device() {
  require_supported_device();
  ensure_tables();
}

DeviceCache::DeviceCache(const PageLayout& layout, int64_t num_pages, int32_t num_layers, int32_t rank)
    : num_pages_(num_pages), num_layers_(num_layers), rank_(rank) {
  layout_ = make_page_layout(layout.dtype, layout.page_size, layout.shards, layout.page_stride);
  INDEXCP_REQUIRE(num_pages >= 1, "num_pages = " + std::to_string(num_pages) + " must be >= 1");
  INDEXCP_REQUIRE(num_pages < (int64_t{1} << 31), "num_pages = " + std::to_string(num_pages) + " must fit in int32 (page ids)");
  INDEXCP_REQUIRE(num_layers >= 1 && num_layers <= 4096, "num_layers = " + std::to_string(num_layers) + " must be in 1..4096");
  INDEXCP_REQUIRE(rank >= 0 && rank < layout_.shards,
          "rank = " + std::to_string(rank) + " must be in [0, shards = " + std::to_string(layout_.shards) + ")");
  const int64_t bytes = size_bytes();
  prepare_device();
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, static_cast<size_t>(bytes));
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw Error(ErrorCode::kRuntime, "could not allocate the device index cache (" + std::to_string(bytes) +
                                         " bytes): cudaMalloc failed: " + cudaGetErrorName(e) + " (" +
                                         cudaGetErrorString(e) + ")");
  }
  data_ = static_cast<uint8_t*>(p);
  // cudaMemset is asynchronous on the legacy stream: wait for it, so that the caller's work on any
  // stream (non-blocking ones are not ordered after the legacy stream) sees a zeroed cache
  INDEXCP_CUDA_CHECK(cudaMemset(data_, 0, static_cast<size_t>(bytes)));
  INDEXCP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

CacheView DeviceCache::view() const {
  return make_cache_view(layout_, data_, num_pages_, num_layers_, rank_, 0, MemoryLocation::kDevice);
}

DeviceCache::~DeviceCache() {
  if (data_) cudaFree(data_);
}

DeviceCache::DeviceCache(DeviceCache&& o) noexcept
    : layout_(o.layout_), num_pages_(o.num_pages_), num_layers_(o.num_layers_), rank_(o.rank_), data_(o.data_) {
  o.data_ = nullptr;
}

DeviceCache& DeviceCache::operator=(DeviceCache&& o) noexcept {
  if (this != &o) {
    if (data_) cudaFree(data_);
    layout_ = o.layout_;
    num_pages_ = o.num_pages_;
    num_layers_ = o.num_layers_;
    rank_ = o.rank_;
    data_ = o.data_;
    o.data_ = nullptr;
  }
  return *this;
}

static void check_same_geometry(const CacheView& d, const IndexCache& h) {
  INDEXCP_REQUIRE(h.layout().dtype == d.layout().dtype && h.layout().page_size == d.layout().page_size &&
              h.layout().shards == d.layout().shards && h.layout().page_stride == d.layout().page_stride &&
              h.num_pages() == d.num_pages() && h.num_layers() == d.num_layers() && h.rank() == d.rank(),
          "host cache geometry (layout, num_pages, num_layers, rank) differs from the device cache's");
}

void DeviceCache::upload(const IndexCache& host) {
  check_same_geometry(*this, host);
  // a copy from pageable memory may return before its DMA lands: wait for it (the caller may use
  // the cache on a non-blocking stream next)
  INDEXCP_CUDA_CHECK(cudaMemcpy(data_, host.data(), static_cast<size_t>(size_bytes()), cudaMemcpyHostToDevice));
  INDEXCP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

void DeviceCache::download(IndexCache& host) const {
  check_same_geometry(*this, host);
  INDEXCP_CUDA_CHECK(cudaMemcpy(host.data(), data_, static_cast<size_t>(size_bytes()), cudaMemcpyDeviceToHost));
}

// ---- insert and Q cast ----------------------------------------------------------------------

namespace {

// cos/sin of indexer.md section 6 for each token (the synchronous calls' per-token table), by the
// CPU's own rule (rope_cos_sin_row).
std::vector<float> rope_rows(const std::vector<int64_t>& positions, double theta) {
  std::vector<float> t(positions.size() * 64);
  for (size_t k = 0; k < positions.size(); ++k) rope_cos_sin_row(positions[k], theta, t.data() + k * 64);
  return t;
}

// What is wrong before any token is read, in the CPU's order (src/cpu/cache.cpp).
void check_insert_args(const CacheView& cache, int32_t layer, const void* keys, const int64_t* slot_mapping,
                       int64_t n, const InsertOptions& opts) {
  check_layer(cache, layer);
  check_num_tokens(n);
  if (n == 0) return;
  INDEXCP_REQUIRE(keys != nullptr, "keys is null");
  INDEXCP_REQUIRE(slot_mapping != nullptr, "slot_mapping is null");
  // a bad S is refused for every dtype, as the CPU insert does (docs/decisions.md)
  INDEXCP_REQUIRE(fmt::is_finite(opts.encode_scale) && opts.encode_scale > 0.0f,
                  "encode_scale = " + std::to_string(opts.encode_scale) +
                      " is invalid: the NVFP4 encode scale S must be finite and > 0");
  check_preprocess(opts.pre);
}

InsertLaunch insert_launch(const CacheView& cache, int32_t layer, const float* keys, const uint16_t* keys_bf16,
                           const int64_t* slot_mapping, int64_t n, const InsertOptions& opts, void* workspace,
                           InsertStatus* status) {
  const PageLayout& l = cache.layout();
  const InsertWorkspace w = insert_workspace_layout(n);
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  InsertLaunch L;
  L.keys_f32 = keys;
  L.keys_bf16 = keys_bf16;
  L.slots = slot_mapping;
  L.n = n;
  L.layer = layer;
  L.layer_base = cache.layer_ptr(layer);
  L.layout = l;
  L.rank = cache.rank();
  L.num_slots = cache.num_pages() * l.page_size;
  L.encode_scale = opts.encode_scale;
  L.norm_weight = opts.pre.norm_weight;
  L.eps = opts.pre.eps;
  L.staged = ws + w.staged;
  L.err = reinterpret_cast<unsigned long long*>(ws + w.err);
  L.dup = ws + w.dup;
  L.sort_keys = reinterpret_cast<int64_t*>(ws + w.sort_keys);
  L.sort_temp = ws + w.sort_temp;
  L.sort_temp_bytes = w.sort_temp_bytes;
  L.status = status;
  return L;
}

void check_async_rope(const KeyPreprocess& pre) {
  INDEXCP_REQUIRE(!pre.rope || (pre.rope_cos_sin != nullptr && pre.rope_table_positions >= 1),
                  "rope is on but rope_cos_sin is null or rope_table_positions < 1 (the asynchronous calls read "
                  "cos/sin from a table: fill_rope_table)");
}

void insert_async_impl(const CacheView& cache, int32_t layer, const float* keys, const uint16_t* keys_bf16,
                       const int64_t* slot_mapping, int64_t n, const InsertOptions& opts, void* workspace,
                       size_t workspace_bytes, InsertStatus* status, cudaStream_t st) {
  check_insert_args(cache, layer, keys ? static_cast<const void*>(keys) : keys_bf16, slot_mapping, n, opts);
  INDEXCP_REQUIRE(status != nullptr, "status is null");
  INDEXCP_REQUIRE(reinterpret_cast<uintptr_t>(status) % 8 == 0, "status is not 8-byte aligned");
  check_async_rope(opts.pre);
  if (n == 0) return;
  const size_t need = insert_workspace_layout(n).total;
  INDEXCP_REQUIRE(workspace_bytes >= need, "workspace_bytes = " + std::to_string(workspace_bytes) +
                                               " is smaller than insert_workspace_bytes(num_tokens = " +
                                               std::to_string(n) + ") = " + std::to_string(need));
  INDEXCP_REQUIRE(workspace != nullptr, "workspace is null");
  INDEXCP_REQUIRE(reinterpret_cast<uintptr_t>(workspace) % kCacheAlignment == 0,
                  "workspace is not 16-byte aligned");
  InsertLaunch L = insert_launch(cache, layer, keys, keys_bf16, slot_mapping, n, opts, workspace, status);
  if (opts.pre.rope) {
    L.rope_cs = opts.pre.rope_cos_sin;
    L.positions = opts.pre.positions;
    L.table_positions = opts.pre.rope_table_positions;
  }
  launch_insert(L, st);
}

// The synchronous form: the asynchronous kernels with a per-call workspace and status, then the
// status read back on the caller's stream and thrown (status_error: the CPU's messages).
void insert_sync_impl(const CacheView& cache, int32_t layer, const float* keys, const uint16_t* keys_bf16,
                      const int64_t* slot_mapping, int64_t n, const InsertOptions& opts, cudaStream_t st) {
  check_insert_args(cache, layer, keys ? static_cast<const void*>(keys) : keys_bf16, slot_mapping, n, opts);
  if (n == 0) return;
  const InsertWorkspace w = insert_workspace_layout(n);
  Tmp<uint8_t> ws(w.total, st);
  Tmp<InsertStatus> status(1, st);
  check(cudaMemsetAsync(status.get(), 0, sizeof(InsertStatus), st), "cudaMemsetAsync (status)");
  InsertLaunch L = insert_launch(cache, layer, keys, keys_bf16, slot_mapping, n, opts, ws.get(), status.get());
  std::unique_ptr<Tmp<float>> cs_dev;
  std::vector<float> t;
  if (opts.pre.rope) {
    t = rope_rows(to_host(opts.pre.positions, static_cast<size_t>(n), "positions (device to host)", st),
                  opts.pre.rope_theta);
    cs_dev = std::make_unique<Tmp<float>>(t.size(), st);
    check(cudaMemcpyAsync(cs_dev->get(), t.data(), t.size() * sizeof(float), cudaMemcpyHostToDevice, st),
          "cudaMemcpyAsync (rope table)");
    L.rope_cs = cs_dev->get();
  }
  launch_insert(L, st);
  InsertStatus h;
  check(cudaMemcpyAsync(&h, status.get(), sizeof(h), cudaMemcpyDeviceToHost, st), "cudaMemcpyAsync (insert status)");
  check(cudaStreamSynchronize(st), "cudaStreamSynchronize (insert)");
  throw_if_refused(h);
}

QCastLaunch qcast_launch(const float* q, int64_t num_tokens, int32_t heads, const KeyPreprocess& pre, uint8_t* out,
                         InsertStatus* status) {
  QCastLaunch L;
  L.q = q;
  L.vectors = num_tokens * heads;
  L.heads = heads;
  L.norm_weight = pre.norm_weight;
  L.eps = pre.eps;
  L.out = out;
  L.status = status;
  return L;
}

void check_qcast_args(const float* q, int64_t num_tokens, int32_t heads, const uint8_t* out) {
  require_supported_device();
  INDEXCP_REQUIRE(heads >= 1 && heads <= 64, "heads = " + std::to_string(heads) + " is out of range 1..64");
  check_num_tokens(num_tokens);
  INDEXCP_REQUIRE(num_tokens == 0 || (q != nullptr && out != nullptr), "q or out is null");
}

}  // namespace

void insert_keys(const CacheView& cache, int32_t layer, const float* keys, const int64_t* slot_mapping,
                 int64_t num_tokens, const InsertOptions& opts, Stream stream) {
  insert_sync_impl(cache, layer, keys, nullptr, slot_mapping, num_tokens, opts, cs(stream));
}

void insert_keys_bf16(const CacheView& cache, int32_t layer, const uint16_t* keys, const int64_t* slot_mapping,
                      int64_t num_tokens, const InsertOptions& opts, Stream stream) {
  insert_sync_impl(cache, layer, nullptr, keys, slot_mapping, num_tokens, opts, cs(stream));
}

size_t insert_workspace_bytes(int64_t max_tokens) {
  check_num_tokens(max_tokens);
  return insert_workspace_layout(max_tokens).total;
}

void insert_keys_async(const CacheView& cache, int32_t layer, const float* keys, const int64_t* slot_mapping,
                       int64_t num_tokens, const InsertOptions& opts, void* workspace, size_t workspace_bytes,
                       InsertStatus* status, Stream stream) {
  insert_async_impl(cache, layer, keys, nullptr, slot_mapping, num_tokens, opts, workspace, workspace_bytes, status,
                    cs(stream));
}

void insert_keys_bf16_async(const CacheView& cache, int32_t layer, const uint16_t* keys, const int64_t* slot_mapping,
                            int64_t num_tokens, const InsertOptions& opts, void* workspace, size_t workspace_bytes,
                            InsertStatus* status, Stream stream) {
  insert_async_impl(cache, layer, nullptr, keys, slot_mapping, num_tokens, opts, workspace, workspace_bytes, status,
                    cs(stream));
}

void quantize_queries(const float* q, int64_t num_tokens, int32_t heads, const KeyPreprocess& pre, uint8_t* out,
                      Stream stream) {
  check_qcast_args(q, num_tokens, heads, out);
  if (num_tokens == 0) return;  // (as insert_keys: no token, nothing else checked)
  check_preprocess(pre);
  const cudaStream_t st = cs(stream);
  Tmp<InsertStatus> status(1, st);
  check(cudaMemsetAsync(status.get(), 0, sizeof(InsertStatus), st), "cudaMemsetAsync (status)");
  QCastLaunch L = qcast_launch(q, num_tokens, heads, pre, out, status.get());
  std::unique_ptr<Tmp<float>> cs_dev;
  std::vector<float> t;
  if (pre.rope) {
    t = rope_rows(to_host(pre.positions, static_cast<size_t>(num_tokens), "positions (device to host)", st),
                  pre.rope_theta);
    cs_dev = std::make_unique<Tmp<float>>(t.size(), st);
    check(cudaMemcpyAsync(cs_dev->get(), t.data(), t.size() * sizeof(float), cudaMemcpyHostToDevice, st),
          "cudaMemcpyAsync (rope table)");
    L.rope_cs = cs_dev->get();
  }
  launch_qcast(L, st);
  InsertStatus h;
  check(cudaMemcpyAsync(&h, status.get(), sizeof(h), cudaMemcpyDeviceToHost, st), "cudaMemcpyAsync (q cast status)");
  check(cudaStreamSynchronize(st), "cudaStreamSynchronize (q cast)");
  throw_if_refused(h);
}

void quantize_queries_async(const float* q, int64_t num_tokens, int32_t heads, const KeyPreprocess& pre,
                            uint8_t* out, InsertStatus* status, Stream stream) {
  check_qcast_args(q, num_tokens, heads, out);
  INDEXCP_REQUIRE(status != nullptr, "status is null");
  INDEXCP_REQUIRE(reinterpret_cast<uintptr_t>(status) % 8 == 0, "status is not 8-byte aligned");
  check_preprocess(pre);
  check_async_rope(pre);
  if (num_tokens == 0) return;
  QCastLaunch L = qcast_launch(q, num_tokens, heads, pre, out, status);
  if (pre.rope) {
    L.rope_cs = pre.rope_cos_sin;
    L.positions = pre.positions;
    L.table_positions = pre.rope_table_positions;
  }
  launch_qcast(L, cs(stream));
}

void fill_rope_table(float* out, int64_t num_positions, double rope_theta, Stream stream) {
  require_supported_device();
  INDEXCP_REQUIRE(out != nullptr, "out is null");
  std::vector<float> t;
  try {
    t.resize(static_cast<size_t>(std::max<int64_t>(0, std::min<int64_t>(num_positions, int64_t{1} << 31))) * 64);
  } catch (const std::bad_alloc&) {
    throw Error(ErrorCode::kRuntime, "could not allocate the host RoPE table of " + std::to_string(num_positions) +
                                         " positions");
  }
  indexcp::fill_rope_table(t.data(), num_positions, rope_theta);  // (checks num_positions, rope_theta)
  const cudaStream_t st = cs(stream);
  check(cudaMemcpyAsync(out, t.data(), t.size() * sizeof(float), cudaMemcpyHostToDevice, st),
        "cudaMemcpyAsync (RoPE table)");
  check(cudaStreamSynchronize(st), "cudaStreamSynchronize (RoPE table)");
}

void reset_status(InsertStatus* status, Stream stream) {
  INDEXCP_REQUIRE(status != nullptr, "status is null");
  check(cudaMemsetAsync(status, 0, sizeof(InsertStatus), cs(stream)), "cudaMemsetAsync (status)");
}

InsertStatus read_status(const InsertStatus* status, Stream stream) {
  INDEXCP_REQUIRE(status != nullptr, "status is null");
  InsertStatus h;
  const cudaStream_t st = cs(stream);
  check(cudaMemcpyAsync(&h, status, sizeof(h), cudaMemcpyDeviceToHost, st), "cudaMemcpyAsync (status)");
  check(cudaStreamSynchronize(st), "cudaStreamSynchronize (status)");
  return h;
}

// ---- validation -----------------------------------------------------------------------------

void validate_decode_batch(const DecodeBatch& b, int64_t num_pages, int32_t page_size, Stream stream) {
  check_decode_shape(b);
  const cudaStream_t st = cs(stream);
  const auto seq = to_host(b.seq_lens, static_cast<size_t>(b.num_requests), "seq_lens (device to host)", st);
  const auto bt = to_host(b.block_table, static_cast<size_t>(b.num_requests) * b.max_pages, "block_table (device to host)", st);
  const auto q = to_host(b.q, static_cast<size_t>(b.rows()) * b.heads * kHeadDim, "q (device to host)", st);
  DecodeBatch hb = b;
  hb.seq_lens = seq.data();
  hb.block_table = bt.data();
  hb.q = q.data();
  (void)decode_rows(hb, num_pages, page_size);
}

int64_t validate_prefill_batch(const PrefillBatch& b, int64_t num_pages, int32_t page_size, Stream stream) {
  return static_cast<int64_t>(read_prefill(b, num_pages, page_size, cs(stream)).rows.size());
}

// ---- decode ---------------------------------------------------------------------------------

void decode_scores(const CacheView& cache, int32_t layer, const DecodeBatch& batch, int32_t h0, int32_t nh,
                   KRounding mode, float* out, Stream stream, bool validate) {
  check_layer(cache, layer);
  check_not_bf16(cache);
  check_decode_shape(batch);
  check_head_range(batch.heads, h0, nh);
  check_k_rounding(mode, "mode");  // (also in decode_score_launch; here before out is filled)
  if (validate) validate_decode_batch(batch, cache.num_pages(), cache.layout().page_size, stream);
  const int64_t mb = max_blocks_of(batch.max_pages, cache.layout());
  const int64_t n = batch.rows() * nh * mb;
  INDEXCP_REQUIRE(n == 0 || out != nullptr, "out is null");
  launch_fill_neg_inf(out, n, cs(stream));
  launch_score(decode_score_launch(cache, layer, batch, h0, nh, mode, out, BlockFilter{}, true), cs(stream));
}

void decode_select(const CacheView& cache, int32_t layer, const DecodeBatch& batch, int32_t h0, int32_t nh,
                   const SelectionParams& sel, KRounding mode, int32_t* out, Stream stream, bool validate) {
  sel.validate();
  check_layer(cache, layer);
  check_not_bf16(cache);
  INDEXCP_REQUIRE(cache.layout().shards == 1, "cache is sharded (shards = " + std::to_string(cache.layout().shards) +
                                          "); decode_select needs a replicated cache, use icp_decode");
  check_decode_shape(batch);
  check_head_range(batch.heads, h0, nh);
  if (validate) validate_decode_batch(batch, cache.num_pages(), cache.layout().page_size, stream);
  const int64_t rows = batch.rows();
  if (rows == 0) return;
  INDEXCP_REQUIRE(out != nullptr, "out is null");
  const cudaStream_t st = cs(stream);
  const int64_t mb = max_blocks_of(batch.max_pages, cache.layout());
  Tmp<float> scores(static_cast<size_t>(rows) * nh * mb, st);
  launch_score(decode_score_launch(cache, layer, batch, h0, nh, mode, scores.get(), BlockFilter{}, true), st);
  SelectLaunch s;
  s.rows = decode_rows_view(batch);
  s.scores = scores.get();
  s.max_blocks = mb;
  s.nh = nh;
  s.sel = sel;
  s.out = out;
  s.out_heads = nh;
  s.out_h0 = 0;
  launch_select(s, st);
}

void prefill_select(const CacheView& cache, int32_t layer, const PrefillBatch& batch, int32_t h0, int32_t nh,
                    const SelectionParams& sel, int32_t* out, Stream stream) {
  sel.validate();
  check_layer(cache, layer);
  check_not_bf16(cache);
  INDEXCP_REQUIRE(cache.layout().shards == 1, "cache is sharded (shards = " + std::to_string(cache.layout().shards) +
                                          "); prefill_select needs a replicated cache, use prefill_gather");
  check_head_range(batch.heads, h0, nh);
  const HostPrefill hp = read_prefill(batch, cache.num_pages(), cache.layout().page_size, cs(stream));
  const int64_t rows = static_cast<int64_t>(hp.rows.size());
  if (rows == 0) return;
  INDEXCP_REQUIRE(out != nullptr, "out is null");
  const cudaStream_t st = cs(stream);
  const int64_t mb = max_blocks_of(batch.max_pages, cache.layout());
  Tmp<float> scores(static_cast<size_t>(rows) * nh * mb, st);
  const ScoreLaunch sl = prefill_score_launch(cache, layer, batch, rows, hp.max_rows_per_request, h0, nh, scores.get());
  launch_score(sl, st);
  SelectLaunch s;
  s.rows = sl.rows;
  s.scores = scores.get();
  s.max_blocks = mb;
  s.nh = nh;
  s.sel = sel;
  s.out = out;
  s.out_heads = nh;
  launch_select(s, st);
  check(cudaStreamSynchronize(st), "cudaStreamSynchronize (prefill_select)");
}

void prefill_scores(const CacheView& cache, int32_t layer, const PrefillBatch& batch, int64_t rows,
                    int32_t max_rows_per_request, int32_t h0, int32_t nh, float* out, Stream stream) {
  check_layer(cache, layer);
  check_not_bf16(cache);
  INDEXCP_REQUIRE(cache.layout().shards == 1, "cache is sharded (shards = " + std::to_string(cache.layout().shards) +
                                                  "); prefill_scores needs a replicated cache");
  INDEXCP_REQUIRE(batch.heads >= 1 && batch.heads <= 64, "heads = " + std::to_string(batch.heads) + " is out of range 1..64");
  check_head_range(batch.heads, h0, nh);
  INDEXCP_REQUIRE(rows >= 0, "rows = " + std::to_string(rows) + " must be >= 0");
  INDEXCP_REQUIRE(max_rows_per_request >= 1,
                  "max_rows_per_request = " + std::to_string(max_rows_per_request) + " must be >= 1");
  if (rows == 0) return;
  INDEXCP_REQUIRE(out != nullptr && batch.q != nullptr && batch.query_start != nullptr && batch.seq_lens != nullptr &&
                      batch.block_table != nullptr,
                  "out or a batch pointer is null");
  const ScoreLaunch sl = prefill_score_launch(cache, layer, batch, rows, max_rows_per_request, h0, nh, out);
  launch_fill_neg_inf(out, rows * nh * sl.max_blocks, cs(stream));
  launch_score(sl, cs(stream));
}

// The argument checks of the collective decode paths (icp_decode: a rank shard; decode CP: a
// replicated cache), in the order their errors are documented.
static void check_collective_decode(Communicator& comm, const CacheView& cache, bool sharded, int32_t layer,
                             const DecodeBatch& batch, const SelectionParams& sel, const int32_t* out, bool validate,
                             Stream stream) {
  sel.validate();
  check_layer(cache, layer, sharded ? "shard" : "cache");
  check_not_bf16(cache);
  check_group(comm, cache, sharded);
  check_decode_shape(batch);
  check_heads_tp(batch.heads, comm.world());
  if (validate) validate_decode_batch(batch, cache.num_pages(), cache.layout().page_size, stream);
  INDEXCP_REQUIRE(batch.rows() == 0 || out != nullptr, "out is null");
}

void icp_decode(Communicator& comm, const CacheView& shard, int32_t layer, const DecodeBatch& batch,
                const SelectionParams& sel, KRounding mode, int32_t* out, Stream stream, bool validate,
                bool p256_stock) {
  check_collective_decode(comm, shard, true, layer, batch, sel, out, validate, stream);
  const PageLayout& l = shard.layout();
  const bool stock = l.rows() >= kBlockTokens && (p256_stock || !(l.page_size == 256 && l.shards == 2));
  const ScoreLaunch sl = decode_score_launch(shard, layer, batch, 0, batch.heads, mode, nullptr, BlockFilter{}, stock);
  icp_select_device(comm, sl, shard, decode_rows_view(batch), sel, out, cs(stream));
}

void decode_cp_replicated(Communicator& comm, const CacheView& cache, int32_t layer, const DecodeBatch& batch,
                          const SelectionParams& sel, KRounding mode, int32_t* out, Stream stream, bool validate) {
  check_collective_decode(comm, cache, false, layer, batch, sel, out, validate, stream);
  const ScoreLaunch sl = decode_score_launch(cache, layer, batch, 0, batch.heads, mode, nullptr,
                                             BlockFilter{comm.world(), comm.rank()}, true);
  icp_select_device(comm, sl, cache, decode_rows_view(batch), sel, out, cs(stream));
}

// ---- prefill under ICP ------------------------------------------------------------------------

void stage_fp8(const CacheView& shard, int32_t layer, const int32_t* pages, int64_t num_pages, uint8_t* out,
               Stream stream, bool validate) {
  check_layer(shard, layer, "shard");
  const PageLayout& l = shard.layout();
  INDEXCP_REQUIRE(l.dtype != KvDtype::kBf16, "shard is a bf16 cache; FP8 staging needs fp8 or nvfp4");
  INDEXCP_REQUIRE(num_pages >= 0, "num_pages = " + std::to_string(num_pages) + " must be >= 0");
  INDEXCP_REQUIRE(num_pages == 0 || (pages != nullptr && out != nullptr), "pages or out is null");
  if (validate && num_pages > 0) {
    const auto p = to_host(pages, static_cast<size_t>(num_pages), "pages (device to host)", cs(stream));
    for (int64_t i = 0; i < num_pages; ++i)
      INDEXCP_REQUIRE(p[i] >= 0 && p[i] < shard.num_pages(), "pages[" + std::to_string(i) + "] = " + std::to_string(p[i]) +
                                                          " is outside [0, num_pages = " +
                                                          std::to_string(shard.num_pages()) + ")");
  }
  launch_stage_fp8(shard.layer_ptr(layer), l, shard.num_pages(), pages, num_pages, out, cs(stream));
}

GatherStats prefill_gather(Communicator& comm, const CacheView& shard, int32_t layer, const PrefillBatch& batch,
                           const SelectionParams& sel, int64_t budget_bytes, int32_t* out, Stream stream) {
  sel.validate();
  check_layer(shard, layer, "shard");
  check_group(comm, shard, true);
  const PageLayout& l = shard.layout();
  INDEXCP_REQUIRE(l.dtype != KvDtype::kBf16, "shard is a bf16 cache; the gather needs fp8 or nvfp4");
  const HostPrefill hp = read_prefill(batch, shard.num_pages(), l.page_size, cs(stream));
  check_heads_tp(batch.heads, comm.world());
  const auto& rows = hp.rows;
  INDEXCP_REQUIRE(rows.empty() || out != nullptr, "out is null");
  const int64_t unit = gather_unit_bytes(l);
  INDEXCP_REQUIRE(budget_bytes >= unit, "indexer_prefill_gather_budget_mib gives " + std::to_string(budget_bytes) +
                                    " bytes, below one page of one request (" + std::to_string(unit) + " bytes)");
  const int32_t W = comm.world(), R = l.rows(), P = l.page_size;
  const cudaStream_t st = cs(stream);
  struct Unit {
    int32_t request;
    int64_t lpage;
  };
  std::vector<Unit> units;
  for (int32_t b = 0; b < batch.num_requests; ++b) {
    const int32_t t = hp.query_start[b + 1] - hp.query_start[b];
    if (t <= 0 || hp.seq_lens[b] <= 0) continue;
    const int64_t max_local = (static_cast<int64_t>(hp.seq_lens[b]) - 1) / kBlockTokens;
    const int64_t npages = (max_local * kBlockTokens + P - 1) / P;
    for (int64_t i = 0; i < npages; ++i) units.push_back({b, i});
  }
  const int64_t per_chunk = budget_bytes / unit;
  GatherStats gs;
  gs.pages = static_cast<int64_t>(units.size());
  gs.reserved_bytes = std::min<int64_t>(gs.pages, per_chunk) * unit;
  gs.gathered_bytes = gs.pages * P * kHeadDim;
  int32_t h0, nh;
  owned_heads(batch.heads, W, comm.rank(), &h0, &nh);
  const int64_t nrows = static_cast<int64_t>(rows.size());
  const int64_t mb = max_blocks_of(batch.max_pages, l);
  const int64_t cap = std::min<int64_t>(gs.pages, per_chunk);
  Tmp<float> scores(static_cast<size_t>(nrows) * nh * mb, st);
  Tmp<uint8_t> staging(static_cast<size_t>(cap) * R * kHeadDim, st);
  Tmp<uint8_t> gathered(static_cast<size_t>(cap) * W * R * kHeadDim, st);
  Tmp<int32_t> phys(static_cast<size_t>(cap), st);
  Tmp<int32_t> bt_local(static_cast<size_t>(batch.num_requests) * batch.max_pages, st);
  // the scorer's work plan, one buffer for every chunk (no per-chunk stream-ordered allocation)
  Tmp<int32_t> plan(static_cast<size_t>(batch.num_requests) + 1, st);
  if (cap > 0) {
    // padding rows of the transient are zero (never scored: only historical blocks are read)
    check(cudaMemsetAsync(staging.get(), 0, static_cast<size_t>(cap) * R * kHeadDim, st), "cudaMemsetAsync");
    check(cudaMemsetAsync(gathered.get(), 0, static_cast<size_t>(cap) * W * R * kHeadDim, st), "cudaMemsetAsync");
  }
  std::vector<int32_t> phys_h(static_cast<size_t>(cap));
  std::vector<int32_t> bt_h(static_cast<size_t>(batch.num_requests) * batch.max_pages);
  const PageLayout gl = make_page_layout(KvDtype::kFp8, P, W);
  for (int64_t c0 = 0; c0 < gs.pages; c0 += per_chunk) {
    const int64_t n = std::min<int64_t>(per_chunk, gs.pages - c0);
    std::fill(bt_h.begin(), bt_h.end(), -1);
    for (int64_t k = 0; k < n; ++k) {
      const Unit& u = units[c0 + k];
      phys_h[k] = hp.block_table[static_cast<int64_t>(u.request) * batch.max_pages + u.lpage];
      bt_h[static_cast<int64_t>(u.request) * batch.max_pages + u.lpage] = static_cast<int32_t>(k);
    }
    check(cudaMemcpyAsync(phys.get(), phys_h.data(), n * sizeof(int32_t), cudaMemcpyHostToDevice, st), "cudaMemcpyAsync");
    check(cudaMemcpyAsync(bt_local.get(), bt_h.data(), bt_h.size() * sizeof(int32_t), cudaMemcpyHostToDevice, st),
          "cudaMemcpyAsync");
    launch_stage_fp8(shard.layer_ptr(layer), l, shard.num_pages(), phys.get(), n, staging.get(), st);
    comm.all_gather(staging.get(), gathered.get(), static_cast<size_t>(n) * R * kHeadDim, st);
    ++gs.chunks;
    ScoreLaunch sl;
    sl.keys.base = gathered.get();
    sl.keys.layout = gl;
    sl.keys.rank = 0;
    sl.keys.num_pages = n;
    sl.keys.gather = true;
    sl.rows = prefill_rows_view(batch, nrows);
    sl.block_table = bt_local.get();
    sl.max_pages = batch.max_pages;
    sl.max_rows_per_request = hp.max_rows_per_request;
    sl.q = batch.q;
    sl.heads = batch.heads;
    sl.h0 = h0;
    sl.nh = nh;
    sl.scores = scores.get();
    sl.max_blocks = mb;
    sl.plan = plan.get();
    launch_score(sl, st);
    // host buffers are reused by the next chunk: the copies above read them synchronously
  }
  SelectLaunch s;
  s.rows = prefill_rows_view(batch, nrows);
  s.scores = scores.get();
  s.max_blocks = mb;
  s.nh = nh;
  s.sel = sel;
  s.out = out;
  s.out_heads = nh;
  launch_select(s, st);
  comm.synchronize(st);  // bounded by the communicator's watchdog (NCCL), a no-op in-process
  check(cudaStreamSynchronize(st), "cudaStreamSynchronize (prefill_gather)");
  return gs;
}

void prefill_local_score(Communicator& comm, const CacheView& shard, int32_t layer, const PrefillBatch& batch,
                         const SelectionParams& sel, int32_t* out, Stream stream) {
  sel.validate();
  check_layer(shard, layer, "shard");
  check_not_bf16(shard);
  check_group(comm, shard, true);
  const HostPrefill hp = read_prefill(batch, shard.num_pages(), shard.layout().page_size, cs(stream));
  check_heads_tp(batch.heads, comm.world());
  const int64_t nrows = static_cast<int64_t>(hp.rows.size());
  INDEXCP_REQUIRE(nrows == 0 || out != nullptr, "out is null");
  ScoreLaunch sl;
  sl.keys = key_source(shard, layer);
  sl.mode = KRounding::kE4m3;
  sl.stock = shard.layout().rows() >= kBlockTokens;
  sl.rows = prefill_rows_view(batch, nrows);
  sl.block_table = batch.block_table;
  sl.max_pages = batch.max_pages;
  sl.max_rows_per_request = hp.max_rows_per_request;
  sl.q = batch.q;
  sl.heads = batch.heads;
  sl.h0 = 0;
  sl.nh = batch.heads;
  sl.max_blocks = max_blocks_of(batch.max_pages, shard.layout());
  icp_select_device(comm, sl, shard, sl.rows, sel, out, cs(stream));
  comm.synchronize(cs(stream));  // bounded by the communicator's watchdog (NCCL)
  check(cudaStreamSynchronize(cs(stream)), "cudaStreamSynchronize (prefill_local_score)");
}

// ---- device communicator ------------------------------------------------------------------

struct DeviceGroup::State {
  int world = 1;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  bool aborted = false;
  std::vector<const void*> ptrs;
  std::vector<cudaEvent_t> ready, done;
  std::vector<std::unique_ptr<Communicator>> comms;

  void check_aborted() const {
    if (aborted) throw Error(ErrorCode::kRuntime, "communicator aborted (another rank failed)");
  }
  void barrier(std::unique_lock<std::mutex>& lk) {
    check_aborted();
    const uint64_t gen = generation;
    if (++arrived == world) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    cv.wait(lk, [&] { return generation != gen || aborted; });
    check_aborted();
  }
};

namespace {

class DeviceComm final : public Communicator {
 public:
  DeviceComm(DeviceGroup::State* s, int rank) : s_(s), rank_(rank) {}
  int rank() const override { return rank_; }
  int world() const override { return s_->world; }
  std::size_t bytes_sent() const override { return sent_; }

  void all_gather(const void* send, void* recv, std::size_t bytes, void* stream) override {
    exchange(send, recv, bytes, stream, false);
    sent_ += bytes;
  }
  void all_to_all(const void* send, void* recv, std::size_t bytes, void* stream) override {
    exchange(send, recv, bytes, stream, true);
    sent_ += bytes * s_->world;
  }

 private:
  void exchange(const void* send, void* recv, std::size_t bytes, void* stream, bool to_all) {
    const cudaStream_t st = static_cast<cudaStream_t>(stream);
    // 1. my send buffer is complete at this point of my stream
    check(cudaEventRecord(s_->ready[rank_], st), "cudaEventRecord (all_gather ready)");
    std::unique_lock<std::mutex> lk(s_->mu);
    s_->ptrs[rank_] = send;
    s_->barrier(lk);
    lk.unlock();
    // 2. copy every rank's block once it is ready
    for (int p = 0; p < s_->world; ++p) {
      check(cudaStreamWaitEvent(st, s_->ready[p], 0), "cudaStreamWaitEvent (all_gather)");
      if (bytes == 0) continue;
      const char* src = static_cast<const char*>(s_->ptrs[p]) + (to_all ? rank_ * bytes : 0);
      check(cudaMemcpyAsync(static_cast<char*>(recv) + p * bytes, src, bytes, cudaMemcpyDeviceToDevice, st),
            "cudaMemcpyAsync (all_gather)");
    }
    check(cudaEventRecord(s_->done[rank_], st), "cudaEventRecord (all_gather done)");
    lk.lock();
    s_->barrier(lk);
    lk.unlock();
    // 3. no rank reuses its send buffer before every peer has read it
    for (int p = 0; p < s_->world; ++p) check(cudaStreamWaitEvent(st, s_->done[p], 0), "cudaStreamWaitEvent (all_gather)");
  }

  DeviceGroup::State* s_;
  int rank_;
  std::size_t sent_ = 0;
};

}  // namespace

DeviceGroup::DeviceGroup(int world) : state_(std::make_unique<State>()) {
  INDEXCP_REQUIRE(world >= 1 && world <= 64, "world = " + std::to_string(world) + " must be in 1..64");
  state_->world = world;
  state_->ptrs.assign(static_cast<size_t>(world), nullptr);
  state_->ready.resize(static_cast<size_t>(world));
  state_->done.resize(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    check(cudaEventCreateWithFlags(&state_->ready[r], cudaEventDisableTiming), "cudaEventCreate");
    check(cudaEventCreateWithFlags(&state_->done[r], cudaEventDisableTiming), "cudaEventCreate");
    state_->comms.push_back(std::make_unique<DeviceComm>(state_.get(), r));
  }
}

DeviceGroup::~DeviceGroup() {
  for (auto e : state_->ready) cudaEventDestroy(e);
  for (auto e : state_->done) cudaEventDestroy(e);
}

int DeviceGroup::world() const { return state_->world; }

Communicator& DeviceGroup::comm(int r) {
  INDEXCP_REQUIRE(r >= 0 && r < state_->world, "rank = " + std::to_string(r) + " is out of range");
  return *state_->comms[static_cast<size_t>(r)];
}

void DeviceGroup::abort() {
  std::lock_guard<std::mutex> lk(state_->mu);
  state_->aborted = true;
  state_->cv.notify_all();
}

void run_device_ranks(int world, const std::function<void(int, Communicator&, Stream)>& fn) {
  int dev = 0;
  INDEXCP_CUDA_CHECK(cudaGetDevice(&dev));
  DeviceGroup group(world);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      cudaStream_t st = nullptr;
      try {
        check(cudaSetDevice(dev), "cudaSetDevice");
        check(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate");
        fn(r, group.comm(r), reinterpret_cast<Stream>(st));
        check(cudaStreamSynchronize(st), "cudaStreamSynchronize (rank)");
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
        group.abort();
      }
      if (st) {
        cudaStreamSynchronize(st);
        cudaStreamDestroy(st);
      }
    });
  }
  for (auto& t : threads) t.join();
  rethrow_rank_errors(errors);
}

// ---- DecodeStep -------------------------------------------------------------------------------

struct DecodeStep::Impl {
  std::vector<CacheView> caches;
  int32_t W = 1, layer = 0;
  DecodeShape shape;
  DecodePath path = DecodePath::kReplicated;
  bool p256_stock = true;
  int64_t max_rows = 0, max_blocks = 0;
  int32_t kk = 1;
  std::vector<DeviceBuffer<float>> scores;  // per rank [max_rows][scored heads][max_blocks]
  std::vector<DeviceBuffer<int32_t>> plans; // per rank: the scorer's work plan [max_requests + 1]
  DeviceBuffer<Candidate> cands;            // [W][rows][H][kk]

  const CacheView& cache_of(int32_t r) const { return caches[path == DecodePath::kIcp ? r : 0]; }
  void scored_heads(int32_t r, int32_t* h0, int32_t* nh) const {
    if (path == DecodePath::kReplicated) {
      owned_heads(shape.heads, W, r, h0, nh);
    } else {
      *h0 = 0;
      *nh = shape.heads;
    }
  }
  bool stock(int32_t r) const {
    const PageLayout& l = cache_of(r).layout();
    if (l.rows() < kBlockTokens) return false;
    if (path == DecodePath::kIcp && l.page_size == 256 && W == 2) return p256_stock;
    return true;
  }
  BlockFilter filter(int32_t r) const {
    return path == DecodePath::kDecodeCp ? BlockFilter{W, r} : BlockFilter{};
  }
  void check_batch(const DecodeBatch& b) const {
    INDEXCP_REQUIRE(b.num_requests >= 0 && b.num_requests <= shape.max_requests,
            "num_requests = " + std::to_string(b.num_requests) + " exceeds the step's max_requests = " +
                std::to_string(shape.max_requests));
    INDEXCP_REQUIRE(b.max_pages == shape.max_pages, "max_pages = " + std::to_string(b.max_pages) +
                                                " differs from the step's max_pages = " + std::to_string(shape.max_pages));
    INDEXCP_REQUIRE(b.query_len == shape.query_len, "query_len = " + std::to_string(b.query_len) +
                                                " differs from the step's query_len = " + std::to_string(shape.query_len));
    INDEXCP_REQUIRE(b.heads == shape.heads,
            "heads = " + std::to_string(b.heads) + " differs from the step's heads = " + std::to_string(shape.heads));
    if (b.num_requests > 0)
      INDEXCP_REQUIRE(b.q != nullptr && b.seq_lens != nullptr && b.block_table != nullptr, "batch has a null device pointer");
  }
};

namespace {
std::vector<CacheView> views_of(const std::vector<const DeviceCache*>& caches) {
  std::vector<CacheView> v;
  for (size_t i = 0; i < caches.size(); ++i) {
    INDEXCP_REQUIRE(caches[i] != nullptr, "caches[" + std::to_string(i) + "] is null");
    v.push_back(caches[i]->view());
  }
  return v;
}
}  // namespace

DecodeStep::DecodeStep(const std::vector<const DeviceCache*>& caches, int32_t world, int32_t layer,
                       const DecodeShape& shape, DecodePath path, bool p256_stock)
    : DecodeStep(views_of(caches), world, layer, shape, path, p256_stock) {}

DecodeStep::DecodeStep(std::vector<CacheView> caches, int32_t world, int32_t layer, const DecodeShape& shape,
                       DecodePath path, bool p256_stock)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  prepare_device();
  shape.sel.validate();
  INDEXCP_REQUIRE(world >= 1 && world <= 64, "world = " + std::to_string(world) + " must be in 1..64");
  check_heads_tp(shape.heads, world);
  INDEXCP_REQUIRE(shape.query_len >= 1 && shape.query_len <= 16, "query_len = " + std::to_string(shape.query_len) + " is out of range 1..16");
  INDEXCP_REQUIRE(shape.max_requests >= 1, "max_requests must be >= 1");
  INDEXCP_REQUIRE(shape.max_pages >= 1, "max_pages must be >= 1");
  for (size_t i = 0; i < caches.size(); ++i)
    check_cache_view(caches[i], MemoryLocation::kDevice, "caches[" + std::to_string(i) + "]");
  if (path == DecodePath::kIcp) {
    INDEXCP_REQUIRE(static_cast<int32_t>(caches.size()) == world, "caches: kIcp needs one shard per rank (" + std::to_string(world) + ")");
    for (int32_t r = 0; r < world; ++r) {
      INDEXCP_REQUIRE(caches[r].layout().shards == world && caches[r].rank() == r,
              "caches[" + std::to_string(r) + "] is not rank " + std::to_string(r) + " of " + std::to_string(world) + " shards");
    }
  } else {
    INDEXCP_REQUIRE(!caches.empty(), "caches[0] is missing");
    INDEXCP_REQUIRE(caches[0].layout().shards == 1, "caches[0] is sharded; kReplicated and kDecodeCp need a replicated cache");
  }
  for (const CacheView& c : caches) {
    check_layer(c, layer);
    check_not_bf16(c);
  }
  m.caches = caches;
  m.W = world;
  m.layer = layer;
  m.shape = shape;
  m.path = path;
  m.p256_stock = p256_stock;
  m.max_rows = static_cast<int64_t>(shape.max_requests) * shape.query_len;
  m.max_blocks = max_blocks_of(shape.max_pages, m.caches[0].layout());
  m.kk = shape.sel.ranked();
  for (int32_t r = 0; r < world; ++r) {
    int32_t h0, nh;
    m.scored_heads(r, &h0, &nh);
    m.scores.emplace_back(static_cast<size_t>(m.max_rows) * nh * m.max_blocks);
    m.plans.emplace_back(static_cast<size_t>(shape.max_requests) + 1);
  }
  if (path != DecodePath::kReplicated) m.cands.resize(static_cast<size_t>(world) * m.max_rows * shape.heads * m.kk);
  ensure_tables();
}

DecodeStep::~DecodeStep() = default;

void DecodeStep::enqueue_score(int32_t r, const DecodeBatch& b, Stream stream) {
  Impl& m = *impl_;
  m.check_batch(b);
  INDEXCP_REQUIRE(r >= 0 && r < m.W, "rank = " + std::to_string(r) + " is out of range");
  int32_t h0, nh;
  m.scored_heads(r, &h0, &nh);
  ScoreLaunch sl = decode_score_launch(m.cache_of(r), m.layer, b, h0, nh, m.shape.mode, m.scores[r].get(), m.filter(r),
                                       m.stock(r));
  sl.plan = m.plans[r].get();
  launch_score(sl, cs(stream));
}

void DecodeStep::enqueue_publish(int32_t r, const DecodeBatch& b, Stream stream) {
  Impl& m = *impl_;
  if (m.path == DecodePath::kReplicated) return;
  m.check_batch(b);
  INDEXCP_REQUIRE(r >= 0 && r < m.W, "rank = " + std::to_string(r) + " is out of range");
  const int64_t per_rank = b.rows() * m.shape.heads * m.kk;
  SelectLaunch pub;
  pub.rows = decode_rows_view(b);
  pub.scores = m.scores[r].get();
  pub.max_blocks = m.max_blocks;
  pub.nh = m.shape.heads;
  pub.sel = m.shape.sel;
  pub.cands = m.cands.get() + r * per_rank;  // the exchange: written straight into the shared buffer
  pub.layout = m.cache_of(r).layout();
  pub.rank = m.cache_of(r).rank();
  pub.filter = m.filter(r);
  launch_select(pub, cs(stream));
}

void DecodeStep::enqueue_select(int32_t r, const DecodeBatch& b, int32_t* out, Stream stream) {
  Impl& m = *impl_;
  m.check_batch(b);
  INDEXCP_REQUIRE(r >= 0 && r < m.W, "rank = " + std::to_string(r) + " is out of range");
  INDEXCP_REQUIRE(b.rows() == 0 || out != nullptr, "out is null");
  int32_t h0, nh;
  owned_heads(m.shape.heads, m.W, r, &h0, &nh);
  if (m.W > m.shape.heads && r != h0 * m.W / m.shape.heads) return;  // another rank writes this head
  if (m.path == DecodePath::kReplicated) {
    SelectLaunch s;
    s.rows = decode_rows_view(b);
    s.scores = m.scores[r].get();
    s.max_blocks = m.max_blocks;
    s.nh = nh;
    s.sel = m.shape.sel;
    s.out = out;
    s.out_heads = m.shape.heads;
    s.out_h0 = h0;
    launch_select(s, cs(stream));
    return;
  }
  MergeLaunch mg;
  mg.rows = decode_rows_view(b);
  mg.cands = m.cands.get();
  mg.world = m.W;
  mg.heads = m.shape.heads;
  mg.h0 = h0;
  mg.nh = nh;
  mg.sel = m.shape.sel;
  mg.out = out;
  mg.out_heads = m.shape.heads;
  mg.out_h0 = h0;
  launch_merge(mg, cs(stream));
}

void DecodeStep::run(const DecodeBatch& b, int32_t* out, Stream stream) {
  Impl& m = *impl_;
  m.check_batch(b);
  for (int32_t r = 0; r < m.W; ++r) {
    enqueue_score(r, b, stream);
    enqueue_publish(r, b, stream);
  }
  for (int32_t r = 0; r < m.W; ++r) enqueue_select(r, b, out, stream);
}

int64_t DecodeStep::bytes_read(int32_t r, const std::vector<int32_t>& seq_lens) const {
  const Impl& m = *impl_;
  const KeySource k = key_source(m.cache_of(r), m.layer);
  int64_t total = 0;
  for (int32_t s : seq_lens) total += score_bytes_read(k, s, m.filter(r));
  return total;
}

int64_t DecodeStep::workspace_bytes() const {
  const Impl& m = *impl_;
  int64_t b = 0;
  for (const auto& s : m.scores) b += static_cast<int64_t>(s.size() * sizeof(float));
  for (const auto& p : m.plans) b += static_cast<int64_t>(p.size() * sizeof(int32_t));
  return b + static_cast<int64_t>(m.cands.size() * sizeof(Candidate));
}

bool DecodeStep::uses_stock_scorer(int32_t r) const { return impl_->stock(r); }

}  // namespace indexcp::cuda
