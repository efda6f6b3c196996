// Attention config, policy, resolved configuration and capacity (spec/config.md sections 1-3).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "indexcp/capacity.hpp"
#include "indexcp/comm.hpp"
#include "indexcp/config.hpp"
#include "indexcp/error.hpp"
#include "indexcp/tp_group.hpp"

using namespace indexcp;
using nlohmann::json;

namespace {

template <class F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Expects an Error whose message holds every needle.
template <class F>
void expect_error(F&& fn, const std::vector<std::string>& needles, const std::string& ctx = "") {
  const std::string w = error_of(fn);
  ASSERT_FALSE(w.empty()) << ctx << ": accepted; expected an error naming " << (needles.empty() ? "" : needles[0]);
  for (const auto& n : needles) EXPECT_NE(w.find(n), std::string::npos) << ctx << ": '" << w << "' lacks '" << n << "'";
}

// Sets / unsets INDEXCP_P256_STOCK_DECODE for one scope, restoring the previous value.
class EnvGuard {
 public:
  explicit EnvGuard(const char* value) {
    if (const char* old = std::getenv(kName)) old_ = old;
    if (value) setenv(kName, value, 1);
    else unsetenv(kName);
  }
  ~EnvGuard() {
    if (old_) setenv(kName, old_->c_str(), 1);
    else unsetenv(kName);
  }

