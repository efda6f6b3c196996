// indexcp Python extension: the shared types of plan.hpp / indexer.hpp / cache.hpp and the CPU
// backend's calls (host memory: numpy arrays, CPU tensors, any DLPack producer on the CPU).
#include <cstring>

#include <nanobind/trampoline.h>

#include "calls.hpp"
#include "common.hpp"
#include "indexcp/cache.hpp"
#include "indexcp/comm.hpp"
#include "indexcp/icp.hpp"
#include "indexcp/indexer.hpp"
#include "indexcp/plan.hpp"

using namespace indexcp;
using namespace indexcp::py;
using namespace nb::literals;

namespace {

constexpr Where kHost = Where::kHost;
constexpr const char* kCpu = "CPU backend: every array is host memory (numpy, CPU tensors); the call is synchronous.";

DecodeBatch host_decode_batch(const In& q, const In& block_table, const In& seq_lens, int32_t query_len) {
  check(seq_lens, "seq_lens", {Dt::kI32}, {-1}, "[num_requests]", kHost);
  const int64_t r = static_cast<int64_t>(seq_lens.shape(0));
  std::string dims = "[num_requests = " + std::to_string(r) + ", max_pages]";
  check(block_table, "block_table", {Dt::kI32}, {r, -1}, dims.c_str(), kHost);
  if (query_len < 1 || query_len > 16) invalid("query_len = " + std::to_string(query_len) + " must lie in 1..16");
  dims = "[num_requests * query_len = " + std::to_string(r * query_len) + ", heads, 128]";
  check(q, "q", {Dt::kU8}, {r * query_len, -1, 128}, dims.c_str(), kHost);
  DecodeBatch b;
  b.q = static_cast<const uint8_t*>(q.data());
  b.heads = static_cast<int32_t>(q.shape(1));
  b.block_table = static_cast<const int32_t*>(block_table.data());
  b.num_requests = static_cast<int32_t>(r);
  b.max_pages = static_cast<int32_t>(block_table.shape(1));
  b.seq_lens = static_cast<const int32_t*>(seq_lens.data());
  b.query_len = query_len;
  return b;
}

PrefillBatch host_prefill_batch(const std::optional<In>& q, const In& block_table, const In& seq_lens,
                                const In& query_start) {
  check(seq_lens, "seq_lens", {Dt::kI32}, {-1}, "[num_requests]", kHost);
  const int64_t r = static_cast<int64_t>(seq_lens.shape(0));
  std::string dims = "[num_requests + 1 = " + std::to_string(r + 1) + "]";
  check(query_start, "query_start", {Dt::kI32}, {r + 1}, dims.c_str(), kHost);
  dims = "[num_requests = " + std::to_string(r) + ", max_pages]";
  check(block_table, "block_table", {Dt::kI32}, {r, -1}, dims.c_str(), kHost);
  PrefillBatch b;
  b.block_table = static_cast<const int32_t*>(block_table.data());
  b.num_requests = static_cast<int32_t>(r);
  b.max_pages = static_cast<int32_t>(block_table.shape(1));
  b.seq_lens = static_cast<const int32_t*>(seq_lens.data());
  b.query_start = static_cast<const int32_t*>(query_start.data());
  if (q) {
    const int64_t rows = r > 0 ? b.query_start[r] : 0;
    dims = "[query_start[-1] = " + std::to_string(rows) + ", heads, 128]";
    check(*q, "q", {Dt::kU8}, {rows, -1, 128}, dims.c_str(), kHost);
    b.q = static_cast<const uint8_t*>(q->data());
    b.heads = static_cast<int32_t>(q->shape(1));
  }
  return b;
}

int32_t* select_out(const Out& out, int64_t rows, int32_t nh, const SelectionParams& sel) {
  return out_ptr(out, rows, nh, sel.topk, kHost);
}

/// A Communicator whose collectives are Python methods (host memory only): the base of
/// indexcp.distributed.TorchCommunicator. The library calls all_gather / all_to_all from inside a
/// CPU plan's run, on the thread that called run, with the GIL released; each call takes the GIL
/// back, wraps the library's buffers as numpy uint8 arrays (no copies, no owner: valid only
/// during the call) and calls the Python method. rank / world are fixed at construction (the
/// library asks for them without the GIL); bytes_sent is counted here, as InProcessGroup counts.
class HostCommunicator : public Communicator {
 public:
  HostCommunicator(int rank, int world) : rank_(rank), world_(world) { check_rank_world(rank, world); }
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  std::size_t bytes_sent() const override { return sent_; }
  void all_gather(const void* send, void* recv, std::size_t bytes, void*) override {
    collective(&HostCommunicator::py_all_gather, send, bytes, recv, bytes * world_);
    sent_ += bytes;
  }
  void all_to_all(const void* send, void* recv, std::size_t bytes, void*) override {
    collective(&HostCommunicator::py_all_to_all, send, bytes * world_, recv, bytes * world_);
    sent_ += bytes * world_;
  }
  /// The Python methods (the trampoline's): send uint8 [n] (read it only), recv uint8 [m].
  virtual void py_all_gather(nb::object send, nb::object recv) = 0;
  virtual void py_all_to_all(nb::object send, nb::object recv) = 0;

