// Replicated decode and prefill against the brute-force reference (indexer.md sections 3-4).
#include <gtest/gtest.h>

#include <cmath>

#include "indexcp/error.hpp"
#include "util.hpp"

using namespace indexcp;
using namespace testutil;

namespace {

struct Setup {
  Requests req;
  std::vector<float> keys;
  std::vector<int64_t> slots;
};

Setup setup(const std::vector<int32_t>& lens, int32_t P, uint32_t seed) {
  Setup s;
  s.req = make_requests(lens, P, seed);
  make_keys(s.req, seed + 1, s.keys, s.slots);
  return s;
}


}  // namespace

class DecodeVsBruteForce
    : public ::testing::TestWithParam<std::tuple<KvDtype, int32_t /*P*/, int32_t /*Q*/, int32_t /*H*/, KRounding>> {};

TEST_P(DecodeVsBruteForce, SelectsTheSameBlocks) {
  const auto [dt, P, Q, H, mode] = GetParam();
  auto s = setup({2100, 0, 300, 4000}, P, 11u + P + Q);
  auto caches = make_shards(dt, s.req, 1, s.keys, s.slots);
  const int64_t rows = static_cast<int64_t>(s.req.seq_lens.size()) * Q;
  const auto q = make_q(rows, H, 99u + H);
  const DecodeBatch b = decode_batch(s.req, q, H, Q);
  SelectionParams sel;
  std::vector<int32_t> out(rows * H * sel.topk, -9);
  decode_select(caches[0], 0, b, 0, H, sel, mode, out.data());
  const auto qrows = decode_rows(b, s.req.num_pages, P);
  const auto ref = brute_force(caches[0], 0, s.req, qrows, q, H, sel, mode);
  EXPECT_EQ(out, ref);
  // structural contract: ascending valid ids, then -1; local block present once
  for (int64_t r = 0; r < rows; ++r)
    for (int32_t h = 0; h < H; ++h) {
      const int32_t* o = out.data() + (r * H + h) * sel.topk;
      const int64_t n = visible_blocks(qrows[r]);
      int valid = 0;
      for (int k = 0; k < sel.topk; ++k) {
        if (o[k] >= 0) {
          ++valid;
          if (k) ASSERT_LT(o[k - 1], o[k]);
        }
      }
      ASSERT_EQ(valid, std::min<int64_t>(16, n));
      if (n) ASSERT_EQ(o[valid - 1], n - 1);
    }
}

INSTANTIATE_TEST_SUITE_P(
    All, DecodeVsBruteForce,
    ::testing::Combine(::testing::Values(KvDtype::kNvfp4, KvDtype::kFp8, KvDtype::kBf16), ::testing::Values(128, 256),
                       ::testing::Values(1, 8, 16), ::testing::Values(1, 2, 4, 8),
                       ::testing::Values(KRounding::kE4m3, KRounding::kExact)));

TEST(Decode, InitBlocksAreForcedAndNeverDuplicated) {
  auto s = setup({5000}, 128, 5);
  auto caches = make_shards(KvDtype::kNvfp4, s.req, 1, s.keys, s.slots);
  const auto q = make_q(2, 2, 3);
  DecodeBatch b = decode_batch(s.req, q, 2, 2);
  for (int init : {1, 3, 14}) {
    SelectionParams sel;
    sel.init_blocks = init;
    std::vector<int32_t> out(2 * 2 * 16);
    decode_select(caches[0], 0, b, 0, 2, sel, KRounding::kE4m3, out.data());
    const auto ref = brute_force(caches[0], 0, s.req, decode_rows(b, s.req.num_pages, 128), q, 2, sel, KRounding::kE4m3);
    EXPECT_EQ(out, ref) << "init " << init;
    for (int i = 0; i < 4; ++i)
      for (int k = 0; k < init; ++k) EXPECT_EQ(out[i * 16 + k], k);
  }
}

TEST(Decode, TopkOtherThanSixteen) {
  auto s = setup({3000, 1000}, 256, 8);
  auto caches = make_shards(KvDtype::kFp8, s.req, 1, s.keys, s.slots);
  const auto q = make_q(6, 4, 4);
  DecodeBatch b = decode_batch(s.req, q, 4, 3);
  for (int K : {2, 8, 32}) {
    SelectionParams sel;
    sel.topk = K;
    std::vector<int32_t> out(6 * 4 * K);
    decode_select(caches[0], 0, b, 0, 4, sel, KRounding::kE4m3, out.data());
    EXPECT_EQ(out, brute_force(caches[0], 0, s.req, decode_rows(b, s.req.num_pages, 256), q, 4, sel, KRounding::kE4m3));
  }
}

