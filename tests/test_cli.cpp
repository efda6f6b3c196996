// The indexcp command itself: exit codes, one-line error messages, nothing written on failure,
// the run report's fields, replay through the command, capacity and config.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "indexcp/cache.hpp"
#include "indexcp/npy.hpp"
#include "indexcp/tp_group.hpp"

#include "cli_util.hpp"

using namespace indexcp;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

fs::path temp_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const fs::path d = fs::temp_directory_path() /
                     ("indexcp_cli_" + std::to_string(::getpid()) + "_" + info->test_suite_name() + "_" + info->name());
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

using cliutil::Result;
using cliutil::slurp;

// Runs `indexcp ARGS` (ARGS already shell-quoted) with stdout/stderr captured in `dir`.
Result run(const std::string& args, const fs::path& dir) { return cliutil::run_cli(args, dir); }

std::string q(const fs::path& p) { return "'" + p.string() + "'"; }

// The failure contract: the given status and exactly one line "indexcp: error: ..." containing
// every needle.
void expect_error(const Result& r, int status, const std::vector<std::string>& needles) {
  EXPECT_EQ(r.status, status) << r.err;
  EXPECT_EQ(r.err.rfind("indexcp: error: ", 0), 0u) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  for (const auto& n : needles) EXPECT_NE(r.err.find(n), std::string::npos) << "missing '" << n << "' in: " << r.err;
  EXPECT_EQ(r.err.find("terminate"), std::string::npos);
}

// A small data directory: keys float16 [R, T, 128], queries float16 [R, Qn, H, 128], meta.json.
void write_data(const fs::path& dir, int R, int T, int Qn, int H) {
  fs::create_directories(dir);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> k(static_cast<size_t>(R) * T * 128), qv(static_cast<size_t>(R) * Qn * H * 128);
  for (auto& x : k) x = npy::float_to_half(nd(rng));
  for (auto& x : qv) x = npy::float_to_half(nd(rng));
  npy::save((dir / "keys.npy").string(), npy::Dtype::kFloat16, {R, T, 128}, k.data());
  npy::save((dir / "queries.npy").string(), npy::Dtype::kFloat16, {R, Qn, H, 128}, qv.data());
  std::ofstream(dir / "meta.json") << R"({"name": "tiny_test_data", "licence": "test"})";
}

// A small decode case (nvfp4, sharding on, TP2, P128, Q4, H4).
void write_case(const fs::path& dir) {
  fs::create_directories(dir);
  const int B = 2, P = 128, Q = 4, H = 4, max_pages = 9;
  const std::vector<int32_t> lens = {1000, 300};
  std::vector<int32_t> bt(B * max_pages, -1);
  for (int i = 0; i < 8; ++i) bt[i] = 10 - i;  // request 0: pages 10..3
  for (int i = 0; i < 3; ++i) bt[max_pages + i] = i;  // request 1: pages 0..2
  const int64_t num_pages = 11;
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> keys(num_pages * P * 128), qv(static_cast<size_t>(B) * Q * H * 128);
  for (auto& x : keys) x = nd(rng);
  for (auto& x : qv) x = nd(rng);
  std::ofstream(dir / "case.json") << json{{"phase", "decode"},
                                           {"attention_config", {{"indexer_kv_dtype", "nvfp4"}, {"indexer_cache_sharding", "on"}}},
                                           {"tp", 2},
                                           {"page_size", P},
                                           {"heads", H},
                                           {"topk", 16},
                                           {"init_blocks", 0},
                                           {"local_blocks", 1},
                                           {"query_len", Q}}
                                          .dump(2);
  npy::save((dir / "block_table.npy").string(), {B, max_pages}, bt.data());
  npy::save((dir / "seq_lens.npy").string(), {B}, lens.data());
  npy::save((dir / "keys.npy").string(), {num_pages * P, 128}, keys.data());
  npy::save((dir / "q.npy").string(), {B * Q, H, 128}, qv.data());
}

}  // namespace

TEST(Cli, VersionAndHelp) {
  const fs::path d = temp_dir();
  auto r = run("--version", d);
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(r.out.rfind("indexcp ", 0), 0u) << r.out;
  r = run("--help", d);
  EXPECT_EQ(r.status, 0);
  EXPECT_NE(r.out.find("CPU reference backend"), std::string::npos) << r.out;
  // a CUDA build on a machine without a GPU says so, instead of looking like a CPU-only build
  EXPECT_EQ(r.out.find("CUDA backend built, no GPU visible") != std::string::npos,
            indexcp::built_with_cuda() && !indexcp::cuda_available())
      << r.out;
  r = run("run --help", d);
  EXPECT_EQ(r.status, 0);
  EXPECT_NE(r.out.find("--prefill-tokens"), std::string::npos);
  EXPECT_NE(r.out.find("--synthetic"), std::string::npos);
  r = run("replay --help", d);
  EXPECT_EQ(r.status, 0);
  EXPECT_NE(r.out.find("--scores"), std::string::npos);
  fs::remove_all(d);
}

TEST(Cli, WrongFlagsAndValues) {
  const fs::path d = temp_dir();
  expect_error(run("", d), 2, {"subcommand"});
  expect_error(run("frobnicate", d), 2, {"frobnicate"});
  expect_error(run("run --bogus", d), 2, {"--bogus"});
  expect_error(run("run --tp 3", d), 2, {"--tp", "3"});
  expect_error(run("run --page-size 64", d), 2, {"--page-size", "64"});
  expect_error(run("run --kv-dtype fp4", d), 2, {"--kv-dtype", "fp4"});
  expect_error(run("run --query-len 17", d), 2, {"--query-len", "17"});
  expect_error(run("run --steps abc", d), 2, {"--steps"});
  expect_error(run("run --synthetic --tokens 100 --requests 1", d), 2, {"--prefill-tokens", "--tokens 100"});
  expect_error(run("run --synthetic --keys x.npy --queries y.npy", d), 2, {"--synthetic"});
  expect_error(run("run --keys x.npy", d), 2, {"--keys and --queries"});
  expect_error(run("capacity --tp 3", d), 2, {"--tp"});
  expect_error(run("capacity --budget-gib -1", d), 2, {"--budget-gib"});
  expect_error(run("capacity --budget-gib 10 --budget-bytes 100", d), 2, {"--budget"});
  expect_error(run("capacity --model gpt-9", d), 2, {"--model", "minimax-m3"});
  expect_error(run("config --tp 2 --page-size 128", d), 2, {"--attention-config"});
  expect_error(run("replay", d), 2, {"CASE_DIR"});
  expect_error(run("replay " + q(d) + " --backend tpu --out " + q(d / "o"), d), 2, {"--backend"});
  EXPECT_FALSE(fs::exists(d / "o"));
  fs::remove_all(d);
}

// A parse error's hint names the subcommand's own --help.
TEST(Cli, ParseErrorsPointToTheSubcommandsHelp) {
  const fs::path d = temp_dir();
  for (const auto& [args, hint] : {std::pair<std::string, std::string>{"run --no-such-flag", "(see indexcp run --help)"},
                                   {"capacity --no-such-flag", "(see indexcp capacity --help)"},
                                   {"--no-such-flag", "(see indexcp --help)"}}) {
    const Result r = run(args, d);
    EXPECT_EQ(r.status, 2) << args;
    EXPECT_NE(r.err.find(hint), std::string::npos) << args << ": " << r.err;
  }
}

