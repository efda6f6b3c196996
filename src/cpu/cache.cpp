// Paged index cache and insert, CPU backend (spec/formats.md sections 3-7, spec/indexer.md 6).
#include "indexcp/cache.hpp"

#include <cmath>
#include <cstring>
#include <new>
#include <string>
#include <unordered_set>

#include "indexcp/error.hpp"

namespace indexcp {

IndexCache::IndexCache(const PageLayout& layout, int64_t num_pages, int32_t num_layers, int32_t rank)
    : layout_(layout), num_pages_(num_pages), num_layers_(num_layers), rank_(rank) {
  // re-validate the layout (a hand-built PageLayout must obey the same rules)
  layout_ = make_page_layout(layout.dtype, layout.page_size, layout.shards, layout.page_stride);
  INDEXCP_REQUIRE(num_pages >= 1, "num_pages = " + std::to_string(num_pages) + " must be >= 1");
  INDEXCP_REQUIRE(num_layers >= 1 && num_layers <= 4096,
          "num_layers = " + std::to_string(num_layers) + " must be in 1..4096");
  INDEXCP_REQUIRE(rank >= 0 && rank < layout_.shards,
          "rank = " + std::to_string(rank) + " must be in [0, shards = " +
              std::to_string(layout_.shards) + ")");
  const long double total = static_cast<long double>(num_pages) * layout_.page_stride * num_layers;
  if (total > static_cast<long double>(int64_t{1} << 46))
    throw Error(ErrorCode::kRuntime,
                "index cache of num_pages = " + std::to_string(num_pages) + " x page_stride = " +
                    std::to_string(layout_.page_stride) + " x num_layers = " + std::to_string(num_layers) +
                    " bytes is larger than the 64 TiB this library allocates");
  try {
    bytes_.assign(static_cast<size_t>(total), 0);
  } catch (const std::bad_alloc&) {
    throw Error(ErrorCode::kRuntime, "could not allocate the index cache (" +
                                         std::to_string(static_cast<int64_t>(total)) + " bytes)");
  }
}

namespace {

// RMSNorm then (cs != nullptr) NeoX RoPE with cos cs[i] / sin cs[32 + i] (indexer.md section 6).
void preprocess_cs(const float* in, const float* norm_weight, float eps, const float* cs, float* out) {
  float y[kHeadDim];
  for (int d = 0; d < kHeadDim; ++d) y[d] = in[d];
  if (norm_weight != nullptr) {
    float ss = 0.0f;
    for (int d = 0; d < kHeadDim; ++d) ss = ss + y[d] * y[d];
    const float ms = ss / 128.0f;
    const float r = 1.0f / std::sqrt(ms + eps);
    for (int d = 0; d < kHeadDim; ++d) {
      const float xr = y[d] * r;
      y[d] = xr * (1.0f + norm_weight[d]);
    }
  }
  if (cs != nullptr) {
    for (int i = 0; i < 32; ++i) {
      const float c = cs[i], s = cs[32 + i];
      const float a = y[i], b = y[i + 32];
      const float ac = a * c, bs = b * s, bc = b * c, as = a * s;
      y[i] = ac - bs;
      y[i + 32] = bc + as;
    }
  }
  for (int d = 0; d < kHeadDim; ++d) out[d] = y[d];
}

}  // namespace

// cos/sin of one position, in double rounded to fp32 (the one owner of the rule).
void rope_cos_sin_row(int64_t position, double theta, float* cs) {
  for (int i = 0; i < 32; ++i) {
    const double inv_freq = std::pow(theta, -2.0 * i / 64.0);
    const double ang = static_cast<double>(position) * inv_freq;
    cs[i] = static_cast<float>(std::cos(ang));
    cs[32 + i] = static_cast<float>(std::sin(ang));
  }
}

void preprocess_vector(const float* in, const float* norm_weight, float eps, bool rope,
                       double rope_theta, int64_t position, float* out) {
  float cs[64];
  if (rope) rope_cos_sin_row(position, rope_theta, cs);
  preprocess_cs(in, norm_weight, eps, rope ? cs : nullptr, out);
}

void fill_rope_table(float* out, int64_t num_positions, double rope_theta) {
  INDEXCP_REQUIRE(num_positions >= 1 && num_positions <= (int64_t{1} << 31),
                  "num_positions = " + std::to_string(num_positions) + " must be in 1..2^31");
  INDEXCP_REQUIRE(std::isfinite(rope_theta) && rope_theta > 0.0,
                  "rope_theta = " + std::to_string(rope_theta) + " must be finite and > 0 (RoPE)");
  INDEXCP_REQUIRE(out != nullptr, "out is null");
  for (int64_t p = 0; p < num_positions; ++p) rope_cos_sin_row(p, rope_theta, out + p * 64);
}

void fill_rope_table(float* out, int64_t num_positions, double rope_theta, CUstream_st* /*stream*/) {
  fill_rope_table(out, num_positions, rope_theta);
}

std::vector<uint8_t> quantize_key_bytes(KvDtype dtype, const float* key, float encode_scale) {
  std::vector<uint8_t> row(static_cast<size_t>(key_bytes(dtype)));
  switch (dtype) {
    case KvDtype::kNvfp4:
      nvfp4_quantize_key(key, encode_scale, row.data(), row.data() + kNvfp4DataBytesPerKey);
      break;
    case KvDtype::kFp8:
      fp8_quantize_key(key, row.data());
      break;
    case KvDtype::kBf16: {
      for (int d = 0; d < kHeadDim; ++d) {
        const uint16_t b = bf16_encode(key[d]);
        row[2 * d] = static_cast<uint8_t>(b & 0xff);
        row[2 * d + 1] = static_cast<uint8_t>(b >> 8);
      }
      break;
    }
  }
  return row;
}

// Writes one row (bytes as quantize_key_bytes returns them) at local row `row` of `page`.
static void write_row(const CacheView& c, int32_t layer, int64_t page, int32_t row, const uint8_t* bytes) {
  const PageLayout& l = c.layout();
  uint8_t* p = c.page_ptr(layer, page);
  if (l.dtype == KvDtype::kNvfp4) {
    std::memcpy(p + l.row_data_offset(row), bytes, kNvfp4DataBytesPerKey);
    std::memcpy(p + l.row_scale_offset(row), bytes + kNvfp4DataBytesPerKey, kNvfp4ScalesPerKey);
  } else {
    std::memcpy(p + l.row_data_offset(row), bytes, static_cast<size_t>(key_bytes(l.dtype)));
  }
}

void check_preprocess(const KeyPreprocess& pre) {
  INDEXCP_REQUIRE(!pre.norm_weight || (std::isfinite(pre.eps) && pre.eps >= 0.0f),
                  "eps = " + std::to_string(pre.eps) + " must be finite and >= 0 (RMSNorm)");
  INDEXCP_REQUIRE(!pre.rope || (std::isfinite(pre.rope_theta) && pre.rope_theta > 0.0),
                  "rope_theta = " + std::to_string(pre.rope_theta) + " must be finite and > 0 (RoPE)");
  INDEXCP_REQUIRE(!pre.rope || pre.positions != nullptr, "rope is on but positions is null");
}

void check_num_tokens(int64_t num_tokens) {
  INDEXCP_REQUIRE(num_tokens >= 0 && num_tokens <= kMaxTokensPerCall,
                  "num_tokens = " + std::to_string(num_tokens) + " must be in 0..2^32 (split larger batches)");
}

namespace {

// The one scan of an insert batch (indexer.md section 6): checks every token in order and stages
// the rows this rank writes. Returns the first refusal (token order; for one token the order of
// InsertRefusal) in *st, counting refused tokens when `count_all`, else stopping at the first.
// Keys are fp32 or bf16 (exactly one non-null).
struct StagedInsert {
  std::vector<uint8_t> bytes;
  std::vector<int64_t> tokens;  // token indices this rank writes, in order
};

template <class LoadKey>
void scan_insert(const CacheView& cache, const LoadKey& load_key, const int64_t* slot_mapping, int64_t num_tokens,
                 const InsertOptions& opts, bool table, bool count_all, InsertStatus* st, StagedInsert* out) {
  const PageLayout& l = cache.layout();
  const int64_t num_slots = cache.num_pages() * l.page_size;
  std::unordered_set<int64_t> seen;
  seen.reserve(static_cast<size_t>(num_tokens));
  float k[kHeadDim], pre[kHeadDim], cs[64];
  const bool has_pre = opts.pre.norm_weight != nullptr || opts.pre.rope;
  auto refuse = [&](int64_t t, InsertRefusal r, int64_t value, int64_t limit, int dim, float kv) {
    ++st->refused_tokens;
    if (st->reason != 0) return;
    st->reason = static_cast<int32_t>(r);
    st->token = t;
    st->value = value;
    st->limit = limit;
    st->dim = dim;
    st->key_value = kv;
  };
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (!count_all && st->reason != 0) break;
    const int64_t s = slot_mapping[t];
    if (s == -1) continue;
    if (s < 0 || s >= num_slots) {
      refuse(t, InsertRefusal::kSlotOutOfRange, s, num_slots, -1, 0.0f);
      continue;
    }
    if (!seen.insert(s).second) {
      refuse(t, InsertRefusal::kDuplicateSlot, s, num_slots, -1, 0.0f);
      continue;
    }
    load_key(t, k);
    int bad = -1;
    for (int d = 0; d < kHeadDim && bad < 0; ++d)
      if (!fmt::is_finite(k[d])) bad = d;
    if (bad >= 0) {
      refuse(t, InsertRefusal::kNonFiniteKey, 0, 0, bad, k[bad]);
      continue;
    }
    const float* src = k;
    if (has_pre) {
      const float* csp = nullptr;
      if (opts.pre.rope) {
        const int64_t pos = opts.pre.positions[t];
        if (table) {
          if (pos < 0 || pos >= opts.pre.rope_table_positions) {
            refuse(t, InsertRefusal::kPositionOutOfTable, pos, opts.pre.rope_table_positions, -1, 0.0f);
            continue;
          }
          csp = opts.pre.rope_cos_sin + pos * 64;
        } else {
          rope_cos_sin_row(pos, opts.pre.rope_theta, cs);
          csp = cs;
        }
      }
      preprocess_cs(k, opts.pre.norm_weight, opts.pre.eps, csp, pre);
      for (int d = 0; d < kHeadDim && bad < 0; ++d)
        if (!fmt::is_finite(pre[d])) bad = d;
      if (bad >= 0) {
        refuse(t, InsertRefusal::kNonFiniteAfterPreprocess, 0, 0, bad, 0.0f);
        continue;
      }
      src = pre;
    }
    if (st->reason != 0) continue;  // refused: stage nothing more
    const SlotLocation loc = locate_slot(l, s);
    if (loc.rank != cache.rank()) continue;  // another rank owns this row
    const auto row = quantize_key_bytes(l.dtype, src, opts.encode_scale);
    out->bytes.insert(out->bytes.end(), row.begin(), row.end());
    out->tokens.push_back(t);
  }
}

// Checks of what is wrong before any token is read (both forms).
void check_insert_args(const CacheView& cache, int32_t layer, const void* keys, const int64_t* slot_mapping,
                       int64_t num_tokens, const InsertOptions& opts) {
  check_cache_view(cache, MemoryLocation::kHost, "cache");
  check_view_layer(cache, layer);
  check_num_tokens(num_tokens);
  if (num_tokens == 0) return;
  INDEXCP_REQUIRE(keys != nullptr, "keys is null");
  INDEXCP_REQUIRE(slot_mapping != nullptr, "slot_mapping is null");
  // S shapes only NVFP4 bytes, but a bad S is refused for every dtype (docs/decisions.md)
  INDEXCP_REQUIRE(fmt::is_finite(opts.encode_scale) && opts.encode_scale > 0.0f,
                  "encode_scale = " + std::to_string(opts.encode_scale) +
                      " is invalid: the NVFP4 encode scale S must be finite and > 0");
  check_preprocess(opts.pre);
}

void write_staged(const CacheView& cache, int32_t layer, const int64_t* slot_mapping, const StagedInsert& st) {
  const size_t kb = static_cast<size_t>(key_bytes(cache.layout().dtype));
  for (size_t i = 0; i < st.tokens.size(); ++i) {
    const SlotLocation loc = locate_slot(cache.layout(), slot_mapping[st.tokens[i]]);
    write_row(cache, layer, loc.page, loc.row, st.bytes.data() + i * kb);
  }
}

template <class LoadKey>
void insert_sync(const CacheView& cache, int32_t layer, const void* keys, const LoadKey& load_key,
                 const int64_t* slot_mapping, int64_t num_tokens, const InsertOptions& opts) {
  check_insert_args(cache, layer, keys, slot_mapping, num_tokens, opts);
  if (num_tokens == 0) return;
  InsertStatus st;
  StagedInsert staged;
  scan_insert(cache, load_key, slot_mapping, num_tokens, opts, /*table=*/false, /*count_all=*/false, &st, &staged);
  if (st.reason != 0) throw status_error(st);
  write_staged(cache, layer, slot_mapping, staged);  // phase 2: cannot fail
}

template <class LoadKey>
void insert_async(const CacheView& cache, int32_t layer, const void* keys, const LoadKey& load_key,
                  const int64_t* slot_mapping, int64_t num_tokens, const InsertOptions& opts, void* workspace,
                  size_t workspace_bytes, InsertStatus* status) {
  check_insert_args(cache, layer, keys, slot_mapping, num_tokens, opts);
  INDEXCP_REQUIRE(status != nullptr, "status is null");
  const size_t need = insert_workspace_bytes(num_tokens);
  INDEXCP_REQUIRE(workspace_bytes >= need, "workspace_bytes = " + std::to_string(workspace_bytes) +
                                               " is smaller than insert_workspace_bytes(num_tokens = " +
                                               std::to_string(num_tokens) + ") = " + std::to_string(need));
  INDEXCP_REQUIRE(need == 0 || workspace != nullptr, "workspace is null");
  INDEXCP_REQUIRE(!opts.pre.rope || (opts.pre.rope_cos_sin != nullptr && opts.pre.rope_table_positions >= 1),
                  "rope is on but rope_cos_sin is null or rope_table_positions < 1 (the asynchronous calls read "
                  "cos/sin from a table: fill_rope_table)");
  if (num_tokens == 0) return;
  InsertStatus st;
  StagedInsert staged;
  scan_insert(cache, load_key, slot_mapping, num_tokens, opts, /*table=*/true, /*count_all=*/true, &st, &staged);
  if (st.reason != 0) {
    if (status->reason == 0) {
      const int64_t calls = status->refused_calls, tokens = status->refused_tokens;
      *status = st;
      status->layer = layer;
      status->refused_calls = calls;
      status->refused_tokens = tokens;
    }
    status->refused_calls += 1;
    status->refused_tokens += st.refused_tokens;
    return;
  }
  write_staged(cache, layer, slot_mapping, staged);
}

auto f32_loader(const float* keys) {
  return [keys](int64_t t, float* k) { std::memcpy(k, keys + t * kHeadDim, sizeof(float) * kHeadDim); };
}
auto bf16_loader(const uint16_t* keys) {
  return [keys](int64_t t, float* k) {
    for (int d = 0; d < kHeadDim; ++d) k[d] = bf16_decode(keys[t * kHeadDim + d]);
  };
}

}  // namespace

