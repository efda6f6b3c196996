// One rank's decode step and prefill chunk as plan / run on the CUDA backend (include/indexcp/
// cuda.hpp, plan.hpp), and DecodeStep, which is W decode plans on one GPU and one stream.
// Every run only enqueues: the workspace is the caller's, its layout computed by the same
// function that sizes it, the exchanges sized for the plan's limits.
#include <algorithm>
#include <string>

#include "common.cuh"
#include "indexcp/error.hpp"
#include "kernels.cuh"
#include "launches.cuh"
#include "plan.cuh"

namespace indexcp::cuda {

using namespace detail;

namespace {

cudaStream_t cs(Stream s) { return reinterpret_cast<cudaStream_t>(s); }

constexpr size_t kAlign = 256;
size_t align_up(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// Lays out consecutive sub-buffers (offsets multiples of 256) and gives the total.
struct Carver {
  size_t total = 0;
  size_t take(size_t bytes) {
    const size_t at = total;
    total = align_up(total + bytes);
    return at;
  }
};

template <class T>
T* at(void* base, size_t off) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + off);
}

void check_limits_common(int32_t max_requests, int32_t max_pages, int32_t heads, int32_t world,
                         const SelectionParams& sel) {
  INDEXCP_REQUIRE(max_requests >= 1 && max_requests <= (1 << 20),
                  "limits.max_requests = " + std::to_string(max_requests) + " is out of range 1..1048576");
  INDEXCP_REQUIRE(max_pages >= 1 && max_pages <= (1 << 24),
                  "limits.max_pages = " + std::to_string(max_pages) + " is out of range 1..16777216");
  INDEXCP_REQUIRE(heads >= 1 && heads <= 64, "limits.heads = " + std::to_string(heads) + " is out of range 1..64");
  try {  // the limits' field named, as the CPU plans do
    check_heads_tp(heads, world);
  } catch (const Error& e) {
    throw Error(e.code(), std::string("limits.") + e.what());
  }
  try {
    sel.validate();
  } catch (const Error& e) {
    throw Error(e.code(), std::string("limits.sel.") + e.what());
  }
}

// The scorer's limit on one launch (score.cu: max_pages * P < 2^30), at the plan's construction
// instead of at every run (inside a capture).
void check_table_width(int32_t max_pages, const PageLayout& l) {
  INDEXCP_REQUIRE(static_cast<int64_t>(max_pages) * l.page_size < (int64_t{1} << 30),
                  "limits.max_pages = " + std::to_string(max_pages) + " at P = " + std::to_string(l.page_size) +
                      " exceeds the scorer's 2^30 tokens per request");
}

void refuse_bf16(KvDtype d) {
  if (d == KvDtype::kBf16)
    throw Error(ErrorCode::kUnsupported,
                "indexer_kv_dtype = bf16 is not supported by the CUDA plans (use fp8 or nvfp4, or the cpu backend)");
}

// The plan's cache: a device view of the config's layout and this rank's rank (0 replicated).
void check_plan_cache(const CacheView& cache, int32_t layer, const PageLayout& want, int32_t want_rank) {
  require_supported_device();
  check_cache_view(cache, MemoryLocation::kDevice, "cache");
  check_view_layer(cache, layer);
  const PageLayout& l = cache.layout();
  INDEXCP_REQUIRE(l.dtype == want.dtype && l.page_size == want.page_size && l.shards == want.shards,
                  "cache has layout " + to_string(l.dtype) + " P" + std::to_string(l.page_size) + " shards " +
                      std::to_string(l.shards) + " but the plan's config has " + to_string(want.dtype) + " P" +
                      std::to_string(want.page_size) + " shards " + std::to_string(want.shards));
  INDEXCP_REQUIRE(cache.rank() == want_rank, "cache is rank " + std::to_string(cache.rank()) +
                                                 "'s but the plan is for rank " + std::to_string(want_rank));
}

void check_ws(const void* workspace, size_t bytes, size_t need) {
  INDEXCP_REQUIRE(bytes >= need, "workspace_bytes = " + std::to_string(bytes) + " is below the plan's workspace_bytes() = " +
                                     std::to_string(need));
  INDEXCP_REQUIRE(need == 0 || workspace != nullptr, "workspace is null");
  INDEXCP_REQUIRE(reinterpret_cast<uintptr_t>(workspace) % 16 == 0, "workspace is not 16-byte aligned");
}

void check_comm(const Communicator* comm, int32_t world, int32_t rank) {
  INDEXCP_REQUIRE(comm != nullptr, "comm is null (this path exchanges candidates; use publish / merge for an engine's own all-gather)");
  INDEXCP_REQUIRE(comm->world() == world, "comm has world = " + std::to_string(comm->world()) +
                                              " but the plan's config has tp = " + std::to_string(world));
  INDEXCP_REQUIRE(comm->rank() == rank,
                  "comm is rank " + std::to_string(comm->rank()) + "'s but the plan is rank " + std::to_string(rank) + "'s");
}

StepSignature base_signature(int32_t num_requests, int32_t query_len, int32_t heads, const SelectionParams& sel,
                             int32_t max_pages, int64_t record_rows, int64_t prefill_rows) {
  StepSignature g;
  g.v[0] = 0x53504349u;
  g.v[1] = 1u;
  g.v[2] = static_cast<uint32_t>(num_requests);
  g.v[3] = static_cast<uint32_t>(query_len);
  g.v[4] = static_cast<uint32_t>(heads);
  g.v[5] = static_cast<uint32_t>(sel.ranked());
  g.v[6] = static_cast<uint32_t>(max_pages);
  g.v[7] = static_cast<uint32_t>(record_rows);
  g.v[10] = static_cast<uint32_t>(prefill_rows);
  return g;
}

DecodeSpec spec_of(const ResolvedConfig& config, int32_t rank, const DecodeLimits& limits) {
  check_resolved_config(config);
  refuse_bf16(config.kv_dtype);
  DecodeSpec s;
  s.path = decode_path(config);
  s.world = config.engine.tp;
  INDEXCP_REQUIRE(rank >= 0 && rank < s.world,
                  "rank = " + std::to_string(rank) + " is outside [0, tp = " + std::to_string(s.world) + ")");
  s.rank = rank;
  s.layout = make_page_layout(config.kv_dtype, config.engine.page_size, config.shards);
  s.mode = config.k_rounding;
  s.precision = config.score_precision;
  s.p256_stock = config.p256_stock_decode;
  s.limits = limits;
  return s;
}

}  // namespace