 private:
  static constexpr const char* kName = "INDEXCP_P256_STOCK_DECODE";
  std::optional<std::string> old_;
};

AttentionConfig cfg(const std::string& j) { return AttentionConfig::from_json(j); }

EngineParams engine(int tp, int P = 128, int heads = 4, int Q = 1, bool connector = false) {
  EngineParams e;
  e.tp = tp;
  e.page_size = P;
  e.heads = heads;
  e.query_len = Q;
  e.kv_connector = connector;
  return e;
}

bool has_note(const ResolvedConfig& r, const std::vector<std::string>& needles) {
  for (const auto& n : r.notes) {
    bool all = true;
    for (const auto& x : needles) all = all && n.find(x) != std::string::npos;
    if (all) return true;
  }
  return false;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// AttentionConfig::from_json (section 1)

TEST(AttentionConfig, Defaults) {
  const AttentionConfig c = cfg("{}");
  EXPECT_EQ(c.kv_dtype, KvDtype::kFp8);
  EXPECT_FALSE(c.cache_sharding);
  EXPECT_EQ(c.prefill_cp, PrefillCp::kGather);
  EXPECT_FALSE(c.decode_cp);
  EXPECT_EQ(c.k_rounding, KRounding::kE4m3);
  EXPECT_EQ(c.prefill_gather_budget_mib, 256);
  const AttentionConfig d;
  EXPECT_EQ(d.kv_dtype, c.kv_dtype);
  EXPECT_EQ(d.prefill_gather_budget_mib, 256);
}

TEST(AttentionConfig, EveryKeyAndValue) {
  for (auto [s, v] : {std::pair{"bf16", KvDtype::kBf16}, std::pair{"fp8", KvDtype::kFp8}, std::pair{"nvfp4", KvDtype::kNvfp4}})
    EXPECT_EQ(cfg(std::string("{\"indexer_kv_dtype\": \"") + s + "\"}").kv_dtype, v);
  EXPECT_TRUE(cfg(R"({"indexer_cache_sharding": "on"})").cache_sharding);
  EXPECT_FALSE(cfg(R"({"indexer_cache_sharding": "off"})").cache_sharding);
  EXPECT_EQ(cfg(R"({"indexer_prefill_cp": "gather"})").prefill_cp, PrefillCp::kGather);
  EXPECT_EQ(cfg(R"({"indexer_prefill_cp": "local_score"})").prefill_cp, PrefillCp::kLocalScore);
  EXPECT_TRUE(cfg(R"({"indexer_decode_cp": true})").decode_cp);
  EXPECT_FALSE(cfg(R"({"indexer_decode_cp": false})").decode_cp);
  EXPECT_EQ(cfg(R"({"indexer_k_rounding": "e4m3"})").k_rounding, KRounding::kE4m3);
  EXPECT_EQ(cfg(R"({"indexer_k_rounding": "exact"})").k_rounding, KRounding::kExact);
  EXPECT_EQ(cfg(R"({"indexer_prefill_gather_budget_mib": 1})").prefill_gather_budget_mib, 1);
  EXPECT_EQ(cfg(R"({"indexer_prefill_gather_budget_mib": 4096})").prefill_gather_budget_mib, 4096);
  EXPECT_EQ(cfg(R"({"indexer_score_precision": "fp32"})").score_precision, ScorePrecision::kFp32);
  EXPECT_EQ(cfg(R"({"indexer_score_precision": "fp8_mma"})").score_precision, ScorePrecision::kFp8Mma);
  EXPECT_EQ(cfg("{}").score_precision, ScorePrecision::kFp32) << "the default";
  const AttentionConfig all = cfg(R"({"indexer_kv_dtype": "nvfp4", "indexer_cache_sharding": "on",
      "indexer_prefill_cp": "local_score", "indexer_decode_cp": true, "indexer_k_rounding": "exact",
      "indexer_prefill_gather_budget_mib": 64, "indexer_score_precision": "fp8_mma"})");
  EXPECT_EQ(all.kv_dtype, KvDtype::kNvfp4);
  EXPECT_EQ(all.score_precision, ScorePrecision::kFp8Mma);
  EXPECT_TRUE(all.cache_sharding);
  EXPECT_EQ(all.prefill_cp, PrefillCp::kLocalScore);
  EXPECT_TRUE(all.decode_cp);
  EXPECT_EQ(all.k_rounding, KRounding::kExact);
  EXPECT_EQ(all.prefill_gather_budget_mib, 64);
  // to_json round-trips through from_json and holds every key
  const json j = json::parse(all.to_json());
  for (const char* k : {"indexer_kv_dtype", "indexer_cache_sharding", "indexer_prefill_cp", "indexer_decode_cp",
                        "indexer_k_rounding", "indexer_prefill_gather_budget_mib", "indexer_score_precision"})
    EXPECT_TRUE(j.contains(k)) << k;
  EXPECT_EQ(j.size(), 7u);
  EXPECT_EQ(j["indexer_score_precision"], "fp8_mma");
  const AttentionConfig back = cfg(all.to_json());
  EXPECT_EQ(back.kv_dtype, all.kv_dtype);
  EXPECT_EQ(back.cache_sharding, all.cache_sharding);
  EXPECT_EQ(back.prefill_cp, all.prefill_cp);
  EXPECT_EQ(back.decode_cp, all.decode_cp);
  EXPECT_EQ(back.k_rounding, all.k_rounding);
  EXPECT_EQ(back.prefill_gather_budget_mib, all.prefill_gather_budget_mib);
  EXPECT_EQ(back.score_precision, all.score_precision);
  EXPECT_EQ(cfg(AttentionConfig{}.to_json()).to_json(), AttentionConfig{}.to_json());
}

TEST(AttentionConfig, UnknownKeyIsNamed) {
  expect_error([] { cfg(R"({"indexer_kv_dtyp": "fp8"})"); }, {"indexer_kv_dtyp"}, "typo");
  expect_error([] { cfg(R"({"indexer_kv_dtype": "fp8", "foo_bar": 1})"); }, {"foo_bar"}, "extra key");
  expect_error([] { cfg(R"({"": 1})"); }, {"unknown"}, "empty key");
}

TEST(AttentionConfig, WrongTypesNameKeyAndValue) {
  expect_error([] { cfg(R"({"indexer_kv_dtype": 3})"); }, {"indexer_kv_dtype", "3"});
  expect_error([] { cfg(R"({"indexer_kv_dtype": null})"); }, {"indexer_kv_dtype", "null"});
  expect_error([] { cfg(R"({"indexer_cache_sharding": true})"); }, {"indexer_cache_sharding", "true"});
  expect_error([] { cfg(R"({"indexer_prefill_cp": ["gather"]})"); }, {"indexer_prefill_cp", "gather"});
  expect_error([] { cfg(R"({"indexer_decode_cp": "true"})"); }, {"indexer_decode_cp", "\"true\""});
  expect_error([] { cfg(R"({"indexer_decode_cp": 1})"); }, {"indexer_decode_cp", "1"});
  expect_error([] { cfg(R"({"indexer_k_rounding": 0})"); }, {"indexer_k_rounding", "0"});
  expect_error([] { cfg(R"({"indexer_score_precision": 1})"); }, {"indexer_score_precision", "1"});
  expect_error([] { cfg(R"({"indexer_score_precision": null})"); }, {"indexer_score_precision", "null"});
  expect_error([] { cfg(R"({"indexer_prefill_gather_budget_mib": "256"})"); },
               {"indexer_prefill_gather_budget_mib", "\"256\""});
  expect_error([] { cfg(R"({"indexer_prefill_gather_budget_mib": 1.5})"); }, {"indexer_prefill_gather_budget_mib", "1.5"});
  expect_error([] { cfg(R"({"indexer_prefill_gather_budget_mib": true})"); }, {"indexer_prefill_gather_budget_mib"});
  // not an object / not JSON
  expect_error([] { cfg("[1, 2]"); }, {"object"});
  expect_error([] { cfg("\"fp8\""); }, {"object"});
  expect_error([] { cfg("{indexer_kv_dtype: fp8}"); }, {"JSON"});
  expect_error([] { cfg(""); }, {"JSON"});
}

TEST(AttentionConfig, BadValuesListWhatIsSupported) {
  expect_error([] { cfg(R"({"indexer_kv_dtype": "fp4"})"); }, {"indexer_kv_dtype", "fp4", "bf16", "fp8", "nvfp4"});
  expect_error([] { cfg(R"({"indexer_kv_dtype": "NVFP4"})"); }, {"indexer_kv_dtype", "NVFP4", "nvfp4"});
  expect_error([] { cfg(R"({"indexer_cache_sharding": "yes"})"); }, {"indexer_cache_sharding", "yes", "off", "on"});
  expect_error([] { cfg(R"({"indexer_prefill_cp": "scatter"})"); },
               {"indexer_prefill_cp", "scatter", "gather", "local_score"});
  expect_error([] { cfg(R"({"indexer_k_rounding": "rne"})"); }, {"indexer_k_rounding", "rne", "e4m3", "exact"});
  expect_error([] { cfg(R"({"indexer_score_precision": "fp16"})"); },
               {"indexer_score_precision", "fp16", "fp32", "fp8_mma"});
  expect_error([] { cfg(R"({"indexer_score_precision": "FP8_MMA"})"); }, {"indexer_score_precision", "FP8_MMA"});
  for (const char* v : {"0", "-1", "-256"})
    expect_error([v] { cfg(std::string(R"({"indexer_prefill_gather_budget_mib": )") + v + "}"); },
                 {"indexer_prefill_gather_budget_mib", v}, v);
  // far above anything sensible (1 TiB = 1048576 MiB is the documented bound)
  expect_error([] { cfg(R"({"indexer_prefill_gather_budget_mib": 1048577})"); },
               {"indexer_prefill_gather_budget_mib", "1048577"});
  expect_error([] { cfg(R"({"indexer_prefill_gather_budget_mib": 99999999999999999})"); },
               {"indexer_prefill_gather_budget_mib"});
}

// ---------------------------------------------------------------------------------------------
// Policy (section 2)

// Rule 1: sharding needs fp8 or nvfp4
TEST(Policy, Rule1ShardingWithBf16IsRefused) {
  EnvGuard env(nullptr);
  for (int tp : {1, 2, 4, 8}) {
    const std::string w =
        error_of([&] { resolve_config(cfg(R"({"indexer_kv_dtype": "bf16", "indexer_cache_sharding": "on"})"), engine(tp)); });
    ASSERT_FALSE(w.empty()) << "tp " << tp;
    for (const char* n : {"indexer_cache_sharding", "on", "indexer_kv_dtype", "bf16", "fp8", "nvfp4"})
      EXPECT_NE(w.find(n), std::string::npos) << "'" << w << "' lacks " << n;
  }
  // bf16 without sharding is fine
  const ResolvedConfig r = resolve_config(cfg(R"({"indexer_kv_dtype": "bf16"})"), engine(4));
  EXPECT_FALSE(r.sharding);
  EXPECT_EQ(r.index_bytes_per_token_per_layer_per_rank, 256);
}

// Rule 2: W in {2, 4, 8}, P in {128, 256}, P / W a multiple of 16; W = 1 is a no-op (a note)
TEST(Policy, Rule2PageSizesAndRanks) {
  EnvGuard env(nullptr);
  for (const char* dt : {"fp8", "nvfp4"})
    for (int P : {128, 256})
      for (int tp : {2, 4, 8}) {
        const ResolvedConfig r = resolve_config(
            cfg(std::string(R"({"indexer_cache_sharding": "on", "indexer_kv_dtype": ")") + dt + "\"}"), engine(tp, P));
        EXPECT_TRUE(r.sharding) << dt << " P" << P << " W" << tp;
        EXPECT_EQ(r.shards, tp);
        EXPECT_EQ((P / r.shards) % 16, 0);
        EXPECT_EQ(r.index_bytes_per_token_per_layer_per_rank, (std::string(dt) == "fp8" ? 128 : 72) / tp);
      }
  const AttentionConfig on = cfg(R"({"indexer_cache_sharding": "on", "indexer_kv_dtype": "nvfp4"})");
  for (int tp : {3, 5, 6, 16, 0, -2})
    expect_error([&] { resolve_config(on, engine(tp, 128, 16)); }, {"tp", std::to_string(tp), "1, 2, 4"},
                 "tp " + std::to_string(tp));
  for (int P : {64, 16, 512, 0, 192})
    expect_error([&] { resolve_config(on, engine(2, P)); }, {"page_size", std::to_string(P), "128", "256"},
                 "P " + std::to_string(P));
  // W = 1: sharding is a no-op, reported as such
  const ResolvedConfig one = resolve_config(on, engine(1));
  EXPECT_FALSE(one.sharding);
  EXPECT_EQ(one.shards, 1);
  EXPECT_TRUE(has_note(one, {"indexer_cache_sharding", "no-op"})) << ::testing::PrintToString(one.notes);
  EXPECT_EQ(one.index_bytes_per_token_per_layer_per_rank, 72);
}

// Rule 3: decode CP and sharding: the indexer CP yields, the cache stays replicated (a note)
TEST(Policy, Rule3DecodeCpYieldsNote) {
  EnvGuard env(nullptr);
  const AttentionConfig c = cfg(R"({"indexer_cache_sharding": "on", "indexer_kv_dtype": "nvfp4", "indexer_decode_cp": true})");
  for (int tp : {2, 4, 8}) {
    const ResolvedConfig r = resolve_config(c, engine(tp));
    EXPECT_FALSE(r.sharding) << tp;
    EXPECT_EQ(r.shards, 1);
    EXPECT_TRUE(r.decode_cp);
    EXPECT_EQ(r.index_bytes_per_token_per_layer_per_rank, 72);
    EXPECT_TRUE(has_note(r, {"indexer_decode_cp", "indexer_cache_sharding", "replicated"}))
        << ::testing::PrintToString(r.notes);
    const json j = json::parse(r.to_json());
    EXPECT_EQ(j["indexer_cache_sharding"], "off");
    EXPECT_EQ(j["indexer_decode_cp"], true);
  }
  // decode CP alone at W >= 2 is on; at W = 1 a no-op
  EXPECT_TRUE(resolve_config(cfg(R"({"indexer_decode_cp": true})"), engine(4)).decode_cp);
  const ResolvedConfig one = resolve_config(cfg(R"({"indexer_decode_cp": true})"), engine(1));
  EXPECT_FALSE(one.decode_cp);
  EXPECT_TRUE(has_note(one, {"indexer_decode_cp"}));
}

// Rule 4: a KV connector / CPU offload is refused with sharding on
TEST(Policy, Rule4KvConnectorRefusedWithSharding) {
  EnvGuard env(nullptr);
  const AttentionConfig on = cfg(R"({"indexer_cache_sharding": "on", "indexer_kv_dtype": "fp8"})");
  for (int tp : {2, 4, 8})
    expect_error([&] { resolve_config(on, engine(tp, 128, 4, 1, true)); },
                 {"indexer_cache_sharding", "on", "connector"}, "tp " + std::to_string(tp));
  // sharding off: a connector is fine
  EXPECT_NO_THROW(resolve_config(cfg("{}"), engine(2, 128, 4, 1, true)));
  EXPECT_NO_THROW(resolve_config(cfg(R"({"indexer_cache_sharding": "off"})"), engine(8, 128, 4, 1, true)));
}

// Rule 5: Q up to 16 accepted (8-query methods such as DSpark k=7 included)
TEST(Policy, Rule5QueryLengthUpToSixteen) {
  EnvGuard env(nullptr);
  const AttentionConfig on = cfg(R"({"indexer_cache_sharding": "on", "indexer_kv_dtype": "nvfp4"})");
  for (int Q : {1, 2, 3, 8, 15, 16}) {
    EngineParams e = engine(2, 128, 4, Q);
    e.speculative_method = Q == 8 ? "dspark" : "";
    const ResolvedConfig r = resolve_config(on, e);
    EXPECT_TRUE(r.sharding);
    EXPECT_EQ(r.engine.query_len, Q);
  }
  for (int Q : {17, 0, -1, 64})
    expect_error([&] { resolve_config(on, engine(2, 128, 4, Q)); }, {"query_len", std::to_string(Q), "16"},
                 "Q " + std::to_string(Q));
}

// Rule 6: sharding off keeps the replicated path
TEST(Policy, Rule6ShardingOffIsReplicated) {
  EnvGuard env(nullptr);
  for (const char* dt : {"bf16", "fp8", "nvfp4"})
    for (int tp : {1, 2, 4, 8}) {
      const ResolvedConfig r = resolve_config(cfg(std::string(R"({"indexer_kv_dtype": ")") + dt + "\"}"), engine(tp));
      EXPECT_FALSE(r.sharding);
      EXPECT_FALSE(r.decode_cp);
      EXPECT_EQ(r.shards, 1);
      EXPECT_FALSE(r.p256_stock_decode);
      EXPECT_EQ(r.index_bytes_per_token_per_layer_per_rank, index_bytes_per_token(parse_kv_dtype(dt), 1));
    }
  // prefill CP applies only with sharding
  const ResolvedConfig r = resolve_config(cfg(R"({"indexer_prefill_cp": "local_score"})"), engine(2));
  EXPECT_FALSE(r.sharding);
  EXPECT_TRUE(has_note(r, {"indexer_prefill_cp"}));
}

TEST(Policy, HeadsAndTpMustDivideOneAnother) {
  EnvGuard env(nullptr);
  for (auto [H, W] : {std::pair{3, 2}, std::pair{6, 4}, std::pair{12, 8}, std::pair{5, 4}}) {
    if (H % W == 0 || W % H == 0) continue;
    expect_error([&] { resolve_config(cfg("{}"), engine(W, 128, H)); }, {"heads", std::to_string(H), "tp",
                                                                         std::to_string(W)},
                 "H" + std::to_string(H) + " W" + std::to_string(W));
  }
  for (auto [H, W] : {std::pair{1, 8}, std::pair{2, 8}, std::pair{4, 8}, std::pair{8, 2}, std::pair{16, 4}, std::pair{4, 4}})
    EXPECT_NO_THROW(resolve_config(cfg(R"({"indexer_cache_sharding": "on", "indexer_kv_dtype": "nvfp4"})"),
                                   engine(W, 128, H)))
        << "H" << H << " W" << W;
  expect_error([] { resolve_config(cfg("{}"), engine(2, 128, 0)); }, {"heads", "0"});
}

// Rule 7: fp8_mma needs E4M3 keys; each refusal names both keys and says what works.
TEST(Policy, Rule7Fp8MmaNeedsE4m3Keys) {
  EnvGuard env(nullptr);
  for (const char* c : {R"({"indexer_kv_dtype": "fp8", "indexer_score_precision": "fp8_mma"})",
                        R"({"indexer_kv_dtype": "nvfp4", "indexer_score_precision": "fp8_mma"})",
                        R"({"indexer_kv_dtype": "nvfp4", "indexer_k_rounding": "e4m3", "indexer_cache_sharding": "on", "indexer_score_precision": "fp8_mma"})",
                        R"({"indexer_kv_dtype": "fp8", "indexer_k_rounding": "exact", "indexer_score_precision": "fp8_mma"})"}) {
    ResolvedConfig r;
    ASSERT_NO_THROW(r = resolve_config(cfg(c), engine(2))) << c;
    EXPECT_EQ(r.score_precision, ScorePrecision::kFp8Mma) << c;
    EXPECT_EQ(json::parse(r.to_json())["indexer_score_precision"], "fp8_mma") << c;
    EXPECT_NO_THROW(check_resolved_config(r)) << c;
  }
  expect_error([] { resolve_config(cfg(R"({"indexer_kv_dtype": "bf16", "indexer_score_precision": "fp8_mma"})"), engine(2)); },
               {"indexer_score_precision", "fp8_mma", "indexer_kv_dtype", "bf16", "fp32"});
  expect_error(
      [] {
        resolve_config(cfg(R"({"indexer_kv_dtype": "nvfp4", "indexer_k_rounding": "exact", "indexer_score_precision": "fp8_mma"})"),
                       engine(2));
      },
      {"indexer_score_precision", "fp8_mma", "indexer_k_rounding", "exact", "e4m3"});
  EXPECT_EQ(resolve_config(cfg(R"({"indexer_kv_dtype": "bf16"})"), engine(1)).score_precision, ScorePrecision::kFp32);
  // a hand-built config with a value that is no enumerator, and a hand-edited resolved config
  AttentionConfig bad;
  bad.score_precision = static_cast<ScorePrecision>(7);
  expect_error([&] { resolve_config(bad, engine(2)); }, {"indexer_score_precision", "7"});
  ResolvedConfig edited = resolve_config(cfg(R"({"indexer_kv_dtype": "fp8"})"), engine(2));
  edited.score_precision = ScorePrecision::kFp8Mma;
  expect_error([&] { check_resolved_config(edited); }, {"ResolvedConfig.score_precision", "fp8_mma", "fp32"});
  EXPECT_EQ(parse_score_precision("fp8_mma"), ScorePrecision::kFp8Mma);
  expect_error([] { parse_score_precision("tf32"); }, {"indexer_score_precision", "tf32"});
}

TEST(Policy, KRoundingExactOnFp8IsANote) {
  EnvGuard env(nullptr);
  const ResolvedConfig r = resolve_config(cfg(R"({"indexer_kv_dtype": "fp8", "indexer_k_rounding": "exact"})"), engine(2));
  EXPECT_EQ(r.k_rounding, KRounding::kExact);
  EXPECT_TRUE(has_note(r, {"indexer_k_rounding"}));
}

// ---------------------------------------------------------------------------------------------
// INDEXCP_P256_STOCK_DECODE (section 2)

TEST(Policy, P256StockDecodeEnvironment) {
  const AttentionConfig on = cfg(R"({"indexer_cache_sharding": "on", "indexer_kv_dtype": "nvfp4"})");
  {
    EnvGuard env(nullptr);  // default 1
    EXPECT_TRUE(resolve_config(on, engine(2, 256)).p256_stock_decode);
    EXPECT_FALSE(resolve_config(on, engine(2, 128)).p256_stock_decode) << "effective at P256/W2 only";
    EXPECT_FALSE(resolve_config(on, engine(4, 256)).p256_stock_decode) << "effective at P256/W2 only";
    EXPECT_FALSE(resolve_config(cfg(R"({"indexer_kv_dtype": "nvfp4"})"), engine(2, 256)).p256_stock_decode)
        << "no sharding, no shard pages";
  }
  {
    EnvGuard env("1");
    EXPECT_TRUE(resolve_config(on, engine(2, 256)).p256_stock_decode);
  }
  {
    EnvGuard env("0");
    EXPECT_FALSE(resolve_config(on, engine(2, 256)).p256_stock_decode);
    const json j = json::parse(resolve_config(on, engine(2, 256)).to_json());
    EXPECT_EQ(j["p256_stock_decode"], false);
  }
  for (const char* bad : {"yes", "2", "true", " 1", "", "01"}) {
    EnvGuard env(bad);
    expect_error([&] { resolve_config(on, engine(2, 256)); }, {"INDEXCP_P256_STOCK_DECODE", "0 or 1"},
                 std::string("value '") + bad + "'");
    const std::string w = error_of([&] { resolve_config(on, engine(2, 256)); });
    EXPECT_NE(w.find(std::string("\"") + bad + "\""), std::string::npos) << w;
  }
}

// ---------------------------------------------------------------------------------------------
// The resolved configuration as JSON

TEST(ResolvedConfig, ToJsonHasEveryKey) {
  EnvGuard env(nullptr);
  EngineParams e = engine(2, 256, 4, 8);
  e.speculative_method = "dspark";
  const ResolvedConfig r = resolve_config(
      cfg(R"({"indexer_cache_sharding": "on", "indexer_kv_dtype": "nvfp4", "indexer_k_rounding": "exact",
              "indexer_prefill_cp": "local_score", "indexer_prefill_gather_budget_mib": 32})"),
      e);
  json j;
  ASSERT_NO_THROW(j = json::parse(r.to_json())) << r.to_json();
  ASSERT_TRUE(j.is_object());
  for (const char* k : {"indexer_kv_dtype", "indexer_cache_sharding", "indexer_prefill_cp", "indexer_decode_cp",
                        "indexer_k_rounding", "indexer_prefill_gather_budget_mib", "indexer_score_precision", "notes"})
    EXPECT_TRUE(j.contains(k)) << k << " missing in " << r.to_json();
  EXPECT_EQ(j["indexer_score_precision"], "fp32");
  EXPECT_EQ(j["indexer_kv_dtype"], "nvfp4");
  EXPECT_EQ(j["indexer_cache_sharding"], "on");
  EXPECT_EQ(j["indexer_prefill_cp"], "local_score");
  EXPECT_EQ(j["indexer_decode_cp"], false);
  EXPECT_EQ(j["indexer_k_rounding"], "exact");
  EXPECT_EQ(j["indexer_prefill_gather_budget_mib"], 32);
  EXPECT_TRUE(j["notes"].is_array());
  // engine parameters and derived values the implementation prints
  EXPECT_EQ(j.value("tp", -1), 2);
  EXPECT_EQ(j.value("page_size", -1), 256);
  EXPECT_EQ(j.value("query_len", -1), 8);
  EXPECT_EQ(j.value("shards", -1), 2);
  EXPECT_EQ(j.value("rows_per_rank", -1), 128);
  EXPECT_EQ(j.value("p256_stock_decode", false), true);
  EXPECT_EQ(j.value("prefill_gather_budget_bytes", int64_t{-1}), int64_t{32} << 20);
  EXPECT_EQ(j.value("index_bytes_per_token_per_layer_per_rank", -1), 36);
  EXPECT_EQ(j.value("speculative_method", std::string()), "dspark");
  EXPECT_EQ(r.prefill_gather_budget_bytes, int64_t{32} << 20);
  // notes land in the JSON
  const ResolvedConfig n = resolve_config(cfg(R"({"indexer_cache_sharding": "on", "indexer_kv_dtype": "fp8"})"), engine(1));
  const json jn = json::parse(n.to_json());
  ASSERT_EQ(jn["notes"].size(), n.notes.size());
  EXPECT_GE(n.notes.size(), 1u);
  EXPECT_EQ(jn["indexer_cache_sharding"], "off");
}

