// The soak on the CPU backend (tests/soak.hpp; docs/testing.md "Soak"): W ranks of one process,
// each with its own cache shard (or the replicated cache), its decode and prefill plans made once
// and their workspaces allocated once, as an engine keeps them; every step's insert and plan runs
// go through the library's public calls. Memory: an allocation counter (this executable's
// operator new / delete) must read the same after every library call as before it.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "indexcp/cache.hpp"
#include "indexcp/comm.hpp"
#include "indexcp/plan.hpp"
#include "soak.hpp"
#include "util.hpp"

// ---- the allocation counter: live bytes of every operator new of this process ------------------
namespace {
std::atomic<int64_t> g_live_bytes{0};
constexpr size_t kHeader = 64;  // >= every alignment asked of it below; keeps the size

void* counted_alloc(size_t n, size_t align) {
  const size_t head = align > kHeader ? align : kHeader;
  void* raw = nullptr;
  if (posix_memalign(&raw, head, n + head) != 0) return nullptr;
  auto* p = static_cast<unsigned char*>(raw) + head;
  reinterpret_cast<size_t*>(p)[-1] = n;
  reinterpret_cast<size_t*>(p)[-2] = head;
  g_live_bytes.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed);
  return p;
}
void counted_free(void* p) noexcept {
  if (!p) return;
  auto* c = static_cast<unsigned char*>(p);
  const size_t n = reinterpret_cast<size_t*>(c)[-1], head = reinterpret_cast<size_t*>(c)[-2];
  g_live_bytes.fetch_sub(static_cast<int64_t>(n), std::memory_order_relaxed);
  std::free(c - head);
}
void* counted_or_throw(size_t n, size_t align) {
  void* p = counted_alloc(n, align);
  if (!p) throw std::bad_alloc();
  return p;
}
}  // namespace

