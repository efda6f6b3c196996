// The CPU backend's decode and prefill plans (include/indexcp/plan.hpp), built on the CPU
// scorer, selection, publish and merge (indexer.cpp, icp.cpp). The CPU plans are the reference of
// the CUDA plans: the same checks, the same exchange records (candidates then the step
// signature), the same outputs and step status.
#include "indexcp/plan.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "indexcp/error.hpp"
#include "indexcp/layout.hpp"
#include "kernels.hpp"

namespace indexcp {

namespace {

constexpr uint32_t kSignatureMagic = 0x53504349u;  // "ICPS"
constexpr uint32_t kSignatureVersion = 1;
constexpr int64_t kMaxRequests = int64_t{1} << 20;
constexpr int64_t kMaxPages = int64_t{1} << 24;
constexpr int64_t kMaxPrefillRows = int64_t{1} << 31;

std::string num(int64_t v) { return std::to_string(v); }

size_t round16(size_t n) { return (n + 15) / 16 * 16; }

void check_limit(int64_t v, int64_t lo, int64_t hi, const char* name) {
  INDEXCP_REQUIRE(v >= lo && v <= hi, std::string(name) + " = " + num(v) + " is out of range " + num(lo) + ".." + num(hi));
}

// check_heads_tp / SelectionParams::validate with the limits' field named ("limits.heads = 3 and
// tp = 2 do not divide one another", "limits.sel.topk = 1 must be in 2..1024").
void check_limit_heads(int32_t heads, int32_t tp) {
  try {
    check_heads_tp(heads, tp);
  } catch (const Error& e) {
    throw Error(e.code(), std::string("limits.") + e.what());
  }
}
void check_limit_sel(const SelectionParams& sel) {
  try {
    sel.validate();
  } catch (const Error& e) {
    throw Error(e.code(), std::string("limits.sel.") + e.what());
  }
}

// What both plans share: the config, the rank, the owned heads, the cache layout.
struct Common {
  ResolvedConfig config;
  int32_t world = 1, rank = 0, h0 = 0, nh = 1;
  PageLayout layout;

  void init(const ResolvedConfig& c, int32_t r, int32_t heads) {
    check_resolved_config(c);
    config = c;
    world = c.engine.tp;
    INDEXCP_REQUIRE(r >= 0 && r < world, "rank = " + num(r) + " is outside [0, tp = " + num(world) + ")");
    rank = r;
    check_limit(heads, 1, 64, "limits.heads");
    check_limit_heads(heads, world);
    owned_heads(heads, world, rank, &h0, &nh);
    layout = make_page_layout(c.kv_dtype, c.engine.page_size, c.shards);
  }

  void check_cache(const CacheView& view, int32_t layer) const {
    check_cache_view(view, MemoryLocation::kHost, "cache");
    check_view_layer(view, layer);
    const PageLayout& l = view.layout();
    const auto describe = [](const PageLayout& x) {
      return to_string(x.dtype) + ", page_size " + num(x.page_size) + ", shards " + num(x.shards);
    };
    if (l.dtype != layout.dtype || l.page_size != layout.page_size || l.shards != layout.shards)
      throw Error(ErrorCode::kInvalidArgument,
                  "cache has the layout (" + describe(l) + ") but the plan's config needs (" + describe(layout) + ")");
    const int32_t want = config.sharding ? rank : 0;
    INDEXCP_REQUIRE(view.rank() == want, "cache is rank " + num(view.rank()) + "'s but the plan needs rank " + num(want) +
                                             "'s" + (config.sharding ? "" : " (a replicated cache)"));
  }

  void check_num_requests(int32_t n, int32_t max_requests) const {
    INDEXCP_REQUIRE(n >= 0, "num_requests = " + num(n) + " must be >= 0");
    INDEXCP_REQUIRE(n <= max_requests, "num_requests = " + num(n) + " exceeds the plan's limits.max_requests = " +
                                           num(max_requests));
  }

