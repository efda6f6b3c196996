// indexcp: one rank's decode step and prefill chunk as plan / run (the engine's form;
// docs/embedding.md section 7, spec: indexer.md sections 3-5).
//
// A plan is made once per captured graph (or once per shape bucket of an engine) from the
// resolved config, this process's rank and the maximum shapes of the steps it will run. It
// reports its workspace size (computed by the same function that lays the workspace out), does
// every one-time setup, and sizes every exchange for those maxima, so that all ranks move the same
// bytes in every step whatever the step's batch. `run` then takes a cache view, a batch whose
// per-step values live in the memory of the backend, caller-owned workspace and output, and (on
// the CUDA backend) the stream: it does no host synchronization, no allocation and no host read
// of per-step values, so it can be captured in a CUDA graph and replayed with new seq_lens, block
// tables and q in the same buffers.
//
// This header holds what both backends share (the paths, the limits, the batch types, the
// exchange record and its step signature) and the CPU backend's plans; include/indexcp/cuda.hpp
// has the CUDA plans, with the same names and arguments plus the stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "indexcp/cache_view.hpp"
#include "indexcp/comm.hpp"
#include "indexcp/config.hpp"
#include "indexcp/icp.hpp"
#include "indexcp/indexer.hpp"
#include "indexcp/layout.hpp"

namespace indexcp {

// ---------------------------------------------------------------------------------------------
// The path a resolved config runs (the one owner of this decision: the plans, TpIndexer and the
// tools all ask these two functions).

/// How a decode step of one rank is computed (indexer.md sections 4-5).
enum class DecodePath {
  kReplicated,  ///< replicated cache: score the rank's owned heads, select
  kIcp,         ///< sharded cache: score all heads over the rank's rows, publish, exchange, merge
  kDecodeCp,    ///< replicated cache, blocks b % W == rank scored, publish, exchange, merge
};
/// How a prefill chunk of one rank is computed.
enum class PrefillPath {
  kReplicated,  ///< replicated cache: score the owned heads (E4M3 keys), select
  kGather,      ///< sharded: stage rows to FP8, all-gather in budgeted chunks, score owned heads
  kLocalScore,  ///< sharded: score all heads over own rows, publish, exchange, merge
};
/// sharding -> kIcp; else decode_cp at W > 1 -> kDecodeCp; else kReplicated.
DecodePath decode_path(const ResolvedConfig& config);
/// sharding with gather -> kGather, with local_score -> kLocalScore; else kReplicated.
PrefillPath prefill_path(const ResolvedConfig& config);
const char* to_string(DecodePath path);
const char* to_string(PrefillPath path);

// ---------------------------------------------------------------------------------------------
// Limits and batches

/// The maximum shapes a decode plan serves (fixed for its life; buffers and exchanges are sized
/// for them).
struct DecodeLimits {
  int32_t max_requests = 1;  ///< every run's num_requests <= this (1 .. 2^20)
  int32_t max_pages = 1;     ///< width of the block table: int32 entries per request (1 .. 2^24)
  int32_t query_len = 1;     ///< Q, 1..16: rows per request (speculative decode)
  int32_t heads = 4;         ///< H: index heads of q; H and W must divide one another
  SelectionParams sel;       ///< K and the forced init blocks (indexer.md section 4)
  /// max_requests * query_len.
  int64_t max_rows() const { return static_cast<int64_t>(max_requests) * query_len; }
};

/// One decode step's per-step values, in the memory of the plan's backend (CUDA: device memory
/// of the current device, read when the kernels run; CPU: host memory). Distinct from the host
/// batch DecodeBatch, whose pointers the synchronous tools read on the host.
///   q            uint8 E4M3 [num_requests * Q, H, 128] (row b*Q + i at position seq_lens[b] - Q + i)
///   block_table  int32 [num_requests, limits.max_pages] physical page ids; entries past a
///                request's ceil(seq_len / P) pages are ignored
///   seq_lens     int32 [num_requests], KV length including this step's tokens; 0 = padding
///                (the request's rows select nothing: -1)
///   num_requests a host value: the grid shape, fixed for a captured graph (pad the batch with
///                seq_len 0 requests); 0 .. limits.max_requests
struct DeviceDecodeBatch {
  const uint8_t* q = nullptr;
  const int32_t* block_table = nullptr;
  const int32_t* seq_lens = nullptr;
  int32_t num_requests = 0;
};

/// The maximum shapes a prefill plan serves.
struct PrefillLimits {
  int32_t max_requests = 1;  ///< every run's num_requests <= this
  int32_t max_pages = 1;     ///< width of the block table
  int64_t max_rows = 1;      ///< query tokens of one chunk, summed over its requests (>= 1)
  int32_t heads = 4;         ///< H
  SelectionParams sel;
  /// kGather: the most (request, page) units a chunk gathers (extents.gather_units); 0 means
  /// max_requests * max_pages. With the budget it sizes the FP8 transient of the workspace.
  int64_t max_gather_units = 0;
};

/// One prefill chunk's per-token values, in the memory of the plan's backend:
///   q            uint8 E4M3 [rows, H, 128]; row query_start[b] + i of request b is at position
///                seq_lens[b] - T_b + i, T_b = query_start[b+1] - query_start[b]
///   block_table  int32 [num_requests, limits.max_pages]
///   seq_lens     int32 [num_requests] (KV length including the chunk's tokens)
///   query_start  int32 [num_requests + 1], [0] = 0, non-decreasing, T_b <= seq_lens[b]
///   num_requests host value, 0 .. limits.max_requests
struct DevicePrefillBatch {
  const uint8_t* q = nullptr;
  const int32_t* block_table = nullptr;
  const int32_t* seq_lens = nullptr;
  const int32_t* query_start = nullptr;
  int32_t num_requests = 0;
};

/// The host values a prefill run needs (an engine's scheduler knows them when it forms the
/// chunk; prefill_extents computes them from host copies of the metadata). Every rank must pass
/// the same values (they size the exchanges).
struct PrefillExtents {
  int64_t rows = 0;                  ///< query_start[num_requests]: 0 .. limits.max_rows
  int32_t max_rows_per_request = 1;  ///< an upper bound on T_b (>= 1): the scorer's grid
  int64_t gather_units = 0;          ///< kGather: an upper bound on the (request, page) units
                                     ///< the chunk gathers (the pages of each request's
                                     ///< historical blocks, for requests with T_b > 0)
};
/// The extents of a host batch (its pointers are host memory; page_size P). Exact values.
/// Errors as prefill_rows' metadata checks (names query_start / seq_lens).
PrefillExtents prefill_extents(const PrefillBatch& host_batch, int32_t page_size);

// ---------------------------------------------------------------------------------------------
// The exchange record (indexer.md section 5, step 3) and its step signature

/// Size of the signature a rank appends after its candidate records.
inline constexpr size_t kStepSignatureBytes = 64;
/// What every rank writes after its candidates (16 uint32): a check that all ranks ran the same
/// step. v[0] = 0x53504349 ("ICPS"), v[1] = 1 (version), v[2] = num_requests, v[3] = Q or 0
/// (prefill), v[4] = H, v[5] = ranked slots (K - 1 - init), v[6] = max_pages, v[7] = the record's
/// candidate rows (the plan's max_rows), v[8] = hash of seq_lens, v[9] = hash of query_start (0
/// for decode), v[10] = prefill rows (0 for decode); v[11..15] = 0. The hash: sum over i of
/// mix32(i * 0x9E3779B9 ^ value_i) mod 2^32 with mix32 the murmur3 finalizer (step_signature_hash).
struct StepSignature {
  uint32_t v[16] = {};
};
static_assert(sizeof(StepSignature) == kStepSignatureBytes, "step signature: 64 bytes");
/// The murmur3 32-bit finalizer (fmix32) of the step signature's hash.
INDEXCP_HD uint32_t step_signature_fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}
/// Term i of the hash: fmix32((uint32)i * 0x9E3779B9 ^ (uint32)v). Inline (host and device) so
/// that both backends sum the very same terms.
INDEXCP_HD uint32_t step_signature_term(int64_t i, int32_t v) {
  return step_signature_fmix32((static_cast<uint32_t>(i) * 0x9E3779B9u) ^ static_cast<uint32_t>(v));
}
/// The hash of v[8] / v[9] over `n` int32 values (host memory): the sum of step_signature_term
/// over i in [0, n) mod 2^32 (0 for n <= 0; `values` may then be null).
uint32_t step_signature_hash(const int32_t* values, int64_t n);

