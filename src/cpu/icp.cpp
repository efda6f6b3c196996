// Indexer context parallelism, CPU backend (spec/indexer.md section 5).
#include "indexcp/icp.hpp"

#include <algorithm>
#include <string>

#include "indexcp/error.hpp"
#include "core/batch.hpp"
#include "kernels.hpp"

namespace indexcp {

void publish_candidates(const BlockScores& scores, const std::vector<QueryRow>& rows,
                        const SelectionParams& sel, Candidate* out) {
  sel.validate();
  cpu::check_scores(scores, rows);
  INDEXCP_REQUIRE(rows.empty() || out != nullptr, "out is null");
  cpu::publish(scores, rows, sel, out);
}

void merge_candidates(const Candidate* cands, int32_t world, const std::vector<QueryRow>& rows,
                      int32_t heads, int32_t h0, int32_t nh, const SelectionParams& sel,
                      int32_t* out) {
  sel.validate();
  INDEXCP_REQUIRE(world >= 1, "world = " + std::to_string(world) + " must be >= 1");
  detail::check_head_range(heads, h0, nh);
  INDEXCP_REQUIRE(rows.empty() || (cands != nullptr && out != nullptr), "cands or out is null");
  cpu::merge(cands, world, rows, heads, h0, nh, sel, out);
}

namespace {

void check_group(const Communicator& comm, const CacheView& cache, bool sharded) {
  check_cache_view(cache, MemoryLocation::kHost, sharded ? "shard" : "cache");
  if (sharded) {
    INDEXCP_REQUIRE(cache.layout().shards == comm.world(),
            "shard has shards = " + std::to_string(cache.layout().shards) +
                " but the communicator has world = " + std::to_string(comm.world()));
    INDEXCP_REQUIRE(cache.rank() == comm.rank(), "shard is rank " + std::to_string(cache.rank()) +
                                             "'s but the communicator is rank " +
                                             std::to_string(comm.rank()) + "'s");
  } else {
    INDEXCP_REQUIRE(cache.layout().shards == 1, "cache is sharded (shards = " +
                                            std::to_string(cache.layout().shards) +
                                            "); decode CP needs a replicated cache");
  }
}

// Score all heads on this rank, publish, all-gather, merge the owned heads.
void icp_select(Communicator& comm, const CacheView& cache, int32_t layer,
                const std::vector<QueryRow>& rows, const int32_t* block_table, int32_t max_pages,
                const uint8_t* q, int32_t heads, const SelectionParams& sel, KRounding mode,
                BlockFilter filter, int32_t* out) {
  check_heads_tp(heads, comm.world());
  INDEXCP_REQUIRE(rows.empty() || out != nullptr, "out is null");
  const auto scores =
      score_blocks(cache, layer, rows, block_table, max_pages, q, heads, 0, heads, mode, filter);
  const size_t per_rank = rows.size() * static_cast<size_t>(heads) * sel.ranked();
  std::vector<Candidate> mine(per_rank), all(per_rank * comm.world());
  cpu::publish(scores, rows, sel, mine.data());
  comm.all_gather(mine.data(), all.data(), per_rank * sizeof(Candidate), nullptr);
  int32_t h0, nh;
  owned_heads(heads, comm.world(), comm.rank(), &h0, &nh);
  cpu::merge(all.data(), comm.world(), rows, heads, h0, nh, sel, out);
}

}  // namespace

void icp_decode(Communicator& comm, const CacheView& shard, int32_t layer,
                const DecodeBatch& batch, const SelectionParams& sel, KRounding mode,
                int32_t* out) {
  sel.validate();
  check_group(comm, shard, true);
  const auto rows = decode_rows(batch, shard.num_pages(), shard.layout().page_size);
  icp_select(comm, shard, layer, rows, batch.block_table, batch.max_pages, batch.q, batch.heads,
             sel, mode, BlockFilter{}, out);
}

void decode_cp_replicated(Communicator& comm, const CacheView& cache, int32_t layer,
                          const DecodeBatch& batch, const SelectionParams& sel, KRounding mode,
                          int32_t* out) {
  sel.validate();
  check_group(comm, cache, false);
  const auto rows = decode_rows(batch, cache.num_pages(), cache.layout().page_size);
  icp_select(comm, cache, layer, rows, batch.block_table, batch.max_pages, batch.q, batch.heads,
             sel, mode, BlockFilter{comm.world(), comm.rank()}, out);
}

void prefill_local_score(Communicator& comm, const CacheView& shard, int32_t layer,
                         const PrefillBatch& batch, const SelectionParams& sel, int32_t* out) {
  sel.validate();
  check_group(comm, shard, true);
  const auto rows = prefill_rows(batch, shard.num_pages(), shard.layout().page_size);
  icp_select(comm, shard, layer, rows, batch.block_table, batch.max_pages, batch.q, batch.heads,
             sel, KRounding::kE4m3, BlockFilter{}, out);
}

void stage_fp8(const CacheView& shard, int32_t layer, const int32_t* pages, int64_t num_pages,
               uint8_t* out) {
  check_cache_view(shard, MemoryLocation::kHost, "shard");
  const PageLayout& l = shard.layout();
  INDEXCP_REQUIRE(l.dtype != KvDtype::kBf16, "shard is a bf16 cache; FP8 staging needs fp8 or nvfp4");
  INDEXCP_REQUIRE(layer >= 0 && layer < shard.num_layers(), "layer = " + std::to_string(layer) + " is out of range");
  INDEXCP_REQUIRE(num_pages >= 0, "num_pages = " + std::to_string(num_pages) + " must be >= 0");
  INDEXCP_REQUIRE(num_pages == 0 || (pages != nullptr && out != nullptr), "pages or out is null");
  for (int64_t i = 0; i < num_pages; ++i)
    INDEXCP_REQUIRE(pages[i] >= 0 && pages[i] < shard.num_pages(),
            "pages[" + std::to_string(i) + "] = " + std::to_string(pages[i]) +
                " is outside [0, num_pages = " + std::to_string(shard.num_pages()) + ")");
  const int32_t R = l.rows();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < num_pages; ++i) {
    const uint8_t* p = shard.page_ptr(layer, pages[i]);
    uint8_t* o = out + i * R * kHeadDim;
    for (int32_t j = 0; j < R; ++j) {
      if (l.dtype == KvDtype::kNvfp4)
        nvfp4_key_to_fp8(p + l.row_data_offset(j), p + l.row_scale_offset(j), o + j * kHeadDim);
      else
        std::copy(p + l.row_data_offset(j), p + l.row_data_offset(j) + kHeadDim, o + j * kHeadDim);
    }
  }
}

