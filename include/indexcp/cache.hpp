// indexcp: the paged index cache (host memory) and insert (spec/indexer.md section 6).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "indexcp/cache_view.hpp"
#include "indexcp/error.hpp"
#include "indexcp/layout.hpp"

// cudaStream_t without the CUDA runtime headers (the CPU calls take one and ignore it).
struct CUstream_st;

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

  /// A host view of every layer of this cache (shallow: writes through it change this cache).
  CacheView view() const;
  operator CacheView() const { return view(); }  // NOLINT: owners convert to views implicitly

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
  /// The asynchronous calls (insert_keys_async, quantize_queries_async) read cos/sin from this
  /// table instead of computing them: fp32 [rope_table_positions, 64], row p = cos of pairs 0..31
  /// then sin of pairs 0..31 at position p (fill_rope_table; rope_theta is then not used, but it
  /// is still checked: finite and > 0). A position outside [0, rope_table_positions) refuses the
  /// batch. The synchronous calls ignore the table.
  const float* rope_cos_sin = nullptr;
  int64_t rope_table_positions = 0;
};

/// Fills `out` (host, fp32 [num_positions, 64]) with the RoPE table of indexer.md section 6:
/// out[p * 64 + i] = (float)cos(p * theta^(-2i/64)), out[p * 64 + 32 + i] = (float)sin(...), in
/// double precision, exactly the values the synchronous insert computes per token. Throws Error
/// naming num_positions (1..2^31) or rope_theta (finite, > 0). (cuda::fill_rope_table fills a
/// device table.)
void fill_rope_table(float* out, int64_t num_positions, double rope_theta);
/// The same with the CUDA backend's signature (the stream is ignored; `out` is host memory).
void fill_rope_table(float* out, int64_t num_positions, double rope_theta, CUstream_st* stream);
/// One row of that table at any position: out (host, fp32 [64]) = cos of pairs 0..31, then sin.
void rope_cos_sin_row(int64_t position, double rope_theta, float* out);

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

/// Quantizes and writes `num_tokens` keys into `cache` (a host view; spec/indexer.md section 6).
/// Synchronous and validating: the tools' and tests' form (insert_keys_async below is the
/// engine's).
///
/// keys: fp32 [num_tokens, 128]; slot_mapping: int64 [num_tokens], slot = page * P + offset, -1
/// skips the token. With a sharded cache only tokens whose page offset this rank owns are
/// written (into local row offset % R); every rank validates the whole batch identically.
/// Errors (Error, nothing of the batch written): layer out of range; slot_mapping[i] outside
/// [-1, num_pages * P) or duplicated; key of token i holding NaN/Inf (after pre-processing);
/// encode_scale not finite and > 0; RoPE without positions.
void insert_keys(const CacheView& cache, int32_t layer, const float* keys,
                 const int64_t* slot_mapping, int64_t num_tokens, const InsertOptions& opts = {});

/// Same as insert_keys with bf16 keys (uint16 bit patterns, [num_tokens, 128]).
void insert_keys_bf16(const CacheView& cache, int32_t layer, const uint16_t* keys,
                      const int64_t* slot_mapping, int64_t num_tokens,
                      const InsertOptions& opts = {});

/// Quantizes one key to the row bytes the cache would store (NVFP4: 64 data bytes followed by 8
/// scale bytes, 72 total; FP8: 128; BF16: 256 little-endian). Used by tests and by tools.
std::vector<uint8_t> quantize_key_bytes(KvDtype dtype, const float* key, float encode_scale = 1.0f);

/// Reads the row bytes (same form as quantize_key_bytes) of local row `row` of physical page
/// `page` of `layer`. Throws Error on out-of-range arguments.
std::vector<uint8_t> read_row_bytes(const CacheView& cache, int32_t layer, int64_t page,
                                    int32_t row);

/// Dequantized k_hat (indexer.md section 2) of local row `row` of a page; `out` [128] fp32.
/// `mode` applies to NVFP4 only.
void read_row_khat(const CacheView& cache, int32_t layer, int64_t page, int32_t row,
                   KRounding mode, float* out);

/// Casts index queries to E4M3 (formats.md section 5): q fp32 [n, 128] -> out uint8 [n, 128],
/// optionally RMSNorm (+RoPE at positions[i / heads] when `pre.rope`) first, with `heads`
/// vectors per token. Throws Error naming q if it holds NaN.
void quantize_queries(const float* q, int64_t num_tokens, int32_t heads, const KeyPreprocess& pre,
                      uint8_t* out);

// ---------------------------------------------------------------------------------------------
// Asynchronous insert and index-Q cast (docs/embedding.md): the engine's form. The CUDA backend
// (cuda.hpp) enqueues them on the caller's stream with no host synchronization and no allocation,
// so that they can be captured in a CUDA graph; these CPU versions take the same arguments (host
// pointers; the stream is ignored) so that one engine code path runs on either backend.

/// Why a batch was refused (InsertStatus::reason). The order is the order of the checks for one
/// token: the first refused token of a batch is reported with its first failing check.
enum class InsertRefusal : int32_t {
  kNone = 0,
  kSlotOutOfRange = 1,        ///< slot_mapping[token] outside [-1, num_pages * P); value = slot
  kDuplicateSlot = 2,         ///< slot_mapping[token] repeats an earlier token's; value = slot
  kNonFiniteKey = 3,          ///< key holds NaN/Inf; dim and key_value say where and what
  kPositionOutOfTable = 4,    ///< positions[token] outside the RoPE table; value = position
  kNonFiniteAfterPreprocess = 5,  ///< non-finite after RMSNorm/RoPE; dim says where
  kQueryNaN = 6,              ///< q holds NaN (Q cast); head and dim say where
  kQueryNaNAfterPreprocess = 7,  ///< q is NaN after RMSNorm/RoPE (Q cast); head and dim say where
};
/// "none", "slot out of range", ... (for logs).
const char* to_string(InsertRefusal r);

