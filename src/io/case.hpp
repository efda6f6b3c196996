// Internal: a case directory loaded and validated (spec/cases.md; docs/cli.md "The case format"):
// case.json and its .npy arrays, every refusal an Error naming the file. The replay
// (replay.cpp) runs what this loads. Not installed.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "indexcp/config.hpp"
#include "indexcp/error.hpp"
#include "indexcp/indexer.hpp"
#include "indexcp/npy.hpp"

namespace indexcp::io {

namespace fs = std::filesystem;

/// Throws Error(kInvalidArgument) "FILE: WHAT": the one form of every refusal of a case.
[[noreturn]] void invalid(const std::string& file, const std::string& what);

// Re-throws a library Error with the file it concerns in front.
template <class Fn>
auto with_file(const std::string& file, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const Error& e) {
    throw Error(e.code(), file + ": " + e.what());
  }
}

struct Case {
  fs::path dir;
  std::string json_path;
  bool decode = true;
  int32_t tp = 1, page_size = 128, heads = 4, query_len = 1;
  SelectionParams sel;
  float encode_scale = 1.0f;
  ResolvedConfig rc, rc_repl;
  std::vector<std::string> notes;

  int32_t B = 0, max_pages = 0;
  std::vector<int32_t> block_table, seq_lens, query_start;
  int64_t num_pages = 0;
  bool from_cache = false;
  npy::Array keys_arr;           // float32 [num_slots, 128] when !from_cache
  const float* keys() const { return keys_arr.data<float>(); }
  npy::Array cache;              // [num_pages, page_bytes] when from_cache
  std::vector<int64_t> used_slots;
  std::vector<uint8_t> q8;       // [rows, H, 128] E4M3
  int64_t rows = 0;
  bool has_expected = false;
  std::vector<int32_t> expected;

  std::string file(const char* name) const { return (dir / name).string(); }
  bool exists(const char* name) const {  // anything there (its loader reports what is wrong with it)
    std::error_code ec;
    return fs::exists(fs::symlink_status(dir / name, ec));
  }
};

/// Loads case.json into c (c.dir set): the configuration, resolved (c.rc) and replicated (c.rc_repl).
void load_case_json(Case& c);
/// Loads and validates the arrays beside it (after load_case_json).
void load_arrays(Case& c);
/// The host batch of a decode / prefill case (pointers into c).
DecodeBatch decode_batch(const Case& c);
PrefillBatch prefill_batch(const Case& c);

}  // namespace indexcp::io
