// Replay of constructed cases (spec/cases.md): sharded == replicated == the library called
// directly, cache.npy == keys.npy, expected_topk, scores, and every invalid-case kind refused
// with the file named and nothing written to the output directory.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "indexcp/cache.hpp"
#include "indexcp/error.hpp"
#include "indexcp/indexer.hpp"
#include "indexcp/npy.hpp"
#include "indexcp/replay.hpp"

using namespace indexcp;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

fs::path temp_dir(const std::string& tag = "") {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = std::string(info->test_suite_name()) + "_" + info->name() + tag;
  for (char& c : name)
    if (c == '/') c = '_';
  const fs::path d = fs::temp_directory_path() / ("indexcp_replay_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// A case in memory. generate() fills the arrays; write() stores it.
struct TCase {
  std::string phase = "decode";
  json attention = {{"indexer_kv_dtype", "nvfp4"}, {"indexer_cache_sharding", "on"}};
  int32_t tp = 2, P = 128, H = 4, topk = 16, Q = 8, init = 0;
  std::vector<int32_t> lens;   // seq_lens
  std::vector<int32_t> chunk;  // prefill: chunk length per request
  bool q_bytes = false;        // q.npy as uint8 E4M3 bytes
  // generated
  int32_t B = 0, max_pages = 0;
  int64_t num_pages = 0, rows = 0;
  std::vector<int32_t> bt, qs;
  std::vector<float> keys, q;
  std::vector<uint8_t> q8;
  std::vector<int64_t> used;

  KvDtype dtype() const { return parse_kv_dtype(attention.value("indexer_kv_dtype", "fp8")); }
  int64_t slot(int32_t b, int64_t pos) const {
    return static_cast<int64_t>(bt[static_cast<size_t>(b) * max_pages + pos / P]) * P + pos % P;
  }

  void generate(uint32_t seed) {
    B = static_cast<int32_t>(lens.size());
    max_pages = 1;
    int64_t total = 0;
    for (int32_t l : lens) {
      max_pages = std::max(max_pages, (l + P - 1) / P + 1);  // one spare column (ignored, -1)
      total += (l + P - 1) / P;
    }
    num_pages = total + 3;
    std::vector<int32_t> pool(static_cast<size_t>(num_pages));
    std::iota(pool.begin(), pool.end(), 0);
    std::mt19937 rng(seed);
    std::shuffle(pool.begin(), pool.end(), rng);
    bt.assign(static_cast<size_t>(B) * max_pages, -1);
    size_t next = 0;
    for (int32_t b = 0; b < B; ++b)
      for (int32_t i = 0; i < (lens[b] + P - 1) / P; ++i) bt[static_cast<size_t>(b) * max_pages + i] = pool[next++];
    std::normal_distribution<float> nd(0.0f, 1.0f);
    // every slot gets NaN first: slots that hold no position < seq_len must be ignored
    keys.assign(static_cast<size_t>(num_pages) * P * 128, std::nanf(""));
    used.clear();
    for (int32_t b = 0; b < B; ++b)
      for (int64_t p = 0; p < lens[b]; ++p) {
        const int64_t s = slot(b, p);
        used.push_back(s);
        for (int d = 0; d < 128; ++d) keys[s * 128 + d] = nd(rng);
      }
    if (phase == "decode") {
      rows = static_cast<int64_t>(B) * Q;
    } else {
      qs.assign(static_cast<size_t>(B) + 1, 0);
      for (int32_t b = 0; b < B; ++b) qs[b + 1] = qs[b] + chunk[b];
      rows = qs[B];
    }
    q.resize(static_cast<size_t>(rows) * H * 128);
    for (auto& x : q) x = nd(rng);
    q8.resize(q.size());
    quantize_queries(q.data(), rows, H, KeyPreprocess{}, q8.data());
  }

  json case_json() const {
    json j = {{"phase", phase}, {"attention_config", attention}, {"tp", tp}, {"page_size", P},
              {"heads", H},     {"topk", topk},                   {"init_blocks", init}, {"local_blocks", 1}};
    if (phase == "decode") j["query_len"] = Q;
    return j;
  }

  void write(const fs::path& dir, bool with_keys = true) const {
    fs::create_directories(dir);
    std::ofstream(dir / "case.json") << case_json().dump(2);
    npy::save((dir / "block_table.npy").string(), {B, max_pages}, bt.data());
    npy::save((dir / "seq_lens.npy").string(), {B}, lens.data());
    if (with_keys) npy::save((dir / "keys.npy").string(), {num_pages * P, 128}, keys.data());
    if (q_bytes) npy::save((dir / "q.npy").string(), {rows, H, 128}, q8.data());
    else npy::save((dir / "q.npy").string(), {rows, H, 128}, q.data());
    if (phase == "prefill") npy::save((dir / "query_start.npy").string(), {B + 1}, qs.data());
  }

  // The replicated cache, filled through the library's insert.
  IndexCache replicated_cache() const {
    IndexCache c(make_page_layout(dtype(), P, 1), num_pages, 1, 0);
    std::vector<float> k(used.size() * 128);
    for (size_t i = 0; i < used.size(); ++i) std::copy_n(keys.data() + used[i] * 128, 128, k.data() + i * 128);
    insert_keys(c, 0, k.data(), used.data(), static_cast<int64_t>(used.size()));
    return c;
  }

  // cache.npy bytes [num_pages, P * key_bytes] of the replicated cache.
  std::vector<uint8_t> cache_bytes() const {
    const IndexCache c = replicated_cache();
    return std::vector<uint8_t>(c.data(), c.data() + c.size_bytes());
  }
  int64_t page_bytes() const { return static_cast<int64_t>(P) * key_bytes(dtype()); }

  // The decode batch of this case (phase "decode").
  DecodeBatch decode_batch() const {
    DecodeBatch b;
    b.q = q8.data();
    b.heads = H;
    b.block_table = bt.data();
    b.num_requests = B;
    b.max_pages = max_pages;
    b.seq_lens = lens.data();
    b.query_len = Q;
    return b;
  }

  // The selection of the library called directly on the replicated cache (all heads).
  std::vector<int32_t> library_topk() const {
    const IndexCache c = replicated_cache();
    SelectionParams sel;
    sel.topk = topk;
    sel.init_blocks = init;
    std::vector<int32_t> out(static_cast<size_t>(rows) * H * topk);
    const KRounding mode = parse_k_rounding(attention.value("indexer_k_rounding", "e4m3"));
    if (phase == "decode") {
      decode_select(c, 0, decode_batch(), 0, H, sel, mode, out.data());
    } else {
      PrefillBatch b;
      b.q = q8.data();
      b.heads = H;
      b.block_table = bt.data();
      b.num_requests = B;
      b.max_pages = max_pages;
      b.seq_lens = lens.data();
      b.query_start = qs.data();
      prefill_select(c, 0, b, 0, H, sel, out.data());
    }
    return out;
  }
};

std::vector<int32_t> read_topk(const fs::path& out, const TCase& c) {
  const auto a = npy::load_checked((out / "topk.npy").string(), npy::Dtype::kInt32, 3);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{c.rows, c.H, c.topk}));
  return std::vector<int32_t>(a.data<int32_t>(), a.data<int32_t>() + a.size());
}

