// The replay cases of ../shared/cases/README.md (C01-C11) on the CPU, the adversarial merge
// tests and the bit-exact sharded == replicated sweep of issue 2 item 8.
// (C07 runs under the `slow` label in test_cases_slow.cpp.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "indexcp/cache.hpp"
#include "indexcp/comm.hpp"
#include "indexcp/error.hpp"
#include "indexcp/icp.hpp"
#include "indexcp/indexer.hpp"
#include "util.hpp"

namespace cases {


using namespace indexcp;
using namespace testutil;

/// Runs fn, expects an indexcp::Error whose message holds every needle.
template <class F>
inline void expect_error(F&& fn, const std::vector<std::string>& needles, const std::string& ctx = "") {
  try {
    fn();
    ADD_FAILURE() << ctx << ": accepted; expected an error naming " << (needles.empty() ? "" : needles[0]);
  } catch (const Error& e) {
    const std::string w = e.what();
    for (const auto& n : needles) EXPECT_NE(w.find(n), std::string::npos) << ctx << ": '" << w << "' lacks '" << n << "'";
  }
}

inline std::vector<uint8_t> snapshot(const IndexCache& c) { return std::vector<uint8_t>(c.data(), c.data() + c.size_bytes()); }

/// Requests whose pages are given by hand (pages may be shared between requests: prefix caching).
inline Requests manual_requests(int32_t P, int64_t num_pages, const std::vector<std::vector<int32_t>>& pages,
                                const std::vector<int32_t>& seq_lens) {
  Requests r;
  r.page_size = P;
  r.num_pages = num_pages;
  r.seq_lens = seq_lens;
  r.max_pages = 1;
  for (const auto& p : pages) r.max_pages = std::max<int32_t>(r.max_pages, static_cast<int32_t>(p.size()));
  r.block_table.assign(pages.size() * static_cast<size_t>(r.max_pages), -1);
  for (size_t b = 0; b < pages.size(); ++b)
    for (size_t i = 0; i < pages[b].size(); ++i) r.block_table[b * r.max_pages + i] = pages[b][i];
  return r;
}

/// Distinct slots of positions [0, upto[b]) of every request (shared pages give one slot once).
inline std::vector<int64_t> distinct_slots(const Requests& r, const std::vector<int32_t>& upto) {
  std::set<int64_t> s;
  for (size_t b = 0; b < upto.size(); ++b)
    for (int64_t p = 0; p < upto[b]; ++p) s.insert(r.slot(static_cast<int32_t>(b), p));
  return std::vector<int64_t>(s.begin(), s.end());
}

inline std::vector<float> normal_keys(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> k(static_cast<size_t>(n) * kHeadDim);
  for (auto& v : k) v = nd(rng);
  return k;
}

/// W caches (one per rank; W = 1: a replicated cache). Each rank gets either the whole batch
/// (full = true: the rank filters by ownership itself) or only the tokens it owns (faster).
inline std::vector<IndexCache> build_caches(KvDtype dt, int32_t P, int32_t W, int64_t num_pages,
                                            const std::vector<float>& keys, const std::vector<int64_t>& slots,
                                            bool full = false, int32_t layers = 1, int32_t layer = 0) {
  const PageLayout l = make_page_layout(dt, P, W);
  std::vector<IndexCache> out;
  for (int32_t r = 0; r < W; ++r) {
    out.emplace_back(l, num_pages, layers, r);
    if (full || W == 1) {
      insert_keys(out.back(), layer, keys.data(), slots.data(), static_cast<int64_t>(slots.size()));
    } else {
      std::vector<float> k;
      std::vector<int64_t> s;
      for (size_t t = 0; t < slots.size(); ++t)
        if (locate_slot(l, slots[t]).rank == r) {
          k.insert(k.end(), keys.begin() + t * kHeadDim, keys.begin() + (t + 1) * kHeadDim);
          s.push_back(slots[t]);
        }
      insert_keys(out.back(), layer, k.data(), s.data(), static_cast<int64_t>(s.size()));
    }
  }
  return out;
}

/// Runs fn(rank, comm, out) on W ranks, each writing [rows, owned heads, K]; returns all heads
/// [rows, H, K] with each head from its owner (ranks sharing a head must agree).
inline std::vector<int32_t> all_heads(int32_t W, int64_t rows, int32_t heads, int32_t K,
                                      const std::function<void(int, Communicator&, int32_t*)>& fn) {
  std::vector<std::vector<int32_t>> per(W);
  for (int32_t rank = 0; rank < W; ++rank) {
    int32_t h0, nh;
    owned_heads(heads, W, rank, &h0, &nh);
    per[rank].assign(static_cast<size_t>(rows) * nh * K, -7);
  }
  run_ranks(W, [&](int rank, Communicator& comm) { fn(rank, comm, per[rank].data()); });
  std::vector<int32_t> all(static_cast<size_t>(rows) * heads * K, -7);
  for (int32_t rank = 0; rank < W; ++rank) {
    int32_t h0, nh;
    owned_heads(heads, W, rank, &h0, &nh);
    for (int64_t r = 0; r < rows; ++r)
      for (int32_t h = 0; h < nh; ++h)
        for (int32_t k = 0; k < K; ++k) {
          const int32_t v = per[rank][(r * nh + h) * K + k];
          int32_t& dst = all[(r * heads + h0 + h) * K + k];
          if (dst == -7) dst = v;
          else EXPECT_EQ(dst, v) << "ranks sharing head " << h0 + h << " disagree at row " << r;
        }
  }
  return all;
}

inline std::vector<int32_t> replicated_decode(const IndexCache& c, const DecodeBatch& b, const SelectionParams& sel,
                                              KRounding mode) {
  std::vector<int32_t> out(static_cast<size_t>(b.rows()) * b.heads * sel.topk, -7);
  decode_select(c, 0, b, 0, b.heads, sel, mode, out.data());
  return out;
}

inline std::vector<int32_t> replicated_prefill(const IndexCache& c, const PrefillBatch& b, const SelectionParams& sel) {
  std::vector<int32_t> out(static_cast<size_t>(b.rows()) * b.heads * sel.topk, -7);
  prefill_select(c, 0, b, 0, b.heads, sel, out.data());
  return out;
}

inline std::vector<int32_t> gather_all(const std::vector<IndexCache>& shards, const PrefillBatch& b,
                                       const SelectionParams& sel, int64_t budget,
                                       std::vector<GatherStats>* stats = nullptr) {
  const int32_t W = static_cast<int32_t>(shards.size());
  std::vector<GatherStats> st(W);
  auto out = all_heads(W, b.rows(), b.heads, sel.topk, [&](int rank, Communicator& comm, int32_t* o) {
    st[rank] = prefill_gather(comm, shards[rank], 0, b, sel, budget, o);
  });
  if (stats) *stats = st;
  return out;
}

inline std::vector<int32_t> local_score_all(const std::vector<IndexCache>& shards, const PrefillBatch& b,
                                            const SelectionParams& sel) {
  const int32_t W = static_cast<int32_t>(shards.size());
  return all_heads(W, b.rows(), b.heads, sel.topk, [&](int rank, Communicator& comm, int32_t* o) {
    prefill_local_score(comm, shards[rank], 0, b, sel, o);
  });
}

/// Checks the output contract of indexer.md section 4 for every (row, head): min(K, n) valid
/// ascending ids, then -1; the local block present; nothing beyond the local block.
inline void expect_contract(const std::vector<int32_t>& out, const std::vector<QueryRow>& rows, int32_t heads,
                            const SelectionParams& sel, const std::string& ctx) {
  for (size_t r = 0; r < rows.size(); ++r)
    for (int32_t h = 0; h < heads; ++h) {
      const int32_t* o = out.data() + (r * heads + h) * sel.topk;
      const int64_t n = visible_blocks(rows[r]);
      const int64_t want = std::min<int64_t>(sel.topk, n);
      int64_t k = 0;
      for (; k < want; ++k) {
        ASSERT_GE(o[k], 0) << ctx << " row " << r << " head " << h << " entry " << k;
        ASSERT_LT(o[k], n) << ctx << " row " << r << " head " << h << ": block beyond the local block";
        if (k) { ASSERT_LT(o[k - 1], o[k]) << ctx << " row " << r << " head " << h; }
      }
      for (; k < sel.topk; ++k) ASSERT_EQ(o[k], -1) << ctx << " row " << r << " head " << h << " entry " << k;
      if (n) { ASSERT_EQ(o[want - 1], n - 1) << ctx << " row " << r << " head " << h << ": local block missing"; }
      for (int32_t i = 0; i < sel.init_blocks && i < n; ++i)
        ASSERT_EQ(o[i], i) << ctx << " row " << r << " head " << h << ": init block missing";
    }
}

}  // namespace cases

using namespace cases;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

std::vector<int32_t> row_of(int32_t K, std::initializer_list<int32_t> ids) {
  std::vector<int32_t> v(ids);
  v.resize(static_cast<size_t>(K), -1);
  return v;
}

std::vector<int32_t> slice(const std::vector<int32_t>& out, int64_t row, int32_t heads, int32_t h, int32_t K) {
  const auto* o = out.data() + (row * heads + h) * K;
  return std::vector<int32_t>(o, o + K);
}

// Writes the same row bytes (quantize_key_bytes form) into every local row of every page of
// every layer of `c`, through the layout's offsets (a constructed cache, not through insert).
void fill_all_rows(IndexCache& c, const std::vector<uint8_t>& row) {
  const PageLayout& l = c.layout();
  for (int32_t layer = 0; layer < c.num_layers(); ++layer)
    for (int64_t p = 0; p < c.num_pages(); ++p)
      for (int32_t j = 0; j < l.rows(); ++j) {
        uint8_t* page = c.page_ptr(layer, p);
        if (l.dtype == KvDtype::kNvfp4) {
          std::memcpy(page + l.row_data_offset(j), row.data(), 64);
          std::memcpy(page + l.row_scale_offset(j), row.data() + 64, 8);
        } else {
          std::memcpy(page + l.row_data_offset(j), row.data(), row.size());
        }
      }
}

