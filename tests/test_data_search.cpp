// Where `indexcp run` finds its default data (src/cli/data_search.hpp): beside an installed
// binary, above a binary built inside a checkout, then the checkout compiled in; and when none
// holds it, an Error that lists every place looked, in order.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "data_search.hpp"
#include "indexcp/error.hpp"

using namespace indexcp;
namespace fs = std::filesystem;

namespace {

class DataSearch : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("indexcp_data_search_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  fs::path mkdir(const fs::path& rel) {
    fs::create_directories(root_ / rel);
    return root_ / rel;
  }
  fs::path root_;
};

const fs::path kInstalled = "../share/indexcp/data/minilm_stdlib";

TEST_F(DataSearch, AnInstalledBinaryFindsTheInstalledDataFirst) {
  const fs::path want = mkdir("prefix/share/indexcp/data/minilm_stdlib");
  mkdir("prefix/data/minilm_stdlib");  // also above the binary: the installed place wins
  const fs::path got = cli::find_default_data(root_ / "prefix/bin/indexcp", kInstalled, root_ / "checkout/data/minilm_stdlib");
  EXPECT_EQ(fs::weakly_canonical(got), fs::weakly_canonical(want));
}

TEST_F(DataSearch, ABinaryInsideACheckoutFindsTheCheckoutsData) {
  const fs::path want = mkdir("repo/data/minilm_stdlib");
  mkdir("repo/build/bin");
  const fs::path got = cli::find_default_data(root_ / "repo/build/bin/indexcp", kInstalled, root_ / "elsewhere");
  EXPECT_EQ(got, want);
}

TEST_F(DataSearch, TheCompiledInCheckoutComesLast) {
  const fs::path want = mkdir("checkout/data/minilm_stdlib");
  const fs::path got = cli::find_default_data(root_ / "build/bin/indexcp", kInstalled, want);
  EXPECT_EQ(got, want);
  // an unknown executable path still finds it
  EXPECT_EQ(cli::find_default_data(fs::path(), kInstalled, want), want);
}

TEST_F(DataSearch, MissingEverywhereListsEveryPlaceInOrder) {
  const fs::path exe = root_ / "a/bin/indexcp", compiled = root_ / "gone/data/minilm_stdlib";
  const std::vector<fs::path> cands = cli::default_data_candidates(exe, kInstalled, compiled);
  ASSERT_GE(cands.size(), 5u);
  EXPECT_EQ(cands.front(), (root_ / "a/share/indexcp/data/minilm_stdlib").lexically_normal());
  EXPECT_EQ(cands[1], root_ / "a/bin/data/minilm_stdlib");
  EXPECT_EQ(cands[2], root_ / "a/data/minilm_stdlib");
  EXPECT_EQ(cands.back(), compiled);
  EXPECT_EQ(cands[cands.size() - 2], fs::path("/data/minilm_stdlib"));  // up to the root
  try {
    cli::find_default_data(exe, kInstalled, compiled);
    if (fs::is_directory("/data/minilm_stdlib")) GTEST_SKIP() << "this machine has /data/minilm_stdlib";
    FAIL() << "no Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kIo);
    const std::string msg = e.what();
    size_t at = 0;
    for (const fs::path& c : cands) {  // every place, in the order searched
      const size_t p = msg.find("\n  " + c.string(), at);
      EXPECT_NE(p, std::string::npos) << c << " missing (or out of order) in: " << msg;
      if (p != std::string::npos) at = p + 1;
    }
    EXPECT_NE(msg.find("--synthetic"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--data DIR"), std::string::npos) << msg;
    EXPECT_NE(msg.find("tools/make_real_data.py"), std::string::npos) << msg;
  }
}

}  // namespace
