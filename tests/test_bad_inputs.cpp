// The catalogue of bad inputs (docs/bad-inputs.md): every entry is run for real, against the
// built indexcp command or the library, and the first line of the error it gets is recorded.
// The test regenerates the whole document from these runs and compares it with the committed
// docs/bad-inputs.md; any difference fails the test and says how to regenerate:
//
//   INDEXCP_WRITE_BAD_INPUTS=1 build/tests/test_bad_inputs    # rewrites docs/bad-inputs.md
//
// Temporary paths are written as CASE/ (the case directory) and TMP/ (other files) in the table.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <regex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "indexcp/cache.hpp"
#include "indexcp/comm.hpp"
#include "indexcp/config.hpp"
#include "indexcp/capacity.hpp"
#include "indexcp/error.hpp"
#include "indexcp/indexer.hpp"
#include "indexcp/npy.hpp"

#include "cli_util.hpp"
#ifndef INDEXCP_SOURCE_DIR
#error "INDEXCP_SOURCE_DIR must name the source tree (for docs/bad-inputs.md)"
#endif

using namespace indexcp;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

fs::path g_tmp;  // this run's scratch directory

using cliutil::slurp;

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  if (from.empty()) return s;
  for (size_t i = s.find(from); i != std::string::npos; i = s.find(from, i + to.size())) s.replace(i, from.size(), to);
  return s;
}

std::string first_line(const std::string& s) {
  const size_t e = s.find('\n');
  return e == std::string::npos ? s : s.substr(0, e);
}

// "exit N: <first stderr line>" of `indexcp ARGS`, temporary paths replaced.
std::string cli(const std::string& args) {
  const cliutil::Result r = cliutil::run_cli(args, g_tmp, g_tmp);
  // CLI11 words its range errors differently across versions ("not in range 2 to 1024" in
  // Debian 12's 2.1, "not in range [2 - 1024]" in later ones): keep the catalogue to one form.
  static const std::regex cli11_range(R"(not in range \[(\S+) - (\S+)\])");
  return "exit " + std::to_string(r.status) + ": " + std::regex_replace(first_line(r.err), cli11_range, "not in range $1 to $2");
}

// The same for an input that could block (a FIFO): killed after 20 s (status 137) instead of hanging.
std::string cli_timeout(const std::string& args) {
  const cliutil::Result r = cliutil::run_cli_timeout(args, g_tmp, 20, g_tmp);
  return "exit " + std::to_string(r.status) + ": " + first_line(r.err);
}

// "Error(code): message" of a library call, or what else happened.
std::string lib(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return std::string("Error(") + error_code_name(e.code()) + "): " + first_line(e.what());
  } catch (const std::exception& e) {
    return std::string("NOT AN indexcp::Error: ") + e.what();
  }
  return "ACCEPTED (no error)";
}

// The reference case: decode, nvfp4, sharding on, TP2, P128, Q2, H4, 2 requests, 4 pages.
const fs::path kCase = "case";
void write_case() {
  const fs::path dir = g_tmp / kCase;
  fs::remove_all(dir);
  fs::create_directories(dir);
  const int B = 2, P = 128, Q = 2, H = 4, max_pages = 3;
  const std::vector<int32_t> lens = {300, 200};
  const std::vector<int32_t> bt = {3, 0, 1, 2, 1, -1};
  const int64_t num_pages = 4;
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> keys(num_pages * P * 128), qv(static_cast<size_t>(B) * Q * H * 128);
  for (auto& x : keys) x = nd(rng);
  for (auto& x : qv) x = nd(rng);
  std::ofstream(dir / "case.json") << json{{"phase", "decode"},
                                           {"attention_config", {{"indexer_kv_dtype", "nvfp4"}, {"indexer_cache_sharding", "on"}}},
                                           {"tp", 2}, {"page_size", P}, {"query_len", Q}}.dump(2);
  npy::save((dir / "block_table.npy").string(), {B, max_pages}, bt.data());
  npy::save((dir / "seq_lens.npy").string(), {B}, lens.data());
  npy::save((dir / "keys.npy").string(), {num_pages * P, 128}, keys.data());
  npy::save((dir / "q.npy").string(), {B * Q, H, 128}, qv.data());
}
fs::path cf(const char* name) { return g_tmp / kCase / name; }
// the CPU backend, so that the catalogue is the same on machines with and without a GPU
std::string replay() { return cli("replay case --out out --backend cpu"); }
void edit_json(const std::function<void(json&)>& fn) {
  json j = json::parse(slurp(cf("case.json")));
  fn(j);
  std::ofstream(cf("case.json")) << j.dump();
}

