// The position of a query row in its request's sequence (spec/indexer.md section 2), on the device:
// shared by the selection kernels and the -Inf fill of prefill_scores; and that fill itself, shared
// by its own kernel and the GEMM-shaped scorer's prologue.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels.cuh"

namespace indexcp::cuda::detail {

/// The request whose prefill chunk holds row `row`: the last b < num_requests with query_start[b]
/// <= row (0 when none), by binary search over query_start[0 .. num_requests).
__device__ __forceinline__ int32_t request_of(const int32_t* query_start, int32_t num_requests, int64_t row) {
  int32_t lo = 0, hi = num_requests - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) / 2;
    if (query_start[mid] <= row) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

/// Position of query row `row` (decode: row = b * query_len + i; prefill: the request whose chunk
/// holds the row, request_of), -1 (decode) or below 0 where the request scores nothing; its
/// historical blocks are 0 .. position / 128 - 1.
__device__ __forceinline__ int64_t row_position(const RowsView& v, int64_t row) {
  if (v.query_start == nullptr) {
    const int32_t b = static_cast<int32_t>(row / v.query_len);
    const int32_t i = static_cast<int32_t>(row % v.query_len);
    const int32_t s = v.seq_lens[b];
    return s > 0 ? static_cast<int64_t>(s) - v.query_len + i : -1;
  }
  const int32_t lo = request_of(v.query_start, v.num_requests, row);
  const int32_t t = v.query_start[lo + 1] - v.query_start[lo];
  return static_cast<int64_t>(v.seq_lens[lo]) - t + (row - v.query_start[lo]);
}

/// prefill_scores' -Inf where no scorer writes (spec/indexer.md section 2), in scores [rows.rows,
/// nh, max_blocks]: (1) blocks olim .. max_blocks - 1 of every (row, head), olim = the row's
/// historical blocks (position / 128, at most max_blocks; 0 where the position is below 0 and for
/// rows outside [query_start[0], query_start[num_requests])); (2) the historical blocks of
/// block-table entries outside [0, num_pages), which every scorer skips (an unvalidated batch).
/// Shared by `nwarps` warps, this one being warp `w` of them: (1) a contiguous range of rows per
/// warp (the request found once, then followed), lanes over the blocks; (2) a warp per request,
/// lanes over the entries of the pages that hold a historical block of its last row (padding past
/// them, -1 or anything, is never read), the (row, head, block) entries of a bad one spread over
/// the warp. No scorer store touches these entries (page sizes are multiples of 128, so a block
/// lies in one page), so the fill may run before or beside the scorer. Prefill rows only
/// (query_start set). Every lane of the warp calls it (warp-uniform loops, ballots).
__device__ __forceinline__ void fill_unscored(const RowsView& rows, int32_t nh, int64_t max_blocks,
                                              const int32_t* block_table, int32_t max_pages, int32_t page_size,
                                              int64_t num_pages, float* out, int64_t w, int64_t nwarps) {
  const int lane = threadIdx.x & 31;
  const int32_t* qs = rows.query_start;
  const int32_t B = rows.num_requests;
  const int64_t qbeg = qs[0], qend = qs[B];
  auto cap = [&](int64_t pos) -> int64_t { return pos < 0 ? 0 : (pos >> 7) < max_blocks ? (pos >> 7) : max_blocks; };
  // (1) rows r0 .. r1 - 1
  const int64_t r0 = rows.rows * w / nwarps, r1 = rows.rows * (w + 1) / nwarps;
  int32_t b = -1;                  // the request of the current row (once a row inside [qbeg, qend) came)
  int64_t q0 = 0, q1 = 0, p0 = 0;  // its rows and the position of its first row
  for (int64_t row = r0; row < r1; ++row) {
    int64_t olim = 0;
    if (row >= qbeg && row < qend) {
      if (b < 0 || row >= q1) {  // the last request whose chunk starts at or before the row (as row_position)
        if (b < 0) b = request_of(qs, B, row);
        while (qs[b + 1] <= row) ++b;  // (stops at B - 1: qs[B] = qend > row)
        q0 = qs[b];
        q1 = qs[b + 1];
        p0 = static_cast<int64_t>(rows.seq_lens[b]) - (q1 - q0);
      }
      olim = cap(p0 + (row - q0));
    }
    for (int32_t h = 0; h < nh; ++h) {
      float* o = out + (row * nh + h) * max_blocks;
      for (int64_t j = olim + lane; j < max_blocks; j += 32) o[j] = -INFINITY;
    }
  }
  // (2) request rb's out-of-range entries among its pages that hold a historical block
  for (int64_t rb = w; rb < B; rb += nwarps) {
    const int64_t a0 = qs[rb], a1 = qs[rb + 1], seq = rows.seq_lens[rb];
    if (seq <= 0 || a1 <= a0) continue;
    const int64_t pa = seq - (a1 - a0);  // the position of the request's first row
    const int64_t hist = (seq - 1) >> 7 < max_blocks ? (seq - 1) >> 7 : max_blocks;  // blocks historical for some row
    const int64_t pages = (hist * 128 + page_size - 1) / page_size < max_pages ? (hist * 128 + page_size - 1) / page_size
                                                                               : max_pages;
    for (int64_t lp0 = 0; lp0 < pages; lp0 += 32) {
      bool bad = false;
      if (lp0 + lane < pages) {
        const int32_t page = block_table[rb * max_pages + lp0 + lane];
        bad = page < 0 || page >= num_pages;
      }
      for (unsigned m = __ballot_sync(0xffffffffu, bad); m != 0u; m &= m - 1u) {
        const int64_t lp = lp0 + __ffs(m) - 1;
        const int64_t first = lp * page_size >> 7;
        const int64_t nb = ((lp + 1) * page_size >> 7) < hist ? ((lp + 1) * page_size >> 7) - first : hist - first;
        // block j is historical for row a0 + i where pa + i >= (j + 1) * 128
        const int64_t i0 = (first + 1) * 128 - pa > 0 ? (first + 1) * 128 - pa : 0;
        const int64_t n = a1 - a0 > i0 ? (a1 - a0 - i0) * nh * nb : 0;  // (row, head, block) triples
        for (int64_t t = lane; t < n; t += 32) {
          const int64_t j = first + t % nb, rh = t / nb, i = i0 + rh / nh, row = a0 + i;
          const int32_t h = static_cast<int32_t>(rh % nh);
          if (row < rows.rows && j < cap(pa + i)) out[(row * nh + h) * max_blocks + j] = -INFINITY;
        }
      }
    }
  }
}

}  // namespace indexcp::cuda::detail