  void check_comm(const Communicator* comm, const char* path) const {
    INDEXCP_REQUIRE(comm != nullptr, std::string("comm is null; the ") + path + " path exchanges through a communicator");
    INDEXCP_REQUIRE(comm->world() == world, "comm has world = " + num(comm->world()) +
                                                " but the plan has world = tp = " + num(world));
    INDEXCP_REQUIRE(comm->rank() == rank, "comm is rank " + num(comm->rank()) + "'s but the plan is rank " +
                                              num(rank) + "'s");
  }
};

void check_workspace(const void* ws, size_t bytes, size_t need) {
  if (need == 0) return;
  INDEXCP_REQUIRE(ws != nullptr, "workspace is null; the plan needs workspace_bytes() = " + num(static_cast<int64_t>(need)) +
                                     " bytes");
  INDEXCP_REQUIRE(bytes >= need, "workspace_bytes = " + num(static_cast<int64_t>(bytes)) +
                                     " is below the plan's workspace_bytes() = " + num(static_cast<int64_t>(need)));
  INDEXCP_REQUIRE(reinterpret_cast<uintptr_t>(ws) % 16 == 0, "workspace is not 16-byte aligned");
}

// Writes this rank's record: the candidates of the step's rows (rows x H x ranked, the record's
// first rows; later rows are left as they are), then the signature.
void write_record(uint8_t* send, const ExchangeLayout& x, const std::vector<Candidate>& mine, const StepSignature& sig) {
  if (!mine.empty()) std::memcpy(send, mine.data(), mine.size() * sizeof(Candidate));
  std::memcpy(send + x.signature_offset, &sig, sizeof sig);
}

// The merge of the exchanged records (world of them, `stride` bytes apart): -1 everywhere and
// status 1 unless every rank's signature equals `want` (this rank's own step); else merges the
// owned heads of the step's rows.
void merge_records(const uint8_t* recv, size_t stride, const ExchangeLayout& x, int32_t world,
                   const StepSignature& want, const std::vector<QueryRow>& rows, int32_t h0, int32_t nh,
                   const SelectionParams& sel, int32_t* out, uint32_t* status) {
  bool agree = true;
  for (int32_t p = 0; p < world && agree; ++p)
    agree = std::memcmp(recv + static_cast<size_t>(p) * stride + x.signature_offset, &want, sizeof want) == 0;
  if (!agree) {
    std::fill(out, out + rows.size() * static_cast<size_t>(nh) * sel.topk, -1);
    if (status) *status = static_cast<uint32_t>(StepStatus::kRanksDisagree);
    return;
  }
  const size_t per_rank = rows.size() * static_cast<size_t>(x.heads) * x.ranked;
  std::vector<Candidate> all(per_rank * world);
  if (per_rank > 0)
    for (int32_t p = 0; p < world; ++p)
      std::memcpy(all.data() + p * per_rank, recv + static_cast<size_t>(p) * stride, per_rank * sizeof(Candidate));
  merge_candidates(all.data(), world, rows, x.heads, h0, nh, sel, out);
  if (status) *status = static_cast<uint32_t>(StepStatus::kOk);
}

}  // namespace

// =============================================================================================
// DecodePlan

struct DecodePlan::Impl {
  Common c;
  DecodeLimits limits;
  DecodePath path = DecodePath::kReplicated;
  KRounding mode = KRounding::kE4m3;
  ExchangeLayout x;
  size_t exchange_bytes = 0, workspace_bytes = 0;

  bool exchanges() const { return path != DecodePath::kReplicated; }

  DecodeBatch host(const DeviceDecodeBatch& b) const {
    DecodeBatch h;
    h.q = b.q;
    h.heads = limits.heads;
    h.block_table = b.block_table;
    h.num_requests = b.num_requests;
    h.max_pages = limits.max_pages;
    h.seq_lens = b.seq_lens;
    h.query_len = limits.query_len;
    return h;
  }

  StepSignature signature(const DeviceDecodeBatch& b) const {
    StepSignature s;
    s.v[0] = kSignatureMagic;
    s.v[1] = kSignatureVersion;
    s.v[2] = static_cast<uint32_t>(b.num_requests);
    s.v[3] = static_cast<uint32_t>(limits.query_len);
    s.v[4] = static_cast<uint32_t>(limits.heads);
    s.v[5] = static_cast<uint32_t>(limits.sel.ranked());
    s.v[6] = static_cast<uint32_t>(limits.max_pages);
    s.v[7] = static_cast<uint32_t>(limits.max_rows());
    s.v[8] = step_signature_hash(b.seq_lens, b.num_requests);
    return s;
  }

