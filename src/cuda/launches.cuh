// The launch arguments of the scorer built in one place (the entry points of decode.cu and prefill.cu, the plans of
// plan.cu and DecodeStep use them): the rows of a batch, where its keys come from, the scorer's
// launch for a decode or prefill batch.
#pragma once

#include "indexcp/cache_view.hpp"
#include "indexcp/indexer.hpp"
#include "kernels.cuh"

namespace indexcp::cuda::detail {

inline RowsView decode_rows_view(const DecodeBatch& b) {
  RowsView v;
  v.seq_lens = b.seq_lens;
  v.num_requests = b.num_requests;
  v.query_len = b.query_len;
  v.rows = b.rows();
  return v;
}

inline KeySource key_source(const CacheView& c, int32_t layer) {
  KeySource k;
  k.base = c.layer_ptr(layer);
  k.layout = c.layout();
  k.rank = c.rank();
  k.num_pages = c.num_pages();
  return k;
}

inline int64_t max_blocks_of(int32_t max_pages, const PageLayout& l) {
  return static_cast<int64_t>(max_pages) * l.blocks_per_page();
}

inline ScoreLaunch decode_score_launch(const CacheView& c, int32_t layer, const DecodeBatch& b, int32_t h0,
                                int32_t nh, KRounding mode, float* scores, BlockFilter filter, bool stock) {
  check_k_rounding(mode, "mode");
  ScoreLaunch s;
  s.keys = key_source(c, layer);
  s.mode = mode;
  s.stock = stock;
  s.rows = decode_rows_view(b);
  s.block_table = b.block_table;
  s.max_pages = b.max_pages;
  s.max_rows_per_request = b.query_len;
  s.q = b.q;
  s.heads = b.heads;
  s.h0 = h0;
  s.nh = nh;
  s.filter = filter;
  s.scores = scores;
  s.max_blocks = max_blocks_of(b.max_pages, c.layout());
  return s;
}

inline RowsView prefill_rows_view(const PrefillBatch& b, int64_t rows) {
  RowsView v;
  v.seq_lens = b.seq_lens;
  v.query_start = b.query_start;
  v.num_requests = b.num_requests;
  v.rows = rows;
  return v;
}

// The scorer launch of a replicated prefill (E4M3 keys, whole-page scorer) for heads [h0, h0+nh).
inline ScoreLaunch prefill_score_launch(const CacheView& cache, int32_t layer, const PrefillBatch& batch, int64_t rows,
                                 int32_t max_rows_per_request, int32_t h0, int32_t nh, float* scores) {
  ScoreLaunch sl;
  sl.keys = key_source(cache, layer);
  sl.mode = KRounding::kE4m3;  // prefill always scores E4M3 keys (indexer.md section 2)
  sl.stock = true;
  sl.rows = prefill_rows_view(batch, rows);
  sl.block_table = batch.block_table;
  sl.max_pages = batch.max_pages;
  sl.max_rows_per_request = max_rows_per_request;
  sl.q = batch.q;
  sl.heads = batch.heads;
  sl.h0 = h0;
  sl.nh = nh;
  sl.scores = scores;
  sl.max_blocks = max_blocks_of(batch.max_pages, cache.layout());
  return sl;
}

/// The whole-page scorer rule: pages whose rank rows cover a whole 128-token block (R >= 128) are
/// scored by the stock scorer; at P = 256 with 2 shards (R = 128, a shard page is a whole stock
/// page) only when `p256_stock` (INDEXCP_P256_STOCK_DECODE; both scorers give identical bits).
inline bool whole_page_scorer(const PageLayout& l, bool p256_stock) {
  if (l.rows() < kBlockTokens) return false;
  return p256_stock || !(l.page_size == 256 && l.shards == 2);
}

}  // namespace indexcp::cuda::detail
