// `indexcp bench` in a build without the CUDA backend: every benchmark reports kUnsupported.
#include "bench/bench.hpp"
#include "indexcp/error.hpp"

namespace indexcp::bench {
namespace {
[[noreturn]] void unsupported() {
  throw Error(ErrorCode::kUnsupported,
              "this indexcp was built without the CUDA backend; `indexcp bench` needs it (configure with "
              "-DINDEXCP_CUDA=ON on a machine with nvcc)");
}
}  // namespace
bool decode(const DecodeOptions& o) {
  validate(o);
  unsupported();
}
bool insert(const InsertOptions& o) {
  validate(o);
  unsupported();
}
bool prefill(const PrefillOptions& o) {
  validate(o);
  unsupported();
}
bool step(const StepOptions& o) {
  validate(o);
  unsupported();
}
}  // namespace indexcp::bench
