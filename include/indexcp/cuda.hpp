// indexcp: the CUDA backend for Hopper (SM90), spec/indexer.md and spec/formats.md on the GPU.
//
// Declared in every build; defined only when the library was built with the CUDA backend
// (INDEXCP_CUDA_BACKEND == 1 in indexcp/version.hpp): a CPU-only build links none of these.
//
// Conventions of this header:
//   - Every pointer argument is DEVICE memory unless its documentation says "host".
//     The batch structs of indexer.hpp (DecodeBatch, PrefillBatch) are reused: in this namespace
//     their pointers (q, block_table, seq_lens, query_start) are device pointers.
//   - The stream is the last argument; work is enqueued on it. Functions documented "sync"
//     synchronize the stream before returning (they read metadata back to the host).
//   - Errors throw indexcp::Error naming the argument (kInvalidArgument), or kRuntime for CUDA
//     failures (the message names the CUDA call and error). A refused call writes nothing.
//   - Bytes written to a cache are identical to the CPU reference's (formats.md). Scores use
//     fp16 tensor-core products (exact: E4M3 x E2M1*E4M3 products fit fp16) with fp32
//     accumulation, so they agree with the CPU's exact scores within fp32 accumulation
//     tolerance; within this backend every scorer (stock, sharded, decode CP, prefill on the same
//     keys) computes a given (query, head, token) dot product bit-identically (same MMA shapes,
//     same dimension order), so sharded and replicated selections are equal bit for bit.
//   - Selections are exact on the scores: radix selection on an order-preserving key of
//     (score, block id) with the NaN / -0.0 order of indexer.md section 3.
//
// Everything that a CUDA graph must replay (seq_lens, block table, query_start, q) is read from
// device buffers when the kernels run; grid sizes depend only on the shape arguments
// (num_requests, max_pages, query_len, heads), so DecodeStep::run can be captured once and
// replayed with new metadata.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "indexcp/cache.hpp"
#include "indexcp/cache_view.hpp"
#include "indexcp/comm.hpp"
#include "indexcp/config.hpp"
#include "indexcp/icp.hpp"
#include "indexcp/indexer.hpp"
#include "indexcp/plan.hpp"

// cudaStream_t without including the CUDA runtime headers in every translation unit.
struct CUstream_st;

namespace indexcp::cuda {

using Stream = CUstream_st*;  ///< the same type as cudaStream_t

/// True when the library was built with the CUDA backend and a GPU is visible.
bool available();
/// "NVIDIA H200" etc. of the current device; Error (kRuntime) when no device is usable.
std::string device_name();

/// The device rule: every call uses the CURRENT device (cudaGetDevice) of the calling thread, and
/// every pointer it is given must be memory of that device. The backend is built for sm_90a
/// (Hopper, compute capability 9.0: H100, H200, GH200) and refuses any other device by name:
/// Error (kUnsupported) "the CUDA backend of indexcp is built for sm_90a ...; device 0 (NAME) has
/// compute capability 8.0". The answer is cached per device, so the check costs a lookup; every
/// entry point and every constructor of this namespace calls it before any other work.
void require_supported_device();
/// The rule itself: "" when a device of compute capability major.minor is supported, else the
/// refusal's message naming the device (index and name) and its compute capability.
std::string device_support_message(int device, const std::string& name, int major, int minor);

/// One-time setup of the current device (the device check, the scorers' constant tables): what
/// must not happen inside a CUDA graph capture. DeviceCache and DecodeStep do it at construction;
/// an engine that brings its own cache memory (CacheView) calls it once per device before its
/// first capture. Idempotent and thread-safe. Sync (first call per device).
void prepare_device();

/// One rank's index cache in device memory: every layer in ONE cudaMalloc, with the geometry of
/// indexcp::IndexCache (layer l at l * layer_stride(), physical page p at p * page_stride).
/// New caches are zero-filled. Move-only. The owner form for tools and tests: an engine keeps the
/// cache in its own memory and passes a CacheView (make_cache_view, MemoryLocation::kDevice).
/// Every function below that takes `const CacheView&` takes a DeviceCache too.
class DeviceCache {
 public:
  /// Errors as IndexCache (names num_pages / num_layers / rank), kRuntime when cudaMalloc fails.
  DeviceCache(const PageLayout& layout, int64_t num_pages, int32_t num_layers, int32_t rank = 0);
  ~DeviceCache();
  DeviceCache(DeviceCache&& o) noexcept;
  DeviceCache& operator=(DeviceCache&& o) noexcept;
  DeviceCache(const DeviceCache&) = delete;
  DeviceCache& operator=(const DeviceCache&) = delete;

