// GPU reliability (issue 8):
//   - buffer exactness: every decode entry point writes exactly its output (guard regions around
//     it keep their sentinel bytes), reads its inputs only (q, block table and seq_lens placed at
//     the very end of their allocations, so an over-read crosses the allocation end, which
//     compute-sanitizer memcheck reports), and never writes the cache;
//   - launch-configuration determinism: block scores and selections are bit-identical for every
//     x size of the scorer's grid (INDEXCP_SCORE_CTAS, read at every launch), across
//     repeated runs and across streams;
//   - faults: allocation failures (cache, DecodeStep workspace, per-call transients) throw
//     Error(kRuntime) naming the CUDA call and leave the library working and the caches
//     unchanged; a kernel fault inside a step surfaces as Error(kRuntime) from the API (death
//     tests: the fault poisons the CUDA context, so it runs in a re-executed child process);
//     refused inserts leave populated (sharded) caches byte for byte unchanged.
//
// Under compute-sanitizer run only GpuReliabilityBuffers.* (the over-read/over-write checks are
// made for memcheck) and GpuReliabilityFaults.Refused*: the death tests fault on purpose, the
// allocation-failure test makes CUDA calls fail on purpose (the sanitizer reports failed API
// calls by default), and the determinism test is long under instrumentation.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <thread>

#include "gpu_util.hpp"
#include "indexcp/error.hpp"

using namespace gpu;

namespace {

constexpr uint8_t kSentinel = 0xA5;  // int32 0xA5A5A5A5 < -1: never a valid selection entry
constexpr size_t kGuardBytes = 4096;

/// One device allocation [guard | n elements | guard], every byte set to the sentinel: the
/// elements start 4096 bytes in (aligned as cudaMalloc's own pointers are).
template <class T>
class Guarded {
 public:
  explicit Guarded(size_t n) : n_(n), total_(2 * kGuardBytes + n * sizeof(T)) {
    if (cudaMalloc(&base_, total_) != cudaSuccess) throw std::runtime_error("cudaMalloc failed in a test");
    reset();
  }
  ~Guarded() { cudaFree(base_); }
  Guarded(const Guarded&) = delete;
  Guarded& operator=(const Guarded&) = delete;
  void reset() {
    if (cudaMemset(base_, kSentinel, total_) != cudaSuccess) throw std::runtime_error("cudaMemset failed in a test");
  }
  T* get() const { return reinterpret_cast<T*>(base_ + kGuardBytes); }
  size_t size() const { return n_; }
  std::vector<T> host() const {
    std::vector<T> h(n_);
    if (n_) cudaMemcpy(h.data(), get(), n_ * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
  /// Both guards still hold the sentinel in every byte.
  ::testing::AssertionResult guards_intact() const {
    std::vector<uint8_t> all(total_);
    if (cudaMemcpy(all.data(), base_, total_, cudaMemcpyDeviceToHost) != cudaSuccess)
      return ::testing::AssertionFailure() << "cudaMemcpy of the guarded buffer failed";
    const size_t end = kGuardBytes + n_ * sizeof(T);
    for (size_t i = 0; i < total_; ++i) {
      if (i >= kGuardBytes && i < end) continue;
      if (all[i] != kSentinel)
        return ::testing::AssertionFailure()
               << "guard byte changed at " << (i < kGuardBytes ? "-" : "+")
               << (i < kGuardBytes ? kGuardBytes - i : i - end + 1) << " bytes "
               << (i < kGuardBytes ? "before the start" : "after the end") << " of the output (0x" << std::hex
               << static_cast<int>(all[i]) << ")";
    }
    return ::testing::AssertionSuccess();
  }
  /// Every element still holds the sentinel (nothing was written).
  bool untouched() const {
    std::vector<uint8_t> b(n_ * sizeof(T));
    if (!b.empty()) cudaMemcpy(b.data(), get(), b.size(), cudaMemcpyDeviceToHost);
    for (uint8_t x : b)
      if (x != kSentinel) return false;
    return guards_intact();
  }

 private:
  uint8_t* base_ = nullptr;
  size_t n_ = 0, total_ = 0;
};

/// An input array placed at the very END of its own allocation (a sentinel-filled front pad
/// before it): reading one element past it crosses the allocation end (memcheck reports it).
template <class T>
class EndPlaced {
 public:
  explicit EndPlaced(const std::vector<T>& h) : data_(h), total_(kGuardBytes + h.size() * sizeof(T)) {
    if (cudaMalloc(&base_, total_) != cudaSuccess) throw std::runtime_error("cudaMalloc failed in a test");
    cudaMemset(base_, kSentinel, kGuardBytes);
    if (!h.empty()) cudaMemcpy(get(), h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  ~EndPlaced() { cudaFree(base_); }
  EndPlaced(const EndPlaced&) = delete;
  EndPlaced& operator=(const EndPlaced&) = delete;
  T* get() const { return reinterpret_cast<T*>(base_ + total_ - data_.size() * sizeof(T)); }
  /// The array and its front pad are exactly as uploaded (inputs are read-only).
  ::testing::AssertionResult intact(const char* what) const {
    std::vector<uint8_t> all(total_);
    if (cudaMemcpy(all.data(), base_, total_, cudaMemcpyDeviceToHost) != cudaSuccess)
      return ::testing::AssertionFailure() << what << ": cudaMemcpy failed";
    for (size_t i = 0; i < kGuardBytes; ++i)
      if (all[i] != kSentinel) return ::testing::AssertionFailure() << what << ": front pad byte " << i << " changed";
    if (std::memcmp(all.data() + kGuardBytes, data_.data(), data_.size() * sizeof(T)) != 0)
      return ::testing::AssertionFailure() << what << ": the input array was modified";
    return ::testing::AssertionSuccess();
  }

 private:
  std::vector<T> data_;
  uint8_t* base_ = nullptr;
  size_t total_ = 0;
};

/// A decode batch whose device arrays each end exactly at the end of their allocation.
struct EndDecode {
  EndPlaced<uint8_t> q;
  EndPlaced<int32_t> bt, sl;
  DecodeBatch b;
  EndDecode(const Requests& r, const std::vector<uint8_t>& qh, int32_t heads, int32_t Q)
      : q(qh), bt(r.block_table), sl(r.seq_lens) {
    b.q = q.get();
    b.heads = heads;
    b.block_table = bt.get();
    b.num_requests = static_cast<int32_t>(r.seq_lens.size());
    b.max_pages = r.max_pages;
    b.seq_lens = sl.get();
    b.query_len = Q;
  }
  ::testing::AssertionResult intact() const {
    auto a = q.intact("q");
    if (!a) return a;
    a = bt.intact("block_table");
    if (!a) return a;
    return sl.intact("seq_lens");
  }
};

/// Downloads of device caches, for before/after comparisons.
std::vector<IndexCache> download_all(const std::vector<cuda::DeviceCache>& dev) {
  std::vector<IndexCache> out;
  for (const auto& d : dev) {
    out.emplace_back(d.layout(), d.num_pages(), d.num_layers(), d.rank());
    d.download(out.back());
  }
  return out;
}

::testing::AssertionResult same_bytes(const std::vector<IndexCache>& a, const std::vector<IndexCache>& b,
                                      const std::string& what) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << what << ": cache count differs";
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].size_bytes() != b[i].size_bytes())
      return ::testing::AssertionFailure() << what << ": cache " << i << " size differs";
    const uint8_t* x = a[i].data();
    const uint8_t* y = b[i].data();
    for (int64_t k = 0; k < a[i].size_bytes(); ++k)
      if (x[k] != y[k])
        return ::testing::AssertionFailure() << what << ": cache " << i << " (rank " << a[i].rank() << ") byte " << k
                                             << " changed";
  }
  return ::testing::AssertionSuccess();
}

/// Columns [h0, h0 + nh) of a [rows, H, K] selection.
std::vector<int32_t> head_slice(const std::vector<int32_t>& all, int64_t rows, int32_t H, int32_t K, int32_t h0,
                                int32_t nh) {
  std::vector<int32_t> out(static_cast<size_t>(rows) * nh * K);
  for (int64_t r = 0; r < rows; ++r)
    for (int32_t h = 0; h < nh; ++h)
      for (int32_t k = 0; k < K; ++k) out[(r * nh + h) * K + k] = all[(r * H + h0 + h) * K + k];
  return out;
}

/// Bitwise equality of two arrays, naming the first differing element.
template <class T>
::testing::AssertionResult bit_equal(const std::vector<T>& a, const std::vector<T>& b, const std::string& what) {
  if (a.size() != b.size())
    return ::testing::AssertionFailure() << what << ": sizes differ (" << a.size() << " vs " << b.size() << ")";
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0)
      return ::testing::AssertionFailure() << what << ": element " << i << " differs (" << a[i] << " vs " << b[i] << ")";
  return ::testing::AssertionSuccess();
}

