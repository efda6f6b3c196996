// Internal launchers of the CUDA backend (scoring, selection, publish, merge, staging, insert).
// Every launcher only enqueues work on the stream; none synchronizes. Arguments are assumed valid
// (the public functions of decode.cu, prefill.cu and insert_api.cu validate them); kernels still never read outside the cache
// (page ids outside [0, num_pages) are skipped).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "indexcp/cache.hpp"
#include "indexcp/icp.hpp"
#include "indexcp/indexer.hpp"
#include "indexcp/layout.hpp"
#include "indexcp/plan.hpp"

namespace indexcp::cuda::detail {

/// Rows of a batch as the kernels see them: decode (query_start == nullptr: request b has rows
/// b*Q .. b*Q+Q-1 when seq_len > 0) or prefill (rows query_start[b] .. query_start[b+1]-1).
struct RowsView {
  const int32_t* seq_lens = nullptr;
  const int32_t* query_start = nullptr;  // null: decode
  int32_t num_requests = 0;
  int32_t query_len = 1;                 // decode Q
  int64_t rows = 0;                      // total rows (decode: num_requests * Q)
};

/// Where the keys of a scoring launch come from.
struct KeySource {
  const uint8_t* base = nullptr;  ///< cache layer base, or the gathered FP8 buffer
  PageLayout layout;              ///< the cache's layout; for `gather`: FP8, P, W of the group
  int32_t rank = 0;               ///< the cache's rank (unused for gather)
  int64_t num_pages = 0;          ///< cache pages, or units in the gathered buffer
  bool gather = false;            ///< keys are [W][num_pages][R][128] FP8 rows (prefill gather)
};

struct ScoreLaunch {
  KeySource keys;
  KRounding mode = KRounding::kE4m3;  ///< NVFP4 only
  ScorePrecision precision = ScorePrecision::kFp32;  ///< kFp8Mma: the fp8_mma form (not with kExact)
  bool stock = false;                 ///< use the whole-page (R >= 128) scorer specialization
  RowsView rows;
  const int32_t* block_table = nullptr;
  int32_t max_pages = 0;
  int32_t max_rows_per_request = 1;   ///< host bound on rows of one request (grid y)
  const uint8_t* q = nullptr;         ///< E4M3 [rows, heads, 128]
  int32_t heads = 1, h0 = 0, nh = 1;
  BlockFilter filter;
  float* scores = nullptr;            ///< [rows, nh, max_blocks]
  int64_t max_blocks = 0;
  /// prefill rows: write -Inf where no scorer writes (rows.cuh, fill_unscored) before any score:
  /// the GEMM-shaped scorer in its prologue, otherwise a launch_fill_unscored first
  bool fill_unscored = false;
  /// device scratch int32 [num_requests + 1] for the work plan of batches of more than 2,048
  /// requests (smaller batches compute it in shared memory and leave it untouched); null:
  /// allocated on the stream when needed
  int32_t* plan = nullptr;
};

/// The checks of a scorer's mode on keys of `dtype` (Error naming the argument): `mode` and
/// `precision` are enumerators, and indexer_score_precision "fp8_mma" has E4M3 keys (spec/config.md
/// section 2, rule 7: not NVFP4 with indexer_k_rounding "exact").
inline void check_score_mode(KvDtype dtype, KRounding mode, ScorePrecision precision) {
  check_k_rounding(mode, "mode");
  check_score_precision(precision, "indexer_score_precision");
  INDEXCP_REQUIRE(!(precision == ScorePrecision::kFp8Mma && dtype == KvDtype::kNvfp4 && mode == KRounding::kExact),
                  "indexer_score_precision = \"fp8_mma\" with indexer_k_rounding = \"exact\" is not supported: the "
                  "mode multiplies E4M3 keys, and exact NVFP4 k_hat values are not (spec/config.md section 2, rule 7)");
}

/// The scorer: block maxima of q . k_hat over the source's rows (indexer.md sections 2-3, 5.1).
void launch_score(const ScoreLaunch& s, cudaStream_t stream);

/// Which scorer kernel the calling thread's last launch_score enqueued: "gemm8p" / "gemm8" / "gemm16"
/// (the GEMM-shaped kernel of E4M3 keys, score/gemm8.cuh, in its fp8_mma form with and without the
/// producer warpgroup / its fp32 form), "tiles"
/// (score_kernel) or "" (none yet, or a launch with no work). For tests and benchmarks.
const char* last_score_kernel();

/// Bytes of keys one launch reads for a request of `seq_len` (for bandwidth reports).
int64_t score_bytes_read(const KeySource& keys, int32_t seq_len, BlockFilter filter);

/// Fills n floats with -Inf.
void launch_fill_neg_inf(float* p, int64_t n, cudaStream_t stream);
/// prefill_scores' -Inf in scores [rows.rows, nh, max_blocks] where no scorer writes: the blocks
/// that are not historical for each row (spec/indexer.md section 2), and the historical blocks of
/// block-table entries outside [0, num_pages) (pages of page_size tokens). Prefill rows only
/// (rows.query_start set). Enqueue it before the scorer (launch_score does, for
/// ScoreLaunch::fill_unscored, where the scorer does not do it itself).
void launch_fill_unscored(const RowsView& rows, int32_t nh, int64_t max_blocks, const int32_t* block_table,
                          int32_t max_pages, int32_t page_size, int64_t num_pages, float* out, cudaStream_t stream);

// What the select and publish kernels read (a kernel parameter: kept to these fields, since a
// larger parameter struct changed the CTA kernels' code generation and cost the publish about
// 1 us, bench/NOTES.md "The decode plans and the step signature").
struct SelectArgs {
  RowsView rows;
  const float* scores = nullptr;  ///< [rows, nh, max_blocks]
  int64_t max_blocks = 0;
  int32_t nh = 1;
  SelectionParams sel;
  // select: out int32 [rows, out_heads, K] at head offset out_h0
  int32_t* out = nullptr;
  int32_t out_heads = 1, out_h0 = 0;
  // publish: cands [rows, nh, ranked] (when non-null, publish instead of select)
  Candidate* cands = nullptr;
  PageLayout layout;  ///< publish: validity of a block on `rank` (rows stored), with `filter`
  int32_t rank = 0;
  BlockFilter filter;
};
/// The publish's step signature, a kernel parameter of its own: when `signature` is non-null,
/// one extra block, the grid's last, writes the step signature (plan.hpp) there: `sig` with v[8]
/// = the hash of rows.seq_lens[0, num_requests) and v[9] = of rows.query_start[0, num_requests]
/// (prefill; 0 for decode) computed on the device.
struct SignatureOut {
  uint32_t* signature = nullptr;
  StepSignature sig;
};
/// Which path of the warp select kernel produced a (row, head) problem's selection
/// (SelectLaunch::paths; tests only).
enum class SelectPath : uint8_t {
  kTrivial = 0,            ///< at most topk visible blocks: all of them, nothing ranked
  kRegisters = 1,          ///< select_in_registers
  kStaged = 2,             ///< the staged path, the register path not tried (instance, row length or kk)
  kRegistersFellBack = 3,  ///< the staged path after the register path found more than 64 survivors
};
struct SelectLaunch : SelectArgs {
  /// publish: see SignatureOut
  uint32_t* signature = nullptr;
  StepSignature sig;
  /// Tests only (nullptr otherwise): when non-null, a select through the warp kernel writes here
  /// the SelectPath of each (row, head) problem p = row * nh + hh (one byte each); the CTA kernel
  /// and the publish write nothing. Such a launch runs a twin of the warp kernel's instance that
  /// writes them (the instances run without it are compiled as if it did not exist); a kernel
  /// parameter of the warp kernel, not in SelectArgs, so that the CTA kernels' code stays as it is
  /// (see SelectArgs).
  uint8_t* paths = nullptr;
};
/// Exact selection (section 4) or publish (section 5 step 2), one CTA per (row, head).
void launch_select(const SelectLaunch& s, cudaStream_t stream);
/// The select / publish kernel instance of this thread's last launch_select: "cta", "cta-publish",
/// "warp512-regs" / "warp1024-regs" (with select_in_registers), "warp512", "warp1024", "warp1536",
/// "warp512-publish", "warp1536-publish", or "" (none yet, or a launch with no problems). For tests.
const char* last_select_kernel();

struct MergeLaunch {
  RowsView rows;
  const Candidate* cands = nullptr;  ///< [world][rows][heads][ranked]
  int32_t world = 1, heads = 1, h0 = 0, nh = 1;
  SelectionParams sel;
  int32_t* out = nullptr;  ///< [rows, out_heads, K] at head offset out_h0
  int32_t out_heads = 1, out_h0 = 0;
  /// candidates between the blocks of two ranks (0: rows * heads * ranked, packed)
  int64_t rank_stride = 0;
  /// when non-null: rank p's step signature at signature + p * rank_stride * 2 (uint32 words; the
  /// plan's records). Every record must equal the signature of the step this rank merges (the
  /// host fields of `expect`, the hashes of `rows` computed here): otherwise every output is -1,
  /// and block 0 writes *status (StepStatus: 0 or 1) when status is non-null
  const uint32_t* signature = nullptr;
  StepSignature expect;
  uint32_t* status = nullptr;
};
/// Merge (section 5 step 4), one CTA per (row, owned head).
void launch_merge(const MergeLaunch& m, cudaStream_t stream);

/// FP8 staging of num_pages pages (ids in `pages`, device) of one shard layer: out
/// [num_pages, rows, 128]. Pages on grid x.
void launch_stage_fp8(const uint8_t* layer_base, const PageLayout& layout, int64_t cache_pages,
                      const int32_t* pages, int64_t num_pages, uint8_t* out, cudaStream_t stream);

/// Prefill gather plan, on the device: unit_first[b] = the first (request, page) unit of request
/// b (exclusive prefix over requests of ceil(((seq_len - 1) / 128) * 128 / P) pages for requests
/// with T_b > 0 and seq_len > 0), unit_first[num_requests] = the total; *status = 2 when the total
/// exceeds `max_units` (the host extents), else 0. One CTA.
void launch_gather_units(const int32_t* seq_lens, const int32_t* query_start, int32_t num_requests,
                         int32_t page_size, int64_t max_units, int32_t* unit_first, uint32_t* status,
                         cudaStream_t stream);
/// One chunk [c0, c0 + n) of the units: phys[u - c0] = block_table[b][i] for the chunk's units
/// (request b, logical page i), bt_local[b][i] = u - c0 for them and -1 for every other entry.
void launch_gather_chunk(const int32_t* block_table, int32_t num_requests, int32_t max_pages,
                         const int32_t* unit_first, int64_t c0, int64_t n, int32_t* phys,
                         int32_t* bt_local, cudaStream_t stream);
/// out[0, n) = -1 when *status != 0 (the step's outputs of a refused plan step).
void launch_poison_if(const uint32_t* status, int32_t* out, int64_t n, cudaStream_t stream);

/// Uploads the E4M3 k_hat table (|e2m1 code| x |scale| rounded to E4M3, per scale byte) to the
/// current device once. Call before any graph capture (DeviceCache's constructor does).
/// (With `stream`: refuses, naming cuda::prepare_device, when the tables are missing and that
/// stream is being captured, instead of a synchronous upload that would break the capture. A
/// capture on another stream or thread is not detected: prepare_device first.)
void ensure_tables(cudaStream_t stream = nullptr);

// ---- insert / q cast ----------------------------------------------------------------------

// Refusals found by the validation kernels are packed so that atomicMin keeps the first one in
// the CPU's order (include/indexcp/cache.hpp, InsertRefusal): insert (token << 11) | (reason << 7)
// | dim; Q cast (class << 60) | (vector << 9) | (after << 8) | dim, class 0 = NaN in q (checked
// for every vector before any preprocessing), class 1 = the vector's position or NaN after
// RMSNorm/RoPE (after = 1). ~0 = none.
inline constexpr unsigned long long kNoRefusal = ~0ull;

struct InsertLaunch {
  const float* keys_f32 = nullptr;     ///< one of these two
  const uint16_t* keys_bf16 = nullptr;
  const int64_t* slots = nullptr;
  int64_t n = 0;
  int32_t layer = 0;
  uint8_t* layer_base = nullptr;
  PageLayout layout;
  int32_t rank = 0;
  int64_t num_slots = 0;  ///< num_pages * P
  float encode_scale = 1.0f;
  const float* norm_weight = nullptr;  ///< device [128] or null
  float eps = 1e-6f;
  /// cos/sin rows ([.][64]: cos[32] then sin[32]) or null: row t (positions == null, the
  /// synchronous call's per-token table) or row positions[t] of a [table_positions] table
  const float* rope_cs = nullptr;
  const int64_t* positions = nullptr;
  int64_t table_positions = 0;
  // workspace (insert_workspace_layout)
  uint8_t* staged = nullptr;           ///< [n][key_bytes]
  unsigned long long* err = nullptr;   ///< [2]: the first refusal (packed), refused tokens
  uint8_t* dup = nullptr;              ///< [n]: 1 where the token repeats an earlier slot
  int64_t* sort_keys = nullptr;        ///< [4][n] int64
  void* sort_temp = nullptr;
  size_t sort_temp_bytes = 0;
  InsertStatus* status = nullptr;      ///< the caller's sticky status (device)
};
/// The workspace of an insert of n tokens of this dtype: every sub-buffer's offset and the total,
/// computed by the one function that also lays it out (offsets are multiples of 256).
struct InsertWorkspace {
  size_t staged = 0, err = 0, dup = 0, sort_keys = 0, sort_temp = 0, sort_temp_bytes = 0, total = 0;
};
InsertWorkspace insert_workspace_layout(int64_t n);
/// validate (duplicates first, then each token), quantize to staging, record the refusal in the
/// status, write only when nothing was refused. Enqueues only (no host synchronization).
void launch_insert(const InsertLaunch& l, cudaStream_t stream);

struct QCastLaunch {
  const float* q = nullptr;
  int64_t vectors = 0;  ///< num_tokens * heads
  int32_t heads = 1;
  const float* norm_weight = nullptr;
  float eps = 1e-6f;
  const float* rope_cs = nullptr;      ///< as InsertLaunch (rows per token, or a table)
  const int64_t* positions = nullptr;
  int64_t table_positions = 0;
  uint8_t* out = nullptr;
  InsertStatus* status = nullptr;      ///< the caller's sticky status; its scratch word is used
};
void launch_qcast(const QCastLaunch& l, cudaStream_t stream);

/// *first = min(*first, the smallest i < n with q[i] an E4M3 NaN byte (0x7F, 0xFF)); the caller
/// sets *first to ~0 (none) before. Spec: formats.md (E4M3 has no infinities, S.1111.111 is NaN).
void launch_e4m3_nan_check(const uint8_t* q, int64_t n, unsigned long long* first, cudaStream_t stream);

}  // namespace indexcp::cuda::detail
