// FP8 staging of shard pages (the prefill gather's rows, spec/indexer.md section 5.2) and the -Inf
// fills of score buffers: small kernels of their own, apart from the scorer.
#include <algorithm>
#include <cmath>
#include <string>

#include "common.cuh"
#include "kernels.cuh"
#include "rows.cuh"

namespace indexcp::cuda::detail {

namespace {

__global__ void fill_kernel(float* p, int64_t n, float v) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = v;
}

// prefill_scores' -Inf where no scorer writes (rows.cuh, fill_unscored), the warps sharing the rows
// and the requests, before a scorer that does not write it itself
__global__ void fill_unscored_kernel(const RowsView rows, int32_t nh, int64_t max_blocks, const int32_t* block_table,
                                     int32_t max_pages, int32_t page_size, int64_t num_pages, float* out) {
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  fill_unscored(rows, nh, max_blocks, block_table, max_pages, page_size, num_pages, out, w, warps);
}

__global__ void stage_fp8_kernel(const uint8_t* layer_base, PageLayout L, int64_t cache_pages,
                                 const int32_t* pages, uint8_t* out) {
  const int64_t i = blockIdx.x;
  const int32_t page = pages[i];
  const int32_t R = L.rows();
  uint8_t* o = out + i * R * kHeadDim;
  if (page < 0 || page >= cache_pages) return;  // validated by the caller
  const uint8_t* p = layer_base + L.page_offset(page);
  if (L.dtype == KvDtype::kFp8) {
    const uint4* src = reinterpret_cast<const uint4*>(p);
    uint4* dst = reinterpret_cast<uint4*>(o);
    for (int e = threadIdx.x; e < R * kHeadDim / 16; e += blockDim.x) dst[e] = src[e];
    return;
  }
  // NVFP4: one item = (row, group of 16 dims) -> 16 E4M3 bytes
  for (int e = threadIdx.x; e < R * kNvfp4ScalesPerKey; e += blockDim.x) {
    const int32_t row = e / kNvfp4ScalesPerKey, gi = e % kNvfp4ScalesPerKey;
    const uint8_t sf = p[L.row_scale_offset(row) + gi];
    const uint2 codes = *reinterpret_cast<const uint2*>(p + L.row_data_offset(row) + gi * 8);
    const float sv = e4m3_decode(sf);
    uint32_t outw[4];
#pragma unroll
    for (int wi = 0; wi < 4; ++wi) {
      const uint32_t cw = wi < 2 ? codes.x : codes.y;
      uint32_t r = 0;
#pragma unroll
      for (int bi = 0; bi < 4; ++bi) {
        const int nib = (wi & 1) * 4 + bi;  // code index within the 32-bit word
        const uint8_t code = static_cast<uint8_t>((cw >> (4 * nib)) & 0xfu);
        r |= static_cast<uint32_t>(e4m3_encode(e2m1_decode(code) * sv)) << (8 * bi);
      }
      outw[wi] = r;
    }
    *reinterpret_cast<uint4*>(o + static_cast<int64_t>(row) * kHeadDim + gi * 16) =
        make_uint4(outw[0], outw[1], outw[2], outw[3]);
  }
}
}  // namespace

void launch_fill_neg_inf(float* p, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const int64_t blocks = std::min<int64_t>(ceil_div(n, 256), 4096);
  fill_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p, n, -INFINITY);
  INDEXCP_CUDA_LAUNCH_CHECK("fill kernel launch");
}

void launch_fill_unscored(const RowsView& rows, int32_t nh, int64_t max_blocks, const int32_t* block_table,
                          int32_t max_pages, int32_t page_size, int64_t num_pages, float* out, cudaStream_t stream) {
  if (rows.rows <= 0 || nh <= 0 || max_blocks <= 0) return;
  // a warp per row and per request: 8 warps per CTA, at most 16 CTAs per multiprocessor's worth
  const int64_t blocks = std::min<int64_t>(ceil_div(std::max<int64_t>(rows.rows, rows.num_requests), 8),
                                           static_cast<int64_t>(sm_count()) * 16);
  fill_unscored_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(rows, nh, max_blocks, block_table, max_pages,
                                                                         page_size, num_pages, out);
  INDEXCP_CUDA_LAUNCH_CHECK("fill_unscored kernel launch");
}

void launch_stage_fp8(const uint8_t* layer_base, const PageLayout& layout, int64_t cache_pages,
                      const int32_t* pages, int64_t num_pages, uint8_t* out, cudaStream_t stream) {
  if (num_pages <= 0) return;
  INDEXCP_REQUIRE(num_pages < (int64_t{1} << 31), "num_pages = " + std::to_string(num_pages) + " exceeds one launch (2^31 - 1)");
  stage_fp8_kernel<<<static_cast<unsigned>(num_pages), 128, 0, stream>>>(layer_base, layout, cache_pages, pages, out);
  INDEXCP_CUDA_LAUNCH_CHECK("stage_fp8 kernel launch");
}

}  // namespace indexcp::cuda::detail
