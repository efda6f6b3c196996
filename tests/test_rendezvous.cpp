// The rendezvous directory (include/indexcp/rendezvous.hpp) on the CPU: blobs exchanged between
// threads and between processes, the timeout when a rank never comes, stale files of another run,
// the group environment variables; and the NCCL entry points of a build without NCCL.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "indexcp/error.hpp"
#include "indexcp/nccl.hpp"
#include "indexcp/rendezvous.hpp"

using namespace indexcp;
namespace fs = std::filesystem;

namespace {

// A fresh directory removed at the end of the test.
struct TempDir {
  std::string path = make_unique_dir("indexcp-test-rdv-");
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// Sets (or unsets, with nullopt) environment variables for the life of the object.
class ScopedEnv {
 public:
  ScopedEnv(std::initializer_list<std::pair<const char*, std::optional<std::string>>> vars) {
    for (const auto& [k, v] : vars) {
      const char* old = std::getenv(k);
      saved_[k] = old ? std::optional<std::string>(old) : std::nullopt;
      if (v) ::setenv(k, v->c_str(), 1);
      else ::unsetenv(k);
    }
  }
  ~ScopedEnv() {
    for (const auto& [k, v] : saved_) {
      if (v) ::setenv(k.c_str(), v->c_str(), 1);
      else ::unsetenv(k.c_str());
    }
  }

 private:
  std::map<std::string, std::optional<std::string>> saved_;
};

// Every group variable unset, then `vars`.
ScopedEnv clean_env() {
  return ScopedEnv{{"INDEXCP_WORLD", std::nullopt},    {"INDEXCP_RANK", std::nullopt},
                   {"INDEXCP_RENDEZVOUS", std::nullopt}, {"INDEXCP_RUN_ID", std::nullopt},
                   {"INDEXCP_DEVICE", std::nullopt},   {"LOCAL_RANK", std::nullopt},
                   {"INDEXCP_NCCL_TIMEOUT_S", std::nullopt}};
}

std::string random_blob(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng() & 0xff);  // zeros and newlines included
  return s;
}

template <class Fn>
void expect_error(Fn&& fn, ErrorCode code, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "no Error thrown";
  } catch (const Error& e) {
    EXPECT_EQ(static_cast<int>(e.code()), static_cast<int>(code)) << e.what();
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what() << " lacks " << p;
  }
}

}  // namespace

