// The boundary checks that read device data back (the validating paths): read_prefill and the
// synchronous batch validation (cuda.hpp validate_*).
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

namespace detail {

// The batch's metadata copied to the host and validated there (detail::prefill_rows_metadata), and
// q's bytes checked on the GPU, where q lives (a prefill chunk's q is MiBs: copying it back and
// scanning it on the host cost the synchronous prefill APIs milliseconds). The same errors, in the
// same order, as prefill_rows on a host copy of the batch.
HostPrefill read_prefill(const PrefillBatch& b, int64_t num_pages, int32_t page_size, cudaStream_t st) {
  INDEXCP_REQUIRE(b.num_requests >= 0, "num_requests = " + std::to_string(b.num_requests) + " must be >= 0");
  INDEXCP_REQUIRE(b.max_pages >= 0, "max_pages = " + std::to_string(b.max_pages) + " must be >= 0");
  INDEXCP_REQUIRE(b.heads >= 1 && b.heads <= 64, "heads = " + std::to_string(b.heads) + " is out of range 1..64");
  HostPrefill h;
  if (b.num_requests > 0) INDEXCP_REQUIRE(b.query_start != nullptr, "query_start is null");
  h.query_start = to_host(b.query_start, static_cast<size_t>(b.num_requests) + 1, "query_start (device to host)", st);
  h.seq_lens = to_host(b.seq_lens, static_cast<size_t>(b.num_requests), "seq_lens (device to host)", st);
  h.block_table = to_host(b.block_table, static_cast<size_t>(b.num_requests) * b.max_pages, "block_table (device to host)", st);
  const int64_t rows = b.num_requests ? h.query_start.back() : 0;
  INDEXCP_REQUIRE(rows >= 0, "query_start[num_requests] = " + std::to_string(rows) + " is negative");
  PrefillBatch hb = b;  // (q stays the device pointer: only tested for null on the host)
  hb.seq_lens = h.seq_lens.data();
  hb.query_start = h.query_start.empty() ? nullptr : h.query_start.data();
  hb.block_table = h.block_table.data();
  if (b.num_requests == 0) {
    static const int32_t zero = 0;
    hb.query_start = &zero;
  }
  h.rows = ::indexcp::detail::prefill_rows_metadata(hb, num_pages, page_size);
  for (int32_t r = 0; r < b.num_requests; ++r)
    h.max_rows_per_request = std::max(h.max_rows_per_request, h.query_start[r + 1] - h.query_start[r]);
  const int64_t n = rows * b.heads * kHeadDim;
  if (n > 0) {
    Tmp<unsigned long long> first(1, st);
    check(cudaMemsetAsync(first.get(), 0xff, sizeof(unsigned long long), st), "cudaMemsetAsync");
    launch_e4m3_nan_check(b.q, n, first.get(), st);
    unsigned long long e = ~0ull;
    check(cudaMemcpyAsync(&e, first.get(), sizeof(e), cudaMemcpyDeviceToHost, st), "cudaMemcpyAsync (q check)");
    check(cudaStreamSynchronize(st), "cudaStreamSynchronize (q check)");
    if (e != ~0ull) ::indexcp::detail::throw_q_nan(static_cast<int64_t>(e), b.heads);
  }
  return h;
}

}  // namespace detail

// ---- validation -----------------------------------------------------------------------------

void validate_decode_batch(const DecodeBatch& b, int64_t num_pages, int32_t page_size, Stream stream) {
  check_decode_shape(b);
  const cudaStream_t st = cs(stream);
  const auto seq = to_host(b.seq_lens, static_cast<size_t>(b.num_requests), "seq_lens (device to host)", st);
  const auto bt = to_host(b.block_table, static_cast<size_t>(b.num_requests) * b.max_pages, "block_table (device to host)", st);
  const auto q = to_host(b.q, static_cast<size_t>(b.rows()) * b.heads * kHeadDim, "q (device to host)", st);
  DecodeBatch hb = b;
  hb.seq_lens = seq.data();
  hb.block_table = bt.data();
  hb.q = q.data();
  (void)decode_rows(hb, num_pages, page_size);
}

int64_t validate_prefill_batch(const PrefillBatch& b, int64_t num_pages, int32_t page_size, Stream stream) {
  return static_cast<int64_t>(read_prefill(b, num_pages, page_size, cs(stream)).rows.size());
}

}  // namespace indexcp::cuda
