// Option checks of `indexcp bench` (bench.hpp), backend-neutral: the same refusals with and
// without the CUDA backend.
#include <string>

#include "bench/bench.hpp"
#include "indexcp/error.hpp"

namespace indexcp::bench {
namespace {

std::string s(int v) { return std::to_string(v); }

void check_run(const RunOptions& o) {
  INDEXCP_REQUIRE(o.replays >= 1 && o.replays <= 100000, "--replays = " + s(o.replays) + " is out of range 1..100000");
  INDEXCP_REQUIRE(o.repeats >= 1 && o.repeats <= 4, "--repeats = " + s(o.repeats) + " is out of range 1..4");
}

void check_tp_heads(int tp, int heads) {
  INDEXCP_REQUIRE(tp == 2 || tp == 4 || tp == 8, "--tp = " + s(tp) + " must be 2, 4 or 8");
  INDEXCP_REQUIRE(heads >= 1 && heads <= 64 && (heads % tp == 0 || tp % heads == 0),
                  "--heads = " + s(heads) + " and --tp = " + s(tp) + " must divide one another (heads 1..64)");
}

void check_page(int p, const char* opt) {
  INDEXCP_REQUIRE(p == 128 || p == 256, std::string(opt) + " value " + s(p) + " must be 128 or 256");
}

void check_query_len(int q) { INDEXCP_REQUIRE(q >= 1 && q <= 16, "--query-len = " + s(q) + " is out of range 1..16"); }

void check_dtype(const std::string& d, const char* opt) {
  INDEXCP_REQUIRE(d == "nvfp4" || d == "fp8", std::string(opt) + " value " + d + " is not one of nvfp4, fp8");
}

}  // namespace

void validate(const DecodeOptions& o) {
  check_run(o.run);
  check_dtype(o.kv_dtype, "--kv-dtype");
  INDEXCP_REQUIRE(o.k_rounding == "e4m3" || o.k_rounding == "exact", "--k-rounding = " + o.k_rounding + " is not one of e4m3, exact");
  INDEXCP_REQUIRE(o.score_precision == "fp32" || o.score_precision == "fp8_mma",
                  "--score-precision = " + o.score_precision + " is not one of fp32, fp8_mma");
  INDEXCP_REQUIRE(!(o.score_precision == "fp8_mma" && o.kv_dtype == "nvfp4" && o.k_rounding == "exact"),
                  "--score-precision fp8_mma with --kv-dtype nvfp4 needs --k-rounding e4m3 (the mode multiplies E4M3 keys)");
  check_tp_heads(o.tp, o.heads);
  check_query_len(o.query_len);
  INDEXCP_REQUIRE(!o.requests.empty() && !o.contexts.empty() && !o.pages.empty(), "--requests, --contexts and --pages need values");
  for (int b : o.requests) INDEXCP_REQUIRE(b >= 1 && b <= 4096, "--requests value " + s(b) + " is out of range 1..4096");
  for (int c : o.contexts)
    INDEXCP_REQUIRE(c >= o.query_len && c <= (1 << 22), "--contexts value " + s(c) + " is out of range query_len..4194304");
  for (int p : o.pages) check_page(p, "--pages");
}

void validate(const InsertOptions& o) {
  check_run(o.run);
  INDEXCP_REQUIRE(!o.tokens.empty() && !o.kv_dtypes.empty(), "--tokens and --kv-dtypes need values");
  for (int n : o.tokens) INDEXCP_REQUIRE(n >= 1 && n <= (1 << 24), "--tokens value " + s(n) + " is out of range 1..16777216");
  for (const auto& d : o.kv_dtypes) check_dtype(d, "--kv-dtypes");
  INDEXCP_REQUIRE(o.tp == 2 || o.tp == 4 || o.tp == 8, "--tp = " + s(o.tp) + " must be 2, 4 or 8");
}

void validate(const PrefillOptions& o) {
  check_run(o.run);
  check_page(o.page_size, "--page-size");
  check_tp_heads(o.tp, o.heads);
  INDEXCP_REQUIRE(o.requests >= 1 && o.requests <= 64, "--requests = " + s(o.requests) + " is out of range 1..64");
  INDEXCP_REQUIRE(o.chunk >= 1 && o.chunk <= 65536, "--chunk = " + s(o.chunk) + " is out of range 1..65536");
  INDEXCP_REQUIRE(!o.contexts.empty(), "--contexts needs values");
  for (int c : o.contexts)
    INDEXCP_REQUIRE(c >= o.chunk && c <= (1 << 21), "--contexts value " + s(c) + " must be in --chunk (" + s(o.chunk) + ")..2097152");
  INDEXCP_REQUIRE(o.budget_mib >= 1 && o.budget_mib <= 65536, "--budget-mib = " + s(o.budget_mib) + " is out of range 1..65536");
  INDEXCP_REQUIRE(o.score_precision == "fp32" || o.score_precision == "fp8_mma",
                  "--score-precision = " + o.score_precision + " is not one of fp32, fp8_mma");
  INDEXCP_REQUIRE(o.layers >= 1 && o.layers <= 256, "--layers = " + s(o.layers) + " is out of range 1..256");
}

void validate(const StepOptions& o) {
  check_run(o.run);
  check_page(o.page_size, "--page-size");
  check_tp_heads(o.tp, o.heads);
  check_query_len(o.query_len);
  INDEXCP_REQUIRE(o.layers >= 1 && o.layers <= 256, "--layers = " + s(o.layers) + " is out of range 1..256");
  INDEXCP_REQUIRE(!o.requests.empty(), "--requests needs values");
  for (int b : o.requests) INDEXCP_REQUIRE(b >= 1 && b <= 1024, "--requests value " + s(b) + " is out of range 1..1024");
  INDEXCP_REQUIRE(o.context >= o.query_len && o.context <= (1 << 21),
                  "--context = " + s(o.context) + " is out of range query_len..2097152");
}

}  // namespace indexcp::bench