struct Entry {
  const char* kind;
  std::string input;  // the bad input, in words or as the command line
  std::function<std::string()> run;
};

std::vector<float> good_keys(int64_t n) {
  std::vector<float> k(static_cast<size_t>(n) * kHeadDim);
  for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>(i % 17) / 8.0f - 1.0f;
  return k;
}

// Insert into a small replicated NVFP4 cache (2 pages of 128).
std::string insert(std::vector<int64_t> slots, std::vector<float> keys, float scale = 1.0f) {
  return lib([&] {
    IndexCache c(make_page_layout(KvDtype::kNvfp4, 128, 1), 2, 1);
    InsertOptions io;
    io.encode_scale = scale;
    insert_keys(c, 0, keys.data(), slots.data(), static_cast<int64_t>(slots.size()), io);
  });
}

// decode_rows of a batch over 4 pages of 128.
std::string decode(std::vector<int32_t> bt, std::vector<int32_t> lens, int32_t Q, int32_t H = 4, uint8_t qbyte = 0x38) {
  return lib([&] {
    const int32_t B = static_cast<int32_t>(lens.size());
    const int32_t maxp = static_cast<int32_t>(bt.size()) / std::max(B, 1);
    std::vector<uint8_t> q(static_cast<size_t>(std::max(B * std::max(Q, 0), 1)) * std::max(H, 1) * 128, qbyte);
    DecodeBatch db{q.data(), H, bt.data(), B, maxp, lens.data(), Q};
    (void)decode_rows(db, 4, 128);
  });
}

