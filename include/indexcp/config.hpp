// indexcp: attention config, policy and resolved configuration (spec/config.md sections 1-2).
#pragma once

#include <cstdint>
#include <functional>
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
  ScorePrecision score_precision = ScorePrecision::kFp32;  ///< indexer_score_precision

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
  ScorePrecision score_precision = ScorePrecision::kFp32;  ///< as requested (rule 7 refuses what cannot run)
  int64_t prefill_gather_budget_bytes = 256ll << 20;
  bool p256_stock_decode = false;  ///< INDEXCP_P256_STOCK_DECODE, default 1 (effective at P256/W2 only)
  int64_t index_bytes_per_token_per_layer_per_rank = 128;  ///< config.md section 3
  std::vector<std::string> notes;  ///< no-ops and yields, in words
  /// Every key with its effective value, plus "notes" (pretty-printed JSON).
  std::string to_json() const;
};

/// Applies the policy of spec/config.md section 2. Throws Error (kUnsupported or
/// kInvalidArgument) whose message names the offending key and value and says what is
/// supported. Reads the environment variable INDEXCP_P256_STOCK_DECODE ("0" or "1"). Rule 7:
/// indexer_score_precision "fp8_mma" needs E4M3 keys, so bf16, and nvfp4 with indexer_k_rounding
/// "exact", are refused naming both keys; whether a backend can run the mode is checked when its
/// indexer or plan is made (the resolved config is backend-independent).
ResolvedConfig resolve_config(const AttentionConfig& config, const EngineParams& engine);

/// Throws Error (kInvalidArgument) naming the field unless `c` is what resolve_config gives for
/// c.requested and c.engine (every field but notes; p256_stock_decode, which the environment
/// sets, may only be true at sharding, P256, TP2). The TP indexers check the config they are given
/// with it, so a hand-edited ResolvedConfig cannot describe caches that do not exist.
void check_resolved_config(const ResolvedConfig& c);

/// What the ranks of one TP group must agree on before their first collective: the effective
/// configuration and the cache's page count, as a fixed-size record of 128 bytes (16 int64; every
/// later version of the record keeps this size, so ranks of different builds still exchange the
/// same byte count and the version field tells them apart). The ranks all-gather it once, when a
/// rank's indexer is made (make_cuda_rank_indexer; engines that call the collective functions
/// themselves use check_rank_agreement of tp_group.hpp or cuda.hpp once after forming the
/// group). Two ranks started with different settings (an engine that launches its own processes,
/// one with another --block-size or indexer_kv_dtype) would otherwise merge candidates of
/// different keys, or wait in collectives of different sizes until the communicator's timeout.
/// Per-step calls do not check again (it would cost a collective per step).
/// Fields (kFieldsUsed of them, the rest zero), in order: record version, tp, page_size,
/// indexer_kv_dtype, effective indexer_cache_sharding, effective indexer_decode_cp, then what
/// applies: indexer_prefill_cp (with sharding; else 0), indexer_k_rounding (nvfp4; else 0),
/// indexer_prefill_gather_budget_mib (sharding with gather; else 0), num_pages,
/// indexer_score_precision (record version 2). A setting that
/// has no effect in the rank's configuration is not compared. Never compared: the heads and query
/// length of EngineParams (each batch carries its own), notes, and p256_stock_decode (its two
/// scorers give identical bits).
struct RankAgreement {
  static constexpr int kFields = 16, kFieldsUsed = 11;
  int64_t v[kFields] = {};
};
static_assert(sizeof(RankAgreement) == 128, "RankAgreement: 128 bytes in every version");
/// The record of one rank: `config` as resolve_config gives it (check_resolved_config), and
/// `num_pages` > 0 (else Error naming num_pages).
RankAgreement rank_agreement(const ResolvedConfig& config, int64_t num_pages);
/// all: `world` records, rank p's at all[p] (what an all-gather of each rank's record returns).
/// Returns when they are equal; otherwise throws Error (kInvalidArgument) naming the first field
/// that differs and the two ranks' values, e.g. "the ranks of the TP group disagree on
/// page_size: rank 0 has 128, rank 1 has 256 ...". A record of all zeros (a rank that refused
/// its own inputs) names that rank; a record of another version (another indexcp build) is
/// refused as such. world < 1 or a null `all` is an Error naming it.
void check_rank_agreement_records(const RankAgreement* all, int world);

namespace detail {
/// The exchange behind both check_rank_agreement functions: builds this rank's record (a rank
/// whose own config, cache size or world fails its checks, or that cannot build the record at all,
/// sends a record of zeros, so that the others learn it refused instead of waiting for it, then
/// rethrows its own error), all-gathers the records with `all_gather(send, recv)` (recv: world
/// records) and checks them. A failure inside `all_gather` itself (an allocation or a copy on the
/// device) leaves the other ranks in the collective until the communicator's timeout.
void exchange_rank_agreement(const ResolvedConfig& config, int64_t num_pages, int world,
                             const std::function<void(const RankAgreement* send, RankAgreement* recv)>& all_gather);
}  // namespace detail

/// Index bytes per token per sparse layer per rank (config.md section 3): NVFP4 72/W_shard,
/// FP8 128/W_shard, BF16 256.
int64_t index_bytes_per_token(KvDtype dtype, int32_t shards);

}  // namespace indexcp