  // The checks of run / publish on the batch (after the cache's).
  void check_batch(const DeviceDecodeBatch& b, bool need_q) const {
    c.check_num_requests(b.num_requests, limits.max_requests);
    if (b.num_requests > 0) {
      if (need_q) INDEXCP_REQUIRE(b.q != nullptr, "q is null");
      INDEXCP_REQUIRE(b.seq_lens != nullptr, "seq_lens is null");
      if (need_q) INDEXCP_REQUIRE(b.block_table != nullptr, "block_table is null");
    }
  }

  // The rows of a step from its seq_lens alone (the merge needs no block table or q): decode_rows'
  // checks of seq_lens.
  std::vector<QueryRow> merge_rows(const DeviceDecodeBatch& b) const {
    std::vector<QueryRow> rows;
    rows.reserve(static_cast<size_t>(b.num_requests) * limits.query_len);
    for (int32_t r = 0; r < b.num_requests; ++r) {
      const int32_t s = b.seq_lens[r];
      INDEXCP_REQUIRE(s >= 0, "seq_lens[" + num(r) + "] = " + num(s) + " is negative");
      INDEXCP_REQUIRE(s == 0 || s >= limits.query_len, "seq_lens[" + num(r) + "] = " + num(s) +
                                                           " is shorter than query_len = " + num(limits.query_len) +
                                                           " (0 marks a padded request)");
      for (int32_t i = 0; i < limits.query_len; ++i)
        rows.push_back({r, s == 0 ? -1 : static_cast<int64_t>(s) - limits.query_len + i});
    }
    return rows;
  }

  void publish(const CacheView& cache, int32_t layer, const DeviceDecodeBatch& b, uint8_t* send) const {
    const DecodeBatch hb = host(b);
    const auto rows = decode_rows(hb, cache.num_pages(), c.layout.page_size);
    const BlockFilter filter = path == DecodePath::kIcp ? BlockFilter{} : BlockFilter{c.world, c.rank};
    const auto scores = score_blocks(cache, layer, rows, hb.block_table, hb.max_pages, hb.q, hb.heads, 0, hb.heads,
                                     mode, filter);
    std::vector<Candidate> mine(rows.size() * static_cast<size_t>(hb.heads) * x.ranked);
    publish_candidates(scores, rows, limits.sel, mine.data());
    write_record(send, x, mine, signature(b));
  }

  void merge(const DeviceDecodeBatch& b, const uint8_t* recv, int32_t* out, uint32_t* status) const {
    const auto rows = merge_rows(b);
    merge_records(recv, exchange_bytes, x, c.world, signature(b), rows, c.h0, c.nh, limits.sel, out, status);
  }
};

DecodePlan::DecodePlan(const ResolvedConfig& config, int32_t rank, const DecodeLimits& limits)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  check_limit(limits.max_requests, 1, kMaxRequests, "limits.max_requests");
  check_limit(limits.max_pages, 1, kMaxPages, "limits.max_pages");
  check_limit(limits.query_len, 1, 16, "limits.query_len");
  m.c.init(config, rank, limits.heads);
  check_limit_sel(limits.sel);
  m.limits = limits;
  m.path = decode_path(config);
  m.mode = config.k_rounding;
  if (m.exchanges()) {
    m.x = exchange_layout(limits.max_rows(), limits.heads, limits.sel);
    m.exchange_bytes = m.x.record_bytes;
    m.workspace_bytes = round16(m.exchange_bytes * (1 + static_cast<size_t>(m.c.world)));
  } else {
    m.x = ExchangeLayout{};
  }
}

DecodePlan::~DecodePlan() = default;
DecodePlan::DecodePlan(DecodePlan&&) noexcept = default;
DecodePlan& DecodePlan::operator=(DecodePlan&&) noexcept = default;

DecodePath DecodePlan::path() const { return impl_->path; }
const DecodeLimits& DecodePlan::limits() const { return impl_->limits; }
int32_t DecodePlan::world() const { return impl_->c.world; }
int32_t DecodePlan::rank() const { return impl_->c.rank; }
int32_t DecodePlan::head_begin() const { return impl_->c.h0; }
int32_t DecodePlan::num_heads() const { return impl_->c.nh; }
size_t DecodePlan::workspace_bytes() const { return impl_->workspace_bytes; }
size_t DecodePlan::exchange_bytes() const { return impl_->exchange_bytes; }
ExchangeLayout DecodePlan::exchange() const { return impl_->x; }

void DecodePlan::check_cache(const CacheView& cache, int32_t layer) const { impl_->c.check_cache(cache, layer); }

