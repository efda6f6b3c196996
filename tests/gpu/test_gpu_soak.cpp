// The soak on the CUDA backend (tests/soak.hpp; docs/testing.md "Soak"), as an engine runs it:
// the index cache of every rank in device memory the test allocated (cache views over it), the
// asynchronous insert with its device status, W decode plans on one stream with the split
// exchange (publish, the engine's all-gather as device copies, merge), the prefill plans through
// an in-process device group; plans and workspaces made once. Data exact in fp32 (the GPU sums in
// its own order, indexer.md section 3), so the selections must equal the brute-force reference
// bit for bit. Memory: device bytes in use (cudaMemGetInfo, the stream-ordered pool trimmed) may
// not grow across any library call after the first steps. This executable runs alone
// (RUN_SERIAL) with eager module loading, so that no other process and no lazily loaded kernel
// moves the device's free memory.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "gpu_util.hpp"
#include "indexcp/cuda.hpp"
#include "soak.hpp"

namespace {

using namespace indexcp;

template <class T>
T* dev_alloc(size_t n) {
  void* p = nullptr;
  if (cudaMalloc(&p, (n ? n : 1) * sizeof(T)) != cudaSuccess) throw std::runtime_error("cudaMalloc failed in the soak");
  return static_cast<T*>(p);
}
template <class T>
void upload(T* dst, const T* src, size_t n, cudaStream_t s) {
  if (n) cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyHostToDevice, s);
}

class GpuBackend : public soak::Backend {
 public:
  explicit GpuBackend(const soak::Options& o) : o_(o), rc_(o.config()), W_(o.tp) {
    cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    const int32_t shards = rc_.sharding ? W_ : 1;
    const PageLayout layout = make_page_layout(o.dtype, o.page_size, shards);
    layer_bytes_ = cache_layer_bytes(layout, o.num_pages);
    for (int32_t r = 0; r < shards; ++r) {
      uint8_t* p = track(dev_alloc<uint8_t>(static_cast<size_t>(layer_bytes_)));
      cudaMemset(p, 0, static_cast<size_t>(layer_bytes_));
      views_.push_back(make_cache_view(layout, p, o.num_pages, 1, r, 0, MemoryLocation::kDevice));
    }
    const DecodeLimits dl = o.decode_limits();
    const PrefillLimits pl = o.prefill_limits();
    max_tokens_ = pl.max_rows + dl.max_rows() + 16;
    ins_ws_bytes_ = cuda::insert_workspace_bytes(max_tokens_);
    ins_ws_ = track(dev_alloc<uint8_t>(ins_ws_bytes_));
    keys_ = track(dev_alloc<float>(static_cast<size_t>(max_tokens_) * kHeadDim));
    keys16_ = track(dev_alloc<uint16_t>(static_cast<size_t>(max_tokens_) * kHeadDim));
    slots_ = track(dev_alloc<int64_t>(static_cast<size_t>(max_tokens_)));
    status_ = track(dev_alloc<InsertStatus>(static_cast<size_t>(shards)));
    cudaMemset(status_, 0, sizeof(InsertStatus) * shards);
    const size_t max_q = static_cast<size_t>(std::max<int64_t>(pl.max_rows, dl.max_rows())) * o.heads * kHeadDim;
    q_ = track(dev_alloc<uint8_t>(max_q));
    table_ = track(dev_alloc<int32_t>(static_cast<size_t>(o.max_requests) * o.max_pages()));
    lens_ = track(dev_alloc<int32_t>(static_cast<size_t>(o.max_requests)));
    qs_ = track(dev_alloc<int32_t>(static_cast<size_t>(o.max_requests) + 1));
    step_status_ = track(dev_alloc<uint32_t>(static_cast<size_t>(W_)));
    for (int32_t r = 0; r < W_; ++r) {
      dplans_.emplace_back(rc_, r, dl);
      pplans_.emplace_back(rc_, r, pl);
      dws_.push_back(track(dev_alloc<uint8_t>(dplans_.back().workspace_bytes())));
      pws_.push_back(track(dev_alloc<uint8_t>(pplans_.back().workspace_bytes())));
      // the exchange copies whole records, rows past a step's included: zero them once (initcheck)
      cudaMemset(dws_.back(), 0, dplans_.back().workspace_bytes());
      cudaMemset(pws_.back(), 0, pplans_.back().workspace_bytes());
      dout_.push_back(track(dev_alloc<int32_t>(static_cast<size_t>(dl.max_rows()) * dplans_.back().num_heads() * dl.sel.topk)));
      pout_.push_back(track(dev_alloc<int32_t>(static_cast<size_t>(pl.max_rows) * pplans_.back().num_heads() * pl.sel.topk)));
    }
    EXPECT_EQ(dplans_[0].path(), decode_path(rc_));
    host_out_.resize(static_cast<size_t>(std::max<int64_t>(pl.max_rows, dl.max_rows())) * o.heads * o.sel.topk);
    cudaDeviceSynchronize();
  }
  ~GpuBackend() override {
    cudaDeviceSynchronize();
    for (void* p : allocs_) cudaFree(p);
    cudaStreamDestroy(stream_);
  }

