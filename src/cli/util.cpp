// Helpers shared by the subcommands (commands.hpp): number formatting, output files, memory budgets.
#include <unistd.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "commands.hpp"
#include "indexcp/error.hpp"

namespace indexcp::cli {

namespace fs = std::filesystem;

// One line for the terminal: control bytes (newlines, ESC, BEL, ...) become spaces, and a message
// that echoes a huge value is cut.
static std::string one_line(std::string s) {
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

void check_output_path(const std::string& path, const std::string& flag) {
  if (path.empty()) throw Error(ErrorCode::kInvalidArgument, flag + ": empty file name");
  std::error_code ec;
  const fs::path p(path);
  if (fs::is_directory(p, ec)) throw Error(ErrorCode::kInvalidArgument, path + ": is a directory (" + flag + ")");
  const fs::path dir = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  if (!fs::is_directory(dir, ec))
    throw Error(ErrorCode::kInvalidArgument, path + ": directory " + dir.string() + " does not exist (" + flag + ")");
}

void write_file_atomic(const std::string& path, const std::string& text) {
  const fs::path p(path);
  std::error_code sec;
  const fs::file_status lst = fs::symlink_status(p, sec);
  if (!sec && fs::exists(lst) && !fs::is_regular_file(lst)) {
    // a symlink, device (/dev/null), FIFO...: write through it, never replace it
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out) throw Error(ErrorCode::kIo, path + ": cannot open for writing");
    out << text;
    out.close();
    if (!out) throw Error(ErrorCode::kIo, path + ": write error");
    return;
  }
  std::string tmp_name(1, '.');  // (built in steps: GCC 12 warns falsely on "." + string)
  tmp_name += p.filename().string();
  tmp_name += ".tmp";
  tmp_name += std::to_string(::getpid());
  const fs::path tmp = p.parent_path() / tmp_name;
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw Error(ErrorCode::kIo, path + ": cannot open for writing");
    out << text;
    out.close();
    if (!out) {
      std::error_code ec;
      fs::remove(tmp, ec);
      throw Error(ErrorCode::kIo, path + ": write error");
    }
  }
  std::error_code ec;
  fs::rename(tmp, p, ec);
  if (ec) {
    std::error_code ec2;
    fs::remove(tmp, ec2);
    throw Error(ErrorCode::kIo, path + ": cannot write (" + ec.message() + ")");
  }
}

int64_t budget_bytes_from_gib(double gib, const std::string& flag) {
  const std::string limits = " must be > 0 and at most " + fmt("%.0f", kMaxBudgetGib) + " (GiB per rank)";
  if (!std::isfinite(gib) || !(gib > 0) || gib > kMaxBudgetGib)
    throw Error(ErrorCode::kInvalidArgument, flag + " = " + fmt("%g", gib) + limits);
  const int64_t bytes = static_cast<int64_t>(std::llround(gib * 1073741824.0));
  if (bytes < 1)
    throw Error(ErrorCode::kInvalidArgument, flag + " = " + fmt("%g", gib) + " is less than one byte;" + limits);
  return bytes;
}

int64_t parse_budget_bytes(const std::string& text, const std::string& flag) {
  int64_t bytes = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, bytes);
  const bool digits = !text.empty() && text.find_first_not_of("-0123456789") == std::string::npos;
  if (!digits || (ec != std::errc() && ec != std::errc::result_out_of_range) || (ec == std::errc() && ptr != end))
    throw Error(ErrorCode::kInvalidArgument, flag + " = " + text + " is not a whole number of bytes");
  if (ec == std::errc::result_out_of_range || bytes < 1 || bytes > kMaxBudgetBytes)
    throw Error(ErrorCode::kInvalidArgument, flag + " = " + text + " must be > 0 and at most " +
                                                 std::to_string(kMaxBudgetBytes) + " (1 PiB per rank)");
  return bytes;
}


std::string fmt_int(int64_t v) {
  std::string s = std::to_string(v < 0 ? -v : v), out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return (v < 0 ? "-" : "") + out;
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

}  // namespace indexcp::cli
