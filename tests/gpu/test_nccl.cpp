// The NCCL communicator (include/indexcp/nccl.hpp) on real GPUs.
//
// One binary, three roles:
//   - Without the launcher's environment (plain ctest, one GPU is enough): NcclSingle.* runs the
//     W = 1 NCCL path - icp_decode, decode CP and gather / local_score prefill over a 1-shard cache
//     through NcclCommunicator equal the replicated path, payload sizes, all_to_all, CUDA-graph
//     capture, the watchdog (init that never completes, a stream that never completes), abort
//     and finalize. NcclLaunch.* runs `indexcp launch --tp 2` on this binary (skipped with fewer
//     than 2 GPUs).
//   - As a rank under `indexcp launch --tp W -- test_nccl --gtest_filter=NcclMulti.*`: each
//     process builds the same deterministic data and its own shard, runs the ICP paths through
//     NCCL and compares with the replicated path computed locally; the payload sizes are checked
//     (decode: each rank sends rows x H x (K-1) x 8 bytes, receives W times that; gather: 128
//     bytes per gathered token). Each rank writes $INDEXCP_REPORT_DIR/rank<r>.json. With fewer
//     GPUs than W the program prints why and exits 77 (skip).
//   - `test_nccl --kill-test=warm|cold` under `indexcp launch --tp 2`: rank 1 exits abruptly
//     (status 0) before a collective; rank 0 must fail with the watchdog's error within
//     INDEXCP_NCCL_TIMEOUT_S and exit 1.
#include <cuda_runtime.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "gpu_util.hpp"
#include "indexcp/error.hpp"
#include "indexcp/nccl.hpp"
#include "indexcp/rendezvous.hpp"

using namespace gpu;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr int kSkipStatus = 77;  // ctest SKIP_RETURN_CODE convention

int visible_gpus() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

// ---- the process's group under the launcher (NcclMulti.*) --------------------------------------

struct Group {
  std::optional<RankEnv> env;
  std::unique_ptr<nccl::NcclCommunicator> comm;
  std::string error;  // why the communicator could not be created
  json report = json::object();
};
Group& group() {
  static Group g;
  return g;
}

class GroupEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    Group& g = group();
    try {
      g.env = rank_env_from_env();
      if (g.env && g.env->world > 1) g.comm = nccl::make_communicator(*g.env);
    } catch (const std::exception& e) {
      g.error = e.what();
    }
  }
  void TearDown() override {
    Group& g = group();
    if (!g.env) return;
    std::string finalize_error;
    try {
      if (g.comm) g.comm->finalize();
    } catch (const std::exception& e) {
      finalize_error = e.what();
    }
    const auto* ut = ::testing::UnitTest::GetInstance();
    g.report["rank"] = g.env->rank;
    g.report["world"] = g.env->world;
    g.report["device"] = g.env->device;
    try {
      g.report["gpu"] = cuda::device_name();
      g.report["nccl_version"] = nccl::version();
    } catch (const std::exception& e) {
      g.report["gpu"] = std::string("unknown: ") + e.what();
    }
    g.report["tests_run"] = ut->test_to_run_count();
    g.report["tests_passed"] = ut->successful_test_count();
    g.report["tests_skipped"] = ut->skipped_test_count();
    g.report["tests_failed"] = ut->failed_test_count();
    g.report["communicator_error"] = g.error.empty() ? json(nullptr) : json(g.error);
    g.report["finalize_error"] = finalize_error.empty() ? json(nullptr) : json(finalize_error);
    g.comm.reset();
    if (const char* dir = std::getenv("INDEXCP_REPORT_DIR")) {
      std::ofstream(std::string(dir) + "/rank" + std::to_string(g.env->rank) + ".json") << g.report.dump(2) << "\n";
    }
  }
};

#define REQUIRE_GROUP()                                                                                    \
  do {                                                                                                     \
    if (!group().env || group().env->world < 2)                                                            \
      GTEST_SKIP() << "runs as a rank of `indexcp launch --tp W -- test_nccl --gtest_filter=NcclMulti.*`"; \
    ASSERT_TRUE(group().comm) << "no NCCL communicator: " << group().error;                               \
  } while (0)

// ---- helpers -------------------------------------------------------------------------------------

struct StreamGuard {
  cudaStream_t s = nullptr;
  StreamGuard() { cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); }
  ~StreamGuard() {
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
  operator cudaStream_t() const { return s; }
  cuda::Stream cs() const { return reinterpret_cast<cuda::Stream>(s); }
};

