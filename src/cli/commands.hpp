// The subcommands of the indexcp command (src/cli). Each returns the process exit status and
// throws indexcp::Error for bad input (exit 2) or runtime failures (exit 1); main() prints the
// one-line message.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace indexcp::cli {

/// 5492736 -> "5,492,736".
std::string fmt_int(int64_t v);
/// printf-style formatting of one double (`f` like "%.3f").
std::string fmt(const char* f, double v);

/// `indexcp run`: the main job (see run.cpp and `indexcp run --help`).
struct RunOptions {
  std::string backend = "auto";
  std::string data_dir;             ///< empty: the embedded default (data/minilm_stdlib)
  std::string keys_file, queries_file;
  bool synthetic = false;
  uint32_t seed = 1;
  int32_t requests = 0;             ///< 0: every request of the data (4 synthetic)
  int32_t tokens = 0;               ///< tokens per request; 0: all the data holds (33024 synthetic)
  int32_t prefill_tokens = 128;     ///< final prefill chunk per request
  int32_t steps = 3;                ///< decode steps
  int32_t query_len = 8;            ///< decode queries per request per step
  int32_t layers = 1;
  int32_t heads = 4;                ///< synthetic only (real data: the queries' head count)
  bool heads_given = false;         ///< --heads was on the command line (refused unless it matches real data)
  int32_t topk = 16;
  std::vector<std::string> kv_dtypes = {"nvfp4", "fp8"};
  std::vector<int32_t> page_sizes = {128, 256};
  std::vector<int32_t> tps = {2, 4};
  bool tps_given = false;           ///< --tp was on the command line (under `indexcp launch` it must be the group's W)
  std::vector<std::string> shardings = {"off", "on"};
  double capacity_budget_gib = 100.0;
  std::string json_path;
  bool quiet = false;
};
int run_command(const RunOptions& o);

/// `indexcp replay CASE_DIR --out DIR`.
int replay_command(const std::string& case_dir, const std::string& out_dir, const std::string& backend,
                   bool scores);

/// `indexcp capacity`.
struct CapacityOptions {
  std::string model = "minimax-m3";
  double budget_gib = 100.0;
  std::string budget_bytes;  ///< --budget-bytes as typed, parsed by the command (overrides budget_gib)
  bool budget_bytes_given = false;
  std::string kv_dtype = "nvfp4", index_dtype = "nvfp4";
  int32_t tp = 2, page_size = 128;
  std::string json_path;
};
int capacity_command(const CapacityOptions& o);

/// The one-line explanation of the difference between the planner and the upstream reference
/// point (5,492,736 vs 6,030,720 tokens, x1.098 at GB300 TP2 P128 NVFP4 KV + index), for the
/// model `model_name_or_file` (the built-in minimax-m3 by default) at `budget_bytes`.
std::string upstream_reference_note(const std::string& model_name_or_file, int64_t budget_bytes);

/// The one limit of every memory budget flag (--budget-gib, --budget-bytes, --capacity-budget-gib):
/// 1 PiB per rank.
constexpr int64_t kMaxBudgetBytes = int64_t{1} << 50;
constexpr double kMaxBudgetGib = static_cast<double>(kMaxBudgetBytes >> 30);  // 1048576
/// Bytes of a budget of `gib` GiB given by `flag`; Error (kInvalidArgument) naming the flag and the
/// limits unless 0 < gib <= kMaxBudgetGib and the budget is at least one byte.
int64_t budget_bytes_from_gib(double gib, const std::string& flag);
/// Parses a budget in bytes given by `flag` as typed: a decimal integer in 1 .. kMaxBudgetBytes;
/// Error naming the flag and quoting `text` otherwise (parsed here, not by CLI11, whose versions
/// differ beyond int64: one saturates, one refuses).
int64_t parse_budget_bytes(const std::string& text, const std::string& flag);

/// `indexcp config`.
struct ConfigOptions {
  std::string attention_config;  ///< JSON text, or @FILE
  int32_t tp = 1, page_size = 128, heads = 4, query_len = 1;
  std::string speculative_method;
  bool kv_connector = false;
};
int config_command(const ConfigOptions& o);

/// Writes `text` to `path` through a temporary file in the same directory and a rename, so that a
/// failure leaves nothing behind; a path that exists and is not a regular file (a symlink,
/// /dev/null, a FIFO) is written through instead, never replaced. Throws Error (kIo) naming the path.
void write_file_atomic(const std::string& path, const std::string& text);
/// Throws Error (kInvalidArgument) naming `flag` unless `path`'s directory exists (checked before
/// long work so that it cannot fail at the end).
void check_output_path(const std::string& path, const std::string& flag);

}  // namespace indexcp::cli
