// The dot-product form of the CUDA backend's scorers (issue "Decode scorer at the memory floor"
// owns it): which dimension of a key and of a query meets which k slot of the fp16 MMA, and the
// integer code that turns stored key bytes into fp16 MMA fragments in that order. Plain C++ with
// no CUDA header, so that the CPU suite checks every expansion against formats.hpp
// (tests/test_score_form.cpp); tiles.cuh, gemm8.cuh and score.cu are its only users on the device.
//
// The MMA is mma.sync.m16n8k16 (or wgmma m64nNk16 with A from registers): in k-step s (0..7) the
// thread of quad lane t4 holds two fp16 pairs of each of its rows, the "first" pair at k = 2 t4,
// 2 t4 + 1 (A regs a0a1, B reg b0) and the "second" at k = 2 t4 + 8, + 9 (a4a5, b1). A thread owns
// 32 consecutive dimensions of its rows (32 t4 .. 32 t4 + 31): k-step s takes dims 32 t4 + 4s ..
// 32 t4 + 4s + 3, the first pair (d, d + 1) and the second (d + 2, d + 3). One 32-bit word of 8
// NVFP4 codes (word j: dims 8j .. 8j + 7 of the thread's 32), or two words of 4 FP8 bytes, feeds
// k-steps 2j and 2j + 1. form_dim is the map; the query fragments are built from it and the key
// expansions below produce it. The fp16 operands hold the values themselves (E4M3 is a subset of
// fp16), so the scores need no rescaling.
//
// Why (d, d + 1): cvt.rn.f16x2.e4m3x2 (one F2FP instruction) turns two adjacent E4M3 bytes into
// an fp16 pair. NVFP4: a mask, 2 table prmt (the E4M3 magnitudes of 4 codes each, the scale's
// sign in their top bits), 2 prmt that replicate the codes' signs (the top bits of the bytes of w
// and w << 4), 2 merges (XOR: the product's sign) and 4
// conversions: 11 integer-pipe and 2 FMA-pipe instructions per 8 codes (the pairs (d, d + 2) of
// the form before took 11 and 6: a prmt, a shift and a mask per pair); FP8 keys: 2 conversions per
// 4 bytes (before: 4 integer-pipe and 2 FMA-pipe). bench/NOTES.md, v14, has the measurements.

#pragma once

#include <cstdint>

#include "indexcp/formats.hpp"