// One rank's shard (rank `rank` of W; W = 1: the replicated cache), filled by the GPU insert.
cuda::DeviceCache device_shard(KvDtype dt, const Requests& r, int32_t W, int32_t rank, const std::vector<float>& keys,
                               const std::vector<int64_t>& slots) {
  cuda::DeviceCache c(make_page_layout(dt, r.page_size, W), r.num_pages, 1, rank);
  DevArr<float> k(keys);
  DevArr<int64_t> s(slots);
  cuda::insert_keys(c, 0, k.get(), s.get(), static_cast<int64_t>(slots.size()), InsertOptions{}, nullptr);
  return c;
}

struct DecodeScene {
  Requests req;
  std::vector<float> keys;
  std::vector<int64_t> slots;
  std::vector<uint8_t> q;
  int32_t H = 4, Q = 8;
  int64_t rows() const { return static_cast<int64_t>(req.seq_lens.size()) * Q; }
};

// The same data in every process (fixed seeds).
DecodeScene decode_scene(int32_t P, uint32_t seed) {
  DecodeScene s;
  s.req = make_requests({3000, 129, 0, 5000, 9, 640}, P, seed);
  make_keys(s.req, seed + 1, s.keys, s.slots);
  s.q = make_q(s.rows(), s.H, seed + 2);
  return s;
}

// out [rows, nh, K] of rank heads h0.. equals expect [rows, H, K] at those heads (first mismatch).
::testing::AssertionResult owned_heads_equal(const std::vector<int32_t>& got, const std::vector<int32_t>& expect,
                                             int64_t rows, int32_t H, int32_t h0, int32_t nh, int32_t K) {
  for (int64_t r = 0; r < rows; ++r)
    for (int32_t hh = 0; hh < nh; ++hh)
      for (int32_t k = 0; k < K; ++k) {
        const int32_t g = got[static_cast<size_t>((r * nh + hh) * K + k)];
        const int32_t e = expect[static_cast<size_t>((r * H + h0 + hh) * K + k)];
        if (g != e)
          return ::testing::AssertionFailure() << "row " << r << " head " << h0 + hh << " k " << k << ": got " << g
                                               << ", replicated " << e;
      }
  return ::testing::AssertionSuccess();
}

// The sum over the ranks of `v`, through the communicator (8 bytes per rank).
uint64_t sum_over_ranks(Communicator& c, uint64_t v, cudaStream_t s) {
  DevArr<uint64_t> mine(std::vector<uint64_t>{v});
  DevArr<uint64_t> all(static_cast<size_t>(c.world()));
  c.all_gather(mine.get(), all.get(), sizeof(uint64_t), s);
  c.synchronize(s);
  uint64_t sum = 0;
  for (uint64_t x : all.host()) sum += x;
  return sum;
}

struct DecodeCheck {
  bool equal = false;
  std::string mismatch;
  size_t sent = 0;
};

// icp_decode (or decode CP over the replicated cache) through `comm` against decode_select on the
// replicated cache, computed in this process.
DecodeCheck check_decode(Communicator& comm, const DecodeScene& s, KvDtype dt, KRounding mode, bool cp,
                         bool p256_stock, cudaStream_t st) {
  const int32_t W = comm.world(), rank = comm.rank();
  const int32_t P = s.req.page_size;
  auto repl = device_shard(dt, s.req, 1, 0, s.keys, s.slots);
  std::optional<cuda::DeviceCache> shard;
  if (!cp) shard.emplace(device_shard(dt, s.req, W, rank, s.keys, s.slots));
  DevDecode d(s.req, s.q, s.H, s.Q);
  SelectionParams sel;
  const int64_t rows = s.rows();
  DevArr<int32_t> expect(static_cast<size_t>(rows) * s.H * sel.topk);
  int32_t h0, nh;
  owned_heads(s.H, W, rank, &h0, &nh);
  DevArr<int32_t> out(static_cast<size_t>(rows) * nh * sel.topk);
  cudaMemsetAsync(out.get(), 0x7f, out.size() * sizeof(int32_t), st);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto stream = reinterpret_cast<cuda::Stream>(st);
  cuda::decode_select(repl, 0, d.b, 0, s.H, sel, mode, expect.get(), stream);
  const size_t before = comm.bytes_sent();
  if (cp) cuda::decode_cp_replicated(comm, repl, 0, d.b, sel, mode, out.get(), stream);
  else cuda::icp_decode(comm, *shard, 0, d.b, sel, mode, out.get(), stream, true, p256_stock);
  comm.synchronize(st);
  DecodeCheck c;
  c.sent = comm.bytes_sent() - before;
  const auto r = owned_heads_equal(out.host(), expect.host(), rows, s.H, h0, nh, sel.topk);
  c.equal = static_cast<bool>(r);
  if (!c.equal) c.mismatch = r.message();
  (void)P;
  return c;
}

