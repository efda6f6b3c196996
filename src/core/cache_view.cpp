// CacheView construction and checks (include/indexcp/cache_view.hpp), and the InsertStatus
// helpers shared by both backends (include/indexcp/cache.hpp).
#include "indexcp/cache_view.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "indexcp/cache.hpp"
#include "indexcp/error.hpp"

namespace indexcp {

const char* to_string(MemoryLocation m) {
  switch (m) {
    case MemoryLocation::kHost: return "host";
    case MemoryLocation::kDevice: return "device";
  }
  return "?";
}

namespace {

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kCacheAlignment == 0; }

std::string ptr_str(const void* p) {
  char b[32];
  std::snprintf(b, sizeof(b), "%p", p);
  return b;
}

// Shared checks of both factories; returns the validated layout.
PageLayout check_common(const PageLayout& layout, int64_t num_pages, int32_t num_layers, int32_t rank,
                        MemoryLocation location) {
  const PageLayout l = make_page_layout(layout.dtype, layout.page_size, layout.shards, layout.page_stride);
  INDEXCP_REQUIRE(num_pages >= 1 && num_pages < (int64_t{1} << 31),
                  "num_pages = " + std::to_string(num_pages) + " must be in 1..2^31-1 (page ids are int32)");
  INDEXCP_REQUIRE(num_layers >= 1 && num_layers <= 4096,
                  "num_layers = " + std::to_string(num_layers) + " must be in 1..4096");
  INDEXCP_REQUIRE(rank >= 0 && rank < l.shards,
                  "rank = " + std::to_string(rank) + " must be in [0, shards = " + std::to_string(l.shards) + ")");
  INDEXCP_REQUIRE(location == MemoryLocation::kHost || location == MemoryLocation::kDevice,
                  "location = " + std::to_string(static_cast<int>(location)) + " is not a MemoryLocation");
  return l;
}

// a * b + c in 64 bits, or -1 when it overflows or exceeds kMaxViewBytes (a, b, c >= 0)
int64_t span_or_neg(int64_t a, int64_t b, int64_t c) {
  int64_t m = 0, r = 0;
  if (__builtin_mul_overflow(a, b, &m) || __builtin_add_overflow(m, c, &r) || r > kMaxViewBytes) return -1;
  return r;
}

}  // namespace

int64_t cache_layer_bytes(const PageLayout& layout, int64_t num_pages) {
  const PageLayout l = make_page_layout(layout.dtype, layout.page_size, layout.shards, layout.page_stride);
  INDEXCP_REQUIRE(num_pages >= 1 && num_pages < (int64_t{1} << 31),
                  "num_pages = " + std::to_string(num_pages) + " must be in 1..2^31-1 (page ids are int32)");
  const int64_t b = span_or_neg(num_pages - 1, l.page_stride, l.page_bytes());
  INDEXCP_REQUIRE(b >= 0, "page_stride = " + std::to_string(l.page_stride) + " x num_pages = " +
                              std::to_string(num_pages) + " exceeds the 2^56 bytes a view may span");
  return b;
}