json read_report(const fs::path& out) {
  std::ifstream in(out / "report.json");
  return json::parse(in);
}

TCase decode_case(const std::string& dtype, bool sharding, int32_t P, int32_t W) {
  TCase c;
  c.attention = {{"indexer_kv_dtype", dtype}, {"indexer_cache_sharding", sharding ? "on" : "off"}};
  c.P = P;
  c.tp = W;
  c.lens = {2100, 0, 300, 2600};
  return c;
}

TCase prefill_case(const std::string& dtype, bool sharding, int32_t P, int32_t W) {
  TCase c = decode_case(dtype, sharding, P, W);
  c.phase = "prefill";
  c.lens = {2400, 700, 2048};
  c.chunk = {130, 700, 5};
  return c;
}

// Expects replay to refuse `dir` with a message containing `file` and `needle`, writing nothing.
void expect_invalid(const fs::path& dir, const std::string& file, const std::string& needle,
                    const std::string& backend = "cpu") {
  const fs::path out = dir.parent_path() / (dir.filename().string() + "_out");
  fs::remove_all(out);
  ReplayOptions o;
  o.backend = backend;
  o.scores = true;
  try {
    replay_case(dir.string(), out.string(), o);
    ADD_FAILURE() << "accepted; expected a refusal naming " << file << " and " << needle;
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(file), std::string::npos) << m;
    EXPECT_NE(m.find(needle), std::string::npos) << m;
  }
  EXPECT_FALSE(fs::exists(out)) << "an invalid case wrote " << out;
  // an existing, empty output directory stays empty
  fs::create_directories(out);
  EXPECT_THROW(replay_case(dir.string(), out.string(), o), Error);
  EXPECT_TRUE(fs::is_empty(out));
  fs::remove_all(out);
}

}  // namespace

// ---------------------------------------------------------------------------------------------

struct ReplayParam {
  std::string phase, dtype;
  bool sharding;
  int32_t P, W;
  std::string extra;  // "decode_cp", "local_score", "exact", "qbytes", "init", "fp8_mma"
};
void PrintTo(const ReplayParam& p, std::ostream* os) {
  *os << p.phase << " " << p.dtype << " sharding " << (p.sharding ? "on" : "off") << " P" << p.P << " W" << p.W << " "
      << p.extra;
}

class ReplayPaths : public ::testing::TestWithParam<ReplayParam> {};