struct GatherCheck {
  bool equal = false;
  std::string mismatch;
  size_t sent = 0;
  GatherStats stats;
};

GatherCheck check_gather(Communicator& comm, const PrefillScene& s, KvDtype dt, int64_t budget_units, bool local_score,
                         cudaStream_t st) {
  const int32_t W = comm.world(), rank = comm.rank();
  auto repl = device_shard(dt, s.req, 1, 0, s.keys, s.slots);
  auto shard = device_shard(dt, s.req, W, rank, s.keys, s.slots);
  DevPrefill d(s);
  SelectionParams sel;
  const int64_t rows = s.qs.back();
  DevArr<int32_t> expect(static_cast<size_t>(rows) * s.heads * sel.topk);
  int32_t h0, nh;
  owned_heads(s.heads, W, rank, &h0, &nh);
  DevArr<int32_t> out(static_cast<size_t>(rows) * nh * sel.topk);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto stream = reinterpret_cast<cuda::Stream>(st);
  cuda::prefill_select(repl, 0, d.b, 0, s.heads, sel, expect.get(), stream);
  const int64_t unit = gather_unit_bytes(shard.layout());
  const int64_t budget = budget_units > 0 ? unit * budget_units : int64_t{256} << 20;
  const size_t before = comm.bytes_sent();
  GatherCheck c;
  if (local_score) cuda::prefill_local_score(comm, shard, 0, d.b, sel, out.get(), stream);
  else c.stats = cuda::prefill_gather(comm, shard, 0, d.b, sel, budget, out.get(), stream);
  comm.synchronize(st);
  c.sent = comm.bytes_sent() - before;
  const auto r = owned_heads_equal(out.host(), expect.host(), rows, s.heads, h0, nh, sel.topk);
  c.equal = static_cast<bool>(r);
  if (!c.equal) c.mismatch = r.message();
  return c;
}

// ---- running the launcher from a test ------------------------------------------------------------

std::string self_path() {
  std::error_code ec;
  return fs::read_symlink("/proc/self/exe", ec).string();
}

struct Run {
  int status = -1;
  std::string out, err;
  double seconds = 0;
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

#ifdef INDEXCP_CLI_PATH
// `indexcp launch ARGS` with this process's group variables removed from the environment.
Run run_launch(const std::string& args, const fs::path& dir) {
  const fs::path o = dir / "stdout.txt", e = dir / "stderr.txt";
  const std::string cmd = "env -u INDEXCP_WORLD -u INDEXCP_RANK -u INDEXCP_RENDEZVOUS -u INDEXCP_RUN_ID '" +
                          std::string(INDEXCP_CLI_PATH) + "' launch " + args + " >'" + o.string() + "' 2>'" +
                          e.string() + "'";
  const auto t0 = std::chrono::steady_clock::now();
  const int rc = std::system(cmd.c_str());
  Run r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.status = WIFEXITED(rc) ? WEXITSTATUS(rc) : 128 + (WIFSIGNALED(rc) ? WTERMSIG(rc) : 0);
  r.out = slurp(o);
  r.err = slurp(e);
  return r;
}
#endif

struct TempDir {
  fs::path path = make_unique_dir("indexcp-test-nccl-");
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

bool contains(const std::string& s, const std::string& p) { return s.find(p) != std::string::npos; }

#define REQUIRE_SINGLE()                                                                                      \
  do {                                                                                                        \
    REQUIRE_GPU();                                                                                            \
    if (group().env && group().env->world > 1) GTEST_SKIP() << "the W = 1 tests run without the launcher"; \
  } while (0)

}  // namespace

// =================================================================================================
// W = 1: runs on a one-GPU machine

TEST(NcclSingle, IcpDecodeAndDecodeCpOnOneShardEqualReplicated) {
  REQUIRE_SINGLE();
  auto comm = nccl::make_communicator_from_env();
  ASSERT_EQ(comm->world(), 1);
  ASSERT_EQ(comm->rank(), 0);
  StreamGuard st;
  for (int32_t P : {128, 256})
    for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8})
      for (KRounding mode : {KRounding::kE4m3, KRounding::kExact}) {
        const auto s = decode_scene(P, 50u + P);
        const std::string what = std::string(to_string(dt)) + " P" + std::to_string(P) +
                                 (mode == KRounding::kExact ? " exact" : " e4m3");
        const auto c = check_decode(*comm, s, dt, mode, false, true, st);
        EXPECT_TRUE(c.equal) << what << ": " << c.mismatch;
        // each rank publishes rows x H x (K-1) records of 8 bytes and the 64-byte step signature
        EXPECT_EQ(c.sent, static_cast<size_t>(s.rows()) * s.H * (16 - 1) * 8 + kStepSignatureBytes) << what;
        const auto cp = check_decode(*comm, s, dt, mode, true, true, st);
        EXPECT_TRUE(cp.equal) << what << " decode CP: " << cp.mismatch;
      }
  comm->finalize();
}

