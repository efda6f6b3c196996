// CPU scoring, selection, publish and merge (spec/indexer.md sections 3-5).
#include "kernels.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <new>
#include <string>

#include "indexcp/error.hpp"

namespace indexcp::cpu {

namespace {
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// NaN-ignoring maximum under the order of indexer.md section 3 (NaN only if all are NaN).
inline float nan_max(float m, float v) {
  if (fmt::is_nan(v)) return m;
  if (fmt::is_nan(m) || v > m) return v;
  return m;
}
}  // namespace

float dot128(const double* q, const double* k) {
  // Every product is exact in fp64 and, for FP8/NVFP4 keys, so is every partial sum (values are
  // multiples of 2^-19 below 2^28 in magnitude: 47 bits): the result is the exact dot product rounded
  // once to fp32, independent of the summation order. BF16 keys: a fixed order.
  double a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
  for (int d = 0; d < kHeadDim; d += 8) {
    a0 += q[d] * k[d];
    a1 += q[d + 1] * k[d + 1];
    a2 += q[d + 2] * k[d + 2];
    a3 += q[d + 3] * k[d + 3];
    a4 += q[d + 4] * k[d + 4];
    a5 += q[d + 5] * k[d + 5];
    a6 += q[d + 6] * k[d + 6];
    a7 += q[d + 7] * k[d + 7];
  }
  return static_cast<float>(((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)));
}

std::vector<std::pair<int64_t, int64_t>> request_runs(const std::vector<QueryRow>& rows) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  int64_t i = 0;
  const int64_t n = static_cast<int64_t>(rows.size());
  while (i < n) {
    if (rows[i].pos < 0) { ++i; continue; }
    int64_t j = i + 1;
    while (j < n && rows[j].request == rows[i].request && rows[j].pos >= 0) ++j;
    runs.emplace_back(i, j);
    i = j;
  }
  return runs;
}

void check_scores(const BlockScores& s, const std::vector<QueryRow>& rows) {
  INDEXCP_REQUIRE(static_cast<int64_t>(rows.size()) == s.rows,
                  "scores.rows = " + std::to_string(s.rows) + " does not match rows (" + std::to_string(rows.size()) + ")");
  INDEXCP_REQUIRE(s.heads >= 1 && s.heads <= 64, "scores.heads = " + std::to_string(s.heads) + " is out of range 1..64");
  INDEXCP_REQUIRE(s.max_blocks >= 0, "scores.max_blocks = " + std::to_string(s.max_blocks) + " must be >= 0");
  // rows x heads x max_blocks can wrap in 64 bits and match empty vectors: an overflowing product
  // matches no size
  int64_t n = 0;
  const bool over = __builtin_mul_overflow(s.rows, static_cast<int64_t>(s.heads), &n) ||
                    __builtin_mul_overflow(n, s.max_blocks, &n);
  INDEXCP_REQUIRE(!over && static_cast<uint64_t>(n) == s.score.size() && static_cast<uint64_t>(n) == s.valid.size(),
                  "scores.score / scores.valid must hold rows x heads x max_blocks = " + std::to_string(s.rows) + " x " +
                      std::to_string(s.heads) + " x " + std::to_string(s.max_blocks) + " entries");
  for (size_t i = 0; i < rows.size(); ++i)
    INDEXCP_REQUIRE(rows[i].pos < 0 || rows[i].pos / kBlockTokens < s.max_blocks,
                    "rows[" + std::to_string(i) + "] at position " + std::to_string(rows[i].pos) +
                        " has blocks beyond scores.max_blocks = " + std::to_string(s.max_blocks));
}

BlockScores make_scores(int64_t rows, int32_t nh, int64_t max_blocks) {
  BlockScores s;
  s.rows = rows;
  s.heads = nh;
  s.max_blocks = max_blocks;
  const long double n = static_cast<long double>(rows) * nh * max_blocks;
  if (n > static_cast<long double>(int64_t{1} << 31))
    throw Error(ErrorCode::kRuntime, "block scores of rows x heads x max_blocks = " + std::to_string(rows) +
                                         " x " + std::to_string(nh) + " x " + std::to_string(max_blocks) +
                                         " exceed 2^31 entries; lower max_pages or split the batch");
  try {
    s.score.assign(static_cast<size_t>(n), kNegInf);
    s.valid.assign(static_cast<size_t>(n), 0);
  } catch (const std::bad_alloc&) {
    throw Error(ErrorCode::kRuntime, "could not allocate block scores of " + std::to_string(static_cast<int64_t>(n)) + " entries");
  }
  return s;
}

