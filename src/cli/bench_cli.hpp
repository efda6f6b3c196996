// `indexcp bench`: registration of the subcommand and its options on the CLI11 app (bench.cpp).
#pragma once

#include <memory>

namespace CLI {
class App;
}

namespace indexcp::cli {

class BenchCommand {
 public:
  explicit BenchCommand(CLI::App& app);  ///< adds `bench` and its subcommands to app
  ~BenchCommand();
  bool parsed() const;
  /// Runs the parsed benchmark; returns the exit status (0, or 3 when selections differed).
  /// Errors propagate as indexcp::Error.
  int run(int argc, char** argv);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace indexcp::cli
