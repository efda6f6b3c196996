// Pages, rank shards, the multi-layer cache and insert (spec/formats.md sections 6-7,
// spec/indexer.md section 6; issue 2 items 2-3).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "indexcp/cache.hpp"
#include "indexcp/error.hpp"
#include "indexcp/formats.hpp"
#include "indexcp/layout.hpp"
#include "util.hpp"

using namespace indexcp;
using namespace testutil;

namespace {

// Runs fn, expects an indexcp::Error whose message holds every needle.
template <class F>
void expect_error(F&& fn, const std::vector<std::string>& needles, const std::string& ctx = "") {
  try {
    fn();
    ADD_FAILURE() << ctx << ": accepted; expected an error naming " << (needles.empty() ? "" : needles[0]);
  } catch (const Error& e) {
    const std::string w = e.what();
    for (const auto& n : needles) EXPECT_NE(w.find(n), std::string::npos) << ctx << ": '" << w << "' lacks '" << n << "'";
  }
}

std::vector<uint8_t> snapshot(const IndexCache& c) {
  return std::vector<uint8_t>(c.data(), c.data() + c.size_bytes());
}

bool all_zero(const IndexCache& c) {
  for (int64_t i = 0; i < c.size_bytes(); ++i)
    if (c.data()[i] != 0) return false;
  return true;
}

std::vector<float> random_keys(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> k(static_cast<size_t>(n) * kHeadDim);
  for (auto& v : k) v = nd(rng);
  return k;
}

// ---- RMSNorm + partial NeoX RoPE, written from spec/indexer.md section 6 only ----------------
// Every step a separately rounded fp32 operation; tests are built with -ffp-contract=off.
void plain_rmsnorm(const float* x, const float* w, float eps, float* y) {
  float sum = 0.0f;
  for (int d = 0; d < 128; ++d) {
    const float sq = x[d] * x[d];
    sum = sum + sq;
  }
  const float ms = sum / 128.0f;
  const float denom = sqrtf(ms + eps);
  const float r = 1.0f / denom;
  for (int d = 0; d < 128; ++d) {
    const float t = x[d] * r;
    const float g = 1.0f + w[d];
    y[d] = t * g;
  }
}

void plain_rope(float* y, int64_t pos, double theta) {
  float out[64];
  for (int d = 0; d < 32; ++d) {
    const double inv_freq = std::pow(theta, -(2.0 * d) / 64.0);
    const double angle = static_cast<double>(pos) * inv_freq;
    const float c = static_cast<float>(std::cos(angle));
    const float s = static_cast<float>(std::sin(angle));
    const float lo_c = y[d] * c;
    const float hi_s = y[d + 32] * s;
    const float hi_c = y[d + 32] * c;
    const float lo_s = y[d] * s;
    out[d] = lo_c - hi_s;
    out[d + 32] = hi_c + lo_s;
  }
  for (int d = 0; d < 64; ++d) y[d] = out[d];
}

void plain_preprocess(const float* x, const float* w, float eps, bool rope, double theta, int64_t pos, float* y) {
  for (int d = 0; d < 128; ++d) y[d] = x[d];
  if (w) plain_rmsnorm(x, w, eps, y);
  if (rope) plain_rope(y, pos, theta);
}

bool same_bits(const float* a, const float* b, int n, int* where) {
  for (int i = 0; i < n; ++i)
    if (fmt::f32_bits(a[i]) != fmt::f32_bits(b[i])) {
      *where = i;
      return false;
    }
  return true;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Geometry

class LayoutGeometry : public ::testing::TestWithParam<std::tuple<int, int, KvDtype>> {};

TEST_P(LayoutGeometry, RowsBytesOwnersAndOffsets) {
  const auto [P, W, dt] = GetParam();
  const PageLayout l = make_page_layout(dt, P, W);
  const int R = P / W;
  const int kb = dt == KvDtype::kNvfp4 ? 72 : 128;
  EXPECT_EQ(l.page_size, P);
  EXPECT_EQ(l.shards, W);
  EXPECT_EQ(l.rows(), R);
  EXPECT_EQ(l.page_bytes(), static_cast<int64_t>(R) * kb);
  EXPECT_EQ(l.page_stride, l.page_bytes());
  EXPECT_EQ(l.blocks_per_page(), P / 128);
  EXPECT_EQ(l.page_offset(0), 0);
  EXPECT_EQ(l.page_offset(7), 7 * l.page_bytes());

  // owner / local row / inverse
  for (int u = 0; u < P; ++u) {
    EXPECT_EQ(l.owner_of_offset(u), u / R) << "u " << u;
    EXPECT_EQ(l.local_row_of_offset(u), u % R) << "u " << u;
    EXPECT_EQ(l.offset_of_local_row(l.owner_of_offset(u), l.local_row_of_offset(u)), u);
  }
  // byte offsets of rows inside a shard page: data rows then (NVFP4) the scale region
  std::vector<int> touched(static_cast<size_t>(l.page_bytes()), 0);
  for (int j = 0; j < R; ++j) {
    if (dt == KvDtype::kNvfp4) {
      EXPECT_EQ(l.row_data_offset(j), 64 * j);
      EXPECT_EQ(l.row_scale_offset(j), static_cast<int64_t>(R) * 64 + 8 * j);
      for (int b = 0; b < 64; ++b) ++touched[l.row_data_offset(j) + b];
      for (int b = 0; b < 8; ++b) ++touched[l.row_scale_offset(j) + b];
    } else {
      EXPECT_EQ(l.row_data_offset(j), 128 * j);
      for (int b = 0; b < 128; ++b) ++touched[l.row_data_offset(j) + b];
    }
  }
  // rows and scales tile the shard page exactly once: no overlap, no hole
  for (size_t i = 0; i < touched.size(); ++i) ASSERT_EQ(touched[i], 1) << "byte " << i;

  // global position of local row j of logical page i on rank r is i*P + r*R + j; the slot of
  // that position (in physical page `phys`) locates back to (r, j)
  for (int64_t i : {0, 1, 5}) {
    const int64_t phys = 3 * i + 2;
    for (int r = 0; r < W; ++r)
      for (int j = 0; j < R; ++j) {
        const int64_t pos = i * P + static_cast<int64_t>(r) * R + j;
        const int u = static_cast<int>(pos % P);
        EXPECT_EQ(pos / P, i);
        EXPECT_EQ(l.offset_of_local_row(r, j), u);
        const SlotLocation s = locate_slot(l, phys * P + u);
        EXPECT_EQ(s.page, phys);
        EXPECT_EQ(s.offset, u);
        EXPECT_EQ(s.rank, r);
        EXPECT_EQ(s.row, j);
        // and block_rows_on_rank of pos's block puts row j on rank r in logical page i
        int64_t lp;
        int32_t first, count;
        l.block_rows_on_rank(pos / 128, r, &lp, &first, &count);
        EXPECT_EQ(lp, i);
        EXPECT_GE(j, first);
        EXPECT_LT(j, first + count);
      }
  }

  // block_rows_on_rank agrees with owner_of_offset for every block of several pages
  for (int64_t b = 0; b < 6 * (P / 128); ++b) {
    int total = 0;
    for (int r = 0; r < W; ++r) {
      int64_t lp;
      int32_t first, count;
      l.block_rows_on_rank(b, r, &lp, &first, &count);
      EXPECT_EQ(lp, b * 128 / P);
      std::set<int> expect, got;
      for (int t = 0; t < 128; ++t) {
        const int u = static_cast<int>((b * 128 + t) % P);
        if (l.owner_of_offset(u) == r) expect.insert(l.local_row_of_offset(u));
      }
      for (int j = first; j < first + count; ++j) got.insert(j);
      EXPECT_EQ(got, expect) << "block " << b << " rank " << r;
      if (count) {
        EXPECT_GE(first, 0);
        EXPECT_LE(first + count, R);
      }
      total += count;
    }
    EXPECT_EQ(total, 128) << "block " << b;
  }
}

INSTANTIATE_TEST_SUITE_P(All, LayoutGeometry,
                         ::testing::Combine(::testing::Values(128, 256), ::testing::Values(1, 2, 4, 8),
                                            ::testing::Values(KvDtype::kNvfp4, KvDtype::kFp8)));

TEST(Layout, Bf16IsAStockPageOfTwoHundredFiftySixBytesPerRow) {
  for (int P : {128, 256}) {
    const PageLayout l = make_page_layout(KvDtype::kBf16, P, 1);
    EXPECT_EQ(l.rows(), P);
    EXPECT_EQ(l.page_bytes(), 256 * P);
    EXPECT_EQ(l.row_data_offset(3), 3 * 256);
  }
}

// formats.md section 7, the table of NVFP4 examples
TEST(Layout, SectionSevenTable) {
  struct Row {
    int P, W, R, per_token, shard_page;
  };
  for (const Row& t : {Row{128, 1, 128, 72, 9216}, Row{128, 2, 64, 36, 4608}, Row{128, 4, 32, 18, 2304},
                       Row{256, 2, 128, 36, 9216}, Row{256, 4, 64, 18, 4608}}) {
    const PageLayout l = make_page_layout(KvDtype::kNvfp4, t.P, t.W);
    EXPECT_EQ(l.rows(), t.R) << t.P << "/" << t.W;
    EXPECT_EQ(l.page_bytes(), t.shard_page) << t.P << "/" << t.W;
    // bytes per token per layer per rank: a shard page covers P tokens of the request
    EXPECT_EQ(l.page_bytes() / t.P, t.per_token) << t.P << "/" << t.W;
    EXPECT_EQ(l.page_bytes() % t.P, 0);
  }
  // a stock page is 9216 bytes (128 rows of 64 data + 8 scale bytes)
  EXPECT_EQ(make_page_layout(KvDtype::kNvfp4, 128, 1).page_bytes(), 9216);
}

TEST(Layout, P256W2ShardPageIsExactlyBlockTwoIPlusRank) {
  const PageLayout l = make_page_layout(KvDtype::kNvfp4, 256, 2);
  ASSERT_EQ(l.page_bytes(), make_page_layout(KvDtype::kNvfp4, 128, 1).page_bytes());
  for (int64_t i = 0; i < 5; ++i)
    for (int r = 0; r < 2; ++r) {
      int64_t lp;
      int32_t first, count;
      l.block_rows_on_rank(2 * i + r, r, &lp, &first, &count);
      EXPECT_EQ(lp, i);
      EXPECT_EQ(first, 0);
      EXPECT_EQ(count, 128);  // the whole block, a complete score
      l.block_rows_on_rank(2 * i + (1 - r), r, &lp, &first, &count);
      EXPECT_EQ(count, 0);  // nothing of the other block
    }
  // P256/W4: half of block 2i + rank/2
  const PageLayout l4 = make_page_layout(KvDtype::kNvfp4, 256, 4);
  for (int64_t i = 0; i < 3; ++i)
    for (int r = 0; r < 4; ++r) {
      int64_t lp;
      int32_t first, count;
      l4.block_rows_on_rank(2 * i + r / 2, r, &lp, &first, &count);
      EXPECT_EQ(lp, i);
      EXPECT_EQ(first, 0);
      EXPECT_EQ(count, 64);
      l4.block_rows_on_rank(2 * i + (1 - r / 2), r, &lp, &first, &count);
      EXPECT_EQ(count, 0);
    }
}

TEST(Layout, Refusals) {
  // rows per rank not a multiple of 16
  expect_error([] { make_page_layout(KvDtype::kNvfp4, 128, 16); }, {"shards", "16"}, "P128 W16");
  expect_error([] { make_page_layout(KvDtype::kFp8, 256, 32); }, {"shards", "32"}, "P256 W32");
  expect_error([] { make_page_layout(KvDtype::kNvfp4, 128, 3); }, {"shards", "3"}, "W3");
  expect_error([] { make_page_layout(KvDtype::kNvfp4, 128, 0); }, {"shards", "0"}, "W0");
  expect_error([] { make_page_layout(KvDtype::kNvfp4, 128, -2); }, {"shards"}, "W-2");
  // page sizes
  for (int P : {0, 64, 192, 512, -128})
    expect_error([P] { make_page_layout(KvDtype::kNvfp4, P, 1); }, {"page_size", std::to_string(P)}, "P");
  // bf16 is never sharded
  for (int W : {2, 4, 8})
    expect_error([W] { make_page_layout(KvDtype::kBf16, 128, W); }, {"bf16"}, "bf16 sharded");
  // page stride: below the page bytes, not a multiple of 16, negative
  expect_error([] { make_page_layout(KvDtype::kNvfp4, 128, 1, 9200); }, {"page_stride", "9200"}, "stride small");
  expect_error([] { make_page_layout(KvDtype::kNvfp4, 128, 1, 9216 + 8); }, {"page_stride", "9224"}, "stride %16");
  expect_error([] { make_page_layout(KvDtype::kNvfp4, 128, 2, -16); }, {"page_stride"}, "stride <0");
  // accepted: stride a multiple of 16 above the page bytes; W = 16 at P = 256 gives 16 rows
  EXPECT_EQ(make_page_layout(KvDtype::kNvfp4, 128, 1, 9216 + 16).page_stride, 9232);
  EXPECT_EQ(make_page_layout(KvDtype::kFp8, 256, 16).rows(), 16);
  // a hand-built layout is re-validated by the cache
  PageLayout bad;
  bad.dtype = KvDtype::kNvfp4;
  bad.page_size = 128;
  bad.shards = 1;
  bad.page_stride = 100;
  expect_error([&] { IndexCache c(bad, 4, 1); }, {"page_stride"}, "cache stride");
  const PageLayout ok = make_page_layout(KvDtype::kNvfp4, 128, 2);
  expect_error([&] { IndexCache c(ok, 0, 1); }, {"num_pages"}, "num_pages");
  expect_error([&] { IndexCache c(ok, 4, 0); }, {"num_layers"}, "num_layers");
  expect_error([&] { IndexCache c(ok, 4, 1, 2); }, {"rank"}, "rank");
  expect_error([&] { IndexCache c(ok, 4, 1, -1); }, {"rank"}, "rank");
}

// All offsets are 64-bit: a cache region beyond 2^31 bytes (formats.md section 6), checked
// arithmetically without allocating it.
TEST(Layout, SixtyFourBitOffsets) {
  // 1M tokens x 57 layers x 72 B: layer 56's last page starts beyond 2^32
  const PageLayout l = make_page_layout(KvDtype::kNvfp4, 128, 1);
  const int64_t pages = (int64_t{1} << 20) / 128;  // 8192
  const int64_t layer_stride = pages * l.page_stride;
  EXPECT_EQ(layer_stride, 75497472);
  const int64_t last = 56 * layer_stride + l.page_offset(pages - 1) + l.row_scale_offset(127);
  EXPECT_EQ(last, 4303355904LL - 9216 + 128 * 64 + 127 * 8);
  EXPECT_GT(last, int64_t{1} << 32);

  // a page id whose byte offset needs more than 31 bits, at every layout
  for (int P : {128, 256})
    for (int W : {1, 2, 4, 8}) {
      const PageLayout s = make_page_layout(KvDtype::kNvfp4, P, W);
      const int64_t page = 3000000;  // 3M pages
      const int64_t off = s.page_offset(page);
      EXPECT_EQ(off, 3000000LL * (P / W) * 72);
      EXPECT_GT(off, int64_t{1} << 31);
      EXPECT_EQ(s.row_scale_offset(s.rows() - 1), static_cast<int64_t>(s.rows()) * 64 + (s.rows() - 1) * 8);
    }
  // a page stride above 2^31 (allowed: >= page bytes, multiple of 16)
  const PageLayout big = make_page_layout(KvDtype::kFp8, 128, 1, (int64_t{1} << 31) + 16);
  EXPECT_EQ(big.page_offset(3), 3 * ((int64_t{1} << 31) + 16));
  // slots and positions beyond 2^31
  const int64_t slot = (int64_t{5} << 31) + 77;
  const SlotLocation sl = locate_slot(make_page_layout(KvDtype::kNvfp4, 256, 4), slot);
  EXPECT_EQ(sl.page, slot / 256);
  EXPECT_EQ(sl.offset, 77);
  EXPECT_EQ(sl.rank, 1);
  EXPECT_EQ(sl.row, 13);
  int64_t lp;
  int32_t first, count;
  const int64_t b = (int64_t{3} << 31) + 1;  // block id; its first position is beyond 2^38
  make_page_layout(KvDtype::kNvfp4, 256, 2).block_rows_on_rank(b, 1, &lp, &first, &count);
  EXPECT_EQ(lp, b / 2);
  EXPECT_EQ(first, 0);
  EXPECT_EQ(count, 128);
  // a cache too large for int64 arithmetic is refused cleanly, without wrapping to a small size
  expect_error([] { IndexCache c(make_page_layout(KvDtype::kNvfp4, 128, 1), int64_t{1} << 60, 57); }, {},
               "huge cache");
  try {
    IndexCache c(make_page_layout(KvDtype::kNvfp4, 128, 1), int64_t{1} << 60, 57);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kRuntime);
  }
}

TEST(Cache, LayerRegionsAndPagePointers) {
  const PageLayout l = make_page_layout(KvDtype::kNvfp4, 256, 4, 4608 + 32);
  IndexCache c(l, 9, 5, 3);
  EXPECT_EQ(c.layer_stride(), 9 * (4608 + 32));
  EXPECT_EQ(c.size_bytes(), 5 * c.layer_stride());
  EXPECT_EQ(c.rank(), 3);
  EXPECT_EQ(c.num_layers(), 5);
  EXPECT_EQ(c.num_pages(), 9);
  for (int layer = 0; layer < 5; ++layer)
    for (int64_t p = 0; p < 9; ++p)
      EXPECT_EQ(c.page_ptr(layer, p) - c.data(), layer * c.layer_stride() + p * (4608 + 32));
  EXPECT_TRUE(all_zero(c)) << "a new cache is zero-filled";
}

// ---------------------------------------------------------------------------------------------
// Insert and read back

TEST(Cache, DifferentKeysInDifferentLayersReadBack) {
  for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8, KvDtype::kBf16}) {
    for (int P : {128, 256}) {
      const int W = dt == KvDtype::kBf16 ? 1 : 2;
      const PageLayout l = make_page_layout(dt, P, W);
      const int layers = 4;
      const int64_t pages = 6;
      std::vector<IndexCache> ranks;
      for (int r = 0; r < W; ++r) ranks.emplace_back(l, pages, layers, r);
      // the same slots in every layer, different keys
      std::vector<int64_t> slots;
      for (int64_t s = 0; s < pages * P; s += 7) slots.push_back(s);
      std::vector<std::vector<float>> keys(layers);
      for (int layer = 0; layer < layers; ++layer) {
        if (layer == 2) continue;  // layer 2 stays empty
        keys[layer] = random_keys(static_cast<int64_t>(slots.size()), 100u + layer, 1.0f + layer);
        for (auto& c : ranks)
          insert_keys(c, layer, keys[layer].data(), slots.data(), static_cast<int64_t>(slots.size()));
      }
      for (int layer = 0; layer < layers; ++layer) {
        std::vector<uint8_t> zero(static_cast<size_t>(key_bytes(dt)), 0);
        for (size_t t = 0; t < slots.size(); ++t) {
          const SlotLocation s = locate_slot(l, slots[t]);
          const auto got = read_row_bytes(ranks[s.rank], layer, s.page, s.row);
          if (layer == 2) {
            EXPECT_EQ(got, zero);
          } else {
            EXPECT_EQ(got, quantize_key_bytes(dt, keys[layer].data() + t * kHeadDim))
                << to_string(dt) << " P" << P << " layer " << layer << " token " << t;
          }
        }
      }
      // layer 2's region is untouched, byte for byte
      for (const auto& c : ranks)
        for (int64_t i = 2 * c.layer_stride(); i < 3 * c.layer_stride(); ++i)
          ASSERT_EQ(c.data()[i], 0) << "layer 2 byte " << i;
    }
  }
}

