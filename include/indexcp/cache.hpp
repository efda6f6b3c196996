// indexcp: the paged index cache (host memory) and insert (spec/indexer.md section 6).
#pragma once

#include <cstdint>
#include <vector>

#include "indexcp/layout.hpp"

namespace indexcp {

/// One rank's index cache: every sparse layer in ONE allocation, layer l's region starting at
/// l * layer_stride() bytes, physical page p of a layer at p * page_stride within it.
/// A replicated cache is the shards == 1 case (rank 0 stores every row). With sharding, each of
/// the W ranks owns one IndexCache with the same num_pages and block table, holding P/W rows of
/// every page (formats.md section 7). New caches are zero-filled.
class IndexCache {
 public:
  /// Throws Error naming the argument: num_pages >= 1, num_layers >= 1, 0 <= rank < layout.shards,
  /// and the total size must fit in memory (kRuntime on allocation failure).
  IndexCache(const PageLayout& layout, int64_t num_pages, int32_t num_layers, int32_t rank = 0);

  const PageLayout& layout() const { return layout_; }
  int64_t num_pages() const { return num_pages_; }
  int32_t num_layers() const { return num_layers_; }
  int32_t rank() const { return rank_; }
  /// Bytes between consecutive layer regions: num_pages * page_stride.
  int64_t layer_stride() const { return num_pages_ * layout_.page_stride; }
  /// Total bytes of this rank's cache: num_layers * layer_stride().
  int64_t size_bytes() const { return static_cast<int64_t>(bytes_.size()); }

  /// Start of physical page `page` of `layer` (no bounds check beyond debug asserts).
  uint8_t* page_ptr(int32_t layer, int64_t page) {
    return bytes_.data() + layer * layer_stride() + layout_.page_offset(page);
  }
  const uint8_t* page_ptr(int32_t layer, int64_t page) const {
    return bytes_.data() + layer * layer_stride() + layout_.page_offset(page);
  }
  uint8_t* data() { return bytes_.data(); }
  const uint8_t* data() const { return bytes_.data(); }

 private:
  PageLayout layout_;
  int64_t num_pages_;
  int32_t num_layers_;
  int32_t rank_;
  std::vector<uint8_t> bytes_;
};

/// Optional pre-processing applied to each key before quantization (indexer.md section 6):
/// Gemma-style RMSNorm with weights w (128 fp32, y = (x * r) * (1 + w)) and/or NeoX rotary
/// embedding on the first 64 dims at the token's position.
struct KeyPreprocess {
  const float* norm_weight = nullptr;  ///< [128] fp32; nullptr: no RMSNorm
  float eps = 1e-6f;
  bool rope = false;                   ///< apply partial NeoX RoPE (needs positions)
  double rope_theta = 5e6;
  const int64_t* positions = nullptr;  ///< [num_tokens] absolute positions, for RoPE
};

/// Throws Error (kInvalidArgument) naming the field unless eps is finite and >= 0 (when
/// norm_weight is set), rope_theta finite and > 0 and positions not null (when rope is on). The
/// weights themselves are not read here (they may live on the device); a non-finite weight shows
/// as a non-finite key after RMSNorm.
void check_preprocess(const KeyPreprocess& pre);

/// Applies RMSNorm and/or partial NeoX RoPE to one 128-value vector, exactly as indexer.md
/// section 6 specifies (separately rounded fp32 operations, cos/sin in double rounded to fp32).
/// `in` and `out` may alias.
void preprocess_vector(const float* in, const float* norm_weight, float eps, bool rope,
                       double rope_theta, int64_t position, float* out);

/// Insert options: encode scale S of NVFP4 (finite, > 0; formats.md section 3) and the optional
/// pre-processing.
struct InsertOptions {
  float encode_scale = 1.0f;
  KeyPreprocess pre;
};

/// The most tokens one insert_keys / insert_keys_bf16 / quantize_queries call takes (either
/// backend): 2^32, so that the element and byte counts of a call (at most 2^32 x 64 heads x 128
/// values) cannot wrap in 64 bits. Split larger batches.
inline constexpr int64_t kMaxTokensPerCall = int64_t{1} << 32;
/// Throws Error (kInvalidArgument) naming num_tokens unless 0 <= num_tokens <= kMaxTokensPerCall.
void check_num_tokens(int64_t num_tokens);

/// Quantizes and writes `num_tokens` keys into `cache` (spec/indexer.md section 6).
///
/// keys: fp32 [num_tokens, 128]; slot_mapping: int64 [num_tokens], slot = page * P + offset, -1
/// skips the token. With a sharded cache only tokens whose page offset this rank owns are
/// written (into local row offset % R); every rank validates the whole batch identically.
/// Errors (Error, nothing of the batch written): layer out of range; slot_mapping[i] outside
/// [-1, num_pages * P) or duplicated; key of token i holding NaN/Inf (after pre-processing);
/// encode_scale not finite and > 0; RoPE without positions.
void insert_keys(IndexCache& cache, int32_t layer, const float* keys,
                 const int64_t* slot_mapping, int64_t num_tokens, const InsertOptions& opts = {});

/// Same as insert_keys with bf16 keys (uint16 bit patterns, [num_tokens, 128]).
void insert_keys_bf16(IndexCache& cache, int32_t layer, const uint16_t* keys,
                      const int64_t* slot_mapping, int64_t num_tokens,
                      const InsertOptions& opts = {});

/// Quantizes one key to the row bytes the cache would store (NVFP4: 64 data bytes followed by 8
/// scale bytes, 72 total; FP8: 128; BF16: 256 little-endian). Used by tests and by tools.
std::vector<uint8_t> quantize_key_bytes(KvDtype dtype, const float* key, float encode_scale = 1.0f);

/// Reads the row bytes (same form as quantize_key_bytes) of local row `row` of physical page
/// `page` of `layer`. Throws Error on out-of-range arguments.
std::vector<uint8_t> read_row_bytes(const IndexCache& cache, int32_t layer, int64_t page,
                                    int32_t row);

/// Dequantized k_hat (indexer.md section 2) of local row `row` of a page; `out` [128] fp32.
/// `mode` applies to NVFP4 only.
void read_row_khat(const IndexCache& cache, int32_t layer, int64_t page, int32_t row,
                   KRounding mode, float* out);

/// Casts index queries to E4M3 (formats.md section 5): q fp32 [n, 128] -> out uint8 [n, 128],
/// optionally RMSNorm (+RoPE at positions[i / heads] when `pre.rope`) first, with `heads`
/// vectors per token. Throws Error naming q if it holds NaN.
void quantize_queries(const float* q, int64_t num_tokens, int32_t heads, const KeyPreprocess& pre,
                      uint8_t* out);

}  // namespace indexcp
