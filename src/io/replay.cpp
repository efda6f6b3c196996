// Replay of one indexer step stored on disk (spec/cases.md; include/indexcp/replay.hpp).
#include "indexcp/replay.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <system_error>

#include <nlohmann/json.hpp>

#include "indexcp/cache.hpp"
#include "indexcp/comm.hpp"
#include "indexcp/config.hpp"
#include "indexcp/error.hpp"
#include "indexcp/icp.hpp"
#include "core/file_util.hpp"
#include "core/json_util.hpp"
#include "indexcp/indexer.hpp"
#include "indexcp/npy.hpp"
#include "indexcp/tp_group.hpp"
#include "core/clock.hpp"

namespace indexcp {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string TopkDifference::describe(const std::string& name_a, const std::string& name_b) const {
  if (!found) return "no difference";
  const auto list = [](const std::vector<int32_t>& v) {
    std::string s = "[";
    for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "]";
  };
  return "row " + std::to_string(row) + ", head " + std::to_string(head) + ": " + name_a + " " + list(a) + " vs " +
         name_b + " " + list(b);
}

TopkDifference first_difference(const int32_t* a, const int32_t* b, int64_t rows, int32_t heads, int32_t topk) {
  TopkDifference d;
  for (int64_t r = 0; r < rows; ++r)
    for (int32_t h = 0; h < heads; ++h) {
      const int64_t o = (r * heads + h) * topk;
      if (!std::equal(a + o, a + o + topk, b + o)) {
        d.found = true;
        d.row = r;
        d.head = h;
        d.a.assign(a + o, a + o + topk);
        d.b.assign(b + o, b + o + topk);
        return d;
      }
    }
  return d;
}

int ReplayResult::exit_code() const {
  if (!selections_equal_replicated) return 3;
  if (has_expected && !expected_equal) return 4;
  return 0;
}

std::string ReplayResult::summary() const {
  std::string s = std::to_string(rows) + " rows x " + std::to_string(heads) + " heads x top-" +
                  std::to_string(topk_k) + " on " + backend + " (" + path + ")";
  if (compared_with_replicated)
    s += selections_equal_replicated ? "; equal to the replicated path" : "; DIFFERS from the replicated path";
  if (has_expected) s += expected_equal ? "; equal to expected_topk.npy" : "; DIFFERS from expected_topk.npy";
  return s;
}

namespace {

using detail::now_us;

[[noreturn]] void invalid(const std::string& file, const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, file + ": " + what);
}

// Re-throws a library Error with the file it concerns in front.
template <class Fn>
auto with_file(const std::string& file, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const Error& e) {
    throw Error(e.code(), file + ": " + e.what());
  }
}

struct Case {
  fs::path dir;
  std::string json_path;
  bool decode = true;
  int32_t tp = 1, page_size = 128, heads = 4, query_len = 1;
  SelectionParams sel;
  float encode_scale = 1.0f;
  ResolvedConfig rc, rc_repl;
  std::vector<std::string> notes;

  int32_t B = 0, max_pages = 0;
  std::vector<int32_t> block_table, seq_lens, query_start;
  int64_t num_pages = 0;
  bool from_cache = false;
  npy::Array keys_arr;           // float32 [num_slots, 128] when !from_cache
  const float* keys() const { return keys_arr.data<float>(); }
  npy::Array cache;              // [num_pages, page_bytes] when from_cache
  std::vector<int64_t> used_slots;
  std::vector<uint8_t> q8;       // [rows, H, 128] E4M3
  int64_t rows = 0;
  bool has_expected = false;
  std::vector<int32_t> expected;

  std::string file(const char* name) const { return (dir / name).string(); }
  bool exists(const char* name) const {  // anything there (its loader reports what is wrong with it)
    std::error_code ec;
    return fs::exists(fs::symlink_status(dir / name, ec));
  }
};

int32_t get_int(const json& j, const std::string& key, const std::string& file, bool required, int32_t dflt) {
  if (!j.contains(key)) {
    if (required) invalid(file, "missing key \"" + key + "\"");
    return dflt;
  }
  const json& v = j.at(key);
  if (!v.is_number_integer()) invalid(file, key + " = " + v.dump() + " must be an integer");
  const int64_t x = v.get<int64_t>();
  if (x < std::numeric_limits<int32_t>::min() || x > std::numeric_limits<int32_t>::max())
    invalid(file, key + " = " + v.dump() + " is out of range");
  return static_cast<int32_t>(x);
}