// Independent float -> E4M3: the nearest finite E4M3 value by exhaustive search (ties to the even
// code), same sign as x; saturates because 448 is the nearest value above it.
uint8_t e4m3_nearest(float x) {
  const bool neg = std::signbit(x);
  const double a = std::fabs(static_cast<double>(x));
  int best = 0;
  double bd = INFINITY;
  for (int c = 0; c <= 0x7E; ++c) {
    const double v = e4m3_decode(static_cast<uint8_t>(c));
    const double d = std::fabs(v - a);
    if (d < bd || (d == bd && (c & 1) == 0)) {
      bd = d;
      best = c;
    }
  }
  return static_cast<uint8_t>(best | (neg ? 0x80 : 0));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// C01: zero keys through insert and read_row_bytes

TEST(Cases, C01_ZeroKeysThroughInsertAndReadBack) {
  std::vector<float> keys(3 * 128);
  for (int d = 0; d < 128; ++d) {
    keys[d] = 0.0f;
    keys[128 + d] = -0.0f;
    keys[256 + d] = (d / 16 == 3) ? 0.0f : 0.37f * static_cast<float>((d % 7) - 3) + 0.01f * d;
  }
  const std::vector<int64_t> slots = {5, 70, 100};
  for (float S : {1.0f, 268.8f})
    for (int W : {1, 2}) {
      const PageLayout l = make_page_layout(KvDtype::kNvfp4, 128, W);
      for (int r = 0; r < W; ++r) {
        IndexCache c(l, 2, 1, r);
        InsertOptions o;
        o.encode_scale = S;
        insert_keys(c, 0, keys.data(), slots.data(), 3, o);
        for (int t = 0; t < 3; ++t) {
          const SlotLocation s = locate_slot(l, slots[t]);
          if (s.rank != r) continue;
          const auto row = read_row_bytes(c, 0, s.page, s.row);
          ASSERT_EQ(row, quantize_key_bytes(KvDtype::kNvfp4, keys.data() + t * 128, S));
          if (t < 2) {
            for (int j = 0; j < 64; ++j) EXPECT_EQ(row[j], t == 0 ? 0x00 : 0x88) << "S " << S << " token " << t;
            for (int g = 0; g < 8; ++g) EXPECT_EQ(row[64 + g], 0x00) << "S " << S << " token " << t;
          } else {
            EXPECT_EQ(row[64 + 3], 0x00);
            for (int j = 24; j < 32; ++j) EXPECT_EQ(row[j], 0x00);
            for (int g = 0; g < 8; ++g) {
              if (g == 3) continue;
              uint8_t p[8];
              EXPECT_EQ(row[64 + g], nvfp4_quantize_group(keys.data() + 256 + 16 * g, S, p)) << "group " << g;
              EXPECT_NE(row[64 + g], 0);
              for (int j = 0; j < 8; ++j) EXPECT_EQ(row[8 * g + j], p[j]) << "group " << g;
            }
          }
          for (KRounding m : {KRounding::kE4m3, KRounding::kExact}) {
            float k[128];
            read_row_khat(c, 0, s.page, s.row, m, k);
            for (int d = 0; d < 128; ++d) {
              ASSERT_FALSE(std::isnan(k[d])) << "token " << t << " dim " << d;
              if (t < 2 || d / 16 == 3) { ASSERT_EQ(k[d], 0.0f) << "token " << t << " dim " << d; }
            }
          }
        }
      }
    }
  // FP8 cache: signed zeros stored as 0x00 / 0x80
  IndexCache f(make_page_layout(KvDtype::kFp8, 128, 1), 1, 1);
  insert_keys(f, 0, keys.data(), slots.data(), 2);
  for (int d = 0; d < 128; ++d) {
    EXPECT_EQ(read_row_bytes(f, 0, 0, 5)[d], 0x00);
    EXPECT_EQ(read_row_bytes(f, 0, 0, 70)[d], 0x80);
  }
  // scoring a cache of zero keys gives exact zeros, never NaN
  auto req = make_requests({400}, 128, 3);
  std::vector<float> zk(400 * 128, 0.0f);
  for (int i = 0; i < 200 * 128; ++i) zk[i] = -0.0f;
  std::vector<int64_t> zs;
  for (int p = 0; p < 400; ++p) zs.push_back(req.slot(0, p));
  IndexCache z(make_page_layout(KvDtype::kNvfp4, 128, 1), req.num_pages, 1);
  insert_keys(z, 0, zk.data(), zs.data(), 400);
  const auto q = make_q(1, 2, 5);
  const std::vector<QueryRow> rows = {{0, 399}};
  for (KRounding m : {KRounding::kE4m3, KRounding::kExact}) {
    const BlockScores s = score_blocks(z, 0, rows, req.block_table.data(), req.max_pages, q.data(), 2, 0, 2, m);
    for (int h = 0; h < 2; ++h)
      for (int b = 0; b < 3; ++b) {
        EXPECT_TRUE(s.valid[(0 * 2 + h) * s.max_blocks + b]);
        EXPECT_EQ(s.at(0, h, b), 0.0f) << "head " << h << " block " << b;
      }
  }
}

// ---------------------------------------------------------------------------------------------
// C02: no double rounding in the FP8 cache writer, the index-Q cast and the FP8 staging

TEST(Cases, C02_Fp8WriterQueryCastAndStaging) {
  const float a = std::nextafter(1.0625f, 2.0f);  // -> 0x39 (1.125); via bf16/fp16: 1.0
  const float b = fmt::bits_f32(0x43c8198c);       // 400.199585 -> 0x7D (416); via bf16: 384
  ASSERT_NEAR(b, 400.199585f, 1e-4f);
  std::vector<float> key(128);
  for (int d = 0; d < 128; ++d) key[d] = (d % 3 == 0) ? a : (d % 3 == 1) ? b : -a;
  const uint8_t want[3] = {0x39, 0x7D, 0xB9};
  // the FP8 cache writer, replicated and sharded
  for (int W : {1, 2, 4}) {
    const PageLayout l = make_page_layout(KvDtype::kFp8, 128, W);
    const int64_t slot = 128 + 77;
    const SlotLocation s = locate_slot(l, slot);
    IndexCache c(l, 2, 1, s.rank);
    insert_keys(c, 0, key.data(), &slot, 1);
    const auto row = read_row_bytes(c, 0, s.page, s.row);
    for (int d = 0; d < 128; ++d) ASSERT_EQ(row[d], want[d % 3]) << "W " << W << " dim " << d;
    // the staging of an FP8 cache hands the very bytes out
    std::vector<uint8_t> staged(static_cast<size_t>(l.rows()) * 128);
    const int32_t page = 1;
    stage_fp8(c, 0, &page, 1, staged.data());
    for (int d = 0; d < 128; ++d) ASSERT_EQ(staged[s.row * 128 + d], want[d % 3]);
  }
  // the index-Q cast
  std::vector<uint8_t> q(2 * 128);
  std::vector<float> q2(key);
  q2.insert(q2.end(), key.begin(), key.end());
  quantize_queries(q2.data(), 1, 2, {}, q.data());
  for (int i = 0; i < 256; ++i) ASSERT_EQ(q[i], want[(i % 128) % 3]) << i;
  // the staging of an NVFP4 cache: every code under every non-NaN scale byte, against an
  // exhaustive nearest-value search (e2m1 * e4m3 products need <= 6 bits: exact in any format,
  // including midpoints, which round to the even code)
  for (int W : {1, 4}) {
    const PageLayout l = make_page_layout(KvDtype::kNvfp4, 128, W);
    IndexCache c(l, 3, 2, W - 1);
    std::vector<uint8_t> scales;
    for (int s = 0; s < 256; ++s)
      if (!e4m3_is_nan(static_cast<uint8_t>(s))) scales.push_back(static_cast<uint8_t>(s));
    ASSERT_EQ(scales.size(), 254u);
    // 254 groups of 16 codes 0..15 -> 32 rows (the last one partly); page 2, layer 1
    const int rows_needed = (static_cast<int>(scales.size()) + 7) / 8;
    ASSERT_LE(rows_needed, l.rows() * 3);
    std::vector<std::pair<int, int>> where;  // (page, row) per used row
    for (int i = 0; i < rows_needed; ++i) where.push_back({2 - i / l.rows(), i % l.rows()});
    for (int i = 0; i < rows_needed; ++i) {
      uint8_t* page = c.page_ptr(1, where[i].first);
      for (int g = 0; g < 8; ++g) {
        const size_t gi = static_cast<size_t>(i) * 8 + g;
        page[l.row_scale_offset(where[i].second) + g] = gi < scales.size() ? scales[gi] : 0x38;
        for (int j = 0; j < 8; ++j)  // codes 2j (low nibble) and 2j+1 (high nibble)
          page[l.row_data_offset(where[i].second) + 8 * g + j] = static_cast<uint8_t>((2 * j) | ((2 * j + 1) << 4));
      }
    }
    const std::vector<int32_t> pages = {2, 1, 0, 2};  // any order, repeats allowed
    std::vector<uint8_t> out(pages.size() * l.rows() * 128, 0xEE);
    stage_fp8(c, 1, pages.data(), static_cast<int64_t>(pages.size()), out.data());
    int ties = 0;
    for (size_t pi = 0; pi < pages.size(); ++pi)
      for (int j = 0; j < l.rows(); ++j) {
        const uint8_t* page = c.page_ptr(1, pages[pi]);
        for (int d = 0; d < 128; ++d) {
          const uint8_t byte = page[l.row_data_offset(j) + d / 2];
          const uint8_t code = (d & 1) ? byte >> 4 : byte & 0xf;
          const float prod = e2m1_decode(code) * e4m3_decode(page[l.row_scale_offset(j) + d / 16]);
          const uint8_t ref = e4m3_nearest(prod);
          ASSERT_EQ(out[(pi * l.rows() + j) * 128 + d], ref)
              << "W " << W << " page " << pages[pi] << " row " << j << " dim " << d << " value " << prod;
          // count exact midpoints between two E4M3 neighbours (the double-rounding hazard)
          const float lo = e4m3_decode(ref);
          if (prod != lo && std::fabs(prod) <= 448.0f) {
            const uint8_t other = static_cast<uint8_t>(ref + ((std::fabs(prod) > std::fabs(lo)) ? 1 : -1));
            if (std::fabs(prod - lo) == std::fabs(prod - e4m3_decode(other))) ++ties;
          }
        }
      }
    EXPECT_GT(ties, 0) << "the staged values include exact midpoints";
  }
}

// ---------------------------------------------------------------------------------------------
// C03: tie plateau of 300 historical blocks (and 4 higher blocks), replicated, ICP and decode CP

class C03 : public ::testing::TestWithParam<KvDtype> {};

TEST_P(C03, TiePlateau) {
  const KvDtype dt = GetParam();
  const int32_t seq = 300 * 128 + 1;  // one decode row at position 38400, local block 300
  const int32_t H = 2;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint8_t> q(H * 128);
  for (auto& v : q) v = e4m3_encode(0.25f + std::fabs(nd(rng)));  // positive: a +1 key scores > 0
  SelectionParams sel;
  const std::vector<int32_t> plateau = row_of(16, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 300});
  const std::vector<int32_t> four = row_of(16, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 100, 250, 299, 300});
  std::vector<float> zero(128, 0.0f), one(128, 1.0f), minus(128, -1.0f);
  ASSERT_EQ(quantize_key_bytes(dt, zero.data()), std::vector<uint8_t>(static_cast<size_t>(key_bytes(dt)), 0))
      << "a zero-filled cache holds quantized +0.0 keys";
  const std::vector<int64_t> hot_pos = {5 * 128 + 17, 100 * 128 + 64, 250 * 128 + 127, 299 * 128 + 3};

  for (int32_t P : {128, 256}) {
    const Requests req = make_requests({seq}, P, 7u + P);
    const DecodeBatch batch = decode_batch(req, q, H, 1);
    for (int variant = 0; variant < 3; ++variant) {
      // variant 0: all keys zero; 1: four blocks hold one +1 key; 2: every key -1 (equal negative scores)
      const std::vector<int32_t>& want = variant == 1 ? four : plateau;
      auto make = [&](int32_t W) {
        const PageLayout l = make_page_layout(dt, P, W);
        std::vector<IndexCache> cs;
        for (int32_t r = 0; r < W; ++r) {
          cs.emplace_back(l, req.num_pages, 1, r);
          if (variant == 2) {
            fill_all_rows(cs.back(), quantize_key_bytes(dt, minus.data()));
          } else {
            // explicit zero keys for the first 130 tokens, the rest is the zero-filled cache
            std::vector<int64_t> slots;
            std::vector<float> keys;
            for (int64_t p = 0; p < 130; ++p) {
              slots.push_back(req.slot(0, p));
              keys.insert(keys.end(), zero.begin(), zero.end());
            }
            if (variant == 1)
              for (int64_t p : hot_pos) {
                slots.push_back(req.slot(0, p));
                keys.insert(keys.end(), one.begin(), one.end());
              }
            insert_keys(cs.back(), 0, keys.data(), slots.data(), static_cast<int64_t>(slots.size()));
          }
        }
        return cs;
      };
      const auto rep = make(1);
      std::map<int32_t, std::vector<IndexCache>> shards;
      for (int32_t W : {2, 4, 8}) shards.emplace(W, make(W));
      for (KRounding m : {KRounding::kE4m3, KRounding::kExact}) {
        const std::string ctx = to_string(dt) + " P" + std::to_string(P) + " variant " + std::to_string(variant) +
                                " " + to_string(m);
        const auto out = replicated_decode(rep[0], batch, sel, m);
        for (int h = 0; h < H; ++h) EXPECT_EQ(slice(out, 0, H, h, 16), want) << ctx << " head " << h;
        for (const auto& [W, sh] : shards)
          EXPECT_EQ(icp_all_heads(sh, 0, batch, sel, m), out) << ctx << " ICP W" << W;
        for (int32_t W : {2, 4})
          EXPECT_EQ(icp_all_heads(rep, 0, batch, sel, m, true, W), out) << ctx << " decode CP W" << W;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, C03, ::testing::Values(KvDtype::kNvfp4, KvDtype::kFp8),
                         [](const auto& i) { return to_string(i.param); });

// ---------------------------------------------------------------------------------------------
// C04: fewer blocks than K

TEST(Cases, C04_FewerBlocksThanK) {
  const std::vector<int64_t> positions = {0, 127, 128, 1919, 1920, 2047, 2048};
  for (int32_t P : {128, 256}) {
    // every request shares the pages of one 2049-token context (prefix caching)
    const int32_t np = (2049 + P - 1) / P;
    std::vector<int32_t> pages;
    for (int32_t i = 0; i < np; ++i) pages.push_back((i * 7 + 2) % (np + 3));
    std::vector<std::vector<int32_t>> bt;
    std::vector<int32_t> lens;
    for (int64_t p : positions) {
      const int32_t need = static_cast<int32_t>((p + 1 + P - 1) / P);
      bt.emplace_back(pages.begin(), pages.begin() + need);
      lens.push_back(static_cast<int32_t>(p + 1));
    }
    const Requests req = manual_requests(P, np + 3, bt, lens);
    const Requests one = manual_requests(P, np + 3, {pages}, {2049});
    std::vector<int64_t> s2;
    for (int64_t p = 0; p < 2049; ++p) s2.push_back(one.slot(0, p));
    const auto keys = normal_keys(2049, 11);
    const int32_t H = 4;
    const auto q = make_q(static_cast<int64_t>(positions.size()), H, 12);
    const DecodeBatch batch = decode_batch(req, q, H, 1);
    const auto rows = decode_rows(batch, req.num_pages, P);
    for (size_t i = 0; i < positions.size(); ++i) ASSERT_EQ(rows[i].pos, positions[i]);
    SelectionParams sel;
    const auto rep = build_caches(KvDtype::kNvfp4, P, 1, req.num_pages, keys, s2);
    const auto out = replicated_decode(rep[0], batch, sel, KRounding::kE4m3);
    expect_contract(out, rows, H, sel, "C04 P" + std::to_string(P));
    for (size_t i = 0; i < positions.size(); ++i) {
      const int64_t n = positions[i] / 128 + 1;
      for (int h = 0; h < H; ++h) {
        const auto o = slice(out, static_cast<int64_t>(i), H, h, 16);
        const int64_t valid = std::count_if(o.begin(), o.end(), [](int32_t v) { return v >= 0; });
        EXPECT_EQ(valid, std::min<int64_t>(16, n)) << "pos " << positions[i];
        if (n <= 16) {
          for (int64_t k = 0; k < 16; ++k) EXPECT_EQ(o[k], k < n ? k : -1) << "pos " << positions[i];
        }
        EXPECT_EQ(std::count(o.begin(), o.end(), static_cast<int32_t>(n - 1)), 1) << "pos " << positions[i];
      }
    }
    EXPECT_EQ(out, brute_force(rep[0], 0, req, rows, q, H, sel, KRounding::kE4m3));
    for (int32_t W : {2, 4}) {
      const auto shards = build_caches(KvDtype::kNvfp4, P, W, req.num_pages, keys, s2);
      EXPECT_EQ(icp_all_heads(shards, 0, batch, sel, KRounding::kE4m3), out) << "ICP P" << P << " W" << W;
      // prefill rows at the same positions (one new token per request)
      std::vector<int32_t> qs(positions.size() + 1);
      for (size_t i = 0; i <= positions.size(); ++i) qs[i] = static_cast<int32_t>(i);
      const PrefillBatch pb = prefill_batch(req, q, H, qs);
      const auto pref = replicated_prefill(rep[0], pb, sel);
      EXPECT_EQ(pref, out) << "prefill replicated P" << P;
      EXPECT_EQ(gather_all(shards, pb, sel, int64_t{1} << 40), pref) << "gather P" << P << " W" << W;
      EXPECT_EQ(local_score_all(shards, pb, sel), pref) << "local_score P" << P << " W" << W;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// C05: the future stays invisible

TEST(Cases, C05_FutureKeysAreNeverSelected) {
  const int32_t H = 4;
  for (int32_t P : {128, 256}) {
    // pages written far beyond seq_len: request 0 up to 2048 tokens, request 1 up to 3072
    Requests req = make_requests({2048, 3072}, P, 21u + P);
    const std::vector<int32_t> big_from = {1024, 2560};
    std::vector<float> keys;
    std::vector<int64_t> slots;
    make_keys(req, 22u + P, keys, slots, 0.1f);
    size_t t = 0;
    for (int32_t b = 0; b < 2; ++b)
      for (int64_t p = 0; p < req.seq_lens[b]; ++p, ++t)
        if (p >= big_from[b])
          for (int d = 0; d < 128; ++d) keys[t * 128 + d] = 4.0f;  // huge dot product with positive q
    req.seq_lens = {1028, 2600};                                  // rows 1020..1027 and 2592..2599
    std::mt19937 rng(23);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<uint8_t> q(16 * H * 128);
    for (auto& v : q) v = e4m3_encode(0.1f + std::fabs(nd(rng)));
    const DecodeBatch batch = decode_batch(req, q, H, 8);
    const auto rows = decode_rows(batch, req.num_pages, P);
    for (int i = 0; i < 8; ++i) {
      ASSERT_EQ(rows[i].pos, 1020 + i);
      ASSERT_EQ(rows[i].pos / 128, i < 4 ? 7 : 8) << "row " << i << " uses its own local block";
    }
    const auto rep = build_caches(KvDtype::kNvfp4, P, 1, req.num_pages, keys, slots);
    std::map<int32_t, std::vector<IndexCache>> sharded;
    for (int32_t W : {2, 4}) sharded.emplace(W, build_caches(KvDtype::kNvfp4, P, W, req.num_pages, keys, slots));
    for (int32_t K : {16, 4}) {
      SelectionParams sel;
      sel.topk = K;
      for (KRounding m : {KRounding::kE4m3, KRounding::kExact}) {
        const std::string ctx = "P" + std::to_string(P) + " K" + std::to_string(K) + " " + to_string(m);
        const auto out = replicated_decode(rep[0], batch, sel, m);
        expect_contract(out, rows, H, sel, ctx);
        EXPECT_EQ(out, brute_force(rep[0], 0, req, rows, q, H, sel, m)) << ctx;
        if (K == 16) {
          for (int i = 0; i < 8; ++i)
            for (int h = 0; h < H; ++h)
              EXPECT_EQ(slice(out, i, H, h, 16),
                        i < 4 ? row_of(16, {0, 1, 2, 3, 4, 5, 6, 7}) : row_of(16, {0, 1, 2, 3, 4, 5, 6, 7, 8}))
                  << ctx << " row " << i;
        }
        for (int32_t W : {2, 4}) {
          const auto& shards = sharded.at(W);
          EXPECT_EQ(icp_all_heads(shards, 0, batch, sel, m), out) << ctx << " ICP W" << W;
          EXPECT_EQ(icp_all_heads(rep, 0, batch, sel, m, true, W), out) << ctx << " decode CP W" << W;
          if (m == KRounding::kE4m3) {
            const std::vector<int32_t> qs = {0, 8, 16};
            const PrefillBatch pb = prefill_batch(req, q, H, qs);
            const auto prows = prefill_rows(pb, req.num_pages, P);
            const auto pref = replicated_prefill(rep[0], pb, sel);
            expect_contract(pref, prows, H, sel, ctx + " prefill");
            EXPECT_EQ(pref, out) << ctx << " prefill rows at the decode positions";
            EXPECT_EQ(gather_all(shards, pb, sel, int64_t{1} << 40), pref) << ctx << " gather W" << W;
            EXPECT_EQ(gather_all(shards, pb, sel, gather_unit_bytes(shards[0].layout())), pref)
                << ctx << " gather one unit W" << W;
            EXPECT_EQ(local_score_all(shards, pb, sel), pref) << ctx << " local_score W" << W;
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// C06: write/read round trip through the owning rank's shard

TEST(Cases, C06_RoundTripThroughTheOwnersShard) {
  for (int32_t P : {128, 256})
    for (int32_t W : {1, 2, 4})
      for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8}) {
        const Requests req = make_requests({1, 129, 300}, P, 31u + P + W, 5);
        std::vector<float> keys;
        std::vector<int64_t> slots;
        make_keys(req, 32u + W, keys, slots, 2.0f);
        const PageLayout l = make_page_layout(dt, P, W);
        const auto shards = build_caches(dt, P, W, req.num_pages, keys, slots, /*full=*/true);
        std::vector<int64_t> owned(W, 0);
        for (size_t t = 0; t < slots.size(); ++t) {
          const SlotLocation s = locate_slot(l, slots[t]);
          ASSERT_EQ(s.page * P + s.offset, slots[t]);
          ASSERT_EQ(s.rank * l.rows() + s.row, s.offset);
          ++owned[s.rank];
          ASSERT_EQ(read_row_bytes(shards[s.rank], 0, s.page, s.row), quantize_key_bytes(dt, keys.data() + t * 128))
              << to_string(dt) << " P" << P << " W" << W << " token " << t;
        }
        // every other row of every shard stays empty
        for (int32_t r = 0; r < W; ++r) {
          int64_t nonzero = 0;
          for (int64_t p = 0; p < req.num_pages; ++p)
            for (int32_t j = 0; j < l.rows(); ++j) {
              const auto b = read_row_bytes(shards[r], 0, p, j);
              nonzero += std::any_of(b.begin(), b.end(), [](uint8_t x) { return x != 0; });
            }
          EXPECT_EQ(nonzero, owned[r]) << to_string(dt) << " P" << P << " W" << W << " rank " << r;
        }
      }
}

// ---------------------------------------------------------------------------------------------
// C08: ranks that own nothing (W = 4, P = 128, 32 rows per rank, Q = 1)

TEST(Cases, C08_RanksThatOwnNothing) {
  const int32_t P = 128, W = 4, H = 4;
  const std::vector<int32_t> tails = {1, 31, 33, 127, 129, 200};
  // physical pages from a shuffled pool; the six long requests share a 20-page prefix
  std::vector<int32_t> pool(48);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), std::mt19937(41));
  size_t next = 0;
  std::vector<std::vector<int32_t>> bt;
  std::vector<int32_t> lens;
  for (int32_t t : tails) {
    bt.emplace_back();
    for (int32_t i = 0; i < (t + P - 1) / P; ++i) bt.back().push_back(pool[next++]);
    lens.push_back(t);
  }
  std::vector<int32_t> prefix;
  for (int i = 0; i < 20; ++i) prefix.push_back(pool[next++]);
  for (int32_t t : tails) {
    bt.push_back(prefix);
    for (int32_t i = 0; i < (t + P - 1) / P; ++i) bt.back().push_back(pool[next++]);
    lens.push_back(2560 + t);
  }
  const Requests req = manual_requests(P, 48, bt, lens);
  const auto slots = distinct_slots(req, lens);
  const auto keys = normal_keys(static_cast<int64_t>(slots.size()), 42);
  std::map<int64_t, size_t> token_of;
  for (size_t t = 0; t < slots.size(); ++t) token_of[slots[t]] = t;

  const PageLayout l = make_page_layout(KvDtype::kNvfp4, P, W);
  const auto rep = build_caches(KvDtype::kNvfp4, P, 1, req.num_pages, keys, slots);
  const auto shards = build_caches(KvDtype::kNvfp4, P, W, req.num_pages, keys, slots, /*full=*/true);
  // no rank writes a key it does not own: every local row holds its own token's key or zeros
  const std::vector<uint8_t> zero(72, 0);
  for (int32_t r = 0; r < W; ++r)
    for (int64_t p = 0; p < req.num_pages; ++p)
      for (int32_t j = 0; j < l.rows(); ++j) {
        const int64_t slot = p * P + l.offset_of_local_row(r, j);
        const auto it = token_of.find(slot);
        const auto got = read_row_bytes(shards[r], 0, p, j);
        if (it == token_of.end()) { ASSERT_EQ(got, zero) << "rank " << r << " page " << p << " row " << j; }
        else ASSERT_EQ(got, quantize_key_bytes(KvDtype::kNvfp4, keys.data() + it->second * 128))
            << "rank " << r << " page " << p << " row " << j;
      }
  // the one-token request lives on rank 0 only
  {
    const SlotLocation s = locate_slot(l, req.slot(0, 0));
    EXPECT_EQ(s.rank, 0);
  }
  const auto q = make_q(static_cast<int64_t>(lens.size()), H, 43);
  const DecodeBatch batch = decode_batch(req, q, H, 1);
  const auto rows = decode_rows(batch, req.num_pages, P);
  SelectionParams sel;
  for (KRounding m : {KRounding::kE4m3, KRounding::kExact}) {
    const auto out = replicated_decode(rep[0], batch, sel, m);
    expect_contract(out, rows, H, sel, "C08");
    EXPECT_EQ(out, brute_force(rep[0], 0, req, rows, q, H, sel, m));
    EXPECT_EQ(icp_all_heads(shards, 0, batch, sel, m), out) << "ICP " << to_string(m);
    EXPECT_EQ(icp_all_heads(rep, 0, batch, sel, m, true, W), out) << "decode CP " << to_string(m);
  }
  // prefill of the last token of every request: gather and local_score
  std::vector<int32_t> qs(lens.size() + 1);
  for (size_t i = 0; i <= lens.size(); ++i) qs[i] = static_cast<int32_t>(i);
  const PrefillBatch pb = prefill_batch(req, q, H, qs);
  const auto pref = replicated_prefill(rep[0], pb, sel);
  EXPECT_EQ(pref, replicated_decode(rep[0], batch, sel, KRounding::kE4m3));
  EXPECT_EQ(gather_all(shards, pb, sel, int64_t{1} << 40), pref);
  EXPECT_EQ(gather_all(shards, pb, sel, 2 * gather_unit_bytes(l)), pref);
  EXPECT_EQ(local_score_all(shards, pb, sel), pref);
}

// ---------------------------------------------------------------------------------------------
// C09: padded batches

TEST(Cases, C09_PaddedBatches) {
  SelectionParams sel;
  const int32_t H = 4;
  for (int32_t B : {32, 64}) {
    // all padding: seq_len 0, block table all -1
    Requests req;
    req.page_size = 128;
    req.num_pages = 4;
    req.max_pages = 4;
    req.seq_lens.assign(B, 0);
    req.block_table.assign(static_cast<size_t>(B) * 4, -1);
    const auto q = make_q(B * 8, H, 51);
    const DecodeBatch batch = decode_batch(req, q, H, 8);
    const std::vector<int32_t> all_minus(static_cast<size_t>(B) * 8 * H * 16, -1);
    std::vector<float> keys;
    std::vector<int64_t> slots;
    for (int32_t W : {1, 2, 4}) {
      const auto caches = build_caches(KvDtype::kNvfp4, 128, W, 4, keys, slots);
      if (W == 1) {
        for (KRounding m : {KRounding::kE4m3, KRounding::kExact})
          EXPECT_EQ(replicated_decode(caches[0], batch, sel, m), all_minus) << "B " << B;
      } else {
        EXPECT_EQ(icp_all_heads(caches, 0, batch, sel, KRounding::kE4m3), all_minus) << "ICP B " << B << " W " << W;
      }
    }
    const auto rep = build_caches(KvDtype::kFp8, 128, 1, 4, keys, slots);
    EXPECT_EQ(icp_all_heads(rep, 0, batch, sel, KRounding::kE4m3, true, 4), all_minus) << "decode CP B " << B;
  }
  // a mix of padded and real requests
  std::vector<int32_t> lens;
  for (int i = 0; i < 32; ++i) lens.push_back(i % 3 == 0 ? (i % 18 == 0 ? 2100 + 37 * i : 300 + 37 * i) : (i % 3 == 1 ? 0 : 9 + i));
  Requests req = make_requests(lens, 128, 52);
  std::vector<float> keys;
  std::vector<int64_t> slots;
  make_keys(req, 53, keys, slots);
  const int32_t Q = 2;
  const auto q = make_q(32 * Q, H, 54);
  const DecodeBatch batch = decode_batch(req, q, H, Q);
  const auto rows = decode_rows(batch, req.num_pages, 128);
  const auto rep = build_caches(KvDtype::kNvfp4, 128, 1, req.num_pages, keys, slots);
  const auto out = replicated_decode(rep[0], batch, sel, KRounding::kE4m3);
  expect_contract(out, rows, H, sel, "C09 mix");
  for (int i = 0; i < 32; ++i)
    if (lens[i] == 0) {
      for (int j = 0; j < Q * H * 16; ++j) ASSERT_EQ(out[i * Q * H * 16 + j], -1) << "padded request " << i;
    }
  const auto shards = build_caches(KvDtype::kNvfp4, 128, 2, req.num_pages, keys, slots);
  EXPECT_EQ(icp_all_heads(shards, 0, batch, sel, KRounding::kE4m3), out);
  EXPECT_EQ(icp_all_heads(rep, 0, batch, sel, KRounding::kE4m3, true, 2), out);
}

// ---------------------------------------------------------------------------------------------
// C10: short speculative steps

TEST(Cases, C10_ShortSpeculativeSteps) {
  SelectionParams sel;
  const int32_t H = 2;
  for (int32_t P : {128, 256}) {
    // Q = 3 at seq_len 129: positions 126, 127, 128; local blocks 0, 0, 1
    Requests req = make_requests({129}, P, 61);
    std::vector<float> keys;
    std::vector<int64_t> slots;
    make_keys(req, 62, keys, slots);
    const auto q = make_q(16, H, 63);
    const auto rep = build_caches(KvDtype::kNvfp4, P, 1, req.num_pages, keys, slots);
    const auto shards = build_caches(KvDtype::kNvfp4, P, 2, req.num_pages, keys, slots);
    {
      const DecodeBatch b = decode_batch(req, q, H, 3);
      const auto rows = decode_rows(b, req.num_pages, P);
      ASSERT_EQ(rows.size(), 3u);
      EXPECT_EQ(rows[0].pos, 126);
      EXPECT_EQ(rows[1].pos, 127);
      EXPECT_EQ(rows[2].pos, 128);
      std::vector<int32_t> want;
      for (int r = 0; r < 3; ++r)
        for (int h = 0; h < H; ++h) {
          const auto v = r < 2 ? row_of(16, {0}) : row_of(16, {0, 1});
          want.insert(want.end(), v.begin(), v.end());
        }
      EXPECT_EQ(replicated_decode(rep[0], b, sel, KRounding::kE4m3), want);
      EXPECT_EQ(icp_all_heads(shards, 0, b, sel, KRounding::kE4m3), want);
      EXPECT_EQ(icp_all_heads(rep, 0, b, sel, KRounding::kExact, true, 2), want);
    }
    // Q = 16 at seq_len 16: positions 0..15, all local block 0
    {
      const std::vector<int32_t> sl = {16};
      const DecodeBatch b = decode_batch(req, q, H, 16, &sl);
      const auto rows = decode_rows(b, req.num_pages, P);
      ASSERT_EQ(rows.size(), 16u);
      for (int i = 0; i < 16; ++i) EXPECT_EQ(rows[i].pos, i);
      std::vector<int32_t> want;
      for (int i = 0; i < 16 * H; ++i) {
        const auto v = row_of(16, {0});
        want.insert(want.end(), v.begin(), v.end());
      }
      EXPECT_EQ(replicated_decode(rep[0], b, sel, KRounding::kE4m3), want);
      EXPECT_EQ(icp_all_heads(shards, 0, b, sel, KRounding::kE4m3), want);
    }
    // seq_len 2 with Q = 3 is refused, naming seq_lens[0] and the query length; nothing written
    {
      const std::vector<int32_t> sl = {2};
      const DecodeBatch b = decode_batch(req, q, H, 3, &sl);
      std::vector<int32_t> out(3 * H * 16, 5);
      expect_error([&] { decode_select(rep[0], 0, b, 0, H, sel, KRounding::kE4m3, out.data()); },
                   {"seq_lens[0]", "2", "query_len"}, "decode_select");
      for (int32_t v : out) ASSERT_EQ(v, 5);
      expect_error([&] { icp_all_heads(shards, 0, b, sel, KRounding::kE4m3); }, {"seq_lens[0]", "query_len"}, "icp");
      expect_error([&] { icp_all_heads(rep, 0, b, sel, KRounding::kE4m3, true, 2); }, {"seq_lens[0]", "query_len"},
                   "decode CP");
    }
  }
}

// ---------------------------------------------------------------------------------------------
// C11: bad encode scale through insert_keys: refused, naming the scale, nothing written

TEST(Cases, C11_BadEncodeScaleInsertWritesNothing) {
  for (int32_t W : {1, 2}) {
    const PageLayout l = make_page_layout(KvDtype::kNvfp4, 128, W);
    const auto keys = normal_keys(8, 71);
    const std::vector<int64_t> slots = {0, 1, 64, 65, 128, 200, 255, 129};
    for (int32_t r = 0; r < W; ++r) {
      IndexCache c(l, 2, 2, r);
      insert_keys(c, 0, keys.data(), slots.data(), 4);  // some earlier content
      const auto before = snapshot(c);
      for (float S : {0.0f, -1.0f, NAN, INFINITY}) {
        InsertOptions o;
        o.encode_scale = S;
        expect_error([&] { insert_keys(c, 1, keys.data(), slots.data(), 8, o); }, {"encode_scale"},
                     "S = " + std::to_string(S));
        EXPECT_EQ(snapshot(c), before) << "S = " << S << " wrote bytes";
      }
      InsertOptions ok;
      ok.encode_scale = 268.8f;
      insert_keys(c, 1, keys.data(), slots.data(), 8, ok);
      for (int t = 0; t < 8; ++t) {
        const SlotLocation s = locate_slot(l, slots[t]);
        if (s.rank == r) {
          EXPECT_EQ(read_row_bytes(c, 1, s.page, s.row), quantize_key_bytes(KvDtype::kNvfp4, keys.data() + t * 128, 268.8f));
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Adversarial merge (issue 2 item 8): candidates built directly from per-rank partial scores,
// publish_candidates + merge_candidates against select_topk on the max-combined full scores.

namespace {

struct MergeSetup {
  int32_t W = 4;
  int32_t heads = 2;
  int64_t max_blocks = 48;
  SelectionParams sel;
  std::vector<QueryRow> rows = {{0, 40 * 128 + 3},  {0, 40 * 128 + 100}, {1, 33 * 128}, {2, 17 * 128 + 5},
                                {3, 15 * 128 + 1},  {4, -1},             {5, 2 * 128}, {6, 47 * 128 + 127},
                                {7, 16 * 128}};
};

// score(rank, row, head, block) -> nullopt (no partial score on that rank) or the partial score
using ScoreFn = std::function<std::optional<float>(int32_t, int64_t, int32_t, int64_t)>;

std::vector<BlockScores> rank_scores(const MergeSetup& m, const ScoreFn& fn) {
  std::vector<BlockScores> out(m.W);
  for (int32_t w = 0; w < m.W; ++w) {
    BlockScores& s = out[w];
    s.rows = static_cast<int64_t>(m.rows.size());
    s.heads = m.heads;
    s.max_blocks = m.max_blocks;
    s.score.assign(static_cast<size_t>(s.rows) * s.heads * s.max_blocks, -kInf);
    s.valid.assign(s.score.size(), 0);
    for (int64_t r = 0; r < s.rows; ++r) {
      const int64_t local = visible_blocks(m.rows[r]) - 1;
      for (int32_t h = 0; h < m.heads; ++h)
        for (int64_t b = 0; b < local; ++b)
          if (const auto v = fn(w, r, h, b)) {
            s.score[(r * s.heads + h) * s.max_blocks + b] = *v;
            s.valid[(r * s.heads + h) * s.max_blocks + b] = 1;
          }
    }
  }
  return out;
}

// The full score of a block: the maximum of its partial scores under the order of indexer.md
// section 3 (NaN below every number), written plainly.
BlockScores combine(const MergeSetup& m, const std::vector<BlockScores>& per) {
  BlockScores c = per[0];
  std::fill(c.valid.begin(), c.valid.end(), 0);
  std::fill(c.score.begin(), c.score.end(), -kInf);
  for (size_t i = 0; i < c.score.size(); ++i) {
    bool any = false;
    float best = 0;
    for (int32_t w = 0; w < m.W; ++w) {
      if (!per[w].valid[i]) continue;
      const float v = per[w].score[i];
      if (!any) best = v;
      else if (std::isnan(best) && !std::isnan(v)) best = v;
      else if (!std::isnan(v) && v > best) best = v;
      any = true;
    }
    if (any) {
      c.score[i] = best;
      c.valid[i] = 1;
    }
  }
  return c;
}

std::vector<Candidate> publish_all(const MergeSetup& m, const std::vector<BlockScores>& per) {
  const size_t per_rank = m.rows.size() * static_cast<size_t>(m.heads) * m.sel.ranked();
  std::vector<Candidate> cands(per_rank * m.W, Candidate{12345.0f, 777});
  for (int32_t w = 0; w < m.W; ++w) publish_candidates(per[w], m.rows, m.sel, cands.data() + w * per_rank);
  return cands;
}

// Checks the published candidates: valid blocks only, ordered by (score desc, id asc), unique,
// empty entries (-1) last, as many as min(ranked, valid non-forced historical blocks).
void check_published(const MergeSetup& m, const std::vector<BlockScores>& per, const std::vector<Candidate>& cands,
                     const std::string& ctx) {
  const int32_t kc = m.sel.ranked();
  const size_t per_rank = m.rows.size() * static_cast<size_t>(m.heads) * kc;
  for (int32_t w = 0; w < m.W; ++w)
    for (size_t r = 0; r < m.rows.size(); ++r)
      for (int32_t h = 0; h < m.heads; ++h) {
        const Candidate* c = cands.data() + w * per_rank + (r * m.heads + h) * kc;
        const int64_t n = visible_blocks(m.rows[r]);
        int64_t avail = 0;
        if (n > m.sel.topk)
          for (int64_t b = m.sel.init_blocks; b < n - 1; ++b) avail += per[w].valid[(r * m.heads + h) * m.max_blocks + b];
        const int64_t want = std::min<int64_t>(kc, avail);
        std::set<int32_t> seen;
        for (int32_t k = 0; k < kc; ++k) {
          if (k >= want) {
            ASSERT_EQ(c[k].block, -1) << ctx << " rank " << w << " row " << r << " head " << h << " entry " << k;
            continue;
          }
          ASSERT_GE(c[k].block, m.sel.init_blocks) << ctx;
          ASSERT_LT(c[k].block, n - 1) << ctx;
          ASSERT_TRUE(per[w].valid[(r * m.heads + h) * m.max_blocks + c[k].block]) << ctx;
          ASSERT_TRUE(seen.insert(c[k].block).second) << ctx << ": block published twice";
          ASSERT_EQ(fmt::f32_bits(c[k].score), fmt::f32_bits(per[w].score[(r * m.heads + h) * m.max_blocks + c[k].block]))
              << ctx;
          if (k) {
            ASSERT_TRUE(candidate_better(c[k - 1].score, c[k - 1].block, c[k].score, c[k].block))
                << ctx << " rank " << w << " row " << r << " head " << h << ": not ordered at " << k;
          }
        }
      }
}

// publish on every rank, merge, and compare with select_topk over the combined scores; also the
// merge of every head range a rank owns. `tamper` may rewrite the exchanged candidates.
void run_merge(const MergeSetup& m, const ScoreFn& fn, const std::string& ctx,
               const std::function<void(std::vector<Candidate>&)>& tamper = nullptr,
               const std::vector<int32_t>* expect_row0 = nullptr) {
  SCOPED_TRACE(ctx);
  const auto per = rank_scores(m, fn);
  auto cands = publish_all(m, per);
  check_published(m, per, cands, ctx);
  if (tamper) tamper(cands);
  const BlockScores full = combine(m, per);
  // every historical block has a full score (some rank scored it)
  for (size_t r = 0; r < m.rows.size(); ++r)
    for (int32_t h = 0; h < m.heads; ++h)
      for (int64_t b = 0; b + 1 < visible_blocks(m.rows[r]); ++b)
        ASSERT_TRUE(full.valid[(r * m.heads + h) * m.max_blocks + b]) << "setup: block " << b << " unscored";
  const int32_t K = m.sel.topk;
  std::vector<int32_t> ref(m.rows.size() * m.heads * K, -7), got(ref.size(), -7);
  select_topk(full, m.rows, m.sel, ref.data());
  merge_candidates(cands.data(), m.W, m.rows, m.heads, 0, m.heads, m.sel, got.data());
  EXPECT_EQ(got, ref);
  expect_contract(got, m.rows, m.heads, m.sel, ctx);
  if (expect_row0) { EXPECT_EQ(slice(got, 0, m.heads, 0, K), *expect_row0); }
  for (int32_t rank = 0; rank < m.W; ++rank) {
    int32_t h0, nh;
    owned_heads(m.heads, m.W, rank, &h0, &nh);
    std::vector<int32_t> part(m.rows.size() * nh * K, -7);
    merge_candidates(cands.data(), m.W, m.rows, m.heads, h0, nh, m.sel, part.data());
    for (size_t r = 0; r < m.rows.size(); ++r)
      for (int32_t h = 0; h < nh; ++h)
        for (int32_t k = 0; k < K; ++k)
          ASSERT_EQ(part[(r * nh + h) * K + k], ref[(r * m.heads + h0 + h) * K + k]) << "rank " << rank;
  }
}

bool owns(const PageLayout& l, int32_t rank, int64_t b) {
  int64_t lp;
  int32_t first, count;
  l.block_rows_on_rank(b, rank, &lp, &first, &count);
  return count > 0;
}

float u01(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  // a deterministic hash to [0, 1) (no shared RNG state between lambdas)
  uint32_t x = a * 0x9E3779B1u ^ (b + 0x7F4A7C15u) * 0x85EBCA77u ^ (c + 0x165667B1u) * 0xC2B2AE3Du ^ d * 0x27D4EB2Fu;
  x ^= x >> 15;
  x *= 0x2C1B3C6Du;
  x ^= x >> 12;
  x *= 0x297A2D39u;
  x ^= x >> 15;
  return static_cast<float>(x >> 8) * (1.0f / 16777216.0f);
}

}  // namespace

TEST(Merge, AllWinnersOnOneRank) {
  for (int32_t init : {0, 2}) {
    MergeSetup m;
    m.sel.init_blocks = init;
    for (int32_t W : {2, 4, 8}) {
      m.W = W;
      const int32_t hot = W - 1;
      // every rank has a partial score of every block; rank `hot` has all the maxima
      run_merge(m, [&](int32_t w, int64_t r, int32_t h, int64_t b) -> std::optional<float> {
        return (w == hot ? 100.0f : 0.0f) + u01(w, static_cast<uint32_t>(r), h, static_cast<uint32_t>(b));
      }, "one hot rank W" + std::to_string(W) + " init " + std::to_string(init));
    }
    // disjoint ownership (P = 256, W = 2): rank 1 owns the odd blocks, which all win
    m.W = 2;
    const PageLayout l = make_page_layout(KvDtype::kNvfp4, 256, 2);
    run_merge(m, [&](int32_t w, int64_t r, int32_t h, int64_t b) -> std::optional<float> {
      if (!owns(l, w, b)) return std::nullopt;
      return (b % 2 ? 50.0f : -50.0f) + u01(w, static_cast<uint32_t>(r), h, static_cast<uint32_t>(b));
    }, "odd blocks on rank 1 win, init " + std::to_string(init));
  }
  // the expected ids of one case by hand: row 0 (local 40): the 15 highest odd blocks 11..39
  MergeSetup m;
  m.W = 2;
  m.heads = 1;
  const PageLayout l = make_page_layout(KvDtype::kNvfp4, 256, 2);
  const std::vector<int32_t> want = {11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, 33, 35, 37, 39, 40};
  run_merge(m, [&](int32_t w, int64_t, int32_t, int64_t b) -> std::optional<float> {
    if (!owns(l, w, b)) return std::nullopt;
    return b % 2 ? 10.0f + static_cast<float>(b) : static_cast<float>(b) * 0.001f;
  }, "by hand", nullptr, &want);
}

TEST(Merge, AllScoresEqual) {
  MergeSetup m;
  const std::vector<int32_t> low15 = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 40};
  for (int32_t W : {2, 4, 8})
    for (float v : {1.0f, 0.0f, -kInf, kInf, -3.5f}) {
      m.W = W;
      run_merge(m, [&](int32_t, int64_t, int32_t, int64_t) -> std::optional<float> { return v; },
                "all equal " + std::to_string(v) + " W" + std::to_string(W), nullptr, &low15);
    }
  // all equal on disjoint and split ownership
  for (int32_t W : {2, 4, 8}) {
    m.W = W;
    const PageLayout l = make_page_layout(KvDtype::kFp8, 256, W);
    run_merge(m, [&](int32_t w, int64_t, int32_t, int64_t b) -> std::optional<float> {
      if (!owns(l, w, b)) return std::nullopt;
      return 2.0f;
    }, "all equal P256 W" + std::to_string(W), nullptr, &low15);
  }
}

TEST(Merge, NaNScores) {
  MergeSetup m;
  const float values[] = {NAN, -NAN, -kInf, kInf, -1.0f, 0.0f, -0.0f, 1.0f, 2.5f};
  for (int32_t W : {2, 4}) {
    m.W = W;
    for (uint32_t seed = 0; seed < 12; ++seed)
      run_merge(m, [&](int32_t w, int64_t r, int32_t h, int64_t b) -> std::optional<float> {
        const float x = u01(w + 17 * seed, static_cast<uint32_t>(r), h, static_cast<uint32_t>(b));
        return values[static_cast<int>(x * 9.0f)];
      }, "NaN mix W" + std::to_string(W) + " seed " + std::to_string(seed));
  }
  // all NaN: NaN == NaN, ties go to the lower id
  m.W = 4;
  const std::vector<int32_t> low15 = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 40};
  run_merge(m, [](int32_t, int64_t, int32_t, int64_t) -> std::optional<float> { return NAN; }, "all NaN", nullptr,
            &low15);
  // NaN loses to every number, -Inf included: five numbered blocks (one -Inf) + the ten lowest NaN
  const std::vector<int32_t> want = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 20, 25, 30, 35, 39, 40};
  run_merge(m, [](int32_t w, int64_t, int32_t, int64_t b) -> std::optional<float> {
    if (w == 2 && (b == 20 || b == 25 || b == 30 || b == 35)) return 1.0f * static_cast<float>(b);
    if (w == 1 && b == 39) return -kInf;
    return NAN;
  }, "NaN below -Inf", nullptr, &want);
  // a block that is NaN on one rank and a number on another scores the number
  const std::vector<int32_t> want2 = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 33, 40};
  run_merge(m, [](int32_t w, int64_t, int32_t, int64_t b) -> std::optional<float> {
    if (b == 33) return w == 0 ? -1e30f : NAN;
    return w == 3 ? -kInf : NAN;
  }, "NaN and a number on different ranks", nullptr, &want2);
}

TEST(Merge, SignedZerosAreEqual) {
  MergeSetup m;
  for (int32_t W : {2, 4}) {
    m.W = W;
    for (uint32_t seed = 0; seed < 6; ++seed)
      run_merge(m, [&](int32_t w, int64_t r, int32_t h, int64_t b) -> std::optional<float> {
        const float x = u01(w + 31 * seed, static_cast<uint32_t>(r), h, static_cast<uint32_t>(b));
        return x < 0.45f ? -0.0f : x < 0.9f ? 0.0f : 1.0f;
      }, "signed zeros W" + std::to_string(W) + " seed " + std::to_string(seed));
  }
  // -0.0 on the low ids, +0.0 on the high ids: still ids 0..14 (equal scores, lower id wins)
  m.W = 2;
  const std::vector<int32_t> low15 = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 40};
  run_merge(m, [](int32_t w, int64_t, int32_t, int64_t b) -> std::optional<float> {
    if (b < 20) return w == 0 ? -0.0f : std::optional<float>{};
    return w == 1 ? 0.0f : std::optional<float>{};
  }, "-0 low ids, +0 high ids", nullptr, &low15);
  run_merge(m, [](int32_t w, int64_t, int32_t, int64_t b) -> std::optional<float> {
    if (b < 20) return w == 0 ? 0.0f : std::optional<float>{};
    return w == 1 ? -0.0f : std::optional<float>{};
  }, "+0 low ids, -0 high ids", nullptr, &low15);
}

TEST(Merge, SameBlockFromSeveralRanksKeepsTheMaximum) {
  MergeSetup m;
  for (int32_t W : {2, 4, 8}) {
    m.W = W;
    for (uint32_t seed = 0; seed < 4; ++seed)
      run_merge(m, [&](int32_t w, int64_t r, int32_t h, int64_t b) -> std::optional<float> {
        return std::floor(8.0f * u01(w + 7 * seed, static_cast<uint32_t>(r), h, static_cast<uint32_t>(b)));
      }, "random partials W" + std::to_string(W) + " seed " + std::to_string(seed));
  }
  // the same high blocks on every rank: without deduplication they would fill several slots
  m.W = 4;
  const std::vector<int32_t> want = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 30, 31, 32, 33, 40};
  run_merge(m, [](int32_t w, int64_t, int32_t, int64_t b) -> std::optional<float> {
    if (b >= 30 && b < 34) return 100.0f + static_cast<float>(w);
    return 0.0f;
  }, "duplicates of the winners", nullptr, &want);
  // block 30: -5 on rank 0, 10 on rank 1; the rest 0..3: the maximum (10) must win
  m.W = 2;
  run_merge(m, [](int32_t w, int64_t, int32_t, int64_t b) -> std::optional<float> {
    if (b == 30) return w == 0 ? -5.0f : 10.0f;
    return static_cast<float>((b * 7 + w) % 4);
  }, "keep the max");
  // and the other way round (the max published first)
  run_merge(m, [](int32_t w, int64_t, int32_t, int64_t b) -> std::optional<float> {
    if (b == 30) return w == 1 ? -5.0f : 10.0f;
    return static_cast<float>((b * 7 + w) % 4);
  }, "keep the max (rank 0)");
}

TEST(Merge, BlocksSplitAcrossRanks) {
  MergeSetup m;
  for (auto [P, W] : {std::pair{256, 4}, std::pair{256, 8}, std::pair{128, 4}, std::pair{256, 2}}) {
    m.W = W;
    const PageLayout l = make_page_layout(KvDtype::kNvfp4, P, W);
    for (uint32_t seed = 0; seed < 4; ++seed) {
      const std::string ctx = "P" + std::to_string(P) + " W" + std::to_string(W) + " seed " + std::to_string(seed);
      run_merge(m, [&](int32_t w, int64_t r, int32_t h, int64_t b) -> std::optional<float> {
        if (!owns(l, w, b)) return std::nullopt;
        return u01(w + 5 * seed, static_cast<uint32_t>(r), h, static_cast<uint32_t>(b)) * 4.0f - 2.0f;
      }, ctx + " continuous");
      run_merge(m, [&](int32_t w, int64_t r, int32_t h, int64_t b) -> std::optional<float> {
        if (!owns(l, w, b)) return std::nullopt;
        return std::floor(3.0f * u01(w + 5 * seed, static_cast<uint32_t>(r), h, static_cast<uint32_t>(b)));
      }, ctx + " ties");
    }
  }
  // init blocks and other K under split ownership
  m.W = 4;
  m.sel.init_blocks = 3;
  m.sel.topk = 8;
  const PageLayout l = make_page_layout(KvDtype::kNvfp4, 256, 4);
  run_merge(m, [&](int32_t w, int64_t r, int32_t h, int64_t b) -> std::optional<float> {
    if (!owns(l, w, b)) return std::nullopt;
    return std::floor(3.0f * u01(w, static_cast<uint32_t>(r), h, static_cast<uint32_t>(b)));
  }, "K8 init3");
}

TEST(Merge, EmptyCandidatesFromRanksThatOwnNothing) {
  MergeSetup m;
  m.W = 4;
  // rank 3 scores nothing; rank 1 only a few blocks
  run_merge(m, [](int32_t w, int64_t r, int32_t h, int64_t b) -> std::optional<float> {
    if (w == 3) return std::nullopt;
    if (w == 1 && b % 9) return std::nullopt;
    return u01(w, static_cast<uint32_t>(r), h, static_cast<uint32_t>(b));
  }, "rank 3 owns nothing");
  // a rank whose few candidates do not fill its K-1 slots publishes empty entries after them
  run_merge(m, [](int32_t w, int64_t r, int32_t h, int64_t b) -> std::optional<float> {
    if (w == 0) return b < 3 ? std::optional<float>{100.0f} : std::nullopt;
    if (w == 1) return b >= 3 ? std::optional<float>{u01(w, static_cast<uint32_t>(r), h, static_cast<uint32_t>(b))}
                              : std::nullopt;
    return std::nullopt;
  }, "short candidate lists");
}

TEST(Merge, CorruptedCandidatesCannotInjectBlocks) {
  for (int32_t init : {0, 2}) {
    MergeSetup m;
    m.W = 4;
    m.sel.init_blocks = init;
    const int32_t kc = m.sel.ranked();
    const size_t per_rank = m.rows.size() * static_cast<size_t>(m.heads) * kc;
    // rank 2 is honest but scores nothing; its exchanged buffer is overwritten with junk: empty
    // ids with extreme scores, the forced local and init blocks, future blocks, negative ids
    auto tamper = [&](std::vector<Candidate>& c) {
      for (size_t r = 0; r < m.rows.size(); ++r) {
        const int32_t local = static_cast<int32_t>(visible_blocks(m.rows[r]) - 1);
        for (int32_t h = 0; h < m.heads; ++h) {
          Candidate* o = c.data() + 2 * per_rank + (r * m.heads + h) * kc;
          const Candidate junk[] = {{kInf, -1},        {NAN, -1},       {kInf, local},       {kInf, local + 1},
                                    {kInf, local + 7}, {kInf, 1 << 30}, {kInf, -5},          {1e30f, -1},
                                    {kInf, 0},         {kInf, 1},       {kInf, local + 100}, {kInf, -2}};
          for (int32_t k = 0; k < kc; ++k) {
            o[k] = junk[k % 12];
            if (init == 0 && (o[k].block == 0 || o[k].block == 1)) o[k].block = -1;  // 0/1 are valid without init
          }
        }
      }
    };
    run_merge(m, [](int32_t w, int64_t r, int32_t h, int64_t b) -> std::optional<float> {
      if (w == 2) return std::nullopt;
      return u01(w, static_cast<uint32_t>(r), h, static_cast<uint32_t>(b));
    }, "junk from rank 2, init " + std::to_string(init), tamper);
  }
}

// ---------------------------------------------------------------------------------------------
// Sharded == replicated, bit for bit, at every (P, W, dtype, K rounding) (issue 2 item 8)

namespace {

enum class Data { kRandom, kFewValues, kRepeatedBlocks };

std::string data_name(Data d) {
  return d == Data::kRandom ? "random" : d == Data::kFewValues ? "few_values" : "repeated_blocks";
}

struct SweepInput {
  Requests req;
  std::vector<float> keys;
  std::vector<int64_t> slots;
  std::vector<uint8_t> q_decode, q_prefill;
  std::vector<int32_t> query_start;
  int32_t heads = 4, Q = 4;
  SelectionParams sel;
};

// random: normal keys and queries, K = 16. few_values: keys and queries from {0, +-1, +-2} with a
// "hot" pattern in about half of the blocks (many equal block maxima, at random ranks), K = 8 with
// one init block, H = 2 (W > H at W = 4, 8). repeated_blocks: every block holds the same 128 keys,
// rotated by the block id (all block scores equal, maxima on different ranks), H = 8.
SweepInput make_input(Data kind, int32_t P, uint32_t seed) {
  SweepInput in;
  std::mt19937 rng(seed);
  if (kind == Data::kRandom) {
    in.req = make_requests({2050, 0, 2400, 500}, P, seed);  // 2046..2049: local 15, 15, 16, 16
    make_keys(in.req, seed + 1, in.keys, in.slots);
    in.heads = 4;
    in.Q = 4;
    in.query_start = {0, 6, 6, 16, 19};
  } else if (kind == Data::kFewValues) {
    in.req = make_requests({1500, 1900}, P, seed);
    in.heads = 2;
    in.Q = 3;
    in.sel.topk = 8;
    in.sel.init_blocks = 1;
    in.query_start = {0, 5, 12};
    std::uniform_int_distribution<int> pick(0, 4);
    std::vector<std::vector<float>> pat(5, std::vector<float>(128));
    const float vals[] = {0.0f, 1.0f, -1.0f, 2.0f, -2.0f};
    for (auto& p : pat)
      for (auto& v : p) v = vals[pick(rng)];
    for (int d = 0; d < 128; ++d) pat[0][d] = 2.0f;  // the hot pattern
    for (size_t b = 0; b < in.req.seq_lens.size(); ++b) {
      int hot_at = -1;
      for (int64_t p = 0; p < in.req.seq_lens[b]; ++p) {
        if (p % 128 == 0) hot_at = (rng() % 2) ? static_cast<int>(rng() % 128) : -1;
        const int which = (p % 128 == hot_at) ? 0 : 1 + static_cast<int>(rng() % 4);
        in.keys.insert(in.keys.end(), pat[which].begin(), pat[which].end());
        in.slots.push_back(in.req.slot(static_cast<int32_t>(b), p));
      }
    }
  } else {
    in.req = make_requests({2200, 2600}, P, seed);
    in.heads = 8;
    in.Q = 2;
    in.query_start = {0, 3, 7};
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> base(128 * 128);
    for (auto& v : base) v = nd(rng);
    for (size_t b = 0; b < in.req.seq_lens.size(); ++b)
      for (int64_t p = 0; p < in.req.seq_lens[b]; ++p) {
        const int64_t src = (p % 128 + 37 * (p / 128)) % 128;
        in.keys.insert(in.keys.end(), base.begin() + src * 128, base.begin() + (src + 1) * 128);
        in.slots.push_back(in.req.slot(static_cast<int32_t>(b), p));
      }
  }
  const int64_t drows = static_cast<int64_t>(in.req.seq_lens.size()) * in.Q;
  if (kind == Data::kFewValues) {
    const uint8_t qv[] = {0x00, 0x38, 0xB8};  // 0, 1, -1
    in.q_decode.resize(static_cast<size_t>(drows) * in.heads * 128);
    in.q_prefill.resize(static_cast<size_t>(in.query_start.back()) * in.heads * 128);
    for (auto& v : in.q_decode) v = qv[rng() % 3];
    for (auto& v : in.q_prefill) v = qv[rng() % 3];
  } else {
    in.q_decode = make_q(drows, in.heads, seed + 2);
    in.q_prefill = make_q(in.query_start.back(), in.heads, seed + 3);
  }
  return in;
}

}  // namespace

class ShardedEqualsReplicated : public ::testing::TestWithParam<std::tuple<int32_t, KvDtype, Data>> {};

TEST_P(ShardedEqualsReplicated, DecodeAndPrefillBitForBit) {
  const auto [P, dt, kind] = GetParam();
  const SweepInput in = make_input(kind, P, 1000u + P + 10u * static_cast<uint32_t>(kind));
  const auto rep = build_caches(dt, P, 1, in.req.num_pages, in.keys, in.slots);
  const DecodeBatch db = decode_batch(in.req, in.q_decode, in.heads, in.Q);
  const PrefillBatch pb = prefill_batch(in.req, in.q_prefill, in.heads, in.query_start);
  const auto drows = decode_rows(db, in.req.num_pages, P);
  const auto prows = prefill_rows(pb, in.req.num_pages, P);
  std::map<KRounding, std::vector<int32_t>> dref;
  for (KRounding m : {KRounding::kE4m3, KRounding::kExact}) {
    dref[m] = replicated_decode(rep[0], db, in.sel, m);
    expect_contract(dref[m], drows, in.heads, in.sel, "replicated decode");
    if (kind != Data::kRandom) {  // the replicated path itself against the plain brute force
      EXPECT_EQ(dref[m], brute_force(rep[0], 0, in.req, drows, in.q_decode, in.heads, in.sel, m)) << to_string(m);
    }
  }
  const auto pref = replicated_prefill(rep[0], pb, in.sel);
  expect_contract(pref, prows, in.heads, in.sel, "replicated prefill");
  if (kind == Data::kRepeatedBlocks) {
    // every block scores the same: the selection is the lowest ids, whatever the head
    for (size_t r = 0; r < drows.size(); ++r)
      for (int32_t h = 0; h < in.heads; ++h) {
        const auto o = slice(dref[KRounding::kE4m3], static_cast<int64_t>(r), in.heads, h, in.sel.topk);
        const int64_t local = drows[r].pos / 128;
        if (local >= in.sel.topk) {
          for (int k = 0; k < in.sel.topk - 1; ++k) ASSERT_EQ(o[k], k) << "row " << r << " head " << h;
        }
      }
  }
  for (int32_t W : {1, 2, 4, 8}) {
    const std::string ctx = to_string(dt) + " P" + std::to_string(P) + " W" + std::to_string(W) + " " + data_name(kind);
    SCOPED_TRACE(ctx);
    const auto shards = W == 1 ? rep : build_caches(dt, P, W, in.req.num_pages, in.keys, in.slots);
    for (KRounding m : {KRounding::kE4m3, KRounding::kExact}) {
      EXPECT_EQ(icp_all_heads(shards, 0, db, in.sel, m), dref[m]) << "ICP decode " << to_string(m);
      EXPECT_EQ(icp_all_heads(rep, 0, db, in.sel, m, true, W), dref[m]) << "decode CP " << to_string(m);
    }
    EXPECT_EQ(gather_all(shards, pb, in.sel, int64_t{256} << 20), pref) << "prefill gather";
    EXPECT_EQ(local_score_all(shards, pb, in.sel), pref) << "prefill local_score";
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, ShardedEqualsReplicated,
    ::testing::Combine(::testing::Values(128, 256), ::testing::Values(KvDtype::kNvfp4, KvDtype::kFp8),
                       ::testing::Values(Data::kRandom, Data::kFewValues, Data::kRepeatedBlocks)),
    [](const auto& i) {
      return "P" + std::to_string(std::get<0>(i.param)) + "_" + to_string(std::get<1>(i.param)) + "_" +
             data_name(std::get<2>(i.param));
    });

// The gather transient is bounded: a batch several times the budget selects exactly what an
// unbounded run selects, in several chunks, reserving no more than the budget.
TEST(Gather, BatchSeveralTimesTheBudget) {
  for (int32_t P : {128, 256})
    for (int32_t W : {2, 4})
      for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8}) {
        if (dt == KvDtype::kFp8 && W == 4) continue;
        const std::string ctx = to_string(dt) + " P" + std::to_string(P) + " W" + std::to_string(W);
        SCOPED_TRACE(ctx);
        Requests req = make_requests({1100, 600, 0, 800}, P, 81u + P + W);
        std::vector<float> keys;
        std::vector<int64_t> slots;
        make_keys(req, 82, keys, slots);
        const std::vector<int32_t> qs = {0, 5, 8, 8, 12};
        const auto q = make_q(12, 4, 83);
        const PrefillBatch pb = prefill_batch(req, q, 4, qs);
        SelectionParams sel;
        sel.topk = 8;
        const auto rep = build_caches(dt, P, 1, req.num_pages, keys, slots);
        const auto shards = build_caches(dt, P, W, req.num_pages, keys, slots);
        const auto pref = replicated_prefill(rep[0], pb, sel);
        const PageLayout l = shards[0].layout();
        const int64_t unit = gather_unit_bytes(l);
        EXPECT_EQ(unit, static_cast<int64_t>(l.rows()) * 128 + static_cast<int64_t>(P) * 128);
        std::vector<GatherStats> big, small, one;
        const auto a = gather_all(shards, pb, sel, int64_t{1} << 40, &big);
        const auto b = gather_all(shards, pb, sel, 3 * unit + unit / 2, &small);
        const auto c = gather_all(shards, pb, sel, unit, &one);
        EXPECT_EQ(a, pref);
        EXPECT_EQ(b, a);
        EXPECT_EQ(c, a);
        // units: the pages holding each request's historical blocks
        int64_t pages = 0;
        for (int r = 0; r < 4; ++r) {
          const int32_t t = qs[r + 1] - qs[r];
          if (t == 0) continue;
          const int64_t max_local = (req.seq_lens[r] - 1) / 128;
          pages += (max_local * 128 + P - 1) / P;
        }
        for (int32_t r = 0; r < W; ++r) {
          EXPECT_EQ(big[r].chunks, 1);
          EXPECT_EQ(big[r].pages, pages);
          EXPECT_EQ(big[r].reserved_bytes, pages * unit);
          EXPECT_EQ(small[r].pages, pages);
          EXPECT_GE(pages, 3 * 3) << "the batch is several times the budget";
          EXPECT_EQ(small[r].chunks, (pages + 2) / 3);
          EXPECT_GT(small[r].chunks, 1);
          EXPECT_LE(small[r].reserved_bytes, 3 * unit + unit / 2);
          EXPECT_EQ(one[r].chunks, pages);
          EXPECT_LE(one[r].reserved_bytes, unit);
          EXPECT_EQ(small[r].gathered_bytes, big[r].gathered_bytes);
          EXPECT_EQ(big[r].gathered_bytes, pages * P * 128);
        }
        // a batch with no historical block at all gathers nothing and selects 0..n-1
        {
          const std::vector<int32_t> sq = {0, 2, 3, 3, 5};
          Requests shortreq = req;
          shortreq.seq_lens = {100, 128, 0, 2};
          const PrefillBatch sb = prefill_batch(shortreq, q, 4, sq);
          std::vector<GatherStats> st;
          const auto o = gather_all(shards, sb, sel, unit, &st);
          EXPECT_EQ(o, replicated_prefill(rep[0], sb, sel));
          EXPECT_EQ(st[0].pages, 0);
          EXPECT_EQ(st[0].gathered_bytes, 0);
          EXPECT_LE(st[0].reserved_bytes, unit);
        }
        // below one unit: refused, naming the budget key
        expect_error([&] { gather_all(shards, pb, sel, unit - 1); }, {"indexer_prefill_gather_budget_mib"}, ctx);
      }
}