// ---------------------------------------------------------------------------------------------
// Memory per token (section 3)

TEST(Capacity, IndexBytesPerToken) {
  EXPECT_EQ(index_bytes_per_token(KvDtype::kNvfp4, 1), 72);
  EXPECT_EQ(index_bytes_per_token(KvDtype::kNvfp4, 2), 36);
  EXPECT_EQ(index_bytes_per_token(KvDtype::kNvfp4, 4), 18);
  EXPECT_EQ(index_bytes_per_token(KvDtype::kNvfp4, 8), 9);
  EXPECT_EQ(index_bytes_per_token(KvDtype::kFp8, 1), 128);
  EXPECT_EQ(index_bytes_per_token(KvDtype::kFp8, 2), 64);
  EXPECT_EQ(index_bytes_per_token(KvDtype::kFp8, 4), 32);
  EXPECT_EQ(index_bytes_per_token(KvDtype::kFp8, 8), 16);
  for (int w : {1, 2, 4, 8}) EXPECT_EQ(index_bytes_per_token(KvDtype::kBf16, w), 256) << "bf16 is never sharded";
  EXPECT_EQ(kv_bytes_per_head_token(KvDtype::kBf16, 128), 256);
  EXPECT_EQ(kv_bytes_per_head_token(KvDtype::kFp8, 128), 128);
  EXPECT_EQ(kv_bytes_per_head_token(KvDtype::kNvfp4, 128), 72);
}

