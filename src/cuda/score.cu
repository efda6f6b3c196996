// The decode / prefill scorer of the CUDA backend (spec/indexer.md sections 2-3 and 5.1).
//
// Work: a "stage" is at most 128 rows of keys that belong to whole (rank-local parts of)
// selection blocks: on a replicated or stock page (R >= 128 rows) 128 rows of one page = one
// block; on a shard page of R < 128 rows, 128/R consecutive logical pages (one block each); in
// the prefill gather buffer, the 128 rows of one block assembled from the W ranks' slices.
// Every warp of a CTA owns a private ring of kBuf stage buffers in shared memory, filled by the
// bulk-copy engine (cp.async.bulk, completion on an mbarrier), so no CTA barrier is needed in the
// loop and each warp keeps one stage in flight while it computes another.
//
// Arithmetic: keys are expanded on the CUDA cores to fp16 and multiplied by the E4M3 queries
// (exact in fp16) on the tensor cores with mma.sync.m16n8k16 (fp32 accumulation), or, for 16 or
// 32 query vectors per CTA (NT = 2, 4) in the sm_90a code, with wgmma.m64n16k16 / m64n32k16 (A =
// the same fragments from registers, B = the query vectors in shared memory). A thread of a
// quad holds 32 consecutive dimensions of its two rows; the k order of the MMA is a fixed
// permutation of the 128 dimensions, the same in every scorer of this backend, so a (query,
// head, token) dot product has the same bits wherever it is computed: mma.sync and wgmma compute
// each 16-product step alike (tests/gpu/test_gpu_decode.cpp, All/GpuHeadWidth.*, compares every
// score of a head scored alone (mma.sync), in a pair and with all four heads (wgmma) bit for bit).
//   - NVFP4, E4M3 rounding: k_hat = e4m3(|e2m1| * |scale|) from a 256 x 8 byte table (one entry
//     per scale byte, built on the host with formats.hpp), looked up with prmt; the E4M3 byte is
//     turned into fp16 bits by a shift (value * 2^-8, subnormals included); the score is
//     multiplied by 2^8 at the end (exact).
//   - FP8 keys (cache or staged): the same fp16 bits from the stored byte.
//   - NVFP4, exact rounding: fp16 of |e2m1| by prmt, sign, times the scale (hmul2, exact).
#include <cuda_fp16.h>

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "common.cuh"
#include "kernels.cuh"
#include "core/knobs.hpp"