const char* path_name(cuda::DecodePath p) {
  return p == cuda::DecodePath::kReplicated ? "replicated" : p == cuda::DecodePath::kIcp ? "icp" : "decode_cp";
}

cuda::Stream ist(cudaStream_t s) { return reinterpret_cast<cuda::Stream>(s); }

}  // namespace

// ---- 1. buffer exactness -------------------------------------------------------------------

// Every decode entry point (DecodeStep::run on all three paths at W = 2, decode_select,
// decode_scores, icp_decode, decode_cp_replicated) writes exactly its output: the guards around
// it keep their sentinel, every output element equals the CPU's (exact data: GPU selections equal
// the CPU's bit for bit, ties included), inputs at the very end of their allocations are read
// correctly and not modified, and the caches are byte for byte unchanged.
class GpuReliabilityBuffers : public ::testing::TestWithParam<std::tuple<KvDtype, int32_t>> {};

TEST_P(GpuReliabilityBuffers, DecodeWritesExactlyItsOutputAndNeverTheCache) {
  REQUIRE_GPU();
  const auto [dt, P] = GetParam();
  const int32_t W = 2, H = 4, Q = 4;
  // the last request is live and the longest: its q rows, seq_len and block-table row are the
  // last elements of their arrays (an over-read of any of them crosses the allocation end)
  Requests req = make_requests({129, 0, 3000, 17, 640, 4, 4100}, P, 500u + P);
  std::vector<float> keys;
  std::vector<int64_t> slots;
  exact_keys(req, 501u + P, keys, slots);
  auto host = make_shards(dt, req, 1, keys, slots);
  auto repl = device_shards(dt, req, 1, keys, slots);
  auto shards = device_shards(dt, req, W, keys, slots);
  const int64_t rows = static_cast<int64_t>(req.seq_lens.size()) * Q;
  const auto q = int_q(rows, H, 502);
  EndDecode d(req, q, H, Q);
  const DecodeBatch hb = host_batch(req, q, H, Q);
  const auto qrows = decode_rows(hb, req.num_pages, P);
  const auto repl_before = download_all(repl);
  const auto shards_before = download_all(shards);
  const int64_t mb = static_cast<int64_t>(req.max_pages) * P / 128;

  std::vector<KRounding> modes = {KRounding::kE4m3};
  if (dt == KvDtype::kNvfp4) modes.push_back(KRounding::kExact);
  for (KRounding mode : modes) {
    const std::string tag = to_string(dt) + " P" + std::to_string(P) + " " + to_string(mode);
    SelectionParams sel;
    const int32_t K = sel.topk;
    std::vector<int32_t> cpu(static_cast<size_t>(rows) * H * K);
    decode_select(host[0], 0, hb, 0, H, sel, mode, cpu.data());
    int32_t live = 0;
    for (int32_t v : cpu) live += v >= 0;
    ASSERT_GT(live, 0) << tag << ": the reference selects nothing";

    // DecodeStep::run, every path (and the general scorer on stock shard pages at P256/W2)
    cuda::DecodeShape shape;
    shape.max_requests = d.b.num_requests;  // workspace sized exactly for this batch
    shape.max_pages = req.max_pages;
    shape.query_len = Q;
    shape.heads = H;
    shape.sel = sel;
    shape.mode = mode;
    struct Variant {
      cuda::DecodePath path;
      bool p256_stock;
    };
    std::vector<Variant> variants = {{cuda::DecodePath::kReplicated, true},
                                     {cuda::DecodePath::kIcp, true},
                                     {cuda::DecodePath::kDecodeCp, true}};
    if (P == 256) variants.push_back({cuda::DecodePath::kIcp, false});
    for (const Variant& v : variants) {
      std::vector<const cuda::DeviceCache*> cs = {&repl[0]};
      if (v.path == cuda::DecodePath::kIcp) cs = {&shards[0], &shards[1]};
      cuda::DecodeStep step(cs, W, 0, shape, v.path, v.p256_stock);
      Guarded<int32_t> out(cpu.size());
      for (int rep = 0; rep < 2; ++rep) {  // a second run into the same buffer: same bytes
        step.run(d.b, out.get(), nullptr);
        CUDA_OK(cudaDeviceSynchronize());
        const std::string what = tag + " DecodeStep " + path_name(v.path) + (v.p256_stock ? "" : " (general scorer)") +
                                 " run " + std::to_string(rep);
        EXPECT_TRUE(out.guards_intact()) << what;
        EXPECT_EQ(out.host(), cpu) << what;
      }
    }

    // decode_select: all heads, then a head range (out [rows, 2, K])
    {
      Guarded<int32_t> out(cpu.size());
      cuda::decode_select(repl[0], 0, d.b, 0, H, sel, mode, out.get(), nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      EXPECT_TRUE(out.guards_intact()) << tag << " decode_select";
      EXPECT_EQ(out.host(), cpu) << tag << " decode_select";
      Guarded<int32_t> part(static_cast<size_t>(rows) * 2 * K);
      cuda::decode_select(repl[0], 0, d.b, 1, 2, sel, mode, part.get(), nullptr, /*validate=*/false);
      CUDA_OK(cudaDeviceSynchronize());
      EXPECT_TRUE(part.guards_intact()) << tag << " decode_select heads [1, 3)";
      EXPECT_EQ(part.host(), head_slice(cpu, rows, H, K, 1, 2)) << tag << " decode_select heads [1, 3)";
    }

    // decode_scores: fp32 [rows, H, max_blocks], -Inf where no score; exact data: equal to the
    // exact reference scores
    {
      Guarded<float> sc(static_cast<size_t>(rows) * H * mb);
      cuda::decode_scores(repl[0], 0, d.b, 0, H, mode, sc.get(), nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      EXPECT_TRUE(sc.guards_intact()) << tag << " decode_scores";
      const auto g = sc.host();
      const auto ref = ref_scores(host[0], req, qrows, q, H, mode);
      ASSERT_EQ(g.size(), ref.score.size());
      int64_t finite = 0;
      for (size_t i = 0; i < g.size(); ++i) {
        if (std::isinf(ref.score[i])) {
          ASSERT_TRUE(std::isinf(g[i]) && g[i] < 0) << tag << " decode_scores: a score where none exists, index " << i;
        } else {
          ASSERT_EQ(g[i], static_cast<float>(ref.score[i])) << tag << " decode_scores index " << i;
          ++finite;
        }
      }
      EXPECT_GT(finite, 0) << tag;
    }

    // icp_decode (shards) and decode_cp_replicated through the threaded device communicator:
    // each rank writes [rows, owned heads, K] into its own guarded buffer
    for (bool cp : {false, true}) {
      std::vector<std::unique_ptr<Guarded<int32_t>>> outs;
      for (int32_t r = 0; r < W; ++r) {
        int32_t h0, nh;
        owned_heads(H, W, r, &h0, &nh);
        outs.push_back(std::make_unique<Guarded<int32_t>>(static_cast<size_t>(rows) * nh * K));
      }
      cuda::run_device_ranks(W, [&](int rank, Communicator& comm, cuda::Stream st) {
        if (cp)
          cuda::decode_cp_replicated(comm, repl[0], 0, d.b, sel, mode, outs[rank]->get(), st, rank == 0);
        else
          cuda::icp_decode(comm, shards[rank], 0, d.b, sel, mode, outs[rank]->get(), st, rank == 0);
      });
      CUDA_OK(cudaDeviceSynchronize());
      for (int32_t r = 0; r < W; ++r) {
        int32_t h0, nh;
        owned_heads(H, W, r, &h0, &nh);
        const std::string what = tag + (cp ? " decode_cp_replicated" : " icp_decode") + " rank " + std::to_string(r);
        EXPECT_TRUE(outs[r]->guards_intact()) << what;
        EXPECT_EQ(outs[r]->host(), head_slice(cpu, rows, H, K, h0, nh)) << what;
      }
    }
  }
  EXPECT_TRUE(d.intact());
  EXPECT_TRUE(same_bytes(download_all(repl), repl_before, "replicated cache after decode"));
  EXPECT_TRUE(same_bytes(download_all(shards), shards_before, "shards after decode"));
}

INSTANTIATE_TEST_SUITE_P(All, GpuReliabilityBuffers,
                         ::testing::Combine(::testing::Values(KvDtype::kNvfp4, KvDtype::kFp8), ::testing::Values(128, 256)));

// ---- 2. launch-configuration determinism ------------------------------------------------------

// The scorer's grid x (CTAs sharing each query slice's work items) is ceil(2 x occupancy x SMs /
// slices), at most occupancy x SMs, unless INDEXCP_SCORE_CTAS overrides it; score.cu reads the
// variable at every launch, so it is set between runs here. Random (not
// exact) data: fp32 accumulation order matters, and must not depend on the grid.
TEST(GpuReliabilityDeterminism, BitIdenticalAcrossGridSizesRunsAndStreams) {
  REQUIRE_GPU();
  ScopedEnv ctas("INDEXCP_SCORE_CTAS");
  ScopedEnv debug("INDEXCP_SCORE_DEBUG");  // a benchmarking aid that skips work: never in this test
  debug.set("");
  const int32_t W = 2, H = 8, Q = 8;
  for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8})
    for (int32_t P : {128, 256}) {
      const std::string tag = to_string(dt) + " P" + std::to_string(P);
      Requests req = make_requests({9000, 129, 0, 5000, 2100, 700, 16, 12000}, P, 600u + P);
      std::vector<float> keys;
      std::vector<int64_t> slots;
      make_keys(req, 601u + P, keys, slots);
      auto repl = device_shards(dt, req, 1, keys, slots);
      auto shards = device_shards(dt, req, W, keys, slots);
      const int64_t rows = static_cast<int64_t>(req.seq_lens.size()) * Q;
      const auto q = make_q(rows, H, 602);
      DevDecode d(req, q, H, Q);
      // a prefill batch over the same requests: the last 40 or 8 positions of each (none of the
      // padded one)
      std::vector<int32_t> qs = {0};
      for (int32_t l : req.seq_lens) qs.push_back(qs.back() + std::min(l, l % 3 == 0 ? 40 : 8));
      const auto pq = make_q(qs.back(), H, 603);
      DevArr<uint8_t> dpq(pq);
      DevArr<int32_t> dqs(qs);
      PrefillBatch pb;
      pb.q = dpq.get();
      pb.heads = H;
      pb.block_table = d.bt.get();
      pb.num_requests = d.b.num_requests;
      pb.max_pages = req.max_pages;
      pb.seq_lens = d.sl.get();
      pb.query_start = dqs.get();
      const int64_t mb = static_cast<int64_t>(req.max_pages) * P / 128;
      SelectionParams sel;
      const int32_t K = sel.topk;
      const size_t nsel = static_cast<size_t>(rows) * H * K;
      cuda::DecodeShape shape;
      shape.max_requests = d.b.num_requests;
      shape.max_pages = req.max_pages;
      shape.query_len = Q;
      shape.heads = H;
      std::vector<KRounding> modes = {KRounding::kE4m3};
      if (dt == KvDtype::kNvfp4) modes.push_back(KRounding::kExact);

      // everything scored under the current grid setting, by name
      using Results = std::pair<std::map<std::string, std::vector<float>>, std::map<std::string, std::vector<int32_t>>>;
      auto run_all = [&]() -> Results {
        std::map<std::string, std::vector<float>> f;
        std::map<std::string, std::vector<int32_t>> s;
        for (KRounding mode : modes) {
          const std::string m = to_string(mode);
          DevArr<float> sc(static_cast<size_t>(rows) * H * mb);
          cuda::decode_scores(repl[0], 0, d.b, 0, H, mode, sc.get(), nullptr);
          DevArr<int32_t> o(nsel);
          cuda::decode_select(repl[0], 0, d.b, 0, H, sel, mode, o.get(), nullptr);
          EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          f["scores " + m] = sc.host();
          s["decode_select " + m] = o.host();
          shape.mode = mode;
          for (auto path : {cuda::DecodePath::kReplicated, cuda::DecodePath::kIcp, cuda::DecodePath::kDecodeCp})
            for (bool stock : {true, false}) {
              if (!stock && !(path == cuda::DecodePath::kIcp && P == 256)) continue;
              std::vector<const cuda::DeviceCache*> cs = {&repl[0]};
              if (path == cuda::DecodePath::kIcp) cs = {&shards[0], &shards[1]};
              cuda::DecodeStep step(cs, W, 0, shape, path, stock);
              DevArr<int32_t> so(nsel);
              so.fill_bytes(0x5a);
              step.run(d.b, so.get(), nullptr);
              EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
              s[std::string("DecodeStep ") + path_name(path) + (stock ? "" : " general") + " " + m] = so.host();
            }
        }
        DevArr<int32_t> po(static_cast<size_t>(qs.back()) * H * K);
        cuda::prefill_select(repl[0], 0, pb, 0, H, sel, po.get(), nullptr);
        s["prefill_select"] = po.host();
        std::vector<std::vector<int32_t>> per(W);
        const int64_t budget = 3 * gather_unit_bytes(shards[0].layout());  // several chunks
        cuda::run_device_ranks(W, [&](int rank, Communicator& comm, cuda::Stream st) {
          int32_t h0, nh;
          owned_heads(H, W, rank, &h0, &nh);
          DevArr<int32_t> o(static_cast<size_t>(qs.back()) * nh * K);
          cuda::prefill_gather(comm, shards[rank], 0, pb, sel, budget, o.get(), st);
          per[rank] = o.host();
        });
        for (int32_t r = 0; r < W; ++r) s["prefill_gather rank " + std::to_string(r)] = per[r];
        return Results(f, s);
      };

      ctas.set("");
      const auto base = run_all();
      // sanity: the baseline is not vacuous, and the paths agree with one another
      int64_t finite = 0;
      for (float v : base.first.at("scores e4m3")) finite += std::isfinite(v) ? 1 : 0;
      ASSERT_GT(finite, 1000) << tag;
      for (KRounding mode : modes) {
        const std::string m = to_string(mode);
        const auto& ref = base.second.at("decode_select " + m);
        for (const auto& [name, v] : base.second)
          if (name.rfind("DecodeStep", 0) == 0 && name.size() > m.size() &&
              name.compare(name.size() - m.size(), m.size(), m) == 0) {
            EXPECT_TRUE(bit_equal(v, ref, tag + " " + name + " vs decode_select"));
          }
      }
      for (const std::string grid : {"1", "7", "132", "1000", "", "1"}) {
        ctas.set(grid);
        for (int rep = 0; rep < 2; ++rep) {
          const auto got = run_all();
          const std::string what = tag + " INDEXCP_SCORE_CTAS=" + (grid.empty() ? "(default)" : grid) + " run " +
                                   std::to_string(rep);
          ASSERT_EQ(got.first.size(), base.first.size());
          ASSERT_EQ(got.second.size(), base.second.size());
          for (const auto& [name, v] : base.first) EXPECT_TRUE(bit_equal(got.first.at(name), v, what + " " + name));
          for (const auto& [name, v] : base.second) EXPECT_TRUE(bit_equal(got.second.at(name), v, what + " " + name));
        }
      }
      ctas.set("");

      // streams: the same work enqueued on two non-blocking streams at once (and on the legacy
      // stream), no host synchronization in between; separate DecodeSteps (each owns workspace)
      cudaStream_t sa = nullptr, sb = nullptr;
      CUDA_OK(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking));
      CUDA_OK(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking));
      {
        shape.mode = KRounding::kE4m3;
        cuda::DecodeStep step_a(std::vector<const cuda::DeviceCache*>{&shards[0], &shards[1]}, W, 0, shape, cuda::DecodePath::kIcp);
        cuda::DecodeStep step_b(std::vector<const cuda::DeviceCache*>{&shards[0], &shards[1]}, W, 0, shape, cuda::DecodePath::kIcp);
        DevArr<float> sca(static_cast<size_t>(rows) * H * mb), scb(sca.size());
        DevArr<int32_t> oa(nsel), ob(nsel), oc(nsel), ia(nsel), ib(nsel);
        cuda::decode_scores(repl[0], 0, d.b, 0, H, KRounding::kE4m3, sca.get(), ist(sa), false);
        cuda::decode_scores(repl[0], 0, d.b, 0, H, KRounding::kE4m3, scb.get(), ist(sb), false);
        cuda::decode_select(repl[0], 0, d.b, 0, H, sel, KRounding::kE4m3, oa.get(), ist(sa), false);
        cuda::decode_select(repl[0], 0, d.b, 0, H, sel, KRounding::kE4m3, ob.get(), ist(sb), false);
        step_a.run(d.b, ia.get(), ist(sa));
        step_b.run(d.b, ib.get(), ist(sb));
        cuda::decode_select(repl[0], 0, d.b, 0, H, sel, KRounding::kE4m3, oc.get(), nullptr, false);
        CUDA_OK(cudaStreamSynchronize(sa));
        CUDA_OK(cudaStreamSynchronize(sb));
        CUDA_OK(cudaDeviceSynchronize());
        const auto& fs = base.first.at("scores e4m3");
        const auto& ss = base.second.at("decode_select e4m3");
        EXPECT_TRUE(bit_equal(sca.host(), fs, tag + " scores on stream A"));
        EXPECT_TRUE(bit_equal(scb.host(), fs, tag + " scores on stream B"));
        EXPECT_TRUE(bit_equal(oa.host(), ss, tag + " decode_select on stream A"));
        EXPECT_TRUE(bit_equal(ob.host(), ss, tag + " decode_select on stream B"));
        EXPECT_TRUE(bit_equal(oc.host(), ss, tag + " decode_select on the legacy stream"));
        EXPECT_TRUE(bit_equal(ia.host(), ss, tag + " DecodeStep icp on stream A"));
        EXPECT_TRUE(bit_equal(ib.host(), ss, tag + " DecodeStep icp on stream B"));
      }
      cudaStreamDestroy(sa);
      cudaStreamDestroy(sb);
    }
}