void insert_keys(const CacheView& cache, int32_t layer, const float* keys, const int64_t* slot_mapping,
                 int64_t num_tokens, const InsertOptions& opts) {
  insert_sync(cache, layer, keys, f32_loader(keys), slot_mapping, num_tokens, opts);
}

void insert_keys_bf16(const CacheView& cache, int32_t layer, const uint16_t* keys,
                      const int64_t* slot_mapping, int64_t num_tokens, const InsertOptions& opts) {
  insert_sync(cache, layer, keys, bf16_loader(keys), slot_mapping, num_tokens, opts);
}

size_t insert_workspace_bytes(int64_t max_tokens) {
  check_num_tokens(max_tokens);
  return 0;  // the CPU backend stages on the heap (it is never captured in a graph)
}

void insert_keys_async(const CacheView& cache, int32_t layer, const float* keys, const int64_t* slot_mapping,
                       int64_t num_tokens, const InsertOptions& opts, void* workspace, size_t workspace_bytes,
                       InsertStatus* status, CUstream_st* /*stream: the CPU runs the call at once*/) {
  insert_async(cache, layer, keys, f32_loader(keys), slot_mapping, num_tokens, opts, workspace, workspace_bytes,
               status);
}

void insert_keys_bf16_async(const CacheView& cache, int32_t layer, const uint16_t* keys,
                            const int64_t* slot_mapping, int64_t num_tokens, const InsertOptions& opts,
                            void* workspace, size_t workspace_bytes, InsertStatus* status, CUstream_st*) {
  insert_async(cache, layer, keys, bf16_loader(keys), slot_mapping, num_tokens, opts, workspace, workspace_bytes,
               status);
}