namespace indexcp::cuda::detail {

/// Dimension (0..127) of the key and of the query at k-step s (0..7), quad lane t4 (0..3), pair
/// (0: first, k = 2 t4 + jj; 1: second, k = 2 t4 + 8 + jj) and half jj (0, 1) of the fp16 pair.
INDEXCP_HD constexpr int form_dim(int s, int t4, int pair, int jj) { return 32 * t4 + 4 * s + 2 * pair + jj; }

// The fp8_mma form (indexer_score_precision "fp8_mma"): wgmma m64nNk32 with E4M3 operands (A from
// registers, per warp the layout of mma.sync.m16n8k32, which the compute_90 PTX issues). In
// k-step s8 (0..3) the thread of quad lane t4 holds 4 bytes of each of its rows at k = 4 t4 + i
// (A regs a0, a1; B reg b0) and 4 at k = 16 + 4 t4 + i (a2, a3; b1). The dimensions are those of
// the fp16 form: k-step s8 takes the fp16 form's k-steps 2 s8 (first word) and 2 s8 + 1 (second),
// so a thread again owns dims 32 t4 .. 32 t4 + 31 and the stored bytes (FP8) or the table bytes
// (NVFP4) feed the MMA with no conversion: word j of 8 NVFP4 codes is k-step j (lo, hi), FP8
// words 2 s8 and 2 s8 + 1 are k-step s8. One chain of 4 MMAs per 16-row tile in every scorer.
/// Dimension of byte i (0..3) of word `half` (0, 1) at k-step s8 (0..3), quad lane t4.
INDEXCP_HD constexpr int form8_dim(int s8, int t4, int half, int i) { return 32 * t4 + 8 * s8 + 4 * half + i; }

/// PTX prmt.b32 in its default mode: byte i of the result is byte (sel >> 4i) & 7 of the 8 bytes
/// {a, b} (a = bytes 0..3); with bit 3 of that nibble set, the byte's sign bit replicated (0x00 or
/// 0xFF). The device issues the instruction; the host computes the same.
INDEXCP_HD uint32_t form_prmt(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
#else
  const uint64_t src = static_cast<uint64_t>(b) << 32 | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t nib = (sel >> (4 * i)) & 0xFu;
    uint32_t byte = static_cast<uint32_t>(src >> (8 * (nib & 7u))) & 0xFFu;
    if (nib & 8u) byte = (byte & 0x80u) ? 0xFFu : 0x00u;
    r |= byte << (8 * i);
  }
  return r;
#endif
}
/// The high 32 bits of a * b: with b = 2^(32 - n) a right shift by n on the FMA pipe.
INDEXCP_HD uint32_t form_mulhi(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

/// fp16 bits of an E4M3 value (every finite E4M3 value is an fp16 normal or zero: exact); NaN
/// bytes give an fp16 NaN.
INDEXCP_HD uint32_t form_e4m3_to_f16_bits(uint8_t b) {
  const float v = e4m3_decode(b);
  const uint32_t u = fmt::f32_bits(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  if ((u & 0x7fffffffu) == 0u) return (u >> 16) & 0x8000u;
  const int e = static_cast<int>((u >> 23) & 0xffu) - 127;
  return ((u >> 16) & 0x8000u) | static_cast<uint32_t>(e + 15) << 10 | ((u >> 13) & 0x3ffu);
}
/// cvt.rn.f16x2.e4m3x2 of bytes 0, 1 (lo) or 2, 3 (hi) of x: the fp16 pair (low half: the lower
/// byte). One F2FP instruction on the device (the integer pipe).
INDEXCP_HD uint32_t form_cvt_lo(uint32_t x) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("{.reg .b16 l, h;\nmov.b32 {l, h}, %1;\ncvt.rn.f16x2.e4m3x2 %0, l;}" : "=r"(r) : "r"(x));
  return r;
#else
  return form_e4m3_to_f16_bits(static_cast<uint8_t>(x)) | form_e4m3_to_f16_bits(static_cast<uint8_t>(x >> 8)) << 16;
#endif
}
INDEXCP_HD uint32_t form_cvt_hi(uint32_t x) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("{.reg .b16 l, h;\nmov.b32 {l, h}, %1;\ncvt.rn.f16x2.e4m3x2 %0, h;}" : "=r"(r) : "r"(x));
  return r;
#else
  return form_cvt_lo(x >> 16);
#endif
}

/// The k_hat table entry of one scale byte (NVFP4, E4M3 rounding; spec/formats.md section 5):
/// byte c of {lo, hi} = e4m3_encode(e2m1(c) * e4m3(scale & 0x7f)) for the 8 magnitudes c, with the
/// scale's sign in bit 7 of every byte (0x80 where the scale byte is negative, which the quantizer
/// never writes but another writer may). form_khat_bytes XORs each code's sign into it, so a code's
/// byte has the sign of code x scale (-0 included) and no scorer needs a negative-scale path.
INDEXCP_HD void form_khat_entry(uint8_t scale, uint32_t* lo, uint32_t* hi) {
  const float sc = e4m3_decode(static_cast<uint8_t>(scale & 0x7fu));
  const uint32_t sign = (scale & 0x80u) ? 0x80808080u : 0u;
  uint32_t v[2] = {0u, 0u};
  for (int c = 0; c < 8; ++c)
    v[c >> 2] |= static_cast<uint32_t>(e4m3_encode(e2m1_decode(static_cast<uint8_t>(c)) * sc)) << (8 * (c & 3));
  *lo = v[0] | sign;
  *hi = v[1] | sign;
}

// The NVFP4 expansions: word w of 8 codes (code c = bits 4c .. 4c + 3, its sign at bit 4c + 3) ->
// h[p], p = 2e + pair: the fp16 pair `pair` of k-step 2j + e (j = the word), i.e. codes
// (4e + 2 pair, 4e + 2 pair + 1).