std::vector<double> decode_q(const uint8_t* q, int64_t rows, int32_t heads, int32_t h0, int32_t nh) {
  std::vector<double> qd(static_cast<size_t>(rows) * nh * kHeadDim);
  for (int64_t r = 0; r < rows; ++r)
    for (int32_t h = 0; h < nh; ++h)
      for (int d = 0; d < kHeadDim; ++d)
        qd[(r * nh + h) * kHeadDim + d] = e4m3_decode(q[(r * heads + h0 + h) * kHeadDim + d]);
  return qd;
}

void score_items(const std::vector<WorkItem>& items, const std::vector<QueryRow>& rows,
                 const std::vector<double>& qd, const BlockSource& source, BlockScores& out) {
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int32_t nh = out.heads;
#pragma omp parallel
  {
    std::vector<double> kbuf(static_cast<size_t>(kBlockTokens) * kHeadDim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const WorkItem& w = items[it];
      const int n = source(w.request, w.block, kbuf.data());
      if (n == 0) continue;
      for (int64_t r = w.row_begin; r < w.row_end; ++r) {
        if (rows[r].pos < 0 || rows[r].pos / kBlockTokens <= w.block) continue;  // not historical
        for (int32_t h = 0; h < nh; ++h) {
          const double* qv = qd.data() + (r * nh + h) * kHeadDim;
          float m = std::numeric_limits<float>::quiet_NaN();
          for (int t = 0; t < n; ++t) m = nan_max(m, dot128(qv, kbuf.data() + t * kHeadDim));
          const size_t idx = static_cast<size_t>((r * nh + h) * out.max_blocks + w.block);
          out.score[idx] = m;
          out.valid[idx] = 1;
        }
      }
    }
  }
}

namespace {
// k_hat of every (scale byte, E2M1 code) pair for both rounding modes: [mode][scale][code], the
// values nvfp4_khat returns (a table lookup instead of the per-element E4M3 re-rounding).
struct KhatTable {
  double v[2][256][16];
  KhatTable() {
    for (int m = 0; m < 2; ++m)
      for (int s = 0; s < 256; ++s)
        for (int c = 0; c < 16; ++c)
          v[m][s][c] = nvfp4_khat(static_cast<uint8_t>(c), static_cast<uint8_t>(s), static_cast<KRounding>(m));
  }
};
const KhatTable& khat_table() {
  static const KhatTable t;
  return t;
}
}  // namespace

const double* e4m3_table() {
  static const struct T {
    double v[256];
    T() {
      for (int b = 0; b < 256; ++b) v[b] = e4m3_decode(static_cast<uint8_t>(b));
    }
  } t;
  return t.v;
}

// k_hat of local rows [first, first+count) of a page into kbuf (fp64).
static void page_rows_khat(const CacheView& c, int32_t layer, int64_t page, int32_t first,
                           int32_t count, KRounding mode, double* kbuf) {
  const PageLayout& l = c.layout();
  const uint8_t* p = c.page_ptr(layer, page);
  const KhatTable& kt = khat_table();
  float tmp[kHeadDim];
  for (int32_t i = 0; i < count; ++i) {
    const int32_t row = first + i;
    switch (l.dtype) {
      case KvDtype::kNvfp4: {
        const uint8_t* data = p + l.row_data_offset(row);
        const uint8_t* sc = p + l.row_scale_offset(row);
        double* o = kbuf + i * kHeadDim;
        for (int g = 0; g < kNvfp4ScalesPerKey; ++g) {
          const double* t = kt.v[static_cast<int>(mode)][sc[g]];
          for (int j = 0; j < kNvfp4Group / 2; ++j) {
            const uint8_t byte = data[g * 8 + j];
            o[g * 16 + 2 * j] = t[byte & 0xf];
            o[g * 16 + 2 * j + 1] = t[byte >> 4];
          }
        }
        continue;
      }
      case KvDtype::kFp8: {
        const double* t = e4m3_table();
        const uint8_t* k = p + l.row_data_offset(row);
        for (int d = 0; d < kHeadDim; ++d) kbuf[i * kHeadDim + d] = t[k[d]];
        continue;
      }
      case KvDtype::kBf16:
        for (int d = 0; d < kHeadDim; ++d) {
          const uint8_t* b = p + l.row_data_offset(row) + 2 * d;
          tmp[d] = bf16_decode(static_cast<uint16_t>(b[0] | (b[1] << 8)));
        }
        break;
    }
    for (int d = 0; d < kHeadDim; ++d) kbuf[i * kHeadDim + d] = tmp[d];
  }
}

