// Helpers of the GPU tests: device arrays, device copies of batches, skip without a GPU, the
// tolerance-aware comparison of selections.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "indexcp/cuda.hpp"
#include "util.hpp"

#define REQUIRE_GPU()                                                                       \
  do {                                                                                      \
    if (!::indexcp::cuda::available()) GTEST_SKIP() << "no CUDA GPU visible: GPU test skipped"; \
  } while (0)

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call << ": " << cudaGetErrorString(cudaGetLastError())

namespace gpu {

using namespace indexcp;
using namespace testutil;

template <class T>
class DevArr {
 public:
  DevArr() = default;
  explicit DevArr(size_t n) { alloc(n); }
  explicit DevArr(const std::vector<T>& h) {
    alloc(h.size());
    if (!h.empty()) cudaMemcpy(p_, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
    cudaDeviceSynchronize();  // pageable copies may return before the DMA lands (non-blocking streams next)
  }
  ~DevArr() {
    if (p_) cudaFree(p_);
  }
  DevArr(const DevArr&) = delete;
  DevArr& operator=(const DevArr&) = delete;
  DevArr(DevArr&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr; o.n_ = 0; }
  void alloc(size_t n) {
    if (p_) cudaFree(p_);
    n_ = n;
    p_ = nullptr;
    if (cudaMalloc(&p_, (n ? n : 1) * sizeof(T)) != cudaSuccess) throw std::runtime_error("cudaMalloc failed in a test");
  }
  void upload(const std::vector<T>& h) {
    if (h.size() != n_) alloc(h.size());
    if (!h.empty()) cudaMemcpy(p_, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
    cudaDeviceSynchronize();
  }
  void fill_bytes(int v) {
    cudaMemset(p_, v, (n_ ? n_ : 1) * sizeof(T));  // asynchronous on the legacy stream
    cudaDeviceSynchronize();
  }
  std::vector<T> host() const {
    std::vector<T> h(n_);
    if (n_) cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
  T* get() const { return p_; }
  size_t size() const { return n_; }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

/// The bit patterns of floats (bit-exact comparisons; -Inf is 0xff800000).
inline std::vector<uint32_t> bits_of(const std::vector<float>& v) {
  std::vector<uint32_t> b(v.size());
  std::memcpy(b.data(), v.data(), v.size() * sizeof(float));
  return b;
}

/// A block table [requests][max_pages] widened to [requests][wider] entries, the extra ones padding
/// as a caller with a fixed max_pages writes it (-1 and a huge page id, alternating).
inline std::vector<int32_t> padded_block_table(const std::vector<int32_t>& bt, size_t requests, int32_t max_pages,
                                               int32_t wider) {
  std::vector<int32_t> out(requests * static_cast<size_t>(wider));
  for (size_t b = 0; b < requests; ++b)
    for (int32_t lp = 0; lp < wider; ++lp)
      out[b * wider + lp] = lp < max_pages ? bt[b * max_pages + lp] : (lp & 1) ? -1 : 1 << 30;
  return out;
}

/// Sets or unsets an environment variable for the life of the object, then restores it.
class ScopedEnv {
 public:
  explicit ScopedEnv(const char* name) : name_(name) {
    if (const char* v = std::getenv(name)) {
      had_ = true;
      old_ = v;
    }
  }
  ~ScopedEnv() {
    if (had_) setenv(name_, old_.c_str(), 1);
    else unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  /// Empty: unset.
  void set(const std::string& v) {
    if (v.empty()) unsetenv(name_);
    else setenv(name_, v.c_str(), 1);
  }

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

/// True when a captured graph holds a memory allocation or free node.
inline bool graph_has_alloc_node(cudaGraph_t g) {
  size_t n = 0;
  cudaGraphGetNodes(g, nullptr, &n);
  std::vector<cudaGraphNode_t> nodes(n);
  cudaGraphGetNodes(g, nodes.data(), &n);
  for (auto node : nodes) {
    cudaGraphNodeType t;
    cudaGraphNodeGetType(node, &t);
    if (t == cudaGraphNodeTypeMemAlloc || t == cudaGraphNodeTypeMemFree) return true;
  }
  return false;
}

/// A decode batch's arrays on the device.
struct DevDecode {
  DevArr<uint8_t> q;
  DevArr<int32_t> bt, sl;
  DecodeBatch b;
  DevDecode(const Requests& r, const std::vector<uint8_t>& qh, int32_t heads, int32_t Q)
      : q(qh), bt(r.block_table), sl(r.seq_lens) {
    b.q = q.get();
    b.heads = heads;
    b.block_table = bt.get();
    b.num_requests = static_cast<int32_t>(r.seq_lens.size());
    b.max_pages = r.max_pages;
    b.seq_lens = sl.get();
    b.query_len = Q;
  }
};

/// A DecodeShape with the given geometry (selection parameters at their defaults).
inline cuda::DecodeShape decode_shape(int32_t max_requests, int32_t max_pages, int32_t Q, int32_t H,
                                      KRounding mode = KRounding::kE4m3,
                                      ScorePrecision precision = ScorePrecision::kFp32) {
  cuda::DecodeShape shape;
  shape.max_requests = max_requests;
  shape.max_pages = max_pages;
  shape.query_len = Q;
  shape.heads = H;
  shape.mode = mode;
  shape.precision = precision;
  return shape;
}

inline DecodeBatch host_batch(const Requests& r, const std::vector<uint8_t>& q, int32_t heads, int32_t Q) {
  DecodeBatch b;
  b.q = q.data();
  b.heads = heads;
  b.block_table = r.block_table.data();
  b.num_requests = static_cast<int32_t>(r.seq_lens.size());
  b.max_pages = r.max_pages;
  b.seq_lens = r.seq_lens.data();
  b.query_len = Q;
  return b;
}

/// Device caches (W shards, or one replicated when W = 1) filled through the GPU insert.
inline std::vector<cuda::DeviceCache> device_shards(KvDtype dt, const Requests& r, int32_t W, const std::vector<float>& keys,
                                                    const std::vector<int64_t>& slots) {
  std::vector<cuda::DeviceCache> out;
  const PageLayout l = make_page_layout(dt, r.page_size, W);
  DevArr<float> k(keys);
  DevArr<int64_t> s(slots);
  for (int32_t rank = 0; rank < W; ++rank) {
    out.emplace_back(l, r.num_pages, 1, rank);
    cuda::insert_keys(out.back(), 0, k.get(), s.get(), static_cast<int64_t>(slots.size()), InsertOptions{}, nullptr);
  }
  return out;
}

/// Keys whose NVFP4 and FP8 forms are exact (16-element groups over the E2M1 grid with amax 6,
/// so the scale is 1.0): with integer queries every dot product is exact in fp32, so the GPU
/// scores equal the CPU's and the selections must be identical, ties included.
inline void exact_keys(const Requests& r, uint32_t seed, std::vector<float>& keys, std::vector<int64_t>& slots) {
  static const float grid[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  std::mt19937 rng(seed);
  keys.clear();
  slots.clear();
  for (size_t b = 0; b < r.seq_lens.size(); ++b)
    for (int64_t p = 0; p < r.seq_lens[b]; ++p) {
      for (int g = 0; g < 8; ++g) {
        const int forced = static_cast<int>(rng() % 16);  // one element of each group is +-6
        for (int i = 0; i < 16; ++i) {
          float v = i == forced ? 6.0f : grid[rng() % 8];
          if (rng() & 1) v = -v;
          keys.push_back(v);
        }
      }
      slots.push_back(r.slot(static_cast<int32_t>(b), p));
    }
}

/// Integer queries in [-4, 4] (exact E4M3).
inline std::vector<uint8_t> int_q(int64_t rows, int32_t heads, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> q(static_cast<size_t>(rows) * heads * kHeadDim);
  for (auto& b : q) b = e4m3_encode(static_cast<float>(static_cast<int>(rng() % 9) - 4));
  return q;
}

/// Exact (long double) block scores and the bound sum |q k| per (row, head, block) from a host
/// replicated cache: the fp64 reference of the dequantized keys.
struct RefScores {
  int64_t rows = 0, max_blocks = 0;
  int32_t heads = 0;
  std::vector<double> score, absmax;  // -inf where no score
  double at(int64_t r, int32_t h, int64_t b) const { return score[(r * heads + h) * max_blocks + b]; }
  double bound(int64_t r, int32_t h, int64_t b) const { return absmax[(r * heads + h) * max_blocks + b]; }
};

inline RefScores ref_scores(const IndexCache& cache, const Requests& r, const std::vector<QueryRow>& rows,
                            const std::vector<uint8_t>& q, int32_t heads, KRounding mode) {
  RefScores s;
  s.rows = static_cast<int64_t>(rows.size());
  s.heads = heads;
  s.max_blocks = static_cast<int64_t>(r.max_pages) * r.page_size / 128;
  s.score.assign(static_cast<size_t>(s.rows * heads * s.max_blocks), -INFINITY);
  s.absmax.assign(s.score.size(), 0.0);
  const int64_t nslots = cache.num_pages() * r.page_size;
  std::vector<float> khat(static_cast<size_t>(nslots) * 128);
  for (int64_t slot = 0; slot < nslots; ++slot)
    read_row_khat(cache, 0, slot / r.page_size, static_cast<int32_t>(slot % r.page_size), mode, khat.data() + slot * 128);
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i].pos < 0) continue;
    const int64_t local = rows[i].pos / 128;
    for (int32_t h = 0; h < heads; ++h) {
      double qd[128];
      for (int d = 0; d < 128; ++d) qd[d] = e4m3_decode(q[(i * heads + h) * 128 + d]);
      for (int64_t b = 0; b < local; ++b) {
        double best = -INFINITY, bound = 0;
        for (int64_t p = b * 128; p < (b + 1) * 128; ++p) {
          const float* k = khat.data() + r.slot(rows[i].request, p) * 128;
          long double acc = 0, aabs = 0;
          for (int d = 0; d < 128; ++d) {
            acc += static_cast<long double>(qd[d]) * k[d];
            aabs += std::fabs(static_cast<long double>(qd[d]) * k[d]);
          }
          best = std::max(best, static_cast<double>(static_cast<float>(static_cast<double>(acc))));
          bound = std::max(bound, static_cast<double>(aabs));
        }
        s.score[(i * heads + h) * s.max_blocks + b] = best;
        s.absmax[(i * heads + h) * s.max_blocks + b] = bound;
      }
    }
  }
  return s;
}

/// Tolerance of a GPU block score: fp32 accumulation of 128 exact products, any order:
/// |err| <= 128 * 2^-24 * sum |q k| (with margin 2x), plus one rounding of the result.
inline double score_tol(double bound, double ref) { return 2.0 * 128.0 * std::ldexp(1.0, -24) * bound + std::fabs(ref) * std::ldexp(1.0, -23); }

/// Compares a GPU selection with the CPU's: identical, or, where they differ, every block that
/// only one of them chose scores within tolerance of every block that only the other chose
/// (a near tie that fp32 accumulation may order either way). Returns the number of rows that
/// differed (all explained by near ties, else a failure is recorded).
inline int compare_selections(const std::vector<int32_t>& gpu, const std::vector<int32_t>& cpu, const RefScores& ref,
                              const std::vector<QueryRow>& rows, int32_t heads, int32_t K, const std::string& what) {
  EXPECT_EQ(gpu.size(), cpu.size()) << what;
  int differing = 0;
  for (size_t i = 0; i < rows.size(); ++i)
    for (int32_t h = 0; h < heads; ++h) {
      const int32_t* g = gpu.data() + (i * heads + h) * K;
      const int32_t* c = cpu.data() + (i * heads + h) * K;
      if (std::equal(g, g + K, c)) continue;
      ++differing;
      std::set<int32_t> gs(g, g + K), csx(c, c + K);
      std::vector<int32_t> only_g, only_c;
      for (int32_t x : gs) if (x >= 0 && !csx.count(x)) only_g.push_back(x);
      for (int32_t x : csx) if (x >= 0 && !gs.count(x)) only_c.push_back(x);
      EXPECT_EQ(only_g.size(), only_c.size()) << what << " row " << i << " head " << h;
      for (int32_t x : only_g)
        for (int32_t y : only_c) {
          const double sx = ref.at(static_cast<int64_t>(i), h, x), sy = ref.at(static_cast<int64_t>(i), h, y);
          const double tol = score_tol(ref.bound(static_cast<int64_t>(i), h, x), sx) +
                             score_tol(ref.bound(static_cast<int64_t>(i), h, y), sy);
          EXPECT_LE(std::fabs(sx - sy), tol) << what << " row " << i << " head " << h << ": GPU chose block " << x
                                             << " (score " << sx << "), CPU block " << y << " (score " << sy
                                             << "): not a near tie";
        }
    }
  return differing;
}

/// A prefill scene (5 requests incl. a padded one, chunks of 130/700/5/0/7 rows, 4 heads): exact
/// keys and integer q (scores exact in fp32) or random ones; and its arrays on the device.
struct PrefillScene {
  Requests req;
  std::vector<float> keys;
  std::vector<int64_t> slots;
  std::vector<int32_t> qs;
  std::vector<uint8_t> q;
  int32_t heads = 4;
};

inline PrefillScene prefill_scene(int32_t P, uint32_t seed, bool exact) {
  PrefillScene s;
  s.req = make_requests({3000, 700, 2048, 0, 130}, P, seed);
  if (exact) exact_keys(s.req, seed + 1, s.keys, s.slots);
  else make_keys(s.req, seed + 1, s.keys, s.slots);
  s.qs = {0, 130, 830, 835, 835, 835 + 7};
  s.q = exact ? int_q(s.qs.back(), s.heads, seed + 2) : make_q(s.qs.back(), s.heads, seed + 2);
  return s;
}

/// The most rows of one request in query_start `qs` (prefill_scores' max_rows_per_request), at least 1.
inline int32_t max_rows_of(const std::vector<int32_t>& qs) {
  int32_t m = 1;
  for (size_t b = 0; b + 1 < qs.size(); ++b) m = std::max(m, qs[b + 1] - qs[b]);
  return m;
}

struct DevPrefill {
  DevArr<uint8_t> q;
  DevArr<int32_t> bt, sl, qs;
  PrefillBatch b;
  DevPrefill(const PrefillScene& s) : q(s.q), bt(s.req.block_table), sl(s.req.seq_lens), qs(s.qs) {
    b.q = q.get();
    b.heads = s.heads;
    b.block_table = bt.get();
    b.num_requests = static_cast<int32_t>(s.req.seq_lens.size());
    b.max_pages = s.req.max_pages;
    b.seq_lens = sl.get();
    b.query_start = qs.get();
  }
};

}  // namespace gpu