TEST_P(ReplayPaths, EqualsReplicatedAndTheLibrary) {
  const ReplayParam& p = GetParam();
  TCase c = p.phase == "decode" ? decode_case(p.dtype, p.sharding, p.P, p.W) : prefill_case(p.dtype, p.sharding, p.P, p.W);
  if (p.extra == "decode_cp") c.attention["indexer_decode_cp"] = true;
  if (p.extra == "local_score") c.attention["indexer_prefill_cp"] = "local_score";
  if (p.extra == "exact") c.attention["indexer_k_rounding"] = "exact";
  if (p.extra == "qbytes") c.q_bytes = true;
  if (p.extra == "init") c.init = 2;
  if (p.extra == "fp8_mma") c.attention["indexer_score_precision"] = "fp8_mma";  // exact scores on the CPU
  c.generate(7u + static_cast<uint32_t>(p.P + p.W));
  const fs::path d = temp_dir(), cd = d / "case", out = d / "out";
  c.write(cd);
  const ReplayResult r = replay_case(cd.string(), out.string());
  EXPECT_EQ(r.exit_code(), 0) << r.summary();
  EXPECT_TRUE(r.selections_equal_replicated);
  EXPECT_EQ(r.compared_with_replicated, p.sharding || (p.phase == "decode" && p.extra == "decode_cp"));
  const auto topk = read_topk(out, c);
  EXPECT_EQ(topk, c.library_topk());
  const json rep = read_report(out);
  EXPECT_EQ(rep["backend"], "cpu");
  EXPECT_EQ(rep["phase"], p.phase);
  EXPECT_EQ(rep["selections_equal_replicated"], true);
  EXPECT_EQ(rep["config"]["tp"], p.W);
  EXPECT_EQ(rep["config"]["page_size"], p.P);
  EXPECT_EQ(rep["config"]["indexer_kv_dtype"], p.dtype);
  EXPECT_EQ(rep["config"]["indexer_score_precision"], p.extra == "fp8_mma" ? "fp8_mma" : "fp32");
  EXPECT_TRUE(rep.contains("time"));
  EXPECT_TRUE(rep["time"]["step_wall_us"].is_number());
  EXPECT_FALSE(fs::exists(out / "scores.npy"));
  fs::remove_all(d);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ReplayPaths,
    ::testing::Values(ReplayParam{"decode", "nvfp4", true, 128, 2, ""}, ReplayParam{"decode", "nvfp4", true, 128, 4, "qbytes"},
                      ReplayParam{"decode", "nvfp4", true, 256, 2, ""}, ReplayParam{"decode", "fp8", true, 256, 4, "init"},
                      ReplayParam{"decode", "nvfp4", true, 128, 8, "exact"},
                      ReplayParam{"decode", "nvfp4", false, 128, 2, "decode_cp"},
                      ReplayParam{"decode", "bf16", false, 256, 1, ""}, ReplayParam{"prefill", "nvfp4", true, 128, 2, ""},
                      ReplayParam{"prefill", "fp8", true, 256, 4, "local_score"},
                      ReplayParam{"prefill", "nvfp4", false, 128, 4, ""},
                      ReplayParam{"decode", "nvfp4", true, 128, 2, "fp8_mma"},
                      ReplayParam{"prefill", "fp8", true, 256, 2, "fp8_mma"}),
    [](const ::testing::TestParamInfo<ReplayParam>& i) {
      return i.param.phase + "_" + i.param.dtype + "_" + (i.param.sharding ? "on" : "off") + "_P" +
             std::to_string(i.param.P) + "_W" + std::to_string(i.param.W) + (i.param.extra.empty() ? "" : "_" + i.param.extra);
    });

// The case.json that docs/cli.md shows ("The case format") is replayed exactly as written: the
// documentation cannot drift into a file the replay refuses (as a // comment once did).
TEST(Replay, TheDocumentedCaseLoads) {
  const fs::path doc = fs::path(INDEXCP_SOURCE_DIR) / "docs" / "cli.md";
  std::ifstream in(doc);
  ASSERT_TRUE(in) << doc;
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string marker = "Replay.TheDocumentedCaseLoads) reads this block -->";
  const size_t m = text.find(marker);
  ASSERT_NE(m, std::string::npos) << doc << " lost the marker of its case.json example";
  const size_t open = text.find("```json\n", m);
  ASSERT_NE(open, std::string::npos);
  const size_t body = open + 8, close = text.find("```", body);
  ASSERT_NE(close, std::string::npos);
  const std::string case_json = text.substr(body, close - body);
  const json j = json::parse(case_json);  // strict JSON: no comments
  TCase c;
  c.phase = j.at("phase").get<std::string>();
  ASSERT_EQ(c.phase, "decode") << "the test builds decode arrays";
  c.attention = j.value("attention_config", json::object());
  c.tp = j.at("tp").get<int32_t>();
  c.P = j.at("page_size").get<int32_t>();
  c.H = j.value("heads", 4);
  c.topk = j.value("topk", 16);
  c.init = j.value("init_blocks", 0);
  c.Q = j.at("query_len").get<int32_t>();
  c.lens = {3 * c.P + 17, 40 * 128 + 5};
  c.generate(11u);
  const fs::path d = temp_dir(), cd = d / "case", out = d / "out";
  c.write(cd);
  std::ofstream(cd / "case.json", std::ios::trunc) << case_json;  // the documented text itself
  const ReplayResult r = replay_case(cd.string(), out.string());
  EXPECT_EQ(r.exit_code(), 0) << r.summary();
  EXPECT_EQ(read_topk(out, c), c.library_topk());
  const json rep = read_report(out);
  EXPECT_EQ(rep["config"]["tp"], c.tp);
  EXPECT_EQ(rep["config"]["page_size"], c.P);
  fs::remove_all(d);
}