TEST(Cli, MissingCorruptAndMistypedFiles) {
  const fs::path d = temp_dir();
  // missing
  expect_error(run("run --keys " + q(d / "nope.npy") + " --queries " + q(d / "nope2.npy"), d), 2,
               {"nope.npy", "no such file"});
  expect_error(run("run --data " + q(d / "nodata"), d), 2, {"nodata", "no such data directory"});
  expect_error(run("capacity --model " + q(d / "model.json"), d), 2, {"model.json", "no such file"});
  // corrupt
  write_data(d / "data", 1, 512, 64, 4);
  { std::ofstream(d / "garbage.npy") << "this is not a npy file"; }
  expect_error(run("run --keys " + q(d / "garbage.npy") + " --queries " + q(d / "data" / "queries.npy"), d), 2,
               {"garbage.npy", "bad magic"});
  {
    const auto bytes = slurp(d / "data" / "keys.npy");
    std::ofstream(d / "short.npy", std::ios::binary) << bytes.substr(0, bytes.size() - 100);
  }
  expect_error(run("run --keys " + q(d / "short.npy") + " --queries " + q(d / "data" / "queries.npy"), d), 2,
               {"short.npy", "truncated"});
  // wrong dtype / shape
  std::vector<int32_t> ints(512 * 128, 1);
  npy::save((d / "ints.npy").string(), {1, 512, 128}, ints.data());
  expect_error(run("run --keys " + q(d / "ints.npy") + " --queries " + q(d / "data" / "queries.npy"), d), 2,
               {"ints.npy", "dtype is int32"});
  std::vector<float> f(512 * 64, 1.0f);
  npy::save((d / "k64.npy").string(), {1, 512, 64}, f.data());
  expect_error(run("run --keys " + q(d / "k64.npy") + " --queries " + q(d / "data" / "queries.npy"), d), 2,
               {"k64.npy", "must be [requests, tokens, 128]"});
  // model JSON with an unknown key
  { std::ofstream(d / "m.json") << R"({"layers": 2, "sparse_layers": 1, "q_heads": 8, "kv_heads": 2, "head_dim": 128, "index_heads": 4, "index_dim": 128, "bogus": 1})"; }
  expect_error(run("capacity --model " + q(d / "m.json"), d), 2, {"bogus"});
  // --json into a missing directory: refused up front, nothing written
  expect_error(run("capacity --json " + q(d / "nodir" / "c.json"), d), 2, {"nodir", "does not exist"});
  expect_error(run("run --synthetic --json " + q(d / "nodir" / "r.json"), d), 2, {"nodir"});
  EXPECT_FALSE(fs::exists(d / "nodir"));
  fs::remove_all(d);
}

TEST(Cli, ConfigPrintsTheResolvedConfigOrTheRefusal) {
  const fs::path d = temp_dir();
  auto r = run(R"(config --attention-config '{"indexer_kv_dtype": "nvfp4", "indexer_cache_sharding": "on"}' --tp 4 --page-size 128)", d);
  ASSERT_EQ(r.status, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["indexer_cache_sharding"], "on");
  EXPECT_EQ(j["index_bytes_per_token_per_layer_per_rank"], 18);
  { std::ofstream(d / "ac.json") << R"({"indexer_kv_dtype": "fp8", "indexer_decode_cp": true, "indexer_cache_sharding": "on"})"; }
  r = run("config --attention-config @" + q(d / "ac.json") + " --tp 4 --page-size 256 --query-len 8 --speculative-method dspark", d);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_FALSE(json::parse(r.out)["notes"].empty());
  expect_error(run(R"(config --attention-config '{"indexer_kv_dtype": "bf16", "indexer_cache_sharding": "on"}' --tp 2 --page-size 128)", d),
               2, {"indexer_kv_dtype", "bf16"});
  expect_error(run(R"(config --attention-config '{"indexer_kv_dtype": "nvfp4", "indexer_cache_sharding": "on"}' --tp 2 --page-size 128 --kv-connector)", d),
               2, {});
  expect_error(run(R"(config --attention-config '{"indexer_cache_sharding": "on"}' --tp 8 --page-size 64)", d), 2, {});
  expect_error(run(R"(config --attention-config '{"no_such_key": 1}' --tp 2 --page-size 128)", d), 2, {"no_such_key"});
  expect_error(run(R"(config --attention-config '{not json' --tp 2 --page-size 128)", d), 2, {"--attention-config"});
  fs::remove_all(d);
}

TEST(Cli, CapacityReportsOffOnAndTheUpstreamReference) {
  const fs::path d = temp_dir();
  auto r = run("capacity --json " + q(d / "cap.json"), d);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("5,492,736"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("6,030,720"), std::string::npos);
  EXPECT_NE(r.out.find("x1.098"), std::string::npos);
  EXPECT_NE(r.out.find("sharding on"), std::string::npos);
  const json j = json::parse(slurp(d / "cap.json"));
  EXPECT_GT(j["on"]["tokens"].get<int64_t>(), j["off"]["tokens"].get<int64_t>());
  EXPECT_EQ(j["off"]["index_bytes_per_token"], 57 * 72);
  EXPECT_EQ(j["on"]["index_bytes_per_token"], 57 * 36);
  EXPECT_EQ(j["tp"], 2);
  EXPECT_NEAR(j["ratio"].get<double>(), 1.098, 0.03);
  { std::ofstream(d / "m.json") << R"({"layers": 2, "sparse_layers": 1, "q_heads": 8, "kv_heads": 2, "head_dim": 128, "index_heads": 4, "index_dim": 128})"; }
  r = run("capacity --model " + q(d / "m.json") + " --budget-bytes 1000000000 --tp 4 --page-size 256 --kv-dtype fp8 --index-dtype fp8", d);
  EXPECT_EQ(r.status, 0) << r.err;
  fs::remove_all(d);
}