void* operator new(size_t n) { return counted_or_throw(n, 16); }
void* operator new[](size_t n) { return counted_or_throw(n, 16); }
void* operator new(size_t n, std::align_val_t a) { return counted_or_throw(n, static_cast<size_t>(a)); }
void* operator new[](size_t n, std::align_val_t a) { return counted_or_throw(n, static_cast<size_t>(a)); }
void* operator new(size_t n, const std::nothrow_t&) noexcept { return counted_alloc(n, 16); }
void* operator new[](size_t n, const std::nothrow_t&) noexcept { return counted_alloc(n, 16); }
void operator delete(void* p) noexcept { counted_free(p); }
void operator delete[](void* p) noexcept { counted_free(p); }
void operator delete(void* p, size_t) noexcept { counted_free(p); }
void operator delete[](void* p, size_t) noexcept { counted_free(p); }
void operator delete(void* p, std::align_val_t) noexcept { counted_free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { counted_free(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { counted_free(p); }
void operator delete[](void* p, size_t, std::align_val_t) noexcept { counted_free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { counted_free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { counted_free(p); }
void* operator new(size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return counted_alloc(n, static_cast<size_t>(a));
}
void* operator new[](size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return counted_alloc(n, static_cast<size_t>(a));
}
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { counted_free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { counted_free(p); }

namespace {

using namespace indexcp;

class CpuBackend : public soak::Backend {
 public:
  explicit CpuBackend(const soak::Options& o) : o_(o), rc_(o.config()), W_(o.tp) {
    const int32_t shards = rc_.sharding ? W_ : 1;
    const PageLayout layout = make_page_layout(o.dtype, o.page_size, shards);
    for (int32_t r = 0; r < shards; ++r) caches_.emplace_back(layout, o.num_pages, 1, r);
    const DecodeLimits dl = o.decode_limits();
    const PrefillLimits pl = o.prefill_limits();
    for (int32_t r = 0; r < W_; ++r) {
      dplans_.emplace_back(rc_, r, dl);
      pplans_.emplace_back(rc_, r, pl);
      dws_.emplace_back(dplans_.back().workspace_bytes(), 0);
      pws_.emplace_back(pplans_.back().workspace_bytes(), 0);
      dout_.emplace_back(static_cast<size_t>(dl.max_rows()) * dplans_.back().num_heads() * dl.sel.topk);
      pout_.emplace_back(static_cast<size_t>(pl.max_rows) * pplans_.back().num_heads() * pl.sel.topk);
    }
    EXPECT_EQ(dplans_[0].path(), decode_path(rc_));
    snapshot_.reserve(static_cast<size_t>(caches_[0].size_bytes()) * shards);
  }

  bool insert(const float* keys, const uint16_t* keys16, const int64_t* slots, int64_t n, bool expect_refused) override {
    if (expect_refused) {
      snapshot_.clear();
      for (const IndexCache& c : caches_) snapshot_.insert(snapshot_.end(), c.data(), c.data() + c.size_bytes());
    }
    int refused = 0;
    for (IndexCache& c : caches_) {
      try {
        if (keys16) insert_keys_bf16(c, 0, keys16, slots, n);
        else insert_keys(c, 0, keys, slots, n);
      } catch (const Error& e) {
        ++refused;
        if (!expect_refused) ADD_FAILURE() << e.what();
        else EXPECT_NE(std::string(e.what()).find("slot_mapping"), std::string::npos) << e.what();
      }
    }
    if (!expect_refused) return refused == 0;
    size_t at = 0;
    for (const IndexCache& c : caches_) {
      EXPECT_EQ(0, std::memcmp(snapshot_.data() + at, c.data(), static_cast<size_t>(c.size_bytes())))
          << "a refused insert changed rank " << c.rank() << "'s cache";
      at += static_cast<size_t>(c.size_bytes());
    }
    return refused == static_cast<int>(caches_.size());
  }

  void decode(const soak::DecodeIn& in, int32_t* out, uint32_t* status) override {
    std::vector<uint32_t>& st = status_;  // sized once (W words)
    st.assign(static_cast<size_t>(W_), 77u);
    run_ranks(W_, [&](int r, Communicator& comm) {
      const DeviceDecodeBatch b{in.q, in.block_table, in.seq_lens, in.num_requests};
      dplans_[r].run(cache(r), 0, b, dws_[r].p, dws_[r].size, dout_[r].data(), &comm, &st[r]);
    });
    assemble(in.num_requests * static_cast<int64_t>(o_.query_len), dplans_, dout_, out);
    *status = combined(st);
  }

  void prefill(const soak::PrefillIn& in, int32_t* out, uint32_t* status) override {
    std::vector<uint32_t>& st = status_;
    st.assign(static_cast<size_t>(W_), 77u);
    run_ranks(W_, [&](int r, Communicator& comm) {
      const DevicePrefillBatch b{in.q, in.block_table, in.seq_lens, in.query_start, in.num_requests};
      pplans_[r].run(cache(r), 0, b, in.extents, pws_[r].p, pws_[r].size, pout_[r].data(), &comm, &st[r]);
    });
    assemble(in.extents.rows, pplans_, pout_, out);
    *status = combined(st);
  }

  int64_t memory_in_use() override { return g_live_bytes.load(); }

 private:
  const IndexCache& cache(int r) const { return caches_[rc_.sharding ? static_cast<size_t>(r) : 0]; }
  static uint32_t combined(const std::vector<uint32_t>& st) {
    uint32_t s = 0;
    for (uint32_t v : st) s = s ? s : v;  // the first rank's non-zero status (77: never written)
    return s;
  }
  template <class Plans>
  void assemble(int64_t rows, const Plans& plans, const std::vector<std::vector<int32_t>>& outs, int32_t* all) const {
    const int32_t H = o_.heads, K = o_.sel.topk;
    for (int32_t r = 0; r < W_; ++r) {
      const int32_t h0 = plans[r].head_begin(), nh = plans[r].num_heads();
      for (int64_t row = 0; row < rows; ++row)
        for (int32_t h = 0; h < nh; ++h)
          std::memcpy(all + (row * H + h0 + h) * K, outs[r].data() + (row * nh + h) * K, sizeof(int32_t) * K);
    }
  }

  soak::Options o_;
  ResolvedConfig rc_;
  int32_t W_;
  std::vector<IndexCache> caches_;
  std::vector<DecodePlan> dplans_;
  std::vector<PrefillPlan> pplans_;
  std::vector<testutil::Buffer> dws_, pws_;
  std::vector<std::vector<int32_t>> dout_, pout_;
  std::vector<uint32_t> status_ = std::vector<uint32_t>(64);
  std::vector<uint8_t> snapshot_;
};

void run_soak(const soak::Options& o) {
  CpuBackend be(o);
  const soak::Result r = soak::run(o, be);
  if (::testing::Test::HasFailure()) return;
  EXPECT_EQ(r.steps, o.steps);
  if (o.steps >= 200) {  // the soak did what it is for: requests came and went, pages were reused
    EXPECT_GT(r.requests_finished, 10);
    EXPECT_GT(r.pages_reused, o.num_pages);
    EXPECT_GE(r.max_live_requests, o.max_requests - 1);
    EXPECT_GT(r.decode_rows_checked, 100);
    EXPECT_GT(r.prefill_rows_checked, 100);
    EXPECT_GT(r.refused_inserts, 0);
  }
  // every library call returned all it allocated (the counter also sees the driver's own data,
  // which grows and shrinks with the live requests, so it is compared call by call)
  EXPECT_EQ(r.memory_retained_max, 0);
  EXPECT_GT(r.memory_checked_calls, 2 * o.steps);
  std::printf("soak: %lld steps, %lld checkpoints, %lld decode rows and %lld prefill rows checked, %lld tokens "
              "inserted, %lld requests finished, %lld pages reused, %lld refused inserts; %lld library calls "
              "each left the live bytes where they were\n",
              static_cast<long long>(r.steps), static_cast<long long>(r.checkpoints),
              static_cast<long long>(r.decode_rows_checked), static_cast<long long>(r.prefill_rows_checked),
              static_cast<long long>(r.tokens_inserted), static_cast<long long>(r.requests_finished),
              static_cast<long long>(r.pages_reused), static_cast<long long>(r.refused_inserts),
              static_cast<long long>(r.memory_checked_calls));
}

// ICP decode and the gather prefill over two NVFP4 shards (the main configuration).
TEST(Soak, Nvfp4ShardedTp2) {
  soak::Options o;
  o.steps = soak::steps_from_env(400);
  o.seed = 11;
  run_soak(o);
}

// Four FP8 shards of 256-token pages, local_score prefill, K 8 with two forced init blocks.
TEST(Soak, Fp8ShardedTp4LocalScore) {
  soak::Options o;
  o.dtype = KvDtype::kFp8;
  o.tp = 4;
  o.page_size = 256;
  o.num_pages = 48;
  o.prefill_cp = PrefillCp::kLocalScore;
  o.sel.topk = 8;
  o.sel.init_blocks = 2;
  o.query_len = 3;
  o.steps = soak::steps_from_env(300);
  o.seed = 12;
  run_soak(o);
}

// A replicated NVFP4 cache (exact k_hat) with decode CP across two ranks and a replicated prefill.
TEST(Soak, Nvfp4ReplicatedDecodeCp) {
  soak::Options o;
  o.mode = KRounding::kExact;
  o.sharding = false;
  o.decode_cp = true;
  o.page_size = 256;
  o.num_pages = 48;
  o.query_len = 1;
  o.steps = soak::steps_from_env(300);
  o.seed = 13;
  run_soak(o);
}

// Data with exact ties everywhere (tests/soak.hpp exact_fp32_data: the GPU soak's data), on the
// whole-page shard of P256 at TP2 with the local_score prefill.
TEST(Soak, TiesNvfp4ShardedTp2P256LocalScore) {
  soak::Options o;
  o.exact_fp32_data = true;
  o.page_size = 256;
  o.num_pages = 48;
  o.prefill_cp = PrefillCp::kLocalScore;
  o.query_len = 4;
  o.steps = soak::steps_from_env(200);
  o.seed = 14;
  run_soak(o);
}

}  // namespace