static void check_row(const CacheView& c, int32_t layer, int64_t page, int32_t row) {
  INDEXCP_REQUIRE(layer >= 0 && layer < c.num_layers(), "layer = " + std::to_string(layer) + " is out of range");
  INDEXCP_REQUIRE(page >= 0 && page < c.num_pages(), "page = " + std::to_string(page) + " is out of range");
  INDEXCP_REQUIRE(row >= 0 && row < c.layout().rows(), "row = " + std::to_string(row) + " is out of range");
}

std::vector<uint8_t> read_row_bytes(const CacheView& c, int32_t layer, int64_t page, int32_t row) {
  check_cache_view(c, MemoryLocation::kHost, "cache");
  check_row(c, layer, page, row);
  const PageLayout& l = c.layout();
  const uint8_t* p = c.page_ptr(layer, page);
  std::vector<uint8_t> out(static_cast<size_t>(key_bytes(l.dtype)));
  if (l.dtype == KvDtype::kNvfp4) {
    std::memcpy(out.data(), p + l.row_data_offset(row), kNvfp4DataBytesPerKey);
    std::memcpy(out.data() + kNvfp4DataBytesPerKey, p + l.row_scale_offset(row), kNvfp4ScalesPerKey);
  } else {
    std::memcpy(out.data(), p + l.row_data_offset(row), out.size());
  }
  return out;
}