void DecodePlan::run(const CacheView& cache, int32_t layer, const DeviceDecodeBatch& batch, void* workspace,
                     size_t workspace_bytes, int32_t* out, Communicator* comm, uint32_t* status) const {
  const Impl& m = *impl_;
  m.c.check_cache(cache, layer);
  m.check_batch(batch, true);
  const int64_t rows = static_cast<int64_t>(batch.num_requests) * m.limits.query_len;
  INDEXCP_REQUIRE(rows == 0 || out != nullptr, "out is null");
  check_workspace(workspace, workspace_bytes, m.workspace_bytes);
  if (!m.exchanges()) {
    decode_select(cache, layer, m.host(batch), m.c.h0, m.c.nh, m.limits.sel, m.mode, out);
    if (status) *status = static_cast<uint32_t>(StepStatus::kOk);
    return;
  }
  m.c.check_comm(comm, to_string(m.path));
  uint8_t* send = static_cast<uint8_t*>(workspace);
  uint8_t* recv = send + m.exchange_bytes;
  m.publish(cache, layer, batch, send);
  comm->all_gather(send, recv, m.exchange_bytes, nullptr);
  m.merge(batch, recv, out, status);
}

void DecodePlan::publish(const CacheView& cache, int32_t layer, const DeviceDecodeBatch& batch, void* workspace,
                         size_t workspace_bytes, void* send) const {
  const Impl& m = *impl_;
  INDEXCP_REQUIRE(m.exchanges(), "DecodePlan::publish: the replicated decode path exchanges nothing (use run)");
  m.c.check_cache(cache, layer);
  m.check_batch(batch, true);
  check_workspace(workspace, workspace_bytes, m.workspace_bytes);
  INDEXCP_REQUIRE(send != nullptr, "send is null");
  INDEXCP_REQUIRE(reinterpret_cast<uintptr_t>(send) % 8 == 0, "send is not 8-byte aligned");
  m.publish(cache, layer, batch, static_cast<uint8_t*>(send));
}

void DecodePlan::merge(const DeviceDecodeBatch& batch, const void* recv, int32_t* out, uint32_t* status) const {
  const Impl& m = *impl_;
  INDEXCP_REQUIRE(m.exchanges(), "DecodePlan::merge: the replicated decode path exchanges nothing (use run)");
  m.check_batch(batch, false);
  const int64_t rows = static_cast<int64_t>(batch.num_requests) * m.limits.query_len;
  INDEXCP_REQUIRE(rows == 0 || out != nullptr, "out is null");
  INDEXCP_REQUIRE(recv != nullptr, "recv is null");
  INDEXCP_REQUIRE(reinterpret_cast<uintptr_t>(recv) % 8 == 0, "recv is not 8-byte aligned");
  m.merge(batch, static_cast<const uint8_t*>(recv), out, status);
}

// =============================================================================================
// PrefillPlan

struct PrefillPlan::Impl {
  Common c;
  PrefillLimits limits;
  PrefillPath path = PrefillPath::kReplicated;
  ExchangeLayout x;
  size_t exchange_bytes = 0, workspace_bytes = 0;
  int64_t units_per_chunk = 0;
  int64_t max_units = 0;  // kGather: limits.max_gather_units, or max_requests x max_pages
  int64_t budget_bytes = 0;

  PrefillBatch host(const DevicePrefillBatch& b, int64_t rows) const {
    static const int32_t no_query_start = 0;  // query_start of a chunk of no requests may be null
    static const uint8_t no_q = 0;            // q of a chunk of no rows may be null (never read)
    PrefillBatch h;
    h.q = b.q == nullptr && rows == 0 ? &no_q : b.q;
    h.heads = limits.heads;
    h.block_table = b.block_table;
    h.num_requests = b.num_requests;
    h.max_pages = limits.max_pages;
    h.seq_lens = b.seq_lens;
    h.query_start = b.num_requests == 0 && b.query_start == nullptr ? &no_query_start : b.query_start;
    return h;
  }

  StepSignature signature(const PrefillBatch& b, int64_t rows) const {
    StepSignature s;
    s.v[0] = kSignatureMagic;
    s.v[1] = kSignatureVersion;
    s.v[2] = static_cast<uint32_t>(b.num_requests);
    s.v[3] = 0;
    s.v[4] = static_cast<uint32_t>(limits.heads);
    s.v[5] = static_cast<uint32_t>(limits.sel.ranked());
    s.v[6] = static_cast<uint32_t>(limits.max_pages);
    s.v[7] = static_cast<uint32_t>(limits.max_rows);
    s.v[8] = step_signature_hash(b.seq_lens, b.num_requests);
    s.v[9] = step_signature_hash(b.query_start, static_cast<int64_t>(b.num_requests) + 1);
    s.v[10] = static_cast<uint32_t>(rows);
    return s;
  }
};