TEST(Cache, PageStrideAbovePageBytes) {
  for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8}) {
    const int P = 128, W = 2;
    const int64_t pb = make_page_layout(dt, P, W).page_bytes();
    const PageLayout tight = make_page_layout(dt, P, W);
    const PageLayout loose = make_page_layout(dt, P, W, pb + 48);
    const int64_t pages = 3;
    const int layers = 2;
    std::vector<int64_t> slots;
    for (int64_t s = 0; s < pages * P; ++s) slots.push_back((s * 37) % (pages * P));  // permutation
    const auto keys = random_keys(static_cast<int64_t>(slots.size()), 7);
    for (int r = 0; r < W; ++r) {
      IndexCache a(tight, pages, layers, r), b(loose, pages, layers, r);
      for (int layer = 0; layer < layers; ++layer) {
        insert_keys(a, layer, keys.data(), slots.data(), static_cast<int64_t>(slots.size()));
        insert_keys(b, layer, keys.data(), slots.data(), static_cast<int64_t>(slots.size()));
      }
      for (int layer = 0; layer < layers; ++layer)
        for (int64_t p = 0; p < pages; ++p) {
          // the page bytes are identical; the gap after them stays zero
          EXPECT_EQ(0, std::memcmp(a.page_ptr(layer, p), b.page_ptr(layer, p), static_cast<size_t>(pb)));
          for (int64_t g = pb; g < pb + 48; ++g) EXPECT_EQ(b.page_ptr(layer, p)[g], 0) << "gap byte " << g;
          for (int j = 0; j < tight.rows(); ++j) EXPECT_EQ(read_row_bytes(a, layer, p, j), read_row_bytes(b, layer, p, j));
        }
    }
  }
  // scoring through a strided replicated cache selects the same blocks
  auto req = make_requests({2200}, 128, 3);
  std::vector<float> keys;
  std::vector<int64_t> slots;
  make_keys(req, 4, keys, slots);
  IndexCache a(make_page_layout(KvDtype::kNvfp4, 128, 1), req.num_pages, 1);
  IndexCache b(make_page_layout(KvDtype::kNvfp4, 128, 1, 9216 + 64), req.num_pages, 1);
  insert_keys(a, 0, keys.data(), slots.data(), static_cast<int64_t>(slots.size()));
  insert_keys(b, 0, keys.data(), slots.data(), static_cast<int64_t>(slots.size()));
  const auto q = make_q(2, 4, 5);
  DecodeBatch batch;
  batch.q = q.data();
  batch.heads = 4;
  batch.block_table = req.block_table.data();
  batch.num_requests = 1;
  batch.max_pages = req.max_pages;
  batch.seq_lens = req.seq_lens.data();
  batch.query_len = 2;
  SelectionParams sel;
  std::vector<int32_t> oa(2 * 4 * 16), ob(2 * 4 * 16);
  decode_select(a, 0, batch, 0, 4, sel, KRounding::kE4m3, oa.data());
  decode_select(b, 0, batch, 0, 4, sel, KRounding::kE4m3, ob.data());
  EXPECT_EQ(oa, ob);
}

