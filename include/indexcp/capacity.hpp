// indexcp: memory accounting and KV-cache capacity (spec/config.md section 3).
#pragma once

#include <cstdint>
#include <string>

#include "indexcp/formats.hpp"

namespace indexcp {

/// A model description. Built in: "minimax-m3" (60 layers, 57 sparse, 64 query heads, 4 KV
/// heads, head dim 128, 4 index heads, index dim 128).
/// The largest value of any integer field of a model description (the heads' upper limit).
inline constexpr int32_t kMaxModelField = 1000000;

struct ModelDesc {
  std::string name = "minimax-m3";
  int32_t layers = 60;
  int32_t sparse_layers = 57;
  int32_t q_heads = 64;
  int32_t kv_heads = 4;
  int32_t head_dim = 128;
  int32_t index_heads = 4;
  int32_t index_dim = 128;

  /// The built-in description `name`; Error naming --model otherwise (lists the built-ins).
  static ModelDesc builtin(const std::string& name);
  /// Parses a JSON object with exactly the keys above ("name" optional); Error naming the key
  /// for unknown keys, wrong types, integers outside 0..kMaxModelField, and the rules of validate().
  static ModelDesc from_json(const std::string& text);
  /// Throws Error (kInvalidArgument) naming the field unless the description obeys the rules of
  /// from_json (which calls it; plan_capacity calls it too, for a description built in code):
  /// layers 1..4096, 0 <= sparse_layers <= layers, heads 1..1000000, head_dim 16..1024 a
  /// multiple of 16, index_dim 128.
  void validate() const;
  std::string to_json() const;
};

/// Bytes of one KV head of one token (head_dim d): bf16 2d, fp8 d, nvfp4 d/2 + d/16 (128: 256,
/// 128, 72).
int64_t kv_bytes_per_head_token(KvDtype dtype, int32_t head_dim);

/// Capacity of one configuration.
struct CapacityResult {
  bool sharding = false;
  int64_t kv_bytes_per_token = 0;     ///< layers * 2 * kv_heads_per_rank * bytes_per_head_token
  int64_t index_bytes_per_token = 0;  ///< sparse_layers * index_bytes_per_token(dtype, W_shard)
  int64_t tokens = 0;                 ///< floor(budget / (kv + index)), down to whole pages
};

/// Capacity with sharding off and on, and their ratio. kv_heads_per_rank = ceil(kv_heads / W)
/// (KV heads are replicated when W exceeds them; docs/decisions.md).
struct CapacityReport {
  ModelDesc model;
  int64_t budget_bytes = 0;
  KvDtype kv_dtype = KvDtype::kNvfp4;
  KvDtype index_dtype = KvDtype::kNvfp4;
  int32_t tp = 2;
  int32_t page_size = 128;
  CapacityResult off, on;
  double ratio() const { return off.tokens ? static_cast<double>(on.tokens) / off.tokens : 0.0; }
  std::string to_json() const;
};

/// Plans capacity (config.md section 3). Errors name the argument: budget_bytes <= 0, tp not in
/// {1,2,4,8}, page_size not in {128,256}. With a BF16 index cache (never sharded) or W = 1,
/// "on" equals "off".
CapacityReport plan_capacity(const ModelDesc& model, int64_t budget_bytes, KvDtype kv_dtype,
                             KvDtype index_dtype, int32_t tp, int32_t page_size);

}  // namespace indexcp
