// Validation of the host batches (indexer.md section 7): the one owner of the checks every
// backend's synchronous entry points and the plans run on DecodeBatch / PrefillBatch metadata.
#include "core/batch.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "indexcp/error.hpp"
#include "indexcp/formats.hpp"

namespace indexcp {

void SelectionParams::validate() const {
  INDEXCP_REQUIRE(topk >= 2 && topk <= 1024, "topk = " + std::to_string(topk) + " must be in 2..1024");
  INDEXCP_REQUIRE(local_blocks == 1, "local_blocks = " + std::to_string(local_blocks) +
                                 " is not supported; the local block is always forced (1)");
  INDEXCP_REQUIRE(init_blocks >= 0 && init_blocks <= topk - 2,
          "init_blocks = " + std::to_string(init_blocks) + " must be in 0..topk-2 (" +
              std::to_string(topk - 2) + ")");
}

static void check_common(const uint8_t* q, int32_t heads, const int32_t* block_table,
                         int32_t num_requests, int32_t max_pages, const int32_t* seq_lens) {
  INDEXCP_REQUIRE(heads >= 1 && heads <= 64, "heads = " + std::to_string(heads) + " is out of range 1..64");
  INDEXCP_REQUIRE(num_requests >= 0, "num_requests = " + std::to_string(num_requests) + " must be >= 0");
  INDEXCP_REQUIRE(max_pages >= 0, "max_pages = " + std::to_string(max_pages) + " must be >= 0");
  if (num_requests > 0) {
    INDEXCP_REQUIRE(seq_lens != nullptr, "seq_lens is null");
    INDEXCP_REQUIRE(q != nullptr, "q is null");
    INDEXCP_REQUIRE(max_pages == 0 || block_table != nullptr, "block_table is null");
  }
}

static void check_request_pages(int32_t b, int32_t seq_len, const int32_t* block_table,
                                int32_t max_pages, int64_t num_pages, int32_t page_size) {
  const int64_t need = (static_cast<int64_t>(seq_len) + page_size - 1) / page_size;
  INDEXCP_REQUIRE(need <= max_pages, "seq_lens[" + std::to_string(b) + "] = " + std::to_string(seq_len) +
                                 " needs " + std::to_string(need) +
                                 " pages but the block table has max_pages = " +
                                 std::to_string(max_pages));
  for (int64_t i = 0; i < need; ++i) {
    const int32_t p = block_table[static_cast<int64_t>(b) * max_pages + i];
    INDEXCP_REQUIRE(p >= 0 && p < num_pages, "block_table[" + std::to_string(b) + "][" +
                                         std::to_string(i) + "] = " + std::to_string(p) +
                                         " is outside [0, num_pages = " +
                                         std::to_string(num_pages) + ")");
  }
}

static void check_q_rows(const uint8_t* q, int64_t row0, int64_t nrows, int32_t heads) {
  // fast path: one branch-free pass over the rows' bytes, 128 at a time (vectorized; a prefill
  // chunk of 8,192 rows x 4 heads is 4 MiB, and the byte-by-byte check below made the synchronous
  // prefill APIs several ms slower: bench/results/prefill-validation-ab-h200-2026-11-30.json);
  // the exact place of a NaN byte is searched only when there is one
  const uint8_t* p = q + row0 * heads * kHeadDim;
  const int64_t vectors = nrows * heads;
  unsigned bad = 0;
  for (int64_t v = 0; v < vectors; ++v) {
    const uint8_t* x = p + v * kHeadDim;
    unsigned b = 0;
    for (int d = 0; d < kHeadDim; ++d) b |= static_cast<unsigned>(e4m3_is_nan(x[d]));
    bad |= b;
  }
  if (bad == 0) return;
  const int64_t end = (row0 + nrows) * heads * kHeadDim;
  for (int64_t i = row0 * heads * kHeadDim; i < end; ++i)
    if (e4m3_is_nan(q[i])) detail::throw_q_nan(i, heads);
}

std::vector<QueryRow> decode_rows(const DecodeBatch& b, int64_t num_pages, int32_t page_size) {
  check_common(b.q, b.heads, b.block_table, b.num_requests, b.max_pages, b.seq_lens);
  INDEXCP_REQUIRE(b.query_len >= 1 && b.query_len <= 16,
          "query_len = " + std::to_string(b.query_len) + " is out of range 1..16");
  std::vector<QueryRow> rows;
  // (capped: a huge num_requests must reach the check of its seq_lens, not fail to allocate)
  rows.reserve(static_cast<size_t>(std::min<int64_t>(b.rows(), int64_t{1} << 20)));
  for (int32_t r = 0; r < b.num_requests; ++r) {
    const int32_t s = b.seq_lens[r];
    INDEXCP_REQUIRE(s >= 0, "seq_lens[" + std::to_string(r) + "] = " + std::to_string(s) + " is negative");
    INDEXCP_REQUIRE(s == 0 || s >= b.query_len,
            "seq_lens[" + std::to_string(r) + "] = " + std::to_string(s) +
                " is shorter than query_len = " + std::to_string(b.query_len) +
                " (0 marks a padded request)");
    if (s > 0) {
      check_request_pages(r, s, b.block_table, b.max_pages, num_pages, page_size);
      check_q_rows(b.q, static_cast<int64_t>(r) * b.query_len, b.query_len, b.heads);
    }
    for (int32_t i = 0; i < b.query_len; ++i)
      rows.push_back({r, s == 0 ? -1 : static_cast<int64_t>(s) - b.query_len + i});
  }
  return rows;
}

static std::vector<QueryRow> prefill_rows_impl(const PrefillBatch& b, int64_t num_pages, int32_t page_size,
                                               bool check_q) {
  check_common(b.q, b.heads, b.block_table, b.num_requests, b.max_pages, b.seq_lens);
  INDEXCP_REQUIRE(b.query_start != nullptr, "query_start is null");
  INDEXCP_REQUIRE(b.query_start[0] == 0, "query_start[0] = " + std::to_string(b.query_start[0]) + " must be 0");
  // pass 1: query_start, seq_lens and the block table of every request (q is sized by
  // query_start[num_requests], so it is read only once all of query_start is known to be sane)
  for (int32_t r = 0; r < b.num_requests; ++r) {
    const int64_t t = static_cast<int64_t>(b.query_start[r + 1]) - b.query_start[r];
    const int32_t s = b.seq_lens[r];
    INDEXCP_REQUIRE(t >= 0, "query_start[" + std::to_string(r + 1) + "] = " +
                        std::to_string(b.query_start[r + 1]) + " is below query_start[" +
                        std::to_string(r) + "] (must be non-decreasing)");
    INDEXCP_REQUIRE(s >= 0, "seq_lens[" + std::to_string(r) + "] = " + std::to_string(s) + " is negative");
    INDEXCP_REQUIRE(t <= s, "request " + std::to_string(r) + " has a chunk of " + std::to_string(t) +
                        " tokens (query_start) longer than seq_lens[" + std::to_string(r) +
                        "] = " + std::to_string(s));
    if (t > 0) check_request_pages(r, s, b.block_table, b.max_pages, num_pages, page_size);
  }
  // pass 2: index Q of every row, then the rows
  std::vector<QueryRow> rows;
  for (int32_t r = 0; r < b.num_requests; ++r) {
    const int32_t t = b.query_start[r + 1] - b.query_start[r];
    const int32_t s = b.seq_lens[r];
    if (t > 0 && check_q) check_q_rows(b.q, b.query_start[r], t, b.heads);
    for (int32_t i = 0; i < t; ++i) rows.push_back({r, static_cast<int64_t>(s) - t + i});
  }
  return rows;
}

std::vector<QueryRow> prefill_rows(const PrefillBatch& b, int64_t num_pages, int32_t page_size) {
  return prefill_rows_impl(b, num_pages, page_size, true);
}

}  // namespace indexcp

namespace indexcp::detail {
void throw_q_nan(int64_t index, int32_t heads) {
  const int64_t v = index / kHeadDim;
  throw Error(ErrorCode::kInvalidArgument, "q holds a NaN byte at row " + std::to_string(v / heads) + ", head " +
                                               std::to_string(v % heads) + ", dim " + std::to_string(index % kHeadDim));
}

std::vector<QueryRow> prefill_rows_metadata(const PrefillBatch& b, int64_t num_pages, int32_t page_size) {
  return prefill_rows_impl(b, num_pages, page_size, false);
}

void check_head_range(int32_t heads, int32_t h0, int32_t nh) {
  const int64_t end = int64_t{h0} + nh;
  INDEXCP_REQUIRE(h0 >= 0 && nh >= 1 && end <= heads, "head range [" + std::to_string(h0) + ", " + std::to_string(end) +
                                                          ") is outside the " + std::to_string(heads) + " heads");
}
}  // namespace indexcp::detail