TEST(NcclSingle, GatherAndLocalScorePrefillOnOneShardEqualReplicated) {
  REQUIRE_SINGLE();
  auto comm = nccl::make_communicator_from_env();
  StreamGuard st;
  for (int32_t P : {128, 256})
    for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8}) {
      const auto s = prefill_scene(P, 81u + P, false);
      const std::string what = std::string(to_string(dt)) + " P" + std::to_string(P);
      for (int64_t units : {int64_t{1}, int64_t{5}, int64_t{0}}) {
        const auto c = check_gather(*comm, s, dt, units, false, st);
        EXPECT_TRUE(c.equal) << what << " budget units " << units << ": " << c.mismatch;
        EXPECT_EQ(c.stats.gathered_bytes, c.stats.pages * P * 128) << what;  // 128 bytes per gathered token
        EXPECT_EQ(c.sent, static_cast<size_t>(c.stats.pages * P * 128)) << what;  // W = 1: all rows are mine
      }
      const auto l = check_gather(*comm, s, dt, 0, true, st);
      EXPECT_TRUE(l.equal) << what << " local_score: " << l.mismatch;
    }
}

TEST(NcclSingle, AllGatherAllToAllAndByteCounts) {
  REQUIRE_SINGLE();
  auto comm = nccl::make_single_rank(0);
  StreamGuard st;
  std::vector<uint8_t> h(1000);
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint8_t>(i * 7 + 3);
  DevArr<uint8_t> a(h), b(h.size());
  comm->all_gather(a.get(), b.get(), h.size(), st);
  comm->synchronize(st);
  EXPECT_EQ(b.host(), h);
  EXPECT_EQ(comm->bytes_sent(), h.size());
  DevArr<uint8_t> c(h.size());
  comm->all_to_all(a.get(), c.get(), h.size(), st);
  comm->synchronize(st);
  EXPECT_EQ(c.host(), h);
  EXPECT_EQ(comm->bytes_sent(), 2 * h.size());
  comm->all_gather(a.get(), b.get(), 0, st);  // nothing to move: no NCCL call
  EXPECT_EQ(comm->bytes_sent(), 2 * h.size());
  comm->finalize();
  comm->finalize();  // idempotent
  try {
    comm->all_gather(a.get(), b.get(), 8, st);
    ADD_FAILURE() << "a collective after finalize() did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kRuntime);
    EXPECT_TRUE(contains(e.what(), "after finalize()")) << e.what();
  }
}

