// The backend-independent parts of the plans (include/indexcp/plan.hpp): the path a resolved
// config runs, the extents of a prefill chunk, the exchange record's layout and step signature,
// and the step status messages.
#include "indexcp/plan.hpp"

#include <algorithm>
#include <limits>
#include <string>

#include "core/batch.hpp"
#include "indexcp/error.hpp"

namespace indexcp {

DecodePath decode_path(const ResolvedConfig& config) {
  if (config.sharding) return DecodePath::kIcp;
  if (config.decode_cp && config.engine.tp > 1) return DecodePath::kDecodeCp;
  return DecodePath::kReplicated;
}

PrefillPath prefill_path(const ResolvedConfig& config) {
  if (config.sharding && config.prefill_cp == PrefillCp::kGather) return PrefillPath::kGather;
  if (config.sharding) return PrefillPath::kLocalScore;
  return PrefillPath::kReplicated;
}

const char* to_string(DecodePath path) {
  switch (path) {
    case DecodePath::kReplicated: return "replicated";
    case DecodePath::kIcp: return "icp";
    case DecodePath::kDecodeCp: return "decode_cp";
  }
  return "?";
}

const char* to_string(PrefillPath path) {
  switch (path) {
    case PrefillPath::kReplicated: return "replicated";
    case PrefillPath::kGather: return "gather";
    case PrefillPath::kLocalScore: return "local_score";
  }
  return "?";
}

PrefillExtents prefill_extents(const PrefillBatch& host_batch, int32_t page_size) {
  INDEXCP_REQUIRE(page_size == 128 || page_size == 256,
                  "page_size = " + std::to_string(page_size) + " must be 128 or 256");
  // The metadata checks of prefill_rows (query_start, seq_lens, the block table's width and
  // entries), without q: q is neither needed nor read, and the heads do not matter here. The
  // cache's page count is not known: block-table entries are only checked to be >= 0.
  PrefillBatch b = host_batch;
  static const uint8_t no_q = 0;
  if (b.q == nullptr) b.q = &no_q;
  b.heads = 1;
  const auto rows = detail::prefill_rows_metadata(b, std::numeric_limits<int64_t>::max(), page_size);
  PrefillExtents e;
  e.rows = static_cast<int64_t>(rows.size());
  e.max_rows_per_request = 1;
  e.gather_units = 0;
  for (int32_t r = 0; r < b.num_requests; ++r) {
    const int64_t t = static_cast<int64_t>(b.query_start[r + 1]) - b.query_start[r];
    const int32_t s = b.seq_lens[r];
    e.max_rows_per_request = static_cast<int32_t>(std::max<int64_t>(e.max_rows_per_request, t));
    if (t <= 0 || s <= 0) continue;
    // the gather's units of request r: the pages holding its historical blocks 0 .. (s-1)/128 - 1
    const int64_t hist_tokens = static_cast<int64_t>((s - 1) / kBlockTokens) * kBlockTokens;
    e.gather_units += (hist_tokens + page_size - 1) / page_size;
  }
  return e;
}

uint32_t step_signature_hash(const int32_t* values, int64_t n) {
  uint32_t h = 0;
  for (int64_t i = 0; i < n; ++i) h += step_signature_term(i, values[i]);
  return h;
}

ExchangeLayout exchange_layout(int64_t rows, int32_t heads, const SelectionParams& sel) {
  INDEXCP_REQUIRE(rows >= 0, "rows = " + std::to_string(rows) + " must be >= 0");
  INDEXCP_REQUIRE(heads >= 1 && heads <= 64, "heads = " + std::to_string(heads) + " is out of range 1..64");
  sel.validate();
  ExchangeLayout x;
  x.rows = rows;
  x.heads = heads;
  x.ranked = sel.ranked();
  x.candidate_bytes = static_cast<size_t>(rows) * static_cast<size_t>(heads) * static_cast<size_t>(x.ranked) *
                      sizeof(Candidate);
  x.signature_offset = x.candidate_bytes;
  x.record_bytes = x.candidate_bytes + kStepSignatureBytes;
  return x;
}

std::string step_status_message(uint32_t status, const char* call) {
  const std::string c = call ? call : "(call)";
  switch (status) {
    case static_cast<uint32_t>(StepStatus::kOk): return "";
    case static_cast<uint32_t>(StepStatus::kRanksDisagree):
      return c + ": the ranks of the TP group ran different steps (their step signatures differ: "
                 "num_requests, seq_lens, query_start or the plan's shapes); the step's outputs are -1";
    case static_cast<uint32_t>(StepStatus::kGatherUnitsExceeded):
      return c + ": the prefill chunk has more gather units than extents.gather_units; the units "
                 "past it were not gathered and the outputs are -1";
    default:
      return c + ": step status " + std::to_string(status) + " is not a StepStatus (0, 1 or 2)";
  }
}

}  // namespace indexcp
