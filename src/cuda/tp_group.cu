// TpIndexer on the CUDA backend, in two shapes:
//  - simulated ranks: W rank caches on the current GPU, W host threads with their own streams, and
//    the device in-process communicator (make_cuda_tp_indexer);
//  - one rank of a group of processes: this process's rank cache only, the caller's communicator
//    (NCCL under `indexcp launch`), the owned heads' selections all-gathered so that every rank
//    returns the whole selection (make_cuda_rank_indexer).
#include <algorithm>
#include <chrono>

#include "common.cuh"
#include "indexcp/cuda.hpp"
#include "indexcp/error.hpp"
#include "indexcp/plan.hpp"
#include "indexcp/tp_group.hpp"
#include "core/clock.hpp"

namespace indexcp {

namespace {

using detail::now_us;

// A device copy of n host elements.
template <class T>
cuda::detail::DeviceBuffer<T> device_copy(const T* host, size_t n) {
  cuda::detail::DeviceBuffer<T> buf(n);
  if (n) {
    buf.upload(host, n);
    // a copy from pageable memory may return before its DMA lands, and the ranks read the batch
    // on their own non-blocking streams (the validating read-backs too): wait for it
    cuda::detail::check(cudaStreamSynchronize(cudaStreamLegacy), "cudaStreamSynchronize (upload)");
  }
  return buf;
}

// Rank `rank`'s selections of its owned heads (int32 [rows, nh, K] at src) into the whole
// selection (int32 [rows, heads, K] at all). When ranks share a head (W > heads), the first of them
// holds it and the others are skipped.
void place_heads(int rank, int W, int32_t heads, int64_t rows, int32_t K, const int32_t* src, int32_t* all) {
  int32_t h0, nh;
  owned_heads(heads, W, rank, &h0, &nh);
  if (W > heads && rank != h0 * W / heads) return;
  for (int64_t r = 0; r < rows; ++r)
    for (int32_t hh = 0; hh < nh; ++hh) std::copy_n(src + (r * nh + hh) * K, K, all + (r * heads + h0 + hh) * K);
}

// The one refusal of both shapes when no GPU is visible.
void require_gpu() {
  if (!cuda::available())
    throw Error(ErrorCode::kUnsupported, "--backend cuda: no CUDA GPU is visible (this build has the CUDA backend)");
}

}  // namespace

void cuda::check_rank_agreement(Communicator& comm, const ResolvedConfig& config, int64_t num_pages, Stream stream) {
  indexcp::detail::exchange_rank_agreement(config, num_pages, comm.world(), [&](const RankAgreement* send, RankAgreement* recv) {
    const size_t n = sizeof(RankAgreement), W = static_cast<size_t>(comm.world());
    cuda::detail::DeviceBuffer<RankAgreement> d(1 + W);  // [send | recv x W]
    const auto st = reinterpret_cast<cudaStream_t>(stream);
    cuda::detail::check(cudaMemcpyAsync(d.get(), send, n, cudaMemcpyHostToDevice, st), "cudaMemcpyAsync (agreement record)");
    comm.all_gather(d.get(), d.get() + 1, n, stream);
    comm.synchronize(stream);  // bounded by the communicator's timeout (a dead peer)
    cuda::detail::check(cudaMemcpyAsync(recv, d.get() + 1, n * W, cudaMemcpyDeviceToHost, st),
                        "cudaMemcpyAsync (agreement records)");
    cuda::detail::check(cudaStreamSynchronize(st), "cudaStreamSynchronize (agreement records)");
  });
}

namespace {

class CudaTpIndexer final : public TpIndexer {
 public:
  // group == nullptr: every rank simulated here; else this process is rank group->rank().
  CudaTpIndexer(const ResolvedConfig& c, int64_t num_pages, Communicator* group) : cfg_(c), group_(group) {
    if (!group_) {
      check_resolved_config(c);
      make_caches(c, num_pages);
      return;
    }
    // a rank of a group: its stream and timing events, then, before anything else, the check that
    // the other ranks were given the same config and cache size (it checks this rank's own config
    // too), then its cache. The destructor does not run when the constructor throws: release().
    // A blocking stream: its work waits for the legacy stream's (the cache's zero fill, the batch
    // uploads by cudaMemcpy, which may return before a pageable copy has landed).
    cudaStream_t s = nullptr;
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    cudaError_t err = cudaStreamCreate(&s);
    if (err == cudaSuccess) err = cudaEventCreate(&e0);
    if (err == cudaSuccess) err = cudaEventCreate(&e1);
    if (err != cudaSuccess) {  // all three or none
      if (e0) cudaEventDestroy(e0);
      if (s) cudaStreamDestroy(s);
      cuda::detail::check(err, "cudaStreamCreate / cudaEventCreate (the rank's stream and timing events)");
    }
    stream_ = s;
    ev_start_ = e0;
    ev_end_ = e1;
    try {
      cuda::check_rank_agreement(*group_, c, num_pages, reinterpret_cast<cuda::Stream>(stream_));
      first_ = c.shards > 1 ? group_->rank() : 0;  // a shard, or this rank's full replicated copy
      make_caches(c, num_pages);
    } catch (...) {
      release();
      throw;
    }
  }
  ~CudaTpIndexer() override { release(); }
  CudaTpIndexer(const CudaTpIndexer&) = delete;
  CudaTpIndexer& operator=(const CudaTpIndexer&) = delete;
  std::string backend() const override { return "cuda"; }
  const ResolvedConfig& config() const override { return cfg_; }
  int64_t cache_bytes_per_rank() const override { return caches_[0].size_bytes(); }