TEST(NcclSingle, IcpDecodeCapturedInCudaGraph) {
  REQUIRE_SINGLE();
  auto comm = nccl::make_single_rank(0);
  StreamGuard st;
  const auto s = decode_scene(128, 77);
  auto repl = device_shard(KvDtype::kNvfp4, s.req, 1, 0, s.keys, s.slots);
  DevDecode d(s.req, s.q, s.H, s.Q);
  SelectionParams sel;
  const size_t n = static_cast<size_t>(s.rows()) * s.H * sel.topk;
  DevArr<int32_t> expect(n), out(n);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cuda::decode_select(repl, 0, d.b, 0, s.H, sel, KRounding::kE4m3, expect.get(), st.cs());
  // warm up outside the capture (NCCL connects lazily)
  cuda::icp_decode(*comm, repl, 0, d.b, sel, KRounding::kE4m3, out.get(), st.cs(), false);
  comm->synchronize(st);
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  cuda::icp_decode(*comm, repl, 0, d.b, sel, KRounding::kE4m3, out.get(), st.cs(), false);
  CUDA_OK(cudaStreamEndCapture(st, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 2; ++rep) {
    CUDA_OK(cudaMemsetAsync(out.get(), 0x7f, n * sizeof(int32_t), st));
    CUDA_OK(cudaGraphLaunch(exec, st));
    comm->synchronize(st);
    EXPECT_EQ(out.host(), expect.host()) << "graph replay " << rep;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST(NcclSingle, InitThatNeverCompletesTimesOutAndAborts) {
  REQUIRE_SINGLE();
  // rank 0 of a group of 2 whose rank 1 never comes: the watchdog must end the init
  nccl::Options o;
  o.rank = 0;
  o.world = 2;
  o.device = 0;
  o.timeout_s = 2.0;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    nccl::NcclCommunicator c(nccl::make_unique_id(), o);
    ADD_FAILURE() << "the init of a group of 2 completed with one rank";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kRuntime);
    EXPECT_TRUE(contains(e.what(), "NCCL rank 0 of 2: ncclCommInitRankConfig")) << e.what();
    EXPECT_TRUE(contains(e.what(), "communicator aborted")) << e.what();
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 30.0) << "the watchdog (2 s) took too long";
}

TEST(NcclSingle, StreamThatNeverCompletesTimesOutAndAborts) {
  REQUIRE_SINGLE();
  // The CUDA context first (its creation is not what is timed), then a communicator whose every
  // wait gives up after 3 s: its init must fit in that, also on a loaded machine (at 1 s it did
  // not, once, with 8 test processes sharing the GPUs under a sanitizer).
  StreamGuard st;
  auto comm = nccl::make_single_rank(0, 3.0);
  // a host function that holds the stream for 8 s stands for a collective waiting on a dead peer
  auto hold = [](void*) { std::this_thread::sleep_for(std::chrono::seconds(8)); };
  CUDA_OK(cudaLaunchHostFunc(st, hold, nullptr));
  const auto t0 = std::chrono::steady_clock::now();
  try {
    comm->synchronize(st);
    ADD_FAILURE() << "synchronize did not time out";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kRuntime);
    EXPECT_TRUE(contains(e.what(), "did not complete within 3 s")) << e.what();
  }
  // The message above proves the timeout fired while the stream was still busy (at 3 s, before
  // the 8 s hold ended). The call itself may return only after the hold: ncclCommAbort waits for
  // work on the device that it cannot cancel (a host function here; a real collective blocked on
  // a dead peer is released by the abort), here after the 8 s hold.
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
  EXPECT_TRUE(comm->aborted());
  DevArr<uint8_t> a(8), b(8);
  EXPECT_THROW(comm->all_gather(a.get(), b.get(), 8, st), Error);
  comm->finalize();  // nothing to do after an abort; the destructor must not hang either
}

TEST(NcclSingle, AbortFromAnotherThreadAndArgumentErrors) {
  REQUIRE_SINGLE();
  auto comm = nccl::make_single_rank(0);
  std::thread t([&] { comm->abort(); });
  t.join();
  EXPECT_TRUE(comm->aborted());
  StreamGuard st;
  DevArr<uint8_t> a(8), b(8);
  try {
    comm->all_to_all(a.get(), b.get(), 8, st);
    ADD_FAILURE() << "a collective on an aborted communicator did not throw";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "aborted communicator")) << e.what();
  }
  comm->abort();  // idempotent
  nccl::Options o;
  o.world = 0;
  EXPECT_THROW(nccl::NcclCommunicator(nccl::UniqueId{}, o), Error);
  o.world = 1;
  o.device = visible_gpus();
  try {
    nccl::NcclCommunicator c(nccl::UniqueId{}, o);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_TRUE(contains(e.what(), "device = " + std::to_string(o.device))) << e.what();
  }
  o.device = 0;
  o.timeout_s = 0;
  EXPECT_THROW(nccl::NcclCommunicator(nccl::UniqueId{}, o), Error);
  EXPECT_FALSE(nccl::version().empty());
}

// =================================================================================================
// `indexcp launch --tp 2` on this binary: needs 2 GPUs