// ---- DecodePlan ---------------------------------------------------------------------------------

DecodePlan::Impl::Impl(const DecodeSpec& spec) : sp(spec) {
  const DecodeLimits& L = sp.limits;
  INDEXCP_REQUIRE(sp.world >= 1 && sp.world <= 64, "world = " + std::to_string(sp.world) + " must be in 1..64");
  check_limits_common(L.max_requests, L.max_pages, L.heads, sp.world, L.sel);
  INDEXCP_REQUIRE(L.query_len >= 1 && L.query_len <= 16,
                  "limits.query_len = " + std::to_string(L.query_len) + " is out of range 1..16");
  refuse_bf16(sp.layout.dtype);
  check_score_mode(sp.layout.dtype, sp.mode, sp.precision);
  check_table_width(L.max_pages, sp.layout);
  owned_heads(L.heads, sp.world, sp.rank, &h0, &nh);
  if (sp.path == DecodePath::kReplicated) {
    score_h0 = h0;
    score_nh = nh;
  } else {
    score_h0 = 0;
    score_nh = L.heads;
  }
  max_rows = L.max_rows();
  max_blocks = max_blocks_of(L.max_pages, sp.layout);
  const int64_t cells = max_rows * score_nh * max_blocks;
  INDEXCP_REQUIRE(cells < (int64_t{1} << 40), "limits: the block scores (max_requests x query_len x heads x "
                                              "max_pages x P / 128) exceed 2^40 entries");
  stock = sp.path == DecodePath::kIcp ? whole_page_scorer(sp.layout, sp.p256_stock) : true;
  filter = sp.path == DecodePath::kDecodeCp ? BlockFilter{sp.world, sp.rank} : BlockFilter{};
  ex = exchanges() ? exchange_layout(max_rows, L.heads, L.sel) : ExchangeLayout{};
  Carver c;
  ws.scores = c.take(static_cast<size_t>(cells) * sizeof(float));
  ws.plan = c.take((static_cast<size_t>(L.max_requests) + 1) * sizeof(int32_t));
  if (exchanges()) {
    ws.send = c.take(ex.record_bytes);
    ws.recv = c.take(ex.record_bytes * static_cast<size_t>(sp.world));
  }
  ws.total = c.total;
}

void DecodePlan::Impl::check_cache(const CacheView& cache, int32_t layer) const {
  check_plan_cache(cache, layer, sp.layout, sp.layout.shards > 1 ? sp.rank : 0);
}

void DecodePlan::Impl::check_batch(const DeviceDecodeBatch& b) const {
  INDEXCP_REQUIRE(b.num_requests >= 0, "num_requests = " + std::to_string(b.num_requests) + " must be >= 0");
  INDEXCP_REQUIRE(b.num_requests <= sp.limits.max_requests,
                  "num_requests = " + std::to_string(b.num_requests) + " exceeds the plan's limits.max_requests = " +
                      std::to_string(sp.limits.max_requests));
  if (b.num_requests > 0) {
    INDEXCP_REQUIRE(b.q != nullptr, "q is null");
    INDEXCP_REQUIRE(b.seq_lens != nullptr, "seq_lens is null");
    INDEXCP_REQUIRE(b.block_table != nullptr, "block_table is null");
  }
}

void DecodePlan::Impl::check_workspace(const void* workspace, size_t bytes) const { check_ws(workspace, bytes, ws.total); }

DecodeBatch DecodePlan::Impl::as_batch(const DeviceDecodeBatch& b) const {
  DecodeBatch d;
  d.q = b.q;
  d.heads = sp.limits.heads;
  d.block_table = b.block_table;
  d.num_requests = b.num_requests;
  d.max_pages = sp.limits.max_pages;
  d.seq_lens = b.seq_lens;
  d.query_len = sp.limits.query_len;
  return d;
}

