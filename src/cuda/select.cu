// Exact top-k selection, publish and merge of the CUDA backend (spec/indexer.md sections 4-5).
//
// One warp per (row, head). Candidates are ranked by a unique 64-bit key: the order-preserving
// key of the score (indexer.md section 3: NaN lowest, -0.0 == +0.0) in the high half and
// (0xffffffff - block id) in the low half, so (score desc, id asc) is plain descending key order
// and there are no ties. The threshold T (the kk-th largest key) is found exactly:
//   fast path: the kk-th largest of the 32 per-lane maxima is a lower bound of T; the few
//   candidates at or above it (at most 64) are ranked against each other in shared memory;
//   fallback (plateaus of equal scores, kk > 32, many survivors): kk rounds of warp arg-max.
// The selection is then { key >= T }. Nothing is approximate, no histogram can drop a candidate.
#include <algorithm>
#include <cstdint>

#include "common.cuh"
#include "kernels.cuh"

namespace indexcp::cuda::detail {

namespace {

constexpr int kWarpsPerCta = 4;
constexpr int kSurvivors = 64;

constexpr int kStaged = 2048;  // candidates staged in shared memory per warp (more: read from L2)

struct WarpSmem {
  union {
    float score[kStaged];        // select / publish: the row's block scores init .. local-1
    Candidate cand[kStaged / 2]; // merge: the W x kk exchanged candidates
  };
  uint64_t key[kSurvivors];      // survivors (fast path)
  int32_t idx[kSurvivors];
  uint8_t keep[kStaged / 2];     // merge: candidate kept after deduplication
};

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

__device__ __forceinline__ uint64_t shfl64(uint64_t v, int src) {
  const uint32_t lo = __shfl_sync(0xffffffffu, static_cast<uint32_t>(v), src);
  const uint32_t hi = __shfl_sync(0xffffffffu, static_cast<uint32_t>(v >> 32), src);
  return (static_cast<uint64_t>(hi) << 32) | lo;
}
__device__ __forceinline__ uint64_t warp_max64(uint64_t v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const uint64_t o = shfl64(v, (threadIdx.x & 31) ^ off);
    v = o > v ? o : v;
  }
  return v;
}
__device__ __forceinline__ int32_t key_id(uint64_t key) {
  return static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(key & 0xffffffffu));
}

// The kk-th largest key among the valid ones (0 when there are at most kk: every valid key is
// > 0, so "key >= 0" keeps them all). *sorted is set when the fallback ran (it has passed the
// selection to emit(rank, key) in descending order), *surv to the number of survivors left in
// sh.key / sh.idx by the fast path.
template <class KeyAt, class Emit>
__device__ uint64_t warp_threshold(int64_t n, int32_t kk, KeyAt key_at, Emit emit, WarpSmem& sh, int* nvalid,
                                   bool* sorted, int* surv) {
  const int lane = threadIdx.x & 31;
  *sorted = false;
  *surv = 0;
  uint64_t lmax = 0;
  int cnt = 0;
  for (int64_t i = lane; i < n; i += 32) {
    uint64_t k;
    if (key_at(i, &k)) {
      ++cnt;
      lmax = k > lmax ? k : lmax;
    }
  }
  const int V = __reduce_add_sync(0xffffffffu, cnt);
  *nvalid = V;
  if (V <= kk) return 0;
  uint64_t t0 = 0;
  if (kk <= 32) {
    int rank = 0;
    for (int o = 0; o < 32; ++o) rank += shfl64(lmax, o) > lmax;
    const unsigned hit = __ballot_sync(0xffffffffu, lmax != 0 && rank == kk - 1);
    if (hit) t0 = shfl64(lmax, __ffs(hit) - 1);
  }
  // survivors: valid keys >= t0
  int sc = 0;
  for (int64_t i = lane; i < n; i += 32) {
    uint64_t k;
    sc += key_at(i, &k) && k >= t0;
  }
  const int S = __reduce_add_sync(0xffffffffu, sc);
  if (S <= kSurvivors) {
    int base = 0;
    for (int64_t i0 = 0; i0 < n; i0 += 32) {
      const int64_t i = i0 + lane;
      uint64_t k = 0;
      const bool sv = i < n && key_at(i, &k) && k >= t0;
      const unsigned m = __ballot_sync(0xffffffffu, sv);
      if (sv) {
        const int pos = base + __popc(m & ((1u << lane) - 1u));
        sh.key[pos] = k;
        sh.idx[pos] = static_cast<int32_t>(i);
      }
      base += __popc(m);
    }
    __syncwarp();
    uint64_t T = 0;
    for (int e = lane; e < S; e += 32) {
      int r = 0;
      for (int f = 0; f < S; ++f) r += sh.key[f] > sh.key[e];
      if (r == kk - 1) T = sh.key[e];
    }
    *surv = S;
    return warp_max64(T);
  }
  // fallback: kk rounds of arg-max; emit(r, key) receives the selection in descending order
  uint64_t prev = ~0ull;
  for (int r = 0; r < kk; ++r) {
    uint64_t m = 0;
    for (int64_t i = lane; i < n; i += 32) {
      uint64_t k;
      if (key_at(i, &k) && k < prev && k > m) m = k;
    }
    prev = warp_max64(m);
    emit(r, prev);
  }
  *sorted = true;
  return prev;
}

