// What the subcommands of the indexcp command (src/cli, subcommand.hpp) share: number formatting,
// the one error line, output files and memory budgets.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace indexcp::cli {

/// 5492736 -> "5,492,736".
std::string fmt_int(int64_t v);
/// printf-style formatting of one double (`f` like "%.3f").
std::string fmt(const char* f, double v);

/// Prints "indexcp: error: MSG" on stderr as one line in one write (control bytes become spaces, a
/// huge message is cut): under `indexcp launch` a SIGTERM may follow at any moment, and a line
/// written in pieces could reach the launcher cut.
void print_error(const std::string& msg);

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

/// Writes `text` to `path` through a temporary file in the same directory and a rename, so that a
/// failure leaves nothing behind; a path that exists and is not a regular file (a symlink,
/// /dev/null, a FIFO) is written through instead, never replaced. Throws Error (kIo) naming the path.
void write_file_atomic(const std::string& path, const std::string& text);
/// Throws Error (kInvalidArgument) naming `flag` unless `path`'s directory exists (checked before
/// long work so that it cannot fail at the end).
void check_output_path(const std::string& path, const std::string& flag);

}  // namespace indexcp::cli