/// The layout of one rank's exchange record. Candidate (row, head, j) of the rank lies at record
/// offset ((row * H + head) * ranked + j) * 8 for row < the step's rows (later rows up to
/// `rows` hold stale bytes, never read); the signature at `signature_offset`. An all-gather of
/// the records puts rank p's record at p * record_bytes.
struct ExchangeLayout {
  int64_t rows = 0;              ///< candidate rows per record (the plan's max rows)
  int32_t heads = 0;             ///< H
  int32_t ranked = 0;            ///< K - 1 - init
  size_t candidate_bytes = 0;    ///< rows * heads * ranked * 8
  size_t signature_offset = 0;   ///< == candidate_bytes
  size_t record_bytes = 0;       ///< candidate_bytes + kStepSignatureBytes (a multiple of 8)
};
ExchangeLayout exchange_layout(int64_t rows, int32_t heads, const SelectionParams& sel);

/// The step status a merge writes (uint32, in the memory of the backend), every step:
enum class StepStatus : uint32_t {
  kOk = 0,
  kRanksDisagree = 1,         ///< the ranks' step signatures differ: every output of the step is -1
  kGatherUnitsExceeded = 2,   ///< prefill gather: the chunk has more units than extents.gather_units
                              ///< (the units past it were not gathered: outputs -1)
};
/// "" for kOk, else the message of the synchronous paths' Error (names the call).
std::string step_status_message(uint32_t status, const char* call);