TEST(Rendezvous, BroadcastAndAllGatherBetweenThreads) {
  TempDir d;
  const int W = 4;
  const std::string id = random_blob(128, 7);
  std::vector<std::string> got(W);
  std::vector<std::vector<std::string>> all(W);
  std::vector<std::thread> ts;
  for (int r = 0; r < W; ++r)
    ts.emplace_back([&, r] {
      FileRendezvous rdv(d.path, r, W, "run-1", 10.0);
      if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the others wait for rank 0
      got[r] = rdv.broadcast("nccl-unique-id-0", r == 0 ? id : std::string());
      all[r] = rdv.all_gather("hello", "payload of rank " + std::to_string(r) + std::string(1, '\0') + "\n");
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < W; ++r) {
    EXPECT_EQ(got[r], id) << "rank " << r;
    ASSERT_EQ(all[r].size(), static_cast<size_t>(W));
    for (int p = 0; p < W; ++p)
      EXPECT_EQ(all[r][p], "payload of rank " + std::to_string(p) + std::string(1, '\0') + "\n");
  }
  // nothing but the published files is left (the temporary files were renamed)
  for (const auto& e : fs::directory_iterator(d.path)) EXPECT_NE(e.path().filename().string()[0], '.') << e.path();
}

TEST(Rendezvous, BlobsBetweenProcesses) {
  TempDir d;
  const int W = 3;
  const std::string id = random_blob(128, 11);
  std::vector<pid_t> kids;
  for (int r = 0; r < W; ++r) {
    const pid_t p = ::fork();
    ASSERT_GE(p, 0);
    if (p == 0) {
      int rc = 0;
      try {
        FileRendezvous rdv(d.path, r, W, "proc-run", 20.0);
        if (rdv.broadcast("id", r == 0 ? id : "") != id) rc = 1;
        const auto all = rdv.all_gather("ready", std::to_string(r * 100));
        for (int q = 0; q < W; ++q)
          if (all[q] != std::to_string(q * 100)) rc = 2;
      } catch (...) {
        rc = 3;
      }
      ::_exit(rc);
    }
    kids.push_back(p);
  }
  for (int r = 0; r < W; ++r) {
    int st = 0;
    ASSERT_EQ(::waitpid(kids[r], &st, 0), kids[r]);
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "rank " << r << " wait status " << st;
  }
}

TEST(Rendezvous, TimeoutWhenARankNeverComes) {
  TempDir d;
  FileRendezvous rdv(d.path, 1, 2, "run-x", 0.3);
  const auto t0 = std::chrono::steady_clock::now();
  expect_error([&] { rdv.wait_for("nccl-unique-id-0", 0); }, ErrorCode::kRuntime,
               {"rank 1 of 2 waited 0.3 s for rank 0's \"nccl-unique-id-0\"", d.path, "INDEXCP_NCCL_TIMEOUT_S"});
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(s, 0.3);
  EXPECT_LT(s, 5.0);
  // the same through broadcast, and all_gather waits for the missing rank too
  expect_error([&] { rdv.broadcast("k", ""); }, ErrorCode::kRuntime, {"rank 0's \"k\""});
  FileRendezvous r0(d.path, 0, 2, "run-x", 0.2);
  expect_error([&] { r0.all_gather("barrier", "x"); }, ErrorCode::kRuntime, {"rank 0 of 2", "rank 1's \"barrier\""});
}

TEST(Rendezvous, StaleFilesOfAnotherRunAreIgnored) {
  TempDir d;
  FileRendezvous old_root(d.path, 0, 2, "old-run", 5.0);
  old_root.publish("nccl-unique-id-0", "OLD");
  FileRendezvous other_world(d.path, 0, 3, "new-run", 5.0);
  other_world.publish("k2", "W3");
  FileRendezvous reader(d.path, 1, 2, "new-run", 0.3);
  expect_error([&] { reader.wait_for("nccl-unique-id-0", 0); }, ErrorCode::kRuntime,
               {"stale", "run \"old-run\"", "this run is \"new-run\""});
  expect_error([&] { reader.wait_for("k2", 0); }, ErrorCode::kRuntime, {"stale", "world 3"});
  // a file that is not ours at all
  { std::ofstream(reader.path_of("junk", 0)) << "hello"; }
  expect_error([&] { reader.wait_for("junk", 0); }, ErrorCode::kRuntime, {"stale"});
  // the current run's rank 0 replaces the stale file: the reader gets the new blob
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    FileRendezvous(d.path, 0, 2, "new-run", 5.0).publish("nccl-unique-id-0", "NEW");
  });
  FileRendezvous patient(d.path, 1, 2, "new-run", 5.0);
  EXPECT_EQ(patient.wait_for("nccl-unique-id-0", 0), "NEW");
  t.join();
}