TEST(NcclLaunch, Tp2IcpAndGatherAcrossProcessesEqualReplicated) {
  REQUIRE_SINGLE();
#ifndef INDEXCP_CLI_PATH
  GTEST_SKIP() << "built without the indexcp command";
#else
  const int n = visible_gpus();
  if (n < 2) GTEST_SKIP() << "needs 2 GPUs for two processes; " << n << " visible";
  TempDir d;
  const fs::path rep = d.path / "report.json";
  const auto r = run_launch("--tp 2 --timeout 120 --report '" + rep.string() + "' -- '" + self_path() +
                                "' --gtest_filter='NcclMulti.*'",
                            d.path);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  const auto j = json::parse(slurp(rep));
  ASSERT_EQ(j["ranks"].size(), 2u) << j.dump(2);
  for (int rank = 0; rank < 2; ++rank) {
    const auto& rr = j["ranks"][rank];
    ASSERT_TRUE(rr.is_object()) << "rank " << rank << " wrote no report: " << r.err;
    EXPECT_EQ(rr["rank"], rank);
    EXPECT_EQ(rr["tests_failed"], 0) << r.out;
    EXPECT_GT(rr["tests_run"].get<int>(), 0);
    // every NcclMulti test ran as a rank of the group: none skipped, all passed
    EXPECT_EQ(rr["tests_skipped"], 0) << r.out;
    EXPECT_EQ(rr["tests_passed"], rr["tests_run"]) << r.out;
    EXPECT_TRUE(rr["communicator_error"].is_null()) << rr.dump();
    EXPECT_TRUE(rr["finalize_error"].is_null()) << rr.dump();
  }
  // every rank sent the same decode payload
  EXPECT_EQ(j["ranks"][0]["decode_bytes_sent"], j["ranks"][1]["decode_bytes_sent"]);
#endif
}

// One GPU is enough: the W = 1 path through the launcher's environment (INDEXCP_WORLD = 1).
TEST(NcclLaunch, Tp1RunsTheSingleRankPathUnderTheLauncher) {
  REQUIRE_SINGLE();
#ifndef INDEXCP_CLI_PATH
  GTEST_SKIP() << "built without the indexcp command";
#else
  TempDir d;
  const fs::path rep = d.path / "report.json";
  const auto r = run_launch("--tp 1 --timeout 60 --report '" + rep.string() + "' -- '" + self_path() +
                                "' --gtest_filter='NcclSingle.IcpDecode*:NcclSingle.AllGather*'",
                            d.path);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "[rank 0] [  PASSED  ] 3 tests.")) << r.out;
  const auto j = json::parse(slurp(rep));
  ASSERT_TRUE(j["ranks"][0].is_object()) << j.dump(2);
  EXPECT_EQ(j["ranks"][0]["world"], 1);
  EXPECT_EQ(j["ranks"][0]["tests_failed"], 0);
  EXPECT_EQ(j["launcher"]["ok"], true);
#endif
}

void kill_test(const std::string& mode) {
#ifndef INDEXCP_CLI_PATH
  GTEST_SKIP() << "built without the indexcp command";
#else
  const int n = visible_gpus();
  if (n < 2) GTEST_SKIP() << "needs 2 GPUs for two processes; " << n << " visible";
  TempDir d;
  const auto r = run_launch("--tp 2 --timeout 5 --time-limit 120 -- '" + self_path() + "' --kill-test=" + mode, d.path);
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  // rank 0 failed on its own (rank 1 exited 0): the watchdog, not the launcher, ended it
  EXPECT_TRUE(contains(r.err, "[rank 1] test_nccl: rank 1 exits before the collective")) << r.err;
  EXPECT_TRUE(contains(r.err, "[rank 0] test_nccl: error: NCCL rank 0 of 2")) << r.err;
  EXPECT_TRUE(contains(r.err, "communicator aborted")) << r.err;
  EXPECT_TRUE(contains(r.err, "indexcp: error: launch: rank 0 of 2 exited with status 1")) << r.err;
  EXPECT_LT(r.seconds, 60.0) << "5 s timeout, plus start-up";
#endif
}

TEST(NcclLaunch, RankDyingAfterWarmUpMakesTheOtherExitWithinTheTimeout) {
  REQUIRE_SINGLE();
  kill_test("warm");
}

TEST(NcclLaunch, RankDyingBeforeTheFirstCollectiveMakesTheOtherExitWithinTheTimeout) {
  REQUIRE_SINGLE();
  kill_test("cold");
}

// =================================================================================================
// Ranks of `indexcp launch --tp W -- test_nccl --gtest_filter=NcclMulti.*` (W >= 2)

