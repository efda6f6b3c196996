// indexcp Python extension (nanobind): the module, the error classes, the configuration, the page
// layout, cache views and capacity. The names mirror the C++ headers (include/indexcp/*.hpp);
// each docstring points to its header and spec section. host.cpp binds the CPU backend's calls,
// cuda.cpp the CUDA backend's (the submodule indexcp._indexcp.cuda).
#include <Python.h>

#include "common.hpp"
#include "indexcp/cache.hpp"
#include "indexcp/capacity.hpp"
#include "indexcp/config.hpp"
#include "indexcp/cuda.hpp"
#include "indexcp/layout.hpp"
#include "indexcp/version.hpp"

using namespace indexcp;
using namespace indexcp::py;
using namespace nb::literals;

namespace {

// The Python error classes (created once in the module's init; the translator raises them).
PyObject* g_error = nullptr;
PyObject* g_invalid = nullptr;
PyObject* g_unsupported = nullptr;
PyObject* g_runtime = nullptr;
PyObject* g_io = nullptr;

PyObject* new_error(nb::module_& m, const char* name, PyObject* base1, PyObject* base2, const char* doc) {
  PyObject* bases = base2 ? PyTuple_Pack(2, base1, base2) : PyTuple_Pack(1, base1);
  const std::string qual = std::string("indexcp.") + name;
  PyObject* cls = PyErr_NewExceptionWithDoc(qual.c_str(), doc, bases, nullptr);
  Py_DECREF(bases);
  if (!cls) throw nb::python_error();
  m.attr(name) = nb::handle(cls);
  return cls;
}

PyObject* class_of(ErrorCode c) {
  switch (c) {
    case ErrorCode::kInvalidArgument: return g_invalid;
    case ErrorCode::kUnsupported: return g_unsupported;
    case ErrorCode::kIo: return g_io;
    case ErrorCode::kRuntime: return g_runtime;
  }
  return g_error;
}

/// The bytes a view spans from its base: the last layer's start plus its layer_bytes(), from the
/// view's own accessors (cache_view.hpp owns the geometry).
int64_t span_bytes(const CacheView& v) {
  if (v.layer_ptrs()) return v.layer_bytes();
  return static_cast<int64_t>(v.num_layers() - 1) * v.layer_stride() + v.layer_bytes();
}

Where where_of(const ArrInfo& a, const char* name) {
  if (a.device_type == nb::device::cpu::value) return Where::kHost;
  if (a.device_type == nb::device::cuda::value) {
#if INDEXCP_CUDA_BACKEND
    return Where::kDevice;
#else
    throw Error(ErrorCode::kUnsupported,
                std::string(name) + " is CUDA memory but this build of indexcp has no CUDA backend "
                                    "(built with INDEXCP_CUDA=OFF or without nvcc)");
#endif
  }
  invalid(std::string(name) + " must be host memory or memory of the current CUDA device, got " + describe(a));
}

/// A writable DLPack array from any producer (numpy, torch, CuPy, a DLPack capsule), by name.
Out as_array(nb::handle obj, const char* name) {
  Out a;
  if (!nb::try_cast<Out>(obj, a))
    invalid(std::string(name) + " must be a writable array (numpy, torch, CuPy or any DLPack producer), got " +
            nb::cast<std::string>(nb::str(obj.type())));
  return a;
}

void check_cache_bytes(const ArrInfo& a, const char* name, Where where) {
  // any shape: an engine may shape its cache tensor [layers, pages, page_stride]
  if (!(a.dtype.code == static_cast<uint8_t>(nb::dlpack::dtype_code::UInt) && a.dtype.bits == 8 && a.dtype.lanes == 1))
    invalid(std::string(name) + " must be a uint8 array (the index cache's bytes), got " + describe(a));
  int64_t expect = 1;
  if (a.strides)
    for (size_t k = a.ndim; k-- > 0;) {
      if (a.shape[k] != 1 && a.strides[k] != expect)
        invalid(std::string(name) + " must be C-contiguous (row-major, no strides), got " + describe(a) +
                " with other strides");
      expect *= a.shape[k];
    }
  (void)where;
}

}  // namespace

