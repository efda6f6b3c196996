// `indexcp launch` on the CPU with ordinary child commands: the environment of each rank, output
// prefixes, a failing rank stopping the others quickly (SIGTERM, then SIGKILL after --grace), a
// rank killed by a signal, the time limit, an interrupted launcher, merged reports, usage errors.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_util.hpp"

namespace fs = std::filesystem;
using cliutil::Result;
using cliutil::run_cli;
using cliutil::slurp;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    std::string t = (fs::temp_directory_path() / "indexcp-test-launch-XXXXXX").string();
    path = ::mkdtemp(t.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

struct Timed {
  Result r;
  double seconds = 0;
};

Timed launch(const std::string& args, const fs::path& dir) {
  const auto t0 = std::chrono::steady_clock::now();
  Timed t;
  t.r = run_cli("launch " + args, dir);
  t.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return t;
}

// The last non-empty line of a text.
std::string last_line(const std::string& s) {
  std::istringstream in(s);
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  return last;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Whether process p still runs (a zombie does not: a container's init may never reap orphans).
bool running(pid_t p) {
  std::ifstream in("/proc/" + std::to_string(p) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return ::kill(p, 0) == 0;  // no /proc: best effort
  const size_t close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] != 'Z';
}

// The pids the ranks wrote to DIR/<rank> (ranks that never wrote one are absent).
std::vector<pid_t> rank_pids(const fs::path& dir, int world) {
  std::vector<pid_t> out;
  for (int r = 0; r < world; ++r) {
    const std::string s = slurp(dir / std::to_string(r));
    if (!s.empty() && s.back() == '\n') out.push_back(static_cast<pid_t>(std::stol(s)));
  }
  return out;
}

}  // namespace

TEST(Launch, EveryRankSeesItsEnvironment) {
  TempDir d;
  ::setenv("CUDA_VISIBLE_DEVICES", "7,5", 1);  // left alone by the launcher
  const auto t = launch(
      "--tp 3 -- sh -c 'echo \"rank=$INDEXCP_RANK world=$INDEXCP_WORLD device=$INDEXCP_DEVICE "
      "cvd=$CUDA_VISIBLE_DEVICES\"; echo \"rdv=$INDEXCP_RENDEZVOUS run=$INDEXCP_RUN_ID\"; "
      "test -d \"$INDEXCP_RENDEZVOUS\" && test -d \"$INDEXCP_REPORT_DIR\" && echo on-stderr >&2'",
      d.path);
  ::unsetenv("CUDA_VISIBLE_DEVICES");
  ASSERT_EQ(t.r.status, 0) << t.r.err;
  std::string rdv_line;
  for (int r = 0; r < 3; ++r) {
    const std::string p = "[rank " + std::to_string(r) + "] ";
    EXPECT_TRUE(contains(t.r.out, p + "rank=" + std::to_string(r) + " world=3 device=" + std::to_string(r) +
                                      " cvd=7,5\n"))
        << t.r.out;
    EXPECT_TRUE(contains(t.r.err, p + "on-stderr\n")) << t.r.err;
    // every rank has the same rendezvous directory and run id
    const size_t at = t.r.out.find(p + "rdv=");
    ASSERT_NE(at, std::string::npos) << t.r.out;
    const std::string line = t.r.out.substr(at + p.size(), t.r.out.find('\n', at) - at - p.size());
    if (r == 0) rdv_line = line;
    EXPECT_EQ(line, rdv_line);
  }
  // "rdv=DIR run=ID": a fresh directory with a run id, removed after the launch
  const std::string dir = rdv_line.substr(4, rdv_line.find(' ') - 4);
  EXPECT_TRUE(contains(rdv_line, " run=") && rdv_line.size() > rdv_line.find(" run=") + 5) << rdv_line;
  EXPECT_FALSE(dir.empty());
  EXPECT_FALSE(fs::exists(dir)) << dir << " was not removed";
}

TEST(Launch, FailingRankGivesItsStatusAndOneLine) {
  TempDir d;
  const auto t = launch("--tp 2 -- sh -c 'exit 3'", d.path);
  EXPECT_EQ(t.r.status, 3);
  const std::string l = last_line(t.r.err);
  EXPECT_EQ(l.rfind("indexcp: error: launch: rank ", 0), 0u) << t.r.err;
  EXPECT_TRUE(contains(l, "of 2 exited with status 3")) << l;
}

TEST(Launch, AFailureStopsTheOtherRanksQuickly) {
  TempDir d;
  // rank 1 fails after a moment; rank 0 would sleep for 1000 s
  const auto t = launch(
      "--tp 2 --grace 5 -- sh -c 'if [ \"$INDEXCP_RANK\" = 1 ]; then sleep 0.2; echo \"going down\" >&2; exit 4; "
      "fi; echo waiting; sleep 1000'",
      d.path);
  EXPECT_EQ(t.r.status, 4) << t.r.err;
  EXPECT_LT(t.seconds, 10.0);
  EXPECT_TRUE(contains(t.r.out, "[rank 0] waiting\n")) << t.r.out;
  EXPECT_EQ(last_line(t.r.err),
            "indexcp: error: launch: rank 1 of 2 exited with status 4; its last line on stderr: going down "
            "(the other ranks were stopped)");
}

// The summary counts only the ranks the launcher stopped: rank 1 finished on its own before rank 0
// failed, rank 2 was still running.
TEST(Launch, OnlyTheRanksStillRunningAreReportedStopped) {
  TempDir d;
  const auto t = launch(
      "--tp 3 --grace 5 -- sh -c 'case $INDEXCP_RANK in 0) sleep 0.5; exit 6;; 1) exit 0;; *) sleep 1000;; esac'",
      d.path);
  EXPECT_EQ(t.r.status, 6) << t.r.err;
  EXPECT_EQ(last_line(t.r.err), "indexcp: error: launch: rank 0 of 3 exited with status 6 (1 other rank was stopped)");
}

TEST(Launch, RankIgnoringSigtermIsKilledAfterTheGrace) {
  TempDir d;
  const auto t = launch(
      "--tp 2 --grace 1 -- sh -c 'if [ \"$INDEXCP_RANK\" = 1 ]; then sleep 0.3; exit 5; fi; "
      "trap \"\" TERM; sleep 1000'",
      d.path);
  EXPECT_EQ(t.r.status, 5) << t.r.err;
  EXPECT_GE(t.seconds, 1.0);
  EXPECT_LT(t.seconds, 10.0);
  EXPECT_TRUE(contains(last_line(t.r.err), "rank 1 of 2 exited with status 5")) << t.r.err;
}

TEST(Launch, RankKilledBySignal) {
  TempDir d;
  const auto t = launch("--tp 2 -- sh -c 'if [ \"$INDEXCP_RANK\" = 1 ]; then kill -KILL $$; fi; sleep 1000'", d.path);
  EXPECT_EQ(t.r.status, 1);
  EXPECT_LT(t.seconds, 10.0);
  EXPECT_TRUE(contains(last_line(t.r.err), "rank 1 of 2 was killed by signal 9")) << t.r.err;
}

TEST(Launch, TimeLimitStopsEveryRank) {
  TempDir d;
  const auto t = launch("--tp 2 --time-limit 0.5 --grace 1 -- sleep 1000", d.path);
  EXPECT_EQ(t.r.status, 1);
  EXPECT_LT(t.seconds, 10.0);
  EXPECT_TRUE(contains(last_line(t.r.err), "the time limit of 0.5 s passed")) << t.r.err;
}

TEST(Launch, TimeoutIsExportedToTheRanks) {
  TempDir d;
  auto t = launch("--tp 1 --timeout 7.5 -- sh -c 'echo \"t=$INDEXCP_NCCL_TIMEOUT_S\"'", d.path);
  EXPECT_EQ(t.r.status, 0) << t.r.err;
  EXPECT_EQ(t.r.out, "[rank 0] t=7.5\n");
  ::setenv("INDEXCP_NCCL_TIMEOUT_S", "9", 1);  // without --timeout the ranks inherit it
  t = launch("--tp 1 -- sh -c 'echo \"t=$INDEXCP_NCCL_TIMEOUT_S\"'", d.path);
  ::unsetenv("INDEXCP_NCCL_TIMEOUT_S");
  EXPECT_EQ(t.r.out, "[rank 0] t=9\n");
}

TEST(Launch, PartialLastLineIsPrefixed) {
  TempDir d;
  const auto t = launch("--tp 2 -- sh -c 'printf \"no newline\"; printf \"a\\nb\" >&2'", d.path);
  EXPECT_EQ(t.r.status, 0) << t.r.err;
  EXPECT_TRUE(contains(t.r.out, "[rank 0] no newline\n") && contains(t.r.out, "[rank 1] no newline\n")) << t.r.out;
  // the two ranks' lines may interleave: each line is checked on its own, the partial "b" included
  for (int r = 0; r < 2; ++r)
    for (const char* line : {"a", "b"})
      EXPECT_TRUE(contains(t.r.err, "[rank " + std::to_string(r) + "] " + line + "\n")) << t.r.err;
}

TEST(Launch, ReportsAreMerged) {
  TempDir d;
  const fs::path rep = d.path / "merged.json";
  const std::string cmd =
      "sh -c 'printf \"{\\\"rank\\\": %s, \\\"value\\\": %s}\" $INDEXCP_RANK $((INDEXCP_RANK * 10)) > "
      "\"$INDEXCP_REPORT_DIR/rank$INDEXCP_RANK.json\"'";
  auto t = launch("--tp 3 --report '" + rep.string() + "' -- " + cmd, d.path);
  ASSERT_EQ(t.r.status, 0) << t.r.err;
  EXPECT_EQ(t.r.out, "");  // written to the file, not printed
  const auto j = nlohmann::json::parse(slurp(rep));
  EXPECT_EQ(j["launcher"]["world"], 3);
  EXPECT_EQ(j["launcher"]["ok"], true);
  EXPECT_TRUE(j["launcher"]["error"].is_null());
  ASSERT_EQ(j["ranks"].size(), 3u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(j["ranks"][r]["rank"], r);
    EXPECT_EQ(j["ranks"][r]["value"], r * 10);
    EXPECT_EQ(j["launcher"]["ranks"][r]["exit_status"], 0);
  }
  // without --report the merged report is printed on stdout (ranks that wrote none give null;
  // invalid JSON is reported as such)
  t = launch("--tp 3 -- sh -c 'if [ $INDEXCP_RANK = 1 ]; then echo \"{oops\" > \"$INDEXCP_REPORT_DIR/rank1.json\"; "
             "elif [ $INDEXCP_RANK = 2 ]; then echo \"{\\\"x\\\": 1}\" > \"$INDEXCP_REPORT_DIR/rank2.json\"; fi'",
             d.path);
  ASSERT_EQ(t.r.status, 0) << t.r.err;
  const auto k = nlohmann::json::parse(t.r.out);
  EXPECT_TRUE(k["ranks"][0].is_null());
  EXPECT_TRUE(contains(k["ranks"][1]["error"].get<std::string>(), "rank1.json is not valid JSON"));
  EXPECT_EQ(k["ranks"][2]["x"], 1);
  // a rank report with bytes that are not UTF-8 is reported as invalid JSON, and the merged
  // report is still written (U+FFFD in place of the bad byte)
  t = launch("--tp 1 --report '" + rep.string() + "' -- sh -c 'printf \"{\\\"a\\\": \\\"\\377\\\"}\" > "
             "\"$INDEXCP_REPORT_DIR/rank0.json\"'",
             d.path);
  ASSERT_EQ(t.r.status, 0) << t.r.err;
  const auto u = nlohmann::json::parse(slurp(rep));
  EXPECT_TRUE(contains(u["ranks"][0]["error"].get<std::string>(), "rank0.json is not valid JSON")) << u.dump();
  // a rank that leaves a FIFO as its report cannot block the launcher
  const auto fifo = cliutil::run_cli_timeout(
      "launch --tp 1 --report '" + rep.string() + "' -- sh -c 'mkfifo \"$INDEXCP_REPORT_DIR/rank0.json\"'", d.path, 30);
  ASSERT_EQ(fifo.status, 0) << fifo.err;
  const auto v = nlohmann::json::parse(slurp(rep));
  EXPECT_TRUE(contains(v["ranks"][0]["error"].get<std::string>(), "rank0.json: not a regular file")) << v.dump();
  // a failed launch still writes the report, naming the failed rank
  t = launch("--tp 2 --report '" + rep.string() + "' -- sh -c 'exit $((INDEXCP_RANK * 6))'", d.path);
  EXPECT_EQ(t.r.status, 6);
  const auto f = nlohmann::json::parse(slurp(rep));
  EXPECT_EQ(f["launcher"]["ok"], false);
  EXPECT_EQ(f["launcher"]["failed_rank"], 1);
  EXPECT_EQ(f["launcher"]["ranks"][1]["exit_status"], 6);
  EXPECT_TRUE(contains(f["launcher"]["error"].get<std::string>(), "rank 1 of 2 exited with status 6"));
}

TEST(Launch, InterruptedLauncherStopsItsRanks) {
  TempDir d;
  const fs::path pids = d.path / "pids";
  fs::create_directory(pids);
  // the launcher in the background; each rank records its pid, then sleeps
  const std::string script = "'" + std::string(INDEXCP_CLI_PATH) +
                             "' launch --tp 2 --grace 1 -- sh -c 'echo $$ > \"" + pids.string() +
                             "/$INDEXCP_RANK\"; exec sleep 1000' >/dev/null 2>'" + (d.path / "err").string() +
                             "' & L=$!; for i in $(seq 100); do [ -s '" + pids.string() + "/0' ] && [ -s '" +
                             pids.string() + "/1' ] && break; sleep 0.05; done; kill -TERM $L; wait $L; echo $? > '" +
                             (d.path / "status").string() + "'";
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(std::system(script.c_str()), 0);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 15.0);
  EXPECT_EQ(std::stoi(slurp(d.path / "status")), 128 + SIGTERM);
  EXPECT_TRUE(contains(slurp(d.path / "err"), "interrupted by signal 15")) << slurp(d.path / "err");
  for (int r = 0; r < 2; ++r) {
    const pid_t p = std::stoi(slurp(pids / std::to_string(r)));
    EXPECT_NE(::kill(p, 0), 0) << "rank " << r << " (pid " << p << ") still runs";
  }
}

TEST(Launch, UsageErrors) {
  TempDir d;
  auto t = launch("--tp 2 -- /no/such/program", d.path);
  EXPECT_EQ(t.r.status, 2);
  EXPECT_EQ(last_line(t.r.err), "indexcp: error: launch: cannot execute \"/no/such/program\": No such file or directory");
  t = launch("--tp 2", d.path);
  EXPECT_EQ(t.r.status, 2);
  EXPECT_TRUE(contains(t.r.err, "command is required")) << t.r.err;
  t = launch("--tp 65 -- true", d.path);
  EXPECT_EQ(t.r.status, 2);
  EXPECT_TRUE(contains(t.r.err, "--tp")) << t.r.err;
  t = launch("-- true", d.path);
  EXPECT_EQ(t.r.status, 2);
  EXPECT_TRUE(contains(t.r.err, "--tp")) << t.r.err;
  t = launch("--tp 1 --report /no/such/dir/r.json -- true", d.path);
  EXPECT_EQ(t.r.status, 2);
  EXPECT_TRUE(contains(t.r.err, "--report")) << t.r.err;
  t = launch("--tp 1 --timeout 0 -- true", d.path);
  EXPECT_EQ(t.r.status, 2);
}

// A rank that cannot be started (here: the launcher runs out of file descriptors for the pipes of
// rank k > 0) stops the ranks already started instead of leaving them running, and says which.
TEST(Launch, RankThatCannotBeStartedStopsTheOthers) {
  TempDir d;
  const fs::path pids = d.path / "pids";
  fs::create_directory(pids);
  const std::string script = "ulimit -n 16 && '" + std::string(INDEXCP_CLI_PATH) +
                             "' launch --tp 12 --grace 1 -- sh -c 'echo $$ > \"" + pids.string() +
                             "/$INDEXCP_RANK\"; exec sleep 1000' >/dev/null 2>'" + (d.path / "err").string() +
                             "'; echo $? > '" + (d.path / "status").string() + "'";
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(std::system(script.c_str()), 0);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 15.0);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // a leftover rank would have written its pid
  for (const pid_t p : rank_pids(pids, 12)) {
    EXPECT_FALSE(running(p)) << "rank pid " << p << " still runs after the launcher exited";
    if (running(p)) ::kill(p, SIGKILL);
  }
  const std::string err = slurp(d.path / "err");
  EXPECT_EQ(std::stoi(slurp(d.path / "status")), 1) << err;
  const size_t at = err.find("cannot start rank ");
  ASSERT_NE(at, std::string::npos) << err;
  EXPECT_GT(std::stoi(err.substr(at + 18)), 0) << "no rank was started before the failure: " << err;
  EXPECT_TRUE(contains(err, "failed: Too many open files")) << err;
}

