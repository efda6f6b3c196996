// `indexcp run` (run.cpp): the main job's parts shared by its files. run_data.cpp loads or
// generates the keys and queries and derives one layer's workload from them; run_report.cpp turns
// the runs into the JSON report and the table; run.cpp declares the command and runs the steps.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "indexcp/config.hpp"
#include "indexcp/formats.hpp"

namespace indexcp::cli {

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
  std::vector<std::string> score_precisions = {"fp32"};  ///< indexer_score_precision values to run
  double capacity_budget_gib = 100.0;
  std::string json_path;
  bool quiet = false;
};
/// `indexcp run`: the main job; returns the exit status (0, or 3 when a sharded selection differed).
int run_command(const RunOptions& o);

// ---------------------------------------------------------------------------------------------
// Data: keys [R][T][128] and queries [R][Qn][H][128] for the last Qn positions of each request.

struct Data {
  std::string source, name, keys_path, queries_path;
  nlohmann::json meta;
  int32_t R = 0, T = 0, Qn = 0, H = 0;
  std::string keys_dtype = "float32", queries_dtype = "float32";
  std::vector<float> keys, queries;
  const float* key(int32_t r, int64_t pos) const { return keys.data() + (static_cast<int64_t>(r) * T + pos) * kHeadDim; }
  // query of request r at data position pos (pos >= T - Qn), head 0
  const float* query(int32_t r, int64_t pos) const {
    return queries.data() + ((static_cast<int64_t>(r) * Qn + (pos - (T - Qn))) * H) * kHeadDim;
  }
};

/// Loads and checks keys [requests, tokens, 128] and queries [requests, positions, heads, 128]
/// (float16 or float32 .npy, finite); Error naming the file otherwise.
Data load_files(const std::string& keys_path, const std::string& queries_path);
/// Synthetic keys with block-level structure and queries that point at a few earlier blocks.
Data make_synthetic(int32_t R, int32_t T, int32_t Qn, int32_t H, uint32_t seed);
/// The data step of `indexcp run`: checks the data options against the data, loads real data
/// (--data, --keys/--queries or the embedded default) or sizes synthetic data (generated later,
/// by make_synthetic, once the policy accepts some configuration). `rows_per_req` = prefill
/// tokens + steps x query length.
Data load_run_data(const RunOptions& o, int32_t rows_per_req);

// ---------------------------------------------------------------------------------------------
// One layer's workload (config-independent parts).

struct Workload {
  int32_t R = 0, L = 0, ctx0 = 0, pt = 0, S = 0, Q = 0, H = 0, K = 16;
  int64_t offset = 0;  // data position of window position 0
  int64_t rows_total = 0;
  std::vector<uint8_t> q_prefill;             // [R*pt][H][128] E4M3
  std::vector<std::vector<uint8_t>> q_decode; // per step [R*Q][H][128]
  std::vector<int32_t> reference;             // [rows_total][H][K]
};


/// The window of the data the options ask for (its quantized queries and reference are filled by
/// build_workload); Error when the window is too short for the prefill and decode positions.
Workload make_workload(const RunOptions& o, const Data& data, int32_t rows_per_req);
/// Quantizes the window's queries and computes the fp32 reference selections of every row. Row
/// order of every selection vector: the prefill rows (request-major), then each decode step's rows
/// (request-major).
void build_workload(const Data& d, Workload& w);

// ---------------------------------------------------------------------------------------------
// One configuration, and what its runs add up to over the layers.

struct Combo {
  KvDtype dtype;
  int32_t P, W;
  bool on;
  ScorePrecision prec = ScorePrecision::kFp32;
};
std::string combo_name(const Combo& c);

struct ConfigReport {
  Combo combo;
  ResolvedConfig rc;
  bool equal = true;
  std::string compared_with;
  std::vector<double> recall_per_head;
  /// fp8_mma runs: the fraction of (row, head) selections that differ from the fp32 mode's
  /// replicated run of the same kv_dtype (mean over layers); -1 when no fp32 run of it ran
  double differs_from_fp32 = -1;
  double insert_us = 0, prefill_us = 0, decode_us = 0;
  int64_t decode_bytes = 0, gather_reserved = 0, cache_bytes = 0, num_pages = 0;
  std::string decode_timing, prefill_timing;
  int layers = 0;
};


/// What the runs of every layer produced.
struct RunOutcome {
  std::vector<ConfigReport> reports;       ///< the listed configurations, in the grid's order
  nlohmann::json skipped = nlohmann::json::array();  ///< configurations the policy refused, with the reason
  std::string backend;                     ///< the backend that ran
  bool want_on = false;                    ///< --sharding included on
};

/// Where this process stands: one process simulating every rank (world 1), or rank `rank` of a
/// group of `world` processes started by `indexcp launch`.
struct RunPlace {
  int world = 1, rank = 0, device = 0;
  bool as_rank() const { return world > 1; }
};

/// The JSON report (`--json`) of the whole run; `t_start` is when the command started (now_s()).
nlohmann::json run_report(const RunOptions& o, const Data& data, const Workload& w, const RunOutcome& out,
                          const RunPlace& place, double t_start);
/// The table printed on stdout, made from the report.
std::string run_table(const RunOptions& o, const Data& data, const Workload& w, const RunOutcome& out,
                      const RunPlace& place, const nlohmann::json& report);

}  // namespace indexcp::cli