TEST(Cli, RunSyntheticReportHasEveryField) {
  const fs::path d = temp_dir();
  const auto r = run("run --synthetic --requests 2 --tokens 2304 --prefill-tokens 16 --steps 2 --query-len 4 "
                     "--tp 1,2,4 --page-size 128 --kv-dtype nvfp4,fp8 --backend cpu --json " + q(d / "r.json"), d);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("sel==repl"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("[12/12]"), std::string::npos) << "progress lines on stderr: " << r.err;
  const json j = json::parse(slurp(d / "r.json"));
  EXPECT_EQ(j["backend"], "cpu");
  EXPECT_EQ(j["processes"], 1);
  EXPECT_EQ(j["num_gpus"], 0);
  const char* rev = std::getenv("INDEXCP_GIT_REV");
  EXPECT_EQ(j["git_rev"], (rev && *rev) ? rev : "unknown");
  EXPECT_EQ(j["data"]["source"], "synthetic");
  EXPECT_TRUE(j["data"]["name"].is_string());
  EXPECT_EQ(j["data"]["tokens"], 2 * 2304);
  EXPECT_EQ(j["workload"]["prefill_tokens_per_request"], 16);
  EXPECT_EQ(j["workload"]["decode_steps"], 2);
  EXPECT_EQ(j["all_selections_equal_replicated"], true);
  ASSERT_EQ(j["configs"].size(), 12u);
  for (const auto& c : j["configs"]) {
    for (const char* k : {"kv_dtype", "page_size", "tp", "sharding", "bytes_per_token_per_layer_per_rank",
                          "selections_equal_replicated", "recall_vs_fp32", "us_per_layer_per_rank"})
      EXPECT_TRUE(c.contains(k)) << k;
    EXPECT_EQ(c["selections_equal_replicated"], true) << c.dump();
    const double rec = c["recall_vs_fp32"];
    EXPECT_GT(rec, 0.3);
    EXPECT_LE(rec, 1.0);
    EXPECT_GT(c["us_per_layer_per_rank"].get<double>(), 0.0);
    const int W = c["tp"];
    const bool on = c["sharding"] == "on";
    const int per = c["kv_dtype"] == "nvfp4" ? 72 : 128;
    EXPECT_EQ(c["bytes_per_token_per_layer_per_rank"], on ? per / W : per) << c.dump();
  }
  // 72 / 36 / 18 for NVFP4 at W = 1 / 2 / 4
  std::map<int, int> nvfp4_on;
  for (const auto& c : j["configs"])
    if (c["kv_dtype"] == "nvfp4" && c["sharding"] == "on") nvfp4_on[c["tp"]] = c["bytes_per_token_per_layer_per_rank"];
  EXPECT_EQ(nvfp4_on, (std::map<int, int>{{1, 72}, {2, 36}, {4, 18}}));
  EXPECT_GT(j["capacity"]["on"]["tokens"].get<int64_t>(), j["capacity"]["off"]["tokens"].get<int64_t>());
  EXPECT_EQ(j["capacity"]["tp"], 2);
  EXPECT_EQ(j["capacity"]["page_size"], 128);
  EXPECT_EQ(j["capacity"]["kv_dtype"], "nvfp4");
  EXPECT_TRUE(j["capacity"].contains("budget_bytes"));
  fs::remove_all(d);
}

// --score-precision fp8_mma,fp32: fp32 runs first (each fp8_mma row is compared with it), every
// configuration once per mode, the precision columns in the table; the CPU backend computes exact
// scores in both modes, so nothing differs; a policy refusal of the mode (bf16) is listed as skipped.
TEST(Cli, RunScorePrecisionGridAndColumns) {
  const fs::path d = temp_dir();
  const auto r = run("run -q --synthetic --requests 2 --tokens 2304 --prefill-tokens 16 --steps 1 --query-len 4 "
                     "--tp 2 --page-size 128 --kv-dtype nvfp4,bf16 --sharding off,on --score-precision fp8_mma,fp32 "
                     "--backend cpu --json " + q(d / "r.json"), d);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("precision"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("!=fp32"), std::string::npos) << r.out;
  const json j = json::parse(slurp(d / "r.json"));
  std::vector<std::string> order;
  int fp8 = 0;
  for (const auto& c : j["configs"]) {
    if (c["kv_dtype"] != "nvfp4") continue;
    order.push_back(c["score_precision"].get<std::string>());
    if (c["score_precision"] == "fp8_mma") {
      ++fp8;
      ASSERT_TRUE(c["selections_differing_from_fp32"].is_number()) << c.dump();
      EXPECT_EQ(c["selections_differing_from_fp32"].get<double>(), 0.0) << "the CPU backend scores exactly in both modes";
      EXPECT_EQ(c["resolved_config"]["indexer_score_precision"], "fp8_mma");
    } else {
      EXPECT_TRUE(c["selections_differing_from_fp32"].is_null()) << c.dump();
    }
    EXPECT_EQ(c["selections_equal_replicated"], true) << c.dump();
  }
  EXPECT_EQ(order, (std::vector<std::string>{"fp32", "fp32", "fp8_mma", "fp8_mma"}));
  EXPECT_EQ(fp8, 2);
  bool bf16_fp8_skipped = false;
  for (const auto& s : j["skipped"])
    if (s["kv_dtype"] == "bf16" && s["score_precision"] == "fp8_mma")
      bf16_fp8_skipped = s["reason"].get<std::string>().find("indexer_score_precision") != std::string::npos;
  EXPECT_TRUE(bf16_fp8_skipped) << j["skipped"].dump();
  // without fp8_mma the table keeps its columns
  const auto r2 = run("run -q --synthetic --requests 1 --tokens 2304 --prefill-tokens 16 --steps 1 --tp 2 "
                      "--page-size 128 --kv-dtype fp8 --sharding off --backend cpu", d);
  ASSERT_EQ(r2.status, 0) << r2.err;
  EXPECT_EQ(r2.out.find("!=fp32"), std::string::npos) << r2.out;
  fs::remove_all(d);
}

TEST(Cli, RunOnADataDirectory) {
  const fs::path d = temp_dir();
  write_data(d / "data", 2, 2200, 40, 4);
  auto r = run("run -q --data " + q(d / "data") + " --tp 2 --kv-dtype nvfp4 --page-size 256 --prefill-tokens 16 "
               "--steps 2 --json " + q(d / "r.json"), d);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(r.err.empty()) << r.err;
  json j = json::parse(slurp(d / "r.json"));
  EXPECT_EQ(j["data"]["source"], "real");
  EXPECT_EQ(j["data"]["name"], "tiny_test_data");
  EXPECT_EQ(j["data"]["tokens_per_request"], 2200);
  EXPECT_EQ(j["workload"]["inserted_directly_per_request"], 2200 - 16 - 16);
  ASSERT_EQ(j["configs"].size(), 2u);
  EXPECT_EQ(j["configs"][1]["bytes_per_token_per_layer_per_rank"], 36);
  EXPECT_EQ(j["configs"][1]["selections_equal_replicated"], true);
  // too many query positions for the stored queries
  expect_error(run("run --data " + q(d / "data") + " --prefill-tokens 32 --steps 2", d), 2,
               {"queries.npy", "last 40 positions"});
  // a shorter window of the same data
  r = run("run -q --data " + q(d / "data") + " --tokens 1500 --tp 4 --kv-dtype fp8 --page-size 128 --prefill-tokens 8 --steps 1 "
          "--json " + q(d / "r2.json"), d);
  ASSERT_EQ(r.status, 0) << r.err;
  j = json::parse(slurp(d / "r2.json"));
  EXPECT_EQ(j["workload"]["window_start_in_data"], 700);
  EXPECT_EQ(j["configs"][1]["bytes_per_token_per_layer_per_rank"], 32);
  fs::remove_all(d);
}

