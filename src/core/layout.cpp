// Page-layout validation (spec/formats.md sections 6-7, spec/indexer.md section 1).
#include "indexcp/layout.hpp"

#include "indexcp/error.hpp"

namespace indexcp {

PageLayout make_page_layout(KvDtype dtype, int page_size, int shards, int64_t page_stride) {
  check_kv_dtype(dtype, "dtype");
  if (page_size != 128 && page_size != 256)
    throw Error(ErrorCode::kUnsupported, "page_size = " + std::to_string(page_size) +
                                             " is not supported; use 128 or 256");
  if (shards < 1 || shards > 16 || (shards & (shards - 1)) != 0)
    throw Error(ErrorCode::kUnsupported,
                "shards = " + std::to_string(shards) + " is not supported; use 1, 2, 4, 8 or 16");
  if (shards > 1 && dtype == KvDtype::kBf16)
    throw Error(ErrorCode::kUnsupported,
                "shards = " + std::to_string(shards) +
                    " with a bf16 index cache: bf16 is never sharded; use fp8 or nvfp4");
  if ((page_size / shards) % 16 != 0)
    throw Error(ErrorCode::kUnsupported,
                "shards = " + std::to_string(shards) + " at page_size = " +
                    std::to_string(page_size) + " gives " + std::to_string(page_size / shards) +
                    " rows per rank; rows per rank must be a multiple of 16");
  PageLayout l;
  l.dtype = dtype;
  l.page_size = page_size;
  l.shards = shards;
  l.page_stride = page_stride == 0 ? l.page_bytes() : page_stride;
  if (l.page_stride < l.page_bytes() || l.page_stride % 16 != 0)
    throw Error(ErrorCode::kInvalidArgument,
                "page_stride = " + std::to_string(page_stride) + " must be >= the page bytes (" +
                    std::to_string(l.page_bytes()) + ") and a multiple of 16");
  return l;
}

void check_heads_tp(int heads, int world) {
  if (heads < 1 || heads > 64)
    throw Error(ErrorCode::kInvalidArgument,
                "heads = " + std::to_string(heads) + " is out of range 1..64");
  if (world < 1)
    throw Error(ErrorCode::kInvalidArgument, "tp = " + std::to_string(world) + " must be >= 1");
  if (heads % world != 0 && world % heads != 0)
    throw Error(ErrorCode::kUnsupported, "heads = " + std::to_string(heads) + " and tp = " +
                                             std::to_string(world) +
                                             " do not divide one another (indexer.md section 1)");
}

}  // namespace indexcp