  bool insert(const float* keys, const uint16_t* keys16, const int64_t* slots, int64_t n, bool expect_refused) override {
    if (n > max_tokens_) {
      ADD_FAILURE() << "the soak inserted " << n << " tokens, more than the " << max_tokens_ << " sized for";
      return false;
    }
    std::vector<uint8_t> before;
    if (expect_refused) before = cache_bytes();
    if (keys16) upload(keys16_, keys16, static_cast<size_t>(n) * kHeadDim, stream_);
    else upload(keys_, keys, static_cast<size_t>(n) * kHeadDim, stream_);
    upload(slots_, slots, static_cast<size_t>(n), stream_);
    for (size_t r = 0; r < views_.size(); ++r) {
      if (keys16)
        cuda::insert_keys_bf16_async(views_[r], 0, keys16_, slots_, n, {}, ins_ws_, ins_ws_bytes_, status_ + r, stream_);
      else
        cuda::insert_keys_async(views_[r], 0, keys_, slots_, n, {}, ins_ws_, ins_ws_bytes_, status_ + r, stream_);
    }
    int refused = 0;
    for (size_t r = 0; r < views_.size(); ++r) {
      const InsertStatus st = cuda::read_status(status_ + r, stream_);
      if (st.reason != 0) {
        ++refused;
        if (!expect_refused) ADD_FAILURE() << status_error(st).what();
        else EXPECT_EQ(st.reason, static_cast<int32_t>(InsertRefusal::kDuplicateSlot)) << status_error(st).what();
        cuda::reset_status(status_ + r, stream_);
      }
    }
    cudaStreamSynchronize(stream_);
    if (!expect_refused) return refused == 0;
    EXPECT_TRUE(cache_bytes() == before) << "a refused insert changed a cache";
    return refused == static_cast<int>(views_.size());
  }

  void decode(const soak::DecodeIn& in, int32_t* out, uint32_t* status) override {
    const int64_t rows = static_cast<int64_t>(in.num_requests) * o_.query_len;
    upload(q_, in.q, static_cast<size_t>(rows) * o_.heads * kHeadDim, stream_);
    upload(table_, in.block_table, static_cast<size_t>(in.num_requests) * o_.max_pages(), stream_);
    upload(lens_, in.seq_lens, static_cast<size_t>(in.num_requests), stream_);
    const DeviceDecodeBatch b{q_, table_, lens_, in.num_requests};
    cudaMemsetAsync(step_status_, 0xFF, sizeof(uint32_t) * W_, stream_);
    if (dplans_[0].path() == DecodePath::kReplicated) {
      for (int32_t r = 0; r < W_; ++r)
        dplans_[r].run(view(r), 0, b, dws_[r], dplans_[r].workspace_bytes(), dout_[r], nullptr, step_status_ + r, stream_);
    } else {
      // the split exchange, as an engine with its own communicator does it on one stream
      for (int32_t r = 0; r < W_; ++r)
        dplans_[r].publish(view(r), 0, b, dws_[r], dplans_[r].workspace_bytes(), dplans_[r].send_buffer(dws_[r]), stream_);
      const size_t X = dplans_[0].exchange_bytes();
      for (int32_t dst = 0; dst < W_; ++dst)
        for (int32_t src = 0; src < W_; ++src)
          cudaMemcpyAsync(static_cast<uint8_t*>(dplans_[dst].recv_buffer(dws_[dst])) + src * X,
                          dplans_[src].send_buffer(dws_[src]), X, cudaMemcpyDeviceToDevice, stream_);
      for (int32_t r = 0; r < W_; ++r)
        dplans_[r].merge(b, dplans_[r].recv_buffer(dws_[r]), dout_[r], step_status_ + r, stream_);
    }
    *status = collect(rows, dplans_, dout_, out);
  }