int64_t gather_unit_bytes(const PageLayout& l) {
  return static_cast<int64_t>(l.rows()) * kHeadDim + static_cast<int64_t>(l.page_size) * kHeadDim;
}

GatherStats prefill_gather(Communicator& comm, const CacheView& shard, int32_t layer,
                           const PrefillBatch& batch, const SelectionParams& sel,
                           int64_t budget_bytes, int32_t* out) {
  sel.validate();
  check_group(comm, shard, true);
  const PageLayout& l = shard.layout();
  INDEXCP_REQUIRE(l.dtype != KvDtype::kBf16, "shard is a bf16 cache; the gather needs fp8 or nvfp4");
  const auto rows = prefill_rows(batch, shard.num_pages(), l.page_size);
  check_heads_tp(batch.heads, comm.world());
  INDEXCP_REQUIRE(rows.empty() || out != nullptr, "out is null");
  const int64_t unit = gather_unit_bytes(l);
  INDEXCP_REQUIRE(budget_bytes >= unit,
          "indexer_prefill_gather_budget_mib gives " + std::to_string(budget_bytes) +
              " bytes, below one page of one request (" + std::to_string(unit) + " bytes)");
  const int32_t W = comm.world(), R = l.rows(), P = l.page_size;

  // (request, logical page) units covering each request's historical blocks
  struct Unit {
    int32_t request;
    int64_t lpage;
  };
  std::vector<Unit> units;
  std::vector<int64_t> max_local(static_cast<size_t>(batch.num_requests), 0);
  std::vector<int64_t> first_unit(static_cast<size_t>(batch.num_requests), 0);
  std::vector<std::pair<int64_t, int64_t>> run_of(static_cast<size_t>(batch.num_requests), {0, 0});
  for (const auto& run : cpu::request_runs(rows)) {
    const int32_t b = rows[run.first].request;
    run_of[b] = run;
    for (int64_t r = run.first; r < run.second; ++r)
      max_local[b] = std::max(max_local[b], rows[r].pos / kBlockTokens);
    first_unit[b] = static_cast<int64_t>(units.size());
    const int64_t npages = (max_local[b] * kBlockTokens + P - 1) / P;
    for (int64_t i = 0; i < npages; ++i) units.push_back({b, i});
  }
  const int64_t per_chunk = budget_bytes / unit;
  GatherStats st;
  st.pages = static_cast<int64_t>(units.size());
  st.reserved_bytes = std::min<int64_t>(st.pages, per_chunk) * unit;
  st.gathered_bytes = st.pages * P * kHeadDim;

  int32_t h0, nh;
  owned_heads(batch.heads, W, comm.rank(), &h0, &nh);
  const int64_t max_blocks = static_cast<int64_t>(batch.max_pages) * l.blocks_per_page();
  BlockScores scores = cpu::make_scores(static_cast<int64_t>(rows.size()), nh, max_blocks);
  const auto qd = cpu::decode_q(batch.q, static_cast<int64_t>(rows.size()), batch.heads, h0, nh);
  const int64_t cap = std::min<int64_t>(st.pages, per_chunk);
  std::vector<uint8_t> staging(static_cast<size_t>(cap) * R * kHeadDim);
  std::vector<uint8_t> gathered(static_cast<size_t>(cap) * P * kHeadDim);
  std::vector<int32_t> phys(static_cast<size_t>(cap));

  for (int64_t c0 = 0; c0 < st.pages; c0 += per_chunk) {
    const int64_t n = std::min<int64_t>(per_chunk, st.pages - c0);
    for (int64_t k = 0; k < n; ++k) {
      const Unit& u = units[c0 + k];
      phys[k] = batch.block_table[static_cast<int64_t>(u.request) * batch.max_pages + u.lpage];
    }
    stage_fp8(shard, layer, phys.data(), n, staging.data());
    comm.all_gather(staging.data(), gathered.data(), static_cast<size_t>(n) * R * kHeadDim, nullptr);
    ++st.chunks;
    std::vector<cpu::WorkItem> items;
    for (int64_t k = 0; k < n; ++k) {
      const Unit& u = units[c0 + k];
      for (int32_t j = 0; j < l.blocks_per_page(); ++j) {
        const int64_t bid = u.lpage * l.blocks_per_page() + j;
        if (bid < max_local[u.request])
          items.push_back({run_of[u.request].first, run_of[u.request].second, u.request, bid});
      }
    }
    const double* e4m3 = cpu::e4m3_table();
    auto source = [&](int32_t request, int64_t bid, double* kbuf) -> int {
      const int64_t lp = bid * kBlockTokens / P;
      const int64_t k = first_unit[request] + lp - c0;  // unit index within this chunk
      const int32_t u0 = static_cast<int32_t>((bid * kBlockTokens) % P);
      for (int32_t t = 0; t < kBlockTokens; ++t) {
        const int32_t uoff = u0 + t;
        const int32_t src = l.owner_of_offset(uoff), row = l.local_row_of_offset(uoff);
        const uint8_t* key = gathered.data() + ((static_cast<int64_t>(src) * n + k) * R + row) * kHeadDim;
        for (int d = 0; d < kHeadDim; ++d) kbuf[t * kHeadDim + d] = e4m3[key[d]];
      }
      return kBlockTokens;
    };
    cpu::score_items(items, rows, qd, source, scores);
  }
  cpu::select_topk(scores, rows, sel, out);
  return st;
}

}  // namespace indexcp