#ifdef __linux__
// A launcher killed outright (SIGKILL: no chance to stop anything) takes its ranks with it.
TEST(Launch, RanksDoNotOutliveAKilledLauncher) {
  TempDir d;
  const fs::path pids = d.path / "pids";
  fs::create_directory(pids);
  // TMPDIR: the killed launcher cannot remove its directory; it lands in d (removed by the test)
  const std::string script = "TMPDIR='" + d.path.string() + "' '" + std::string(INDEXCP_CLI_PATH) +
                             "' launch --tp 2 -- sh -c 'echo $$ > \"" +
                             pids.string() + "/$INDEXCP_RANK.tmp\" && mv \"" + pids.string() +
                             "/$INDEXCP_RANK.tmp\" \"" + pids.string() +
                             "/$INDEXCP_RANK\"; exec sleep 1000' >/dev/null 2>&1 & L=$!; for i in $(seq 200); do [ -s '" +
                             pids.string() + "/0' ] && [ -s '" + pids.string() +
                             "/1' ] && break; sleep 0.05; done; kill -KILL $L; wait $L; true";
  ASSERT_EQ(std::system(script.c_str()), 0);
  const auto ranks = rank_pids(pids, 2);
  ASSERT_EQ(ranks.size(), 2u) << "the ranks did not start";
  const auto t0 = std::chrono::steady_clock::now();
  bool alive = true;
  while (alive && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5)) {
    alive = running(ranks[0]) || running(ranks[1]);
    if (alive) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (const pid_t p : ranks) {
    EXPECT_FALSE(running(p)) << "rank pid " << p << " outlived the killed launcher";
    if (running(p)) ::kill(p, SIGKILL);
  }
}
#endif

