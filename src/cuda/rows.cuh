// The position of a query row in its request's sequence (spec/indexer.md section 2), on the device:
// shared by the selection kernels and the -Inf fill of prefill_scores.
#pragma once

#include <cstdint>

#include "kernels.cuh"

namespace indexcp::cuda::detail {

/// Position of query row `row` (decode: row = b * query_len + i; prefill: the request whose chunk
/// holds the row, by binary search over query_start), -1 (decode) or below 0 where the request
/// scores nothing; its historical blocks are 0 .. position / 128 - 1.
__device__ __forceinline__ int64_t row_position(const RowsView& v, int64_t row) {
  if (v.query_start == nullptr) {
    const int32_t b = static_cast<int32_t>(row / v.query_len);
    const int32_t i = static_cast<int32_t>(row % v.query_len);
    const int32_t s = v.seq_lens[b];
    return s > 0 ? static_cast<int64_t>(s) - v.query_len + i : -1;
  }
  int32_t lo = 0, hi = v.num_requests - 1;  // the request whose chunk holds the row
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) / 2;
    if (v.query_start[mid] <= row) lo = mid;
    else hi = mid - 1;
  }
  const int32_t t = v.query_start[lo + 1] - v.query_start[lo];
  return static_cast<int64_t>(v.seq_lens[lo]) - t + (row - v.query_start[lo]);
}

}  // namespace indexcp::cuda::detail
