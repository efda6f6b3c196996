// indexcp Python extension: the argument checks shared by the host and CUDA bindings.
#include "common.hpp"

#include <cstdio>
#include <string>

#include "indexcp/version.hpp"
#if INDEXCP_CUDA_BACKEND
#include <cuda_runtime_api.h>
#endif

namespace indexcp::py {

const char* dt_name(Dt d) {
  switch (d) {
    case Dt::kU8: return "uint8";
    case Dt::kU16: return "uint16";
    case Dt::kBf16: return "bfloat16";
    case Dt::kI32: return "int32";
    case Dt::kU32: return "uint32";
    case Dt::kI64: return "int64";
    case Dt::kF32: return "float32";
  }
  return "?";
}

namespace {
bool dt_is(const nb::dlpack::dtype& t, Dt d) {
  using C = nb::dlpack::dtype_code;
  auto is = [&](C code, int bits) { return t.code == static_cast<uint8_t>(code) && t.bits == bits && t.lanes == 1; };
  switch (d) {
    case Dt::kU8: return is(C::UInt, 8);
    case Dt::kU16: return is(C::UInt, 16);
    case Dt::kBf16: return is(C::Bfloat, 16);
    case Dt::kI32: return is(C::Int, 32);
    case Dt::kU32: return is(C::UInt, 32);
    case Dt::kI64: return is(C::Int, 64);
    case Dt::kF32: return is(C::Float, 32);
  }
  return false;
}

std::string dtype_str(const nb::dlpack::dtype& t) {
  using C = nb::dlpack::dtype_code;
  const char* base = "?";
  switch (static_cast<C>(t.code)) {
    case C::Int: base = "int"; break;
    case C::UInt: base = "uint"; break;
    case C::Float: base = "float"; break;
    case C::Bfloat: base = "bfloat"; break;
    case C::Complex: base = "complex"; break;
    case C::Bool: base = "bool"; break;
    default: break;
  }
  return std::string(base) + std::to_string(t.bits) + (t.lanes != 1 ? "x" + std::to_string(t.lanes) : "");
}

const char* device_str(int device_type) {
  switch (device_type) {
    case 1: return "cpu";
    case 2: return "cuda";
    case 3: return "cuda_host";
    case 13: return "cuda_managed";
    default: return "another device";
  }
}

std::string shape_str(const ArrInfo& a) {
  std::string s = "[";
  for (size_t i = 0; i < a.ndim; ++i) s += (i ? ", " : "") + std::to_string(a.shape[i]);
  return s + "]";
}

bool c_contiguous(const ArrInfo& a) {
  if (a.strides == nullptr) return true;  // DLPack: null strides mean compact row-major
  int64_t expect = 1;
  for (size_t k = a.ndim; k-- > 0;) {
    if (a.shape[k] != 1 && a.strides[k] != expect) return false;
    expect *= a.shape[k];
  }
  return true;
}

void check_where(const ArrInfo& a, const char* name, Where where) {
  if (where == Where::kHost) {
    if (a.device_type != nb::device::cpu::value)
      invalid(std::string(name) + " is on " + device_str(a.device_type) + " (device " + std::to_string(a.device_id) +
              "); the CPU backend needs host memory (a numpy array or a CPU tensor)");
    return;
  }
  if (a.device_type != nb::device::cuda::value)
    invalid(std::string(name) + " is on " + device_str(a.device_type) +
            "; the CUDA backend needs memory of the current CUDA device (a CUDA tensor or CuPy array)");
#if INDEXCP_CUDA_BACKEND
  int dev = -1;
  if (cudaGetDevice(&dev) == cudaSuccess && dev != a.device_id)
    invalid(std::string(name) + " is on cuda:" + std::to_string(a.device_id) + " but the current device is cuda:" +
            std::to_string(dev) + " (every array of a call must be memory of the current device)");
#endif
}
}  // namespace

void invalid(const std::string& msg) { throw Error(ErrorCode::kInvalidArgument, msg); }

std::string describe(const ArrInfo& a) {
  return dtype_str(a.dtype) + " " + shape_str(a) + " on " + device_str(a.device_type);
}

Dt check_array(const ArrInfo& a, const char* name, std::initializer_list<Dt> dts,
               std::initializer_list<int64_t> shape, const char* dims, Where where) {
  const Dt* found = nullptr;
  for (const Dt& d : dts)
    if (dt_is(a.dtype, d)) found = &d;
  if (!found) {
    std::string want;
    for (const Dt& d : dts) want += (want.empty() ? "" : " or ") + std::string(dt_name(d));
    invalid(std::string(name) + " must be " + want + " " + dims + ", got " + describe(a));
  }
  bool shape_ok = a.ndim == shape.size();
  if (shape_ok) {
    size_t i = 0;
    for (int64_t e : shape) {
      if (e >= 0 && a.shape[i] != e) shape_ok = false;
      ++i;
    }
  }
  if (!shape_ok) invalid(std::string(name) + " must have shape " + dims + ", got " + describe(a));
  if (!c_contiguous(a))
    invalid(std::string(name) + " must be C-contiguous (row-major, no strides), got " + describe(a) +
            " with other strides");
  check_where(a, name, where);
  return *found;
}

int64_t check_buffer(const ArrInfo& a, const char* name, int64_t min_bytes, int64_t align, Where where) {
  check_array(a, name, {Dt::kU8}, {-1}, "[bytes]", where);
  const int64_t n = static_cast<int64_t>(a.nbytes);
  if (n < min_bytes)
    invalid(std::string(name) + " holds " + std::to_string(n) + " bytes; the call needs at least " +
            std::to_string(min_bytes));
  if (align > 1 && n > 0 && reinterpret_cast<uintptr_t>(a.data) % static_cast<uintptr_t>(align) != 0)
    invalid(std::string(name) + " must be " + std::to_string(align) + "-byte aligned");
  return n;
}

const CacheView& view_at(const PyCacheView& c, Where where) {
  check_cache_view(c.view, where, "cache");
#if INDEXCP_CUDA_BACKEND
  if (where == Where::kDevice) {
    int dev = -1;
    if (cudaGetDevice(&dev) == cudaSuccess && dev != c.device_id)
      invalid("cache is on cuda:" + std::to_string(c.device_id) + " but the current device is cuda:" +
              std::to_string(dev) + " (every array of a call must be memory of the current device)");
  }
#endif
  return c.view;
}

void* stream_of(const std::optional<uintptr_t>& stream) {
  if (stream) return reinterpret_cast<void*>(*stream);
  nb::object hook = nb::module_::import_("indexcp._streams").attr("current_stream");
  return reinterpret_cast<void*>(nb::cast<uintptr_t>(hook()));
}

}  // namespace indexcp::py