TEST(Capacity, MinimaxM3Builtin) {
  const ModelDesc m = ModelDesc::builtin("minimax-m3");
  EXPECT_EQ(m.layers, 60);
  EXPECT_EQ(m.sparse_layers, 57);
  EXPECT_EQ(m.q_heads, 64);
  EXPECT_EQ(m.kv_heads, 4);
  EXPECT_EQ(m.head_dim, 128);
  EXPECT_EQ(m.index_heads, 4);
  EXPECT_EQ(m.index_dim, 128);
  expect_error([] { ModelDesc::builtin("minimax-m4"); }, {"--model", "minimax-m4", "minimax-m3"});
}

// The planner at the upstream reference point: TP2, P128, NVFP4 KV and index cache.
TEST(Capacity, PlanMinimaxM3Tp2P128Nvfp4) {
  const ModelDesc m = ModelDesc::builtin("minimax-m3");
  // a budget at which sharding-off holds the upstream 5,492,736 tokens
  const int64_t kv = 60LL * 2 * (4 / 2) * 72;  // 17280 B/token: K and V, 2 KV heads per rank
  const int64_t idx_off = 57LL * 72, idx_on = 57LL * 36;
  const int64_t budget = 5492736LL * (kv + idx_off) + 1000;
  const CapacityReport r = plan_capacity(m, budget, KvDtype::kNvfp4, KvDtype::kNvfp4, 2, 128);
  EXPECT_EQ(r.off.kv_bytes_per_token, kv);
  EXPECT_EQ(r.on.kv_bytes_per_token, kv);
  EXPECT_EQ(r.off.index_bytes_per_token, idx_off);
  EXPECT_EQ(r.on.index_bytes_per_token, idx_on);
  EXPECT_FALSE(r.off.sharding);
  EXPECT_TRUE(r.on.sharding);
  // tokens = floor(budget / (kv + index)), rounded down to whole pages
  EXPECT_EQ(r.off.tokens, budget / (kv + idx_off) / 128 * 128);
  EXPECT_EQ(r.on.tokens, budget / (kv + idx_on) / 128 * 128);
  EXPECT_EQ(r.off.tokens, 5492736);
  EXPECT_EQ(r.off.tokens % 128, 0);
  EXPECT_EQ(r.on.tokens % 128, 0);
  EXPECT_GT(r.on.tokens, r.off.tokens);
  const double ref = 6030720.0 / 5492736.0;  // x1.098
  EXPECT_NEAR(r.ratio(), static_cast<double>(r.on.tokens) / r.off.tokens, 1e-12);
  EXPECT_LT(std::fabs(r.ratio() / ref - 1.0), 0.03) << "ratio " << r.ratio() << " vs upstream " << ref;
  // the report prints as JSON
  const json j = json::parse(r.to_json());
  EXPECT_EQ(j["off"]["tokens"], r.off.tokens);
  EXPECT_EQ(j["on"]["tokens"], r.on.tokens);
  // over a range of budgets: page rounding and the formula hold, on >= off
  for (int64_t gib : {1, 7, 40, 100, 180}) {
    for (int P : {128, 256})
      for (int tp : {1, 2, 4, 8}) {
        const int64_t b = gib << 30;
        const CapacityReport c = plan_capacity(m, b, KvDtype::kNvfp4, KvDtype::kNvfp4, tp, P);
        const int64_t kvt = 60LL * 2 * ((4 + tp - 1) / tp) * 72;
        EXPECT_EQ(c.off.tokens, b / (kvt + 57LL * 72) / P * P) << gib << " GiB P" << P << " W" << tp;
        EXPECT_EQ(c.on.tokens, b / (kvt + 57LL * (72 / tp)) / P * P) << gib << " GiB P" << P << " W" << tp;
        EXPECT_EQ(c.off.tokens % P, 0);
        EXPECT_EQ(c.on.tokens % P, 0);
        EXPECT_GE(c.on.tokens, c.off.tokens);
        if (tp == 1) { EXPECT_EQ(c.on.tokens, c.off.tokens) << "sharding is a no-op at W = 1"; }
      }
  }
  // bf16 index cache is never sharded: on == off
  const CapacityReport bf = plan_capacity(m, budget, KvDtype::kFp8, KvDtype::kBf16, 2, 128);
  EXPECT_EQ(bf.on.tokens, bf.off.tokens);
  EXPECT_EQ(bf.on.index_bytes_per_token, 57 * 256);
  // fp8 KV + fp8 index at TP4
  const CapacityReport f8 = plan_capacity(m, budget, KvDtype::kFp8, KvDtype::kFp8, 4, 256);
  EXPECT_EQ(f8.off.kv_bytes_per_token, 60LL * 2 * 1 * 128);
  EXPECT_EQ(f8.on.index_bytes_per_token, 57LL * 32);
  EXPECT_EQ(f8.on.tokens, budget / (60LL * 2 * 128 + 57LL * 32) / 256 * 256);
}