TEST(Cli, ReplayThroughTheCommand) {
  const fs::path d = temp_dir();
  write_case(d / "case");
  auto r = run("replay " + q(d / "case") + " --out " + q(d / "out") + " --backend cpu --scores", d);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(fs::exists(d / "out" / "topk.npy"));
  EXPECT_TRUE(fs::exists(d / "out" / "scores.npy"));
  const json rep = json::parse(slurp(d / "out" / "report.json"));
  EXPECT_EQ(rep["selections_equal_replicated"], true);
  EXPECT_EQ(rep["backend"], "cpu");
  EXPECT_EQ(rep["config"]["indexer_cache_sharding"], "on");
  // expected_topk that differs at one (row, head): exit 4, one line naming row and head
  const auto topk = npy::load((d / "out" / "topk.npy").string());
  std::vector<int32_t> e(topk.data<int32_t>(), topk.data<int32_t>() + topk.size());
  e[(5 * 4 + 3) * 16 + 0] += 1;
  npy::save((d / "case" / "expected_topk.npy").string(), {8, 4, 16}, e.data());
  r = run("replay " + q(d / "case") + " --out " + q(d / "out2"), d);
  expect_error(r, 4, {"expected_topk.npy differs at row 5, head 3: expected [", "] vs got ["});
  fs::remove(d / "case" / "expected_topk.npy");
  // an invalid case: exit 2, the file named, nothing written
  std::vector<float> bad(8 * 4 * 128, 0.5f);
  bad[3] = std::nanf("");
  npy::save((d / "case" / "q.npy").string(), {8, 4, 128}, bad.data());
  r = run("replay " + q(d / "case") + " --out " + q(d / "out3"), d);
  expect_error(r, 2, {"q.npy", "NaN at row 0, head 0, dim 3"});
  EXPECT_FALSE(fs::exists(d / "out3"));
  { std::ofstream(d / "case" / "q.npy", std::ios::trunc) << "\x93NUMPY"; }
  r = run("replay " + q(d / "case") + " --out " + q(d / "out3"), d);
  expect_error(r, 2, {"q.npy"});
  EXPECT_FALSE(fs::exists(d / "out3"));
  r = run("replay " + q(d / "missing") + " --out " + q(d / "out3"), d);
  expect_error(r, 2, {"missing", "no such case directory"});
  EXPECT_FALSE(fs::exists(d / "out3"));
  fs::remove_all(d);
}

// Input paths that are not regular files (a FIFO would block the read, /dev/zero never ends), empty
// paths, and repeated keys in case.json are refused with the file or flag named; a path or rank
// message with bytes that are not UTF-8 still gives a valid JSON report; replay writes all of its
// outputs or none.
TEST(Cli, OddInputPathsAndOutputs) {
  const fs::path d = temp_dir();
  write_data(d / "data", 1, 600, 24, 4);
  write_case(d / "case");
  ASSERT_EQ(::mkfifo((d / "fifo").c_str(), 0600), 0);
  fs::create_symlink("/dev/zero", d / "zero");
  auto timed = [&](const std::string& args) { return cliutil::run_cli_timeout(args, d, 20); };
  // FIFO or device as an input file: refused at once (status 137 would mean killed by the timeout)
  expect_error(timed("run --keys " + q(d / "fifo") + " --queries " + q(d / "data" / "queries.npy")), 2,
               {"fifo", "not a regular file"});
  expect_error(timed("run --keys " + q(d / "zero") + " --queries " + q(d / "data" / "queries.npy")), 2,
               {"zero", "not a regular file"});
  expect_error(timed("config --tp 2 --page-size 128 --attention-config @" + q(d / "fifo")), 2,
               {"fifo", "not a regular file", "--attention-config"});
  expect_error(timed("config --tp 2 --page-size 128 --attention-config @"), 2, {"--attention-config", "@FILE"});
  expect_error(timed("capacity --model " + q(d / "zero")), 2, {"zero", "not a regular file", "--model"});
  for (const char* what : {"fifo", "zero", "dir"}) {
    const fs::path c = d / (std::string("case_") + what);
    fs::create_directories(c);
    for (const auto& e : fs::directory_iterator(d / "case"))
      if (e.path().filename() != "case.json") fs::copy_file(e.path(), c / e.path().filename());
    if (std::string(what) == "fifo") ASSERT_EQ(::mkfifo((c / "case.json").c_str(), 0600), 0);
    else if (std::string(what) == "zero") fs::create_symlink("/dev/zero", c / "case.json");
    else fs::create_directory(c / "case.json");
    expect_error(timed("replay " + q(c) + " --out " + q(d / "o_odd")), 2,
                 {"case.json", std::string(what) == "dir" ? "is a directory" : "not a regular file"});
    EXPECT_FALSE(fs::exists(d / "o_odd")) << what;
  }
  // a key given twice in case.json
  {
    std::string text = slurp(d / "case" / "case.json");
    text.insert(text.rfind('}'), ", \"tp\": 4");
    fs::create_directories(d / "case_dup");
    for (const auto& e : fs::directory_iterator(d / "case")) fs::copy_file(e.path(), d / "case_dup" / e.path().filename());
    std::ofstream(d / "case_dup" / "case.json", std::ios::trunc) << text;
    expect_error(run("replay " + q(d / "case_dup") + " --out " + q(d / "o_dup"), d), 2,
                 {"case.json", "\"tp\" appears twice"});
    EXPECT_FALSE(fs::exists(d / "o_dup"));
  }
  // empty paths are refused, not taken for "not given"
  expect_error(run("run --keys '' --queries ''", d), 2, {"--keys"});
  expect_error(run("run --synthetic --data ''", d), 2, {"--data"});
  expect_error(run("bench decode --dump ''", d), 2, {"--dump"});
  // replay: one output that cannot be written means none is written
  fs::create_directories(d / "o_part" / "report.json");
  expect_error(run("replay " + q(d / "case") + " --out " + q(d / "o_part") + " --backend cpu --scores", d), 2,
               {"report.json", "not a regular file"});
  EXPECT_FALSE(fs::exists(d / "o_part" / "topk.npy"));
  EXPECT_FALSE(fs::exists(d / "o_part" / "scores.npy"));
  // the output directory is created (also written "new/" or "new/."), its parent is not
  for (const char* o : {"o_new/", "o_new2/."}) {
    auto ok = run("replay " + q(d / "case") + " --out " + q(d.string() + "/" + o) + " --backend cpu", d);
    ASSERT_EQ(ok.status, 0) << o << ": " << ok.err;
    EXPECT_TRUE(fs::exists(d / fs::path(o).lexically_normal() / "topk.npy")) << o;
  }
  expect_error(run("replay " + q(d / "case") + " --out " + q(d / "no" / "such" / "o"), d), 2, {"does not exist"});
  EXPECT_FALSE(fs::exists(d / "no"));
  expect_error(run("replay " + q(d / "case") + " --out " + q(d / "case" / "case.json" / "o"), d), 2, {"is not a directory"});
  fs::create_symlink("loop", d / "loop");  // a symbolic-link loop: refused as an Error (status 2), not an exception
  expect_error(run("replay " + q(d / "case") + " --out " + q(d / "loop"), d), 2, {"loop", "--out"});
  // an output that is a symbolic link to a regular file is replaced like a regular file
  fs::create_directories(d / "o_link");
  { std::ofstream(d / "old_report.json") << "{}"; }
  fs::create_symlink(d / "old_report.json", d / "o_link" / "report.json");
  const auto r0 = run("replay " + q(d / "case") + " --out " + q(d / "o_link") + " --backend cpu", d);
  ASSERT_EQ(r0.status, 0) << r0.err;
  EXPECT_EQ(json::parse(slurp(d / "o_link" / "report.json"))["backend"], "cpu");
  // meta.json of a data directory refuses a key given twice, like every JSON input
  write_data(d / "data_dup", 1, 600, 24, 4);
  { std::ofstream(d / "data_dup" / "meta.json", std::ios::trunc) << R"({"name": "a", "name": "b"})"; }
  expect_error(run("run --data " + q(d / "data_dup"), d), 2, {"meta.json", "\"name\" appears twice"});
  // a data path that is not UTF-8: the report is still JSON (U+FFFD for the bad byte)
  const fs::path odd = d / "odd\xff";
  fs::create_directories(odd);
  fs::copy_file(d / "data" / "keys.npy", odd / "k.npy");
  fs::copy_file(d / "data" / "queries.npy", odd / "q.npy");
  auto r = run("run -q --keys " + q(odd / "k.npy") + " --queries " + q(odd / "q.npy") +
                   " --tp 2 --kv-dtype nvfp4 --page-size 128 --prefill-tokens 8 --steps 1 --json " + q(d / "u.json"),
               d);
  ASSERT_EQ(r.status, 0) << r.err;
  const json u = json::parse(slurp(d / "u.json"));
  EXPECT_NE(u["data"]["name"].get<std::string>().find("\xef\xbf\xbd"), std::string::npos) << u["data"].dump();
  fs::remove_all(d);
}