namespace indexcp::cuda::detail {

namespace {

constexpr int kBuf = 2;         // half-stage buffers per warp
constexpr int kHalfRows = 64;   // rows per half-stage; a work item ("pair") is 2 halves
constexpr int kPlanLocal = 2048;  // requests up to which each CTA computes the plan itself
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
template <int MODE>
constexpr int minb_of() { return MODE == kModeFp8 ? 2 : INDEXCP_SCORE_MINB; }

__device__ uint2 g_khat_lut[256];

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
  int32_t debug;        // benchmarking aid (INDEXCP_SCORE_DEBUG): 1 = no arithmetic, 2 = no loads
  uint64_t wg_desc_bits;  // the fixed fields of the wgmma B descriptor (wg_desc_fixed_bits())
};

struct ReqInfo {
  int32_t seq, row0, cnt;
  int32_t max_local;      // blocks b < max_local may be historical for some row
  int32_t npages_needed;  // logical pages holding those blocks
};

__device__ __forceinline__ ReqInfo request_info(const ScoreArgs& a, int32_t b) {
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
  int32_t ml = (r.seq - 1) / kBlockTokens;
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

// ---- PTX wrappers ---------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t h2_bits(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ __half2 bits_h2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

// ---- key expansion ----------------------------------------------------------------------------
// The k order of the MMA: in k-step s (0..7) the thread of quad lane t4 holds dims 32*t4 + 4s +
// {0, 2} (A regs a0a1 / B regs b0b1) and 32*t4 + 4s + {1, 3} (a4a5 / b2b3). One 32-bit word of
// 8 NVFP4 codes (dims 8j..8j+7 of the thread's 32) feeds k-steps 2j and 2j+1:
//   h[0] = (c0, c2), h[1] = (c1, c3)  -> k-step 2j;   h[2] = (c4, c6), h[3] = (c5, c7) -> 2j+1.
// fp16 bits of an E4M3 value x 2^-8: sign << 15 | magnitude byte << 7 (exact, subnormals too).

// NVFP4, E4M3 rounding: |k| bytes from the per-scale table, signs by sign-replicating the byte
// of w (or w << 4) whose top bit is the code's sign bit.
__device__ __forceinline__ void expand_e4m3(uint32_t w, uint2 lut, uint32_t* h) {
  const uint32_t m = w & 0x77777777u;
  const uint32_t plo = prmt(lut.x, lut.y, m);        // [M0 M1 M2 M3]
  const uint32_t phi = prmt(lut.x, lut.y, __umulhi(m, 1u << 16));  // [M4 M5 M6 M7]; m >> 16 on the FMA pipe
  const uint32_t w4 = w << 4;
  h[0] = (prmt(plo, w4, 0xD2C0u) << 7) & 0xFF80FF80u;  // [M0, s0 x8, M2, s2 x8]
  h[1] = (prmt(plo, w, 0xD3C1u) << 7) & 0xFF80FF80u;   // [M1, s1, M3, s3]
  h[2] = (prmt(phi, w4, 0xF2E0u) << 7) & 0xFF80FF80u;  // [M4, s4, M6, s6]
  h[3] = (prmt(phi, w, 0xF3E1u) << 7) & 0xFF80FF80u;   // [M5, s5, M7, s7]
}

// NVFP4, exact rounding: fp16 |e2m1| from a fixed table, sign, times the scale (exact).
__device__ __forceinline__ void expand_exact(uint32_t w, __half2 sc2, uint32_t* h) {
  constexpr uint32_t E0 = 0x3E3C3800u, E1 = 0x46444240u;  // fp16 high bytes of |e2m1| 0..7
  const uint32_t m = w & 0x77777777u;
  const uint32_t plo = prmt(E0, E1, m), phi = prmt(E0, E1, m >> 16);
  const uint32_t w4 = w << 4;
  // magnitudes into the high byte of each half (low byte: sign-replicate of a byte < 0x80 = 0)
  const uint32_t x0 = prmt(plo, 0u, 0x2808u), x1 = prmt(plo, 0u, 0x3818u);
  const uint32_t x2 = prmt(phi, 0u, 0x2808u), x3 = prmt(phi, 0u, 0x3818u);
  const uint32_t s0 = prmt(w4, 0u, 0x9888u) & 0x80008000u;  // [_, s0, _, s2] (bytes 0/1 of w4)
  const uint32_t s1 = prmt(w, 0u, 0x9888u) & 0x80008000u;   // [_, s1, _, s3]
  const uint32_t s2 = prmt(w4, 0u, 0xBAAAu) & 0x80008000u;  // [_, s4, _, s6] (bytes 2/3)
  const uint32_t s3 = prmt(w, 0u, 0xBAAAu) & 0x80008000u;   // [_, s5, _, s7]
  h[0] = h2_bits(__hmul2(bits_h2(x0 | s0), sc2));
  h[1] = h2_bits(__hmul2(bits_h2(x1 | s1), sc2));
  h[2] = h2_bits(__hmul2(bits_h2(x2 | s2), sc2));
  h[3] = h2_bits(__hmul2(bits_h2(x3 | s3), sc2));
}

// FP8 keys: one word x of 4 E4M3 bytes (dims 4s..4s+3) -> (b0, b2), (b1, b3).
__device__ __forceinline__ void expand_fp8(uint32_t x, uint32_t* lo, uint32_t* hi) {
  *lo = (prmt(x, x, 0xA280u) << 7) & 0xBF80BF80u;  // [b0, s0 x8, b2, s2 x8]
  *hi = (prmt(x, x, 0xB391u) << 7) & 0xBF80BF80u;  // [b1, s1, b3, s3]
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

// B fragments (the query vectors) of k-step s for the mma.sync tiles (NT = 1 in the sm_90a code,
// every NT in the compute_90 PTX; the wgmma tiles use the wg_b_index layout instead): registers
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
template <int MODE, bool NEG, class F>
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
      expand_fp8(x0[s], &A[0], &A[2]);
      expand_fp8(x1[s], &A[1], &A[3]);
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
    uint32_t n0[2] = {0u, 0u}, n1[2] = {0u, 0u};
#pragma unroll
    for (int gi = 0; gi < 2; ++gi) {
      const uint32_t e0 = (sc0 >> (8 * gi)) & 0xffu, e1 = (sc1 >> (8 * gi)) & 0xffu;
      if (MODE == kModeE4m3) {
        l0[gi] = lut[e0];
        l1[gi] = lut[e1];
        if (NEG) {  // a negative scale flips every code's sign (never written by the quantizer)
          n0[gi] = (0u - (e0 >> 7)) & 0x88888888u;
          n1[gi] = (0u - (e1 >> 7)) & 0x88888888u;
        }
      } else {
        f0[gi] = __float2half2_rn(e4m3_decode(static_cast<uint8_t>(e0)));
        f1[gi] = __float2half2_rn(e4m3_decode(static_cast<uint8_t>(e1)));
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t h0[4], h1[4];
      if (MODE == kModeE4m3) {
        expand_e4m3(NEG ? w0[j] ^ n0[j >> 1] : w0[j], l0[j >> 1], h0);
        expand_e4m3(NEG ? w1[j] ^ n1[j >> 1] : w1[j], l1[j >> 1], h1);
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

// The block maxima of a warp: lane (g, t4) holds V = 2 NT partial maxima, value v = 2 nt + jj for
// column 8 nt + 2 t4 + jj, over rows g, g + 8 of its tiles. A reduce-scatter over the 8 lanes of
// a column group (lane bits 4, 3, 2 = g bits 2, 1, 0; each step halves the values a lane keeps,
// down to one) leaves in v[0] of lane (g, t4) the maximum over all 16
// rows of value scatter_value<V>(g); scatter_writer<V>(g) marks one lane per value (3, 4, 7
// shuffles for V = 2, 4, 8 instead of 6, 12, 24). Max is exact
// and -0.0 == +0.0 in selection (spec/indexer.md section 3), so the order of the reduction does
// not change any selection.
template <int V>
__host__ __device__ constexpr int scatter_value(int g) {
  const int g2 = (g >> 2) & 1, g1 = (g >> 1) & 1, g0 = g & 1;
  return V == 8 ? (g2 << 2 | g1 << 1 | g0) : V == 4 ? (g2 << 1 | g1) : g2;
}
template <int V>
__host__ __device__ constexpr bool scatter_writer(int g) {
  return V == 8 ? true : V == 4 ? (g & 1) == 0 : (g & 3) == 0;
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
template <int MODE, int NT, bool NEG>
__device__ __forceinline__ void score_tile(const uint8_t* st, int rb, int g, int t4, const uint2* lut,
                                           const BFrags<NT>& bq, float (&rm)[NT][2]) {
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
  tile_frags<MODE, NEG>(st, rb, g, t4, lut, [&](int s, const uint32_t* A) {
    uint2 bb[NT];
    bq.get(s, bb);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mma16816(acc[nt], A, bb[nt].x, bb[nt].y);
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

// wgmma exists in the sm_90a code only (the compute_90 PTX of the build, JIT-compiled for newer
// GPUs, keeps mma.sync). It serves NT = 2 and 4 (16 and 32 query vectors per CTA): one
// instruction per k-step instead of NT HMMA (and, for NT = 4, 2 shared loads of B fragments), at
// the price of keeping the 4 warps of a warpgroup in step. Same-session A/B (bench/NOTES.md, v8):
// NT = 4 -6%, NT = 2 -1%, NT = 1 +6% (so NT = 1 keeps mma.sync). -DINDEXCP_SCORE_WGMMA=0 builds
// without it.
#ifndef INDEXCP_SCORE_WGMMA
#define INDEXCP_SCORE_WGMMA 1
#endif
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && INDEXCP_SCORE_WGMMA
#define INDEXCP_HAVE_WGMMA 1
#else
#define INDEXCP_HAVE_WGMMA 0
#endif
#ifndef INDEXCP_SCORE_WGMMA_NT1
#define INDEXCP_SCORE_WGMMA_NT1 0
#endif
#ifndef INDEXCP_SCORE_WGMMA_MIN_NT
#define INDEXCP_SCORE_WGMMA_MIN_NT 2
#endif
template <int NT>
inline constexpr bool kWgmmaTiles =
    (NT >= INDEXCP_SCORE_WGMMA_MIN_NT || INDEXCP_SCORE_WGMMA_NT1) && INDEXCP_HAVE_WGMMA;

// The shared-memory matrix descriptor of B (PTX ISA, "Matrix Descriptor Format"): start address,
// LBO and SBO in units of 16 bytes (bits 0-13, 16-29, 32-45), base offset 0, no swizzle. The
// fixed fields travel in the launch arguments: as a compile-time constant ptxas rebuilt the 8
// descriptors of a tile between its wgmma instructions, 4.5% slower (bench/NOTES.md, v8); from a
// kernel argument they stay in uniform registers across the loop.
constexpr uint64_t wg_desc_fixed_bits() { return (uint64_t{128 >> 4} << 16) | (uint64_t{256 >> 4} << 32); }
__device__ __forceinline__ uint64_t wg_desc(const void* smem_b, uint64_t fixed_bits) {
  return ((smem_u32(smem_b) & 0x3FFFFu) >> 4) | fixed_bits;
}
__device__ __forceinline__ void wg_fence() {
#if INDEXCP_HAVE_WGMMA
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_commit() {
#if INDEXCP_HAVE_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_wait0() {
#if INDEXCP_HAVE_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#endif
}
// D (+)= A x B for m64nNk16, N = NT * 8 (16 or 32; 8 with -DINDEXCP_SCORE_WGMMA_NT1=1), fp32 accumulation; d holds the mma.m16n8 C layout per
// n-tile (d[nt][0..3]); scale_d = 0 ignores the old d.
template <int NT>
__device__ __forceinline__ void wgmma_tile(float (&d)[NT][4], const uint32_t* a, uint64_t desc, int scale_d) {
#if INDEXCP_HAVE_WGMMA
  if constexpr (NT == 1) {  // only with -DINDEXCP_SCORE_WGMMA_NT1=1 (kWgmmaTiles)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
  } else if constexpr (NT == 2) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, "
        "1, 1, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
  } else if constexpr (NT == 4) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,"
        "%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
  }
#endif
}
template <int NT>
__device__ __forceinline__ void fence_acc(float (&d)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(d[nt][i])::"memory");
}

// One tile with wgmma. Every warp of the warpgroup calls it the same number of times (valid =
// false: a placeholder tile whose product is discarded, so that the warpgroup stays in step).
template <int MODE, int NT>
__device__ __forceinline__ void score_tile_wg(const uint8_t* st, int rb, int g, int t4, const uint2* lut,
                                              uint64_t desc, bool valid, float (&rm)[NT][2]) {
  uint32_t A[8][4];
  if (valid)
    tile_frags<MODE, false>(st, rb, g, t4, lut, [&](int s, const uint32_t* a) {
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

// NVFP4 in a half buffer: does any of rows row0 .. row0 + nrows - 1 have a negative scale byte?
// (never, for caches we wrote) Warp-uniform result.
__device__ __forceinline__ bool any_negative_scale(const uint8_t* st, int row0, int nrows, int lane) {
  uint32_t orx = 0;
  for (int r = lane; r < nrows; r += 32) {
    const uint2 v = *reinterpret_cast<const uint2*>(st + kHalfRows * kNvfp4DataBytesPerKey + (row0 + r) * 8);
    orx |= v.x | v.y;
  }
  return __any_sync(0xffffffffu, (orx & 0x80808080u) != 0);
}

// NVFP4 with E4M3 rounding, before a wgmma tile: rows of the chunk whose scale byte is negative
// (never written by the quantizer) get their codes' signs flipped in the stage buffer, so that
// one code path (and one wgmma site) serves every warp; the table lookup ignores the scale sign.
__device__ __forceinline__ void fix_negative_scales(uint8_t* st, int row0, int nrows, int lane) {
  for (int i = lane; i < nrows * 8; i += 32) {
    const int r = row0 + i / 8, gi = i % 8;
    if (st[kHalfRows * kNvfp4DataBytesPerKey + r * 8 + gi] & 0x80u) {
      uint2* w = reinterpret_cast<uint2*>(st + r * kNvfp4DataBytesPerKey + gi * 8);
      w->x ^= 0x88888888u;
      w->y ^= 0x88888888u;
    }
  }
  // the generic-proxy writes before the bulk copy (async proxy) that later refills this buffer
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncwarp();
}

// Prefix sums of work items per request (the plan; graph-safe: reads seq_lens at run time):
// plan[0] = 0, plan[b + 1] = pairs of requests 0..b. THREADS threads of one CTA, all of them
// calling; ends with a barrier, so plan may be shared memory.
template <bool GATHER, int THREADS>
__device__ __forceinline__ void plan_block(const ScoreArgs& a, int32_t* plan,
                                           typename cub::BlockScan<int32_t, THREADS>::TempStorage& tmp) {
  int32_t carry = 0;
  for (int32_t base = 0; base < a.rows.num_requests; base += THREADS) {
    const int32_t b = base + static_cast<int32_t>(threadIdx.x);
    const int32_t v = b < a.rows.num_requests ? num_pairs<GATHER>(a, request_info(a, b)) : 0;
    int32_t incl, total;
    cub::BlockScan<int32_t, THREADS>(tmp).InclusiveSum(v, incl, total);
    if (b < a.rows.num_requests) plan[b + 1] = carry + incl;
    carry += total;
    __syncthreads();  // tmp is reused
  }
  if (threadIdx.x == 0) plan[0] = 0;
  __syncthreads();
}

// The plan in global memory, for batches of more than kPlanLocal requests.
template <bool GATHER>
__global__ void __launch_bounds__(1024) plan_kernel(const ScoreArgs a, int32_t* plan) {
  __shared__ typename cub::BlockScan<int32_t, 1024>::TempStorage tmp;
  plan_block<GATHER, 1024>(a, plan, tmp);
}

template <int MODE, int NT, bool STOCK, bool GATHER>
__global__ void __launch_bounds__(warps_of<MODE>() * 32, minb_of<MODE>()) score_kernel(const ScoreArgs a) {
  constexpr int kWarps = warps_of<MODE>(), kThreads = kWarps * 32;
  constexpr bool WG = kWgmmaTiles<NT>;
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int HALF = half_bytes<MODE>();
  constexpr int ROWB = MODE == kModeFp8 ? kHeadDim : kNvfp4DataBytesPerKey;
  constexpr float kScale = MODE == kModeExact ? 1.0f : 256.0f;
  __shared__ int32_t scol[NT * 8];  // output columns of the CTA's query vectors (per request, the
                                    // same for every warp): row * 64 + head, or -1
  uint8_t* stages = smem;
  uint2* lut = reinterpret_cast<uint2*>(smem + kWarps * kBuf * HALF);
  uint2* qf = lut + 256;                                           // 8 * NT * 32: BFrags::index or wg_b_index
  ChunkEnt* tab = reinterpret_cast<ChunkEnt*>(qf + 8 * NT * 32);        // [kWarps][2][kTab]
  uint64_t* bars = reinterpret_cast<uint64_t*>(tab + kWarps * 2 * kTab);  // [kWarps][kBuf]
  int32_t* meta = reinterpret_cast<int32_t*>(bars + kWarps * kBuf);  // [kWarps][kBuf][4]: chunk blocks

  // the plan (computed here for up to kPlanLocal requests: no separate kernel, no global loads in
  // the cursor), then this CTA's share of the work items of all requests
  const int32_t B = a.rows.num_requests;
  const int32_t* plan = a.plan;
  if (a.plan_local) {
    __shared__ typename cub::BlockScan<int32_t, kThreads>::TempStorage scan_tmp;
    int32_t* splan = reinterpret_cast<int32_t*>(meta + kWarps * kBuf * 4);  // [kPlanLocal + 1]
    plan_block<GATHER, kThreads>(a, splan, scan_tmp);
    plan = splan;
  }
  const int64_t total = plan[B];
  const int64_t p0 = total * blockIdx.x / gridDim.x, p1 = total * (blockIdx.x + 1) / gridDim.x;
  if (p0 >= p1) return;
  const int32_t n0 = blockIdx.y * NT * 8;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  if (MODE == kModeE4m3)
    for (int i = threadIdx.x; i < 256; i += kThreads) lut[i] = g_khat_lut[i];
  uint8_t* wst = stages + warp * kBuf * HALF;
  uint64_t* wbar = bars + warp * kBuf;
  int32_t* wmeta = meta + warp * kBuf * 4;
  if (lane == 0) {
    for (int i = 0; i < kBuf; ++i) mbar_init(&wbar[i], 1);
    mbar_fence_init();
  }
  // first request of the range
  int32_t b_first = 0;
  {
    int32_t lo = 0, hi = B - 1;  // largest b with plan[b] <= p0
    while (lo < hi) {
      const int32_t mid = (lo + hi + 1) >> 1;
      if (plan[mid] <= p0) lo = mid;
      else hi = mid - 1;
    }
    b_first = lo;
  }
  const int nch = chunks_per_half<STOCK, GATHER>(a);
  const Geo G(a.keys);

  // A cursor over this warp's items (request, pair, half) in order; pairs of a request are
  // taken round robin by the warps: pair index seg_begin + warp + kWarps * k.
  struct Cursor {
    int32_t b, s, end;  // request, pair within the request, end of the request's segment
    int h;
    int32_t k;          // half-stage index within this warp's part of request b (2 per pair)
    bool valid;
    ReqInfo ri;         // GATHER only
  };
  auto seg_of = [&](int32_t b, int32_t* s0, int32_t* s1) {
    const int64_t lo = plan[b] > p0 ? plan[b] : p0;
    const int64_t hi = plan[b + 1] < p1 ? plan[b + 1] : p1;
    *s0 = static_cast<int32_t>(lo - plan[b]);
    *s1 = static_cast<int32_t>(hi - plan[b]);
  };
  auto first_of = [&](int32_t b, Cursor* c) {  // first item of request b at or after b
    for (; b < B; ++b) {
      if (plan[b] >= p1) break;
      int32_t s0, s1;
      seg_of(b, &s0, &s1);
      if (s0 + warp < s1) {
        *c = Cursor{b, s0 + warp, s1, 0, 0, true, {}};
        if constexpr (GATHER) c->ri = request_info(a, b);  // (read by the gather's copy issue only)
        return;
      }
    }
    c->valid = false;
  };
  auto advance = [&](Cursor* c) {
    ++c->k;
    if (c->h == 0) {
      c->h = 1;
      return;
    }
    c->h = 0;
    c->s += kWarps;
    if (c->s < c->end) return;
    first_of(c->b + 1, c);
  };
  // The chunk table (not the gather): when the prefetch cursor enters a half-stage outside the
  // window [win_k0, win_k0 + kTab / nch) of request win_b, every lane computes one chunk of the new
  // window (entry i: chunk i % nch of half-stage win_k0 + i / nch; the block-table loads go in
  // parallel) into the other of the warp's two tables. Warp-uniform. It runs right after the
  // cursor advances, and lane 0 reads the entry in the next issue, after a __syncwarp; lane 0's
  // reads of the previous window, in the table not written, came before that barrier too (no
  // barrier inside this function: one there made ptxas spill in the tile loop).
  constexpr bool kUseTab = !GATHER;
  const int32_t win_len = kTab / nch;  // (once: a division per half-stage cost 3% of the ICP scorer)
  int32_t win_b = -1, win_k0 = 0, win_t = 0;
  auto refill = [&](const Cursor& c) {
    if (!kUseTab || (c.b == win_b && c.k < win_k0 + win_len)) return;
    win_t ^= 1;
    const int32_t kk = c.k + lane / nch;
    const int32_t s = c.s + kWarps * ((kk >> 1) - (c.k >> 1));  // (c.h == c.k & 1)
    ChunkEnt e{-1, 0, nullptr, nullptr};
    Chunk ch;
    if (s < c.end && half_chunk<STOCK, GATHER>(a, G, c.b, request_info(a, c.b), s, kk & 1, lane % nch, &ch)) {
      e.block = ch.block;
      e.data = ch.data;
      e.scales = ch.scales;
    }
    tab[(warp * 2 + win_t) * kTab + lane] = e;
    win_b = c.b;
    win_k0 = c.k;
  };
  // chunk k of the half-stage at cursor c: from the table, or computed (the gather)
  auto get_chunk = [&](const Cursor& c, int k, Chunk* ch) -> bool {
    if constexpr (kUseTab) {
      const ChunkEnt e = tab[(warp * 2 + win_t) * kTab + (c.k - win_k0) * nch + k];
      ch->block = e.block;
      ch->nrows = STOCK || G.R >= kHalfRows ? kHalfRows : G.R;
      ch->data = e.data;
      ch->scales = e.scales;
      return e.block >= 0;
    } else {
      return half_chunk<STOCK, GATHER>(a, G, c.b, c.ri, c.s, c.h, k, ch);
    }
  };
  // lane 0: copies one half into a buffer and records each chunk's block (-1: not needed) in
  // the buffer's meta slots, which the warp reads after the mbarrier wait (no recomputation and
  // no block-table load on the compute side)
  auto issue = [&](const Cursor& c, uint8_t* dst, uint64_t* bar, int32_t* m) {
    constexpr int kRowBytes = ROWB + (MODE == kModeFp8 ? 0 : kNvfp4ScalesPerKey);
    if constexpr (STOCK) {  // one chunk: arrive and expect its bytes in one barrier operation
      Chunk ch;
      const bool ok = get_chunk(c, 0, &ch);
      m[0] = ok ? ch.block : -1;
      if (a.debug & 2) return;  // benchmarking aid: no loads
      mbar_arrive_expect_tx(bar, ok ? ch.nrows * kRowBytes : 0);
      if (!ok) return;
      bulk_g2s(dst, ch.data, ch.nrows * ROWB, bar);
      if (MODE != kModeFp8) bulk_g2s(dst + kHalfRows * ROWB, ch.scales, ch.nrows * kNvfp4ScalesPerKey, bar);
    } else {
      // shard pages (nch = 64 / R <= 4 chunks, R >= 16 checked at launch): chunk by chunk, its
      // bytes announced on the barrier (expect_tx), then its copies; one arrive at the end
      // completes the phase once every copy has landed (no per-chunk arrays: they made the
      // non-stock scorers spill)
      for (int k = 0; k < nch; ++k) {
        Chunk ch;
        const bool ok = get_chunk(c, k, &ch);
        m[k] = ok ? ch.block : -1;
        if (!ok || (a.debug & 2)) continue;
        mbar_expect_tx(bar, ch.nrows * kRowBytes);
        bulk_g2s(dst + k * ch.nrows * ROWB, ch.data, ch.nrows * ROWB, bar);
        if (MODE != kModeFp8)
          bulk_g2s(dst + kHalfRows * ROWB + k * ch.nrows * kNvfp4ScalesPerKey, ch.scales,
                   ch.nrows * kNvfp4ScalesPerKey, bar);
      }
      if (!(a.debug & 2)) mbar_arrive(bar);
    }
  };

  Cursor pre;  // the prefetch cursor runs kBuf items ahead of the compute
  first_of(b_first, &pre);
  __syncthreads();  // barriers initialized, LUT loaded
  // (the kBuf = 2 items of the prologue are the two halves of one pair: one window)
  if (pre.valid) refill(pre);
  __syncwarp();  // the table before lane 0 reads it
  int issued = 0;
  if (lane == 0)
    for (; issued < kBuf && pre.valid; ++issued) {
      issue(pre, wst + issued * HALF, &wbar[issued], wmeta + issued * 4);
      advance(&pre);
    }
  else
    for (; issued < kBuf && pre.valid; ++issued) advance(&pre);
  if (pre.valid) refill(pre);
  __syncwarp();  // the prologue's meta and table writes before anyone reads them
  int item = 0;  // items consumed by this warp
  const int32_t rc_half = GATHER ? (G.R < kHalfRows ? G.R : kHalfRows)
                                 : ((STOCK || G.R >= kHalfRows) ? kHalfRows : G.R);  // rows per chunk

  const float kNaN = __int_as_float(0x7fc00000);
  for (int32_t b = b_first; b < B && plan[b] < p1; ++b) {
    int32_t s0, s1;
    seg_of(b, &s0, &s1);
    if (s0 >= s1) continue;
    const ReqInfo ri = request_info(a, b);
    const int32_t nvec = ri.cnt * a.nh;
    // the query fragments of request b (every warp of the CTA takes part)
    __syncthreads();
    // qf[BFrags<NT>::index(s, nt, ln)] (mma.sync) or the wg_b_index words (wgmma). Each thread
    // takes kQIt elements: first all their query bytes (one 32-bit load per element when q is
    // 4-byte aligned, so the loads are in flight together), then the conversion.
    constexpr int kQIt = (8 * NT * 32 + kThreads - 1) / kThreads;
    uint32_t qraw[kQIt];
    const bool q_aligned = (reinterpret_cast<uintptr_t>(a.q) & 3u) == 0;
#pragma unroll
    for (int it = 0; it < kQIt; ++it) {
      const int e = threadIdx.x + it * kThreads;
      constexpr int NW = BFrags<NT>::NW, NG = BFrags<NT>::NG;
      const int ln = (e / NW) & 31, nt = (e / (NW * 32)) % NG * NW + e % NW, s = e / (NW * 32 * NG);
      const int n = n0 + nt * 8 + (ln >> 2);
      qraw[it] = 0u;
      if (e < 8 * NT * 32 && n < nvec) {
        const int i = n / a.nh, hh = n % a.nh;
        const uint8_t* qv = a.q + ((static_cast<int64_t>(ri.row0) + i) * a.heads + a.h0 + hh) * kHeadDim;
        const int d = 32 * (ln & 3) + 4 * s;  // dims d .. d + 3
        if (q_aligned) {
          qraw[it] = *reinterpret_cast<const uint32_t*>(qv + d);
        } else {
          qraw[it] = static_cast<uint32_t>(qv[d]) | static_cast<uint32_t>(qv[d + 1]) << 8 |
                     static_cast<uint32_t>(qv[d + 2]) << 16 | static_cast<uint32_t>(qv[d + 3]) << 24;
        }
      }
    }
#pragma unroll
    for (int it = 0; it < kQIt; ++it) {
      const int e = threadIdx.x + it * kThreads;
      if (e >= 8 * NT * 32) break;
      constexpr int NW = BFrags<NT>::NW, NG = BFrags<NT>::NG;
      const int ln = (e / NW) & 31, nt = (e / (NW * 32)) % NG * NW + e % NW, s = e / (NW * 32 * NG);
      const uint32_t w = qraw[it];  // 0 (= +0.0 in E4M3) for vectors past nvec
      uint2 v;
      v.x = q_pair_bytes(w & 0xffu, (w >> 16) & 0xffu);         // dims d, d + 2
      v.y = q_pair_bytes((w >> 8) & 0xffu, (w >> 24) & 0xffu);  // dims d + 1, d + 3
      if constexpr (WG) {
        uint32_t* qw = reinterpret_cast<uint32_t*>(qf);
        qw[wg_b_index<NT>(s, nt * 8 + (ln >> 2), 0, ln & 3)] = v.x;
        qw[wg_b_index<NT>(s, nt * 8 + (ln >> 2), 1, ln & 3)] = v.y;
      } else {
        qf[e] = v;
      }
    }
    if constexpr (WG) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // B for wgmma
    if (threadIdx.x < NT * 8) {  // output column of query vector n0 + threadIdx.x: row * 64 + head, or -1
      const int n = n0 + threadIdx.x;
      scol[threadIdx.x] = n < nvec ? (n / a.nh) * 64 + n % a.nh : -1;
    }
    __syncthreads();
    // The one score this lane writes at each flush (reduce_scatter_max): its query vector's
    // output row and head, and the blocks that are historical for that row (spec/indexer.md
    // section 2); olim = 0 when the lane writes nothing
    int64_t obase = 0;
    int32_t olim = 0;
    {
      const int v = scatter_value<2 * NT>(g);
      const int32_t cc = scatter_writer<2 * NT>(g) ? scol[(v >> 1) * 8 + 2 * t4 + (v & 1)] : -1;
      if (cc >= 0) {
        const int32_t i = cc >> 6, hh = cc & 63;
        olim = (ri.seq - ri.cnt + i) >> 7;
        obase = ((static_cast<int64_t>(ri.row0) + i) * a.nh + hh) * a.max_blocks;
      }
    }
    BFrags<NT> bq;
    if constexpr (!WG) bq.load(qf, lane);
    const uint64_t desc = wg_desc(qf, a.wg_desc_bits);
    const bool active = n0 < nvec && !(a.debug & 1);
    // WG: every warp runs the same number of pair iterations (those past its last pair are
    // placeholders) so that the warpgroup's wgmma instructions stay in step
    const int32_t nit = WG ? (s1 - s0 + kWarps - 1) / kWarps : 0;
    for (int32_t s = s0 + warp, it = 0; WG ? it < nit : s < s1; s += kWarps, ++it) {
      const bool have = !WG || s < s1;
      float rm[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) rm[nt][0] = rm[nt][1] = kNaN;
      int32_t cur = -1;
      auto flush = [&]() {
        float v[2 * NT];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          v[2 * nt] = rm[nt][0];
          v[2 * nt + 1] = rm[nt][1];
        }
        reduce_scatter_max<2 * NT>(v, g);
        if (cur < olim) a.scores[obase + cur] = v[0] * kScale;  // historical for this row only
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) rm[nt][0] = rm[nt][1] = kNaN;
      };
      for (int h = 0; h < 2; ++h) {
        const int buf = item % kBuf;
        if (have && !(a.debug & 2)) mbar_wait(&wbar[buf], static_cast<uint32_t>((item / kBuf) & 1));
        uint8_t* st = wst + buf * HALF;
        if (WG && active) {
          for (int c = 0; c < nch; ++c) {  // chunks of rc_half rows (a multiple of 16)
            const int32_t blk = have ? wmeta[buf * 4 + c] : -1;
            const bool ok = blk >= 0;
            if (ok && blk != cur) {
              if (cur >= 0) flush();
              cur = blk;
            }
            if (MODE == kModeE4m3 && ok && any_negative_scale(st, c * rc_half, rc_half, lane))
              fix_negative_scales(st, c * rc_half, rc_half, lane);
#pragma unroll 1
            for (int t = 0; t < rc_half / 16; ++t)
              score_tile_wg<MODE, NT>(st, c * rc_half + t * 16, g, t4, lut, desc, ok, rm);
          }
        } else if (active) {
          for (int c = 0; c < nch; ++c) {
            const int32_t blk = wmeta[buf * 4 + c];
            if (blk < 0) continue;
            Chunk ch;
            ch.block = blk;
            ch.nrows = rc_half;
            if (ch.block != cur) {
              if (cur >= 0) flush();
              cur = ch.block;
            }
            const bool neg = MODE == kModeE4m3 && any_negative_scale(st, c * ch.nrows, ch.nrows, lane);
            auto tile = [&](int t) {
              if (neg) score_tile<MODE, NT, true>(st, c * ch.nrows + t * 16, g, t4, lut, bq, rm);
              else score_tile<MODE, NT, false>(st, c * ch.nrows + t * 16, g, t4, lut, bq, rm);
            };
            if constexpr (NT <= 2 && MODE != kModeFp8) {  // two tiles interleaved (v6: -1%; NT = 4 and FP8 spill)
#pragma unroll 2
              for (int t = 0; t < ch.nrows / 16; ++t) tile(t);
            } else {
              for (int t = 0; t < ch.nrows / 16; ++t) tile(t);
            }
          }
        }
        if (!have) continue;
        __syncwarp();
        if (pre.valid) {
          if (lane == 0) issue(pre, wst + buf * HALF, &wbar[buf], wmeta + buf * 4);
          advance(&pre);
          if (pre.valid) refill(pre);
        }
        ++item;
      }
      if (cur >= 0) flush();
    }
  }
}

template <int MODE, int NT, bool STOCK, bool GATHER>
void launch_t(const ScoreArgs& a, dim3 grid, cudaStream_t stream) {
  constexpr int smem = score_smem_bytes<MODE, NT>(), kThreads = warps_of<MODE>() * 32;
  static_assert(smem <= 227 * 1024, "shared memory");
  auto k = score_kernel<MODE, NT, STOCK, GATHER>;
  check(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
        "cudaFuncSetAttribute (score kernel shared memory)");
  if (!a.plan_local) {
    plan_kernel<GATHER><<<1, 1024, 0, stream>>>(a, const_cast<int32_t*>(a.plan));
    INDEXCP_CUDA_LAUNCH_CHECK("score plan kernel launch");
  }
  int per_sm = 0;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, kThreads, smem), "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  dim3 g = grid;
  // CTAs along x share each query slice's work items: ceil(2 x resident / slices) per slice, two
  // to four waves over all slices (grid.y: prefill chunks have hundreds), not a full wave per
  // slice, whose CTAs would each get a few items or none and spend the launch on their prologue
  const int64_t resident = static_cast<int64_t>(std::max(1, per_sm)) * sm_count();
  g.x = static_cast<unsigned>(std::clamp<int64_t>(ceil_div(2 * resident, static_cast<int64_t>(grid.y)), 1, resident));
  if (const char* e = ::indexcp::detail::knob_env("INDEXCP_SCORE_CTAS")) g.x = static_cast<unsigned>(std::max(1, std::atoi(e)));
  k<<<g, kThreads, smem, stream>>>(a);
  INDEXCP_CUDA_LAUNCH_CHECK("score kernel launch");
}

template <int MODE, bool STOCK, bool GATHER>
void launch_nt(int nt, const ScoreArgs& a, dim3 grid, cudaStream_t stream) {
  if (nt == 1) launch_t<MODE, 1, STOCK, GATHER>(a, grid, stream);
  else if (nt == 2) launch_t<MODE, 2, STOCK, GATHER>(a, grid, stream);
  else launch_t<MODE, 4, STOCK, GATHER>(a, grid, stream);
}

__global__ void fill_kernel(float* p, int64_t n, float v) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = v;
}

__global__ void stage_fp8_kernel(const uint8_t* layer_base, PageLayout L, int64_t cache_pages,
                                 const int32_t* pages, uint8_t* out) {
  const int64_t i = blockIdx.x;
  const int32_t page = pages[i];
  const int32_t R = L.rows();
  uint8_t* o = out + i * R * kHeadDim;
  if (page < 0 || page >= cache_pages) return;  // validated by the caller
  const uint8_t* p = layer_base + L.page_offset(page);
  if (L.dtype == KvDtype::kFp8) {
    const uint4* src = reinterpret_cast<const uint4*>(p);
    uint4* dst = reinterpret_cast<uint4*>(o);
    for (int e = threadIdx.x; e < R * kHeadDim / 16; e += blockDim.x) dst[e] = src[e];
    return;
  }
  // NVFP4: one item = (row, group of 16 dims) -> 16 E4M3 bytes
  for (int e = threadIdx.x; e < R * kNvfp4ScalesPerKey; e += blockDim.x) {
    const int32_t row = e / kNvfp4ScalesPerKey, gi = e % kNvfp4ScalesPerKey;
    const uint8_t sf = p[L.row_scale_offset(row) + gi];
    const uint2 codes = *reinterpret_cast<const uint2*>(p + L.row_data_offset(row) + gi * 8);
    const float sv = e4m3_decode(sf);
    uint32_t outw[4];
#pragma unroll
    for (int wi = 0; wi < 4; ++wi) {
      const uint32_t cw = wi < 2 ? codes.x : codes.y;
      uint32_t r = 0;
#pragma unroll
      for (int bi = 0; bi < 4; ++bi) {
        const int nib = (wi & 1) * 4 + bi;  // code index within the 32-bit word
        const uint8_t code = static_cast<uint8_t>((cw >> (4 * nib)) & 0xfu);
        r |= static_cast<uint32_t>(e4m3_encode(e2m1_decode(code) * sv)) << (8 * bi);
      }
      outw[wi] = r;
    }
    *reinterpret_cast<uint4*>(o + static_cast<int64_t>(row) * kHeadDim + gi * 16) =
        make_uint4(outw[0], outw[1], outw[2], outw[3]);
  }
}

std::mutex g_tables_mu;
std::vector<int> g_tables_done;

}  // namespace

int sm_count() {
  static std::mutex mu;
  static std::vector<int> cache(64, 0);
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  std::lock_guard<std::mutex> lk(mu);
  if (dev < 64 && cache[dev]) return cache[dev];
  int n = 0;
  check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
  if (dev < 64) cache[dev] = n;
  return n;
}

void ensure_tables(cudaStream_t stream) {
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  std::lock_guard<std::mutex> lk(g_tables_mu);
  if (static_cast<int>(g_tables_done.size()) <= dev) g_tables_done.resize(dev + 1, 0);
  if (g_tables_done[dev]) return;
  // the first use on a device uploads the tables (a synchronous copy): never inside a capture
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (stream != nullptr && cudaStreamIsCapturing(stream, &capturing) == cudaSuccess &&
      capturing != cudaStreamCaptureStatusNone)
    throw Error(ErrorCode::kInvalidArgument,
                "stream is being captured but device " + std::to_string(dev) +
                    " was not prepared: call cuda::prepare_device() (or create a DeviceCache) before the capture");
  uint2 t[256];
  for (int s = 0; s < 256; ++s) {
    const uint8_t mag_scale = static_cast<uint8_t>(s & 0x7f);  // the sign is applied to the codes
    uint8_t m[8];
    for (int c = 0; c < 8; ++c) m[c] = e4m3_encode(e2m1_decode(static_cast<uint8_t>(c)) * e4m3_decode(mag_scale));
    t[s].x = m[0] | (m[1] << 8) | (m[2] << 16) | (static_cast<uint32_t>(m[3]) << 24);
    t[s].y = m[4] | (m[5] << 8) | (m[6] << 16) | (static_cast<uint32_t>(m[7]) << 24);
  }
  check(cudaMemcpyToSymbol(g_khat_lut, t, sizeof(t)), "cudaMemcpyToSymbol (k_hat table)");
  g_tables_done[dev] = 1;
}

void launch_score(const ScoreLaunch& s, cudaStream_t stream) {
  if (s.rows.num_requests == 0 || s.nh == 0) return;
  ScoreArgs a;
  a.keys = s.keys;
  a.rows = s.rows;
  a.block_table = s.block_table;
  a.max_pages = s.max_pages;
  a.q = s.q;
  a.heads = s.heads;
  a.h0 = s.h0;
  a.nh = s.nh;
  a.filter_mod = s.filter.modulus;
  a.filter_res = s.filter.residue;
  a.scores = s.scores;
  a.max_blocks = s.max_blocks;
  a.debug = 0;
  a.wg_desc_bits = wg_desc_fixed_bits();
  if (const char* e = ::indexcp::detail::knob_env("INDEXCP_SCORE_DEBUG")) a.debug = std::atoi(e);
  const PageLayout& L = s.keys.layout;
  const int32_t R = L.rows();
  INDEXCP_REQUIRE(static_cast<int64_t>(s.max_pages) * L.page_size < (int64_t{1} << 30),
          "max_pages x page_size must stay below 2^30 tokens per request");
  INDEXCP_REQUIRE(s.max_pages > 0, "max_pages must be > 0");
  // rows per rank: a multiple of 16 (formats.md section 7; PageLayout enforces it), so a 64-row
  // half-stage holds at most 4 chunks (the kernel's meta slots)
  INDEXCP_REQUIRE(R >= 16 && R % 16 == 0, "rows per rank must be a multiple of 16");
  // INDEXCP_SCORE_PLAN=kernel forces the separate plan kernel (tests compare both paths)
  const char* pe = ::indexcp::detail::knob_env("INDEXCP_SCORE_PLAN");
  a.plan_local = s.rows.num_requests <= kPlanLocal && !(pe && std::strcmp(pe, "kernel") == 0);
  int32_t* plan = s.plan;
  int32_t* owned = nullptr;
  if (plan == nullptr && !a.plan_local) {
    check(cudaMallocAsync(reinterpret_cast<void**>(&owned), (s.rows.num_requests + 1) * sizeof(int32_t), stream),
          "cudaMallocAsync (score plan)");
    plan = owned;
  }
  a.plan = plan;  // null when the plan is local and the caller gave no buffer
  const int64_t nvec_max = static_cast<int64_t>(s.max_rows_per_request) * s.nh;
  const int nt = nvec_max <= 8 ? 1 : nvec_max <= 16 ? 2 : 4;
  const int64_t gy = ceil_div(nvec_max, nt * 8);
  INDEXCP_REQUIRE(gy <= 65535, "score launch too large (rows of one request x heads)");
  const dim3 grid(1, static_cast<unsigned>(gy));
  ensure_tables(stream);
  if (s.keys.gather) {
    launch_nt<kModeFp8, false, true>(nt, a, grid, stream);
  } else {
    const bool stock = s.stock && R >= kBlockTokens;
    const int mode = L.dtype == KvDtype::kFp8 ? kModeFp8 : (s.mode == KRounding::kExact ? kModeExact : kModeE4m3);
    if (stock) {
      if (mode == kModeFp8) launch_nt<kModeFp8, true, false>(nt, a, grid, stream);
      else if (mode == kModeExact) launch_nt<kModeExact, true, false>(nt, a, grid, stream);
      else launch_nt<kModeE4m3, true, false>(nt, a, grid, stream);
    } else {
      if (mode == kModeFp8) launch_nt<kModeFp8, false, false>(nt, a, grid, stream);
      else if (mode == kModeExact) launch_nt<kModeExact, false, false>(nt, a, grid, stream);
      else launch_nt<kModeE4m3, false, false>(nt, a, grid, stream);
    }
  }
  if (owned) check(cudaFreeAsync(owned, stream), "cudaFreeAsync (score plan)");
}

int64_t score_bytes_read(const KeySource& keys, int32_t seq_len, BlockFilter filter) {
  if (seq_len <= 0) return 0;
  const PageLayout& L = keys.layout;
  const int64_t max_local = (static_cast<int64_t>(seq_len) - 1) / kBlockTokens;
  int64_t bytes = 0;
  for (int64_t blk = 0; blk < max_local; ++blk) {
    if (filter.modulus > 1 && blk % filter.modulus != filter.residue) continue;
    int64_t lp;
    int32_t first, count;
    L.block_rows_on_rank(blk, keys.rank, &lp, &first, &count);
    bytes += static_cast<int64_t>(count) * key_bytes(L.dtype);
  }
  return bytes;
}

void launch_fill_neg_inf(float* p, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const int64_t blocks = std::min<int64_t>(ceil_div(n, 256), 4096);
  fill_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p, n, -INFINITY);
  INDEXCP_CUDA_LAUNCH_CHECK("fill kernel launch");
}

void launch_stage_fp8(const uint8_t* layer_base, const PageLayout& layout, int64_t cache_pages,
                      const int32_t* pages, int64_t num_pages, uint8_t* out, cudaStream_t stream) {
  if (num_pages <= 0) return;
  INDEXCP_REQUIRE(num_pages < (int64_t{1} << 31), "num_pages = " + std::to_string(num_pages) + " exceeds one launch (2^31 - 1)");
  stage_fp8_kernel<<<static_cast<unsigned>(num_pages), 128, 0, stream>>>(layer_base, layout, cache_pages, pages, out);
  INDEXCP_CUDA_LAUNCH_CHECK("stage_fp8 kernel launch");
}

}  // namespace indexcp::cuda::detail
