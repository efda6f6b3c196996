// Insert (quantize + write) and index-Q cast of the CUDA backend (spec/indexer.md section 6,
// spec/formats.md sections 2-5). The quantizers are formats.hpp's own __host__ __device__
// functions, so the bytes are the CPU reference's; the optional RMSNorm and RoPE are written as
// the spec orders them (separately rounded fp32 operations; this file is compiled with
// -fmad=false; cos/sin come from the host, computed in double exactly as the CPU does).
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cstdint>

#include "common.cuh"
#include "kernels.cuh"

namespace indexcp::cuda::detail {

namespace {

constexpr int kWarpsPerBlock = 4;
constexpr unsigned long long kNoError = ~0ull;

__device__ __forceinline__ float load_key(const InsertLaunch& l, int64_t t, int d) {
  if (l.keys_f32) return l.keys_f32[t * kHeadDim + d];
  return bf16_decode(l.keys_bf16[t * kHeadDim + d]);
}

// RMSNorm (+ RoPE) of the warp's vector y[128] in shared memory, as indexer.md section 6.
__device__ void preprocess_warp(float* y, const float* norm_weight, float eps, const float* cs) {
  const int lane = threadIdx.x & 31;
  if (norm_weight != nullptr) {
    float r = 0.0f;
    if (lane == 0) {
      float ss = 0.0f;
      for (int d = 0; d < kHeadDim; ++d) ss = ss + y[d] * y[d];
      const float ms = ss / 128.0f;
      r = 1.0f / sqrtf(ms + eps);
    }
    r = __shfl_sync(0xffffffffu, r, 0);
    __syncwarp();
    for (int d = lane; d < kHeadDim; d += 32) {
      const float xr = y[d] * r;
      y[d] = xr * (1.0f + norm_weight[d]);
    }
    __syncwarp();
  }
  if (cs != nullptr) {
    const int i = lane;  // pairs (i, i + 32), i < 32
    const float c = cs[i], s = cs[32 + i];
    const float a = y[i], b = y[i + 32];
    const float ac = a * c, bs = b * s, bc = b * c, as = a * s;
    __syncwarp();
    y[i] = ac - bs;
    y[i + 32] = bc + as;
    __syncwarp();
  }
}

__global__ void __launch_bounds__(kWarpsPerBlock * 32) insert_prep_kernel(const InsertLaunch l) {
  __shared__ float ybuf[kWarpsPerBlock][kHeadDim];
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
  float* y = ybuf[wib];
  const int kb = key_bytes(l.layout.dtype);
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + wib; t < l.n;
       t += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    __syncwarp();  // the previous token's lanes are done with y
    const int64_t s = l.slots[t];
    if (s == -1) continue;
    if (s < -1 || s >= l.num_slots) {
      if (lane == 0) atomicMin(l.err, (static_cast<unsigned long long>(t) << 3) | 1ull);
      continue;
    }
    bool bad = false;
    for (int d = lane; d < kHeadDim; d += 32) {
      const float v = load_key(l, t, d);
      y[d] = v;
      bad |= !fmt::is_finite(v);
    }
    if (__any_sync(0xffffffffu, bad)) {
      if (lane == 0) atomicMin(l.err, (static_cast<unsigned long long>(t) << 3) | 3ull);
      continue;
    }
    __syncwarp();
    if (l.norm_weight != nullptr || l.rope_cs != nullptr) {
      preprocess_warp(y, l.norm_weight, l.eps, l.rope_cs ? l.rope_cs + t * 64 : nullptr);
      bad = false;
      for (int d = lane; d < kHeadDim; d += 32) bad |= !fmt::is_finite(y[d]);
      if (__any_sync(0xffffffffu, bad)) {
        if (lane == 0) atomicMin(l.err, (static_cast<unsigned long long>(t) << 3) | 4ull);
        continue;
      }
    }
    uint8_t* row = l.staged + t * kb;
    switch (l.layout.dtype) {
      case KvDtype::kNvfp4:
        if (lane < kNvfp4ScalesPerKey) {
          uint8_t packed[8];
          const uint8_t sf = nvfp4_quantize_group(y + kNvfp4Group * lane, l.encode_scale, packed);
          for (int j = 0; j < 8; ++j) row[lane * 8 + j] = packed[j];
          row[kNvfp4DataBytesPerKey + lane] = sf;
        }
        break;
      case KvDtype::kFp8:
        for (int d = lane; d < kHeadDim; d += 32) row[d] = e4m3_encode(y[d]);
        break;
      case KvDtype::kBf16:
        for (int d = lane; d < kHeadDim; d += 32) {
          const uint16_t b = bf16_encode(y[d]);
          row[2 * d] = static_cast<uint8_t>(b & 0xff);
          row[2 * d + 1] = static_cast<uint8_t>(b >> 8);
        }
        break;
    }
    __syncwarp();
  }
}

__global__ void iota_kernel(const int64_t* slots, int64_t n, int64_t* keys, int64_t* vals) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    keys[i] = slots[i];
    vals[i] = i;
  }
}

__global__ void dup_kernel(const int64_t* keys, const int64_t* vals, int64_t n, int64_t num_slots,
                           unsigned long long* err) {
  for (int64_t i = 1 + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t s = keys[i];
    if (s >= 0 && s < num_slots && keys[i - 1] == s)
      atomicMin(err, (static_cast<unsigned long long>(vals[i]) << 3) | 2ull);
  }
}