void load_case_json(Case& c) {
  c.json_path = c.file("case.json");
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(c.json_path, ec))) invalid(c.json_path, "no such file (a case directory needs case.json)");
  // a regular file of at most 64 MiB; invalid JSON or a key given twice is an invalid case
  const json j = detail::parse_json_strict(detail::read_text_file(c.json_path, ""), c.json_path);
  const std::string& f = c.json_path;
  if (!j.is_object()) invalid(f, "must hold a JSON object");
  static const char* known[] = {"phase", "attention_config", "tp", "page_size", "heads", "topk",
                                "init_blocks", "local_blocks", "query_len", "encode_scale", "comment"};
  for (auto it = j.begin(); it != j.end(); ++it) {
    bool ok = false;
    for (const char* k : known) ok = ok || it.key() == k;
    if (!ok)
      invalid(f, "unknown key \"" + it.key() +
                     "\" (known: phase, attention_config, tp, page_size, heads, topk, init_blocks, local_blocks, "
                     "query_len, encode_scale, comment)");
  }
  if (!j.contains("phase")) invalid(f, "missing key \"phase\" (\"decode\" or \"prefill\")");
  if (!j["phase"].is_string() || (j["phase"] != "decode" && j["phase"] != "prefill"))
    invalid(f, "phase = " + j["phase"].dump() + " must be \"decode\" or \"prefill\"");
  c.decode = j["phase"] == "decode";
  c.tp = get_int(j, "tp", f, true, 1);
  c.page_size = get_int(j, "page_size", f, true, 128);
  c.heads = get_int(j, "heads", f, false, 4);
  c.sel.topk = get_int(j, "topk", f, false, 16);
  c.sel.init_blocks = get_int(j, "init_blocks", f, false, 0);
  c.sel.local_blocks = get_int(j, "local_blocks", f, false, 1);
  if (c.decode) {
    c.query_len = get_int(j, "query_len", f, true, 1);
    if (c.query_len < 1 || c.query_len > 16)
      invalid(f, "query_len = " + std::to_string(c.query_len) + " is out of range 1..16");
  } else if (j.contains("query_len")) {
    const int32_t q = get_int(j, "query_len", f, false, 1);
    if (q < 1 || q > 16) invalid(f, "query_len = " + std::to_string(q) + " is out of range 1..16");
    c.notes.push_back("query_len is ignored in a prefill case (rows come from query_start.npy)");
  }
  if (c.tp < 1) invalid(f, "tp = " + std::to_string(c.tp) + " must be >= 1");
  if (c.heads < 1 || c.heads > 64) invalid(f, "heads = " + std::to_string(c.heads) + " is out of range 1..64");
  with_file(f, [&] { c.sel.validate(); });
  if (j.contains("encode_scale")) {
    const json& v = j["encode_scale"];
    if (!v.is_number()) invalid(f, "encode_scale = " + v.dump() + " must be a number");
    const double s = v.get<double>();
    if (!std::isfinite(s) || s <= 0 || s > std::numeric_limits<float>::max())
      invalid(f, "encode_scale = " + v.dump() + " must be finite and > 0");
    c.encode_scale = static_cast<float>(s);
  }
  json ac = json::object();
  if (j.contains("attention_config")) {
    ac = j["attention_config"];
    if (!ac.is_object()) invalid(f, "attention_config must be a JSON object");
  }
  EngineParams ep;
  ep.tp = c.tp;
  ep.page_size = c.page_size;
  ep.heads = c.heads;
  ep.query_len = c.decode ? c.query_len : 1;
  const AttentionConfig cfg = with_file(f, [&] { return AttentionConfig::from_json(ac.dump()); });
  c.rc = with_file(f, [&] { return resolve_config(cfg, ep); });
  with_file(f, [&] { check_heads_tp(c.heads, c.tp); });
  AttentionConfig rep = cfg;
  rep.cache_sharding = false;
  rep.decode_cp = false;
  c.rc_repl = with_file(f, [&] { return resolve_config(rep, ep); });
}

