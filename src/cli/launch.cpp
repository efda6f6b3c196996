// `indexcp launch --tp W -- COMMAND ...`: one process per rank on this host.
//
// For each rank r in 0..W-1 the launcher fork/execs COMMAND with
//   INDEXCP_RANK=r  INDEXCP_WORLD=W  INDEXCP_DEVICE=r  INDEXCP_RENDEZVOUS=<fresh dir>
//   INDEXCP_RUN_ID=<fresh id>  INDEXCP_REPORT_DIR=<fresh dir>  [INDEXCP_NCCL_TIMEOUT_S=--timeout]
// (CUDA_VISIBLE_DEVICES is left alone), stdin from /dev/null, stdout and stderr through pipes: each
// line is copied to the launcher's stdout / stderr prefixed "[rank r] ". Each rank runs in its own
// process group, so that stopping a rank also stops what it started; on Linux a rank also gets
// SIGKILL when the launcher dies without stopping it (PR_SET_PDEATHSIG). When a rank cannot be
// started (pipe or fork failure), the ranks already started are stopped as below (exit status 1).
//
// When a rank exits with a non-zero status or is killed by a signal, the launcher sends SIGTERM to
// every other rank's process group, SIGKILL after --grace seconds to what is left, and exits with
// one line naming the first failed rank, its status and its last line on stderr. The same happens
// at --time-limit and when the launcher itself gets SIGINT, SIGTERM or SIGHUP.
//
// Reports: a rank may write a JSON object to $INDEXCP_REPORT_DIR/rank<r>.json; the launcher merges
// {"launcher": {...per-rank exit statuses...}, "ranks": [rank 0's report or null, ...]} and writes
// it to --report FILE, or prints it on stdout when no --report is given and some rank wrote one.
// The fresh directories live under one mkdtemp directory ($TMPDIR or /tmp) removed at the end.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "core/file_util.hpp"
#include "core/json_util.hpp"
#include "validators.hpp"
#include "indexcp/error.hpp"
#include "indexcp/rendezvous.hpp"
#include "subcommand.hpp"

namespace indexcp::cli {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

struct LaunchOptions {
  int tp = 0;                       ///< W, 1..64
  double timeout_s = 0.0;           ///< > 0: exported to the ranks as INDEXCP_NCCL_TIMEOUT_S
  double grace_s = 5.0;             ///< SIGTERM -> SIGKILL delay when the ranks are stopped
  double time_limit_s = 0.0;        ///< > 0: stop every rank after this wall time
  std::string report_path;          ///< write the merged report here (else printed when ranks wrote one)
  std::vector<std::string> command; ///< what each rank runs
};


volatile sig_atomic_t g_signal = 0;
extern "C" void on_signal(int sig) { g_signal = sig; }

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string seconds(double t) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", t);
  return b;
}

void write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return;  // our stdout is gone (EPIPE): drop the output, keep supervising
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

std::string signal_name(int sig) {
  const char* d = ::strsignal(sig);
  return std::to_string(sig) + " (" + (d ? d : "?") + ")";
}

// One output stream of one rank: a pipe read end and the partial line not yet written.
struct Stream {
  int fd = -1;
  int out_fd = 1;  // where its lines go (1 or 2)
  std::string partial;
  std::string last_line;  // last non-empty line (stderr: for the error message)
};

struct Rank {
  pid_t pid = -1;
  bool running = false;
  bool stopped = false;  // still running when the launcher sent the stop (SIGTERM)
  int status = 0;        // waitpid status once reaped
  double wall_s = 0.0;
  Stream out, err;
};