__global__ void insert_write_kernel(const InsertLaunch l) {
  if (*l.err != kNoError) return;  // a refused batch writes nothing
  const PageLayout L = l.layout;
  const int kb = key_bytes(L.dtype);
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < l.n;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t s = l.slots[t];
    if (s < 0) continue;
    const SlotLocation loc = locate_slot(L, s);
    if (loc.rank != l.rank) continue;  // another rank owns this row
    uint8_t* page = l.layer_base + L.page_offset(loc.page);
    const uint8_t* src = l.staged + t * kb;
    if (L.dtype == KvDtype::kNvfp4) {
      uint8_t* d = page + L.row_data_offset(loc.row);
      for (int j = 0; j < kNvfp4DataBytesPerKey; j += 8)
        *reinterpret_cast<uint2*>(d + j) = *reinterpret_cast<const uint2*>(src + j);
      *reinterpret_cast<uint2*>(page + L.row_scale_offset(loc.row)) =
          *reinterpret_cast<const uint2*>(src + kNvfp4DataBytesPerKey);
    } else {
      uint8_t* d = page + L.row_data_offset(loc.row);
      for (int j = 0; j < kb; j += 8) *reinterpret_cast<uint2*>(d + j) = *reinterpret_cast<const uint2*>(src + j);
    }
  }
}

__global__ void e4m3_nan_kernel(const uint8_t* q, int64_t n, unsigned long long* first) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    if (e4m3_is_nan(q[i])) atomicMin(first, static_cast<unsigned long long>(i));
}

__global__ void qcast_check_kernel(const QCastLaunch l) {
  const int64_t total = l.vectors * kHeadDim;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    if (fmt::is_nan(l.q[i])) atomicMin(l.err, static_cast<unsigned long long>(i));
}

__global__ void __launch_bounds__(kWarpsPerBlock * 32) qcast_kernel(const QCastLaunch l) {
  if (*l.err != kNoError) return;
  __shared__ float ybuf[kWarpsPerBlock][kHeadDim];
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
  float* y = ybuf[wib];
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + wib; v < l.vectors;
       v += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    for (int d = lane; d < kHeadDim; d += 32) y[d] = l.q[v * kHeadDim + d];
    __syncwarp();
    if (l.norm_weight != nullptr || l.rope_cs != nullptr)
      preprocess_warp(y, l.norm_weight, l.eps, l.rope_cs ? l.rope_cs + (v / l.heads) * 64 : nullptr);
    for (int d = lane; d < kHeadDim; d += 32) l.out[v * kHeadDim + d] = e4m3_encode(y[d]);
    __syncwarp();
  }
}

unsigned grid_for(int64_t items, int per_block) {
  const int64_t b = ceil_div(items, per_block);
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(b, 65535)));
}

}  // namespace

size_t insert_sort_temp_bytes(int64_t n) {
  size_t bytes = 0;
  check(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const int64_t*>(nullptr),
                                        static_cast<int64_t*>(nullptr), static_cast<const int64_t*>(nullptr),
                                        static_cast<int64_t*>(nullptr), n),
        "cub::DeviceRadixSort::SortPairs (size query)");
  return bytes;
}

void launch_insert(const InsertLaunch& l, cudaStream_t stream) {
  if (l.n <= 0) return;
  insert_prep_kernel<<<grid_for(l.n, kWarpsPerBlock), kWarpsPerBlock * 32, 0, stream>>>(l);
  INDEXCP_CUDA_LAUNCH_CHECK("insert prep kernel launch");
  if (l.n > 1) {
    int64_t* k_in = l.sort_keys;
    int64_t* v_in = l.sort_keys + l.n;
    int64_t* k_out = l.sort_keys + 2 * l.n;
    int64_t* v_out = l.sort_keys + 3 * l.n;
    iota_kernel<<<grid_for(l.n, 256), 256, 0, stream>>>(l.slots, l.n, k_in, v_in);
    INDEXCP_CUDA_LAUNCH_CHECK("insert iota kernel launch");
    size_t tb = l.sort_temp_bytes;
    check(cub::DeviceRadixSort::SortPairs(l.sort_temp, tb, k_in, k_out, v_in, v_out, l.n, 0, 64, stream),
          "cub::DeviceRadixSort::SortPairs (duplicate slots)");
    dup_kernel<<<grid_for(l.n, 256), 256, 0, stream>>>(k_out, v_out, l.n, l.num_slots, l.err);
    INDEXCP_CUDA_LAUNCH_CHECK("insert duplicate kernel launch");
  }
  insert_write_kernel<<<grid_for(l.n, 256), 256, 0, stream>>>(l);
  INDEXCP_CUDA_LAUNCH_CHECK("insert write kernel launch");
}

void launch_e4m3_nan_check(const uint8_t* q, int64_t n, unsigned long long* first, cudaStream_t stream) {
  if (n <= 0) return;
  e4m3_nan_kernel<<<grid_for(n, 256), 256, 0, stream>>>(q, n, first);
  INDEXCP_CUDA_LAUNCH_CHECK("E4M3 NaN check kernel launch");
}

void launch_qcast(const QCastLaunch& l, cudaStream_t stream) {
  if (l.vectors <= 0) return;
  qcast_check_kernel<<<grid_for(l.vectors * kHeadDim, 256), 256, 0, stream>>>(l);
  INDEXCP_CUDA_LAUNCH_CHECK("q cast check kernel launch");
  qcast_kernel<<<grid_for(l.vectors, kWarpsPerBlock), kWarpsPerBlock * 32, 0, stream>>>(l);
  INDEXCP_CUDA_LAUNCH_CHECK("q cast kernel launch");
}

}  // namespace indexcp::cuda::detail