void load_arrays(Case& c) {
  const int32_t P = c.page_size;
  const KvDtype dt = c.rc.kv_dtype;
  // block table and seq_lens
  const std::string bt_f = c.file("block_table.npy"), sl_f = c.file("seq_lens.npy");
  {
    const npy::Array bt = npy::load_checked(bt_f, npy::Dtype::kInt32, 2);
    if (bt.shape[0] > std::numeric_limits<int32_t>::max() || bt.shape[1] > std::numeric_limits<int32_t>::max())
      invalid(bt_f, "shape " + npy::shape_string(bt.shape) + " is too large");
    c.B = static_cast<int32_t>(bt.shape[0]);
    c.max_pages = static_cast<int32_t>(bt.shape[1]);
    c.block_table.assign(bt.data<int32_t>(), bt.data<int32_t>() + bt.size());
  }
  {
    const npy::Array sl = npy::load_checked(sl_f, npy::Dtype::kInt32, 1);
    if (sl.shape[0] != c.B)
      invalid(sl_f, "shape " + npy::shape_string(sl.shape) + " has " + std::to_string(sl.shape[0]) +
                        " requests but block_table.npy has " + std::to_string(c.B) + " rows");
    c.seq_lens.assign(sl.data<int32_t>(), sl.data<int32_t>() + sl.size());
  }
  // keys or cache
  const bool has_keys = c.exists("keys.npy"), has_cache = c.exists("cache.npy");
  if (has_keys && has_cache) invalid(c.dir.string(), "holds both keys.npy and cache.npy; a case gives one of them");
  if (!has_keys && !has_cache) invalid(c.file("keys.npy"), "no such file (a case needs keys.npy or cache.npy)");
  c.from_cache = has_cache;
  if (!has_cache) {
    const std::string f = c.file("keys.npy");
    // float16 or float32, as `indexcp run --keys` accepts (float16 widened to float32 exactly)
    c.keys_arr = npy::load(f);
    if (c.keys_arr.dtype != npy::Dtype::kFloat16 && c.keys_arr.dtype != npy::Dtype::kFloat32)
      invalid(f, "dtype is " + npy::dtype_name(c.keys_arr.dtype) + ", expected float16 or float32");
    if (c.keys_arr.ndim() != 2)
      invalid(f, "shape " + npy::shape_string(c.keys_arr.shape) + " has " + std::to_string(c.keys_arr.ndim()) +
                     " dimensions, expected 2");
    if (c.keys_arr.dtype == npy::Dtype::kFloat16) {
      const std::vector<float> wide = npy::to_float32(c.keys_arr, f);
      c.keys_arr.dtype = npy::Dtype::kFloat32;
      c.keys_arr.bytes.resize(wide.size() * sizeof(float));
      std::memcpy(c.keys_arr.bytes.data(), wide.data(), c.keys_arr.bytes.size());
    }
    const npy::Array& k = c.keys_arr;
    if (k.shape[1] != kHeadDim || k.shape[0] == 0 || k.shape[0] % P != 0)
      invalid(f, "shape " + npy::shape_string(k.shape) + " must be [num_slots, 128] with num_slots a positive multiple of page_size = " +
                     std::to_string(P));
    c.num_pages = k.shape[0] / P;
  } else {
    const std::string f = c.file("cache.npy");
    c.cache = npy::load_checked(f, npy::Dtype::kUint8, 2);
    const int64_t page_bytes = static_cast<int64_t>(P) * key_bytes(dt);
    if (c.cache.shape[0] == 0 || c.cache.shape[1] != page_bytes)
      invalid(f, "shape " + npy::shape_string(c.cache.shape) + " must be [num_pages, " + std::to_string(page_bytes) +
                     "] (num_pages >= 1; a replicated " + to_string(dt) + " page of " + std::to_string(P) +
                     " tokens is " + std::to_string(page_bytes) + " bytes)");
    c.num_pages = c.cache.shape[0];
  }
  // seq_lens and block table entries
  for (int32_t b = 0; b < c.B; ++b) {
    const int32_t s = c.seq_lens[b];
    if (s < 0) invalid(sl_f, "seq_lens[" + std::to_string(b) + "] = " + std::to_string(s) + " is negative");
    if (c.decode && s > 0 && s < c.query_len)
      invalid(sl_f, "seq_lens[" + std::to_string(b) + "] = " + std::to_string(s) + " is shorter than query_len = " +
                        std::to_string(c.query_len) + " (0 marks a padded request)");
    const int64_t need = (static_cast<int64_t>(s) + P - 1) / P;
    if (need > c.max_pages)
      invalid(bt_f, "seq_lens[" + std::to_string(b) + "] = " + std::to_string(s) + " needs " + std::to_string(need) +
                        " pages but the block table has max_pages = " + std::to_string(c.max_pages));
    for (int64_t i = 0; i < need; ++i) {
      const int32_t p = c.block_table[static_cast<std::size_t>(b) * c.max_pages + i];
      if (p < 0 || p >= c.num_pages)
        invalid(bt_f, "block_table[" + std::to_string(b) + "][" + std::to_string(i) + "] = " + std::to_string(p) +
                          " is outside [0, num_pages = " + std::to_string(c.num_pages) + ") (needed by seq_lens[" +
                          std::to_string(b) + "] = " + std::to_string(s) + ")");
    }
  }
  // rows
  const std::string qs_f = c.file("query_start.npy");
  if (c.decode) {
    if (c.exists("query_start.npy")) invalid(qs_f, "query_start.npy belongs to prefill cases, but phase is \"decode\"");
    c.rows = static_cast<int64_t>(c.B) * c.query_len;
  } else {
    const npy::Array qs = npy::load_checked(qs_f, npy::Dtype::kInt32, 1);
    if (qs.shape[0] != static_cast<int64_t>(c.B) + 1)
      invalid(qs_f, "shape " + npy::shape_string(qs.shape) + " must be [B + 1] = [" + std::to_string(c.B + 1) + "]");
    c.query_start.assign(qs.data<int32_t>(), qs.data<int32_t>() + qs.size());
    if (c.query_start[0] != 0) invalid(qs_f, "query_start[0] = " + std::to_string(c.query_start[0]) + " must be 0");
    for (int32_t b = 0; b < c.B; ++b) {
      const int64_t T = static_cast<int64_t>(c.query_start[b + 1]) - c.query_start[b];
      if (T < 0)
        invalid(qs_f, "query_start[" + std::to_string(b + 1) + "] = " + std::to_string(c.query_start[b + 1]) +
                          " is below query_start[" + std::to_string(b) + "] = " + std::to_string(c.query_start[b]));
      if (T > c.seq_lens[b])
        invalid(qs_f, "request " + std::to_string(b) + " has a chunk of " + std::to_string(T) +
                          " tokens, more than seq_lens[" + std::to_string(b) + "] = " + std::to_string(c.seq_lens[b]));
    }
    c.rows = c.query_start[c.B];
  }
  // q
  {
    const std::string f = c.file("q.npy");
    const npy::Array q = npy::load(f);
    if (q.dtype != npy::Dtype::kFloat32 && q.dtype != npy::Dtype::kUint8)
      invalid(f, "dtype is " + npy::dtype_name(q.dtype) + ", expected float32 or uint8 (E4M3 bytes)");
    if (q.ndim() != 3 || q.shape[0] != c.rows || q.shape[1] != c.heads || q.shape[2] != kHeadDim)
      invalid(f, "shape " + npy::shape_string(q.shape) + " must be [rows, heads, 128] = [" + std::to_string(c.rows) +
                     ", " + std::to_string(c.heads) + ", 128]" +
                     (c.decode ? " (rows = B * query_len)" : " (rows = query_start[B])"));
    const int64_t n = c.rows * c.heads * kHeadDim;
    c.q8.resize(static_cast<std::size_t>(n));
    const auto where = [&](int64_t i) {
      return "row " + std::to_string(i / (c.heads * kHeadDim)) + ", head " +
             std::to_string((i / kHeadDim) % c.heads) + ", dim " + std::to_string(i % kHeadDim);
    };
    if (q.dtype == npy::Dtype::kFloat32) {
      const float* p = q.data<float>();
      for (int64_t i = 0; i < n; ++i)
        if (std::isnan(p[i])) invalid(f, "NaN at " + where(i));
      quantize_queries(p, c.rows, c.heads, KeyPreprocess{}, c.q8.data());
    } else {
      const uint8_t* p = q.data<uint8_t>();
      for (int64_t i = 0; i < n; ++i)
        if (e4m3_is_nan(p[i])) {
          char hex[8];
          std::snprintf(hex, sizeof hex, "0x%02X", p[i]);
          invalid(f, std::string("NaN byte ") + hex + " (E4M3) at " + where(i));
        }
      std::copy(p, p + n, c.q8.begin());
    }
  }
  // expected
  if (c.exists("expected_topk.npy")) {
    const std::string f = c.file("expected_topk.npy");
    const npy::Array e = npy::load_checked(f, npy::Dtype::kInt32, 3);
    if (e.shape[0] != c.rows || e.shape[1] != c.heads || e.shape[2] != c.sel.topk)
      invalid(f, "shape " + npy::shape_string(e.shape) + " must be [rows, heads, topk] = [" + std::to_string(c.rows) +
                     ", " + std::to_string(c.heads) + ", " + std::to_string(c.sel.topk) + "]");
    c.has_expected = true;
    c.expected.assign(e.data<int32_t>(), e.data<int32_t>() + e.size());
  }
  // used slots: every position < seq_len of some request; validate their keys / cache bytes
  const int64_t num_slots = c.num_pages * P;
  std::vector<uint8_t> used(static_cast<std::size_t>(num_slots), 0);
  const PageLayout lr = make_page_layout(dt, P, 1);
  for (int32_t b = 0; b < c.B; ++b)
    for (int64_t pos = 0; pos < c.seq_lens[b]; ++pos) {
      const int64_t slot =
          static_cast<int64_t>(c.block_table[static_cast<std::size_t>(b) * c.max_pages + pos / P]) * P + pos % P;
      if (used[slot]) continue;
      used[slot] = 1;
      c.used_slots.push_back(slot);
      const std::string at = "slot " + std::to_string(slot) + " (request " + std::to_string(b) + ", position " +
                             std::to_string(pos) + ")";
      if (!c.from_cache) {
        const float* k = c.keys() + slot * kHeadDim;
        for (int d = 0; d < kHeadDim; ++d)
          if (!std::isfinite(k[d]))
            invalid(c.file("keys.npy"), "row " + std::to_string(slot) + " = " + at + " holds a non-finite value (" +
                                            std::to_string(k[d]) + " at dim " + std::to_string(d) + ")");
      } else {
        const SlotLocation loc = locate_slot(lr, slot);
        const uint8_t* page = c.cache.bytes.data() + loc.page * c.cache.shape[1];
        const auto bad_byte = [&](int64_t off, const char* kind) {
          char hex[8];
          std::snprintf(hex, sizeof hex, "0x%02X", page[off]);
          invalid(c.file("cache.npy"), std::string("NaN byte ") + hex + " (E4M3 " + kind + ") at page " +
                                           std::to_string(loc.page) + ", byte " + std::to_string(off) + ", " + at);
        };
        if (dt == KvDtype::kNvfp4) {
          for (int g = 0; g < kNvfp4ScalesPerKey; ++g)
            if (e4m3_is_nan(page[lr.row_scale_offset(loc.row) + g])) bad_byte(lr.row_scale_offset(loc.row) + g, "scale");
        } else if (dt == KvDtype::kFp8) {
          for (int d = 0; d < kHeadDim; ++d)
            if (e4m3_is_nan(page[lr.row_data_offset(loc.row) + d])) bad_byte(lr.row_data_offset(loc.row) + d, "data");
        } else {
          for (int d = 0; d < kHeadDim; ++d) {
            const int64_t off = lr.row_data_offset(loc.row) + 2 * d;
            const float v = bf16_decode(static_cast<uint16_t>(page[off] | (page[off + 1] << 8)));
            if (!std::isfinite(v))
              invalid(c.file("cache.npy"), "non-finite bfloat16 value at page " + std::to_string(loc.page) + ", byte " +
                                               std::to_string(off) + ", " + at);
          }
        }
      }
    }
}