// A refused grid says why (the first refusal and how many), and nothing but the error is printed.
TEST(Cli, RunRefusingEveryCombinationSaysWhy) {
  const fs::path d = temp_dir();
  expect_error(run("run --synthetic --tokens 2048 --heads 5 --backend cpu", d), 2,
               {"heads = 5 and tp = 2 do not divide one another", "combinations refused"});
  expect_error(run("run --synthetic --kv-dtype bf16 --sharding on --backend cpu", d), 2,
               {"indexer_cache_sharding = \"on\" with indexer_kv_dtype = \"bf16\"", "combinations refused"});
  EXPECT_TRUE(run("run --synthetic --kv-dtype bf16 --sharding on --backend cpu", d).out.empty());
  fs::remove_all(d);
}

// Every budget flag: one limit, a readable message.
TEST(Cli, BudgetLimitsAreReadable) {
  const fs::path d = temp_dir();
  for (const std::string v : {"8.6e9", "0", "-1", "inf", "nan", "1e999"}) {
    const auto r = run("capacity --budget-gib " + v, d);
    expect_error(r, 2, {"--budget-gib = ", "must be > 0 and at most 1048576"});
    EXPECT_LT(r.err.size(), 200u) << r.err;
    EXPECT_EQ(r.err.find("not in range"), std::string::npos) << r.err;
  }
  expect_error(run("capacity --budget-gib 0", d), 2, {"--budget-gib = 0 must be > 0 and at most 1048576"});
  expect_error(run("capacity --budget-gib 1e-12", d), 2, {"--budget-gib = 1e-12", "less than one byte"});
  expect_error(run("capacity --budget-bytes 0", d), 2, {"--budget-bytes = 0", "must be > 0 and at most 1125899906842624"});
  expect_error(run("capacity --budget-bytes 1125899906842625", d), 2, {"--budget-bytes", "at most 1125899906842624"});
  // beyond int64: the value as typed, not as the parser saturated it
  expect_error(run("capacity --budget-bytes 99999999999999999999", d), 2,
               {"--budget-bytes = 99999999999999999999 must be > 0"});
  expect_error(run("capacity --budget-bytes -99999999999999999999", d), 2,
               {"--budget-bytes = -99999999999999999999 must be > 0"});
  for (const std::string v : {"1e3", "0x10", "12abc", "1.5", "1-2"})
    expect_error(run("capacity --budget-bytes " + v, d), 2, {"--budget-bytes = " + v + " is not a whole number of bytes"});
  EXPECT_EQ(run("capacity --budget-gib 1048576", d).status, 0);
  EXPECT_EQ(run("capacity --budget-bytes 1125899906842624", d).status, 0);
  for (const std::string v : {"0", "-1", "inf", "2e6"})
    expect_error(run("run --synthetic --capacity-budget-gib " + v, d), 2,
                 {"--capacity-budget-gib = ", "must be > 0 and at most 1048576"});
  fs::remove_all(d);
}

// The sharding note only where sharding truly does not apply; no ratio of 0; the upstream
// sentence only at the reference settings, with the printed ratio.
TEST(Cli, CapacityNotesAreTrue) {
  const fs::path d = temp_dir();
  const std::string na = "sharding does not apply";
  auto r = run("capacity --budget-bytes 1", d);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out.find(na), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("fewer than one page"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("x0.000"), std::string::npos) << r.out;
  r = run("capacity", d);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out.find(na), std::string::npos) << r.out;
  const auto p = r.out.find("ratio on/off: x");
  ASSERT_NE(p, std::string::npos) << r.out;
  const std::string ratio = r.out.substr(p + 15, 5);
  EXPECT_NE(r.out.find("the planner gives x" + ratio), std::string::npos) << r.out;
  for (const std::string a : {"--tp 1", "--index-dtype bf16"}) {
    r = run("capacity " + a, d);
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find(na), std::string::npos) << a << ": " << r.out;
    EXPECT_EQ(r.out.find("upstream reference"), std::string::npos) << a << ": " << r.out;
    // the row that asks for sharding says it does not apply, instead of a second "sharding off"
    EXPECT_NE(r.out.find("\nsharding n/a "), std::string::npos) << a << ": " << r.out;
    EXPECT_EQ(r.out.find("\nsharding on "), std::string::npos) << a << ": " << r.out;
  }
  for (const std::string a : {"--tp 4", "--page-size 256", "--kv-dtype fp8", "--index-dtype fp8"}) {
    r = run("capacity " + a, d);
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(r.out.find(na), std::string::npos) << a << ": " << r.out;
    EXPECT_EQ(r.out.find("upstream reference"), std::string::npos) << a << ": " << r.out;
  }
  { std::ofstream(d / "m.json") << R"({"layers": 2, "sparse_layers": 0, "q_heads": 8, "kv_heads": 2, "head_dim": 128, "index_heads": 4, "index_dim": 128})"; }
  r = run("capacity --model " + q(d / "m.json"), d);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("no sparse layers"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("upstream reference"), std::string::npos) << r.out;
  fs::remove_all(d);
}