CacheView make_cache_view(const PageLayout& layout, void* base, int64_t num_pages, int32_t num_layers,
                          int32_t rank, int64_t layer_stride, MemoryLocation location) {
  CacheView v;
  v.layout_ = check_common(layout, num_pages, num_layers, rank, location);
  INDEXCP_REQUIRE(base != nullptr, "base is null");
  INDEXCP_REQUIRE(aligned(base), "base = " + ptr_str(base) + " is not 16-byte aligned (the bulk copies need it)");
  v.num_pages_ = num_pages;
  const int64_t lb = cache_layer_bytes(v.layout_, num_pages);
  const int64_t packed = num_pages * v.layout_.page_stride;  // (<= lb + page_stride: no overflow)
  if (layer_stride == 0) layer_stride = packed;
  INDEXCP_REQUIRE(layer_stride > 0 && layer_stride % kCacheAlignment == 0,
                  "layer_stride = " + std::to_string(layer_stride) + " must be > 0 and a multiple of 16 bytes");
  INDEXCP_REQUIRE(num_layers == 1 || layer_stride >= v.layer_bytes(),
                  "layer_stride = " + std::to_string(layer_stride) + " is smaller than one layer's pages (" +
                      std::to_string(v.layer_bytes()) + " bytes = (num_pages - 1) x page_stride + page_bytes): "
                      "layers would overlap");
  const int64_t span = span_or_neg(num_layers - 1, layer_stride, lb);
  INDEXCP_REQUIRE(span >= 0, "layer_stride = " + std::to_string(layer_stride) + " x num_layers = " +
                                 std::to_string(num_layers) + " exceeds the 2^56 bytes a view may span");
  INDEXCP_REQUIRE(reinterpret_cast<uintptr_t>(base) <= UINTPTR_MAX - static_cast<uintptr_t>(span),
                  "base + the view's " + std::to_string(span) + " bytes wraps the address space");
  v.base_ = static_cast<uint8_t*>(base);
  v.layer_stride_ = layer_stride;
  v.num_layers_ = num_layers;
  v.rank_ = rank;
  v.location_ = location;
  return v;
}

CacheView make_cache_view_layers(const PageLayout& layout, uint8_t* const* layer_ptrs, int64_t num_pages,
                                 int32_t num_layers, int32_t rank, MemoryLocation location) {
  CacheView v;
  v.layout_ = check_common(layout, num_pages, num_layers, rank, location);
  INDEXCP_REQUIRE(layer_ptrs != nullptr, "layer_ptrs is null");
  for (int32_t l = 0; l < num_layers; ++l) {
    INDEXCP_REQUIRE(layer_ptrs[l] != nullptr, "layer_ptrs[" + std::to_string(l) + "] is null");
    INDEXCP_REQUIRE(aligned(layer_ptrs[l]), "layer_ptrs[" + std::to_string(l) + "] = " + ptr_str(layer_ptrs[l]) +
                                                " is not 16-byte aligned (the bulk copies need it)");
  }
  // the layers' regions must not overlap (nor wrap): sort the starts, compare neighbours
  const int64_t lb = cache_layer_bytes(v.layout_, num_pages);
  std::vector<std::pair<uintptr_t, int32_t>> starts;
  for (int32_t l = 0; l < num_layers; ++l) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(layer_ptrs[l]);
    INDEXCP_REQUIRE(p <= UINTPTR_MAX - static_cast<uintptr_t>(lb),
                    "layer_ptrs[" + std::to_string(l) + "] + the layer's bytes wraps the address space");
    starts.emplace_back(p, l);
  }
  std::sort(starts.begin(), starts.end());
  for (size_t i = 1; i < starts.size(); ++i)
    INDEXCP_REQUIRE(starts[i].first - starts[i - 1].first >= static_cast<uintptr_t>(lb),
                    "layer_ptrs[" + std::to_string(starts[i - 1].second) + "] and layer_ptrs[" +
                        std::to_string(starts[i].second) + "] overlap (a layer holds " + std::to_string(lb) +
                        " bytes = (num_pages - 1) x page_stride + page_bytes)");
  v.layer_ptrs_ = layer_ptrs;
  v.num_pages_ = num_pages;
  v.num_layers_ = num_layers;
  v.rank_ = rank;
  v.location_ = location;
  return v;
}

void check_cache_view(const CacheView& view, MemoryLocation where, const std::string& what) {
  INDEXCP_REQUIRE(view.num_layers() >= 1, what + " is an empty view (build it with make_cache_view)");
  if (view.location() != where)
    throw Error(ErrorCode::kInvalidArgument,
                what + " is a " + to_string(view.location()) + " view (location = " + to_string(view.location()) +
                    "); the " + (where == MemoryLocation::kDevice ? "CUDA" : "CPU") + " backend needs " +
                    to_string(where) + " memory");
}

void check_view_layer(const CacheView& view, int32_t layer) {
  INDEXCP_REQUIRE(layer >= 0 && layer < view.num_layers(),
                  "layer = " + std::to_string(layer) + " is outside [0, " + std::to_string(view.num_layers()) + ")");
}

