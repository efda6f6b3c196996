// indexcp: the one error convention of the library.
//
// Every public function that can fail throws indexcp::Error (derived from std::runtime_error).
// The message names the offending argument (and value) and, where useful, what is supported.
// The library never aborts the process and never writes partial results on a refused call.
#pragma once

#include <stdexcept>
#include <string>

namespace indexcp {

/// What kind of failure an Error reports.
enum class ErrorCode {
  kInvalidArgument,  ///< a value, shape, dtype or range is wrong (names the argument)
  kUnsupported,      ///< a valid but unsupported combination (names what is supported)
  kIo,               ///< a file could not be read or written
  kRuntime,          ///< a device, allocation or communication failure
};

/// "kInvalidArgument" etc.: the enumerator's name (for messages and logs).
inline const char* error_code_name(ErrorCode c) {
  switch (c) {
    case ErrorCode::kInvalidArgument: return "kInvalidArgument";
    case ErrorCode::kUnsupported: return "kUnsupported";
    case ErrorCode::kIo: return "kIo";
    case ErrorCode::kRuntime: return "kRuntime";
  }
  return "?";
}

/// The single exception type thrown by the library.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& what) : std::runtime_error(what), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

/// Throws Error(kInvalidArgument, msg) unless cond holds. The message expression is evaluated
/// only on failure, so checks inside loops cost a comparison, not a string.
#define INDEXCP_REQUIRE(cond, msg)                                                    \
  do {                                                                                \
    if (!(cond)) throw ::indexcp::Error(::indexcp::ErrorCode::kInvalidArgument, (msg)); \
  } while (0)

/// Function form of INDEXCP_REQUIRE for cold paths (builds `msg` before the check).
inline void require(bool cond, const std::string& msg) {
  if (!cond) throw Error(ErrorCode::kInvalidArgument, msg);
}

}  // namespace indexcp