TEST(Capacity, PlannerRefusals) {
  const ModelDesc m;
  expect_error([&] { plan_capacity(m, 0, KvDtype::kNvfp4, KvDtype::kNvfp4, 2, 128); }, {"budget", "0"});
  expect_error([&] { plan_capacity(m, -5, KvDtype::kNvfp4, KvDtype::kNvfp4, 2, 128); }, {"budget", "-5"});
  expect_error([&] { plan_capacity(m, 1 << 30, KvDtype::kNvfp4, KvDtype::kNvfp4, 3, 128); }, {"tp", "3"});
  expect_error([&] { plan_capacity(m, 1 << 30, KvDtype::kNvfp4, KvDtype::kNvfp4, 2, 64); }, {"page_size", "64"});
  // a budget below one page of tokens plans zero tokens (not a negative or partial page)
  const CapacityReport tiny = plan_capacity(m, 1000, KvDtype::kNvfp4, KvDtype::kNvfp4, 2, 128);
  EXPECT_EQ(tiny.off.tokens, 0);
  EXPECT_EQ(tiny.on.tokens, 0);
}

TEST(Capacity, ModelDescFromJson) {
  const std::string good = R"({"name": "tiny", "layers": 4, "sparse_layers": 3, "q_heads": 8, "kv_heads": 2,
                               "head_dim": 64, "index_heads": 2, "index_dim": 128})";
  const ModelDesc m = ModelDesc::from_json(good);
  EXPECT_EQ(m.name, "tiny");
  EXPECT_EQ(m.layers, 4);
  EXPECT_EQ(m.sparse_layers, 3);
  EXPECT_EQ(m.kv_heads, 2);
  EXPECT_EQ(m.head_dim, 64);
  // round trip through to_json
  const ModelDesc b = ModelDesc::from_json(ModelDesc::builtin("minimax-m3").to_json());
  EXPECT_EQ(b.layers, 60);
  EXPECT_EQ(b.sparse_layers, 57);
  EXPECT_EQ(b.kv_heads, 4);
  // capacity with a custom model uses its numbers
  const CapacityReport r = plan_capacity(m, int64_t{1} << 30, KvDtype::kFp8, KvDtype::kNvfp4, 2, 128);
  EXPECT_EQ(r.off.kv_bytes_per_token, 4LL * 2 * 1 * 64);
  EXPECT_EQ(r.on.index_bytes_per_token, 3LL * 36);

  auto with = [&](const std::string& key, const std::string& value) {
    json j = json::parse(good);
    j[key] = json::parse(value);
    return j.dump();
  };
  // unknown key, wrong types, out-of-range values: each names the key
  expect_error([&] { ModelDesc::from_json(with("layer", "60")); }, {"layer"}, "unknown key");
  expect_error([&] { ModelDesc::from_json(with("layers", "\"60\"")); }, {"layers"}, "string");
  expect_error([&] { ModelDesc::from_json(with("kv_heads", "2.5")); }, {"kv_heads"}, "float");
  // a large value is a non-negative integer: the message says what the limit is
  expect_error([&] { ModelDesc::from_json(with("layers", "4000000000")); },
               {"layers = 4000000000", "must be an integer in 0.." + std::to_string(kMaxModelField)}, "too large");
  expect_error([&] { ModelDesc::from_json(with("q_heads", "-1")); }, {"q_heads"}, "negative");
  expect_error([&] { ModelDesc::from_json(with("layers", "0")); }, {"layers", "0"}, "zero layers");
  expect_error([&] { ModelDesc::from_json(with("layers", "5000")); }, {"layers"}, "too many layers");
  expect_error([&] { ModelDesc::from_json(with("sparse_layers", "5")); }, {"sparse_layers", "5"}, "sparse > layers");
  expect_error([&] { ModelDesc::from_json(with("kv_heads", "0")); }, {"kv_heads", "0"}, "no kv heads");
  expect_error([&] { ModelDesc::from_json(with("index_heads", "0")); }, {"index_heads", "0"}, "no index heads");
  expect_error([&] { ModelDesc::from_json(with("head_dim", "100")); }, {"head_dim", "100"}, "head_dim % 16");
  expect_error([&] { ModelDesc::from_json(with("head_dim", "2048")); }, {"head_dim"}, "head_dim too big");
  expect_error([&] { ModelDesc::from_json(with("index_dim", "64")); }, {"index_dim", "64"}, "index_dim");
  expect_error([&] { ModelDesc::from_json(with("name", "5")); }, {"name"}, "name type");
  {
    json j = json::parse(good);
    j.erase("kv_heads");
    expect_error([&] { ModelDesc::from_json(j.dump()); }, {"kv_heads"}, "missing key");
  }
  expect_error([] { ModelDesc::from_json("[]"); }, {"object"}, "array");
  expect_error([] { ModelDesc::from_json("{layers: 1}"); }, {"JSON"}, "not JSON");
}

