// Exact top-k selection, publish and merge of the CUDA backend (spec/indexer.md sections 4-5).
//
// A candidate's key is K = score_key(score) + 1 (score_key: the order-preserving map of
// indexer.md section 3, NaN lowest, -0.0 == +0.0) or 0 when it is not a candidate; the order is
// (K desc, block id asc), a total order without ties. Two select / publish kernels, the same
// selections (the GPU tests run the exactness suites with each, INDEXCP_SELECT):
//   warp kernel, one warp per (row, head), for many problems (throughput): the keys of the row are
//   staged once in shared memory (kStageIlp loads per thread in flight; instances staging rows of
//   up to 512, 1,024 (select only) or 1,536 blocks, the smallest one max_blocks allows); fast path:
//   the kk-th largest of the 32 per-lane maxima bounds the boundary from below (kk <= 32;
//   otherwise every candidate survives); when at most 64 keys survive they are sorted by a warp
//   bitonic sort and the selection is their first entries (select writes them in id order, each
//   at its id's rank among them); fallback (plateaus of equal scores, many survivors): bisection
//   on the 32-bit key, then the equal keys taken in ascending id order. The select's 512 and
//   1,024 instances keep rows of up to 256 / 1,024 candidates in registers instead
//   (select_in_registers: the same bound, the survivors sorted as 32-bit keys, the ties and the
//   output from the survivors; more than 64 survivors take the staged path);
//   CTA kernel, 256 threads per (row, head), for few problems (latency): a radix select over the
//   32-bit keys (4 passes of 8 bits), the ties at the boundary taken in id order by a block scan.
//   merge: one warp per (row, head) over the W x (K-1) published candidates: up to 32 of them
//   (W = 2, K = 16) one per lane, sorted by id once (a warp bitonic sort), deduplicated by
//   neighbours and selected by counting ranks across the warp; more of them in shared memory, by
//   counting.
// Nothing is approximate: the selection is exactly the CPU's on the same scores.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <cub/block/block_scan.cuh>

#include "common.cuh"
#include "kernels.cuh"
#include "rows.cuh"
#include "core/knobs.hpp"

