// The scorer's tiles: NVFP4 / FP8 key expansion to fp16 MMA fragments (the fixed k order of every
// scorer of this backend), the query fragments, one tile's dot products with mma.sync or wgmma and
// the per-block maximum. Private to score.cu
// (src/cuda/score.cu has the overview).
#pragma once

#include <cuda_fp16.h>

#include "cuda/common.cuh"
#include "cuda/kernels.cuh"
#include "cuda/score/form.hpp"
#include "cuda/score/ptx.cuh"
#include "cuda/score/schedule.cuh"

namespace indexcp::cuda::detail {

// Internal linkage on purpose: this header is part of score.cu's one translation unit.
namespace {

// The E4M3 k_hat table (256 scale bytes x 8 magnitudes, the scale's sign in each byte's top bit:
// form_khat_entry, so a negative scale byte needs no path of its own), uploaded by ensure_tables;
// each CTA that needs it copies it into shared memory.
__device__ uint2 g_khat_lut[256];

// ---- key expansion ----------------------------------------------------------------------------
// The k order and the integer code are form.hpp's (the dot-product form, tested on the CPU):
// word j of a thread's row (dims 8j .. 8j + 7 of its 32) feeds k-steps 2j (pairs h[0], h[1]) and
// 2j + 1 (h[2], h[3]); each pair holds dims (d, d + 1).

// NVFP4, E4M3 rounding: fp16 bits of k_hat from the scale's table entry.
__device__ __forceinline__ void expand_e4m3(uint32_t w, uint2 lut, uint32_t (&h)[4]) {
  form_expand_e4m3(w, lut.x, lut.y, h);
}

// NVFP4, exact rounding: fp16 +-|e2m1|, times the scale (exact).
__device__ __forceinline__ void expand_exact(uint32_t w, __half2 sc2, uint32_t (&h)[4]) {
  form_expand_e2m1(w, h, [sc2](uint32_t x) { return h2_bits(__hmul2(bits_h2(x), sc2)); });
}

__device__ __forceinline__ uint32_t q_pair_bytes(uint32_t b0, uint32_t b1) {
  return h2_bits(__floats2half2_rn(e4m3_decode(static_cast<uint8_t>(b0)), e4m3_decode(static_cast<uint8_t>(b1))));  // exact
}

template <int MODE>
constexpr int half_bytes() {
  return MODE == kModeFp8 ? kHalfRows * kHeadDim : kHalfRows * (kNvfp4DataBytesPerKey + kNvfp4ScalesPerKey);
}
template <int MODE, int NT>
constexpr int score_smem_bytes() {
  constexpr int kWarps = warps_of<MODE>();
  return kWarps * kBuf * half_bytes<MODE>() + 256 * 8 + 8 * NT * 32 * 8 + kWarps * 2 * kTab * static_cast<int>(sizeof(ChunkEnt)) +
         kWarps * kBuf * 8 + kWarps * kBuf * 4 * 4 +
         (kPlanLocal + 1) * 4;
}

// B fragments (the query vectors) of k-step s for the mma.sync tiles (NT = 1 in the sm_90a code, and
// NT = 2 on NVFP4 stock pages; every NT in the compute_90 PTX; the wgmma tiles use the wg_b_index layout instead): registers
// (NT <= 2) or shared memory (NT = 4, to stay under 128 registers at 16 warps per multiprocessor). Shared layout: [8 k-steps][NT / NW
// n-tile groups][32 lanes][NW] uint2 with NW = min(NT, 2) n-tiles per group, so a lane reads the
// fragments of two n-tiles with one 16-byte load and a warp's load is contiguous (no bank
// conflicts).
template <int NT>
struct BFrags {
  static constexpr bool kReg = NT <= 2;
  static constexpr int NW = NT < 2 ? NT : 2, NG = NT / NW;
  __host__ __device__ static constexpr int index(int s, int nt, int lane) {
    return ((s * NG + nt / NW) * 32 + lane) * NW + nt % NW;
  }
  uint32_t r[kReg ? 8 : 1][kReg ? NT : 1][2];
  const uint2* smem;
  __device__ __forceinline__ void load(const uint2* qf, int lane) {
    smem = qf + lane * NW;
    if (kReg) {
#pragma unroll
      for (int s = 0; s < 8; ++s)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const uint2 v = qf[index(s, nt, lane)];
          r[kReg ? s : 0][kReg ? nt : 0][0] = v.x;
          r[kReg ? s : 0][kReg ? nt : 0][1] = v.y;
        }
    }
  }
  // the NT fragments of k-step s
  __device__ __forceinline__ void get(int s, uint2 (&bb)[NT]) const {
    if (kReg) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        bb[nt] = make_uint2(r[kReg ? s : 0][kReg ? nt : 0][0], r[kReg ? s : 0][kReg ? nt : 0][1]);
    } else {
#pragma unroll
      for (int gi = 0; gi < NG; ++gi) {
        const uint4 v = *reinterpret_cast<const uint4*>(smem + (s * NG + gi) * 32 * NW);
        bb[gi * NW] = make_uint2(v.x, v.y);
        bb[gi * NW + 1] = make_uint2(v.z, v.w);
      }
    }
  }
};

