// The CUDA backend's dot-product form (src/cuda/score/form.hpp) on the CPU: the k-slot -> dimension
// map is a bijection per quad, and the key expansions (NVFP4 with E4M3 rounding, FP8, and the
// signed |e2m1| of exact rounding before the device's multiplication by the scale) put in each
// fp16 half the value formats.hpp gives for the dimension form_dim names. The device runs the same
// functions (prmt, mulhi and the E4M3 -> fp16 conversion as instructions); the GPU suite then
// checks whole scores against the CPU reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <set>

#include "cuda/score/form.hpp"
#include "indexcp/formats.hpp"

namespace {

using namespace indexcp;
using namespace indexcp::cuda::detail;

// fp16 bits -> float (every finite fp16, subnormals included)
float half_value(uint32_t bits) {
  const uint32_t s = (bits >> 15) & 1u, e = (bits >> 10) & 0x1Fu, m = bits & 0x3FFu;
  EXPECT_NE(e, 0x1Fu) << "fp16 inf/NaN bits " << bits;
  const float v = e == 0 ? std::ldexp(static_cast<float>(m), -24) : std::ldexp(static_cast<float>(m | 0x400u), static_cast<int>(e) - 25);
  return s ? -v : v;
}
uint32_t half_of(uint32_t word, int jj) { return (word >> (16 * jj)) & 0xFFFFu; }

// The dimension of half jj of pair h[p] (p = 2 e + pair) of word j, as the tiles consume it:
// k-step 2 j + e, quad lane t4.
int dim_of(int t4, int j, int p, int jj) { return form_dim(2 * j + (p >> 1), t4, p & 1, jj); }

TEST(ScoreForm, KSlotsCoverEveryDimensionOnce) {
  std::set<int> dims;
  for (int t4 = 0; t4 < 4; ++t4)
    for (int s = 0; s < 8; ++s)
      for (int pair = 0; pair < 2; ++pair)
        for (int jj = 0; jj < 2; ++jj) {
          const int d = form_dim(s, t4, pair, jj);
          ASSERT_GE(d, 32 * t4);
          ASSERT_LT(d, 32 * t4 + 32) << "a quad lane owns 32 consecutive dims";
          EXPECT_TRUE(dims.insert(d).second) << "dim " << d << " twice";
        }
  EXPECT_EQ(dims.size(), 128u);
  // word j of a thread holds dims 8j .. 8j + 7: pair p of it dims (8j + 2p, 8j + 2p + 1)
  for (int j = 0; j < 4; ++j)
    for (int p = 0; p < 4; ++p) {
      EXPECT_EQ(dim_of(0, j, p, 0), 8 * j + 2 * p);
      EXPECT_EQ(dim_of(0, j, p, 1), 8 * j + 2 * p + 1);
    }
}

TEST(ScoreForm, PrmtMatchesThePtxDefinition) {
  const uint32_t a = 0x83828180u, b = 0x07060504u;
  EXPECT_EQ(form_prmt(a, b, 0x3210u), a);
  EXPECT_EQ(form_prmt(a, b, 0x7654u), b);
  EXPECT_EQ(form_prmt(a, b, 0x0123u), 0x80818283u);
  EXPECT_EQ(form_prmt(a, b, 0x8C84u), 0xFF00FF04u);  // replicate: a's bytes are negative, b's positive
  EXPECT_EQ(form_mulhi(0xDEADBEEFu, 1u << 16), 0xDEADu);
}

// the k_hat table of one scale byte holds the CPU reference's k_hat of each magnitude (both sides
// round with formats.hpp: what this checks is the packing, one byte per magnitude) with the
// scale's sign in every byte's top bit
TEST(ScoreForm, KhatEntryPacksTheReferenceRoundingOfEachMagnitudeAndTheScaleSign) {
  for (int sc = 0; sc < 256; ++sc) {
    uint32_t lo = 0, hi = 0;
    form_khat_entry(static_cast<uint8_t>(sc), &lo, &hi);
    for (int c = 0; c < 8; ++c) {
      const uint8_t byte = static_cast<uint8_t>(((c < 4 ? lo : hi) >> (8 * (c & 3))) & 0xFFu);
      const float want = std::fabs(nvfp4_khat(static_cast<uint8_t>(c), static_cast<uint8_t>(sc & 0x7f), KRounding::kE4m3));
      EXPECT_EQ(byte & 0x80u, static_cast<unsigned>(sc & 0x80)) << "scale " << sc << " code " << c;
      if (std::isnan(want)) continue;  // a NaN scale byte (0x7f, 0xff): never written by the quantizer
      EXPECT_EQ(e4m3_decode(static_cast<uint8_t>(byte & 0x7fu)), want) << "scale " << sc << " code " << c;
    }
  }
}

TEST(ScoreForm, Nvfp4E4m3ExpansionPutsEachDimensionWhereFormDimSays) {
  std::mt19937 rng(7);
  for (int it = 0; it < 20000; ++it) {
    const uint32_t w = rng();
    const uint8_t sc = static_cast<uint8_t>(rng() % 0x7f);  // finite, non-negative scale bytes
    uint32_t lo = 0, hi = 0, h[4];
    form_khat_entry(sc, &lo, &hi);
    form_expand_e4m3(w, lo, hi, h);
    for (int p = 0; p < 4; ++p)
      for (int jj = 0; jj < 2; ++jj) {
        const int d = dim_of(0, 0, p, jj);  // dim within the word = code index
        const uint8_t code = static_cast<uint8_t>((w >> (4 * d)) & 0xFu);
        const float want = nvfp4_khat(code, sc, KRounding::kE4m3);
        const float got = half_value(half_of(h[p], jj));
        ASSERT_EQ(got, want) << "w " << std::hex << w << " scale " << +sc << " pair " << p << " half " << jj;
        ASSERT_EQ(std::signbit(got), (code & 8u) != 0) << "sign of code " << +code << " (-0 included)";
      }
  }
}

// A negative scale byte (never written by the quantizer, but possible in a cache filled by other
// software): the table entry carries the scale's sign, so the expansion of the codes as stored
// gives the reference's k_hat of the negative scale, sign and -0 included. The bytes are those of
// the scorers' earlier form (the table without the sign, every code's sign flipped: w ^
// 0x88888888), for every scale byte, NaN ones included, so the scores keep their bits.
TEST(ScoreForm, NegativeScalesByTheTableEntrysSign) {
  std::mt19937 rng(17);
  for (int it = 0; it < 20000; ++it) {
    const uint32_t w = rng();
    const uint8_t sc = static_cast<uint8_t>(0x80u | (rng() % 0x7f));
    uint32_t lo = 0, hi = 0, h[4];
    form_khat_entry(sc, &lo, &hi);
    form_expand_e4m3(w, lo, hi, h);
    for (int p = 0; p < 4; ++p)
      for (int jj = 0; jj < 2; ++jj) {
        const int d = dim_of(0, 0, p, jj);
        const uint8_t code = static_cast<uint8_t>((w >> (4 * d)) & 0xFu);
        const float got = half_value(half_of(h[p], jj)), want = nvfp4_khat(code, sc, KRounding::kE4m3);
        ASSERT_EQ(got, want) << std::hex << "w " << w << " scale " << +sc << " pair " << p << " half " << jj;
        ASSERT_EQ(std::signbit(got), std::signbit(want)) << std::hex << "w " << w << " scale " << +sc << " code " << +code;
      }
  }
  for (int sc = 0; sc < 256; ++sc)
    for (const uint32_t w : {0u, 0xFFFFFFFFu, 0x88888888u, 0x77777777u, 0x76543210u, 0xFEDCBA98u, 0x19A2B3C4u}) {
      uint32_t lo = 0, hi = 0, blo = 0, bhi = 0, olo = 0, ohi = 0;
      form_khat_entry(static_cast<uint8_t>(sc), &lo, &hi);
      form_khat_bytes(w, lo, hi, &blo, &bhi);
      const uint32_t flip = (sc & 0x80) ? 0x88888888u : 0u;
      form_khat_bytes(w ^ flip, lo & 0x7F7F7F7Fu, hi & 0x7F7F7F7Fu, &olo, &ohi);
      EXPECT_EQ(blo, olo) << std::hex << "scale " << sc << " w " << w;
      EXPECT_EQ(bhi, ohi) << std::hex << "scale " << sc << " w " << w;
    }
}

TEST(ScoreForm, Nvfp4ExactExpansionPutsEachDimensionWhereFormDimSays) {
  for (uint32_t w : {0u, 0xFFFFFFFFu, 0x76543210u, 0xFEDCBA98u, 0x89ABCDEFu, 0x01234567u}) {
    std::mt19937 rng(w);
    for (int it = 0; it < 2000; ++it, w = rng()) {
      uint32_t h[4];
      form_expand_e2m1(w, h, [](uint32_t x) { return x; });
      for (int p = 0; p < 4; ++p)
        for (int jj = 0; jj < 2; ++jj) {
          const int d = dim_of(0, 0, p, jj);
          const uint8_t code = static_cast<uint8_t>((w >> (4 * d)) & 0xFu);
          const float got = half_value(half_of(h[p], jj));
          ASSERT_EQ(got, e2m1_decode(code)) << "w " << std::hex << w << " pair " << p << " half " << jj;
          ASSERT_EQ(std::signbit(got), (code & 8u) != 0);
        }
    }
  }
}

TEST(ScoreForm, Fp8ExpansionPutsEachDimensionWhereFormDimSays) {
  std::mt19937 rng(11);
  for (int it = 0; it < 20000; ++it) {
    const uint32_t x = rng();  // dims 4s .. 4s + 3 of k-step s
    uint32_t h[2];
    form_expand_fp8(x, &h[0], &h[1]);
    for (int pair = 0; pair < 2; ++pair)
      for (int jj = 0; jj < 2; ++jj) {
        const int d = form_dim(0, 0, pair, jj);
        const uint8_t byte = static_cast<uint8_t>((x >> (8 * d)) & 0xFFu);
        if ((byte & 0x7Fu) == 0x7Fu) continue;  // E4M3 NaN: never stored
        ASSERT_EQ(half_value(half_of(h[pair], jj)), e4m3_decode(byte))
            << std::hex << "x " << x << " pair " << pair << " half " << jj;
        ASSERT_EQ(std::signbit(half_value(half_of(h[pair], jj))), (byte & 0x80u) != 0);
      }
  }
}

// NVFP4 rows staged to FP8 by the library (nvfp4_key_to_fp8, the prefill gather) and scored as
// FP8 give the fp16 bits the NVFP4 expansion gives for the same rows: one form, the same products.
TEST(ScoreForm, Fp8StagingAndNvfp4ExpandToTheSameBits) {
  std::mt19937 rng(13);
  for (int it = 0; it < 2000; ++it) {
    uint8_t data[kNvfp4DataBytesPerKey], scales[kNvfp4ScalesPerKey], staged[kHeadDim];
    for (auto& b : data) b = static_cast<uint8_t>(rng());
    for (auto& b : scales) b = static_cast<uint8_t>(rng() % 0x7f);
    if (it == 0) data[0] = 0x88;  // -0 codes
    nvfp4_key_to_fp8(data, scales, staged);
    for (int j = 0; j < kHeadDim / 8; ++j) {  // word j: dims 8j .. 8j + 7, scale of group j / 2
      uint32_t w = 0, x[2] = {0u, 0u};
      for (int i = 0; i < 4; ++i) w |= static_cast<uint32_t>(data[4 * j + i]) << (8 * i);
      for (int i = 0; i < 8; ++i) x[i >> 2] |= static_cast<uint32_t>(staged[8 * j + i]) << (8 * (i & 3));
      uint32_t lo = 0, hi = 0, hn[4], hf[4];
      form_khat_entry(scales[j / 2], &lo, &hi);
      form_expand_e4m3(w, lo, hi, hn);
      form_expand_fp8(x[0], &hf[0], &hf[1]);  // k-step 2j
      form_expand_fp8(x[1], &hf[2], &hf[3]);  // k-step 2j + 1
      for (int p = 0; p < 4; ++p) ASSERT_EQ(hn[p], hf[p]) << std::hex << "w " << w << " scale " << +scales[j / 2] << " pair " << p;
    }
  }
}

// The fp8_mma form: the k-slots of the m16n8k32 steps cover every dimension once and name the
// same dimensions as the fp16 form (k-step s8 = the fp16 form's k-steps 2 s8, 2 s8 + 1), so both
// precision modes read the same bytes of a thread's rows and queries.
TEST(ScoreForm, Fp8MmaKSlotsAreTheFp16FormsDimensions) {
  std::set<int> dims;
  for (int t4 = 0; t4 < 4; ++t4)
    for (int s8 = 0; s8 < 4; ++s8)
      for (int half = 0; half < 2; ++half)
        for (int i = 0; i < 4; ++i) {
          const int d = form8_dim(s8, t4, half, i);
          EXPECT_TRUE(dims.insert(d).second) << "dim " << d << " twice";
          EXPECT_EQ(d, form_dim(2 * s8 + half, t4, i >> 1, i & 1));
        }
  EXPECT_EQ(dims.size(), 128u);
}

// The signed E4M3 bytes the fp8_mma form multiplies: byte c of lo (codes 0..3) / hi (4..7) is the
// reference's k_hat of code c as an E4M3 byte, sign (and -0) included, for positive and negative
// scale bytes; the fp16 form's pairs are their conversions.
TEST(ScoreForm, KhatBytesAreTheReferenceE4m3OfEachCode) {
  std::mt19937 rng(19);
  for (int it = 0; it < 20000; ++it) {
    const uint32_t w = rng();
    const bool neg = it & 1;
    const uint8_t sc = static_cast<uint8_t>((neg ? 0x80u : 0u) | (rng() % 0x7f));
    uint32_t lo = 0, hi = 0, blo = 0, bhi = 0, h[4];
    form_khat_entry(sc, &lo, &hi);
    form_khat_bytes(w, lo, hi, &blo, &bhi);
    form_expand_e4m3(w, lo, hi, h);
    for (int c = 0; c < 8; ++c) {
      const uint8_t code = static_cast<uint8_t>((w >> (4 * c)) & 0xFu);
      const uint8_t byte = static_cast<uint8_t>(((c < 4 ? blo : bhi) >> (8 * (c & 3))) & 0xFFu);
      const float want = nvfp4_khat(code, sc, KRounding::kE4m3);
      ASSERT_EQ(e4m3_decode(byte), want) << std::hex << "w " << w << " scale " << +sc << " code " << c;
      ASSERT_EQ((byte & 0x80u) != 0, std::signbit(want)) << "sign of code " << +code;
    }
    EXPECT_EQ(h[0], form_cvt_lo(blo));
    EXPECT_EQ(h[1], form_cvt_hi(blo));
    EXPECT_EQ(h[2], form_cvt_lo(bhi));
    EXPECT_EQ(h[3], form_cvt_hi(bhi));
  }
}

}  // namespace
