// Attention config, policy and resolved configuration (spec/config.md sections 1-2).
#include "indexcp/config.hpp"

#include <cstdlib>
#include <exception>
#include <nlohmann/json.hpp>

#include "indexcp/error.hpp"
#include "indexcp/layout.hpp"
#include "json_util.hpp"
#include "core/knobs.hpp"

namespace indexcp {

using nlohmann::json;

std::string to_string(PrefillCp p) { return p == PrefillCp::kGather ? "gather" : "local_score"; }

namespace {

[[noreturn]] void bad(const std::string& key, const json& v, const std::string& supported) {
  throw Error(ErrorCode::kInvalidArgument,
              "attention config: " + key + " = " + detail::short_dump(v) + " is not supported; " + supported);
}

std::string need_string(const std::string& key, const json& v, const std::string& supported) {
  if (!v.is_string()) bad(key, v, supported);
  return v.get<std::string>();
}

}  // namespace

AttentionConfig AttentionConfig::from_json(const std::string& text) {
  const json j = detail::parse_json_strict(text, "attention config");
  if (!j.is_object())
    throw Error(ErrorCode::kInvalidArgument,
                "attention config must be a JSON object, got " + std::string(j.type_name()));
  AttentionConfig c;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    const json& v = it.value();
    if (k == "indexer_kv_dtype") {
      const std::string s = need_string(k, v, "use \"bf16\", \"fp8\" or \"nvfp4\"");
      if (s == "bf16") c.kv_dtype = KvDtype::kBf16;
      else if (s == "fp8") c.kv_dtype = KvDtype::kFp8;
      else if (s == "nvfp4") c.kv_dtype = KvDtype::kNvfp4;
      else bad(k, v, "use \"bf16\", \"fp8\" or \"nvfp4\"");
    } else if (k == "indexer_cache_sharding") {
      const std::string s = need_string(k, v, "use \"off\" or \"on\"");
      if (s == "on") c.cache_sharding = true;
      else if (s == "off") c.cache_sharding = false;
      else bad(k, v, "use \"off\" or \"on\"");
    } else if (k == "indexer_prefill_cp") {
      const std::string s = need_string(k, v, "use \"gather\" or \"local_score\"");
      if (s == "gather") c.prefill_cp = PrefillCp::kGather;
      else if (s == "local_score") c.prefill_cp = PrefillCp::kLocalScore;
      else bad(k, v, "use \"gather\" or \"local_score\"");
    } else if (k == "indexer_decode_cp") {
      if (!v.is_boolean()) bad(k, v, "use true or false");
      c.decode_cp = v.get<bool>();
    } else if (k == "indexer_k_rounding") {
      const std::string s = need_string(k, v, "use \"e4m3\" or \"exact\"");
      if (s == "e4m3") c.k_rounding = KRounding::kE4m3;
      else if (s == "exact") c.k_rounding = KRounding::kExact;
      else bad(k, v, "use \"e4m3\" or \"exact\"");
    } else if (k == "indexer_score_precision") {
      const std::string s = need_string(k, v, "use \"fp32\" or \"fp8_mma\"");
      if (s == "fp32") c.score_precision = ScorePrecision::kFp32;
      else if (s == "fp8_mma") c.score_precision = ScorePrecision::kFp8Mma;
      else bad(k, v, "use \"fp32\" or \"fp8_mma\"");
    } else if (k == "indexer_prefill_gather_budget_mib") {
      const std::string use = "use an integer number of MiB in 1.." + std::to_string(kMaxGatherBudgetMib);
      if (!v.is_number_integer()) bad(k, v, use);
      const auto n = v.get<int64_t>();
      if (n < 1 || n > kMaxGatherBudgetMib) bad(k, v, use);
      c.prefill_gather_budget_mib = n;
    } else {
      throw Error(ErrorCode::kInvalidArgument,
                  "attention config: unknown key \"" + (k.size() > 64 ? k.substr(0, 64) + "..." : k) +
                      "\"; known keys are indexer_kv_dtype, indexer_cache_sharding, "
                      "indexer_prefill_cp, indexer_decode_cp, indexer_k_rounding, "
                      "indexer_prefill_gather_budget_mib, indexer_score_precision");
    }
  }
  return c;
}

