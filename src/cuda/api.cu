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
#include "core/batch.hpp"
#include "indexcp/cuda.hpp"
#include "kernels.cuh"
#include "launches.cuh"
#include "plan.cuh"
#include "comm/rank_barrier.hpp"

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
  ::indexcp::detail::check_head_range(heads, h0, nh);
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





struct HostPrefill {
  std::vector<int32_t> seq_lens, query_start, block_table;
  std::vector<QueryRow> rows;
  int32_t max_rows_per_request = 1;
};

// The batch's metadata copied to the host and validated there (detail::prefill_rows_metadata), and
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
  h.rows = ::indexcp::detail::prefill_rows_metadata(hb, num_pages, page_size);
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
    if (e != ~0ull) ::indexcp::detail::throw_q_nan(static_cast<int64_t>(e), b.heads);
  }
  return h;
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

namespace {

// The per-rank entry points are one-rank plans for the batch's own shape, with stream-ordered
// workspace (the plan's run enqueues the same launches an engine's plan does).
DecodeLimits limits_of(const DecodeBatch& b, const SelectionParams& sel) {
  DecodeLimits l;
  l.max_requests = std::max(1, b.num_requests);
  l.max_pages = std::max(1, b.max_pages);
  l.query_len = b.query_len;
  l.heads = b.heads;
  l.sel = sel;
  return l;
}

// validate (the synchronous form): the step status is read back and a disagreement of the ranks
// is an Error on every rank; otherwise the call only enqueues (a disagreement gives -1 outputs).
void run_decode_plan(const DecodeSpec& spec, Communicator& comm, const CacheView& cache, int32_t layer,
                     const DecodeBatch& batch, int32_t* out, bool validate, cudaStream_t st, const char* call) {
  check_k_rounding(spec.mode, "mode");
  if (batch.rows() == 0) return;
  const DecodePlan::Impl plan(spec);
  Tmp<uint8_t> ws(plan.ws.total, st);
  // whole records are exchanged: the records' stale rows zero (initcheck)
  check(cudaMemsetAsync(ws.get() + plan.ws.send, 0, plan.ws.total - plan.ws.send, st), "cudaMemsetAsync (records)");
  Tmp<uint32_t> status(1, st);
  const DeviceDecodeBatch d{batch.q, batch.block_table, batch.seq_lens, batch.num_requests};
  plan.run(cache, layer, d, ws.get(), plan.ws.total, out, &comm, status.get(), st);
  if (!validate) return;
  uint32_t h = 0;
  check(cudaMemcpyAsync(&h, status.get(), sizeof(h), cudaMemcpyDeviceToHost, st), "cudaMemcpyAsync (step status)");
  comm.synchronize(st);  // bounded by the communicator's watchdog (NCCL)
  check(cudaStreamSynchronize(st), "cudaStreamSynchronize (step status)");
  if (h != 0) throw Error(ErrorCode::kRuntime, step_status_message(h, call));
}

}  // namespace

void icp_decode(Communicator& comm, const CacheView& shard, int32_t layer, const DecodeBatch& batch,
                const SelectionParams& sel, KRounding mode, int32_t* out, Stream stream, bool validate,
                bool p256_stock) {
  check_collective_decode(comm, shard, true, layer, batch, sel, out, validate, stream);
  DecodeSpec sp;
  sp.path = DecodePath::kIcp;
  sp.world = comm.world();
  sp.rank = comm.rank();
  sp.layout = shard.layout();
  sp.mode = mode;
  sp.p256_stock = p256_stock;
  sp.limits = limits_of(batch, sel);
  run_decode_plan(sp, comm, shard, layer, batch, out, validate, cs(stream), "icp_decode");
}

