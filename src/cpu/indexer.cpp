// Block scores and exact selection, CPU backend (spec/indexer.md sections 2-4).
#include "indexcp/indexer.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "indexcp/error.hpp"
#include "kernels.hpp"

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
    if (e4m3_is_nan(q[i])) cpu::throw_q_nan(i, heads);
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

namespace cpu {
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
}  // namespace cpu

BlockScores score_blocks(const CacheView& cache, int32_t layer, const std::vector<QueryRow>& rows,
                         const int32_t* block_table, int32_t max_pages, const uint8_t* q,
                         int32_t heads, int32_t h0, int32_t nh, KRounding mode, BlockFilter filter) {
  check_cache_view(cache, MemoryLocation::kHost, "cache");
  INDEXCP_REQUIRE(layer >= 0 && layer < cache.num_layers(),
          "layer = " + std::to_string(layer) + " is outside [0, " +
              std::to_string(cache.num_layers()) + ")");
  cpu::check_head_range(heads, h0, nh);
  check_k_rounding(mode, "mode");
  INDEXCP_REQUIRE(filter.modulus >= 1 && filter.residue >= 0 && filter.residue < filter.modulus,
          "block filter " + std::to_string(filter.residue) + " mod " +
              std::to_string(filter.modulus) + " is invalid");
  INDEXCP_REQUIRE(max_pages >= 0, "max_pages = " + std::to_string(max_pages) + " must be >= 0");
  INDEXCP_REQUIRE(rows.empty() || q != nullptr, "q is null");
  const int32_t P = cache.layout().page_size;
  const int64_t max_blocks = static_cast<int64_t>(max_pages) * cache.layout().blocks_per_page();
  for (size_t i = 0; i < rows.size(); ++i) {
    const QueryRow& r = rows[i];
    if (r.pos < 0) continue;
    INDEXCP_REQUIRE(r.request >= 0, "rows[" + std::to_string(i) + "].request = " +
                                        std::to_string(r.request) + " is negative");
    INDEXCP_REQUIRE(r.pos / kBlockTokens < max_blocks,
                    "rows[" + std::to_string(i) + "] at position " + std::to_string(r.pos) +
                        " lies beyond max_pages = " + std::to_string(max_pages) + " pages");
    INDEXCP_REQUIRE(block_table != nullptr, "block_table is null");
  }
  // pages holding the historical blocks of each run of rows of one request
  for (const auto& run : cpu::request_runs(rows)) {
    int64_t max_pos = 0;
    for (int64_t i = run.first; i < run.second; ++i) max_pos = std::max(max_pos, rows[i].pos);
    const QueryRow& r = rows[run.first];
    const int64_t pages = (max_pos / kBlockTokens * kBlockTokens + P - 1) / P;
    for (int64_t p = 0; p < pages; ++p) {
      const int32_t id = block_table[static_cast<int64_t>(r.request) * max_pages + p];
      INDEXCP_REQUIRE(id >= 0 && id < cache.num_pages(),
                      "block_table[" + std::to_string(r.request) + "][" + std::to_string(p) + "] = " +
                          std::to_string(id) + " is outside [0, num_pages = " +
                          std::to_string(cache.num_pages()) + ")");
    }
  }
  return cpu::score_blocks(cache, layer, rows, block_table, max_pages, q, heads, h0, nh, mode,
                           filter);
}

void select_topk(const BlockScores& s, const std::vector<QueryRow>& rows, const SelectionParams& sel,
                 int32_t* out) {
  sel.validate();
  cpu::check_scores(s, rows);
  INDEXCP_REQUIRE(rows.empty() || out != nullptr, "out is null");
  cpu::select_topk(s, rows, sel, out);
}

void decode_select(const CacheView& cache, int32_t layer, const DecodeBatch& batch, int32_t h0,
                   int32_t nh, const SelectionParams& sel, KRounding mode, int32_t* out) {
  sel.validate();
  check_cache_view(cache, MemoryLocation::kHost, "cache");
  INDEXCP_REQUIRE(cache.layout().shards == 1,
          "cache is sharded (shards = " + std::to_string(cache.layout().shards) +
              "); decode_select needs a replicated cache, use icp_decode");
  const auto rows = decode_rows(batch, cache.num_pages(), cache.layout().page_size);
  INDEXCP_REQUIRE(rows.empty() || out != nullptr, "out is null");
  const auto s = score_blocks(cache, layer, rows, batch.block_table, batch.max_pages, batch.q,
                              batch.heads, h0, nh, mode);
  cpu::select_topk(s, rows, sel, out);
}

void prefill_select(const CacheView& cache, int32_t layer, const PrefillBatch& batch, int32_t h0,
                    int32_t nh, const SelectionParams& sel, int32_t* out) {
  sel.validate();
  check_cache_view(cache, MemoryLocation::kHost, "cache");
  INDEXCP_REQUIRE(cache.layout().shards == 1,
          "cache is sharded (shards = " + std::to_string(cache.layout().shards) +
              "); prefill_select needs a replicated cache, use prefill_gather");
  const auto rows = prefill_rows(batch, cache.num_pages(), cache.layout().page_size);
  INDEXCP_REQUIRE(rows.empty() || out != nullptr, "out is null");
  // prefill always scores E4M3-rounded NVFP4 keys (indexer.md section 2)
  const auto s = score_blocks(cache, layer, rows, batch.block_table, batch.max_pages, batch.q,
                              batch.heads, h0, nh, KRounding::kE4m3);
  cpu::select_topk(s, rows, sel, out);
}

}  // namespace indexcp