static json config_json(const AttentionConfig& c) {
  return json{{"indexer_kv_dtype", to_string(c.kv_dtype)},
              {"indexer_cache_sharding", c.cache_sharding ? "on" : "off"},
              {"indexer_prefill_cp", to_string(c.prefill_cp)},
              {"indexer_decode_cp", c.decode_cp},
              {"indexer_k_rounding", to_string(c.k_rounding)},
              {"indexer_prefill_gather_budget_mib", c.prefill_gather_budget_mib},
              {"indexer_score_precision", to_string(c.score_precision)}};
}

std::string AttentionConfig::to_json() const { return config_json(*this).dump(); }

int64_t index_bytes_per_token(KvDtype dtype, int32_t shards) {
  if (dtype == KvDtype::kBf16) return 256;
  return key_bytes(dtype) / (shards < 1 ? 1 : shards);
}

ResolvedConfig resolve_config(const AttentionConfig& c, const EngineParams& e) {
  const auto num = [](int64_t v) { return std::to_string(v); };
  if (e.tp != 1 && e.tp != 2 && e.tp != 4 && e.tp != 8)
    throw Error(ErrorCode::kUnsupported, "tp = " + num(e.tp) + " is not supported; use 1, 2, 4 or 8");
  if (e.page_size != 128 && e.page_size != 256)
    throw Error(ErrorCode::kUnsupported,
                "page_size = " + num(e.page_size) + " is not supported; use 128 or 256");
  if (e.query_len < 1 || e.query_len > 16)
    throw Error(ErrorCode::kUnsupported, "query_len = " + num(e.query_len) +
                                             " is not supported; speculative decoding is "
                                             "accepted with query lengths 1..16");
  check_heads_tp(e.heads, e.tp);
  // a hand-built AttentionConfig (from_json checks the same)
  check_kv_dtype(c.kv_dtype, "indexer_kv_dtype");
  check_k_rounding(c.k_rounding, "indexer_k_rounding");
  check_score_precision(c.score_precision, "indexer_score_precision");
  INDEXCP_REQUIRE(c.prefill_cp == PrefillCp::kGather || c.prefill_cp == PrefillCp::kLocalScore,
                  "indexer_prefill_cp = " + num(static_cast<int>(c.prefill_cp)) + " is not a PrefillCp (kGather or kLocalScore)");
  INDEXCP_REQUIRE(c.prefill_gather_budget_mib >= 1 && c.prefill_gather_budget_mib <= kMaxGatherBudgetMib,
                  "indexer_prefill_gather_budget_mib = " + num(c.prefill_gather_budget_mib) + " must be in 1.." +
                      num(kMaxGatherBudgetMib));

  ResolvedConfig r;
  r.requested = c;
  r.engine = e;
  r.kv_dtype = c.kv_dtype;
  r.prefill_cp = c.prefill_cp;
  r.k_rounding = c.k_rounding;
  r.score_precision = c.score_precision;
  r.prefill_gather_budget_bytes = c.prefill_gather_budget_mib << 20;
  // rule 7: FP8 tensor cores multiply E4M3 values only
  if (c.score_precision == ScorePrecision::kFp8Mma && c.kv_dtype == KvDtype::kBf16)
    throw Error(ErrorCode::kUnsupported,
                "indexer_score_precision = \"fp8_mma\" with indexer_kv_dtype = \"bf16\" is not supported; "
                "the mode needs E4M3 keys: indexer_kv_dtype \"fp8\", or \"nvfp4\" with indexer_k_rounding "
                "\"e4m3\" (or indexer_score_precision \"fp32\")");
  if (c.score_precision == ScorePrecision::kFp8Mma && c.kv_dtype == KvDtype::kNvfp4 &&
      c.k_rounding == KRounding::kExact)
    throw Error(ErrorCode::kUnsupported,
                "indexer_score_precision = \"fp8_mma\" with indexer_kv_dtype = \"nvfp4\" and indexer_k_rounding = "
                "\"exact\" is not supported; exact k_hat values are not E4M3: use indexer_k_rounding \"e4m3\", "
                "or indexer_score_precision \"fp32\"");
  if (c.kv_dtype != KvDtype::kNvfp4 && c.k_rounding == KRounding::kExact)
    r.notes.push_back("indexer_k_rounding = \"exact\" has no effect on a " + to_string(c.kv_dtype) +
                      " cache");

  bool sharding = c.cache_sharding;
  if (sharding) {
    if (c.kv_dtype == KvDtype::kBf16)
      throw Error(ErrorCode::kUnsupported,
                  "indexer_cache_sharding = \"on\" with indexer_kv_dtype = \"bf16\" is not "
                  "supported; sharding needs indexer_kv_dtype \"fp8\" or \"nvfp4\"");
    if (e.tp == 1) {
      r.notes.push_back("indexer_cache_sharding = \"on\" at tp = 1 is a no-op: one rank keeps the whole cache");
      sharding = false;
    } else if ((e.page_size / e.tp) % 16 != 0) {
      throw Error(ErrorCode::kUnsupported,
                  "indexer_cache_sharding = \"on\" with tp = " + num(e.tp) + " and page_size = " +
                      num(e.page_size) + " gives " + num(e.page_size / e.tp) +
                      " rows per rank; rows per rank (page_size / tp) must be a multiple of 16 "
                      "(page_size 128: tp 2, 4, 8; page_size 256: tp 2, 4, 8)");
    }
  }
  bool decode_cp = c.decode_cp;
  if (decode_cp && e.tp == 1) {
    r.notes.push_back("indexer_decode_cp = true at tp = 1 is a no-op");
    decode_cp = false;
  }
  if (decode_cp && sharding) {
    r.notes.push_back("indexer_decode_cp = true with indexer_cache_sharding = \"on\": the indexer "
                      "CP yields to decode CP and the index cache stays replicated");
    sharding = false;
  }
  // rule 4 applies to the effective sharding (not when it is a no-op or yields to decode CP)
  if (sharding && e.kv_connector)
    throw Error(ErrorCode::kUnsupported,
                "indexer_cache_sharding = \"on\" with a KV connector (or KV-cache CPU offload) is "
                "not supported; turn sharding off or remove the connector");
  r.sharding = sharding;
  r.decode_cp = decode_cp;
  r.shards = sharding ? e.tp : 1;
  if (!sharding && c.prefill_cp != PrefillCp::kGather)
    r.notes.push_back("indexer_prefill_cp applies only with sharding; prefill uses the replicated cache");

  r.p256_stock_decode = true;  // the default of INDEXCP_P256_STOCK_DECODE
  if (const char* env = detail::knob_env_raw("INDEXCP_P256_STOCK_DECODE")) {
    const std::string v(env);
    if (v == "1") r.p256_stock_decode = true;
    else if (v == "0") r.p256_stock_decode = false;
    else
      throw Error(ErrorCode::kInvalidArgument, "environment INDEXCP_P256_STOCK_DECODE = \"" + v +
                                                   "\" is not supported; use 0 or 1");
  }
  if (!(sharding && e.page_size == 256 && e.tp == 2)) r.p256_stock_decode = false;
  r.index_bytes_per_token_per_layer_per_rank = index_bytes_per_token(c.kv_dtype, r.shards);
  return r;
}

