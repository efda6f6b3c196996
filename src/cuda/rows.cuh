// The position of a query row in its request's sequence (spec/indexer.md section 2), on the device:
// shared by the selection kernels and the -Inf fill of prefill_scores; and that fill itself, shared
// by its own kernel and the GEMM-shaped scorer's prologue.
#pragma once

#include <cmath>
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

/// prefill_scores' -Inf where no scorer writes (spec/indexer.md section 2), in scores [rows.rows,
/// nh, max_blocks]: blocks olim .. max_blocks - 1 of every (row, head), olim = the row's historical
/// blocks (position / 128; 0 for a request that scores nothing and for rows past
/// query_start[num_requests]); and the historical blocks of block-table entries outside [0,
/// num_pages), which every scorer skips (an unvalidated batch). Shared by `nwarps` warps, this one
/// being warp `w` of them (rows w, w + nwarps, ...; entries likewise, one per lane). No scorer
/// store touches these entries (page sizes are multiples of 128, so a block lies in one page), so
/// the fill may run before or beside the scorer. Prefill rows only (query_start set).
__device__ __forceinline__ void fill_unscored(const RowsView& rows, int32_t nh, int64_t max_blocks,
                                              const int32_t* block_table, int32_t max_pages, int32_t page_size,
                                              int64_t num_pages, float* out, int64_t w, int64_t nwarps) {
  const int lane = threadIdx.x & 31;
  const int32_t qend = rows.query_start[rows.num_requests];
  auto olim_of = [&](int64_t row) -> int64_t {
    const int64_t pos = row < qend ? row_position(rows, row) : -1;
    return pos < 0 ? 0 : (pos >> 7) < max_blocks ? (pos >> 7) : max_blocks;
  };
  for (int64_t row = w; row < rows.rows; row += nwarps) {
    const int64_t olim = olim_of(row);
    for (int32_t h = 0; h < nh; ++h) {
      float* o = out + (row * nh + h) * max_blocks;
      for (int64_t j = olim + lane; j < max_blocks; j += 32) o[j] = -INFINITY;
    }
  }
  // the block-table entries of every request: those past the request's historical blocks (the
  // padding of a fixed max_pages, -1 or anything) cost one comparison; an out-of-range entry inside
  // them (an unvalidated batch) has its block(s) written for the rows that see them
  const int64_t entries = static_cast<int64_t>(rows.num_requests) * max_pages;
  for (int64_t e = w * 32 + lane; e < entries; e += nwarps * 32) {
    const int32_t b = static_cast<int32_t>(e / max_pages), lp = static_cast<int32_t>(e % max_pages);
    const int64_t q0 = rows.query_start[b], q1 = rows.query_start[b + 1], seq = rows.seq_lens[b];
    const int64_t p0 = seq - (q1 - q0);  // the position of the request's first row
    const int64_t first = (static_cast<int64_t>(lp) * page_size) >> 7, last = ((lp + int64_t{1}) * page_size - 1) >> 7;
    if (seq <= 0 || q1 <= q0 || first >= ((seq - 1) >> 7) || first >= max_blocks) continue;  // historical for no row
    const int32_t page = block_table[e];
    if (page >= 0 && page < num_pages) continue;
    // block j is historical for row q0 + i where p0 + i >= (j + 1) * 128
    for (int64_t i = (first + 1) * 128 - p0 > 0 ? (first + 1) * 128 - p0 : 0; q0 + i < q1; ++i) {
      const int64_t row = q0 + i, olim = ((p0 + i) >> 7) < max_blocks ? (p0 + i) >> 7 : max_blocks;
      if (row >= rows.rows) break;
      for (int64_t j = first; j <= last && j < olim; ++j)
        for (int32_t h = 0; h < nh; ++h) out[(row * nh + h) * max_blocks + j] = -INFINITY;
    }
  }
}

}  // namespace indexcp::cuda::detail