TEST(Cache, RowsLandWhereTheLayoutSays) {
  // raw bytes: NVFP4 data rows, then the scale region; FP8 rows
  for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8}) {
    const PageLayout l = make_page_layout(dt, 256, 4);
    IndexCache c(l, 3, 2, 2);
    const auto key = random_keys(1, 9);
    const int64_t slot = 2 * 256 + 2 * 64 + 17;  // page 2, offset 145: rank 2, row 17
    insert_keys(c, 1, key.data(), &slot, 1);
    const auto want = quantize_key_bytes(dt, key.data());
    const uint8_t* page = c.page_ptr(1, 2);
    if (dt == KvDtype::kNvfp4) {
      EXPECT_EQ(0, std::memcmp(page + 17 * 64, want.data(), 64));
      EXPECT_EQ(0, std::memcmp(page + 64 * 64 + 17 * 8, want.data() + 64, 8));
    } else {
      EXPECT_EQ(0, std::memcmp(page + 17 * 128, want.data(), 128));
    }
    // nothing else is written
    int64_t nonzero = 0;
    for (int64_t i = 0; i < c.size_bytes(); ++i) nonzero += c.data()[i] != 0;
    int64_t want_nz = 0;
    for (uint8_t b : want) want_nz += b != 0;
    EXPECT_EQ(nonzero, want_nz);
  }
}

