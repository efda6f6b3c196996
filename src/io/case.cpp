// Loading and validating a case directory (src/io/case.hpp).
#include "case.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <nlohmann/json.hpp>

#include "core/file_util.hpp"
#include "core/json_util.hpp"
#include "indexcp/cache.hpp"
#include "indexcp/formats.hpp"
#include "indexcp/layout.hpp"

namespace indexcp::io {

using json = nlohmann::json;

[[noreturn]] void invalid(const std::string& file, const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, file + ": " + what);
}

namespace {

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

}  // namespace

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

}  // namespace indexcp::io
