// Memory accounting and KV capacity (spec/config.md section 3).
#include "indexcp/capacity.hpp"

#include <nlohmann/json.hpp>

#include "indexcp/config.hpp"
#include "indexcp/error.hpp"
#include "json_util.hpp"

namespace indexcp {

using nlohmann::json;

ModelDesc ModelDesc::builtin(const std::string& name) {
  if (name == "minimax-m3") return ModelDesc{};
  throw Error(ErrorCode::kInvalidArgument,
              "--model = \"" + name + "\" is not a built-in model; built-in: minimax-m3 (or give a JSON file)");
}

ModelDesc ModelDesc::from_json(const std::string& text) {
  const json j = detail::parse_json_strict(text, "model description");
  if (!j.is_object()) throw Error(ErrorCode::kInvalidArgument, "model description must be a JSON object");
  ModelDesc m;
  m.name = "custom";
  const char* required[] = {"layers", "sparse_layers", "q_heads", "kv_heads", "head_dim", "index_heads", "index_dim"};
  for (const char* k : required)
    if (!j.contains(k)) throw Error(ErrorCode::kInvalidArgument, std::string("model description: missing key \"") + k + "\"");
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    const json& v = it.value();
    if (k == "name") {
      if (!v.is_string()) throw Error(ErrorCode::kInvalidArgument, "model description: name must be a string");
      m.name = v.get<std::string>();
      continue;
    }
    int32_t* dst = k == "layers" ? &m.layers
                   : k == "sparse_layers" ? &m.sparse_layers
                   : k == "q_heads" ? &m.q_heads
                   : k == "kv_heads" ? &m.kv_heads
                   : k == "head_dim" ? &m.head_dim
                   : k == "index_heads" ? &m.index_heads
                   : k == "index_dim" ? &m.index_dim
                                      : nullptr;
    if (!dst)
      throw Error(ErrorCode::kInvalidArgument,
                  "model description: unknown key \"" + (k.size() > 64 ? k.substr(0, 64) + "..." : k) + "\"");
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > kMaxModelField)
      throw Error(ErrorCode::kInvalidArgument, "model description: " + k + " = " + detail::short_dump(v) + " must be an integer in 0.." + std::to_string(kMaxModelField));
    *dst = static_cast<int32_t>(v.get<int64_t>());
  }
  m.validate();
  return m;
}

void ModelDesc::validate() const {
  const auto bad = [](const std::string& k, int64_t v, const std::string& why) {
    throw Error(ErrorCode::kInvalidArgument, "model description: " + k + " = " + std::to_string(v) + " " + why);
  };
  const std::string heads_range = "must be in 1.." + std::to_string(kMaxModelField);
  if (layers < 1 || layers > 4096) bad("layers", layers, "must be in 1..4096");
  if (sparse_layers < 0 || sparse_layers > layers) bad("sparse_layers", sparse_layers, "must be in 0..layers");
  if (q_heads < 1 || q_heads > kMaxModelField) bad("q_heads", q_heads, heads_range);
  if (kv_heads < 1 || kv_heads > kMaxModelField) bad("kv_heads", kv_heads, heads_range);
  if (index_heads < 1 || index_heads > kMaxModelField) bad("index_heads", index_heads, heads_range);
  if (head_dim < 16 || head_dim > 1024 || head_dim % 16) bad("head_dim", head_dim, "must be a multiple of 16 in 16..1024");
  if (index_dim != 128) bad("index_dim", index_dim, "must be 128 (fixed by the index-key formats)");
}

std::string ModelDesc::to_json() const {
  return json{{"name", name}, {"layers", layers}, {"sparse_layers", sparse_layers}, {"q_heads", q_heads},
              {"kv_heads", kv_heads}, {"head_dim", head_dim}, {"index_heads", index_heads}, {"index_dim", index_dim}}
      .dump();
}

int64_t kv_bytes_per_head_token(KvDtype dtype, int32_t d) {
  switch (dtype) {
    case KvDtype::kBf16: return 2ll * d;
    case KvDtype::kFp8: return d;
    case KvDtype::kNvfp4: return d / 2 + d / 16;
  }
  return 0;
}

CapacityReport plan_capacity(const ModelDesc& m, int64_t budget, KvDtype kv_dtype, KvDtype index_dtype,
                             int32_t tp, int32_t page_size) {
  INDEXCP_REQUIRE(budget > 0, "budget = " + std::to_string(budget) + " bytes must be > 0");
  m.validate();
  check_kv_dtype(kv_dtype, "kv_dtype");
  check_kv_dtype(index_dtype, "index_dtype");
  if (tp != 1 && tp != 2 && tp != 4 && tp != 8)
    throw Error(ErrorCode::kUnsupported, "tp = " + std::to_string(tp) + " is not supported; use 1, 2, 4 or 8");
  if (page_size != 128 && page_size != 256)
    throw Error(ErrorCode::kUnsupported, "page_size = " + std::to_string(page_size) + " is not supported; use 128 or 256");
  CapacityReport r;
  r.model = m;
  r.budget_bytes = budget;
  r.kv_dtype = kv_dtype;
  r.index_dtype = index_dtype;
  r.tp = tp;
  r.page_size = page_size;
  const int64_t kv_heads_per_rank = (m.kv_heads + tp - 1) / tp;
  const int64_t kv = static_cast<int64_t>(m.layers) * 2 * kv_heads_per_rank * kv_bytes_per_head_token(kv_dtype, m.head_dim);
  const auto fill = [&](bool on) {
    CapacityResult c;
    const bool shard = on && index_dtype != KvDtype::kBf16 && tp > 1 && (page_size / tp) % 16 == 0;
    c.sharding = shard;  // effective: off for a bf16 index, TP1, or rows per rank not a multiple of 16
    c.kv_bytes_per_token = kv;
    c.index_bytes_per_token = static_cast<int64_t>(m.sparse_layers) * index_bytes_per_token(index_dtype, shard ? tp : 1);
    const int64_t per = c.kv_bytes_per_token + c.index_bytes_per_token;
    c.tokens = (budget / per) / page_size * page_size;
    return c;
  };
  r.off = fill(false);
  r.on = fill(true);
  return r;
}

std::string CapacityReport::to_json() const {
  const auto res = [](const CapacityResult& c) {
    return json{{"sharding", c.sharding ? "on" : "off"}, {"kv_bytes_per_token", c.kv_bytes_per_token},
                {"index_bytes_per_token", c.index_bytes_per_token}, {"tokens", c.tokens}};
  };
  json j{{"model", json::parse(model.to_json())}, {"budget_bytes", budget_bytes}, {"kv_dtype", to_string(kv_dtype)},
         {"index_dtype", to_string(index_dtype)}, {"tp", tp}, {"page_size", page_size},
         {"off", res(off)}, {"on", res(on)}, {"ratio", ratio()}};
  return j.dump(2);
}

}  // namespace indexcp