TEST(Cache, InsertWritesOnlyTheOwnerRanksRows) {
  for (int P : {128, 256})
    for (int W : {2, 4, 8}) {
      const PageLayout l = make_page_layout(KvDtype::kNvfp4, P, W);
      const int R = P / W;
      const int64_t pages = 2;
      for (int owner = 0; owner < W; owner += (W > 2 ? W - 1 : 1)) {
        // tokens only at offsets of `owner`, over every page
        std::vector<int64_t> slots;
        for (int64_t p = 0; p < pages; ++p)
          for (int j = 0; j < R; j += 3) slots.push_back(p * P + owner * R + j);
        const auto keys = random_keys(static_cast<int64_t>(slots.size()), 17u + owner);
        for (int r = 0; r < W; ++r) {
          IndexCache c(l, pages, 2, r);
          insert_keys(c, 1, keys.data(), slots.data(), static_cast<int64_t>(slots.size()));
          if (r != owner) {
            EXPECT_TRUE(all_zero(c)) << "P" << P << " W" << W << ": rank " << r << " wrote a row of rank " << owner;
          } else {
            for (size_t t = 0; t < slots.size(); ++t) {
              const SlotLocation s = locate_slot(l, slots[t]);
              EXPECT_EQ(read_row_bytes(c, 1, s.page, s.row), quantize_key_bytes(KvDtype::kNvfp4, keys.data() + t * 128));
            }
          }
        }
      }
      // a full batch over all offsets: each rank's cache holds exactly its rows
      std::vector<int64_t> slots;
      for (int64_t s = 0; s < pages * P; ++s) slots.push_back(s);
      const auto keys = random_keys(static_cast<int64_t>(slots.size()), 23);
      for (int r = 0; r < W; ++r) {
        IndexCache c(l, pages, 1, r);
        insert_keys(c, 0, keys.data(), slots.data(), static_cast<int64_t>(slots.size()));
        for (int64_t p = 0; p < pages; ++p)
          for (int j = 0; j < R; ++j) {
            const int64_t slot = p * P + r * R + j;
            ASSERT_EQ(read_row_bytes(c, 0, p, j), quantize_key_bytes(KvDtype::kNvfp4, keys.data() + slot * 128))
                << "P" << P << " W" << W << " rank " << r << " page " << p << " row " << j;
          }
      }
    }
}

