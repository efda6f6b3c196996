// `indexcp bench decode|topk|insert|prefill|step`: the benchmarks of spec/bench.md on the CUDA
// backend (src/bench/bench.hpp has the method). Exit status as the other commands; 3 when a
// sharded selection differed from the replicated one.
#include <CLI/CLI.hpp>

#include <filesystem>

#include "commands.hpp"
#include "subcommand.hpp"
#include "validators.hpp"

#include "bench/bench.hpp"
#include "indexcp/error.hpp"
#include "indexcp/rendezvous.hpp"

namespace indexcp::cli {
namespace {

void add_common(CLI::App* c, bench::RunOptions& r) {
  c->add_option("--replays", r.replays, "timed replays per cell; the median is reported")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  c->add_option("--repeats", r.repeats, "whole-table repetitions (medians averaged when within 2%)")
      ->check(CLI::Range(1, 4))
      ->capture_default_str();
  c->add_option("--out", r.out,
                "JSON record to write; 'auto' = <benchmark>-<device>-<date>.json in the current directory")
      ->check(non_empty_path())
      ->capture_default_str();
  c->add_flag_callback("--no-record", [&r] { r.out.clear(); }, "write no JSON record");
  c->add_option("--git-rev", r.git_rev, "git revision stored in the record (default: $INDEXCP_GIT_REV or unknown)");
  c->add_flag_callback("-q,--quiet", [&r] { r.progress = false; }, "no progress lines on stderr");
}

class BenchCommand final : public Subcommand {
 public:
  CLI::App* add(CLI::App& app) override;
  int run(int argc, char** argv) override;

