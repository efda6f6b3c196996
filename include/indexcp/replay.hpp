// indexcp: replay of one indexer step stored on disk (spec/cases.md).
//
// A case directory holds case.json and .npy arrays (block_table, seq_lens, keys or cache, q,
// query_start for prefill, optional expected_topk). replay_case() loads and validates the whole
// case first (every refusal is an Error whose message starts with the offending file's path and
// says what is wrong), runs it through a TpIndexer on the chosen backend (all W ranks; each
// head's selection from its owner rank), runs the replicated path too when sharding or decode CP
// is on, compares, and only then writes topk.npy, report.json and (optionally) scores.npy into
// the output directory. An invalid case writes nothing into the output directory.
//
// A case with cache.npy (raw replicated cache bytes instead of keys) is replayed on the CPU
// backend: the bytes are split into rank shards with the library's PageLayout, and the CPU
// entry points (decode_select, icp_decode, decode_cp_replicated, prefill_select,
// prefill_gather, prefill_local_score) run on W threads. With --backend cuda such a case is
// refused (kUnsupported); with auto it runs on the CPU and the report says so.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace indexcp {

/// Options of a replay.
struct ReplayOptions {
  std::string backend = "cpu";  ///< "cpu" | "cuda" | "auto"
  bool scores = false;          ///< also write scores.npy (the replicated path's block scores)
};

/// The first (row, head) where two selections differ.
struct TopkDifference {
  bool found = false;
  int64_t row = -1;
  int32_t head = -1;
  std::vector<int32_t> a, b;  ///< the two id lists at (row, head)
  /// "row R, head H: <name_a> [..] vs <name_b> [..]".
  std::string describe(const std::string& name_a, const std::string& name_b) const;
};

/// Compares two int32 [rows, heads, topk] selections; returns the first differing (row, head).
TopkDifference first_difference(const int32_t* a, const int32_t* b, int64_t rows, int32_t heads,
                                int32_t topk);

/// What a replay did.
struct ReplayResult {
  std::string backend;                     ///< backend that ran the case
  std::string path;                        ///< the path that produced topk.npy, in words
  bool compared_with_replicated = false;   ///< sharding or decode CP was on: replicated run too
  bool selections_equal_replicated = true;
  TopkDifference replicated_difference;    ///< sharded/CP (a) vs replicated (b)
  bool has_expected = false;
  bool expected_equal = true;
  TopkDifference expected_difference;      ///< expected_topk.npy (a) vs topk (b)
  std::vector<int32_t> topk;               ///< [rows, heads, topk]
  int64_t rows = 0;
  int32_t heads = 0, topk_k = 0;
  std::string report_json;                 ///< what report.json holds
  std::vector<std::string> written;        ///< files written into the output directory

  /// 0 when everything agrees, 3 when the sharded/CP path differs from the replicated path,
  /// 4 when only expected_topk.npy differs.
  int exit_code() const;
  /// A one-line summary for a terminal.
  std::string summary() const;
};

/// Loads, validates, runs and compares a case and writes its outputs into out_dir (created if
/// needed; an existing non-directory is refused). Throws Error on an invalid case (nothing
/// written), on an unsupported backend, or (kRuntime/kIo) when the outputs cannot be written.
ReplayResult replay_case(const std::string& case_dir, const std::string& out_dir,
                         const ReplayOptions& opts = {});

}  // namespace indexcp