DecodeBatch decode_batch(const Case& c) {
  DecodeBatch b;
  b.q = c.q8.data();
  b.heads = c.heads;
  b.block_table = c.block_table.data();
  b.num_requests = c.B;
  b.max_pages = c.max_pages;
  b.seq_lens = c.seq_lens.data();
  b.query_len = c.query_len;
  return b;
}

PrefillBatch prefill_batch(const Case& c) {
  PrefillBatch b;
  b.q = c.q8.data();
  b.heads = c.heads;
  b.block_table = c.block_table.data();
  b.num_requests = c.B;
  b.max_pages = c.max_pages;
  b.seq_lens = c.seq_lens.data();
  b.query_start = c.query_start.data();
  return b;
}

std::string path_name(const Case& c, const ResolvedConfig& rc) {
  const std::string W = std::to_string(rc.engine.tp);
  if (c.decode) {
    if (rc.sharding) return "icp_decode over " + W + " rank shards";
    if (rc.decode_cp) return "decode_cp_replicated over " + W + " ranks";
    return "replicated decode on " + W + " ranks";
  }
  if (rc.sharding && rc.prefill_cp == PrefillCp::kGather) return "prefill_gather over " + W + " rank shards";
  if (rc.sharding) return "prefill_local_score over " + W + " rank shards";
  return "replicated prefill on " + W + " ranks";
}