TEST(NcclMulti, IcpDecodeEqualsReplicatedAndPayloadSizes) {
  REQUIRE_GROUP();
  auto& comm = *group().comm;
  const int32_t W = comm.world();
  StreamGuard st;
  json sent = json::object();
  for (int32_t P : {128, 256})
    for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8})
      for (KRounding mode : {KRounding::kE4m3, KRounding::kExact}) {
        if (P / W < 16) continue;  // not a valid shard
        const auto s = decode_scene(P, 50u + P);
        const std::string what = std::string(to_string(dt)) + " P" + std::to_string(P) +
                                 (mode == KRounding::kExact ? " exact" : " e4m3");
        const auto c = check_decode(comm, s, dt, mode, false, true, st);
        const uint64_t received = sum_over_ranks(comm, c.sent, st);  // what each rank's all-gather delivers
        EXPECT_TRUE(c.equal) << what << ": " << c.mismatch;
        const size_t per_rank = static_cast<size_t>(s.rows()) * s.H * (16 - 1) * 8;  // rows x H x (K-1) x 8
        EXPECT_EQ(c.sent, per_rank) << what;
        EXPECT_EQ(received, static_cast<uint64_t>(W) * per_rank) << what;
        sent[what] = c.sent;
        if (P == 256 && W == 2) {  // the general scorer on whole stock shard pages: same bits
          const auto g = check_decode(comm, s, dt, mode, false, false, st);
          EXPECT_TRUE(g.equal) << what << " (general scorer): " << g.mismatch;
        }
      }
  group().report["decode_bytes_sent"] = sent;
}

TEST(NcclMulti, DecodeCpEqualsReplicated) {
  REQUIRE_GROUP();
  auto& comm = *group().comm;
  StreamGuard st;
  for (int32_t P : {128, 256})
    for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8}) {
      const auto s = decode_scene(P, 60u + P);
      const auto c = check_decode(comm, s, dt, KRounding::kE4m3, true, true, st);
      EXPECT_TRUE(c.equal) << to_string(dt) << " P" << P << ": " << c.mismatch;
      EXPECT_EQ(c.sent, static_cast<size_t>(s.rows()) * s.H * 15 * 8 + kStepSignatureBytes);
    }
}

TEST(NcclMulti, GatherPrefillEqualsReplicatedAndMoves128BytesPerToken) {
  REQUIRE_GROUP();
  auto& comm = *group().comm;
  const int32_t W = comm.world();
  StreamGuard st;
  json rec = json::array();
  for (int32_t P : {128, 256})
    for (KvDtype dt : {KvDtype::kNvfp4, KvDtype::kFp8}) {
      if (P / W < 16) continue;
      const auto s = prefill_scene(P, 81u + P, false);
      for (int64_t units : {int64_t{1}, int64_t{5}, int64_t{0}}) {
        const std::string what = std::string(to_string(dt)) + " P" + std::to_string(P) + " budget units " +
                                 std::to_string(units);
        const auto c = check_gather(comm, s, dt, units, false, st);
        const uint64_t received = sum_over_ranks(comm, c.sent, st);
        EXPECT_TRUE(c.equal) << what << ": " << c.mismatch;
        // each rank sends its P/W rows of every gathered page; every rank receives the whole
        // pages: 128 bytes per gathered token
        EXPECT_EQ(c.sent, static_cast<size_t>(c.stats.pages * (P / W) * 128)) << what;
        EXPECT_EQ(received, static_cast<uint64_t>(c.stats.pages * P * 128)) << what;
        EXPECT_EQ(c.stats.gathered_bytes, c.stats.pages * P * 128) << what;
        rec.push_back({{"case", what}, {"pages", c.stats.pages}, {"chunks", c.stats.chunks}, {"sent", c.sent},
                       {"received", received}});
      }
      const auto l = check_gather(comm, s, dt, 0, true, st);
      EXPECT_TRUE(l.equal) << to_string(dt) << " P" << P << " local_score: " << l.mismatch;
    }
  group().report["gather"] = rec;
}

TEST(NcclMulti, AllToAllDeliversEveryBlock) {
  REQUIRE_GROUP();
  auto& comm = *group().comm;
  const int W = comm.world(), me = comm.rank();
  StreamGuard st;
  const size_t bytes = 4096 + 3;
  std::vector<uint8_t> h(bytes * W);
  for (int p = 0; p < W; ++p)
    for (size_t i = 0; i < bytes; ++i) h[p * bytes + i] = static_cast<uint8_t>(me * 16 + p + i * 3);
  DevArr<uint8_t> a(h), b(h.size());
  const size_t before = comm.bytes_sent();
  comm.all_to_all(a.get(), b.get(), bytes, st);
  comm.synchronize(st);
  EXPECT_EQ(comm.bytes_sent() - before, bytes * W);
  const auto got = b.host();
  for (int p = 0; p < W; ++p)
    for (size_t i = 0; i < bytes; ++i)
      ASSERT_EQ(got[p * bytes + i], static_cast<uint8_t>(p * 16 + me + i * 3)) << "block from rank " << p << " byte " << i;
}

