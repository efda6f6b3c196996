// Test helpers: random data, request/page setup, a plainly written brute-force reference, and a
// driver that runs the W ranks of the in-process communicator.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "indexcp/cache.hpp"
#include "indexcp/comm.hpp"
#include "indexcp/error.hpp"
#include "indexcp/icp.hpp"
#include "indexcp/indexer.hpp"

namespace testutil {

/// The message of the indexcp::Error that fn throws, or "(no error)".
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const indexcp::Error& e) {
    return e.what();
  }
  return "(no error)";
}

using namespace indexcp;

/// Host memory with a 16-byte aligned start (the plans' workspace alignment), filled with `fill`.
struct Buffer {
  std::vector<uint8_t> raw;
  uint8_t* p = nullptr;
  size_t size = 0;
  explicit Buffer(size_t n, uint8_t fill = 0xCD) : raw(n + 16, fill), size(n) {
    p = raw.data() + (16 - reinterpret_cast<uintptr_t>(raw.data()) % 16) % 16;
  }
};

/// Requests laid into scattered physical pages: block table [B, max_pages], seq_lens, slots.
struct Requests {
  int32_t page_size = 128;
  int32_t max_pages = 0;
  int64_t num_pages = 0;
  std::vector<int32_t> seq_lens;
  std::vector<int32_t> block_table;
  /// slot of (request b, position p)
  int64_t slot(int32_t b, int64_t p) const {
    return static_cast<int64_t>(block_table[static_cast<size_t>(b) * max_pages + p / page_size]) * page_size +
           p % page_size;
  }
};

/// Scatters pages of `lens` requests over a shuffled page pool (extra spare pages included).
inline Requests make_requests(const std::vector<int32_t>& lens, int32_t page_size, uint32_t seed,
                              int32_t extra_pages = 3) {
  Requests r;
  r.page_size = page_size;
  r.seq_lens = lens;
  int64_t total = 0;
  for (int32_t l : lens) {
    const int32_t np = (l + page_size - 1) / page_size;
    r.max_pages = std::max(r.max_pages, np);
    total += np;
  }
  r.max_pages = std::max(r.max_pages, 1);
  r.num_pages = total + extra_pages;
  std::vector<int32_t> pool(static_cast<size_t>(r.num_pages));
  std::iota(pool.begin(), pool.end(), 0);
  std::mt19937 rng(seed);
  std::shuffle(pool.begin(), pool.end(), rng);
  r.block_table.assign(lens.size() * static_cast<size_t>(r.max_pages), -1);
  size_t next = 0;
  for (size_t b = 0; b < lens.size(); ++b) {
    const int32_t np = (lens[b] + page_size - 1) / page_size;
    for (int32_t i = 0; i < np; ++i) r.block_table[b * r.max_pages + i] = pool[next++];
  }
  return r;
}

/// A decode batch over requests `r` with index Q `q` ([B * Q, heads, 128]); `seq_lens` replaces
/// the requests' own lengths when given.
inline DecodeBatch decode_batch(const Requests& r, const std::vector<uint8_t>& q, int32_t heads, int32_t Q,
                                const std::vector<int32_t>* seq_lens = nullptr) {
  DecodeBatch b;
  b.q = q.data();
  b.heads = heads;
  b.block_table = r.block_table.data();
  b.num_requests = static_cast<int32_t>(r.seq_lens.size());
  b.max_pages = r.max_pages;
  b.seq_lens = seq_lens ? seq_lens->data() : r.seq_lens.data();
  b.query_len = Q;
  return b;
}

/// A prefill batch over requests `r`: q [query_start.back(), heads, 128].
inline PrefillBatch prefill_batch(const Requests& r, const std::vector<uint8_t>& q, int32_t heads,
                                  const std::vector<int32_t>& query_start) {
  PrefillBatch b;
  b.q = q.data();
  b.heads = heads;
  b.block_table = r.block_table.data();
  b.num_requests = static_cast<int32_t>(r.seq_lens.size());
  b.max_pages = r.max_pages;
  b.seq_lens = r.seq_lens.data();
  b.query_start = query_start.data();
  return b;
}

/// Random keys (normal, unit scale) for every position of every request: [sum(lens), 128] and
/// the matching slot mapping.
inline void make_keys(const Requests& r, uint32_t seed, std::vector<float>& keys, std::vector<int64_t>& slots,
                      float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  keys.clear();
  slots.clear();
  for (size_t b = 0; b < r.seq_lens.size(); ++b)
    for (int64_t p = 0; p < r.seq_lens[b]; ++p) {
      for (int d = 0; d < kHeadDim; ++d) keys.push_back(nd(rng));
      slots.push_back(r.slot(static_cast<int32_t>(b), p));
    }
}

/// Random E4M3 queries [rows, heads, 128] from normal fp32 values.
inline std::vector<uint8_t> make_q(int64_t rows, int32_t heads, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<uint8_t> q(static_cast<size_t>(rows) * heads * kHeadDim);
  for (auto& b : q) b = e4m3_encode(nd(rng));
  return q;
}