// ---- 3. faults --------------------------------------------------------------------------------

namespace {

/// A small scene on exact data with its CPU reference selection, for "the library still works".
struct SmallScene {
  Requests req;
  std::vector<float> keys;
  std::vector<int64_t> slots;
  std::vector<uint8_t> q;
  std::vector<int32_t> cpu;  // replicated CPU selection, all heads
  static constexpr int32_t H = 4, Q = 2, W = 2;
  SmallScene() {
    req = make_requests({700, 2100, 0, 3000}, 128, 700);
    exact_keys(req, 701, keys, slots);
    q = int_q(static_cast<int64_t>(req.seq_lens.size()) * Q, H, 702);
    auto host = make_shards(KvDtype::kNvfp4, req, 1, keys, slots);
    cpu.assign(static_cast<size_t>(req.seq_lens.size()) * Q * H * 16, 0);
    decode_select(host[0], 0, host_batch(req, q, H, Q), 0, H, SelectionParams{}, KRounding::kE4m3, cpu.data());
  }
};

/// decode_select and a DecodeStep (kIcp) on the scene's caches equal the CPU.
void expect_decode_works(const SmallScene& s, const std::vector<cuda::DeviceCache>& repl,
                         const std::vector<cuda::DeviceCache>& shards, const std::string& when) {
  try {
    DevDecode d(s.req, s.q, s.H, s.Q);
    DevArr<int32_t> a(s.cpu.size()), b(s.cpu.size());
    cuda::decode_select(repl[0], 0, d.b, 0, s.H, SelectionParams{}, KRounding::kE4m3, a.get(), nullptr);
    cuda::DecodeShape shape;
    shape.max_requests = d.b.num_requests;
    shape.max_pages = s.req.max_pages;
    shape.query_len = s.Q;
    shape.heads = s.H;
    cuda::DecodeStep step(std::vector<const cuda::DeviceCache*>{&shards[0], &shards[1]}, s.W, 0, shape, cuda::DecodePath::kIcp);
    step.run(d.b, b.get(), nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << when;
    EXPECT_EQ(a.host(), s.cpu) << "decode_select " << when;
    EXPECT_EQ(b.host(), s.cpu) << "DecodeStep " << when;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "decode failed " << when << ": " << e.what();
  }
}

/// Free device memory, the largest of a few samples (other processes may hold memory briefly).
size_t free_memory_settled() {
  size_t best = 0;
  for (int i = 0; i < 10; ++i) {
    size_t f = 0, t = 0;
    if (cudaMemGetInfo(&f, &t) == cudaSuccess) best = std::max(best, f);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return best;
}

}  // namespace

// Allocations that cannot succeed (the device cache, a DecodeStep's workspace, a call's
// transient buffer) throw Error(kRuntime) naming the CUDA call, leave no stale CUDA error behind
// (the next valid call works), leak nothing, write nothing, and leave existing caches unchanged.
// Nothing large is ever actually allocated (the GPU tests run in concurrent shards).
TEST(GpuReliabilityFaults, AllocationFailuresThrowRuntimeErrorsAndTheLibraryKeepsWorking) {
  REQUIRE_GPU();
  CUDA_OK(cudaDeviceSynchronize());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess) << "a CUDA error was pending before the test";
  SmallScene s;
  auto repl = device_shards(KvDtype::kNvfp4, s.req, 1, s.keys, s.slots);
  auto shards = device_shards(KvDtype::kNvfp4, s.req, s.W, s.keys, s.slots);
  const auto repl_before = download_all(repl);
  const auto shards_before = download_all(shards);
  expect_decode_works(s, repl, shards, "before any failure");
  size_t free_bytes = 0, total = 0;
  CUDA_OK(cudaMemGetInfo(&free_bytes, &total));
  RecordProperty("device_memory_total", std::to_string(total));

  // (1) a device cache several times larger than the GPU
  {
    const PageLayout l = make_page_layout(KvDtype::kFp8, 256, 1);
    const int64_t pages = std::min<int64_t>((int64_t{1} << 31) - 1, static_cast<int64_t>(4 * total / l.page_stride) + 1);
    struct Case {
      int64_t pages;
      int32_t layers;
    };
    for (const Case c : {Case{pages, 1}, Case{(int64_t{1} << 31) - 1, 4096}}) {
      const int64_t bytes = c.pages * l.page_stride * c.layers;
      try {
        cuda::DeviceCache huge(l, c.pages, c.layers, 0);
        ADD_FAILURE() << "a device cache of " << bytes << " bytes was allocated on a GPU of " << total << " bytes";
      } catch (const Error& e) {
        const std::string m = e.what();
        EXPECT_EQ(e.code(), ErrorCode::kRuntime) << m;
        EXPECT_NE(m.find("cudaMalloc"), std::string::npos) << "the message does not name the CUDA call: " << m;
        EXPECT_NE(m.find(std::to_string(bytes)), std::string::npos) << "the message does not give the size: " << m;
        if (c.layers == 1) {
          EXPECT_NE(m.find("cudaErrorMemoryAllocation"), std::string::npos) << "not reported as out of memory: " << m;
        }
      }
      EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess) << "a stale CUDA error is left after the failed cache allocation";
      cudaGetLastError();
    }
    expect_decode_works(s, repl, shards, "after a failed cache allocation");
  }

