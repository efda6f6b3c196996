// The scorer's schedule (spec/indexer.md sections 2-3): its launch arguments, the work of a request
// (pairs of 64-row half-stages over the request's historical blocks), the chunks of a half-stage,
// and the plan (prefix sums of work items per request) computed per CTA or by plan_kernel.
// Private to score.cu (src/cuda/score.cu has the overview).
#pragma once

#include <cub/block/block_scan.cuh>

#include "cuda/common.cuh"
#include "cuda/kernels.cuh"

namespace indexcp::cuda::detail {

// Internal linkage on purpose: this header is part of score.cu's one translation unit.
namespace {

constexpr int kBuf = 2;         // half-stage buffers per warp
constexpr int kHalfRows = 64;   // rows per half-stage; a work item ("pair") is 2 halves
constexpr int kPlanLocal = 2048;  // requests up to which each CTA computes the plan itself
constexpr int kPlanHalf = (kPlanLocal + 2) / 2;  // gemm8: a second plan at table + kPlanHalf (requests + 1 <= kPlanHalf)
constexpr int kModeE4m3 = 0, kModeExact = 1, kModeFp8 = 2;
// Warps per CTA and CTAs per multiprocessor (experiment knobs, bench/NOTES.md "Knobs"; a multiple
// of 4 warps, for the wgmma warpgroups). FP8 keeps 8 warps and a cap of 2 CTAs (its stage rings
// are twice the size; it runs 1 CTA per multiprocessor by shared memory)
#ifndef INDEXCP_SCORE_WARPS
#define INDEXCP_SCORE_WARPS 8
#endif
#ifndef INDEXCP_SCORE_MINB
#define INDEXCP_SCORE_MINB 2
#endif
template <int MODE>
constexpr int warps_of() { return MODE == kModeFp8 ? 8 : INDEXCP_SCORE_WARPS; }
static_assert(INDEXCP_SCORE_WARPS % 4 == 0 && INDEXCP_SCORE_WARPS > 0, "INDEXCP_SCORE_WARPS: whole warpgroups");
// NT = 8 and 16 (64 and 128 query vectors per CTA, the prefill) hold 32 and 64 fp32 accumulators
// and 16 and 32 block maxima per thread: one CTA per multiprocessor, up to 255 registers.
constexpr int kMaxNt = 16;
// INDEXCP_SCORE_WIDE_MINB: CTAs per multiprocessor at NT = 8 (an experiment knob, bench/NOTES.md
// "Knobs"; 2 caps the registers at 128 per thread)
#ifndef INDEXCP_SCORE_WIDE_MINB
#define INDEXCP_SCORE_WIDE_MINB 1
#endif
template <int MODE, int NT>
constexpr int minb_of() {
  return NT >= 16 ? 1 : NT == 8 ? INDEXCP_SCORE_WIDE_MINB : MODE == kModeFp8 ? 2 : INDEXCP_SCORE_MINB;
}

struct ScoreArgs {
  KeySource keys;
  RowsView rows;
  const int32_t* block_table;
  int32_t max_pages;
  const uint8_t* q;
  int32_t heads, h0, nh;
  int32_t filter_mod, filter_res;
  float* scores;
  int64_t max_blocks;
  const int32_t* plan;  // [num_requests + 1] prefix sums of work items (pairs), from plan_kernel
  int32_t plan_local;   // 1: every CTA computes the plan into its shared memory (num_requests <=
                        // kPlanLocal), and plan_kernel is not launched
  int32_t debug;        // benchmarking aid (INDEXCP_SCORE_DEBUG): 1 = no arithmetic, 2 = no loads (gemm8_score_kernel,
                        // built with INDEXCP_SCORE_G8_DEBUG=1: no key loads or expansion where keys pass through
                        // the threads), 4 = no block maxima (gemm8)
  uint64_t wg_desc_bits;  // the fixed fields of the wgmma B descriptor (wg_desc_fixed_bits())
  int32_t g8_slices;      // gemm8_score_kernel: > 0, the query slices of its persistent grid; 0: grid y = slices
  int32_t fill_unscored;  // gemm8_score_kernel: 1 = the -Inf of ScoreLaunch::fill_unscored in its prologue
  int32_t g8_plan_ahead;  // gemm8_score_kernel, persistent producer form: 1 = a share's second segment planned in
                          // the prologue (batches of up to 1,024 requests: kPlanHalf)
};

struct ReqInfo {
  int32_t seq, row0, cnt;
  int32_t max_local;      // blocks b < max_local may be historical for some row of the slice
  int32_t npages_needed;  // logical pages holding those blocks
};

// The query slice of a CTA (blockIdx.y): its query vectors v0 .. v0 + 8 NT - 1 of every request
// (vector n = row * nh + head), so rows v0 / nh .. row_last. A row needs only its historical
// blocks (spec/indexer.md section 2), so the slice's work ends at the blocks of its last row: a
// prefill chunk's first slices skip the blocks only its later rows see (at 32K context and an
// 8,192-row chunk about an eighth of the work). Slice{} (no cap) is the whole request: the plan
// in global memory (plan_kernel) is shared by every slice and uses it.
struct Slice {
  int32_t v0 = 0, row_last = INT32_MAX;
};

__device__ __forceinline__ ReqInfo request_info(const ScoreArgs& a, int32_t b, const Slice& sl) {
  ReqInfo r;
  r.seq = a.rows.seq_lens[b];
  if (a.rows.query_start != nullptr) {
    r.row0 = a.rows.query_start[b];
    r.cnt = a.rows.query_start[b + 1] - r.row0;
  } else {
    r.row0 = b * a.rows.query_len;
    r.cnt = a.rows.query_len;
  }
  if (r.seq <= 0 || r.cnt <= 0) {
    r.cnt = 0;
    r.max_local = 0;
    r.npages_needed = 0;
    return r;
  }
  const int32_t P = a.keys.layout.page_size;
  if (static_cast<int64_t>(r.cnt) * a.nh <= sl.v0) {  // the slice holds no vector of this request
    r.max_local = 0;
    r.npages_needed = 0;
    return r;
  }
  const int32_t last = r.cnt - 1 < sl.row_last ? r.cnt - 1 : sl.row_last;  // the slice's last row
  int32_t ml = r.seq - r.cnt + last;  // its position; its historical blocks are those below ml / 128
  ml = ml > 0 ? ml / kBlockTokens : 0;  // (seq - 1) / 128 for the request's last row
  const int32_t cap = static_cast<int32_t>(static_cast<int64_t>(a.max_pages) * P / kBlockTokens);
  if (ml > cap) ml = cap;  // never beyond the block table (validated batches never get here)
  r.max_local = ml;
  r.npages_needed = (ml * kBlockTokens + P - 1) / P;
  return r;
}

// Work items ("pairs", 128 rows of one rank: whole blocks or whole rank-parts of blocks).
template <bool GATHER>
__device__ __forceinline__ int32_t num_pairs(const ScoreArgs& a, const ReqInfo& ri) {
  if (GATHER) return ri.max_local;
  const int32_t R = a.keys.layout.rows();
  if (R >= kBlockTokens) return ri.npages_needed * (R / kBlockTokens);
  const int32_t ppp = kBlockTokens / R;
  return (ri.npages_needed + ppp - 1) / ppp;
}

template <bool STOCK, bool GATHER>
__device__ __forceinline__ int chunks_per_half(const ScoreArgs& a) {
  if (STOCK) return 1;
  const int32_t R = a.keys.layout.rows();
  return R >= kHalfRows ? 1 : kHalfRows / R;
}

struct Chunk {
  int32_t block;
  int32_t nrows;
  const uint8_t* data;    // rows of key bytes (NVFP4: 64 per row; FP8: 128 per row)
  const uint8_t* scales;  // NVFP4: 8 per row
};

// The chunk table of a warp (not the gather): the chunks of its next kTab / nch half-stages (nch
// chunks each), computed by the warp's lanes in parallel (lane i: chunk i % nch of the (i / nch)-th
// half-stage from the window's start), so that the copy issue of a half-stage (lane 0) is a table
// read instead of a serial chunk computation with a block-table load (bench/NOTES.md, v9).
constexpr int kTab = 32;
struct ChunkEnt {
  int32_t block;  // -1: not needed
  int32_t pad;
  const uint8_t* data;
  const uint8_t* scales;
};

// Geometry constants of the launch, taken once from the layout's accessors (P and R are powers of
// two): local row j of a page starts at row_data_offset(0) + j * rowb, its scales at
// scale0 + 8j; page offset of local row j on this rank is rank_off + j.
struct Geo {
  int32_t P, R, lgP, lgR, rank_off, rowb;
  int64_t scale0, stride;
  __device__ __forceinline__ explicit Geo(const KeySource& k) {
    const PageLayout& L = k.layout;
    P = L.page_size;
    R = L.rows();
    lgP = __ffs(P) - 1;
    lgR = __ffs(R) - 1;
    rank_off = L.offset_of_local_row(k.rank, 0);
    rowb = static_cast<int32_t>(L.row_data_offset(1));
    scale0 = L.dtype == KvDtype::kNvfp4 ? L.row_scale_offset(0) : 0;
    stride = L.page_offset(1);
  }
};

// Chunk c of half h of pair s of request b; false when it is not needed (past the request, not
// historical for any row, filtered out, or an invalid page id).
template <bool STOCK, bool GATHER>
__device__ __forceinline__ bool half_chunk(const ScoreArgs& a, const Geo& G, int32_t b, const ReqInfo& ri, int32_t s,
                                           int h, int c, Chunk* ch) {
  if (GATHER) {
    const int32_t blk = s;
    if (blk >= ri.max_local) return false;
    const int32_t lp = (blk * kBlockTokens) >> G.lgP;
    const int32_t k = a.block_table[static_cast<int64_t>(b) * a.max_pages + lp];
    if (k < 0 || k >= a.keys.num_pages) return false;
    const int32_t rc = G.R < kHalfRows ? G.R : kHalfRows;
    const int32_t u = ((blk * kBlockTokens) & (G.P - 1)) + h * kHalfRows + c * rc;
    const int32_t src = u >> G.lgR, row = u & (G.R - 1);  // owner rank and local row of offset u
    ch->block = blk;
    ch->nrows = rc;
    ch->data = a.keys.base + ((static_cast<int64_t>(src) * a.keys.num_pages + k) * G.R + row) * kHeadDim;
    ch->scales = nullptr;
    return true;
  }
  int32_t lp, j0, rc;
  if (STOCK || G.R >= kBlockTokens) {
    const int32_t lgspp = G.lgR - 7;  // pairs per page: R / 128
    lp = s >> lgspp;
    j0 = ((s & ((1 << lgspp) - 1)) << 7) + h * kHalfRows;
    rc = kHalfRows;
  } else {
    const int32_t lgppp = 7 - G.lgR;  // pages per pair: 128 / R
    lp = (s << lgppp) + h * (1 << (lgppp - 1)) + c;
    j0 = 0;
    rc = G.R < kHalfRows ? G.R : kHalfRows;
  }
  if (lp >= ri.npages_needed) return false;
  const int32_t blk = ((lp << G.lgP) + G.rank_off + j0) >> 7;
  if (blk >= ri.max_local) return false;
  if (a.filter_mod > 1 && blk % a.filter_mod != a.filter_res) return false;
  const int32_t page = a.block_table[static_cast<int64_t>(b) * a.max_pages + lp];
  if (page < 0 || page >= a.keys.num_pages) return false;
  const uint8_t* pg = a.keys.base + page * G.stride;
  ch->block = blk;
  ch->nrows = rc;
  ch->data = pg + static_cast<int64_t>(j0) * G.rowb;
  ch->scales = pg + G.scale0 + j0 * kNvfp4ScalesPerKey;
  return true;
}

// Prefix sums of work items per request for the slice sl (the plan; graph-safe: reads seq_lens at
// run time): plan[0] = 0, plan[b + 1] = pairs of requests 0..b. THREADS threads of one CTA, all of them
// calling; ends with a barrier, so plan may be shared memory.
template <bool GATHER, int THREADS>
__device__ __forceinline__ void plan_block(const ScoreArgs& a, const Slice& sl, int32_t* plan,
                                           typename cub::BlockScan<int32_t, THREADS>::TempStorage& tmp) {
  int32_t carry = 0;
  for (int32_t base = 0; base < a.rows.num_requests; base += THREADS) {
    const int32_t b = base + static_cast<int32_t>(threadIdx.x);
    const int32_t v = b < a.rows.num_requests ? num_pairs<GATHER>(a, request_info(a, b, sl)) : 0;
    int32_t incl, total;
    cub::BlockScan<int32_t, THREADS>(tmp).InclusiveSum(v, incl, total);
    if (b < a.rows.num_requests) plan[b + 1] = carry + incl;
    carry += total;
    __syncthreads();  // tmp is reused
  }
  if (threadIdx.x == 0) plan[0] = 0;
  __syncthreads();
}

// The plans of two slices at once (plan0 for sl0, plan1 for sl1), in one scan of both counts
// packed in 64 bits (every prefix of either fits 31 bits, as plan_block's int32 entries assume).
// The same calling rules as plan_block.
template <bool GATHER, int THREADS>
__device__ __forceinline__ void plan_block2(const ScoreArgs& a, const Slice& sl0, const Slice& sl1, int32_t* plan0,
                                            int32_t* plan1, typename cub::BlockScan<int64_t, THREADS>::TempStorage& tmp) {
  int64_t carry = 0;
  for (int32_t base = 0; base < a.rows.num_requests; base += THREADS) {
    const int32_t b = base + static_cast<int32_t>(threadIdx.x);
    int64_t v = 0;
    if (b < a.rows.num_requests) {
      const int64_t c0 = num_pairs<GATHER>(a, request_info(a, b, sl0));
      const int64_t c1 = num_pairs<GATHER>(a, request_info(a, b, sl1));
      v = (c0 << 32) + c1;
    }
    int64_t incl, total;
    cub::BlockScan<int64_t, THREADS>(tmp).InclusiveSum(v, incl, total);
    if (b < a.rows.num_requests) {
      const int64_t x = carry + incl;
      plan0[b + 1] = static_cast<int32_t>(x >> 32);
      plan1[b + 1] = static_cast<int32_t>(x & 0xffffffffll);
    }
    carry += total;
    __syncthreads();  // tmp is reused
  }
  if (threadIdx.x == 0) {
    plan0[0] = 0;
    plan1[0] = 0;
  }
  __syncthreads();
}

// The plan in global memory, for batches of more than kPlanLocal requests.
template <bool GATHER>
__global__ void __launch_bounds__(1024) plan_kernel(const ScoreArgs a, int32_t* plan) {
  __shared__ typename cub::BlockScan<int32_t, 1024>::TempStorage tmp;
  plan_block<GATHER, 1024>(a, Slice{}, plan, tmp);
}


}  // namespace
}  // namespace indexcp::cuda::detail