/// Inserts keys into W shard caches (or one replicated cache when W = 1).
inline std::vector<IndexCache> make_shards(KvDtype dt, const Requests& r, int32_t W, const std::vector<float>& keys,
                                           const std::vector<int64_t>& slots, int32_t layers = 1, int32_t layer = 0) {
  std::vector<IndexCache> out;
  const PageLayout l = make_page_layout(dt, r.page_size, W);
  for (int32_t rank = 0; rank < W; ++rank) {
    out.emplace_back(l, r.num_pages, layers, rank);
    insert_keys(out.back(), layer, keys.data(), slots.data(), static_cast<int64_t>(slots.size()));
  }
  return out;
}

/// Brute force, written plainly from indexer.md sections 2-4: k_hat of every token from the
/// replicated cache, dot products in long double, block max, sort by (score desc, id asc).
/// Scores are rounded to fp32 after an exact (long double) sum, as the CPU backend does.
inline std::vector<int32_t> brute_force(const IndexCache& cache, int32_t layer, const Requests& r,
                                        const std::vector<QueryRow>& rows, const std::vector<uint8_t>& q,
                                        int32_t heads, const SelectionParams& sel, KRounding mode) {
  std::vector<int32_t> out(rows.size() * heads * sel.topk, -1);
  // k_hat of every slot of the cache, read one token at a time through the public reader
  const int64_t nslots = cache.num_pages() * r.page_size;
  std::vector<float> khat(static_cast<size_t>(nslots) * 128);
  for (int64_t slot = 0; slot < nslots; ++slot)
    read_row_khat(cache, layer, slot / r.page_size, static_cast<int32_t>(slot % r.page_size), mode,
                  khat.data() + slot * 128);
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i].pos < 0) continue;
    const int64_t local = rows[i].pos / 128;
    const int64_t n = local + 1;
    for (int32_t h = 0; h < heads; ++h) {
      int32_t* o = out.data() + (i * heads + h) * sel.topk;
      if (n <= sel.topk) {
        for (int64_t k = 0; k < n; ++k) o[k] = static_cast<int32_t>(k);
        continue;
      }
      std::vector<std::pair<float, int32_t>> blocks;
      for (int64_t b = sel.init_blocks; b < local; ++b) {
        float best = -INFINITY;
        for (int64_t p = b * 128; p < (b + 1) * 128; ++p) {
          const float* k = khat.data() + r.slot(rows[i].request, p) * 128;
          long double s = 0;
          for (int d = 0; d < 128; ++d)
            s += static_cast<long double>(e4m3_decode(q[(i * heads + h) * 128 + d])) * k[d];
          best = std::max(best, static_cast<float>(static_cast<double>(s)));
        }
        blocks.push_back({best, static_cast<int32_t>(b)});
      }
      std::sort(blocks.begin(), blocks.end(), [](auto& a, auto& b) {
        return a.first != b.first ? a.first > b.first : a.second < b.second;
      });
      std::vector<int32_t> ids;
      for (int32_t k = 0; k < sel.ranked(); ++k) ids.push_back(blocks[k].second);
      for (int32_t k = 0; k < sel.init_blocks; ++k) ids.push_back(k);
      ids.push_back(static_cast<int32_t>(local));
      std::sort(ids.begin(), ids.end());
      for (size_t k = 0; k < ids.size(); ++k) o[k] = ids[k];
    }
  }
  return out;
}

/// Runs ICP decode on W shards; returns the selection of all heads [rows, H, K], each head taken
/// from its owner rank.
inline std::vector<int32_t> icp_all_heads(const std::vector<IndexCache>& shards, int32_t layer,
                                          const DecodeBatch& batch, const SelectionParams& sel, KRounding mode,
                                          bool decode_cp = false, int32_t world = 0) {
  const int32_t W = world ? world : static_cast<int32_t>(shards.size());
  const int64_t rows = batch.rows();
  std::vector<std::vector<int32_t>> per(W);
  run_ranks(W, [&](int rank, Communicator& comm) {
    int32_t h0, nh;
    owned_heads(batch.heads, W, rank, &h0, &nh);
    per[rank].assign(static_cast<size_t>(rows) * nh * sel.topk, -7);
    if (decode_cp)
      decode_cp_replicated(comm, shards[0], layer, batch, sel, mode, per[rank].data());
    else
      icp_decode(comm, shards[rank], layer, batch, sel, mode, per[rank].data());
  });
  std::vector<int32_t> all(static_cast<size_t>(rows) * batch.heads * sel.topk, -7);
  for (int32_t rank = 0; rank < W; ++rank) {
    int32_t h0, nh;
    owned_heads(batch.heads, W, rank, &h0, &nh);
    for (int64_t r = 0; r < rows; ++r)
      for (int32_t h = 0; h < nh; ++h)
        for (int32_t k = 0; k < sel.topk; ++k) {
          const int32_t v = per[rank][(r * nh + h) * sel.topk + k];
          int32_t& dst = all[(r * batch.heads + h0 + h) * sel.topk + k];
          if (dst == -7) dst = v;
          else EXPECT_EQ(dst, v) << "ranks sharing head " << h0 + h << " disagree at row " << r;
        }
  }
  return all;
}

}  // namespace testutil