TEST(Rendezvous, ArgumentsAreChecked) {
  TempDir d;
  expect_error([&] { FileRendezvous(d.path, 0, 0); }, ErrorCode::kInvalidArgument, {"world = 0"});
  expect_error([&] { FileRendezvous(d.path, 0, 65); }, ErrorCode::kInvalidArgument, {"world = 65"});
  expect_error([&] { FileRendezvous(d.path, 2, 2); }, ErrorCode::kInvalidArgument, {"rank = 2"});
  expect_error([&] { FileRendezvous("", 0, 2); }, ErrorCode::kInvalidArgument, {"rendezvous directory"});
  expect_error([&] { FileRendezvous(d.path, 0, 2, "bad id/"); }, ErrorCode::kInvalidArgument, {"run_id"});
  expect_error([&] { FileRendezvous(d.path, 0, 2, "", 0.0); }, ErrorCode::kInvalidArgument, {"timeout_s = 0"});
  expect_error([&] { FileRendezvous(d.path + "/no/such/parent", 0, 2); }, ErrorCode::kIo, {"no/such/parent"});
  FileRendezvous rdv(d.path, 0, 2);
  expect_error([&] { rdv.publish("a/b", "x"); }, ErrorCode::kInvalidArgument, {"key = \"a/b\""});
  expect_error([&] { rdv.wait_for("k", 5); }, ErrorCode::kInvalidArgument, {"from = 5"});
  // a missing directory is created
  FileRendezvous created(d.path + "/sub", 0, 1);
  EXPECT_TRUE(fs::is_directory(d.path + "/sub"));
  EXPECT_EQ(created.broadcast("k", "v"), "v");
}

TEST(Rendezvous, UniqueDirectoriesAndRunIds) {
  std::set<std::string> dirs, ids;
  for (int i = 0; i < 5; ++i) {
    const std::string p = make_unique_dir("indexcp-test-uniq-");
    EXPECT_TRUE(fs::is_directory(p));
    EXPECT_EQ(fs::status(p).permissions() & fs::perms::all, fs::perms::owner_all) << p;
    dirs.insert(p);
    fs::remove(p);
    ids.insert(make_run_id());
  }
  EXPECT_EQ(dirs.size(), 5u);
  EXPECT_EQ(ids.size(), 5u);
  for (const auto& id : ids) {
    EXPECT_LE(id.size(), 64u);
    EXPECT_EQ(id.find_first_not_of("0123456789abcdefABCDEF-"), std::string::npos) << id;
  }
  expect_error([] { make_unique_dir("x-", "/no/such/dir"); }, ErrorCode::kIo, {"/no/such/dir"});
}

TEST(RankEnv, NotLaunchedWithoutWorld) {
  auto clean = clean_env();
  EXPECT_FALSE(rank_env_from_env().has_value());
  EXPECT_EQ(group_timeout_from_env(), kDefaultGroupTimeoutS);
  EXPECT_EQ(device_from_env(3), 3);
  ScopedEnv e{{"LOCAL_RANK", "2"}};
  EXPECT_EQ(device_from_env(0), 2);
}

TEST(RankEnv, FromTheLauncherVariables) {
  auto clean = clean_env();
  ScopedEnv e{{"INDEXCP_WORLD", "4"}, {"INDEXCP_RANK", "3"}, {"INDEXCP_RENDEZVOUS", "/tmp/x"},
              {"INDEXCP_RUN_ID", "abc-1"}, {"INDEXCP_NCCL_TIMEOUT_S", "2.5"}};
  auto env = rank_env_from_env();
  ASSERT_TRUE(env.has_value());
  EXPECT_EQ(env->world, 4);
  EXPECT_EQ(env->rank, 3);
  EXPECT_EQ(env->device, 3);  // no INDEXCP_DEVICE / LOCAL_RANK: the rank
  EXPECT_EQ(env->rendezvous_dir, "/tmp/x");
  EXPECT_EQ(env->run_id, "abc-1");
  EXPECT_EQ(env->timeout_s, 2.5);
  {
    ScopedEnv l{{"LOCAL_RANK", "1"}};
    EXPECT_EQ(rank_env_from_env()->device, 1);
    ScopedEnv dv{{"INDEXCP_DEVICE", "0"}};  // INDEXCP_DEVICE wins over LOCAL_RANK
    EXPECT_EQ(rank_env_from_env()->device, 0);
  }
  ScopedEnv one{{"INDEXCP_WORLD", "1"}, {"INDEXCP_RANK", "0"}, {"INDEXCP_RENDEZVOUS", std::nullopt}};
  EXPECT_EQ(rank_env_from_env()->world, 1);  // a group of one needs no directory
}