// The CPU group for cache.npy cases: the replicated cache and (with sharding) W rank shards,
// filled from the replicated page bytes through the library's PageLayout.
struct CacheGroup {
  std::unique_ptr<IndexCache> repl;
  std::vector<IndexCache> shards;

  CacheGroup(const Case& c, bool sharded) {
    const KvDtype dt = c.rc.kv_dtype;
    const int32_t P = c.page_size;
    const PageLayout lr = make_page_layout(dt, P, 1);
    const int64_t pb = c.cache.shape[1];
    repl = std::make_unique<IndexCache>(lr, c.num_pages, 1, 0);
    for (int64_t p = 0; p < c.num_pages; ++p)
      std::memcpy(repl->page_ptr(0, p), c.cache.bytes.data() + p * pb, static_cast<std::size_t>(pb));
    if (!sharded) return;
    const int32_t W = c.tp;
    const PageLayout ls = make_page_layout(dt, P, W);
    const int64_t data_bytes = dt == KvDtype::kNvfp4 ? kNvfp4DataBytesPerKey : key_bytes(dt);
    for (int32_t r = 0; r < W; ++r) {
      shards.emplace_back(ls, c.num_pages, 1, r);
      IndexCache& s = shards.back();
      for (int64_t p = 0; p < c.num_pages; ++p) {
        const uint8_t* src = repl->page_ptr(0, p);
        uint8_t* dst = s.page_ptr(0, p);
        for (int32_t j = 0; j < ls.rows(); ++j) {
          const int32_t u = ls.offset_of_local_row(r, j);
          std::memcpy(dst + ls.row_data_offset(j), src + lr.row_data_offset(u), static_cast<std::size_t>(data_bytes));
          if (dt == KvDtype::kNvfp4)
            std::memcpy(dst + ls.row_scale_offset(j), src + lr.row_scale_offset(u), kNvfp4ScalesPerKey);
        }
      }
    }
  }

