// Prefill of one rank, the host API (cuda.hpp): FP8 staging, gather and local_score, the one-rank
// plans.
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

// ---- prefill under ICP ------------------------------------------------------------------------

void stage_fp8(const CacheView& shard, int32_t layer, const int32_t* pages, int64_t num_pages, uint8_t* out,
               Stream stream, bool validate) {
  check_layer(shard, layer, "shard");
  const PageLayout& l = shard.layout();
  INDEXCP_REQUIRE(l.dtype != KvDtype::kBf16, "shard is a bf16 cache; FP8 staging needs fp8 or nvfp4");
  INDEXCP_REQUIRE(num_pages >= 0, "num_pages = " + std::to_string(num_pages) + " must be >= 0");
  INDEXCP_REQUIRE(num_pages == 0 || (pages != nullptr && out != nullptr), "pages or out is null");
  if (validate && num_pages > 0) {
    const auto p = to_host(pages, static_cast<size_t>(num_pages), "pages (device to host)", cs(stream));
    for (int64_t i = 0; i < num_pages; ++i)
      INDEXCP_REQUIRE(p[i] >= 0 && p[i] < shard.num_pages(), "pages[" + std::to_string(i) + "] = " + std::to_string(p[i]) +
                                                          " is outside [0, num_pages = " +
                                                          std::to_string(shard.num_pages()) + ")");
  }
  launch_stage_fp8(shard.layer_ptr(layer), l, shard.num_pages(), pages, num_pages, out, cs(stream));
}

namespace {

PrefillLimits limits_of(const PrefillBatch& b, int64_t rows, const SelectionParams& sel) {
  PrefillLimits l;
  l.max_requests = std::max(1, b.num_requests);
  l.max_pages = std::max(1, b.max_pages);
  l.max_rows = std::max<int64_t>(1, rows);
  l.heads = b.heads;
  l.sel = sel;
  return l;
}

// A one-rank prefill plan for the batch's own shape, run and waited for (the synchronous paths
// turn a step status into an Error on every rank).
void run_prefill_plan(const PrefillSpec& spec, Communicator& comm, const CacheView& cache, int32_t layer,
                      const PrefillBatch& batch, const PrefillExtents& e, int32_t* out, cudaStream_t st,
                      const char* call) {
  const PrefillPlan::Impl plan(spec);
  Tmp<uint8_t> ws(plan.ws.total, st);
  check(cudaMemsetAsync(ws.get(), 0, plan.ws.total, st), "cudaMemsetAsync (workspace)");  // whole records are exchanged
  Tmp<uint32_t> status(1, st);
  check(cudaMemsetAsync(status.get(), 0, sizeof(uint32_t), st), "cudaMemsetAsync (status)");
  const DevicePrefillBatch d{batch.q, batch.block_table, batch.seq_lens, batch.query_start, batch.num_requests};
  plan.run(cache, layer, d, e, ws.get(), plan.ws.total, out, &comm, status.get(), st);
  uint32_t h = 0;
  check(cudaMemcpyAsync(&h, status.get(), sizeof(h), cudaMemcpyDeviceToHost, st), "cudaMemcpyAsync (status)");
  comm.synchronize(st);  // bounded by the communicator's watchdog (NCCL), a no-op in-process
  check(cudaStreamSynchronize(st), (std::string("cudaStreamSynchronize (") + call + ")").c_str());
  if (h != 0) throw Error(ErrorCode::kRuntime, step_status_message(h, call));
}

}  // namespace

GatherStats prefill_gather(Communicator& comm, const CacheView& shard, int32_t layer, const PrefillBatch& batch,
                           const SelectionParams& sel, int64_t budget_bytes, int32_t* out, Stream stream,
                           ScorePrecision precision) {
  sel.validate();
  check_layer(shard, layer, "shard");
  check_group(comm, shard, true);
  const PageLayout& l = shard.layout();
  INDEXCP_REQUIRE(l.dtype != KvDtype::kBf16, "shard is a bf16 cache; the gather needs fp8 or nvfp4");
  const HostPrefill hp = read_prefill(batch, shard.num_pages(), l.page_size, cs(stream));
  check_heads_tp(batch.heads, comm.world());
  const int64_t rows = static_cast<int64_t>(hp.rows.size());
  INDEXCP_REQUIRE(rows == 0 || out != nullptr, "out is null");
  const int64_t unit = gather_unit_bytes(l);
  INDEXCP_REQUIRE(budget_bytes >= unit, "indexer_prefill_gather_budget_mib gives " + std::to_string(budget_bytes) +
                                            " bytes, below one page of one request (" + std::to_string(unit) + " bytes)");
  PrefillBatch hb = batch;  // host copies of the metadata: the extents
  hb.seq_lens = hp.seq_lens.data();
  hb.query_start = hp.query_start.data();
  hb.block_table = hp.block_table.data();
  PrefillExtents e;
  if (batch.num_requests > 0) e = prefill_extents(hb, l.page_size);
  e.max_rows_per_request = std::max(1, hp.max_rows_per_request);
  PrefillSpec sp;
  sp.path = PrefillPath::kGather;
  sp.world = comm.world();
  sp.rank = comm.rank();
  sp.layout = l;
  sp.limits = limits_of(batch, rows, sel);
  sp.limits.max_gather_units = std::max<int64_t>(1, e.gather_units);
  sp.budget = budget_bytes;
  sp.precision = precision;
  GatherStats gs;
  gs.pages = e.gather_units;
  gs.chunks = e.gather_units > 0 ? (e.gather_units + budget_bytes / unit - 1) / (budget_bytes / unit) : 0;
  gs.reserved_bytes = std::min<int64_t>(gs.pages, budget_bytes / unit) * unit;
  gs.gathered_bytes = gs.pages * l.page_size * kHeadDim;
  run_prefill_plan(sp, comm, shard, layer, batch, e, out, cs(stream), "prefill_gather");
  return gs;
}

void prefill_local_score(Communicator& comm, const CacheView& shard, int32_t layer, const PrefillBatch& batch,
                         const SelectionParams& sel, int32_t* out, Stream stream, ScorePrecision precision) {
  sel.validate();
  check_layer(shard, layer, "shard");
  check_not_bf16(shard);
  check_group(comm, shard, true);
  const HostPrefill hp = read_prefill(batch, shard.num_pages(), shard.layout().page_size, cs(stream));
  check_heads_tp(batch.heads, comm.world());
  const int64_t rows = static_cast<int64_t>(hp.rows.size());
  INDEXCP_REQUIRE(rows == 0 || out != nullptr, "out is null");
  if (rows == 0) return;
  PrefillSpec sp;
  sp.path = PrefillPath::kLocalScore;
  sp.world = comm.world();
  sp.rank = comm.rank();
  sp.layout = shard.layout();
  sp.limits = limits_of(batch, rows, sel);
  sp.precision = precision;
  PrefillExtents e;
  e.rows = rows;
  e.max_rows_per_request = std::max(1, hp.max_rows_per_request);
  run_prefill_plan(sp, comm, shard, layer, batch, e, out, cs(stream), "prefill_local_score");
}

}  // namespace indexcp::cuda