TEST(Decode, HeadRangeEqualsSliceOfAllHeads) {
  auto s = setup({4000}, 128, 21);
  auto caches = make_shards(KvDtype::kNvfp4, s.req, 1, s.keys, s.slots);
  const auto q = make_q(8, 4, 22);
  DecodeBatch b = decode_batch(s.req, q, 4, 8);
  SelectionParams sel;
  std::vector<int32_t> all(8 * 4 * 16), part(8 * 2 * 16);
  decode_select(caches[0], 0, b, 0, 4, sel, KRounding::kE4m3, all.data());
  decode_select(caches[0], 0, b, 2, 2, sel, KRounding::kE4m3, part.data());
  for (int r = 0; r < 8; ++r)
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 16; ++k) EXPECT_EQ(part[(r * 2 + h) * 16 + k], all[(r * 4 + 2 + h) * 16 + k]);
}

TEST(Prefill, ReplicatedMatchesBruteForceWithE4m3Keys) {
  for (int32_t P : {128, 256}) {
    auto s = setup({3000, 700, 2048}, P, 31u + P);
    auto caches = make_shards(KvDtype::kNvfp4, s.req, 1, s.keys, s.slots);
    std::vector<int32_t> qs = {0, 130, 130 + 700, 130 + 700 + 5};
    const auto q = make_q(qs.back(), 4, 32);
    const PrefillBatch b = prefill_batch(s.req, q, 4, qs);
    SelectionParams sel;
    std::vector<int32_t> out(qs.back() * 4 * 16);
    prefill_select(caches[0], 0, b, 0, 4, sel, out.data());
    const auto rows = prefill_rows(b, s.req.num_pages, P);
    ASSERT_EQ(rows[0].pos, 3000 - 130);
    ASSERT_EQ(rows[130].pos, 0);
    // prefill scores E4M3-rounded keys whatever the decode rounding is
    EXPECT_EQ(out, brute_force(caches[0], 0, s.req, rows, q, 4, sel, KRounding::kE4m3));
  }
}

TEST(Select, NaNRanksBelowEverythingAndZerosTie) {
  EXPECT_TRUE(score_below(NAN, -INFINITY));
  EXPECT_FALSE(score_below(-INFINITY, NAN));
  EXPECT_FALSE(score_below(NAN, NAN));
  EXPECT_FALSE(score_below(-0.0f, 0.0f));
  EXPECT_FALSE(score_below(0.0f, -0.0f));
  EXPECT_TRUE(candidate_better(-0.0f, 3, 0.0f, 4));
  EXPECT_TRUE(candidate_better(0.0f, 3, -0.0f, 4));
  EXPECT_TRUE(candidate_better(-INFINITY, 9, NAN, 1));
  // selection from scores holding NaN: NaN blocks lose to every number
  const std::vector<QueryRow> rows = {{0, 20 * 128 + 5}};
  BlockScores s;
  s.rows = 1;
  s.heads = 1;
  s.max_blocks = 21;
  s.score.assign(21, NAN);
  s.valid.assign(21, 1);
  for (int b = 0; b < 20; b += 2) s.score[b] = -1000.0f + b;  // 10 numbers, 10 NaN
  SelectionParams sel;
  std::vector<int32_t> out(16);
  select_topk(s, rows, sel, out.data());
  // 10 numbered blocks + 5 lowest-id NaN blocks (1, 3, 5, 7, 9) + local 20
  EXPECT_EQ(out, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 16, 18, 20}));
}