// An environment error is not attributed to case.json.
TEST(Cli, EnvironmentErrorsAreNotCaseErrors) {
  const fs::path d = temp_dir();
  write_case(d / "case");
  ::setenv("INDEXCP_P256_STOCK_DECODE", "garbage", 1);
  const auto r = run("replay " + q(d / "case") + " --out " + q(d / "out") + " --backend cpu", d);
  const auto r2 = run("run --synthetic --backend cpu", d);
  ::unsetenv("INDEXCP_P256_STOCK_DECODE");
  expect_error(r, 2, {"INDEXCP_P256_STOCK_DECODE"});
  EXPECT_EQ(r.err.find("case.json"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(d / "out"));
  expect_error(r2, 2, {"INDEXCP_P256_STOCK_DECODE"});
  EXPECT_EQ(r2.err.find("refuses"), std::string::npos) << r2.err;
  fs::remove_all(d);
}

// Repeated flag values run once; a grid without a sharded run does not claim sharded results;
// --heads is refused on real data it does not describe.
TEST(Cli, RunGridIsWhatWasAsked) {
  const fs::path d = temp_dir();
  const std::string small = "run -q --synthetic --requests 1 --tokens 1024 --prefill-tokens 16 --steps 1 --backend cpu ";
  auto r = run(small + "--kv-dtype nvfp4 --kv-dtype nvfp4,nvfp4 --tp 2 --tp 2 --page-size 128,128 --sharding on,on,off "
                       "--json " + q(d / "r.json"), d);
  ASSERT_EQ(r.status, 0) << r.err;
  json j = json::parse(slurp(d / "r.json"));
  EXPECT_EQ(j["configs"].size(), 2u);
  EXPECT_EQ(j["sharded_configurations_run"], 1);
  EXPECT_NE(r.out.find("in every configuration"), std::string::npos) << r.out;
  r = run(small + "--kv-dtype nvfp4 --tp 1 --page-size 128 --json " + q(d / "r1.json"), d);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out.find("in every configuration"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("no sharded configuration ran"), std::string::npos) << r.out;
  EXPECT_EQ(json::parse(slurp(d / "r1.json"))["sharded_configurations_run"], 0);
  r = run(small + "--kv-dtype nvfp4 --tp 2 --page-size 128 --sharding off", d);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("no sharded configuration ran (--sharding off)"), std::string::npos) << r.out;
  write_data(d / "data", 1, 600, 40, 4);
  expect_error(run("run --data " + q(d / "data") + " --heads 8 --prefill-tokens 16 --steps 1", d), 2,
               {"--heads = 8", "4 query heads"});
  r = run("run -q --data " + q(d / "data") + " --heads 4 --prefill-tokens 16 --steps 1 --tp 2 --kv-dtype nvfp4 "
          "--page-size 128 --backend cpu", d);
  EXPECT_EQ(r.status, 0) << r.err;
  fs::remove_all(d);
}

// tools/make_example_case.py writes a case that replays, replaces its own earlier files and
// refuses a directory holding anything else (skipped without python3 + numpy).
TEST(Cli, MakeExampleCaseWritesAFreshCase) {
  const fs::path script = fs::path(__FILE__).parent_path().parent_path() / "tools" / "make_example_case.py";
  if (!fs::exists(script)) GTEST_SKIP() << script << " not found";
  if (std::system("python3 -c 'import numpy' >/dev/null 2>&1") != 0) GTEST_SKIP() << "python3 with numpy not available";
  const fs::path d = temp_dir();
  const auto py = [&](const std::string& args) {
    const std::string cmd = "python3 " + q(script) + " " + args + " >" + q(d / "py.out") + " 2>" + q(d / "py.err");
    const int rc = std::system(cmd.c_str());
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
  };
  const std::string c = q(d / "case");
  ASSERT_EQ(py(c + " --synthetic --phase prefill --tokens 1024 --prefill-tokens 16"), 0) << slurp(d / "py.err");
  EXPECT_TRUE(fs::exists(d / "case" / "query_start.npy"));
  std::ofstream(d / "case" / "cache.npy") << "stale";         // of an earlier case
  std::ofstream(d / "case" / "expected_topk.npy") << "stale";
  ASSERT_EQ(py(c + " --synthetic --phase decode --tokens 1024 --query-len 4"), 0) << slurp(d / "py.err");
  for (const char* f : {"query_start.npy", "cache.npy", "expected_topk.npy"})
    EXPECT_FALSE(fs::exists(d / "case" / f)) << f;
  auto r = run("replay " + c + " --out " + q(d / "out") + " --backend cpu", d);
  EXPECT_EQ(r.status, 0) << r.err;
  // values the library would refuse are refused by the script too, naming the option
  for (const char* bad : {" --tp 3", " --page-size 64", " --query-len 17"}) {
    EXPECT_NE(py(q(d / "bad_case") + " --synthetic" + bad), 0) << bad;
    const std::string opt = std::string(bad).substr(1, std::string(bad).find(' ', 1) - 1);
    EXPECT_NE(slurp(d / "py.err").find(opt), std::string::npos) << bad << ": " << slurp(d / "py.err");
    EXPECT_FALSE(fs::exists(d / "bad_case" / "case.json")) << bad;
  }
  std::ofstream(d / "case" / "notes.txt") << "mine";
  EXPECT_NE(py(c + " --synthetic"), 0);
  EXPECT_NE(slurp(d / "py.err").find("notes.txt"), std::string::npos) << slurp(d / "py.err");
  EXPECT_TRUE(fs::exists(d / "case" / "notes.txt"));
  EXPECT_TRUE(fs::exists(d / "case" / "case.json"));
  fs::remove_all(d);
}

