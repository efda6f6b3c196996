// The GEMM-shaped scorer of E4M3 keys in the fp8_mma form (issue "Prefill indexer at tensor-core
// speed"): keys whose stored bytes are already the MMA operand (the prefill gather's FP8 rows, an
// FP8 cache with at least 128 rows per page) go from global memory straight into the wgmma B
// operand, with no expansion and no register staging; NVFP4 keys with E4M3 rounding (R >= 128) are
// expanded into it by the threads instead. Private to score.cu (src/cuda/score.cu has
// the overview).
//
// Shape: 256 threads = two warpgroups; the CTA holds 256 query vectors of its slice, 128 per
// warpgroup, as the A operand in registers (two m64 tiles of raw E4M3 bytes per warpgroup, loaded
// once per request: 32 registers). A stage is one selection block: 128 keys x 128 bytes (16 KiB) in
// the 128-byte-swizzled K-major layout, read by both warpgroups: each multiplies it with two chains
// of 4 wgmma m64n128k32 (one per m64 tile), so a key byte copied from L2 serves 256 query vectors
// (the 128-vector version of session 18 read every key from L2 once per 128 vectors, about 3.3
// TB/s at its speed: bench/NOTES.md v19). The block maximum of a query vector is then a maximum over
// the 128 accumulator columns of its row: 31 fmax in the thread and a reduce-scatter over the quad
// (no per-block maxima held across tiles). The warpgroups take turns at issuing their chains of a
// block (two mbarriers of 128 arrivals each: warpgroup 0 issues block c after warpgroup 1 issued
// block c - 1, warpgroup 1 after warpgroup 0 issued block c), so the tensor cores run one
// warpgroup's chains while the other takes its maxima ("ping-pong" on a shared stage). Neither
// barrier can run two phases ahead of its waiter: each arrival waits for the other's.
//
// The bits are those of every other scorer of the mode (form.hpp, form8_dim): k slot 16 half +
// 4 t4 + i of k-step s8 multiplies dimension 32 t4 + 8 s8 + 4 half + i, with the queries as A and
// the keys as B (score_kernel has them the other way round; the products and their order per
// k-step are the same). So the copy places raw 4-byte piece p = 8 t4 + 2 s8 + half of a key
// (dims 4p .. 4p + 3) at logical 16-byte chunk 2 s8 + half, word t4 of the key's 128-byte row, which
// the swizzle stores at physical chunk (2 s8 + half) ^ (row & 7): one cp.async of 4 bytes per lane,
// lane = p, one instruction per key row, conflict-free (the 32 lanes hit 32 different banks). The
// GPU suite compares these scores with score_kernel's bit for bit (All/GpuFp8MmaForm.*,
// GpuFp8Mma.GemmScorerEqualsTheTileScorer).
//
// Pipeline: one ring of kG8Stages stages shared by the warpgroups, kG8Stages - 2 blocks in flight,
// two mbarriers per stage. Every warp copies 16 rows of a block (warp w: rows 16 w .. 16 w + 15, 4
// bytes per lane per row); every thread arrives on the stage's `full` barrier when its copies land
// (cp.async.mbarrier.arrive.noinc),
// or, for NVFP4 keys (E4M3 rounding, R >= 128), expands half a row into it (gemm8_expand_half),
// fences its stores for the async proxy and arrives;
// thread 0 also writes the stage's block index and arrives once more. A thread waits on `full`,
// fences the copies for the async proxy and issues its warpgroup's chains; once they are done it
// arrives on the stage's `empty` barrier, which a thread waits on before it copies into the stage
// again. The counters (stage, phase) run on over the requests of the CTA.
#pragma once

#include <cub/block/block_scan.cuh>

#include "cuda/common.cuh"
#include "cuda/kernels.cuh"
#include "cuda/score/ptx.cuh"
#include "cuda/score/schedule.cuh"
#include "cuda/score/tiles.cuh"

