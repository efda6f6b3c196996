// indexcp Python extension: what the binding's translation units share. The arrays crossing the
// boundary are nanobind ndarrays (DLPack, no copies); every check here runs before the library
// sees a pointer, so a refused call touches no memory. Messages name the Python argument.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "indexcp/cache_view.hpp"
#include "indexcp/error.hpp"

namespace nb = nanobind;

namespace indexcp::py {

/// A DLPack array of any dtype, shape and device (read-only inputs included).
using In = nb::ndarray<nb::ro>;
/// The same, written through (outputs, the cache, workspaces, status buffers).
using Out = nb::ndarray<>;

/// The element types the API takes.
enum class Dt { kU8, kU16, kBf16, kI32, kU32, kI64, kF32 };
const char* dt_name(Dt d);

/// Where an array must live: host memory (the CPU backend) or the current CUDA device.
using Where = MemoryLocation;

/// What the checks read of an array (either ndarray form).
struct ArrInfo {
  nb::dlpack::dtype dtype{};
  size_t ndim = 0;
  const int64_t* shape = nullptr;
  const int64_t* strides = nullptr;  ///< in elements
  int device_type = 0;
  int device_id = 0;
  void* data = nullptr;
  size_t nbytes = 0;
  size_t size = 0;
};
template <class A>
ArrInfo info(const A& a) {
  ArrInfo i;
  i.dtype = a.dtype();
  i.ndim = a.ndim();
  i.shape = a.shape_ptr();
  i.strides = a.stride_ptr();
  i.device_type = a.device_type();
  i.device_id = a.device_id();
  i.data = const_cast<void*>(static_cast<const void*>(a.data()));
  i.nbytes = a.nbytes();
  i.size = a.size();
  return i;
}

/// Throws Error (kInvalidArgument) naming `name` unless the array has one of the dtypes `dts`,
/// ndim == shape.size() with shape[i] == expected[i] (-1: any; `dims` names the dimensions in
/// the message, e.g. "[num_tokens, 128]"), is C-contiguous and lives at `where` (host, or the
/// current CUDA device). Returns the matching dtype.
Dt check_array(const ArrInfo& a, const char* name, std::initializer_list<Dt> dts,
               std::initializer_list<int64_t> shape, const char* dims, Where where);
template <class A>
Dt check(const A& a, const char* name, std::initializer_list<Dt> dts,
         std::initializer_list<int64_t> shape, const char* dims, Where where) {
  return check_array(info(a), name, dts, shape, dims, where);
}

/// 1-D contiguous uint8 buffer of at least `min_bytes` bytes at `where` whose data pointer is
/// aligned to `align` (workspaces, status buffers, exchange records). Returns its size in bytes.
int64_t check_buffer(const ArrInfo& a, const char* name, int64_t min_bytes, int64_t align, Where where);
template <class A>
int64_t check_bytes(const A& a, const char* name, int64_t min_bytes, int64_t align, Where where) {
  return check_buffer(info(a), name, min_bytes, align, where);
}

/// "float32 [3, 128] on cpu" style description of an array (for messages).
std::string describe(const ArrInfo& a);

[[noreturn]] void invalid(const std::string& msg);

/// The checks of a Python-implemented communicator's rank and world (HostCommunicator,
/// DeviceCommunicator): world in 1..64, rank in 0..world - 1, else InvalidArgumentError naming them.
inline void check_rank_world(int rank, int world) {
  if (world < 1 || world > 64) invalid("world = " + std::to_string(world) + " must lie in 1..64");
  if (rank < 0 || rank >= world)
    invalid("rank = " + std::to_string(rank) + " must lie in 0..world - 1 = " + std::to_string(world - 1));
}

/// A cache view as Python holds it: the library's view plus the array (or arrays) it points
/// into, kept alive by the Python object.
struct PyCacheView {
  CacheView view;
  nb::object owner;             ///< the object(s) the caller passed
  std::vector<Out> arrays;      ///< the imported arrays themselves: they own a DLPack capsule's memory
  std::vector<uint8_t*> ptrs;   ///< per-layer pointers (make_cache_view_layers), else empty; view points into it
  int64_t required_bytes = 0;   ///< bytes the view spans from its base (the packed form)
  int device_id = -1;           ///< the CUDA device of the bytes (-1: host)

  PyCacheView() = default;
  // view holds ptrs.data() (make_cache_view_layers): a copy would point into the original's vector
  PyCacheView(const PyCacheView&) = delete;
  PyCacheView& operator=(const PyCacheView&) = delete;
  PyCacheView(PyCacheView&&) noexcept = default;
  PyCacheView& operator=(PyCacheView&&) noexcept = default;
};

/// The cache argument of a call: a PyCacheView of the expected location (Error naming `cache`).
const CacheView& view_at(const PyCacheView& c, Where where);

/// The stream handle of a CUDA call: `stream` when given, else the Python hook's default
/// (indexcp._streams.current_stream(): the current torch stream when torch is imported, else 0).
void* stream_of(const std::optional<uintptr_t>& stream);

void bind_host(nb::module_& m);
void bind_cuda(nb::module_& m);

}  // namespace indexcp::py