// `indexcp bench`: option refusals name the option (with or without the CUDA backend); without a
// usable GPU the command says why; with one, every benchmark runs on tiny shapes and writes a
// record with the fields of spec/bench.md section 3 and equal selections.
TEST(Cli, BenchRefusesBadOptionsAndRunsWhereAGpuIs) {
  const fs::path d = temp_dir();
  expect_error(run("bench", d), 2, {"subcommand"});
  expect_error(run("bench decode --replays 0", d), 2, {"--replays"});
  expect_error(run("bench decode --pages 64", d), 2, {"--pages"});
  expect_error(run("bench decode --kv-dtype bf16", d), 2, {"--kv-dtype"});
  expect_error(run("bench decode --requests 0 --no-record", d), 2, {"--requests value 0"});
  expect_error(run("bench decode --contexts 4 --no-record", d), 2, {"--contexts value 4"});
  expect_error(run("bench decode --tp 4 --heads 6 --no-record", d), 2, {"--heads = 6", "--tp = 4"});
  expect_error(run("bench insert --tokens 0 --no-record", d), 2, {"--tokens value 0"});
  expect_error(run("bench prefill --chunk 4096 --contexts 1024 --no-record", d), 2, {"--contexts value 1024"});
  expect_error(run("bench step --layers 0", d), 2, {"--layers"});
  expect_error(run("bench step --requests 2000 --no-record", d), 2, {"--requests value 2000"});
  {  // under the launcher only `bench decode` runs as a rank; the launcher passes the rank's status on
    const Result r = run("launch --tp 2 -- " + std::string(INDEXCP_CLI_PATH) + " bench step --no-record", d);
    EXPECT_EQ(r.status, 2) << r.err;
    EXPECT_NE(r.err.find("INDEXCP_WORLD = 2: under `indexcp launch` only `indexcp bench decode`"), std::string::npos) << r.err;
  }

  const std::string tiny = " --replays 2 --repeats 1 -q --out " + q(d / "rec.json");
  if (!cuda_available()) {
    const Result r = run("bench decode --requests 1 --contexts 1024" + tiny, d);
    EXPECT_EQ(r.status, 2) << r.err;  // as `run --backend cuda` without a GPU: the request cannot be met here
    EXPECT_TRUE(r.err.find("CUDA backend") != std::string::npos || r.err.find("no CUDA GPU") != std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(d / "rec.json"));
    fs::remove_all(d);
    GTEST_SKIP() << "no CUDA GPU: the benchmarks themselves were not run";
  }
  const std::vector<std::pair<std::string, std::string>> runs = {
      {"decode", "bench decode --requests 2 --contexts 2048 --pages 128,256"},
      {"topk", "bench topk --requests 2 --contexts 2048 --pages 128"},
      {"decode", "bench decode --tp 4 --requests 1 --contexts 3000 --pages 256 --kv-dtype fp8"},
      {"insert", "bench insert --tokens 64,1000"},
      {"prefill", "bench prefill --contexts 4096 --chunk 512"},
      {"step", "bench step --requests 2 --context 4096 --layers 3"}};
  for (const auto& [name, args] : runs) {
    fs::remove(d / "rec.json");
    const Result r = run(args + tiny, d);
    ASSERT_EQ(r.status, 0) << args << "\n" << r.err;
    const json rec = json::parse(slurp(d / "rec.json"));
    EXPECT_EQ(rec["benchmark"], name) << args;
    for (const char* k : {"device", "num_gpus", "processes", "cuda", "driver", "git_rev", "command", "copy_bandwidth_gbs"})
      EXPECT_TRUE(rec.contains(k)) << args << ": no " << k;
    EXPECT_GT(rec["copy_bandwidth_gbs"].get<double>(), 100.0);
    ASSERT_TRUE(rec.contains("graph_launch_us")) << args;
    EXPECT_GT(rec["graph_launch_us"].get<double>(), 0.0) << args;
    ASSERT_TRUE(rec["results"].is_array() && !rec["results"].empty()) << args;
    for (const auto& res : rec["results"]) {
      EXPECT_TRUE(res.contains("variant"));
      EXPECT_GT(res["median_us"].get<double>(), 0.0) << res.dump();
      EXPECT_LE(res["min_us"].get<double>(), res["median_us"].get<double>());
      EXPECT_GE(res["max_us"].get<double>(), res["median_us"].get<double>());
      EXPECT_EQ(res["samples"], 2);
      if (res.contains("selections_equal_replicated")) EXPECT_TRUE(res["selections_equal_replicated"].get<bool>()) << res.dump();
      if (res.contains("bandwidth_fraction")) {
        EXPECT_GE(res["bandwidth_fraction"].get<double>(), 0.0);
        EXPECT_LT(res["bandwidth_fraction"].get<double>(), 1.5) << res.dump();
      }
    }
    if (name == "decode" && args.find("--tp 4") == std::string::npos) {
      int icp_stock = 0;
      for (const auto& res : rec["results"]) icp_stock += res["variant"] == "icp_stock";
      EXPECT_EQ(icp_stock, 1) << "icp_stock only at P256, TP2";
    }
    if (name == "step")
      for (const auto& res : rec["results"])
        EXPECT_EQ(res["index_bytes_per_token_per_layer"], res["variant"] == "step_sharding_on" ? 36 : 72);
  }
  fs::remove_all(d);
}

// `indexcp launch --tp 2 -- indexcp bench decode --tp 2`: TP2 across two processes (one GPU each,
// NCCL); needs two GPUs, skipped otherwise (counted with nvidia-smi -L).
// GPUs a child process would see (0 without the CUDA backend); `dir` holds a scratch file.
int visible_gpus(const fs::path& dir) {
  int gpus = 0;
  if (cuda_available()) {
    const std::string cmd = "nvidia-smi -L > '" + (dir / "gpus.txt").string() + "' 2>/dev/null";
    if (std::system(cmd.c_str()) == 0) {
      std::istringstream lines(slurp(dir / "gpus.txt"));
      for (std::string l; std::getline(lines, l);) gpus += l.rfind("GPU ", 0) == 0;  // not the MIG lines
    }
    if (const char* v = std::getenv("CUDA_VISIBLE_DEVICES"))  // nvidia-smi ignores it
      gpus = std::min(gpus, static_cast<int>(std::count(v, v + std::strlen(v), ',')) + (*v ? 1 : 0));
  }
  return gpus;
}

// Why a two-process test cannot run here ("" when 2 GPUs are visible); removes the test's
// directory d when it cannot.
std::string two_gpus_missing(const fs::path& d) {
  const int gpus = visible_gpus(d);
  if (gpus >= 2) return "";
  fs::remove_all(d);
  return "needs 2 GPUs; " + std::to_string(gpus) + " visible";
}

TEST(Cli, BenchDecodeAcrossTwoProcesses) {
  const fs::path d = temp_dir();
  if (const std::string why = two_gpus_missing(d); !why.empty()) GTEST_SKIP() << why;
  const Result r = run(std::string("launch --tp 2 --timeout 120 --report ") + q(d / "report.json") + " -- '" + INDEXCP_CLI_PATH +
                           "' bench decode --tp 2 --requests 2 --contexts 2048 --pages 128,256 --replays 3 --repeats 1 "
                           "-q --out " + q(d / "rec.json"),
                       d);
  ASSERT_EQ(r.status, 0) << r.err;
  const json rec = json::parse(slurp(d / "rec.json"));
  EXPECT_EQ(rec["processes"], 2);
  EXPECT_EQ(rec["num_gpus"], 2);
  int icp = 0, exchange = 0;
  for (const auto& res : rec["results"]) {
    EXPECT_TRUE(res["selections_equal_replicated"].get<bool>()) << res.dump();
    EXPECT_EQ(res["per_rank_median_us"].size(), 2u);
    icp += res["variant"] == "icp_nccl";
    if (res["variant"] == "icp_nccl_exchange") {
      ++exchange;
      // decode: rows x H x (K-1) x 8 bytes per rank (indexer.md section 5) + the 64-byte step signature
      EXPECT_EQ(res["bytes_sent_per_rank"], 2 * 8 * 4 * 15 * 8 + 64);
    }
  }
  EXPECT_EQ(icp, 2);
  EXPECT_EQ(exchange, 2);
  // the launcher's merged report holds each rank's own results
  const json rep = json::parse(slurp(d / "report.json"));
  ASSERT_EQ(rep["ranks"].size(), 2u);
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(rep["ranks"][k]["rank"], k);
    EXPECT_EQ(rep["ranks"][k]["results"].size(), rec["results"].size());
  }
  fs::remove_all(d);
}