void check_resolved_config(const ResolvedConfig& c) {
  const ResolvedConfig r = resolve_config(c.requested, c.engine);
  const auto differs = [](const std::string& field, const std::string& have, const std::string& want) {
    throw Error(ErrorCode::kInvalidArgument, "ResolvedConfig." + field + " = " + have + " differs from " + want +
                                                 ", what resolve_config gives for its requested config and engine; "
                                                 "build the config with resolve_config");
  };
  const auto b = [](bool v) { return std::string(v ? "true" : "false"); };
  const auto i = [](int64_t v) { return std::to_string(v); };
  // an enum by its name, or by its number when it is none of the enumerators
  const auto e = [&](auto v, int lo, int hi) {
    const int n = static_cast<int>(v);
    return n >= lo && n <= hi ? to_string(v) : i(n);
  };
  if (static_cast<int>(c.kv_dtype) != static_cast<int>(r.kv_dtype))
    differs("kv_dtype", e(c.kv_dtype, 0, 2), to_string(r.kv_dtype));
  if (c.sharding != r.sharding) differs("sharding", b(c.sharding), b(r.sharding));
  if (c.shards != r.shards) differs("shards", i(c.shards), i(r.shards));
  if (static_cast<int>(c.prefill_cp) != static_cast<int>(r.prefill_cp))
    differs("prefill_cp", e(c.prefill_cp, 0, 1), to_string(r.prefill_cp));
  if (c.decode_cp != r.decode_cp) differs("decode_cp", b(c.decode_cp), b(r.decode_cp));
  if (static_cast<int>(c.k_rounding) != static_cast<int>(r.k_rounding))
    differs("k_rounding", e(c.k_rounding, 0, 1), to_string(r.k_rounding));
  if (static_cast<int>(c.score_precision) != static_cast<int>(r.score_precision))
    differs("score_precision", e(c.score_precision, 0, 1), to_string(r.score_precision));
  if (c.prefill_gather_budget_bytes != r.prefill_gather_budget_bytes)
    differs("prefill_gather_budget_bytes", i(c.prefill_gather_budget_bytes), i(r.prefill_gather_budget_bytes));
  if (c.index_bytes_per_token_per_layer_per_rank != r.index_bytes_per_token_per_layer_per_rank)
    differs("index_bytes_per_token_per_layer_per_rank", i(c.index_bytes_per_token_per_layer_per_rank),
            i(r.index_bytes_per_token_per_layer_per_rank));
  if (c.p256_stock_decode && !(c.sharding && c.engine.page_size == 256 && c.engine.tp == 2))
    differs("p256_stock_decode", "true", "false (it applies at sharding, P256, TP2 only)");
}