  // Runs one step through `rc`'s path on W threads; each head from its owner rank.
  std::vector<int32_t> run(const Case& c, const ResolvedConfig& rc, double* wall_us, double* us_per_rank) const {
    const int32_t W = rc.engine.tp, H = c.heads, K = c.sel.topk;
    const DecodeBatch db = decode_batch(c);
    const PrefillBatch pb = prefill_batch(c);
    std::vector<std::vector<int32_t>> per(static_cast<std::size_t>(W));
    std::vector<double> busy(static_cast<std::size_t>(W), 0.0);
    const double t0 = now_us();
    run_ranks(W, [&](int rank, Communicator& comm) {
      int32_t h0, nh;
      owned_heads(H, W, rank, &h0, &nh);
      per[rank].assign(static_cast<std::size_t>(c.rows) * nh * K, -1);
      int32_t* out = per[rank].data();
      const double a = now_us();
      if (c.decode) {
        if (rc.sharding) icp_decode(comm, shards[rank], 0, db, c.sel, rc.k_rounding, out);
        else if (rc.decode_cp) decode_cp_replicated(comm, *repl, 0, db, c.sel, rc.k_rounding, out);
        else decode_select(*repl, 0, db, h0, nh, c.sel, rc.k_rounding, out);
      } else {
        if (rc.sharding && rc.prefill_cp == PrefillCp::kGather)
          prefill_gather(comm, shards[rank], 0, pb, c.sel, rc.prefill_gather_budget_bytes, out);
        else if (rc.sharding) prefill_local_score(comm, shards[rank], 0, pb, c.sel, out);
        else prefill_select(*repl, 0, pb, h0, nh, c.sel, out);
      }
      busy[rank] = now_us() - a;
    });
    *wall_us = now_us() - t0;
    *us_per_rank = 0;
    for (double b : busy) *us_per_rank += b / W;
    std::vector<int32_t> all(static_cast<std::size_t>(c.rows) * H * K, -1);
    for (int32_t rank = 0; rank < W; ++rank) {
      int32_t h0, nh;
      owned_heads(H, W, rank, &h0, &nh);
      if (W > H && rank != h0 * W / H) continue;  // the first rank sharing a head
      for (int64_t r = 0; r < c.rows; ++r)
        for (int32_t h = 0; h < nh; ++h)
          std::copy_n(per[rank].data() + (r * nh + h) * K, K, all.data() + (r * H + h0 + h) * K);
    }
    return all;
  }
};

// Block scores of the replicated path on the CPU (prefill scores E4M3-rounded NVFP4 keys).
std::vector<float> cpu_scores(const Case& c, const IndexCache& repl) {
  if (c.decode) {
    const DecodeBatch db = decode_batch(c);
    const auto rows = decode_rows(db, repl.num_pages(), c.page_size);
    return score_blocks(repl, 0, rows, db.block_table, db.max_pages, db.q, c.heads, 0, c.heads, c.rc.k_rounding).score;
  }
  const PrefillBatch pb = prefill_batch(c);
  const auto rows = prefill_rows(pb, repl.num_pages(), c.page_size);
  return score_blocks(repl, 0, rows, pb.block_table, pb.max_pages, pb.q, c.heads, 0, c.heads, KRounding::kE4m3).score;
}

json diff_json(const TopkDifference& d, const char* name_a, const char* name_b) {
  if (!d.found) return nullptr;
  return json{{"row", d.row}, {"head", d.head}, {name_a, d.a}, {name_b, d.b}};
}

// The output files of a replay (written into --out).
constexpr const char* kTopkFile = "topk.npy";
constexpr const char* kScoresFile = "scores.npy";
constexpr const char* kReportFile = "report.json";
std::vector<std::string> output_names(bool scores) {
  std::vector<std::string> n = {kTopkFile, kReportFile};
  if (scores) n.push_back(kScoresFile);
  return n;
}

// Throws Error naming --out unless the outputs `names` can be written into out_dir: the directory
// is usable (detail::check_output_directory) and no output exists as anything but a regular file,
// or a symbolic link to one (a directory or a FIFO there would fail the write half way).
void check_outputs(const fs::path& out_dir, const std::vector<std::string>& names) {
  detail::check_output_directory(out_dir, "--out");
  std::error_code ec;
  for (const auto& n : names) {
    const fs::file_status st = fs::status(out_dir / n, ec);
    if (fs::exists(st) && !fs::is_regular_file(st))
      throw Error(ErrorCode::kIo, (out_dir / n).string() + ": exists and is not a regular file (--out)");
  }
}