PrefillPlan::PrefillPlan(const ResolvedConfig& config, int32_t rank, const PrefillLimits& limits)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  check_limit(limits.max_requests, 1, kMaxRequests, "limits.max_requests");
  check_limit(limits.max_pages, 1, kMaxPages, "limits.max_pages");
  check_limit(limits.max_rows, 1, kMaxPrefillRows, "limits.max_rows");
  m.c.init(config, rank, limits.heads);
  check_limit_sel(limits.sel);
  m.limits = limits;
  m.path = prefill_path(config);
  m.budget_bytes = config.prefill_gather_budget_bytes;
  if (m.path == PrefillPath::kLocalScore) {
    m.x = exchange_layout(limits.max_rows, limits.heads, limits.sel);
    m.exchange_bytes = m.x.record_bytes;
  } else if (m.path == PrefillPath::kGather) {
    const int64_t unit = gather_unit_bytes(m.c.layout);
    INDEXCP_REQUIRE(m.budget_bytes >= unit, "indexer_prefill_gather_budget_mib gives " + num(m.budget_bytes) +
                                                " bytes, below one page of one request (" + num(unit) + " bytes)");
    const int64_t table = static_cast<int64_t>(limits.max_requests) * limits.max_pages;
    INDEXCP_REQUIRE(table < (int64_t{1} << 31), "limits: max_requests x max_pages exceeds 2^31 gather units");
    INDEXCP_REQUIRE(limits.max_gather_units >= 0 && limits.max_gather_units <= table,
                    "limits.max_gather_units = " + num(limits.max_gather_units) +
                        " is outside [0, max_requests x max_pages = " + num(table) + "]");
    m.max_units = limits.max_gather_units > 0 ? limits.max_gather_units : table;
    m.units_per_chunk = std::max<int64_t>(1, std::min<int64_t>(m.budget_bytes / unit, m.max_units));
    m.exchange_bytes = static_cast<size_t>(m.units_per_chunk) * m.c.layout.rows() * kHeadDim;
  }
  if (m.path != PrefillPath::kReplicated)
    m.workspace_bytes = round16(m.exchange_bytes * (1 + static_cast<size_t>(m.c.world)));
}

PrefillPlan::~PrefillPlan() = default;
PrefillPlan::PrefillPlan(PrefillPlan&&) noexcept = default;
PrefillPlan& PrefillPlan::operator=(PrefillPlan&&) noexcept = default;

PrefillPath PrefillPlan::path() const { return impl_->path; }
const PrefillLimits& PrefillPlan::limits() const { return impl_->limits; }
int32_t PrefillPlan::world() const { return impl_->c.world; }
int32_t PrefillPlan::rank() const { return impl_->c.rank; }
int32_t PrefillPlan::head_begin() const { return impl_->c.h0; }
int32_t PrefillPlan::num_heads() const { return impl_->c.nh; }
size_t PrefillPlan::workspace_bytes() const { return impl_->workspace_bytes; }
size_t PrefillPlan::exchange_bytes() const { return impl_->exchange_bytes; }
int64_t PrefillPlan::units_per_chunk() const { return impl_->units_per_chunk; }

int64_t PrefillPlan::gather_chunks(const PrefillExtents& extents) const {
  const Impl& m = *impl_;
  if (m.path != PrefillPath::kGather || extents.gather_units <= 0) return 0;
  return (extents.gather_units + m.units_per_chunk - 1) / m.units_per_chunk;
}

void PrefillPlan::check_cache(const CacheView& cache, int32_t layer) const { impl_->c.check_cache(cache, layer); }

