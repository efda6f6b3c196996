// The rendezvous directory and the group environment (include/indexcp/rendezvous.hpp): plain
// POSIX C++, built with or without CUDA and NCCL, unit-tested on the CPU (tests/test_rendezvous.cpp).
#include "indexcp/rendezvous.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "indexcp/error.hpp"
#include "core/knobs.hpp"

namespace indexcp {

namespace {

constexpr double kMaxTimeoutS = 604800.0;  // one week
constexpr const char* kMagic = "indexcp-rendezvous";
constexpr int kVersion = 1;

const char* env_or_null(const char* name) {
  // INDEXCP_* variables are knobs of the table (src/core/knobs.cpp); TMPDIR, LOCAL_RANK are not ours
  if (std::strncmp(name, "INDEXCP_", 8) == 0) return detail::knob_env(name);
  const char* v = std::getenv(name);
  return (v && *v) ? v : nullptr;
}

long parse_int_env(const char* name, const char* v, long lo, long hi) {
  errno = 0;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  // decimal digits only: no sign, no spaces (strtol would skip leading ones)
  const bool digits = std::isdigit(static_cast<unsigned char>(v[0])) != 0;
  if (!digits || errno != 0 || end == v || *end != '\0' || x < lo || x > hi)
    throw Error(ErrorCode::kInvalidArgument, std::string(name) + " = \"" + v + "\" must be an integer in " +
                                                 std::to_string(lo) + ".." + std::to_string(hi));
  return x;
}

bool valid_token(const std::string& s, size_t max_len) {
  if (s.size() > max_len) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) return false;
  return true;
}

std::string seconds(double t) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", t);
  return b;
}

void check_timeout(double t, const std::string& name) {
  if (!(std::isfinite(t) && t > 0.0 && t <= kMaxTimeoutS))
    throw Error(ErrorCode::kInvalidArgument,
                name + " = " + seconds(t) + " must be a number of seconds in (0, 604800]");
}

std::string errno_text(int e) { return std::strerror(e); }


void ensure_dir(const std::string& dir) {
  struct stat st{};
  if (::stat(dir.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode))
      throw Error(ErrorCode::kIo, "rendezvous directory \"" + dir + "\" exists but is not a directory");
    return;
  }
  // Several ranks may create it at once: EEXIST is fine.
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    throw Error(ErrorCode::kIo, "cannot create the rendezvous directory \"" + dir + "\": " + errno_text(errno));
}

bool read_whole(const std::string& path, std::string& out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream ss;
  ss << in.rdbuf();
  out = ss.str();
  return true;
}

std::string header_of(const std::string& run, int world, int rank, const std::string& key, size_t bytes) {
  return std::string(kMagic) + " v" + std::to_string(kVersion) + " run=" + run + " world=" + std::to_string(world) +
         " rank=" + std::to_string(rank) + " key=" + key + " bytes=" + std::to_string(bytes) + "\n";
}

// The value of "name=value" in a header line ("" when absent).
std::string field(const std::string& header, const std::string& name) {
  std::istringstream ss(header);
  std::string tok;
  while (ss >> tok)
    if (tok.rfind(name + "=", 0) == 0) return tok.substr(name.size() + 1);
  return "";
}

}  // namespace

double group_timeout_from_env() {
  const char* v = env_or_null("INDEXCP_NCCL_TIMEOUT_S");
  if (!v) return kDefaultGroupTimeoutS;
  errno = 0;
  char* end = nullptr;
  const double t = std::strtod(v, &end);
  if (errno != 0 || end == v || *end != '\0' || !(std::isfinite(t) && t > 0.0 && t <= kMaxTimeoutS))
    throw Error(ErrorCode::kInvalidArgument,
                std::string("INDEXCP_NCCL_TIMEOUT_S = \"") + v + "\" must be a number of seconds in (0, 604800]");
  return t;
}