TEST(Cache, RefusedBatchesWriteNothing) {
  for (int W : {1, 2}) {
    const PageLayout l = make_page_layout(KvDtype::kNvfp4, 128, W);
    const int64_t pages = 4;
    std::vector<IndexCache> ranks;
    for (int r = 0; r < W; ++r) ranks.emplace_back(l, pages, 2, r);
    // some content first, so "unchanged" is not just "still zero"
    std::vector<int64_t> pre;
    for (int64_t s = 0; s < pages * 128; s += 5) pre.push_back(s);
    const auto pre_keys = random_keys(static_cast<int64_t>(pre.size()), 31);
    for (auto& c : ranks) insert_keys(c, 0, pre_keys.data(), pre.data(), static_cast<int64_t>(pre.size()));
    std::vector<std::vector<uint8_t>> before;
    for (auto& c : ranks) before.push_back(snapshot(c));

    const int n = 6;
    const std::vector<int64_t> good = {1, 130, 260, 390, 64, 200};  // both ranks own some
    const auto keys = random_keys(n, 32, 3.0f);
    auto try_all = [&](const std::vector<float>& k, const std::vector<int64_t>& s, InsertOptions o, int layer,
                       const std::vector<std::string>& needles, const std::string& what) {
      for (int r = 0; r < W; ++r) {
        expect_error([&] { insert_keys(ranks[r], layer, k.data(), s.data(), n, o); }, needles,
                     what + " W" + std::to_string(W) + " rank " + std::to_string(r));
        EXPECT_EQ(snapshot(ranks[r]), before[r]) << what << ": a refused batch wrote bytes (rank " << r << ")";
      }
    };
    // slot out of range: past the last slot, below -1
    for (int64_t bad : {pages * 128, pages * 128 + 1000, int64_t{-2}, int64_t{-1000}}) {
      auto s = good;
      s[4] = bad;
      try_all(keys, s, {}, 0, {"slot_mapping[4]", std::to_string(bad)}, "slot " + std::to_string(bad));
    }
    // duplicate slot in one batch
    {
      auto s = good;
      s[5] = s[2];
      try_all(keys, s, {}, 0, {"slot_mapping[5]"}, "duplicate");
    }
    // non-finite key values name the token (the first bad one, even if another rank owns it)
    for (float bad : {NAN, INFINITY, -INFINITY, -NAN}) {
      auto k = keys;
      k[3 * 128 + 77] = bad;
      try_all(k, good, {}, 0, {"token 3"}, "non-finite key");
    }
    // bad encode scale
    for (float S : {0.0f, -0.0f, -1.0f, NAN, INFINITY, -INFINITY}) {
      InsertOptions o;
      o.encode_scale = S;
      try_all(keys, good, o, 0, {"encode_scale"}, "encode scale");
    }
    // layer out of range
    for (int layer : {-1, 2, 1000}) try_all(keys, good, {}, layer, {"layer", std::to_string(layer)}, "layer");
    // RoPE without positions
    {
      InsertOptions o;
      o.pre.rope = true;
      try_all(keys, good, o, 0, {"positions"}, "rope without positions");
    }
    // the valid batch is then accepted and written
    for (auto& c : ranks) insert_keys(c, 1, keys.data(), good.data(), n);
    for (int t = 0; t < n; ++t) {
      const SlotLocation s = locate_slot(l, good[t]);
      EXPECT_EQ(read_row_bytes(ranks[s.rank], 1, s.page, s.row), quantize_key_bytes(KvDtype::kNvfp4, keys.data() + t * 128));
    }
  }
}

