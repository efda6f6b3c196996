// C07 of ../shared/cases/README.md: the FP8 staging primitive on more than 65,535 pages in one
// call (the budgeted gather is not involved). On the CPU with 16-row shard pages (P = 128, W = 8,
// and P = 256, W = 16); registered under the ctest label `slow`.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "indexcp/cache.hpp"
#include "indexcp/formats.hpp"
#include "indexcp/icp.hpp"
#include "indexcp/layout.hpp"

using namespace indexcp;

namespace {

// Fills every row of every page with random but valid bytes (NVFP4: scale bytes never NaN).
void fill_random(IndexCache& c, uint32_t seed) {
  std::mt19937 rng(seed);
  const PageLayout& l = c.layout();
  for (int64_t p = 0; p < c.num_pages(); ++p) {
    uint8_t* page = c.page_ptr(0, p);
    for (int64_t i = 0; i < l.page_bytes(); ++i) page[i] = static_cast<uint8_t>(rng());
    if (l.dtype == KvDtype::kNvfp4) {
      for (int32_t j = 0; j < l.rows(); ++j)
        for (int g = 0; g < 8; ++g) {
          uint8_t& s = page[l.row_scale_offset(j) + g];
          s = static_cast<uint8_t>(s % 0x7F);  // 0x00..0x7E
        }
    } else {
      for (int64_t i = 0; i < l.page_bytes(); ++i)
        if (e4m3_is_nan(page[i])) page[i] = 0x00;
    }
  }
}

// The reference staged bytes of one row, written from formats.md / indexer.md only.
void reference_row(const IndexCache& c, int64_t page, int32_t row, uint8_t* out) {
  const PageLayout& l = c.layout();
  const uint8_t* p = c.page_ptr(0, page);
  for (int d = 0; d < 128; ++d) {
    if (l.dtype == KvDtype::kFp8) {
      out[d] = p[row * 128 + d];
    } else {
      const uint8_t byte = p[static_cast<int64_t>(row) * 64 + d / 2];
      const uint8_t code = (d % 2 == 0) ? (byte & 0x0F) : (byte >> 4);
      const uint8_t scale = p[static_cast<int64_t>(l.rows()) * 64 + row * 8 + d / 16];
      out[d] = e4m3_encode(e2m1_decode(code) * e4m3_decode(scale));
    }
  }
}

void stage_and_check(int P, int W, KvDtype dt) {
  const PageLayout l = make_page_layout(dt, P, W);
  ASSERT_EQ(l.rows(), 16);
  const int64_t num_pages = 131073;
  const int32_t rank = W - 1;
  IndexCache c(l, num_pages, 1, rank);
  fill_random(c, 7u + P + W);
  std::vector<int32_t> all(static_cast<size_t>(num_pages));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), std::mt19937(11));
  for (int64_t n : {int64_t{65535}, int64_t{65536}, int64_t{131073}}) {
    SCOPED_TRACE(to_string(dt) + " P" + std::to_string(P) + " W" + std::to_string(W) + " pages " + std::to_string(n));
    std::vector<uint8_t> out(static_cast<size_t>(n) * 16 * 128, 0xEE);
    stage_fp8(c, 0, all.data(), n, out.data());
    uint8_t ref[128];
    int64_t bad = 0;
    for (int64_t i = 0; i < n && bad < 5; ++i)
      for (int32_t j = 0; j < 16; ++j) {
        reference_row(c, all[i], j, ref);
        if (!std::equal(ref, ref + 128, out.data() + (i * 16 + j) * 128)) {
          ADD_FAILURE() << "page index " << i << " (physical " << all[i] << ") row " << j << " differs";
          ++bad;
        }
      }
    EXPECT_EQ(bad, 0);
  }
}

}  // namespace

TEST(CasesSlow, C07_StageFp8BeyondSixtyFiveThousandPages_P128W8) { stage_and_check(128, 8, KvDtype::kNvfp4); }

TEST(CasesSlow, C07_StageFp8BeyondSixtyFiveThousandPages_P256W16) { stage_and_check(256, 16, KvDtype::kNvfp4); }

TEST(CasesSlow, C07_StageFp8BeyondSixtyFiveThousandPages_Fp8) { stage_and_check(128, 8, KvDtype::kFp8); }