// `indexcp run` as one rank of a group (INDEXCP_WORLD > 1, as `indexcp launch` sets it): the
// refusals that come before the group forms, each naming what to change. No GPU needed.
TEST(Cli, RunAsARankRefusesWhatCannotRunAcrossProcesses) {
  const fs::path d = temp_dir();
  ::setenv("INDEXCP_WORLD", "2", 1);
  ::setenv("INDEXCP_RANK", "0", 1);
  ::setenv("INDEXCP_RENDEZVOUS", (d / "rdv").string().c_str(), 1);
  ::setenv("INDEXCP_NCCL_TIMEOUT_S", "5", 1);
  expect_error(run("run --synthetic --backend cpu", d), 2, {"--backend cpu", "indexcp launch --tp 2", "--backend cuda"});
  expect_error(run("run --synthetic --tp 4", d), 2, {"--tp", "the only TP size is 2"});
  expect_error(run("run --synthetic --tp 2,4", d), 2, {"--tp", "the only TP size is 2"});
  // without a GPU (the GPU and NCCL path itself is Cli.RunAcrossTwoProcessesEqualsTheSimulatedRun)
  if (!cuda_available()) expect_error(run("run --synthetic --tp 2", d), 2, {"runs on a GPU", "INDEXCP_WORLD = 2", "rank 0"});
  ::setenv("INDEXCP_WORLD", "3", 1);
  ::setenv("INDEXCP_RANK", "0", 1);
  expect_error(run("run --synthetic", d), 2, {"INDEXCP_WORLD = 3", "TP 2, 4 or 8"});
  expect_error(run("run --synthetic --tp 2 --backend cpu", d), 2, {"INDEXCP_WORLD = 3", "TP 2, 4 or 8"});  // W first
  for (const char* v : {"INDEXCP_WORLD", "INDEXCP_RANK", "INDEXCP_RENDEZVOUS", "INDEXCP_NCCL_TIMEOUT_S"}) ::unsetenv(v);
  fs::remove_all(d);
}

// The main job across two processes (one GPU each, NCCL) equals the same job with both ranks
// simulated in one process: the same configurations, bit-equal recall per head (a function of
// every selection), the same payload sizes and cache bytes; sharded equals replicated throughout.
TEST(Cli, RunAcrossTwoProcessesEqualsTheSimulatedRun) {
  const fs::path d = temp_dir();
  if (const std::string why = two_gpus_missing(d); !why.empty()) GTEST_SKIP() << why;
  const std::string job =
      "run --synthetic --requests 2 --tokens 4096 --prefill-tokens 64 --steps 2 --query-len 4 --kv-dtype nvfp4,fp8 "
      "--page-size 128,256 -q --json ";
  const Result multi = run("launch --tp 2 --timeout 120 --report " + q(d / "report.json") + " -- '" + INDEXCP_CLI_PATH +
                               "' " + job + q(d / "multi.json"),
                           d);
  ASSERT_EQ(multi.status, 0) << multi.out << multi.err;
  const Result single = run(job + q(d / "single.json") + " --backend cuda --tp 2", d);
  ASSERT_EQ(single.status, 0) << single.err;
  const json m = json::parse(slurp(d / "multi.json")), s = json::parse(slurp(d / "single.json"));
  EXPECT_EQ(m["processes"], 2);
  EXPECT_EQ(m["num_gpus"], 2);
  EXPECT_EQ(s["processes"], 1);
  EXPECT_EQ(m["backend"], "cuda");
  EXPECT_TRUE(m["all_selections_equal_replicated"].get<bool>());
  EXPECT_EQ(m["sharded_configurations_run"], 4);
  ASSERT_EQ(m["configs"].size(), 8u);
  ASSERT_EQ(m["configs"].size(), s["configs"].size());
  for (size_t i = 0; i < m["configs"].size(); ++i) {
    const json& a = m["configs"][i];
    const json& b = s["configs"][i];
    for (const char* k : {"kv_dtype", "page_size", "tp", "sharding", "recall_vs_fp32_per_head", "cache_bytes_per_rank",
                          "decode_bytes_exchanged_per_rank", "prefill_gather_reserved_bytes"})
      EXPECT_EQ(a[k], b[k]) << k << " of " << a.dump();
    EXPECT_EQ(a["tp"], 2);
    EXPECT_TRUE(a["selections_equal_replicated"].get<bool>()) << a.dump();
    if (a["sharding"] == "on")  // decode: each rank publishes rows x H x (K-1) candidates of 8 bytes (indexer.md
                                // section 5) and the 64-byte step signature (plan.hpp)
      EXPECT_EQ(a["decode_bytes_exchanged_per_rank"], (2 * 4) * 4 * 15 * 8 + 64) << a.dump();
  }
  // only rank 0 prints the table; every rank reports to the launcher
  EXPECT_NE(multi.out.find("[rank 0] indexcp run:"), std::string::npos) << multi.out;
  EXPECT_NE(multi.out.find("TP2 across 2 processes"), std::string::npos) << multi.out;
  EXPECT_EQ(multi.out.find("[rank 1] indexcp run:"), std::string::npos) << multi.out;
  const json rep = json::parse(slurp(d / "report.json"));
  ASSERT_EQ(rep["ranks"].size(), 2u) << rep.dump();
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(rep["ranks"][k]["rank"], k);
    EXPECT_TRUE(rep["ranks"][k]["all_selections_equal_replicated"].get<bool>());
    EXPECT_EQ(rep["ranks"][k]["configs"].size(), 8u);
  }
  fs::remove_all(d);
}

// Two ranks started with different settings (an engine that starts its own processes): each rank
// checks, before its first collective, that the other was given the same config and cache size,
// and both stop with an error naming what differs instead of merging candidates of different
// caches or waiting in collectives of different sizes.
TEST(Cli, RunAcrossTwoProcessesRefusesRanksThatDisagree) {
  const fs::path d = temp_dir();
  if (const std::string why = two_gpus_missing(d); !why.empty()) GTEST_SKIP() << why;
  // rank r runs with --page-size 128 << r
  const std::string job = "run --synthetic --requests 1 --tokens 2048 --prefill-tokens 16 --steps 1 --query-len 4 "
                          "--kv-dtype nvfp4 --sharding on -q --page-size $((128 << INDEXCP_RANK))";
  const auto t0 = std::chrono::steady_clock::now();
  const Result r = run("launch --tp 2 --timeout 30 --time-limit 120 -- sh -c 'exec \"$0\" " + job + "' '" +
                           INDEXCP_CLI_PATH + "'",
                       d);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.status, 2) << r.out << r.err;
  // both ranks raise it; the launcher stops the other as soon as one exits, so at least one
  // rank's line is there, and the launcher's summary quotes the first rank's last line
  const std::string what = "the ranks of the TP group disagree on page_size: rank 0 has 128, rank 1 has 256";
  EXPECT_TRUE(r.err.find("[rank 0] indexcp: error: " + what) != std::string::npos ||
              r.err.find("[rank 1] indexcp: error: " + what) != std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("exited with status 2; its last line on stderr: indexcp: error: " + what), std::string::npos) << r.err;
  EXPECT_LT(seconds, 25.0) << "refused at the start, not after a collective's 30 s timeout";
  fs::remove_all(d);
}