  // (2) a DecodeStep whose candidate buffer cannot be allocated, after its score buffers were
  // (2 x 128 MiB): the constructor throws and frees what it had allocated (repeated 64 times: a
  // leak would accumulate to 16 GiB; other test processes may hold a few GiB meanwhile)
  {
    cuda::DecodeShape shape;
    shape.max_requests = 131072;
    shape.query_len = 16;
    shape.heads = 16;
    shape.max_pages = 1;
    shape.sel.topk = 1024;  // candidates: 2 ranks x 2M rows x 16 heads x 1023 x 8 bytes = 549 GB
    const size_t before = free_memory_settled();
    const int reps = 64;
    for (int i = 0; i < reps; ++i) {
      try {
        cuda::DecodeStep huge(std::vector<const cuda::DeviceCache*>{&shards[0], &shards[1]}, s.W, 0, shape, cuda::DecodePath::kIcp);
        ADD_FAILURE() << "a DecodeStep with 549 GB of candidate workspace was constructed";
        break;
      } catch (const Error& e) {
        const std::string m = e.what();
        EXPECT_EQ(e.code(), ErrorCode::kRuntime) << m;
        EXPECT_NE(m.find("cudaMalloc"), std::string::npos) << m;
        EXPECT_NE(m.find("cudaErrorMemoryAllocation"), std::string::npos) << m;
        if (i == 0) RecordProperty("workspace_oom_message", m);
      }
      const cudaError_t stale = cudaGetLastError();
      if (stale != cudaSuccess) {
        ADD_FAILURE() << "a stale CUDA error is left after the failed workspace allocation: " << cudaGetErrorName(stale);
        break;
      }
    }
    const size_t after = free_memory_settled();
    EXPECT_GE(after + (size_t{8} << 30), before)
        << "free device memory fell by " << (before - after) / (1 << 20) << " MiB over " << reps
        << " failed DecodeStep constructions (128 MiB x 2 each if leaked)";
    expect_decode_works(s, repl, shards, "after a failed DecodeStep construction");
  }