  const PageLayout& layout() const { return layout_; }
  int64_t num_pages() const { return num_pages_; }
  int32_t num_layers() const { return num_layers_; }
  int32_t rank() const { return rank_; }
  int64_t layer_stride() const { return num_pages_ * layout_.page_stride; }
  int64_t size_bytes() const { return layer_stride() * num_layers_; }
  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  /// Device address of layer `layer` (no check).
  const uint8_t* layer_ptr(int32_t layer) const { return data_ + layer * layer_stride(); }
  uint8_t* layer_ptr(int32_t layer) { return data_ + layer * layer_stride(); }

  /// A device view of every layer of this cache (shallow: writes through it change this cache).
  CacheView view() const;
  operator CacheView() const { return view(); }  // NOLINT: owners convert to views implicitly

  /// Copies a host cache of the same geometry (layout, num_pages, num_layers, rank) in; sync.
  void upload(const IndexCache& host);
  /// Copies this cache out into a host cache of the same geometry; sync.
  void download(IndexCache& host) const;

 private:
  PageLayout layout_;
  int64_t num_pages_ = 0;
  int32_t num_layers_ = 0;
  int32_t rank_ = 0;
  uint8_t* data_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// Insert and index-Q cast (indexer.md section 6)

/// Quantizes and writes `num_tokens` keys (fp32 [num_tokens, 128], device) at slot_mapping
/// (int64 [num_tokens], device; -1 skips) into `cache`; with a sharded cache only the owner rank's
/// rows are written. Byte-identical to indexcp::insert_keys. opts.pre.norm_weight ([128] fp32)
/// and opts.pre.positions ([num_tokens] int64) are device pointers. Validation (slot range,
/// duplicates, non-finite keys before and after RMSNorm/RoPE) runs on the device before the
/// write kernel, which writes nothing when it failed; then the call synchronizes and throws the
/// same Error as the CPU insert (the message names the first offending token). Sync.
void insert_keys(const CacheView& cache, int32_t layer, const float* keys, const int64_t* slot_mapping,
                 int64_t num_tokens, const InsertOptions& opts, Stream stream);
/// Same with bf16 keys (uint16 bit patterns [num_tokens, 128], device). Sync.
void insert_keys_bf16(const CacheView& cache, int32_t layer, const uint16_t* keys,
                      const int64_t* slot_mapping, int64_t num_tokens, const InsertOptions& opts,
                      Stream stream);

/// Index-Q cast (formats.md section 5): q fp32 [num_tokens, heads, 128] -> out E4M3 bytes, with
/// optional RMSNorm / RoPE (pre.norm_weight, pre.positions device pointers; positions per token).
/// NaN in q, before or after RMSNorm/RoPE, is refused (Error naming token, head and dim, as the
/// CPU); nothing is written. Sync.
void quantize_queries(const float* q, int64_t num_tokens, int32_t heads, const KeyPreprocess& pre,
                      uint8_t* out, Stream stream);

// ---------------------------------------------------------------------------------------------
// Asynchronous insert and index-Q cast (the engine's form; docs/embedding.md). Each call only
// enqueues kernels and memsets on `stream`: no host synchronization, no allocation, no host read
// of device data, so it can be captured in a CUDA graph (cudaStreamCaptureModeGlobal included)
// and replayed with new keys, slots and positions in the same device buffers. Semantics, status
// and errors as the CPU versions in cache.hpp; here every pointer is device memory of the
// current device, and `status` is a device InsertStatus (72 bytes, 8-byte aligned).

/// Workspace bytes insert_keys_async / insert_keys_bf16_async need for up to max_tokens tokens
/// (staging, the duplicate-slot sort and its CUB temporary storage). Host computation only.
size_t insert_workspace_bytes(int64_t max_tokens);

/// Quantizes and writes keys (fp32 [num_tokens, 128]) at slot_mapping (int64 [num_tokens]) into
/// a device view: a validation pass (duplicates by a sort, then slot range, finite key, RoPE
/// position, finite after RMSNorm/RoPE) records the first refused token in *status, and the write
/// kernel writes nothing when any token was refused. RoPE reads opts.pre.rope_cos_sin (a device
/// table, fill_rope_table) at opts.pre.positions (device int64 [num_tokens]).
/// `workspace`: device, 16-byte aligned, workspace_bytes >= insert_workspace_bytes(num_tokens).
/// Throws (nothing enqueued) only for host-visible faults: a host view, layer, num_tokens, null
/// pointers, a small workspace, encode_scale, eps, rope without a table.
void insert_keys_async(const CacheView& cache, int32_t layer, const float* keys,
                       const int64_t* slot_mapping, int64_t num_tokens, const InsertOptions& opts,
                       void* workspace, size_t workspace_bytes, InsertStatus* status, Stream stream);
/// Same with bf16 keys (uint16 bit patterns [num_tokens, 128], device).
void insert_keys_bf16_async(const CacheView& cache, int32_t layer, const uint16_t* keys,
                            const int64_t* slot_mapping, int64_t num_tokens,
                            const InsertOptions& opts, void* workspace, size_t workspace_bytes,
                            InsertStatus* status, Stream stream);
/// Index-Q cast, asynchronous: NaN in q (before or after RMSNorm/RoPE) or a position outside the
/// RoPE table is recorded in *status and nothing is written. Uses status->scratch; no workspace.
void quantize_queries_async(const float* q, int64_t num_tokens, int32_t heads,
                            const KeyPreprocess& pre, uint8_t* out, InsertStatus* status,
                            Stream stream);

/// Fills a device RoPE table (fp32 [num_positions, 64], indexcp::fill_rope_table's values,
/// computed on the host in double precision) and synchronizes `stream`: setup, not for capture.
void fill_rope_table(float* out, int64_t num_positions, double rope_theta, Stream stream);
/// Zero-fills a device status on `stream` (a memset: capturable).
void reset_status(InsertStatus* status, Stream stream);
/// Copies a device status to the host on `stream` and synchronizes it (then status_error /
/// throw_if_refused turn it into the synchronous call's Error). Sync.
InsertStatus read_status(const InsertStatus* status, Stream stream);

// ---------------------------------------------------------------------------------------------
// Decode and prefill, one rank

/// Validates a decode batch whose arrays are device pointers against a cache geometry by copying
/// them to the host and applying indexcp::decode_rows (the same errors as the CPU). Sync.
/// The copies run on `stream` (after the caller's own writes to it; never the legacy default
/// stream unless stream is nullptr), which is then synchronized.
void validate_decode_batch(const DecodeBatch& batch, int64_t num_pages, int32_t page_size,
                           Stream stream = nullptr);
/// Same for a prefill batch (indexcp::prefill_rows). Sync. Returns the number of rows.
int64_t validate_prefill_batch(const PrefillBatch& batch, int64_t num_pages, int32_t page_size,
                               Stream stream = nullptr);

/// Block scores of heads [h0, h0+nh) of a decode batch against one rank's cache (replicated or a
/// shard; NVFP4 or FP8): out fp32 [rows, nh, max_pages * P / 128], -Inf where no score exists
/// (not historical, or no rows on this rank). Validates the batch (sync) when `validate`.
void decode_scores(const CacheView& cache, int32_t layer, const DecodeBatch& batch, int32_t h0,
                   int32_t nh, KRounding mode, float* out, Stream stream, bool validate = true,
                   ScorePrecision precision = ScorePrecision::kFp32);

/// Replicated decode: score heads [h0, h0+nh) and select (indexer.md sections 3-4).
/// out int32 [rows, nh, K] (device). The cache must be unsharded (Error naming cache).
/// Validates the batch first when `validate` (sync); otherwise the call only enqueues work.
void decode_select(const CacheView& cache, int32_t layer, const DecodeBatch& batch, int32_t h0,
                   int32_t nh, const SelectionParams& sel, KRounding mode, int32_t* out,
                   Stream stream, bool validate = true, ScorePrecision precision = ScorePrecision::kFp32);

/// Replicated prefill: NVFP4 scored with E4M3 keys; out int32 [rows, nh, K]. Sync.
void prefill_select(const CacheView& cache, int32_t layer, const PrefillBatch& batch,
                    int32_t h0, int32_t nh, const SelectionParams& sel, int32_t* out,
                    Stream stream, ScorePrecision precision = ScorePrecision::kFp32);

/// Block scores of heads [h0, h0+nh) of a prefill batch against a replicated cache, E4M3 keys
/// (indexer.md sections 2-3): out fp32 [rows, nh, max_pages * P / 128], -Inf where no score
/// exists (not historical, rows outside [query_start[0], query_start[num_requests]), and blocks
/// whose page id is outside [0, num_pages)); every entry is written, and block-table entries past
/// a request's historical blocks (padding) are never read. No validation and no host
/// synchronization, so the call can be captured in a CUDA graph: the caller validated the batch
/// (validate_prefill_batch) and passes the host values `rows` (= query_start[num_requests]) and
/// `max_rows_per_request` (the largest query_start[b+1] - query_start[b]; an upper bound is fine;
/// below it, the historical entries of the rows past it are unspecified). Errors name the argument for the
/// host-side checks (cache sharded or bf16, layer, heads, rows < 0, max_rows_per_request < 1).
void prefill_scores(const CacheView& cache, int32_t layer, const PrefillBatch& batch, int64_t rows,
                    int32_t max_rows_per_request, int32_t h0, int32_t nh, float* out, Stream stream,
                    ScorePrecision precision = ScorePrecision::kFp32);

// ---------------------------------------------------------------------------------------------
// Indexer context parallelism, one rank (indexer.md section 5). `comm` must be a device
// communicator (DeviceGroup) whose collectives move device buffers on `stream`.

/// indexcp::check_rank_agreement (tp_group.hpp) for a communicator on device buffers (NCCL,
/// DeviceGroup): every rank calls it once with its own config and cache size, before its first
/// collective call below; make_cuda_rank_indexer does. Uploads the rank's record (config.hpp,
/// RankAgreement, 128 bytes) on `stream`, all-gathers it through comm, waits with
/// comm.synchronize(stream) and checks the records on the host. Errors as the host version; a
/// communicator failure (a dead peer) is comm's Error; an allocation or copy failure inside leaves
/// the other ranks in the collective until the communicator's timeout.
void check_rank_agreement(Communicator& comm, const ResolvedConfig& config, int64_t num_pages, Stream stream);

/// ICP decode over a sharded cache: score all heads over this rank's rows, publish, all-gather
/// through comm, merge this rank's owned heads. out int32 [rows, owned heads, K].
/// `p256_stock` (INDEXCP_P256_STOCK_DECODE): at P = 256, W = 2 the shard pages are whole stock
/// pages and are scored by the stock scorer; false keeps the general one (identical bits).
void icp_decode(Communicator& comm, const CacheView& shard, int32_t layer,
                const DecodeBatch& batch, const SelectionParams& sel, KRounding mode, int32_t* out,
                Stream stream, bool validate = true, bool p256_stock = true,
                ScorePrecision precision = ScorePrecision::kFp32);

/// Decode CP over a replicated cache: rank r scores blocks b % W == r, then as icp_decode.
void decode_cp_replicated(Communicator& comm, const CacheView& cache, int32_t layer,
                          const DecodeBatch& batch, const SelectionParams& sel, KRounding mode,
                          int32_t* out, Stream stream, bool validate = true,
                          ScorePrecision precision = ScorePrecision::kFp32);

/// FP8 staging (indexer.md section 5): for each of `num_pages` physical page ids (device int32
/// [num_pages]), this rank's rows as E4M3 k_hat bytes: out uint8 [num_pages, rows(), 128].
/// Pages on grid x: any number of pages in one call. BF16 caches are refused. `validate` copies
/// the page ids to the host and checks them (sync) like the CPU (names pages[i]).
void stage_fp8(const CacheView& shard, int32_t layer, const int32_t* pages, int64_t num_pages,
               uint8_t* out, Stream stream, bool validate = true);

/// Gather prefill, one rank: like indexcp::prefill_gather (chunks of (request, page) units whose
/// staging + gathered transient fits budget_bytes), the scoring on the GPU. Sync.
GatherStats prefill_gather(Communicator& comm, const CacheView& shard, int32_t layer,
                           const PrefillBatch& batch, const SelectionParams& sel,
                           int64_t budget_bytes, int32_t* out, Stream stream,
                           ScorePrecision precision = ScorePrecision::kFp32);

/// local_score prefill, one rank (E4M3 keys), publish, exchange, merge owned heads. Sync.
void prefill_local_score(Communicator& comm, const CacheView& shard, int32_t layer,
                         const PrefillBatch& batch, const SelectionParams& sel, int32_t* out,
                         Stream stream, ScorePrecision precision = ScorePrecision::kFp32);

// ---------------------------------------------------------------------------------------------
// One rank's decode step and prefill chunk as plan / run (plan.hpp has the shared types and the
// CPU plans with the same names). Every pointer is device memory of the current device; the
// plan's constructor does the one-time setup (prepare_device) and allocates nothing; run,
// publish and merge only enqueue kernels (and, for the built-in exchange, comm's collective) on
// `stream`: no host synchronization, no allocation, no host read of device data, so a step can
// be captured in a CUDA graph (cudaStreamCaptureModeGlobal included) and replayed with new
// seq_lens, block tables and q. The host-side checks (Error naming the argument) cover what is
// host-visible: the view, layer, num_requests against the limits, null pointers, the workspace
// size, comm; device contents are not validated (validate_decode_batch / validate_prefill_batch
// are the synchronous checks for tools and tests): page ids outside the cache are skipped.
// Outputs, exchange records and step status are those of the CPU plans (one difference: a prefill
// gather whose chunk exceeds extents.gather_units still makes its all-gathers here); the
// selections equal the other CUDA entry points' bit for bit (the same kernels).

class DecodePlan {
 public:
  /// As indexcp::DecodePlan; bf16 caches are refused (kUnsupported). The P256/TP2 whole-page
  /// scorer choice follows config.p256_stock_decode.
  DecodePlan(const ResolvedConfig& config, int32_t rank, const DecodeLimits& limits);
  ~DecodePlan();
  DecodePlan(DecodePlan&&) noexcept;
  DecodePlan& operator=(DecodePlan&&) noexcept;