// NaN would pass a plain range check; a NaN grace would never expire, so it is refused up front
// (and so are infinity, hex, spaces, empty values and trailing garbage: decimal numbers only).
TEST(Launch, NotANumberDurationsAreRefused) {
  TempDir d;
  for (const char* opt : {"--grace", "--time-limit", "--timeout"})
    for (const char* v : {"nan", "-nan", "inf", "1e400", "5s", "0x10", "' 5'", "''"}) {
      const Timed t = launch(std::string(opt) + " " + v + " --tp 2 -- true", d.path);
      EXPECT_EQ(t.r.status, 2) << opt << ": " << t.r.err;
      EXPECT_TRUE(contains(t.r.err, std::string(opt) + ": \"")) << t.r.err;
      EXPECT_TRUE(contains(t.r.err, "\" is not a number of seconds in ")) << t.r.err;
    }
}

// What a rank leaves running in its process group ends with the launch, also after success.
TEST(Launch, BackgroundChildrenOfASuccessfulRankAreStopped) {
  TempDir d;
  const std::string script = "sleep 60 & echo $! > " + (d.path / "bg").string() + "_$INDEXCP_RANK; exit 0";
  const Timed t = launch("--tp 2 -- sh -c '" + script + "'", d.path);
  EXPECT_EQ(t.r.status, 0) << t.r.err;
  EXPECT_LT(t.seconds, 20.0);
  for (int r = 0; r < 2; ++r) {
    const std::string s = slurp(d.path.string() + "/bg_" + std::to_string(r));
    ASSERT_FALSE(s.empty()) << "rank " << r << " wrote no pid";
    const pid_t p = static_cast<pid_t>(std::stol(s));
    for (int i = 0; i < 100 && running(p); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_FALSE(running(p)) << "background child " << p << " of rank " << r << " outlived the launch";
  }
}

// --report through a symlink writes the file it points to and leaves the link in place.
TEST(Launch, ReportThroughASymlinkKeepsTheLink) {
  TempDir d;
  const fs::path target = d.path / "target.json", link = d.path / "link.json";
  std::ofstream(target) << "old";
  fs::create_symlink(target, link);
  const Timed t = launch("--tp 1 --report '" + link.string() + "' -- true", d.path);
  EXPECT_EQ(t.r.status, 0) << t.r.err;
  EXPECT_TRUE(fs::is_symlink(link));
  const auto j = nlohmann::json::parse(slurp(target));
  EXPECT_EQ(j["launcher"]["world"], 1);
}