TEST(Decode, BadInputsAreRefusedWithTheArgumentNamed) {
  auto s = setup({1000}, 128, 41);
  auto caches = make_shards(KvDtype::kNvfp4, s.req, 1, s.keys, s.slots);
  auto q = make_q(4, 4, 42);
  SelectionParams sel;
  std::vector<int32_t> out(4 * 4 * 16, 5);
  auto expect_error = [&](DecodeBatch b, const std::string& needle, SelectionParams sp = {}) {
    try {
      decode_select(caches[0], 0, b, 0, 4, sp, KRounding::kE4m3, out.data());
      ADD_FAILURE() << "accepted; expected an error naming " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  DecodeBatch b = decode_batch(s.req, q, 4, 4);
  DecodeBatch x = b;
  x.query_len = 17;
  expect_error(x, "query_len");
  x = b;
  x.query_len = 0;
  expect_error(x, "query_len");
  std::vector<int32_t> bad_len = {2};
  x = b;
  x.seq_lens = bad_len.data();
  expect_error(x, "seq_lens[0]");
  bad_len = {-1};
  expect_error(x, "seq_lens[0]");
  bad_len = {100000};
  expect_error(x, "seq_lens[0]");
  auto bt = s.req.block_table;
  bt[3] = static_cast<int32_t>(s.req.num_pages);
  x = b;
  x.block_table = bt.data();
  expect_error(x, "block_table[0][3]");
  bt[3] = -1;
  expect_error(x, "block_table[0][3]");
  auto qn = q;
  qn[5 * 128 + 7] = 0xFF;
  x = b;
  x.q = qn.data();
  expect_error(x, "q holds a NaN byte at row 1, head 1, dim 7");
  x = b;
  x.heads = 0;
  expect_error(x, "heads");
  SelectionParams bad;
  bad.local_blocks = 0;
  expect_error(b, "local_blocks", bad);
  bad = {};
  bad.init_blocks = 15;
  expect_error(b, "init_blocks", bad);
  for (int32_t v : out) EXPECT_EQ(v, 5) << "a refused call wrote its output";
}

// The q check finds a NaN byte (0x7F or 0xFF) wherever it is, and names its row, head and dim:
// first and last byte, every head, a later request's rows, in decode and prefill batches (the
// check scans 128 bytes at a time and looks for the exact place only after a hit).
TEST(Validation, QNaNByteFoundAnywhereWithItsPlace) {
  const int32_t heads = 3, P = 128, pages = 4;
  std::vector<int32_t> bt = {0, 1, 2, 3};  // 2 requests x max_pages 2
  std::vector<int32_t> lens = {200, 256};
  std::vector<int32_t> qs = {0, 5, 12};  // prefill: 5 and 7 rows
  const int64_t prefill_rows_n = 12, decode_rows_n = 2 * 4;
  std::mt19937 rng(3);
  for (const bool prefill : {false, true}) {
    const int64_t rows = prefill ? prefill_rows_n : decode_rows_n;
    std::vector<uint8_t> q(static_cast<size_t>(rows) * heads * 128, 0x38);
    std::vector<int64_t> places = {0, static_cast<int64_t>(q.size()) - 1};
    for (int i = 0; i < 40; ++i) places.push_back(static_cast<int64_t>(rng() % q.size()));
    for (const int64_t at : places)
      for (const uint8_t nan : {uint8_t{0x7F}, uint8_t{0xFF}}) {
        std::vector<uint8_t> qn = q;
        qn[static_cast<size_t>(at)] = nan;
        const int64_t r = at / (heads * 128), h = at / 128 % heads, d = at % 128;
        const std::string want = "q holds a NaN byte at row " + std::to_string(r) + ", head " + std::to_string(h) +
                                 ", dim " + std::to_string(d);
        try {
          if (prefill) {
            PrefillBatch b{qn.data(), heads, bt.data(), 2, 2, lens.data(), qs.data()};
            (void)prefill_rows(b, pages, P);
          } else {
            DecodeBatch b{qn.data(), heads, bt.data(), 2, 2, lens.data(), 4};
            (void)decode_rows(b, pages, P);
          }
          ADD_FAILURE() << "accepted a NaN byte at " << at << (prefill ? " (prefill)" : " (decode)");
        } catch (const Error& e) {
          EXPECT_EQ(std::string(e.what()), want) << at;
        }
      }
    // and no NaN: accepted
    if (prefill) {
      PrefillBatch b{q.data(), heads, bt.data(), 2, 2, lens.data(), qs.data()};
      EXPECT_EQ(prefill_rows(b, pages, P).size(), static_cast<size_t>(prefill_rows_n));
    } else {
      DecodeBatch b{q.data(), heads, bt.data(), 2, 2, lens.data(), 4};
      EXPECT_EQ(decode_rows(b, pages, P).size(), static_cast<size_t>(decode_rows_n));
    }
  }
}
