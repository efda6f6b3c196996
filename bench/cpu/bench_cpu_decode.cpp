// CPU decode step benchmark (issue 2 "Speed"): 16 requests x 32K tokens x 4 index heads x 8
// queries at W = 2, replicated (one rank's 2 owned heads over all pages) and ICP over shards (all
// 4 heads over the rank's half of each page, publish, exchange, merge), all ranks in-process.
//   build/bench/bench_cpu_decode --benchmark_out=bench/results/cpu-decode-<host>-<date>.json
#include <benchmark/benchmark.h>

#include <map>
#include <memory>

#include "util.hpp"

using namespace indexcp;
using namespace testutil;

namespace {

struct Fixture {
  Requests req;
  std::vector<IndexCache> rep, shards;
  std::vector<uint8_t> q;
  DecodeBatch batch;
};

Fixture& fixture(int32_t P) {
  static std::map<int32_t, std::unique_ptr<Fixture>> cache;
  auto& f = cache[P];
  if (f) return *f;
  f = std::make_unique<Fixture>();
  f->req = make_requests(std::vector<int32_t>(16, 32768), P, 1);
  std::vector<float> keys;
  std::vector<int64_t> slots;
  make_keys(f->req, 2, keys, slots);
  f->rep = make_shards(KvDtype::kNvfp4, f->req, 1, keys, slots);
  f->shards = make_shards(KvDtype::kNvfp4, f->req, 2, keys, slots);
  f->q = make_q(16 * 8, 4, 3);
  DecodeBatch& b = f->batch;
  b.q = f->q.data();
  b.heads = 4;
  b.block_table = f->req.block_table.data();
  b.num_requests = 16;
  b.max_pages = f->req.max_pages;
  b.seq_lens = f->req.seq_lens.data();
  b.query_len = 8;
  return *f;
}

void BM_ReplicatedDecode_W2(benchmark::State& state) {
  Fixture& f = fixture(static_cast<int32_t>(state.range(0)));
  SelectionParams sel;
  for (auto _ : state) {
    run_ranks(2, [&](int rank, Communicator&) {
      std::vector<int32_t> out(f.batch.rows() * 2 * 16);
      decode_select(f.rep[0], 0, f.batch, rank * 2, 2, sel, KRounding::kE4m3, out.data());
      benchmark::DoNotOptimize(out.data());
    });
  }
  state.counters["rows"] = static_cast<double>(f.batch.rows());
}

void BM_IcpDecode_W2(benchmark::State& state) {
  Fixture& f = fixture(static_cast<int32_t>(state.range(0)));
  SelectionParams sel;
  for (auto _ : state) {
    run_ranks(2, [&](int rank, Communicator& comm) {
      std::vector<int32_t> out(f.batch.rows() * 2 * 16);
      icp_decode(comm, f.shards[rank], 0, f.batch, sel, KRounding::kE4m3, out.data());
      benchmark::DoNotOptimize(out.data());
    });
  }
}

}  // namespace

BENCHMARK(BM_ReplicatedDecode_W2)->Arg(128)->Arg(256)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3);
BENCHMARK(BM_IcpDecode_W2)->Arg(128)->Arg(256)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3);
BENCHMARK_MAIN();
