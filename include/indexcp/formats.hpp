// indexcp: index-key formats (spec/formats.md sections 1-5; spec/indexer.md section 2).
//
// The scalar codecs are inline and __host__ __device__, so the CPU reference and the CUDA kernels
// execute the very same operations: this header is the single owner of every bit-exact rule.
// Everything here is plain IEEE fp32 arithmetic with round-to-nearest-even; it must be compiled
// without fast-math, FTZ or approximate reciprocals (the build sets the flags).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__CUDACC__)
#define INDEXCP_HD __host__ __device__ __forceinline__
#else
#define INDEXCP_HD inline
#endif

namespace indexcp {

/// Head dimension of index keys and index queries (fixed by the formats).
inline constexpr int kHeadDim = 128;
/// NVFP4 group size: one E4M3 scale byte per 16 E2M1 codes (formats.md section 3).
inline constexpr int kNvfp4Group = 16;
/// Scale bytes per NVFP4 key (128 / 16).
inline constexpr int kNvfp4ScalesPerKey = kHeadDim / kNvfp4Group;
/// Packed E2M1 bytes per NVFP4 key (two codes per byte).
inline constexpr int kNvfp4DataBytesPerKey = kHeadDim / 2;
/// Selection block size in tokens (indexer.md section 1): block of position pos is pos / 128.
inline constexpr int kBlockTokens = 128;

/// Index-cache element format (config key `indexer_kv_dtype`).
enum class KvDtype : int { kBf16 = 0, kFp8 = 1, kNvfp4 = 2 };

/// NVFP4 K-rounding mode used at decode (config key `indexer_k_rounding`, indexer.md section 2).
enum class KRounding : int {
  kE4m3 = 0,   ///< k_hat = e4m3_rne_satfinite(e2m1(code) * e4m3(scale)) (default)
  kExact = 1,  ///< k_hat = e2m1(code) * e4m3(scale)
};

/// Accumulation of the indexer's dot products (config key `indexer_score_precision`, indexer.md
/// section 3). The CPU backend computes exact scores in both; docs/precision.md has the fp8_mma
/// mode's measured error and selection figures.
enum class ScorePrecision : int {
  kFp32 = 0,    ///< fp32-class accumulation (the default): scores within fp32 tolerance of fp64
  kFp8Mma = 1,  ///< opt-in: E4M3 keys times E4M3 queries on FP8 tensor cores, whose accumulation
                ///< on Hopper is narrower than fp32 (needs E4M3 keys: fp8, or nvfp4 with e4m3)
};

/// "bf16" | "fp8" | "nvfp4".
std::string to_string(KvDtype d);
/// "fp32" | "fp8_mma".
std::string to_string(ScorePrecision p);
/// Throws Error (kInvalidArgument) naming `what` unless `p` is one of the enumerators.
void check_score_precision(ScorePrecision p, const std::string& what);
/// Parses "fp32" | "fp8_mma"; throws Error naming `what` otherwise.
ScorePrecision parse_score_precision(const std::string& s, const std::string& what = "indexer_score_precision");
/// "e4m3" | "exact".
std::string to_string(KRounding r);
/// Throws Error (kInvalidArgument) naming `what` unless `d` is one of the enumerators (a value
/// cast from an integer may be none of them).
void check_kv_dtype(KvDtype d, const std::string& what);
/// The same for KRounding.
void check_k_rounding(KRounding r, const std::string& what);
/// Parses "bf16" | "fp8" | "nvfp4"; throws Error naming `what` otherwise.
KvDtype parse_kv_dtype(const std::string& s, const std::string& what = "indexer_kv_dtype");
/// Parses "e4m3" | "exact"; throws Error naming `what` otherwise.
KRounding parse_k_rounding(const std::string& s, const std::string& what = "indexer_k_rounding");

/// Bytes one token's key takes in a row of a page of this dtype: NVFP4 72 (64 data + 8 scales),
/// FP8 128, BF16 256 (formats.md sections 3, 4, 6).
constexpr int key_bytes(KvDtype d) {
  return d == KvDtype::kNvfp4 ? kNvfp4DataBytesPerKey + kNvfp4ScalesPerKey
         : d == KvDtype::kFp8 ? kHeadDim
                              : 2 * kHeadDim;
}

namespace fmt {

INDEXCP_HD uint32_t f32_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
INDEXCP_HD float bits_f32(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
INDEXCP_HD bool is_nan(float x) { return (f32_bits(x) & 0x7fffffffu) > 0x7f800000u; }
INDEXCP_HD bool is_finite(float x) { return (f32_bits(x) & 0x7f800000u) != 0x7f800000u; }

}  // namespace fmt

// ---------------------------------------------------------------------------------------------
// E2M1 (formats.md section 1)

/// Decodes a 4-bit E2M1 code (low nibble of `code`) to fp32. Exact.
INDEXCP_HD float e2m1_decode(uint8_t code) {
  // magnitude table of codes 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6 (= m * 2^(e-1) with implicit bit)
  const uint32_t c = code & 0x7u;
  const float mag = c == 0 ? 0.0f
                    : c == 1 ? 0.5f
                    : c == 2 ? 1.0f
                    : c == 3 ? 1.5f
                    : c == 4 ? 2.0f
                    : c == 5 ? 3.0f
                    : c == 6 ? 4.0f
                             : 6.0f;
  return (code & 0x8u) ? -mag : mag;
}

/// fp32 -> E2M1 code: round to nearest, ties to the even code, saturating at 6; the sign is kept
/// (-0.0 -> 0x8), +-Inf -> 0x7/0xF, NaN of either sign -> 0x7 (formats.md section 1).
INDEXCP_HD uint8_t e2m1_encode(float x) {
  if (fmt::is_nan(x)) return 0x7;
  const uint32_t sign = (fmt::f32_bits(x) >> 31) ? 0x8u : 0x0u;
  const float a = fmt::bits_f32(fmt::f32_bits(x) & 0x7fffffffu);
  uint32_t c;
  if (a <= 0.25f) c = 0;
  else if (a < 0.75f) c = 1;
  else if (a <= 1.25f) c = 2;
  else if (a < 1.75f) c = 3;
  else if (a <= 2.5f) c = 4;
  else if (a < 3.5f) c = 5;
  else if (a <= 5.0f) c = 6;
  else c = 7;
  return static_cast<uint8_t>(sign | c);
}

// ---------------------------------------------------------------------------------------------
// E4M3, finite "fn" variant (formats.md section 2)

/// Decodes an E4M3 byte to fp32. Exact. 0x7F / 0xFF decode to NaN.
INDEXCP_HD float e4m3_decode(uint8_t b) {
  const uint32_t s = b >> 7, e = (b >> 3) & 0xfu, m = b & 0x7u;
  if (e == 0xfu && m == 0x7u) return fmt::bits_f32(0x7fc00000u | (s << 31));
  float v;
  if (e == 0) {
    v = static_cast<float>(m) * 0.001953125f;  // m * 2^-9, exact
  } else {
    // (8 + m) * 2^(e - 10): build the fp32 directly (exponent e - 7 + 127, mantissa m << 20)
    v = fmt::bits_f32(((e + 120u) << 23) | (m << 20));
  }
  return s ? -v : v;
}

/// True for the two E4M3 NaN bytes (0x7F, 0xFF).
INDEXCP_HD bool e4m3_is_nan(uint8_t b) { return (b & 0x7fu) == 0x7fu; }

/// fp32 -> E4M3, round to nearest even, saturating to +-448 (CUDA __NV_SATFINITE), directly from
/// fp32: |x| > 464 and +-Inf -> +-448, exactly 464 -> 448, |x| <= 2^-10 -> signed zero,
/// NaN -> 0x7F (formats.md section 2).
INDEXCP_HD uint8_t e4m3_encode(float x) {
  const uint32_t u = fmt::f32_bits(x);
  if (fmt::is_nan(x)) return 0x7f;
  const uint8_t sign = static_cast<uint8_t>((u >> 31) << 7);
  const uint32_t au = u & 0x7fffffffu;
  if (au > 0x43e80000u) return static_cast<uint8_t>(sign | 0x7e);  // > 464 (and Inf)
  const float a = fmt::bits_f32(au);
  if (a < 0.015625f) {
    // subnormal range of E4M3 (below 2^-6): value = m * 2^-9. a * 512 is exact (power of two);
    // round half to even by hand (no dependence on the FPU rounding mode).
    const float t = a * 512.0f;
    uint32_t m = static_cast<uint32_t>(t);  // floor, t < 8
    const float frac = t - static_cast<float>(m);  // exact
    if (frac > 0.5f || (frac == 0.5f && (m & 1u))) ++m;
    return static_cast<uint8_t>(sign | m);  // m == 8 is 0x08 = 2^-6, the smallest normal
  }
  // normal: round the 23-bit fp32 mantissa to 3 bits, ties to even, in the integer domain
  uint32_t r = au + 0x7ffffu + ((au >> 20) & 1u);
  r &= ~0xfffffu;
  const uint32_t e = (r >> 23) - 120u;  // E4M3 biased exponent: (E - 127) + 7
  const uint32_t m = (r >> 20) & 7u;
  uint32_t code = (e << 3) | m;
  if (code > 0x7eu) code = 0x7eu;  // 464 rounds to 448 (even); above was handled
  return static_cast<uint8_t>(sign | code);
}

// ---------------------------------------------------------------------------------------------
// BF16 (formats.md section 4)

/// fp32 -> bfloat16 bits, round to nearest even; NaN stays a (quiet) NaN.
INDEXCP_HD uint16_t bf16_encode(float x) {
  const uint32_t u = fmt::f32_bits(x);
  if (fmt::is_nan(x)) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/// bfloat16 bits -> fp32. Exact.
INDEXCP_HD float bf16_decode(uint16_t b) { return fmt::bits_f32(static_cast<uint32_t>(b) << 16); }

// ---------------------------------------------------------------------------------------------
// NVFP4 (formats.md section 3)

/// Quantizes one group of 16 fp32 values with encode scale S (> 0, finite; not checked here)
/// by the canonical recipe of formats.md section 3, in exactly its fp32 order.
/// Writes 8 packed bytes (element 2j in the low nibble of byte j) and returns the scale byte.
INDEXCP_HD uint8_t nvfp4_quantize_group(const float* x, float S, uint8_t* packed) {
  const float r6 = 1.0f / 6.0f;
  float amax = 0.0f;
  for (int i = 0; i < kNvfp4Group; ++i) {
    const float a = fmt::bits_f32(fmt::f32_bits(x[i]) & 0x7fffffffu);
    if (a > amax) amax = a;  // NaN compares false: ignored
  }
  const float sfv = S * (amax * r6);
  const uint8_t sf = e4m3_encode(sfv);
  const float sff = e4m3_decode(sf);
  const float osc = (sff == 0.0f) ? 0.0f : 1.0f / (sff * (1.0f / S));
  for (int j = 0; j < kNvfp4Group / 2; ++j) {
    const uint8_t lo = e2m1_encode(x[2 * j] * osc);
    const uint8_t hi = e2m1_encode(x[2 * j + 1] * osc);
    packed[j] = static_cast<uint8_t>(lo | (hi << 4));
  }
  return sf;
}

/// The key value used in a score for one NVFP4 element (indexer.md section 2): code = E2M1 code
/// (low nibble), scale = stored E4M3 scale byte. S is never applied.
INDEXCP_HD float nvfp4_khat(uint8_t code, uint8_t scale, KRounding mode) {
  const float p = e2m1_decode(code) * e4m3_decode(scale);  // exact: <= 6 significant bits
  return mode == KRounding::kE4m3 ? e4m3_decode(e4m3_encode(p)) : p;
}

// ---------------------------------------------------------------------------------------------
// Whole keys (host functions, defined in src/cpu/formats.cpp)

/// Quantizes one key of 128 fp32 values to NVFP4: `data` receives 64 packed bytes, `scales` 8
/// scale bytes (formats.md section 3). Throws Error naming `encode_scale` unless S is finite and
/// > 0. Non-finite elements follow the recipe (the insert path refuses them before this).
void nvfp4_quantize_key(const float* x, float encode_scale, uint8_t* data, uint8_t* scales);

/// Dequantizes one NVFP4 key (64 packed bytes + 8 scales) to 128 k_hat values for `mode`
/// (indexer.md section 2).
void nvfp4_dequantize_key(const uint8_t* data, const uint8_t* scales, KRounding mode, float* out);

/// Dequantizes one NVFP4 key to its E4M3 k_hat bytes (the FP8 staging of the prefill gather,
/// indexer.md section 5): out[d] = e4m3_encode(e2m1(code_d) * e4m3(scale_g)).
void nvfp4_key_to_fp8(const uint8_t* data, const uint8_t* scales, uint8_t* out);

/// Casts 128 fp32 values to E4M3 bytes (FP8 key, index Q; formats.md sections 4-5).
void fp8_quantize_key(const float* x, uint8_t* out);

/// Casts 128 fp32 values to little-endian bfloat16 (formats.md section 4).
void bf16_quantize_key(const float* x, uint16_t* out);

}  // namespace indexcp