TEST(Replay, CacheNpyEqualsKeysNpy) {
  for (const auto& [phase, dt, P, W] : {std::tuple{"decode", "nvfp4", 128, 4}, std::tuple{"decode", "fp8", 256, 2},
                                        std::tuple{"prefill", "nvfp4", 256, 4}, std::tuple{"prefill", "fp8", 128, 2}}) {
    {
      TCase c = std::string(phase) == "decode" ? decode_case(dt, true, P, W) : prefill_case(dt, true, P, W);
      c.lens = std::string(phase) == "decode" ? std::vector<int32_t>{1100, 0, 300, 2200} : std::vector<int32_t>{1300, 400, 700};
      c.chunk = {130, 400, 5};
      c.generate(99u + static_cast<uint32_t>(P));
      const fs::path d = temp_dir(std::string("_") + phase + dt + std::to_string(P) + std::to_string(W));
      c.write(d / "keys_case");
      c.write(d / "cache_case", false);
      const auto bytes = c.cache_bytes();
      npy::save((d / "cache_case" / "cache.npy").string(), {c.num_pages, c.page_bytes()}, bytes.data());
      ReplayOptions o;
      o.scores = true;
      const auto r1 = replay_case((d / "keys_case").string(), (d / "o1").string(), o);
      const auto r2 = replay_case((d / "cache_case").string(), (d / "o2").string(), o);
      EXPECT_EQ(r1.exit_code(), 0);
      EXPECT_EQ(r2.exit_code(), 0);
      EXPECT_TRUE(r2.compared_with_replicated);
      EXPECT_EQ(read_topk(d / "o1", c), read_topk(d / "o2", c));
      EXPECT_EQ(read_topk(d / "o2", c), c.library_topk());
      const auto s1 = npy::load((d / "o1" / "scores.npy").string());
      const auto s2 = npy::load((d / "o2" / "scores.npy").string());
      EXPECT_EQ(s1.bytes, s2.bytes);
      EXPECT_EQ(read_report(d / "o2")["keys_from"], "cache.npy");
      fs::remove_all(d);
    }
  }
}

// keys.npy in float16 (as `indexcp run --keys` accepts): keys exact in float16 give the selections
// of the same keys in float32; other dtypes are refused with the message `run` gives.
TEST(Replay, Float16KeysEqualFloat32Keys) {
  TCase c = decode_case("nvfp4", true, 128, 2);
  c.generate(7u);
  for (auto& v : c.keys) v = std::round(v * 16.0f) / 16.0f;  // n / 16, |n| < 2^11: exact in float16
  const fs::path d = temp_dir("_f16keys");
  c.write(d / "f32");
  c.write(d / "f16");
  std::vector<uint16_t> h(c.keys.size());
  for (size_t i = 0; i < h.size(); ++i) {  // float -> float16 bits, exact for these values
    const float v = c.keys[i];
    uint32_t u;
    std::memcpy(&u, &v, 4);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const int32_t e = static_cast<int32_t>((u >> 23) & 0xff) - 127;
    if (std::isnan(v)) {  // (the case keeps non-finite keys in slots no request uses)
      h[i] = 0x7e00u;
      continue;
    }
    if (std::isinf(v)) {
      h[i] = static_cast<uint16_t>(sign | 0x7c00u);
      continue;
    }
    h[i] = (u & 0x7fffffffu) == 0 ? static_cast<uint16_t>(sign)
                                  : static_cast<uint16_t>(sign | static_cast<uint32_t>(e + 15) << 10 | ((u >> 13) & 0x3ffu));
    ASSERT_TRUE((u & 0x1fffu) == 0 && (v == 0.0f || (e >= -14 && e <= 15))) << v;
  }
  npy::save((d / "f16" / "keys.npy").string(), npy::Dtype::kFloat16, {c.num_pages * c.P, 128}, h.data());
  const auto r32 = replay_case((d / "f32").string(), (d / "o32").string());
  const auto r16 = replay_case((d / "f16").string(), (d / "o16").string());
  EXPECT_EQ(r16.exit_code(), 0);
  EXPECT_EQ(r16.topk, r32.topk);
  std::vector<int32_t> ints(c.keys.size(), 1);
  npy::save((d / "f16" / "keys.npy").string(), {c.num_pages * c.P, 128}, ints.data());
  try {
    replay_case((d / "f16").string(), (d / "o_int").string());
    ADD_FAILURE() << "int32 keys.npy was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dtype is int32, expected float16 or float32"), std::string::npos) << e.what();
  }
  fs::remove_all(d);
}