  void prefill(const soak::PrefillIn& in, int32_t* out, uint32_t* status) override {
    const int64_t rows = in.extents.rows;
    upload(q_, in.q, static_cast<size_t>(rows) * o_.heads * kHeadDim, stream_);
    upload(table_, in.block_table, static_cast<size_t>(in.num_requests) * o_.max_pages(), stream_);
    upload(lens_, in.seq_lens, static_cast<size_t>(in.num_requests), stream_);
    upload(qs_, in.query_start, static_cast<size_t>(in.num_requests) + 1, stream_);
    cudaMemsetAsync(step_status_, 0xFF, sizeof(uint32_t) * W_, stream_);
    cudaStreamSynchronize(stream_);  // the ranks' streams read these
    const DevicePrefillBatch b{q_, table_, lens_, qs_, in.num_requests};
    cuda::run_device_ranks(W_, [&](int r, Communicator& comm, cuda::Stream s) {
      pplans_[r].run(view(r), 0, b, in.extents, pws_[r], pplans_[r].workspace_bytes(), pout_[r], &comm,
                     step_status_ + r, s);
    });
    *status = collect(rows, pplans_, pout_, out);
  }

  int64_t memory_in_use() override {
    cudaDeviceSynchronize();
    int dev = 0;
    cudaGetDevice(&dev);
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, dev) == cudaSuccess) cudaMemPoolTrimTo(pool, 0);
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    return static_cast<int64_t>(total_b - free_b);
  }

 private:
  template <class T>
  T* track(T* p) {
    allocs_.push_back(p);
    return p;
  }
  const CacheView& view(int r) const { return views_[rc_.sharding ? static_cast<size_t>(r) : 0]; }
  std::vector<uint8_t> cache_bytes() {
    cudaStreamSynchronize(stream_);
    std::vector<uint8_t> h(views_.size() * static_cast<size_t>(layer_bytes_));
    for (size_t r = 0; r < views_.size(); ++r)
      cudaMemcpy(h.data() + r * layer_bytes_, views_[r].layer_ptr(0), static_cast<size_t>(layer_bytes_), cudaMemcpyDeviceToHost);
    return h;
  }
  // Every head of the step from its owner rank, and the first rank's non-zero status.
  template <class Plans>
  uint32_t collect(int64_t rows, const Plans& plans, const std::vector<int32_t*>& outs, int32_t* all) {
    const int32_t H = o_.heads, K = o_.sel.topk;
    std::vector<uint32_t> st(static_cast<size_t>(W_));
    cudaMemcpyAsync(st.data(), step_status_, sizeof(uint32_t) * W_, cudaMemcpyDeviceToHost, stream_);
    for (int32_t r = 0; r < W_; ++r) {
      const int32_t h0 = plans[r].head_begin(), nh = plans[r].num_heads();
      if (rows > 0)
        cudaMemcpyAsync(host_out_.data(), outs[r], sizeof(int32_t) * rows * nh * K, cudaMemcpyDeviceToHost, stream_);
      cudaStreamSynchronize(stream_);
      for (int64_t row = 0; row < rows; ++row)
        for (int32_t h = 0; h < nh; ++h)
          std::memcpy(all + (row * H + h0 + h) * K, host_out_.data() + (row * nh + h) * K, sizeof(int32_t) * K);
    }
    const cudaError_t e = cudaGetLastError();
    EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
    uint32_t s = 0;
    for (uint32_t v : st) s = s ? s : v;
    return s;
  }

  soak::Options o_;
  ResolvedConfig rc_;
  int32_t W_;
  cudaStream_t stream_ = nullptr;
  int64_t layer_bytes_ = 0, max_tokens_ = 0;
  std::vector<void*> allocs_;
  std::vector<CacheView> views_;
  size_t ins_ws_bytes_ = 0;
  uint8_t* ins_ws_ = nullptr;
  float* keys_ = nullptr;
  uint16_t* keys16_ = nullptr;
  int64_t* slots_ = nullptr;
  InsertStatus* status_ = nullptr;
  uint8_t* q_ = nullptr;
  int32_t *table_ = nullptr, *lens_ = nullptr, *qs_ = nullptr;
  uint32_t* step_status_ = nullptr;
  std::vector<cuda::DecodePlan> dplans_;
  std::vector<cuda::PrefillPlan> pplans_;
  std::vector<uint8_t*> dws_, pws_;
  std::vector<int32_t*> dout_, pout_;
  std::vector<int32_t> host_out_;
};

