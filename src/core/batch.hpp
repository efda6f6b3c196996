// Internal: the batch checks shared by every backend (src/core/batch.cpp owns batch validation;
// the public decode_rows / prefill_rows are in include/indexcp/indexer.hpp). Not installed.
#pragma once

#include <cstdint>
#include <vector>

#include "indexcp/indexer.hpp"

namespace indexcp::detail {

/// Throws the error of a NaN byte in q (E4M3, [rows, heads, 128]) at flat byte `index`: "q holds a
/// NaN byte at row r, head h, dim d" (kInvalidArgument), the one message of every q check.
[[noreturn]] void throw_q_nan(int64_t index, int32_t heads);

/// Throws Error (kInvalidArgument) unless 0 <= h0, 1 <= nh and h0 + nh <= heads (compared in
/// int64: no wrap for h0 or nh near INT32_MAX): "head range [h0, h0 + nh) is outside the N heads".
void check_head_range(int32_t heads, int32_t h0, int32_t nh);

/// prefill_rows without the check of q's bytes (q is only tested for null, never read): for a
/// caller that checks them elsewhere (the CUDA backend, on the GPU, where q lives).
std::vector<QueryRow> prefill_rows_metadata(const PrefillBatch& batch, int64_t num_pages, int32_t page_size);

}  // namespace indexcp::detail