  void insert(const float* keys, const int64_t* slots, int64_t n, float S) override {
    check_num_tokens(n);  // before n keys are uploaded
    if (n == 0) return;
    INDEXCP_REQUIRE(keys != nullptr && slots != nullptr, "keys or slot_mapping is null");
    const auto k = device_copy<float>(keys, static_cast<size_t>(n) * kHeadDim);
    const auto s = device_copy<int64_t>(slots, static_cast<size_t>(n));
    InsertOptions o;
    o.encode_scale = S;
    // rank 0 validates first: a refused batch writes nothing on any rank
    for (auto& c : caches_) cuda::insert_keys(c, 0, k.get(), s.get(), n, o, nullptr);
  }

  // One decode step through the plans of the engine API (cuda::DecodePlan, one per rank): the
  // resolved config picks the path. Simulated ranks: each rank's plan runs on its own thread and
  // stream through the in-process device group; its time is then taken as CUDA graph replays of
  // that rank's plan (as an engine runs it). A rank of a process group: its plan on its stream,
  // the exchange through the group's communicator.
  std::vector<int32_t> decode(const DecodeBatch& b, const SelectionParams& sel, StepStats* st) override {
    sel.validate();
    (void)decode_rows(b, caches_[0].num_pages(), cfg_.engine.page_size);  // the CPU's checks and messages
    const int64_t rows = b.rows();
    const auto q = device_copy<uint8_t>(b.q, static_cast<size_t>(rows) * b.heads * kHeadDim);
    const auto bt = device_copy<int32_t>(b.block_table, static_cast<size_t>(b.num_requests) * b.max_pages);
    const auto sl = device_copy<int32_t>(b.seq_lens, static_cast<size_t>(b.num_requests));
    const DeviceDecodeBatch d{q.get(), bt.get(), sl.get(), b.num_requests};
    check_heads_tp(b.heads, cfg_.engine.tp);
    DecodeLimits lim;
    lim.max_requests = std::max(1, b.num_requests);
    lim.max_pages = std::max(1, b.max_pages);
    lim.query_len = b.query_len;
    lim.heads = b.heads;
    lim.sel = sel;
    const int W = cfg_.engine.tp;
    std::vector<cuda::DecodePlan> plans;
    std::vector<cuda::detail::DeviceBuffer<uint8_t>> ws;
    for (int r = 0; r < W; ++r) {
      if (group_ && r != group_->rank()) continue;
      plans.emplace_back(cfg_, r, lim);
      ws.emplace_back(plans.back().workspace_bytes());
      // zero-filled once (the exchange copies whole records, stale rows included)
      cuda::detail::check(cudaMemset(ws.back().get(), 0, ws.back().size()), "cudaMemset (workspace)");
    }
    cuda::detail::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (workspace)");
    cuda::detail::DeviceBuffer<uint32_t> status(static_cast<size_t>(W));
    auto plan_of = [&](int rank) -> size_t { return group_ ? 0 : static_cast<size_t>(rank); };
    auto res = run(rows, b.heads, sel, st, [&](int rank, Communicator& comm, int32_t* out, cuda::Stream s) {
      const size_t i = plan_of(rank);
      plans[i].run(rank_cache(rank), 0, d, ws[i].get(), ws[i].size(), out, &comm, status.get() + rank, s);
    });
    // the step statuses, after every rank's stream was synchronized (not inside the timed span):
    // ranks that disagree all see it, so every rank throws the same Error
    if (rows > 0 && plans[0].path() != DecodePath::kReplicated) {
      std::vector<uint32_t> h(static_cast<size_t>(W), 0);
      cuda::detail::check(cudaMemcpy(h.data(), status.get(), h.size() * sizeof(uint32_t), cudaMemcpyDeviceToHost),
                          "cudaMemcpy (step status)");
      for (int r = 0; r < W; ++r)
        if ((!group_ || r == group_->rank()) && h[static_cast<size_t>(r)] != 0)
          throw Error(ErrorCode::kRuntime, step_status_message(h[static_cast<size_t>(r)], "decode"));
    }
    if (st && !group_ && rows > 0) {
      st->us_per_rank = graph_us_per_rank(plans, ws, d, rows * plans[0].num_heads() * sel.topk);
      st->timing = "each rank's decode plan as CUDA graph replays on one GPU (score + publish, then merge; the "
                   "in-process exchange excluded), median of 20 after 3 warm-up replays, L2 not flushed";
    } else if (st && group_) {
      st->timing = "this rank's stream from its first to its last launch (CUDA events), eager, the NCCL exchange "
                   "included";
    }
    return res;
  }