// Writes `files` (name -> bytes) into out_dir: each to a temporary file first, then all renamed,
// after check_outputs (so that nothing is written when one of them cannot be; only a rename that
// fails after the checks, e.g. on a vanishing file system, can leave part of them written).
void write_outputs(const fs::path& out_dir, const std::vector<std::pair<std::string, std::vector<uint8_t>>>& files) {
  std::vector<std::string> names;
  for (const auto& f : files) names.push_back(f.first);
  check_outputs(out_dir, names);
  std::error_code ec;
  const bool created = !fs::exists(out_dir, ec);
  if (created) fs::create_directory(detail::directory_name(out_dir), ec);
  if (ec || !fs::is_directory(out_dir, ec))
    throw Error(ErrorCode::kIo, out_dir.string() + ": cannot create the output directory (" + ec.message() + ")");
  std::vector<fs::path> tmps;
  try {
    for (const auto& f : files) {
      const fs::path tmp = out_dir / ("." + f.first + ".tmp" + std::to_string(::getpid()));
      tmps.push_back(tmp);
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      if (!out) throw Error(ErrorCode::kIo, (out_dir / f.first).string() + ": cannot open for writing");
      out.write(reinterpret_cast<const char*>(f.second.data()), static_cast<std::streamsize>(f.second.size()));
      out.close();
      if (!out) throw Error(ErrorCode::kIo, (out_dir / f.first).string() + ": write error");
    }
    for (std::size_t i = 0; i < files.size(); ++i) {
      fs::rename(tmps[i], out_dir / files[i].first, ec);
      if (ec) throw Error(ErrorCode::kIo, (out_dir / files[i].first).string() + ": cannot write (" + ec.message() + ")");
    }
  } catch (...) {
    for (const auto& t : tmps) fs::remove(t, ec);
    if (created) {
      for (const auto& f : files) fs::remove(out_dir / f.first, ec);
      fs::remove(detail::directory_name(out_dir), ec);
    }
    throw;
  }
}

}  // namespace

