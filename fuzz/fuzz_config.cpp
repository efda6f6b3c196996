// libFuzzer target: the attention-config JSON (AttentionConfig::from_json) and the policy
// (resolve_config). Input: the first 6 bytes pick the engine parameters (tp, page_size, heads,
// query_len, kv_connector, speculative method), the rest is the JSON text.
// Contract checked: only indexcp::Error escapes; an accepted config round-trips through to_json.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "indexcp/config.hpp"
#include "indexcp/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace indexcp;
  EngineParams ep;
  if (size >= 6) {
    static const int32_t tps[] = {1, 2, 4, 8, 16, 3, 0, -1};
    static const int32_t pages[] = {128, 256, 64, 512, 0, -128, 129, 1 << 30};
    static const int32_t heads[] = {4, 1, 2, 8, 16, 64, 3, 0};
    ep.tp = tps[data[0] & 7];
    ep.page_size = pages[data[1] & 7];
    ep.heads = heads[data[2] & 7];
    ep.query_len = static_cast<int8_t>(data[3]);
    ep.kv_connector = data[4] & 1;
    ep.speculative_method = (data[5] & 1) ? "dspark" : "";
    data += 6;
    size -= 6;
  }
  const std::string text(reinterpret_cast<const char*>(data), size);
  AttentionConfig cfg;
  try {
    cfg = AttentionConfig::from_json(text);
  } catch (const Error&) {
    return 0;
  }
  // an accepted config must parse back from its own serialization to the same serialization
  const std::string j1 = cfg.to_json();
  const AttentionConfig again = AttentionConfig::from_json(j1);
  if (again.to_json() != j1) std::abort();
  try {
    const ResolvedConfig rc = resolve_config(cfg, ep);
    (void)rc.to_json();
    if (rc.shards < 1 || rc.index_bytes_per_token_per_layer_per_rank <= 0) std::abort();
  } catch (const Error&) {
  }
  return 0;
}