CacheView IndexCache::view() const {
  return make_cache_view(layout_, const_cast<uint8_t*>(bytes_.data()), num_pages_, num_layers_, rank_, 0,
                         MemoryLocation::kHost);
}

// ---- InsertStatus ----------------------------------------------------------------------------

const char* to_string(InsertRefusal r) {
  switch (r) {
    case InsertRefusal::kNone: return "none";
    case InsertRefusal::kSlotOutOfRange: return "slot out of range";
    case InsertRefusal::kDuplicateSlot: return "duplicate slot";
    case InsertRefusal::kNonFiniteKey: return "non-finite key";
    case InsertRefusal::kPositionOutOfTable: return "position outside the RoPE table";
    case InsertRefusal::kNonFiniteAfterPreprocess: return "non-finite after RMSNorm/RoPE";
    case InsertRefusal::kQueryNaN: return "NaN in q";
    case InsertRefusal::kQueryNaNAfterPreprocess: return "NaN in q after RMSNorm/RoPE";
  }
  return "?";
}

void reset_status(InsertStatus* status) {
  INDEXCP_REQUIRE(status != nullptr, "status is null");
  std::memset(static_cast<void*>(status), 0, sizeof(*status));  // zero-fill, as the device memset
}

// The messages are the synchronous calls' (src/cpu/cache.cpp, src/cuda/insert_api.cu): one owner here.
Error status_error(const InsertStatus& s) {
  const std::string t = std::to_string(s.token);
  switch (static_cast<InsertRefusal>(s.reason)) {
    case InsertRefusal::kNone:
      return Error(ErrorCode::kRuntime, "status holds no refusal (reason = 0)");
    case InsertRefusal::kSlotOutOfRange:
      return Error(ErrorCode::kInvalidArgument, "slot_mapping[" + t + "] = " + std::to_string(s.value) +
                                                    " is outside [-1, " + std::to_string(s.limit) +
                                                    ") (num_pages x page_size)");
    case InsertRefusal::kDuplicateSlot:
      return Error(ErrorCode::kInvalidArgument,
                   "slot_mapping[" + t + "] = " + std::to_string(s.value) + " repeats a slot of the same batch");
    case InsertRefusal::kNonFiniteKey:
      return Error(ErrorCode::kInvalidArgument, "key of token " + t + " holds a non-finite value (" +
                                                    std::to_string(s.key_value) + " at dim " +
                                                    std::to_string(s.dim) + ")");
    case InsertRefusal::kPositionOutOfTable:
      return Error(ErrorCode::kInvalidArgument, "positions[" + t + "] = " + std::to_string(s.value) +
                                                    " is outside the RoPE table [0, " + std::to_string(s.limit) +
                                                    ") (rope_table_positions)");
    case InsertRefusal::kNonFiniteAfterPreprocess:
      return Error(ErrorCode::kInvalidArgument, "key of token " + t + " is non-finite after RMSNorm/RoPE (dim " +
                                                    std::to_string(s.dim) + ")");
    case InsertRefusal::kQueryNaN:
      return Error(ErrorCode::kInvalidArgument, "q holds NaN at token " + t + ", head " + std::to_string(s.head) +
                                                    ", dim " + std::to_string(s.dim));
    case InsertRefusal::kQueryNaNAfterPreprocess:
      return Error(ErrorCode::kInvalidArgument, "q is NaN after RMSNorm/RoPE at token " + t + ", head " +
                                                    std::to_string(s.head) + ", dim " + std::to_string(s.dim));
  }
  return Error(ErrorCode::kRuntime, "status holds an unknown reason = " + std::to_string(s.reason));
}

void reset_status(InsertStatus* status, CUstream_st* /*stream: host memory, done at once*/) { reset_status(status); }

InsertStatus read_status(const InsertStatus* status, CUstream_st* /*stream*/) {
  INDEXCP_REQUIRE(status != nullptr, "status is null");
  return *status;
}

void throw_if_refused(const InsertStatus& status) {
  if (status.reason != 0) throw status_error(status);
}

}  // namespace indexcp
