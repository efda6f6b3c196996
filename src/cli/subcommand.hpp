// The subcommands of the indexcp command. Each lives in its own source file of src/cli, declares
// its options and runs itself, and registers itself with INDEXCP_SUBCOMMAND(order, Type); main.cpp
// knows none of them by name. `order` is the place in `indexcp --help` (run first, launch last).
#pragma once

#include <memory>
#include <vector>

namespace CLI {
class App;
}

namespace indexcp::cli {

class Subcommand {
 public:
  virtual ~Subcommand() = default;
  /// Adds the subcommand and its options to `app`; returns it (main asks it whether it was parsed).
  virtual CLI::App* add(CLI::App& app) = 0;
  /// Runs the parsed subcommand: returns the exit status (main.cpp lists them); throws Error for
  /// bad input (exit 2) or a runtime failure (exit 1). argv is the whole command line (records
  /// store it).
  virtual int run(int argc, char** argv) = 0;
};

struct SubcommandEntry {
  int order;
  const char* name;
  std::unique_ptr<Subcommand> (*make)();
};

/// Called by INDEXCP_SUBCOMMAND before main(); returns true.
bool register_subcommand(SubcommandEntry e);
/// Every registered subcommand, by `order`.
std::vector<SubcommandEntry> registered_subcommands();

}  // namespace indexcp::cli

/// Registers `Type` (a Subcommand with a default constructor) as subcommand `name` at `order`;
/// used inside namespace indexcp::cli, with `Type` an unqualified name.
#define INDEXCP_SUBCOMMAND(order, name, Type)                                                       \
  namespace {                                                                                        \
  const bool indexcp_registered_##Type = ::indexcp::cli::register_subcommand(                        \
      {order, name, []() -> std::unique_ptr<::indexcp::cli::Subcommand> { return std::make_unique<Type>(); }}); \
  }
