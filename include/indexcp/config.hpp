// indexcp: attention config, policy and resolved configuration (spec/config.md sections 1-2).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "indexcp/formats.hpp"

namespace indexcp {

/// Prefill mode under sharding (config key `indexer_prefill_cp`, indexer.md section 5).
enum class PrefillCp : int { kGather = 0, kLocalScore = 1 };
std::string to_string(PrefillCp p);

/// The largest indexer_prefill_gather_budget_mib (1 TiB per rank); the smallest is 1.
inline constexpr int64_t kMaxGatherBudgetMib = 1048576;

/// The engine's attention config as given (spec/config.md section 1); defaults as the spec says.
struct AttentionConfig {
  KvDtype kv_dtype = KvDtype::kFp8;            ///< indexer_kv_dtype
  bool cache_sharding = false;                 ///< indexer_cache_sharding "on"/"off"
  PrefillCp prefill_cp = PrefillCp::kGather;   ///< indexer_prefill_cp
  bool decode_cp = false;                      ///< indexer_decode_cp
  KRounding k_rounding = KRounding::kE4m3;     ///< indexer_k_rounding
  int64_t prefill_gather_budget_mib = 256;     ///< indexer_prefill_gather_budget_mib, 1..kMaxGatherBudgetMib

  /// Parses a JSON object. Errors (Error, kInvalidArgument) name the key and value: not an
  /// object, unknown key, wrong type, value not among those listed (the message lists them),
  /// budget <= 0 or above 1 TiB.
  static AttentionConfig from_json(const std::string& text);
  /// The config as a JSON object string (every key).
  std::string to_json() const;
};

/// Engine parameters that the policy reads (spec/config.md section 1).
struct EngineParams {
  int32_t tp = 1;                  ///< W: tensor-parallel size (1, 2, 4, 8)
  int32_t page_size = 128;         ///< P: tokens per page (engines' --block-size), 128 or 256
  int32_t heads = 4;               ///< H: index heads; H and W must divide one another
  int32_t query_len = 1;           ///< Q: decode query length, 1..16
  std::string speculative_method;  ///< informational ("" = none), e.g. "dspark"
  bool kv_connector = false;       ///< a KV connector / CPU offload is configured
};

/// The configuration as resolved by the policy (spec/config.md section 2).
struct ResolvedConfig {
  AttentionConfig requested;
  EngineParams engine;
  KvDtype kv_dtype = KvDtype::kFp8;
  bool sharding = false;           ///< effective: the cache is sharded over W ranks
  int32_t shards = 1;              ///< W_shard: W with sharding, else 1
  PrefillCp prefill_cp = PrefillCp::kGather;
  bool decode_cp = false;          ///< effective decode CP over a replicated cache
  KRounding k_rounding = KRounding::kE4m3;
  int64_t prefill_gather_budget_bytes = 256ll << 20;
  bool p256_stock_decode = false;  ///< INDEXCP_P256_STOCK_DECODE, default 1 (effective at P256/W2 only)
  int64_t index_bytes_per_token_per_layer_per_rank = 128;  ///< config.md section 3
  std::vector<std::string> notes;  ///< no-ops and yields, in words
  /// Every key with its effective value, plus "notes" (pretty-printed JSON).
  std::string to_json() const;
};

/// Applies the policy of spec/config.md section 2. Throws Error (kUnsupported or
/// kInvalidArgument) whose message names the offending key and value and says what is
/// supported. Reads the environment variable INDEXCP_P256_STOCK_DECODE ("0" or "1").
ResolvedConfig resolve_config(const AttentionConfig& config, const EngineParams& engine);

/// Throws Error (kInvalidArgument) naming the field unless `c` is what resolve_config gives for
/// c.requested and c.engine (every field but notes; p256_stock_decode, which the environment
/// sets, may only be true at sharding, P256, TP2). The TP indexers check the config they are given
/// with it, so a hand-edited ResolvedConfig cannot describe caches that do not exist.
void check_resolved_config(const ResolvedConfig& c);

/// Index bytes per token per sparse layer per rank (config.md section 3): NVFP4 72/W_shard,
/// FP8 128/W_shard, BF16 256.
int64_t index_bytes_per_token(KvDtype dtype, int32_t shards);

}  // namespace indexcp
