// indexcp command: where the default real data of `indexcp run` is found (docs/cli.md).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace indexcp::cli {

/// The data set's directory name: data/minilm_stdlib in the checkout,
/// share/indexcp/data/minilm_stdlib in an installed prefix (cmake/indexcpInstall.cmake).
inline constexpr const char* kDefaultDataName = "minilm_stdlib";

/// The places `indexcp run` looks for its default data, in order, for an executable at `exe`:
///   1. <exe's directory>/`installed` (an installed binary, relocatable: `installed` is the data
///      directory relative to the binary's, ../share/indexcp/data/minilm_stdlib by default)
///   2. <each directory above exe>/data/minilm_stdlib           (a binary built inside a checkout)
///   3. `compiled_in`                                           (the checkout the binary was built from)
/// `exe` empty (its path unknown) leaves out 1 and 2; `installed` empty leaves out 1.
std::vector<std::filesystem::path> default_data_candidates(const std::filesystem::path& exe,
                                                           const std::filesystem::path& installed,
                                                           const std::filesystem::path& compiled_in);

/// The first candidate that is a directory. Throws Error(kIo) listing every place looked, with
/// what to do (tools/make_real_data.py, --data, --keys/--queries, --synthetic), when none is.
std::filesystem::path find_default_data(const std::filesystem::path& exe, const std::filesystem::path& installed,
                                        const std::filesystem::path& compiled_in);

/// This process's executable (/proc/self/exe); empty when it cannot be read.
std::filesystem::path self_executable();

}  // namespace indexcp::cli