  // The mean over ranks of each rank's plan replayed as a CUDA graph: the exchanging paths as
  // publish (into the rank's send record) + merge (of the records the step just exchanged, still in
  // the rank's receive buffer), the replicated path as its whole run.
  double graph_us_per_rank(const std::vector<cuda::DecodePlan>& plans,
                           const std::vector<cuda::detail::DeviceBuffer<uint8_t>>& ws, const DeviceDecodeBatch& d,
                           int64_t out_elems) {
    cudaStream_t s = nullptr;
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    cuda::detail::check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate (timing)");
    cuda::detail::check(cudaEventCreate(&e0), "cudaEventCreate (timing)");
    cuda::detail::check(cudaEventCreate(&e1), "cudaEventCreate (timing)");
    cuda::detail::DeviceBuffer<int32_t> out(static_cast<size_t>(std::max<int64_t>(1, out_elems)));
    const auto ss = reinterpret_cast<cuda::Stream>(s);
    double total = 0;
    try {
      for (size_t r = 0; r < plans.size(); ++r) {
        const cuda::DecodePlan& p = plans[r];
        cudaGraph_t g = nullptr;
        cudaGraphExec_t ge = nullptr;
        cuda::detail::check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
        try {
          if (p.path() == DecodePath::kReplicated) {
            p.run(rank_cache(static_cast<int>(r)), 0, d, ws[r].get(), ws[r].size(), out.get(), nullptr, nullptr, ss);
          } else {
            p.publish(rank_cache(static_cast<int>(r)), 0, d, ws[r].get(), ws[r].size(), p.send_buffer(ws[r].get()), ss);
            p.merge(d, p.recv_buffer(ws[r].get()), out.get(), nullptr, ss);
          }
        } catch (...) {
          cudaStreamEndCapture(s, &g);
          if (g) cudaGraphDestroy(g);
          throw;
        }
        cuda::detail::check(cudaStreamEndCapture(s, &g), "cudaStreamEndCapture");
        cuda::detail::check(cudaGraphInstantiate(&ge, g, 0), "cudaGraphInstantiate");
        std::vector<float> t;
        for (int i = 0; i < 23; ++i) {
          cuda::detail::check(cudaEventRecord(e0, s), "cudaEventRecord");
          cuda::detail::check(cudaGraphLaunch(ge, s), "cudaGraphLaunch");
          cuda::detail::check(cudaEventRecord(e1, s), "cudaEventRecord");
          cuda::detail::check(cudaEventSynchronize(e1), "cudaEventSynchronize");
          float ms = 0;
          cuda::detail::check(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
          if (i >= 3) t.push_back(ms);
        }
        std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
        total += static_cast<double>(t[t.size() / 2]) * 1e3;
        cudaGraphExecDestroy(ge);
        cudaGraphDestroy(g);
      }
    } catch (...) {
      cudaEventDestroy(e0);
      cudaEventDestroy(e1);
      cudaStreamDestroy(s);
      throw;
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaStreamDestroy(s);
    return total / static_cast<double>(plans.size());
  }

  std::vector<int32_t> prefill(const PrefillBatch& b, const SelectionParams& sel, StepStats* st) override {
    sel.validate();
    (void)prefill_rows(b, caches_[0].num_pages(), cfg_.engine.page_size);
    const int64_t rows = b.rows();
    const auto q = device_copy<uint8_t>(b.q, static_cast<size_t>(rows) * b.heads * kHeadDim);
    const auto bt = device_copy<int32_t>(b.block_table, static_cast<size_t>(b.num_requests) * b.max_pages);
    const auto sl = device_copy<int32_t>(b.seq_lens, static_cast<size_t>(b.num_requests));
    const auto qs = device_copy<int32_t>(b.query_start, static_cast<size_t>(b.num_requests) + 1);
    PrefillBatch d = b;
    d.q = q.get();
    d.block_table = bt.get();
    d.seq_lens = sl.get();
    d.query_start = qs.get();
    std::vector<int64_t> reserved(static_cast<size_t>(cfg_.engine.tp), 0);
    auto res = run(rows, b.heads, sel, st, [&](int rank, Communicator& comm, int32_t* out, cuda::Stream s) {
      if (cfg_.sharding && cfg_.prefill_cp == PrefillCp::kGather) {
        reserved[rank] = cuda::prefill_gather(comm, cache(rank), 0, d, sel, cfg_.prefill_gather_budget_bytes, out, s,
                                               cfg_.score_precision)
                             .reserved_bytes;
      } else if (cfg_.sharding) {
        cuda::prefill_local_score(comm, cache(rank), 0, d, sel, out, s, cfg_.score_precision);
      } else {
        int32_t h0, nh;
        owned_heads(d.heads, comm.world(), rank, &h0, &nh);
        cuda::prefill_select(cache(0), 0, d, h0, nh, sel, out, s, cfg_.score_precision);
      }
    });
    if (st) {
      st->gather_reserved_bytes = *std::max_element(reserved.begin(), reserved.end());
      st->timing = group_ ? "this rank's stream (CUDA events), eager, synchronous entry points"
                          : "host wall time of each rank's thread around its synchronous prefill call";
    }
    return res;
  }

  std::vector<float> decode_scores(const DecodeBatch& b) override {
    INDEXCP_REQUIRE(!cfg_.sharding, "decode_scores needs a replicated cache (sharding is on)");
    (void)decode_rows(b, caches_[0].num_pages(), cfg_.engine.page_size);
    const int64_t rows = b.rows();
    const auto q = device_copy<uint8_t>(b.q, static_cast<size_t>(rows) * b.heads * kHeadDim);
    const auto bt = device_copy<int32_t>(b.block_table, static_cast<size_t>(b.num_requests) * b.max_pages);
    const auto sl = device_copy<int32_t>(b.seq_lens, static_cast<size_t>(b.num_requests));
    DecodeBatch d = b;
    d.q = q.get();
    d.block_table = bt.get();
    d.seq_lens = sl.get();
    const int64_t mb = static_cast<int64_t>(b.max_pages) * caches_[0].layout().blocks_per_page();
    const size_t n = static_cast<size_t>(rows) * b.heads * mb;
    cuda::detail::DeviceBuffer<float> out(n);
    cuda::decode_scores(caches_[0], 0, d, 0, b.heads, cfg_.k_rounding, out.get(), nullptr, false,
                        cfg_.score_precision);
    std::vector<float> h(n);
    if (n) cuda::detail::check(cudaMemcpy(h.data(), out.get(), n * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy (scores)");
    return h;
  }

 private:
  template <class Fn>
  std::vector<int32_t> run(int64_t rows, int32_t heads, const SelectionParams& sel, StepStats* st, Fn&& fn) {
    const int W = cfg_.engine.tp;
    check_heads_tp(heads, W);
    if (group_) return run_rank(rows, heads, sel, st, fn);
    std::vector<cuda::detail::DeviceBuffer<int32_t>> outs(static_cast<size_t>(W));
    std::vector<double> busy(static_cast<size_t>(W), 0.0);
    std::vector<int64_t> sent(static_cast<size_t>(W), 0);
    for (int r = 0; r < W; ++r) {
      int32_t h0, nh;
      owned_heads(heads, W, r, &h0, &nh);
      outs[r].resize(static_cast<size_t>(std::max<int64_t>(1, rows * nh * sel.topk)));
    }
    const double t0 = now_us();
    cuda::run_device_ranks(W, [&](int rank, Communicator& comm, cuda::Stream s) {
      const double a = now_us();
      fn(rank, comm, outs[rank].get(), s);
      cuda::detail::check(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(s)), "cudaStreamSynchronize");
      busy[rank] = now_us() - a;
      sent[rank] = static_cast<int64_t>(comm.bytes_sent());
    });
    const double wall = now_us() - t0;
    std::vector<int32_t> all(static_cast<size_t>(rows) * heads * sel.topk, -1);
    for (int rank = 0; rank < W; ++rank) {
      int32_t h0, nh;
      owned_heads(heads, W, rank, &h0, &nh);
      std::vector<int32_t> h(static_cast<size_t>(rows) * nh * sel.topk);
      if (!h.empty())
        cuda::detail::check(cudaMemcpy(h.data(), outs[rank].get(), h.size() * sizeof(int32_t), cudaMemcpyDeviceToHost),
                            "cudaMemcpy (selection)");
      place_heads(rank, W, heads, rows, sel.topk, h.data(), all.data());
    }
    if (st) {
      *st = StepStats{};
      st->wall_us = wall;
      for (int r = 0; r < W; ++r) {
        st->us_per_rank += busy[r] / W;
        st->bytes_exchanged = std::max(st->bytes_exchanged, sent[r]);
      }
    }
    return all;
  }

  // This process as rank group_->rank(): fn on this rank's stream, then the owned heads of every
  // rank all-gathered through the group (each rank's block is rows x nh x K int32, nh the same on
  // every rank since H % W == 0 or W % H == 0), so every rank returns the whole selection.
  template <class Fn>
  std::vector<int32_t> run_rank(int64_t rows, int32_t heads, const SelectionParams& sel, StepStats* st, Fn&& fn) {
    const int W = cfg_.engine.tp, me = group_->rank();
    int32_t h0, nh;
    owned_heads(heads, W, me, &h0, &nh);
    const size_t per_rank = static_cast<size_t>(rows) * nh * sel.topk;
    cuda::detail::DeviceBuffer<int32_t> out(std::max<size_t>(1, per_rank)), all_dev(std::max<size_t>(1, per_rank * W));
    const size_t sent0 = group_->bytes_sent();
    size_t step_sent = 0;  // the step's collectives only, not the selection all-gather below
    float busy_ms = 0;
    try {
      // the step's time on this rank: its stream from the first to the last of its work (events;
      // the communicator's polling wait would round it up)
      cuda::detail::check(cudaEventRecord(ev_start_, stream_), "cudaEventRecord");
      fn(me, *group_, out.get(), reinterpret_cast<cuda::Stream>(stream_));
      cuda::detail::check(cudaEventRecord(ev_end_, stream_), "cudaEventRecord");
      wait_stream();
      cuda::detail::check(cudaEventElapsedTime(&busy_ms, ev_start_, ev_end_), "cudaEventElapsedTime");
      step_sent = group_->bytes_sent() - sent0;
      if (per_rank) group_->all_gather(out.get(), all_dev.get(), per_rank * sizeof(int32_t), stream_);
      wait_stream();
    } catch (...) {
      // work may still be queued on the stream (a collective whose peer failed): wait for it
      // through the communicator (bounded; it aborts on timeout) before the buffers are freed
      try {
        wait_stream();
      } catch (...) {
      }
      throw;
    }
    const double busy = static_cast<double>(busy_ms) * 1e3;
    std::vector<int32_t> gathered(per_rank * W);
    if (!gathered.empty())
      cuda::detail::check(cudaMemcpy(gathered.data(), all_dev.get(), gathered.size() * sizeof(int32_t), cudaMemcpyDeviceToHost),
                          "cudaMemcpy (selection)");
    std::vector<int32_t> all(static_cast<size_t>(rows) * heads * sel.topk, -1);
    for (int rank = 0; rank < W; ++rank)
      place_heads(rank, W, heads, rows, sel.topk, gathered.data() + static_cast<size_t>(rank) * per_rank, all.data());
    if (st) {
      *st = StepStats{};
      st->wall_us = busy;
      st->us_per_rank = busy;
      st->bytes_exchanged = static_cast<int64_t>(step_sent);
    }
    return all;
  }

  // bf16 is refused; simulated ranks keep one cache per shard (or one replicated copy), a rank of
  // a group only its own
  void make_caches(const ResolvedConfig& c, int64_t num_pages) {
    if (c.kv_dtype == KvDtype::kBf16)
      throw Error(ErrorCode::kUnsupported,
                  "indexer_kv_dtype = bf16 is not supported by --backend cuda (use fp8 or nvfp4, or --backend cpu)");
    const PageLayout l = make_page_layout(c.kv_dtype, c.engine.page_size, c.shards);
    const int32_t n = group_ ? 1 : c.shards;
    for (int32_t r = 0; r < n; ++r) caches_.emplace_back(l, num_pages, 1, first_ + r);
  }

  // The rank's stream and events (rank mode), after the communicator's bounded wait and the
  // stream's own (a collective whose peer died would never complete: the communicator aborts
  // after its timeout and throws, and the stream is then released without waiting).
  void release() noexcept {
    if (!stream_) return;
    try {
      wait_stream();
    } catch (...) {
    }
    cudaStreamDestroy(stream_);
    cudaEventDestroy(ev_start_);
    cudaEventDestroy(ev_end_);
    stream_ = nullptr;
  }

  // Waits for this rank's stream: the communicator's bounded wait first (NCCL: a peer that died is
  // reported after the timeout instead of blocking forever), then the stream itself (the wait of
  // the in-process DeviceGroup is a no-op; after NCCL's it returns at once).
  void wait_stream() {
    group_->synchronize(stream_);
    cuda::detail::check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (the rank's stream)");
  }

  // rank r's cache: simulated ranks keep one per rank (sharded) or one shared copy; a process
  // rank keeps only its own (first_ is its rank when sharded, 0 otherwise)
  cuda::DeviceCache& cache(int rank) { return caches_.at(static_cast<size_t>(rank - first_)); }
  // the cache rank r reads: its shard, or the one replicated copy (simulated: caches_[0]; a
  // process rank: its own full copy)
  cuda::DeviceCache& rank_cache(int rank) { return cfg_.shards > 1 ? cache(rank) : caches_.at(0); }

  ResolvedConfig cfg_;
  Communicator* group_ = nullptr;
  int32_t first_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ev_start_ = nullptr, ev_end_ = nullptr;
  std::vector<cuda::DeviceCache> caches_;
};

}  // namespace

bool cuda_available() { return cuda::available(); }
bool built_with_cuda() { return true; }

std::unique_ptr<TpIndexer> make_cuda_tp_indexer(const ResolvedConfig& config, int64_t num_pages) {
  require_gpu();
  return std::make_unique<CudaTpIndexer>(config, num_pages, nullptr);
}

std::unique_ptr<TpIndexer> make_cuda_rank_indexer(const ResolvedConfig& config, int64_t num_pages, Communicator& comm) {
  require_gpu();
  return std::make_unique<CudaTpIndexer>(config, num_pages, &comm);
}

}  // namespace indexcp
