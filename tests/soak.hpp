// The soak driver (issue 25 item 2; docs/testing.md "Soak"): an engine's life in a fixed number
// of steps. Requests arrive with random prompt and output lengths, are prefilled in random chunks,
// decode Q tokens a step and finish; their pages go back to the pool and are handed to later
// requests without being cleared; the decode and prefill batches change shape every step (padding
// requests, zero-length chunks, a different order each time). Every step inserts the step's keys
// (fp32 or bf16, with skipped -1 slots), runs one prefill chunk and one decode step through the
// backend under test, and at checkpoints compares the selections with a brute-force reference
// that lives here: its own copy of every live token's k_hat (from the format functions, not from
// the cache), each score an exact dot product rounded to fp32 once, the selection rule of
// indexer.md section 4 written out. The CPU backend must agree bit for bit, and so must the GPU.
// Now and then a batch the library must refuse (a duplicated slot that would overwrite live
// tokens) is inserted: nothing stored may change. The backend reports its memory in use before
// and after every call: it may not grow.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "indexcp/cache.hpp"
#include "indexcp/config.hpp"
#include "indexcp/formats.hpp"
#include "indexcp/indexer.hpp"
#include "indexcp/layout.hpp"
#include "indexcp/plan.hpp"

namespace soak {

using namespace indexcp;

struct Options {
  KvDtype dtype = KvDtype::kNvfp4;
  KRounding mode = KRounding::kE4m3;
  int32_t tp = 2;
  int32_t page_size = 128;
  bool sharding = true;
  bool decode_cp = false;
  PrefillCp prefill_cp = PrefillCp::kGather;
  int32_t heads = 4;
  int32_t query_len = 2;     ///< Q of every decode step
  SelectionParams sel;       ///< K 16 unless changed
  int64_t num_pages = 96;    ///< the page pool (each rank's cache holds all of them)
  int32_t max_requests = 8;  ///< live requests at most (decode batch width incl. padding)
  int32_t max_len = 4096;    ///< longest request (prompt + output tokens)
  int32_t max_chunk = 160;   ///< the most prefill tokens of one request in one step
  int64_t max_prefill_rows = 320;  ///< the most prefill tokens of one step
  int32_t steps = 200;
  int32_t check_every = 2;   ///< compare with the reference every this many steps (and the last)
  int32_t check_prefill_rows = 48;  ///< prefill rows compared per checkpoint (a random sample)
  int32_t refused_insert_every = 23;  ///< a refused insert every this many steps (0: never)
  /// Memory may grow during the first steps (lazily loaded kernels, first-use tables); after
  /// them every call must leave the memory in use where it found it.
  int32_t memory_warmup_steps = 2;
  uint32_t seed = 1;
  /// Data whose dot products are exact in fp32 whatever the summation order: keys on the E2M1
  /// grid with a 6 in every 16-value group (NVFP4 scale 1, exact in FP8 and BF16 too) and
  /// integer queries in [-4, 4]. Many exact ties. For backends whose accumulation order differs
  /// from an exact sum (the GPU: indexer.md section 3 allows fp32 accumulation), so that they
  /// must still match the reference bit for bit. Off: normal keys of several magnitudes.
  bool exact_fp32_data = false;

