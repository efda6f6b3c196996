// Microbenchmark of the integer-pipe budget (issue "Decode scorer at the memory floor"): which pipe
// PRMT, LOP3, IMAD and F2FP.F16.E4M3 (cvt.rn.f16x2.e4m3x2) issue on, and at what rate (warp
// instructions per SM per clock at the device's nominal clock). Each thread runs 8 independent
// chains; two kinds interleaved 1:1 that reach twice the rate of either alone issue on two pipes.
//   nvcc -arch=sm_90a -O3 -o pipes bench/cuda/pipes.cu && ./pipes
// bench/NOTES.md (v13) has the H200 figures; record bench/results/pipes-h200-2026-12-02.json.
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
constexpr int kIters = 4096;
__device__ __forceinline__ uint32_t op_prmt(uint32_t x, uint32_t y) { uint32_t r; asm volatile("prmt.b32 %0, %1, %2, 0x3120;" : "=r"(r) : "r"(x), "r"(y)); return r; }
__device__ __forceinline__ uint32_t op_lop3(uint32_t x, uint32_t y) { uint32_t r; asm volatile("lop3.b32 %0, %1, %2, 0x77777777, 0x6a;" : "=r"(r) : "r"(x), "r"(y)); return r; }
__device__ __forceinline__ uint32_t op_imad(uint32_t x, uint32_t y) { uint32_t r; asm volatile("mad.lo.u32 %0, %1, 129, %2;" : "=r"(r) : "r"(x), "r"(y)); return r; }
__device__ __forceinline__ uint32_t op_cvt(uint32_t x, uint32_t) { uint32_t r; asm volatile("{.reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, lo;}" : "=r"(r) : "r"(x)); return r; }
template <int A, int B>  // A: first op kind, B: second op kind (-1 none)
__global__ void k(uint32_t* out, uint32_t seed) {
  uint32_t v[8];
  for (int i = 0; i < 8; ++i) v[i] = seed * (threadIdx.x + 7 * i + 1);
  const uint32_t y = seed ^ blockIdx.x;
  for (int it = 0; it < kIters; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      auto f = [&](int kind, uint32_t x) { return kind == 0 ? op_prmt(x, y) : kind == 1 ? op_lop3(x, y) : kind == 2 ? op_imad(x, y) : op_cvt(x, y); };
      v[i] = f(A, v[i]);
      if (B >= 0) v[i] = f(B, v[i]);
    }
  }
  uint32_t s = 0;
  for (int i = 0; i < 8; ++i) s ^= v[i];
  if (s == 0x12345678u) out[0] = s;
}
template <int A, int B>
void run(const char* name, int sms, uint32_t* d) {
  const int blocks = sms * 4, threads = 512;  // 64 warps per SM
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  k<A, B><<<blocks, threads>>>(d, 3u);
  cudaEventRecord(e0);
  for (int r = 0; r < 5; ++r) k<A, B><<<blocks, threads>>>(d, 3u + r);
  cudaEventRecord(e1); cudaEventSynchronize(e1);
  float ms; cudaEventElapsedTime(&ms, e0, e1);
  int clk; cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);
  const double warp_instr = 5.0 * blocks * (threads / 32) * kIters * 8 * (B >= 0 ? 2 : 1);
  const double cycles = ms * 1e-3 * clk * 1e3;  // at the max clock
  std::printf("%-14s %8.3f ms  %6.2f warp-instr / SM / clk (at %d MHz)\n", name, ms, warp_instr / sms / cycles, clk / 1000);
}
int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  uint32_t* d; cudaMalloc(&d, 4);
  run<0, -1>("prmt", sms, d); run<1, -1>("lop3", sms, d); run<2, -1>("imad", sms, d); run<3, -1>("cvt_e4m3x2", sms, d);
  run<0, 3>("prmt+cvt", sms, d); run<1, 3>("lop3+cvt", sms, d); run<2, 3>("imad+cvt", sms, d);
  run<0, 1>("prmt+lop3", sms, d); run<0, 2>("prmt+imad", sms, d);
  return 0;
}
