// The prefill gather's per-chunk unit lists, built on the device (spec/indexer.md section 5), so
// that a PrefillPlan's run reads no per-token value on the host.
#include <algorithm>

#include "common.cuh"
#include "kernels.cuh"

namespace indexcp::cuda::detail {

namespace {

constexpr int kUnitThreads = 256;

// One CTA: the pages of each request's historical blocks, then an exclusive scan over requests.
__global__ void __launch_bounds__(kUnitThreads) gather_units_kernel(const int32_t* seq_lens, const int32_t* query_start,
                                                                    int32_t num_requests, int32_t page_size,
                                                                    int64_t max_units, int32_t* unit_first,
                                                                    uint32_t* status) {
  __shared__ int64_t carry;
  __shared__ int64_t part[kUnitThreads];
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int32_t b0 = 0; b0 < num_requests; b0 += kUnitThreads) {
    const int32_t b = b0 + static_cast<int32_t>(threadIdx.x);
    int64_t n = 0;
    if (b < num_requests) {
      const int32_t t = query_start[b + 1] - query_start[b], s = seq_lens[b];
      if (t > 0 && s > 0) {
        const int64_t max_local = (static_cast<int64_t>(s) - 1) / kBlockTokens;
        n = (max_local * kBlockTokens + page_size - 1) / page_size;
      }
    }
    part[threadIdx.x] = n;
    __syncthreads();
    // inclusive scan of the tile (Hillis-Steele; requests per chunk are few)
    for (int off = 1; off < kUnitThreads; off <<= 1) {
      const int64_t v = threadIdx.x >= static_cast<unsigned>(off) ? part[threadIdx.x - off] : 0;
      __syncthreads();
      part[threadIdx.x] += v;
      __syncthreads();
    }
    if (b < num_requests) unit_first[b] = static_cast<int32_t>(carry + part[threadIdx.x] - n);
    __syncthreads();
    if (threadIdx.x == kUnitThreads - 1) carry += part[threadIdx.x];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    unit_first[num_requests] = static_cast<int32_t>(carry);
    if (status != nullptr) *status = carry > max_units ? static_cast<uint32_t>(StepStatus::kGatherUnitsExceeded) : 0u;
  }
}

__global__ void gather_chunk_kernel(const int32_t* block_table, int32_t max_pages, const int32_t* unit_first,
                                    int64_t c0, int64_t n, int32_t* phys, int32_t* bt_local) {
  const int32_t b = static_cast<int32_t>(blockIdx.x);
  const int64_t first = unit_first[b], count = unit_first[b + 1] - first;
  for (int32_t i = threadIdx.x; i < max_pages; i += blockDim.x) {
    const int64_t u = first + i;
    const int64_t e = static_cast<int64_t>(b) * max_pages + i;
    const bool in = i < count && u >= c0 && u < c0 + n;
    bt_local[e] = in ? static_cast<int32_t>(u - c0) : -1;
    if (in) phys[u - c0] = block_table[e];
  }
}

__global__ void poison_if_kernel(const uint32_t* status, int32_t* out, int64_t n) {
  if (*status == 0u) return;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = -1;
}

}  // namespace

void launch_gather_units(const int32_t* seq_lens, const int32_t* query_start, int32_t num_requests, int32_t page_size,
                         int64_t max_units, int32_t* unit_first, uint32_t* status, cudaStream_t stream) {
  gather_units_kernel<<<1, kUnitThreads, 0, stream>>>(seq_lens, query_start, num_requests, page_size, max_units,
                                                      unit_first, status);
  INDEXCP_CUDA_LAUNCH_CHECK("gather units kernel launch");
}

void launch_gather_chunk(const int32_t* block_table, int32_t num_requests, int32_t max_pages, const int32_t* unit_first,
                         int64_t c0, int64_t n, int32_t* phys, int32_t* bt_local, cudaStream_t stream) {
  if (num_requests <= 0) return;
  gather_chunk_kernel<<<static_cast<unsigned>(num_requests), 128, 0, stream>>>(block_table, max_pages, unit_first, c0, n,
                                                                               phys, bt_local);
  INDEXCP_CUDA_LAUNCH_CHECK("gather chunk kernel launch");
}

void launch_poison_if(const uint32_t* status, int32_t* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(n, 256), 1024));
  poison_if_kernel<<<blocks, 256, 0, stream>>>(status, out, n);
  INDEXCP_CUDA_LAUNCH_CHECK("poison kernel launch");
}

}  // namespace indexcp::cuda::detail