  ResolvedConfig config() const {
    AttentionConfig a;
    a.kv_dtype = dtype;
    a.k_rounding = mode;
    a.cache_sharding = sharding;
    a.decode_cp = decode_cp;
    a.prefill_cp = prefill_cp;
    a.prefill_gather_budget_mib = 1;  // small: the gather runs in several chunks
    EngineParams e;
    e.tp = tp;
    e.page_size = page_size;
    e.heads = heads;
    e.query_len = query_len;
    return resolve_config(a, e);
  }
  int32_t max_pages() const { return (max_len + page_size - 1) / page_size; }
  DecodeLimits decode_limits() const {
    DecodeLimits l;
    l.max_requests = max_requests;
    l.max_pages = max_pages();
    l.query_len = query_len;
    l.heads = heads;
    l.sel = sel;
    return l;
  }
  PrefillLimits prefill_limits() const {
    PrefillLimits l;
    l.max_requests = max_requests;
    l.max_pages = max_pages();
    l.max_rows = max_prefill_rows;
    l.heads = heads;
    l.sel = sel;
    return l;
  }
};

/// One step's decode input (host arrays; the backend copies them where it needs them).
struct DecodeIn {
  const uint8_t* q;            // [num_requests * Q, H, 128]
  const int32_t* block_table;  // [num_requests, max_pages]
  const int32_t* seq_lens;     // [num_requests]
  int32_t num_requests;
};
struct PrefillIn {
  const uint8_t* q;            // [rows, H, 128]
  const int32_t* block_table;
  const int32_t* seq_lens;
  const int32_t* query_start;  // [num_requests + 1]
  int32_t num_requests;
  PrefillExtents extents;
};

/// What the soak drives: the engine's calls on one backend, for every rank of the TP group.
class Backend {
 public:
  virtual ~Backend() = default;
  /// Inserts n keys (fp32 [n, 128], or bf16 when keys_bf16 is set) at `slots` into layer 0 of
  /// every rank's cache. `expect_refused`: the batch must be refused (nothing written); returns
  /// whether it was.
  virtual bool insert(const float* keys, const uint16_t* keys_bf16, const int64_t* slots, int64_t n,
                      bool expect_refused) = 0;
  /// out: [num_requests * Q, H, K] with every head (from the rank that owns it); status of the step.
  virtual void decode(const DecodeIn& in, int32_t* out, uint32_t* status) = 0;
  /// out: [extents.rows, H, K].
  virtual void prefill(const PrefillIn& in, int32_t* out, uint32_t* status) = 0;
  /// Memory the backend holds now (host: live bytes of operator new; GPU: device bytes in use
  /// with the stream-ordered pools trimmed), after everything it enqueued has finished.
  virtual int64_t memory_in_use() = 0;
};

struct Result {
  int64_t steps = 0, checkpoints = 0, decode_rows_checked = 0, prefill_rows_checked = 0;
  int64_t tokens_inserted = 0, requests_finished = 0, pages_reused = 0, refused_inserts = 0;
  int64_t max_live_requests = 0;
  /// memory_in_use after the first call past the warm-up steps, and the most after any later call
  int64_t memory_first = -1, memory_max = -1;
  /// The most bytes any one call (past the warm-up) left in use, and how many calls were checked
  int64_t memory_retained_max = 0, memory_checked_calls = 0;
};

namespace detail {

struct Request {
  int32_t prompt = 0, target = 0, len = 0;
  std::vector<int32_t> pages;   // physical pages for the whole target length
  std::vector<double> khat;      // [len, 128]: the reference's own copy of every inserted key (decode)
  std::vector<double> khat_pre;  // NVFP4 with exact rounding only: the E4M3-rounded k_hat prefill scores
  const std::vector<double>& prefill_khat() const { return khat_pre.empty() ? khat : khat_pre; }
};

// k_hat of one key as the cache dtype stores it (formats.md), from the format functions alone.
inline void khat_of(KvDtype dt, KRounding mode, const float* key, double* out) {
  if (dt != KvDtype::kNvfp4 && dt != KvDtype::kFp8) throw std::logic_error("the soak's reference knows nvfp4 and fp8 only");
  float k[kHeadDim];
  if (dt == KvDtype::kNvfp4) {
    uint8_t data[64], scales[8];
    nvfp4_quantize_key(key, 1.0f, data, scales);
    nvfp4_dequantize_key(data, scales, mode, k);
  } else {
    uint8_t b[kHeadDim];
    fp8_quantize_key(key, b);
    for (int d = 0; d < kHeadDim; ++d) k[d] = e4m3_decode(b[d]);
  }
  for (int d = 0; d < kHeadDim; ++d) out[d] = k[d];
}

// The selection of one (row, head): indexer.md section 4. Scores: the exact dot product (the
// products of E4M3 q and k_hat are multiples of 2^-19 below 2^21, so a double sum of 128 of them
// is exact), rounded to fp32 once; ties by the lower block id.
inline void select_row(const std::vector<double>& khat, int64_t pos, const double* q, const SelectionParams& sel,
                       int32_t* out) {
  std::fill(out, out + sel.topk, -1);
  if (pos < 0) return;
  const int64_t local = pos / 128, n = local + 1;
  if (n <= sel.topk) {
    for (int64_t b = 0; b < n; ++b) out[b] = static_cast<int32_t>(b);
    return;
  }
  std::vector<std::pair<float, int32_t>> blocks;
  for (int64_t b = sel.init_blocks; b < local; ++b) {
    float best = 0;
    for (int64_t t = b * 128; t < (b + 1) * 128; ++t) {
      const double* k = khat.data() + t * kHeadDim;
      double s = 0;
      for (int d = 0; d < kHeadDim; ++d) s += q[d] * k[d];
      const float f = static_cast<float>(s);
      if (t == b * 128 || f > best) best = f;
    }
    blocks.push_back({best, static_cast<int32_t>(b)});
  }
  std::partial_sort(blocks.begin(), blocks.begin() + sel.ranked(), blocks.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  std::vector<int32_t> ids;
  for (int32_t k = 0; k < sel.ranked(); ++k) ids.push_back(blocks[k].second);
  for (int32_t k = 0; k < sel.init_blocks; ++k) ids.push_back(k);
  ids.push_back(static_cast<int32_t>(local));
  std::sort(ids.begin(), ids.end());
  std::copy(ids.begin(), ids.end(), out);
}

// Ascending distinct ids in [0, visible), -1 only at the end, the own block present: what every
// output row must look like (checked every step, between the reference's checkpoints).
inline bool well_formed(const int32_t* o, int32_t K, int64_t pos) {
  if (pos < 0) return std::all_of(o, o + K, [](int32_t v) { return v == -1; });
  const int64_t local = pos / 128;
  bool seen_local = false, ended = false;
  for (int32_t k = 0; k < K; ++k) {
    if (o[k] == -1) {
      ended = true;
      continue;
    }
    if (ended || o[k] < 0 || o[k] > local || (k > 0 && o[k] <= o[k - 1])) return false;
    seen_local = seen_local || o[k] == local;
  }
  return seen_local;
}

}  // namespace detail

/// Runs the soak; every failure is a gtest failure (the run stops at the first step with one).
inline Result run(const Options& o, Backend& be) {
  using detail::Request;
  Result res;
  const int32_t P = o.page_size, Q = o.query_len, H = o.heads, K = o.sel.topk, MP = o.max_pages();
  std::mt19937 rng(o.seed);
  auto uni = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto random_q = [&]() -> uint8_t {
    return e4m3_encode(o.exact_fp32_data ? static_cast<float>(uni(-4, 4)) : nd(rng));
  };

  std::vector<int32_t> free_pages(static_cast<size_t>(o.num_pages));
  std::iota(free_pages.begin(), free_pages.end(), 0);
  std::shuffle(free_pages.begin(), free_pages.end(), rng);
  std::vector<bool> page_used_before(static_cast<size_t>(o.num_pages), false);
  std::vector<Request> live;
  const int32_t kGarbage = 0x3fffffff;  // block table entries past a request's pages

  auto track_memory = [&](int64_t before, const char* call, int64_t step) {
    const int64_t after = be.memory_in_use();
    if (step < o.memory_warmup_steps) return true;
    EXPECT_LE(after, before) << call << " at step " << step << " kept " << after - before << " bytes";
    if (res.memory_first < 0) res.memory_first = after;
    res.memory_max = std::max(res.memory_max, after);
    res.memory_retained_max = std::max(res.memory_retained_max, after - before);
    ++res.memory_checked_calls;
    return after <= before;
  };

  for (int32_t step = 0; step < o.steps; ++step) {
    // ---- arrivals: a new request when the pool has the pages for its whole length
    for (int tries = 0; tries < 2 && static_cast<int32_t>(live.size()) < o.max_requests; ++tries) {
      if (uni(0, 2) == 0) continue;
      const int kind = static_cast<int>(uni(0, 9));
      const int32_t out_steps = static_cast<int32_t>(uni(1, 24));
      const int32_t prompt_max = o.max_len - out_steps * Q;
      const int32_t prompt = static_cast<int32_t>(kind < 3 ? uni(1, std::min(300, prompt_max))
                                                 : kind < 8 ? uni(300, std::min(2500, prompt_max))
                                                            : uni(2500, prompt_max));
      Request r;
      r.prompt = prompt;
      r.target = prompt + out_steps * Q;
      const int32_t pages = (r.target + P - 1) / P;
      if (pages > static_cast<int32_t>(free_pages.size())) break;
      for (int32_t i = 0; i < pages; ++i) {
        r.pages.push_back(free_pages.back());
        if (page_used_before[free_pages.back()]) ++res.pages_reused;
        page_used_before[free_pages.back()] = true;
        free_pages.pop_back();
      }
      live.push_back(std::move(r));
    }
    res.max_live_requests = std::max<int64_t>(res.max_live_requests, static_cast<int64_t>(live.size()));

    // ---- this step's work: prefill chunks and decode steps
    std::vector<int32_t> order(live.size());
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<int32_t> pre_req, pre_len, dec_req;
    int64_t pre_rows = 0;
    for (int32_t i : order) {
      Request& r = live[i];
      if (r.len < r.prompt) {
        const int64_t room = o.max_prefill_rows - pre_rows;
        if (room <= 0) continue;
        const int32_t chunk = static_cast<int32_t>(std::min<int64_t>({uni(1, o.max_chunk), r.prompt - r.len, room}));
        pre_req.push_back(i);
        pre_len.push_back(chunk);
        pre_rows += chunk;
      } else if (r.len < r.target) {
        dec_req.push_back(i);
      }
    }
    // a decoding request in the prefill batch with a zero-length chunk now and then
    if (!dec_req.empty() && static_cast<int32_t>(pre_req.size()) < o.max_requests && uni(0, 3) == 0) {
      pre_req.push_back(dec_req[0]);
      pre_len.push_back(0);
    }

    // ---- keys of the new tokens (prefill chunks, then each decode request's Q tokens), in a
    // shuffled order with a few skipped (-1) slots; fp32 or bf16
    struct NewToken {
      int32_t req;
      int32_t pos;
    };
    std::vector<NewToken> toks;
    for (size_t j = 0; j < pre_req.size(); ++j)
      for (int32_t t = 0; t < pre_len[j]; ++t) toks.push_back({pre_req[j], live[pre_req[j]].len + t});
    for (int32_t i : dec_req)
      for (int32_t t = 0; t < Q; ++t) toks.push_back({i, live[i].len + t});
    const int64_t skipped = uni(0, 3);
    for (int64_t s = 0; s < skipped; ++s) toks.push_back({-1, -1});
    std::shuffle(toks.begin(), toks.end(), rng);
    const bool bf16 = uni(0, 4) == 0;
    std::vector<float> keys(toks.size() * kHeadDim);
    std::vector<uint16_t> keys16(bf16 ? keys.size() : 0);
    std::vector<int64_t> slots(toks.size());
    for (size_t t = 0; t < toks.size(); ++t) {
      float* k = keys.data() + t * kHeadDim;
      if (o.exact_fp32_data) {
        static const float grid[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
        for (int g = 0; g < kHeadDim / 16; ++g) {
          const int64_t six = uni(0, 15);
          for (int i = 0; i < 16; ++i) {
            const float v = i == six ? 6.0f : grid[uni(0, 7)];
            k[g * 16 + i] = uni(0, 1) ? -v : v;
          }
        }
      } else {
        const float scale = std::ldexp(1.0f, static_cast<int>(uni(-3, 3)));  // keys of different magnitudes
        for (int d = 0; d < kHeadDim; ++d) k[d] = nd(rng) * scale;
      }
      if (bf16)
        for (int d = 0; d < kHeadDim; ++d) {
          keys16[t * kHeadDim + d] = bf16_encode(k[d]);
          k[d] = bf16_decode(keys16[t * kHeadDim + d]);  // what the reference sees
        }
      slots[t] = toks[t].req < 0 ? -1
                                 : static_cast<int64_t>(live[toks[t].req].pages[toks[t].pos / P]) * P + toks[t].pos % P;
    }
    {
      const int64_t before = be.memory_in_use();
      if (!be.insert(keys.data(), bf16 ? keys16.data() : nullptr, slots.data(), static_cast<int64_t>(toks.size()), false)) {
        ADD_FAILURE() << "step " << step << ": a valid insert was refused";
        return res;
      }
      if (!track_memory(before, "insert", step)) return res;
    }
    res.tokens_inserted += static_cast<int64_t>(toks.size()) - skipped;
    // the reference's copy, in position order per request
    // (prefill scores NVFP4 keys rounded to E4M3 whatever indexer_k_rounding says: indexer.md section 2)
    const bool two_khats = o.dtype == KvDtype::kNvfp4 && o.mode == KRounding::kExact;
    auto grow = [&](Request& r, int32_t len) {
      r.khat.resize(static_cast<size_t>(len) * kHeadDim);
      if (two_khats) r.khat_pre.resize(r.khat.size());
    };
    for (size_t j = 0; j < pre_req.size(); ++j) grow(live[pre_req[j]], live[pre_req[j]].len + pre_len[j]);
    for (int32_t i : dec_req) grow(live[i], live[i].len + Q);
    for (size_t t = 0; t < toks.size(); ++t)
      if (toks[t].req >= 0) {
        Request& r = live[toks[t].req];
        const size_t at = static_cast<size_t>(toks[t].pos) * kHeadDim;
        detail::khat_of(o.dtype, o.mode, keys.data() + t * kHeadDim, r.khat.data() + at);
        if (two_khats) detail::khat_of(o.dtype, KRounding::kE4m3, keys.data() + t * kHeadDim, r.khat_pre.data() + at);
      }

    // ---- a batch the library must refuse: new keys over live slots, one slot given twice
    if (o.refused_insert_every > 0 && step % o.refused_insert_every == o.refused_insert_every - 1 && !toks.empty()) {
      std::vector<int64_t> bad;
      for (size_t t = 0; t < toks.size() && bad.size() < 6; ++t)
        if (slots[t] >= 0) bad.push_back(slots[t]);
      if (!bad.empty()) {
        bad.push_back(bad.front());
        std::vector<float> junk(bad.size() * kHeadDim);
        for (auto& x : junk) x = nd(rng) * 8.0f;
        const int64_t before = be.memory_in_use();
        if (!be.insert(junk.data(), nullptr, bad.data(), static_cast<int64_t>(bad.size()), true)) {
          ADD_FAILURE() << "step " << step << ": an insert with a duplicated slot was not refused";
          return res;
        }
        if (!track_memory(before, "refused insert", step)) return res;
        ++res.refused_inserts;
      }
    }

    const bool check = step % o.check_every == o.check_every - 1 || step == o.steps - 1;

    // ---- prefill chunk
    if (!pre_req.empty()) {
      const int32_t B = static_cast<int32_t>(pre_req.size());
      std::vector<int32_t> table(static_cast<size_t>(B) * MP, kGarbage), lens(B), qs(B + 1, 0);
      for (int32_t b = 0; b < B; ++b) {
        const Request& r = live[pre_req[b]];
        std::copy(r.pages.begin(), r.pages.end(), table.begin() + static_cast<size_t>(b) * MP);
        lens[b] = r.len + pre_len[b];
        qs[b + 1] = qs[b] + pre_len[b];
      }
      const int64_t rows = qs[B];
      std::vector<uint8_t> q(static_cast<size_t>(rows) * H * kHeadDim);
      for (auto& x : q) x = random_q();
      PrefillBatch hb;
      hb.q = q.data();
      hb.heads = H;
      hb.block_table = table.data();
      hb.num_requests = B;
      hb.max_pages = MP;
      hb.seq_lens = lens.data();
      hb.query_start = qs.data();
      const PrefillIn in{q.data(), table.data(), lens.data(), qs.data(), B, prefill_extents(hb, P)};
      std::vector<int32_t> out(static_cast<size_t>(rows) * H * K, -9);
      uint32_t status = 77;
      const int64_t before = be.memory_in_use();
      be.prefill(in, out.data(), &status);
      if (!track_memory(before, "prefill", step)) return res;
      if (status != 0) {
        ADD_FAILURE() << "step " << step << ": prefill status " << status;
        return res;
      }
      std::vector<int64_t> pos(static_cast<size_t>(rows));
      std::vector<int32_t> row_req(static_cast<size_t>(rows));
      for (int32_t b = 0; b < B; ++b)
        for (int32_t i = 0; i < pre_len[b]; ++i) {
          pos[qs[b] + i] = lens[b] - pre_len[b] + i;
          row_req[qs[b] + i] = b;
        }
      for (int64_t row = 0; row < rows; ++row)
        for (int32_t h = 0; h < H; ++h)
          if (!detail::well_formed(out.data() + (row * H + h) * K, K, pos[row])) {
            ADD_FAILURE() << "step " << step << ": prefill row " << row << " head " << h << " is not a selection";
            return res;
          }
      if (check && rows > 0) {
        std::vector<int64_t> sample(static_cast<size_t>(rows));
        std::iota(sample.begin(), sample.end(), 0);
        std::shuffle(sample.begin(), sample.end(), rng);
        sample.resize(std::min<size_t>(sample.size(), static_cast<size_t>(o.check_prefill_rows)));
        std::vector<double> qd(kHeadDim);
        std::vector<int32_t> want(K);
        for (int64_t row : sample) {
          for (int32_t h = 0; h < H; ++h) {
            for (int d = 0; d < kHeadDim; ++d) qd[d] = e4m3_decode(q[(row * H + h) * kHeadDim + d]);
            detail::select_row(live[pre_req[row_req[row]]].prefill_khat(), pos[row], qd.data(), o.sel, want.data());
            const int32_t* got = out.data() + (row * H + h) * K;
            if (!std::equal(want.begin(), want.end(), got)) {
              ADD_FAILURE() << "step " << step << ": prefill row " << row << " (position " << pos[row] << ") head " << h
                            << " differs from the reference";
              return res;
            }
          }
          ++res.prefill_rows_checked;
        }
      }
      for (int32_t b = 0; b < B; ++b) live[pre_req[b]].len += pre_len[b];
    }

    // ---- decode step: the decoding requests in a random order with padding requests among them
    {
      std::vector<int32_t> slots_req;  // live index or -1 (padding)
      for (int32_t i : dec_req) slots_req.push_back(i);
      const int64_t pads = uni(0, std::max<int64_t>(0, o.max_requests - static_cast<int64_t>(slots_req.size())));
      for (int64_t p = 0; p < pads; ++p) slots_req.push_back(-1);
      std::shuffle(slots_req.begin(), slots_req.end(), rng);
      const int32_t B = static_cast<int32_t>(slots_req.size());
      std::vector<int32_t> table(static_cast<size_t>(std::max(B, 1)) * MP, kGarbage), lens(std::max(B, 1), 0);
      for (int32_t b = 0; b < B; ++b) {
        if (slots_req[b] < 0) continue;
        const Request& r = live[slots_req[b]];
        std::copy(r.pages.begin(), r.pages.end(), table.begin() + static_cast<size_t>(b) * MP);
        lens[b] = r.len + Q;
      }
      const int64_t rows = static_cast<int64_t>(B) * Q;
      std::vector<uint8_t> q(static_cast<size_t>(std::max<int64_t>(rows, 1)) * H * kHeadDim);
      for (auto& x : q) x = random_q();
      const DecodeIn in{q.data(), table.data(), lens.data(), B};
      std::vector<int32_t> out(static_cast<size_t>(std::max<int64_t>(rows, 1)) * H * K, -9);
      uint32_t status = 77;
      const int64_t before = be.memory_in_use();
      be.decode(in, out.data(), &status);
      if (!track_memory(before, "decode", step)) return res;
      if (status != 0) {
        ADD_FAILURE() << "step " << step << ": decode status " << status;
        return res;
      }
      std::vector<double> qd(kHeadDim);
      std::vector<int32_t> want(K);
      for (int32_t b = 0; b < B; ++b)
        for (int32_t i = 0; i < Q; ++i) {
          const int64_t row = static_cast<int64_t>(b) * Q + i;
          const int64_t p = slots_req[b] < 0 ? -1 : lens[b] - Q + i;
          for (int32_t h = 0; h < H; ++h) {
            const int32_t* got = out.data() + (row * H + h) * K;
            if (!detail::well_formed(got, K, p)) {
              ADD_FAILURE() << "step " << step << ": decode row " << row << " head " << h << " is not a selection";
              return res;
            }
            if (!check || p < 0) continue;
            for (int d = 0; d < kHeadDim; ++d) qd[d] = e4m3_decode(q[(row * H + h) * kHeadDim + d]);
            detail::select_row(live[slots_req[b]].khat, p, qd.data(), o.sel, want.data());
            if (!std::equal(want.begin(), want.end(), got)) {
              ADD_FAILURE() << "step " << step << ": decode row " << row << " (position " << p << ") head " << h
                            << " differs from the reference";
              return res;
            }
          }
          if (check && p >= 0) ++res.decode_rows_checked;
        }
      for (int32_t i : dec_req) live[i].len += Q;
    }
    if (check) ++res.checkpoints;

    // ---- departures: finished requests give their pages back (not cleared)
    for (size_t i = 0; i < live.size();) {
      if (live[i].len >= live[i].target) {
        for (int32_t p : live[i].pages) free_pages.push_back(p);
        live[i] = std::move(live.back());
        live.pop_back();
        ++res.requests_finished;
      } else {
        ++i;
      }
    }
    std::shuffle(free_pages.begin(), free_pages.end(), rng);
    ++res.steps;
  }
  return res;
}

/// The steps of a soak: INDEXCP_SOAK_STEPS when set (docs/testing.md: the long GPU run), else
/// `default_steps`.
inline int32_t steps_from_env(int32_t default_steps) {
  if (const char* s = std::getenv("INDEXCP_SOAK_STEPS"); s && *s) {
    char* end = nullptr;
    const long v = std::strtol(s, &end, 10);
    if (end != s && *end == '\0' && v > 0 && v <= 100000000) {
      if (v < 200) std::printf("soak: INDEXCP_SOAK_STEPS = %ld: below 200 steps the coverage checks are skipped\n", v);
      return static_cast<int32_t>(v);
    }
    ADD_FAILURE() << "INDEXCP_SOAK_STEPS = \"" << s << "\" must be an integer in 1..100000000";
  }
  return default_steps;
}

}  // namespace soak
