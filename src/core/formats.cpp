// Whole-key codecs and enum names (spec/formats.md sections 3-5).
#include "indexcp/formats.hpp"

#include "indexcp/error.hpp"

namespace indexcp {

std::string to_string(KvDtype d) {
  switch (d) {
    case KvDtype::kBf16: return "bf16";
    case KvDtype::kFp8: return "fp8";
    case KvDtype::kNvfp4: return "nvfp4";
  }
  return "?";
}

std::string to_string(KRounding r) { return r == KRounding::kE4m3 ? "e4m3" : "exact"; }

void check_kv_dtype(KvDtype d, const std::string& what) {
  const int v = static_cast<int>(d);
  INDEXCP_REQUIRE(v >= 0 && v <= 2, what + " = " + std::to_string(v) + " is not a KvDtype (kBf16, kFp8 or kNvfp4)");
}

void check_k_rounding(KRounding r, const std::string& what) {
  const int v = static_cast<int>(r);
  INDEXCP_REQUIRE(v == 0 || v == 1, what + " = " + std::to_string(v) + " is not a KRounding (kE4m3 or kExact)");
}

std::string to_string(ScorePrecision p) { return p == ScorePrecision::kFp32 ? "fp32" : "fp8_mma"; }

void check_score_precision(ScorePrecision p, const std::string& what) {
  const int v = static_cast<int>(p);
  INDEXCP_REQUIRE(v == 0 || v == 1, what + " = " + std::to_string(v) + " is not a ScorePrecision (kFp32 or kFp8Mma)");
}

ScorePrecision parse_score_precision(const std::string& s, const std::string& what) {
  if (s == "fp32") return ScorePrecision::kFp32;
  if (s == "fp8_mma") return ScorePrecision::kFp8Mma;
  throw Error(ErrorCode::kInvalidArgument,
              what + " = \"" + s + "\" is not supported; use \"fp32\" or \"fp8_mma\"");
}

KvDtype parse_kv_dtype(const std::string& s, const std::string& what) {
  if (s == "bf16") return KvDtype::kBf16;
  if (s == "fp8") return KvDtype::kFp8;
  if (s == "nvfp4") return KvDtype::kNvfp4;
  throw Error(ErrorCode::kInvalidArgument,
              what + " = \"" + s + "\" is not supported; use \"bf16\", \"fp8\" or \"nvfp4\"");
}

KRounding parse_k_rounding(const std::string& s, const std::string& what) {
  if (s == "e4m3") return KRounding::kE4m3;
  if (s == "exact") return KRounding::kExact;
  throw Error(ErrorCode::kInvalidArgument,
              what + " = \"" + s + "\" is not supported; use \"e4m3\" or \"exact\"");
}

static void check_encode_scale(float S) {
  if (!(fmt::is_finite(S) && S > 0.0f))
    throw Error(ErrorCode::kInvalidArgument,
                "encode_scale = " + std::to_string(S) +
                    " is invalid: the NVFP4 encode scale S must be finite and > 0");
}

void nvfp4_quantize_key(const float* x, float encode_scale, uint8_t* data, uint8_t* scales) {
  check_encode_scale(encode_scale);
  for (int g = 0; g < kNvfp4ScalesPerKey; ++g)
    scales[g] = nvfp4_quantize_group(x + g * kNvfp4Group, encode_scale, data + g * (kNvfp4Group / 2));
}

void nvfp4_dequantize_key(const uint8_t* data, const uint8_t* scales, KRounding mode, float* out) {
  for (int d = 0; d < kHeadDim; ++d) {
    const uint8_t byte = data[d / 2];
    const uint8_t code = (d & 1) ? static_cast<uint8_t>(byte >> 4) : static_cast<uint8_t>(byte & 0xf);
    out[d] = nvfp4_khat(code, scales[d / kNvfp4Group], mode);
  }
}

void nvfp4_key_to_fp8(const uint8_t* data, const uint8_t* scales, uint8_t* out) {
  for (int d = 0; d < kHeadDim; ++d) {
    const uint8_t byte = data[d / 2];
    const uint8_t code = (d & 1) ? static_cast<uint8_t>(byte >> 4) : static_cast<uint8_t>(byte & 0xf);
    out[d] = e4m3_encode(e2m1_decode(code) * e4m3_decode(scales[d / kNvfp4Group]));
  }
}

void fp8_quantize_key(const float* x, uint8_t* out) {
  for (int d = 0; d < kHeadDim; ++d) out[d] = e4m3_encode(x[d]);
}

void bf16_quantize_key(const float* x, uint16_t* out) {
  for (int d = 0; d < kHeadDim; ++d) out[d] = bf16_encode(x[d]);
}

}  // namespace indexcp
