// `indexcp replay CASE_DIR --out DIR`: replay one indexer step stored as a case (src/io/replay.cpp
// does the work; this file is its command line).
#include <CLI/CLI.hpp>

#include <iostream>
#include <string>

#include "commands.hpp"
#include "indexcp/replay.hpp"
#include "subcommand.hpp"
#include "validators.hpp"

namespace indexcp::cli {

namespace {

class ReplayCommand final : public Subcommand {
 public:
  CLI::App* add(CLI::App& app) override {
    auto* rep = app.add_subcommand("replay", "Replay one indexer step stored as case.json + .npy arrays (spec/cases.md)");
    rep->add_option("CASE_DIR", case_dir_, "the case directory")->required();
    rep->add_option("--out", out_dir_, "output directory (topk.npy, report.json, scores.npy)")->required()->check(non_empty_path());
    rep->add_option("--backend", backend_, "cpu, cuda or auto")
        ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
        ->capture_default_str();
    rep->add_flag("--scores", scores_, "also write scores.npy (the replicated path's block scores)");
    rep->footer(
        "Exit status: 0 equal; 2 invalid case (nothing written); 3 the sharded/CP path differs from the replicated "
        "path; 4 the selection differs from expected_topk.npy (outputs are written in both cases).");
    return rep;
  }

  int run(int, char**) override {
    ReplayOptions opts;
    opts.backend = backend_;
    opts.scores = scores_;
    const ReplayResult r = replay_case(case_dir_, out_dir_, opts);
    std::cout << "indexcp replay: " << r.summary() << "\n";
    std::cout << "wrote";
    for (const auto& f : r.written) std::cout << " " << f;
    std::cout << " to " << out_dir_ << std::endl;
    if (!r.selections_equal_replicated)
      print_error("the " + r.path + " selection differs from the replicated path at " +
                  r.replicated_difference.describe("sharded", "replicated"));
    else if (r.has_expected && !r.expected_equal)
      print_error("expected_topk.npy differs at " + r.expected_difference.describe("expected", "got"));
    return r.exit_code();
  }

 private:
  std::string case_dir_, out_dir_, backend_ = "auto";
  bool scores_ = false;
};

}  // namespace

INDEXCP_SUBCOMMAND(20, "replay", ReplayCommand)

}  // namespace indexcp::cli