void emit_lines(int rank, Stream& s, const char* data, size_t n, bool flush_partial) {
  s.partial.append(data, n);
  const std::string prefix = "[rank " + std::to_string(rank) + "] ";
  size_t start = 0;
  std::string buf;
  for (;;) {
    const size_t nl = s.partial.find('\n', start);
    if (nl == std::string::npos) break;
    const std::string line = s.partial.substr(start, nl - start);
    buf += prefix + line + "\n";
    if (!line.empty()) s.last_line = line;
    start = nl + 1;
  }
  s.partial.erase(0, start);
  // very long lines without a newline are passed on in pieces (64 KiB)
  if (!s.partial.empty() && (flush_partial || s.partial.size() >= 65536)) {
    buf += prefix + s.partial + "\n";
    s.last_line = s.partial;
    s.partial.clear();
  }
  if (!buf.empty()) write_all(s.out_fd, buf.data(), buf.size());
}

// Reads what is available on s.fd; closes it at EOF. Returns false when closed.
bool pump(int rank, Stream& s) {
  if (s.fd < 0) return false;
  char buf[16384];
  for (;;) {
    const ssize_t n = ::read(s.fd, buf, sizeof buf);
    if (n > 0) {
      emit_lines(rank, s, buf, static_cast<size_t>(n), false);
      if (static_cast<size_t>(n) < sizeof buf) return true;
      continue;
    }
    if (n < 0 && (errno == EINTR)) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    emit_lines(rank, s, "", 0, true);  // EOF (or error): flush the partial line
    ::close(s.fd);
    s.fd = -1;
    return false;
  }
}

bool group_alive(pid_t pgid) { return pgid > 0 && (::kill(-pgid, 0) == 0 || errno == EPERM); }

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "was killed by signal " + signal_name(WTERMSIG(status));
  return "ended with wait status " + std::to_string(status);
}

std::string shorten(std::string s, size_t n = 300) {
  for (char& c : s)  // the line goes into our one-line error: no control bytes (NUL, ESC, ...)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = ' ';
  if (s.size() > n) s = s.substr(0, n) + "...";
  return s;
}

// A number of seconds in [lo, hi], written in decimal (digits, one point, an exponent; no hex,
// no spaces, no inf/nan), as our own message rather than CLI::Range's, whose number formatting
// differs between CLI11 versions (docs/bad-inputs.md quotes the message).
CLI::Validator seconds_in(double lo, double hi) {
  const std::string range = fmt("%g", lo) + " to " + fmt("%g", hi);
  return CLI::Validator(
      [lo, hi, range](std::string& s) -> std::string {
        const bool decimal = !s.empty() && s.size() <= 64 &&
                             s.find_first_not_of("0123456789.eE+-") == std::string::npos &&
                             s.find_first_of("0123456789") != std::string::npos;
        char* end = nullptr;
        const double v = decimal ? std::strtod(s.c_str(), &end) : 0.0;  // underflow gives 0 or a denormal: fine
        if (!decimal || end != s.c_str() + s.size() || !(v >= lo && v <= hi))
          return "\"" + shorten(s, 64) + "\" is not a number of seconds in " + range;
        return {};
      },
      "SECONDS in " + range);
}

CLI::App* add_launch_subcommand(CLI::App& app, LaunchOptions& o) {
  auto* l = app.add_subcommand("launch",
                               "Start W processes of a command, one per rank (and GPU) of a TP group on this host, "
                               "with INDEXCP_RANK / INDEXCP_WORLD / INDEXCP_DEVICE / INDEXCP_RENDEZVOUS set");
  l->add_option("--tp", o.tp, "number of ranks W (processes), 1..64")->required()->check(CLI::Range(1, 64));
  l->add_option("--timeout", o.timeout_s,
                "seconds; exported to the ranks as INDEXCP_NCCL_TIMEOUT_S, the bound of their rendezvous and "
                "NCCL waits (default: inherited, else 60)")
      ->check(seconds_in(1e-3, 604800.0));
  l->add_option("--grace", o.grace_s, "seconds between SIGTERM and SIGKILL when the ranks are stopped")
      ->check(seconds_in(0.0, 3600.0))
      ->capture_default_str();
  l->add_option("--time-limit", o.time_limit_s, "stop every rank after this many seconds (0: no limit)")
      ->check(seconds_in(0.0, 604800.0))
      ->capture_default_str();
  l->add_option("--report", o.report_path,
                "write the merged JSON report (launcher status + each rank's $INDEXCP_REPORT_DIR/rank<r>.json) to FILE")
      ->check(non_empty_path());
  l->add_option("command", o.command, "the command each rank runs, after --")->required();
  l->footer(
      "Example: indexcp launch --tp 2 --timeout 30 -- build/tests/test_nccl. Each rank's output lines are prefixed "
      "\"[rank r] \". When a rank fails (non-zero status or a signal), the others get SIGTERM, then SIGKILL after "
      "--grace seconds, and the launcher exits with that rank's status (1 for a signal) and one line naming it. "
      "A rank may write a JSON report to $INDEXCP_REPORT_DIR/rank<r>.json: the launcher merges them.");
  return l;
}