void PrefillPlan::run(const CacheView& cache, int32_t layer, const DevicePrefillBatch& batch,
                      const PrefillExtents& extents, void* workspace, size_t workspace_bytes, int32_t* out,
                      Communicator* comm, uint32_t* status) const {
  const Impl& m = *impl_;
  m.c.check_cache(cache, layer);
  m.c.check_num_requests(batch.num_requests, m.limits.max_requests);
  INDEXCP_REQUIRE(extents.rows >= 0 && extents.rows <= m.limits.max_rows,
                  "extents.rows = " + num(extents.rows) + " is outside [0, limits.max_rows = " + num(m.limits.max_rows) +
                      "]");
  INDEXCP_REQUIRE(extents.max_rows_per_request >= 1,
                  "extents.max_rows_per_request = " + num(extents.max_rows_per_request) + " must be >= 1");
  INDEXCP_REQUIRE(extents.gather_units >= 0, "extents.gather_units = " + num(extents.gather_units) + " must be >= 0");
  INDEXCP_REQUIRE(m.path != PrefillPath::kGather || extents.gather_units <= m.max_units,
                  "extents.gather_units = " + num(extents.gather_units) +
                      " exceeds the plan's limits.max_gather_units = " + num(m.max_units));
  if (batch.num_requests > 0) {
    INDEXCP_REQUIRE(batch.query_start != nullptr, "query_start is null");
    INDEXCP_REQUIRE(batch.seq_lens != nullptr, "seq_lens is null");
    INDEXCP_REQUIRE(batch.block_table != nullptr, "block_table is null");
    INDEXCP_REQUIRE(extents.rows == 0 || batch.q != nullptr, "q is null");
  }
  const PrefillBatch pb = m.host(batch, extents.rows);
  const int64_t rows = pb.query_start[pb.num_requests];
  INDEXCP_REQUIRE(extents.rows == rows, "extents.rows = " + num(extents.rows) +
                                            " differs from query_start[num_requests] = " + num(rows));
  int64_t max_t = 0;
  for (int32_t r = 0; r < pb.num_requests; ++r)
    max_t = std::max<int64_t>(max_t, static_cast<int64_t>(pb.query_start[r + 1]) - pb.query_start[r]);
  INDEXCP_REQUIRE(max_t <= extents.max_rows_per_request,
                  "extents.max_rows_per_request = " + num(extents.max_rows_per_request) +
                      " is below the chunk's longest request (" + num(max_t) + " rows)");
  INDEXCP_REQUIRE(rows == 0 || out != nullptr, "out is null");
  check_workspace(workspace, workspace_bytes, m.workspace_bytes);
  if (m.path != PrefillPath::kReplicated) m.c.check_comm(comm, to_string(m.path));

  switch (m.path) {
    case PrefillPath::kReplicated:
      prefill_select(cache, layer, pb, m.c.h0, m.c.nh, m.limits.sel, out);
      if (status) *status = static_cast<uint32_t>(StepStatus::kOk);
      return;
    case PrefillPath::kGather: {
      // the batch's checks first (prefill_gather repeats them), then the chunk's true units
      // (every rank computes the same from the same batch)
      (void)prefill_rows(pb, cache.num_pages(), m.c.layout.page_size);
      const PrefillExtents exact = prefill_extents(pb, m.c.layout.page_size);
      if (exact.gather_units > extents.gather_units) {
        std::fill(out, out + static_cast<size_t>(rows) * m.c.nh * m.limits.sel.topk, -1);
        if (status) *status = static_cast<uint32_t>(StepStatus::kGatherUnitsExceeded);
        return;
      }
      prefill_gather(*comm, cache, layer, pb, m.limits.sel, m.budget_bytes, out);
      if (status) *status = static_cast<uint32_t>(StepStatus::kOk);
      return;
    }
    case PrefillPath::kLocalScore: {
      const auto qrows = prefill_rows(pb, cache.num_pages(), m.c.layout.page_size);
      const auto scores = score_blocks(cache, layer, qrows, pb.block_table, pb.max_pages, pb.q, pb.heads, 0, pb.heads,
                                       KRounding::kE4m3, BlockFilter{});
      std::vector<Candidate> mine(qrows.size() * static_cast<size_t>(pb.heads) * m.x.ranked);
      publish_candidates(scores, qrows, m.limits.sel, mine.data());
      uint8_t* send = static_cast<uint8_t*>(workspace);
      uint8_t* recv = send + m.exchange_bytes;
      const StepSignature sig = m.signature(pb, rows);
      write_record(send, m.x, mine, sig);
      comm->all_gather(send, recv, m.exchange_bytes, nullptr);
      merge_records(recv, m.exchange_bytes, m.x, m.c.world, sig, qrows, m.c.h0, m.c.nh, m.limits.sel, out, status);
      return;
    }
  }
}

}  // namespace indexcp
