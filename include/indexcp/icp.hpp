// indexcp: indexer context parallelism (spec/indexer.md section 5), CPU backend:
// candidates, publish, merge, sharded decode, decode CP over a replicated cache, gather prefill
// (FP8 staging + all-gather within a byte budget) and local_score prefill.
#pragma once

#include <cstdint>
#include <vector>

#include "indexcp/comm.hpp"
#include "indexcp/indexer.hpp"

namespace indexcp {

/// One published candidate: 8 bytes, fp32 partial score then int32 block id (-1 = empty).
struct Candidate {
  float score;
  int32_t block;
};
static_assert(sizeof(Candidate) == 8, "candidate records are 8 bytes (indexer.md section 5)");

/// Publish (indexer.md section 5, step 2): for every (row, head) of `scores`, the
/// sel.ranked() best valid candidates among the non-forced historical blocks (init .. local-1),
/// ordered by (score desc, id asc), then empty entries. Rows with visible_blocks <= K publish
/// nothing (all empty). out [rows, scores.heads, sel.ranked()].
void publish_candidates(const BlockScores& scores, const std::vector<QueryRow>& rows,
                        const SelectionParams& sel, Candidate* out);

/// Merge (indexer.md section 5, step 4) for heads [h0, h0+nh) of `heads` published heads:
/// cands [world][rows][heads][sel.ranked()] as exchanged; out int32 [rows, nh, K] with the
/// output contract of section 4 (deduplicate by maximum, best ranked() by (score desc, id asc),
/// forced blocks added, ascending ids, -1 padding). Candidates with ids outside the row's
/// non-forced historical blocks are ignored (a corrupted peer cannot inject a future block).
void merge_candidates(const Candidate* cands, int32_t world, const std::vector<QueryRow>& rows,
                      int32_t heads, int32_t h0, int32_t nh, const SelectionParams& sel,
                      int32_t* out);

/// ICP decode over a sharded cache, one rank (indexer.md section 5): score all heads over this
/// rank's rows, publish, all-gather the candidates through `comm`, merge this rank's owned
/// heads (owned_heads(batch.heads, W, rank)). `shard` must have layout().shards == comm.world()
/// and rank() == comm.rank(). out int32 [rows, owned heads, K]. Every rank must call it with the
/// same batch. Exchanged bytes per rank: rows * heads * ranked() * 8.
void icp_decode(Communicator& comm, const CacheView& shard, int32_t layer,
                const DecodeBatch& batch, const SelectionParams& sel, KRounding mode,
                int32_t* out);

/// Decode CP over a replicated cache (`indexer_decode_cp`): rank r scores all heads over blocks
/// with b % W == r, then publish, exchange and merge as icp_decode. At W = 1 it equals
/// decode_select. out int32 [rows, owned heads, K].
void decode_cp_replicated(Communicator& comm, const CacheView& cache, int32_t layer,
                          const DecodeBatch& batch, const SelectionParams& sel, KRounding mode,
                          int32_t* out);

/// The FP8 staging primitive of the gather (indexer.md section 5): for each of `num_pages`
/// physical page ids, this rank's rows converted to E4M3 k_hat bytes: out uint8
/// [num_pages, rows(), 128]. NVFP4 -> e4m3_encode(e2m1 * e4m3 scale); FP8 copied. Any number of
/// pages per call. Errors: page id outside [0, num_pages) (names pages[i]), BF16 cache.
void stage_fp8(const CacheView& shard, int32_t layer, const int32_t* pages, int64_t num_pages,
               uint8_t* out);

/// What a gather prefill did.
struct GatherStats {
  int64_t reserved_bytes = 0;  ///< staging + gathered buffer bytes reserved per rank
                               ///< (`prefill_gather_reserved_bytes`)
  int64_t chunks = 0;          ///< chunks the batch was processed in
  int64_t pages = 0;           ///< (request, page) units gathered
  int64_t gathered_bytes = 0;  ///< FP8 bytes received per rank (128 per gathered token)
};

/// Bytes per (request, page) unit of the gather on one rank: staging rows()*128 plus gathered
/// P*128.
int64_t gather_unit_bytes(const PageLayout& layout);

/// Gather prefill, one rank (indexer.md section 5): pages of each request's historical blocks
/// are staged to FP8 and all-gathered in chunks whose transient (staging + gathered) fits
/// `budget_bytes`; each rank then scores its owned heads over the full FP8 keys like an
/// unsharded FP8 cache and selects. out int32 [rows, owned heads, K]. Errors: budget_bytes below
/// one unit (names indexer_prefill_gather_budget_mib), shard/comm mismatch, batch errors.
GatherStats prefill_gather(Communicator& comm, const CacheView& shard, int32_t layer,
                           const PrefillBatch& batch, const SelectionParams& sel,
                           int64_t budget_bytes, int32_t* out);

/// local_score prefill, one rank: score all heads over this rank's rows (E4M3-rounded NVFP4),
/// publish, exchange, merge owned heads. out int32 [rows, owned heads, K].
void prefill_local_score(Communicator& comm, const CacheView& shard, int32_t layer,
                         const PrefillBatch& batch, const SelectionParams& sel, int32_t* out);

}  // namespace indexcp