TEST(Cache, SlotMinusOneIsSkipped) {
  const PageLayout l = make_page_layout(KvDtype::kFp8, 128, 1);
  IndexCache c(l, 3, 1);
  const std::vector<int64_t> slots = {-1, 5, -1, 300, -1};
  const auto keys = random_keys(5, 41);
  insert_keys(c, 0, keys.data(), slots.data(), 5);
  EXPECT_EQ(read_row_bytes(c, 0, 0, 5), quantize_key_bytes(KvDtype::kFp8, keys.data() + 1 * 128));
  EXPECT_EQ(read_row_bytes(c, 0, 2, 44), quantize_key_bytes(KvDtype::kFp8, keys.data() + 3 * 128));
  // exactly two rows written
  int64_t rows_nonzero = 0;
  for (int64_t p = 0; p < 3; ++p)
    for (int j = 0; j < 128; ++j) {
      const auto b = read_row_bytes(c, 0, p, j);
      bool nz = false;
      for (uint8_t x : b) nz |= x != 0;
      rows_nonzero += nz;
    }
  EXPECT_EQ(rows_nonzero, 2);
  // a batch of only skipped tokens (and an empty batch) writes nothing
  IndexCache d(l, 3, 1);
  const std::vector<int64_t> none = {-1, -1};
  insert_keys(d, 0, keys.data(), none.data(), 2);
  insert_keys(d, 0, keys.data(), none.data(), 0);
  EXPECT_TRUE(all_zero(d));
  // -1 may repeat (it is not a slot)
  const std::vector<int64_t> reps = {-1, -1, -1, 7, -1};
  insert_keys(d, 0, keys.data(), reps.data(), 5);
  EXPECT_EQ(read_row_bytes(d, 0, 0, 7), quantize_key_bytes(KvDtype::kFp8, keys.data() + 3 * 128));
}