int device_from_env(int fallback) {
  if (const char* d = env_or_null("INDEXCP_DEVICE")) return static_cast<int>(parse_int_env("INDEXCP_DEVICE", d, 0, 1023));
  if (const char* l = env_or_null("LOCAL_RANK")) return static_cast<int>(parse_int_env("LOCAL_RANK", l, 0, 1023));
  return fallback;
}

std::optional<RankEnv> rank_env_from_env() {
  const char* w = env_or_null("INDEXCP_WORLD");
  if (!w) return std::nullopt;
  RankEnv e;
  e.world = static_cast<int>(parse_int_env("INDEXCP_WORLD", w, 1, 64));
  const char* r = env_or_null("INDEXCP_RANK");
  if (!r) throw Error(ErrorCode::kInvalidArgument, "INDEXCP_RANK is not set (INDEXCP_WORLD = " + std::string(w) + " is)");
  e.rank = static_cast<int>(parse_int_env("INDEXCP_RANK", r, 0, e.world - 1));
  e.device = device_from_env(e.rank);
  if (const char* dir = env_or_null("INDEXCP_RENDEZVOUS")) e.rendezvous_dir = dir;
  if (e.world > 1 && e.rendezvous_dir.empty())
    throw Error(ErrorCode::kInvalidArgument,
                "INDEXCP_RENDEZVOUS is not set; a group of INDEXCP_WORLD = " + std::to_string(e.world) +
                    " processes needs a rendezvous directory (indexcp launch sets it)");
  if (const char* id = env_or_null("INDEXCP_RUN_ID")) {
    e.run_id = id;
    if (!valid_token(e.run_id, 64))
      throw Error(ErrorCode::kInvalidArgument, "INDEXCP_RUN_ID = \"" + e.run_id +
                                                   "\" must be at most 64 characters of [A-Za-z0-9._-]");
  }
  e.timeout_s = group_timeout_from_env();
  return e;
}

std::string make_unique_dir(const std::string& prefix, const std::string& parent) {
  std::string base = parent;
  std::string from;  // where the parent came from, for the error
  if (base.empty()) {
    const char* t = env_or_null("TMPDIR");
    base = t ? t : "/tmp";
    from = t ? " (TMPDIR)" : "";
  }
  std::string templ = base + "/" + prefix + "XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (!::mkdtemp(buf.data()))
    throw Error(ErrorCode::kIo, "cannot create a directory in \"" + base + "\"" + from + ": " + errno_text(errno));
  return std::string(buf.data());
}

std::string make_run_id() {
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(
                      std::chrono::system_clock::now().time_since_epoch())
                      .count();
  std::random_device rd;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%08x%08x", rd(), rd());
  return std::to_string(::getpid()) + "-" + std::to_string(us) + "-" + hex;
}

// ---- FileRendezvous ---------------------------------------------------------------------------

FileRendezvous::FileRendezvous(std::string dir, int rank, int world, std::string run_id, double timeout_s)
    : dir_(std::move(dir)), run_id_(std::move(run_id)), rank_(rank), world_(world), timeout_s_(timeout_s) {
  require(world >= 1 && world <= 64, "world = " + std::to_string(world) + " must be in 1..64");
  require(rank >= 0 && rank < world, "rank = " + std::to_string(rank) + " must be in 0..world-1 = " +
                                         std::to_string(world - 1));
  require(!dir_.empty(), "the rendezvous directory is empty (INDEXCP_RENDEZVOUS)");
  require(valid_token(run_id_, 64), "run_id = \"" + run_id_ + "\" must be at most 64 characters of [A-Za-z0-9._-]");
  check_timeout(timeout_s, "timeout_s");
  while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
  ensure_dir(dir_);
}

FileRendezvous::FileRendezvous(const RankEnv& env)
    : FileRendezvous(env.rendezvous_dir, env.rank, env.world, env.run_id, env.timeout_s) {}

std::string FileRendezvous::path_of(const std::string& key, int r) const {
  return dir_ + "/" + key + ".rank" + std::to_string(r);
}

