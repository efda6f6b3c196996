// The indexcp command: run (the main job), replay, capacity, config, knobs, bench, launch. Each
// subcommand lives in its own file and registers itself (subcommand.hpp); this file parses the
// command line, runs the parsed subcommand and turns its failure into one line and an exit status.
//
// Exit status: 0 success; 1 runtime failure; 2 usage or input error (bad flag, missing or corrupt
// file, wrong dtype/shape, out-of-range value, refused configuration); 3 a sharded/CP selection
// differs from the replicated one; 4 (replay) the selection differs from expected_topk.npy.
// Every failure prints exactly one line "indexcp: error: ..." on stderr.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "commands.hpp"
#include "subcommand.hpp"
#include "indexcp/error.hpp"
#include "indexcp/tp_group.hpp"

#ifndef INDEXCP_VERSION
#define INDEXCP_VERSION "0"
#endif

namespace indexcp::cli {

namespace {

// Filled by the static initializers of the subcommands' files, before main().
std::vector<SubcommandEntry>& registry() {
  static std::vector<SubcommandEntry> r;
  return r;
}

int exit_code_of(const indexcp::Error& e) { return e.code() == indexcp::ErrorCode::kRuntime ? 1 : 2; }

}  // namespace

bool register_subcommand(SubcommandEntry e) {
  registry().push_back(e);
  return true;
}

std::vector<SubcommandEntry> registered_subcommands() {
  std::vector<SubcommandEntry> r = registry();
  std::stable_sort(r.begin(), r.end(), [](const SubcommandEntry& a, const SubcommandEntry& b) { return a.order < b.order; });
  return r;
}

namespace {

int real_main(int argc, char** argv) {
  CLI::App app{"indexcp: block-sparse attention indexer with a sharded NVFP4/FP8 index cache and indexer context "
               "parallelism (CPU reference backend" +
                   std::string(indexcp::cuda_available()    ? ", CUDA"
                               : indexcp::built_with_cuda() ? "; CUDA backend built, no GPU visible"
                                                            : "") +
                   ")",
               "indexcp"};
  app.set_version_flag("--version", std::string("indexcp ") + INDEXCP_VERSION);
  app.require_subcommand(0, 1);
  app.fallthrough(false);

  struct Added {
    std::unique_ptr<Subcommand> cmd;
    CLI::App* app;
  };
  std::vector<Added> subs;
  std::string names;
  for (const SubcommandEntry& e : registered_subcommands()) {
    auto cmd = e.make();
    CLI::App* a = cmd->add(app);
    subs.push_back({std::move(cmd), a});
    names += (names.empty() ? "" : ", ") + std::string(e.name);
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    return app.exit(e);  // --help, --version
  } catch (const CLI::ParseError& e) {
    // the hint names the subcommand being parsed: "see indexcp run --help"
    std::string where = "indexcp";
    for (const CLI::App* sub = &app;;) {
      const auto parsed = sub->get_subcommands();
      if (parsed.empty()) break;
      sub = parsed.front();
      where += " " + sub->get_name();
    }
    print_error(std::string(e.what()) + " (see " + where + " --help)");
    return 2;
  }
  for (auto& s : subs)
    if (s.app->parsed()) return s.cmd->run(argc, argv);
  print_error("a subcommand is required (" + names + ")");
  return 2;
}

}  // namespace

}  // namespace indexcp::cli

int main(int argc, char** argv) {
  using indexcp::cli::print_error;
  try {
    return indexcp::cli::real_main(argc, argv);
  } catch (const indexcp::Error& e) {
    print_error(e.what());
    return indexcp::cli::exit_code_of(e);
  } catch (const std::bad_alloc&) {
    print_error("out of memory");
    return 1;
  } catch (const std::exception& e) {
    print_error(e.what());
    return 1;
  } catch (...) {
    print_error("unknown failure");
    return 1;
  }
}
