// `indexcp run`'s report (run.hpp): the JSON written by --json and the table printed on stdout.
#include <cstdio>
#include <sstream>

#include "commands.hpp"
#include "core/clock.hpp"
#include "core/knobs.hpp"
#include "indexcp/capacity.hpp"
#include "indexcp/nccl.hpp"
#include "run.hpp"

#ifndef INDEXCP_VERSION
#define INDEXCP_VERSION "0"
#endif

namespace indexcp::cli {

using json = nlohmann::json;
using detail::now_s;

namespace {

// The report's capacity section: the stated budget, TP2 P128, NVFP4 KV and index.
int64_t capacity_budget(const RunOptions& o) {
  return budget_bytes_from_gib(o.capacity_budget_gib, "--capacity-budget-gib");
}

CapacityReport capacity_of(const RunOptions& o) {
  return plan_capacity(ModelDesc::builtin("minimax-m3"), capacity_budget(o), KvDtype::kNvfp4, KvDtype::kNvfp4, 2, 128);
}

json capacity_json(const RunOptions& o) {
  const CapacityReport cap = capacity_of(o);
  json capj = json::parse(cap.to_json());
  capj["budget_gib_per_rank"] = o.capacity_budget_gib;
  capj["note"] = upstream_reference_note("minimax-m3", capacity_budget(o));
  if (cap.off.tokens == 0) capj["ratio"] = nullptr;  // fewer than one page fits: no ratio
  return capj;
}

}  // namespace

json run_report(const RunOptions& o, const Data& data, const Workload& w, const RunOutcome& out,
                const RunPlace& place, double t_start) {
  bool all_equal = true;
  int sharded_runs = 0;  // listed configurations whose index cache really was sharded
  json configs = json::array();
  for (const auto& r : out.reports) {
    if (r.combo.on && r.rc.sharding) ++sharded_runs;
    double recall = 0;
    for (double x : r.recall_per_head) recall += x / static_cast<double>(r.recall_per_head.size());
    all_equal = all_equal && r.equal;
    configs.push_back({{"kv_dtype", to_string(r.combo.dtype)},
                       {"page_size", r.combo.P},
                       {"tp", r.combo.W},
                       {"sharding", r.combo.on ? "on" : "off"},
                       {"score_precision", to_string(r.combo.prec)},
                       {"selections_differing_from_fp32",
                        r.differs_from_fp32 < 0 ? json(nullptr) : json(r.differs_from_fp32)},
                       {"bytes_per_token_per_layer_per_rank", r.rc.index_bytes_per_token_per_layer_per_rank},
                       {"selections_equal_replicated", r.equal},
                       {"compared_with", r.compared_with},
                       {"recall_vs_fp32", recall},
                       {"recall_vs_fp32_per_head", r.recall_per_head},
                       {"us_per_layer_per_rank", r.decode_us},
                       {"prefill_us_per_layer_per_rank", r.prefill_us},
                       {"decode_timing", r.decode_timing},
                       {"prefill_timing", r.prefill_timing},
                       {"insert_us_per_layer", r.insert_us},
                       {"decode_bytes_exchanged_per_rank", r.decode_bytes},
                       {"prefill_gather_reserved_bytes", r.gather_reserved},
                       {"cache_bytes_per_rank", r.cache_bytes},
                       {"num_pages", r.num_pages},
                       {"resolved_config", json::parse(r.rc.to_json())}});
  }
  json dataj = {{"source", data.source},
                {"name", data.name},
                {"tokens", static_cast<int64_t>(w.R) * w.L},
                {"requests", w.R},
                {"tokens_per_request", w.L},
                {"heads", w.H}};
  if (!data.keys_path.empty()) {
    dataj["keys"] = data.keys_path;
    dataj["queries"] = data.queries_path;
    dataj["keys_dtype"] = data.keys_dtype;
    dataj["queries_dtype"] = data.queries_dtype;
    dataj["tokens_in_data_per_request"] = data.T;
  } else {
    dataj["seed"] = o.seed;
  }
  if (data.meta.is_object()) {  // meta.json's short entries (provenance), not long lists
    json m = json::object();
    for (auto it = data.meta.begin(); it != data.meta.end(); ++it)
      if (it.value().dump().size() <= 2048) m[it.key()] = it.value();
    dataj["meta"] = m;
  }
  json report = {
      {"indexcp_version", INDEXCP_VERSION},
      {"backend", out.backend},
      {"data", dataj},
      {"workload",
       {{"layers", o.layers},
        {"requests", w.R},
        {"tokens_per_request", w.L},
        {"window_start_in_data", w.offset},
        {"inserted_directly_per_request", w.ctx0},
        {"prefill_tokens_per_request", w.pt},
        {"decode_steps", w.S},
        {"decode_query_len", w.Q},
        {"heads", w.H},
        {"topk", w.K},
        {"init_blocks", 0},
        {"local_blocks", 1},
        {"prefill_mode_when_sharded", "gather"},
        {"rows_compared_per_layer", w.rows_total},
        {"encode_scale", 1.0}}},
      {"configs", configs},
      {"skipped", out.skipped},
      {"all_selections_equal_replicated", all_equal},
      {"sharded_configurations_run", sharded_runs},
      {"capacity", capacity_json(o)},
      {"definitions",
       {{"us_per_layer_per_rank",
         "mean over decode steps of one rank's busy time (StepStats.us_per_rank, averaged over ranks) for one "
         "decode step of one layer"},
        {"prefill_us_per_layer_per_rank", "the same for the prefill chunk"},
        {"recall_vs_fp32",
         "|fp32-reference blocks ∩ selected blocks| / |fp32-reference blocks| per (row, head), the forced local "
         "block included, averaged over all prefill and decode rows, then over heads; the reference scores blocks "
         "by max over tokens of dot(q, k) in double from the unquantized fp32 keys and queries"},
        {"selections_differing_from_fp32",
         "fp8_mma runs: the share of (row, head) selections, over every prefill and decode row, whose block lists "
         "differ from the fp32 mode's replicated run of the same kv_dtype (null: fp32 mode, or no fp32 run)"},
        {"selections_equal_replicated",
         "sharding on: bit-for-bit equal to the sharding-off run of the same kv_dtype, score precision, page size "
         "and TP on every prefill and decode step; sharding off: equal to the first sharding-off run of the same "
         "kv_dtype and score precision"}}},
      {"wall_s", now_s() - t_start}};
  {  // the commit that ran, as the bench records carry it (INDEXCP_GIT_REV, set by the device scripts)
    const char* rev = detail::knob_env("INDEXCP_GIT_REV");
    report["git_rev"] = (rev && *rev) ? rev : "unknown";
  }
  report["processes"] = place.as_rank() ? place.world : 1;  // spec/bench.md's fields: ranks as processes, GPUs used
  report["num_gpus"] = place.as_rank() ? place.world : (out.backend == "cuda" ? 1 : 0);
  if (place.as_rank()) {
    report["nccl"] = nccl::version();
    report["definitions"]["us_per_layer_per_rank"] =
        "mean over decode steps of rank 0's busy time (its GPU work and its NCCL exchanges, one process per rank) "
        "for one decode step of one layer";
  }
  return report;
}

std::string run_table(const RunOptions& o, const Data& data, const Workload& w, const RunOutcome& out,
                      const RunPlace& place, const json& report) {
  const json& configs = report["configs"];
  const bool all_equal = report["all_selections_equal_replicated"].get<bool>();
  const int sharded_runs = report["sharded_configurations_run"].get<int>();
  const CapacityReport cap = capacity_of(o);
  std::ostringstream os;
  const auto plural = [](int64_t n, const char* one, const char* many) { return std::to_string(n) + (n == 1 ? one : many); };
  os << "indexcp run: " << data.source << " data \"" << data.name << "\", " << plural(w.R, " request", " requests") << " x "
     << w.L << " tokens, " << plural(o.layers, " layer", " layers") << ", backend " << out.backend
     << (place.as_rank() ? ", TP" + std::to_string(place.world) + " across " + std::to_string(place.world) +
                       " processes (one GPU each, NCCL; times of rank 0)"
                 : std::string())
     << "\n";
  os << "  per request: " << w.ctx0 << " tokens inserted directly, a " << w.pt
     << "-token prefill chunk (gather mode when sharded), " << plural(w.S, " decode step", " decode steps") << " x "
     << plural(w.Q, " query", " queries") << "; H = " << w.H << ", top-" << w.K << "\n\n";
  char line[320];
  // the precision columns only when an fp8_mma run is in the table
  bool any_fp8 = false;
  for (const auto& c : configs) any_fp8 = any_fp8 || c["score_precision"] == "fp8_mma";
  std::snprintf(line, sizeof line, "%-8s %5s %3s %-8s %12s %10s %9s %14s %14s", "kv_dtype", "P", "TP", "sharding",
                "B/token/rank", "sel==repl", "recall", "decode us/rank", "prefill us/rank");
  os << line;
  if (any_fp8) {
    std::snprintf(line, sizeof line, " %-9s %9s", "precision", "!=fp32");
    os << line;
  }
  os << "\n";
  for (const auto& c : configs) {
    std::snprintf(line, sizeof line, "%-8s %5d %3d %-8s %12lld %10s %9.4f %14.0f %14.0f",
                  c["kv_dtype"].get<std::string>().c_str(), c["page_size"].get<int>(), c["tp"].get<int>(),
                  c["sharding"].get<std::string>().c_str(),
                  static_cast<long long>(c["bytes_per_token_per_layer_per_rank"].get<int64_t>()),
                  c["selections_equal_replicated"].get<bool>() ? "yes" : "NO", c["recall_vs_fp32"].get<double>(),
                  c["us_per_layer_per_rank"].get<double>(), c["prefill_us_per_layer_per_rank"].get<double>());
    os << line;
    if (any_fp8) {
      const json& d = c["selections_differing_from_fp32"];
      const std::string diff = d.is_null() ? "-" : fmt("%.4f", d.get<double>());
      std::snprintf(line, sizeof line, " %-9s %9s", c["score_precision"].get<std::string>().c_str(), diff.c_str());
      os << line;
    }
    os << "\n";
  }
  if (any_fp8)
    os << "!=fp32: share of (row, head) selections that differ from the fp32 mode's replicated run of the same "
          "kv_dtype (fp8_mma rows; - where the grid has no fp32 run of it; the cpu backend computes exact scores in "
          "both modes)\n";
  {  // how the times were taken (the same for every configuration of one backend)
    std::string dt, pt;
    for (const auto& c : configs) {
      if (dt.empty()) dt = c["decode_timing"].get<std::string>();
      if (pt.empty()) pt = c["prefill_timing"].get<std::string>();
    }
    if (!dt.empty()) os << "decode us/rank: " << dt << "\n";
    if (!pt.empty()) os << "prefill us/rank: " << pt << "\n";
  }
  for (const auto& s : out.skipped)
    os << "skipped: " << s["kv_dtype"].get<std::string>() << " P" << s["page_size"].get<int>() << " TP"
       << s["tp"].get<int>() << " sharding " << s["sharding"].get<std::string>()
       << (s.value("score_precision", "fp32") == "fp8_mma" ? " fp8_mma" : "") << ": "
       << s["reason"].get<std::string>() << "\n";
  if (sharded_runs > 0) {
    os << "\nsharded selections " << (all_equal ? "equal" : "DIFFER FROM") << " the replicated ones"
       << (all_equal ? " in every configuration" : "") << " (bit for bit, every prefill and decode step)\n";
  } else {
    bool any_on = false;
    for (const auto& r : out.reports) any_on = any_on || r.combo.on;
    const std::string why = !out.want_on ? "--sharding off"
                            : any_on ? "sharding on is a no-op at TP1: one rank keeps the whole cache"
                                     : "the policy refused every sharding-on configuration";
    os << "\nno sharded configuration ran (" << why << "); the replicated selections "
       << (all_equal ? "agree" : "DIFFER") << " across the configurations of each kv_dtype\n";
  }
  os << "capacity, minimax-m3 at " << fmt("%g", o.capacity_budget_gib) << " GiB per rank, TP2 P128, NVFP4 KV + index: "
     << fmt_int(cap.off.tokens) << " tokens with sharding off, " << fmt_int(cap.on.tokens) << " on ("
     << (cap.off.tokens ? std::string("x") + fmt("%.3f", cap.ratio()) : std::string("no ratio: fewer than one page fits"))
     << ")\n";
  return os.str();
}

}  // namespace indexcp::cli
