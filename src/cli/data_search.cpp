#include "data_search.hpp"

#include <system_error>

#include "indexcp/error.hpp"

namespace indexcp::cli {

namespace fs = std::filesystem;

std::vector<fs::path> default_data_candidates(const fs::path& exe, const fs::path& installed,
                                              const fs::path& compiled_in) {
  std::vector<fs::path> out;
  if (!exe.empty()) {
    const fs::path bin = exe.parent_path();
    if (!installed.empty()) out.push_back((bin / installed).lexically_normal());
    for (fs::path p = bin; !p.empty(); p = p.parent_path()) {
      out.push_back(p / "data" / kDefaultDataName);
      if (p == p.root_path()) break;
    }
  }
  if (!compiled_in.empty()) out.push_back(compiled_in);
  return out;
}

fs::path find_default_data(const fs::path& exe, const fs::path& installed, const fs::path& compiled_in) {
  const std::vector<fs::path> cands = default_data_candidates(exe, installed, compiled_in);
  std::error_code ec;
  for (const fs::path& c : cands)
    if (fs::is_directory(c, ec)) return c;
  std::string looked;
  for (const fs::path& c : cands) looked += "\n  " + c.string();
  throw Error(ErrorCode::kIo,
              "the default real data is missing: run tools/make_real_data.py to produce it, pass --data DIR or "
              "--keys/--queries, or use --synthetic; looked in, in order:" +
                  looked);
}

fs::path self_executable() {
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? fs::path() : exe;
}

}  // namespace indexcp::cli
