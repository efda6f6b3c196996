// indexcp: block scores and exact top-k selection (spec/indexer.md sections 3-4), CPU backend.
#pragma once

#include <cstdint>
#include <vector>

#include "indexcp/cache.hpp"

namespace indexcp {

/// Top-k selection parameters (indexer.md sections 1 and 4).
struct SelectionParams {
  int32_t topk = 16;         ///< K: ids per (row, head)
  int32_t init_blocks = 0;   ///< forced sink blocks 0 .. init-1; 0 <= init <= K-2
  int32_t local_blocks = 1;  ///< must be 1: the query's own block is forced
  /// Ranked slots: K - 1 - init (also the candidates each rank publishes in ICP).
  int32_t ranked() const { return topk - 1 - init_blocks; }
  /// Throws Error naming topk / init_blocks / local_blocks when out of range (topk 2..1024).
  void validate() const;
};

/// One decode step's batch (indexer.md sections 3 and 7). All pointers are host memory.
///   q            uint8 [num_requests * query_len, heads, 128], E4M3 bytes (no NaN bytes)
///   block_table  int32 [num_requests, max_pages] physical page ids; the first ceil(seq_len/P)
///                entries of a request must lie in [0, num_pages); later entries are ignored
///   seq_lens     int32 [num_requests], KV length including this step's tokens; 0 = padding
///   query_len    Q in 1..16; row b*Q + i is at position seq_len[b] - Q + i
struct DecodeBatch {
  const uint8_t* q = nullptr;
  int32_t heads = 4;
  const int32_t* block_table = nullptr;
  int32_t num_requests = 0;
  int32_t max_pages = 0;
  const int32_t* seq_lens = nullptr;
  int32_t query_len = 1;
  /// num_requests * query_len (0 when either is not positive).
  int64_t rows() const {
    return (num_requests <= 0 || query_len <= 0) ? 0 : static_cast<int64_t>(num_requests) * query_len;
  }
};

/// One prefill batch. Like DecodeBatch, but request b has a chunk of T_b = query_start[b+1] -
/// query_start[b] new tokens (T_b <= seq_len[b]); row query_start[b] + i is at position
/// seq_len[b] - T_b + i. query_start int32 [num_requests + 1], [0] = 0, non-decreasing.
struct PrefillBatch {
  const uint8_t* q = nullptr;
  int32_t heads = 4;
  const int32_t* block_table = nullptr;
  int32_t num_requests = 0;
  int32_t max_pages = 0;
  const int32_t* seq_lens = nullptr;
  const int32_t* query_start = nullptr;
  /// query_start[num_requests] (0 when query_start is null or num_requests <= 0).
  int64_t rows() const {
    return (num_requests <= 0 || query_start == nullptr) ? 0 : query_start[num_requests];
  }
};

/// A query row: the request it belongs to and its absolute position (-1: padding, selects
/// nothing). Rows of one request are contiguous.
struct QueryRow {
  int32_t request;
  int64_t pos;
};

/// Validates a decode batch against a cache's page count and page size, then lists its rows.
/// Errors name the argument: q (null / NaN byte at row, head, dim), heads (1..64), query_len
/// (1..16), seq_lens[b] (< 0, 0 < seq_len < query_len, more pages than max_pages),
/// block_table[b][i] (outside [0, num_pages)).
std::vector<QueryRow> decode_rows(const DecodeBatch& batch, int64_t num_pages, int32_t page_size);

/// Same for a prefill batch (query_start checked: [0] = 0, non-decreasing, T_b <= seq_len[b]).
std::vector<QueryRow> prefill_rows(const PrefillBatch& batch, int64_t num_pages,
                                   int32_t page_size);

/// Visible blocks n = pos / 128 + 1 of a row (indexer.md section 4); 0 for padding.
inline int64_t visible_blocks(const QueryRow& r) { return r.pos < 0 ? 0 : r.pos / kBlockTokens + 1; }

/// Block scores of rows x heads x blocks (indexer.md section 3). score[(row*nh + h)*max_blocks
/// + b]; valid[] says whether the score exists (the block is historical for the row, passes the
/// block filter and, on a shard, has rows on this rank). Invalid entries hold -Inf.
struct BlockScores {
  int64_t rows = 0;
  int32_t heads = 0;       ///< heads scored (a contiguous range of the batch's heads)
  int64_t max_blocks = 0;  ///< max_pages * P / 128
  std::vector<float> score;
  std::vector<uint8_t> valid;
  float at(int64_t row, int32_t h, int64_t b) const { return score[(row * heads + h) * max_blocks + b]; }
};

/// Which blocks a scorer scores: those with b % modulus == residue (decode CP over a replicated
/// cache, indexer.md section 5); {1, 0} scores all.
struct BlockFilter {
  int32_t modulus = 1;
  int32_t residue = 0;
};

/// Scores rows against one rank's cache (replicated or shard): for every row, head in
/// [h0, h0 + nh) and historical block b < pos/128 passing `filter`, the maximum over the tokens
/// of block b stored on this rank of sum_d q[row][h][d] * k_hat[token][d] (indexer.md sections
/// 2-3, 5.1). q uint8 E4M3 [rows, heads, 128].
///
/// `rows` must come from decode_rows / prefill_rows of a batch using this block_table (request
/// indices are trusted); each live row's local block must lie below max_pages * P / 128 and the
/// block-table entries of its historical blocks in [0, num_pages), else Error naming the row.
/// The result holds rows x nh x max_pages*P/128 fp32 + bytes: Error (kRuntime) beyond 2^31
/// entries or when the allocation fails.
///
/// Arithmetic (docs/decisions.md): every product q*k_hat is exact and the sum over d is formed
/// exactly in fp64 (for FP8/NVFP4 keys all 128 products are multiples of 2^-19 below 2^28) then
/// rounded once to fp32, so a (query, head, token) dot product is bit-identical on every CPU scorer and does
/// not depend on summation order or thread count. A NaN dot product is ignored by the block max.
BlockScores score_blocks(const CacheView& cache, int32_t layer, const std::vector<QueryRow>& rows,
                         const int32_t* block_table, int32_t max_pages, const uint8_t* q,
                         int32_t heads, int32_t h0, int32_t nh, KRounding mode,
                         BlockFilter filter = {});

/// The total order on scores used by every selection (indexer.md section 3): -0.0 == +0.0, NaN
/// equal to NaN and below every number. Returns true when a ranks strictly below b.
inline bool score_below(float a, float b) {
  if (fmt::is_nan(a)) return !fmt::is_nan(b);
  if (fmt::is_nan(b)) return false;
  return a < b;
}
/// (score desc, id asc): true when candidate (sa, ia) is better than (sb, ib).
inline bool candidate_better(float sa, int32_t ia, float sb, int32_t ib) {
  if (score_below(sb, sa)) return true;
  if (score_below(sa, sb)) return false;
  return ia < ib;
}

/// Selection from complete scores (indexer.md section 4): out int32 [rows, nh, K], ascending ids
/// then -1. Every historical block of every row must have a score (rows as for score_blocks;
/// Error when a row's local block is beyond scores.max_blocks or the sizes disagree).
void select_topk(const BlockScores& scores, const std::vector<QueryRow>& rows,
                 const SelectionParams& sel, int32_t* out);

/// Replicated decode (one rank's owned heads, or any head range): score heads [h0, h0+nh) of a
/// replicated cache and select. out int32 [rows, nh, K]. Errors: see decode_rows; the cache must
/// not be sharded (Error naming cache); h0/nh must lie within batch.heads.
void decode_select(const CacheView& cache, int32_t layer, const DecodeBatch& batch, int32_t h0,
                   int32_t nh, const SelectionParams& sel, KRounding mode, int32_t* out);

/// Replicated prefill: like decode_select on prefill rows; NVFP4 keys are always scored with
/// E4M3 rounding (indexer.md section 2). out int32 [rows, nh, K].
void prefill_select(const CacheView& cache, int32_t layer, const PrefillBatch& batch, int32_t h0,
                    int32_t nh, const SelectionParams& sel, int32_t* out);

}  // namespace indexcp