// The A fragments of one tile of 16 rows (r0 = g, r1 = g + 8 within the half buffer): f(s, A)
// is called for each k-step s = 0..7 with its 4 registers (the mma.m16n8k16 A layout, which is
// also the per-warp A layout of wgmma's m64nNk16 with A in registers).
template <int MODE, class F>
__device__ __forceinline__ void tile_frags(const uint8_t* st, int rb, int g, int t4, const uint2* lut, F&& f) {
  constexpr int ROWB = MODE == kModeFp8 ? kHeadDim : kNvfp4DataBytesPerKey;
  const int r0 = rb + g, r1 = r0 + 8;
  if (MODE == kModeFp8) {
    const uint4 a0 = *reinterpret_cast<const uint4*>(st + r0 * ROWB + t4 * 32);
    const uint4 a1 = *reinterpret_cast<const uint4*>(st + r0 * ROWB + t4 * 32 + 16);
    const uint4 b0 = *reinterpret_cast<const uint4*>(st + r1 * ROWB + t4 * 32);
    const uint4 b1 = *reinterpret_cast<const uint4*>(st + r1 * ROWB + t4 * 32 + 16);
    const uint32_t x0[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
    const uint32_t x1[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      uint32_t A[4];
      form_expand_fp8(x0[s], &A[0], &A[2]);
      form_expand_fp8(x1[s], &A[1], &A[3]);
      f(s, A);
    }
  } else {
    const uint4 a0 = *reinterpret_cast<const uint4*>(st + r0 * ROWB + t4 * 16);
    const uint4 b0 = *reinterpret_cast<const uint4*>(st + r1 * ROWB + t4 * 16);
    const uint8_t* scl = st + kHalfRows * ROWB;
    const uint32_t sc0 = *reinterpret_cast<const uint16_t*>(scl + r0 * 8 + 2 * t4);
    const uint32_t sc1 = *reinterpret_cast<const uint16_t*>(scl + r1 * 8 + 2 * t4);
    const uint32_t w0[4] = {a0.x, a0.y, a0.z, a0.w};
    const uint32_t w1[4] = {b0.x, b0.y, b0.z, b0.w};
    uint2 l0[2], l1[2];
    __half2 f0[2], f1[2];
#pragma unroll
    for (int gi = 0; gi < 2; ++gi) {
      const uint32_t e0 = (sc0 >> (8 * gi)) & 0xffu, e1 = (sc1 >> (8 * gi)) & 0xffu;
      if (MODE == kModeE4m3) {
        l0[gi] = lut[e0];
        l1[gi] = lut[e1];
      } else {
        f0[gi] = __float2half2_rn(e4m3_decode(static_cast<uint8_t>(e0)));
        f1[gi] = __float2half2_rn(e4m3_decode(static_cast<uint8_t>(e1)));
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t h0[4], h1[4];
      if (MODE == kModeE4m3) {
        expand_e4m3(w0[j], l0[j >> 1], h0);
        expand_e4m3(w1[j], l1[j >> 1], h1);
      } else {
        expand_exact(w0[j], f0[j >> 1], h0);
        expand_exact(w1[j], f1[j >> 1], h1);
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const uint32_t A[4] = {h0[2 * e], h1[2 * e], h0[2 * e + 1], h1[2 * e + 1]};
        f(2 * j + e, A);
      }
    }
  }
}

// The A fragments of one tile of 16 rows in the fp8_mma form (form.hpp, form8_dim): f(s8, A) for
// k-steps s8 = 0..3 with the 4 registers of mma.m16n8k32 (a0, a1: rows g, g + 8 at k = 4 t4 + i;
// a2, a3: at k = 16 + 4 t4 + i): the stored E4M3 bytes (FP8) or the table's k_hat bytes (NVFP4,
// E4M3 rounding), unconverted.
template <int MODE, class F>
__device__ __forceinline__ void tile_frags8(const uint8_t* st, int rb, int g, int t4, const uint2* lut, F&& f) {
  static_assert(MODE != kModeExact, "fp8_mma needs E4M3 keys (config.md rule 7)");
  constexpr int ROWB = MODE == kModeFp8 ? kHeadDim : kNvfp4DataBytesPerKey;
  const int r0 = rb + g, r1 = r0 + 8;
  if (MODE == kModeFp8) {  // 8 bytes of each row per k-step, loaded as it goes (no conversion to wait for)
#pragma unroll
    for (int s8 = 0; s8 < 4; ++s8) {
      const uint2 x0 = *reinterpret_cast<const uint2*>(st + r0 * ROWB + t4 * 32 + 8 * s8);
      const uint2 x1 = *reinterpret_cast<const uint2*>(st + r1 * ROWB + t4 * 32 + 8 * s8);
      const uint32_t A[4] = {x0.x, x1.x, x0.y, x1.y};
      f(s8, A);
    }
  } else {
    const uint4 a0 = *reinterpret_cast<const uint4*>(st + r0 * ROWB + t4 * 16);
    const uint4 b0 = *reinterpret_cast<const uint4*>(st + r1 * ROWB + t4 * 16);
    const uint8_t* scl = st + kHalfRows * ROWB;
    const uint32_t sc0 = *reinterpret_cast<const uint16_t*>(scl + r0 * 8 + 2 * t4);
    const uint32_t sc1 = *reinterpret_cast<const uint16_t*>(scl + r1 * 8 + 2 * t4);
    const uint32_t w0[4] = {a0.x, a0.y, a0.z, a0.w};
    const uint32_t w1[4] = {b0.x, b0.y, b0.z, b0.w};
    uint2 l0[2], l1[2];
#pragma unroll
    for (int gi = 0; gi < 2; ++gi) {
      l0[gi] = lut[(sc0 >> (8 * gi)) & 0xffu];
      l1[gi] = lut[(sc1 >> (8 * gi)) & 0xffu];
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t A[4];
      form_khat_bytes(w0[j], l0[j >> 1].x, l0[j >> 1].y, &A[0], &A[2]);
      form_khat_bytes(w1[j], l1[j >> 1].x, l1[j >> 1].y, &A[1], &A[3]);
      f(j, A);
    }
  }
}

// The block maxima of a warp: lane (g, t4) holds V = 2 NT partial maxima, value v = 2 nt + jj for
// column 8 nt + 2 t4 + jj, over rows g, g + 8 of its tiles. A reduce-scatter over the 8 lanes of
// a column group (lane bits 4, 3, 2 = g bits 2, 1, 0; each step halves the values a lane keeps)
// leaves in v[0 .. scatter_count<V>() - 1] of lane (g, t4) the maxima over all 16 rows of values
// scatter_value<V>(g) + i; scatter_writer<V>(g) marks one lane per value (3, 4, 7 shuffles for
// V = 2, 4, 8 instead of 6, 12, 24; V = 16, 32 (the prefill's 64 and 128 query vectors) end with
// 2 and 4 values per lane after 14 and 28). Max is exact and -0.0 == +0.0 in selection
// (spec/indexer.md section 3), so the order of the reduction does not change any selection.
template <int V>
__host__ __device__ constexpr int scatter_count() {
  return V > 8 ? V / 8 : 1;
}
template <int V>
__host__ __device__ constexpr int scatter_value(int g) {
  const int g2 = (g >> 2) & 1, g1 = (g >> 1) & 1, g0 = g & 1;
  return V >= 8 ? (g2 << 2 | g1 << 1 | g0) * scatter_count<V>() : V == 4 ? (g2 << 1 | g1) : g2;
}
template <int V>
__host__ __device__ constexpr bool scatter_writer(int g) {
  return V >= 8 ? true : V == 4 ? (g & 1) == 0 : (g & 3) == 0;
}
template <int V>
__device__ __forceinline__ void reduce_scatter_max(float (&v)[V], int g) {
#pragma unroll
  for (int step = 0; step < 3; ++step) {
    const int mask = 16 >> step;
    const bool hi = (g >> (2 - step)) & 1;
    constexpr int kHalf0 = V / 2;  // values kept after the first step
    const int C = V >> step;       // values held before this step (a constant after unrolling)
    if (C > 1) {
#pragma unroll
      for (int i = 0; i < kHalf0; ++i) {
        if (i < C / 2) {
          const float send = hi ? v[i] : v[i + C / 2];
          const float keep = hi ? v[i + C / 2] : v[i];
          v[i] = fmaxf(keep, __shfl_xor_sync(0xffffffffu, send, mask));
        }
      }
    } else {
      v[0] = fmaxf(v[0], __shfl_xor_sync(0xffffffffu, v[0], mask));
    }
  }
}

// Block maxima of one tile: rm[nt][jj] = max(rm, the tile's two rows) of the lane's columns.
template <int NT>
__device__ __forceinline__ void fold_max(const float (&acc)[NT][4], float (&rm)[NT][2]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    rm[nt][0] = fmaxf(rm[nt][0], fmaxf(acc[nt][0], acc[nt][2]));
    rm[nt][1] = fmaxf(rm[nt][1], fmaxf(acc[nt][1], acc[nt][3]));
  }
}

// One tile of 16 rows against NT*8 query vectors with mma.sync (B fragments from BFrags).
template <int MODE, int NT>
__device__ __forceinline__ void score_tile(const uint8_t* st, int rb, int g, int t4, const uint2* lut,
                                           const BFrags<NT>& bq, float (&rm)[NT][2]) {
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
  tile_frags<MODE>(st, rb, g, t4, lut, [&](int s, const uint32_t* A) {
    uint2 bb[NT];
    bq.get(s, bb);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mma16816(acc[nt], A, bb[nt].x, bb[nt].y);
  });
  fold_max<NT>(acc, rm);
}

// The same tile in the fp8_mma form: 4 mma.m16n8k32 per n-tile. The query fragments hold the raw
// E4M3 words: BFrags slot s8 (of the first 4) = (b0, b1) of k-step s8.
template <int MODE, int NT>
__device__ __forceinline__ void score_tile8(const uint8_t* st, int rb, int g, int t4, const uint2* lut,
                                            const BFrags<NT>& bq, float (&rm)[NT][2]) {
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
  tile_frags8<MODE>(st, rb, g, t4, lut, [&](int s8, const uint32_t* A) {
    uint2 bb[NT];
    bq.get(s8, bb);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mma16832_e4m3(acc[nt], A, bb[nt].x, bb[nt].y);
  });
  fold_max<NT>(acc, rm);
}

// ---- wgmma (sm_90a): the 4 warps of a warpgroup each multiply their own 16 rows (A from
// registers) by the same NT*8 query vectors (B in shared memory), one instruction per k-step.
// B of k-step s is stored K-major without swizzle: 8 x 8 "core matrices" of fp16 (8 vectors x 16
// bytes, 128 contiguous bytes); the two core matrices of a k-step's 16 k values are LBO = 128
// bytes apart, consecutive groups of 8 vectors SBO = 256 bytes apart, k-steps N * 32 bytes apart.
// Word index of the fp16 pair (k = 2 t4 + 8 half, +1) of vector n in k-step s:
template <int NT>
__host__ __device__ constexpr int wg_b_index(int s, int n, int half, int t4) {
  return s * NT * 64 + (n >> 3) * 64 + half * 32 + (n & 7) * 4 + t4;
}

// Whether the fp16 form's tiles of width NT use wgmma (else mma.sync: the same bits, since both
// compute each 16-product k-step alike); STOCK: the tiles of an NVFP4 stock page (score_kernel)
template <int NT, bool STOCK = false>
inline constexpr bool kWgmmaTiles =
    (NT >= (STOCK ? INDEXCP_SCORE_WGMMA_MIN_NT_STOCK : INDEXCP_SCORE_WGMMA_MIN_NT) || (NT == 1 && INDEXCP_SCORE_WGMMA_NT1)) &&
    INDEXCP_HAVE_WGMMA;

// One tile with wgmma. Every warp of the warpgroup calls it the same number of times (valid =
// false: a placeholder tile whose product is discarded, so that the warpgroup stays in step).
template <int MODE, int NT>
__device__ __forceinline__ void score_tile_wg(const uint8_t* st, int rb, int g, int t4, const uint2* lut,
                                              uint64_t desc, bool valid, float (&rm)[NT][2]) {
  uint32_t A[8][4];
  if (valid)
    tile_frags<MODE>(st, rb, g, t4, lut, [&](int s, const uint32_t* a) {
#pragma unroll
      for (int i = 0; i < 4; ++i) A[s][i] = a[i];
    });
  float acc[NT][4];
  wg_fence();
#pragma unroll
  for (int s = 0; s < 8; ++s) wgmma_tile<NT>(acc, A[s], desc + static_cast<uint64_t>(s * NT * 16), s > 0);
  wg_commit();
  wg_wait0();
  fence_acc<NT>(acc);
  if (valid) fold_max<NT>(acc, rm);
}

// One tile in the fp8_mma form with wgmma (4 instructions m64nNk32 on the E4M3 bytes), in step
// with the warpgroup as score_tile_wg.
template <int MODE, int NT>
__device__ __forceinline__ void score_tile_wg8(const uint8_t* st, int rb, int g, int t4, const uint2* lut,
                                               uint64_t desc, bool valid, float (&rm)[NT][2]) {
  uint32_t A[4][4];
  if (valid)
    tile_frags8<MODE>(st, rb, g, t4, lut, [&](int s8, const uint32_t* a) {
#pragma unroll
      for (int i = 0; i < 4; ++i) A[s8][i] = a[i];
    });
  float acc[NT][4];
  wg_fence();
#pragma unroll
  for (int s8 = 0; s8 < 4; ++s8) wgmma8_tile<NT>(acc, A[s8], desc + static_cast<uint64_t>(s8 * NT * 16), s8 > 0);
  wg_commit();
  wg_wait0();
  fence_acc<NT>(acc);
  if (valid) fold_max<NT>(acc, rm);
}

}  // namespace
}  // namespace indexcp::cuda::detail