TEST(RankEnv, MalformedVariablesAreNamed) {
  auto clean = clean_env();
  {
    ScopedEnv e{{"INDEXCP_WORLD", "two"}};
    expect_error([] { rank_env_from_env(); }, ErrorCode::kInvalidArgument, {"INDEXCP_WORLD = \"two\""});
  }
  for (const char* w : {" 2", "+2", "2 ", "0x2", "2.0"}) {  // decimal digits only
    ScopedEnv e{{"INDEXCP_WORLD", w}, {"INDEXCP_RANK", "0"}, {"INDEXCP_RENDEZVOUS", "/tmp/x"}};
    expect_error([] { rank_env_from_env(); }, ErrorCode::kInvalidArgument, {"INDEXCP_WORLD = \"", "must be an integer"});
  }
  {
    ScopedEnv e{{"INDEXCP_WORLD", "2"}};
    expect_error([] { rank_env_from_env(); }, ErrorCode::kInvalidArgument, {"INDEXCP_RANK is not set"});
  }
  {
    ScopedEnv e{{"INDEXCP_WORLD", "2"}, {"INDEXCP_RANK", "2"}, {"INDEXCP_RENDEZVOUS", "/tmp/x"}};
    expect_error([] { rank_env_from_env(); }, ErrorCode::kInvalidArgument, {"INDEXCP_RANK = \"2\"", "0..1"});
  }
  {
    ScopedEnv e{{"INDEXCP_WORLD", "2"}, {"INDEXCP_RANK", "1"}};
    expect_error([] { rank_env_from_env(); }, ErrorCode::kInvalidArgument, {"INDEXCP_RENDEZVOUS is not set"});
  }
  {
    ScopedEnv e{{"INDEXCP_WORLD", "2"}, {"INDEXCP_RANK", "1"}, {"INDEXCP_RENDEZVOUS", "/tmp/x"}, {"INDEXCP_DEVICE", "-1"}};
    expect_error([] { rank_env_from_env(); }, ErrorCode::kInvalidArgument, {"INDEXCP_DEVICE = \"-1\""});
  }
  {
    ScopedEnv e{{"INDEXCP_WORLD", "2"}, {"INDEXCP_RANK", "1"}, {"INDEXCP_RENDEZVOUS", "/tmp/x"}, {"INDEXCP_RUN_ID", "a b"}};
    expect_error([] { rank_env_from_env(); }, ErrorCode::kInvalidArgument, {"INDEXCP_RUN_ID"});
  }
  for (const char* bad : {"0", "-3", "abc", "1e9", "nan", "5s"}) {
    ScopedEnv e{{"INDEXCP_NCCL_TIMEOUT_S", bad}};
    expect_error([] { group_timeout_from_env(); }, ErrorCode::kInvalidArgument,
                 {std::string("INDEXCP_NCCL_TIMEOUT_S = \"") + bad + "\""});
  }
}

TEST(Nccl, WithoutNcclEveryEntryPointIsUnsupported) {
  if (nccl::built_with_nccl()) GTEST_SKIP() << "this build has NCCL (tests/gpu/test_nccl.cpp covers it)";
  expect_error([] { nccl::make_single_rank(); }, ErrorCode::kUnsupported, {"built without NCCL"});
  expect_error([] { nccl::make_unique_id(); }, ErrorCode::kUnsupported, {"built without NCCL"});
  expect_error([] { nccl::NcclCommunicator(nccl::UniqueId{}, nccl::Options{}); }, ErrorCode::kUnsupported,
               {"built without NCCL"});
  RankEnv env;
  expect_error([&] { nccl::make_communicator(env); }, ErrorCode::kUnsupported, {"built without NCCL"});
}
