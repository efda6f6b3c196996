// The layers of src/ (README "Repository map", docs/architecture.md): which folder may include which.
// core is backend-neutral and includes only the public headers and itself; the backends (cpu,
// cuda) build on core and never on each other (cuda uses comm's rank barrier for its device
// group); the tools (io, bench, cli) sit on top. A new include across the layers fails this test.
// One file is allowed across: bench's device buffers are the backend's DeviceBuffer
// (cuda/device_buffer.cuh, the CUDA runtime only), so that src/ has one RAII device allocation.
// Not enforced by the build yet (every folder compiles with src/ on its include path), and only
// includes are checked: cuda also calls the CPU backend's definitions of some public functions
// (IndexCache, gather_unit_bytes) through the public headers.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <set>
#include <string>

namespace {

namespace fs = std::filesystem;

const std::map<std::string, std::set<std::string>> kAllowed = {
    {"core", {"indexcp", "core"}},
    {"cpu", {"indexcp", "core", "cpu"}},
    {"comm", {"indexcp", "core", "comm"}},
    {"cuda", {"indexcp", "core", "comm", "cuda"}},
    {"nccl", {"indexcp", "core", "nccl"}},
    {"io", {"indexcp", "core", "io"}},
    {"bench", {"indexcp", "core", "bench"}},
    {"cli", {"indexcp", "core", "bench", "cli"}},
};
// Single headers a folder may include from a layer it may not otherwise include.
const std::map<std::string, std::set<std::string>> kAllowedFiles = {
    {"bench", {"cuda/device_buffer.cuh"}},
};

TEST(Layers, IncludesFollowTheLayers) {
  const fs::path src = fs::path(INDEXCP_SOURCE_DIR) / "src";
  const std::regex inc(R"re(#\s*include\s+"([^"]+)")re");
  int files = 0;
  for (const auto& e : fs::recursive_directory_iterator(src)) {
    if (!e.is_regular_file()) continue;
    const std::string ext = e.path().extension().string();
    if (ext != ".cpp" && ext != ".cu" && ext != ".cuh" && ext != ".hpp") continue;
    const std::string folder = fs::relative(e.path(), src).begin()->string();
    const auto allowed = kAllowed.find(folder);
    ASSERT_NE(allowed, kAllowed.end()) << "src/" << folder << " is a folder the layer table does not know";
    std::ifstream in(e.path());
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ++files;
    for (std::sregex_iterator it(text.begin(), text.end(), inc), end; it != end; ++it) {
      const std::string path = (*it)[1].str();
      EXPECT_EQ(path.find(".."), std::string::npos) << e.path() << " includes \"" << path << "\" through ..";
      const size_t slash = path.find('/');
      if (slash == std::string::npos) continue;  // the folder's own header
      const std::string to = path.substr(0, slash);
      if (!fs::is_directory(src / to) && to != "indexcp") continue;  // a system or third-party path
      const auto files_ok = kAllowedFiles.find(folder);
      if (files_ok != kAllowedFiles.end() && files_ok->second.count(path)) continue;
      EXPECT_TRUE(allowed->second.count(to)) << "src/" << folder << " may not include \"" << path << "\" ("
                                             << e.path().filename().string() << ")";
    }
  }
  EXPECT_GT(files, 40);
}

// A file allowed across the layers includes no project header, so it brings nothing else across.
TEST(Layers, AllowedFilesIncludeNoProjectHeader) {
  const fs::path src = fs::path(INDEXCP_SOURCE_DIR) / "src";
  const std::regex inc(R"re(#\s*include\s+"([^"]+)")re");
  for (const auto& [folder, paths] : kAllowedFiles)
    for (const std::string& path : paths) {
      std::ifstream in(src / path);
      ASSERT_TRUE(in.good()) << "src/" << path << " (allowed for src/" << folder << ") does not exist";
      const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      EXPECT_FALSE(std::regex_search(text, inc)) << "src/" << path << " includes a project header";
    }
}

}  // namespace
