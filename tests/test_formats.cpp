// Formats: the acceptance vectors (tests/data/vectors/nvfp4_blocks.json, the contract's copy), byte for byte, plus
// the consequences spec/formats.md section 3 lists (cases C01, C02, C11).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <iterator>
#include <string>

#include "indexcp/cache.hpp"
#include "indexcp/error.hpp"
#include "indexcp/formats.hpp"

using namespace indexcp;
using nlohmann::json;

namespace {

std::string shared_dir() {
  if (const char* e = std::getenv("INDEXCP_SHARED_DIR")) return e;
  return INDEXCP_SHARED_DIR;
}

json load_vectors() {
  const std::string path = shared_dir() + "/vectors/nvfp4_blocks.json";
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot open " + path + " (set INDEXCP_SHARED_DIR)");
  return json::parse(f);
}

uint32_t hex(const std::string& s) { return static_cast<uint32_t>(std::stoul(s, nullptr, 16)); }
float f(const std::string& bits) { return fmt::bits_f32(hex(bits)); }

}  // namespace

// The repository's copy of the acceptance vectors (tests/data/vectors/) is the contract's
// (shared/vectors/), byte for byte, wherever the contract's folder is beside the checkout.
TEST(Vectors, MatchesTheContractsCopy) {
  const std::string contract = std::string(INDEXCP_CONTRACT_DIR) + "/vectors/nvfp4_blocks.json";
  std::ifstream c(contract, std::ios::binary);
  if (!c) GTEST_SKIP() << "no " << contract << " beside this checkout: nothing to compare";
  const std::string mine_path = shared_dir() + "/vectors/nvfp4_blocks.json";
  std::ifstream m(mine_path, std::ios::binary);
  ASSERT_TRUE(m) << "cannot open " << mine_path;
  const std::string a((std::istreambuf_iterator<char>(c)), std::istreambuf_iterator<char>());
  const std::string b((std::istreambuf_iterator<char>(m)), std::istreambuf_iterator<char>());
  EXPECT_EQ(a, b) << mine_path << " differs from " << contract;
}

TEST(Vectors, E2M1) {
  const json v = load_vectors();
  ASSERT_GE(v["e2m1"].size(), 20u);
  for (const auto& e : v["e2m1"]) {
    const float x = f(e["x_bits"]);
    EXPECT_EQ(e2m1_encode(x), hex(e["code"])) << "x_bits " << e["x_bits"];
  }
}

TEST(Vectors, E4M3) {
  const json v = load_vectors();
  ASSERT_GE(v["e4m3"].size(), 20u);
  for (const auto& e : v["e4m3"]) {
    const float x = f(e["x_bits"]);
    EXPECT_EQ(e4m3_encode(x), hex(e["code"])) << "x_bits " << e["x_bits"];
  }
}

TEST(Vectors, Nvfp4Blocks) {
  const json v = load_vectors();
  ASSERT_GE(v["nvfp4_blocks"].size(), 10u);
  for (const auto& blk : v["nvfp4_blocks"]) {
    float x[16];
    for (int i = 0; i < 16; ++i) x[i] = f(blk["x_bits"][i]);
    const float S = f(blk["S_bits"]);
    uint8_t packed[8];
    const uint8_t sf = nvfp4_quantize_group(x, S, packed);
    EXPECT_EQ(sf, hex(blk["scale"])) << blk["name"];
    char buf[17];
    for (int j = 0; j < 8; ++j) std::snprintf(buf + 2 * j, 3, "%02X", packed[j]);
    EXPECT_EQ(std::string(buf), blk["packed"].get<std::string>()) << blk["name"];
    // the same group inside a whole key, through the public key quantizer
    float key[128] = {};
    for (int i = 0; i < 16; ++i) key[32 + i] = x[i];
    uint8_t data[64], scales[8];
    nvfp4_quantize_key(key, S, data, scales);
    EXPECT_EQ(scales[2], sf) << blk["name"];
    for (int j = 0; j < 8; ++j) EXPECT_EQ(data[16 + j], packed[j]) << blk["name"];
  }
}

TEST(E4m3, DecodeRoundTripsEveryFiniteCode) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t b = static_cast<uint8_t>(c);
    if (e4m3_is_nan(b)) {
      EXPECT_TRUE(std::isnan(e4m3_decode(b)));
      continue;
    }
    const float v = e4m3_decode(b);
    const uint8_t back = e4m3_encode(v);
    if (v == 0.0f) EXPECT_EQ(back & 0x7f, 0);
    else EXPECT_EQ(back, b) << "code " << c;
  }
  EXPECT_EQ(e4m3_decode(0x7E), 448.0f);
  EXPECT_EQ(e4m3_decode(0x01), std::ldexp(1.0f, -9));
}

TEST(E2m1, DecodeTable) {
  const float t[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int c = 0; c < 16; ++c) {
    const float v = e2m1_decode(static_cast<uint8_t>(c));
    EXPECT_EQ(std::fabs(v), t[c & 7]);
    EXPECT_EQ(std::signbit(v), (c & 8) != 0);
    EXPECT_EQ(e2m1_encode(v), c);
  }
}