std::vector<Entry> catalogue() {
  const std::string mfile = (g_tmp / "model.json").string();
  std::vector<Entry> e;
  // ---- command-line flags
  e.push_back({"CLI flag", "`indexcp` (no subcommand)", [] { return cli(""); }});
  e.push_back({"CLI flag", "`indexcp frobnicate`", [] { return cli("frobnicate"); }});
  e.push_back({"CLI flag", "`indexcp run --backend gpu`", [] { return cli("run --backend gpu"); }});
  e.push_back({"CLI flag", "`indexcp run --topk 1`", [] { return cli("run --topk 1"); }});
  e.push_back({"CLI flag", "`indexcp run --query-len 17`", [] { return cli("run --query-len 17"); }});
  e.push_back({"CLI flag", "`indexcp run --tp 3`", [] { return cli("run --tp 3"); }});
  e.push_back({"CLI flag", "`indexcp run --score-precision fp16`", [] { return cli("run --score-precision fp16"); }});
  e.push_back({"CLI flag", "`indexcp run --steps 12abc`", [] { return cli("run --steps 12abc"); }});
  e.push_back({"CLI flag", "`indexcp capacity --budget-gib 0`", [] { return cli("capacity --budget-gib 0"); }});
  e.push_back({"CLI flag (NaN)", "`indexcp capacity --budget-gib nan`", [] { return cli("capacity --budget-gib nan"); }});
  e.push_back({"CLI flag (oversized)", "`indexcp capacity --budget-gib 1e30`", [] { return cli("capacity --budget-gib 1e30"); }});
  e.push_back({"CLI flag", "`indexcp capacity --model nosuch-model`", [] { return cli("capacity --model nosuch-model"); }});
  e.push_back({"CLI flag", "`indexcp replay --out out` (no CASE_DIR)", [] { return cli("replay --out out"); }});
  e.push_back({"file", "`indexcp replay missing_dir --out out`", [] { return cli("replay missing_dir --out out"); }});
  e.push_back({"file", "`indexcp run --keys missing.npy --queries missing.npy`",
               [] { return cli("run --backend cpu --keys missing.npy --queries missing.npy"); }});
  // ---- bench: options are checked before the build or the GPU is looked at, so these are the
  // same with and without the CUDA backend (a valid command line would say which one is missing)
  e.push_back({"CLI flag", "`indexcp bench` (no benchmark)", [] { return cli("bench"); }});
  e.push_back({"CLI flag", "`indexcp bench decode --replays 0`", [] { return cli("bench decode --replays 0"); }});
  e.push_back({"CLI flag", "`indexcp bench decode --pages 64`", [] { return cli("bench decode --pages 64"); }});
  e.push_back({"CLI flag (list)", "`indexcp bench decode --requests 16,0,64`", [] { return cli("bench decode --requests 16,0,64 --no-record"); }});
  e.push_back({"CLI flag (oversized)", "`indexcp bench decode --requests 2147483648`",
               [] { return cli("bench decode --requests 2147483648 --no-record"); }});
  e.push_back({"CLI flag", "`indexcp bench decode --contexts 4` (shorter than --query-len 8)",
               [] { return cli("bench decode --contexts 4 --no-record"); }});
  e.push_back({"CLI flag", "`indexcp bench decode --tp 4 --heads 6`", [] { return cli("bench decode --tp 4 --heads 6 --no-record"); }});
  e.push_back({"CLI flag (list)", "`indexcp bench insert --kv-dtypes nvfp4,bf16`",
               [] { return cli("bench insert --kv-dtypes nvfp4,bf16 --no-record"); }});
  e.push_back({"CLI flag (oversized)", "`indexcp bench insert --tokens 16777217`",
               [] { return cli("bench insert --tokens 16777217 --no-record"); }});
  e.push_back({"CLI flag", "`indexcp bench prefill --chunk 4096 --contexts 1024`",
               [] { return cli("bench prefill --chunk 4096 --contexts 1024 --no-record"); }});
  e.push_back({"CLI flag", "`indexcp bench prefill --budget-mib 0`", [] { return cli("bench prefill --budget-mib 0 --no-record"); }});
  e.push_back({"CLI flag (oversized)", "`indexcp bench step --context 9999999999`",
               [] { return cli("bench step --context 9999999999 --no-record"); }});
  e.push_back({"CLI flag", "`indexcp bench step --layers 257`", [] { return cli("bench step --layers 257 --no-record"); }});
  // ---- launch (plain POSIX: the same on every machine)
  e.push_back({"CLI flag", "`indexcp launch -- true` (no --tp)", [] { return cli("launch -- true"); }});
  e.push_back({"CLI flag", "`indexcp launch --tp 0 -- true`", [] { return cli("launch --tp 0 -- true"); }});
  e.push_back({"CLI flag (oversized)", "`indexcp launch --tp 100000 -- true`", [] { return cli("launch --tp 100000 -- true"); }});
  e.push_back({"CLI flag", "`indexcp launch --tp 2` (no command)", [] { return cli("launch --tp 2"); }});
  e.push_back({"CLI flag", "`indexcp launch --tp 2 --timeout 0 -- true`", [] { return cli("launch --tp 2 --timeout 0 -- true"); }});
  e.push_back({"CLI flag", "`indexcp launch --tp 2 --grace -1 -- true`", [] { return cli("launch --tp 2 --grace -1 -- true"); }});
  e.push_back({"CLI flag", "`indexcp launch --tp 2 --grace 0x10 -- true` (hex)", [] { return cli("launch --tp 2 --grace 0x10 -- true"); }});
  e.push_back({"file", "`indexcp run --json ''` (empty file name)", [] { return cli("run --json ''"); }});
  e.push_back({"file", "`indexcp run --keys '' --queries ''` (empty file names)", [] { return cli("run --keys '' --queries ''"); }});
  e.push_back({"file", "`indexcp run --keys fifo --queries fifo` (a FIFO: reading it would block)", [] {
                 if (!fs::exists(g_tmp / "fifo")) ::mkfifo((g_tmp / "fifo").c_str(), 0600);
                 return cli_timeout("run --backend cpu --keys fifo --queries fifo");
               }});
  e.push_back({"file", "`indexcp launch --tp 2 -- indexcp-no-such-command`", [] { return cli("launch --tp 2 -- indexcp-no-such-command"); }});
  e.push_back({"file", "`indexcp launch --tp 2 -- case/case.json` (not executable)", [] { return cli("launch --tp 2 -- case/case.json"); }});
  e.push_back({"file", "`indexcp launch --tp 2 --report missing_dir/r.json -- true`",
               [] { return cli("launch --tp 2 --report missing_dir/r.json -- true"); }});
  e.push_back({"file", "`indexcp launch --tp 2 --report case -- true` (a directory)", [] { return cli("launch --tp 2 --report case -- true"); }});
  e.push_back({"rank failure", "`indexcp launch --tp 1 -- sh -c 'exit 3'`", [] { return cli("launch --tp 1 -- sh -c 'exit 3'"); }});
  e.push_back({"rank failure", "`indexcp launch --tp 1 -- sh -c 'kill -9 $$'`", [] { return cli("launch --tp 1 -- sh -c 'kill -9 $$'"); }});
  e.push_back({"rank failure", "`indexcp launch --tp 1 --time-limit 0.2 --grace 1 -- sleep 30`",
               [] { return cli("launch --tp 1 --time-limit 0.2 --grace 1 -- sleep 30"); }});
  // ---- configs
  e.push_back({"config", "`config --tp 2 --page-size 128 --attention-config '{\"indexer_kv_dtype\": \"bf16\", \"indexer_cache_sharding\": \"on\"}'`",
               [] { return cli("config --tp 2 --page-size 128 --attention-config '{\"indexer_kv_dtype\": \"bf16\", \"indexer_cache_sharding\": \"on\"}'"); }});
  e.push_back({"config", "`config --tp 2 --page-size 128 --attention-config '{\"indexer_kv_dtype\": \"int4\"}'`",
               [] { return cli("config --tp 2 --page-size 128 --attention-config '{\"indexer_kv_dtype\": \"int4\"}'"); }});
  e.push_back({"config", "`config --tp 2 --page-size 128 --attention-config '{\"indexer_kv_dtype\": \"fp8\", \"indexer_kv_dtype\": \"nvfp4\"}'` (repeated key)",
               [] { return cli("config --tp 2 --page-size 128 --attention-config '{\"indexer_kv_dtype\": \"fp8\", \"indexer_kv_dtype\": \"nvfp4\"}'"); }});
  e.push_back({"config", "`config --tp 2 --page-size 128 --attention-config '{\"indexer_sharding\": \"on\"}'` (unknown key)",
               [] { return cli("config --tp 2 --page-size 128 --attention-config '{\"indexer_sharding\": \"on\"}'"); }});
  e.push_back({"config", "`config --tp 2 --page-size 128 --attention-config '{\"indexer_score_precision\": \"fp16\"}'`",
               [] { return cli("config --tp 2 --page-size 128 --attention-config '{\"indexer_score_precision\": \"fp16\"}'"); }});
  e.push_back({"config", "`config --tp 2 --page-size 128 --attention-config '{\"indexer_kv_dtype\": \"bf16\", \"indexer_score_precision\": \"fp8_mma\"}'`",
               [] { return cli("config --tp 2 --page-size 128 --attention-config '{\"indexer_kv_dtype\": \"bf16\", \"indexer_score_precision\": \"fp8_mma\"}'"); }});
  e.push_back({"config", "`config --tp 2 --page-size 128 --attention-config '{\"indexer_kv_dtype\": \"nvfp4\", \"indexer_k_rounding\": \"exact\", \"indexer_score_precision\": \"fp8_mma\"}'`",
               [] { return cli("config --tp 2 --page-size 128 --attention-config '{\"indexer_kv_dtype\": \"nvfp4\", \"indexer_k_rounding\": \"exact\", \"indexer_score_precision\": \"fp8_mma\"}'"); }});
  e.push_back({"config", "`config --tp 2 --page-size 128 --attention-config '{'` (not JSON)", [] { return cli("config --tp 2 --page-size 128 --attention-config '{'"); }});
  e.push_back({"config (oversized)", "`config --tp 2 --page-size 128 --attention-config '{\"indexer_prefill_gather_budget_mib\": 1e300}'`",
               [] { return cli("config --tp 2 --page-size 128 --attention-config '{\"indexer_prefill_gather_budget_mib\": 1e300}'"); }});
  e.push_back({"config", "`config --tp 3 --page-size 128 --attention-config '{\"indexer_cache_sharding\": \"on\"}'`",
               [] { return cli("config --tp 3 --page-size 128 --attention-config '{\"indexer_cache_sharding\": \"on\"}'"); }});
  e.push_back({"config", "model file with `\"index_dim\": 64` (`capacity --model FILE`)", [mfile] {
                 std::ofstream(mfile) << R"({"layers": 60, "sparse_layers": 57, "q_heads": 64, "kv_heads": 4, "head_dim": 128, "index_heads": 4, "index_dim": 64})";
                 return cli("capacity --model model.json");
               }});
  e.push_back({"config", "model file with `\"sparse_layers\": 61` of 60 layers", [mfile] {
                 std::ofstream(mfile) << R"({"layers": 60, "sparse_layers": 61, "q_heads": 64, "kv_heads": 4, "head_dim": 128, "index_heads": 4, "index_dim": 128})";
                 return cli("capacity --model model.json");
               }});
  // ---- replay case files (each on a fresh copy of a valid case)
  e.push_back({"file", "case.json without `phase`", [] { edit_json([](json& j) { j.erase("phase"); }); return replay(); }});
  e.push_back({"file", "case.json with an unknown key `topK`", [] { edit_json([](json& j) { j["topK"] = 8; }); return replay(); }});
  e.push_back({"file", "case.json with `tp` given twice", [] {
                 std::string t = slurp(cf("case.json"));
                 t.insert(t.rfind('}'), ", \"tp\": 4");
                 std::ofstream(cf("case.json"), std::ios::trunc) << t;
                 return replay();
               }});
  e.push_back({"file", "case.json a symbolic link to /dev/zero (never ends)", [] {
                 fs::remove(cf("case.json"));
                 fs::create_symlink("/dev/zero", cf("case.json"));
                 return replay();
               }});
  e.push_back({"file", "`indexcp replay case --out out2` where out2/report.json is a directory", [] {
                 fs::create_directories(g_tmp / "out2" / "report.json");
                 std::string r = cli("replay case --out out2 --backend cpu");
                 if (fs::exists(g_tmp / "out2" / "topk.npy")) r += " (and topk.npy was written)";
                 fs::remove_all(g_tmp / "out2");
                 return r;
               }});
  e.push_back({"file", "`indexcp replay case --out missing_dir/out`", [] { return cli("replay case --out missing_dir/out --backend cpu"); }});
  e.push_back({"file (out of range)", "case.json `query_len` 17", [] { edit_json([](json& j) { j["query_len"] = 17; }); return replay(); }});
  e.push_back({"file (oversized)", "case.json `tp` 2^40", [] { edit_json([](json& j) { j["tp"] = int64_t{1} << 40; }); return replay(); }});
  e.push_back({"file", "block_table.npy stored as float32", [] {
                 const std::vector<float> v(6, 0.0f);
                 npy::save(cf("block_table.npy").string(), {2, 3}, v.data());
                 return replay();
               }});
  e.push_back({"out-of-range id", "block_table.npy entry 4 with 4 pages", [] {
                 const std::vector<int32_t> bt = {3, 0, 4, 2, 1, -1};
                 npy::save(cf("block_table.npy").string(), {2, 3}, bt.data());
                 return replay();
               }});
  e.push_back({"tensor", "seq_lens.npy holding -5", [] {
                 const std::vector<int32_t> v = {300, -5};
                 npy::save(cf("seq_lens.npy").string(), {2}, v.data());
                 return replay();
               }});
  e.push_back({"mismatched shapes", "seq_lens.npy of 3 requests, block_table.npy of 2", [] {
                 const std::vector<int32_t> v = {300, 200, 100};
                 npy::save(cf("seq_lens.npy").string(), {3}, v.data());
                 return replay();
               }});
  e.push_back({"oversized value", "seq_lens.npy 1,000,000 with max_pages 3", [] {
                 const std::vector<int32_t> v = {1000000, 200};
                 npy::save(cf("seq_lens.npy").string(), {2}, v.data());
                 return replay();
               }});
  e.push_back({"corrupt header", "q.npy whose shape is a tuple nested 100,000 deep (format 2.0)", [] {
                 // one recursion per '(' overflowed the stack (SIGSEGV) before the parser refused nesting
                 std::string h = "{'descr': '<f4', 'fortran_order': False, 'shape': " + std::string(100000, '(') + "}";
                 h.append((64 - (12 + h.size() + 1) % 64) % 64, ' ');
                 h += '\n';
                 std::string f = std::string("\x93NUMPY\x02\x00", 8);
                 for (int i = 0; i < 4; ++i) f += static_cast<char>((h.size() >> (8 * i)) & 0xff);
                 std::ofstream(cf("q.npy"), std::ios::binary) << f << h;
                 return replay();
               }});
  e.push_back({"NaN/Inf", "keys.npy with NaN in a used slot", [] {
                 npy::Array a = npy::load(cf("keys.npy").string());
                 reinterpret_cast<float*>(a.bytes.data())[3 * 128 * 128 + 5] = std::numeric_limits<float>::quiet_NaN();
                 npy::save(cf("keys.npy").string(), a.shape, a.data<float>());
                 return replay();
               }});
  e.push_back({"NaN/Inf", "keys.npy with +Inf in a used slot", [] {
                 npy::Array a = npy::load(cf("keys.npy").string());
                 reinterpret_cast<float*>(a.bytes.data())[128 + 7] = std::numeric_limits<float>::infinity();
                 npy::save(cf("keys.npy").string(), a.shape, a.data<float>());
                 return replay();
               }});
  e.push_back({"mismatched shapes", "keys.npy of shape [512, 64]", [] {
                 const std::vector<float> v(512 * 64, 0.5f);
                 npy::save(cf("keys.npy").string(), {512, 64}, v.data());
                 return replay();
               }});
  e.push_back({"NaN/Inf", "q.npy with NaN", [] {
                 npy::Array a = npy::load(cf("q.npy").string());
                 reinterpret_cast<float*>(a.bytes.data())[1 * 4 * 128 + 2 * 128 + 9] = std::numeric_limits<float>::quiet_NaN();
                 npy::save(cf("q.npy").string(), a.shape, a.data<float>());
                 return replay();
               }});
  e.push_back({"mismatched shapes", "q.npy of shape [4, 2, 128] for 4 heads", [] {
                 const std::vector<float> v(4 * 2 * 128, 0.5f);
                 npy::save(cf("q.npy").string(), {4, 2, 128}, v.data());
                 return replay();
               }});
  e.push_back({"file", "keys.npy truncated by 100 bytes", [] {
                 std::string s = slurp(cf("keys.npy"));
                 s.resize(s.size() - 100);
                 std::ofstream(cf("keys.npy"), std::ios::binary | std::ios::trunc) << s;
                 return replay();
               }});
  e.push_back({"file", "seq_lens.npy that is not a .npy file (text)", [] {
                 std::ofstream(cf("seq_lens.npy"), std::ios::trunc) << "300 200\n";
                 return replay();
               }});
  e.push_back({"file", "seq_lens.npy with a header claiming 2^40 elements", [] {
                 std::string s = slurp(cf("seq_lens.npy"));
                 s = replace_all(s, "(2,)", "(1099511627776,)");
                 std::ofstream(cf("seq_lens.npy"), std::ios::binary | std::ios::trunc) << s;
                 return replay();
               }});
  // ---- library calls
  e.push_back({"out-of-range id", "`insert_keys` slot 256 into 2 pages of 128", [] { return insert({0, 256}, good_keys(2)); }});
  e.push_back({"out-of-range id", "`insert_keys` slot -2", [] { return insert({-2}, good_keys(1)); }});
  e.push_back({"tensor", "`insert_keys` slot 5 twice in one batch", [] { return insert({5, 7, 5}, good_keys(3)); }});
  e.push_back({"NaN/Inf", "`insert_keys` key with -Inf", [] {
                 auto k = good_keys(2);
                 k[128 + 3] = -std::numeric_limits<float>::infinity();
                 return insert({0, 1}, k);
               }});
  e.push_back({"NaN/Inf", "`insert_keys` encode_scale NaN", [] { return insert({0}, good_keys(1), std::nanf("")); }});
  e.push_back({"tensor", "`decode_rows` query_len 0", [] { return decode({0, 1}, {200}, 0); }});
  e.push_back({"tensor", "`decode_rows` seq_len 1 with query_len 4", [] { return decode({0, 1}, {1}, 4); }});
  e.push_back({"NaN/Inf", "`decode_rows` q holding the E4M3 NaN byte 0x7F", [] { return decode({0, 1}, {200}, 1, 4, 0x7F); }});
  e.push_back({"tensor", "`prefill_rows` query_start [0, 5, 3]", [] {
                 return lib([] {
                   std::vector<int32_t> bt = {0, 1, 2, 3}, lens = {200, 200}, qs = {0, 5, 3};
                   std::vector<uint8_t> q(5 * 4 * 128, 0x38);
                   PrefillBatch pb{q.data(), 4, bt.data(), 2, 2, lens.data(), qs.data()};
                   (void)prefill_rows(pb, 4, 128);
                 });
               }});
  e.push_back({"oversized value", "`SelectionParams` topk 1025", [] {
                 return lib([] {
                   SelectionParams s;
                   s.topk = 1025;
                   s.validate();
                 });
               }});
  e.push_back({"oversized value", "`IndexCache` of 2^40 pages", [] {
                 return lib([] { IndexCache c(make_page_layout(KvDtype::kNvfp4, 128, 1), int64_t{1} << 40, 1); });
               }});
  e.push_back({"library argument", "`run_ranks` with world 65", [] { return lib([] { run_ranks(65, [](int, Communicator&) {}); }); }});
  return e;
}

