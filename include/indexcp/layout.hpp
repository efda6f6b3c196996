// indexcp: page and rank-shard geometry (spec/formats.md sections 6-7).
//
// The single owner of slot -> (owner rank, local row) and of every byte offset inside a page.
// The writer, the scorers, the staging of the gather and the tests all call these accessors.
// All offsets are 64-bit. Everything is inline __host__ __device__ so CUDA kernels use it too.
#pragma once

#include <cstdint>

#include "indexcp/formats.hpp"

namespace indexcp {

/// Geometry of one rank's pages of one layer.
///
/// A page holds `page_size` (P) consecutive token positions of one request. With `shards` (W)
/// ranks sharing a page, each stores `rows = P / W` of them: page offset u belongs to rank
/// u / rows at local row u % rows. A rank's shard page is laid out like a page of `rows` rows:
///   NVFP4: rows*64 data bytes (row-major) then rows*8 scale bytes; FP8: rows*128; BF16: rows*256.
/// `page_stride` (bytes between consecutive physical pages) >= page_bytes(), multiple of 16.
struct PageLayout {
  KvDtype dtype = KvDtype::kNvfp4;
  int32_t page_size = 128;   ///< P, tokens per page (128 or 256)
  int32_t shards = 1;        ///< W_shard: 1 for a replicated cache, else the TP size
  int64_t page_stride = 0;   ///< bytes; 0 in make_page_layout means "= page_bytes()"

  /// Rows one rank stores of each page: P / W.
  INDEXCP_HD int32_t rows() const { return page_size / shards; }
  /// Bytes of one rank's shard page: rows * key_bytes(dtype).
  INDEXCP_HD int64_t page_bytes() const {
    return static_cast<int64_t>(rows()) * key_bytes(dtype);
  }
  /// Rank that stores page offset u (0 <= u < P).
  INDEXCP_HD int32_t owner_of_offset(int32_t u) const { return u / rows(); }
  /// Local row of page offset u on its owner rank.
  INDEXCP_HD int32_t local_row_of_offset(int32_t u) const { return u % rows(); }
  /// Page offset of local row j on rank r (inverse of the two above).
  INDEXCP_HD int32_t offset_of_local_row(int32_t rank, int32_t j) const {
    return rank * rows() + j;
  }
  /// Byte offset of a physical page from the start of the layer region.
  INDEXCP_HD int64_t page_offset(int64_t page) const { return page * page_stride; }
  /// Byte offset, within a shard page, of local row j's key data (NVFP4: 64 packed bytes;
  /// FP8: 128 bytes; BF16: 256 bytes).
  INDEXCP_HD int64_t row_data_offset(int32_t j) const {
    return static_cast<int64_t>(j) *
           (dtype == KvDtype::kNvfp4 ? kNvfp4DataBytesPerKey : key_bytes(dtype));
  }
  /// Byte offset, within a shard page, of local row j's 8 NVFP4 scale bytes (NVFP4 only).
  INDEXCP_HD int64_t row_scale_offset(int32_t j) const {
    return static_cast<int64_t>(rows()) * kNvfp4DataBytesPerKey +
           static_cast<int64_t>(j) * kNvfp4ScalesPerKey;
  }

  /// Selection blocks (128 tokens) per page: P / 128.
  INDEXCP_HD int32_t blocks_per_page() const { return page_size / kBlockTokens; }
  /// Local rows [*first, *first + *count) of rank r that hold block b's tokens, and the logical
  /// page that holds block b. *count is 0 when rank r stores nothing of block b.
  INDEXCP_HD void block_rows_on_rank(int64_t b, int32_t rank, int64_t* logical_page,
                                     int32_t* first, int32_t* count) const {
    const int64_t start = b * kBlockTokens;  // first position of block b
    *logical_page = start / page_size;
    const int32_t u0 = static_cast<int32_t>(start % page_size);  // block's first page offset
    const int32_t lo = rank * rows(), hi = lo + rows();          // rank's page offsets
    const int32_t a = u0 > lo ? u0 : lo;
    const int32_t e = (u0 + kBlockTokens) < hi ? (u0 + kBlockTokens) : hi;
    *first = a - lo;
    *count = e > a ? e - a : 0;
  }
};

/// Builds and validates a PageLayout: dtype sharded only for FP8/NVFP4, page_size in {128, 256},
/// shards in {1, 2, 4, 8, 16} with rows = P / W a multiple of 16, page_stride 0 (meaning
/// page_bytes()) or >= page_bytes() and a multiple of 16. Throws Error naming the argument.
PageLayout make_page_layout(KvDtype dtype, int page_size, int shards, int64_t page_stride = 0);

/// Where one slot of the slot mapping lands (spec/indexer.md section 6): physical page slot / P,
/// page offset slot % P, owner rank and local row from the layout.
struct SlotLocation {
  int64_t page;
  int32_t offset;
  int32_t rank;
  int32_t row;
};
INDEXCP_HD SlotLocation locate_slot(const PageLayout& l, int64_t slot) {
  SlotLocation s;
  s.page = slot / l.page_size;
  s.offset = static_cast<int32_t>(slot % l.page_size);
  s.rank = l.owner_of_offset(s.offset);
  s.row = l.local_row_of_offset(s.offset);
  return s;
}

/// Index heads owned by rank r of W (indexer.md section 1): [*h0, *h0 + *count).
/// W <= H: heads r*H/W .. (r+1)*H/W - 1; W > H: the single head floor(r*H/W).
/// Requires H % W == 0 or W % H == 0 (validated by check_heads_tp).
INDEXCP_HD void owned_heads(int32_t heads, int32_t world, int32_t rank, int32_t* h0,
                            int32_t* count) {
  if (world <= heads) {
    *h0 = rank * heads / world;
    *count = heads / world;
  } else {
    *h0 = rank * heads / world;
    *count = 1;
  }
}

/// Throws Error unless H and W divide one another (H >= 1, W >= 1).
void check_heads_tp(int heads, int world);

}  // namespace indexcp
