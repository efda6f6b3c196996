// The CUDA plans' internals (plan.cu): one rank's decode step as a spec plus the launches it
// enqueues, shared by cuda::DecodePlan (one rank per process) and cuda::DecodeStep (W ranks
// simulated on one GPU, one stream).
#pragma once

#include <cstddef>
#include <cstdint>

#include "indexcp/cuda.hpp"
#include "kernels.cuh"

namespace indexcp::cuda {

/// What a decode plan was made for (from a ResolvedConfig, or from DecodeStep's arguments).
struct DecodeSpec {
  DecodePath path = DecodePath::kReplicated;
  int32_t world = 1, rank = 0;
  PageLayout layout;           ///< the layout of the cache every run is given
  KRounding mode = KRounding::kE4m3;
  ScorePrecision precision = ScorePrecision::kFp32;  ///< indexer_score_precision
  bool p256_stock = true;      ///< the whole-page scorer at P256 / 2 shards
  DecodeLimits limits;
};

/// The offsets of a decode plan's workspace, computed by the one function that lays it out.
struct DecodeWorkspace {
  size_t scores = 0, plan = 0, send = 0, recv = 0, total = 0;
};

struct DecodePlan::Impl {
  DecodeSpec sp;
  int32_t h0 = 0, nh = 1;              ///< owned heads (the output)
  int32_t score_h0 = 0, score_nh = 1;  ///< scored heads (replicated: owned; else all)
  int64_t max_rows = 0, max_blocks = 0;
  ExchangeLayout ex;
  DecodeWorkspace ws;
  bool stock = true;
  BlockFilter filter;

  explicit Impl(const DecodeSpec& spec);
  bool exchanges() const { return sp.path != DecodePath::kReplicated; }
  void check_cache(const CacheView& cache, int32_t layer) const;
  void check_batch(const DeviceDecodeBatch& b) const;
  void check_workspace(const void* workspace, size_t bytes) const;
  DecodeBatch as_batch(const DeviceDecodeBatch& b) const;
  float* scores(void* workspace) const;
  /// The checks and launches of DecodePlan::run.
  void run(const CacheView& cache, int32_t layer, const DeviceDecodeBatch& b, void* workspace, size_t workspace_bytes,
           int32_t* out, Communicator* comm, uint32_t* status, cudaStream_t st) const;
  // the launches of one step (no checks)
  void enqueue_score(const CacheView& cache, int32_t layer, const DeviceDecodeBatch& b, void* workspace,
                     cudaStream_t st) const;
  void enqueue_publish(const CacheView& cache, const DeviceDecodeBatch& b, void* workspace, void* send,
                       cudaStream_t st) const;
  /// kReplicated: select the owned heads into out [rows, out_heads, K] at head offset out_h0.
  void enqueue_select(const DeviceDecodeBatch& b, void* workspace, int32_t* out, int32_t out_heads, int32_t out_h0,
                      cudaStream_t st) const;
  void enqueue_merge(const DeviceDecodeBatch& b, const void* recv, int32_t* out, int32_t out_heads, int32_t out_h0,
                     uint32_t* status, cudaStream_t st) const;
};

/// What a prefill plan was made for.
struct PrefillSpec {
  PrefillPath path = PrefillPath::kReplicated;
  int32_t world = 1, rank = 0;
  PageLayout layout;
  PrefillLimits limits;
  int64_t budget = 0;  ///< indexer_prefill_gather_budget_mib in bytes
  ScorePrecision precision = ScorePrecision::kFp32;  ///< indexer_score_precision
};

struct PrefillPlan::Impl {
  explicit Impl(const PrefillSpec& spec);
  PrefillPath path = PrefillPath::kReplicated;
  int32_t world = 1, rank = 0;
  PageLayout layout;
  PrefillLimits limits;
  int64_t budget = 0;
  ScorePrecision precision = ScorePrecision::kFp32;
  int32_t h0 = 0, nh = 1, score_h0 = 0, score_nh = 1;
  int64_t max_blocks = 0, cap = 0;  // cap: units per chunk (kGather)
  int64_t max_units = 0;             // kGather: the most units of one run
  ExchangeLayout ex;
  struct {
    size_t scores = 0, plan = 0, send = 0, recv = 0, staging = 0, gathered = 0, phys = 0, bt_local = 0,
           unit_first = 0, status = 0, total = 0;
  } ws;

  bool exchanges() const { return path == PrefillPath::kLocalScore; }
  /// kGather: the all-gathers of a run with these extents.
  int64_t chunks(const PrefillExtents& e) const;
  /// The checks and launches of PrefillPlan::run.
  void run(const CacheView& cache, int32_t layer, const DevicePrefillBatch& batch, const PrefillExtents& e,
           void* workspace, size_t workspace_bytes, int32_t* out, Communicator* comm, uint32_t* status,
           cudaStream_t st) const;
  PrefillBatch as_batch(const DevicePrefillBatch& b) const {
    PrefillBatch d;
    d.q = b.q;
    d.heads = limits.heads;
    d.block_table = b.block_table;
    d.num_requests = b.num_requests;
    d.max_pages = limits.max_pages;
    d.seq_lens = b.seq_lens;
    d.query_start = b.query_start;
    return d;
  }
};

}  // namespace indexcp::cuda