NB_MODULE(_indexcp, m) {
  m.doc() = "indexcp: paged NVFP4/FP8 index cache, block-sparse-attention indexer and indexer context "
            "parallelism (the C++ library's Python binding; docs/python.md).";

  // ---- errors (error.hpp) -------------------------------------------------------------------
  g_error = new_error(m, "Error", PyExc_Exception, nullptr,
                      "Base class of every error the library raises (C++ indexcp::Error, error.hpp). "
                      "`code` names the C++ ErrorCode.");
  g_invalid = new_error(m, "InvalidArgumentError", g_error, PyExc_ValueError,
                        "kInvalidArgument: a value, shape, dtype, device or range is wrong; the message "
                        "names the argument.");
  g_unsupported = new_error(m, "UnsupportedError", g_error, PyExc_NotImplementedError,
                            "kUnsupported: a valid but unsupported combination; the message says what is "
                            "supported.");
  g_runtime = new_error(m, "RuntimeError", g_error, PyExc_RuntimeError,
                        "kRuntime: a device, allocation or communication failure.");
  g_io = new_error(m, "IoError", g_error, PyExc_RuntimeError, "kIo: a file could not be read or written.");
  nb::handle(g_error).attr("code") = "";
  nb::handle(g_invalid).attr("code") = "kInvalidArgument";
  nb::handle(g_unsupported).attr("code") = "kUnsupported";
  nb::handle(g_runtime).attr("code") = "kRuntime";
  nb::handle(g_io).attr("code") = "kIo";
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(class_of(e.code()), e.what());
    }
  });

  // torch.library keeps the custom ops of indexcp.ops (and with them the plans and layouts they
  // reference) alive past this module's teardown at interpreter exit: not a leak of the binding.
  nb::set_leak_warnings(false);

  m.attr("__version__") = version();
  m.attr("CUDA_BACKEND") = bool(INDEXCP_CUDA_BACKEND);
  m.def("version", [] { return std::string(version()); },
        "The linked library's version, MAJOR.MINOR.PATCH (version.hpp; the CMake project version).");
  m.def("cuda_available", [] {
#if INDEXCP_CUDA_BACKEND
        return cuda::available();
#else
        return false;
#endif
      },
      "True when the package was built with the CUDA backend and a GPU is visible (cuda.hpp available()).");

  // ---- enums (formats.hpp, config.hpp, cache_view.hpp, plan.hpp) ----------------------------
  nb::enum_<KvDtype>(m, "KvDtype", "Index-cache element format (indexer_kv_dtype; formats.hpp, spec/formats.md 3-4).")
      .value("bf16", KvDtype::kBf16)
      .value("fp8", KvDtype::kFp8)
      .value("nvfp4", KvDtype::kNvfp4);
  nb::enum_<KRounding>(m, "KRounding", "NVFP4 K-rounding at decode (indexer_k_rounding; spec/indexer.md 2).")
      .value("e4m3", KRounding::kE4m3)
      .value("exact", KRounding::kExact);
  nb::enum_<ScorePrecision>(m, "ScorePrecision",
                            "Accumulation of the dot products (indexer_score_precision; spec/indexer.md 3): fp32 "
                            "(default) or the opt-in fp8_mma (FP8 tensor cores on a GPU; the CPU computes exact scores).")
      .value("fp32", ScorePrecision::kFp32)
      .value("fp8_mma", ScorePrecision::kFp8Mma);
  nb::enum_<PrefillCp>(m, "PrefillCp", "indexer_prefill_cp (spec/indexer.md 5).")
      .value("gather", PrefillCp::kGather)
      .value("local_score", PrefillCp::kLocalScore);
  nb::enum_<MemoryLocation>(m, "MemoryLocation", "Where a cache view's bytes live (cache_view.hpp).")
      .value("host", MemoryLocation::kHost)
      .value("device", MemoryLocation::kDevice);
  m.def("key_bytes", [](KvDtype d) { return key_bytes(d); }, "dtype"_a,
        "Bytes of one token's key in a page row: nvfp4 72, fp8 128, bf16 256 (formats.hpp).");
  m.def("parse_kv_dtype", [](const std::string& s) { return parse_kv_dtype(s); }, "text"_a,
        "'bf16' | 'fp8' | 'nvfp4' -> KvDtype; InvalidArgumentError naming indexer_kv_dtype otherwise.");
  m.def("parse_k_rounding", [](const std::string& s) { return parse_k_rounding(s); }, "text"_a,
        "'e4m3' | 'exact' -> KRounding; InvalidArgumentError naming indexer_k_rounding otherwise.");
  m.def("parse_score_precision", [](const std::string& s) { return parse_score_precision(s); }, "text"_a,
        "'fp32' | 'fp8_mma' -> ScorePrecision; InvalidArgumentError naming indexer_score_precision otherwise.");
  m.attr("HEAD_DIM") = kHeadDim;
  m.attr("BLOCK_TOKENS") = kBlockTokens;
  m.attr("CACHE_ALIGNMENT") = kCacheAlignment;

  // ---- configuration (config.hpp, spec/config.md 1-3) ---------------------------------------
  nb::class_<AttentionConfig>(m, "AttentionConfig",
                              "The engine's attention config as given (config.hpp, spec/config.md 1).")
      .def(nb::init<>())
      .def_static("from_json", &AttentionConfig::from_json, "text"_a,
                  "Parses a JSON object (the same JSON as the C++ library and `indexcp config`). "
                  "InvalidArgumentError naming the key and value: not an object, unknown key, wrong "
                  "type, value not among those listed, budget <= 0 or above 1 TiB.")
      .def("to_json", &AttentionConfig::to_json, "Every key as a JSON object string.")
      .def_rw("kv_dtype", &AttentionConfig::kv_dtype)
      .def_rw("cache_sharding", &AttentionConfig::cache_sharding)
      .def_rw("prefill_cp", &AttentionConfig::prefill_cp)
      .def_rw("decode_cp", &AttentionConfig::decode_cp)
      .def_rw("k_rounding", &AttentionConfig::k_rounding)
      .def_rw("prefill_gather_budget_mib", &AttentionConfig::prefill_gather_budget_mib)
      .def_rw("score_precision", &AttentionConfig::score_precision);

  nb::class_<EngineParams>(m, "EngineParams", "Engine parameters the policy reads (config.hpp, spec/config.md 1).")
      .def("__init__",
           [](EngineParams* p, int32_t tp, int32_t page_size, int32_t heads, int32_t query_len,
              std::string speculative_method, bool kv_connector) {
             new (p) EngineParams{tp, page_size, heads, query_len, std::move(speculative_method), kv_connector};
           },
           "tp"_a = 1, "page_size"_a = 128, "heads"_a = 4, "query_len"_a = 1, "speculative_method"_a = "",
           "kv_connector"_a = false)
      .def_rw("tp", &EngineParams::tp)
      .def_rw("page_size", &EngineParams::page_size)
      .def_rw("heads", &EngineParams::heads)
      .def_rw("query_len", &EngineParams::query_len)
      .def_rw("speculative_method", &EngineParams::speculative_method)
      .def_rw("kv_connector", &EngineParams::kv_connector);

  nb::class_<ResolvedConfig>(m, "ResolvedConfig", "The configuration as resolved by the policy (config.hpp, spec/config.md 2).")
      .def_ro("requested", &ResolvedConfig::requested, nb::rv_policy::copy)
      .def_ro("engine", &ResolvedConfig::engine, nb::rv_policy::copy)
      .def_ro("kv_dtype", &ResolvedConfig::kv_dtype)
      .def_ro("sharding", &ResolvedConfig::sharding)
      .def_ro("shards", &ResolvedConfig::shards)
      .def_ro("prefill_cp", &ResolvedConfig::prefill_cp)
      .def_ro("decode_cp", &ResolvedConfig::decode_cp)
      .def_ro("k_rounding", &ResolvedConfig::k_rounding)
      .def_ro("score_precision", &ResolvedConfig::score_precision)
      .def_ro("prefill_gather_budget_bytes", &ResolvedConfig::prefill_gather_budget_bytes)
      .def_ro("p256_stock_decode", &ResolvedConfig::p256_stock_decode)
      .def_ro("index_bytes_per_token_per_layer_per_rank", &ResolvedConfig::index_bytes_per_token_per_layer_per_rank)
      .def_ro("notes", &ResolvedConfig::notes)
      .def("to_json", &ResolvedConfig::to_json, "Every key with its effective value, plus notes (JSON).");

  m.def("resolve_config", &resolve_config, "config"_a, "engine"_a,
        "Applies the policy of spec/config.md 2 (config.hpp resolve_config). Raises UnsupportedError or "
        "InvalidArgumentError whose one-line message names the key and value and says what is supported. "
        "Reads INDEXCP_P256_STOCK_DECODE from the environment.");
  m.def("index_bytes_per_token", &index_bytes_per_token, "dtype"_a, "shards"_a,
        "Index bytes per token per sparse layer per rank (spec/config.md 3): nvfp4 72/W, fp8 128/W, bf16 256.");

  // ---- page layout and cache views (layout.hpp, cache_view.hpp, spec/formats.md 6-7) ---------
  nb::class_<PageLayout>(m, "PageLayout",
                         "Geometry of one rank's pages of one layer (layout.hpp, spec/formats.md 6-7). "
                         "Build it with make_page_layout.")
      .def_ro("dtype", &PageLayout::dtype)
      .def_ro("page_size", &PageLayout::page_size)
      .def_ro("shards", &PageLayout::shards)
      .def_ro("page_stride", &PageLayout::page_stride)
      .def_prop_ro("rows", &PageLayout::rows, "Rows one rank stores of each page: P / W.")
      .def_prop_ro("page_bytes", &PageLayout::page_bytes, "Bytes of one rank's shard page: rows * key_bytes(dtype).")
      .def_prop_ro("blocks_per_page", &PageLayout::blocks_per_page)
      .def("owner_of_offset", &PageLayout::owner_of_offset, "u"_a)
      .def("local_row_of_offset", &PageLayout::local_row_of_offset, "u"_a)
      .def("offset_of_local_row", &PageLayout::offset_of_local_row, "rank"_a, "j"_a)
      .def("page_offset", &PageLayout::page_offset, "page"_a)
      .def("row_data_offset", &PageLayout::row_data_offset, "j"_a)
      .def("row_scale_offset", &PageLayout::row_scale_offset, "j"_a)
      .def("__repr__", [](const PageLayout& l) {
        return "PageLayout(dtype=" + to_string(l.dtype) + ", page_size=" + std::to_string(l.page_size) +
               ", shards=" + std::to_string(l.shards) + ", page_stride=" + std::to_string(l.page_stride) + ")";
      });
  m.def("make_page_layout", &make_page_layout, "dtype"_a, "page_size"_a = 128, "shards"_a = 1, "page_stride"_a = 0,
        "Builds and validates a PageLayout (layout.hpp): page_size 128 or 256, shards in {1,2,4,8,16} with "
        "P/W a multiple of 16 (bf16 never sharded), page_stride 0 (= page_bytes) or >= page_bytes and a "
        "multiple of 16. InvalidArgumentError naming the argument.");
  m.def("cache_layer_bytes", &cache_layer_bytes, "layout"_a, "num_pages"_a,
        "Bytes one layer region of num_pages pages must hold: (num_pages - 1) * page_stride + page_bytes "
        "(cache_view.hpp).");
  m.def("check_heads_tp", &check_heads_tp, "heads"_a, "world"_a,
        "InvalidArgumentError unless H and W divide one another (layout.hpp).");
  m.def("owned_heads", [](int32_t heads, int32_t world, int32_t rank) {
        check_heads_tp(heads, world);
        if (rank < 0 || rank >= world) invalid("rank = " + std::to_string(rank) + " must lie in [0, world)");
        int32_t h0 = 0, n = 0;
        owned_heads(heads, world, rank, &h0, &n);
        return nb::make_tuple(h0, n);
      }, "heads"_a, "world"_a, "rank"_a,
      "(h0, count): the index heads rank r of W owns (layout.hpp owned_heads, spec/indexer.md 1).");

  nb::class_<PyCacheView>(m, "CacheView",
                          "A non-owning view of one rank's paged index cache over an array the caller "
                          "allocated (cache_view.hpp). Build it with make_cache_view; it keeps the array alive.")
      .def_prop_ro("layout", [](const PyCacheView& c) { return c.view.layout(); })
      .def_prop_ro("num_pages", [](const PyCacheView& c) { return c.view.num_pages(); })
      .def_prop_ro("num_layers", [](const PyCacheView& c) { return c.view.num_layers(); })
      .def_prop_ro("rank", [](const PyCacheView& c) { return c.view.rank(); })
      .def_prop_ro("location", [](const PyCacheView& c) { return c.view.location(); })
      .def_prop_ro("layer_stride", [](const PyCacheView& c) { return c.view.layer_stride(); })
      .def_prop_ro("layer_bytes", [](const PyCacheView& c) { return c.view.layer_bytes(); })
      .def_prop_ro("span_bytes", [](const PyCacheView& c) { return span_bytes(c.view); },
                   "Bytes the view addresses from its base (the packed form): (num_layers - 1) * "
                   "layer_stride + layer_bytes.")
      .def_prop_ro("array", [](const PyCacheView& c) { return c.owner; }, "The array (or list of arrays) viewed.");

  m.def("view_bytes",
        [](const PageLayout& layout, int64_t num_pages, int32_t num_layers, int64_t layer_stride) {
          // a view over an aligned placeholder address, only to ask the view its span
          const CacheView v = make_cache_view(layout, reinterpret_cast<void*>(uintptr_t{kCacheAlignment}), num_pages,
                                              num_layers, 0, layer_stride, MemoryLocation::kHost);
          return span_bytes(v);
        },
        "layout"_a, "num_pages"_a, "num_layers"_a = 1, "layer_stride"_a = 0,
        "Bytes to allocate for a cache of num_layers layers of num_pages pages (layer_stride 0: packed, "
        "num_pages * page_stride). Allocate a uint8 array of this size (16-byte aligned) and pass it to "
        "make_cache_view. Errors as make_cache_view.");

  m.def("make_cache_view",
        [](const PageLayout& layout, nb::object cache_obj, int64_t num_pages, int32_t num_layers, int32_t rank,
           int64_t layer_stride) {
          const Out cache = as_array(cache_obj, "cache");
          const ArrInfo a = info(cache);
          const Where where = where_of(a, "cache");
          check_cache_bytes(a, "cache", where);
          PyCacheView c;
          c.view = make_cache_view(layout, a.data, num_pages, num_layers, rank, layer_stride, where);
          c.required_bytes = span_bytes(c.view);
          if (static_cast<int64_t>(a.nbytes) < c.required_bytes)
            invalid("cache holds " + std::to_string(a.nbytes) + " bytes but a view of num_pages = " +
                    std::to_string(num_pages) + ", num_layers = " + std::to_string(num_layers) +
                    ", layer_stride = " + std::to_string(c.view.layer_stride()) + " of this layout spans " +
                    std::to_string(c.required_bytes) + " (view_bytes)");
          c.owner = cache_obj;
          c.arrays.push_back(cache);  // owns the memory of a raw DLPack capsule (the caller's object does not)
          c.device_id = where == Where::kDevice ? a.device_id : -1;
          return c;
        },
        "layout"_a, "cache"_a, "num_pages"_a, "num_layers"_a = 1, "rank"_a = 0, "layer_stride"_a = 0,
        "A view of num_layers layer regions spaced layer_stride bytes apart (0: packed) in `cache`, a "
        "C-contiguous uint8 array (numpy / torch / any DLPack producer; host memory -> a host view for the "
        "CPU backend, CUDA memory -> a device view for the CUDA backend), no copy. InvalidArgumentError "
        "naming the argument: cache not uint8 / not contiguous / smaller than the view spans (view_bytes) "
        "/ not 16-byte aligned (base), and every refusal of C++ make_cache_view.");

  m.def("make_cache_view_layers",
        [](const PageLayout& layout, nb::sequence layer_objs, int64_t num_pages, int32_t rank) {
          std::vector<Out> layers;
          for (size_t l = 0; l < nb::len(layer_objs); ++l)
            layers.push_back(as_array(layer_objs[l], ("layers[" + std::to_string(l) + "]").c_str()));
          if (layers.empty()) invalid("layers must hold one array per layer, got none");
          PyCacheView c;
          Where where = Where::kHost;
          for (size_t l = 0; l < layers.size(); ++l) {
            const std::string name = "layers[" + std::to_string(l) + "]";
            const ArrInfo a = info(layers[l]);
            const Where w = where_of(a, name.c_str());
            if (l == 0) where = w;
            else if (w != where) invalid(name + " is not in the same memory as layers[0]");
            check_cache_bytes(a, name.c_str(), w);
            c.ptrs.push_back(static_cast<uint8_t*>(a.data));
          }
          // each array's size first: the library's overlap check compares the layers' regions of
          // cache_layer_bytes each, and a too-small array's region may reach into another's
          const int64_t layer_bytes = cache_layer_bytes(layout, num_pages);
          for (size_t l = 0; l < layers.size(); ++l)
            if (static_cast<int64_t>(layers[l].nbytes()) < layer_bytes)
              invalid("layers[" + std::to_string(l) + "] holds " + std::to_string(layers[l].nbytes()) +
                      " bytes but one layer of num_pages = " + std::to_string(num_pages) + " spans " +
                      std::to_string(layer_bytes) + " (cache_layer_bytes)");
          c.view = make_cache_view_layers(layout, c.ptrs.data(), num_pages, static_cast<int32_t>(layers.size()),
                                          rank, where);
          c.required_bytes = c.view.layer_bytes();
          c.owner = nb::list(layer_objs);
          c.device_id = where == Where::kDevice ? info(layers[0]).device_id : -1;
          for (size_t l = 1; l < layers.size(); ++l)
            if (where == Where::kDevice && info(layers[l]).device_id != c.device_id)
              invalid("layers[" + std::to_string(l) + "] is on cuda:" + std::to_string(info(layers[l]).device_id) +
                      " but layers[0] is on cuda:" + std::to_string(c.device_id));
          c.arrays = std::move(layers);
          return c;
        },
        "layout"_a, "layers"_a, "num_pages"_a, "rank"_a = 0,
        "A view whose layer l is the uint8 array layers[l] (each at least cache_layer_bytes(layout, "
        "num_pages)); cache_view.hpp make_cache_view_layers.");

  // ---- capacity (capacity.hpp, spec/config.md 3) --------------------------------------------
  nb::class_<ModelDesc>(m, "ModelDesc", "A model description (capacity.hpp).")
      .def(nb::init<>())
      .def_static("builtin", &ModelDesc::builtin, "name"_a, "The built-in description (\"minimax-m3\").")
      .def_static("from_json", &ModelDesc::from_json, "text"_a)
      .def("validate", &ModelDesc::validate)
      .def("to_json", &ModelDesc::to_json)
      .def_rw("name", &ModelDesc::name)
      .def_rw("layers", &ModelDesc::layers)
      .def_rw("sparse_layers", &ModelDesc::sparse_layers)
      .def_rw("q_heads", &ModelDesc::q_heads)
      .def_rw("kv_heads", &ModelDesc::kv_heads)
      .def_rw("head_dim", &ModelDesc::head_dim)
      .def_rw("index_heads", &ModelDesc::index_heads)
      .def_rw("index_dim", &ModelDesc::index_dim);
  nb::class_<CapacityResult>(m, "CapacityResult")
      .def_ro("sharding", &CapacityResult::sharding)
      .def_ro("kv_bytes_per_token", &CapacityResult::kv_bytes_per_token)
      .def_ro("index_bytes_per_token", &CapacityResult::index_bytes_per_token)
      .def_ro("tokens", &CapacityResult::tokens);
  nb::class_<CapacityReport>(m, "CapacityReport")
      .def_ro("model", &CapacityReport::model, nb::rv_policy::copy)
      .def_ro("budget_bytes", &CapacityReport::budget_bytes)
      .def_ro("kv_dtype", &CapacityReport::kv_dtype)
      .def_ro("index_dtype", &CapacityReport::index_dtype)
      .def_ro("tp", &CapacityReport::tp)
      .def_ro("page_size", &CapacityReport::page_size)
      .def_ro("off", &CapacityReport::off, nb::rv_policy::copy)
      .def_ro("on", &CapacityReport::on, nb::rv_policy::copy)
      .def_prop_ro("ratio", &CapacityReport::ratio)
      .def("to_json", &CapacityReport::to_json);
  m.def("plan_capacity", &plan_capacity, "model"_a, "budget_bytes"_a, "kv_dtype"_a, "index_dtype"_a, "tp"_a,
        "page_size"_a,
        "KV-cache capacity with sharding off and on (capacity.hpp, spec/config.md 3). InvalidArgumentError "
        "naming budget_bytes <= 0, tp not in {1,2,4,8}, page_size not in {128,256}.");

  bind_host(m);
  nb::module_ cu = m.def_submodule("cuda", "The CUDA backend (cuda.hpp); empty of calls in a CPU-only build.");
  bind_cuda(cu);
}
