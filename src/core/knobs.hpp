// indexcp: the knob table, the one place every INDEXCP_* environment variable and every -D build
// switch is declared with its default and what it does (docs/knobs.md is generated from it by
// `indexcp knobs --markdown`; tests/test_knobs.cpp checks that the sources read no variable the
// table lacks, that the table lists nothing the sources do not read, and that docs/knobs.md is
// current). Internal to the library and its tools: not a public header.
#pragma once

#include <string>
#include <vector>

namespace indexcp::detail {

/// How a knob is set.
enum class KnobKind {
  kEnv,    ///< an environment variable read at run time
  kCmake,  ///< a CMake cache variable (cmake -DNAME=...)
  kMacro,  ///< a preprocessor switch of the CUDA sources (-DCMAKE_CUDA_FLAGS=-DNAME=...)
};
const char* to_string(KnobKind k);

struct Knob {
  const char* name;
  KnobKind kind;
  const char* default_value;  ///< "" when unset is the default
  const char* read_by;        ///< who reads it: library, launcher, command, benchmarks, tests, scripts, build
  const char* doc;
};

/// Every knob, grouped by who reads it.
const std::vector<Knob>& knob_table();

/// getenv(name) (null when unset or empty) for an environment knob of the table. A name the
/// table does not declare as kEnv throws Error(kRuntime): every read goes through the table.
const char* knob_env(const char* name);
/// The same, with a set but empty variable returned as "" (for knobs that refuse an empty value).
const char* knob_env_raw(const char* name);

/// The table as GitHub markdown (docs/knobs.md) or as aligned text (`indexcp knobs`).
std::string knob_markdown();
std::string knob_text();

}  // namespace indexcp::detail