TEST(Replay, ScoresHoldTheReplicatedBlockScores) {
  TCase c = decode_case("nvfp4", true, 256, 2);
  c.generate(5);
  const fs::path d = temp_dir();
  c.write(d / "case");
  ReplayOptions o;
  o.scores = true;
  const auto r = replay_case((d / "case").string(), (d / "out").string(), o);
  EXPECT_EQ(r.exit_code(), 0);
  const auto s = npy::load_checked((d / "out" / "scores.npy").string(), npy::Dtype::kFloat32, 3);
  const int64_t max_blocks = static_cast<int64_t>(c.max_pages) * c.P / 128;
  ASSERT_EQ(s.shape, (std::vector<int64_t>{c.rows, c.H, max_blocks}));
  const IndexCache cache = c.replicated_cache();
  const auto rows = decode_rows(c.decode_batch(), c.num_pages, c.P);
  const auto ref = score_blocks(cache, 0, rows, c.bt.data(), c.max_pages, c.q8.data(), c.H, 0, c.H, KRounding::kE4m3);
  const float* got = s.data<float>();
  for (int64_t i = 0; i < s.size(); ++i) {
    if (std::isinf(ref.score[i])) EXPECT_TRUE(std::isinf(got[i]) && got[i] < 0) << i;
    else EXPECT_EQ(got[i], ref.score[i]) << i;
  }
  // a padded request (seq_len 0) has no scores at all
  for (int32_t i = 0; i < c.Q; ++i)
    for (int64_t k = 0; k < c.H * max_blocks; ++k) EXPECT_TRUE(std::isinf(got[(1 * c.Q + i) * c.H * max_blocks + k]));
  fs::remove_all(d);
}

TEST(Replay, ExpectedTopkMatchesAndMismatches) {
  TCase c = decode_case("nvfp4", true, 128, 2);
  c.generate(3);
  const fs::path d = temp_dir();
  c.write(d / "case");
  auto expected = c.library_topk();
  npy::save((d / "case" / "expected_topk.npy").string(), {c.rows, c.H, c.topk}, expected.data());
  auto r = replay_case((d / "case").string(), (d / "out").string());
  EXPECT_EQ(r.exit_code(), 0);
  EXPECT_TRUE(r.has_expected);
  EXPECT_TRUE(r.expected_equal);
  EXPECT_EQ(read_report(d / "out")["expected_topk"]["equal"], true);
  // change one id at row 17, head 2 (request 2, query 1) and another later one
  const size_t at = (17 * c.H + 2) * c.topk + 3;
  expected[at] = expected[at] + 1000;
  expected[(30 * c.H + 1) * c.topk] = 77;
  npy::save((d / "case" / "expected_topk.npy").string(), {c.rows, c.H, c.topk}, expected.data());
  r = replay_case((d / "case").string(), (d / "out2").string());
  EXPECT_EQ(r.exit_code(), 4);
  EXPECT_FALSE(r.expected_equal);
  EXPECT_EQ(r.expected_difference.row, 17);
  EXPECT_EQ(r.expected_difference.head, 2);
  const std::string msg = r.expected_difference.describe("expected", "got");
  EXPECT_NE(msg.find("row 17, head 2: expected ["), std::string::npos) << msg;
  EXPECT_NE(msg.find("] vs got ["), std::string::npos) << msg;
  const json rep = read_report(d / "out2");
  EXPECT_EQ(rep["expected_topk"]["equal"], false);
  EXPECT_EQ(rep["expected_topk"]["first_difference"]["row"], 17);
  EXPECT_EQ(rep["selections_equal_replicated"], true);
  // outputs are written on a mismatch (they are valid results)
  EXPECT_TRUE(fs::exists(d / "out2" / "topk.npy"));
  fs::remove_all(d);
}

TEST(Replay, FirstDifferenceAndExitCodes) {
  const std::vector<int32_t> a = {0, 1, 2, 3, 4, 5, 6, 7}, b = {0, 1, 2, 3, 4, 5, 9, 7};
  const auto d = first_difference(a.data(), b.data(), 2, 2, 2);  // [2 rows][2 heads][2]
  ASSERT_TRUE(d.found);
  EXPECT_EQ(d.row, 1);
  EXPECT_EQ(d.head, 1);
  EXPECT_EQ(d.describe("sharded", "replicated"), "row 1, head 1: sharded [6, 7] vs replicated [9, 7]");
  EXPECT_FALSE(first_difference(a.data(), a.data(), 2, 2, 2).found);
  ReplayResult r;
  EXPECT_EQ(r.exit_code(), 0);
  r.has_expected = true;
  r.expected_equal = false;
  EXPECT_EQ(r.exit_code(), 4);
  r.selections_equal_replicated = false;
  EXPECT_EQ(r.exit_code(), 3);
}

