// indexcp Python extension: the CUDA backend (cuda.hpp), bound when the library has it.
#include "calls.hpp"
#include "common.hpp"
#include "indexcp/version.hpp"

#if INDEXCP_CUDA_BACKEND
#include <cuda_runtime_api.h>
#include <nanobind/trampoline.h>

#include "indexcp/cuda.hpp"
#endif

using namespace indexcp;
using namespace nb::literals;

namespace indexcp::py {

#if INDEXCP_CUDA_BACKEND
namespace {

/// A Communicator over device memory whose collectives are Python methods: the base of
/// indexcp.distributed.TorchDeviceCommunicator (an engine's torch.distributed / NCCL group) and of
/// any other exchange an engine brings. The library calls all_gather / all_to_all from inside a
/// CUDA plan's run, on the thread that called run, with the GIL released; each call takes the GIL
/// back, wraps the library's device buffers as DLPack uint8 arrays of their device (no copies, no
/// owner: valid only during the call) and calls the Python method with the run's stream (an int
/// cudaStream_t): the method must enqueue its collective in order with that stream (on it, or
/// waiting on it and making it wait) and must not synchronize it when the run is being captured.
/// rank / world are fixed at construction; bytes_sent is counted here.
class DeviceCommunicatorBase : public Communicator {
 public:
  DeviceCommunicatorBase(int rank, int world) : rank_(rank), world_(world) { check_rank_world(rank, world); }
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  std::size_t bytes_sent() const override { return sent_; }
  void all_gather(const void* send, void* recv, std::size_t bytes, void* stream) override {
    collective(&DeviceCommunicatorBase::py_all_gather, send, bytes, recv, bytes * world_, stream);
    sent_ += bytes;
  }
  void all_to_all(const void* send, void* recv, std::size_t bytes, void* stream) override {
    collective(&DeviceCommunicatorBase::py_all_to_all, send, bytes * world_, recv, bytes * world_, stream);
    sent_ += bytes * world_;
  }
  /// The Python methods (the trampoline's): send uint8 [n] (read it only), recv uint8 [m], stream.
  virtual void py_all_gather(nb::object send, nb::object recv, uintptr_t stream) = 0;
  virtual void py_all_to_all(nb::object send, nb::object recv, uintptr_t stream) = 0;

 private:
  void collective(void (DeviceCommunicatorBase::*f)(nb::object, nb::object, uintptr_t), const void* send,
                  size_t send_bytes, void* recv, size_t recv_bytes, void* stream) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
      (void)cudaGetLastError();
      throw Error(ErrorCode::kRuntime, "DeviceCommunicator: cudaGetDevice failed");
    }
    nb::gil_scoped_acquire gil;
    using Arr = nb::ndarray<uint8_t, nb::ndim<1>, nb::device::cuda>;
    nb::object s = nb::cast(Arr(const_cast<void*>(send), {send_bytes}, nb::handle(), {}, nb::dtype<uint8_t>(),
                                nb::device::cuda::value, dev),
                            nb::rv_policy::reference);
    nb::object r = nb::cast(Arr(recv, {recv_bytes}, nb::handle(), {}, nb::dtype<uint8_t>(), nb::device::cuda::value, dev),
                            nb::rv_policy::reference);
    (this->*f)(s, r, reinterpret_cast<uintptr_t>(stream));
  }
  int rank_, world_;
  std::size_t sent_ = 0;
};

struct PyDeviceCommunicator : DeviceCommunicatorBase {
#if NB_VERSION_MAJOR >= 3
  NB_TRAMPOLINE(DeviceCommunicatorBase);
#else
  NB_TRAMPOLINE(DeviceCommunicatorBase, 2);
#endif
  void py_all_gather(nb::object send, nb::object recv, uintptr_t stream) override {
    NB_OVERRIDE_PURE_NAME("all_gather", py_all_gather, send, recv, stream);
  }
  void py_all_to_all(nb::object send, nb::object recv, uintptr_t stream) override {
    NB_OVERRIDE_PURE_NAME("all_to_all", py_all_to_all, send, recv, stream);
  }
};

}  // namespace

