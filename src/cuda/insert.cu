// Insert (quantize + write) and index-Q cast of the CUDA backend (spec/indexer.md section 6,
// spec/formats.md sections 2-5). The quantizers are formats.hpp's own __host__ __device__
// functions, so the bytes are the CPU reference's; the optional RMSNorm and RoPE are written as
// the spec orders them (separately rounded fp32 operations; this file is compiled with
// -fmad=false; cos/sin come from the host, computed in double exactly as the CPU does).
#include <cub/block/block_radix_sort.cuh>
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cstdint>

#include "common.cuh"
#include "kernels.cuh"

namespace indexcp::cuda::detail {

namespace {

constexpr int kWarpsPerBlock = 4;

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

// The smallest d < 128 whose y[d] fails `ok`, or 128 (all lanes of the warp get it).
template <class Ok>
__device__ __forceinline__ unsigned first_bad_dim(const float* y, Ok ok) {
  const int lane = threadIdx.x & 31;
  unsigned m = kHeadDim;
  for (int d = lane + 96; d >= 0; d -= 32)
    if (!ok(y[d])) m = static_cast<unsigned>(d);
  return __reduce_min_sync(0xffffffffu, m);
}

__device__ __forceinline__ unsigned long long pack_insert(int64_t t, InsertRefusal r, unsigned dim) {
  return (static_cast<unsigned long long>(t) << 11) | (static_cast<unsigned long long>(r) << 7) | (dim & 127u);
}

// One warp per token: slot range, (duplicates: marked before by dup_kernel), finite key, RoPE
// position, finite after RMSNorm/RoPE; a good token is quantized into the staging buffer.
__global__ void __launch_bounds__(kWarpsPerBlock * 32) insert_prep_kernel(const InsertLaunch l) {
  __shared__ float ybuf[kWarpsPerBlock][kHeadDim];
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
  float* y = ybuf[wib];
  const int kb = key_bytes(l.layout.dtype);
  auto refuse = [&](int64_t t, InsertRefusal r, unsigned dim) {
    if (lane == 0) {
      atomicMin(&l.err[0], pack_insert(t, r, dim));
      atomicAdd(&l.err[1], 1ull);
    }
  };
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + wib; t < l.n;
       t += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    __syncwarp();  // the previous token's lanes are done with y
    const int64_t s = l.slots[t];
    if (s == -1) continue;
    if (s < -1 || s >= l.num_slots) {
      refuse(t, InsertRefusal::kSlotOutOfRange, 0);
      continue;
    }
    if (l.dup != nullptr && l.dup[t]) continue;  // refused (and counted) by dup_kernel
    for (int d = lane; d < kHeadDim; d += 32) y[d] = load_key(l, t, d);
    __syncwarp();
    unsigned bad = first_bad_dim(y, [](float v) { return fmt::is_finite(v); });
    if (bad < kHeadDim) {
      refuse(t, InsertRefusal::kNonFiniteKey, bad);
      continue;
    }
    if (l.norm_weight != nullptr || l.rope_cs != nullptr) {
      const float* cs = nullptr;
      if (l.rope_cs != nullptr) {
        if (l.positions != nullptr) {
          const int64_t pos = l.positions[t];
          if (pos < 0 || pos >= l.table_positions) {
            refuse(t, InsertRefusal::kPositionOutOfTable, 0);
            continue;
          }
          cs = l.rope_cs + pos * 64;
        } else {
          cs = l.rope_cs + t * 64;
        }
      }
      preprocess_warp(y, l.norm_weight, l.eps, cs);
      bad = first_bad_dim(y, [](float v) { return fmt::is_finite(v); });
      if (bad < kHeadDim) {
        refuse(t, InsertRefusal::kNonFiniteAfterPreprocess, bad);
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

// The duplicate check sorts (slot, token) pairs by slot. Keys: an in-range slot, or num_slots
// for a skipped or out-of-range one (sorted last, never a duplicate), so the sort needs only the
// bits of num_slots (sort_bits) instead of 64.
__device__ __forceinline__ int64_t dup_key(int64_t s, int64_t num_slots) {
  return s >= 0 && s < num_slots ? s : num_slots;
}

__device__ __forceinline__ void mark_dup(int64_t token, bool d, uint8_t* dup, unsigned long long* err) {
  dup[token] = d ? 1 : 0;
  if (d) {
    atomicMin(&err[0], pack_insert(token, InsertRefusal::kDuplicateSlot, 0));
    atomicAdd(&err[1], 1ull);
  }
}

// Small batches (n <= kDupBlockMax): the whole duplicate check in one CTA (a stable block radix
// sort in shared memory), which also initializes the call's refusal words.
constexpr int kDupThreads = 256, kDupItems = 8;
constexpr int64_t kDupBlockMax = int64_t{kDupThreads} * kDupItems;

__global__ void __launch_bounds__(kDupThreads) dup_block_kernel(const int64_t* slots, int64_t n, int64_t num_slots,
                                                                int key_bits, uint8_t* dup, unsigned long long* err) {
  using Sort = cub::BlockRadixSort<int64_t, kDupThreads, kDupItems, int32_t>;
  __shared__ typename Sort::TempStorage tmp;
  __shared__ int64_t sorted[kDupBlockMax];
  if (threadIdx.x == 0) {
    err[0] = kNoRefusal;
    err[1] = 0;
  }
  int64_t k[kDupItems];
  int32_t v[kDupItems];
  for (int j = 0; j < kDupItems; ++j) {  // blocked arrangement: item r is token r (stable order)
    const int64_t i = static_cast<int64_t>(threadIdx.x) * kDupItems + j;
    k[j] = i < n ? dup_key(slots[i], num_slots) : num_slots;
    v[j] = i < n ? static_cast<int32_t>(i) : -1;
  }
  Sort(tmp).Sort(k, v, 0, key_bits);  // stable: equal slots keep token order
  for (int j = 0; j < kDupItems; ++j) sorted[threadIdx.x * kDupItems + j] = k[j];
  __syncthreads();  // (also orders the refusal words' initialization before the atomics)
  for (int j = 0; j < kDupItems; ++j) {
    const int r = threadIdx.x * kDupItems + j;
    if (v[j] < 0) continue;
    mark_dup(v[j], r > 0 && k[j] != num_slots && sorted[r - 1] == k[j], dup, err);
  }
}

// Larger batches: keys and token ids for a device-wide radix sort (and the refusal words).
__global__ void iota_kernel(const int64_t* slots, int64_t n, int64_t num_slots, int64_t* keys, int64_t* vals,
                            unsigned long long* err) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    err[0] = kNoRefusal;
    err[1] = 0;
  }
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    keys[i] = dup_key(slots[i], num_slots);
    vals[i] = i;
  }
}

// After the stable sort by slot: every in-range slot equal to its predecessor's is a duplicate of
// an earlier token (the CPU reports each repeat after the first). Marks every token (0 or 1).
__global__ void dup_kernel(const int64_t* keys, const int64_t* vals, int64_t n, int64_t num_slots, uint8_t* dup,
                           unsigned long long* err) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t s = keys[i];
    mark_dup(vals[i], i > 0 && s != num_slots && keys[i - 1] == s, dup, err);
  }
}