void read_row_khat(const CacheView& c, int32_t layer, int64_t page, int32_t row, KRounding mode,
                   float* out) {
  check_cache_view(c, MemoryLocation::kHost, "cache");
  check_row(c, layer, page, row);
  check_k_rounding(mode, "mode");
  INDEXCP_REQUIRE(out != nullptr, "out is null");
  const PageLayout& l = c.layout();
  const uint8_t* p = c.page_ptr(layer, page);
  switch (l.dtype) {
    case KvDtype::kNvfp4:
      nvfp4_dequantize_key(p + l.row_data_offset(row), p + l.row_scale_offset(row), mode, out);
      break;
    case KvDtype::kFp8:
      for (int d = 0; d < kHeadDim; ++d) out[d] = e4m3_decode(p[l.row_data_offset(row) + d]);
      break;
    case KvDtype::kBf16:
      for (int d = 0; d < kHeadDim; ++d) {
        const uint8_t* b = p + l.row_data_offset(row) + 2 * d;
        out[d] = bf16_decode(static_cast<uint16_t>(b[0] | (b[1] << 8)));
      }
      break;
  }
}

namespace {

// The one scan of an index-Q cast: NaN in q first (flat order), then per vector its RoPE position
// (table form) and NaN after RMSNorm/RoPE. Writes `out` only when nothing was refused.
void qcast_scan(const float* q, int64_t num_tokens, int32_t heads, const KeyPreprocess& pre, bool table,
                uint8_t* out, InsertStatus* st) {
  const int64_t n = num_tokens * heads;
  auto refuse = [&](InsertRefusal r, int64_t i, int d, int64_t value, int64_t limit) {
    st->reason = static_cast<int32_t>(r);
    st->token = i / heads;
    st->head = static_cast<int32_t>(i % heads);
    st->heads = heads;
    st->dim = d;
    st->value = value;
    st->limit = limit;
    st->refused_tokens = 1;
  };
  for (int64_t i = 0; i < n; ++i)
    for (int d = 0; d < kHeadDim; ++d)
      if (fmt::is_nan(q[i * kHeadDim + d])) return refuse(InsertRefusal::kQueryNaN, i, d, 0, 0);
  const bool has_pre = pre.norm_weight != nullptr || pre.rope;
  float v[kHeadDim], cs[64];
  auto vec = [&](int64_t i, bool check) -> const float* {
    const float* x = q + i * kHeadDim;
    if (!has_pre) return x;
    const float* csp = nullptr;
    if (pre.rope) {
      const int64_t pos = pre.positions[i / heads];
      if (table) {
        if (pos < 0 || pos >= pre.rope_table_positions) {
          if (check) refuse(InsertRefusal::kPositionOutOfTable, i, -1, pos, pre.rope_table_positions);
          return nullptr;
        }
        csp = pre.rope_cos_sin + pos * 64;
      } else {
        rope_cos_sin_row(pos, pre.rope_theta, cs);
        csp = cs;
      }
    }
    preprocess_cs(x, pre.norm_weight, pre.eps, csp, v);
    if (check)
      for (int d = 0; d < kHeadDim; ++d)
        if (fmt::is_nan(v[d])) {
          refuse(InsertRefusal::kQueryNaNAfterPreprocess, i, d, 0, 0);
          return nullptr;
        }
    return v;
  };
  if (has_pre)
    for (int64_t i = 0; i < n; ++i)
      if (vec(i, true) == nullptr) return;
  // phase 2: write (nothing is written when any vector is refused)
  for (int64_t i = 0; i < n; ++i) fp8_quantize_key(vec(i, false), out + i * kHeadDim);
}

void check_qcast_args(const float* q, int64_t num_tokens, int32_t heads, const uint8_t* out) {
  INDEXCP_REQUIRE(heads >= 1 && heads <= 64, "heads = " + std::to_string(heads) + " is out of range 1..64");
  check_num_tokens(num_tokens);
  INDEXCP_REQUIRE(num_tokens == 0 || (q != nullptr && out != nullptr), "q or out is null");
}

}  // namespace