/// The signed E4M3 bytes of k_hat of word w: *lo = codes 0..3 (byte c = code c), *hi = codes 4..7;
/// magnitude (and the scale's sign) from the scale's table entry, XOR the code's sign (one LOP3
/// per 4 codes). The fp8_mma form multiplies these bytes directly; the fp16 form converts them.
INDEXCP_HD void form_khat_bytes(uint32_t w, uint32_t lut_lo, uint32_t lut_hi, uint32_t* lo, uint32_t* hi) {
  const uint32_t m = w & 0x77777777u;
  const uint32_t plo = form_prmt(lut_lo, lut_hi, m);                         // [M0 M1 M2 M3]
  const uint32_t phi = form_prmt(lut_lo, lut_hi, form_mulhi(m, 1u << 16));  // [M4 M5 M6 M7]
  const uint32_t w4 = w << 4;
  *lo = plo ^ (form_prmt(w4, w, 0xD9C8u) & 0x80808080u);  // signs of codes 0..3 replicated
  *hi = phi ^ (form_prmt(w4, w, 0xFBEAu) & 0x80808080u);  // codes 4..7
}

/// NVFP4 with E4M3 rounding: the fp16 bits of k_hat: form_khat_bytes' E4M3 bytes of the 8 codes in
/// code order, two at a time through the conversion instruction.
INDEXCP_HD void form_expand_e4m3(uint32_t w, uint32_t lut_lo, uint32_t lut_hi, uint32_t (&h)[4]) {
  uint32_t lo, hi;
  form_khat_bytes(w, lut_lo, lut_hi, &lo, &hi);
  h[0] = form_cvt_lo(lo);  // (c0, c1)
  h[1] = form_cvt_hi(lo);  // (c2, c3)
  h[2] = form_cvt_lo(hi);  // (c4, c5)
  h[3] = form_cvt_hi(hi);  // (c6, c7)
}

/// NVFP4, exact rounding (the SM107 semantics): h[p] = fin(the fp16 bits of +-|e2m1|); the device's
/// fin multiplies by the scale in fp16 (exact), the host's test passes the bits through.
template <class Fin>
INDEXCP_HD void form_expand_e2m1(uint32_t w, uint32_t (&h)[4], Fin&& fin) {
  constexpr uint32_t E0 = 0x3E3C3800u, E1 = 0x46444240u;  // fp16 high bytes of |e2m1| 0..7
  const uint32_t m = w & 0x77777777u;
  const uint32_t plo = form_prmt(E0, E1, m), phi = form_prmt(E0, E1, m >> 16);
  const uint32_t w4 = w << 4;
  // magnitudes into the high byte of each half (low byte: sign replicate of a byte < 0x80 = 0)
  const uint32_t x0 = form_prmt(plo, 0u, 0x1808u), x1 = form_prmt(plo, 0u, 0x3828u);  // [_, E0, _, E1], [_, E2, _, E3]
  const uint32_t x2 = form_prmt(phi, 0u, 0x1808u), x3 = form_prmt(phi, 0u, 0x3828u);
  const uint32_t s0 = form_prmt(w4, w, 0xC888u) & 0x80008000u;  // [_, s0, _, s1]
  const uint32_t s1 = form_prmt(w4, w, 0xD898u) & 0x80008000u;  // [_, s2, _, s3]
  const uint32_t s2 = form_prmt(w4, w, 0xE8A8u) & 0x80008000u;  // [_, s4, _, s5]
  const uint32_t s3 = form_prmt(w4, w, 0xF8B8u) & 0x80008000u;  // [_, s6, _, s7]
  h[0] = fin(x0 | s0);
  h[1] = fin(x1 | s1);
  h[2] = fin(x2 | s2);
  h[3] = fin(x3 | s3);
}

/// FP8 keys (an FP8 cache, or NVFP4 rows staged to E4M3): one word x of 4 E4M3 bytes (dims
/// 4s .. 4s + 3 of k-step s) -> the fp16 bits of its first pair (bytes 0, 1) and second pair
/// (2, 3): the bits form_expand_e4m3 gives for the same k_hat bytes.
INDEXCP_HD void form_expand_fp8(uint32_t x, uint32_t* first, uint32_t* second) {
  *first = form_cvt_lo(x);
  *second = form_cvt_hi(x);
}

}  // namespace indexcp::cuda::detail