 private:
  void collective(void (HostCommunicator::*f)(nb::object, nb::object), const void* send, size_t send_bytes,
                  void* recv, size_t recv_bytes) {
    nb::gil_scoped_acquire gil;
    using Arr = nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>;
    nb::object s = nb::cast(Arr(const_cast<void*>(send), {send_bytes}, nb::handle()), nb::rv_policy::reference);
    nb::object r = nb::cast(Arr(recv, {recv_bytes}, nb::handle()), nb::rv_policy::reference);
    (this->*f)(s, r);
  }
  int rank_, world_;
  std::size_t sent_ = 0;
};

struct PyHostCommunicator : HostCommunicator {
#if NB_VERSION_MAJOR >= 3
  NB_TRAMPOLINE(HostCommunicator);
#else
  NB_TRAMPOLINE(HostCommunicator, 2);
#endif
  void py_all_gather(nb::object send, nb::object recv) override { NB_OVERRIDE_PURE_NAME("all_gather", py_all_gather, send, recv); }
  void py_all_to_all(nb::object send, nb::object recv) override { NB_OVERRIDE_PURE_NAME("all_to_all", py_all_to_all, send, recv); }
};

template <class T>
nb::ndarray<nb::numpy, T> owned_array(std::vector<T>&& v, std::initializer_list<size_t> shape) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule del(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(heap->data(), shape, del);
}

}  // namespace