TEST(Cache, Bf16KeysInsertPath) {
  const int n = 40;
  std::mt19937 rng(51);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<uint16_t> kb(static_cast<size_t>(n) * 128);
  std::vector<float> kf(kb.size());
  for (size_t i = 0; i < kb.size(); ++i) {
    kb[i] = bf16_encode(nd(rng));
    kf[i] = bf16_decode(kb[i]);
  }
  std::vector<int64_t> slots;
  for (int t = 0; t < n; ++t) slots.push_back((t * 53) % 512);
  for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8, KvDtype::kBf16})
    for (int W : {1, 2}) {
      if (dt == KvDtype::kBf16 && W > 1) continue;
      const PageLayout l = make_page_layout(dt, 256, W);
      for (int r = 0; r < W; ++r) {
        IndexCache a(l, 2, 1, r), b(l, 2, 1, r);
        insert_keys_bf16(a, 0, kb.data(), slots.data(), n);
        insert_keys(b, 0, kf.data(), slots.data(), n);
        EXPECT_EQ(snapshot(a), snapshot(b)) << to_string(dt) << " W" << W;
        for (int t = 0; t < n; ++t) {
          const SlotLocation s = locate_slot(l, slots[t]);
          if (s.rank != r) continue;
          const auto row = read_row_bytes(a, 0, s.page, s.row);
          if (dt == KvDtype::kBf16) {
            // a bf16 key stored in a bf16 cache keeps its bits (little-endian)
            for (int d = 0; d < 128; ++d)
              ASSERT_EQ(row[2 * d] | (row[2 * d + 1] << 8), kb[t * 128 + d]) << "token " << t << " dim " << d;
          } else {
            EXPECT_EQ(row, quantize_key_bytes(dt, kf.data() + t * 128));
          }
        }
      }
    }
  // a non-finite bf16 key is refused, naming the token, nothing written
  IndexCache c(make_page_layout(KvDtype::kNvfp4, 128, 1), 4, 1);
  auto bad = kb;
  bad[7 * 128 + 3] = 0x7f80;  // +Inf
  expect_error([&] { insert_keys_bf16(c, 0, bad.data(), slots.data(), n); }, {"token 7"}, "bf16 inf");
  bad[7 * 128 + 3] = 0x7fc1;  // NaN
  expect_error([&] { insert_keys_bf16(c, 0, bad.data(), slots.data(), n); }, {"token 7"}, "bf16 nan");
  EXPECT_TRUE(all_zero(c));
}

TEST(Cache, ReadRowKhatMatchesTheDequantizer) {
  const auto keys = random_keys(3, 61, 5.0f);
  const std::vector<int64_t> slots = {0, 129, 255};
  for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8, KvDtype::kBf16}) {
    IndexCache c(make_page_layout(dt, 128, 1), 2, 1);
    insert_keys(c, 0, keys.data(), slots.data(), 3);
    for (int t = 0; t < 3; ++t) {
      const auto row = quantize_key_bytes(dt, keys.data() + t * 128);
      for (KRounding m : {KRounding::kE4m3, KRounding::kExact}) {
        float got[128], want[128];
        read_row_khat(c, 0, slots[t] / 128, static_cast<int32_t>(slots[t] % 128), m, got);
        for (int d = 0; d < 128; ++d) {
          if (dt == KvDtype::kNvfp4) {
            const uint8_t code = (d & 1) ? row[d / 2] >> 4 : row[d / 2] & 0xf;
            const float p = e2m1_decode(code) * e4m3_decode(row[64 + d / 16]);
            want[d] = m == KRounding::kExact ? p : e4m3_decode(e4m3_encode(p));
          } else if (dt == KvDtype::kFp8) {
            want[d] = e4m3_decode(row[d]);  // rounding has no effect
          } else {
            want[d] = bf16_decode(static_cast<uint16_t>(row[2 * d] | (row[2 * d + 1] << 8)));
          }
        }
        int w = -1;
        EXPECT_TRUE(same_bits(got, want, 128, &w)) << to_string(dt) << " token " << t << " dim " << w;
      }
    }
    float out[128];
    expect_error([&] { read_row_khat(c, 0, 2, 0, KRounding::kE4m3, out); }, {"page"}, "page");
    expect_error([&] { read_row_bytes(c, 0, 0, 128); }, {"row"}, "row");
    expect_error([&] { read_row_bytes(c, 1, 0, 0); }, {"layer"}, "layer");
  }
}

// ---------------------------------------------------------------------------------------------
// Pre-processing (indexer.md section 6): an independent plain implementation, bit for bit

TEST(Preprocess, PlainRmsNormAndRopeEqualPreprocessVector) {
  std::mt19937 rng(71);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(-0.5f, 0.5f);
  const int64_t positions[] = {0, 1, 2, 127, 128, 1000, 4095, 65537, 1000003, (int64_t{1} << 31) + 5};
  int checked = 0;
  for (int it = 0; it < 60; ++it) {
    float x[128], w[128];
    const float mag = std::ldexp(1.0f, (it % 13) - 6);
    for (int d = 0; d < 128; ++d) {
      x[d] = nd(rng) * mag;
      w[d] = ud(rng);
    }
    for (double theta : {5e6, 1e4}) {
      for (int64_t pos : positions) {
        for (int mode = 0; mode < 3; ++mode) {  // norm only, rope only, both
          const bool norm = mode != 1, rope = mode != 0;
          const float eps = 1e-6f;
          float want[128], got[128];
          plain_preprocess(x, norm ? w : nullptr, eps, rope, theta, pos, want);
          preprocess_vector(x, norm ? w : nullptr, eps, rope, theta, pos, got);
          int where = -1;
          ASSERT_TRUE(same_bits(want, got, 128, &where))
              << "it " << it << " theta " << theta << " pos " << pos << " mode " << mode << " dim " << where
              << ": " << want[where] << " vs " << got[where];
          ++checked;
        }
        if (pos > 1000 && it % 4) break;  // keep the runtime small
      }
    }
  }
  EXPECT_GT(checked, 500);
  // in place (in == out) gives the same result; dims 64..127 untouched by RoPE
  float x[128], w[128], a[128], b[128];
  for (int d = 0; d < 128; ++d) {
    x[d] = nd(rng);
    w[d] = ud(rng);
  }
  preprocess_vector(x, w, 1e-6f, true, 5e6, 777, a);
  std::copy(x, x + 128, b);
  preprocess_vector(b, w, 1e-6f, true, 5e6, 777, b);
  int where = -1;
  EXPECT_TRUE(same_bits(a, b, 128, &where)) << where;
  float n_only[128];
  plain_preprocess(x, w, 1e-6f, false, 5e6, 0, n_only);
  EXPECT_TRUE(same_bits(a + 64, n_only + 64, 64, &where)) << where;
  // position 0: cos = 1, sin = 0 -> RoPE is the identity
  float r0[128];
  preprocess_vector(x, nullptr, 1e-6f, true, 5e6, 0, r0);
  EXPECT_TRUE(same_bits(r0, x, 128, &where)) << where;
}