  // (3) a decode whose transient score buffer ([rows, heads, max_blocks] fp32, stream-ordered
  // allocation inside decode_select) cannot be allocated: a valid, all-padded batch of 64
  // requests x 16 rows x 64 heads and a block table wide enough for 3x the GPU's memory
  {
    const int32_t B = 64, Qh = 16, Hh = 64, Pp = 256;
    const int64_t per_block = static_cast<int64_t>(B) * Qh * Hh * 4;  // bytes of scores per block column
    const int64_t blocks = static_cast<int64_t>(3 * total / per_block) + 1;
    const int32_t max_pages = static_cast<int32_t>((blocks + 1) / 2);  // P256: 2 blocks per page
    ASSERT_LT(static_cast<int64_t>(max_pages) * Pp, int64_t{1} << 30);
    auto big_repl = std::vector<cuda::DeviceCache>{};
    big_repl.emplace_back(make_page_layout(KvDtype::kNvfp4, Pp, 1), 4, 1, 0);
    const auto big_before = download_all(big_repl);
    DevArr<int32_t> bt(std::vector<int32_t>(static_cast<size_t>(B) * max_pages, -1));
    DevArr<int32_t> sl(std::vector<int32_t>(B, 0));
    DevArr<uint8_t> qq(std::vector<uint8_t>(static_cast<size_t>(B) * Qh * Hh * 128, 0));
    DecodeBatch b;
    b.q = qq.get();
    b.heads = Hh;
    b.block_table = bt.get();
    b.num_requests = B;
    b.max_pages = max_pages;
    b.seq_lens = sl.get();
    b.query_len = Qh;
    Guarded<int32_t> out(static_cast<size_t>(B) * Qh * Hh * 16);
    for (bool validate : {true, false}) {
      try {
        cuda::decode_select(big_repl[0], 0, b, 0, Hh, SelectionParams{}, KRounding::kE4m3, out.get(), nullptr, validate);
        CUDA_OK(cudaDeviceSynchronize());
        ADD_FAILURE() << "decode_select allocated " << blocks * per_block << " bytes of scores";
      } catch (const Error& e) {
        const std::string m = e.what();
        EXPECT_EQ(e.code(), ErrorCode::kRuntime) << m;
        EXPECT_NE(m.find("cudaMallocAsync"), std::string::npos) << m;
        EXPECT_NE(m.find("cudaErrorMemoryAllocation"), std::string::npos) << m;
      }
      EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess) << "a stale CUDA error is left after the failed transient allocation";
      cudaGetLastError();
      CUDA_OK(cudaDeviceSynchronize());
      EXPECT_TRUE(out.untouched()) << "the failed decode_select wrote into its output (validate " << validate << ")";
    }
    EXPECT_TRUE(same_bytes(download_all(big_repl), big_before, "cache of the failed decode"));
    expect_decode_works(s, repl, shards, "after a failed transient allocation");
  }
  EXPECT_TRUE(same_bytes(download_all(repl), repl_before, "replicated cache after the allocation failures"));
  EXPECT_TRUE(same_bytes(download_all(shards), shards_before, "shards after the allocation failures"));
  cudaGetLastError();  // never hand a stale error to the next test
}