// The call's first refusal into the caller's sticky status (cache.hpp, InsertStatus); one thread,
// after validation (the refusal words are final).
__device__ void insert_status_update(const InsertLaunch& l) {
  const unsigned long long e = l.err[0];
  if (e == kNoRefusal) return;
  InsertStatus* st = l.status;
  st->refused_calls += 1;
  st->refused_tokens += static_cast<int64_t>(l.err[1]);
  if (st->reason != 0) return;  // an earlier call's refusal stays
  const int64_t t = static_cast<int64_t>(e >> 11);
  const auto r = static_cast<InsertRefusal>((e >> 7) & 15u);
  const int dim = static_cast<int>(e & 127u);
  st->reason = static_cast<int32_t>(r);
  st->layer = l.layer;
  st->token = t;
  st->value = 0;
  st->limit = 0;
  st->dim = -1;
  st->head = -1;
  st->heads = 0;
  st->key_value = 0.0f;
  switch (r) {
    case InsertRefusal::kSlotOutOfRange:
    case InsertRefusal::kDuplicateSlot:
      st->value = l.slots[t];
      st->limit = l.num_slots;
      break;
    case InsertRefusal::kNonFiniteKey:
      st->dim = dim;
      st->key_value = load_key(l, t, dim);
      break;
    case InsertRefusal::kPositionOutOfTable:
      st->value = l.positions[t];
      st->limit = l.table_positions;
      break;
    case InsertRefusal::kNonFiniteAfterPreprocess:
      st->dim = dim;
      break;
    default:
      break;
  }
}