TEST(Replay, NonFiniteKeysOutsideUsedSlotsAreIgnored) {
  // generate() already puts NaN in every unused slot; a block-table entry past the needed pages
  // may hold anything
  TCase c = decode_case("fp8", true, 128, 4);
  c.generate(11);
  c.bt[static_cast<size_t>(0) * c.max_pages + c.max_pages - 1] = 999999;  // spare column: ignored
  const fs::path d = temp_dir();
  c.write(d / "case");
  const auto r = replay_case((d / "case").string(), (d / "out").string());
  EXPECT_EQ(r.exit_code(), 0);
  EXPECT_EQ(read_topk(d / "out", c), c.library_topk());
  fs::remove_all(d);
}

// ---------------------------------------------------------------------------------------------
// Invalid cases

class InvalidCase : public ::testing::Test {
 protected:
  void SetUp() override {
    d_ = temp_dir();
    c_ = decode_case("nvfp4", true, 128, 2);
    c_.generate(21);
  }
  void TearDown() override { fs::remove_all(d_); }
  fs::path fresh(const std::string& name, bool with_keys = true) {
    const fs::path p = d_ / name;
    c_.write(p, with_keys);
    return p;
  }
  fs::path d_;
  TCase c_;
};

TEST_F(InvalidCase, MissingFiles) {
  auto p = fresh("no_seq");
  fs::remove(p / "seq_lens.npy");
  expect_invalid(p, "seq_lens.npy", "no such file");
  p = fresh("no_case_json");
  fs::remove(p / "case.json");
  expect_invalid(p, "case.json", "no such file");
  p = fresh("no_keys");
  fs::remove(p / "keys.npy");
  expect_invalid(p, "keys.npy", "keys.npy or cache.npy");
  p = fresh("no_q");
  fs::remove(p / "q.npy");
  expect_invalid(p, "q.npy", "no such file");
  expect_invalid(d_ / "does_not_exist", "does_not_exist", "no such case directory");
}

TEST_F(InvalidCase, WrongDtypeOrShape) {
  auto p = fresh("bt_float");
  std::vector<float> f(c_.bt.begin(), c_.bt.end());
  npy::save((p / "block_table.npy").string(), {c_.B, c_.max_pages}, f.data());
  expect_invalid(p, "block_table.npy", "dtype is float32, expected int32");
  p = fresh("seq_int64");
  std::vector<int64_t> l(c_.lens.begin(), c_.lens.end());
  npy::save((p / "seq_lens.npy").string(), {c_.B}, l.data());
  expect_invalid(p, "seq_lens.npy", "dtype is int64, expected int32");
  p = fresh("seq_shape");
  npy::save((p / "seq_lens.npy").string(), {c_.B - 1}, c_.lens.data());
  expect_invalid(p, "seq_lens.npy", "requests but block_table.npy has");
  p = fresh("q_rows");
  npy::save((p / "q.npy").string(), {c_.rows - 1, c_.H, 128}, c_.q.data());
  expect_invalid(p, "q.npy", "must be [rows, heads, 128]");
  p = fresh("q_int");
  std::vector<int32_t> qi(c_.q.size(), 1);
  npy::save((p / "q.npy").string(), {c_.rows, c_.H, 128}, qi.data());
  expect_invalid(p, "q.npy", "expected float32 or uint8");
  p = fresh("keys_dim");
  npy::save((p / "keys.npy").string(), {c_.num_pages * c_.P * 2, 64}, c_.keys.data());
  expect_invalid(p, "keys.npy", "must be [num_slots, 128]");
  p = fresh("keys_not_pages");
  npy::save((p / "keys.npy").string(), {c_.num_pages * c_.P - 1, 128}, c_.keys.data());
  expect_invalid(p, "keys.npy", "multiple of page_size");
  p = fresh("expected_shape");
  std::vector<int32_t> e(static_cast<size_t>(c_.rows) * c_.H * 8, 0);
  npy::save((p / "expected_topk.npy").string(), {c_.rows, c_.H, 8}, e.data());
  expect_invalid(p, "expected_topk.npy", "must be [rows, heads, topk]");
  p = fresh("corrupt");
  {
    static const char raw[] = "\x93NUMPY\x01\x00\x40\x00{'descr': '<f4', 'fortran_order'";
    const std::string bytes(raw, sizeof raw - 1);  // the header claims 64 bytes; 32 follow
    std::ofstream out(p / "q.npy", std::ios::binary | std::ios::trunc);
    out << bytes;
  }
  expect_invalid(p, "q.npy", "truncated");
  p = fresh("cache_shape", false);
  std::vector<uint8_t> cb(static_cast<size_t>(c_.num_pages) * 100, 0);
  npy::save((p / "cache.npy").string(), {c_.num_pages, 100}, cb.data());
  expect_invalid(p, "cache.npy", "must be [num_pages, 9216]");
}