__device__ __forceinline__ void write_all_visible(int64_t n, int32_t K, int32_t* o) {
  for (int k = threadIdx.x & 31; k < K; k += 32) o[k] = k < n ? k : -1;
}

__global__ void __launch_bounds__(kWarpsPerCta * 32) select_kernel(const SelectLaunch s) {
  __shared__ WarpSmem shm[kWarpsPerCta];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t problem = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + warp;
  if (problem >= s.rows.rows * s.nh) return;
  WarpSmem& sh = shm[warp];
  const int64_t row = problem / s.nh;
  const int32_t hh = static_cast<int32_t>(problem % s.nh);
  const int64_t pos = row_position(s.rows, row);
  const int64_t n_vis = pos < 0 ? 0 : pos / kBlockTokens + 1;
  const SelectionParams sel = s.sel;
  const int32_t kk = sel.topk - 1 - sel.init_blocks;
  const float* sc = s.scores + (row * s.nh + hh) * s.max_blocks;
  const int64_t local = n_vis - 1;
  const int64_t nc = local - sel.init_blocks;  // candidates: blocks init .. local-1

  if (s.cands == nullptr) {  // ---- selection: ascending ids
    int32_t* o = s.out + (row * s.out_heads + s.out_h0 + hh) * sel.topk;
    if (n_vis <= sel.topk) {
      write_all_visible(n_vis, sel.topk, o);
      return;
    }
    const bool staged = nc <= kStaged;
    if (staged) {
#pragma unroll 8
      for (int64_t i = lane; i < nc; i += 32) sh.score[i] = sc[sel.init_blocks + i];
      __syncwarp();
    }
    auto key_at = [&](int64_t i, uint64_t* key) {
      const int32_t b = static_cast<int32_t>(sel.init_blocks + i);
      *key = cand_key(staged ? sh.score[i] : sc[b], b);
      return true;
    };
    int V, S;
    bool sorted;
    const uint64_t T = warp_threshold(nc, kk, key_at, [](int, uint64_t) {}, sh, &V, &sorted, &S);
    for (int k = lane; k < sel.init_blocks; k += 32) o[k] = k;
    int base = 0;
    for (int64_t i0 = 0; i0 < nc; i0 += 32) {
      const int64_t i = i0 + lane;
      uint64_t k = 0;
      const bool take = i < nc && key_at(i, &k) && k >= T;
      const unsigned m = __ballot_sync(0xffffffffu, take);
      if (take) o[sel.init_blocks + base + __popc(m & ((1u << lane) - 1u))] = static_cast<int32_t>(sel.init_blocks + i);
      base += __popc(m);
    }
    for (int k = sel.init_blocks + base + lane; k < sel.topk; k += 32)
      o[k] = k == sel.init_blocks + base ? static_cast<int32_t>(local) : -1;
    return;
  }

  // ---- publish: the kk best valid candidates by (score desc, id asc), then empty entries
  Candidate* o = s.cands + (row * s.nh + hh) * kk;
  const int32_t P = s.layout.page_size, R = s.layout.rows(), lo_off = s.rank * R;
  const int32_t fmod = s.filter.modulus, fres = s.filter.residue;
  const bool staged = nc <= kStaged;
  if (staged && n_vis > sel.topk) {
#pragma unroll 8
    for (int64_t i = lane; i < nc; i += 32) sh.score[i] = sc[sel.init_blocks + i];
    __syncwarp();
  }
  auto key_at = [&](int64_t i, uint64_t* key) {
    const int32_t b = static_cast<int32_t>(sel.init_blocks + i);
    if (fmod > 1 && b % fmod != fres) return false;
    const int32_t u0 = (b * kBlockTokens) & (P - 1);  // the block's first page offset (P = 128 or 256)
    if (!(u0 < lo_off + R && lo_off < u0 + kBlockTokens)) return false;  // no rows on this rank
    *key = cand_key(staged ? sh.score[i] : sc[b], b);
    return true;
  };
  auto emit = [&](int r, uint64_t key) {  // fallback: the selection in descending order
    if (lane == 0) {
      const int32_t b = key_id(key);
      o[r] = Candidate{sc[b], b};
    }
  };
  int m = 0;
  if (n_vis > sel.topk) {
    int V, S;
    bool sorted;
    const uint64_t T = warp_threshold(nc, kk, key_at, emit, sh, &V, &sorted, &S);
    if (sorted) {  // fallback: already written by emit
      m = kk;
    } else if (S > 0) {  // fast path: rank the survivors
      m = kk;
      for (int e = lane; e < S; e += 32) {
        int r = 0;
        for (int f = 0; f < S; ++f) r += sh.key[f] > sh.key[e];
        if (r < kk) {
          const int32_t b = key_id(sh.key[e]);
          o[r] = Candidate{sc[b], b};
        }
      }
    } else {  // at most kk valid: all of them, ranked against each other (V <= kk)
      m = V;
      for (int64_t i0 = 0; i0 < nc; i0 += 32) {
        const int64_t i = i0 + lane;
        uint64_t k = 0;
        if (i < nc && key_at(i, &k)) {
          int r = 0;
          for (int64_t f = 0; f < nc; ++f) {
            uint64_t kf;
            if (key_at(f, &kf) && kf > k) ++r;
          }
          const int32_t b = key_id(k);
          o[r] = Candidate{sc[b], b};
        }
      }
    }
    (void)T;
  }
  for (int k = m + lane; k < kk; k += 32) o[k] = Candidate{-INFINITY, -1};
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
  int32_t* o = mg.out + (row * mg.out_heads + mg.out_h0 + hh) * sel.topk;
  const int64_t pos = row_position(mg.rows, row);
  const int64_t n_vis = pos < 0 ? 0 : pos / kBlockTokens + 1;
  if (n_vis <= sel.topk) {
    write_all_visible(n_vis, sel.topk, o);
    return;
  }
  const int32_t local = static_cast<int32_t>(n_vis - 1);
  const int64_t m = static_cast<int64_t>(mg.world) * kk;
  const int64_t per_rank = mg.rows.rows * mg.heads * kk;
  const Candidate* base_c = mg.cands + (row * mg.heads + h) * kk;
  const bool staged = m <= kStaged / 2;
  if (staged) {
    for (int64_t e = lane; e < m; e += 32) sh.cand[e] = base_c[(e / kk) * per_rank + e % kk];
    __syncwarp();
  }
  auto cand = [&](int64_t e) -> Candidate {
    if (staged) return sh.cand[e];
    const int64_t w = e / kk, k = e % kk;
    return base_c[w * per_rank + k];
  };
  // kept = in range and not beaten by another entry of the same block (max score, then first)
  auto kept_slow = [&](int64_t e) -> bool {
    const Candidate c = cand(e);
    if (!(c.block >= sel.init_blocks && c.block < local)) return false;
    const uint32_t ke = score_key(c.score);
    for (int64_t f = 0; f < m; ++f) {
      if (f == e) continue;
      const Candidate d = cand(f);
      if (d.block != c.block) continue;
      const uint32_t kf = score_key(d.score);
      if (kf > ke || (kf == ke && f < e)) return false;
    }
    return true;
  };
  const bool cached = m <= kStaged / 2;
  if (cached) {
    for (int64_t e = lane; e < m; e += 32) sh.keep[e] = kept_slow(e);
    __syncwarp();
  }
  auto key_at = [&](int64_t e, uint64_t* key) {
    if (cached ? !sh.keep[e] : !kept_slow(e)) return false;
    const Candidate c = cand(e);
    *key = cand_key(c.score, c.block);
    return true;
  };
  int V, S;
  bool sorted;
  const uint64_t T = warp_threshold(m, kk, key_at, [](int, uint64_t) {}, sh, &V, &sorted, &S);
  __syncwarp();
  // the selected ids (at most kk), written in ascending order: repeated arg-min over ids
  for (int k = lane; k < sel.init_blocks; k += 32) o[k] = k;
  int32_t prev = -1;
  int got = 0;
  for (;; ++got) {
    int32_t best = 0x7fffffff;
    for (int64_t e = lane; e < m; e += 32) {
      uint64_t k;
      if (key_at(e, &k) && k >= T) {
        const int32_t id = key_id(k);
        if (id > prev && id < best) best = id;
      }
    }
    best = __reduce_min_sync(0xffffffffu, best);
    if (best == 0x7fffffff || got >= kk) break;
    if (lane == 0) o[sel.init_blocks + got] = best;
    prev = best;
  }
  for (int k = sel.init_blocks + got + lane; k < sel.topk; k += 32) o[k] = k == sel.init_blocks + got ? local : -1;
}

}  // namespace

void launch_select(const SelectLaunch& s, cudaStream_t stream) {
  const int64_t problems = s.rows.rows * s.nh;
  if (problems == 0) return;
  const int64_t ctas = ceil_div(problems, kWarpsPerCta);
  require(ctas < (int64_t{1} << 31), "select launch too large");
  select_kernel<<<static_cast<unsigned>(ctas), kWarpsPerCta * 32, 0, stream>>>(s);
  INDEXCP_CUDA_LAUNCH_CHECK("select kernel launch");
}

void launch_merge(const MergeLaunch& m, cudaStream_t stream) {
  const int64_t problems = m.rows.rows * m.nh;
  if (problems == 0) return;
  const int64_t ctas = ceil_div(problems, kWarpsPerCta);
  require(ctas < (int64_t{1} << 31), "merge launch too large");
  merge_kernel<<<static_cast<unsigned>(ctas), kWarpsPerCta * 32, 0, stream>>>(m);
  INDEXCP_CUDA_LAUNCH_CHECK("merge kernel launch");
}

}  // namespace indexcp::cuda::detail
