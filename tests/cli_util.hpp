// Test helpers for running the built indexcp command (tests/test_cli.cpp, test_bad_inputs.cpp).
#pragma once

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#ifndef INDEXCP_CLI_PATH
#error "INDEXCP_CLI_PATH must name the built indexcp executable"
#endif

namespace cliutil {

/// The whole content of a file ("" when it cannot be read).
inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// Exit status and captured output of one command.
struct Result {
  int status = -1;
  std::string out, err;
};

/// Runs `indexcp ARGS` (ARGS already shell-quoted) in `cwd` (empty: the current directory), with
/// stdout and stderr captured through files in `dir`. A signal gives status 128 + signal. With
/// `timeout_s` > 0 it runs under `timeout -s KILL timeout_s`, so that a command that would block
/// (reading a FIFO) ends with status 137 instead of hanging the test.
inline Result run_cli(const std::string& args, const std::filesystem::path& dir,
                      const std::filesystem::path& cwd = {}, int timeout_s = 0) {
  const std::filesystem::path o = dir / "stdout.txt", e = dir / "stderr.txt";
  std::string cmd = std::string(timeout_s > 0 ? "timeout -s KILL " + std::to_string(timeout_s) + " " : "") + "'" +
                    INDEXCP_CLI_PATH + "' " + args + " >'" + o.string() + "' 2>'" + e.string() + "'";
  if (!cwd.empty()) cmd = "cd '" + cwd.string() + "' && " + cmd;
  const int rc = std::system(cmd.c_str());
  Result r;
  r.status = WIFEXITED(rc) ? WEXITSTATUS(rc) : 128 + (WIFSIGNALED(rc) ? WTERMSIG(rc) : 0);
  r.out = slurp(o);
  r.err = slurp(e);
  return r;
}

/// run_cli under a kill timeout of `seconds`.
inline Result run_cli_timeout(const std::string& args, const std::filesystem::path& dir, int seconds,
                              const std::filesystem::path& cwd = {}) {
  return run_cli(args, dir, cwd, seconds);
}

}  // namespace cliutil