int launch_command(const LaunchOptions& o) {
  require(o.tp >= 1 && o.tp <= 64, "--tp = " + std::to_string(o.tp) + " must be in 1..64");
  require(!o.command.empty(), "launch: no command given (indexcp launch --tp W -- COMMAND [ARGS...])");
  // the parser's validator refuses these already; library callers of launch_command may not
  // (a NaN grace would never expire: the ranks would never get SIGKILL)
  require(std::isfinite(o.grace_s), "--grace = " + seconds(o.grace_s) + " is not a number of seconds in 0..3600");
  require(std::isfinite(o.time_limit_s), "--time-limit = " + seconds(o.time_limit_s) + " is not a number of seconds in 0..604800");
  require(std::isfinite(o.timeout_s), "--timeout = " + seconds(o.timeout_s) + " is not a number of seconds in 0.001..604800");
  if (!o.report_path.empty()) check_output_path(o.report_path, "--report");
  const int W = o.tp;

  // fresh directories for this launch
  const std::string root = make_unique_dir("indexcp-launch-");
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } cleanup{root};
  const std::string rdv = root + "/rendezvous", reports = root + "/reports";
  if (::mkdir(rdv.c_str(), 0700) != 0 || ::mkdir(reports.c_str(), 0700) != 0)
    throw Error(ErrorCode::kIo, "launch: cannot create directories in \"" + root + "\": " + std::strerror(errno));
  const std::string run_id = make_run_id();

  // signals: remember them, stop the ranks, exit 128 + signal (the flag is cleared BEFORE the
  // handlers are installed: a signal that arrives in between must not be forgotten)
  g_signal = 0;
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: poll() returns EINTR
  struct sigaction old_int{}, old_term{}, old_hup{}, old_pipe{};
  ::sigaction(SIGINT, &sa, &old_int);
  ::sigaction(SIGTERM, &sa, &old_term);
  ::sigaction(SIGHUP, &sa, &old_hup);
  struct sigaction ign{};
  ign.sa_handler = SIG_IGN;
  sigemptyset(&ign.sa_mask);
  ::sigaction(SIGPIPE, &ign, &old_pipe);
  struct RestoreSignals {
    struct sigaction i, t, h, p;
    ~RestoreSignals() {
      ::sigaction(SIGINT, &i, nullptr);
      ::sigaction(SIGTERM, &t, nullptr);
      ::sigaction(SIGHUP, &h, nullptr);
      ::sigaction(SIGPIPE, &p, nullptr);
    }
  } restore{old_int, old_term, old_hup, old_pipe};

  std::vector<char*> argv;
  for (const auto& a : o.command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);

  std::vector<Rank> ranks(static_cast<size_t>(W));
  const auto t0 = Clock::now();
  // why not every rank was started ("" when all were) and the exit status that goes with it: the
  // ranks already running are then stopped by the supervision below, never left behind
  std::string start_error;
  int start_code = 0;
  const pid_t launcher_pid = ::getpid();

  // the environment every rank shares (set in this process before each fork: children inherit it)
  ::setenv("INDEXCP_WORLD", std::to_string(W).c_str(), 1);
  ::setenv("INDEXCP_RENDEZVOUS", rdv.c_str(), 1);
  ::setenv("INDEXCP_RUN_ID", run_id.c_str(), 1);
  ::setenv("INDEXCP_REPORT_DIR", reports.c_str(), 1);
  if (o.timeout_s > 0) ::setenv("INDEXCP_NCCL_TIMEOUT_S", seconds(o.timeout_s).c_str(), 1);

  for (int r = 0; r < W && start_error.empty(); ++r) {
    int out[2] = {-1, -1}, err[2] = {-1, -1}, ex[2] = {-1, -1};  // pipe2 leaves them alone on failure
    auto close_all = [&] {
      for (int fd : {out[0], out[1], err[0], err[1], ex[0], ex[1]})
        if (fd >= 0) ::close(fd);
    };
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0 || ::pipe2(ex, O_CLOEXEC) != 0) {
      const int e = errno;
      close_all();
      start_error = "cannot start rank " + std::to_string(r) + " of " + std::to_string(W) + ": pipe failed: " +
                    std::strerror(e);
      start_code = 1;
      break;
    }
    ::setenv("INDEXCP_RANK", std::to_string(r).c_str(), 1);
    ::setenv("INDEXCP_DEVICE", std::to_string(r).c_str(), 1);
    std::fflush(stdout);
    std::fflush(stderr);
    const pid_t pid = ::fork();
    if (pid < 0) {
      const int e = errno;
      close_all();
      start_error = "cannot start rank " + std::to_string(r) + " of " + std::to_string(W) + ": fork failed: " +
                    std::strerror(e);
      start_code = 1;
      break;
    }
    if (pid == 0) {
      // child: async-signal-safe calls only
      ::setpgid(0, 0);
#ifdef __linux__
      // a rank does not outlive a launcher that was killed outright (SIGKILL: no chance to stop
      // the ranks); the launcher may already be gone by now
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher_pid) ::_exit(127);
#else
      (void)launcher_pid;