float* DecodePlan::Impl::scores(void* workspace) const { return at<float>(workspace, ws.scores); }

void DecodePlan::Impl::enqueue_score(const CacheView& cache, int32_t layer, const DeviceDecodeBatch& b, void* workspace,
                                     cudaStream_t st) const {
  launch_score(decode_score_launch(cache, layer, as_batch(b), score_h0, score_nh, sp.mode, sp.precision, scores(workspace), filter,
                                   stock, at<int32_t>(workspace, ws.plan)),
               st);
}

void DecodePlan::Impl::enqueue_publish(const CacheView& cache, const DeviceDecodeBatch& b, void* workspace, void* send,
                                       cudaStream_t st) const {
  uint32_t* signature = signature_in(send, ex);
#ifdef INDEXCP_AB_NO_STEP_SIGNATURE  // A/B builds of bench/NOTES.md only: the step without its signature
  signature = nullptr;
#endif
  const StepSignature sig = base_signature(b.num_requests, sp.limits.query_len, sp.limits.heads, sp.limits.sel,
                                           sp.limits.max_pages, max_rows, 0);
  launch_select(publish_launch(decode_rows_view(as_batch(b)), scores(workspace), max_blocks, sp.limits.heads,
                               sp.limits.sel, send, cache, filter, signature, sig),
                st);
}

void DecodePlan::Impl::enqueue_select(const DeviceDecodeBatch& b, void* workspace, int32_t* out, int32_t out_heads,
                                      int32_t out_h0, cudaStream_t st) const {
  launch_select(select_launch(decode_rows_view(as_batch(b)), scores(workspace), max_blocks, nh, sp.limits.sel, out,
                              out_heads, out_h0),
                st);
}

void DecodePlan::Impl::enqueue_merge(const DeviceDecodeBatch& b, const void* recv, int32_t* out, int32_t out_heads,
                                     int32_t out_h0, uint32_t* status, cudaStream_t st) const {
  const uint32_t* signature = signature_in(recv, ex);
#ifdef INDEXCP_AB_NO_STEP_SIGNATURE
  signature = nullptr;
#endif
  const StepSignature expect = base_signature(b.num_requests, sp.limits.query_len, sp.limits.heads, sp.limits.sel,
                                              sp.limits.max_pages, max_rows, 0);
  launch_merge(merge_launch(decode_rows_view(as_batch(b)), recv, ex, sp.world, sp.limits.heads, h0, nh, sp.limits.sel,
                            out, out_heads, out_h0, signature, expect, status),
               st);
}

DecodePlan::DecodePlan(const ResolvedConfig& config, int32_t rank, const DecodeLimits& limits) {
  const DecodeSpec s = spec_of(config, rank, limits);
  prepare_device();
  impl_ = std::make_unique<Impl>(s);
}
DecodePlan::~DecodePlan() = default;
DecodePlan::DecodePlan(DecodePlan&&) noexcept = default;
DecodePlan& DecodePlan::operator=(DecodePlan&&) noexcept = default;

DecodePath DecodePlan::path() const { return impl_->sp.path; }
const DecodeLimits& DecodePlan::limits() const { return impl_->sp.limits; }
int32_t DecodePlan::world() const { return impl_->sp.world; }
int32_t DecodePlan::rank() const { return impl_->sp.rank; }
int32_t DecodePlan::head_begin() const { return impl_->h0; }
int32_t DecodePlan::num_heads() const { return impl_->nh; }
size_t DecodePlan::workspace_bytes() const { return impl_->ws.total; }
size_t DecodePlan::exchange_bytes() const { return impl_->ex.record_bytes; }
ExchangeLayout DecodePlan::exchange() const { return impl_->ex; }
bool DecodePlan::uses_stock_scorer() const { return impl_->stock; }
void* DecodePlan::send_buffer(void* workspace) const {
  return impl_->exchanges() && workspace ? at<void>(workspace, impl_->ws.send) : nullptr;
}
void* DecodePlan::recv_buffer(void* workspace) const {
  return impl_->exchanges() && workspace ? at<void>(workspace, impl_->ws.recv) : nullptr;
}
void DecodePlan::check_cache(const CacheView& cache, int32_t layer) const { impl_->check_cache(cache, layer); }

void DecodePlan::run(const CacheView& cache, int32_t layer, const DeviceDecodeBatch& batch, void* workspace,
                     size_t workspace_bytes, int32_t* out, Communicator* comm, uint32_t* status, Stream stream) const {
  impl_->run(cache, layer, batch, workspace, workspace_bytes, out, comm, status, cs(stream));
}