namespace {

// "icpa" and the record's version: a rank of another build (another field list) is refused as such
constexpr int64_t kRankAgreementMagic = 0x69637061;
constexpr int64_t kRankAgreementVersion = (kRankAgreementMagic << 32) | 2;  // 2: indexer_score_precision
constexpr const char* kRankAgreementNames[RankAgreement::kFieldsUsed] = {
    "the agreement record's version", "tp", "page_size", "indexer_kv_dtype", "indexer_cache_sharding (effective)",
    "indexer_decode_cp (effective)", "indexer_prefill_cp", "indexer_k_rounding", "indexer_prefill_gather_budget_mib",
    "num_pages (index cache pages per rank)", "indexer_score_precision"};

// field f's value as the user set it: an enum by name, a switch as on / off; a setting that does
// not apply to the rank's configuration was stored as 0 and reads "n/a" where 0 is not a value
std::string agreement_value(int f, int64_t v, const RankAgreement& r) {
  const auto in = [&](int64_t lo, int64_t hi) { return v >= lo && v <= hi; };
  const bool sharded = r.v[4] == 1, nvfp4 = r.v[3] == static_cast<int64_t>(KvDtype::kNvfp4);
  switch (f) {
    case 3: return in(0, 2) ? to_string(static_cast<KvDtype>(v)) : std::to_string(v);
    case 4:
    case 5: return in(0, 1) ? (v ? "on" : "off") : std::to_string(v);
    case 6: return !sharded ? "n/a (sharding off)" : in(0, 1) ? to_string(static_cast<PrefillCp>(v)) : std::to_string(v);
    case 7: return !nvfp4 ? "n/a (not nvfp4)" : in(0, 1) ? to_string(static_cast<KRounding>(v)) : std::to_string(v);
    case 8: return v == 0 ? "n/a (no gather prefill)" : std::to_string(v);
    case 10: return in(0, 1) ? to_string(static_cast<ScorePrecision>(v)) : std::to_string(v);
    default: return std::to_string(v);
  }
}

}  // namespace

RankAgreement rank_agreement(const ResolvedConfig& c, int64_t num_pages) {
  check_resolved_config(c);
  INDEXCP_REQUIRE(num_pages > 0, "num_pages = " + std::to_string(num_pages) + " must be > 0");
  RankAgreement r;
  r.v[0] = kRankAgreementVersion;
  r.v[1] = c.engine.tp;
  r.v[2] = c.engine.page_size;
  r.v[3] = static_cast<int64_t>(c.kv_dtype);
  r.v[4] = c.sharding;
  r.v[5] = c.decode_cp;
  // settings that have no effect in this configuration are not compared (0)
  r.v[6] = c.sharding ? static_cast<int64_t>(c.prefill_cp) : 0;
  r.v[7] = c.kv_dtype == KvDtype::kNvfp4 ? static_cast<int64_t>(c.k_rounding) : 0;
  r.v[8] = c.sharding && c.prefill_cp == PrefillCp::kGather ? c.prefill_gather_budget_bytes >> 20 : 0;
  r.v[9] = num_pages;
  r.v[10] = static_cast<int64_t>(c.score_precision);
  return r;
}