// Last: a graph capture with a multi-process communicator (NCCL's own graph support).
TEST(NcclMulti, IcpDecodeCapturedInCudaGraph) {
  REQUIRE_GROUP();
  auto& comm = *group().comm;
  const int32_t W = comm.world(), rank = comm.rank();
  StreamGuard st;
  const auto s = decode_scene(128, 91);
  auto repl = device_shard(KvDtype::kNvfp4, s.req, 1, 0, s.keys, s.slots);
  auto shard = device_shard(KvDtype::kNvfp4, s.req, W, rank, s.keys, s.slots);
  DevDecode d(s.req, s.q, s.H, s.Q);
  SelectionParams sel;
  int32_t h0, nh;
  owned_heads(s.H, W, rank, &h0, &nh);
  DevArr<int32_t> expect(static_cast<size_t>(s.rows()) * s.H * sel.topk);
  DevArr<int32_t> out(static_cast<size_t>(s.rows()) * nh * sel.topk);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cuda::decode_select(repl, 0, d.b, 0, s.H, sel, KRounding::kE4m3, expect.get(), st.cs());
  cuda::icp_decode(comm, shard, 0, d.b, sel, KRounding::kE4m3, out.get(), st.cs(), false);  // warm-up
  comm.synchronize(st);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  cuda::icp_decode(comm, shard, 0, d.b, sel, KRounding::kE4m3, out.get(), st.cs(), false);
  ASSERT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  const auto e = expect.host();
  for (int rep = 0; rep < 2; ++rep) {
    cudaMemsetAsync(out.get(), 0x7f, out.size() * sizeof(int32_t), st);
    cudaGraphLaunch(exec, st);
    comm.synchronize(st);
    EXPECT_TRUE(owned_heads_equal(out.host(), e, s.rows(), s.H, h0, nh, sel.topk)) << "replay " << rep;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// =================================================================================================

namespace {

// A rank of the kill tests: both ranks join; "warm" runs one collective first (connections up);
// then rank 1 exits abruptly with status 0 and rank 0 runs a collective that can never complete.
int kill_test_rank(const std::string& mode) {
  try {
    const auto env = rank_env_from_env();
    if (!env || env->world != 2) {
      std::fprintf(stderr, "test_nccl: --kill-test runs under `indexcp launch --tp 2`\n");
      return 2;
    }
    if (visible_gpus() < 2) {
      std::fprintf(stderr, "test_nccl: --kill-test needs 2 GPUs; skipped\n");
      return kSkipStatus;
    }
    auto comm = nccl::make_communicator(*env);
    cudaStream_t st = nullptr;
    cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    const size_t bytes = size_t{1} << 20;
    DevArr<uint8_t> send(bytes), recv(bytes * 2);
    if (mode == "warm") {
      comm->all_gather(send.get(), recv.get(), bytes, st);
      comm->synchronize(st);
    }
    if (env->rank == 1) {
      std::fprintf(stderr, "test_nccl: rank 1 exits before the collective\n");
      std::fflush(stderr);
      ::_exit(0);  // abrupt: no finalize, no abort
    }
    const auto t0 = std::chrono::steady_clock::now();
    comm->all_gather(send.get(), recv.get(), bytes, st);
    comm->synchronize(st);
    std::fprintf(stderr, "test_nccl: rank 0's collective completed without rank 1 (after %.1f s)\n",
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    std::fflush(stderr);
    ::_exit(3);
  } catch (const std::exception& e) {
    // what a real rank does: report and leave at once (no teardown that could wait on the GPU)
    std::fprintf(stderr, "test_nccl: error: %s\n", e.what());
    std::fflush(stderr);
    ::_exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--kill-test=", 0) == 0) return kill_test_rank(a.substr(12));
  }
  ::testing::InitGoogleTest(&argc, argv);
  try {
    if (auto env = rank_env_from_env(); env && env->world > 1) {
      const int n = visible_gpus();
      if (n < env->world) {
        std::fprintf(stderr,
                     "test_nccl: INDEXCP_WORLD = %d but %d GPU(s) visible: the multi-process NCCL tests are skipped\n",
                     env->world, n);
        return kSkipStatus;
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "test_nccl: error: %s\n", e.what());
    return 2;
  }
  ::testing::AddGlobalTestEnvironment(new GroupEnvironment);
  return RUN_ALL_TESTS();
}
