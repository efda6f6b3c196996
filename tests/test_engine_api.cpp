// The engine API of the CPU backend (docs/embedding.md): cache views over caller memory, the
// asynchronous insert and Q cast with their status, the RoPE table, and the device rule.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <climits>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "indexcp/cache.hpp"
#include "indexcp/cache_view.hpp"
#include "indexcp/cuda.hpp"
#include "indexcp/indexer.hpp"
#include "util.hpp"

namespace {

using namespace indexcp;
using testutil::error_of;

std::vector<float> random_keys(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> k(static_cast<size_t>(n) * kHeadDim);
  for (auto& v : k) v = nd(rng);
  return k;
}

// Distinct random slots of [0, num_slots), some -1.
std::vector<int64_t> random_slots(int64_t n, int64_t num_slots, uint32_t seed) {
  std::vector<int64_t> all(static_cast<size_t>(num_slots));
  for (int64_t i = 0; i < num_slots; ++i) all[i] = i;
  std::mt19937 rng(seed);
  std::shuffle(all.begin(), all.end(), rng);
  std::vector<int64_t> s(all.begin(), all.begin() + n);
  for (int64_t i = 0; i < n; i += 7) s[i] = -1;
  return s;
}

// A pool of host memory, 16-byte aligned, filled with a sentinel byte.
struct Pool {
  std::vector<uint8_t> raw;
  uint8_t* base = nullptr;
  explicit Pool(size_t bytes, uint8_t fill = 0xA5) : raw(bytes + 64, fill) {
    base = raw.data() + (16 - reinterpret_cast<uintptr_t>(raw.data()) % 16) % 16;
  }
};

struct Geometry {
  KvDtype dtype;
  int32_t P, W, rank;
  int64_t extra_page_stride;  // bytes added to page_bytes (multiple of 16)
  int64_t offset;             // view base offset inside the pool (multiple of 16)
  int64_t layer_gap;          // bytes between one layer's last page and the next layer (multiple of 16)
};

// Inserting through a view with unusual strides and offsets writes the bytes the owning cache
// writes, at the view's addresses, and nothing outside its pages' rows.
TEST(CacheView, InsertThroughStridedViewsEqualsTheOwningCache) {
  const std::vector<Geometry> geos = {
      {KvDtype::kNvfp4, 128, 1, 0, 0, 0, 0},        {KvDtype::kNvfp4, 128, 2, 1, 48, 4096 + 16, 160},
      {KvDtype::kNvfp4, 256, 4, 2, 16, 32, 16},     {KvDtype::kFp8, 128, 2, 0, 112, 1024, 0},
      {KvDtype::kFp8, 256, 1, 0, 16, 16, 4096},     {KvDtype::kBf16, 128, 1, 0, 32, 48, 48},
  };
  const int64_t num_pages = 9;
  const int32_t layers = 3;
  for (const Geometry& g : geos) {
    const PageLayout packed = make_page_layout(g.dtype, g.P, g.W);
    const PageLayout strided = make_page_layout(g.dtype, g.P, g.W, packed.page_bytes() + g.extra_page_stride);
    IndexCache ref(packed, num_pages, layers, g.rank);
    const int64_t layer_bytes = (num_pages - 1) * strided.page_stride + strided.page_bytes();
    const int64_t layer_stride = layer_bytes + g.layer_gap + (16 - layer_bytes % 16) % 16;
    Pool pool(static_cast<size_t>(g.offset + layer_stride * layers));
    for (int32_t layer = 0; layer < layers; ++layer)  // the pages start zeroed, the gaps hold 0xA5
      for (int64_t p = 0; p < num_pages; ++p)
        std::memset(pool.base + g.offset + layer * layer_stride + p * strided.page_stride, 0,
                    static_cast<size_t>(packed.page_bytes()));
    const std::vector<uint8_t> untouched = pool.raw;
    const CacheView v = make_cache_view(strided, pool.base + g.offset, num_pages, layers, g.rank,
                                        layer_stride, MemoryLocation::kHost);
    const int64_t n = 300;
    const auto keys = random_keys(n, 7u + g.P);
    for (int32_t layer = 0; layer < layers; ++layer) {
      const auto slots = random_slots(n, num_pages * g.P, 11u * (layer + 1));
      insert_keys(ref, layer, keys.data(), slots.data(), n);
      insert_keys(v, layer, keys.data(), slots.data(), n);
    }
    const std::string tag = to_string(g.dtype) + " P" + std::to_string(g.P) + " W" + std::to_string(g.W);
    // every row of every page equal; every byte outside the pages' row bytes untouched
    std::vector<uint8_t> expect = untouched;
    const ptrdiff_t shift = pool.base - pool.raw.data();
    for (int32_t layer = 0; layer < layers; ++layer)
      for (int64_t p = 0; p < num_pages; ++p) {
        const uint8_t* src = ref.page_ptr(layer, p);
        uint8_t* dst = expect.data() + shift + g.offset + layer * layer_stride + p * strided.page_stride;
        std::memcpy(dst, src, static_cast<size_t>(packed.page_bytes()));
        for (int32_t row = 0; row < packed.rows(); ++row)
          ASSERT_EQ(read_row_bytes(ref, layer, p, row), read_row_bytes(v, layer, p, row)) << tag;
      }
    EXPECT_TRUE(expect == pool.raw) << tag << ": bytes outside the rows differ or a row differs";
  }
}

// A view of separately allocated layers (per-layer pointers) addresses each layer's own memory.
TEST(CacheView, PerLayerPointersAddressTheirOwnAllocations) {
  const PageLayout l = make_page_layout(KvDtype::kNvfp4, 128, 2, 4800);
  const int64_t num_pages = 5;
  std::vector<Pool> layers;
  for (int i = 0; i < 4; ++i) layers.emplace_back(static_cast<size_t>(num_pages * l.page_stride), 0);
  std::vector<uint8_t*> ptrs;
  for (auto& p : layers) ptrs.push_back(p.base);
  const CacheView v = make_cache_view_layers(l, ptrs.data(), num_pages, 4, 1, MemoryLocation::kHost);
  EXPECT_EQ(v.layer_stride(), 0);
  IndexCache ref(make_page_layout(KvDtype::kNvfp4, 128, 2), num_pages, 4, 1);
  const auto keys = random_keys(200, 3);
  for (int32_t layer = 0; layer < 4; ++layer) {
    const auto slots = random_slots(200, num_pages * 128, 5u + layer);
    insert_keys(v, layer, keys.data(), slots.data(), 200);
    insert_keys(ref, layer, keys.data(), slots.data(), 200);
    EXPECT_EQ(v.layer_ptr(layer), ptrs[layer]);
    for (int64_t p = 0; p < num_pages; ++p)
      EXPECT_EQ(0, std::memcmp(v.page_ptr(layer, p), ref.page_ptr(layer, p), static_cast<size_t>(l.page_bytes())));
  }
}

TEST(CacheView, BadViewsAreRefusedByName) {
  const PageLayout l = make_page_layout(KvDtype::kNvfp4, 128, 2);
  Pool pool(1 << 20);
  uint8_t* b = pool.base;
  auto msg = [&](const std::function<void()>& f) { return error_of(f); };
  EXPECT_NE(msg([&] { make_cache_view(l, nullptr, 4, 1, 0, 0, MemoryLocation::kHost); }).find("base is null"),
            std::string::npos);
  EXPECT_NE(msg([&] { make_cache_view(l, b + 8, 4, 1, 0, 0, MemoryLocation::kHost); }).find("base = "),
            std::string::npos);
  EXPECT_NE(msg([&] { make_cache_view(l, b + 8, 4, 1, 0, 0, MemoryLocation::kHost); }).find("16-byte aligned"),
            std::string::npos);
  EXPECT_NE(msg([&] { make_cache_view(l, b, 0, 1, 0, 0, MemoryLocation::kHost); }).find("num_pages = 0"),
            std::string::npos);
  EXPECT_NE(msg([&] { make_cache_view(l, b, 4, 0, 0, 0, MemoryLocation::kHost); }).find("num_layers = 0"),
            std::string::npos);
  EXPECT_NE(msg([&] { make_cache_view(l, b, 4, 1, 2, 0, MemoryLocation::kHost); }).find("rank = 2"),
            std::string::npos);
  EXPECT_NE(msg([&] { make_cache_view(l, b, 4, 2, 0, 24, MemoryLocation::kHost); }).find("layer_stride = 24"),
            std::string::npos);
  // smaller than one layer's pages: layers would overlap
  EXPECT_NE(msg([&] { make_cache_view(l, b, 4, 2, 0, 3 * l.page_stride, MemoryLocation::kHost); })
                .find("layers would overlap"),
            std::string::npos);
  PageLayout odd = l;
  odd.page_stride = l.page_bytes() + 8;
  EXPECT_NE(msg([&] { make_cache_view(odd, b, 4, 1, 0, 0, MemoryLocation::kHost); }).find("page_stride"),
            std::string::npos);
  EXPECT_NE(msg([&] { make_cache_view(l, b, 4, 1, 0, 0, static_cast<MemoryLocation>(7)); }).find("location = 7"),
            std::string::npos);
  std::vector<uint8_t*> ptrs = {b, nullptr};
  EXPECT_NE(msg([&] { make_cache_view_layers(l, ptrs.data(), 4, 2, 0, MemoryLocation::kHost); })
                .find("layer_ptrs[1] is null"),
            std::string::npos);
  ptrs[1] = b + 4;
  EXPECT_NE(msg([&] { make_cache_view_layers(l, ptrs.data(), 4, 2, 0, MemoryLocation::kHost); })
                .find("layer_ptrs[1] = "),
            std::string::npos);
  // sizes that would overflow the address computations (an engine's bug, or a hostile value)
  const PageLayout big = make_page_layout(KvDtype::kNvfp4, 128, 1, int64_t{1} << 33);
  EXPECT_NE(msg([&] { make_cache_view(big, b, (int64_t{1} << 31) - 1, 2, 0, 16, MemoryLocation::kHost); })
                .find("exceeds the 2^56 bytes a view may span"),
            std::string::npos);
  EXPECT_NE(msg([&] {
              make_cache_view(l, b, 4, 4, 0, (INT64_MAX / 2) & ~int64_t{15}, MemoryLocation::kHost);
            }).find("layer_stride = "),
            std::string::npos);
  uint8_t* top = reinterpret_cast<uint8_t*>(~uintptr_t{0} - 4095);  // 16-aligned, 4 KiB below the end (never read)
  EXPECT_NE(msg([&] { make_cache_view(l, top, 4, 2, 0, int64_t{1} << 20, MemoryLocation::kHost); })
                .find("wraps the address space"),
            std::string::npos);
  // per-layer pointers whose layers overlap (aliasing, or closer than one layer's bytes)
  std::vector<uint8_t*> same = {b, b, b};
  EXPECT_NE(msg([&] { make_cache_view_layers(l, same.data(), 4, 3, 0, MemoryLocation::kHost); })
                .find("overlap"),
            std::string::npos);
  const int64_t lb = cache_layer_bytes(l, 4);
  EXPECT_EQ(lb, 3 * l.page_stride + l.page_bytes());
  std::vector<uint8_t*> close = {b + lb + 16, b};  // more than one layer apart: fine
  EXPECT_NO_THROW(make_cache_view_layers(l, close.data(), 4, 2, 0, MemoryLocation::kHost));
  close[0] = b + lb - 16;
  EXPECT_NE(msg([&] { make_cache_view_layers(l, close.data(), 4, 2, 0, MemoryLocation::kHost); })
                .find("layer_ptrs[1] and layer_ptrs[0] overlap"),
            std::string::npos);
  EXPECT_NE(msg([&] { (void)cache_layer_bytes(l, 0); }).find("num_pages = 0"), std::string::npos);
  // the CPU backend refuses a device view and an empty one, naming the argument
  const CacheView dev = make_cache_view(l, b, 4, 1, 0, 0, MemoryLocation::kDevice);
  const auto keys = random_keys(1, 1);
  const int64_t slot = 0;
  EXPECT_NE(msg([&] { insert_keys(dev, 0, keys.data(), &slot, 1); }).find("cache is a device view"),
            std::string::npos);
  EXPECT_NE(msg([&] { (void)read_row_bytes(dev, 0, 0, 0); }).find("cache is a device view"), std::string::npos);
  EXPECT_NE(msg([&] { insert_keys(CacheView{}, 0, keys.data(), &slot, 1); }).find("cache is an empty view"),
            std::string::npos);
  const CacheView host = make_cache_view(l, b, 4, 1, 0, 0, MemoryLocation::kHost);
  EXPECT_NE(msg([&] { insert_keys(host, 1, keys.data(), &slot, 1); }).find("layer = 1 is outside [0, 1)"),
            std::string::npos);
}

// ---- asynchronous insert ---------------------------------------------------------------------

struct AsyncCase {
  std::string name;
  std::function<void(std::vector<float>&, std::vector<int64_t>&, std::vector<int64_t>&)> spoil;
  InsertRefusal reason;
};

// Each kind of bad token: the status names it as the synchronous call's Error does, the batch
// writes nothing, and the status is sticky (a later refused call leaves the first one's details
// and adds to the counts; a later good call writes).
TEST(InsertAsync, StatusReportsEachRefusalAsTheSynchronousCallAndWritesNothing) {
  const PageLayout l = make_page_layout(KvDtype::kNvfp4, 128, 2);
  const int64_t num_pages = 6, n = 40;
  const double theta = 5e6;
  std::vector<float> table(64 * 1000);
  fill_rope_table(table.data(), 1000, theta);
  std::vector<float> w(kHeadDim);
  for (int d = 0; d < kHeadDim; ++d) w[d] = 0.01f * d;
  const std::vector<AsyncCase> cases = {
      {"slot out of range", [](auto&, auto& s, auto&) { s[9] = 6 * 128; }, InsertRefusal::kSlotOutOfRange},
      {"slot below -1", [](auto&, auto& s, auto&) { s[3] = -2; }, InsertRefusal::kSlotOutOfRange},
      {"duplicate slot", [](auto&, auto& s, auto&) { s[20] = s[5]; }, InsertRefusal::kDuplicateSlot},
      {"NaN key", [](auto& k, auto&, auto&) { k[12 * kHeadDim + 77] = NAN; }, InsertRefusal::kNonFiniteKey},
      {"Inf key", [](auto& k, auto&, auto&) { k[2 * kHeadDim + 3] = -INFINITY; }, InsertRefusal::kNonFiniteKey},
      {"position beyond the table", [](auto&, auto&, auto& p) { p[15] = 1000; }, InsertRefusal::kPositionOutOfTable},
      {"negative position", [](auto&, auto&, auto& p) { p[1] = -1; }, InsertRefusal::kPositionOutOfTable},
      {"zero key with eps = 0 (NaN after RMSNorm)", [](auto& k, auto&, auto&) {
         for (int d = 0; d < kHeadDim; ++d) k[30 * kHeadDim + d] = 0.0f;
       }, InsertRefusal::kNonFiniteAfterPreprocess},
      {"first of two bad tokens", [](auto& k, auto& s, auto&) {
         s[25] = 99999;
         k[8 * kHeadDim] = NAN;
       }, InsertRefusal::kNonFiniteKey},
  };
  for (const auto& c : cases) {
    auto keys = random_keys(n, 21);
    auto slots = random_slots(n, num_pages * 128, 22);
    std::vector<int64_t> pos(n);
    for (int64_t i = 0; i < n; ++i) pos[i] = 3 * i;
    c.spoil(keys, slots, pos);
    InsertOptions opts;
    opts.pre.norm_weight = w.data();
    opts.pre.eps = 0.0f;
    opts.pre.rope = true;
    opts.pre.positions = pos.data();
    opts.pre.rope_theta = theta;
    opts.pre.rope_cos_sin = table.data();
    opts.pre.rope_table_positions = 1000;
    IndexCache cache(l, num_pages, 2, 1);
    const std::vector<uint8_t> before(cache.data(), cache.data() + cache.size_bytes());
    InsertStatus st;
    reset_status(&st);
    insert_keys_async(cache, 1, keys.data(), slots.data(), n, opts, nullptr, 0, &st);
    EXPECT_EQ(st.reason, static_cast<int32_t>(c.reason)) << c.name;
    EXPECT_EQ(st.layer, 1) << c.name;
    EXPECT_EQ(st.refused_calls, 1) << c.name;
    EXPECT_GE(st.refused_tokens, 1) << c.name;
    EXPECT_TRUE(std::equal(before.begin(), before.end(), cache.data())) << c.name << ": a refused batch wrote";
    if (c.reason != InsertRefusal::kPositionOutOfTable) {
      // the same batch through the synchronous call (positions in range there: no table) throws
      // the message status_error gives
      const std::string sync = error_of([&] { insert_keys(cache, 1, keys.data(), slots.data(), n, opts); });
      EXPECT_EQ(std::string(status_error(st).what()), sync) << c.name;
    } else {
      EXPECT_NE(std::string(status_error(st).what()).find("is outside the RoPE table [0, 1000)"), std::string::npos)
          << status_error(st).what();
    }
    EXPECT_EQ(status_error(st).code(), ErrorCode::kInvalidArgument);
    EXPECT_THROW(throw_if_refused(st), Error);
    // sticky: a second refused call keeps the first details and adds to the counts
    const InsertStatus first = st;
    insert_keys_async(cache, 0, keys.data(), slots.data(), n, opts, nullptr, 0, &st);
    EXPECT_EQ(st.reason, first.reason);
    EXPECT_EQ(st.layer, 1);
    EXPECT_EQ(st.token, first.token);
    EXPECT_EQ(st.refused_calls, 2);
    EXPECT_EQ(st.refused_tokens, 2 * first.refused_tokens);
  }
}

TEST(InsertAsync, CountsEveryRefusedTokenOnce) {
  const PageLayout l = make_page_layout(KvDtype::kFp8, 128, 1);
  IndexCache cache(l, 4, 1, 0);
  auto keys = random_keys(10, 1);
  std::vector<int64_t> slots = {0, 1, 1, 1, 700, 5, 6, 6, 8, 9};  // dups at 2, 3, 7; range at 4
  keys[5 * kHeadDim + 1] = NAN;  // token 5
  keys[7 * kHeadDim + 1] = NAN;  // token 7 is a duplicate first: counted once
  InsertStatus st;
  reset_status(&st);
  insert_keys_async(cache, 0, keys.data(), slots.data(), 10, {}, nullptr, 0, &st);
  EXPECT_EQ(st.reason, static_cast<int32_t>(InsertRefusal::kDuplicateSlot));
  EXPECT_EQ(st.token, 2);
  EXPECT_EQ(st.value, 1);
  EXPECT_EQ(st.refused_tokens, 5);
  // the same out-of-range slot twice: both refused as out of range, neither as a duplicate
  std::vector<int64_t> oor = {900, 1, 900};
  InsertStatus s2;
  reset_status(&s2);
  insert_keys_async(cache, 0, keys.data(), oor.data(), 3, {}, nullptr, 0, &s2);
  EXPECT_EQ(s2.reason, static_cast<int32_t>(InsertRefusal::kSlotOutOfRange));
  EXPECT_EQ(s2.token, 0);
  EXPECT_EQ(s2.refused_tokens, 2);
}

// A good batch writes the synchronous call's bytes, with RoPE from the table (fill_rope_table)
// and from per-call cos/sin alike; fp32 and bf16 keys; owner-rank-only rows with sharding.
TEST(InsertAsync, GoodBatchesWriteTheSynchronousBytes) {
  const int64_t num_pages = 8, n = 500;
  std::vector<float> table(64 * 70000);
  fill_rope_table(table.data(), 70000, 5e6);
  std::vector<float> w(kHeadDim);
  for (int d = 0; d < kHeadDim; ++d) w[d] = -0.2f + 0.003f * d;
  std::vector<int64_t> pos(n);
  for (int64_t i = 0; i < n; ++i) pos[i] = (i * 131) % 70000;
  const auto keys = random_keys(n, 9);
  std::vector<uint16_t> kb(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) kb[i] = bf16_encode(keys[i]);
  for (const auto dt : {KvDtype::kNvfp4, KvDtype::kFp8, KvDtype::kBf16})
    for (const int32_t W : {1, 2, 4}) {
      if (dt == KvDtype::kBf16 && W > 1) continue;
      for (const bool pre : {false, true}) {
        const PageLayout l = make_page_layout(dt, 256, W);
        const auto slots = random_slots(n, num_pages * 256, 4u + W);
        InsertOptions o;
        o.encode_scale = 0.75f;
        if (pre) {
          o.pre.norm_weight = w.data();
          o.pre.rope = true;
          o.pre.positions = pos.data();
          o.pre.rope_cos_sin = table.data();
          o.pre.rope_table_positions = 70000;
        }
        for (int32_t r = 0; r < W; ++r) {
          IndexCache a(l, num_pages, 1, r), b(l, num_pages, 1, r), c(l, num_pages, 1, r), d(l, num_pages, 1, r);
          insert_keys(a, 0, keys.data(), slots.data(), n, o);
          InsertStatus st;
          reset_status(&st);
          insert_keys_async(b, 0, keys.data(), slots.data(), n, o, nullptr, insert_workspace_bytes(n), &st);
          EXPECT_EQ(st.reason, 0);
          EXPECT_EQ(0, std::memcmp(a.data(), b.data(), static_cast<size_t>(a.size_bytes())))
              << to_string(dt) << " W" << W << " pre " << pre;
          insert_keys_bf16(c, 0, kb.data(), slots.data(), n, o);
          insert_keys_bf16_async(d, 0, kb.data(), slots.data(), n, o, nullptr, 0, &st);
          EXPECT_EQ(st.reason, 0);
          EXPECT_EQ(0, std::memcmp(c.data(), d.data(), static_cast<size_t>(c.size_bytes())));
        }
      }
    }
}

TEST(InsertAsync, ArgumentsAreRefusedByName) {
  IndexCache cache(make_page_layout(KvDtype::kNvfp4, 128, 1), 2, 1, 0);
  const auto keys = random_keys(2, 1);
  const int64_t slots[2] = {0, 1};
  InsertStatus st;
  reset_status(&st);
  EXPECT_NE(error_of([&] { insert_keys_async(cache, 0, keys.data(), slots, 2, {}, nullptr, 0, nullptr); })
                .find("status is null"),
            std::string::npos);
  InsertOptions o;
  o.pre.rope = true;
  const int64_t pos[2] = {0, 1};
  o.pre.positions = pos;
  EXPECT_NE(error_of([&] { insert_keys_async(cache, 0, keys.data(), slots, 2, o, nullptr, 0, &st); })
                .find("rope_cos_sin is null"),
            std::string::npos);
  EXPECT_NE(error_of([&] { insert_keys_async(cache, 0, nullptr, slots, 2, {}, nullptr, 0, &st); }).find("keys is null"),
            std::string::npos);
  EXPECT_NE(error_of([&] { (void)insert_workspace_bytes(-1); }).find("num_tokens = -1"), std::string::npos);
  EXPECT_EQ(st.reason, 0);  // argument errors throw; they are not refusals of a batch
  EXPECT_NE(error_of([&] { fill_rope_table(nullptr, 4, 5e6); }).find("out is null"), std::string::npos);
  std::vector<float> t(64);
  EXPECT_NE(error_of([&] { fill_rope_table(t.data(), 0, 5e6); }).find("num_positions = 0"), std::string::npos);
  EXPECT_NE(error_of([&] { fill_rope_table(t.data(), 1, -1.0); }).find("rope_theta"), std::string::npos);
}

// The table holds exactly the per-token values of the synchronous path (indexer.md section 6).
TEST(RopeTable, RowsArePreprocessVectorsRule) {
  std::vector<float> t(64 * 5000);
  fill_rope_table(t.data(), 5000, 1e4);
  float row[64];
  for (const int64_t p : {0, 1, 2, 63, 999, 4999}) {
    rope_cos_sin_row(p, 1e4, row);
    EXPECT_EQ(0, std::memcmp(row, t.data() + p * 64, sizeof(row))) << p;
    for (int i = 0; i < 32; ++i) {
      const double a = static_cast<double>(p) * std::pow(1e4, -2.0 * i / 64.0);
      EXPECT_EQ(row[i], static_cast<float>(std::cos(a)));
      EXPECT_EQ(row[32 + i], static_cast<float>(std::sin(a)));
    }
  }
}

// ---- asynchronous Q cast -----------------------------------------------------------------------

TEST(QCastAsync, EqualsTheSynchronousCastAndRecordsRefusals) {
  const int64_t T = 6;
  const int32_t H = 4;
  auto q = random_keys(T * H, 31);
  std::vector<float> table(64 * 100);
  fill_rope_table(table.data(), 100, 5e6);
  std::vector<int64_t> pos = {0, 5, 9, 50, 99, 3};
  std::vector<float> w(kHeadDim, 0.5f);
  KeyPreprocess pre;
  pre.norm_weight = w.data();
  pre.rope = true;
  pre.positions = pos.data();
  pre.rope_cos_sin = table.data();
  pre.rope_table_positions = 100;
  std::vector<uint8_t> a(q.size()), b(q.size(), 0x11);
  quantize_queries(q.data(), T, H, pre, a.data());
  InsertStatus st;
  reset_status(&st);
  quantize_queries_async(q.data(), T, H, pre, b.data(), &st);
  EXPECT_EQ(st.reason, 0);
  EXPECT_EQ(a, b);
  // NaN in q: recorded (token, head, dim), nothing written, the synchronous message
  q[(3 * H + 2) * kHeadDim + 100] = NAN;
  std::vector<uint8_t> c(q.size(), 0x22);
  quantize_queries_async(q.data(), T, H, pre, c.data(), &st);
  EXPECT_EQ(st.reason, static_cast<int32_t>(InsertRefusal::kQueryNaN));
  EXPECT_EQ(st.token, 3);
  EXPECT_EQ(st.head, 2);
  EXPECT_EQ(st.dim, 100);
  EXPECT_EQ(st.layer, -1);
  EXPECT_EQ(c, std::vector<uint8_t>(q.size(), 0x22));
  EXPECT_EQ(std::string(status_error(st).what()),
            error_of([&] { quantize_queries(q.data(), T, H, pre, c.data()); }));
  // position outside the table
  q[(3 * H + 2) * kHeadDim + 100] = 0.5f;
  pos[4] = 100;
  InsertStatus s2;
  reset_status(&s2);
  quantize_queries_async(q.data(), T, H, pre, c.data(), &s2);
  EXPECT_EQ(s2.reason, static_cast<int32_t>(InsertRefusal::kPositionOutOfTable));
  EXPECT_EQ(s2.token, 4);
  EXPECT_EQ(s2.value, 100);
  EXPECT_EQ(c, std::vector<uint8_t>(q.size(), 0x22));
  // NaN only after RMSNorm (an infinite element): the synchronous message too
  pos[4] = 4;
  q[(1 * H + 0) * kHeadDim + 7] = INFINITY;
  InsertStatus s3;
  reset_status(&s3);
  quantize_queries_async(q.data(), T, H, pre, c.data(), &s3);
  EXPECT_EQ(s3.reason, static_cast<int32_t>(InsertRefusal::kQueryNaNAfterPreprocess));
  EXPECT_EQ(std::string(status_error(s3).what()),
            error_of([&] { quantize_queries(q.data(), T, H, pre, c.data()); }));
}

// The CPU backend offers the CUDA backend's signatures too (the stream ignored), so that one
// engine code path can be written once for `indexcp::` and `indexcp::cuda::`.
TEST(InsertStatusHelpers, CpuHasTheCudaSignatures) {
  InsertStatus s;
  s.reason = 3;
  s.refused_calls = 7;
  CUstream_st* stream = nullptr;
  EXPECT_EQ(read_status(&s, stream).refused_calls, 7);
  reset_status(&s, stream);
  EXPECT_EQ(read_status(&s).reason, 0);
  EXPECT_EQ(s.refused_calls, 0);
  std::vector<float> a(64 * 10), c(64 * 10);
  fill_rope_table(a.data(), 10, 1e4);
  fill_rope_table(c.data(), 10, 1e4, stream);
  EXPECT_EQ(a, c);
  EXPECT_EQ(insert_workspace_bytes(512), 0u);
  EXPECT_NE(error_of([&] { (void)read_status(nullptr); }).find("status is null"), std::string::npos);
}

TEST(InsertStatusHelpers, MessagesNameEveryReason) {
  for (int r = 1; r <= 7; ++r) {
    InsertStatus s;
    s.reason = r;
    s.token = 4;
    s.value = 77;
    s.limit = 128;
    s.dim = 3;
    s.head = 1;
    const Error e = status_error(s);
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << r;
    EXPECT_NE(std::string(e.what()).find('4'), std::string::npos) << e.what();
    EXPECT_STRNE(to_string(static_cast<InsertRefusal>(r)), "?");
  }
  InsertStatus none;
  EXPECT_EQ(status_error(none).code(), ErrorCode::kRuntime);
  EXPECT_NO_THROW(throw_if_refused(none));
}

// The CUDA backend's device rule (cuda.hpp): sm_90 only, refusals name the device and its
// compute capability. (Plain C++: runs in every build.)
TEST(DeviceRule, OnlyComputeCapability90IsSupported) {
  EXPECT_EQ(cuda::device_support_message(0, "NVIDIA H200", 9, 0), "");
  const std::string a = cuda::device_support_message(1, "NVIDIA A100-SXM4-80GB", 8, 0);
  EXPECT_NE(a.find("device 1 (NVIDIA A100-SXM4-80GB) has compute capability 8.0"), std::string::npos) << a;
  EXPECT_NE(a.find("sm_90a"), std::string::npos);
  EXPECT_NE(cuda::device_support_message(0, "NVIDIA B200", 10, 0).find("compute capability 10.0"), std::string::npos);
  EXPECT_NE(cuda::device_support_message(0, "X", 9, 1), "");
}

}  // namespace
