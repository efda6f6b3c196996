// The PTX the scorer issues, wrapped: shared-memory addresses, mbarriers, bulk copies
// (cp.async.bulk), mma.sync.m16n8k16 and the wgmma (sm_90a) fence / commit / wait, descriptor and
// tile instructions. Private to score.cu (src/cuda/score.cu has the overview).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

namespace indexcp::cuda::detail {

// Internal linkage on purpose: this header is part of score.cu's one translation unit.
namespace {

// ---- PTX wrappers ---------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// The fp8_mma form (form.hpp) in the compute_90 PTX only (no wgmma there): mma.sync.m16n8k32 on
// E4M3 bytes, C = the fp32 accumulator. On sm_90 ptxas lowers it to E4M3 -> fp16 conversions and
// HMMA.16816, so the sm_90a code uses wgmma8_tile (the FP8 tensor cores) instead.
__device__ __forceinline__ void mma16832_e4m3(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t h2_bits(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ __half2 bits_h2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

// wgmma exists in the sm_90a code only (the compute_90 PTX of the build, JIT-compiled for newer
// GPUs, keeps mma.sync). It serves NT = 2 to 16 (16 to 128 query vectors per CTA; NVFP4 stock
// pages from NT = 4: INDEXCP_SCORE_WGMMA_MIN_NT_STOCK below): one instruction per k-step instead of
// NT HMMA (and, for NT = 4, 2 shared loads of B fragments), at the price of keeping the 4 warps of
// a warpgroup in step. Same-session A/B (bench/NOTES.md, v8): NT = 4 -6%, NT = 2 -1%, NT = 1 +6%
// (so NT = 1 keeps mma.sync); v32 measured NT = 2 again on NVFP4 stock pages. -DINDEXCP_SCORE_WGMMA=0
// builds without it.
#ifndef INDEXCP_SCORE_WGMMA
#define INDEXCP_SCORE_WGMMA 1
#endif
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && INDEXCP_SCORE_WGMMA
#define INDEXCP_HAVE_WGMMA 1
#else
#define INDEXCP_HAVE_WGMMA 0
#endif
#ifndef INDEXCP_SCORE_WGMMA_NT1
#define INDEXCP_SCORE_WGMMA_NT1 0
#endif
#ifndef INDEXCP_SCORE_WGMMA_MIN_NT
#define INDEXCP_SCORE_WGMMA_MIN_NT 2
#endif
// The same for the fp32 form's tiles of NVFP4 stock pages (the replicated decode among them): NT = 2
// by mma.sync, whose arithmetic took 4% less time than wgmma's on an H100, and the exact rounding's
// decode 4-5% (bench/NOTES.md v32). Neither this nor INDEXCP_SCORE_WGMMA_MIN_NT applies to fp8_mma.
#ifndef INDEXCP_SCORE_WGMMA_MIN_NT_STOCK
#define INDEXCP_SCORE_WGMMA_MIN_NT_STOCK 4
#endif
// The shared-memory matrix descriptor of B (PTX ISA, "Matrix Descriptor Format"): start address,
// LBO and SBO in units of 16 bytes (bits 0-13, 16-29, 32-45), base offset 0, no swizzle. The
// fixed fields travel in the launch arguments: as a compile-time constant ptxas rebuilt the 8
// descriptors of a tile between its wgmma instructions, 4.5% slower (bench/NOTES.md, v8); from a
// kernel argument they stay in uniform registers across the loop.
constexpr uint64_t wg_desc_fixed_bits() { return (uint64_t{128 >> 4} << 16) | (uint64_t{256 >> 4} << 32); }
__device__ __forceinline__ uint64_t wg_desc(const void* smem_b, uint64_t fixed_bits) {
  return ((smem_u32(smem_b) & 0x3FFFFu) >> 4) | fixed_bits;
}
__device__ __forceinline__ void wg_fence() {
#if INDEXCP_HAVE_WGMMA
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_commit() {
#if INDEXCP_HAVE_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
// all but the N most recent wgmma groups of the warp have completed (wg_wait0: all of them)
template <int N>
__device__ __forceinline__ void wg_wait() {
#if INDEXCP_HAVE_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}
__device__ __forceinline__ void wg_wait0() { wg_wait<0>(); }
// The accumulator operands of the m64n64 and m64n128 instructions (NT = 8, 16; both forms): D32 /
// D64 bind d[nt][i] to %0 .. %31 / %0 .. %63 in order, and R32 / R64 are those register lists.
#define INDEXCP_WG_D4(d, k) "+f"(d[k][0]), "+f"(d[k][1]), "+f"(d[k][2]), "+f"(d[k][3])
#define INDEXCP_WG_D32(d)                                                                                      \
  INDEXCP_WG_D4(d, 0), INDEXCP_WG_D4(d, 1), INDEXCP_WG_D4(d, 2), INDEXCP_WG_D4(d, 3), INDEXCP_WG_D4(d, 4),  \
      INDEXCP_WG_D4(d, 5), INDEXCP_WG_D4(d, 6), INDEXCP_WG_D4(d, 7)
#define INDEXCP_WG_D64(d)                                                                                        \
  INDEXCP_WG_D32(d), INDEXCP_WG_D4(d, 8), INDEXCP_WG_D4(d, 9), INDEXCP_WG_D4(d, 10), INDEXCP_WG_D4(d, 11),     \
      INDEXCP_WG_D4(d, 12), INDEXCP_WG_D4(d, 13), INDEXCP_WG_D4(d, 14), INDEXCP_WG_D4(d, 15)
#define INDEXCP_WG_R32 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define INDEXCP_WG_R64 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
// D (+)= A x B for m64nNk16, N = NT * 8 (16, 32, 64 or 128; 8 with -DINDEXCP_SCORE_WGMMA_NT1=1), fp32 accumulation; d holds the mma.m16n8 C layout per
// n-tile (d[nt][0..3]); scale_d = 0 ignores the old d.
template <int NT>
__device__ __forceinline__ void wgmma_tile(float (&d)[NT][4], const uint32_t* a, uint64_t desc, int scale_d) {
#if INDEXCP_HAVE_WGMMA
  if constexpr (NT == 1) {  // only with -DINDEXCP_SCORE_WGMMA_NT1=1 (kWgmmaTiles)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
  } else if constexpr (NT == 2) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, "
        "1, 1, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
  } else if constexpr (NT == 4) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,"
        "%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
  } else if constexpr (NT == 8) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " INDEXCP_WG_R32 ", {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
                 : INDEXCP_WG_D32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
  } else if constexpr (NT == 16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " INDEXCP_WG_R64 ", {%64,%65,%66,%67}, %68, p, 1, 1, 0;\n}\n"
                 : INDEXCP_WG_D64(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
  }
#endif
}
// The fp8_mma form's D (+)= A x B for m64nNk32 with E4M3 A (registers: the mma.m16n8k32 A layout
// per warp) and E4M3 B (shared memory, the wg_b_index layout in bytes: the fp16 form's core
// matrices hold 16 E4M3 k values per row instead of 8 fp16), N = NT * 8, fp32 accumulators.
// These are the FP8 tensor cores; mma.sync.m16n8k32.e4m3 is not: on sm_90 ptxas lowers it to
// E4M3 -> fp16 conversions and two HMMA.16816 (bench/NOTES.md, fp8_mma).
template <int NT>
__device__ __forceinline__ void wgmma8_tile(float (&d)[NT][4], const uint32_t* a, uint64_t desc, int scale_d) {
#if INDEXCP_HAVE_WGMMA
  if constexpr (NT == 1) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
  } else if constexpr (NT == 2) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, "
        "1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
  } else if constexpr (NT == 4) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,"
        "%15}, {%16,%17,%18,%19}, %20, p, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
  } else if constexpr (NT == 8) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " INDEXCP_WG_R32 ", {%32,%33,%34,%35}, %36, p, 1, 1;\n}\n"
                 : INDEXCP_WG_D32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
  } else if constexpr (NT == 16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " INDEXCP_WG_R64 ", {%64,%65,%66,%67}, %68, p, 1, 1;\n}\n"
                 : INDEXCP_WG_D64(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
  }
#endif
}
// The GEMM-shaped scorer's fp32 form (gemm8.cuh, F16): D (+)= A x B for m64n128k16 with both
// operands fp16 in shared memory (A = 64 query vectors, B = 128 keys, both K-major in the 128-byte
// swizzle: sw128_desc), fp32 accumulators in the layout of wgmma_tile<16>.
__device__ __forceinline__ void wgmma16_ss(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b, int scale_d) {
#if INDEXCP_HAVE_WGMMA
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " INDEXCP_WG_R64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
               : INDEXCP_WG_D64(d)
               : "l"(desc_a), "l"(desc_b), "r"(scale_d));
#endif
}
template <int NT>
__device__ __forceinline__ void fence_acc(float (&d)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(d[nt][i])::"memory");
}


}  // namespace
}  // namespace indexcp::cuda::detail