void DecodePlan::Impl::run(const CacheView& cache, int32_t layer, const DeviceDecodeBatch& batch, void* workspace,
                           size_t workspace_bytes, int32_t* out, Communicator* comm, uint32_t* status,
                           cudaStream_t st) const {
  const Impl& m = *this;
  const Stream stream = reinterpret_cast<Stream>(st);
  m.check_cache(cache, layer);
  m.check_batch(batch);
  const int64_t rows = static_cast<int64_t>(batch.num_requests) * m.sp.limits.query_len;
  INDEXCP_REQUIRE(rows == 0 || out != nullptr, "out is null");
  m.check_workspace(workspace, workspace_bytes);
  if (m.exchanges()) check_comm(comm, m.sp.world, m.sp.rank);
  m.enqueue_score(cache, layer, batch, workspace, st);
  if (!m.exchanges()) {
    m.enqueue_select(batch, workspace, out, m.nh, 0, st);
    // nothing to disagree on: the status says so every step, as the exchanging paths' merge does
    if (status != nullptr) check(cudaMemsetAsync(status, 0, sizeof(uint32_t), st), "cudaMemsetAsync (status)");
    return;
  }
  void* send = at<void>(workspace, m.ws.send);
  void* recv = at<void>(workspace, m.ws.recv);
  m.enqueue_publish(cache, batch, workspace, send, st);
  comm->all_gather(send, recv, m.ex.record_bytes, stream);
  m.enqueue_merge(batch, recv, out, m.nh, 0, status, st);
}

void DecodePlan::publish(const CacheView& cache, int32_t layer, const DeviceDecodeBatch& batch, void* workspace,
                         size_t workspace_bytes, void* send, Stream stream) const {
  const Impl& m = *impl_;
  INDEXCP_REQUIRE(m.exchanges(), std::string("publish: the plan's path is ") + to_string(m.sp.path) +
                                     ", which exchanges nothing (call run)");
  m.check_cache(cache, layer);
  m.check_batch(batch);
  m.check_workspace(workspace, workspace_bytes);
  INDEXCP_REQUIRE(send != nullptr, "send is null");
  INDEXCP_REQUIRE(reinterpret_cast<uintptr_t>(send) % 8 == 0, "send is not 8-byte aligned");
  m.enqueue_score(cache, layer, batch, workspace, cs(stream));
  m.enqueue_publish(cache, batch, workspace, send, cs(stream));
}

void DecodePlan::merge(const DeviceDecodeBatch& batch, const void* recv, int32_t* out, uint32_t* status,
                       Stream stream) const {
  const Impl& m = *impl_;
  INDEXCP_REQUIRE(m.exchanges(), std::string("merge: the plan's path is ") + to_string(m.sp.path) +
                                     ", which exchanges nothing (call run)");
  require_supported_device();
  INDEXCP_REQUIRE(batch.num_requests >= 0 && batch.num_requests <= m.sp.limits.max_requests,
                  "num_requests = " + std::to_string(batch.num_requests) + " is outside [0, limits.max_requests = " +
                      std::to_string(m.sp.limits.max_requests) + "]");
  // the merge reads only seq_lens (q and the block table may be null)
  INDEXCP_REQUIRE(batch.num_requests == 0 || batch.seq_lens != nullptr, "seq_lens is null");
  INDEXCP_REQUIRE(recv != nullptr, "recv is null");
  INDEXCP_REQUIRE(reinterpret_cast<uintptr_t>(recv) % 8 == 0, "recv is not 8-byte aligned");
  const int64_t rows = static_cast<int64_t>(batch.num_requests) * m.sp.limits.query_len;
  INDEXCP_REQUIRE(rows == 0 || out != nullptr, "out is null");
  m.enqueue_merge(batch, recv, out, m.nh, 0, status, cs(stream));
}

// ---- PrefillPlan --------------------------------------------------------------------------------


