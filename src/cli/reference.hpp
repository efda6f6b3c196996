// The fp32-key reference selection used by `indexcp run` for recall_vs_fp32.
#pragma once

#include <cstdint>
#include <vector>

namespace indexcp::cli {

/// Selection of an unquantized reference for the rows of one request at consecutive positions
/// pos0 .. pos0 + n - 1: for each row and head, score[b] = max over the 128 tokens of block b
/// (every historical block b < pos / 128) of dot(q, k) computed in double from the fp32 values,
/// then the selection rule of spec/indexer.md section 4 (the `topk - 1 - init` best blocks by
/// (score desc, id asc) among blocks init .. local-1, plus the forced blocks 0 .. init-1 and the
/// local block; ascending ids, -1 padding; all visible blocks when there are at most topk).
///   keys  fp32 [>= pos0 + n][128], the request's keys by position
///   q     fp32 [n][heads][128]
///   out   int32 [n][heads][topk]
void reference_select(const float* keys, const float* q, int64_t pos0, int64_t n, int32_t heads,
                      int32_t topk, int32_t init_blocks, int32_t* out);

/// |ref ∩ sel| / |ref| for one (row, head): both int32 [topk], ascending valid ids then -1.
double selection_recall(const int32_t* ref, const int32_t* sel, int32_t topk);

}  // namespace indexcp::cli
