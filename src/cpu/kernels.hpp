// Internal CPU kernels shared by the replicated, ICP and gather paths. Not installed.
#pragma once

#include <functional>
#include <vector>

#include "indexcp/icp.hpp"
#include "indexcp/indexer.hpp"

namespace indexcp::cpu {

/// One unit of scoring work: rows [row_begin, row_end) of one request against one block.
struct WorkItem {
  int64_t row_begin, row_end;
  int32_t request;
  int64_t block;
};

/// Fills kbuf [n][128] (fp64) with the k_hat of the tokens of (request, block) that the source
/// holds and returns n (0: nothing stored).
using BlockSource = std::function<int(int32_t request, int64_t block, double* kbuf)>;

/// Splits rows into runs of one request (padding rows, pos < 0, are skipped): [begin, end).
std::vector<std::pair<int64_t, int64_t>> request_runs(const std::vector<QueryRow>& rows);

/// Throws Error unless `s` is consistently sized for `rows` and every live row's local block lies
/// below s.max_blocks (the preconditions of selection and publish on caller-built scores).
void check_scores(const BlockScores& s, const std::vector<QueryRow>& rows);

/// Allocates BlockScores for rows x nh x max_blocks, all invalid (-Inf).
BlockScores make_scores(int64_t rows, int32_t nh, int64_t max_blocks);

/// Decodes q rows, heads [h0, h0+nh) to fp64 [rows][nh][128].
std::vector<double> decode_q(const uint8_t* q, int64_t rows, int32_t heads, int32_t h0, int32_t nh);

/// Scores every item (parallel over items; each score written by exactly one thread).
void score_items(const std::vector<WorkItem>& items, const std::vector<QueryRow>& rows,
                 const std::vector<double>& qd, const BlockSource& source, BlockScores& out);

/// e4m3_decode of every byte, as fp64 (the FP8 key and staged-row decoder of the scorers).
const double* e4m3_table();

/// The exact dot product of indexer.md section 3 as this backend computes it (docs/decisions.md).
float dot128(const double* q, const double* k);

BlockScores score_blocks(const CacheView& cache, int32_t layer, const std::vector<QueryRow>& rows,
                         const int32_t* block_table, int32_t max_pages, const uint8_t* q,
                         int32_t heads, int32_t h0, int32_t nh, KRounding mode, BlockFilter filter);

void select_topk(const BlockScores& s, const std::vector<QueryRow>& rows, const SelectionParams& sel,
                 int32_t* out);

void publish(const BlockScores& s, const std::vector<QueryRow>& rows, const SelectionParams& sel,
             Candidate* out);

void merge(const Candidate* cands, int32_t world, const std::vector<QueryRow>& rows, int32_t heads,
           int32_t h0, int32_t nh, const SelectionParams& sel, int32_t* out);

}  // namespace indexcp::cpu