PrefillPlan::Impl::Impl(const PrefillSpec& sp) {
  Impl& m = *this;
  const PrefillLimits& limits = sp.limits;
  m.world = sp.world;
  INDEXCP_REQUIRE(sp.rank >= 0 && sp.rank < m.world,
                  "rank = " + std::to_string(sp.rank) + " is outside [0, tp = " + std::to_string(m.world) + ")");
  check_limits_common(limits.max_requests, limits.max_pages, limits.heads, m.world, limits.sel);
  INDEXCP_REQUIRE(limits.max_rows >= 1 && limits.max_rows <= (int64_t{1} << 31),
                  "limits.max_rows = " + std::to_string(limits.max_rows) + " is out of range 1..2^31");
  refuse_bf16(sp.layout.dtype);
  check_table_width(limits.max_pages, sp.layout);
  m.rank = sp.rank;
  m.path = sp.path;
  m.layout = sp.layout;
  m.limits = limits;
  m.budget = sp.budget;
  check_score_precision(sp.precision, "indexer_score_precision");
  m.precision = sp.precision;
  const int32_t rank = sp.rank;
  owned_heads(limits.heads, m.world, rank, &m.h0, &m.nh);
  if (m.path == PrefillPath::kLocalScore) {
    m.score_h0 = 0;
    m.score_nh = limits.heads;
  } else {
    m.score_h0 = m.h0;
    m.score_nh = m.nh;
  }
  m.max_blocks = max_blocks_of(limits.max_pages, m.layout);
  const int64_t cells = limits.max_rows * m.score_nh * m.max_blocks;
  INDEXCP_REQUIRE(cells < (int64_t{1} << 40), "limits: the block scores (max_rows x heads x max_pages x P / 128) "
                                              "exceed 2^40 entries");
  Carver c;
  m.ws.scores = c.take(static_cast<size_t>(cells) * sizeof(float));
  m.ws.plan = c.take((static_cast<size_t>(limits.max_requests) + 1) * sizeof(int32_t));
  if (m.path == PrefillPath::kLocalScore) {
    m.ex = exchange_layout(limits.max_rows, limits.heads, limits.sel);
    m.ws.send = c.take(m.ex.record_bytes);
    m.ws.recv = c.take(m.ex.record_bytes * static_cast<size_t>(m.world));
  } else if (m.path == PrefillPath::kGather) {
    const int64_t unit = gather_unit_bytes(m.layout);
    INDEXCP_REQUIRE(m.budget >= unit, "indexer_prefill_gather_budget_mib gives " + std::to_string(m.budget) +
                                          " bytes, below one page of one request (" + std::to_string(unit) + " bytes)");
    const int64_t table = static_cast<int64_t>(limits.max_requests) * limits.max_pages;
    INDEXCP_REQUIRE(table < (int64_t{1} << 31), "limits: max_requests x max_pages exceeds 2^31 gather units");
    INDEXCP_REQUIRE(limits.max_gather_units >= 0 && limits.max_gather_units <= table,
                    "limits.max_gather_units = " + std::to_string(limits.max_gather_units) +
                        " is outside [0, max_requests x max_pages = " + std::to_string(table) + "]");
    m.max_units = limits.max_gather_units > 0 ? limits.max_gather_units : table;
    m.cap = std::max<int64_t>(1, std::min<int64_t>(m.budget / unit, m.max_units));
    const size_t R = static_cast<size_t>(m.layout.rows());
    m.ws.staging = c.take(static_cast<size_t>(m.cap) * R * kHeadDim);
    m.ws.gathered = c.take(static_cast<size_t>(m.cap) * m.world * R * kHeadDim);
    m.ws.phys = c.take(static_cast<size_t>(m.cap) * sizeof(int32_t));
    m.ws.bt_local = c.take(static_cast<size_t>(table) * sizeof(int32_t));
    m.ws.unit_first = c.take((static_cast<size_t>(limits.max_requests) + 1) * sizeof(int32_t));
    m.ws.status = c.take(sizeof(uint32_t));
  }
  m.ws.total = c.total;
}


PrefillPlan::PrefillPlan(const ResolvedConfig& config, int32_t rank, const PrefillLimits& limits) {
  check_resolved_config(config);
  refuse_bf16(config.kv_dtype);
  PrefillSpec sp;
  sp.path = prefill_path(config);
  sp.world = config.engine.tp;
  sp.rank = rank;
  sp.layout = make_page_layout(config.kv_dtype, config.engine.page_size, config.shards);
  sp.limits = limits;
  sp.budget = config.prefill_gather_budget_bytes;
  sp.precision = config.score_precision;
  impl_ = std::make_unique<Impl>(sp);
  prepare_device();
}
PrefillPlan::~PrefillPlan() = default;
PrefillPlan::PrefillPlan(PrefillPlan&&) noexcept = default;
PrefillPlan& PrefillPlan::operator=(PrefillPlan&&) noexcept = default;

PrefillPath PrefillPlan::path() const { return impl_->path; }
const PrefillLimits& PrefillPlan::limits() const { return impl_->limits; }
int32_t PrefillPlan::world() const { return impl_->world; }
int32_t PrefillPlan::rank() const { return impl_->rank; }
int32_t PrefillPlan::head_begin() const { return impl_->h0; }
int32_t PrefillPlan::num_heads() const { return impl_->nh; }
size_t PrefillPlan::workspace_bytes() const { return impl_->ws.total; }
size_t PrefillPlan::exchange_bytes() const {
  const Impl& m = *impl_;
  if (m.path == PrefillPath::kLocalScore) return m.ex.record_bytes;
  if (m.path == PrefillPath::kGather) return static_cast<size_t>(m.cap) * m.layout.rows() * kHeadDim;
  return 0;
}
int64_t PrefillPlan::units_per_chunk() const { return impl_->cap; }
int64_t PrefillPlan::gather_chunks(const PrefillExtents& e) const { return impl_->chunks(e); }
void PrefillPlan::check_cache(const CacheView& cache, int32_t layer) const {
  check_plan_cache(cache, layer, impl_->layout, impl_->layout.shards > 1 ? impl_->rank : 0);
}

void PrefillPlan::run(const CacheView& cache, int32_t layer, const DevicePrefillBatch& batch, const PrefillExtents& e,
                      void* workspace, size_t workspace_bytes, int32_t* out, Communicator* comm, uint32_t* status,
                      Stream stream) const {
  impl_->run(cache, layer, batch, e, workspace, workspace_bytes, out, comm, status, cs(stream));
}

int64_t PrefillPlan::Impl::chunks(const PrefillExtents& e) const {
  if (path != PrefillPath::kGather || e.gather_units <= 0) return 0;
  return (e.gather_units + cap - 1) / cap;
}

