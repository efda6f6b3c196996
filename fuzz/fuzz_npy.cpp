// libFuzzer target: the .npy reader (npy::parse). Any byte string is a file image. Only
// indexcp::Error may escape; an accepted array holds exactly size * itemsize bytes, and
// serialize(parse(x)) parses back to the same array.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "indexcp/error.hpp"
#include "indexcp/npy.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace indexcp;
  const std::vector<uint8_t> file(data, data + size);
  npy::Array a;
  try {
    a = npy::parse(file, "fuzz.npy");
  } catch (const Error&) {
    return 0;
  }
  if (static_cast<int64_t>(a.bytes.size()) != a.size() * static_cast<int64_t>(npy::itemsize(a.dtype))) std::abort();
  (void)npy::shape_string(a.shape);
  const std::vector<uint8_t> out = npy::serialize(a.dtype, a.shape, a.bytes.data());
  const npy::Array b = npy::parse(out, "again.npy");
  if (b.dtype != a.dtype || b.shape != a.shape || b.bytes != a.bytes) std::abort();
  if (a.dtype == npy::Dtype::kFloat16 || a.dtype == npy::Dtype::kFloat32) (void)npy::to_float32(a, "fuzz.npy");
  return 0;
}
