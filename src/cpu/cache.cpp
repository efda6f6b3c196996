// Paged index cache and insert, CPU backend (spec/formats.md sections 3-7, spec/indexer.md 6).
#include "indexcp/cache.hpp"

#include <cmath>
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

void preprocess_vector(const float* in, const float* norm_weight, float eps, bool rope,
                       double rope_theta, int64_t position, float* out) {
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
  if (rope) {
    for (int i = 0; i < 32; ++i) {
      const double inv_freq = std::pow(rope_theta, -2.0 * i / 64.0);
      const double ang = static_cast<double>(position) * inv_freq;
      const float c = static_cast<float>(std::cos(ang));
      const float s = static_cast<float>(std::sin(ang));
      const float a = y[i], b = y[i + 32];
      const float ac = a * c, bs = b * s, bc = b * c, as = a * s;
      y[i] = ac - bs;
      y[i + 32] = bc + as;
    }
  }
  for (int d = 0; d < kHeadDim; ++d) out[d] = y[d];
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
static void write_row(IndexCache& c, int32_t layer, int64_t page, int32_t row, const uint8_t* bytes) {
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

static void insert_impl(IndexCache& cache, int32_t layer, const float* keys,
                        const int64_t* slot_mapping, int64_t num_tokens, const InsertOptions& opts) {
  INDEXCP_REQUIRE(layer >= 0 && layer < cache.num_layers(),
          "layer = " + std::to_string(layer) + " is outside [0, " +
              std::to_string(cache.num_layers()) + ")");
  check_num_tokens(num_tokens);
  if (num_tokens == 0) return;
  INDEXCP_REQUIRE(keys != nullptr, "keys is null");
  INDEXCP_REQUIRE(slot_mapping != nullptr, "slot_mapping is null");
  // S shapes only NVFP4 bytes, but a bad S is refused for every dtype (docs/decisions.md)
  INDEXCP_REQUIRE(fmt::is_finite(opts.encode_scale) && opts.encode_scale > 0.0f,
            "encode_scale = " + std::to_string(opts.encode_scale) +
                " is invalid: the NVFP4 encode scale S must be finite and > 0");
  check_preprocess(opts.pre);
  const PageLayout& l = cache.layout();
  const int64_t num_slots = cache.num_pages() * l.page_size;
  // phase 1: validate everything and quantize into a staging buffer
  std::unordered_set<int64_t> seen;
  seen.reserve(static_cast<size_t>(num_tokens));
  std::vector<uint8_t> staged;
  std::vector<int64_t> todo;  // token indices this rank writes
  const size_t kb = static_cast<size_t>(key_bytes(l.dtype));
  float pre[kHeadDim];
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t s = slot_mapping[t];
    if (s == -1) continue;
    INDEXCP_REQUIRE(s >= 0 && s < num_slots, "slot_mapping[" + std::to_string(t) + "] = " +
                                         std::to_string(s) + " is outside [-1, " +
                                         std::to_string(num_slots) + ") (num_pages x page_size)");
    INDEXCP_REQUIRE(seen.insert(s).second, "slot_mapping[" + std::to_string(t) + "] = " +
                                       std::to_string(s) + " repeats a slot of the same batch");
    const float* k = keys + t * kHeadDim;
    for (int d = 0; d < kHeadDim; ++d)
      INDEXCP_REQUIRE(fmt::is_finite(k[d]), "key of token " + std::to_string(t) + " holds a non-finite value (" +
                                        std::to_string(k[d]) + " at dim " + std::to_string(d) + ")");
    const bool has_pre = opts.pre.norm_weight != nullptr || opts.pre.rope;
    if (has_pre) {
      preprocess_vector(k, opts.pre.norm_weight, opts.pre.eps, opts.pre.rope, opts.pre.rope_theta,
                        opts.pre.rope ? opts.pre.positions[t] : 0, pre);
      for (int d = 0; d < kHeadDim; ++d)
        INDEXCP_REQUIRE(fmt::is_finite(pre[d]), "key of token " + std::to_string(t) +
                                            " is non-finite after RMSNorm/RoPE (dim " +
                                            std::to_string(d) + ")");
      k = pre;
    }
    const SlotLocation loc = locate_slot(l, s);
    if (loc.rank != cache.rank()) continue;  // another rank owns this row
    const auto row = quantize_key_bytes(l.dtype, k, opts.encode_scale);
    staged.insert(staged.end(), row.begin(), row.end());
    todo.push_back(t);
  }
  // phase 2: write (cannot fail)
  for (size_t i = 0; i < todo.size(); ++i) {
    const SlotLocation loc = locate_slot(l, slot_mapping[todo[i]]);
    write_row(cache, layer, loc.page, loc.row, staged.data() + i * kb);
  }
}

void insert_keys(IndexCache& cache, int32_t layer, const float* keys, const int64_t* slot_mapping,
                 int64_t num_tokens, const InsertOptions& opts) {
  insert_impl(cache, layer, keys, slot_mapping, num_tokens, opts);
}

void insert_keys_bf16(IndexCache& cache, int32_t layer, const uint16_t* keys,
                      const int64_t* slot_mapping, int64_t num_tokens, const InsertOptions& opts) {
  check_num_tokens(num_tokens);
  INDEXCP_REQUIRE(num_tokens == 0 || keys != nullptr, "keys is null");
  std::vector<float> f;
  try {
    f.resize(static_cast<size_t>(num_tokens) * kHeadDim);
  } catch (const std::bad_alloc&) {
    throw Error(ErrorCode::kRuntime, "could not allocate the fp32 copy of " + std::to_string(num_tokens) + " bf16 keys");
  }
  for (size_t i = 0; i < f.size(); ++i) f[i] = bf16_decode(keys[i]);
  insert_impl(cache, layer, f.data(), slot_mapping, num_tokens, opts);
}

static void check_row(const IndexCache& c, int32_t layer, int64_t page, int32_t row) {
  INDEXCP_REQUIRE(layer >= 0 && layer < c.num_layers(), "layer = " + std::to_string(layer) + " is out of range");
  INDEXCP_REQUIRE(page >= 0 && page < c.num_pages(), "page = " + std::to_string(page) + " is out of range");
  INDEXCP_REQUIRE(row >= 0 && row < c.layout().rows(), "row = " + std::to_string(row) + " is out of range");
}

std::vector<uint8_t> read_row_bytes(const IndexCache& c, int32_t layer, int64_t page, int32_t row) {
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

void read_row_khat(const IndexCache& c, int32_t layer, int64_t page, int32_t row, KRounding mode,
                   float* out) {
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

void quantize_queries(const float* q, int64_t num_tokens, int32_t heads, const KeyPreprocess& pre,
                      uint8_t* out) {
  INDEXCP_REQUIRE(heads >= 1 && heads <= 64, "heads = " + std::to_string(heads) + " is out of range 1..64");
  check_num_tokens(num_tokens);
  INDEXCP_REQUIRE(num_tokens == 0 || (q != nullptr && out != nullptr), "q or out is null");
  if (num_tokens == 0) return;  // (as insert_keys: no token, nothing else checked)
  check_preprocess(pre);
  const int64_t n = num_tokens * heads;
  for (int64_t i = 0; i < n; ++i)
    for (int d = 0; d < kHeadDim; ++d)
      INDEXCP_REQUIRE(!fmt::is_nan(q[i * kHeadDim + d]),
              "q holds NaN at token " + std::to_string(i / heads) + ", head " +
                  std::to_string(i % heads) + ", dim " + std::to_string(d));
  float v[kHeadDim];
  for (int64_t i = 0; i < n; ++i) {
    const float* x = q + i * kHeadDim;
    if (pre.norm_weight != nullptr || pre.rope) {
      preprocess_vector(x, pre.norm_weight, pre.eps, pre.rope, pre.rope_theta,
                        pre.rope ? pre.positions[i / heads] : 0, v);
      for (int d = 0; d < kHeadDim; ++d)
        INDEXCP_REQUIRE(!fmt::is_nan(v[d]), "q is NaN after RMSNorm/RoPE at token " + std::to_string(i / heads) +
                                                ", head " + std::to_string(i % heads) + ", dim " + std::to_string(d));
      x = v;
    }
  }
  // phase 2: write (nothing is written when any vector is refused)
  for (int64_t i = 0; i < n; ++i) {
    const float* x = q + i * kHeadDim;
    if (pre.norm_weight != nullptr || pre.rope) {
      preprocess_vector(x, pre.norm_weight, pre.eps, pre.rope, pre.rope_theta,
                        pre.rope ? pre.positions[i / heads] : 0, v);
      x = v;
    }
    fp8_quantize_key(x, out + i * kHeadDim);
  }
}

}  // namespace indexcp
