// fp32-key reference selection (see reference.hpp).
#include "reference.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace indexcp::cli {

namespace {

constexpr int kD = 128;  // head dim
constexpr int kB = 128;  // block tokens
constexpr int kV = 4;    // query vectors per pass over a block's keys

// acc[v][t] = sum_d q[v][d] * kT[d][t] for kV query vectors, in double, d in order 0..127;
// returns the maximum over t for each vector.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
void block_max(const double* kT, const double* const* q, int nv, double* best) {
  alignas(64) double acc[kV][kB];
  for (int v = 0; v < kV; ++v)
    for (int t = 0; t < kB; ++t) acc[v][t] = 0.0;
  for (int d = 0; d < kD; ++d) {
    const double* kr = kT + d * kB;
    for (int v = 0; v < kV; ++v) {
      const double qv = v < nv ? q[v][d] : 0.0;
      double* a = acc[v];
      for (int t = 0; t < kB; ++t) a[t] += qv * kr[t];
    }
  }
  for (int v = 0; v < nv; ++v) {
    double m = -std::numeric_limits<double>::infinity();
    for (int t = 0; t < kB; ++t) m = acc[v][t] > m ? acc[v][t] : m;
    best[v] = m;
  }
}

}  // namespace

void reference_select(const float* keys, const float* q, int64_t pos0, int64_t n, int32_t heads,
                      int32_t topk, int32_t init_blocks, int32_t* out) {
  if (n <= 0) return;
  const int64_t max_local = (pos0 + n - 1) / kB;
  const int64_t nvec = n * heads;
  std::vector<double> qd(static_cast<size_t>(nvec) * kD);
  for (int64_t i = 0; i < nvec * kD; ++i) qd[i] = q[i];
  std::vector<double> score(static_cast<size_t>(nvec * std::max<int64_t>(max_local, 1)),
                            -std::numeric_limits<double>::infinity());
#pragma omp parallel
  {
    std::vector<double> kT(static_cast<size_t>(kD) * kB);
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < max_local; ++c) {
      for (int t = 0; t < kB; ++t)
        for (int d = 0; d < kD; ++d) kT[d * kB + t] = keys[(c * kB + t) * kD + d];
      // rows whose local block is after c: pos >= (c + 1) * 128
      const int64_t r0 = std::max<int64_t>(0, (c + 1) * kB - pos0);
      for (int64_t v0 = r0 * heads; v0 < nvec; v0 += kV) {
        const int nv = static_cast<int>(std::min<int64_t>(kV, nvec - v0));
        const double* qp[kV];
        for (int v = 0; v < kV; ++v) qp[v] = qd.data() + (v0 + std::min(v, nv - 1)) * kD;
        double best[kV];
        block_max(kT.data(), qp, nv, best);
        for (int v = 0; v < nv; ++v) score[(v0 + v) * max_local + c] = best[v];
      }
    }
  }
  const int32_t ranked = topk - 1 - init_blocks;
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t local = (pos0 + i) / kB;
    for (int32_t h = 0; h < heads; ++h) {
      int32_t* o = out + (i * heads + h) * topk;
      if (local + 1 <= topk) {
        for (int32_t k = 0; k < topk; ++k) o[k] = k <= local ? k : -1;
        continue;
      }
      const double* s = score.data() + (i * heads + h) * max_local;
      ids.resize(static_cast<size_t>(local - init_blocks));
      std::iota(ids.begin(), ids.end(), init_blocks);
      const auto better = [&](int32_t a, int32_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); };
      std::partial_sort(ids.begin(), ids.begin() + ranked, ids.end(), better);
      ids.resize(static_cast<size_t>(ranked));
      for (int32_t k = 0; k < init_blocks; ++k) ids.push_back(k);
      ids.push_back(static_cast<int32_t>(local));
      std::sort(ids.begin(), ids.end());
      for (int32_t k = 0; k < topk; ++k) o[k] = k < static_cast<int32_t>(ids.size()) ? ids[k] : -1;
    }
  }
}

double selection_recall(const int32_t* ref, const int32_t* sel, int32_t topk) {
  int32_t nref = 0, hit = 0, j = 0;
  for (int32_t i = 0; i < topk && ref[i] >= 0; ++i) {
    ++nref;
    while (j < topk && sel[j] >= 0 && sel[j] < ref[i]) ++j;
    if (j < topk && sel[j] == ref[i]) ++hit;
  }
  return nref ? static_cast<double>(hit) / nref : 1.0;
}

}  // namespace indexcp::cli