namespace indexcp::cuda::detail {

namespace {

constexpr int kWarpsPerCta = 4;
constexpr int kSurv = 64;      // survivors kept (shared-memory slots) and sorted (fast path)
constexpr int kStageIlp = 8;   // keys in flight per thread while a row is staged (warp and CTA kernels)
constexpr int kStaged = 1536;  // keys staged per warp: rows of up to 1536 blocks (196K tokens);
                               // longer rows are read from L2 directly (correct, slower)
// The select / publish warp kernel's second instance, for launches whose rows have at most 512
// blocks (64K tokens: the scores' row stride, max_blocks, says so): a quarter of the shared memory
// per warp, so twice the warps per multiprocessor (then the registers bound them), for a kernel
// that waits on its loads and shuffles (bench/NOTES.md, v24).
constexpr int kStagedSmall = 512;
// The select kernel's (not the publish's) third instance, for rows of at most 1024 blocks (128K
// tokens): without the publish's indices its warps need 4.5 KiB each, so that registers, not shared
// memory, bound the warps per multiprocessor (bench/NOTES.md v28).
constexpr int kStagedMid = 1024;

// IDX: the publish's candidate indices (select has none: a third less shared memory per warp, so
// more warps per multiprocessor)
template <int STAGED, bool IDX = true>
struct WarpSmemT {
  uint32_t key[STAGED];             // select / publish: candidate keys (publish: compacted); merge: K and ids
  uint16_t idx[IDX ? STAGED : 2];   // publish: the candidate index (block - init) of each compacted key
  uint32_t skey[kSurv];
  int32_t sidx[kSurv];
};
using WarpSmem = WarpSmemT<kStaged>;

__device__ __forceinline__ uint32_t lanemask_lt() { return (1u << (threadIdx.x & 31)) - 1u; }

// (K, i) better than (K2, i2) in the order (K desc, i asc)
__device__ __forceinline__ bool better(uint32_t k, int32_t i, uint32_t k2, int32_t i2) {
  return k > k2 || (k == k2 && i < i2);
}

// Ascending bitonic sort of 32 keys, one per lane (all 32 lanes take part); T: uint32_t or uint64_t.
template <class T>
__device__ __forceinline__ T warp_sort_asc(T v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int k = 2; k <= 32; k <<= 1) {
#pragma unroll
    for (int j = k >> 1; j > 0; j >>= 1) {
      const T o = __shfl_xor_sync(0xffffffffu, v, j);
      const bool keep_min = ((lane & j) == 0) == ((lane & k) == 0);
      v = keep_min ? (o < v ? o : v) : (o > v ? o : v);
    }
  }
  return v;
}

// Sorts the S <= kSurv (= 64) survivors in sh.skey / sh.sidx into the order (K desc, index asc):
// a bitonic sort on the composite key K << 32 | ~index (indices are unique, so the order is
// total; empty slots are 0 and sort last) of 32 slots, one per lane, when S <= 32, else of 64
// slots, slot p = 32 r + lane in register v[r].
template <class Smem>
__device__ __forceinline__ void sort_survivors(int S, Smem& sh) {
  static_assert(kSurv == 64, "two slots per lane");
  const int lane = threadIdx.x & 31;
  if (S <= 32) {  // one slot per lane: ascending on ~key is descending on key
    uint64_t v = lane < S ? (static_cast<uint64_t>(sh.skey[lane]) << 32 | static_cast<uint32_t>(~sh.sidx[lane])) : 0u;
    __syncwarp();
    v = ~warp_sort_asc(~v);
    if (lane < S) {
      sh.skey[lane] = static_cast<uint32_t>(v >> 32);
      sh.sidx[lane] = static_cast<int32_t>(~static_cast<uint32_t>(v));
    }
    __syncwarp();
    return;
  }
  uint64_t v[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int p = 32 * r + lane;
    v[r] = p < S ? (static_cast<uint64_t>(sh.skey[p]) << 32 | static_cast<uint32_t>(~sh.sidx[p])) : 0u;
  }
  __syncwarp();
#pragma unroll
  for (int k = 2; k <= 64; k <<= 1) {
#pragma unroll
    for (int j = k >> 1; j > 0; j >>= 1) {
      if (j == 32) {  // k = 64: slots lane and lane + 32, both in this lane
        const uint64_t hi = v[0] > v[1] ? v[0] : v[1], lo = v[0] > v[1] ? v[1] : v[0];
        v[0] = hi;
        v[1] = lo;
        continue;
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int p = 32 * r + lane;
        const uint64_t o = __shfl_xor_sync(0xffffffffu, v[r], j);
        // descending overall: the lower slot of a pair keeps the larger key in runs where
        // (p & k) == 0, the smaller one elsewhere
        const bool keep_max = ((p & j) == 0) == ((p & k) == 0);
        v[r] = keep_max ? (o > v[r] ? o : v[r]) : (o < v[r] ? o : v[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int p = 32 * r + lane;
    if (p < S) {
      sh.skey[p] = static_cast<uint32_t>(v[r] >> 32);
      sh.sidx[p] = static_cast<int32_t>(~static_cast<uint32_t>(v[r]));
    }
  }
  __syncwarp();
}

// The boundary of the kk best (by (K desc, index asc)) among n keys given by key(i) (0 = not a
// candidate). On return the selection is { K(i) > 0 and (K, i) not worse than (*tk, *ti) }.
// *surv > 0 when sh.skey / sh.sidx hold every selected element (and possibly more) in the order
// (K desc, index asc), so the selected ones are the first entries.
template <class Key, class Smem>
__device__ void warp_boundary(int32_t n, int32_t kk, Key key, Smem& sh, uint32_t* tk, int32_t* ti, int* surv) {
  const int lane = threadIdx.x & 31;
  *surv = 0;
  uint32_t lm = 0;
  int cnt = 0;
#pragma unroll 4
  for (int32_t i = lane; i < n; i += 32) {
    const uint32_t k = key(i);
    cnt += k != 0;
    lm = k > lm ? k : lm;
  }
  const int V = __reduce_add_sync(0xffffffffu, cnt);
  uint32_t t0 = 1;
  if (V > kk && kk <= 32) {
    int ge = 0;
    for (int o = 0; o < 32; ++o) ge += __shfl_sync(0xffffffffu, lm, o) >= lm;
    const uint32_t cand = (lm != 0 && ge >= kk) ? lm : 1u;
    t0 = __reduce_max_sync(0xffffffffu, cand);
  }
  int sc = 0;
#pragma unroll 4
  for (int32_t i = lane; i < n; i += 32) sc += key(i) >= t0;
  const int S = __reduce_add_sync(0xffffffffu, sc);
  if (S <= kSurv) {
    int base = 0;
#pragma unroll 4
    for (int32_t i0 = 0; i0 < n; i0 += 32) {
      const int32_t i = i0 + lane;
      const uint32_t k = i < n ? key(i) : 0u;
      const bool sv = k >= t0 && k != 0;
      const unsigned m = __ballot_sync(0xffffffffu, sv);
      if (sv) {
        const int p = base + __popc(m & lanemask_lt());
        sh.skey[p] = k;
        sh.sidx[p] = i;
      }
      base += __popc(m);
    }
    __syncwarp();
    sort_survivors(S, sh);
    if (V <= kk) {  // all of them
      *tk = 1u;
      *ti = INT_MAX;
    } else {  // the kk-th best
      *tk = sh.skey[kk - 1];
      *ti = sh.sidx[kk - 1];
    }
    *surv = S;
    return;
  }
  if (V <= kk) {
    *tk = 1u;
    *ti = INT_MAX;
    return;
  }
  // fallback: the largest T with #{K >= T} >= kk, bit by bit
  uint32_t T = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const uint32_t c = T | (1u << bit);
    int ge = 0;
    for (int32_t i = lane; i < n; i += 32) ge += key(i) >= c;
    if (__reduce_add_sync(0xffffffffu, ge) >= kk) T = c;
  }
  int gt = 0;
  for (int32_t i = lane; i < n; i += 32) gt += key(i) > T;
  int need = kk - __reduce_add_sync(0xffffffffu, gt);  // >= 1 equal keys, taken in index order
  int32_t last = -1;
  for (int32_t i0 = 0; i0 < n && need > 0; i0 += 32) {
    const int32_t i = i0 + lane;
    const bool eq = i < n && key(i) == T;
    const unsigned m = __ballot_sync(0xffffffffu, eq);
    const int c = __popc(m);
    if (c >= need) {
      // the need-th set bit of m
      unsigned mm = m;
      for (int q = 1; q < need; ++q) mm &= mm - 1;
      last = i0 + __ffs(mm) - 1;
      need = 0;
    } else {
      need -= c;
    }
  }
  *tk = T;
  *ti = last;
}

// Descending sort of 32 keys, one per lane (all 32 lanes take part): lane 0 the largest.
__device__ __forceinline__ uint32_t warp_sort_desc32(uint32_t v) { return ~warp_sort_asc<uint32_t>(~v); }

__device__ __forceinline__ void write_all_visible(int64_t n, int32_t K, int32_t* o) {
  for (int k = threadIdx.x & 31; k < K; k += 32) o[k] = k < n ? k : -1;
}

// The output frame of a selection (indexer.md section 4) of a row with more than topk visible
// blocks: the forced blocks 0 .. init-1, the chosen blocks in ascending id order from init, the
// row's local block right after them, then -1 up to topk. Its five writers (select_in_registers,
// the warp kernel's staged path, the CTA kernel, the merge's two paths) differ only in how they
// find the chosen ids and their places, so the frame is written here once and each writer passes
// chosen(put): it stores every chosen id by put(p, id) (o[init + p] = id, p its rank in id order
// among the chosen) and returns how many it chose, the same on every thread. The tail comes after
// the chosen ids because some writers count them only while storing them (the staged path without
// survivors, the merge's shared-memory path). Thread t of `threads` writes every threads-th entry
// of the fixed parts. The chosen ids lie in [init, local) and number at most kk = topk - 1 - init,
// so the local block appears once and always fits (rows of at most topk visible blocks, where init
// may exceed them, never get here: write_trivial and write_all_visible take those). put and chosen
// are lambdas, inlined: each writer's code is that of its loops written out.
template <class Chosen>
__device__ __forceinline__ void write_selection(int32_t* o, int32_t init, int32_t local, int32_t topk, int t,
                                                int threads, Chosen&& chosen) {
  for (int k = t; k < init; k += threads) o[k] = k;
  const int got = chosen([&](int p, int32_t id) { o[init + p] = id; });
  for (int k = init + got + t; k < topk; k += threads) o[k] = k == init + got ? local : -1;
}

// One (row, head) problem of select / publish, as both kernels see it: the visible blocks, the
// candidates (blocks init .. local-1), the outputs, and the candidate key of spec/indexer.md
// section 3 (publish: only blocks of which this rank stores rows, and the block filter).
struct SelectProblem {
  int64_t row, n_vis;
  int32_t hh, kk, init, local, n;  // n: candidates
  bool publish;
  const float* sc;
  Candidate* oc;  // publish: kk candidates
  int32_t* o;     // select: topk ids
  int32_t P, R, lo_off, fmod, fres;

  // pub: publish (s.cands != nullptr, which the launch checked); a compile-time constant in each
  // kernel instance
  __device__ __forceinline__ SelectProblem(const SelectArgs& s, int64_t problem, bool pub) {
    // (problems < 2^31: launch_select checks it; a 32-bit division is a fraction of a 64-bit one)
    const uint32_t p32 = static_cast<uint32_t>(problem), nh32 = static_cast<uint32_t>(s.nh);
    row = p32 / nh32;
    hh = static_cast<int32_t>(p32 % nh32);
    const int64_t pos = row_position(s.rows, row);
    n_vis = pos < 0 ? 0 : pos / kBlockTokens + 1;
    kk = s.sel.topk - 1 - s.sel.init_blocks;
    init = s.sel.init_blocks;
    local = static_cast<int32_t>(n_vis - 1);
    n = local - init;
    sc = s.scores + (row * s.nh + hh) * s.max_blocks;
    publish = pub;
    oc = publish ? s.cands + (row * s.nh + hh) * kk : nullptr;
    o = publish ? nullptr : s.out + (row * s.out_heads + s.out_h0 + hh) * s.sel.topk;
    P = s.layout.page_size;
    R = s.layout.rows();
    lo_off = s.rank * R;
    fmod = s.filter.modulus;
    fres = s.filter.residue;
  }
  // Rows with at most topk visible blocks take them all (publish: no candidates); true when done.
  // Thread t of `threads` writes every threads-th entry.
  __device__ __forceinline__ bool write_trivial(int32_t topk, int t, int threads) const {
    if (n_vis > topk) return false;
    if (publish)
      for (int k = t; k < kk; k += threads) oc[k] = Candidate{-INFINITY, -1};
    else
      for (int k = t; k < topk; k += threads) o[k] = k < n_vis ? k : -1;
    return true;
  }
  // Is block init + i a candidate? (select: always; publish: the rank stores rows of it and the
  // block filter keeps it)
  __device__ __forceinline__ bool candidate(int32_t i) const {
    if (!publish) return true;
    const int32_t b = init + i;
    if (fmod > 1 && b % fmod != fres) return false;
    const int32_t u0 = (b * kBlockTokens) & (P - 1);  // the block's first page offset (P = 128 or 256)
    return u0 < lo_off + R && lo_off < u0 + kBlockTokens;  // rows on this rank
  }
  // K of candidate i (block init + i); 0 when it is not a candidate
  __device__ __forceinline__ uint32_t key(int32_t i) const {
    return candidate(i) ? score_key(sc[init + i]) + 1u : 0u;
  }
  // The keys of blocks init + i0 + STRIDE u + t (u < kStageIlp; 0 past n and for non-candidates):
  // all loads of the thread are issued before the first key is computed (a load followed by its
  // use made the select and publish kernels wait one L2 round trip per STRIDE blocks:
  // bench/NOTES.md, v10)
  template <int STRIDE>
  __device__ __forceinline__ void keys_batch(int32_t i0, int t, uint32_t (&kv)[kStageIlp]) const {
    float v[kStageIlp];
    bool ok[kStageIlp];
#pragma unroll
    for (int u = 0; u < kStageIlp; ++u) {
      const int32_t i = i0 + STRIDE * u + t;
      ok[u] = i < n && candidate(i);
      v[u] = ok[u] ? sc[init + i] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kStageIlp; ++u) kv[u] = ok[u] ? score_key(v[u]) + 1u : 0u;
  }
};

// The selection of one (row, head) problem whose candidates fit in registers (select only: n <=
// 32 RK, 1 <= kk <= 32), by one whole warp; the same selection as warp_boundary and the staged
// path (bench/NOTES.md v29: that path spent about 1,370 warp instructions per problem of the 32K
// prefill chunk, and the kernel was issue bound). Candidate i = 32 u + lane sits in kv[u], so index
// order is (u, lane) order. Steps:
//   1. t0 = the kk-th largest of the 32 lane maxima (a sort of 32 keys): at least kk keys are >= t0,
//      so the boundary key T (the kk-th largest key, with multiplicity) is >= t0, and every key the
//      selection takes is >= t0;
//   2. the S keys >= t0 ("survivors") compacted with their indices, in index order, to sk / si;
//      when S <= 64 they are sorted as 32-bit keys (one sort of 32, or two and a merge) and T is
//      the kk-th of them;
//   3. the selection, from the survivors alone (two per lane): the keys > T and the first
//      kk - #{K > T} keys == T in index order, written in ascending id order after the forced
//      blocks, then the local block and -1 (as the staged path).
// More than 64 survivors (plateaus of equal scores): false, with nothing written, and the caller
// takes the staged path. Only steps 1 and 2's loads, keys and compaction scale with RK, so the code
// stays short (v30: a path whose tie search, output and plateau fallback were unrolled over the 32
// keys of a lane was 12,448 SASS instructions long, the staged instance 4,336, and slower).
// RK: keys per lane (the 512 instance: 8, rows of up to 256 candidates, 32K tokens; the 1,024
// instance: 32, rows of up to 1,024, 128K tokens).
template <int RK>
__device__ __forceinline__ bool select_in_registers(const SelectProblem& pb, int32_t topk, uint32_t* sk, int32_t* si) {
  const int lane = threadIdx.x & 31;
  const int32_t n = pb.n, kk = pb.kk, init = pb.init;
  uint32_t kv[RK];
  {
    float v[RK];
#pragma unroll
    for (int u = 0; u < RK; ++u) {  // every load in flight before the first key
      const int32_t i = 32 * u + lane;
      v[u] = i < n ? pb.sc[init + i] : __int_as_float(0x7fffffff);  // past n: a NaN, key 0 (+ 0 below)
    }
#pragma unroll
    for (int u = 0; u < RK; ++u) kv[u] = score_key(v[u]) + static_cast<uint32_t>(32 * u + lane < n);
  }
  uint32_t lm = 0u;
#pragma unroll
  for (int u = 0; u < RK; ++u) lm = max(lm, kv[u]);
  const uint32_t t0 = max(__shfl_sync(0xffffffffu, warp_sort_desc32(lm), kk - 1), 1u);
  int S = 0;  // survivors, compacted in index order
#pragma unroll
  for (int u = 0; u < RK; ++u) {
    const uint32_t k = kv[u];
    const bool sv = k >= t0;
    const unsigned m = __ballot_sync(0xffffffffu, sv);
    const int p = S + __popc(m & lanemask_lt());
    if (sv && p < kSurv) {
      sk[p] = k;
      si[p] = 32 * u + lane;
    }
    S += __popc(m);
  }
  __syncwarp();
  if (S > kSurv) return false;  // (warp-uniform; the caller syncs the warp before sk is reused)
  const uint32_t ka = lane < S ? sk[lane] : 0u, kb = lane + 32 < S ? sk[lane + 32] : 0u;
  const int32_t ia = lane < S ? si[lane] : 0, ib = lane + 32 < S ? si[lane + 32] : 0;
  uint32_t T;
  if (S <= 32) {
    T = __shfl_sync(0xffffffffu, warp_sort_desc32(ka), kk - 1);
  } else {
    const uint32_t a = warp_sort_desc32(ka), b = warp_sort_desc32(kb);
    // the 32 largest of both: a bitonic sequence, then merged (descending)
    uint32_t c = max(a, __shfl_sync(0xffffffffu, b, 31 - lane));
#pragma unroll
    for (int j = 16; j > 0; j >>= 1) {
      const uint32_t o = __shfl_xor_sync(0xffffffffu, c, j);
      c = (lane & j) == 0 ? max(o, c) : min(o, c);
    }
    T = __shfl_sync(0xffffffffu, c, kk - 1);
  }
  // T >= t0 >= 1, so non-survivors (0) are never taken; need >= 1 keys equal to T, in index order
  // (the survivors' a half before their b half)
  const unsigned ea = __ballot_sync(0xffffffffu, ka == T), eb = __ballot_sync(0xffffffffu, kb == T);
  const int need = kk - __popc(__ballot_sync(0xffffffffu, ka > T)) - __popc(__ballot_sync(0xffffffffu, kb > T));
  const bool take_a = ka > T || (ka == T && __popc(ea & lanemask_lt()) < need);
  const bool take_b = kb > T || (kb == T && __popc(ea) + __popc(eb & lanemask_lt()) < need);
  const unsigned ta = __ballot_sync(0xffffffffu, take_a), tb = __ballot_sync(0xffffffffu, take_b);
  write_selection(pb.o, init, pb.local, topk, lane, 32, [&](auto put) {
    const int na = __popc(ta);  // chosen in the a halves, which come first in index order
    if (take_a) put(__popc(ta & lanemask_lt()), init + ia);
    if (take_b) put(na + __popc(tb & lanemask_lt()), init + ib);
    return na + __popc(tb);  // (kk)
  });
  __syncwarp();  // (the survivors' slots are read by every lane above)
  return true;
}

// The hashes of a step signature (plan.hpp: v[8] over seq_lens, v[9] over query_start), by one
// whole warp; every lane gets them.
__device__ __forceinline__ void step_hashes(const RowsView& rows, uint32_t& h8, uint32_t& h9) {
  const int lane = threadIdx.x & 31;
  h8 = 0u;
  h9 = 0u;
  for (int32_t i = lane; i < rows.num_requests; i += 32) h8 += step_signature_term(i, rows.seq_lens[i]);
  if (rows.query_start != nullptr)
    for (int32_t i = lane; i <= rows.num_requests; i += 32) h9 += step_signature_term(i, rows.query_start[i]);
  h8 = __reduce_add_sync(0xffffffffu, h8);
  h9 = __reduce_add_sync(0xffffffffu, h9);
}

// Word k of the signature of this step: the host fields of `sig` with the device hashes.
__device__ __forceinline__ uint32_t signature_word(const StepSignature& sig, int k, uint32_t h8, uint32_t h9) {
  uint32_t w = 0u;
#pragma unroll
  for (int j = 0; j < 16; ++j)
    if (k == j) w = j == 8 ? h8 : (j == 9 ? h9 : sig.v[j]);
  return w;
}

// The step signature of a plan's exchange record: warp 0 of block 0 of a publish.
__device__ __forceinline__ void write_step_signature(const RowsView& rows, const SignatureOut& so) {
  uint32_t h8, h9;
  step_hashes(rows, h8, h9);
  const int lane = threadIdx.x & 31;
  if (lane < 16) so.signature[lane] = signature_word(so.sig, lane, h8, h9);
}

// The merge's check of the step signatures, in two parts so that its loads leave with the row's
// first loads instead of after the candidates: SignatureLoads issues this lane's loads (its word of
// the first two ranks' signatures, seq_lens and query_start at lane + 32 u for u < kSigPre) as
// plain predicated loads whose values are consumed only later (a load consumed inside a loop made
// the whole warp wait one L2 round trip before the row's own loads); signatures_differ then
// computes the hashes (entries past 32 kSigPre by a loop of their own), and compares: true on every
// lane of the warp when some rank's record carries another signature than the step this rank
// merges (the merge's rows and the plan's fields in mg.expect).
constexpr int kSigPre = 4;  // hash entries per lane loaded up front: batches of up to 128 requests
struct SignatureLoads {
  int32_t seq[kSigPre] = {}, qs[kSigPre] = {};  // seq_lens / query_start at lane + 32 u (when in range)
  uint32_t first = 0u;  // word lane & 15 of rank lane >> 4's signature (when that rank exists)
};

__device__ __forceinline__ SignatureLoads signature_loads(const MergeLaunch& mg) {
  SignatureLoads l;
  const int lane = threadIdx.x & 31;
  const int32_t n = mg.rows.num_requests;
  if (lane >> 4 < mg.world) l.first = mg.signature[static_cast<int64_t>(lane >> 4) * mg.rank_stride * 2 + (lane & 15)];
#pragma unroll
  for (int u = 0; u < kSigPre; ++u)
    if (lane + 32 * u < n) l.seq[u] = mg.rows.seq_lens[lane + 32 * u];
  if (mg.rows.query_start != nullptr) {
#pragma unroll
    for (int u = 0; u < kSigPre; ++u)
      if (lane + 32 * u <= n) l.qs[u] = mg.rows.query_start[lane + 32 * u];
  }
  return l;
}

__device__ __forceinline__ bool signatures_differ(const MergeLaunch& mg, const SignatureLoads& l) {
  const int lane = threadIdx.x & 31;
  const int32_t n = mg.rows.num_requests;
  uint32_t h8 = 0u, h9 = 0u;
#pragma unroll
  for (int u = 0; u < kSigPre; ++u)
    if (lane + 32 * u < n) h8 += step_signature_term(lane + 32 * u, l.seq[u]);
  for (int32_t i = lane + 32 * kSigPre; i < n; i += 32) h8 += step_signature_term(i, mg.rows.seq_lens[i]);
  if (mg.rows.query_start != nullptr) {
#pragma unroll
    for (int u = 0; u < kSigPre; ++u)
      if (lane + 32 * u <= n) h9 += step_signature_term(lane + 32 * u, l.qs[u]);
    for (int32_t i = lane + 32 * kSigPre; i <= n; i += 32) h9 += step_signature_term(i, mg.rows.query_start[i]);
  }
  h8 = __reduce_add_sync(0xffffffffu, h8);
  h9 = __reduce_add_sync(0xffffffffu, h9);
  const uint32_t mine = signature_word(mg.expect, lane & 15, h8, h9);
  bool differ = (lane >> 4 < mg.world) && l.first != mine;
  for (int p = (lane >> 4) + 2; p < mg.world; p += 2)
    differ |= mg.signature[static_cast<int64_t>(p) * mg.rank_stride * 2 + (lane & 15)] != mine;
  return __any_sync(0xffffffffu, differ);
}

__device__ __forceinline__ bool signatures_differ(const MergeLaunch& mg) {
  return signatures_differ(mg, signature_loads(mg));
}

// keys per lane of select_in_registers in the select instance staging STAGED keys
template <int STAGED>
constexpr int kRegKeys = STAGED <= kStagedSmall ? 8 : 32;

// PUBLISH: a kernel instance each for select and publish (one instance holding both paths was
// 9,144 instructions long and stalled on instruction fetch: bench/NOTES.md, v10). REGS (select
// only, the 512 and 1,024 instances): rows of up to 32 kRegKeys<STAGED> candidates (and kk <= 32)
// take select_in_registers; instances of their own, so that the others keep their registers
// (inlined into every instance, its first form took the 1,024 one from 40 to 48 registers). Their
// minimum CTAs per multiprocessor: 12 holds the 512 one at 40 registers without a spill (48
// without the bound); 5 lets the 1,024 one keep 95 (127 without; 80 or fewer spill), 20 warps per
// multiprocessor (bench/NOTES.md v30).
// TRACE (select only, tests: SelectLaunch::paths): each problem's SelectPath written to `paths`
// (nullptr and unused otherwise). Instances of their own, so that the others are compiled as
// without it: a store behind a test of `paths` in every instance, never taken in production, still
// moved ptxas's allocation in the 512 register instance, held at 40 registers (39 shared-memory
// addresses recomputed where one register had held them, some in the register path's survivor
// compaction).
template <bool PUBLISH, int STAGED, bool REGS = false, bool TRACE = false>
__global__ void __launch_bounds__(kWarpsPerCta * 32, REGS ? (STAGED <= kStagedSmall ? 12 : 5) : 1) select_warp_kernel(const SelectArgs s, const SignatureOut so, uint8_t* const paths) {
  __shared__ WarpSmemT<STAGED, PUBLISH> shm[kWarpsPerCta];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t problem = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + warp;
  if (PUBLISH && so.signature != nullptr && blockIdx.x == gridDim.x - 1) {  // the signature's own block
    if (warp == 0) write_step_signature(s.rows, so);
    return;
  }
  if (problem >= s.rows.rows * s.nh) return;
  WarpSmemT<STAGED, PUBLISH>& sh = shm[warp];
  const SelectProblem pb(s, problem, PUBLISH);
  const SelectionParams sel = s.sel;
  const int32_t kk = pb.kk, local = pb.local, nc = pb.n, init = pb.init;
  constexpr bool publish = PUBLISH;
  const float* sc = pb.sc;
  Candidate* oc = pb.oc;
  int32_t* o = pb.o;
  // TRACE: the path that produces this problem's selection (a register path that always gave up
  // would still select right, only slower, so the tests look here)
  auto note_path = [&](SelectPath p) {
    if constexpr (TRACE) {
      if (lane == 0) paths[problem] = static_cast<uint8_t>(p);
    }
  };
  if (pb.write_trivial(sel.topk, lane, 32)) {
    note_path(SelectPath::kTrivial);
    return;
  }
  SelectPath path = SelectPath::kStaged;
  if constexpr (!PUBLISH && REGS) {  // rows that fit: the keys stay in registers
    constexpr int RK = kRegKeys<STAGED>;
    if (nc <= 32 * RK && kk <= 32) {
      if (select_in_registers<RK>(pb, sel.topk, sh.skey, sh.sidx)) {
        note_path(SelectPath::kRegisters);
        return;
      }
      path = SelectPath::kRegistersFellBack;
      __syncwarp();  // more than 64 survivors: the staged path, which rewrites the survivors' slots
    }
  }
  note_path(path);
  auto key_global = [&](int32_t i) -> uint32_t { return pb.key(i); };
  // stage the keys; publish compacts them to the blocks this rank stores (so that a periodic
  // validity pattern, e.g. every other block at P256, cannot defeat the per-lane filter)
  const bool staged = nc <= STAGED;
  int32_t n = nc;
  if (staged) {
    int base = 0;  // publish: the keys are compacted to the candidates
    for (int32_t i0 = 0; i0 < nc; i0 += kStageIlp * 32) {
      uint32_t kv[kStageIlp];
      pb.keys_batch<32>(i0, lane, kv);
#pragma unroll
      for (int u = 0; u < kStageIlp; ++u) {
        const int32_t i = i0 + 32 * u + lane;
        if (publish) {
          const unsigned m = __ballot_sync(0xffffffffu, kv[u] != 0);
          if (kv[u] != 0) {
            const int p = base + __popc(m & lanemask_lt());
            sh.key[p] = kv[u];
            sh.idx[p] = static_cast<uint16_t>(i);
          }
          base += __popc(m);
        } else if (i < nc) {
          sh.key[i] = kv[u];
        }
      }
    }
    if (publish) n = base;
    __syncwarp();
  }
  auto key = [&](int32_t j) -> uint32_t { return staged ? sh.key[j] : key_global(j); };
  auto block_of = [&](int32_t j) -> int32_t { return init + ((staged && publish) ? static_cast<int32_t>(sh.idx[j]) : j); };
  uint32_t tk;
  int32_t ti;
  int S;
  warp_boundary(n, kk, key, sh, &tk, &ti, &S);
  auto selected = [&](uint32_t k, int32_t i) { return k != 0 && !better(tk, ti, k, i); };

  if constexpr (!PUBLISH) {  // ---- selection: [0..init), chosen ids ascending, local
    write_selection(o, init, local, sel.topk, lane, 32, [&](auto put) {
      int base = 0;
      if (S > 0) {  // the selection is a prefix of the sorted survivors; each one's place is its id's rank
        int c = 0;
        for (int e = lane; e < S; e += 32) c += selected(sh.skey[e], sh.sidx[e]);
        base = __reduce_add_sync(0xffffffffu, c);
        for (int e = lane; e < base; e += 32) {
          const int32_t id = sh.sidx[e];
          int p = 0;
#pragma unroll 4
          for (int f = 0; f < base; ++f) p += sh.sidx[f] < id;
          put(p, init + id);
        }
      }
      for (int32_t i0 = 0; S == 0 && i0 < nc; i0 += 32) {
        const int32_t i = i0 + lane;
        const bool take = i < nc && selected(key(i), i);
        const unsigned m = __ballot_sync(0xffffffffu, take);
        if (take) put(base + __popc(m & lanemask_lt()), init + i);
        base += __popc(m);
      }
      return base;
    });
  } else {
    // ---- publish: the selection ordered by (score desc, id asc), then empty entries
    int m = 0;
    if (S > 0) {  // survivors sorted: the selection is their first m entries, in publish order
      int c = 0;
      for (int e = lane; e < S; e += 32) {
        if (!selected(sh.skey[e], sh.sidx[e])) continue;
        ++c;
        const int32_t b = block_of(sh.sidx[e]);
        oc[e] = Candidate{sc[b], b};
      }
      m = __reduce_add_sync(0xffffffffu, c);
    } else {  // rounds of arg-max below the previous one, over the selection
      uint32_t pk = UINT_MAX;
      int32_t pi = -1;
      for (;; ++m) {
        uint32_t bk = 0;
        int32_t bi = INT_MAX;
        for (int32_t i = lane; i < n; i += 32) {
          const uint32_t k = key(i);
          if (selected(k, i) && better(pk, pi, k, i) && better(k, i, bk, bi)) {
            bk = k;
            bi = i;
          }
        }
        const uint32_t wk = __reduce_max_sync(0xffffffffu, bk);
        const int32_t wi = static_cast<int32_t>(__reduce_min_sync(0xffffffffu, static_cast<unsigned>(bk == wk ? bi : INT_MAX)));
        if (wk == 0) break;
        if (lane == 0) oc[m] = Candidate{sc[block_of(wi)], block_of(wi)};
        pk = wk;
        pi = wi;
      }
    }
    for (int k = m + lane; k < kk; k += 32) oc[k] = Candidate{-INFINITY, -1};
  }
}

// ---- select / publish: one CTA of kSelThreads per (row, head) --------------------------------
//
// The boundary (T, ti) of the kk best keys by (K desc, index asc) is found exactly by a radix
// select on the 32-bit keys, 8 bits per pass (a 256-bin histogram of the keys that match the
// digits fixed so far; the digit is where the suffix count reaches what is still needed), then
// the ties at T are taken in index order (an ordered scan). Nothing depends on the order of the
// histogram's atomics: the result is the same on every run and for every grid.

constexpr int kSelThreads = 256;
constexpr int kSelStaged = 4096;  // keys staged per CTA (rows up to 512K tokens); longer rows
                                  // read the scores from global memory in every pass
constexpr int kSelOut = 1024;     // selected entries kept for publish's ordering (kk <= 1022)

using SelScan = cub::BlockScan<int, kSelThreads>;

struct SelSmem {
  uint32_t key[kSelStaged];
  uint32_t sel_key[kSelOut];
  int32_t sel_idx[kSelOut];
  int hist[256];
  typename SelScan::TempStorage scan;
  uint32_t prefix;
  int remaining;
  int32_t tie_idx;
};

template <bool PUBLISH>
__global__ void __launch_bounds__(kSelThreads) select_cta_kernel(const SelectArgs s, const SignatureOut so) {
  __shared__ SelSmem sh;
  const int tid = threadIdx.x;
  if (PUBLISH && so.signature != nullptr && blockIdx.x == gridDim.x - 1) {  // the signature's own block
    if (tid < 32) write_step_signature(s.rows, so);
    return;
  }
  const SelectProblem pb(s, blockIdx.x, PUBLISH);
  const SelectionParams sel = s.sel;
  const int32_t kk = pb.kk, local = pb.local, n = pb.n, init = pb.init;
  const float* sc = pb.sc;
  Candidate* oc = pb.oc;
  int32_t* o = pb.o;
  if (pb.write_trivial(sel.topk, tid, kSelThreads)) return;
  auto key_global = [&](int32_t i) -> uint32_t { return pb.key(i); };
  const bool staged = n <= kSelStaged;
  int nonzero = 0;
  if (staged) {
    for (int32_t i0 = 0; i0 < n; i0 += kStageIlp * kSelThreads) {
      uint32_t kv[kStageIlp];
      pb.keys_batch<kSelThreads>(i0, tid, kv);
#pragma unroll
      for (int u = 0; u < kStageIlp; ++u) {
        const int32_t i = i0 + kSelThreads * u + tid;
        if (i < n) sh.key[i] = kv[u];
        nonzero += kv[u] != 0;
      }
    }
  } else {
    for (int32_t i = tid; i < n; i += kSelThreads) nonzero += key_global(i) != 0;
  }
  auto key = [&](int32_t i) -> uint32_t { return staged ? sh.key[i] : key_global(i); };
  int total;
  SelScan(sh.scan).ExclusiveSum(nonzero, nonzero, total);  // total: candidates of the row
  __syncthreads();
  // the boundary: T = the kk-th largest key (with multiplicity), ti = the last index taken at T
  uint32_t T = 1u;
  int32_t ti = INT_MAX;
  if (total > kk) {
    uint32_t prefix = 0, mask = 0;
    int remaining = kk;
    for (int shift = 24; shift >= 0; shift -= 8) {
      sh.hist[tid] = 0;
      __syncthreads();
      for (int32_t i = tid; i < n; i += kSelThreads) {
        const uint32_t k = key(i);
        if (k != 0 && (k & mask) == prefix) atomicAdd(&sh.hist[(k >> shift) & 255u], 1);
      }
      __syncthreads();
      const int x = sh.hist[255 - tid];  // thread t: digit 255 - t (descending)
      int cum;
      SelScan(sh.scan).InclusiveSum(x, cum);  // keys with digit >= 255 - t
      if (cum >= remaining && cum - x < remaining) {
        sh.prefix = prefix | (static_cast<uint32_t>(255 - tid) << shift);
        sh.remaining = remaining - (cum - x);
      }
      __syncthreads();
      prefix = sh.prefix;
      remaining = sh.remaining;
      mask |= 255u << shift;
      __syncthreads();
    }
    T = prefix;
    // ties at T: the first `remaining` in index order (each thread a contiguous range of indices)
    const int32_t per = (n + kSelThreads - 1) / kSelThreads;
    const int32_t a = min(n, tid * per), e = min(n, a + per);
    int eq = 0;
    for (int32_t i = a; i < e; ++i) eq += key(i) == T;
    int before;
    SelScan(sh.scan).ExclusiveSum(eq, before);
    if (before < remaining && before + eq >= remaining) {
      int c = before;
      for (int32_t i = a; i < e; ++i)
        if (key(i) == T && ++c == remaining) {
          sh.tie_idx = i;
          break;
        }
    }
    __syncthreads();
    ti = sh.tie_idx;
  }
  auto selected = [&](uint32_t k, int32_t i) { return k != 0 && (k > T || (k == T && i <= ti)); };
  // the selected entries in ascending index order: each thread's range, placed by a scan
  const int32_t per = (n + kSelThreads - 1) / kSelThreads;
  const int32_t a = min(n, tid * per), e = min(n, a + per);
  int cnt = 0;
  for (int32_t i = a; i < e; ++i) cnt += selected(key(i), i);
  int place, got;
  SelScan(sh.scan).ExclusiveSum(cnt, place, got);
  if constexpr (!PUBLISH) {  // ---- selection: [0..init), chosen ids ascending, local, then -1
    write_selection(o, init, local, sel.topk, tid, kSelThreads, [&](auto put) {
      for (int32_t i = a; i < e; ++i)
        if (selected(key(i), i)) put(place++, init + i);
      return got;
    });
  } else {
    // ---- publish: the selection ordered by (score desc, id asc), then empty entries
    for (int32_t i = a; i < e; ++i) {
      const uint32_t k = key(i);
      if (selected(k, i)) {
        sh.sel_key[place] = k;
        sh.sel_idx[place] = i;
        ++place;
      }
    }
    __syncthreads();
    for (int m = tid; m < got; m += kSelThreads) {
      const uint32_t k = sh.sel_key[m];
      const int32_t i = sh.sel_idx[m];
      int r = 0;
      for (int f = 0; f < got; ++f) r += better(sh.sel_key[f], sh.sel_idx[f], k, i);
      const int32_t b = init + i;
      oc[r] = Candidate{sc[b], b};
    }
    for (int k = got + tid; k < kk; k += kSelThreads) oc[k] = Candidate{-INFINITY, -1};
  }
}

// ---- merge ---------------------------------------------------------------------------------

__global__ void __launch_bounds__(kWarpsPerCta * 32) merge_kernel(const MergeLaunch mg) {
  __shared__ WarpSmem shm[kWarpsPerCta];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t problem = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + warp;
  if (problem >= mg.rows.rows * mg.nh) return;
  WarpSmem& sh = shm[warp];
  const int64_t row = problem / mg.nh;
  const int32_t hh = static_cast<int32_t>(problem % mg.nh);
  const int32_t h = mg.h0 + hh;
  const SelectionParams sel = mg.sel;
  const int32_t kk = sel.topk - 1 - sel.init_blocks;
  const int32_t init = sel.init_blocks;
  int32_t* o = mg.out + (row * mg.out_heads + mg.out_h0 + hh) * sel.topk;
  const int64_t per_rank = mg.rank_stride != 0 ? mg.rank_stride : mg.rows.rows * mg.heads * kk;
  // The plans' step signatures (did every rank run this step?): their loads are issued first, with
  // the row's seq_lens load, and checked on the fast path after its arithmetic, just before its
  // writes, so that the latencies overlap.
  SignatureLoads sig_loads;
  if (mg.signature != nullptr) sig_loads = signature_loads(mg);
  auto disagree = [&]() -> bool {
    if (mg.signature == nullptr) return false;
    const bool differ = signatures_differ(mg, sig_loads);
    if (mg.status != nullptr && problem == 0 && lane == 0)
      *mg.status = differ ? static_cast<uint32_t>(StepStatus::kRanksDisagree) : 0u;
    if (differ)
      for (int q = lane; q < sel.topk; q += 32) o[q] = -1;
    return differ;
  };
  const int64_t pos = row_position(mg.rows, row);
  const int64_t n_vis = pos < 0 ? 0 : pos / kBlockTokens + 1;
  if (n_vis <= sel.topk) {
    if (disagree()) return;
    write_all_visible(n_vis, sel.topk, o);
    return;
  }
  const int32_t local = static_cast<int32_t>(n_vis - 1);
  const int32_t m = mg.world * kk;  // <= kStaged / 2 (checked at launch)
  const Candidate* base_c = mg.cands + (row * mg.heads + h) * kk;
  if (m <= 32) {  // fast path (e.g. W = 2, K = 16): one entry per lane, one warp sort in registers
    uint32_t k = 0u;
    int32_t id = -1;
    Candidate c{0.0f, -1};
    if (lane < m) c = base_c[static_cast<int64_t>(lane / kk) * per_rank + lane % kk];
    if (lane < m) {
      id = c.block;
      k = (c.block >= init && c.block < local) ? score_key(c.score) + 1u : 0u;  // row's non-forced blocks only
    }
    // 1. by (id asc, K desc), non-candidates last: the first entry of each block is its best
    uint64_t v = k != 0u ? (static_cast<uint64_t>(static_cast<uint32_t>(id)) << 32 | ~k) : ~uint64_t{0};
    v = warp_sort_asc(v);
    id = static_cast<int32_t>(v >> 32);
    k = ~static_cast<uint32_t>(v);
    const int32_t prev = __shfl_up_sync(0xffffffffu, id, 1);
    const uint32_t kept = (k != 0u && (lane == 0 || prev != id)) ? k : 0u;  // K of a kept entry, else 0
    // 2. each kept entry's rank by (K desc, id asc) among the kept ones, by counting: the lanes
    //    hold ascending ids now, so an id tie is lane order (no second sort)
    int r = 0;
#pragma unroll
    for (int f = 0; f < 32; ++f) {
      const uint32_t kf = __shfl_sync(0xffffffffu, kept, f);
      r += (kf > kept || (kf == kept && f < lane)) ? 1 : 0;
    }
    const bool chosen = kept != 0u && r < kk;
    // 3. the selection in ascending id order: a chosen entry's place is the chosen lanes below it
    const unsigned cm = __ballot_sync(0xffffffffu, chosen);
    const int got = __popc(cm);
    if (disagree()) return;  // after the arithmetic, so that the check's latency hides behind it
    write_selection(o, init, local, sel.topk, lane, 32, [&](auto put) {
      if (chosen) put(__popc(cm & ((1u << lane) - 1u)), id);
      return got;
    });
    return;
  }
  if (disagree()) return;
  uint32_t* K = sh.key;                                          // K of entry e (0: not a candidate)
  int32_t* ID = reinterpret_cast<int32_t*>(sh.key + kStaged / 2);  // block id of entry e
  for (int32_t e = lane; e < m; e += 32) {
    const Candidate c = base_c[static_cast<int64_t>(e / kk) * per_rank + e % kk];
    ID[e] = c.block;
    K[e] = (c.block >= init && c.block < local) ? score_key(c.score) + 1u : 0u;  // row's non-forced blocks only
  }
  __syncwarp();
  // 1. deduplicate: an entry is dropped when another entry of the same block is better (max
  //    score, then the first); decisions first, then applied (bit j of `drop`: entry lane + 32j)
  uint32_t drop = 0;
  for (int32_t e = lane, j = 0; e < m; e += 32, ++j) {
    const uint32_t k = K[e];
    if (k == 0) continue;
    for (int32_t f = 0; f < m; ++f)
      if (f != e && ID[f] == ID[e] && (K[f] > k || (K[f] == k && f < e))) {
        drop |= 1u << j;
        break;
      }
  }
  __syncwarp();
  for (int32_t e = lane, j = 0; e < m; e += 32, ++j)
    if (drop >> j & 1u) K[e] = 0u;
  __syncwarp();
  // 2. the kk best of the kept entries by (K desc, id asc); ids are unique now
  uint32_t out_mask = 0;
  for (int32_t e = lane, j = 0; e < m; e += 32, ++j) {
    const uint32_t k = K[e];
    if (k == 0) continue;
    int r = 0;
    for (int32_t f = 0; f < m; ++f) r += K[f] > k || (K[f] == k && K[f] != 0 && ID[f] < ID[e]);
    if (r >= kk) out_mask |= 1u << j;
  }
  __syncwarp();
  for (int32_t e = lane, j = 0; e < m; e += 32, ++j)
    if (out_mask >> j & 1u) K[e] = 0u;
  __syncwarp();
  // 3. ascending ids: each selected entry's place among the selected
  write_selection(o, init, local, sel.topk, lane, 32, [&](auto put) {
    int cnt = 0;
    for (int32_t e = lane; e < m; e += 32) {
      if (K[e] == 0) continue;
      ++cnt;
      int p = 0;
      for (int32_t f = 0; f < m; ++f) p += K[f] != 0 && ID[f] < ID[e];
      put(p, ID[e]);
    }
    return __reduce_add_sync(0xffffffffu, cnt);
  });
}

__global__ void signature_kernel(const RowsView rows, const SignatureOut so) { write_step_signature(rows, so); }

__global__ void signature_status_kernel(const MergeLaunch mg) {
  const bool differ = signatures_differ(mg);
  if (threadIdx.x == 0) *mg.status = differ ? static_cast<uint32_t>(StepStatus::kRanksDisagree) : 0u;
}

thread_local const char* t_last_select = "";  // last_select_kernel

// A select instance of the warp kernel; its TRACE twin when the caller asks for the paths (tests).
template <int STAGED, bool REGS>
void launch_select_warp(unsigned ctas, const SelectArgs& s, uint8_t* paths, cudaStream_t stream) {
  if (paths != nullptr)
    select_warp_kernel<false, STAGED, REGS, true><<<ctas, kWarpsPerCta * 32, 0, stream>>>(s, SignatureOut{}, paths);
  else
    select_warp_kernel<false, STAGED, REGS><<<ctas, kWarpsPerCta * 32, 0, stream>>>(s, SignatureOut{}, nullptr);
}

}  // namespace

const char* last_select_kernel() { return t_last_select; }

// INDEXCP_SELECT = warp | cta forces a kernel (tests run both); otherwise the CTA kernel when the
// problems fit in one wave of 4 CTAs per SM (latency bound: the warp kernel would leave most
// schedulers idle), the warp kernel beyond (throughput: the CTA kernel does more work per key).
// H200, `indexcp bench topk`: select 256 problems 19.7 -> 11.8 us, publish 512 problems 30.7 ->
// 14.8 us with the CTA kernel; publish 2,048 problems 32.8 (warp) vs 41.6 us (CTA).
void launch_select(const SelectLaunch& launch, cudaStream_t stream) {
  t_last_select = "";
  const SelectArgs& s = launch;
  SignatureOut so;
  so.signature = launch.signature;
  so.sig = launch.sig;
  const int64_t problems = s.rows.rows * s.nh;
  if (problems == 0) {
    if (s.cands != nullptr && so.signature != nullptr) {  // a step without rows still signs its record
      signature_kernel<<<1, 32, 0, stream>>>(s.rows, so);
      INDEXCP_CUDA_LAUNCH_CHECK("signature kernel launch");
    }
    return;
  }
  INDEXCP_REQUIRE(problems < (int64_t{1} << 31), "select launch too large");
  bool cta;
  const char* e = ::indexcp::detail::knob_env("INDEXCP_SELECT");
  if (e && std::strcmp(e, "warp") == 0) {
    cta = false;
  } else if (e && std::strcmp(e, "cta") == 0) {
    cta = true;
  } else {
    int dev = 0, sms = 0;
    check(cudaGetDevice(&dev), "cudaGetDevice");
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
    cta = problems <= int64_t{4} * sms;
  }
  const bool publish = s.cands != nullptr;
  // the warp kernel's instance: the smallest staging that holds max_blocks (the scores' row stride,
  // so no row has more): 512 (select and publish), 1024 (select only), else 1536, rows longer than
  // that read from L2. INDEXCP_SELECT_STAGED = 512 | 1024 | 1536 forces one for every launch (the GPU
  // tests run each; any staging is correct for any row); 1024 means 1536 for a publish.
  int staged = s.max_blocks <= kStagedSmall ? kStagedSmall : (!publish && s.max_blocks <= kStagedMid) ? kStagedMid : kStaged;
  if (const char* es = ::indexcp::detail::knob_env("INDEXCP_SELECT_STAGED")) {
    const int v = std::strcmp(es, "512") == 0 ? kStagedSmall : std::strcmp(es, "1024") == 0 ? kStagedMid
                  : std::strcmp(es, "1536") == 0 ? kStaged : 0;
    INDEXCP_REQUIRE(v != 0,
                    std::string("INDEXCP_SELECT_STAGED = '") + es + "' must be 512, 1024 or 1536");
    staged = publish && v == kStagedMid ? kStaged : v;
  }
  // the select's register path (select_in_registers) in the 512 and 1,024 instances (rows of up to
  // 256 / 1,024 candidates): INDEXCP_SELECT_REGS=0 turns it off (the staged path then takes every
  // row; the GPU tests run both), 512 keeps it in the 512 instance only
  bool regs = true, regs_mid = true;
  if (const char* er = ::indexcp::detail::knob_env("INDEXCP_SELECT_REGS")) {
    INDEXCP_REQUIRE(std::strcmp(er, "0") == 0 || std::strcmp(er, "1") == 0 || std::strcmp(er, "512") == 0,
                    std::string("INDEXCP_SELECT_REGS = '") + er + "' must be 0, 1 or 512");
    regs = er[0] != '0';
    regs_mid = er[0] == '1';
  }
  if (staged == kStagedMid) regs = regs_mid;
  // a publish that signs its record gets one more block, which writes the signature alone (in
  // parallel with the problems: no block's work grows)
  const unsigned ctas = static_cast<unsigned>((cta ? problems : ceil_div(problems, kWarpsPerCta)) +
                                              (publish && so.signature != nullptr ? 1 : 0));
  if (cta && publish) select_cta_kernel<true><<<ctas, kSelThreads, 0, stream>>>(s, so);
  else if (cta) select_cta_kernel<false><<<ctas, kSelThreads, 0, stream>>>(s, SignatureOut{});
  else if (publish && staged == kStagedSmall) select_warp_kernel<true, kStagedSmall><<<ctas, kWarpsPerCta * 32, 0, stream>>>(s, so, nullptr);
  else if (publish) select_warp_kernel<true, kStaged><<<ctas, kWarpsPerCta * 32, 0, stream>>>(s, so, nullptr);
  else if (staged == kStagedSmall && regs) launch_select_warp<kStagedSmall, true>(ctas, s, launch.paths, stream);
  else if (staged == kStagedSmall) launch_select_warp<kStagedSmall, false>(ctas, s, launch.paths, stream);
  else if (staged == kStagedMid && regs) launch_select_warp<kStagedMid, true>(ctas, s, launch.paths, stream);
  else if (staged == kStagedMid) launch_select_warp<kStagedMid, false>(ctas, s, launch.paths, stream);
  else launch_select_warp<kStaged, false>(ctas, s, launch.paths, stream);
  t_last_select = cta ? (publish ? "cta-publish" : "cta") : publish ? (staged == kStagedSmall ? "warp512-publish" : "warp1536-publish")
                  : staged == kStagedSmall ? (regs ? "warp512-regs" : "warp512")
                  : staged == kStagedMid ? (regs ? "warp1024-regs" : "warp1024") : "warp1536";
  INDEXCP_CUDA_LAUNCH_CHECK("select kernel launch");
}

void launch_merge(const MergeLaunch& m, cudaStream_t stream) {
  const int64_t problems = m.rows.rows * m.nh;
  if (problems == 0) {
    if (m.signature != nullptr && m.status != nullptr) {  // no rows: the agreement alone
      signature_status_kernel<<<1, 32, 0, stream>>>(m);
      INDEXCP_CUDA_LAUNCH_CHECK("signature status kernel launch");
    }
    return;
  }
  const int64_t ctas = ceil_div(problems, kWarpsPerCta);
  INDEXCP_REQUIRE(ctas < (int64_t{1} << 31), "merge launch too large");
  if (static_cast<int64_t>(m.world) * (m.sel.topk - 1 - m.sel.init_blocks) > kStaged / 2)
    throw Error(ErrorCode::kUnsupported, "the CUDA merge handles at most " + std::to_string(kStaged / 2) +
                                             " candidates per (row, head): world x (topk - 1 - init_blocks) = " +
                                             std::to_string(m.world * (m.sel.topk - 1 - m.sel.init_blocks)));
  merge_kernel<<<static_cast<unsigned>(ctas), kWarpsPerCta * 32, 0, stream>>>(m);
  INDEXCP_CUDA_LAUNCH_CHECK("merge kernel launch");
}

}  // namespace indexcp::cuda::detail