/// The status an asynchronous insert or Q cast writes: 72 bytes of caller-owned memory (device
/// memory for the CUDA backend, host for the CPU), zero-filled once by the caller (or by
/// reset_status / cuda::reset_status). It is sticky, as an engine wants it: the first refused
/// call's details stay until the caller resets it, later calls are still validated and written on
/// their own merits, and `refused_calls` / `refused_tokens` add up. A refused call writes nothing.
struct InsertStatus {
  int32_t reason = 0;          ///< InsertRefusal of the first refused call; 0 while none was
  int32_t layer = -1;          ///< its layer (-1 for a Q cast); meaningful only when reason != 0
  int64_t token = -1;          ///< its first refused token (index into the call's batch)
  int64_t value = 0;           ///< the slot or position (kSlotOutOfRange, kDuplicateSlot, ...)
  int32_t dim = -1;            ///< the dimension (kNonFiniteKey, kNonFiniteAfterPreprocess, kQueryNaN)
  int32_t head = -1;           ///< the head (kQueryNaN)
  float key_value = 0.0f;      ///< the non-finite input value (kNonFiniteKey)
  int32_t heads = 0;           ///< heads of the refused Q cast
  int64_t limit = 0;           ///< the bound `value` broke: num_pages * P, or rope_table_positions
  int64_t refused_calls = 0;   ///< calls refused since the last reset
  int64_t refused_tokens = 0;  ///< tokens refused since the last reset (a token counts once per call)
  unsigned long long scratch = 0;  ///< the library's per-call word; do not read
};
static_assert(sizeof(InsertStatus) == 72, "InsertStatus is part of the ABI");

/// Zero-fills a host status (the CPU backend's). (The overload with a stream, ignored, has the
/// CUDA backend's signature.)
void reset_status(InsertStatus* status);
void reset_status(InsertStatus* status, CUstream_st* stream);
/// A copy of a host status (the CUDA backend's read_status copies a device one back).
InsertStatus read_status(const InsertStatus* status, CUstream_st* stream = nullptr);
/// The Error that the synchronous call would have thrown for the first refusal recorded in
/// `status` (a host copy), with the same message; nullptr-free: status.reason == 0 returns an
/// Error of code kRuntime saying nothing was refused (call it only when reason != 0).
Error status_error(const InsertStatus& status);
/// Throws status_error(status) when status.reason != 0.
void throw_if_refused(const InsertStatus& status);

/// Bytes of workspace this backend's insert_keys_async needs for up to `max_tokens` tokens: 0 on
/// the CPU, which stages on the heap (cuda::insert_workspace_bytes for the CUDA backend). Throws
/// Error naming max_tokens outside 0..kMaxTokensPerCall.
size_t insert_workspace_bytes(int64_t max_tokens);

/// Quantizes and writes keys (fp32 [num_tokens, 128]) at slot_mapping (int64 [num_tokens]), as
/// insert_keys, without throwing for a bad token: a batch holding one (slot out of range,
/// duplicate slot, non-finite key, position outside the RoPE table, non-finite after RMSNorm /
/// RoPE) writes nothing and is recorded in *status. RoPE (opts.pre.rope) needs
/// opts.pre.rope_cos_sin. `workspace` holds workspace_bytes >= insert_workspace_bytes(num_tokens)
/// bytes. Throws Error (kInvalidArgument, naming the argument, nothing enqueued) only for what is
/// wrong before any token is read: the view (host), layer, num_tokens, null pointers, workspace too
/// small, encode_scale, eps, rope without a table.
void insert_keys_async(const CacheView& cache, int32_t layer, const float* keys,
                       const int64_t* slot_mapping, int64_t num_tokens, const InsertOptions& opts,
                       void* workspace, size_t workspace_bytes, InsertStatus* status,
                       CUstream_st* stream = nullptr);
/// Same with bf16 keys (uint16 bit patterns [num_tokens, 128]).
void insert_keys_bf16_async(const CacheView& cache, int32_t layer, const uint16_t* keys,
                            const int64_t* slot_mapping, int64_t num_tokens,
                            const InsertOptions& opts, void* workspace, size_t workspace_bytes,
                            InsertStatus* status, CUstream_st* stream = nullptr);

/// Index-Q cast as quantize_queries (q fp32 [num_tokens, heads, 128] -> out E4M3 [num_tokens,
/// heads, 128]) with refusals recorded in *status instead of thrown (nothing written): NaN in q
/// (kQueryNaN), a position outside the RoPE table (kPositionOutOfTable), NaN after RMSNorm/RoPE
/// (kQueryNaNAfterPreprocess). Every row is checked: padding rows must be finite. RoPE needs
/// pre.rope_cos_sin. No workspace.
void quantize_queries_async(const float* q, int64_t num_tokens, int32_t heads,
                            const KeyPreprocess& pre, uint8_t* out, InsertStatus* status,
                            CUstream_st* stream = nullptr);

}  // namespace indexcp