TEST(Preprocess, InsertAppliesNormAndRopeBeforeQuantizing) {
  const int n = 12;
  const auto keys = random_keys(n, 81, 3.0f);
  std::vector<float> w(128);
  std::mt19937 rng(82);
  std::uniform_real_distribution<float> ud(-0.3f, 0.3f);
  for (auto& v : w) v = ud(rng);
  std::vector<int64_t> positions, slots;
  for (int t = 0; t < n; ++t) {
    positions.push_back(1000 + 37 * t);
    slots.push_back(t * 21);
  }
  for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8}) {
    IndexCache c(make_page_layout(dt, 128, 1), 2, 1);
    InsertOptions o;
    o.pre.norm_weight = w.data();
    o.pre.rope = true;
    o.pre.positions = positions.data();
    insert_keys(c, 0, keys.data(), slots.data(), n, o);
    for (int t = 0; t < n; ++t) {
      float y[128];
      plain_preprocess(keys.data() + t * 128, w.data(), 1e-6f, true, 5e6, positions[t], y);
      EXPECT_EQ(read_row_bytes(c, 0, slots[t] / 128, static_cast<int32_t>(slots[t] % 128)), quantize_key_bytes(dt, y))
          << to_string(dt) << " token " << t;
    }
  }
}

TEST(Preprocess, QuantizeQueries) {
  const int tokens = 5, heads = 3;
  const auto q = random_keys(tokens * heads, 91, 40.0f);
  // plain cast
  std::vector<uint8_t> out(static_cast<size_t>(tokens) * heads * 128, 0xAA);
  quantize_queries(q.data(), tokens, heads, {}, out.data());
  for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], e4m3_encode(q[i])) << i;
  // with RMSNorm and RoPE at positions[token] (every head of a token shares its position)
  std::vector<float> w(128);
  for (int d = 0; d < 128; ++d) w[d] = 0.01f * static_cast<float>(d % 11) - 0.05f;
  const std::vector<int64_t> positions = {3, 129, 4096, 70000, 12};
  KeyPreprocess pre;
  pre.norm_weight = w.data();
  pre.rope = true;
  pre.positions = positions.data();
  quantize_queries(q.data(), tokens, heads, pre, out.data());
  for (int t = 0; t < tokens; ++t)
    for (int h = 0; h < heads; ++h) {
      float y[128];
      plain_preprocess(q.data() + (t * heads + h) * 128, w.data(), 1e-6f, true, 5e6, positions[t], y);
      for (int d = 0; d < 128; ++d)
        ASSERT_EQ(out[(t * heads + h) * 128 + d], e4m3_encode(y[d])) << "token " << t << " head " << h << " dim " << d;
    }
  // saturation: +-Inf and large values go to +-448
  std::vector<float> big(128, 1e9f);
  big[0] = INFINITY;
  big[1] = -INFINITY;
  big[2] = -500.0f;
  std::vector<uint8_t> ob(128);
  quantize_queries(big.data(), 1, 1, {}, ob.data());
  EXPECT_EQ(ob[0], 0x7E);
  EXPECT_EQ(ob[1], 0xFE);
  EXPECT_EQ(ob[2], 0xFE);
  EXPECT_EQ(ob[3], 0x7E);
  // NaN is refused, naming q (and where); the output is not written
  auto qn = q;
  qn[(2 * heads + 1) * 128 + 9] = NAN;
  std::vector<uint8_t> keep(out.size(), 0x55);
  expect_error([&] { quantize_queries(qn.data(), tokens, heads, {}, keep.data()); }, {"q", "token 2", "head 1"},
               "NaN q");
  for (uint8_t b : keep) ASSERT_EQ(b, 0x55);
  // RoPE without positions is refused
  KeyPreprocess nopos;
  nopos.rope = true;
  expect_error([&] { quantize_queries(q.data(), tokens, heads, nopos, keep.data()); }, {"positions"}, "rope");
  expect_error([&] { quantize_queries(q.data(), tokens, 0, {}, keep.data()); }, {"heads"}, "heads");
}

TEST(CacheLimits, ACacheLargerThanTheLimitIsRefusedWithItsFactorsNamed) {
  try {
    indexcp::IndexCache c(indexcp::make_page_layout(indexcp::KvDtype::kNvfp4, 128, 1), int64_t{1} << 50, 1);
    ADD_FAILURE() << "allocated 2^50 pages";
  } catch (const indexcp::Error& e) {
    EXPECT_EQ(e.code(), indexcp::ErrorCode::kRuntime);
    EXPECT_NE(std::string(e.what()).find("num_pages = 1125899906842624"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find(".000000"), std::string::npos) << e.what();
  }
}
