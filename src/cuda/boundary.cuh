// Internal to the CUDA backend's host API: the checks at its boundary (device views, shapes, head
// ranges, groups) and the copies the validating paths read back, shared by the files of each
// operation (device.cu, device_cache.cu, insert_api.cu, decode.cu, prefill.cu, device_group.cu).
#pragma once

#include <string>
#include <vector>

#include "common.cuh"
#include "core/batch.hpp"
#include "indexcp/comm.hpp"
#include "indexcp/cuda.hpp"

namespace indexcp::cuda::detail {

inline cudaStream_t cs(Stream s) { return reinterpret_cast<cudaStream_t>(s); }

/// Stream-ordered temporary device memory (cudaMallocAsync / cudaFreeAsync on one stream).
template <class T>
class Tmp {
 public:
  Tmp(size_t n, cudaStream_t s) : s_(s) {
    if (n) check(cudaMallocAsync(reinterpret_cast<void**>(&p_), n * sizeof(T), s), "cudaMallocAsync");
  }
  ~Tmp() {
    if (p_) cudaFreeAsync(p_, s_);
  }
  Tmp(const Tmp&) = delete;
  Tmp& operator=(const Tmp&) = delete;
  T* get() const { return p_; }

 private:
  T* p_ = nullptr;
  cudaStream_t s_;
};

// Device data read back by the validating paths: on the caller's stream, after the caller's own
// writes to it (never on the legacy default stream), then that stream is synchronized.
template <class T>
std::vector<T> to_host(const T* dev, size_t n, const char* what, cudaStream_t st) {
  std::vector<T> h(n);
  if (n) {
    INDEXCP_REQUIRE(dev != nullptr, std::string(what) + " is null");
    check(cudaMemcpyAsync(h.data(), dev, n * sizeof(T), cudaMemcpyDeviceToHost, st), what);
    check(cudaStreamSynchronize(st), what);
  }
  return h;
}

// Every entry point's first cache check: a device view (not a host one), then the layer.
inline void check_layer(const CacheView& c, int32_t layer, const char* name = "cache") {
  require_supported_device();
  check_cache_view(c, MemoryLocation::kDevice, name);
  check_view_layer(c, layer);
}

inline void check_not_bf16(const CacheView& c) {
  if (c.layout().dtype == KvDtype::kBf16)
    throw Error(ErrorCode::kUnsupported,
                "indexer_kv_dtype = bf16 is not supported by the CUDA scorers (use fp8 or nvfp4, or the cpu backend)");
}

inline void check_head_range(int32_t heads, int32_t h0, int32_t nh) {
  INDEXCP_REQUIRE(heads >= 1 && heads <= 64, "heads = " + std::to_string(heads) + " is out of range 1..64");
  ::indexcp::detail::check_head_range(heads, h0, nh);
}

inline void check_decode_shape(const DecodeBatch& b) {
  INDEXCP_REQUIRE(b.query_len >= 1 && b.query_len <= 16, "query_len = " + std::to_string(b.query_len) + " is out of range 1..16");
  INDEXCP_REQUIRE(b.num_requests >= 0, "num_requests = " + std::to_string(b.num_requests) + " must be >= 0");
  INDEXCP_REQUIRE(b.max_pages >= 0, "max_pages = " + std::to_string(b.max_pages) + " must be >= 0");
  INDEXCP_REQUIRE(b.heads >= 1 && b.heads <= 64, "heads = " + std::to_string(b.heads) + " is out of range 1..64");
  if (b.num_requests > 0) {
    INDEXCP_REQUIRE(b.seq_lens != nullptr, "seq_lens is null");
    INDEXCP_REQUIRE(b.q != nullptr, "q is null");
    INDEXCP_REQUIRE(b.max_pages == 0 || b.block_table != nullptr, "block_table is null");
  }
}

struct HostPrefill {
  std::vector<int32_t> seq_lens, query_start, block_table;
  std::vector<QueryRow> rows;
  int32_t max_rows_per_request = 1;
};

// The batch's metadata copied to the host and validated there (detail::prefill_rows_metadata), and
// q's bytes checked on the GPU, where q lives (a prefill chunk's q is MiBs: copying it back and
// scanning it on the host cost the synchronous prefill APIs milliseconds). The same errors, in the
// same order, as prefill_rows on a host copy of the batch.
HostPrefill read_prefill(const PrefillBatch& b, int64_t num_pages, int32_t page_size, cudaStream_t st);

inline void check_group(const Communicator& comm, const CacheView& c, bool sharded) {
  if (sharded) {
    INDEXCP_REQUIRE(c.layout().shards == comm.world(), "shard has shards = " + std::to_string(c.layout().shards) +
                                                   " but the communicator has world = " + std::to_string(comm.world()));
    INDEXCP_REQUIRE(c.rank() == comm.rank(), "shard is rank " + std::to_string(c.rank()) + "'s but the communicator is rank " +
                                         std::to_string(comm.rank()) + "'s");
  } else {
    INDEXCP_REQUIRE(c.layout().shards == 1,
            "cache is sharded (shards = " + std::to_string(c.layout().shards) + "); decode CP needs a replicated cache");
  }
}

}  // namespace indexcp::cuda::detail
