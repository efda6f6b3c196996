// `indexcp launch --tp W [options] -- COMMAND [ARGS...]`: starts W processes of COMMAND, one per
// rank (see launch.cpp and README "Several processes"). Pure POSIX; works without CUDA and NCCL.
#pragma once

#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace indexcp::cli {

struct LaunchOptions {
  int tp = 0;                       ///< W, 1..64
  double timeout_s = 0.0;           ///< > 0: exported to the ranks as INDEXCP_NCCL_TIMEOUT_S
  double grace_s = 5.0;             ///< SIGTERM -> SIGKILL delay when the ranks are stopped
  double time_limit_s = 0.0;        ///< > 0: stop every rank after this wall time
  std::string report_path;          ///< write the merged report here (else printed when ranks wrote one)
  std::vector<std::string> command; ///< what each rank runs
};

/// Registers the `launch` subcommand on `app`, filling `o`.
CLI::App* add_launch_subcommand(CLI::App& app, LaunchOptions& o);

/// Runs the launch; returns the exit status (0 when every rank exited 0; else the first failed
/// rank's exit status, 1 when it was killed by a signal, the time limit passed or a rank could
/// not be started (pipe or fork failure: the ranks already started are stopped), 128 + signal
/// when the launcher was interrupted, 2 for a command that cannot be executed).
int launch_command(const LaunchOptions& o);

}  // namespace indexcp::cli