namespace indexcp::py {

void bind_host(nb::module_& m) {
  // ---- shared types (indexer.hpp, plan.hpp, icp.hpp) --------------------------------------
  nb::class_<SelectionParams>(m, "SelectionParams", "Top-k selection parameters (indexer.hpp, spec/indexer.md 1, 4).")
      .def("__init__", [](SelectionParams* p, int32_t topk, int32_t init_blocks, int32_t local_blocks) {
        new (p) SelectionParams{topk, init_blocks, local_blocks};
      }, "topk"_a = 16, "init_blocks"_a = 0, "local_blocks"_a = 1)
      .def_rw("topk", &SelectionParams::topk)
      .def_rw("init_blocks", &SelectionParams::init_blocks)
      .def_rw("local_blocks", &SelectionParams::local_blocks)
      .def_prop_ro("ranked", &SelectionParams::ranked, "K - 1 - init: ranked slots (the candidates a rank publishes).")
      .def("validate", &SelectionParams::validate);

  nb::enum_<DecodePath>(m, "DecodePath", "How a decode step of one rank is computed (plan.hpp).")
      .value("replicated", DecodePath::kReplicated)
      .value("icp", DecodePath::kIcp)
      .value("decode_cp", DecodePath::kDecodeCp);
  nb::enum_<PrefillPath>(m, "PrefillPath", "How a prefill chunk of one rank is computed (plan.hpp).")
      .value("replicated", PrefillPath::kReplicated)
      .value("gather", PrefillPath::kGather)
      .value("local_score", PrefillPath::kLocalScore);
  nb::enum_<StepStatus>(m, "StepStatus", "The uint32 a merge writes every step (plan.hpp; an IntEnum).", nb::is_arithmetic())
      .value("ok", StepStatus::kOk)
      .value("ranks_disagree", StepStatus::kRanksDisagree)
      .value("gather_units_exceeded", StepStatus::kGatherUnitsExceeded);
  m.def("decode_path", &decode_path, "config"_a);
  m.def("prefill_path", &prefill_path, "config"_a);
  m.def("step_status_message", &step_status_message, "status"_a, "call"_a,
        "'' for 0 (ok), else the message of the synchronous paths' error.");

  nb::class_<DecodeLimits>(m, "DecodeLimits", "The maximum shapes a decode plan serves (plan.hpp).")
      .def("__init__", [](DecodeLimits* p, int32_t max_requests, int32_t max_pages, int32_t query_len, int32_t heads,
                          const SelectionParams& sel) { new (p) DecodeLimits{max_requests, max_pages, query_len, heads, sel}; },
           "max_requests"_a = 1, "max_pages"_a = 1, "query_len"_a = 1, "heads"_a = 4, "sel"_a = SelectionParams{})
      .def_rw("max_requests", &DecodeLimits::max_requests)
      .def_rw("max_pages", &DecodeLimits::max_pages)
      .def_rw("query_len", &DecodeLimits::query_len)
      .def_rw("heads", &DecodeLimits::heads)
      .def_rw("sel", &DecodeLimits::sel)
      .def_prop_ro("max_rows", &DecodeLimits::max_rows);
  nb::class_<PrefillLimits>(m, "PrefillLimits", "The maximum shapes a prefill plan serves (plan.hpp).")
      .def("__init__", [](PrefillLimits* p, int32_t max_requests, int32_t max_pages, int64_t max_rows, int32_t heads,
                          const SelectionParams& sel, int64_t max_gather_units) {
        new (p) PrefillLimits{max_requests, max_pages, max_rows, heads, sel, max_gather_units};
      }, "max_requests"_a = 1, "max_pages"_a = 1, "max_rows"_a = 1, "heads"_a = 4, "sel"_a = SelectionParams{},
           "max_gather_units"_a = 0)
      .def_rw("max_requests", &PrefillLimits::max_requests)
      .def_rw("max_pages", &PrefillLimits::max_pages)
      .def_rw("max_rows", &PrefillLimits::max_rows)
      .def_rw("heads", &PrefillLimits::heads)
      .def_rw("sel", &PrefillLimits::sel)
      .def_rw("max_gather_units", &PrefillLimits::max_gather_units);
  nb::class_<PrefillExtents>(m, "PrefillExtents", "The host values a prefill run needs (plan.hpp).")
      .def("__init__", [](PrefillExtents* p, int64_t rows, int32_t max_rows_per_request, int64_t gather_units) {
        new (p) PrefillExtents{rows, max_rows_per_request, gather_units};
      }, "rows"_a = 0, "max_rows_per_request"_a = 1, "gather_units"_a = 0)
      .def_rw("rows", &PrefillExtents::rows)
      .def_rw("max_rows_per_request", &PrefillExtents::max_rows_per_request)
      .def_rw("gather_units", &PrefillExtents::gather_units);
  m.def("prefill_extents",
        [](In block_table, In seq_lens, In query_start, int32_t page_size) {
          const PrefillBatch b = host_prefill_batch(std::nullopt, block_table, seq_lens, query_start);
          return prefill_extents(b, page_size);
        },
        "block_table"_a, "seq_lens"_a, "query_start"_a, "page_size"_a,
        "The exact extents of a prefill chunk from host copies of its metadata (plan.hpp prefill_extents).");
  nb::class_<ExchangeLayout>(m, "ExchangeLayout", "The layout of one rank's exchange record (plan.hpp).")
      .def_ro("rows", &ExchangeLayout::rows)
      .def_ro("heads", &ExchangeLayout::heads)
      .def_ro("ranked", &ExchangeLayout::ranked)
      .def_ro("candidate_bytes", &ExchangeLayout::candidate_bytes)
      .def_ro("signature_offset", &ExchangeLayout::signature_offset)
      .def_ro("record_bytes", &ExchangeLayout::record_bytes);
  m.def("exchange_layout", &exchange_layout, "rows"_a, "heads"_a, "sel"_a);
  nb::class_<GatherStats>(m, "GatherStats")
      .def_ro("reserved_bytes", &GatherStats::reserved_bytes)
      .def_ro("chunks", &GatherStats::chunks)
      .def_ro("pages", &GatherStats::pages)
      .def_ro("gathered_bytes", &GatherStats::gathered_bytes);

  nb::class_<Communicator>(m, "Communicator",
                           "A group's exchange of byte buffers (comm.hpp). From InProcessGroup.comm(rank).")
      .def_prop_ro("rank", &Communicator::rank)
      .def_prop_ro("world", &Communicator::world)
      .def_prop_ro("bytes_sent", &Communicator::bytes_sent);
  nb::class_<HostCommunicator, Communicator, PyHostCommunicator>(
      m, "HostCommunicator",
      "A Communicator (comm.hpp) over host memory whose collectives are Python methods, for the CPU plans' "
      "run(comm=...): subclass it, call HostCommunicator.__init__(self, rank, world) and define "
      "all_gather(send, recv) (send uint8 [bytes], recv uint8 [world * bytes]: rank p's send lands at "
      "recv[p * bytes:]) and all_to_all(send, recv) (both uint8 [world * bytes]: block p of send goes to rank p, "
      "block p of recv came from rank p). The library calls them from inside run on the calling thread (the "
      "GIL is taken back for the call); the arrays wrap the library's buffers without copies and are valid "
      "only during the call (do not keep them; do not write send). A Python exception in them ends the run "
      "with that exception. indexcp.distributed.TorchCommunicator is one over torch.distributed. "
      "InvalidArgumentError names rank / world out of range.")
      .def(nb::init<int, int>(), "rank"_a, "world"_a)
      .def("call_all_gather",
           [](HostCommunicator& c, Out send, Out recv) {
             const int64_t n = check_bytes(send, "send", 0, 1, kHost);
             check_bytes(recv, "recv", n * c.world(), 1, kHost);
             nb::gil_scoped_release nogil;
             c.all_gather(send.data(), recv.data(), static_cast<size_t>(n), nullptr);
           },
           "send"_a, "recv"_a,
           "Calls the C++ all_gather as a plan does (GIL released, then taken back by the call): for tests of "
           "a subclass. send uint8 [n], recv uint8 [>= world * n].");
  nb::class_<InProcessGroup>(m, "InProcessGroup",
                             "W ranks in one process, one thread each, exchanging host buffers (comm.hpp). Run "
                             "each rank's calls on its own Python thread: the calls release the GIL.")
      .def(nb::init<int>(), "world"_a)
      .def_prop_ro("world", &InProcessGroup::world)
      .def("comm", &InProcessGroup::comm, "rank"_a, nb::rv_policy::reference_internal)
      .def("abort", &InProcessGroup::abort)
      .def("depart", &InProcessGroup::depart, "rank"_a);

  // ---- insert and Q cast (cache.hpp, spec/indexer.md 6, formats.md 3-5) ---------------------
  nb::enum_<InsertRefusal>(m, "InsertRefusal", "Why a batch was refused (cache.hpp InsertStatus.reason; an IntEnum).", nb::is_arithmetic())
      .value("none", InsertRefusal::kNone)
      .value("slot_out_of_range", InsertRefusal::kSlotOutOfRange)
      .value("duplicate_slot", InsertRefusal::kDuplicateSlot)
      .value("non_finite_key", InsertRefusal::kNonFiniteKey)
      .value("position_out_of_table", InsertRefusal::kPositionOutOfTable)
      .value("non_finite_after_preprocess", InsertRefusal::kNonFiniteAfterPreprocess)
      .value("query_nan", InsertRefusal::kQueryNaN)
      .value("query_nan_after_preprocess", InsertRefusal::kQueryNaNAfterPreprocess);
  nb::class_<InsertStatus>(m, "InsertStatus", "A host copy of a status buffer (cache.hpp InsertStatus, 72 bytes).")
      .def_ro("reason", &InsertStatus::reason)
      .def_ro("layer", &InsertStatus::layer)
      .def_ro("token", &InsertStatus::token)
      .def_ro("value", &InsertStatus::value)
      .def_ro("dim", &InsertStatus::dim)
      .def_ro("head", &InsertStatus::head)
      .def_ro("key_value", &InsertStatus::key_value)
      .def_ro("heads", &InsertStatus::heads)
      .def_ro("limit", &InsertStatus::limit)
      .def_ro("refused_calls", &InsertStatus::refused_calls)
      .def_ro("refused_tokens", &InsertStatus::refused_tokens)
      .def("error", [](const InsertStatus& s) -> nb::object {
        if (s.reason == 0) return nb::none();
        throw status_error(s);
      }, "Raises the error the synchronous call would have raised for the first refusal; None when none.")
      .def("__repr__", [](const InsertStatus& s) {
        return "InsertStatus(reason=" + std::string(to_string(static_cast<InsertRefusal>(s.reason))) +
               ", layer=" + std::to_string(s.layer) + ", token=" + std::to_string(s.token) +
               ", refused_calls=" + std::to_string(s.refused_calls) + ")";
      });
  m.attr("STATUS_BYTES") = sizeof(InsertStatus);
  m.def("reset_status", [](Out status) { reset_status(status_ptr(status, kHost)); }, "status"_a,
        "Zero-fills a host status buffer (uint8 [STATUS_BYTES]).");
  m.def("read_status", [](Out status) { return read_status(status_ptr(status, kHost)); }, "status"_a,
        "A copy of a host status buffer as InsertStatus.");
  m.def("throw_if_refused", [](Out status) { throw_if_refused(read_status(status_ptr(status, kHost))); }, "status"_a,
        "Raises the synchronous call's error (same class and message) when the host status recorded a refusal.");
  m.def("insert_workspace_bytes", [](int64_t n) { return insert_workspace_bytes(n); }, "max_tokens"_a,
        "Workspace bytes the CPU backend's insert_keys_async needs: 0 (cache.hpp).");
  m.def("check_num_tokens", &check_num_tokens, "num_tokens"_a);

  m.def("insert_keys",
        [](const PyCacheView& cache, int32_t layer, In keys, In slot_mapping, float encode_scale,
           std::optional<In> norm_weight, float eps, bool rope, double rope_theta, std::optional<In> positions) {
          const CacheView& v = view_at(cache, kHost);
          const Dt kd = check_keys(keys, kHost);
          const int64_t n = static_cast<int64_t>(keys.shape(0));
          const std::string dims = "[num_tokens = " + std::to_string(n) + "]";
          check(slot_mapping, "slot_mapping", {Dt::kI64}, {n}, dims.c_str(), kHost);
          InsertOptions opts;
          opts.encode_scale = encode_scale;
          opts.pre = make_pre(kHost, n, norm_weight, eps, rope, rope_theta, positions, std::nullopt);
          nb::gil_scoped_release nogil;
          if (kd == Dt::kF32)
            insert_keys(v, layer, static_cast<const float*>(keys.data()),
                        static_cast<const int64_t*>(slot_mapping.data()), n, opts);
          else
            insert_keys_bf16(v, layer, static_cast<const uint16_t*>(keys.data()),
                             static_cast<const int64_t*>(slot_mapping.data()), n, opts);
        },
        "cache"_a, "layer"_a, "keys"_a, "slot_mapping"_a, nb::kw_only(), "encode_scale"_a = 1.0f,
        "norm_weight"_a = nb::none(), "eps"_a = 1e-6f, "rope"_a = false, "rope_theta"_a = 5e6,
        "positions"_a = nb::none(),
        (std::string("Quantizes and writes keys (fp32, or bf16 / uint16 bit patterns, [num_tokens, 128]) at "
                     "slot_mapping (int64 [num_tokens]; slot = page * P + offset, -1 skips) into a host cache "
                     "view: the synchronous, validating form (cache.hpp insert_keys; spec/indexer.md 6, "
                     "formats.md 3-4). With a sharded view only this rank's rows are written. "
                     "InvalidArgumentError (nothing of the batch written): layer, slot out of range or "
                     "duplicated, non-finite key, encode_scale, RoPE without positions.") +
         kPreDoc)
            .c_str());
  bind_insert_async(m, kHost, &indexcp::insert_keys_async, &indexcp::insert_keys_bf16_async, kCpu);

  m.def("quantize_queries",
        [](In q, Out out, std::optional<In> norm_weight, float eps, bool rope, double rope_theta,
           std::optional<In> positions) {
          check(q, "q", {Dt::kF32}, {-1, -1, 128}, "[num_tokens, heads, 128]", kHost);
          const int64_t n = static_cast<int64_t>(q.shape(0));
          const int32_t heads = static_cast<int32_t>(q.shape(1));
          const std::string dims = "[num_tokens = " + std::to_string(n) + ", heads = " + std::to_string(heads) + ", 128]";
          check(out, "out", {Dt::kU8}, {n, heads, 128}, dims.c_str(), kHost);
          const KeyPreprocess pre = make_pre(kHost, n, norm_weight, eps, rope, rope_theta, positions, std::nullopt);
          nb::gil_scoped_release nogil;
          quantize_queries(static_cast<const float*>(q.data()), n, heads, pre, static_cast<uint8_t*>(out.data()));
        },
        "q"_a, "out"_a, nb::kw_only(), "norm_weight"_a = nb::none(), "eps"_a = 1e-6f, "rope"_a = false,
        "rope_theta"_a = 5e6, "positions"_a = nb::none(),
        (std::string("Index-Q cast (formats.md 5; cache.hpp quantize_queries): q fp32 [num_tokens, heads, 128] "
                     "-> out uint8 E4M3 [num_tokens, heads, 128] (e4m3_rne_satfinite). InvalidArgumentError "
                     "naming q (token, head, dim) for NaN; nothing written.") +
         kPreDoc)
            .c_str());
  bind_quantize_async(m, kHost, &indexcp::quantize_queries_async, kCpu);

  m.def("fill_rope_table",
        [](Out out, double rope_theta) {
          check(out, "out", {Dt::kF32}, {-1, 64}, "[num_positions, 64]", kHost);
          fill_rope_table(static_cast<float*>(out.data()), static_cast<int64_t>(out.shape(0)), rope_theta);
        },
        "out"_a, "rope_theta"_a = 5e6,
        "Fills a host RoPE table fp32 [num_positions, 64]: row p = cos of pairs 0..31 then sin (cache.hpp).");

  m.def("quantize_key_bytes",
        [](KvDtype dtype, In key, float encode_scale) {
          check(key, "key", {Dt::kF32}, {128}, "[128]", kHost);
          const std::vector<uint8_t> b = quantize_key_bytes(dtype, static_cast<const float*>(key.data()), encode_scale);
          return nb::bytes(reinterpret_cast<const char*>(b.data()), b.size());
        },
        "dtype"_a, "key"_a, "encode_scale"_a = 1.0f,
        "The row bytes the cache would store for one key (nvfp4: 64 data + 8 scales; fp8: 128; bf16: 256).");
  m.def("read_row_bytes",
        [](const PyCacheView& cache, int32_t layer, int64_t page, int32_t row) {
          const std::vector<uint8_t> b = read_row_bytes(view_at(cache, kHost), layer, page, row);
          return nb::bytes(reinterpret_cast<const char*>(b.data()), b.size());
        },
        "cache"_a, "layer"_a, "page"_a, "row"_a, "Row bytes (quantize_key_bytes form) of local row `row` of a page.");
  m.def("read_row_khat",
        [](const PyCacheView& cache, int32_t layer, int64_t page, int32_t row, KRounding mode, Out out) {
          check(out, "out", {Dt::kF32}, {128}, "[128]", kHost);
          read_row_khat(view_at(cache, kHost), layer, page, row, mode, static_cast<float*>(out.data()));
        },
        "cache"_a, "layer"_a, "page"_a, "row"_a, "mode"_a, "out"_a,
        "Dequantized k_hat (spec/indexer.md 2) of a local row into out fp32 [128].");

  // ---- synchronous decode / prefill / ICP (indexer.hpp, icp.hpp) ----------------------------
  m.def("score_blocks",
        [](const PyCacheView& cache, int32_t layer, In q, In block_table, In seq_lens, int32_t query_len, int32_t h0,
           int32_t nh, KRounding mode) {
          const CacheView& v = view_at(cache, kHost);
          const DecodeBatch b = host_decode_batch(q, block_table, seq_lens, query_len);
          const auto rows = decode_rows(b, v.num_pages(), v.layout().page_size);
          BlockScores s = score_blocks(v, layer, rows, b.block_table, b.max_pages, b.q, b.heads, h0, nh, mode);
          const size_t r = static_cast<size_t>(s.rows), h = static_cast<size_t>(s.heads),
                       nb_ = static_cast<size_t>(s.max_blocks);
          return nb::make_tuple(owned_array<float>(std::move(s.score), {r, h, nb_}),
                                owned_array<uint8_t>(std::move(s.valid), {r, h, nb_}));
        },
        "cache"_a, "layer"_a, "q"_a, "block_table"_a, "seq_lens"_a, "query_len"_a, "h0"_a, "nh"_a,
        "mode"_a = KRounding::kE4m3,
        "Block scores of a decode batch (indexer.hpp score_blocks, spec/indexer.md 3): (score fp32 [rows, nh, "
        "max_pages * P / 128], valid uint8 of the same shape); invalid entries hold -inf. A tool: allocates.");
  m.def("decode_select",
        [](const PyCacheView& cache, int32_t layer, In q, In block_table, In seq_lens, int32_t query_len, int32_t h0,
           int32_t nh, const SelectionParams& sel, KRounding mode, Out out) {
          const CacheView& v = view_at(cache, kHost);
          const DecodeBatch b = host_decode_batch(q, block_table, seq_lens, query_len);
          int32_t* o = select_out(out, b.rows(), nh, sel);
          nb::gil_scoped_release nogil;
          decode_select(v, layer, b, h0, nh, sel, mode, o);
        },
        "cache"_a, "layer"_a, "q"_a, "block_table"_a, "seq_lens"_a, "query_len"_a, "h0"_a, "nh"_a, "sel"_a,
        "mode"_a, "out"_a,
        "Replicated decode (indexer.hpp decode_select; spec/indexer.md 3-4), synchronous and validating: q "
        "uint8 E4M3 [num_requests * query_len, heads, 128], block_table int32 [num_requests, max_pages], "
        "seq_lens int32 [num_requests] -> out int32 [rows, nh, K] for heads [h0, h0 + nh).");
  m.def("prefill_select",
        [](const PyCacheView& cache, int32_t layer, In q, In block_table, In seq_lens, In query_start, int32_t h0,
           int32_t nh, const SelectionParams& sel, Out out) {
          const CacheView& v = view_at(cache, kHost);
          const PrefillBatch b = host_prefill_batch(q, block_table, seq_lens, query_start);
          int32_t* o = select_out(out, b.rows(), nh, sel);
          nb::gil_scoped_release nogil;
          prefill_select(v, layer, b, h0, nh, sel, o);
        },
        "cache"_a, "layer"_a, "q"_a, "block_table"_a, "seq_lens"_a, "query_start"_a, "h0"_a, "nh"_a, "sel"_a,
        "out"_a,
        "Replicated prefill (indexer.hpp prefill_select): NVFP4 scored with E4M3 keys; out int32 [rows, nh, K].");
  m.def("stage_fp8",
        [](const PyCacheView& cache, int32_t layer, In pages, Out out) {
          const CacheView& v = view_at(cache, kHost);
          check(pages, "pages", {Dt::kI32}, {-1}, "[num_pages]", kHost);
          const int64_t n = static_cast<int64_t>(pages.shape(0));
          const std::string dims = "[num_pages = " + std::to_string(n) + ", rows = " + std::to_string(v.layout().rows()) + ", 128]";
          check(out, "out", {Dt::kU8}, {n, v.layout().rows(), 128}, dims.c_str(), kHost);
          nb::gil_scoped_release nogil;
          stage_fp8(v, layer, static_cast<const int32_t*>(pages.data()), n, static_cast<uint8_t*>(out.data()));
        },
        "cache"_a, "layer"_a, "pages"_a, "out"_a,
        "FP8 staging of the gather (icp.hpp stage_fp8, spec/indexer.md 5): this rank's rows of each page id "
        "(int32 [n]) as E4M3 k_hat bytes, out uint8 [n, rows, 128].");
  m.def("icp_decode",
        [](Communicator& comm, const PyCacheView& shard, int32_t layer, In q, In block_table, In seq_lens,
           int32_t query_len, const SelectionParams& sel, KRounding mode, Out out) {
          const CacheView& v = view_at(shard, kHost);
          const DecodeBatch b = host_decode_batch(q, block_table, seq_lens, query_len);
          if (b.heads < 1) invalid("q must have at least one head");
          int32_t h0 = 0, nh = 0;
          check_heads_tp(b.heads, comm.world());
          owned_heads(b.heads, comm.world(), comm.rank(), &h0, &nh);
          int32_t* o = select_out(out, b.rows(), nh, sel);
          nb::gil_scoped_release nogil;
          icp_decode(comm, v, layer, b, sel, mode, o);
        },
        "comm"_a, "shard"_a, "layer"_a, "q"_a, "block_table"_a, "seq_lens"_a, "query_len"_a, "sel"_a, "mode"_a, "out"_a,
        "ICP decode of one rank over a sharded cache (icp.hpp icp_decode): score, publish, all-gather through "
        "comm, merge the owned heads; out int32 [rows, owned heads, K]. Every rank calls it (one thread each).");

  // ---- plans (plan.hpp) ----------------------------------------------------------------------
  bind_decode_plan<DecodePlan, false>(m, kHost, kCpu);
  bind_prefill_plan<PrefillPlan, false>(m, kHost, kCpu);
}

}  // namespace indexcp::py