namespace indexcp::cuda::detail {

// Internal linkage on purpose: this header is part of score.cu's one translation unit.
namespace {

constexpr int kG8Threads = 256;
constexpr int kG8Vectors = 256;  // query vectors per CTA: 128 per warpgroup (NT = 16 each)
#ifndef INDEXCP_SCORE_G8_STAGES
#define INDEXCP_SCORE_G8_STAGES 12
#endif
constexpr int kG8Stages = INDEXCP_SCORE_G8_STAGES;  // the ring
constexpr int kG8Ahead = kG8Stages - 2;              // blocks in flight
static_assert(kG8Stages >= 4, "INDEXCP_SCORE_G8_STAGES: at least 4");
constexpr int kG8StageBytes = kBlockTokens * kHeadDim;  // 16 KiB
constexpr int gemm8_smem_bytes() {
  return 1024 /* alignment of the swizzled stages */ + kG8Stages * kG8StageBytes + (2 * kG8Stages + 2) * 8 /* mbarriers */ +
         kG8Stages * 4 + (kPlanLocal + 2) * 4 + 8 /* alignment of the table */ + 256 * 8 /* the NVFP4 k_hat table */;
}

// 4 bytes global -> shared (cp.async, through L1), the row offsets as immediates of the instruction
template <int DOFF, int SOFF>
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0+%2], [%1+%3], 4;" ::"r"(dst), "l"(src), "n"(DOFF), "n"(SOFF) : "memory");
}
// Rows i = 0..15 of a run: dst[i & 7] holds the lane's swizzled address of row i & 7.
template <int I = 0>
__device__ __forceinline__ void cp_async_run(const uint32_t (&dst)[8], const uint8_t* src) {
  if constexpr (I < 16) {
    cp_async4<(I & 8) * kHeadDim, I * kHeadDim>(dst[I & 7], src);
    cp_async_run<I + 1>(dst, src);
  }
}
// A value every lane of the warp holds, made visibly uniform for ptxas (redux.sync writes a uniform
// register): the loops and branches around the wgmma instructions are then convergent (otherwise
// ptxas serializes the wgmma instructions: C7518).
__device__ __forceinline__ int32_t uniform(int32_t x) { return __reduce_max_sync(0xffffffffu, x); }
// The thread's arrival on a stage's `full` barrier when its cp.async copies so far have landed
// (counted in the barrier's expected count: .noinc).
__device__ __forceinline__ void cp_async_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// The B descriptor of a K-major tile in the 128-byte swizzle (PTX ISA, "Matrix Descriptor
// Format"): start address (the stage, 1024-aligned, plus 32 bytes per k-step), LBO unused (1), SBO
// = 1024 bytes between groups of 8 rows, layout type 1 (128B swizzle) in bits 62-63.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t saddr) {
  return static_cast<uint64_t>((saddr & 0x3FFFFu) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

// The block-table entry of pair s of request b (a page id, or the gather's unit), or -1 past the
// pages the request needs. Read one pair ahead of its use (the refills' `pend`), so that its load
// latency is not waited for in the loop. Uniform over the CTA.
template <bool GATHER>
__device__ __forceinline__ int32_t gemm8_bt(const ScoreArgs& a, const Geo& G, int32_t b, const ReqInfo& ri, int32_t s) {
  const int32_t lp = GATHER ? (s * kBlockTokens) >> G.lgP : s >> (G.lgR - 7);
  if (GATHER ? s >= ri.max_local : lp >= ri.npages_needed) return -1;
  return a.block_table[static_cast<int64_t>(b) * a.max_pages + lp];
}

// The rows of pair s (block-table entry `page`) that warp w (0..7) copies: rows 16 w .. 16 w + 15
// of the block, contiguous in memory (R is a multiple of 16 and a block starts on a multiple of 128
// of its page), from *src; false when the pair is not scored (past the request's historical
// blocks, filtered out, or an invalid page id). Uniform over the CTA.
template <bool GATHER>
__device__ __forceinline__ bool gemm8_rows(const ScoreArgs& a, const Geo& G, const ReqInfo& ri, int32_t s, int32_t page,
                                           int w, int32_t* blk, const uint8_t** src) {
  if (GATHER) {
    if (s >= ri.max_local || page < 0 || page >= a.keys.num_pages) return false;
    *blk = s;
    const int32_t u = ((s * kBlockTokens) & (G.P - 1)) + 16 * w;
    const int32_t owner = u >> G.lgR, row = u & (G.R - 1);  // owner rank and local row of offset u
    *src = a.keys.base + ((static_cast<int64_t>(owner) * a.keys.num_pages + page) * G.R + row) * kHeadDim;
    return true;
  }
  const int32_t lgspp = G.lgR - 7;  // blocks per page on this rank: R / 128 (R >= 128 here)
  const int32_t lp = s >> lgspp;
  if (lp >= ri.npages_needed) return false;
  const int32_t j0 = (s & ((1 << lgspp) - 1)) << 7;
  const int32_t bk = ((lp << G.lgP) + G.rank_off + j0) >> 7;
  if (bk >= ri.max_local) return false;
  if (a.filter_mod > 1 && bk % a.filter_mod != a.filter_res) return false;
  if (page < 0 || page >= a.keys.num_pages) return false;
  *blk = bk;
  *src = a.keys.base + page * G.stride + static_cast<int64_t>(j0 + 16 * w) * G.rowb;
  return true;
}

// NVFP4 (R >= 128): the page of pair s (block-table entry `page`) and the block's first row j0 on
// it, or false (the checks of gemm8_rows). Uniform over the CTA.
__device__ __forceinline__ bool gemm8_page(const ScoreArgs& a, const Geo& G, const ReqInfo& ri, int32_t s, int32_t page,
                                           int32_t* blk, const uint8_t** pg, int32_t* j0) {
  const int32_t lgspp = G.lgR - 7;
  const int32_t lp = s >> lgspp;
  if (lp >= ri.npages_needed) return false;
  *j0 = (s & ((1 << lgspp) - 1)) << 7;
  const int32_t bk = ((lp << G.lgP) + G.rank_off + *j0) >> 7;
  if (bk >= ri.max_local) return false;
  if (a.filter_mod > 1 && bk % a.filter_mod != a.filter_res) return false;
  if (page < 0 || page >= a.keys.num_pages) return false;
  *blk = bk;
  *pg = a.keys.base + page * G.stride;
  return true;
}

// NVFP4 with E4M3 rounding: half h of one key row (8 of its 16 code words, 4 of its 8 scale bytes)
// expanded to its signed E4M3 bytes (form_khat_bytes, the table of the scale; a negative scale flips
// the codes' signs, as fix_negative_scales does for the tile scorer) and stored as swizzled 16-byte
// chunks 4h .. 4h + 3 of its row of the stage. Chunk c holds pieces c, c + 8, c + 16, c + 24 (word
// t4 = piece c + 8 t4 = dims 4c + 32 t4 .. + 3), i.e. the lo (c even) or hi (c odd) bytes of code
// words c / 2 + 4 t4: half h needs words 2h + jj + 4k (jj = 0, 1; k = 0..3), rw[k] = (word 2h + 4k,
// word 2h + 1 + 4k), of scale group h + 2k. A warp's 8 consecutive rows write 8 different chunk
// positions per 16-byte store: no conflict.
__device__ __forceinline__ void gemm8_expand_half(const uint2 (&rw)[4], uint64_t scales, int h, const uint2* lut,
                                                  uint32_t row_addr, uint32_t r7) {
  uint32_t lo[2][4], hi[2][4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t e = static_cast<uint32_t>(scales >> (8 * (h + 2 * k))) & 0xffu;
    const uint2 l = lut[e];
    const uint32_t neg = (0u - (e >> 7)) & 0x88888888u;
    form_khat_bytes(rw[k].x ^ neg, l.x, l.y, &lo[0][k], &hi[0][k]);
    form_khat_bytes(rw[k].y ^ neg, l.x, l.y, &lo[1][k], &hi[1][k]);
  }
#pragma unroll
  for (int c4 = 0; c4 < 4; ++c4) {
    const int jj = c4 >> 1;
    const bool odd = c4 & 1;  // (c = 4h + c4 has the parity of c4)
    const uint32_t dst = row_addr + (((static_cast<uint32_t>(4 * h + c4)) ^ r7) << 4);
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(odd ? hi[jj][0] : lo[jj][0]),
                 "r"(odd ? hi[jj][1] : lo[jj][1]), "r"(odd ? hi[jj][2] : lo[jj][2]), "r"(odd ? hi[jj][3] : lo[jj][3])
                 : "memory");
  }
}