// ---------------------------------------------------------------------------------------------
// The CPU backend's plans. Pointers are host memory. The CPU backend is the reference: its run
// allocates host temporaries (capture does not apply), but it takes the same arguments, sizes
// the same exchange records and writes the same outputs as the CUDA plans (the GPU tests compare
// the two).

/// One rank's decode step. Built from a resolved config (check_resolved_config), this process's
/// rank in 0 .. tp-1 and the limits. Errors (kInvalidArgument) name the argument: rank,
/// limits.max_requests / max_pages / query_len / heads (with tp: check_heads_tp), limits.sel;
/// bf16 is refused by the CUDA plan only.
class DecodePlan {
 public:
  DecodePlan(const ResolvedConfig& config, int32_t rank, const DecodeLimits& limits);
  ~DecodePlan();
  DecodePlan(DecodePlan&&) noexcept;
  DecodePlan& operator=(DecodePlan&&) noexcept;

  DecodePath path() const;
  const DecodeLimits& limits() const;
  int32_t world() const;
  int32_t rank() const;
  /// The heads this rank's output holds: [head_begin(), head_begin() + num_heads()) of H
  /// (owned_heads; every head when W = 1).
  int32_t head_begin() const;
  int32_t num_heads() const;
  /// Bytes of workspace run / publish / merge need (16-byte aligned pointer).
  size_t workspace_bytes() const;
  /// Bytes of one rank's exchange record (0 for kReplicated: nothing is exchanged).
  size_t exchange_bytes() const;
  ExchangeLayout exchange() const;
  /// The cache a run must be given: layout (dtype, P, shards) and rank as the config says.
  /// Throws Error naming `cache` when the view does not match (host view, other layout or rank,
  /// layer out of range).
  void check_cache(const CacheView& cache, int32_t layer) const;

  /// The whole step: out int32 [num_requests * Q, num_heads(), K] (ascending ids, -1 padding).
  /// kReplicated: score and select (comm unused, may be null). kIcp / kDecodeCp: publish into
  /// the workspace's send record, all-gather the records through `comm` (world() ranks, this
  /// rank's communicator), merge. status: uint32 (StepStatus), written by the merge; may be null.
  /// Host-side checks only (Error naming the argument): the cache, layer, num_requests above
  /// limits.max_requests, null pointers, the workspace size, comm's world and rank.
  void run(const CacheView& cache, int32_t layer, const DeviceDecodeBatch& batch, void* workspace,
           size_t workspace_bytes, int32_t* out, Communicator* comm, uint32_t* status = nullptr) const;
  /// The split exchange, first half: score and write this rank's record (exchange_bytes(),
  /// 8-byte aligned) at `send`. kIcp / kDecodeCp only (Error for kReplicated).
  void publish(const CacheView& cache, int32_t layer, const DeviceDecodeBatch& batch, void* workspace,
               size_t workspace_bytes, void* send) const;
  /// Second half: `recv` holds world() records (rank p's at p * exchange_bytes()), as an
  /// all-gather of every rank's `send` gives; writes out and status as run.
  void merge(const DeviceDecodeBatch& batch, const void* recv, int32_t* out, uint32_t* status = nullptr) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// One rank's prefill chunk. kReplicated exchanges nothing; kLocalScore exchanges as the decode
/// plan (records of limits.max_rows rows); kGather all-gathers FP8 rows through `comm` in chunks
/// whose staging + gathered bytes fit the config's indexer_prefill_gather_budget_mib. The CUDA
/// plan makes gather_chunks(extents) all-gathers (a host value, the same on every rank); this CPU
/// reference plan gathers the chunk's exact units in chunks of the same budget (extents.gather_units
/// below them gives status 2 and -1, as on the GPU). extents.max_rows_per_request must bound the
/// longest request's rows: the CPU plan refuses a smaller value, the CUDA plan cannot see it (its
/// selections would be wrong).
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
  size_t workspace_bytes() const;
  /// kLocalScore: one rank's record (as DecodePlan); kGather: the largest chunk's FP8 bytes per
  /// rank; kReplicated: 0.
  size_t exchange_bytes() const;
  /// kGather: (request, page) units per chunk (from the budget, at most the limits' units).
  int64_t units_per_chunk() const;
  /// kGather: the all-gathers a run with these extents makes (ceil(gather_units / units_per_chunk)).
  int64_t gather_chunks(const PrefillExtents& extents) const;
  void check_cache(const CacheView& cache, int32_t layer) const;

  /// out int32 [extents.rows, num_heads(), K]. Errors (host-side): as DecodePlan::run, plus
  /// extents (rows above limits.max_rows, max_rows_per_request < 1, gather_units < 0).
  void run(const CacheView& cache, int32_t layer, const DevicePrefillBatch& batch,
           const PrefillExtents& extents, void* workspace, size_t workspace_bytes, int32_t* out,
           Communicator* comm, uint32_t* status = nullptr) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace indexcp
