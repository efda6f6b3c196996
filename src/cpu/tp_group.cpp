// TpIndexer on the CPU backend: W rank caches, W threads, in-process communicator.
#include <chrono>
#include <mutex>

#include "indexcp/error.hpp"
#include "indexcp/icp.hpp"
#include "indexcp/plan.hpp"
#include "indexcp/tp_group.hpp"
#include "core/clock.hpp"

namespace indexcp {

namespace {

using detail::now_us;

class CpuTpIndexer final : public TpIndexer {
 public:
  CpuTpIndexer(const ResolvedConfig& c, int64_t num_pages) : cfg_(c) {
    check_resolved_config(c);
    const PageLayout l = make_page_layout(c.kv_dtype, c.engine.page_size, c.shards);
    for (int32_t r = 0; r < c.shards; ++r) caches_.emplace_back(l, num_pages, 1, r);
  }
  std::string backend() const override { return "cpu"; }
  const ResolvedConfig& config() const override { return cfg_; }
  int64_t cache_bytes_per_rank() const override { return caches_[0].size_bytes(); }

  void insert(const float* keys, const int64_t* slots, int64_t n, float S) override {
    InsertOptions o;
    o.encode_scale = S;
    // validate on rank 0 first: a refused batch writes nothing on any rank
    insert_keys(caches_[0], 0, keys, slots, n, o);
    for (size_t r = 1; r < caches_.size(); ++r) insert_keys(caches_[r], 0, keys, slots, n, o);
  }

