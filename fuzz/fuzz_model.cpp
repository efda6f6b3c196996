// libFuzzer target: the model-description JSON of the capacity planner (ModelDesc::from_json)
// and plan_capacity. Input: 8 bytes pick (budget, kv dtype, index dtype, tp, page size), the rest
// is the JSON text. Only indexcp::Error may escape; an accepted plan has non-negative tokens.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "indexcp/capacity.hpp"
#include "indexcp/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace indexcp;
  int64_t budget = 100ll << 30;
  KvDtype kv = KvDtype::kNvfp4, ix = KvDtype::kNvfp4;
  int32_t tp = 2, page = 128;
  if (size >= 8) {
    static const KvDtype dts[] = {KvDtype::kNvfp4, KvDtype::kFp8, KvDtype::kBf16, KvDtype::kNvfp4};
    int64_t b = 0;
    std::memcpy(&b, data, 4);  // low 4 bytes: a budget in MiB (signed)
    budget = static_cast<int64_t>(static_cast<int32_t>(b)) << 20;
    kv = dts[data[4] & 3];
    ix = dts[(data[4] >> 2) & 3];
    static const int32_t tps[] = {1, 2, 4, 8, 16, 3, 0, -2};
    tp = tps[data[5] & 7];
    page = (data[6] & 1) ? 256 : ((data[6] & 2) ? 64 : 128);
    if (data[7] & 1) budget = (data[7] & 2) ? INT64_MAX : -1;
    data += 8;
    size -= 8;
  }
  const std::string text(reinterpret_cast<const char*>(data), size);
  ModelDesc m;
  try {
    m = ModelDesc::from_json(text);
  } catch (const Error&) {
    return 0;
  }
  const ModelDesc again = ModelDesc::from_json(m.to_json());
  if (again.to_json() != m.to_json()) std::abort();
  try {
    const CapacityReport r = plan_capacity(m, budget, kv, ix, tp, page);
    if (r.off.tokens < 0 || r.on.tokens < 0) std::abort();
    (void)r.to_json();
  } catch (const Error&) {
  }
  return 0;
}