Communicator* python_device_communicator(nb::handle comm) {
  if (!nb::isinstance<DeviceCommunicatorBase>(comm)) return nullptr;
  return nb::cast<DeviceCommunicatorBase*>(comm);
}
#endif

void bind_cuda(nb::module_& m) {
#if INDEXCP_CUDA_BACKEND
  constexpr Where kDev = Where::kDevice;
  constexpr const char* kGpu =
      "CUDA backend: every array is memory of the current CUDA device (torch / CuPy / any DLPack producer); "
      "work is enqueued on `stream` (an int cudaStream_t; None: the current torch stream when torch is "
      "imported, else the legacy default stream 0) without host synchronization or allocation.";
  m.def("available", &cuda::available, "True when a GPU is visible to the CUDA backend.");
  m.def("device_name", &cuda::device_name);
  m.def("prepare_device", &cuda::prepare_device,
        "One-time setup of the current device (before the first CUDA graph capture; cuda.hpp).");
  m.def("insert_workspace_bytes", [](int64_t n) { return cuda::insert_workspace_bytes(n); }, "max_tokens"_a,
        "Device workspace bytes insert_keys_async needs for up to max_tokens tokens (cuda.hpp).");
  bind_insert_async(m, kDev, &cuda::insert_keys_async, &cuda::insert_keys_bf16_async, kGpu);
  bind_quantize_async(m, kDev, &cuda::quantize_queries_async, kGpu);
  m.def("reset_status",
        [](Out status, std::optional<uintptr_t> stream) {
          cuda::reset_status(status_ptr(status, kDev), static_cast<CUstream_st*>(stream_of(stream)));
        },
        "status"_a, nb::kw_only(), "stream"_a = nb::none(), "Zero-fills a device status (a memset; capturable).");
  m.def("read_status",
        [](Out status, std::optional<uintptr_t> stream) {
          return cuda::read_status(status_ptr(status, kDev), static_cast<CUstream_st*>(stream_of(stream)));
        },
        "status"_a, nb::kw_only(), "stream"_a = nb::none(),
        "Copies a device status to the host (synchronizes the stream): InsertStatus.");
  m.def("throw_if_refused",
        [](Out status, std::optional<uintptr_t> stream) {
          throw_if_refused(cuda::read_status(status_ptr(status, kDev), static_cast<CUstream_st*>(stream_of(stream))));
        },
        "status"_a, nb::kw_only(), "stream"_a = nb::none(),
        "Reads a device status (sync) and raises the synchronous call's error when it recorded a refusal.");
  m.def("fill_rope_table",
        [](Out out, double rope_theta, std::optional<uintptr_t> stream) {
          check(out, "out", {Dt::kF32}, {-1, 64}, "[num_positions, 64]", kDev);
          cuda::fill_rope_table(static_cast<float*>(out.data()), static_cast<int64_t>(out.shape(0)), rope_theta,
                                static_cast<CUstream_st*>(stream_of(stream)));
        },
        "out"_a, "rope_theta"_a = 5e6, nb::kw_only(), "stream"_a = nb::none(),
        "Fills a device RoPE table fp32 [num_positions, 64] and synchronizes (setup, not for capture).");
  m.def("insert_keys",
        [](const PyCacheView& cache, int32_t layer, In keys, In slot_mapping, float encode_scale,
           std::optional<In> norm_weight, float eps, bool rope, double rope_theta, std::optional<In> positions,
           std::optional<uintptr_t> stream) {
          const CacheView& v = view_at(cache, kDev);
          const Dt kd = check_keys(keys, kDev);
          const int64_t n = static_cast<int64_t>(keys.shape(0));
          const std::string dims = "[num_tokens = " + std::to_string(n) + "]";
          check(slot_mapping, "slot_mapping", {Dt::kI64}, {n}, dims.c_str(), kDev);
          InsertOptions opts;
          opts.encode_scale = encode_scale;
          opts.pre = make_pre(kDev, n, norm_weight, eps, rope, rope_theta, positions, std::nullopt);
          auto* s = static_cast<CUstream_st*>(stream_of(stream));
          nb::gil_scoped_release nogil;
          if (kd == Dt::kF32)
            cuda::insert_keys(v, layer, static_cast<const float*>(keys.data()),
                              static_cast<const int64_t*>(slot_mapping.data()), n, opts, s);
          else
            cuda::insert_keys_bf16(v, layer, static_cast<const uint16_t*>(keys.data()),
                                   static_cast<const int64_t*>(slot_mapping.data()), n, opts, s);
        },
        "cache"_a, "layer"_a, "keys"_a, "slot_mapping"_a, nb::kw_only(), "encode_scale"_a = 1.0f,
        "norm_weight"_a = nb::none(), "eps"_a = 1e-6f, "rope"_a = false, "rope_theta"_a = 5e6,
        "positions"_a = nb::none(), "stream"_a = nb::none(),
        "The synchronous, validating insert on the device (cuda.hpp insert_keys; raises as the CPU insert).");
  m.def("quantize_queries",
        [](In q, Out out, std::optional<In> norm_weight, float eps, bool rope, double rope_theta,
           std::optional<In> positions, std::optional<uintptr_t> stream) {
          check(q, "q", {Dt::kF32}, {-1, -1, 128}, "[num_tokens, heads, 128]", kDev);
          const int64_t n = static_cast<int64_t>(q.shape(0));
          const int32_t heads = static_cast<int32_t>(q.shape(1));
          const std::string dims = "[num_tokens = " + std::to_string(n) + ", heads = " + std::to_string(heads) + ", 128]";
          check(out, "out", {Dt::kU8}, {n, heads, 128}, dims.c_str(), kDev);
          const KeyPreprocess pre = make_pre(kDev, n, norm_weight, eps, rope, rope_theta, positions, std::nullopt);
          auto* s = static_cast<CUstream_st*>(stream_of(stream));
          nb::gil_scoped_release nogil;
          cuda::quantize_queries(static_cast<const float*>(q.data()), n, heads, pre, static_cast<uint8_t*>(out.data()), s);
        },
        "q"_a, "out"_a, nb::kw_only(), "norm_weight"_a = nb::none(), "eps"_a = 1e-6f, "rope"_a = false,
        "rope_theta"_a = 5e6, "positions"_a = nb::none(), "stream"_a = nb::none(),
        "The synchronous, validating index-Q cast on the device (cuda.hpp quantize_queries).");
  nb::class_<DeviceComm>(m, "DeviceComm",
                         "Rank r's communicator of a DeviceGroup (comm.hpp Communicator over device buffers): "
                         "the comm of the CUDA plans' run. Keeps its group alive.")
      .def_prop_ro("rank", [](const DeviceComm& c) { return c.comm->rank(); })
      .def_prop_ro("world", [](const DeviceComm& c) { return c.comm->world(); })
      .def_prop_ro("bytes_sent", [](const DeviceComm& c) { return c.comm->bytes_sent(); });
  nb::class_<cuda::DeviceGroup>(m, "DeviceGroup",
                                "W simulated ranks in one process on the current CUDA device (cuda.hpp DeviceGroup): "
                                "collectives copy device buffers with cudaMemcpyAsync on each rank's stream, ordered "
                                "across the ranks' streams with events; the host threads meet at a barrier. Run each "
                                "rank's calls on its own Python thread with its own stream (the calls release the "
                                "GIL). world 1..64, else InvalidArgumentError naming world.")
      .def(nb::init<int>(), "world"_a)
      .def_prop_ro("world", &cuda::DeviceGroup::world)
      .def("comm",
           [](cuda::DeviceGroup& g, int rank) {
             if (rank < 0 || rank >= g.world())
               invalid("rank = " + std::to_string(rank) + " must lie in 0..world - 1 = " + std::to_string(g.world() - 1));
             return DeviceComm{&g.comm(rank)};
           },
           "rank"_a, nb::keep_alive<0, 1>(), "Rank `rank`'s communicator (DeviceComm), for the CUDA plans' run(comm=).")
      .def("abort", &cuda::DeviceGroup::abort, "Makes every pending and future collective raise.")
      .def("depart", &cuda::DeviceGroup::depart, "rank"_a,
           "Rank `rank` makes no further collective calls: a collective another rank waits in raises instead of "
           "waiting forever.");
  nb::class_<DeviceCommunicatorBase, PyDeviceCommunicator>(
      m, "DeviceCommunicator",
      "A Communicator (comm.hpp) over device memory whose collectives are Python methods, for the CUDA plans' "
      "run(comm=...) and the ops' comm_handle: subclass it, call DeviceCommunicator.__init__(self, rank, world) "
      "and define all_gather(send, recv, stream) (send uint8 [bytes], recv uint8 [world * bytes]: rank p's send "
      "lands at recv[p * bytes:]) and all_to_all(send, recv, stream) (both uint8 [world * bytes]: block p of send "
      "goes to rank p, block p of recv came from rank p). send and recv are DLPack arrays of the library's device "
      "buffers (torch.from_dlpack, cupy.from_dlpack), without copies and valid only during the call (do not keep "
      "them; do not write send); stream is the run's cudaStream_t as an int. The collective must be ordered with "
      "that stream (enqueued on it, or waiting on it and making it wait) and must not synchronize it while the "
      "run is being captured into a CUDA graph. The library calls the methods from inside run on the calling "
      "thread (the GIL is taken back for the call); a Python exception in them ends the run with that "
      "exception. indexcp.distributed.TorchDeviceCommunicator is one over torch.distributed (NCCL). "
      "InvalidArgumentError names rank / world out of range.")
      .def(nb::init<int, int>(), "rank"_a, "world"_a)
      .def_prop_ro("rank", &DeviceCommunicatorBase::rank)
      .def_prop_ro("world", &DeviceCommunicatorBase::world)
      .def_prop_ro("bytes_sent", &DeviceCommunicatorBase::bytes_sent)
      .def("call_all_gather",
           [](DeviceCommunicatorBase& c, Out send, Out recv, std::optional<uintptr_t> stream) {
             const int64_t n = check_bytes(send, "send", 0, 1, kDev);
             check_bytes(recv, "recv", n * c.world(), 1, kDev);
             void* s = stream_of(stream);
             nb::gil_scoped_release nogil;
             c.all_gather(send.data(), recv.data(), static_cast<size_t>(n), s);
           },
           "send"_a, "recv"_a, nb::kw_only(), "stream"_a = nb::none(),
           "Calls the C++ all_gather as a plan does (GIL released, then taken back by the call): for tests of a "
           "subclass. send uint8 [n], recv uint8 [>= world * n], device memory; stream as for the plans.");
  bind_decode_plan<cuda::DecodePlan, true>(m, kDev, kGpu)
      .def("send_buffer",
           [](const cuda::DecodePlan& p, Out workspace) -> nb::object {
             check_bytes(workspace, "workspace", static_cast<int64_t>(p.workspace_bytes()), 16, kDev);
             void* s = p.send_buffer(workspace.data());
             if (!s) return nb::none();
             return nb::int_(static_cast<uint8_t*>(s) - static_cast<uint8_t*>(workspace.data()));
           },
           "workspace"_a,
           "Byte offset of the send record inside `workspace` (cuda.hpp send_buffer; None for the replicated "
           "path): workspace[off : off + exchange_bytes] is the buffer of the engine's all-gather.")
      .def("recv_buffer",
           [](const cuda::DecodePlan& p, Out workspace) -> nb::object {
             check_bytes(workspace, "workspace", static_cast<int64_t>(p.workspace_bytes()), 16, kDev);
             void* r = p.recv_buffer(workspace.data());
             if (!r) return nb::none();
             return nb::int_(static_cast<uint8_t*>(r) - static_cast<uint8_t*>(workspace.data()));
           },
           "workspace"_a,
           "Byte offset of the world receive records inside `workspace` (cuda.hpp recv_buffer; None for the "
           "replicated path).")
      .def_prop_ro("uses_stock_scorer", &cuda::DecodePlan::uses_stock_scorer);
  bind_prefill_plan<cuda::PrefillPlan, true>(m, kDev, kGpu);
#else
  (void)m;
#endif
}

}  // namespace indexcp::py