  DecodePath path() const;
  const DecodeLimits& limits() const;
  int32_t world() const;
  int32_t rank() const;
  int32_t head_begin() const;
  int32_t num_heads() const;
  /// Device bytes of workspace (a 16-byte aligned pointer; sub-buffers at 256-byte offsets): the
  /// block scores, the scorer's work plan, and for the exchanging paths one send record and
  /// world() receive records (the built-in exchange's buffers). The plan never reads a byte of it
  /// that the same step did not write, but the exchange copies whole records (rows past the
  /// step's included): zero-fill the workspace once after allocating it if a memory checker
  /// (compute-sanitizer initcheck) watches the program.
  size_t workspace_bytes() const;
  size_t exchange_bytes() const;
  ExchangeLayout exchange() const;
  /// The send record / receive records inside a workspace (for the built-in exchange, or as the
  /// buffers of the engine's own all-gather); null for kReplicated.
  void* send_buffer(void* workspace) const;
  void* recv_buffer(void* workspace) const;
  void check_cache(const CacheView& cache, int32_t layer) const;
  /// True when this rank scores with the whole-page (stock) scorer.
  bool uses_stock_scorer() const;

  /// The whole step on `stream`: out int32 [num_requests * Q, num_heads(), K]; for the
  /// exchanging paths comm must be a device communicator (NCCL, DeviceGroup) of world() ranks
  /// whose collective enqueues on `stream`. status: device uint32 (StepStatus) or null, written
  /// by every run (0 on the replicated path): one word per (layer, rank) keeps every step's.
  void run(const CacheView& cache, int32_t layer, const DeviceDecodeBatch& batch, void* workspace,
           size_t workspace_bytes, int32_t* out, Communicator* comm, uint32_t* status, Stream stream) const;
  /// Split exchange: score and write this rank's record (exchange_bytes(), 8-byte aligned,
  /// device) at `send` on `stream`; the engine then all-gathers world() records on the same
  /// stream with its own communicator and calls merge.
  void publish(const CacheView& cache, int32_t layer, const DeviceDecodeBatch& batch, void* workspace,
               size_t workspace_bytes, void* send, Stream stream) const;
  void merge(const DeviceDecodeBatch& batch, const void* recv, int32_t* out, uint32_t* status,
             Stream stream) const;

