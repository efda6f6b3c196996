// indexcp: a non-owning view of one rank's paged index cache (spec/formats.md sections 6-7),
// over memory the library did not allocate (docs/embedding.md).
//
// An engine allocates the index cache inside its own KV-cache pool (one tensor per layer, one for
// every layer, a slice at an offset inside a larger pool) and hands the library a CacheView. Every
// entry point that reads or writes a cache takes one; IndexCache (host) and cuda::DeviceCache
// (device) are owners that hand out views of themselves (view(), or the implicit conversion).
//
// Addressing: layer l starts at layer_ptr(l) (base + l * layer_stride, or the caller's per-layer
// pointer array); physical page p of a layer starts page_stride bytes after page p - 1
// (layout.page_offset); inside a page the rows are laid out as PageLayout documents. A view is
// shallow, like std::span: a const CacheView still writes through its pointers.
#pragma once

#include <cstdint>
#include <string>

#include "indexcp/error.hpp"
#include "indexcp/layout.hpp"

namespace indexcp {

/// Where a view's bytes live: host memory (the CPU backend) or device memory of the current
/// CUDA device (the CUDA backend). Each backend refuses a view of the other kind by name.
enum class MemoryLocation : int32_t { kHost = 0, kDevice = 1 };

/// "host" | "device".
const char* to_string(MemoryLocation m);

/// Alignment (bytes) of every base pointer, per-layer pointer, page stride and layer stride.
inline constexpr int64_t kCacheAlignment = 16;
/// The most bytes one view may span (all layers, strides included): 2^56, far beyond any memory,
/// so that no address computation of a valid view can overflow.
inline constexpr int64_t kMaxViewBytes = int64_t{1} << 56;

/// Bytes one layer region of `num_pages` pages of `layout` must hold: (num_pages - 1) *
/// page_stride + page_bytes() (the last page need not be padded to the stride). Allocate at least
/// this much per layer. Throws Error naming num_pages (1..2^31-1) or page_stride when the size
/// exceeds kMaxViewBytes; the layout is validated (make_page_layout).
int64_t cache_layer_bytes(const PageLayout& layout, int64_t num_pages);

/// One rank's index cache: `num_layers` layer regions of `num_pages` physical pages each.
/// Build it with make_cache_view or make_cache_view_layers (they validate); a default-constructed
/// view is empty (num_layers() == 0) and refused by every entry point.
class CacheView {
 public:
  CacheView() = default;

  const PageLayout& layout() const { return layout_; }
  int64_t num_pages() const { return num_pages_; }
  int32_t num_layers() const { return num_layers_; }
  int32_t rank() const { return rank_; }
  MemoryLocation location() const { return location_; }
  /// Bytes between layer l and layer l + 1 (0 when the view holds per-layer pointers).
  int64_t layer_stride() const { return layer_ptrs_ ? 0 : layer_stride_; }
  /// Bytes of one layer region that the geometry addresses: (num_pages - 1) * page_stride +
  /// page_bytes(). A layer's allocation must hold at least this many bytes.
  int64_t layer_bytes() const {
    return num_pages_ <= 0 ? 0 : (num_pages_ - 1) * layout_.page_stride + layout_.page_bytes();
  }
  /// The per-layer pointer array (host memory, [num_layers]) or nullptr.
  uint8_t* const* layer_ptrs() const { return layer_ptrs_; }
  /// Start of layer `layer`'s region (no check; layer in [0, num_layers)).
  uint8_t* layer_ptr(int32_t layer) const {
    return layer_ptrs_ ? layer_ptrs_[layer] : base_ + static_cast<int64_t>(layer) * layer_stride_;
  }
  /// Start of physical page `page` of `layer` (no check).
  uint8_t* page_ptr(int32_t layer, int64_t page) const {
    return layer_ptr(layer) + layout_.page_offset(page);
  }

 private:
  friend CacheView make_cache_view(const PageLayout&, void*, int64_t, int32_t, int32_t, int64_t,
                                   MemoryLocation);
  friend CacheView make_cache_view_layers(const PageLayout&, uint8_t* const*, int64_t, int32_t,
                                          int32_t, MemoryLocation);
  PageLayout layout_;
  uint8_t* base_ = nullptr;
  uint8_t* const* layer_ptrs_ = nullptr;
  int64_t layer_stride_ = 0;
  int64_t num_pages_ = 0;
  int32_t num_layers_ = 0;
  int32_t rank_ = 0;
  MemoryLocation location_ = MemoryLocation::kHost;
};

/// A view of `num_layers` layer regions spaced `layer_stride` bytes apart from `base`
/// (layer_stride 0 means num_pages * layout.page_stride, the packed form IndexCache uses).
/// `layout` is re-validated (make_page_layout); page_stride 0 means page_bytes().
/// Throws Error (kInvalidArgument) naming the argument: base null or not 16-byte aligned;
/// num_pages outside 1..2^31-1; num_layers outside 1..4096; rank outside [0, shards);
/// layer_stride negative, not a multiple of 16, or (num_layers > 1) smaller than layer_bytes(),
/// so that two layers' pages would overlap; the whole view spanning more than kMaxViewBytes or
/// wrapping the address space; location not an enumerator.
CacheView make_cache_view(const PageLayout& layout, void* base, int64_t num_pages,
                          int32_t num_layers, int32_t rank, int64_t layer_stride,
                          MemoryLocation location);

/// A view whose layer l starts at layer_ptrs[l] (a HOST array of num_layers pointers into host or
/// device memory, kept alive by the caller for as long as the view is used; the array is read at
/// each call, never by a kernel). Errors as make_cache_view, naming layer_ptrs[l] for a null or
/// misaligned entry, or two entries whose layer regions (layer_bytes() each) overlap.
CacheView make_cache_view_layers(const PageLayout& layout, uint8_t* const* layer_ptrs,
                                 int64_t num_pages, int32_t num_layers, int32_t rank,
                                 MemoryLocation location);

/// Throws Error naming `what` unless `view` is a non-empty view located at `where`
/// ("cache is a host view (location = host); the CUDA backend needs device memory").
void check_cache_view(const CacheView& view, MemoryLocation where, const std::string& what);

/// Throws Error naming `layer` unless 0 <= layer < view.num_layers().
void check_view_layer(const CacheView& view, int32_t layer);

}  // namespace indexcp