// The write (only when nothing was refused) and, by its first thread, the status update.
__global__ void insert_write_kernel(const InsertLaunch l) {
  if (blockIdx.x == 0 && threadIdx.x == 0) insert_status_update(l);
  if (l.err[0] != kNoRefusal) return;  // a refused batch writes nothing
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

// One warp per q vector. Pass 0: NaN in q (every vector, before any preprocessing, as the CPU
// checks all of q first); pass 1: the vector's RoPE position and NaN after RMSNorm/RoPE.
__global__ void __launch_bounds__(kWarpsPerBlock * 32) qcast_check_kernel(const QCastLaunch l) {
  __shared__ float ybuf[kWarpsPerBlock][kHeadDim];
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
  float* y = ybuf[wib];
  unsigned long long* err = &l.status->scratch;
  const bool has_pre = l.norm_weight != nullptr || l.rope_cs != nullptr;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + wib; v < l.vectors;
       v += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    __syncwarp();
    for (int d = lane; d < kHeadDim; d += 32) y[d] = l.q[v * kHeadDim + d];
    __syncwarp();
    unsigned bad = first_bad_dim(y, [](float x) { return !fmt::is_nan(x); });
    if (bad < kHeadDim) {
      if (lane == 0) atomicMin(err, (static_cast<unsigned long long>(v) << 9) | bad);
      continue;
    }
    if (!has_pre) continue;
    const float* cs = nullptr;
    if (l.rope_cs != nullptr) {
      const int64_t tok = v / l.heads;
      if (l.positions != nullptr) {
        const int64_t pos = l.positions[tok];
        if (pos < 0 || pos >= l.table_positions) {
          if (lane == 0) atomicMin(err, (1ull << 60) | (static_cast<unsigned long long>(v) << 9));
          continue;
        }
        cs = l.rope_cs + pos * 64;
      } else {
        cs = l.rope_cs + tok * 64;
      }
    }
    preprocess_warp(y, l.norm_weight, l.eps, cs);
    bad = first_bad_dim(y, [](float x) { return !fmt::is_nan(x); });
    if (bad < kHeadDim && lane == 0)
      atomicMin(err, (1ull << 60) | (static_cast<unsigned long long>(v) << 9) | (1ull << 8) | bad);
  }
}

__device__ void qcast_status_update(const QCastLaunch& l);

// The cast (only when nothing was refused) and, by its first thread, the status update.
__global__ void __launch_bounds__(kWarpsPerBlock * 32) qcast_kernel(const QCastLaunch l) {
  if (blockIdx.x == 0 && threadIdx.x == 0) qcast_status_update(l);
  if (l.status->scratch != kNoRefusal) return;
  __shared__ float ybuf[kWarpsPerBlock][kHeadDim];
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
  float* y = ybuf[wib];
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + wib; v < l.vectors;
       v += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    for (int d = lane; d < kHeadDim; d += 32) y[d] = l.q[v * kHeadDim + d];
    __syncwarp();
    if (l.norm_weight != nullptr || l.rope_cs != nullptr) {
      const int64_t tok = v / l.heads;
      const float* cs = l.rope_cs == nullptr ? nullptr
                        : l.positions != nullptr ? l.rope_cs + l.positions[tok] * 64
                                                 : l.rope_cs + tok * 64;
      preprocess_warp(y, l.norm_weight, l.eps, cs);
    }
    for (int d = lane; d < kHeadDim; d += 32) l.out[v * kHeadDim + d] = e4m3_encode(y[d]);
    __syncwarp();
  }
}

__device__ void qcast_status_update(const QCastLaunch& l) {
  InsertStatus* st = l.status;
  const unsigned long long e = st->scratch;
  if (e == kNoRefusal) return;
  st->refused_calls += 1;
  st->refused_tokens += 1;
  if (st->reason != 0) return;
  const bool per_vector = (e >> 60) != 0;
  const int64_t v = static_cast<int64_t>((e & ((1ull << 60) - 1)) >> 9);
  const bool after = ((e >> 8) & 1u) != 0;
  const auto r = !per_vector ? InsertRefusal::kQueryNaN
                 : after     ? InsertRefusal::kQueryNaNAfterPreprocess
                             : InsertRefusal::kPositionOutOfTable;
  st->reason = static_cast<int32_t>(r);
  st->layer = -1;
  st->token = v / l.heads;
  st->head = static_cast<int32_t>(v % l.heads);
  st->heads = l.heads;
  st->dim = r == InsertRefusal::kPositionOutOfTable ? -1 : static_cast<int32_t>(e & 127u);
  st->key_value = 0.0f;
  st->value = r == InsertRefusal::kPositionOutOfTable ? l.positions[v / l.heads] : 0;
  st->limit = r == InsertRefusal::kPositionOutOfTable ? l.table_positions : 0;
}

__global__ void e4m3_nan_kernel(const uint8_t* q, int64_t n, unsigned long long* first) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    if (e4m3_is_nan(q[i])) atomicMin(first, static_cast<unsigned long long>(i));
}

unsigned grid_for(int64_t items, int per_block) {
  const int64_t b = ceil_div(items, per_block);
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(b, 65535)));
}

size_t align256(size_t x) { return (x + 255) & ~size_t{255}; }

int sort_bits(int64_t num_slots) {  // bits of the largest key (num_slots, the sentinel)
  int b = 1;
  while (b < 63 && (int64_t{1} << b) <= num_slots) ++b;
  return b;
}

}  // namespace