#endif
      struct sigaction dfl{};
      dfl.sa_handler = SIG_DFL;
      sigemptyset(&dfl.sa_mask);
      ::sigaction(SIGPIPE, &dfl, nullptr);
      ::sigaction(SIGINT, &dfl, nullptr);
      ::sigaction(SIGTERM, &dfl, nullptr);
      ::sigaction(SIGHUP, &dfl, nullptr);
      const int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
      if (devnull >= 0) ::dup2(devnull, 0);
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
      ::execvp(argv[0], argv.data());
      const int e = errno;
      ssize_t ignored = ::write(ex[1], &e, sizeof e);
      (void)ignored;
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also here: no race with the kill below
    ::close(out[1]);
    ::close(err[1]);
    ::close(ex[1]);
    int e = 0;
    ssize_t n;
    do n = ::read(ex[0], &e, sizeof e);
    while (n < 0 && errno == EINTR);
    ::close(ex[0]);
    Rank& rk = ranks[static_cast<size_t>(r)];
    rk.pid = pid;
    rk.running = true;
    rk.out.fd = out[0];
    rk.out.out_fd = 1;
    rk.err.fd = err[0];
    rk.err.out_fd = 2;
    ::fcntl(out[0], F_SETFL, ::fcntl(out[0], F_GETFL) | O_NONBLOCK);
    ::fcntl(err[0], F_SETFL, ::fcntl(err[0], F_GETFL) | O_NONBLOCK);
    if (n == static_cast<ssize_t>(sizeof e)) {
      start_error = "cannot execute \"" + o.command[0] + "\": " + std::strerror(e);
      start_code = 2;
    }
  }

  // supervise
  int failed = -1;                // first failed rank
  std::string stop_reason;        // why the ranks were stopped ("" while they run freely)
  int exit_code = 0;
  double term_at = -1.0;          // when SIGTERM went out
  bool killed = false;
  double all_reaped_at = -1.0;
  auto stop_all = [&](const std::string& why, int code) {
    if (!stop_reason.empty()) return;
    stop_reason = why;
    exit_code = code;
    term_at = since(t0);
    for (auto& rk : ranks) {
      // still running: not reaped, and not already exited (peeked at without reaping it)
      siginfo_t info{};
      rk.stopped = rk.running && rk.pid > 0 &&
                   ::waitid(P_PID, static_cast<id_t>(rk.pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
                   info.si_pid == 0;
      if (rk.pid > 0 && group_alive(rk.pid)) ::kill(-rk.pid, SIGTERM);
    }
  };
  if (!start_error.empty()) stop_all(start_error, start_code);

  for (;;) {
    // reap
    for (;;) {
      int st = 0;
      const pid_t p = ::waitpid(-1, &st, WNOHANG);
      if (p <= 0) break;
      for (size_t r = 0; r < ranks.size(); ++r) {
        Rank& rk = ranks[r];
        if (rk.pid != p || !rk.running) continue;
        rk.running = false;
        rk.status = st;
        rk.wall_s = since(t0);
        const bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
        if (!ok && stop_reason.empty()) {
          failed = static_cast<int>(r);
          const int code = WIFEXITED(st) ? WEXITSTATUS(st) : 1;
          stop_all("rank " + std::to_string(r) + " of " + std::to_string(W) + " " + describe_status(st), code);
        }
      }
    }
    const bool any_running = std::any_of(ranks.begin(), ranks.end(), [](const Rank& rk) { return rk.running; });
    if (!any_running && all_reaped_at < 0) all_reaped_at = since(t0);
    if (g_signal != 0) {
      const int sig = g_signal;
      stop_all("interrupted by signal " + signal_name(sig) + "; the ranks were stopped", 128 + sig);
    }
    if (o.time_limit_s > 0 && since(t0) >= o.time_limit_s && any_running)
      stop_all("the time limit of " + seconds(o.time_limit_s) + " s passed; the ranks were stopped", 1);
    if (term_at >= 0 && !killed && since(t0) >= term_at + o.grace_s) {
      killed = true;
      for (auto& rk : ranks)
        if (rk.pid > 0 && group_alive(rk.pid)) ::kill(-rk.pid, SIGKILL);
    }
    // output
    std::vector<pollfd> fds;
    std::vector<Stream*> owners;
    std::vector<int> owner_rank;
    for (size_t r = 0; r < ranks.size(); ++r)
      for (Stream* s : {&ranks[r].out, &ranks[r].err})
        if (s->fd >= 0) {
          fds.push_back({s->fd, POLLIN, 0});
          owners.push_back(s);
          owner_rank.push_back(static_cast<int>(r));
        }
    // done: every rank reaped and every pipe at EOF, or 1 s after the last exit (a leftover
    // background process may hold a pipe open)
    if (!any_running && (fds.empty() || since(t0) >= all_reaped_at + 1.0)) break;
    if (fds.empty()) {
      ::usleep(20000);
      continue;
    }
    const int n = ::poll(fds.data(), fds.size(), 20);
    if (n > 0)
      for (size_t i = 0; i < fds.size(); ++i)
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) pump(owner_rank[i], *owners[i]);
  }
  for (size_t r = 0; r < ranks.size(); ++r)
    for (Stream* s : {&ranks[r].out, &ranks[r].err})
      if (s->fd >= 0) {
        pump(static_cast<int>(r), *s);
        if (s->fd >= 0) {
          emit_lines(static_cast<int>(r), *s, "", 0, true);
          ::close(s->fd);
          s->fd = -1;
        }
      }
  // whatever the ranks left running in their process groups (background children) ends with the
  // launch, also after a successful run
  for (auto& rk : ranks)
      if (rk.pid > 0 && group_alive(rk.pid)) ::kill(-rk.pid, SIGKILL);
  const double wall = since(t0);

  // the merged report
  json launcher = {{"world", W},
                   {"command", o.command},
                   {"ok", stop_reason.empty()},
                   {"error", stop_reason.empty() ? json(nullptr) : json(stop_reason)},
                   {"failed_rank", failed >= 0 ? json(failed) : json(nullptr)},
                   {"wall_s", wall}};
  json per = json::array(), reps = json::array();
  bool any_report = false;
  for (int r = 0; r < W; ++r) {
    const Rank& rk = ranks[static_cast<size_t>(r)];
    json e = {{"rank", r}, {"wall_s", rk.wall_s}};
    if (rk.pid < 0) e["started"] = false;
    else if (WIFEXITED(rk.status)) e["exit_status"] = WEXITSTATUS(rk.status);
    else if (WIFSIGNALED(rk.status)) e["signal"] = WTERMSIG(rk.status);
    per.push_back(e);
    const std::string file = reports + "/rank" + std::to_string(r) + ".json";
    std::error_code ec;
    if (!fs::exists(fs::symlink_status(file, ec))) {
      reps.push_back(nullptr);
      continue;
    }
    any_report = true;
    try {  // (a regular file of at most 64 MiB: a rank that left a FIFO there cannot block the launcher)
      reps.push_back(json::parse(detail::read_text_file(file, "")));
    } catch (const json::exception& ex) {
      reps.push_back(json{{"error", "rank" + std::to_string(r) + ".json is not valid JSON: " + std::string(ex.what())}});
    } catch (const Error& ex) {  // named as the rank wrote it, not by the launcher's temporary path
      std::string m = ex.what();
      if (m.rfind(file, 0) == 0) m = "rank" + std::to_string(r) + ".json" + m.substr(file.size());
      reps.push_back(json{{"error", m}});
    }
  }
  launcher["ranks"] = per;
  const json merged = {{"launcher", launcher}, {"ranks", reps}};
  std::string report_error;  // a report that cannot be written must not hide a rank's failure
  if (!o.report_path.empty()) {
    try {
      write_file_atomic(o.report_path, detail::dump_text(merged, 2) + "\n");
    } catch (const Error& e) {
      if (stop_reason.empty()) throw;
      report_error = e.what();
    }
  } else if (any_report) {
    std::cout << detail::dump_text(merged, 2) << std::endl;
  }

  if (stop_reason.empty()) return 0;
  std::string msg = "launch: " + stop_reason;
  if (!report_error.empty()) msg += "; --report not written: " + report_error;
  if (failed >= 0) {
    const std::string& last = ranks[static_cast<size_t>(failed)].err.last_line;
    if (!last.empty()) msg += "; its last line on stderr: " + shorten(last);
    // only the ranks that were still running when the stop went out (not those that failed on
    // their own at the same time: their statuses are in the report)
    const int others = static_cast<int>(std::count_if(ranks.begin(), ranks.end(), [&](const Rank& rk) {
      return &rk != &ranks[static_cast<size_t>(failed)] && rk.stopped;
    }));
    if (others > 0)
      msg += others + 1 == W ? std::string(" (the other ranks were stopped)")
             : others == 1   ? std::string(" (1 other rank was stopped)")
                             : " (" + std::to_string(others) + " other ranks were stopped)";
  }
  std::cout.flush();
  std::cerr << "indexcp: error: " << msg << std::endl;
  return exit_code == 0 ? 1 : exit_code;
}

class LaunchCommand final : public Subcommand {
 public:
  CLI::App* add(CLI::App& app) override { return add_launch_subcommand(app, o_); }
  int run(int, char**) override { return launch_command(o_); }

 private:
  LaunchOptions o_;
};

}  // namespace

INDEXCP_SUBCOMMAND(70, "launch", LaunchCommand)

}  // namespace indexcp::cli
