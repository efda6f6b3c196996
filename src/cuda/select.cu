// Exact top-k selection, publish and merge of the CUDA backend (spec/indexer.md sections 4-5).
//
// A candidate's key is K = score_key(score) + 1 (score_key: the order-preserving map of
// indexer.md section 3, NaN lowest, -0.0 == +0.0) or 0 when it is not a candidate; the order is
// (K desc, block id asc), a total order without ties.
//   select / publish: one CTA of 256 threads per (row, head); the keys of the row are staged once
//   in shared memory; the boundary (the kk-th best) comes from a radix select over the 32-bit keys
//   (4 passes of 8 bits), the ties at the boundary taken in ascending id order by a block scan.
//   merge: one warp per (row, head) over the W x (K-1) published candidates.
// Nothing is approximate: the selection is exactly the CPU's on the same scores.
#include <algorithm>
#include <climits>
#include <cstdint>

#include <cub/block/block_scan.cuh>

#include "common.cuh"
#include "kernels.cuh"

namespace indexcp::cuda::detail {

namespace {

constexpr int kWarpsPerCta = 4;  // merge: one warp per (row, head)
constexpr int kStaged = 1536;    // merge: K and block ids of up to kStaged / 2 candidates per warp

struct WarpSmem {
  uint32_t key[kStaged];
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

// (K, i) better than (K2, i2) in the order (K desc, i asc)
__device__ __forceinline__ bool better(uint32_t k, int32_t i, uint32_t k2, int32_t i2) {
  return k > k2 || (k == k2 && i < i2);
}

__device__ __forceinline__ void write_all_visible(int64_t n, int32_t K, int32_t* o) {
  for (int k = threadIdx.x & 31; k < K; k += 32) o[k] = k < n ? k : -1;
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

__global__ void __launch_bounds__(kSelThreads) select_kernel(const SelectLaunch s) {
  __shared__ SelSmem sh;
  const int tid = threadIdx.x;
  const int64_t problem = blockIdx.x;
  const int64_t row = problem / s.nh;
  const int32_t hh = static_cast<int32_t>(problem % s.nh);
  const int64_t pos = row_position(s.rows, row);
  const int64_t n_vis = pos < 0 ? 0 : pos / kBlockTokens + 1;
  const SelectionParams sel = s.sel;
  const int32_t kk = sel.topk - 1 - sel.init_blocks;
  const float* sc = s.scores + (row * s.nh + hh) * s.max_blocks;
  const int32_t local = static_cast<int32_t>(n_vis - 1);
  const int32_t n = local - sel.init_blocks;  // candidates: blocks init .. local-1
  const int32_t init = sel.init_blocks;
  const bool publish = s.cands != nullptr;
  Candidate* oc = publish ? s.cands + (row * s.nh + hh) * kk : nullptr;
  int32_t* o = publish ? nullptr : s.out + (row * s.out_heads + s.out_h0 + hh) * sel.topk;
  if (n_vis <= sel.topk) {
    if (publish)
      for (int k = tid; k < kk; k += kSelThreads) oc[k] = Candidate{-INFINITY, -1};
    else
      for (int k = tid; k < sel.topk; k += kSelThreads) o[k] = k < n_vis ? k : -1;
    return;
  }
  // candidate keys (publish: only blocks of which this rank stores rows, and the block filter)
  const int32_t P = s.layout.page_size, R = s.layout.rows(), lo_off = s.rank * R;
  const int32_t fmod = s.filter.modulus, fres = s.filter.residue;
  auto key_global = [&](int32_t i) -> uint32_t {
    const int32_t b = init + i;
    if (publish) {
      if (fmod > 1 && b % fmod != fres) return 0u;
      const int32_t u0 = (b * kBlockTokens) & (P - 1);  // the block's first page offset (P = 128 or 256)
      if (!(u0 < lo_off + R && lo_off < u0 + kBlockTokens)) return 0u;  // no rows on this rank
    }
    return score_key(sc[b]) + 1u;
  };
  const bool staged = n <= kSelStaged;
  int nonzero = 0;
  if (staged) {
    for (int32_t i = tid; i < n; i += kSelThreads) {
      const uint32_t k = key_global(i);
      sh.key[i] = k;
      nonzero += k != 0;
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
  if (!publish) {  // ---- selection: [0..init), chosen ids ascending, local, then -1
    for (int k = tid; k < init; k += kSelThreads) o[k] = k;
    for (int32_t i = a; i < e; ++i)
      if (selected(key(i), i)) o[init + place++] = init + i;
    for (int k = init + got + tid; k < sel.topk; k += kSelThreads) o[k] = k == init + got ? local : -1;
    return;
  }
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
  const int64_t pos = row_position(mg.rows, row);
  const int64_t n_vis = pos < 0 ? 0 : pos / kBlockTokens + 1;
  if (n_vis <= sel.topk) {
    write_all_visible(n_vis, sel.topk, o);
    return;
  }
  const int32_t local = static_cast<int32_t>(n_vis - 1);
  const int32_t m = mg.world * kk;  // <= kStaged / 2 (checked at launch)
  const int64_t per_rank = mg.rows.rows * mg.heads * kk;
  const Candidate* base_c = mg.cands + (row * mg.heads + h) * kk;
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
  for (int k = lane; k < init; k += 32) o[k] = k;
  int cnt = 0;
  for (int32_t e = lane; e < m; e += 32) {
    if (K[e] == 0) continue;
    ++cnt;
    int p = 0;
    for (int32_t f = 0; f < m; ++f) p += K[f] != 0 && ID[f] < ID[e];
    o[init + p] = ID[e];
  }
  const int got = __reduce_add_sync(0xffffffffu, cnt);
  for (int k = init + got + lane; k < sel.topk; k += 32) o[k] = k == init + got ? local : -1;
}

}  // namespace

void launch_select(const SelectLaunch& s, cudaStream_t stream) {
  const int64_t problems = s.rows.rows * s.nh;
  if (problems == 0) return;
  INDEXCP_REQUIRE(problems < (int64_t{1} << 31), "select launch too large");
  select_kernel<<<static_cast<unsigned>(problems), kSelThreads, 0, stream>>>(s);
  INDEXCP_CUDA_LAUNCH_CHECK("select kernel launch");
}

void launch_merge(const MergeLaunch& m, cudaStream_t stream) {
  const int64_t problems = m.rows.rows * m.nh;
  if (problems == 0) return;
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
