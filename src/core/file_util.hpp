// Reading input files that the caller names (JSON documents, .npy arrays). Internal.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>

#include "indexcp/error.hpp"

namespace indexcp::detail {

/// Largest JSON document read whole (case.json, model and attention-config files, meta.json).
inline constexpr std::uintmax_t kMaxTextFileBytes = std::uintmax_t{64} << 20;

/// Throws Error(kIo) unless `path` names a regular file (symbolic links followed): a missing path,
/// a directory, a FIFO, a socket or a device (reading one would block or never end) is refused.
/// `what` (e.g. "--keys"), when not empty, is named in the message.
inline void require_regular_file(const std::string& path, const std::string& what) {
  namespace fs = std::filesystem;
  const std::string by = what.empty() ? std::string() : " (" + what + ")";
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) throw Error(ErrorCode::kIo, path + ": no such file" + by);
  if (fs::is_directory(st)) throw Error(ErrorCode::kIo, path + ": is a directory" + by);
  if (!fs::is_regular_file(st))
    throw Error(ErrorCode::kIo, path + ": not a regular file (a FIFO, socket or device)" + by);
}

/// The whole content of the regular file `path`, at most `max_bytes` long (require_regular_file's
/// errors, then a size refusal; kIo on read errors).
inline std::string read_text_file(const std::string& path, const std::string& what,
                                  std::uintmax_t max_bytes = kMaxTextFileBytes) {
  require_regular_file(path, what);
  const std::string by = what.empty() ? std::string() : " (" + what + ")";
  std::error_code ec;
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec) throw Error(ErrorCode::kIo, path + ": cannot determine the file size" + by);
  if (size > max_bytes)
    throw Error(ErrorCode::kIo, path + ": " + std::to_string(size) + " bytes, more than the " +
                                    std::to_string(max_bytes >> 20) + " MiB read for a JSON document" + by);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorCode::kIo, path + ": cannot open for reading" + by);
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw Error(ErrorCode::kIo, path + ": read error" + by);
  return ss.str();
}

}  // namespace indexcp::detail
