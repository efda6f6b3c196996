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
// (exact in fp16) on the tensor cores with mma.sync.m16n8k16 (fp32 accumulation), or, for 16 to
// 128 query vectors per CTA (NT = 2 .. 16; 64 and 128 are the prefill's wide tiles, one CTA per
// multiprocessor; NVFP4 stock pages from 32, NT = 4: INDEXCP_SCORE_WGMMA_MIN_NT_STOCK) in the sm_90a
// code, with wgmma.m64nNk16, N = 8 NT (A =
// the same fragments from registers, B = the query vectors in shared memory). A thread of a
// quad holds 32 consecutive dimensions of its two rows; the k order of the MMA is a fixed
// permutation of the 128 dimensions (score/form.hpp, the dot-product form, tested on the CPU),
// the same in every scorer of this backend, so a (query,
// head, token) dot product has the same bits wherever it is computed: mma.sync and wgmma compute
// each 16-product step alike (tests/gpu/test_gpu_decode.cpp, All/GpuHeadWidth.*, compares every
// score of a head scored alone (mma.sync), in a pair (wgmma; mma.sync on NVFP4 stock pages) and
// with all four heads (wgmma) bit for bit).
//   - NVFP4, E4M3 rounding: k_hat = e4m3(|e2m1| * |scale|) from a 256 x 8 byte table (one entry
//     per scale byte, built on the host with formats.hpp, the scale's sign in each byte's top
//     bit), looked up with prmt, the code's sign XORed in; the signed E4M3 bytes become fp16 pairs
//     through cvt.rn.f16x2.e4m3x2 (exact).
//   - FP8 keys (cache or staged): the same conversion of the stored bytes.
//   - NVFP4, exact rounding: fp16 of |e2m1| by prmt, sign, times the scale (hmul2, exact).
// indexer_score_precision "fp8_mma" (template flag M8): the signed E4M3 bytes (the table's for
// NVFP4 with E4M3 rounding, the stored ones for FP8 keys) go unconverted to the FP8 tensor cores,
// wgmma m64nNk32.e4m3 at every width, the queries as raw E4M3 bytes in the same core-matrix
// layout (form.hpp, form8_dim; docs/precision.md for the accuracy of the mode).
// In either mode, requests with more than 128 query vectors whose keys are the prefill gather's FP8
// rows or a cache with R >= 128 (E4M3 rounding for NVFP4) go to gemm8_score_kernel instead
// (score/gemm8.cuh: 256 vectors per CTA, keys in the wgmma B operand, queries as A; fp8_mma: FP8 keys
// copied as they are, NVFP4 keys expanded; fp32 ("gemm16"): keys and queries converted to fp16 in
// shared memory; the same products in the same k order, so the same bits).
// INDEXCP_SCORE_GEMM8=0 keeps the tiles in fp8_mma, INDEXCP_SCORE_GEMM16=0 in fp32.
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
#include "score/ptx.cuh"
#include "score/schedule.cuh"
#include "score/tiles.cuh"
#include "score/gemm8.cuh"