ReplayResult replay_case(const std::string& case_dir, const std::string& out_dir, const ReplayOptions& opts) {
  const double t_start = now_us();
  if (opts.backend != "cpu" && opts.backend != "cuda" && opts.backend != "auto")
    throw Error(ErrorCode::kInvalidArgument, "--backend = \"" + opts.backend + "\" is not supported; use cpu, cuda or auto");
  if (out_dir.empty()) throw Error(ErrorCode::kInvalidArgument, "--out: the output directory is empty");
  check_outputs(out_dir, output_names(opts.scores));  // before any work; write_outputs checks again
  Case c;
  c.dir = case_dir;
  {
    std::error_code ec;
    if (!fs::exists(c.dir, ec)) throw Error(ErrorCode::kIo, case_dir + ": no such case directory");
    if (!fs::is_directory(c.dir, ec)) throw Error(ErrorCode::kInvalidArgument, case_dir + ": is not a directory");
  }
  // the environment (INDEXCP_P256_STOCK_DECODE) is checked on its own first, so that its error is
  // not attributed to case.json
  (void)resolve_config(AttentionConfig{}, EngineParams{});
  load_case_json(c);
  load_arrays(c);

  ReplayResult res;
  res.rows = c.rows;
  res.heads = c.heads;
  res.topk_k = c.sel.topk;
  std::string backend = opts.backend;
  if (c.from_cache) {
    if (backend == "cuda")
      throw Error(ErrorCode::kUnsupported, c.file("cache.npy") +
                                               ": a case given as raw cache bytes replays on the cpu backend only "
                                               "(--backend cuda); use --backend cpu, or give keys.npy");
    if (backend == "auto" && cuda_available())
      c.notes.push_back("cache.npy cases replay on the cpu backend; --backend auto chose cpu");
    backend = "cpu";
  }
  const bool cp = c.rc.sharding || (c.decode && c.rc.decode_cp);
  res.compared_with_replicated = cp;
  res.path = path_name(c, c.rc);

  std::vector<int32_t> ref;
  std::vector<float> scores;
  double step_wall = 0, step_rank = 0, repl_wall = 0, insert_wall = 0;
  if (!c.from_cache) {
    // keys.npy: through TpIndexer on the chosen backend
    std::vector<float> kbuf(c.used_slots.size() * kHeadDim);
    for (std::size_t i = 0; i < c.used_slots.size(); ++i)
      std::copy_n(c.keys() + c.used_slots[i] * kHeadDim, kHeadDim, kbuf.data() + i * kHeadDim);
    const int64_t n = static_cast<int64_t>(c.used_slots.size());
    auto main = make_tp_indexer(backend, c.rc, c.num_pages);
    res.backend = main->backend();
    double t = now_us();
    main->insert(kbuf.data(), c.used_slots.data(), n, c.encode_scale);
    insert_wall = now_us() - t;
    StepStats st;
    const DecodeBatch db = decode_batch(c);
    const PrefillBatch pb = prefill_batch(c);
    res.topk = c.decode ? main->decode(db, c.sel, &st) : main->prefill(pb, c.sel, &st);
    step_wall = st.wall_us;
    step_rank = st.us_per_rank;
    std::unique_ptr<TpIndexer> rep;
    if (cp) {
      rep = make_tp_indexer(backend, c.rc_repl, c.num_pages);
      rep->insert(kbuf.data(), c.used_slots.data(), n, c.encode_scale);
      StepStats st2;
      ref = c.decode ? rep->decode(db, c.sel, &st2) : rep->prefill(pb, c.sel, &st2);
      repl_wall = st2.wall_us;
    }
    if (opts.scores) {
      if (c.decode) {
        scores = (cp ? rep : main)->decode_scores(db);
      } else {
        IndexCache repl(make_page_layout(c.rc.kv_dtype, c.page_size, 1), c.num_pages, 1, 0);
        InsertOptions io;
        io.encode_scale = c.encode_scale;
        insert_keys(repl, 0, kbuf.data(), c.used_slots.data(), n, io);
        scores = cpu_scores(c, repl);
        if (res.backend != "cpu") c.notes.push_back("scores.npy of a prefill case is computed on the cpu backend");
      }
    }
  } else {
    res.backend = "cpu";
    double t = now_us();
    const CacheGroup g(c, c.rc.sharding);
    insert_wall = now_us() - t;
    res.topk = g.run(c, c.rc, &step_wall, &step_rank);
    if (cp) {
      double r1 = 0;
      ref = g.run(c, c.rc_repl, &repl_wall, &r1);
    }
    if (opts.scores) scores = cpu_scores(c, *g.repl);
  }

  if (cp) {
    res.replicated_difference = first_difference(res.topk.data(), ref.data(), c.rows, c.heads, c.sel.topk);
    res.selections_equal_replicated = !res.replicated_difference.found;
  }
  if (c.has_expected) {
    res.has_expected = true;
    res.expected_difference = first_difference(c.expected.data(), res.topk.data(), c.rows, c.heads, c.sel.topk);
    res.expected_equal = !res.expected_difference.found;
  }

  // outputs
  std::vector<std::pair<std::string, std::vector<uint8_t>>> files;
  files.emplace_back(kTopkFile, npy::serialize(npy::Dtype::kInt32, {c.rows, c.heads, c.sel.topk}, res.topk.data()));
  const int64_t max_blocks = static_cast<int64_t>(c.max_pages) * c.page_size / kBlockTokens;
  if (opts.scores)
    files.emplace_back(kScoresFile, npy::serialize(npy::Dtype::kFloat32, {c.rows, c.heads, max_blocks}, scores.data()));
  json rep;
  rep["case"] = fs::absolute(c.dir).lexically_normal().string();
  rep["phase"] = c.decode ? "decode" : "prefill";
  rep["backend"] = res.backend;
  rep["config"] = json::parse(c.rc.to_json());
  rep["keys_from"] = c.from_cache ? "cache.npy" : "keys.npy";
  rep["requests"] = c.B;
  rep["rows"] = c.rows;
  rep["heads"] = c.heads;
  rep["topk"] = c.sel.topk;
  rep["init_blocks"] = c.sel.init_blocks;
  if (c.decode) rep["query_len"] = c.query_len;
  rep["num_pages"] = c.num_pages;
  rep["path"] = res.path;
  rep["compared_with_replicated"] = cp;
  rep["selections_equal_replicated"] = res.selections_equal_replicated;
  rep["first_difference_vs_replicated"] = diff_json(res.replicated_difference, "sharded", "replicated");
  if (c.has_expected)
    rep["expected_topk"] = json{{"equal", res.expected_equal}, {"first_difference", diff_json(res.expected_difference, "expected", "got")}};
  else
    rep["expected_topk"] = nullptr;
  rep["time"] = json{{"step_wall_us", step_wall},
                     {"step_us_per_rank", step_rank},
                     {"replicated_step_wall_us", cp ? json(repl_wall) : json(nullptr)},
                     {"insert_wall_us", insert_wall},
                     {"total_wall_us", now_us() - t_start}};
  json outs = json::array();
  for (const auto& f : files) outs.push_back(f.first);
  outs.push_back(kReportFile);
  rep["outputs"] = outs;
  rep["notes"] = c.notes;
  res.report_json = detail::dump_text(rep, 2) + "\n";
  files.emplace_back(kReportFile, std::vector<uint8_t>(res.report_json.begin(), res.report_json.end()));
  write_outputs(out_dir, files);
  for (const auto& f : files) res.written.push_back(f.first);
  return res;
}

}  // namespace indexcp
