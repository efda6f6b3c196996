// `indexcp knobs`: the knob table (src/core/knobs.cpp; docs/knobs.md).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>

#include "core/knobs.hpp"
#include "subcommand.hpp"

namespace indexcp::cli {

namespace {

class KnobsCommand final : public Subcommand {
 public:
  CLI::App* add(CLI::App& app) override {
    auto* kno = app.add_subcommand("knobs", "List every INDEXCP_* environment variable and -D build switch, with its "
                                            "default and what it does");
    kno->add_flag("--markdown", markdown_, "print the table as markdown (docs/knobs.md)");
    return kno;
  }
  int run(int, char**) override {
    const std::string t = markdown_ ? indexcp::detail::knob_markdown() : indexcp::detail::knob_text();
    std::fwrite(t.data(), 1, t.size(), stdout);
    return 0;
  }

 private:
  bool markdown_ = false;
};

}  // namespace

INDEXCP_SUBCOMMAND(50, "knobs", KnobsCommand)

}  // namespace indexcp::cli