namespace indexcp::cuda::detail {

namespace {

// M8: the fp8_mma form (indexer_score_precision "fp8_mma"): wgmma m64nNk32 on the E4M3 bytes for
// every NT in the sm_90a code, so that the one chain of 4 MMAs per tile is the same in every
// scorer (the compute_90 PTX, without wgmma, multiplies them with mma.sync.m16n8k32).
template <int MODE, int NT, bool STOCK, bool GATHER, bool M8>
__global__ void __launch_bounds__(warps_of<MODE>() * 32, minb_of<MODE, NT>()) score_kernel(const ScoreArgs a) {
  constexpr int kWarps = warps_of<MODE>(), kThreads = kWarps * 32;
  // (NVFP4 stock tiles of NT = 2 by mma.sync: INDEXCP_SCORE_WGMMA_MIN_NT_STOCK; FP8 keys keep wgmma,
  // 0.5-1% faster there: bench/NOTES.md v32)
  constexpr bool WG = M8 ? static_cast<bool>(INDEXCP_HAVE_WGMMA) : kWgmmaTiles<NT, STOCK && MODE != kModeFp8>;
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int HALF = half_bytes<MODE>();
  constexpr int ROWB = MODE == kModeFp8 ? kHeadDim : kNvfp4DataBytesPerKey;
  constexpr float kScale = 1.0f;  // the fp16 operands hold the key values themselves
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
  const int32_t n0 = blockIdx.y * NT * 8;
  // the local plan is this slice's: its work ends at its last row's historical blocks
  const Slice sl = a.plan_local ? Slice{n0, (n0 + NT * 8 - 1) / a.nh} : Slice{};
  const int32_t* plan = a.plan;
  if (a.plan_local) {
    __shared__ typename cub::BlockScan<int32_t, kThreads>::TempStorage scan_tmp;
    int32_t* splan = reinterpret_cast<int32_t*>(meta + kWarps * kBuf * 4);  // [kPlanLocal + 1]
    plan_block<GATHER, kThreads>(a, sl, splan, scan_tmp);
    plan = splan;
  }
  const int64_t total = plan[B];
  const int64_t p0 = total * blockIdx.x / gridDim.x, p1 = total * (blockIdx.x + 1) / gridDim.x;
  if (p0 >= p1) return;

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
        if constexpr (GATHER) c->ri = request_info(a, b, sl);  // (read by the gather's copy issue only)
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
    if (s < c.end && half_chunk<STOCK, GATHER>(a, G, c.b, request_info(a, c.b, sl), s, kk & 1, lane % nch, &ch)) {
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
    const ReqInfo ri = request_info(a, b, sl);
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
        const int d = form_dim(s, ln & 3, 0, 0);  // k-step s takes dims d .. d + 3 (form.hpp)
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
      uint2 v{0u, 0u};
      // the byte of w of each half follows form_dim (w holds dims d .. d + 3 of k-step s)
      static_assert(form_dim(0, 0, 0, 1) == form_dim(0, 0, 0, 0) + 1 && form_dim(0, 0, 1, 0) == form_dim(0, 0, 0, 0) + 2 &&
                        form_dim(0, 0, 1, 1) == form_dim(0, 0, 0, 0) + 3 && form_dim(1, 0, 0, 0) == form_dim(0, 0, 0, 0) + 4,
                    "the query pairs below assume form_dim's order");
      if constexpr (M8) {  // the E4M3 bytes themselves: k-step s8 = s / 2 takes the words of fp16
                           // k-steps 2 s8, 2 s8 + 1 (form8_dim) as its halves
        uint32_t* qw = reinterpret_cast<uint32_t*>(qf);
        if constexpr (WG) qw[wg_b_index<NT>(s >> 1, nt * 8 + (ln >> 2), s & 1, ln & 3)] = w;  // bytes, k32 core matrices
        else qw[2 * BFrags<NT>::index(s >> 1, nt, ln) + (s & 1)] = w;                       // (b0, b1) in slot s8
        continue;
      } else {
        v.x = q_pair_bytes(w & 0xffu, (w >> 8) & 0xffu);          // first pair: dims d, d + 1
        v.y = q_pair_bytes((w >> 16) & 0xffu, (w >> 24) & 0xffu);  // second pair: dims d + 2, d + 3
      }
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
    constexpr int kOut = scatter_count<2 * NT>();  // scores a lane writes per flush (1, or 2 / 4 for NT = 8 / 16)
    int64_t obase[kOut];
    int32_t olim[kOut];
#pragma unroll
    for (int o = 0; o < kOut; ++o) {
      obase[o] = 0;
      olim[o] = 0;
      const int v = scatter_value<2 * NT>(g) + o;
      const int32_t cc = scatter_writer<2 * NT>(g) ? scol[(v >> 1) * 8 + 2 * t4 + (v & 1)] : -1;
      if (cc >= 0) {
        const int32_t i = cc >> 6, hh = cc & 63;
        olim[o] = (ri.seq - ri.cnt + i) >> 7;
        obase[o] = ((static_cast<int64_t>(ri.row0) + i) * a.nh + hh) * a.max_blocks;
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
#pragma unroll
        for (int o = 0; o < kOut; ++o)
          if (cur < olim[o]) a.scores[obase[o] + cur] = v[o] * kScale;  // historical for this row only
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
#pragma unroll 1
            for (int t = 0; t < rc_half / 16; ++t) {
              if constexpr (M8) score_tile_wg8<MODE, NT>(st, c * rc_half + t * 16, g, t4, lut, desc, ok, rm);
              else score_tile_wg<MODE, NT>(st, c * rc_half + t * 16, g, t4, lut, desc, ok, rm);
            }
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
            auto tile = [&](int t) {
              if constexpr (M8) score_tile8<MODE, NT>(st, c * ch.nrows + t * 16, g, t4, lut, bq, rm);
              else score_tile<MODE, NT>(st, c * ch.nrows + t * 16, g, t4, lut, bq, rm);
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

// CTAs along x share each query slice's work items: ceil(2 x resident / slices) per slice, two to
// four waves over all slices (grid.y: prefill chunks have hundreds), not a full wave per slice,
// whose CTAs would each get a few items or none and spend the launch on their prologue
unsigned grid_x(int per_sm, unsigned gy) {
  const int64_t resident = static_cast<int64_t>(std::max(1, per_sm)) * sm_count();
  unsigned gx = static_cast<unsigned>(std::clamp<int64_t>(ceil_div(2 * resident, static_cast<int64_t>(gy)), 1, resident));
  if (const char* e = ::indexcp::detail::knob_env("INDEXCP_SCORE_CTAS")) gx = static_cast<unsigned>(std::max(1, std::atoi(e)));
  return gx;
}

template <int MODE, int NT, bool STOCK, bool GATHER, bool M8>
void launch_t(const ScoreArgs& a, dim3 grid, cudaStream_t stream) {
  constexpr int smem = score_smem_bytes<MODE, NT>(), kThreads = warps_of<MODE>() * 32;
  static_assert(smem <= 227 * 1024, "shared memory");
  auto k = score_kernel<MODE, NT, STOCK, GATHER, M8>;
  check(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
        "cudaFuncSetAttribute (score kernel shared memory)");
  if (!a.plan_local) {
    plan_kernel<GATHER><<<1, 1024, 0, stream>>>(a, const_cast<int32_t*>(a.plan));
    INDEXCP_CUDA_LAUNCH_CHECK("score plan kernel launch");
  }
  int per_sm = 0;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, kThreads, smem), "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  k<<<dim3(grid_x(per_sm, grid.y), grid.y), kThreads, smem, stream>>>(a);
  INDEXCP_CUDA_LAUNCH_CHECK("score kernel launch");
}

// The GEMM-shaped scorer of E4M3 keys (score/gemm8.cuh, both modes): 256 query vectors per CTA, one
// CTA per multiprocessor. Without the persistent grid (gemm8_persistent), CTAs along x share each
// slice's pairs as in grid_x, but their number is chosen for whole waves: the fewest from ceil(2 x
// resident / slices) up whose CTAs fill their waves to at least 90% on average (else the best fill
// up to 4 waves): at the prefill's 64 slices and 132 multiprocessors, 6 per slice (384 CTAs, 97%)
// rather than 5 (320, 81%).
unsigned gemm8_grid_x(int per_sm, unsigned gy) {
  const int64_t resident = static_cast<int64_t>(std::max(1, per_sm)) * sm_count();
  const int64_t lo = std::clamp<int64_t>(ceil_div(2 * resident, static_cast<int64_t>(gy)), 1, resident);
  const int64_t hi = std::max(lo, ceil_div(4 * resident, static_cast<int64_t>(gy)));
  int64_t gx = lo;
  double best = 0.0;
  for (int64_t x = lo; x <= hi; ++x) {
    const int64_t ctas = x * gy;
    const double fill = static_cast<double>(ctas) / static_cast<double>(ceil_div(ctas, resident) * resident);
    if (fill > best + 1e-9) {
      best = fill;
      gx = x;
    }
    if (fill >= 0.9) break;
  }
  if (const char* e = ::indexcp::detail::knob_env("INDEXCP_SCORE_CTAS")) gx = std::max(1, std::atoi(e));
  return static_cast<unsigned>(gx);
}

// The value of an on-by-default knob (knob_env's result): on unless it is "0". (Each caller passes
// its own literal knob_env("NAME") call: tests/test_knobs.cpp finds the knobs a source reads by them.)
bool on_unless_zero(const char* e) { return !(e != nullptr && std::strcmp(e, "0") == 0); }

// The persistent grid of the GEMM-shaped scorer (INDEXCP_SCORE_G8_PERSISTENT, 1 by default): one
// CTA per multiprocessor, each taking an equal share of all slices' pairs. Only with the in-CTA plan
// and where each CTA's count of every slice's pairs stays small (slices x requests <= 65,536).
bool gemm8_persistent(const ScoreArgs& a, int64_t gy) {
  if (!a.plan_local || gy * a.rows.num_requests > 65536) return false;
  return on_unless_zero(::indexcp::detail::knob_env("INDEXCP_SCORE_G8_PERSISTENT"));
}

// Whether the persistent GEMM-shaped scorer plans a share's second segment in its prologue, so that
// neither role waits for the other at the switch (INDEXCP_SCORE_G8_PLAN_AHEAD, 1 by default; the
// same bits either way: bench/NOTES.md v31).
bool gemm8_plan_ahead() {
  return on_unless_zero(::indexcp::detail::knob_env("INDEXCP_SCORE_G8_PLAN_AHEAD"));
}

template <bool GATHER, bool NVFP4, bool F16, bool PROD = false>
void launch_gemm8(const ScoreArgs& a0, int64_t nvec_max, cudaStream_t stream) {
  constexpr int smem = gemm8_smem_bytes<F16, NVFP4, PROD>();
  constexpr int threads = g8_threads<PROD>();
  static_assert(smem + 5120 <= 227 * 1024, "shared memory: the dynamic part and up to 5 KiB of static (cub's scans: 3.5 KiB by ptxas, 5 KiB in the producer form)");
  const int64_t gy = ceil_div(nvec_max, static_cast<int64_t>(kG8Vectors));
  auto k = gemm8_score_kernel<GATHER, NVFP4, F16, PROD>;
  check(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
        "cudaFuncSetAttribute (gemm8 score kernel shared memory)");
  ScoreArgs a = a0;
  if (!a.plan_local) {
    plan_kernel<GATHER><<<1, 1024, 0, stream>>>(a, const_cast<int32_t*>(a.plan));
    INDEXCP_CUDA_LAUNCH_CHECK("score plan kernel launch");
  }
  int per_sm = 0;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, threads, smem), "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  dim3 grid;
  if (gemm8_persistent(a, gy)) {
    a.g8_slices = static_cast<int32_t>(gy);
    unsigned ctas = static_cast<unsigned>(std::max(1, per_sm) * sm_count());
    if (const char* e = ::indexcp::detail::knob_env("INDEXCP_SCORE_CTAS")) ctas = static_cast<unsigned>(std::max(1, std::atoi(e)));
    grid = dim3(ctas, 1);
  } else {
    grid = dim3(gemm8_grid_x(per_sm, static_cast<unsigned>(gy)), static_cast<unsigned>(gy));
  }
  k<<<grid, threads, smem, stream>>>(a);
  INDEXCP_CUDA_LAUNCH_CHECK("gemm8 score kernel launch");
}

// Whether the fp8_mma form of the GEMM-shaped scorer runs with its producer warpgroup (score/gemm8.cuh,
// G8Form; the default, INDEXCP_SCORE_G8_PRODUCER=0 keeps the two-warpgroup form): the same bits
// either way (bench/NOTES.md v25).
bool gemm8_producer() {
  return on_unless_zero(::indexcp::detail::knob_env("INDEXCP_SCORE_G8_PRODUCER"));
}

// Whether the GEMM-shaped scorer takes the E4M3 keys of a launch in its mode (m8: fp8_mma). fp8_mma:
// unless INDEXCP_SCORE_GEMM8 is 0; fp32: unless INDEXCP_SCORE_GEMM16 is 0 (bench/NOTES.md v20,
// v21). Either keeps the tile scorer's bits. Only where its code exists: a build with an sm_90a
// cubin and wgmma (INDEXCP_BUILD_SM90A from src/cuda/CMakeLists.txt, INDEXCP_SCORE_WGMMA), run on
// compute capability 9.0.
#ifndef INDEXCP_BUILD_SM90A
#define INDEXCP_BUILD_SM90A 0
#endif
bool gemm8_enabled(bool m8) {
  if (!INDEXCP_BUILD_SM90A || !INDEXCP_SCORE_WGMMA) return false;
  const char* e = m8 ? ::indexcp::detail::knob_env("INDEXCP_SCORE_GEMM8") : ::indexcp::detail::knob_env("INDEXCP_SCORE_GEMM16");
  if (!on_unless_zero(e)) return false;
  int dev = 0, major = 0, minor = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "cudaDeviceGetAttribute");
  check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), "cudaDeviceGetAttribute");
  return major == 9 && minor == 0;
}

template <int MODE, bool STOCK, bool GATHER, bool M8 = false>
void launch_nt(int nt, const ScoreArgs& a, dim3 grid, cudaStream_t stream) {
  if (nt == 1) launch_t<MODE, 1, STOCK, GATHER, M8>(a, grid, stream);
  else if (nt == 2) launch_t<MODE, 2, STOCK, GATHER, M8>(a, grid, stream);
  else if (nt == 4) launch_t<MODE, 4, STOCK, GATHER, M8>(a, grid, stream);
  else if (nt == 8) launch_t<MODE, 8, STOCK, GATHER, M8>(a, grid, stream);
  else launch_t<MODE, 16, STOCK, GATHER, M8>(a, grid, stream);
}

thread_local const char* t_last_kernel = "";

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
  for (int s = 0; s < 256; ++s) form_khat_entry(static_cast<uint8_t>(s), &t[s].x, &t[s].y);
  check(cudaMemcpyToSymbol(g_khat_lut, t, sizeof(t)), "cudaMemcpyToSymbol (k_hat table)");
  g_tables_done[dev] = 1;
}

const char* last_score_kernel() { return t_last_kernel; }

void launch_score(const ScoreLaunch& s, cudaStream_t stream) {
  t_last_kernel = "";
  INDEXCP_REQUIRE(!s.fill_unscored || (s.rows.query_start != nullptr && !s.keys.gather),
                  "fill_unscored needs prefill rows (query_start) over a cache's own block table");
  auto fill_first = [&] {  // ScoreLaunch::fill_unscored by its own kernel
    if (s.fill_unscored)
      launch_fill_unscored(s.rows, s.nh, s.max_blocks, s.block_table, s.max_pages, s.keys.layout.page_size,
                           s.keys.num_pages, s.scores, stream);
  };
  if (s.rows.num_requests == 0 || s.nh == 0) {
    fill_first();
    return;
  }
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
  a.g8_slices = 0;
  a.fill_unscored = 0;
  a.g8_plan_ahead = gemm8_plan_ahead() ? 1 : 0;
  if (const char* e = ::indexcp::detail::knob_env("INDEXCP_SCORE_DEBUG")) a.debug = std::atoi(e);
  const PageLayout& L = s.keys.layout;
  const int32_t R = L.rows();
  INDEXCP_REQUIRE(static_cast<int64_t>(s.max_pages) * L.page_size < (int64_t{1} << 30),
          "max_pages x page_size must stay below 2^30 tokens per request");
  INDEXCP_REQUIRE(s.max_pages > 0, "max_pages must be > 0");
  // rows per rank: a multiple of 16 (formats.md section 7; PageLayout enforces it), so a 64-row
  // half-stage holds at most 4 chunks (the kernel's meta slots)
  INDEXCP_REQUIRE(R >= 16 && R % 16 == 0, "rows per rank must be a multiple of 16");
  check_score_mode(s.keys.gather ? KvDtype::kFp8 : L.dtype, s.mode, s.precision);
  const bool m8 = s.precision == ScorePrecision::kFp8Mma;
  const int mode = s.keys.gather || L.dtype == KvDtype::kFp8 ? kModeFp8
                   : s.mode == KRounding::kExact            ? kModeExact
                                                            : kModeE4m3;
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
  // query vectors per CTA: 8 NT, the fewest that hold a request's rows x heads, at most 128 (the
  // prefill's GEMM-shaped tiles: each expanded key tile serves 128 query vectors). The
  // INDEXCP_SCORE_MAX_NT knob caps NT (an experiment knob: 4 is the scorer before the wide tiles).
  int nt_cap = kMaxNt;
  if (const char* e = ::indexcp::detail::knob_env("INDEXCP_SCORE_MAX_NT")) {
    const int v = std::atoi(e);  // rounded down to 1, 2, 4, 8 or 16; not a number: the default
    if (v >= 1) {
      nt_cap = 1;
      while (nt_cap * 2 <= std::min(v, kMaxNt)) nt_cap *= 2;
    }
  }
  int nt = 1;
  while (nt < nt_cap && nvec_max > nt * 8) nt *= 2;
  const int64_t gy = ceil_div(nvec_max, nt * 8);
  INDEXCP_REQUIRE(gy <= 65535, "score launch too large (rows of one request x heads)");
  const dim3 grid(1, static_cast<unsigned>(gy));
  ensure_tables(stream);
  const bool stock = s.stock && R >= kBlockTokens;
  // the GEMM-shaped scorer: E4M3 keys (the gather's FP8 rows; FP8 or NVFP4 caches with E4M3
  // rounding (fp8_mma refuses exact; in fp32 exact keeps the tiles) of at least 128 rows per page)
  // and more than 128 query vectors per request (it holds 256 per CTA; INDEXCP_SCORE_MAX_NT below
  // 16 keeps the tiles): the fp8_mma form ("gemm8") or the fp32 form ("gemm16")
  const bool gemm = nt == kMaxNt && nvec_max > kMaxNt * 8 && (s.keys.gather || R >= kBlockTokens) && mode != kModeExact;
  // the -Inf fill (ScoreLaunch::fill_unscored): in the GEMM-shaped scorer's math warps at their start
  // (the producer form: after the prologue's plans; else before the first plan; gemm8.cuh), or its own kernel
  if (gemm && gemm8_enabled(m8)) a.fill_unscored = s.fill_unscored ? 1 : 0;
  else fill_first();
  if (gemm && m8 && gemm8_enabled(true)) {
    if (gemm8_producer()) {  // the producer warpgroup (INDEXCP_SCORE_G8_PRODUCER)
      if (s.keys.gather) launch_gemm8<true, false, false, true>(a, nvec_max, stream);
      else if (mode == kModeFp8) launch_gemm8<false, false, false, true>(a, nvec_max, stream);
      else launch_gemm8<false, true, false, true>(a, nvec_max, stream);
    } else {
      if (s.keys.gather) launch_gemm8<true, false, false>(a, nvec_max, stream);
      else if (mode == kModeFp8) launch_gemm8<false, false, false>(a, nvec_max, stream);
      else launch_gemm8<false, true, false>(a, nvec_max, stream);
    }
    t_last_kernel = gemm8_producer() ? "gemm8p" : "gemm8";
  } else if (gemm && !m8 && gemm8_enabled(false)) {
    if (s.keys.gather) launch_gemm8<true, false, true>(a, nvec_max, stream);
    else if (mode == kModeFp8) launch_gemm8<false, false, true>(a, nvec_max, stream);
    else launch_gemm8<false, true, true>(a, nvec_max, stream);
    t_last_kernel = "gemm16";
  } else if (m8) {
    if (s.keys.gather) launch_nt<kModeFp8, false, true, true>(nt, a, grid, stream);
    else if (stock && mode == kModeFp8) launch_nt<kModeFp8, true, false, true>(nt, a, grid, stream);
    else if (stock) launch_nt<kModeE4m3, true, false, true>(nt, a, grid, stream);
    else if (mode == kModeFp8) launch_nt<kModeFp8, false, false, true>(nt, a, grid, stream);
    else launch_nt<kModeE4m3, false, false, true>(nt, a, grid, stream);
  } else if (s.keys.gather) {
    launch_nt<kModeFp8, false, true>(nt, a, grid, stream);
  } else {
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
  if (*t_last_kernel == '\0') t_last_kernel = "tiles";
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

}  // namespace indexcp::cuda::detail
