// cuda::DeviceCache, the library-owned device index cache, and its host copies (cuda.hpp).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common.cuh"
#include "core/batch.hpp"
#include "indexcp/cuda.hpp"
#include "kernels.cuh"
#include "launches.cuh"
#include "plan.cuh"
#include "comm/rank_barrier.hpp"
#include "boundary.cuh"

namespace indexcp::cuda {

using namespace detail;

DeviceCache::DeviceCache(const PageLayout& layout, int64_t num_pages, int32_t num_layers, int32_t rank)
    : num_pages_(num_pages), num_layers_(num_layers), rank_(rank) {
  layout_ = make_page_layout(layout.dtype, layout.page_size, layout.shards, layout.page_stride);
  INDEXCP_REQUIRE(num_pages >= 1, "num_pages = " + std::to_string(num_pages) + " must be >= 1");
  INDEXCP_REQUIRE(num_pages < (int64_t{1} << 31), "num_pages = " + std::to_string(num_pages) + " must fit in int32 (page ids)");
  INDEXCP_REQUIRE(num_layers >= 1 && num_layers <= 4096, "num_layers = " + std::to_string(num_layers) + " must be in 1..4096");
  INDEXCP_REQUIRE(rank >= 0 && rank < layout_.shards,
          "rank = " + std::to_string(rank) + " must be in [0, shards = " + std::to_string(layout_.shards) + ")");
  const int64_t bytes = size_bytes();
  prepare_device();
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, static_cast<size_t>(bytes));
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw Error(ErrorCode::kRuntime, "could not allocate the device index cache (" + std::to_string(bytes) +
                                         " bytes): cudaMalloc failed: " + cudaGetErrorName(e) + " (" +
                                         cudaGetErrorString(e) + ")");
  }
  data_ = static_cast<uint8_t*>(p);
  // cudaMemset is asynchronous on the legacy stream: wait for it, so that the caller's work on any
  // stream (non-blocking ones are not ordered after the legacy stream) sees a zeroed cache
  INDEXCP_CUDA_CHECK(cudaMemset(data_, 0, static_cast<size_t>(bytes)));
  INDEXCP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

CacheView DeviceCache::view() const {
  return make_cache_view(layout_, data_, num_pages_, num_layers_, rank_, 0, MemoryLocation::kDevice);
}

DeviceCache::~DeviceCache() {
  if (data_) cudaFree(data_);
}

DeviceCache::DeviceCache(DeviceCache&& o) noexcept
    : layout_(o.layout_), num_pages_(o.num_pages_), num_layers_(o.num_layers_), rank_(o.rank_), data_(o.data_) {
  o.data_ = nullptr;
}

DeviceCache& DeviceCache::operator=(DeviceCache&& o) noexcept {
  if (this != &o) {
    if (data_) cudaFree(data_);
    layout_ = o.layout_;
    num_pages_ = o.num_pages_;
    num_layers_ = o.num_layers_;
    rank_ = o.rank_;
    data_ = o.data_;
    o.data_ = nullptr;
  }
  return *this;
}

static void check_same_geometry(const CacheView& d, const IndexCache& h) {
  INDEXCP_REQUIRE(h.layout().dtype == d.layout().dtype && h.layout().page_size == d.layout().page_size &&
              h.layout().shards == d.layout().shards && h.layout().page_stride == d.layout().page_stride &&
              h.num_pages() == d.num_pages() && h.num_layers() == d.num_layers() && h.rank() == d.rank(),
          "host cache geometry (layout, num_pages, num_layers, rank) differs from the device cache's");
}

void DeviceCache::upload(const IndexCache& host) {
  check_same_geometry(*this, host);
  // a copy from pageable memory may return before its DMA lands: wait for it (the caller may use
  // the cache on a non-blocking stream next)
  INDEXCP_CUDA_CHECK(cudaMemcpy(data_, host.data(), static_cast<size_t>(size_bytes()), cudaMemcpyHostToDevice));
  INDEXCP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

void DeviceCache::download(IndexCache& host) const {
  check_same_geometry(*this, host);
  INDEXCP_CUDA_CHECK(cudaMemcpy(host.data(), data_, static_cast<size_t>(size_bytes()), cudaMemcpyDeviceToHost));
}

}  // namespace indexcp::cuda