void run_soak(soak::Options o) {
  o.exact_fp32_data = true;
  o.memory_warmup_steps = 3;
  GpuBackend be(o);
  const soak::Result r = soak::run(o, be);
  if (::testing::Test::HasFailure()) return;
  EXPECT_EQ(r.steps, o.steps);
  if (o.steps >= 200) {  // a sized run (a short one under compute-sanitizer checks less)
    EXPECT_GT(r.requests_finished, 10);
    EXPECT_GT(r.pages_reused, o.num_pages);
    EXPECT_GT(r.decode_rows_checked, 100);
    EXPECT_GT(r.prefill_rows_checked, 100);
    EXPECT_GT(r.refused_inserts, 0);
  }
  // device memory in use (the driver's data is host memory): flat from the end of the warm-up on
  EXPECT_EQ(r.memory_max, r.memory_first) << "device memory in use grew during the soak";
  EXPECT_EQ(r.memory_retained_max, 0);
  std::printf("gpu soak: %lld steps, %lld checkpoints, %lld decode rows and %lld prefill rows checked, %lld tokens "
              "inserted, %lld requests finished, %lld pages reused, %lld refused inserts; device memory in use %lld "
              "bytes after the warm-up, at most %lld over %lld library calls\n",
              static_cast<long long>(r.steps), static_cast<long long>(r.checkpoints),
              static_cast<long long>(r.decode_rows_checked), static_cast<long long>(r.prefill_rows_checked),
              static_cast<long long>(r.tokens_inserted), static_cast<long long>(r.requests_finished),
              static_cast<long long>(r.pages_reused), static_cast<long long>(r.refused_inserts),
              static_cast<long long>(r.memory_first), static_cast<long long>(r.memory_max),
              static_cast<long long>(r.memory_checked_calls));
}

TEST(GpuSoak, Nvfp4ShardedTp2) {
  REQUIRE_GPU();
  soak::Options o;
  o.steps = soak::steps_from_env(400);
  o.seed = 21;
  run_soak(o);
}

// P256 at TP2: the whole-page (stock) scorer on each rank's shard page.
TEST(GpuSoak, Nvfp4ShardedTp2P256LocalScore) {
  REQUIRE_GPU();
  soak::Options o;
  o.page_size = 256;
  o.num_pages = 48;
  o.prefill_cp = PrefillCp::kLocalScore;
  o.query_len = 4;
  o.steps = soak::steps_from_env(300);
  o.seed = 22;
  run_soak(o);
}

TEST(GpuSoak, Fp8ShardedTp4) {
  REQUIRE_GPU();
  soak::Options o;
  o.dtype = KvDtype::kFp8;
  o.tp = 4;
  o.sel.topk = 8;
  o.sel.init_blocks = 2;
  o.query_len = 3;
  o.steps = soak::steps_from_env(300);
  o.seed = 23;
  run_soak(o);
}

TEST(GpuSoak, Nvfp4ReplicatedDecodeCp) {
  REQUIRE_GPU();
  soak::Options o;
  o.mode = KRounding::kExact;
  o.sharding = false;
  o.decode_cp = true;
  o.query_len = 1;
  o.steps = soak::steps_from_env(300);
  o.seed = 24;
  run_soak(o);
}

}  // namespace