// Refused inserts into POPULATED caches (replicated and sharded, NVFP4 and FP8, fp32 and bf16
// keys) leave every rank's bytes unchanged; the same batch, corrected, is then accepted and the
// caches equal the CPU's. (GpuInsert.RefusalsWriteNothingAndNameTheToken covers an empty
// replicated NVFP4 cache and the messages.)
TEST(GpuReliabilityFaults, RefusedInsertsLeavePopulatedCachesUnchanged) {
  REQUIRE_GPU();
  for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8})
    for (int32_t W : {1, 2}) {
      const std::string tag = to_string(dt) + " W" + std::to_string(W);
      // requests 0-1 are inserted first; the second batch writes request 2 and overwrites part
      // of request 0
      Requests req = make_requests({700, 300, 500}, 128, 800u + W);
      std::vector<float> keys;
      std::vector<int64_t> slots;
      make_keys(req, 801, keys, slots);
      const size_t first = 1000;  // tokens of requests 0 and 1
      std::vector<float> k1(keys.begin(), keys.begin() + first * 128);
      std::vector<int64_t> s1(slots.begin(), slots.begin() + first);
      std::vector<float> k2(keys.begin() + first * 128, keys.end());
      std::vector<int64_t> s2(slots.begin() + first, slots.end());
      std::mt19937 rng(802);
      std::normal_distribution<float> nd(0.0f, 2.0f);
      for (int64_t p = 100; p < 164; ++p) {  // overwrite 64 tokens of request 0 with new keys
        for (int dd = 0; dd < 128; ++dd) k2.push_back(nd(rng));
        s2.push_back(req.slot(0, p));
      }
      const int64_t n2 = static_cast<int64_t>(s2.size());
      auto dev = device_shards(dt, req, W, k1, s1);
      auto host = make_shards(dt, req, W, k1, s1);
      const auto before = download_all(dev);
      for (int32_t r = 0; r < W; ++r)
        ASSERT_EQ(std::memcmp(before[r].data(), host[r].data(), static_cast<size_t>(host[r].size_bytes())), 0) << tag;

      auto expect_refused = [&](const std::vector<float>& k, const std::vector<int64_t>& s, const InsertOptions& o,
                                bool bf16, const std::string& what) {
        DevArr<float> dk(k);
        DevArr<int64_t> ds(s);
        std::vector<uint16_t> kb(k.size());
        for (size_t i = 0; i < k.size(); ++i) kb[i] = bf16_encode(k[i]);
        DevArr<uint16_t> dkb(kb);
        for (int32_t r = 0; r < W; ++r) {
          try {
            if (bf16) cuda::insert_keys_bf16(dev[r], 0, dkb.get(), ds.get(), static_cast<int64_t>(s.size()), o, nullptr);
            else cuda::insert_keys(dev[r], 0, dk.get(), ds.get(), static_cast<int64_t>(s.size()), o, nullptr);
            ADD_FAILURE() << tag << " " << what << ": accepted by rank " << r;
          } catch (const Error& e) {
            EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << tag << " " << what << ": " << e.what();
          }
        }
        EXPECT_TRUE(same_bytes(download_all(dev), before, tag + " " + what));
      };
      for (bool bf16 : {false, true}) {
        const std::string kt = bf16 ? " (bf16 keys)" : "";
        auto s = s2;
        s.back() = req.num_pages * 128;  // past the end, last token
        expect_refused(k2, s, {}, bf16, "slot past the end" + kt);
        s = s2;
        s[0] = -2;
        expect_refused(k2, s, {}, bf16, "slot -2" + kt);
        s = s2;
        s[n2 - 1] = s[3];  // duplicate within the batch
        expect_refused(k2, s, {}, bf16, "duplicate slot" + kt);
        auto k = k2;
        k[(n2 - 1) * 128 + 127] = NAN;
        expect_refused(k, s2, {}, bf16, "NaN in the last key" + kt);
        k = k2;
        k[(n2 / 2) * 128] = INFINITY;
        expect_refused(k, s2, {}, bf16, "Inf key" + kt);
      }
      InsertOptions bad_scale;
      bad_scale.encode_scale = 0.0f;
      expect_refused(k2, s2, bad_scale, false, "encode_scale 0");
      // the corrected batch is accepted; every rank then equals the CPU after both batches
      DevArr<float> dk(k2);
      DevArr<int64_t> ds(s2);
      for (int32_t r = 0; r < W; ++r) {
        cuda::insert_keys(dev[r], 0, dk.get(), ds.get(), n2, InsertOptions{}, nullptr);
        insert_keys(host[r], 0, k2.data(), s2.data(), n2);
      }
      const auto after = download_all(dev);
      for (int32_t r = 0; r < W; ++r)
        EXPECT_EQ(std::memcmp(after[r].data(), host[r].data(), static_cast<size_t>(host[r].size_bytes())), 0)
            << tag << " rank " << r << " after the accepted batch";
      EXPECT_FALSE(same_bytes(after, before, "")) << tag << ": the accepted batch changed nothing";
    }
}

