// The layers of src/ (README "Repository map", docs/architecture.md): which folder may include which.
// core is backend-neutral and includes only the public headers and itself; the backends (cpu,
// cuda) build on core and never on each other (cuda uses comm's rank barrier for its device
// group); the tools (io, bench, cli) sit on top. A new include across the layers fails this test.
// The build enforces the same table (cmake/indexcpLayers.cmake): each folder compiles with only
// the folders it may include on its include path (layers/<folder>/ in the build tree, one link per
// allowed folder, instead of src/), so a new include across the layers does not compile either;
// the layers.include_path.<folder> tests probe those include paths, and
// Layers.BuildTableMatchesThisTable keeps the build's copy of the table equal to kAllowed. Only
// includes are checked: an include through ".." is refused here (an include path cannot stop it),
// and cuda also calls the CPU backend's definitions of some public functions (IndexCache,
// gather_unit_bytes) through the public headers.
// One file is allowed across: bench's device buffers are the backend's DeviceBuffer
// (cuda/device_buffer.cuh, the CUDA runtime only), so that src/ has one RAII device allocation
// (kAllowedFiles; the build links that one file into layers/bench/cuda/).
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

// cmake/indexcpLayers.cmake states the table for the build as
// set(INDEXCP_LAYER_ALLOWED_<folder> <folders>...) (the public headers are always on the path).
TEST(Layers, BuildTableMatchesThisTable) {
  std::ifstream in(fs::path(INDEXCP_SOURCE_DIR) / "cmake" / "indexcpLayers.cmake");
  ASSERT_TRUE(in) << "cmake/indexcpLayers.cmake not found";
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::regex row(R"re(\nset\(INDEXCP_LAYER_ALLOWED_(\w+)((?: \w+)+)\))re");
  const std::regex word(R"(\w+)");
  std::map<std::string, std::set<std::string>> build;
  for (std::sregex_iterator it(text.begin(), text.end(), row), end; it != end; ++it) {
    std::set<std::string> to = {"indexcp"};
    const std::string list = (*it)[2].str();
    for (std::sregex_iterator w(list.begin(), list.end(), word), wend; w != wend; ++w) to.insert(w->str());
    EXPECT_TRUE(build.emplace((*it)[1].str(), to).second) << "INDEXCP_LAYER_ALLOWED_" << (*it)[1] << " set twice";
  }
  EXPECT_EQ(build, kAllowed);
  // and the single files: set(INDEXCP_LAYER_FILES_<folder> <folder>/<file>...)
  const std::regex files_row(R"re(\nset\(INDEXCP_LAYER_FILES_(\w+)((?: [\w./]+)+)\))re");
  const std::regex file_word(R"([\w./]+)");
  std::map<std::string, std::set<std::string>> build_files;
  for (std::sregex_iterator it(text.begin(), text.end(), files_row), end; it != end; ++it) {
    std::set<std::string> paths;
    const std::string list = (*it)[2].str();
    for (std::sregex_iterator w(list.begin(), list.end(), file_word), wend; w != wend; ++w) paths.insert(w->str());
    build_files.emplace((*it)[1].str(), paths);
  }
  EXPECT_EQ(build_files, kAllowedFiles);
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