// Outside JSON is parsed strictly: a repeated key is refused (it cannot silently mean its last
// value), and error messages quote at most a short prefix of a huge value.
TEST(ConfigStrictJson, DuplicateKeysAreRefused) {
  for (const char* text : {R"({"indexer_kv_dtype":"nvfp4","indexer_kv_dtype":"bf16"})",
                           R"({"indexer_decode_cp":true, "indexer_decode_cp":true})"}) {
    try {
      indexcp::AttentionConfig::from_json(text);
      ADD_FAILURE() << "accepted " << text;
    } catch (const indexcp::Error& e) {
      EXPECT_NE(std::string(e.what()).find("appears twice"), std::string::npos) << e.what();
    }
  }
  const std::string model =
      R"({"layers":60,"layers":61,"sparse_layers":57,"q_heads":64,"kv_heads":4,"head_dim":128,"index_heads":4,"index_dim":128})";
  try {
    indexcp::ModelDesc::from_json(model);
    ADD_FAILURE() << "accepted a model with a repeated key";
  } catch (const indexcp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("\"layers\" appears twice"), std::string::npos) << e.what();
  }
}

TEST(ConfigStrictJson, LongValuesAreCutInMessages) {
  const std::string huge(100000, 'x');
  for (const std::string& text : {"{\"indexer_kv_dtype\":\"" + huge + "\"}", "{\"" + huge + "\":1}"}) {
    try {
      indexcp::AttentionConfig::from_json(text);
      ADD_FAILURE() << "accepted";
    } catch (const indexcp::Error& e) {
      EXPECT_LT(std::string(e.what()).size(), 400u);
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
    }
  }
}