TEST_F(InvalidCase, BlockTableEntryOutOfRange) {
  for (int32_t v : {-1, static_cast<int32_t>(c_.num_pages)}) {
    TCase c = c_;
    c.bt[static_cast<size_t>(3) * c.max_pages + 5] = v;  // request 3 (2600 tokens) needs 21 pages
    const fs::path p = d_ / ("bt" + std::to_string(v));
    c.write(p);
    expect_invalid(p, "block_table.npy", "block_table[3][5] = " + std::to_string(v) + " is outside [0, num_pages");
  }
  TCase c = c_;
  c.lens[3] = c.max_pages * c.P + 1;
  const fs::path p = d_ / "too_long";
  c.write(p);
  expect_invalid(p, "block_table.npy", "pages but the block table has max_pages");
}

TEST_F(InvalidCase, SeqLenAndQueryLen) {
  TCase c = c_;
  c.lens[2] = 5;  // 0 < 5 < query_len 8
  fs::path p = d_ / "short";
  c.write(p);
  expect_invalid(p, "seq_lens.npy", "seq_lens[2] = 5 is shorter than query_len = 8");
  c = c_;
  c.lens[0] = -3;
  p = d_ / "neg";
  c.write(p);
  expect_invalid(p, "seq_lens.npy", "seq_lens[0] = -3 is negative");
  for (int32_t q : {0, 17}) {
    p = fresh("ql" + std::to_string(q));
    json j = c_.case_json();
    j["query_len"] = q;
    std::ofstream(p / "case.json") << j.dump();
    expect_invalid(p, "case.json", "query_len = " + std::to_string(q) + " is out of range 1..16");
  }
  p = fresh("ql_missing");
  json j = c_.case_json();
  j.erase("query_len");
  std::ofstream(p / "case.json") << j.dump();
  expect_invalid(p, "case.json", "missing key \"query_len\"");
}

TEST_F(InvalidCase, NonFiniteKeyInAUsedSlot) {
  for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
    TCase c = c_;
    const int64_t s = c.slot(3, 2599);  // the last token of request 3
    c.keys[s * 128 + 77] = bad;
    const fs::path p = d_ / ("key" + std::to_string(static_cast<int>(std::isnan(bad))) + std::to_string(bad > 0));
    c.write(p);
    expect_invalid(p, "keys.npy", "slot " + std::to_string(s) + " (request 3, position 2599) holds a non-finite value");
  }
}

TEST_F(InvalidCase, NaNInQ) {
  TCase c = c_;
  c.q[(static_cast<size_t>(9) * c.H + 3) * 128 + 100] = std::nanf("");
  fs::path p = d_ / "qnan";
  c.write(p);
  expect_invalid(p, "q.npy", "NaN at row 9, head 3, dim 100");
  c = c_;
  c.q_bytes = true;
  for (uint8_t b : {uint8_t{0x7f}, uint8_t{0xff}}) {
    c.q8 = c_.q8;
    c.q8[(static_cast<size_t>(2) * c.H + 1) * 128 + 5] = b;
    p = d_ / ("qbyte" + std::to_string(b));
    c.write(p);
    expect_invalid(p, "q.npy", "NaN byte 0x" + std::string(b == 0x7f ? "7F" : "FF") + " (E4M3) at row 2, head 1, dim 5");
  }
}

TEST_F(InvalidCase, NaNBytesInCacheNpy) {
  // NVFP4: a scale byte of a used slot; FP8: a data byte of a used slot
  for (const std::string dt : {"nvfp4", "fp8"}) {
    TCase c = decode_case(dt, true, 128, 2);
    c.generate(4);
    auto bytes = c.cache_bytes();
    const int64_t s = c.slot(0, 100);
    const int64_t page = s / c.P, u = s % c.P;
    const PageLayout l = make_page_layout(c.dtype(), c.P, 1);
    const int64_t off = dt == "nvfp4" ? l.row_scale_offset(static_cast<int32_t>(u)) + 3 : l.row_data_offset(static_cast<int32_t>(u)) + 9;
    bytes[page * c.page_bytes() + off] = 0xFF;
    const fs::path p = d_ / ("cache_nan_" + dt);
    c.write(p, false);
    npy::save((p / "cache.npy").string(), {c.num_pages, c.page_bytes()}, bytes.data());
    expect_invalid(p, "cache.npy", "NaN byte 0xFF (E4M3 " + std::string(dt == "nvfp4" ? "scale" : "data") + ")");
    // and a cache.npy case with --backend cuda is refused clearly
    bytes[page * c.page_bytes() + off] = 0x00;
    npy::save((p / "cache.npy").string(), {c.num_pages, c.page_bytes()}, bytes.data());
    expect_invalid(p, "cache.npy", "cpu backend only", "cuda");
  }
}

