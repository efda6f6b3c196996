// The indexcp command: run (the main job), replay, capacity, config, knobs, bench, launch.
//
// Exit status: 0 success; 1 runtime failure; 2 usage or input error (bad flag, missing or corrupt
// file, wrong dtype/shape, out-of-range value, refused configuration); 3 a sharded/CP selection
// differs from the replicated one; 4 (replay) the selection differs from expected_topk.npy.
// Every failure prints exactly one line "indexcp: error: ..." on stderr.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>
#include <new>
#include <string>

#include <unistd.h>

#include "bench_cli.hpp"
#include "commands.hpp"
#include "launch.hpp"
#include "validators.hpp"
#include "core/knobs.hpp"
#include "indexcp/error.hpp"
#include "indexcp/replay.hpp"
#include "indexcp/tp_group.hpp"

#ifndef INDEXCP_VERSION
#define INDEXCP_VERSION "0"
#endif

namespace {

// One line for the terminal: control bytes (newlines, ESC, BEL, ...) become spaces, and a message
// that echoes a huge value is cut.
std::string one_line(std::string s) {
  for (char& c : s)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = ' ';
  while (!s.empty() && s.back() == ' ') s.pop_back();
  if (s.size() > 2000) s = s.substr(0, 2000) + "...";
  return s;
}

// The whole line in one write: under `indexcp launch` a SIGTERM may follow at any moment, and a
// line written in pieces could reach the launcher cut.
void print_error(const std::string& msg) {
  const std::string line = "indexcp: error: " + one_line(msg) + "\n";
  std::fflush(stdout);
  std::size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(2, line.data() + done, line.size() - done);
    if (n <= 0) break;
    done += static_cast<std::size_t>(n);
  }
}

int exit_code_of(const indexcp::Error& e) { return e.code() == indexcp::ErrorCode::kRuntime ? 1 : 2; }

}  // namespace

namespace indexcp::cli {

int replay_command(const std::string& case_dir, const std::string& out_dir, const std::string& backend, bool scores) {
  ReplayOptions opts;
  opts.backend = backend;
  opts.scores = scores;
  const ReplayResult r = replay_case(case_dir, out_dir, opts);
  std::cout << "indexcp replay: " << r.summary() << "\n";
  std::cout << "wrote";
  for (const auto& f : r.written) std::cout << " " << f;
  std::cout << " to " << out_dir << std::endl;
  if (!r.selections_equal_replicated)
    print_error("the " + r.path + " selection differs from the replicated path at " +
                r.replicated_difference.describe("sharded", "replicated"));
  else if (r.has_expected && !r.expected_equal)
    print_error("expected_topk.npy differs at " + r.expected_difference.describe("expected", "got"));
  return r.exit_code();
}

}  // namespace indexcp::cli