std::string cell(std::string s) {
  s = replace_all(s, "|", "\\|");
  return s;
}

}  // namespace

TEST(BadInputs, CatalogueMatchesDocs) {
  g_tmp = fs::temp_directory_path() / ("indexcp_bad_inputs_" + std::to_string(::getpid()));
  fs::remove_all(g_tmp);
  fs::create_directories(g_tmp);
  std::ostringstream doc;
  doc << "# Bad inputs and the errors they get\n\n"
         "GENERATED by `tests/test_bad_inputs.cpp` from real runs of the built `indexcp` command and of\n"
         "library calls; the ctest test `BadInputs.CatalogueMatchesDocs` fails when this file and the\n"
         "runs disagree. Regenerate with\n\n"
         "```\nINDEXCP_WRITE_BAD_INPUTS=1 build/tests/test_bad_inputs\n```\n\n"
         "Command-line entries show the exit status (2: bad input, 1: runtime failure) and the first line\n"
         "of stderr; library entries show the `indexcp::Error` code and message. `launch` entries whose\n"
         "rank fails show the status the launcher passes on (the rank's exit status; 1 for a signal or the\n"
         "time limit). `bench` entries are refused before the build or the GPU is looked at, so they are\n"
         "the same with and without the CUDA backend. Replay entries start\n"
         "from one valid decode case (nvfp4, sharding on, TP2, P128, query_len 2, 4 heads, 2 requests of\n"
         "300 and 200 tokens over 4 pages) and change one thing; `case/` is that case directory. Nothing\n"
         "here crashes, hangs or writes output.\n\n"
         "| # | kind | bad input | what it gets |\n|---|---|---|---|\n";
  const auto entries = catalogue();
  int n = 0;
  for (const auto& en : entries) {
    write_case();
    fs::remove_all(g_tmp / "out");
    std::string got = en.run();
    got = replace_all(got, (g_tmp / "").string(), "");
    got = replace_all(got, g_tmp.string(), ".");
    EXPECT_FALSE(fs::exists(g_tmp / "out")) << en.input << ": a refused replay wrote its output directory";
    EXPECT_EQ(got.find("ACCEPTED"), std::string::npos) << en.input << " was accepted";
    EXPECT_EQ(got.find("NOT AN"), std::string::npos) << en.input << ": " << got;
    EXPECT_EQ(got.find("exit 0"), std::string::npos) << en.input << " was accepted";
    doc << "| " << ++n << " | " << en.kind << " | " << cell(en.input) << " | `" << cell(got) << "` |\n";
  }
  fs::remove_all(g_tmp);
  const fs::path path = fs::path(INDEXCP_SOURCE_DIR) / "docs" / "bad-inputs.md";
  const char* w = std::getenv("INDEXCP_WRITE_BAD_INPUTS");
  if (w && std::string(w) == "1") {
    std::ofstream(path, std::ios::trunc) << doc.str();
    std::printf("wrote %s (%d entries)\n", path.string().c_str(), n);
    return;
  }
  const std::string have = slurp(path);
  if (have != doc.str()) {
    std::istringstream a(have), b(doc.str());
    std::string la, lb;
    int line = 0;
    while (true) {
      const bool ga = static_cast<bool>(std::getline(a, la)), gb = static_cast<bool>(std::getline(b, lb));
      ++line;
      if (!ga && !gb) break;
      if (!ga || !gb || la != lb) {
        ADD_FAILURE() << path.string() << " differs from the real runs at line " << line << ":\n  docs: " << (ga ? la : "<end>")
                      << "\n  runs: " << (gb ? lb : "<end>")
                      << "\nIf the new behaviour is intended, regenerate: INDEXCP_WRITE_BAD_INPUTS=1 <build>/tests/test_bad_inputs";
        break;
      }
    }
  }
}