// ---- 3b. a kernel fault inside a step (death tests: a re-executed child process) ------------

namespace {

constexpr int kFaultExit = 42;
// bytes 0x100..: never mapped in a process (below mmap_min_addr) nor in the GPU's address space
const int32_t* const kBogusDevicePtr = reinterpret_cast<const int32_t*>(uintptr_t{0x100});

enum class FaultVariant {
  kDecodeSelectThenInsert,     // decode_select (validate off) faults; the next insert_keys reports
  kDecodeStepThenPrefill,      // DecodeStep::run (no validation) faults; prefill_select reports
  kIcpRankFaultInRunRanks,     // rank 1 of icp_decode faults; run_device_ranks reports
};

/// The child: enqueue a step whose block table is a bogus device pointer, then make the next
/// synchronizing library call; exits kFaultExit after printing the Error when the library
/// reports Error(kRuntime), another code otherwise. Never returns.
[[noreturn]] void fault_child(FaultVariant v) {
  // setup (objects outside the try blocks: never destroyed, the process ends with _Exit)
  SmallScene* s = nullptr;
  std::vector<cuda::DeviceCache>* repl = nullptr;
  std::vector<cuda::DeviceCache>* shards = nullptr;
  DevDecode* d = nullptr;
  DevArr<int32_t>* out = nullptr;
  DevArr<float>* keys = nullptr;
  DevArr<int64_t>* slots = nullptr;
  try {
    s = new SmallScene();
    repl = new std::vector<cuda::DeviceCache>(device_shards(KvDtype::kNvfp4, s->req, 1, s->keys, s->slots));
    shards = new std::vector<cuda::DeviceCache>(device_shards(KvDtype::kNvfp4, s->req, s->W, s->keys, s->slots));
    d = new DevDecode(s->req, s->q, s->H, s->Q);
    out = new DevArr<int32_t>(s->cpu.size());
    keys = new DevArr<float>(std::vector<float>(s->keys.begin(), s->keys.begin() + 128 * 64));
    slots = new DevArr<int64_t>(std::vector<int64_t>(s->slots.begin(), s->slots.begin() + 64));
    if (cudaDeviceSynchronize() != cudaSuccess) throw std::runtime_error("setup left a CUDA error");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fault child: setup failed: %s\n", e.what());
    std::fflush(stderr);
    std::_Exit(3);
  }
  DecodeBatch bad = d->b;
  bad.block_table = kBogusDevicePtr;
  const char* stage = "the faulting call";
  try {
    switch (v) {
      case FaultVariant::kDecodeSelectThenInsert: {
        cuda::decode_select((*repl)[0], 0, bad, 0, s->H, SelectionParams{}, KRounding::kE4m3, out->get(), nullptr,
                            /*validate=*/false);
        stage = "the next synchronizing call (insert_keys)";
        cuda::insert_keys((*repl)[0], 0, keys->get(), slots->get(), 64, InsertOptions{}, nullptr);
        break;
      }
      case FaultVariant::kDecodeStepThenPrefill: {
        cuda::DecodeShape shape;
        shape.max_requests = bad.num_requests;
        shape.max_pages = s->req.max_pages;
        shape.query_len = s->Q;
        shape.heads = s->H;
        auto* step = new cuda::DecodeStep(std::vector<const cuda::DeviceCache*>{&(*shards)[0], &(*shards)[1]}, s->W, 0, shape, cuda::DecodePath::kIcp);
        step->run(bad, out->get(), nullptr);
        stage = "the next synchronizing call (prefill_select)";
        // a valid prefill batch: 2 rows of each live request (request 2 is padded: no rows)
        auto* dqs = new DevArr<int32_t>(std::vector<int32_t>{0, 2, 4, 4, 6});
        PrefillBatch pb;
        pb.q = d->q.get();
        pb.heads = s->H;
        pb.block_table = d->bt.get();
        pb.num_requests = d->b.num_requests;
        pb.max_pages = d->b.max_pages;
        pb.seq_lens = d->sl.get();
        pb.query_start = dqs->get();
        cuda::prefill_select((*repl)[0], 0, pb, 0, s->H, SelectionParams{}, out->get(), nullptr);
        break;
      }
      case FaultVariant::kIcpRankFaultInRunRanks: {
        stage = "run_device_ranks";
        auto* outs = new std::vector<DevArr<int32_t>>();
        for (int r = 0; r < s->W; ++r) outs->emplace_back(s->cpu.size() / 2);
        cuda::run_device_ranks(s->W, [&](int rank, Communicator& comm, cuda::Stream st) {
          cuda::icp_decode(comm, (*shards)[rank], 0, rank == 1 ? bad : d->b, SelectionParams{}, KRounding::kE4m3,
                           (*outs)[rank].get(), st, /*validate=*/false);
        });
        break;
      }
    }
    const cudaError_t sync = cudaDeviceSynchronize();
    std::fprintf(stderr, "fault child: no error reported by the library (cudaDeviceSynchronize: %s)\n",
                 cudaGetErrorName(sync));
    std::fflush(stderr);
    std::_Exit(1);
  } catch (const Error& e) {
    const cudaError_t last = cudaGetLastError();  // for the log: a sticky error stays set
    std::fprintf(stderr, "fault child: reported by %s: indexcp::Error code=%s: %s; last CUDA error: %s\n", stage,
                 error_code_name(e.code()), e.what(), cudaGetErrorName(last));
    std::fflush(stderr);
    std::_Exit(e.code() == ErrorCode::kRuntime ? kFaultExit : 4);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fault child: a non-indexcp exception: %s\n", e.what());
    std::fflush(stderr);
    std::_Exit(5);
  }
}

/// Runs fault_child(v) in a re-executed child ("threadsafe" death tests: no fork of a process
/// that holds a CUDA context) and checks its exit code and message.
void expect_fault_reported(FaultVariant v) {
  const std::string style = GTEST_FLAG_GET(death_test_style);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(fault_child(v), ::testing::ExitedWithCode(kFaultExit),
              "indexcp::Error code=kRuntime: CUDA: .+ failed: cudaError[A-Za-z]+");
  GTEST_FLAG_SET(death_test_style, style);
}

}  // namespace

// The kernel faults (illegal address through the block table); the context is then unusable, so
// the test only asserts that the library reports it as Error(kRuntime) naming the CUDA call and
// the CUDA error, and does not abort the process.
TEST(GpuReliabilityDeathTest, KernelFaultInDecodeSelectIsReportedByTheNextSyncCall) {
  REQUIRE_GPU();
  expect_fault_reported(FaultVariant::kDecodeSelectThenInsert);
}

TEST(GpuReliabilityDeathTest, KernelFaultInDecodeStepIsReportedByTheNextSyncCall) {
  REQUIRE_GPU();
  expect_fault_reported(FaultVariant::kDecodeStepThenPrefill);
}

TEST(GpuReliabilityDeathTest, KernelFaultOnOneRankIsReportedByRunDeviceRanks) {
  REQUIRE_GPU();
  expect_fault_reported(FaultVariant::kIcpRankFaultInRunRanks);
}