InsertWorkspace insert_workspace_layout(int64_t n) {
  InsertWorkspace w;
  if (n <= 0) return w;
  size_t tb = 0;
  if (n > 1)
    check(cub::DeviceRadixSort::SortPairs(nullptr, tb, static_cast<const int64_t*>(nullptr),
                                          static_cast<int64_t*>(nullptr), static_cast<const int64_t*>(nullptr),
                                          static_cast<int64_t*>(nullptr), n),
          "cub::DeviceRadixSort::SortPairs (size query)");
  const size_t un = static_cast<size_t>(n);
  size_t o = 0;
  w.err = o;
  o = align256(o + 2 * sizeof(unsigned long long));
  w.staged = o;
  o = align256(o + un * key_bytes(KvDtype::kBf16));  // the largest row: one layout for every dtype
  w.dup = o;
  o = align256(o + un);
  w.sort_keys = o;
  o = align256(o + 4 * un * sizeof(int64_t));
  w.sort_temp = o;
  w.sort_temp_bytes = tb;
  o = align256(o + tb);
  w.total = o;
  return w;
}

void launch_insert(const InsertLaunch& l, cudaStream_t stream) {
  if (l.n <= 0) return;
  InsertLaunch p = l;
  p.dup = nullptr;
  const int bits = sort_bits(l.num_slots);
  if (l.n == 1) {  // no duplicate possible
    check(cudaMemsetAsync(l.err, 0xff, sizeof(unsigned long long), stream), "cudaMemsetAsync (insert refusal)");
    check(cudaMemsetAsync(l.err + 1, 0, sizeof(unsigned long long), stream), "cudaMemsetAsync (insert count)");
  } else if (l.n <= kDupBlockMax) {
    dup_block_kernel<<<1, kDupThreads, 0, stream>>>(l.slots, l.n, l.num_slots, bits, l.dup, l.err);
    INDEXCP_CUDA_LAUNCH_CHECK("insert duplicate kernel launch");
    p.dup = l.dup;
  } else {
    int64_t* k_in = l.sort_keys;
    int64_t* v_in = l.sort_keys + l.n;
    int64_t* k_out = l.sort_keys + 2 * l.n;
    int64_t* v_out = l.sort_keys + 3 * l.n;
    iota_kernel<<<grid_for(l.n, 256), 256, 0, stream>>>(l.slots, l.n, l.num_slots, k_in, v_in, l.err);
    INDEXCP_CUDA_LAUNCH_CHECK("insert iota kernel launch");
    size_t tb = l.sort_temp_bytes;
    check(cub::DeviceRadixSort::SortPairs(l.sort_temp, tb, k_in, k_out, v_in, v_out, l.n, 0, bits, stream),
          "cub::DeviceRadixSort::SortPairs (duplicate slots)");
    dup_kernel<<<grid_for(l.n, 256), 256, 0, stream>>>(k_out, v_out, l.n, l.num_slots, l.dup, l.err);
    INDEXCP_CUDA_LAUNCH_CHECK("insert duplicate kernel launch");
    p.dup = l.dup;
  }
  insert_prep_kernel<<<grid_for(l.n, kWarpsPerBlock), kWarpsPerBlock * 32, 0, stream>>>(p);
  INDEXCP_CUDA_LAUNCH_CHECK("insert prep kernel launch");
  insert_write_kernel<<<grid_for(l.n, 256), 256, 0, stream>>>(p);
  INDEXCP_CUDA_LAUNCH_CHECK("insert write kernel launch");
}

void launch_e4m3_nan_check(const uint8_t* q, int64_t n, unsigned long long* first, cudaStream_t stream) {
  if (n <= 0) return;
  e4m3_nan_kernel<<<grid_for(n, 256), 256, 0, stream>>>(q, n, first);
  INDEXCP_CUDA_LAUNCH_CHECK("E4M3 NaN check kernel launch");
}

void launch_qcast(const QCastLaunch& l, cudaStream_t stream) {
  if (l.vectors <= 0) return;
  check(cudaMemsetAsync(&l.status->scratch, 0xff, sizeof(unsigned long long), stream),
        "cudaMemsetAsync (q cast refusal)");
  qcast_check_kernel<<<grid_for(l.vectors, kWarpsPerBlock), kWarpsPerBlock * 32, 0, stream>>>(l);
  INDEXCP_CUDA_LAUNCH_CHECK("q cast check kernel launch");
  qcast_kernel<<<grid_for(l.vectors, kWarpsPerBlock), kWarpsPerBlock * 32, 0, stream>>>(l);
  INDEXCP_CUDA_LAUNCH_CHECK("q cast kernel launch");
}

}  // namespace indexcp::cuda::detail