 private:
  CLI::App* bench = nullptr;
  CLI::App *decode = nullptr, *topk = nullptr, *insert = nullptr, *prefill = nullptr, *step = nullptr;
  bench::DecodeOptions d, t;
  bench::InsertOptions i;
  bench::PrefillOptions p;
  bench::StepOptions s;
};

CLI::App* BenchCommand::add(CLI::App& app) {
  BenchCommand& m = *this;
  m.bench = app.add_subcommand("bench", "Benchmarks of the CUDA backend (spec/bench.md): decode, topk, insert, prefill, step");
  m.bench->require_subcommand(1);
  m.bench->footer(
      "One GPU, TP ranks simulated on it (`bench decode` also runs as one rank per GPU under `indexcp launch --tp W`, "
      "through NCCL). Each timed sequence is a CUDA graph replayed --replays times with L2 flushed "
      "before each; the table runs --repeats times. Copy bandwidth and FP8 matrix rate are measured in the same run. "
      "Prints a table, progress on stderr, and writes a JSON record (bench/plot.py turns records into charts).");
  for (int k = 0; k < 2; ++k) {
    const bool topk = k == 1;
    bench::DecodeOptions& o = topk ? m.t : m.d;
    o.topk_only = topk;
    CLI::App* c = m.bench->add_subcommand(
        topk ? "topk" : "decode",
        topk ? "Top-k selection, ICP publish and merge alone, on the shapes of the decode table"
             : "The decode indexer table (bench.md section 1): replicated stock vs ICP general / stock scorer");
    add_common(c, o.run);
    c->add_option("--requests", o.requests, "requests per batch")->delimiter(',')->capture_default_str();
    c->add_option("--contexts", o.contexts, "context lengths in tokens")->delimiter(',')->capture_default_str();
    c->add_option("--pages", o.pages, "page sizes")->delimiter(',')->check(CLI::IsMember({128, 256}))->capture_default_str();
    c->add_option("--tp", o.tp, topk ? "simulated TP size" : "TP size (simulated; under `indexcp launch --tp W`: W, one rank per process)")->check(CLI::IsMember({2, 4, 8}))->capture_default_str();
    c->add_option("--heads", o.heads, "index heads")->check(CLI::Range(1, 64))->capture_default_str();
    c->add_option("--query-len", o.query_len, "queries per request (Q)")->check(CLI::Range(1, 16))->capture_default_str();
    c->add_option("--kv-dtype", o.kv_dtype, "index cache dtype")->check(CLI::IsMember({"nvfp4", "fp8"}))->capture_default_str();
    c->add_option("--k-rounding", o.k_rounding, "NVFP4 K rounding")->check(CLI::IsMember({"e4m3", "exact"}))->capture_default_str();
    c->add_option("--score-precision", o.score_precision,
                  "indexer_score_precision: fp32, or fp8_mma (FP8 tensor cores; each cell also reports the share of "
                  "(row, head) selections that differ from the fp32 mode)")
        ->check(CLI::IsMember({"fp32", "fp8_mma"}))
        ->capture_default_str();
    if (!topk)
      c->add_option("--dump", o.dump,
                    "write the replicated pages, block table, q and selections under DIR (input of bench/torch/baseline.py)")
          ->check(non_empty_path());
    (topk ? m.topk : m.decode) = c;
  }
  {
    auto* c = m.insert = m.bench->add_subcommand("insert", "Insert (quantize + write) throughput, replicated and sharded");
    add_common(c, m.i.run);
    c->add_option("--tokens", m.i.tokens, "tokens per insert call")->delimiter(',')->capture_default_str();
    c->add_option("--kv-dtypes", m.i.kv_dtypes, "cache dtypes")->delimiter(',')->check(CLI::IsMember({"nvfp4", "fp8"}))->capture_default_str();
    c->add_option("--tp", m.i.tp, "shards of the sharded cache")->check(CLI::IsMember({2, 4, 8}))->capture_default_str();
  }
  {
    auto* c = m.prefill = m.bench->add_subcommand("prefill", "Gather prefill: FP8 staging, all-gather, scoring TFLOP/s, transient bytes");
    add_common(c, m.p.run);
    c->add_option("--requests", m.p.requests, "requests")->check(CLI::Range(1, 64))->capture_default_str();
    c->add_option("--contexts", m.p.contexts, "context lengths L (the chunk is the last --chunk tokens)")->delimiter(',')->capture_default_str();
    c->add_option("--chunk", m.p.chunk, "new tokens per request (query rows)")->check(CLI::Range(1, 65536))->capture_default_str();
    c->add_option("--page-size", m.p.page_size, "page size")->check(CLI::IsMember({128, 256}))->capture_default_str();
    c->add_option("--tp", m.p.tp, "simulated TP size")->check(CLI::IsMember({2, 4, 8}))->capture_default_str();
    c->add_option("--heads", m.p.heads, "index heads")->check(CLI::Range(1, 64))->capture_default_str();
    c->add_option("--budget-mib", m.p.budget_mib, "indexer_prefill_gather_budget_mib")->check(CLI::Range(1, 65536))->capture_default_str();
    c->add_option("--score-precision", m.p.score_precision, "indexer_score_precision: fp32, or fp8_mma (FP8 tensor cores)")
        ->check(CLI::IsMember({"fp32", "fp8_mma"}))
        ->capture_default_str();
    c->add_option("--layers", m.p.layers,
                  "sparse layers of the computed prompt line (with --contexts T,2T,..,nT for --chunk T)")
        ->check(CLI::Range(1, 256))
        ->capture_default_str();
  }
  {
    auto* c = m.step = m.bench->add_subcommand("step", "The whole decode step across all sparse layers, sharding off vs on");
    add_common(c, m.s.run);
    c->add_option("--requests", m.s.requests, "requests per batch")->delimiter(',')->capture_default_str();
    c->add_option("--context", m.s.context, "context length in tokens")->capture_default_str();
    c->add_option("--page-size", m.s.page_size, "page size")->check(CLI::IsMember({128, 256}))->capture_default_str();
    c->add_option("--layers", m.s.layers, "sparse layers (MiniMax-M3: 57)")->check(CLI::Range(1, 256))->capture_default_str();
    c->add_option("--tp", m.s.tp, "simulated TP size")->check(CLI::IsMember({2, 4, 8}))->capture_default_str();
    c->add_option("--heads", m.s.heads, "index heads")->check(CLI::Range(1, 64))->capture_default_str();
    c->add_option("--query-len", m.s.query_len, "queries per request (Q)")->check(CLI::Range(1, 16))->capture_default_str();
  }
  return m.bench;
}

int BenchCommand::run(int argc, char** argv) {
  BenchCommand& m = *this;
  std::string cmd;
  for (int k = 0; k < argc; ++k) cmd += (k ? " " : "") + std::string(argv[k]);
  // output paths are checked before minutes of benchmarking, not after
  for (const bench::RunOptions* ro : {&m.d.run, &m.t.run, &m.i.run, &m.p.run, &m.s.run})
    if (!ro->out.empty() && ro->out != "auto") check_output_path(ro->out, "--out");
  if (!m.d.dump.empty()) {
    std::error_code ec;
    if (std::filesystem::exists(m.d.dump, ec) && !std::filesystem::is_directory(m.d.dump, ec))
      throw Error(ErrorCode::kInvalidArgument, "--dump " + m.d.dump + ": exists and is not a directory");
  }
  bool eq = true;
  if (!m.decode->parsed())
    if (const auto env = rank_env_from_env(); env && env->world > 1)
      throw Error(ErrorCode::kInvalidArgument,
                  "INDEXCP_WORLD = " + std::to_string(env->world) +
                      ": under `indexcp launch` only `indexcp bench decode` runs as one rank of a group; the other "
                      "benchmarks run on one GPU (start them without the launcher)");
  if (m.decode->parsed()) {
    m.d.run.command = cmd;
    eq = bench::decode(m.d);
  } else if (m.topk->parsed()) {
    m.t.run.command = cmd;
    eq = bench::decode(m.t);
  } else if (m.insert->parsed()) {
    m.i.run.command = cmd;
    eq = bench::insert(m.i);
  } else if (m.prefill->parsed()) {
    m.p.run.command = cmd;
    eq = bench::prefill(m.p);
  } else if (m.step->parsed()) {
    m.s.run.command = cmd;
    eq = bench::step(m.s);
  }
  if (!eq) {
    std::fprintf(stderr, "indexcp: error: a sharded selection differs from the replicated one (see the table)\n");
    return 3;
  }
  return 0;
}

}  // namespace

INDEXCP_SUBCOMMAND(60, "bench", BenchCommand)

}  // namespace indexcp::cli