void FileRendezvous::publish(const std::string& key, const std::string& blob) const {
  require(!key.empty() && valid_token(key, 128), "key = \"" + key + "\" must be 1..128 characters of [A-Za-z0-9._-]");
  static std::atomic<unsigned> counter{0};
  const std::string final_path = path_of(key, rank_);
  const std::string tmp = dir_ + "/." + key + ".rank" + std::to_string(rank_) + ".tmp." + std::to_string(::getpid()) +
                          "." + std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id()) % 1000000) +
                          "." + std::to_string(counter++);
  const std::string text = header_of(run_id_, world_, rank_, key, blob.size()) + blob;
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) throw Error(ErrorCode::kIo, "rendezvous: cannot create \"" + tmp + "\": " + errno_text(errno));
  size_t off = 0;
  while (off < text.size()) {
    const ssize_t n = ::write(fd, text.data() + off, text.size() - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      throw Error(ErrorCode::kIo, "rendezvous: cannot write \"" + tmp + "\": " + errno_text(e));
    }
    off += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    throw Error(ErrorCode::kIo, "rendezvous: cannot write \"" + tmp + "\": " + errno_text(e));
  }
  if (::rename(tmp.c_str(), final_path.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    throw Error(ErrorCode::kIo, "rendezvous: cannot rename into \"" + final_path + "\": " + errno_text(e));
  }
}

std::string FileRendezvous::wait_for(const std::string& key, int from) const {
  require(!key.empty() && valid_token(key, 128), "key = \"" + key + "\" must be 1..128 characters of [A-Za-z0-9._-]");
  require(from >= 0 && from < world_, "from = " + std::to_string(from) + " must be in 0..world-1 = " +
                                          std::to_string(world_ - 1));
  const std::string path = path_of(key, from);
  const auto t0 = std::chrono::steady_clock::now();
  auto sleep = std::chrono::microseconds(500);
  std::string stale;  // description of the last stale file seen
  for (;;) {
    std::string text;
    if (read_whole(path, text)) {
      const size_t nl = text.find('\n');
      if (nl != std::string::npos) {
        const std::string header = text.substr(0, nl);
        const std::string body = text.substr(nl + 1);
        const bool ours = header.rfind(std::string(kMagic) + " v" + std::to_string(kVersion) + " ", 0) == 0;
        if (ours && field(header, "run") == run_id_ && field(header, "world") == std::to_string(world_) &&
            field(header, "rank") == std::to_string(from) && field(header, "key") == key &&
            field(header, "bytes") == std::to_string(body.size()))
          return body;
        stale = ours ? "run \"" + field(header, "run") + "\", world " + field(header, "world") : "not a rendezvous file";
      } else {
        stale = "no header line";
      }
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (waited >= timeout_s_) {
      std::string msg = "rendezvous: rank " + std::to_string(rank_) + " of " + std::to_string(world_) + " waited " +
                        seconds(timeout_s_) + " s for rank " +
                        std::to_string(from) + "'s \"" + key + "\" in \"" + dir_ + "\"";
      if (!stale.empty())
        msg += " and found only a stale file (" + stale + "; this run is \"" + run_id_ + "\", world " +
               std::to_string(world_) + ")";
      msg += "; did rank " + std::to_string(from) + " start? (INDEXCP_NCCL_TIMEOUT_S sets the timeout)";
      throw Error(ErrorCode::kRuntime, msg);
    }
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, std::chrono::microseconds(20000));
  }
}

std::string FileRendezvous::broadcast(const std::string& key, const std::string& blob, int root) const {
  require(root >= 0 && root < world_, "root = " + std::to_string(root) + " must be in 0..world-1 = " +
                                          std::to_string(world_ - 1));
  if (rank_ == root) {
    publish(key, blob);
    return blob;
  }
  return wait_for(key, root);
}

std::vector<std::string> FileRendezvous::all_gather(const std::string& key, const std::string& blob) const {
  publish(key, blob);
  std::vector<std::string> out(static_cast<size_t>(world_));
  for (int r = 0; r < world_; ++r) out[static_cast<size_t>(r)] = r == rank_ ? blob : wait_for(key, r);
  return out;
}

}  // namespace indexcp
