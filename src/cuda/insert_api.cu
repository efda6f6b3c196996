// Insert and index-Q cast, the host API (cuda.hpp): checks, workspace, status, and the launches
// of insert.cu's kernels.
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
#include "boundary.cuh"

namespace indexcp::cuda {

using namespace detail;

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

}  // namespace indexcp::cuda
