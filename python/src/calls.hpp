// indexcp Python extension: the calls both backends bind the same way (the CPU backend in host.cpp,
// the CUDA backend in cuda.cpp): the asynchronous insert and Q cast, and the decode / prefill
// plans. Each takes the backend's functions or plan class; the checks run before any call.
#pragma once

#include <string>

#include "common.hpp"
#include "indexcp/cache.hpp"
#include "indexcp/comm.hpp"
#include "indexcp/plan.hpp"
#include "indexcp/version.hpp"

namespace indexcp::py {

/// A communicator of cuda::DeviceGroup (indexcp.cuda.DeviceGroup(world).comm(rank)): its
/// collectives copy device buffers on the caller's stream. A distinct Python type, so that the
/// plans can tell it from the host InProcessGroup's Communicator: the CUDA plans take only this
/// one (InProcessGroup's all_gather is a host memcpy: given device pointers it would crash), the
/// CPU plans only the host one. The group is kept alive by each of its DeviceComm objects.
struct DeviceComm {
  Communicator* comm = nullptr;
};

#if INDEXCP_CUDA_BACKEND
/// The Communicator of an indexcp.cuda.DeviceCommunicator (a device communicator whose collectives
/// are Python methods, e.g. indexcp.distributed.TorchDeviceCommunicator; cuda.cpp), or nullptr
/// when `comm` is not one.
Communicator* python_device_communicator(nb::handle comm);
#endif

/// The `comm` argument of a plan's run: None -> nullptr; else the communicator of the plan's
/// memory (host Communicator for the CPU plans; DeviceComm or a DeviceCommunicator for the CUDA
/// plans), refused by name otherwise.
template <bool kCuda>
Communicator* comm_arg(nb::handle comm) {
  if (comm.is_none()) return nullptr;
  if constexpr (kCuda) {
    if (nb::isinstance<DeviceComm>(comm)) return nb::cast<DeviceComm&>(comm).comm;
#if INDEXCP_CUDA_BACKEND
    if (Communicator* c = python_device_communicator(comm)) return c;
#endif
    if (nb::isinstance<Communicator>(comm))
      invalid("comm: the CUDA plans exchange through a device communicator (indexcp.cuda.DeviceGroup(world)"
              ".comm(rank), or an indexcp.cuda.DeviceCommunicator such as indexcp.distributed."
              "TorchDeviceCommunicator); a host communicator copies host memory. Pass a device one (for a "
              "decode plan also: comm=None and publish / all-gather / merge, indexcp.distributed.decode)");
  } else {
    if (nb::isinstance<Communicator>(comm)) return nb::cast<Communicator*>(comm);
#if INDEXCP_CUDA_BACKEND
    if (nb::isinstance<DeviceComm>(comm) || python_device_communicator(comm) != nullptr)
      invalid("comm: a device communicator (DeviceGroup, DeviceCommunicator) exchanges device memory; the CPU "
              "plans take a host communicator (indexcp.InProcessGroup(world).comm(rank), HostCommunicator)");
#endif
  }
  invalid(std::string("comm must be None or a communicator (") +
          (kCuda ? "indexcp.cuda.DeviceGroup(world).comm(rank) or an indexcp.cuda.DeviceCommunicator"
                 : "indexcp.InProcessGroup(world).comm(rank) or an indexcp.HostCommunicator") +
          "), got " + nb::type_name(comm.type()).c_str());
}

using namespace nb::literals;

/// Optional arrays of an insert / Q cast's pre-processing (cache.hpp KeyPreprocess).
inline KeyPreprocess make_pre(Where w, int64_t n, const std::optional<In>& norm_weight, float eps, bool rope,
                              double rope_theta, const std::optional<In>& positions,
                              const std::optional<In>& rope_cos_sin) {
  KeyPreprocess pre;
  if (norm_weight) {
    check(*norm_weight, "norm_weight", {Dt::kF32}, {128}, "[128]", w);
    pre.norm_weight = static_cast<const float*>(norm_weight->data());
  }
  pre.eps = eps;
  pre.rope = rope;
  pre.rope_theta = rope_theta;
  if (positions) {
    const std::string dims = "[num_tokens = " + std::to_string(n) + "]";
    check(*positions, "positions", {Dt::kI64}, {n}, dims.c_str(), w);
    pre.positions = static_cast<const int64_t*>(positions->data());
  }
  if (rope_cos_sin) {
    check(*rope_cos_sin, "rope_cos_sin", {Dt::kF32}, {-1, 64}, "[positions, 64]", w);
    pre.rope_cos_sin = static_cast<const float*>(rope_cos_sin->data());
    pre.rope_table_positions = static_cast<int64_t>(rope_cos_sin->shape(0));
  }
  return pre;
}

/// The insert's keys: fp32 or bf16 (torch.bfloat16, or uint16 bit patterns) [num_tokens, 128].
inline Dt check_keys(const In& keys, Where w) {
  return check(keys, "keys", {Dt::kF32, Dt::kBf16, Dt::kU16}, {-1, 128}, "[num_tokens, 128]", w);
}

/// The InsertStatus buffer: uint8 [STATUS_BYTES], 8-byte aligned.
inline InsertStatus* status_ptr(const Out& status, Where w) {
  check_bytes(status, "status", sizeof(InsertStatus), 8, w);
  if (status.nbytes() != sizeof(InsertStatus))
    invalid("status must hold exactly " + std::to_string(sizeof(InsertStatus)) + " bytes (STATUS_BYTES), got " +
            std::to_string(status.nbytes()));
  return static_cast<InsertStatus*>(status.data());
}

inline const char* kPreDoc =
    " Pre-processing (cache.hpp KeyPreprocess, spec/indexer.md 6): norm_weight fp32 [128] (Gemma-style "
    "RMSNorm with eps), rope (partial NeoX RoPE on the first 64 dims at positions int64 [num_tokens], theta "
    "rope_theta).";

template <class InsertF32, class InsertBf16>
void bind_insert_async(nb::module_& m, Where w, InsertF32 f32, InsertBf16 bf16, const char* backend) {
  m.def("insert_keys_async",
        [w, f32, bf16](const PyCacheView& cache, int32_t layer, In keys, In slot_mapping, Out status,
                       std::optional<Out> workspace, float encode_scale, std::optional<In> norm_weight, float eps,
                       bool rope, double rope_theta, std::optional<In> positions, std::optional<In> rope_cos_sin,
                       std::optional<uintptr_t> stream) {
          const CacheView& v = view_at(cache, w);
          const Dt kd = check_keys(keys, w);
          const int64_t n = static_cast<int64_t>(keys.shape(0));
          const std::string dims = "[num_tokens = " + std::to_string(n) + "]";
          check(slot_mapping, "slot_mapping", {Dt::kI64}, {n}, dims.c_str(), w);
          InsertStatus* st = status_ptr(status, w);
          void* ws = nullptr;
          size_t wsb = 0;
          if (workspace) {
            wsb = static_cast<size_t>(check_bytes(*workspace, "workspace", 0, 16, w));
            ws = workspace->data();
          }
          InsertOptions opts;
          opts.encode_scale = encode_scale;
          opts.pre = make_pre(w, n, norm_weight, eps, rope, rope_theta, positions, rope_cos_sin);
          CUstream_st* s = w == Where::kDevice ? static_cast<CUstream_st*>(stream_of(stream)) : nullptr;
          nb::gil_scoped_release nogil;
          if (kd == Dt::kF32)
            f32(v, layer, static_cast<const float*>(keys.data()), static_cast<const int64_t*>(slot_mapping.data()), n,
                opts, ws, wsb, st, s);
          else
            bf16(v, layer, static_cast<const uint16_t*>(keys.data()),
                 static_cast<const int64_t*>(slot_mapping.data()), n, opts, ws, wsb, st, s);
        },
        "cache"_a, "layer"_a, "keys"_a, "slot_mapping"_a, "status"_a, "workspace"_a = nb::none(), nb::kw_only(),
        "encode_scale"_a = 1.0f, "norm_weight"_a = nb::none(), "eps"_a = 1e-6f, "rope"_a = false,
        "rope_theta"_a = 5e6, "positions"_a = nb::none(), "rope_cos_sin"_a = nb::none(), "stream"_a = nb::none(),
        (std::string("Quantizes and writes keys (fp32, or bf16 / uint16 bit patterns, [num_tokens, 128]) at "
                     "slot_mapping (int64 [num_tokens], slot = page * P + offset, -1 skips) into layer `layer` of "
                     "`cache`, the engine's form (cache.hpp / cuda.hpp insert_keys_async; spec/indexer.md 6). ") +
         backend +
         " A bad token (slot out of range or duplicated, non-finite key, position outside the RoPE table) "
         "writes nothing of the batch and is recorded in `status` (uint8 [STATUS_BYTES], zero-filled once; "
         "read_status / throw_if_refused). workspace: uint8 [>= insert_workspace_bytes(num_tokens)], "
         "16-byte aligned (may be None when that is 0). RoPE needs rope_cos_sin, fp32 [positions, 64] "
         "(fill_rope_table). Raises (nothing written) only for what is wrong before any token is read." +
         kPreDoc)
            .c_str());
}

template <class QuantizeAsync>
void bind_quantize_async(nb::module_& m, Where w, QuantizeAsync f, const char* backend) {
  m.def("quantize_queries_async",
        [w, f](In q, Out out, Out status, std::optional<In> norm_weight, float eps, bool rope, double rope_theta,
               std::optional<In> positions, std::optional<In> rope_cos_sin, std::optional<uintptr_t> stream) {
          check(q, "q", {Dt::kF32}, {-1, -1, 128}, "[num_tokens, heads, 128]", w);
          const int64_t n = static_cast<int64_t>(q.shape(0));
          const int32_t heads = static_cast<int32_t>(q.shape(1));
          const std::string dims = "[num_tokens = " + std::to_string(n) + ", heads = " + std::to_string(heads) + ", 128]";
          check(out, "out", {Dt::kU8}, {n, heads, 128}, dims.c_str(), w);
          InsertStatus* st = status_ptr(status, w);
          const KeyPreprocess pre = make_pre(w, n, norm_weight, eps, rope, rope_theta, positions, rope_cos_sin);
          CUstream_st* s = w == Where::kDevice ? static_cast<CUstream_st*>(stream_of(stream)) : nullptr;
          nb::gil_scoped_release nogil;
          f(static_cast<const float*>(q.data()), n, heads, pre, static_cast<uint8_t*>(out.data()), st, s);
        },
        "q"_a, "out"_a, "status"_a, nb::kw_only(), "norm_weight"_a = nb::none(), "eps"_a = 1e-6f, "rope"_a = false,
        "rope_theta"_a = 5e6, "positions"_a = nb::none(), "rope_cos_sin"_a = nb::none(), "stream"_a = nb::none(),
        (std::string("Index-Q cast (formats.md 5; cache.hpp / cuda.hpp quantize_queries_async): q fp32 "
                     "[num_tokens, heads, 128] -> out uint8 E4M3 [num_tokens, heads, 128], NaN (before or "
                     "after RMSNorm/RoPE) recorded in status and nothing written. ") +
         backend + kPreDoc)
            .c_str());
}

// ---- plans (plan.hpp, cuda.hpp) ---------------------------------------------------------------

inline DeviceDecodeBatch decode_batch(const DecodeLimits& lim, const In& q, const In& block_table,
                                      const In& seq_lens, Where w) {
  check(seq_lens, "seq_lens", {Dt::kI32}, {-1}, "[num_requests]", w);
  const int64_t r = static_cast<int64_t>(seq_lens.shape(0));
  std::string dims = "[num_requests = " + std::to_string(r) + ", max_pages = " + std::to_string(lim.max_pages) + "]";
  check(block_table, "block_table", {Dt::kI32}, {r, lim.max_pages}, dims.c_str(), w);
  dims = "[num_requests * query_len = " + std::to_string(r * lim.query_len) + ", heads = " +
         std::to_string(lim.heads) + ", 128]";
  check(q, "q", {Dt::kU8}, {r * lim.query_len, lim.heads, 128}, dims.c_str(), w);
  DeviceDecodeBatch b;
  b.q = static_cast<const uint8_t*>(q.data());
  b.block_table = static_cast<const int32_t*>(block_table.data());
  b.seq_lens = static_cast<const int32_t*>(seq_lens.data());
  b.num_requests = static_cast<int32_t>(r);
  return b;
}

inline int32_t* out_ptr(const Out& out, int64_t rows, int32_t heads, int32_t k, Where w) {
  const std::string dims = "[rows = " + std::to_string(rows) + ", num_heads = " + std::to_string(heads) +
                           ", topk = " + std::to_string(k) + "]";
  check(out, "out", {Dt::kI32}, {rows, heads, k}, dims.c_str(), w);
  return static_cast<int32_t*>(out.data());
}

inline uint32_t* step_status_ptr(const std::optional<Out>& status, Where w) {
  if (!status) return nullptr;
  check(*status, "status", {Dt::kU32, Dt::kI32}, {1}, "[1] (uint32 StepStatus)", w);
  return static_cast<uint32_t*>(status->data());
}

inline void* workspace_ptr(const std::optional<Out>& ws, size_t need, size_t* bytes, Where w) {
  if (!ws) {
    if (need > 0) invalid("workspace is None; this plan needs " + std::to_string(need) + " bytes (workspace_bytes)");
    *bytes = 0;
    return nullptr;
  }
  *bytes = static_cast<size_t>(check_bytes(*ws, "workspace", static_cast<int64_t>(need), 16, w));
  return ws->data();
}

template <class Plan, bool kCuda>
nb::class_<Plan> bind_decode_plan(nb::module_& m, Where w, const char* backend) {
  return nb::class_<Plan>(m, "DecodePlan",
                   (std::string("One rank's decode step as plan / run (plan.hpp; spec/indexer.md 3-5). ") + backend +
                    " Built once from a resolved config, this process's rank and the DecodeLimits; "
                    "InvalidArgumentError names rank / limits.* ; run / publish / merge take caller-owned "
                    "workspace (uint8 [workspace_bytes], 16-byte aligned) and outputs, allocate nothing.")
                       .c_str())
      .def(nb::init<const ResolvedConfig&, int32_t, const DecodeLimits&>(), "config"_a, "rank"_a, "limits"_a)
      .def_prop_ro("path", &Plan::path)
      .def_prop_ro("limits", [](const Plan& p) { return p.limits(); },
                   "A copy of the plan's limits (changing it does not change the plan).")
      .def_prop_ro("world", &Plan::world)
      .def_prop_ro("rank", &Plan::rank)
      .def_prop_ro("head_begin", &Plan::head_begin)
      .def_prop_ro("num_heads", &Plan::num_heads)
      .def_prop_ro("workspace_bytes", &Plan::workspace_bytes, "Bytes of workspace run / publish / merge need.")
      .def_prop_ro("exchange_bytes", &Plan::exchange_bytes,
                   "Bytes of one rank's exchange record (0 for the replicated path).")
      .def_prop_ro("exchange", &Plan::exchange)
      .def("check_cache", [w](const Plan& p, const PyCacheView& c, int32_t layer) { p.check_cache(view_at(c, w), layer); },
           "cache"_a, "layer"_a)
      .def("run",
           [w](const Plan& p, const PyCacheView& cache, int32_t layer, In q, In block_table, In seq_lens,
               std::optional<Out> workspace, Out out, nb::handle comm_obj, std::optional<Out> status,
               std::optional<uintptr_t> stream) {
             Communicator* comm = comm_arg<kCuda>(comm_obj);
             const CacheView& v = view_at(cache, w);
             const DeviceDecodeBatch b = decode_batch(p.limits(), q, block_table, seq_lens, w);
             int32_t* o = out_ptr(out, int64_t{b.num_requests} * p.limits().query_len, p.num_heads(),
                                  p.limits().sel.topk, w);
             uint32_t* st = step_status_ptr(status, w);
             size_t wsb = 0;
             void* ws = workspace_ptr(workspace, p.workspace_bytes(), &wsb, w);
             if constexpr (kCuda) {
               auto* s = static_cast<CUstream_st*>(stream_of(stream));
               nb::gil_scoped_release nogil;
               p.run(v, layer, b, ws, wsb, o, comm, st, s);
             } else {
               (void)stream;
               nb::gil_scoped_release nogil;
               p.run(v, layer, b, ws, wsb, o, comm, st);
             }
           },
           "cache"_a, "layer"_a, "q"_a, "block_table"_a, "seq_lens"_a, "workspace"_a, "out"_a,
           "comm"_a.none() = nb::none(), "status"_a = nb::none(), nb::kw_only(), "stream"_a = nb::none(),
           "The whole step: q uint8 E4M3 [num_requests * Q, H, 128], block_table int32 [num_requests, "
           "limits.max_pages], seq_lens int32 [num_requests] (0 = padding) -> out int32 [num_requests * Q, "
           "num_heads, K] (ascending ids, -1 padding). The exchanging paths need comm, a communicator of world "
           "ranks: for the CPU plans a host one (InProcessGroup(world).comm(rank), ranks on threads; a "
           "HostCommunicator such as indexcp.distributed.TorchCommunicator, one rank per process), for the CUDA "
           "plans a device one (indexcp.cuda.DeviceGroup(world).comm(rank), ranks on threads with their own "
           "streams; an indexcp.cuda.DeviceCommunicator such as indexcp.distributed.TorchDeviceCommunicator, one "
           "rank per process); or use publish + merge with the engine's own all-gather. status: uint32 [1] "
           "(StepStatus) or None.")
      .def("publish",
           [w](const Plan& p, const PyCacheView& cache, int32_t layer, In q, In block_table, In seq_lens,
               std::optional<Out> workspace, Out send, std::optional<uintptr_t> stream) {
             const CacheView& v = view_at(cache, w);
             const DeviceDecodeBatch b = decode_batch(p.limits(), q, block_table, seq_lens, w);
             check_bytes(send, "send", static_cast<int64_t>(p.exchange_bytes()), 8, w);
             size_t wsb = 0;
             void* ws = workspace_ptr(workspace, p.workspace_bytes(), &wsb, w);
             if constexpr (kCuda) {
               auto* s = static_cast<CUstream_st*>(stream_of(stream));
               nb::gil_scoped_release nogil;
               p.publish(v, layer, b, ws, wsb, send.data(), s);
             } else {
               (void)stream;
               nb::gil_scoped_release nogil;
               p.publish(v, layer, b, ws, wsb, send.data());
             }
           },
           "cache"_a, "layer"_a, "q"_a, "block_table"_a, "seq_lens"_a, "workspace"_a, "send"_a, nb::kw_only(),
           "stream"_a = nb::none(),
           "Split exchange, first half (ICP / decode CP): score and write this rank's record into send "
           "(uint8 [>= exchange_bytes], 8-byte aligned). All-gather the ranks' records (rank p's at p * "
           "exchange_bytes) with the engine's communicator, then merge.")
      .def("merge",
           [w](const Plan& p, In q, In block_table, In seq_lens, In recv, Out out, std::optional<Out> status,
               std::optional<uintptr_t> stream) {
             const DeviceDecodeBatch b = decode_batch(p.limits(), q, block_table, seq_lens, w);
             check_bytes(recv, "recv", static_cast<int64_t>(p.exchange_bytes()) * p.world(), 8, w);
             int32_t* o = out_ptr(out, int64_t{b.num_requests} * p.limits().query_len, p.num_heads(),
                                  p.limits().sel.topk, w);
             uint32_t* st = step_status_ptr(status, w);
             if constexpr (kCuda) {
               auto* s = static_cast<CUstream_st*>(stream_of(stream));
               nb::gil_scoped_release nogil;
               p.merge(b, recv.data(), o, st, s);
             } else {
               (void)stream;
               nb::gil_scoped_release nogil;
               p.merge(b, recv.data(), o, st);
             }
           },
           "q"_a, "block_table"_a, "seq_lens"_a, "recv"_a, "out"_a, "status"_a = nb::none(), nb::kw_only(),
           "stream"_a = nb::none(),
           "Split exchange, second half: recv uint8 [world * exchange_bytes] (every rank's record) -> out "
           "int32 [num_requests * Q, num_heads, K] and status as run.");
}

template <class Plan, bool kCuda>
void bind_prefill_plan(nb::module_& m, Where w, const char* backend) {
  nb::class_<Plan>(m, "PrefillPlan",
                   (std::string("One rank's prefill chunk as plan / run (plan.hpp; spec/indexer.md 5). ") + backend)
                       .c_str())
      .def(nb::init<const ResolvedConfig&, int32_t, const PrefillLimits&>(), "config"_a, "rank"_a, "limits"_a)
      .def_prop_ro("path", &Plan::path)
      .def_prop_ro("limits", [](const Plan& p) { return p.limits(); },
                   "A copy of the plan's limits (changing it does not change the plan).")
      .def_prop_ro("world", &Plan::world)
      .def_prop_ro("rank", &Plan::rank)
      .def_prop_ro("head_begin", &Plan::head_begin)
      .def_prop_ro("num_heads", &Plan::num_heads)
      .def_prop_ro("workspace_bytes", &Plan::workspace_bytes)
      .def_prop_ro("exchange_bytes", &Plan::exchange_bytes)
      .def_prop_ro("units_per_chunk", &Plan::units_per_chunk)
      .def("gather_chunks", &Plan::gather_chunks, "extents"_a)
      .def("check_cache", [w](const Plan& p, const PyCacheView& c, int32_t layer) { p.check_cache(view_at(c, w), layer); },
           "cache"_a, "layer"_a)
      .def("run",
           [w](const Plan& p, const PyCacheView& cache, int32_t layer, In q, In block_table, In seq_lens,
               In query_start, const PrefillExtents& extents, std::optional<Out> workspace, Out out,
               nb::handle comm_obj, std::optional<Out> status, std::optional<uintptr_t> stream) {
             Communicator* comm = comm_arg<kCuda>(comm_obj);
             const CacheView& v = view_at(cache, w);
             const PrefillLimits& lim = p.limits();
             check(seq_lens, "seq_lens", {Dt::kI32}, {-1}, "[num_requests]", w);
             const int64_t r = static_cast<int64_t>(seq_lens.shape(0));
             std::string dims = "[num_requests + 1 = " + std::to_string(r + 1) + "]";
             check(query_start, "query_start", {Dt::kI32}, {r + 1}, dims.c_str(), w);
             dims = "[num_requests = " + std::to_string(r) + ", max_pages = " + std::to_string(lim.max_pages) + "]";
             check(block_table, "block_table", {Dt::kI32}, {r, lim.max_pages}, dims.c_str(), w);
             dims = "[extents.rows = " + std::to_string(extents.rows) + ", heads = " + std::to_string(lim.heads) + ", 128]";
             check(q, "q", {Dt::kU8}, {extents.rows, lim.heads, 128}, dims.c_str(), w);
             int32_t* o = out_ptr(out, extents.rows, p.num_heads(), lim.sel.topk, w);
             uint32_t* st = step_status_ptr(status, w);
             size_t wsb = 0;
             void* ws = workspace_ptr(workspace, p.workspace_bytes(), &wsb, w);
             DevicePrefillBatch b;
             b.q = static_cast<const uint8_t*>(q.data());
             b.block_table = static_cast<const int32_t*>(block_table.data());
             b.seq_lens = static_cast<const int32_t*>(seq_lens.data());
             b.query_start = static_cast<const int32_t*>(query_start.data());
             b.num_requests = static_cast<int32_t>(r);
             if constexpr (kCuda) {
               auto* s = static_cast<CUstream_st*>(stream_of(stream));
               nb::gil_scoped_release nogil;
               p.run(v, layer, b, extents, ws, wsb, o, comm, st, s);
             } else {
               (void)stream;
               nb::gil_scoped_release nogil;
               p.run(v, layer, b, extents, ws, wsb, o, comm, st);
             }
           },
           "cache"_a, "layer"_a, "q"_a, "block_table"_a, "seq_lens"_a, "query_start"_a, "extents"_a, "workspace"_a,
           "out"_a, "comm"_a.none() = nb::none(), "status"_a = nb::none(), nb::kw_only(), "stream"_a = nb::none(),
           "q uint8 E4M3 [extents.rows, H, 128], block_table int32 [num_requests, limits.max_pages], seq_lens "
           "int32 [num_requests], query_start int32 [num_requests + 1] -> out int32 [extents.rows, num_heads, "
           "K]. gather / local_score (spec/indexer.md 5) exchange inside run through comm, which they need: a "
           "communicator of world ranks (host for the CPU plans: InProcessGroup(world).comm(rank) or a "
           "HostCommunicator such as indexcp.distributed.TorchCommunicator; device for the CUDA plans: "
           "indexcp.cuda.DeviceGroup(world).comm(rank) or an indexcp.cuda.DeviceCommunicator such as "
           "indexcp.distributed.TorchDeviceCommunicator; the call releases the GIL, so simulated ranks run "
           "on threads). The library has no split form of the prefill exchange (a gather run makes "
           "gather_chunks(extents) all-gathers between its steps): an engine brings its own exchange as "
           "such a communicator. InvalidArgumentError names comm when it is missing or of the wrong memory.");
}

}  // namespace indexcp::py