// C02: no double rounding through bf16 / fp16.
TEST(Cases, C02_Fp8DoubleRounding) {
  EXPECT_EQ(e4m3_encode(std::nextafter(1.0625f, 2.0f)), 0x39);
  EXPECT_EQ(e4m3_encode(fmt::bits_f32(0x43c8198c)), 0x7D);  // 400.199585 -> 416
  // through bf16 first it would be 1.0 and 384: make sure the direct path differs from that
  EXPECT_NE(e4m3_encode(bf16_decode(bf16_encode(std::nextafter(1.0625f, 2.0f)))), 0x39);
  // FP8 key writer and index-Q cast use the same conversion
  float k[128];
  for (int d = 0; d < 128; ++d) k[d] = d % 2 ? fmt::bits_f32(0x43c8198c) : std::nextafter(1.0625f, 2.0f);
  const auto row = quantize_key_bytes(KvDtype::kFp8, k);
  for (int d = 0; d < 128; ++d) EXPECT_EQ(row[d], d % 2 ? 0x7D : 0x39);
  uint8_t q[128];
  quantize_queries(k, 1, 1, {}, q);
  for (int d = 0; d < 128; ++d) EXPECT_EQ(q[d], d % 2 ? 0x7D : 0x39);
}

// C01: zero keys and a zero group among normal groups, with S = 1 and S = 268.8.
TEST(Cases, C01_ZeroKeys) {
  for (float S : {1.0f, 268.8f}) {
    float pz[128], nz[128], mixed[128];
    for (int d = 0; d < 128; ++d) {
      pz[d] = 0.0f;
      nz[d] = -0.0f;
      mixed[d] = (d / 16 == 3) ? 0.0f : 0.37f * static_cast<float>((d % 7) - 3);
    }
    uint8_t data[64], sc[8];
    nvfp4_quantize_key(pz, S, data, sc);
    for (int g = 0; g < 8; ++g) EXPECT_EQ(sc[g], 0);
    for (int j = 0; j < 64; ++j) EXPECT_EQ(data[j], 0x00);
    nvfp4_quantize_key(nz, S, data, sc);
    for (int g = 0; g < 8; ++g) EXPECT_EQ(sc[g], 0);
    for (int j = 0; j < 64; ++j) EXPECT_EQ(data[j], 0x88);
    float deq[128];
    nvfp4_dequantize_key(data, sc, KRounding::kExact, deq);
    for (int d = 0; d < 128; ++d) EXPECT_EQ(deq[d], 0.0f);
    nvfp4_quantize_key(mixed, S, data, sc);
    EXPECT_EQ(sc[3], 0);
    for (int j = 24; j < 32; ++j) EXPECT_EQ(data[j], 0x00);
    // the other groups are those of the group quantized on its own
    for (int g = 0; g < 8; ++g) {
      if (g == 3) continue;
      uint8_t p[8];
      EXPECT_EQ(nvfp4_quantize_group(mixed + 16 * g, S, p), sc[g]);
      for (int j = 0; j < 8; ++j) EXPECT_EQ(p[j], data[8 * g + j]);
      EXPECT_NE(sc[g], 0);
    }
    for (KRounding m : {KRounding::kE4m3, KRounding::kExact}) {
      nvfp4_dequantize_key(data, sc, m, deq);
      for (int d = 0; d < 128; ++d) {
        EXPECT_FALSE(std::isnan(deq[d]));
        if (d / 16 == 3) EXPECT_EQ(deq[d], 0.0f);
      }
    }
  }
}

// C11: bad encode scales are refused with an error naming the scale.
TEST(Cases, C11_BadEncodeScaleQuantizer) {
  float x[128] = {1.0f};
  uint8_t data[64], sc[8];
  for (float S : {0.0f, -1.0f, NAN, INFINITY}) {
    try {
      nvfp4_quantize_key(x, S, data, sc);
      FAIL() << "accepted S = " << S;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("encode_scale"), std::string::npos) << e.what();
    }
  }
}

TEST(Nvfp4, ScaleNeverNaNAndKhatModes) {
  std::srand(7);
  for (int it = 0; it < 2000; ++it) {
    float x[16];
    const float mag = std::ldexp(1.0f, (std::rand() % 40) - 20);
    for (float& v : x) v = mag * (static_cast<float>(std::rand()) / RAND_MAX - 0.5f);
    uint8_t p[8];
    const uint8_t sf = nvfp4_quantize_group(x, 1.0f, p);
    EXPECT_FALSE(e4m3_is_nan(sf));
    for (int j = 0; j < 16; ++j) {
      const uint8_t code = (j & 1) ? p[j / 2] >> 4 : p[j / 2] & 0xf;
      const float exact = nvfp4_khat(code, sf, KRounding::kExact);
      EXPECT_EQ(exact, e2m1_decode(code) * e4m3_decode(sf));
      EXPECT_EQ(nvfp4_khat(code, sf, KRounding::kE4m3), e4m3_decode(e4m3_encode(exact)));
    }
  }
}

TEST(Bf16, RoundToNearestEven) {
  EXPECT_EQ(bf16_encode(1.0f), 0x3f80);
  EXPECT_EQ(bf16_encode(fmt::bits_f32(0x3f808000)), 0x3f80);  // tie -> even
  EXPECT_EQ(bf16_encode(fmt::bits_f32(0x3f818000)), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(bf16_encode(fmt::bits_f32(0x3f808001)), 0x3f81);
  EXPECT_EQ(bf16_decode(0xc000), -2.0f);
}
