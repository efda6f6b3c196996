// indexcp: one layer's indexer over the W ranks of a TP group, on a backend.
//
// This is what the command line, the replay and the end-to-end tests drive. Simulated ranks
// (make_cpu_tp_indexer, make_cuda_tp_indexer): it owns the W rank caches (replicated or sharded,
// as the resolved config says), runs each collective step on W threads through an in-process
// communicator, and returns every head's selection taken from the head's owner rank. One rank of
// a group of processes (make_cuda_rank_indexer): it owns this process's rank cache, exchanges
// through the caller's communicator (NCCL) and all-gathers the heads' selections. Backends: "cpu"
// (this library) and "cuda" (the CUDA backend, when built).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "indexcp/config.hpp"
#include "indexcp/indexer.hpp"

namespace indexcp {

class Communicator;  // comm.hpp

/// Timing and traffic of one step.
struct StepStats {
  double wall_us = 0;            ///< wall time of the whole step (all ranks, in parallel)
  double us_per_rank = 0;        ///< mean over ranks of each rank's own busy time
  int64_t bytes_exchanged = 0;   ///< bytes each rank contributed to collectives
  int64_t gather_reserved_bytes = 0;  ///< prefill gather transient reserved per rank
  /// How us_per_rank was measured, in words (the CLI prints it under its table): e.g. "CUDA graph
  /// replays of each rank's plan" or "host wall time of each rank's thread".
  std::string timing;
};

/// All ranks of one TP group for one layer.
class TpIndexer {
 public:
  virtual ~TpIndexer() = default;
  /// "cpu" or "cuda".
  virtual std::string backend() const = 0;
  virtual const ResolvedConfig& config() const = 0;
  /// Inserts keys (fp32 [n, 128]) at slots (int64 [n], -1 skips) into every rank's cache (each
  /// rank writes what it owns). Errors as insert_keys.
  virtual void insert(const float* keys, const int64_t* slot_mapping, int64_t n,
                      float encode_scale = 1.0f) = 0;
  /// One decode step through the configured path (replicated, ICP over shards, or decode CP).
  /// Returns int32 [rows, H, K], each head from its owner rank.
  virtual std::vector<int32_t> decode(const DecodeBatch& batch, const SelectionParams& sel,
                                      StepStats* stats = nullptr) = 0;
  /// One prefill batch through the configured path (replicated, gather or local_score).
  virtual std::vector<int32_t> prefill(const PrefillBatch& batch, const SelectionParams& sel,
                                       StepStats* stats = nullptr) = 0;
  /// Replicated block scores of heads [0, H) for decode rows (for reports; fp32
  /// [rows, H, max_pages * P / 128], -Inf where no score exists). Requires an unsharded cache.
  virtual std::vector<float> decode_scores(const DecodeBatch& batch) = 0;
  /// Bytes of index cache per rank.
  virtual int64_t cache_bytes_per_rank() const = 0;
};

/// Checks, once per group, that every rank was given the same effective configuration and cache
/// size (config.hpp, RankAgreement): every rank of `comm` calls it with its own values, before its
/// first collective call of icp.hpp. `comm` moves host buffers (InProcessGroup); a group on device
/// buffers (NCCL, DeviceGroup) uses cuda::check_rank_agreement. On every rank: returns when all
/// agree; otherwise throws Error (kInvalidArgument) naming the field and two ranks' values. A rank
/// whose own inputs are refused (check_resolved_config, num_pages <= 0, comm.world() != tp) throws
/// its own error, and the others "rank r ... refused its own configuration".
void check_rank_agreement(Communicator& comm, const ResolvedConfig& config, int64_t num_pages);

/// The CPU backend: W caches of num_pages pages (one layer). Errors as resolve_config and
/// IndexCache.
std::unique_ptr<TpIndexer> make_cpu_tp_indexer(const ResolvedConfig& config, int64_t num_pages);

/// The CUDA backend on the current device (simulated ranks on one GPU), or nullptr-free Error
/// (kUnsupported) when the library was built without CUDA or no GPU is present.
std::unique_ptr<TpIndexer> make_cuda_tp_indexer(const ResolvedConfig& config, int64_t num_pages);

/// One rank of a TP group whose ranks are separate processes, one GPU each (`indexcp launch`,
/// nccl.hpp): this process is rank comm.rank() of comm.world() == config.engine.tp, on the
/// current CUDA device, and keeps only its own cache (its shard rows with sharding on, a full
/// replicated copy with sharding off). The ranks exchange through `comm`, which must outlive the
/// indexer. Every call is collective: every rank calls it with the same arguments in the same
/// order; a refused argument is refused on every rank alike (the checks are the same). decode and
/// prefill return the whole selection int32 [rows, H, K] on every rank (each rank's owned heads,
/// all-gathered through `comm`). StepStats: wall_us and us_per_rank are this rank's busy time,
/// bytes_exchanged what this rank sent during the step (not counting the selection all-gather).
/// Errors: kUnsupported without the CUDA backend or a GPU, or for bf16; kInvalidArgument when
/// comm.world() differs from config.engine.tp; kRuntime from the communicator (a peer failed).
std::unique_ptr<TpIndexer> make_cuda_rank_indexer(const ResolvedConfig& config, int64_t num_pages, Communicator& comm);

/// True when the CUDA backend is built in and a GPU is visible.
bool cuda_available();

/// True when this build has the CUDA backend (whether or not a GPU is visible).
bool built_with_cuda();

/// "cpu" | "cuda" | "auto" (cuda when available). Errors name --backend.
std::unique_ptr<TpIndexer> make_tp_indexer(const std::string& backend, const ResolvedConfig& config,
                                           int64_t num_pages);

}  // namespace indexcp