void PrefillPlan::Impl::run(const CacheView& cache, int32_t layer, const DevicePrefillBatch& batch, const PrefillExtents& e,
                            void* workspace, size_t workspace_bytes, int32_t* out, Communicator* comm, uint32_t* status,
                            cudaStream_t st) const {
  const Impl& m = *this;
  check_plan_cache(cache, layer, m.layout, m.layout.shards > 1 ? m.rank : 0);
  INDEXCP_REQUIRE(batch.num_requests >= 0, "num_requests = " + std::to_string(batch.num_requests) + " must be >= 0");
  INDEXCP_REQUIRE(batch.num_requests <= m.limits.max_requests,
                  "num_requests = " + std::to_string(batch.num_requests) + " exceeds the plan's limits.max_requests = " +
                      std::to_string(m.limits.max_requests));
  INDEXCP_REQUIRE(e.rows >= 0 && e.rows <= m.limits.max_rows,
                  "extents.rows = " + std::to_string(e.rows) + " is outside [0, limits.max_rows = " +
                      std::to_string(m.limits.max_rows) + "]");
  INDEXCP_REQUIRE(e.max_rows_per_request >= 1,
                  "extents.max_rows_per_request = " + std::to_string(e.max_rows_per_request) + " must be >= 1");
  INDEXCP_REQUIRE(e.gather_units >= 0, "extents.gather_units = " + std::to_string(e.gather_units) + " must be >= 0");
  INDEXCP_REQUIRE(m.path != PrefillPath::kGather || e.gather_units <= m.max_units,
                  "extents.gather_units = " + std::to_string(e.gather_units) + " exceeds the plan's limits.max_gather_units = " +
                      std::to_string(m.max_units));
  if (batch.num_requests > 0) {
    INDEXCP_REQUIRE(batch.query_start != nullptr, "query_start is null");
    INDEXCP_REQUIRE(batch.seq_lens != nullptr, "seq_lens is null");
    INDEXCP_REQUIRE(batch.block_table != nullptr, "block_table is null");
    INDEXCP_REQUIRE(e.rows == 0 || batch.q != nullptr, "q is null");
  }
  INDEXCP_REQUIRE(e.rows == 0 || out != nullptr, "out is null");
  check_ws(workspace, workspace_bytes, m.ws.total);
  if (m.path != PrefillPath::kReplicated) check_comm(comm, m.world, m.rank);
  const Stream stream = reinterpret_cast<Stream>(st);
  const PrefillBatch d = m.as_batch(batch);
  float* scores = at<float>(workspace, m.ws.scores);
  int32_t* plan = at<int32_t>(workspace, m.ws.plan);
  const RowsView rv = prefill_rows_view(d, e.rows);

  if (m.path == PrefillPath::kGather) {
    const int32_t R = m.layout.rows(), P = m.layout.page_size;
    uint32_t* st_word = status != nullptr ? status : at<uint32_t>(workspace, m.ws.status);
    int32_t* unit_first = at<int32_t>(workspace, m.ws.unit_first);
    int32_t* phys = at<int32_t>(workspace, m.ws.phys);
    int32_t* bt_local = at<int32_t>(workspace, m.ws.bt_local);
    uint8_t* staging = at<uint8_t>(workspace, m.ws.staging);
    uint8_t* gathered = at<uint8_t>(workspace, m.ws.gathered);
    if (batch.num_requests > 0)
      launch_gather_units(d.seq_lens, d.query_start, d.num_requests, P, e.gather_units, unit_first, st_word, st);
    else
      check(cudaMemsetAsync(st_word, 0, sizeof(uint32_t), st), "cudaMemsetAsync (status)");
    const PageLayout gl = make_page_layout(KvDtype::kFp8, P, m.world);
    const int64_t n_chunks = m.chunks(e);
    for (int64_t c = 0; c < n_chunks; ++c) {
      const int64_t c0 = c * m.cap, n = std::min<int64_t>(m.cap, e.gather_units - c0);
      // page ids the chunk does not fill are -1 (the staging kernel skips them)
      check(cudaMemsetAsync(phys, 0xff, static_cast<size_t>(n) * sizeof(int32_t), st), "cudaMemsetAsync (phys)");
      launch_gather_chunk(d.block_table, d.num_requests, d.max_pages, unit_first, c0, n, phys, bt_local, st);
      launch_stage_fp8(cache.layer_ptr(layer), m.layout, cache.num_pages(), phys, n, staging, st);
      comm->all_gather(staging, gathered, static_cast<size_t>(n) * R * kHeadDim, stream);
      if (e.rows == 0) continue;
      launch_score(gather_score_launch(gathered, gl, n, d, rv, bt_local, e.max_rows_per_request, m.h0, m.nh, m.precision,
                                       scores, m.max_blocks, plan),
                   st);
    }
    launch_select(select_launch(rv, scores, m.max_blocks, m.nh, m.limits.sel, out, m.nh, 0), st);
    launch_poison_if(st_word, out, e.rows * m.nh * m.limits.sel.topk, st);
    return;
  }

  const bool stock = m.path == PrefillPath::kLocalScore ? m.layout.rows() >= kBlockTokens : true;
  launch_score(prefill_score_launch(cache, layer, d, e.rows, e.max_rows_per_request, m.score_h0, m.score_nh, m.precision,
                                    scores, stock, plan),
               st);
  if (m.path == PrefillPath::kReplicated) {
    launch_select(select_launch(rv, scores, m.max_blocks, m.nh, m.limits.sel, out, m.nh, 0), st);
    if (status != nullptr) check(cudaMemsetAsync(status, 0, sizeof(uint32_t), st), "cudaMemsetAsync (status)");
    return;
  }
  // local_score: publish (with the signature), exchange, merge
  void* send = at<void>(workspace, m.ws.send);
  void* recv = at<void>(workspace, m.ws.recv);
  const StepSignature sig = base_signature(batch.num_requests, 0, m.limits.heads, m.limits.sel, m.limits.max_pages,
                                           m.limits.max_rows, e.rows);
  launch_select(publish_launch(rv, scores, m.max_blocks, m.limits.heads, m.limits.sel, send, cache, BlockFilter{},
                               signature_in(send, m.ex), sig),
                st);
  comm->all_gather(send, recv, m.ex.record_bytes, stream);
  launch_merge(merge_launch(rv, recv, m.ex, m.world, m.limits.heads, m.h0, m.nh, m.limits.sel, out, m.nh, 0,
                            signature_in(recv, m.ex), sig, status),
               st);
}

