// Option validators shared by the subcommands (CLI11).
#pragma once

#include <string>

#include <CLI/CLI.hpp>

namespace indexcp::cli {

/// A file or directory name that may not be empty: `--json ''` is refused rather than taken for
/// "not given".
inline CLI::Validator non_empty_path() {
  return CLI::Validator([](std::string& s) { return s.empty() ? std::string("an empty file name") : std::string(); },
                        "FILE");
}

}  // namespace indexcp::cli