// The epilogue of one block: the maxima over the 128 keys of the thread's four query vectors (rows
// g and g + 8 of its warp's 16 in m64 tiles 0 and 1: values 2 m + r), reduce-scattered over the
// quad so that lane t4 ends with value t4 over all 4 lanes (3 shuffles), and written where the
// block is historical for the vector's row. fmaxf drops NaN as fold_max does, and max is exact,
// so the order of the reduction does not change the result.
__device__ __forceinline__ void gemm8_epilogue(const float (&acc)[2][16][4], int t4, int32_t blk, float* out,
                                               int64_t obase, int32_t olim) {
  float v[4];
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    float m0 = fmaxf(acc[m][0][0], acc[m][0][1]), m1 = fmaxf(acc[m][0][2], acc[m][0][3]);
#pragma unroll
    for (int j = 1; j < 16; ++j) {
      m0 = fmaxf(m0, fmaxf(acc[m][j][0], acc[m][j][1]));
      m1 = fmaxf(m1, fmaxf(acc[m][j][2], acc[m][j][3]));
    }
    v[2 * m] = m0;
    v[2 * m + 1] = m1;
  }
  const bool hi = t4 & 2, lo = t4 & 1;
  const float w0 = fmaxf(hi ? v[2] : v[0], __shfl_xor_sync(0xffffffffu, hi ? v[0] : v[2], 2));
  const float w1 = fmaxf(hi ? v[3] : v[1], __shfl_xor_sync(0xffffffffu, hi ? v[1] : v[3], 2));
  const float x = fmaxf(lo ? w1 : w0, __shfl_xor_sync(0xffffffffu, lo ? w0 : w1, 1));
  if (blk < olim) out[obase + blk] = x;
}

