// Block scores and exact selection, CPU backend (spec/indexer.md sections 2-4).
#include "indexcp/indexer.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "indexcp/error.hpp"
#include "core/batch.hpp"
#include "kernels.hpp"

namespace indexcp {

BlockScores score_blocks(const CacheView& cache, int32_t layer, const std::vector<QueryRow>& rows,
                         const int32_t* block_table, int32_t max_pages, const uint8_t* q,
                         int32_t heads, int32_t h0, int32_t nh, KRounding mode, BlockFilter filter) {
  check_cache_view(cache, MemoryLocation::kHost, "cache");
  INDEXCP_REQUIRE(layer >= 0 && layer < cache.num_layers(),
          "layer = " + std::to_string(layer) + " is outside [0, " +
              std::to_string(cache.num_layers()) + ")");
  detail::check_head_range(heads, h0, nh);
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