BlockScores score_blocks(const CacheView& cache, int32_t layer, const std::vector<QueryRow>& rows,
                         const int32_t* block_table, int32_t max_pages, const uint8_t* q,
                         int32_t heads, int32_t h0, int32_t nh, KRounding mode, BlockFilter filter) {
  const PageLayout& l = cache.layout();
  const int64_t max_blocks = static_cast<int64_t>(max_pages) * l.blocks_per_page();
  BlockScores out = make_scores(static_cast<int64_t>(rows.size()), nh, max_blocks);
  const auto qd = decode_q(q, static_cast<int64_t>(rows.size()), heads, h0, nh);
  std::vector<WorkItem> items;
  for (const auto& run : request_runs(rows)) {
    int64_t max_local = 0;
    for (int64_t r = run.first; r < run.second; ++r)
      max_local = std::max(max_local, rows[r].pos / kBlockTokens);
    for (int64_t b = 0; b < max_local; ++b) {
      if (b % filter.modulus != filter.residue) continue;
      int64_t lp;
      int32_t first, count;
      l.block_rows_on_rank(b, cache.rank(), &lp, &first, &count);
      if (count == 0) continue;
      items.push_back({run.first, run.second, rows[run.first].request, b});
    }
  }
  const int32_t rank = cache.rank();
  auto source = [&](int32_t request, int64_t b, double* kbuf) -> int {
    int64_t lp;
    int32_t first, count;
    l.block_rows_on_rank(b, rank, &lp, &first, &count);
    const int64_t page = block_table[static_cast<int64_t>(request) * max_pages + lp];
    page_rows_khat(cache, layer, page, first, count, mode, kbuf);
    return count;
  };
  score_items(items, rows, qd, source, out);
  return out;
}

namespace {
struct Cand {
  float s;
  int32_t id;
};
inline bool better(const Cand& a, const Cand& b) { return candidate_better(a.s, a.id, b.s, b.id); }

// Writes the selection of one (row, head) given the chosen ranked ids (any order).
void finish_row(int64_t local, const SelectionParams& sel, std::vector<int32_t>& ids, int32_t* out) {
  for (int32_t i = 0; i < sel.init_blocks; ++i) ids.push_back(i);
  ids.push_back(static_cast<int32_t>(local));
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  int32_t k = 0;
  for (; k < sel.topk && k < static_cast<int32_t>(ids.size()); ++k) out[k] = ids[k];
  for (; k < sel.topk; ++k) out[k] = -1;
}

// Output for rows with n <= K visible blocks (or padding, n = 0): 0..n-1 then -1.
void write_all_visible(int64_t n, const SelectionParams& sel, int32_t* out) {
  for (int32_t k = 0; k < sel.topk; ++k) out[k] = k < n ? k : -1;
}

// Keeps the `keep` best of v (by (score desc, id asc)) in v's first entries, sorted.
void keep_best(std::vector<Cand>& v, int32_t keep) {
  if (static_cast<int32_t>(v.size()) > keep) {
    std::nth_element(v.begin(), v.begin() + keep, v.end(), better);
    v.resize(static_cast<size_t>(keep));
  }
  std::sort(v.begin(), v.end(), better);
}
}  // namespace