// The pairs of query slice y (256 vectors: rows y * 256 / nh .. (y * 256 + 255) / nh of each
// request) over all requests: the total of that slice's plan (plan_block). For the persistent grid.
template <bool GATHER>
__device__ __forceinline__ int64_t gemm8_slice_pairs(const ScoreArgs& a, int32_t y) {
  const int32_t v0 = y * kG8Vectors;
  const Slice sl{v0, (v0 + kG8Vectors - 1) / a.nh};
  int64_t t = 0;
  for (int32_t b = 0; b < a.rows.num_requests; ++b) t += num_pairs<GATHER>(a, request_info(a, b, sl));
  return t;
}

// NVFP4: the keys are an NVFP4 cache with E4M3 rounding and R >= 128 (not GATHER), expanded by the
// threads into the stage (half a row each) instead of copied.
template <bool GATHER, bool NVFP4>
__global__ void __launch_bounds__(kG8Threads, 1) gemm8_score_kernel(const ScoreArgs a) {
#if INDEXCP_HAVE_WGMMA
  extern __shared__ __align__(128) unsigned char g8_smem[];
  __shared__ typename cub::BlockScan<int32_t, kG8Threads>::TempStorage scan_tmp;
  uint8_t* stages = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(g8_smem) + 1023) & ~uintptr_t{1023});
  uint64_t* full = reinterpret_cast<uint64_t*>(stages + kG8Stages * kG8StageBytes);  // [kG8Stages]
  uint64_t* empty = full + kG8Stages;                                                 // [kG8Stages]
  uint64_t* turn = empty + kG8Stages;  // [2]: warpgroup 0 / 1 has issued its chains of a block
  int32_t* smeta = reinterpret_cast<int32_t*>(turn + 2);  // [kG8Stages]: the block of a stage
  int32_t* splan = smeta + kG8Stages;                     // [kPlanLocal + 2]
  uint2* lut = reinterpret_cast<uint2*>((reinterpret_cast<uintptr_t>(splan + kPlanLocal + 2) + 7) & ~uintptr_t{7});  // [256] (NVFP4)
  if constexpr (NVFP4)
    for (int i = threadIdx.x; i < 256; i += kG8Threads) lut[i] = g_khat_lut[i];
  if (threadIdx.x == 0) {
    for (int i = 0; i < kG8Stages; ++i) {
      mbar_init(&full[i], kG8Threads + 1);  // every thread's copies, and thread 0's block index
      mbar_init(&empty[i], kG8Threads);     // every thread's chains done
    }
    mbar_init(&turn[0], kG8Threads / 2);  // the threads of one warpgroup
    mbar_init(&turn[1], kG8Threads / 2);
    mbar_fence_init();
  }
  __syncthreads();

  const int32_t B = a.rows.num_requests;
  // The work: the pairs of every query slice (256 vectors each, y = 0 .. slices - 1). Either each
  // CTA takes a share of one slice's pairs (grid x = CTAs per slice, y = slices), or, persistent
  // (a.g8_slices > 0, grid y = 1: gemm8_persistent), an equal share of all slices' pairs in slice
  // order, slice by slice ("segments"), so that every multiprocessor gets the same work whatever
  // the slices' sizes (a prefill chunk's later rows see more blocks) and fills its ring once per
  // segment rather than once per CTA of a wave.
  const int32_t nslices = a.g8_slices;
  const bool persist = nslices > 0;
  int32_t y = blockIdx.y;   // the segment's slice
  int64_t lo = 0, hi = 0;   // persistent: this CTA's share of all slices' pairs
  int64_t pre = 0;          // persistent: the pairs of slices before y
  if (persist) {
    __shared__ int64_t s_first[2];  // the first slice of the share and the pairs before it
    using Scan64 = cub::BlockScan<int64_t, kG8Threads>;
    __shared__ typename Scan64::TempStorage scan64;
    int64_t W = 0;
    for (int32_t y0 = 0; y0 < nslices; y0 += kG8Threads) {
      const int32_t yy = y0 + static_cast<int32_t>(threadIdx.x);
      const int64_t t = yy < nslices ? gemm8_slice_pairs<GATHER>(a, yy) : 0;
      int64_t incl, tot;
      Scan64(scan64).InclusiveSum(t, incl, tot);
      W += tot;
      __syncthreads();  // scan64 is reused
    }
    lo = W * blockIdx.x / gridDim.x;
    hi = W * (blockIdx.x + 1) / gridDim.x;
    if (lo >= hi) return;
    int64_t carry = 0;
    for (int32_t y0 = 0; y0 < nslices; y0 += kG8Threads) {
      const int32_t yy = y0 + static_cast<int32_t>(threadIdx.x);
      const int64_t t = yy < nslices ? gemm8_slice_pairs<GATHER>(a, yy) : 0;
      int64_t excl, tot;
      Scan64(scan64).ExclusiveSum(t, excl, tot);
      if (t > 0 && carry + excl <= lo && lo < carry + excl + t) {  // the one slice holding pair lo
        s_first[0] = yy;
        s_first[1] = carry + excl;
      }
      carry += tot;
      __syncthreads();  // scan64 is reused; s_first is written
      if (carry > lo) break;
    }
    y = static_cast<int32_t>(s_first[0]);
    pre = s_first[1];
  }

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int wg = warp >> 2, wq = warp & 3;
  const Geo G(a.keys);
  // this lane's 4-byte piece p = lane of a key row: logical chunk p & 7, word p >> 3 (see the top),
  // stored in row r at r * 128 + (((p & 7) ^ (r & 7)) << 4) + 4 (p >> 3); warp w copies rows 16 w ..
  uint32_t lane_off[8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
    lane_off[i] = static_cast<uint32_t>((16 * warp + i) * kHeadDim) +
                  ((static_cast<uint32_t>(lane & 7) ^ static_cast<uint32_t>(i)) << 4) + (static_cast<uint32_t>(lane >> 3) << 2);
  const bool q_aligned = (reinterpret_cast<uintptr_t>(a.q) & 3u) == 0;
  const uint32_t ring0 = smem_u32(stages);
  // the cursors, over the requests: the next stage to fill and its phase, the next to multiply
  int32_t ist = 0, cst = 0;
  uint32_t iph = 0, cph = 0;
  uint32_t chains = 0;  // blocks this warpgroup has issued its chains of (the turn barriers' phases)

  for (;;) {  // the segments: one (non-persistent), or the slices of the share
    const int32_t n0 = y * kG8Vectors;
    const Slice sl = a.plan_local ? Slice{n0, (n0 + kG8Vectors - 1) / a.nh} : Slice{};
    const int32_t* plan = a.plan;
    if (a.plan_local) {
      __syncthreads();  // the previous segment's reads of splan are done
      plan_block<GATHER, kG8Threads>(a, sl, splan, scan_tmp);
      plan = splan;
    }
    const int64_t total = plan[B];
    int64_t p0, p1;
    if (persist) {
      p0 = lo > pre ? lo - pre : 0;
      p1 = hi - pre < total ? hi - pre : total;
    } else {
      p0 = total * blockIdx.x / gridDim.x;
      p1 = total * (blockIdx.x + 1) / gridDim.x;
    }
    int32_t b_first = 0;
    {
      int32_t blo = 0, bhi = B - 1;  // largest b with plan[b] <= p0
      while (blo < bhi) {
        const int32_t mid = (blo + bhi + 1) >> 1;
        if (plan[mid] <= p0) blo = mid;
        else bhi = mid - 1;
      }
      b_first = uniform(blo);
    }
    if (p0 >= p1) b_first = B;  // nothing of this slice
    for (int32_t b = b_first; b < B && uniform(plan[b] < p1); ++b) {
      const int64_t lo = plan[b] > p0 ? plan[b] : p0, hi = plan[b + 1] < p1 ? plan[b + 1] : p1;
      const int32_t s0 = uniform(static_cast<int32_t>(lo - plan[b])), s1 = uniform(static_cast<int32_t>(hi - plan[b]));
      if (s0 >= s1) continue;
      const ReqInfo ri = request_info(a, b, sl);
      const int32_t nvec = ri.cnt * a.nh;
      if (!uniform(n0 < nvec)) continue;  // a slice past the request's vectors scores nothing
      // A: query vectors v(m, r) = n0 + 128 wg + 64 m + 16 wq + g + 8 r (rows g, g + 8 of this warp's
      // 16 in m64 tile m), raw E4M3 words of form8_dim: k-step s8 takes dims 32 t4 + 8 s8 + 0..3 (a0
      // row g, a1 row g + 8) and + 4..7 (a2, a3)
      const int32_t nw = n0 + 128 * wg;  // this warpgroup's first vector
      uint32_t qa[2][4][4];
  #pragma unroll
      for (int m = 0; m < 2; ++m)
  #pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int32_t v = nw + 64 * m + 16 * wq + g + 8 * r;
          const uint8_t* qv = nullptr;
          if (v < nvec) {
            const int32_t i = v / a.nh, hh = v % a.nh;
            qv = a.q + ((static_cast<int64_t>(ri.row0) + i) * a.heads + a.h0 + hh) * kHeadDim + 32 * t4;
          }
  #pragma unroll
          for (int s8 = 0; s8 < 4; ++s8)
  #pragma unroll
            for (int half = 0; half < 2; ++half) {
              uint32_t w = 0u;  // (= +0.0 in E4M3) for vectors past nvec
              if (qv != nullptr) {
                const uint8_t* p = qv + 8 * s8 + 4 * half;
                w = q_aligned ? *reinterpret_cast<const uint32_t*>(p)
                              : static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
                                    static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
              }
              qa[m][s8][2 * half + r] = w;
            }
        }
      // the score this lane writes: value t4 of the epilogue, vector v(t4 >> 1, t4 & 1)
      int64_t obase = 0;
      int32_t olim = 0;
      {
        const int32_t v = nw + 64 * (t4 >> 1) + 16 * wq + g + 8 * (t4 & 1);
        if (v < nvec) {
          const int32_t i = v / a.nh, hh = v % a.nh;
          olim = (ri.seq - ri.cnt + i) >> 7;  // historical blocks of this row (spec/indexer.md section 2)
          obase = ((static_cast<int64_t>(ri.row0) + i) * a.nh + hh) * a.max_blocks;
        }
      }

      // the request's blocks: pairs s0 .. s1 - 1, each copied by all 8 warps and multiplied by both
      // warpgroups
      int32_t next = s0;  // the next pair to look at
      int32_t pend = gemm8_bt<GATHER>(a, G, b, ri, next);  // its block-table entry
      int head = 0;       // blocks of this request issued
      // the next scored pair into stage ist, once both warpgroups are done with it: copied (FP8 keys)
      auto next_stage = [&]() {
        mbar_wait(&empty[ist], iph ^ 1u);  // (a fresh barrier: the phase before it counts as done)
        return ring0 + static_cast<uint32_t>(ist * kG8StageBytes);
      };
      auto published = [&](int32_t blk) {  // the stage's block index; the cursor moves on
        if (threadIdx.x == 0) {
          smeta[ist] = blk;
          mbar_arrive(&full[ist]);
        }
        if (++ist == kG8Stages) {
          ist = 0;
          iph ^= 1u;
        }
        ++head;
      };
      // NVFP4: or expanded from the raw codes and scales of this thread's half row (row tid & 127,
      // half wg) in registers, loaded one pair ahead of the expansion (load_next)
      const int xrow = threadIdx.x & 127;
      uint2 rw[4];
      uint64_t rsc = 0;
      int32_t raw_blk = -1;
      auto load_next = [&]() {
        raw_blk = -1;
        while (next < s1) {
          const int32_t s = next, page = pend;
          ++next;
          pend = next < s1 ? gemm8_bt<GATHER>(a, G, b, ri, next) : -1;
          int32_t blk, j0;
          const uint8_t* pgp;
          if (!gemm8_page(a, G, ri, s, page, &blk, &pgp, &j0)) continue;
          const uint8_t* rowp = pgp + static_cast<int64_t>(j0 + xrow) * kNvfp4DataBytesPerKey + 8 * wg;
  #pragma unroll
          for (int k = 0; k < 4; ++k) rw[k] = *reinterpret_cast<const uint2*>(rowp + 16 * k);
          rsc = *reinterpret_cast<const uint64_t*>(pgp + G.scale0 + static_cast<int64_t>(j0 + xrow) * kNvfp4ScalesPerKey);
          raw_blk = blk;
          return;
        }
      };
      auto issue = [&]() {
        if constexpr (NVFP4) {
          if (!uniform(raw_blk >= 0)) return;
          const uint32_t base = next_stage();
          gemm8_expand_half(rw, rsc, wg, lut, base + static_cast<uint32_t>(xrow * kHeadDim), static_cast<uint32_t>(xrow & 7));
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the stores, for wgmma (async proxy)
          mbar_arrive(&full[ist]);
          published(raw_blk);
          load_next();
        } else {
          while (next < s1) {
            const int32_t s = next, page = pend;
            ++next;
            pend = next < s1 ? gemm8_bt<GATHER>(a, G, b, ri, next) : -1;  // used by the next refill
            int32_t blk;
            const uint8_t* src;
            if (!gemm8_rows<GATHER>(a, G, ri, s, page, warp, &blk, &src)) continue;
            const uint32_t base = next_stage();
            uint32_t dst[8];
  #pragma unroll
            for (int i = 0; i < 8; ++i) dst[i] = base + lane_off[i];
            cp_async_run(dst, src + 4 * lane);
            cp_async_arrive(&full[ist]);
            published(blk);
            return;
          }
        }
      };
      if constexpr (NVFP4) load_next();
  #pragma unroll 1
      for (int i = 0; i < kG8Ahead; ++i) issue();
      float acc[2][16][4];
  #pragma unroll 1
      for (int t = 0; t < uniform(head); ++t) {
        mbar_wait(&full[cst], cph);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the copies, for wgmma (async proxy)
        const int32_t blk = smeta[cst];
        const uint32_t sa = ring0 + static_cast<uint32_t>(cst * kG8StageBytes);
        if (wg == 0 && chains > 0) mbar_wait(&turn[1], (chains - 1) & 1u);  // warpgroup 1 issued block c - 1
        if (wg == 1) mbar_wait(&turn[0], chains & 1u);                     // warpgroup 0 issued block c
        wg_fence();
  #pragma unroll
        for (int m = 0; m < 2; ++m)
  #pragma unroll
          for (int s8 = 0; s8 < 4; ++s8) wgmma8_tile<16>(acc[m], qa[m][s8], sw128_desc(sa + 32 * s8), s8 > 0);
        wg_commit();
        mbar_arrive(&turn[wg]);
        ++chains;
        issue();  // the refill (a block-table load, then the copies or the expansion) while the chains run
        wg_wait0();
        fence_acc<16>(acc[0]);
        fence_acc<16>(acc[1]);
        mbar_arrive(&empty[cst]);
        if (++cst == kG8Stages) {
          cst = 0;
          cph ^= 1u;
        }
        gemm8_epilogue(acc, t4, blk, a.scores, obase, olim);
      }
    }
    if (!persist) break;
    pre += total;
    ++y;
    if (!uniform(pre < hi && y < nslices)) break;
  }
#else
  __trap();  // no wgmma in this code: the launcher never picks this kernel then (gemm8_enabled)
#endif
}

}  // namespace
}  // namespace indexcp::cuda::detail