void quantize_queries(const float* q, int64_t num_tokens, int32_t heads, const KeyPreprocess& pre,
                      uint8_t* out) {
  check_qcast_args(q, num_tokens, heads, out);
  if (num_tokens == 0) return;  // (as insert_keys: no token, nothing else checked)
  check_preprocess(pre);
  InsertStatus st;
  qcast_scan(q, num_tokens, heads, pre, /*table=*/false, out, &st);
  if (st.reason != 0) throw status_error(st);
}

void quantize_queries_async(const float* q, int64_t num_tokens, int32_t heads, const KeyPreprocess& pre,
                            uint8_t* out, InsertStatus* status, CUstream_st* /*stream*/) {
  check_qcast_args(q, num_tokens, heads, out);
  INDEXCP_REQUIRE(status != nullptr, "status is null");
  check_preprocess(pre);
  INDEXCP_REQUIRE(!pre.rope || (pre.rope_cos_sin != nullptr && pre.rope_table_positions >= 1),
                  "rope is on but rope_cos_sin is null or rope_table_positions < 1 (the asynchronous calls read "
                  "cos/sin from a table: fill_rope_table)");
  if (num_tokens == 0) return;
  InsertStatus st;
  qcast_scan(q, num_tokens, heads, pre, /*table=*/true, out, &st);
  if (st.reason == 0) return;
  if (status->reason == 0) {
    const int64_t calls = status->refused_calls, tokens = status->refused_tokens;
    *status = st;
    status->refused_calls = calls;
    status->refused_tokens = tokens;
  }
  status->refused_calls += 1;
  status->refused_tokens += 1;
}

}  // namespace indexcp