static int real_main(int argc, char** argv) {
  using namespace indexcp::cli;
  CLI::App app{"indexcp: block-sparse attention indexer with a sharded NVFP4/FP8 index cache and indexer context "
               "parallelism (CPU reference backend" +
                   std::string(indexcp::cuda_available()    ? ", CUDA"
                               : indexcp::built_with_cuda() ? "; CUDA backend built, no GPU visible"
                                                            : "") +
                   ")",
               "indexcp"};
  app.set_version_flag("--version", std::string("indexcp ") + INDEXCP_VERSION);
  app.require_subcommand(0, 1);
  app.fallthrough(false);

  // ---- run
  RunOptions ro;
  auto* run = app.add_subcommand("run", "The main job: an end-to-end indexer workload over real keys and queries, for "
                                        "every accepted kv dtype x page size x TP x sharding");
  run->add_option("--backend", ro.backend, "cpu, cuda or auto (the GPU when one is present)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  run->add_option("--data", ro.data_dir,
                  "data directory with keys.npy, queries.npy and meta.json (default: the embedded data, found "
                  "beside the installed binary (../share/indexcp/data/minilm_stdlib), in a data/minilm_stdlib above "
                  "it, or in the checkout it was built from)")
      ->check(non_empty_path());
  run->add_option("--keys", ro.keys_file, "index keys: float16/float32 .npy [requests, tokens, 128]")
      ->check(non_empty_path());
  run->add_option("--queries", ro.queries_file,
                  "index queries: float16/float32 .npy [requests, positions, heads, 128] for the LAST `positions` "
                  "positions of each request")
      ->check(non_empty_path());
  run->add_flag("--synthetic", ro.synthetic, "use synthetic data (never the default)");
  run->add_option("--seed", ro.seed, "seed of the synthetic data")->capture_default_str();
  run->add_option("--requests", ro.requests, "requests to use (default: all the data holds; 4 synthetic)")
      ->check(CLI::Range(1, 4096));
  run->add_option("--tokens", ro.tokens,
                  "tokens per request, L (default: all the data holds; 33024 synthetic); below the data's length the "
                  "last L tokens are used")
      ->check(CLI::Range(1, 1 << 26));
  run->add_option("--prefill-tokens", ro.prefill_tokens, "tokens of the final prefill chunk per request")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  run->add_option("--steps", ro.steps, "decode steps")->check(CLI::Range(0, 1 << 16))->capture_default_str();
  run->add_option("--query-len", ro.query_len, "queries per request per decode step (1..16)")
      ->check(CLI::Range(1, 16))
      ->capture_default_str();
  run->add_option("--layers", ro.layers, "layers to run (real data: the same layer's data each time)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  auto* heads = run->add_option("--heads", ro.heads, "index heads of synthetic data (real data: the queries' heads)")
                    ->check(CLI::Range(1, 64))
                    ->capture_default_str();
  run->add_option("--topk", ro.topk, "blocks selected per row and head")->check(CLI::Range(2, 1024))->capture_default_str();
  run->add_option("--kv-dtype", ro.kv_dtypes, "index cache dtypes")
      ->delimiter(',')
      ->check(CLI::IsMember({"nvfp4", "fp8", "bf16"}))
      ->capture_default_str();
  run->add_option("--page-size", ro.page_sizes, "page sizes")
      ->delimiter(',')
      ->check(CLI::IsMember({128, 256}))
      ->capture_default_str();
  auto* tps = run->add_option("--tp", ro.tps, "tensor-parallel sizes (as a rank of `indexcp launch --tp W`: W)")
      ->delimiter(',')
      ->check(CLI::IsMember({1, 2, 4, 8}))
      ->capture_default_str();
  run->add_option("--sharding", ro.shardings, "index cache sharding")
      ->delimiter(',')
      ->check(CLI::IsMember({"off", "on"}))
      ->capture_default_str();
  run->add_option("--capacity-budget-gib", ro.capacity_budget_gib,
                  "memory budget per rank for the report's capacity section (minimax-m3, TP2 P128, NVFP4); "
                  "> 0, at most 1048576")
      ->capture_default_str();
  run->add_option("--json", ro.json_path, "write the report as JSON to FILE")->check(non_empty_path());
  run->add_flag("-q,--quiet", ro.quiet, "no progress lines on stderr");
  run->footer(
      "Per request of L tokens: positions 0 .. L-C-S*Q-1 are inserted directly, the next C (--prefill-tokens) are "
      "inserted and prefilled as one chunk (gather mode when sharded), then S (--steps) decode steps each insert Q "
      "(--query-len) tokens and decode them. The default real data has 33024 tokens per request and queries for the "
      "last 256 positions, so C + S*Q must be <= 256 (default 128 + 3*8 = 152: 32872 tokens inserted directly). "
      "Sharding-on selections are compared bit for bit with the sharding-off run of the same dtype, P and TP; "
      "recall_vs_fp32 compares with a selection from unquantized keys scored in double. Exit status 3 if any "
      "sharded selection differs.");

  // ---- replay
  std::string case_dir, out_dir, replay_backend = "auto";
  bool scores = false;
  auto* rep = app.add_subcommand("replay", "Replay one indexer step stored as case.json + .npy arrays (spec/cases.md)");
  rep->add_option("CASE_DIR", case_dir, "the case directory")->required();
  rep->add_option("--out", out_dir, "output directory (topk.npy, report.json, scores.npy)")->required()->check(non_empty_path());
  rep->add_option("--backend", replay_backend, "cpu, cuda or auto")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  rep->add_flag("--scores", scores, "also write scores.npy (the replicated path's block scores)");
  rep->footer(
      "Exit status: 0 equal; 2 invalid case (nothing written); 3 the sharded/CP path differs from the replicated "
      "path; 4 the selection differs from expected_topk.npy (outputs are written in both cases).");

  // ---- capacity
  CapacityOptions co;
  auto* cap = app.add_subcommand("capacity", "KV-cache capacity in tokens with index-cache sharding off and on");
  cap->add_option("--model", co.model, "built-in model name (minimax-m3) or a model JSON file")->capture_default_str();
  // (the limits are checked by the command, with one message: commands.hpp kMaxBudgetBytes)
  auto* gib = cap->add_option("--budget-gib", co.budget_gib, "KV-cache memory budget per rank in GiB (> 0, at most 1048576)")
                  ->capture_default_str();
  auto* bytes = cap->add_option("--budget-bytes", co.budget_bytes,
                                "KV-cache memory budget per rank in bytes (> 0, at most 2^50)");
  gib->excludes(bytes);
  cap->add_option("--kv-dtype", co.kv_dtype, "KV cache dtype")
      ->check(CLI::IsMember({"bf16", "fp8", "nvfp4"}))
      ->capture_default_str();
  cap->add_option("--index-dtype", co.index_dtype, "index cache dtype")
      ->check(CLI::IsMember({"bf16", "fp8", "nvfp4"}))
      ->capture_default_str();
  cap->add_option("--tp", co.tp, "tensor-parallel size")->check(CLI::IsMember({1, 2, 4, 8}))->capture_default_str();
  cap->add_option("--page-size", co.page_size, "page size (engines' --block-size)")
      ->check(CLI::IsMember({128, 256}))
      ->capture_default_str();
  cap->add_option("--json", co.json_path, "also write the plan as JSON to FILE")->check(non_empty_path());

  // ---- config
  ConfigOptions cfg;
  auto* con = app.add_subcommand("config", "Resolve an attention config under the policy and print it (or the refusal)");
  con->add_option("--attention-config", cfg.attention_config, "the attention config as a JSON object, or @FILE")
      ->required();
  con->add_option("--tp", cfg.tp, "tensor-parallel size W")->required()->check(CLI::Range(1, 1024));
  con->add_option("--page-size", cfg.page_size, "page size P (engines' --block-size)")
      ->required()
      ->check(CLI::Range(1, 1 << 20));
  con->add_option("--heads", cfg.heads, "index heads H")->check(CLI::Range(1, 1024))->capture_default_str();
  con->add_option("--query-len", cfg.query_len, "decode query length Q")->check(CLI::Range(1, 1024))->capture_default_str();
  con->add_option("--speculative-method", cfg.speculative_method, "speculative decoding method (informational)");
  con->add_flag("--kv-connector", cfg.kv_connector, "a KV connector / CPU offload is configured");

  // ---- knobs: the knob table (src/core/knobs.cpp; docs/knobs.md)
  bool knobs_markdown = false;
  auto* kno = app.add_subcommand("knobs", "List every INDEXCP_* environment variable and -D build switch, with its "
                                          "default and what it does");
  kno->add_flag("--markdown", knobs_markdown, "print the table as markdown (docs/knobs.md)");

  // ---- bench (bench.cpp)
  BenchCommand bench_cmd(app);

  // ---- launch (launch.cpp)
  LaunchOptions lo;
  auto* lau = add_launch_subcommand(app, lo);

  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    return app.exit(e);  // --help, --version
  } catch (const CLI::ParseError& e) {
    // the hint names the subcommand being parsed: "see indexcp run --help"
    std::string where = "indexcp";
    for (const CLI::App* sub = &app;;) {
      const auto subs = sub->get_subcommands();
      if (subs.empty()) break;
      sub = subs.front();
      where += " " + sub->get_name();
    }
    print_error(std::string(e.what()) + " (see " + where + " --help)");
    return 2;
  }
  if (run->parsed()) {
    ro.heads_given = heads->count() > 0;
    ro.tps_given = tps->count() > 0;
    return run_command(ro);
  }
  if (rep->parsed()) return replay_command(case_dir, out_dir, replay_backend, scores);
  if (cap->parsed()) {
    co.budget_bytes_given = bytes->count() > 0;
    return capacity_command(co);
  }
  if (con->parsed()) return config_command(cfg);
  if (kno->parsed()) {
    const std::string t = knobs_markdown ? indexcp::detail::knob_markdown() : indexcp::detail::knob_text();
    std::fwrite(t.data(), 1, t.size(), stdout);
    return 0;
  }
  if (lau->parsed()) return launch_command(lo);
  if (bench_cmd.parsed()) return bench_cmd.run(argc, argv);
  print_error("a subcommand is required (run, replay, capacity, config, knobs, bench, launch)");
  return 2;
}

int main(int argc, char** argv) {
  try {
    return real_main(argc, argv);
  } catch (const indexcp::Error& e) {
    print_error(e.what());
    return exit_code_of(e);
  } catch (const std::bad_alloc&) {
    print_error("out of memory");
    return 1;
  } catch (const std::exception& e) {
    print_error(e.what());
    return 1;
  } catch (...) {
    print_error("unknown failure");
    return 1;
  }
}