// ---- the ranks of a TP group agree on the config and cache size (config.hpp, RankAgreement) ----

namespace {

ResolvedConfig resolved(const std::string& j, int tp = 2, int P = 128) { return resolve_config(cfg(j), engine(tp, P)); }

// Each rank's error message (empty: it returned) from check_rank_agreement over an in-process
// group, one thread per rank. A watchdog aborts the group after 20 s, so that a rank left waiting
// for one that never joined the exchange fails the test ("communicator aborted") instead of
// hanging it.
std::vector<std::string> agree(const std::vector<ResolvedConfig>& cs, const std::vector<int64_t>& pages) {
  const int W = static_cast<int>(cs.size());
  InProcessGroup g(W);
  std::vector<std::string> msg(cs.size());
  std::vector<std::thread> ranks;
  for (int r = 0; r < W; ++r)
    ranks.emplace_back([&, r] {
      msg[static_cast<size_t>(r)] =
          error_of([&] { check_rank_agreement(g.comm(r), cs[static_cast<size_t>(r)], pages[static_cast<size_t>(r)]); });
    });
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::thread watchdog([&] {
    std::unique_lock<std::mutex> lk(mu);
    if (!cv.wait_for(lk, std::chrono::seconds(20), [&] { return done; })) g.abort();
  });
  for (auto& t : ranks) t.join();
  {
    std::lock_guard<std::mutex> lk(mu);
    done = true;
  }
  cv.notify_all();
  watchdog.join();
  return msg;
}

}  // namespace