// ---- DecodeStep: W decode plans on one GPU, one stream ------------------------------------------

struct DecodeStep::Impl {
  std::vector<CacheView> caches;
  int32_t W = 1, layer = 0;
  DecodeShape shape;
  DecodePath path = DecodePath::kReplicated;
  std::vector<DecodePlan::Impl> plans;         // rank r's plan
  std::vector<DeviceBuffer<uint8_t>> work;     // rank r's workspace (scores, work plan)
  DeviceBuffer<uint8_t> records;               // [W] exchange records: rank r publishes into its own

  const CacheView& cache_of(int32_t r) const { return caches[path == DecodePath::kIcp ? r : 0]; }
  DeviceDecodeBatch device_batch(const DecodeBatch& b) const {
    DeviceDecodeBatch d;
    d.q = b.q;
    d.block_table = b.block_table;
    d.seq_lens = b.seq_lens;
    d.num_requests = b.num_requests;
    return d;
  }
  void* record(int32_t r) const { return records.get() + static_cast<size_t>(r) * plans[0].ex.record_bytes; }
  void check_batch(const DecodeBatch& b) const {
    INDEXCP_REQUIRE(b.num_requests >= 0 && b.num_requests <= shape.max_requests,
                    "num_requests = " + std::to_string(b.num_requests) + " exceeds the step's max_requests = " +
                        std::to_string(shape.max_requests));
    INDEXCP_REQUIRE(b.max_pages == shape.max_pages, "max_pages = " + std::to_string(b.max_pages) +
                                                        " differs from the step's max_pages = " + std::to_string(shape.max_pages));
    INDEXCP_REQUIRE(b.query_len == shape.query_len, "query_len = " + std::to_string(b.query_len) +
                                                        " differs from the step's query_len = " + std::to_string(shape.query_len));
    INDEXCP_REQUIRE(b.heads == shape.heads,
                    "heads = " + std::to_string(b.heads) + " differs from the step's heads = " + std::to_string(shape.heads));
    if (b.num_requests > 0)
      INDEXCP_REQUIRE(b.q != nullptr && b.seq_lens != nullptr && b.block_table != nullptr, "batch has a null device pointer");
  }
  void check_rank(int32_t r) const {
    INDEXCP_REQUIRE(r >= 0 && r < W, "rank = " + std::to_string(r) + " is out of range");
  }
};

namespace {
std::vector<CacheView> views_of(const std::vector<const DeviceCache*>& caches) {
  std::vector<CacheView> v;
  for (size_t i = 0; i < caches.size(); ++i) {
    INDEXCP_REQUIRE(caches[i] != nullptr, "caches[" + std::to_string(i) + "] is null");
    v.push_back(caches[i]->view());
  }
  return v;
}
}  // namespace

DecodeStep::DecodeStep(const std::vector<const DeviceCache*>& caches, int32_t world, int32_t layer,
                       const DecodeShape& shape, DecodePath path, bool p256_stock)
    : DecodeStep(views_of(caches), world, layer, shape, path, p256_stock) {}

