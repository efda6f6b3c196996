// Decode of one rank, the host API (cuda.hpp): scores, select, ICP, decode CP, the one-rank plans.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common.cuh"
#include "core/batch.hpp"
#include "indexcp/cuda.hpp"
#include "kernels.cuh"
#include "launches.cuh"
#include "plan.cuh"
#include "comm/rank_barrier.hpp"
#include "boundary.cuh"

namespace indexcp::cuda {

using namespace detail;

// ---- decode ---------------------------------------------------------------------------------

void decode_scores(const CacheView& cache, int32_t layer, const DecodeBatch& batch, int32_t h0, int32_t nh,
                   KRounding mode, float* out, Stream stream, bool validate, ScorePrecision precision) {
  check_layer(cache, layer);
  check_not_bf16(cache);
  check_decode_shape(batch);
  check_head_range(batch.heads, h0, nh);
  check_score_mode(cache.layout().dtype, mode, precision);  // (also in decode_score_launch; here before out is filled)
  if (validate) validate_decode_batch(batch, cache.num_pages(), cache.layout().page_size, stream);
  const int64_t mb = max_blocks_of(batch.max_pages, cache.layout());
  const int64_t n = batch.rows() * nh * mb;
  INDEXCP_REQUIRE(n == 0 || out != nullptr, "out is null");
  launch_fill_neg_inf(out, n, cs(stream));
  launch_score(decode_score_launch(cache, layer, batch, h0, nh, mode, precision, out, BlockFilter{}, true), cs(stream));
}

void decode_select(const CacheView& cache, int32_t layer, const DecodeBatch& batch, int32_t h0, int32_t nh,
                   const SelectionParams& sel, KRounding mode, int32_t* out, Stream stream, bool validate,
                   ScorePrecision precision) {
  sel.validate();
  check_layer(cache, layer);
  check_not_bf16(cache);
  INDEXCP_REQUIRE(cache.layout().shards == 1, "cache is sharded (shards = " + std::to_string(cache.layout().shards) +
                                          "); decode_select needs a replicated cache, use icp_decode");
  check_decode_shape(batch);
  check_head_range(batch.heads, h0, nh);
  if (validate) validate_decode_batch(batch, cache.num_pages(), cache.layout().page_size, stream);
  const int64_t rows = batch.rows();
  if (rows == 0) return;
  INDEXCP_REQUIRE(out != nullptr, "out is null");
  const cudaStream_t st = cs(stream);
  const int64_t mb = max_blocks_of(batch.max_pages, cache.layout());
  Tmp<float> scores(static_cast<size_t>(rows) * nh * mb, st);
  launch_score(decode_score_launch(cache, layer, batch, h0, nh, mode, precision, scores.get(), BlockFilter{}, true), st);
  launch_select(select_launch(decode_rows_view(batch), scores.get(), mb, nh, sel, out, nh, 0), st);
}

void prefill_select(const CacheView& cache, int32_t layer, const PrefillBatch& batch, int32_t h0, int32_t nh,
                    const SelectionParams& sel, int32_t* out, Stream stream, ScorePrecision precision) {
  sel.validate();
  check_layer(cache, layer);
  check_not_bf16(cache);
  INDEXCP_REQUIRE(cache.layout().shards == 1, "cache is sharded (shards = " + std::to_string(cache.layout().shards) +
                                          "); prefill_select needs a replicated cache, use prefill_gather");
  check_head_range(batch.heads, h0, nh);
  const HostPrefill hp = read_prefill(batch, cache.num_pages(), cache.layout().page_size, cs(stream));
  const int64_t rows = static_cast<int64_t>(hp.rows.size());
  if (rows == 0) return;
  INDEXCP_REQUIRE(out != nullptr, "out is null");
  const cudaStream_t st = cs(stream);
  const int64_t mb = max_blocks_of(batch.max_pages, cache.layout());
  Tmp<float> scores(static_cast<size_t>(rows) * nh * mb, st);
  const ScoreLaunch sl = prefill_score_launch(cache, layer, batch, rows, hp.max_rows_per_request, h0, nh, precision,
                                              scores.get());
  launch_score(sl, st);
  launch_select(select_launch(sl.rows, scores.get(), mb, nh, sel, out, nh, 0), st);
  check(cudaStreamSynchronize(st), "cudaStreamSynchronize (prefill_select)");
}

void prefill_scores(const CacheView& cache, int32_t layer, const PrefillBatch& batch, int64_t rows,
                    int32_t max_rows_per_request, int32_t h0, int32_t nh, float* out, Stream stream,
                    ScorePrecision precision) {
  check_layer(cache, layer);
  check_not_bf16(cache);
  check_score_mode(cache.layout().dtype, KRounding::kE4m3, precision);  // before out is filled
  INDEXCP_REQUIRE(cache.layout().shards == 1, "cache is sharded (shards = " + std::to_string(cache.layout().shards) +
                                                  "); prefill_scores needs a replicated cache");
  INDEXCP_REQUIRE(batch.heads >= 1 && batch.heads <= 64, "heads = " + std::to_string(batch.heads) + " is out of range 1..64");
  check_head_range(batch.heads, h0, nh);
  INDEXCP_REQUIRE(rows >= 0, "rows = " + std::to_string(rows) + " must be >= 0");
  INDEXCP_REQUIRE(max_rows_per_request >= 1,
                  "max_rows_per_request = " + std::to_string(max_rows_per_request) + " must be >= 1");
  if (rows == 0) return;
  INDEXCP_REQUIRE(out != nullptr && batch.q != nullptr && batch.query_start != nullptr && batch.seq_lens != nullptr &&
                      batch.block_table != nullptr,
                  "out or a batch pointer is null");
  ScoreLaunch sl = prefill_score_launch(cache, layer, batch, rows, max_rows_per_request, h0, nh, precision, out);
  // -Inf only where the scorer writes nothing (not historical, out-of-range page ids): the scorer
  // writes every other entry, so the fill writes a fraction of out, in the GEMM-shaped scorer or
  // just before the tile scorer (launch_score; bench/NOTES.md v27, v28)
  sl.fill_unscored = true;
  launch_score(sl, cs(stream));
}

// The argument checks of the collective decode paths (icp_decode: a rank shard; decode CP: a
// replicated cache), in the order their errors are documented.
static void check_collective_decode(Communicator& comm, const CacheView& cache, bool sharded, int32_t layer,
                             const DecodeBatch& batch, const SelectionParams& sel, const int32_t* out, bool validate,
                             Stream stream) {
  sel.validate();
  check_layer(cache, layer, sharded ? "shard" : "cache");
  check_not_bf16(cache);
  check_group(comm, cache, sharded);
  check_decode_shape(batch);
  check_heads_tp(batch.heads, comm.world());
  if (validate) validate_decode_batch(batch, cache.num_pages(), cache.layout().page_size, stream);
  INDEXCP_REQUIRE(batch.rows() == 0 || out != nullptr, "out is null");
}

namespace {

// The per-rank entry points are one-rank plans for the batch's own shape, with stream-ordered
// workspace (the plan's run enqueues the same launches an engine's plan does).
DecodeLimits limits_of(const DecodeBatch& b, const SelectionParams& sel) {
  DecodeLimits l;
  l.max_requests = std::max(1, b.num_requests);
  l.max_pages = std::max(1, b.max_pages);
  l.query_len = b.query_len;
  l.heads = b.heads;
  l.sel = sel;
  return l;
}

// validate (the synchronous form): the step status is read back and a disagreement of the ranks
// is an Error on every rank; otherwise the call only enqueues (a disagreement gives -1 outputs).
void run_decode_plan(const DecodeSpec& spec, Communicator& comm, const CacheView& cache, int32_t layer,
                     const DecodeBatch& batch, int32_t* out, bool validate, cudaStream_t st, const char* call) {
  check_k_rounding(spec.mode, "mode");
  if (batch.rows() == 0) return;
  const DecodePlan::Impl plan(spec);
  Tmp<uint8_t> ws(plan.ws.total, st);
  // whole records are exchanged: the records' stale rows zero (initcheck)
  check(cudaMemsetAsync(ws.get() + plan.ws.send, 0, plan.ws.total - plan.ws.send, st), "cudaMemsetAsync (records)");
  Tmp<uint32_t> status(1, st);
  const DeviceDecodeBatch d{batch.q, batch.block_table, batch.seq_lens, batch.num_requests};
  plan.run(cache, layer, d, ws.get(), plan.ws.total, out, &comm, status.get(), st);
  if (!validate) return;
  uint32_t h = 0;
  check(cudaMemcpyAsync(&h, status.get(), sizeof(h), cudaMemcpyDeviceToHost, st), "cudaMemcpyAsync (step status)");
  comm.synchronize(st);  // bounded by the communicator's watchdog (NCCL)
  check(cudaStreamSynchronize(st), "cudaStreamSynchronize (step status)");
  if (h != 0) throw Error(ErrorCode::kRuntime, step_status_message(h, call));
}

}  // namespace

void icp_decode(Communicator& comm, const CacheView& shard, int32_t layer, const DecodeBatch& batch,
                const SelectionParams& sel, KRounding mode, int32_t* out, Stream stream, bool validate,
                bool p256_stock, ScorePrecision precision) {
  check_collective_decode(comm, shard, true, layer, batch, sel, out, validate, stream);
  DecodeSpec sp;
  sp.path = DecodePath::kIcp;
  sp.world = comm.world();
  sp.rank = comm.rank();
  sp.layout = shard.layout();
  sp.mode = mode;
  sp.precision = precision;
  sp.p256_stock = p256_stock;
  sp.limits = limits_of(batch, sel);
  run_decode_plan(sp, comm, shard, layer, batch, out, validate, cs(stream), "icp_decode");
}

void decode_cp_replicated(Communicator& comm, const CacheView& cache, int32_t layer, const DecodeBatch& batch,
                          const SelectionParams& sel, KRounding mode, int32_t* out, Stream stream, bool validate,
                          ScorePrecision precision) {
  check_collective_decode(comm, cache, false, layer, batch, sel, out, validate, stream);
  DecodeSpec sp;
  sp.path = DecodePath::kDecodeCp;
  sp.world = comm.world();
  sp.rank = comm.rank();
  sp.layout = cache.layout();
  sp.mode = mode;
  sp.precision = precision;
  sp.limits = limits_of(batch, sel);
  run_decode_plan(sp, comm, cache, layer, batch, out, validate, cs(stream), "decode_cp_replicated");
}

}  // namespace indexcp::cuda
