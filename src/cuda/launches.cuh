// The launch argument structs of kernels.cuh built in one place (the entry points of decode.cu and the plans of
// plan.cu use them), so that each field is set once: the rows of a batch, where its keys come from,
// the scorer's launch (decode, prefill, prefill gather), the selection, the publish and the merge.
#pragma once

#include "indexcp/cache_view.hpp"
#include "indexcp/indexer.hpp"
#include "indexcp/plan.hpp"
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

// `plan`: ScoreLaunch::plan (null: allocated on the stream when needed).
inline ScoreLaunch decode_score_launch(const CacheView& c, int32_t layer, const DecodeBatch& b, int32_t h0,
                                int32_t nh, KRounding mode, ScorePrecision precision, float* scores,
                                BlockFilter filter, bool stock, int32_t* plan = nullptr) {
  check_score_mode(c.layout().dtype, mode, precision);
  ScoreLaunch s;
  s.keys = key_source(c, layer);
  s.mode = mode;
  s.precision = precision;
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
  s.plan = plan;
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

// The scorer launch of a prefill on the cache's own keys (E4M3) for heads [h0, h0+nh); `stock`:
// the whole-page scorer (a replicated cache always); `plan` as decode_score_launch.
inline ScoreLaunch prefill_score_launch(const CacheView& cache, int32_t layer, const PrefillBatch& batch, int64_t rows,
                                 int32_t max_rows_per_request, int32_t h0, int32_t nh, ScorePrecision precision,
                                 float* scores, bool stock = true, int32_t* plan = nullptr) {
  ScoreLaunch sl;
  sl.keys = key_source(cache, layer);
  sl.mode = KRounding::kE4m3;  // prefill always scores E4M3 keys (indexer.md section 2)
  sl.precision = precision;
  sl.stock = stock;
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
  sl.plan = plan;
  return sl;
}

// The scorer launch of one chunk of a prefill gather: `units` gathered FP8 pages (layout gl) through
// the chunk's block table bt_local, into scores [rows, nh, max_blocks].
inline ScoreLaunch gather_score_launch(const uint8_t* gathered, const PageLayout& gl, int64_t units,
                                       const PrefillBatch& batch, const RowsView& rows, const int32_t* bt_local,
                                       int32_t max_rows_per_request, int32_t h0, int32_t nh,
                                       ScorePrecision precision, float* scores, int64_t max_blocks, int32_t* plan) {
  ScoreLaunch sl;
  sl.precision = precision;
  sl.keys.base = gathered;
  sl.keys.layout = gl;
  sl.keys.rank = 0;
  sl.keys.num_pages = units;
  sl.keys.gather = true;
  sl.rows = rows;
  sl.block_table = bt_local;
  sl.max_pages = batch.max_pages;
  sl.max_rows_per_request = max_rows_per_request;
  sl.q = batch.q;
  sl.heads = batch.heads;
  sl.h0 = h0;
  sl.nh = nh;
  sl.scores = scores;
  sl.max_blocks = max_blocks;
  sl.plan = plan;
  return sl;
}

// Exact selection of the nh heads of scores [rows, nh, max_blocks] into out [rows, out_heads, K]
// at head offset out_h0.
inline SelectLaunch select_launch(const RowsView& rows, const float* scores, int64_t max_blocks, int32_t nh,
                                  const SelectionParams& sel, int32_t* out, int32_t out_heads, int32_t out_h0) {
  SelectLaunch s;
  s.rows = rows;
  s.scores = scores;
  s.max_blocks = max_blocks;
  s.nh = nh;
  s.sel = sel;
  s.out = out;
  s.out_heads = out_heads;
  s.out_h0 = out_h0;
  return s;
}

// The publish of this rank's candidates of nh heads into its exchange record at `send`,
// block validity from the cache's layout and rank with `filter`, the step signature `sig` written
// at `signature` (null: none).
inline SelectLaunch publish_launch(const RowsView& rows, const float* scores, int64_t max_blocks, int32_t nh,
                                   const SelectionParams& sel, void* send, const CacheView& cache, BlockFilter filter,
                                   uint32_t* signature, const StepSignature& sig) {
  SelectLaunch pub;
  pub.rows = rows;
  pub.scores = scores;
  pub.max_blocks = max_blocks;
  pub.nh = nh;
  pub.sel = sel;
  pub.cands = static_cast<Candidate*>(send);
  pub.layout = cache.layout();
  pub.rank = cache.rank();
  pub.filter = filter;
  pub.signature = signature;
  pub.sig = sig;
  return pub;
}

// The record of the step signature in an exchange record at `record` (layout ex).
inline uint32_t* signature_in(void* record, const ExchangeLayout& ex) {
  return reinterpret_cast<uint32_t*>(static_cast<char*>(record) + ex.signature_offset);
}
inline const uint32_t* signature_in(const void* record, const ExchangeLayout& ex) {
  return reinterpret_cast<const uint32_t*>(static_cast<const char*>(record) + ex.signature_offset);
}

// The merge of the world ranks' records at `recv` (layout ex) for heads [h0, h0+nh) of `heads` into
// out [rows, out_heads, K] at head offset out_h0; every record's signature (at `signature`, null:
// unchecked) must equal `expect`, the verdict in *status (null: none).
inline MergeLaunch merge_launch(const RowsView& rows, const void* recv, const ExchangeLayout& ex, int32_t world,
                                int32_t heads, int32_t h0, int32_t nh, const SelectionParams& sel, int32_t* out,
                                int32_t out_heads, int32_t out_h0, const uint32_t* signature,
                                const StepSignature& expect, uint32_t* status) {
  MergeLaunch m;
  m.rows = rows;
  m.cands = static_cast<const Candidate*>(recv);
  m.world = world;
  m.heads = heads;
  m.h0 = h0;
  m.nh = nh;
  m.sel = sel;
  m.out = out;
  m.out_heads = out_heads;
  m.out_h0 = out_h0;
  m.rank_stride = static_cast<int64_t>(ex.record_bytes / sizeof(Candidate));
  m.signature = signature;
  m.expect = expect;
  m.status = status;
  return m;
}

/// The whole-page scorer rule: pages whose rank rows cover a whole 128-token block (R >= 128) are
/// scored by the stock scorer; at P = 256 with 2 shards (R = 128, a shard page is a whole stock
/// page) only when `p256_stock` (INDEXCP_P256_STOCK_DECODE; both scorers give identical bits).
inline bool whole_page_scorer(const PageLayout& l, bool p256_stock) {
  if (l.rows() < kBlockTokens) return false;
  return p256_stock || !(l.page_size == 256 && l.shards == 2);
}

}  // namespace indexcp::cuda::detail