TEST(RankAgreement, EqualRecordsPassAndEachFieldIsNamedWhenItDiffers) {
  EnvGuard env(nullptr);
  const std::string on = R"({"indexer_kv_dtype": "nvfp4", "indexer_cache_sharding": "on"})";
  const ResolvedConfig base = resolved(on);
  const RankAgreement a = rank_agreement(base, 100);
  std::vector<RankAgreement> all = {a, a};
  EXPECT_NO_THROW(check_rank_agreement_records(all.data(), 2));
  EXPECT_NO_THROW(check_rank_agreement_records(all.data(), 1));
  // settings that have no effect in the configuration are not compared: fp8 without sharding
  // ignores the prefill mode, the gather budget and the K rounding
  const RankAgreement f1 = rank_agreement(resolved(R"({"indexer_kv_dtype": "fp8"})"), 9);
  const RankAgreement f2 = rank_agreement(
      resolved(R"({"indexer_kv_dtype": "fp8", "indexer_prefill_cp": "local_score", "indexer_k_rounding": "exact", "indexer_prefill_gather_budget_mib": 64})"),
      9);
  EXPECT_EQ(0, std::memcmp(&f1, &f2, sizeof(RankAgreement)));
  // and local_score prefill ignores the gather budget
  const RankAgreement l1 = rank_agreement(resolved(R"({"indexer_kv_dtype": "nvfp4", "indexer_cache_sharding": "on", "indexer_prefill_cp": "local_score"})"), 9);
  const RankAgreement l2 = rank_agreement(resolved(R"({"indexer_kv_dtype": "nvfp4", "indexer_cache_sharding": "on", "indexer_prefill_cp": "local_score", "indexer_prefill_gather_budget_mib": 8})"), 9);
  EXPECT_EQ(0, std::memcmp(&l1, &l2, sizeof(RankAgreement)));
  for (int f = RankAgreement::kFieldsUsed; f < RankAgreement::kFields; ++f) EXPECT_EQ(a.v[f], 0) << "field " << f;
  struct Case {
    ResolvedConfig other;
    int64_t pages;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {resolved(on, 4), 100, {"disagree on tp", "rank 0 has 2", "rank 1 has 4"}},
      {resolved(on, 2, 256), 100, {"disagree on page_size", "rank 0 has 128", "rank 1 has 256"}},
      {resolved(R"({"indexer_kv_dtype": "fp8", "indexer_cache_sharding": "on"})"), 100,
       {"indexer_kv_dtype", "rank 0 has nvfp4", "rank 1 has fp8"}},
      {resolved(R"({"indexer_kv_dtype": "nvfp4"})"), 100, {"indexer_cache_sharding (effective)", "rank 0 has on", "rank 1 has off"}},
      {resolved(R"({"indexer_kv_dtype": "nvfp4", "indexer_decode_cp": true})"), 100,
       {"indexer_cache_sharding (effective)"}},  // the first field that differs is named
      {resolved(R"({"indexer_kv_dtype": "nvfp4", "indexer_cache_sharding": "on", "indexer_prefill_cp": "local_score"})"), 100,
       {"indexer_prefill_cp", "rank 0 has gather", "rank 1 has local_score"}},
      {resolved(R"({"indexer_kv_dtype": "nvfp4", "indexer_cache_sharding": "on", "indexer_k_rounding": "exact"})"), 100,
       {"indexer_k_rounding", "rank 0 has e4m3", "rank 1 has exact"}},
      {resolved(R"({"indexer_kv_dtype": "nvfp4", "indexer_cache_sharding": "on", "indexer_prefill_gather_budget_mib": 64})"), 100,
       {"indexer_prefill_gather_budget_mib", "rank 0 has 256", "rank 1 has 64"}},
      {base, 101, {"num_pages", "rank 0 has 100", "rank 1 has 101"}},
      {resolved(R"({"indexer_kv_dtype": "nvfp4", "indexer_cache_sharding": "on", "indexer_score_precision": "fp8_mma"})"), 100,
       {"indexer_score_precision", "rank 0 has fp32", "rank 1 has fp8_mma"}},
  };
  for (const auto& c : cases) {
    const std::string ctx = c.needles[0];
    std::vector<RankAgreement> two = {a, rank_agreement(c.other, c.pages)};
    expect_error([&] { check_rank_agreement_records(two.data(), 2); }, c.needles, ctx);
    // the rank that differs is named wherever it sits
    std::vector<RankAgreement> three = {a, a, rank_agreement(c.other, c.pages)};
    expect_error([&] { check_rank_agreement_records(three.data(), 3); }, {"rank 2 has"}, ctx);
  }
  // decode CP over a replicated cache, against plain replicated decode
  std::vector<RankAgreement> cp = {rank_agreement(resolved(R"({"indexer_kv_dtype": "fp8"})"), 9),
                                   rank_agreement(resolved(R"({"indexer_kv_dtype": "fp8", "indexer_decode_cp": true})"), 9)};
  expect_error([&] { check_rank_agreement_records(cp.data(), 2); }, {"indexer_decode_cp (effective)", "off", "on"});
}

TEST(RankAgreement, RecordsOfAnotherBuildOrOfARefusingRankAndBadArguments) {
  EnvGuard env(nullptr);
  const RankAgreement a = rank_agreement(resolved(R"({"indexer_kv_dtype": "nvfp4"})"), 10);
  RankAgreement other = a;
  other.v[0] += 1;  // another version of the record
  std::vector<RankAgreement> v = {a, other};
  expect_error([&] { check_rank_agreement_records(v.data(), 2); },
               {"rank 1", "version 3 of the agreement record, this build's is 2", "same indexcp on every rank"});
  other.v[0] = 12345;  // not a record of ours
  v = {other, a};
  expect_error([&] { check_rank_agreement_records(v.data(), 2); }, {"rank 0", "no indexcp agreement record"});
  v = {a, a};
  v[1] = RankAgreement{};  // zeros: that rank refused its own inputs
  expect_error([&] { check_rank_agreement_records(v.data(), 2); }, {"rank 1", "refused its own configuration"});
  expect_error([&] { check_rank_agreement_records(v.data(), 0); }, {"world = 0"});
  expect_error([&] { check_rank_agreement_records(nullptr, 2); }, {"null"});
  expect_error([&] { rank_agreement(resolved(R"({"indexer_kv_dtype": "nvfp4"})"), 0); }, {"num_pages = 0"});
  ResolvedConfig edited = resolved(R"({"indexer_kv_dtype": "nvfp4"})");
  edited.shards = 2;  // not what resolve_config gives
  expect_error([&] { rank_agreement(edited, 10); }, {"ResolvedConfig.shards"});
}

// Over a communicator: every rank learns of a disagreement (no rank waits for one that already
// gave up), and a rank that refuses its own inputs names them while the others name that rank.
TEST(RankAgreement, EveryRankOfAGroupIsToldWhatDiffers) {
  EnvGuard env(nullptr);
  const std::string on = R"({"indexer_kv_dtype": "nvfp4", "indexer_cache_sharding": "on"})";
  auto m = agree({resolved(on), resolved(on)}, {50, 50});
  EXPECT_EQ(m[0], "");
  EXPECT_EQ(m[1], "");
  m = agree({resolved(on), resolved(on, 2, 256)}, {50, 50});
  for (int r = 0; r < 2; ++r)
    for (const char* n : {"disagree on page_size", "rank 0 has 128", "rank 1 has 256"})
      EXPECT_NE(m[r].find(n), std::string::npos) << "rank " << r << ": " << m[r];
  m = agree({resolved(on, 4), resolved(on, 4), resolved(on, 4), resolved(on, 4)}, {7, 7, 8, 7});
  for (int r = 0; r < 4; ++r) EXPECT_NE(m[r].find("rank 2 has 8"), std::string::npos) << "rank " << r << ": " << m[r];
  // rank 1 was given tp = 4 on a group of 2: it says so, rank 0 names rank 1
  m = agree({resolved(on), resolved(on, 4)}, {50, 50});
  EXPECT_NE(m[1].find("world size (2) differs from the configuration's tp (4)"), std::string::npos) << m[1];
  EXPECT_NE(m[0].find("rank 1 of the TP group refused its own configuration"), std::string::npos) << m[0];
  m = agree({resolved(on), resolved(on)}, {50, -1});
  EXPECT_NE(m[1].find("num_pages = -1"), std::string::npos) << m[1];
  EXPECT_NE(m[0].find("rank 1 of the TP group refused"), std::string::npos) << m[0];
}