void decode_cp_replicated(Communicator& comm, const CacheView& cache, int32_t layer, const DecodeBatch& batch,
                          const SelectionParams& sel, KRounding mode, int32_t* out, Stream stream, bool validate) {
  check_collective_decode(comm, cache, false, layer, batch, sel, out, validate, stream);
  DecodeSpec sp;
  sp.path = DecodePath::kDecodeCp;
  sp.world = comm.world();
  sp.rank = comm.rank();
  sp.layout = cache.layout();
  sp.mode = mode;
  sp.limits = limits_of(batch, sel);
  run_decode_plan(sp, comm, cache, layer, batch, out, validate, cs(stream), "decode_cp_replicated");
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

namespace {

PrefillLimits limits_of(const PrefillBatch& b, int64_t rows, const SelectionParams& sel) {
  PrefillLimits l;
  l.max_requests = std::max(1, b.num_requests);
  l.max_pages = std::max(1, b.max_pages);
  l.max_rows = std::max<int64_t>(1, rows);
  l.heads = b.heads;
  l.sel = sel;
  return l;
}

// A one-rank prefill plan for the batch's own shape, run and waited for (the synchronous paths
// turn a step status into an Error on every rank).
void run_prefill_plan(const PrefillSpec& spec, Communicator& comm, const CacheView& cache, int32_t layer,
                      const PrefillBatch& batch, const PrefillExtents& e, int32_t* out, cudaStream_t st,
                      const char* call) {
  const PrefillPlan::Impl plan(spec);
  Tmp<uint8_t> ws(plan.ws.total, st);
  check(cudaMemsetAsync(ws.get(), 0, plan.ws.total, st), "cudaMemsetAsync (workspace)");  // whole records are exchanged
  Tmp<uint32_t> status(1, st);
  check(cudaMemsetAsync(status.get(), 0, sizeof(uint32_t), st), "cudaMemsetAsync (status)");
  const DevicePrefillBatch d{batch.q, batch.block_table, batch.seq_lens, batch.query_start, batch.num_requests};
  plan.run(cache, layer, d, e, ws.get(), plan.ws.total, out, &comm, status.get(), st);
  uint32_t h = 0;
  check(cudaMemcpyAsync(&h, status.get(), sizeof(h), cudaMemcpyDeviceToHost, st), "cudaMemcpyAsync (status)");
  comm.synchronize(st);  // bounded by the communicator's watchdog (NCCL), a no-op in-process
  check(cudaStreamSynchronize(st), (std::string("cudaStreamSynchronize (") + call + ")").c_str());
  if (h != 0) throw Error(ErrorCode::kRuntime, step_status_message(h, call));
}

}  // namespace

GatherStats prefill_gather(Communicator& comm, const CacheView& shard, int32_t layer, const PrefillBatch& batch,
                           const SelectionParams& sel, int64_t budget_bytes, int32_t* out, Stream stream) {
  sel.validate();
  check_layer(shard, layer, "shard");
  check_group(comm, shard, true);
  const PageLayout& l = shard.layout();
  INDEXCP_REQUIRE(l.dtype != KvDtype::kBf16, "shard is a bf16 cache; the gather needs fp8 or nvfp4");
  const HostPrefill hp = read_prefill(batch, shard.num_pages(), l.page_size, cs(stream));
  check_heads_tp(batch.heads, comm.world());
  const int64_t rows = static_cast<int64_t>(hp.rows.size());
  INDEXCP_REQUIRE(rows == 0 || out != nullptr, "out is null");
  const int64_t unit = gather_unit_bytes(l);
  INDEXCP_REQUIRE(budget_bytes >= unit, "indexer_prefill_gather_budget_mib gives " + std::to_string(budget_bytes) +
                                            " bytes, below one page of one request (" + std::to_string(unit) + " bytes)");
  PrefillBatch hb = batch;  // host copies of the metadata: the extents
  hb.seq_lens = hp.seq_lens.data();
  hb.query_start = hp.query_start.data();
  hb.block_table = hp.block_table.data();
  PrefillExtents e;
  if (batch.num_requests > 0) e = prefill_extents(hb, l.page_size);
  e.max_rows_per_request = std::max(1, hp.max_rows_per_request);
  PrefillSpec sp;
  sp.path = PrefillPath::kGather;
  sp.world = comm.world();
  sp.rank = comm.rank();
  sp.layout = l;
  sp.limits = limits_of(batch, rows, sel);
  sp.limits.max_gather_units = std::max<int64_t>(1, e.gather_units);
  sp.budget = budget_bytes;
  GatherStats gs;
  gs.pages = e.gather_units;
  gs.chunks = e.gather_units > 0 ? (e.gather_units + budget_bytes / unit - 1) / (budget_bytes / unit) : 0;
  gs.reserved_bytes = std::min<int64_t>(gs.pages, budget_bytes / unit) * unit;
  gs.gathered_bytes = gs.pages * l.page_size * kHeadDim;
  run_prefill_plan(sp, comm, shard, layer, batch, e, out, cs(stream), "prefill_gather");
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
  const int64_t rows = static_cast<int64_t>(hp.rows.size());
  INDEXCP_REQUIRE(rows == 0 || out != nullptr, "out is null");
  if (rows == 0) return;
  PrefillSpec sp;
  sp.path = PrefillPath::kLocalScore;
  sp.world = comm.world();
  sp.rank = comm.rank();
  sp.layout = shard.layout();
  sp.limits = limits_of(batch, rows, sel);
  PrefillExtents e;
  e.rows = rows;
  e.max_rows_per_request = std::max(1, hp.max_rows_per_request);
  run_prefill_plan(sp, comm, shard, layer, batch, e, out, cs(stream), "prefill_local_score");
}

// ---- device communicator ------------------------------------------------------------------

struct DeviceGroup::State {
  explicit State(int w) : world(w), barrier(w) {}
  int world = 1;
  indexcp::detail::RankBarrier barrier;
  std::vector<cudaEvent_t> ready, done;
  std::vector<std::unique_ptr<Communicator>> comms;
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
    s_->barrier.enter(rank_, to_all ? "all_to_all" : "all_gather", send, bytes);
    // 2. copy every rank's block once it is ready (a failing copy still meets the peers below)
    std::exception_ptr failed;
    try {
      for (int p = 0; p < s_->world; ++p) {
        check(cudaStreamWaitEvent(st, s_->ready[p], 0), "cudaStreamWaitEvent (all_gather)");
        if (bytes == 0) continue;
        const char* src = static_cast<const char*>(s_->barrier.ptr(p)) + (to_all ? rank_ * bytes : 0);
        check(cudaMemcpyAsync(static_cast<char*>(recv) + p * bytes, src, bytes, cudaMemcpyDeviceToDevice, st),
              "cudaMemcpyAsync (all_gather)");
      }
      check(cudaEventRecord(s_->done[rank_], st), "cudaEventRecord (all_gather done)");
    } catch (...) {
      failed = std::current_exception();
    }
    s_->barrier.leave();
    if (failed) std::rethrow_exception(failed);
    // 3. no rank reuses its send buffer before every peer has read it
    for (int p = 0; p < s_->world; ++p) check(cudaStreamWaitEvent(st, s_->done[p], 0), "cudaStreamWaitEvent (all_gather)");
  }

  DeviceGroup::State* s_;
  int rank_;
  std::size_t sent_ = 0;
};

}  // namespace

DeviceGroup::DeviceGroup(int world) {
  INDEXCP_REQUIRE(world >= 1 && world <= 64, "world = " + std::to_string(world) + " must be in 1..64");
  state_ = std::make_unique<State>(world);
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

void DeviceGroup::abort() { state_->barrier.abort(); }

void DeviceGroup::depart(int r) {
  INDEXCP_REQUIRE(r >= 0 && r < state_->world, "rank = " + std::to_string(r) + " is out of range");
  state_->barrier.depart(r);
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
        group.depart(r);  // peers still waiting in a collective get an Error
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

}  // namespace indexcp::cuda
