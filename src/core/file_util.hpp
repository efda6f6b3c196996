// Reading input files and checking output paths that the caller names. Internal.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <new>
#include <string>
#include <system_error>
#include <vector>

#include "indexcp/error.hpp"

namespace indexcp::detail {

/// Largest JSON document read whole (case.json, model and attention-config files, meta.json, rank
/// reports).
inline constexpr std::uintmax_t kMaxTextFileBytes = std::uintmax_t{64} << 20;

/// The whole content of the file `path`, which must be a regular file (symbolic links followed)
/// of at most `max_bytes`. The file is opened without blocking and checked on the open descriptor,
/// so a FIFO (no writer: the read would block), a socket or a device (/dev/zero never ends) is
/// refused, and no more than the size fstat reports (at most max_bytes) is read. Errors: Error(kIo)
/// naming the path and, when not empty, `what` (e.g. "--keys"): no such file, is a directory, not
/// a regular file, too large, read error; Error(kRuntime) when the bytes do not fit in memory.
inline std::vector<uint8_t> read_regular_file(const std::string& path, const std::string& what,
                                              std::uintmax_t max_bytes) {
  const std::string by = what.empty() ? std::string() : " (" + what + ")";
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    if (e == ENOENT || e == ENOTDIR) throw Error(ErrorCode::kIo, path + ": no such file" + by);
    throw Error(ErrorCode::kIo, path + ": cannot open for reading (" + std::strerror(e) + ")" + by);
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw Error(ErrorCode::kIo, path + ": cannot determine the file type" + by);
  if (S_ISDIR(st.st_mode)) throw Error(ErrorCode::kIo, path + ": is a directory" + by);
  if (!S_ISREG(st.st_mode)) throw Error(ErrorCode::kIo, path + ": not a regular file (a FIFO, socket or device)" + by);
  const auto size = static_cast<std::uintmax_t>(st.st_size);
  if (size > max_bytes)
    throw Error(ErrorCode::kIo, path + ": " + std::to_string(size) + " bytes, more than the " + std::to_string(max_bytes) +
                                    " read for this input" + by);
  std::vector<uint8_t> buf;
  try {
    buf.resize(static_cast<std::size_t>(size));
  } catch (const std::bad_alloc&) {
    throw Error(ErrorCode::kRuntime, path + ": out of memory reading " + std::to_string(size) + " bytes" + by);
  }
  std::size_t got = 0;
  while (got < buf.size()) {  // (a file that grows after fstat is read up to its size then)
    const ssize_t n = ::read(fd, buf.data() + got, buf.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw Error(ErrorCode::kIo, path + ": read error (" + std::strerror(errno) + ")" + by);
    if (n == 0) break;
    got += static_cast<std::size_t>(n);
  }
  buf.resize(got);  // a file that shrank after fstat
  return buf;
}

/// A JSON (text) document: read_regular_file with the kMaxTextFileBytes limit.
inline std::string read_text_file(const std::string& path, const std::string& what) {
  const std::vector<uint8_t> b = read_regular_file(path, what, kMaxTextFileBytes);
  return std::string(b.begin(), b.end());
}

/// `dir` without a trailing "/" or "/." ("out/" and "out/." are "out"; "/" stays "/").
inline std::filesystem::path directory_name(const std::filesystem::path& dir) {
  std::filesystem::path d = dir.lexically_normal();
  while (!d.has_filename() && d.has_relative_path()) d = d.parent_path();
  return d;
}

/// Throws Error(kIo) naming `flag` unless `dir`, an output directory, can be used: it is a
/// directory, or it does not exist and its parent is a directory (only `dir` itself will be
/// created). A trailing "/" or "/." is ignored; a dangling symbolic link, a path that exists as
/// something else, and errors such as a symbolic-link loop are refused.
inline void check_output_directory(const std::filesystem::path& dir, const std::string& flag) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(dir, ec);
  if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory)
    throw Error(ErrorCode::kIo, dir.string() + ": " + ec.message() + " (" + flag + ")");
  if (fs::exists(st)) {
    if (!fs::is_directory(st)) throw Error(ErrorCode::kInvalidArgument, dir.string() + ": exists and is not a directory (" + flag + ")");
    return;
  }
  if (fs::exists(fs::symlink_status(dir, ec)))
    throw Error(ErrorCode::kIo, dir.string() + ": a symbolic link to nothing (" + flag + ")");
  const fs::path d = directory_name(dir);
  const fs::path parent = d.parent_path().empty() ? fs::path(".") : d.parent_path();
  const fs::file_status ps = fs::status(parent, ec);
  if (!fs::exists(ps)) throw Error(ErrorCode::kIo, dir.string() + ": directory " + parent.string() + " does not exist (" + flag + ")");
  if (!fs::is_directory(ps)) throw Error(ErrorCode::kIo, dir.string() + ": " + parent.string() + " is not a directory (" + flag + ")");
}

}  // namespace indexcp::detail