  std::vector<int32_t> decode(const DecodeBatch& b, const SelectionParams& sel, StepStats* st) override {
    sel.validate();
    decode_rows(b, caches_[0].num_pages(), cfg_.engine.page_size);  // validate before sizing outputs
    // each rank's decode plan (plan.hpp): the resolved config picks the path
    DecodeLimits lim;
    lim.max_requests = std::max(1, b.num_requests);
    lim.max_pages = std::max(1, b.max_pages);
    lim.query_len = b.query_len;
    lim.heads = b.heads;
    lim.sel = sel;
    check_heads_tp(b.heads, cfg_.engine.tp);
    const DeviceDecodeBatch d{b.q, b.block_table, b.seq_lens, b.num_requests};
    return run(b.rows(), b.heads, sel, st, [&](int rank, Communicator& comm, int32_t* out, StepStats& s) {
      const DecodePlan plan(cfg_, rank, lim);
      std::vector<uint8_t> ws(plan.workspace_bytes() + 16);
      void* w = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.data()) + 15) / 16 * 16);
      uint32_t status = 0;
      plan.run(caches_[cfg_.shards > 1 ? rank : 0], 0, d, w, plan.workspace_bytes(), out, &comm, &status);
      if (status != 0) throw Error(ErrorCode::kRuntime, step_status_message(status, "decode"));
      s.bytes_exchanged = static_cast<int64_t>(comm.bytes_sent());
    });
  }

  std::vector<int32_t> prefill(const PrefillBatch& b, const SelectionParams& sel, StepStats* st) override {
    sel.validate();
    prefill_rows(b, caches_[0].num_pages(), cfg_.engine.page_size);  // validate before sizing outputs
    return run(b.rows(), b.heads, sel, st, [&](int rank, Communicator& comm, int32_t* out, StepStats& s) {
      if (cfg_.sharding && cfg_.prefill_cp == PrefillCp::kGather) {
        const GatherStats g = prefill_gather(comm, caches_[rank], 0, b, sel, cfg_.prefill_gather_budget_bytes, out);
        s.gather_reserved_bytes = g.reserved_bytes;
      } else if (cfg_.sharding) {
        prefill_local_score(comm, caches_[rank], 0, b, sel, out);
      } else {
        int32_t h0, nh;
        owned_heads(b.heads, comm.world(), rank, &h0, &nh);
        prefill_select(caches_[0], 0, b, h0, nh, sel, out);
      }
      s.bytes_exchanged = static_cast<int64_t>(comm.bytes_sent());
    });
  }

  std::vector<float> decode_scores(const DecodeBatch& b) override {
    INDEXCP_REQUIRE(!cfg_.sharding, "decode_scores needs a replicated cache (sharding is on)");
    const auto rows = decode_rows(b, caches_[0].num_pages(), cfg_.engine.page_size);
    const auto s = score_blocks(caches_[0], 0, rows, b.block_table, b.max_pages, b.q, b.heads, 0, b.heads,
                                cfg_.k_rounding);
    return s.score;
  }

 private:
  template <class Fn>
  std::vector<int32_t> run(int64_t rows, int32_t heads, const SelectionParams& sel, StepStats* st, Fn&& fn) {
    const int W = cfg_.engine.tp;
    check_heads_tp(heads, W);
    std::vector<std::vector<int32_t>> per(static_cast<size_t>(W));
    std::vector<StepStats> stats(static_cast<size_t>(W));
    const double t0 = now_us();
    run_ranks(W, [&](int rank, Communicator& comm) {
      int32_t h0, nh;
      owned_heads(heads, W, rank, &h0, &nh);
      per[rank].assign(static_cast<size_t>(rows) * nh * sel.topk, -1);
      const double a = now_us();
      fn(rank, comm, per[rank].data(), stats[rank]);
      stats[rank].us_per_rank = now_us() - a;
    });
    std::vector<int32_t> all(static_cast<size_t>(rows) * heads * sel.topk, -1);
    for (int rank = 0; rank < W; ++rank) {
      int32_t h0, nh;
      owned_heads(heads, W, rank, &h0, &nh);
      if (W > heads && rank != h0 * W / heads) continue;  // the first rank sharing a head
      for (int64_t r = 0; r < rows; ++r)
        for (int32_t h = 0; h < nh; ++h)
          std::copy_n(per[rank].data() + (r * nh + h) * sel.topk, sel.topk,
                      all.data() + (r * heads + h0 + h) * sel.topk);
    }
    if (st) {
      *st = StepStats{};
      st->wall_us = now_us() - t0;
      st->timing = "host wall time of each rank's thread (CPU backend), averaged over ranks";
      for (const auto& s : stats) {
        st->us_per_rank += s.us_per_rank / W;
        st->bytes_exchanged = std::max(st->bytes_exchanged, s.bytes_exchanged);
        st->gather_reserved_bytes = std::max(st->gather_reserved_bytes, s.gather_reserved_bytes);
      }
    }
    return all;
  }

  ResolvedConfig cfg_;
  std::vector<IndexCache> caches_;
};

}  // namespace

void check_rank_agreement(Communicator& comm, const ResolvedConfig& config, int64_t num_pages) {
  detail::exchange_rank_agreement(config, num_pages, comm.world(), [&](const RankAgreement* send, RankAgreement* recv) {
    comm.all_gather(send, recv, sizeof(RankAgreement), nullptr);
  });
}

std::unique_ptr<TpIndexer> make_cpu_tp_indexer(const ResolvedConfig& c, int64_t num_pages) {
  return std::make_unique<CpuTpIndexer>(c, num_pages);
}

std::unique_ptr<TpIndexer> make_tp_indexer(const std::string& backend, const ResolvedConfig& c, int64_t num_pages) {
  if (backend == "cpu") return make_cpu_tp_indexer(c, num_pages);
  if (backend == "cuda") return make_cuda_tp_indexer(c, num_pages);
  if (backend == "auto") return cuda_available() ? make_cuda_tp_indexer(c, num_pages) : make_cpu_tp_indexer(c, num_pages);
  throw Error(ErrorCode::kInvalidArgument, "--backend = \"" + backend + "\" is not supported; use cpu, cuda or auto");
}

}  // namespace indexcp