void select_topk(const BlockScores& s, const std::vector<QueryRow>& rows, const SelectionParams& sel,
                 int32_t* out) {
  const int64_t nrows = static_cast<int64_t>(rows.size());
#pragma omp parallel
  {
    std::vector<Cand> v;
    std::vector<int32_t> ids;
#pragma omp for schedule(dynamic, 4)
    for (int64_t r = 0; r < nrows; ++r) {
      const int64_t n = visible_blocks(rows[r]);
      for (int32_t h = 0; h < s.heads; ++h) {
        int32_t* o = out + (r * s.heads + h) * sel.topk;
        if (n <= sel.topk) { write_all_visible(n, sel, o); continue; }
        const int64_t local = n - 1;
        v.clear();
        for (int64_t b = sel.init_blocks; b < local; ++b)
          v.push_back({s.at(r, h, b), static_cast<int32_t>(b)});
        keep_best(v, sel.ranked());
        ids.clear();
        for (const auto& c : v) ids.push_back(c.id);
        finish_row(local, sel, ids, o);
      }
    }
  }
}

void publish(const BlockScores& s, const std::vector<QueryRow>& rows, const SelectionParams& sel,
             Candidate* out) {
  const int64_t nrows = static_cast<int64_t>(rows.size());
  const int32_t kc = sel.ranked();
#pragma omp parallel
  {
    std::vector<Cand> v;
#pragma omp for schedule(dynamic, 4)
    for (int64_t r = 0; r < nrows; ++r) {
      const int64_t n = visible_blocks(rows[r]);
      for (int32_t h = 0; h < s.heads; ++h) {
        Candidate* o = out + (r * s.heads + h) * kc;
        v.clear();
        if (n > sel.topk) {
          const int64_t local = n - 1;
          const size_t base = static_cast<size_t>((r * s.heads + h) * s.max_blocks);
          for (int64_t b = sel.init_blocks; b < local; ++b)
            if (s.valid[base + b]) v.push_back({s.score[base + b], static_cast<int32_t>(b)});
          keep_best(v, kc);
        }
        int32_t k = 0;
        for (; k < static_cast<int32_t>(v.size()); ++k) o[k] = {v[k].s, v[k].id};
        for (; k < kc; ++k) o[k] = {kNegInf, -1};
      }
    }
  }
}

void merge(const Candidate* cands, int32_t world, const std::vector<QueryRow>& rows, int32_t heads,
           int32_t h0, int32_t nh, const SelectionParams& sel, int32_t* out) {
  const int64_t nrows = static_cast<int64_t>(rows.size());
  const int32_t kc = sel.ranked();
  const int64_t per_rank = nrows * heads * kc;
#pragma omp parallel
  {
    std::vector<Cand> v;
    std::vector<int32_t> ids;
#pragma omp for schedule(dynamic, 4)
    for (int64_t r = 0; r < nrows; ++r) {
      const int64_t n = visible_blocks(rows[r]);
      for (int32_t hh = 0; hh < nh; ++hh) {
        const int32_t h = h0 + hh;
        int32_t* o = out + (r * nh + hh) * sel.topk;
        if (n <= sel.topk) { write_all_visible(n, sel, o); continue; }
        const int64_t local = n - 1;
        v.clear();
        for (int32_t w = 0; w < world; ++w) {
          const Candidate* c = cands + w * per_rank + (r * heads + h) * kc;
          for (int32_t k = 0; k < kc; ++k)
            if (c[k].block >= sel.init_blocks && c[k].block < local) v.push_back({c[k].score, c[k].block});
        }
        // deduplicate by block id keeping the maximum score
        std::sort(v.begin(), v.end(), [](const Cand& a, const Cand& b) {
          if (a.id != b.id) return a.id < b.id;
          return score_below(b.s, a.s);  // best first within an id
        });
        size_t u = 0;
        for (size_t i = 0; i < v.size(); ++i)
          if (u == 0 || v[u - 1].id != v[i].id) v[u++] = v[i];
        v.resize(u);
        keep_best(v, kc);
        ids.clear();
        for (const auto& c : v) ids.push_back(c.id);
        finish_row(local, sel, ids, o);
      }
    }
  }
}

}  // namespace indexcp::cpu
