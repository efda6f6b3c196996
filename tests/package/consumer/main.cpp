// A program of another project that uses indexcp through its CMake package (tests/package):
// prints the library version, inserts keys into an NVFP4 index cache on the CPU and checks the
// stored rows against quantize_key_bytes, and checks that a refused insert throws indexcp::Error
// and writes nothing. Exits 0 when every check holds, 1 otherwise (naming the failed check).
#include <cstdio>
#include <cstring>
#include <vector>

#include "indexcp/cache.hpp"
#include "indexcp/error.hpp"
#include "indexcp/layout.hpp"
#include "indexcp/tp_group.hpp"
#include "indexcp/version.hpp"

namespace {

int failures = 0;

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "consumer: FAILED: %s\n", what);
    ++failures;
  }
}

}  // namespace

int main() {
  using namespace indexcp;
  std::printf("indexcp %s (headers %s), CUDA backend %s\n", version(), INDEXCP_VERSION_STRING,
              built_with_cuda() ? "built" : "not built");
  check(std::strcmp(version(), INDEXCP_VERSION_STRING) == 0, "indexcp::version() == INDEXCP_VERSION_STRING");
  check(INDEXCP_VERSION_MAJOR == 0 && INDEXCP_VERSION_MINOR >= 2, "version macros say 0.2 or later");

  const int P = 128;
  const int64_t num_pages = 4;
  const PageLayout layout = make_page_layout(KvDtype::kNvfp4, P, /*shards=*/1);
  check(layout.page_bytes() == P * 72, "an NVFP4 page holds 72 bytes per token");
  IndexCache cache(layout, num_pages, /*num_layers=*/1);
  check(cache.size_bytes() == num_pages * P * 72, "cache size = pages x page bytes");

  // three tokens in pages 0, 1 and 3
  const std::vector<int64_t> slots = {5, 130, 511};
  std::vector<float> keys(slots.size() * 128);
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = static_cast<float>(static_cast<int>(i % 29) - 14) * 0.25f;
  insert_keys(cache, 0, keys.data(), slots.data(), static_cast<int64_t>(slots.size()));
  for (size_t t = 0; t < slots.size(); ++t) {
    const auto want = quantize_key_bytes(KvDtype::kNvfp4, keys.data() + t * 128);
    const auto got = read_row_bytes(cache, 0, slots[t] / P, static_cast<int32_t>(slots[t] % P));
    check(want.size() == 72 && got == want, "a stored row equals quantize_key_bytes of its key");
  }
  const auto untouched = read_row_bytes(cache, 0, 2, 0);
  check(untouched == std::vector<uint8_t>(72, 0), "a row never written stays zero");

  // a slot outside the cache: Error (kInvalidArgument), nothing of the batch written
  const std::vector<int64_t> bad = {7, num_pages * P};
  bool threw = false;
  try {
    insert_keys(cache, 0, keys.data(), bad.data(), 2);
  } catch (const Error& e) {
    threw = e.code() == ErrorCode::kInvalidArgument;
    std::printf("refused as expected: %s\n", e.what());
  }
  check(threw, "a slot out of range throws indexcp::Error (kInvalidArgument)");
  check(read_row_bytes(cache, 0, 0, 7) == std::vector<uint8_t>(72, 0), "a refused batch writes nothing");

  if (failures != 0) {
    std::fprintf(stderr, "consumer: %d check(s) failed\n", failures);
    return 1;
  }
  std::printf("consumer: all checks passed\n");
  return 0;
}