TEST_F(InvalidCase, BothKeysAndCache) {
  auto p = fresh("both");
  const auto bytes = c_.cache_bytes();
  npy::save((p / "cache.npy").string(), {c_.num_pages, c_.page_bytes()}, bytes.data());
  expect_invalid(p, "both", "holds both keys.npy and cache.npy");
}

TEST_F(InvalidCase, BadCaseJson) {
  const auto with = [&](const std::string& name, const std::string& text) {
    const fs::path p = fresh(name);
    std::ofstream(p / "case.json", std::ios::trunc) << text;
    return p;
  };
  expect_invalid(with("notjson", "{\"phase\": "), "case.json", "not valid JSON");
  expect_invalid(with("array", "[1, 2]"), "case.json", "JSON object");
  json j = c_.case_json();
  j["topK"] = 16;
  expect_invalid(with("unknown", j.dump()), "case.json", "unknown key \"topK\"");
  j = c_.case_json();
  j["phase"] = "verify";
  expect_invalid(with("phase", j.dump()), "case.json", "phase = \"verify\"");
  j = c_.case_json();
  j.erase("tp");
  expect_invalid(with("no_tp", j.dump()), "case.json", "missing key \"tp\"");
  j = c_.case_json();
  j["tp"] = "2";
  expect_invalid(with("tp_string", j.dump()), "case.json", "tp = \"2\" must be an integer");
  j = c_.case_json();
  j["attention_config"]["indexer_kv_dtype"] = "bf16";
  expect_invalid(with("bf16_sharded", j.dump()), "case.json", "indexer_kv_dtype");
  j = c_.case_json();
  j["attention_config"]["bogus"] = 1;
  expect_invalid(with("ac_unknown", j.dump()), "case.json", "bogus");
  j = c_.case_json();
  j["tp"] = 3;
  expect_invalid(with("tp3", j.dump()), "case.json", "tp");
  j = c_.case_json();
  j["topk"] = 1;
  expect_invalid(with("topk1", j.dump()), "case.json", "topk = 1");
  j = c_.case_json();
  j["encode_scale"] = 0;
  expect_invalid(with("scale0", j.dump()), "case.json", "encode_scale");
  j = c_.case_json();
  j["local_blocks"] = 0;
  expect_invalid(with("local0", j.dump()), "case.json", "local_blocks");
}

TEST_F(InvalidCase, PrefillQueryStart) {
  TCase c = prefill_case("nvfp4", true, 128, 2);
  c.generate(8);
  fs::path p = d_ / "qs_over";
  TCase x = c;
  x.chunk = {130, 701, 4};  // 701 > seq_len 700
  x.generate(8);
  x.write(p);
  expect_invalid(p, "query_start.npy", "request 1 has a chunk of 701 tokens, more than seq_lens[1] = 700");
  p = d_ / "qs_missing";
  c.write(p);
  fs::remove(p / "query_start.npy");
  expect_invalid(p, "query_start.npy", "no such file");
  p = d_ / "qs_first";
  c.write(p);
  std::vector<int32_t> qs = c.qs;
  qs[0] = 1;
  npy::save((p / "query_start.npy").string(), {c.B + 1}, qs.data());
  expect_invalid(p, "query_start.npy", "query_start[0] = 1 must be 0");
  p = d_ / "qs_decreasing";
  c.write(p);
  qs = c.qs;
  qs[2] = qs[1] - 1;
  npy::save((p / "query_start.npy").string(), {c.B + 1}, qs.data());
  expect_invalid(p, "query_start.npy", "is below query_start[1]");
  // a decode case with query_start.npy is refused too
  p = fresh("decode_with_qs");
  npy::save((p / "query_start.npy").string(), {c.B + 1}, c.qs.data());
  expect_invalid(p, "query_start.npy", "prefill");
}

TEST_F(InvalidCase, OutputPathThatIsAFile) {
  const fs::path p = fresh("ok");
  std::ofstream(d_ / "a_file") << "x";
  try {
    replay_case(p.string(), (d_ / "a_file").string());
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is not a directory"), std::string::npos) << e.what();
  }
}

// spec/cases.md: query_len is decode only; a prefill case carrying it is accepted and the report
// notes that it is ignored.
TEST(Replay, PrefillQueryLenIsNotedInTheReport) {
  const fs::path d = temp_dir();
  TCase c = prefill_case("nvfp4", true, 128, 2);
  c.generate(3);
  c.write(d / "case");
  json j = c.case_json();
  j["query_len"] = 4;
  std::ofstream(d / "case" / "case.json", std::ios::trunc) << j.dump();
  ReplayOptions o;
  o.backend = "cpu";
  const ReplayResult r = replay_case((d / "case").string(), (d / "out").string(), o);
  EXPECT_EQ(r.exit_code(), 0);
  const json rep = read_report(d / "out");
  bool noted = false;
  for (const auto& n : rep["notes"]) noted = noted || n.get<std::string>().find("query_len") != std::string::npos;
  EXPECT_TRUE(noted) << rep["notes"].dump();
  fs::remove_all(d);
}