  struct Impl;
  const Impl& impl() const { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

class PrefillPlan {
 public:
  PrefillPlan(const ResolvedConfig& config, int32_t rank, const PrefillLimits& limits);
  ~PrefillPlan();
  PrefillPlan(PrefillPlan&&) noexcept;
  PrefillPlan& operator=(PrefillPlan&&) noexcept;

  PrefillPath path() const;
  const PrefillLimits& limits() const;
  int32_t world() const;
  int32_t rank() const;
  int32_t head_begin() const;
  int32_t num_heads() const;
  /// Device bytes of workspace: block scores [max_rows, scored heads, max_pages * P / 128] fp32,
  /// plus kGather: the staging and gathered FP8 transient of one chunk (within the budget) and
  /// the unit lists; kLocalScore: the send and receive records.
  size_t workspace_bytes() const;
  size_t exchange_bytes() const;
  int64_t units_per_chunk() const;
  int64_t gather_chunks(const PrefillExtents& extents) const;
  void check_cache(const CacheView& cache, int32_t layer) const;

  /// out int32 [extents.rows, num_heads(), K] on `stream`. kGather: the unit list of each chunk is
  /// built on the device from seq_lens, query_start and the block table; the number of
  /// all-gathers (gather_chunks) and their sizes come from the host extents, so every rank moves
  /// the same bytes; a chunk with more units than extents.gather_units sets status 2 and gives -1.
  void run(const CacheView& cache, int32_t layer, const DevicePrefillBatch& batch,
           const PrefillExtents& extents, void* workspace, size_t workspace_bytes, int32_t* out,
           Communicator* comm, uint32_t* status, Stream stream) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// ---------------------------------------------------------------------------------------------
// Simulated ranks on one GPU

/// W ranks in one process on the current device; collectives copy device buffers with
/// cudaMemcpyAsync on the caller's stream, ordered across the ranks' streams with events (the
/// host threads meet at the barrier InProcessGroup uses; nothing blocks on the GPU). Ranks that
/// pass different byte counts get an Error on every rank (comm.hpp); abort() makes pending and
/// future collectives throw.
class DeviceGroup {
 public:
  explicit DeviceGroup(int world);  ///< world 1..64, else Error naming world
  /// As ~InProcessGroup: aborts, waits until no rank is inside a collective, then frees the events.
  ~DeviceGroup();
  DeviceGroup(const DeviceGroup&) = delete;
  DeviceGroup& operator=(const DeviceGroup&) = delete;
  int world() const;
  Communicator& comm(int rank);
  void abort();
  /// As InProcessGroup::depart (run_device_ranks calls it when a rank's function returns).
  void depart(int rank);
  struct State;

 private:
  std::unique_ptr<State> state_;
};

/// Runs fn(rank, comm, stream) on `world` host threads (each with its own non-blocking stream on
/// the current device) through a fresh DeviceGroup, synchronizes every stream and joins. The
/// first rank error is rethrown (the group is aborted so that no rank hangs).
void run_device_ranks(int world, const std::function<void(int rank, Communicator& comm, Stream s)>& fn);

// ---------------------------------------------------------------------------------------------
// One layer's decode step over all W ranks of a TP group on one GPU, one stream: capturable in a
// CUDA graph (no host synchronization, no allocation in run()).

/// The decode paths (plan.hpp): kReplicated (every rank scores its owned heads over the
/// replicated cache and selects), kIcp (shards), kDecodeCp (replicated, blocks b % W == r).
using indexcp::DecodePath;

/// Shapes fixed for the life of a DecodeStep (buffers are sized for them).
struct DecodeShape {
  int32_t max_requests = 1;  ///< num_requests of every batch run() sees must be <= this
  int32_t max_pages = 1;     ///< width of the block table (batch.max_pages must equal it)
  int32_t query_len = 1;     ///< Q, 1..16
  int32_t heads = 4;         ///< H; H and W must divide one another
  SelectionParams sel;
  KRounding mode = KRounding::kE4m3;
  ScorePrecision precision = ScorePrecision::kFp32;  ///< indexer_score_precision (not kFp8Mma with kExact)
};

class DecodeStep {
 public:
  /// caches: kIcp: W shards (rank r's cache at index r, shards == W); otherwise one replicated
  /// cache (index 0) shared by every rank. `p256_stock`: at P = 256, W = 2 (shard pages are whole
  /// stock pages) score them with the stock scorer (INDEXCP_P256_STOCK_DECODE); both scorers give
  /// identical bits. Allocates all workspace (cudaMalloc) here.
  DecodeStep(std::vector<CacheView> caches, int32_t world, int32_t layer,
             const DecodeShape& shape, DecodePath path, bool p256_stock = true);
  /// The same over owners (their views; null entries are refused by index).
  DecodeStep(const std::vector<const DeviceCache*>& caches, int32_t world, int32_t layer,
             const DecodeShape& shape, DecodePath path, bool p256_stock = true);
  ~DecodeStep();
  DecodeStep(const DecodeStep&) = delete;
  DecodeStep& operator=(const DecodeStep&) = delete;

  /// Enqueues the whole step (all ranks; the exchange is a device-to-device copy of candidate
  /// records between the ranks' buffers) on `stream`. batch: device pointers; num_requests <=
  /// max_requests, max_pages == shape.max_pages, query_len and heads as the shape says.
  /// out int32 [num_requests * Q, H, K]: every head, from its owner rank. Padded requests
  /// (seq_len 0) give -1. No validation of device contents (see validate_decode_batch).
  void run(const DecodeBatch& batch, int32_t* out, Stream stream);

  /// The pieces of one rank (for timing and for tests): scoring (plus publish into the shared
  /// candidate buffer for kIcp / kDecodeCp), then selection (kReplicated) or merge of the owned
  /// heads from the shared candidate buffer. out as for run() (rank r writes its heads).
  void enqueue_score(int32_t rank, const DecodeBatch& batch, Stream stream);
  void enqueue_publish(int32_t rank, const DecodeBatch& batch, Stream stream);
  void enqueue_select(int32_t rank, const DecodeBatch& batch, int32_t* out, Stream stream);

  /// Bytes of index cache rank r reads per step at the given seq_lens (host array).
  int64_t bytes_read(int32_t rank, const std::vector<int32_t>& seq_lens) const;
  int64_t workspace_bytes() const;
  /// True when rank r's scoring uses the stock (whole 128-row page) scorer.
  bool uses_stock_scorer(int32_t rank) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace indexcp::cuda
