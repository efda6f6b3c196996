// The knob table (src/core/knobs.cpp) is the one list of every INDEXCP_* environment variable and
// -D build switch: the sources read nothing it lacks, it lists nothing they do not read, every
// read goes through it, and docs/knobs.md is what `indexcp knobs --markdown` prints. What the
// scan sees: getenv / knob_env / env_or_null in C++, $NAME and ${NAME...} in scripts, os.environ
// reads in Python, option() / set(... CACHE) in CMake, #ifdef / #ifndef switches in src/cuda
// (not `#if NAME`, which the sources use only for macros they define themselves).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <set>
#include <string>

#include "core/knobs.hpp"
#include "indexcp/error.hpp"

namespace {

namespace fs = std::filesystem;
using indexcp::detail::KnobKind;

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

bool has_ext(const fs::path& p, std::initializer_list<const char*> exts) {
  const std::string e = p.extension().string();
  for (const char* x : exts)
    if (e == x) return true;
  return false;
}

// (name, kind) -> the first file that uses it, from the repository's sources and scripts.
std::map<std::pair<std::string, KnobKind>, std::string> knobs_in_sources() {
  const fs::path root = INDEXCP_SOURCE_DIR;
  std::map<std::pair<std::string, KnobKind>, std::string> found;
  const std::regex cxx_env(R"re((?:getenv|knob_env|knob_env_raw|env_or_null)\(\s*"((?:INDEXCP|BENCH)_[A-Z0-9_]+)")re");
  // every $NAME / ${NAME...} of ours in a script, except the script's own arrays (NAME=( ... ))
  const std::regex sh_env(R"re(\$\{?((?:INDEXCP|BENCH)_[A-Z0-9_]+))re");
  const std::regex py_env(
      R"re((?:os\.environ\.get|os\.environ\.setdefault|os\.getenv|os\.environ\[|environ\.get)\(?\s*["'](INDEXCP_[A-Z0-9_]+)["']|["'](INDEXCP_[A-Z0-9_]+)["']\s+in\s+os\.environ)re");
  const std::regex cmake_opt(R"re(option\((INDEXCP_[A-Z0-9_]+))re");
  const std::regex cmake_cache(R"re(set\((INDEXCP_[A-Z0-9_]+)\s[^)]*\bCACHE\b)re");
  const std::regex macro(R"re(#\s*if(?:n?def)\s+(INDEXCP_[A-Z0-9_]+))re");
  auto scan = [&](const fs::path& file, const std::regex& re, KnobKind kind) {
    const std::string text = read_file(file);
    for (std::sregex_iterator it(text.begin(), text.end(), re), end; it != end; ++it) {
      const std::string name = (*it)[1].matched ? (*it)[1].str() : (*it)[2].str();
      if (&re == &sh_env && std::regex_search(text, std::regex("(^|\\n)\\s*" + name + "=\\(")))
        continue;  // a script's own array, not the environment
      found.emplace(std::make_pair(name, kind), fs::relative(file, root).string());
    }
  };
  for (const char* dir : {"src", "include", "tests", "examples", "bench", "scripts", "tools", "fuzz", "cmake", "python", ".ci"}) {
    if (!fs::is_directory(root / dir)) continue;
    for (const auto& e : fs::recursive_directory_iterator(root / dir)) {
      if (!e.is_regular_file()) continue;
      const fs::path& p = e.path();
      if (p.string().find("/results/") != std::string::npos || p.filename() == "test_knobs.cpp") continue;
      if (has_ext(p, {".cpp", ".cu", ".cuh", ".hpp", ".h"})) {
        scan(p, cxx_env, KnobKind::kEnv);
        if (p.string().find("/src/cuda/") != std::string::npos) scan(p, macro, KnobKind::kMacro);
      }
      if (has_ext(p, {".sh"}) || p.filename() == "run") scan(p, sh_env, KnobKind::kEnv);
      if (has_ext(p, {".py"})) scan(p, py_env, KnobKind::kEnv);
      if (has_ext(p, {".cmake"}) || p.filename() == "CMakeLists.txt") {
        scan(p, cmake_opt, KnobKind::kCmake);
        scan(p, cmake_cache, KnobKind::kCmake);
      }
    }
  }
  for (const fs::path p : {root / "CMakeLists.txt"}) {
    scan(p, cmake_opt, KnobKind::kCmake);
    scan(p, cmake_cache, KnobKind::kCmake);
  }
  return found;
}

TEST(Knobs, TheTableListsExactlyWhatTheSourcesRead) {
  const auto found = knobs_in_sources();
  ASSERT_GT(found.size(), 20u) << "the scan found almost nothing: is INDEXCP_SOURCE_DIR right?";
  std::set<std::pair<std::string, KnobKind>> table;
  for (const auto& k : indexcp::detail::knob_table()) {
    EXPECT_TRUE(table.emplace(k.name, k.kind).second) << k.name << " is declared twice as " << to_string(k.kind);
    EXPECT_GT(std::string(k.doc).size(), 10u) << k.name << " has no doc";
  }
  for (const auto& [key, file] : found)
    EXPECT_TRUE(table.count(key)) << key.first << " (" << to_string(key.second) << ") is read by " << file
                                  << " but not declared in src/core/knobs.cpp";
  for (const auto& key : table)
    EXPECT_TRUE(found.count(key)) << key.first << " (" << to_string(key.second)
                                  << ") is declared in src/core/knobs.cpp but nothing reads it";
}

TEST(Knobs, ReadsGoThroughTheTable) {
  EXPECT_THROW(indexcp::detail::knob_env("INDEXCP_NOT_A_KNOB"), indexcp::Error);
  EXPECT_THROW(indexcp::detail::knob_env("INDEXCP_SCORE_WARPS"), indexcp::Error);  // a build switch, not an env knob
  ::setenv("INDEXCP_SOAK_STEPS", "", 1);
  EXPECT_EQ(indexcp::detail::knob_env("INDEXCP_SOAK_STEPS"), nullptr);  // empty reads as unset
  ::setenv("INDEXCP_SOAK_STEPS", "12", 1);
  ASSERT_NE(indexcp::detail::knob_env("INDEXCP_SOAK_STEPS"), nullptr);
  EXPECT_STREQ(indexcp::detail::knob_env("INDEXCP_SOAK_STEPS"), "12");
  ::unsetenv("INDEXCP_SOAK_STEPS");
  // no source reads an INDEXCP_ variable with a plain getenv outside the table's function and the
  // tests (library, command, benchmarks: src/)
  const std::regex plain(R"re(getenv\(\s*"(INDEXCP|BENCH)_)re");
  for (const auto& e : fs::recursive_directory_iterator(fs::path(INDEXCP_SOURCE_DIR) / "src")) {
    if (!e.is_regular_file()) continue;
    const std::string text = read_file(e.path());
    EXPECT_FALSE(std::regex_search(text, plain)) << e.path() << " reads an INDEXCP_ / BENCH_ variable without knob_env";
  }
}

TEST(Knobs, DocsKnobsMdIsTheGeneratedTable) {
  const fs::path doc = fs::path(INDEXCP_SOURCE_DIR) / "docs" / "knobs.md";
  const std::string text = read_file(doc);
  ASSERT_FALSE(text.empty()) << doc;
  EXPECT_NE(text.find(indexcp::detail::knob_markdown()), std::string::npos)
      << doc << " is not current: regenerate its table with `build/bin/indexcp knobs --markdown`";
}

}  // namespace