DecodeStep::DecodeStep(std::vector<CacheView> caches, int32_t world, int32_t layer, const DecodeShape& shape,
                       DecodePath path, bool p256_stock)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  prepare_device();
  shape.sel.validate();
  INDEXCP_REQUIRE(world >= 1 && world <= 64, "world = " + std::to_string(world) + " must be in 1..64");
  check_heads_tp(shape.heads, world);
  INDEXCP_REQUIRE(shape.query_len >= 1 && shape.query_len <= 16,
                  "query_len = " + std::to_string(shape.query_len) + " is out of range 1..16");
  INDEXCP_REQUIRE(shape.max_requests >= 1, "max_requests must be >= 1");
  INDEXCP_REQUIRE(shape.max_pages >= 1, "max_pages must be >= 1");
  for (size_t i = 0; i < caches.size(); ++i)
    check_cache_view(caches[i], MemoryLocation::kDevice, "caches[" + std::to_string(i) + "]");
  if (path == DecodePath::kIcp) {
    INDEXCP_REQUIRE(static_cast<int32_t>(caches.size()) == world,
                    "caches: kIcp needs one shard per rank (" + std::to_string(world) + ")");
    for (int32_t r = 0; r < world; ++r)
      INDEXCP_REQUIRE(caches[r].layout().shards == world && caches[r].rank() == r,
                      "caches[" + std::to_string(r) + "] is not rank " + std::to_string(r) + " of " +
                          std::to_string(world) + " shards");
  } else {
    INDEXCP_REQUIRE(!caches.empty(), "caches[0] is missing");
    INDEXCP_REQUIRE(caches[0].layout().shards == 1,
                    "caches[0] is sharded; kReplicated and kDecodeCp need a replicated cache");
  }
  for (const CacheView& c : caches) {
    require_supported_device();
    check_view_layer(c, layer);
    refuse_bf16(c.layout().dtype);
  }
  m.caches = caches;
  m.W = world;
  m.layer = layer;
  m.shape = shape;
  m.path = path;
  for (int32_t r = 0; r < world; ++r) {
    DecodeSpec s;
    s.path = path;
    s.world = world;
    s.rank = r;
    s.layout = m.cache_of(r).layout();
    s.mode = shape.mode;
    s.precision = shape.precision;
    s.p256_stock = p256_stock;
    s.limits.max_requests = shape.max_requests;
    s.limits.max_pages = shape.max_pages;
    s.limits.query_len = shape.query_len;
    s.limits.heads = shape.heads;
    s.limits.sel = shape.sel;
    m.plans.emplace_back(s);
  }
  // each rank's scores and work plan (its send and receive records are the shared ones below),
  // zero-filled once: the exchange copies whole records (docs/embedding.md section 8)
  for (int32_t r = 0; r < world; ++r) {
    m.work.emplace_back(m.plans[r].ws.send ? m.plans[r].ws.send : m.plans[r].ws.total);
    check(cudaMemset(m.work.back().get(), 0, m.work.back().size()), "cudaMemset (workspace)");
  }
  if (path != DecodePath::kReplicated) {
    m.records.resize(m.plans[0].ex.record_bytes * static_cast<size_t>(world));
    check(cudaMemset(m.records.get(), 0, m.records.size()), "cudaMemset (records)");
  }
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (DecodeStep workspace)");
  ensure_tables();
}

DecodeStep::~DecodeStep() = default;

void DecodeStep::enqueue_score(int32_t r, const DecodeBatch& b, Stream stream) {
  const Impl& m = *impl_;
  m.check_batch(b);
  m.check_rank(r);
  m.plans[r].enqueue_score(m.cache_of(r), m.layer, m.device_batch(b), m.work[r].get(), cs(stream));
}

void DecodeStep::enqueue_publish(int32_t r, const DecodeBatch& b, Stream stream) {
  const Impl& m = *impl_;
  if (m.path == DecodePath::kReplicated) return;
  m.check_batch(b);
  m.check_rank(r);
  // the exchange: written straight into rank r's record of the shared buffer
  m.plans[r].enqueue_publish(m.cache_of(r), m.device_batch(b), m.work[r].get(), m.record(r), cs(stream));
}

void DecodeStep::enqueue_select(int32_t r, const DecodeBatch& b, int32_t* out, Stream stream) {
  const Impl& m = *impl_;
  m.check_batch(b);
  m.check_rank(r);
  INDEXCP_REQUIRE(b.rows() == 0 || out != nullptr, "out is null");
  const DecodePlan::Impl& p = m.plans[r];
  if (m.W > m.shape.heads && r != p.h0 * m.W / m.shape.heads) return;  // another rank writes this head
  if (m.path == DecodePath::kReplicated)
    p.enqueue_select(m.device_batch(b), m.work[r].get(), out, m.shape.heads, p.h0, cs(stream));
  else
    p.enqueue_merge(m.device_batch(b), m.records.get(), out, m.shape.heads, p.h0, nullptr, cs(stream));
}

void DecodeStep::run(const DecodeBatch& b, int32_t* out, Stream stream) {
  const Impl& m = *impl_;
  m.check_batch(b);
  for (int32_t r = 0; r < m.W; ++r) {
    enqueue_score(r, b, stream);
    enqueue_publish(r, b, stream);
  }
  for (int32_t r = 0; r < m.W; ++r) enqueue_select(r, b, out, stream);
}

int64_t DecodeStep::bytes_read(int32_t r, const std::vector<int32_t>& seq_lens) const {
  const Impl& m = *impl_;
  m.check_rank(r);
  const KeySource k = key_source(m.cache_of(r), m.layer);
  int64_t total = 0;
  for (int32_t s : seq_lens) total += score_bytes_read(k, s, m.plans[r].filter);
  return total;
}

int64_t DecodeStep::workspace_bytes() const {
  const Impl& m = *impl_;
  int64_t b = 0;
  for (const auto& w : m.work) b += static_cast<int64_t>(w.size());
  return b + static_cast<int64_t>(m.records.size());
}

bool DecodeStep::uses_stock_scorer(int32_t r) const {
  impl_->check_rank(r);
  return impl_->plans[r].stock;
}

}  // namespace indexcp::cuda