void check_rank_agreement_records(const RankAgreement* all, int world) {
  INDEXCP_REQUIRE(world >= 1, "world = " + std::to_string(world) + " must be >= 1");
  INDEXCP_REQUIRE(all != nullptr, "the ranks' agreement records are null");
  for (int p = 0; p < world; ++p)
    if (all[p].v[0] == 0)
      throw Error(ErrorCode::kInvalidArgument, "rank " + std::to_string(p) +
                                                   " of the TP group refused its own configuration, cache size or "
                                                   "communicator (its own error says why)");
  for (int p = 0; p < world; ++p)
    if (all[p].v[0] != kRankAgreementVersion) {
      const int64_t v = all[p].v[0];
      const std::string what = (v >> 32) == kRankAgreementMagic
                                   ? "version " + std::to_string(v & 0xffffffff) + " of the agreement record, this build's is " +
                                         std::to_string(kRankAgreementVersion & 0xffffffff)
                                   : "no indexcp agreement record";
      throw Error(ErrorCode::kInvalidArgument, "rank " + std::to_string(p) + " of the TP group sent " + what +
                                                   " (another indexcp build?); run the same indexcp on every rank");
    }
  for (int f = 1; f < RankAgreement::kFieldsUsed; ++f)
    for (int p = 1; p < world; ++p)
      if (all[p].v[f] != all[0].v[f])
        throw Error(ErrorCode::kInvalidArgument,
                    std::string("the ranks of the TP group disagree on ") + kRankAgreementNames[f] + ": rank 0 has " +
                        agreement_value(f, all[0].v[f], all[0]) + ", rank " + std::to_string(p) + " has " +
                        agreement_value(f, all[p].v[f], all[p]) +
                        "; every rank needs the same attention config, engine parameters and number of index cache "
                        "pages");
}

namespace detail {

void exchange_rank_agreement(const ResolvedConfig& c, int64_t num_pages, int world,
                             const std::function<void(const RankAgreement*, RankAgreement*)>& all_gather) {
  INDEXCP_REQUIRE(world >= 1, "the communicator's world = " + std::to_string(world) + " must be >= 1");
  RankAgreement mine;  // zeros: this rank refused its own inputs
  std::exception_ptr own;
  try {
    INDEXCP_REQUIRE(world == c.engine.tp, "the communicator's world size (" + std::to_string(world) +
                                              ") differs from the configuration's tp (" +
                                              std::to_string(c.engine.tp) + ")");
    mine = rank_agreement(c, num_pages);
  } catch (...) {  // whatever it is, the others must not wait for this rank
    own = std::current_exception();
  }
  std::vector<RankAgreement> all(static_cast<std::size_t>(world));
  all_gather(&mine, all.data());
  if (own) std::rethrow_exception(own);
  check_rank_agreement_records(all.data(), world);
}

}  // namespace detail

std::string ResolvedConfig::to_json() const {
  json j = config_json(requested);
  j["indexer_cache_sharding"] = sharding ? "on" : "off";
  j["indexer_decode_cp"] = decode_cp;
  j["indexer_prefill_cp"] = to_string(prefill_cp);
  j["tp"] = engine.tp;
  j["page_size"] = engine.page_size;
  j["index_heads"] = engine.heads;
  j["query_len"] = engine.query_len;
  j["speculative_method"] = engine.speculative_method;
  j["kv_connector"] = engine.kv_connector;
  j["shards"] = shards;
  j["rows_per_rank"] = engine.page_size / shards;
  j["p256_stock_decode"] = p256_stock_decode;
  j["prefill_gather_budget_bytes"] = prefill_gather_budget_bytes;
  j["index_bytes_per_token_per_layer_per_rank"] = index_bytes_per_token_per_layer_per_rank;
  j["notes"] = notes;
  return j.dump(2);
}

}  // namespace indexcp
