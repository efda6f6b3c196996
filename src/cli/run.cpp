// `indexcp run`: the main job. Runs one layer's indexer (or --layers of them) over real keys and
// queries end to end for every accepted combination of kv dtype x page size x TP x sharding, and
// reports bytes per token, whether sharded selections equal replicated ones bit for bit, recall
// against an fp32-key reference, and time per layer per rank.
//
// Geometry per request of L tokens (L = --tokens, default: all the data holds): positions
// 0 .. L - pt - S*Q - 1 are inserted directly; the next pt (--prefill-tokens) are inserted and
// prefilled as one chunk; then S (--steps) decode steps each insert Q (--query-len) tokens and
// decode them. Query rows therefore sit at the last pt + S*Q positions, which must be covered by
// the stored queries (real data: the last 256 positions of each request). With L below the data's
// length the LAST L tokens of each request are used, renumbered from position 0.
//
// run_command below is the sequence of the job's steps, each a function of this file: check the
// options, the rank's environment and the backend, then the grid, load the data (run_data.cpp),
// plan the configurations, join the group, run every layer, and report (run_report.cpp).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>

#include "commands.hpp"
#include "core/clock.hpp"
#include "core/json_util.hpp"
#include "core/knobs.hpp"
#include "indexcp/comm.hpp"
#include "indexcp/config.hpp"
#include "indexcp/error.hpp"
#include "indexcp/nccl.hpp"
#include "indexcp/rendezvous.hpp"
#include "indexcp/replay.hpp"
#include "indexcp/tp_group.hpp"
#include "reference.hpp"
#include "run.hpp"
#include "subcommand.hpp"
#include "validators.hpp"

namespace indexcp::cli {

using json = nlohmann::json;

std::string combo_name(const Combo& c) {
  return to_string(c.dtype) + " P" + std::to_string(c.P) + " TP" + std::to_string(c.W) + " sharding " +
         (c.on ? "on" : "off") + (c.prec == ScorePrecision::kFp8Mma ? " fp8_mma" : "");
}

namespace {

using detail::now_s;

[[noreturn]] void bad(const std::string& msg) { throw Error(ErrorCode::kInvalidArgument, msg); }

struct RunResult {
  std::vector<int32_t> sel;  // [rows_total][H][K]
  double insert_us = 0, prefill_us = 0, decode_us = 0;  // per rank (prefill/decode) / wall (insert)
  int64_t decode_bytes = 0, gather_reserved = 0, cache_bytes = 0, num_pages = 0;
  std::string backend;
  std::string decode_timing, prefill_timing;  // StepStats::timing: how the times were taken
};

// group: this process is one rank of a group of processes (indexcp launch); nullptr: every rank
// of the configuration simulated in this process.
RunResult run_combo(const std::string& backend, const ResolvedConfig& rc, const Data& d, const Workload& w,
                    Communicator* group) {
  RunResult out;
  const int32_t P = rc.engine.page_size;
  // block table: each request's pages scattered over a shuffled pool (deterministic)
  const int32_t max_pages = (w.L + P - 1) / P;
  const int64_t num_pages = static_cast<int64_t>(w.R) * max_pages + 1;
  std::vector<int32_t> pool(static_cast<std::size_t>(num_pages));
  std::iota(pool.begin(), pool.end(), 0);
  std::mt19937 rng(1234u + static_cast<uint32_t>(P));
  std::shuffle(pool.begin(), pool.end(), rng);
  std::vector<int32_t> bt(static_cast<std::size_t>(w.R) * max_pages);
  for (std::size_t i = 0; i < bt.size(); ++i) bt[i] = pool[i];
  const auto slot = [&](int32_t r, int64_t pos) {
    return static_cast<int64_t>(bt[static_cast<std::size_t>(r) * max_pages + pos / P]) * P + pos % P;
  };
  auto ix = group ? make_cuda_rank_indexer(rc, num_pages, *group) : make_tp_indexer(backend, rc, num_pages);
  out.backend = ix->backend();
  out.cache_bytes = ix->cache_bytes_per_rank();
  out.num_pages = num_pages;
  // inserts: [pos0, pos0 + n) of every request
  std::vector<float> kbuf;
  std::vector<int64_t> sbuf;
  const auto insert_range = [&](int64_t pos0, int64_t n) {
    if (n <= 0) return;
    const double t = now_s();
    kbuf.resize(static_cast<std::size_t>(w.R * n) * kHeadDim);
    sbuf.resize(static_cast<std::size_t>(w.R * n));
    for (int32_t r = 0; r < w.R; ++r)
      for (int64_t i = 0; i < n; ++i) {
        std::copy_n(d.key(r, w.offset + pos0 + i), kHeadDim, kbuf.data() + (r * n + i) * kHeadDim);
        sbuf[r * n + i] = slot(r, pos0 + i);
      }
    ix->insert(kbuf.data(), sbuf.data(), w.R * n, 1.0f);
    out.insert_us += (now_s() - t) * 1e6;
  };
  // earlier tokens, inserted directly (one request at a time keeps the staging buffer small)
  {
    const double t = now_s();
    for (int32_t r = 0; r < w.R; ++r) {
      sbuf.resize(static_cast<std::size_t>(w.ctx0));
      for (int64_t p = 0; p < w.ctx0; ++p) sbuf[p] = slot(r, p);
      if (w.ctx0) ix->insert(d.key(r, w.offset), sbuf.data(), w.ctx0, 1.0f);
    }
    out.insert_us += (now_s() - t) * 1e6;
  }
  SelectionParams sel;
  sel.topk = w.K;
  const std::size_t per_row = static_cast<std::size_t>(w.H) * w.K;
  out.sel.reserve(static_cast<std::size_t>(w.rows_total) * per_row);
  std::vector<int32_t> seq(static_cast<std::size_t>(w.R), w.ctx0);
  if (w.pt) {
    insert_range(w.ctx0, w.pt);
    for (auto& s : seq) s += w.pt;
    std::vector<int32_t> qs(static_cast<std::size_t>(w.R) + 1);
    for (int32_t r = 0; r <= w.R; ++r) qs[r] = r * w.pt;
    PrefillBatch pb;
    pb.q = w.q_prefill.data();
    pb.heads = w.H;
    pb.block_table = bt.data();
    pb.num_requests = w.R;
    pb.max_pages = max_pages;
    pb.seq_lens = seq.data();
    pb.query_start = qs.data();
    StepStats st;
    const auto o = ix->prefill(pb, sel, &st);
    out.sel.insert(out.sel.end(), o.begin(), o.end());
    out.prefill_us = st.us_per_rank;
    out.gather_reserved = st.gather_reserved_bytes;
    out.prefill_timing = st.timing;
  }
  for (int32_t s = 0; s < w.S; ++s) {
    insert_range(w.ctx0 + w.pt + static_cast<int64_t>(s) * w.Q, w.Q);
    for (auto& x : seq) x += w.Q;
    DecodeBatch db;
    db.q = w.q_decode[s].data();
    db.heads = w.H;
    db.block_table = bt.data();
    db.num_requests = w.R;
    db.max_pages = max_pages;
    db.seq_lens = seq.data();
    db.query_len = w.Q;
    StepStats st;
    const auto o = ix->decode(db, sel, &st);
    out.sel.insert(out.sel.end(), o.begin(), o.end());
    out.decode_us += st.us_per_rank;
    out.decode_bytes = std::max(out.decode_bytes, st.bytes_exchanged);
    out.decode_timing = st.timing;
  }
  return out;
}


// The values of a repeated flag (--tp 2 --tp 2, --kv-dtype nvfp4,nvfp4) once each, in order.
template <class T>
std::vector<T> unique_in_order(const std::vector<T>& v) {
  std::vector<T> out;
  for (const T& x : v)
    if (std::find(out.begin(), out.end(), x) == out.end()) out.push_back(x);
  return out;
}

// ---- the steps of run_command, in order

// 1. The options, repeated values once each, and the checks the parser cannot make.
RunOptions checked_options(const RunOptions& opts) {
  RunOptions o = opts;
  o.kv_dtypes = unique_in_order(o.kv_dtypes);
  o.page_sizes = unique_in_order(o.page_sizes);
  o.tps = unique_in_order(o.tps);
  o.shardings = unique_in_order(o.shardings);
  o.score_precisions = unique_in_order(o.score_precisions);
  // fp32 first: each fp8_mma run is compared with the fp32 run of its kv_dtype
  std::stable_sort(o.score_precisions.begin(), o.score_precisions.end(),
                   [](const std::string& a, const std::string& b) { return a == "fp32" && b != "fp32"; });
  if (!o.json_path.empty()) check_output_path(o.json_path, "--json");
  // validate the options that the parser cannot
  if (o.steps < 0) bad("--steps = " + std::to_string(o.steps) + " must be >= 0");
  if (o.prefill_tokens < 0) bad("--prefill-tokens = " + std::to_string(o.prefill_tokens) + " must be >= 0");
  if (o.steps == 0 && o.prefill_tokens == 0) bad("--steps 0 and --prefill-tokens 0 leave nothing to run");
  if (o.query_len < 1 || o.query_len > 16) bad("--query-len = " + std::to_string(o.query_len) + " is out of range 1..16");
  if (o.layers < 1 || o.layers > 64) bad("--layers = " + std::to_string(o.layers) + " is out of range 1..64");
  if (o.topk < 2 || o.topk > 1024) bad("--topk = " + std::to_string(o.topk) + " is out of range 2..1024");
  if (o.kv_dtypes.empty() || o.page_sizes.empty() || o.tps.empty() || o.shardings.empty() || o.score_precisions.empty())
    bad("--kv-dtype, --page-size, --tp, --sharding and --score-precision each need at least one value");
  if (o.synthetic && (!o.keys_file.empty() || !o.queries_file.empty() || !o.data_dir.empty()))
    bad("--synthetic cannot be combined with --data, --keys or --queries");
  if (o.keys_file.empty() != o.queries_file.empty()) bad("--keys and --queries go together");
  if (!o.keys_file.empty() && !o.data_dir.empty()) bad("--data cannot be combined with --keys/--queries");
  (void)budget_bytes_from_gib(o.capacity_budget_gib, "--capacity-budget-gib");
  return o;
}

// 2. One rank of a group of processes (`indexcp launch --tp W -- indexcp run ...`): this process
// runs every configuration at TP W as rank INDEXCP_RANK on its own GPU, exchanging through NCCL;
// rank 0 prints the table and writes --json, every rank writes its rank report for the launcher.
// Returns where this process stands, and narrows the options to what a rank runs.
RunPlace rank_place(RunOptions& o, std::optional<RankEnv>& env) {
  env = rank_env_from_env();
  RunPlace place;
  if (!(env && env->world > 1)) return place;
  {
    const int W = env->world;
    const std::string why = " (INDEXCP_WORLD = " + std::to_string(W) + ": this process is rank " +
                            std::to_string(env->rank) + " of a group started by `indexcp launch`)";
    if (W != 2 && W != 4 && W != 8)
      bad("INDEXCP_WORLD = " + std::to_string(W) + ": `indexcp run` supports TP 2, 4 or 8 across processes");
    if (o.backend == "cpu")
      bad("--backend cpu: as a rank of `indexcp launch --tp " + std::to_string(W) +
          "` each process runs on its own GPU through NCCL; use --backend cuda (or auto)");
    if (o.tps_given && (o.tps.size() != 1 || o.tps[0] != W))
      bad("--tp: as a rank of `indexcp launch --tp " + std::to_string(W) + "` (INDEXCP_WORLD = " + std::to_string(W) +
          ") the only TP size is " + std::to_string(W) + "; leave --tp out or pass --tp " + std::to_string(W));
    if (!cuda_available())
      throw Error(ErrorCode::kUnsupported, "a rank of `indexcp launch -- indexcp run` runs on a GPU, and " +
                                               std::string(built_with_cuda() ? "no CUDA GPU is visible"
                                                                             : "this build has no CUDA backend") +
                                               why);
    if (!nccl::built_with_nccl())
      throw Error(ErrorCode::kUnsupported,
                  "a rank of `indexcp launch -- indexcp run` exchanges through NCCL, and this build has no NCCL" + why);
    o.tps = {W};
    o.backend = "cuda";
    if (env->rank != 0) o.quiet = true;  // one rank's progress lines are enough
  }
  place.world = env->world;
  place.rank = env->rank;
  place.device = env->device;
  return place;
}

// 3. The environment (INDEXCP_P256_STOCK_DECODE) fails now, on its own, not as a policy refusal of
// every combination; an unavailable backend fails now, not after the data is loaded (one process:
// a probe; a rank: the checks of rank_place, before any CUDA call, which must come after the
// communicator has made the rank's device current).
void probe_backend(const RunOptions& o, const RunPlace& place) {
  const ResolvedConfig rc_default = resolve_config(AttentionConfig{}, EngineParams{});
  if (!place.as_rank() && o.backend != "cpu") (void)make_tp_indexer(o.backend, rc_default, 1);
}

// 4. The grid: kv dtypes x page sizes x TP x sharding.
struct Grid {
  std::vector<KvDtype> dtypes;
  std::vector<ScorePrecision> precs;
  bool want_off = false, want_on = false;
};

Grid parse_grid(const RunOptions& o) {
  Grid g;
  for (const auto& s : o.kv_dtypes) g.dtypes.push_back(parse_kv_dtype(s, "--kv-dtype"));
  for (const auto& s : o.score_precisions) g.precs.push_back(parse_score_precision(s, "--score-precision"));
  for (const auto& s : o.shardings) {
    if (s == "off") g.want_off = true;
    else if (s == "on") g.want_on = true;
    else bad("--sharding = \"" + s + "\" is not supported; use off, on or off,on");
  }
  for (int32_t P : o.page_sizes)
    if (P != 128 && P != 256) bad("--page-size = " + std::to_string(P) + " is not supported; use 128, 256");
  for (int32_t W : o.tps)
    if (W != 1 && W != 2 && W != 4 && W != 8) bad("--tp = " + std::to_string(W) + " is not supported; use 1, 2, 4, 8");
  return g;
}

// 5. (run_data.cpp: load_run_data, make_workload.) 6. The configurations to run: every combination
// the policy accepts, each sharding-on run after the sharding-off run it is compared with (run
// even when only "on" is listed, as its replicated reference); the refused ones with the reason.
struct Planned {
  Combo combo;
  ResolvedConfig rc;
  bool listed;      // reported (else only the replicated reference of an "on" run)
  int report = -1;  // index into RunOutcome::reports
};

std::vector<Planned> plan_runs(const RunOptions& o, const Grid& g, const Workload& w, json& skipped) {
  std::vector<Planned> plan;
  const std::vector<KvDtype>& dts = g.dtypes;
  const bool want_off = g.want_off, want_on = g.want_on;
  for (KvDtype dt : dts)
   for (ScorePrecision prec : g.precs)
    for (int32_t P : o.page_sizes)
      for (int32_t W : o.tps) {
        EngineParams ep;
        ep.tp = W;
        ep.page_size = P;
        ep.heads = w.H;
        ep.query_len = w.Q;
        AttentionConfig off;
        off.kv_dtype = dt;
        off.score_precision = prec;
        ResolvedConfig rc_off;
        try {
          check_heads_tp(w.H, W);
          rc_off = resolve_config(off, ep);
        } catch (const Error& e) {
          for (bool on : {false, true})
            if ((on && want_on) || (!on && want_off))
              skipped.push_back({{"kv_dtype", to_string(dt)}, {"page_size", P}, {"tp", W},
                                 {"sharding", on ? "on" : "off"}, {"score_precision", to_string(prec)},
                                 {"reason", e.what()}});
          continue;
        }
        std::optional<ResolvedConfig> rc_on;
        if (want_on) {
          AttentionConfig on = off;
          on.cache_sharding = true;
          try {
            rc_on = resolve_config(on, ep);
          } catch (const Error& e) {
            skipped.push_back({{"kv_dtype", to_string(dt)}, {"page_size", P}, {"tp", W}, {"sharding", "on"},
                               {"score_precision", to_string(prec)}, {"reason", e.what()}});
          }
        }
        if (!want_off && !rc_on) continue;
        plan.push_back({{dt, P, W, false, prec}, rc_off, want_off});
        if (rc_on) plan.push_back({{dt, P, W, true, prec}, *rc_on, true});
      }
  if (plan.empty()) {
    std::string why = "the policy refuses every requested combination";
    if (!skipped.empty()) {
      const json& s0 = skipped[0];
      why += ": " + s0["reason"].get<std::string>() + " (" + s0["kv_dtype"].get<std::string>() + " P" +
             std::to_string(s0["page_size"].get<int>()) + " TP" + std::to_string(s0["tp"].get<int>()) + " sharding " +
             s0["sharding"].get<std::string>() + "; " + std::to_string(skipped.size()) +
             (skipped.size() == 1 ? " combination" : " combinations") + " refused)";
    }
    bad(why + "; see --kv-dtype, --page-size, --tp, --sharding" + (o.synthetic ? ", --heads" : ""));
  }
  return plan;
}

// 7. The data itself: synthetic data is generated only now, once the policy accepts some
// configuration (an error before is the only output).
void prepare_data(const RunOptions& o, int32_t rows_per_req, Data& data, const std::function<void(const std::string&)>& progress) {
  if (o.synthetic) {
    progress("generating synthetic data (" + std::to_string(data.R) + " requests x " + std::to_string(data.T) +
             " tokens)");
    data = make_synthetic(data.R, data.T, rows_per_req, o.heads, o.seed);
  } else {
    progress("loaded " + data.keys_path + " (" + std::to_string(data.R) + " requests x " + std::to_string(data.T) +
             " tokens, " + data.keys_dtype + ") and " + data.queries_path + " (last " + std::to_string(data.Qn) +
             " positions x " + std::to_string(data.H) + " heads, " + data.queries_dtype + ")");
  }
}

// 8. Every layer: each planned configuration runs the whole workload, its selections compared
// with its replicated reference and with the fp32 reference.
void run_layers(const RunOptions& o, const std::vector<Planned>& plan, int32_t rows_per_req, Data& data, Workload& w,
                Communicator* group, RunOutcome& out, const std::function<void(const std::string&)>& progress) {
  std::vector<ConfigReport>& reports = out.reports;
  std::string& backend_used = out.backend;
  const int n_runs = static_cast<int>(plan.size());
  for (int32_t layer = 0; layer < o.layers; ++layer) {
    const std::string lname = o.layers > 1 ? "layer " + std::to_string(layer) + ": " : "";
    if (o.synthetic && layer > 0) data = make_synthetic(w.R, w.L, rows_per_req, w.H, o.seed + static_cast<uint32_t>(layer));
    if (layer == 0 || o.synthetic) {
      const double t = now_s();
      build_workload(data, w);
      progress(lname + "fp32 reference selections: " + fmt("%.1f s", now_s() - t));
    }
    const std::size_t per_row = static_cast<std::size_t>(w.H) * w.K;
    // (dtype, precision) -> the first replicated run's selections
    std::map<std::pair<int, int>, std::vector<int32_t>> first_off;
    std::vector<int32_t> last_off;
    std::string last_off_name;
    for (int i = 0; i < n_runs; ++i) {
      const Planned& p = plan[i];
      const double t = now_s();
      RunResult rr = run_combo(o.backend, p.rc, data, w, group);
      backend_used = rr.backend;
      progress(lname + "[" + std::to_string(i + 1) + "/" + std::to_string(n_runs) + "] " + combo_name(p.combo) +
               (p.listed ? "" : " (replicated reference)") + ": insert " + fmt("%.1f s", rr.insert_us * 1e-6) +
               ", prefill " + fmt("%.2f s", rr.prefill_us * 1e-6) + ", decode " +
               fmt("%.2f s", rr.decode_us * 1e-6) + " per rank; " + fmt("%.1f s", now_s() - t) + " wall");
      bool equal;
      std::string vs;
      if (!p.combo.on) {
        const std::pair<int, int> key{static_cast<int>(p.combo.dtype), static_cast<int>(p.combo.prec)};
        auto it = first_off.find(key);
        if (it == first_off.end()) it = first_off.emplace(key, rr.sel).first;
        equal = it->second == rr.sel;
        vs = "the first sharding-off run of this kv_dtype and score precision (replicated selections do not "
             "depend on P or TP)";
        last_off = rr.sel;
        last_off_name = combo_name(p.combo);
      } else {
        equal = last_off == rr.sel;
        vs = "sharding off at the same kv_dtype, score precision, page size and TP (every prefill and decode step)";
        if (!equal) {
          const auto d = first_difference(rr.sel.data(), last_off.data(), w.rows_total, w.H, w.K);
          progress("MISMATCH " + combo_name(p.combo) + " vs " + last_off_name + ": " +
                   d.describe("sharded", "replicated"));
        }
      }
      if (p.report < 0) continue;
      ConfigReport& r = reports[p.report];
      r.equal = r.equal && equal;
      r.compared_with = vs;
      for (int64_t row = 0; row < w.rows_total; ++row)
        for (int32_t h = 0; h < w.H; ++h) {
          const std::size_t off = row * per_row + static_cast<std::size_t>(h) * w.K;
          r.recall_per_head[h] += selection_recall(w.reference.data() + off, rr.sel.data() + off, w.K) /
                                  static_cast<double>(w.rows_total) / o.layers;
        }
      if (p.combo.prec == ScorePrecision::kFp8Mma) {
        const auto f = first_off.find({static_cast<int>(p.combo.dtype), static_cast<int>(ScorePrecision::kFp32)});
        if (f != first_off.end()) {
          int64_t differ = 0;
          for (int64_t rh = 0; rh < w.rows_total * w.H; ++rh)
            differ += !std::equal(rr.sel.begin() + rh * w.K, rr.sel.begin() + (rh + 1) * w.K, f->second.begin() + rh * w.K);
          r.differs_from_fp32 = std::max(0.0, r.differs_from_fp32) +
                                static_cast<double>(differ) / static_cast<double>(w.rows_total * w.H) / o.layers;
        }
      }
      r.insert_us += rr.insert_us / o.layers;
      r.prefill_us += rr.prefill_us / o.layers;
      r.decode_us += (w.S ? rr.decode_us / w.S : 0.0) / o.layers;
      r.decode_bytes = rr.decode_bytes;
      r.gather_reserved = rr.gather_reserved;
      r.cache_bytes = rr.cache_bytes;
      r.num_pages = rr.num_pages;
      r.decode_timing = rr.decode_timing;
      r.prefill_timing = rr.prefill_timing;
      ++r.layers;
    }
  }
}

// 9. A rank's outcome for the launcher's merged report ($INDEXCP_REPORT_DIR/rank<r>.json).
void write_rank_report(const RunPlace& place, const json& report) {
  if (const char* dir = detail::knob_env("INDEXCP_REPORT_DIR"); dir && *dir) {
    const json& configs = report["configs"];
    json rr = {{"rank", place.rank}, {"cuda_device", place.device},
               {"all_selections_equal_replicated", report["all_selections_equal_replicated"]},
               {"configs", json::array()}};
    for (const auto& c : configs)
      rr["configs"].push_back({{"kv_dtype", c["kv_dtype"]}, {"page_size", c["page_size"]}, {"tp", c["tp"]},
                               {"sharding", c["sharding"]}, {"score_precision", c["score_precision"]},
                               {"selections_equal_replicated", c["selections_equal_replicated"]},
                               {"us_per_layer_per_rank", c["us_per_layer_per_rank"]},
                               {"prefill_us_per_layer_per_rank", c["prefill_us_per_layer_per_rank"]}});
    write_file_atomic(std::string(dir) + "/rank" + std::to_string(place.rank) + ".json", detail::dump_text(rr) + "\n");
  }
}

}  // namespace

int run_command(const RunOptions& opts) {
  const double t_start = now_s();
  RunOptions o = checked_options(opts);
  std::optional<RankEnv> env;
  const RunPlace place = rank_place(o, env);
  const auto progress = [&](const std::string& s) {
    if (!o.quiet) std::cerr << "indexcp run: " << s << std::endl;
  };
  probe_backend(o, place);
  const Grid grid = parse_grid(o);
  const int32_t rows_per_req = o.prefill_tokens + o.steps * o.query_len;
  Data data = load_run_data(o, rows_per_req);
  Workload w = make_workload(o, data, rows_per_req);
  RunOutcome out;
  out.want_on = grid.want_on;
  std::vector<Planned> plan = plan_runs(o, grid, w, out.skipped);
  prepare_data(o, rows_per_req, data, progress);
  for (auto& p : plan)
    if (p.listed) {
      p.report = static_cast<int>(out.reports.size());
      ConfigReport r;
      r.combo = p.combo;
      r.rc = p.rc;
      r.recall_per_head.assign(static_cast<std::size_t>(w.H), 0.0);
      out.reports.push_back(r);
    }
  // the group (as a rank): formed once the arguments and data are known to be good
  std::unique_ptr<nccl::NcclCommunicator> group;
  if (place.as_rank()) {
    progress("joining the TP" + std::to_string(env->world) + " group (rank " + std::to_string(env->rank) + ", GPU " +
             std::to_string(env->device) + ")");
    group = nccl::make_communicator(*env);  // also makes env->device the current device
  }
  run_layers(o, plan, rows_per_req, data, w, group.get(), out, progress);

  const json report = run_report(o, data, w, out, place, t_start);
  const std::string table = run_table(o, data, w, out, place, report);
  if (place.as_rank()) {
    write_rank_report(place, report);
    group->finalize();
  }
  const bool all_equal = report["all_selections_equal_replicated"].get<bool>();
  const bool lead = !place.as_rank() || place.rank == 0;
  if (lead && !o.json_path.empty()) write_file_atomic(o.json_path, detail::dump_text(report, 2) + "\n");
  if (lead) std::cout << table << std::flush;
  progress("done in " + fmt("%.1f s", now_s() - t_start));
  if (!all_equal) {  // the failure's one error line, last
    std::string which;
    for (const auto& r : out.reports)
      if (!r.equal) {
        which = combo_name(r.combo);
        break;
      }
    std::cerr << "indexcp: error: selections differ from the replicated ones (first: " << which
              << "; see the table and the MISMATCH lines)" << std::endl;
  }
  return all_equal ? 0 : 3;
}

namespace {

class RunCommand final : public Subcommand {
 public:
  CLI::App* add(CLI::App& app) override {
    RunOptions& ro = o_;
    CLI::App* run = nullptr;
    run = app.add_subcommand("run", "The main job: an end-to-end indexer workload over real keys and queries, for "
                                          "every accepted kv dtype x page size x TP x sharding");
    run->add_option("--backend", ro.backend, "cpu, cuda or auto (the GPU when one is present)")
        ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
        ->capture_default_str();
    run->add_option("--data", ro.data_dir,
                    "data directory with keys.npy, queries.npy and meta.json (default: the embedded data, found "
                    "beside the installed binary (../share/indexcp/data/minilm_stdlib), in a data/minilm_stdlib above "
                    "it, or in the checkout it was built from)")
        ->check(non_empty_path());
    run->add_option("--keys", ro.keys_file, "index keys: float16/float32 .npy [requests, tokens, 128]")
        ->check(non_empty_path());
    run->add_option("--queries", ro.queries_file,
                    "index queries: float16/float32 .npy [requests, positions, heads, 128] for the LAST `positions` "
                    "positions of each request")
        ->check(non_empty_path());
    run->add_flag("--synthetic", ro.synthetic, "use synthetic data (never the default)");
    run->add_option("--seed", ro.seed, "seed of the synthetic data")->capture_default_str();
    run->add_option("--requests", ro.requests, "requests to use (default: all the data holds; 4 synthetic)")
        ->check(CLI::Range(1, 4096));
    run->add_option("--tokens", ro.tokens,
                    "tokens per request, L (default: all the data holds; 33024 synthetic); below the data's length the "
                    "last L tokens are used")
        ->check(CLI::Range(1, 1 << 26));
    run->add_option("--prefill-tokens", ro.prefill_tokens, "tokens of the final prefill chunk per request")
        ->check(CLI::Range(0, 1 << 20))
        ->capture_default_str();
    run->add_option("--steps", ro.steps, "decode steps")->check(CLI::Range(0, 1 << 16))->capture_default_str();
    run->add_option("--query-len", ro.query_len, "queries per request per decode step (1..16)")
        ->check(CLI::Range(1, 16))
        ->capture_default_str();
    run->add_option("--layers", ro.layers, "layers to run (real data: the same layer's data each time)")
        ->check(CLI::Range(1, 64))
        ->capture_default_str();
    heads_ = run->add_option("--heads", ro.heads, "index heads of synthetic data (real data: the queries' heads)")
                      ->check(CLI::Range(1, 64))
                      ->capture_default_str();
    run->add_option("--topk", ro.topk, "blocks selected per row and head")->check(CLI::Range(2, 1024))->capture_default_str();
    run->add_option("--kv-dtype", ro.kv_dtypes, "index cache dtypes")
        ->delimiter(',')
        ->check(CLI::IsMember({"nvfp4", "fp8", "bf16"}))
        ->capture_default_str();
    run->add_option("--page-size", ro.page_sizes, "page sizes")
        ->delimiter(',')
        ->check(CLI::IsMember({128, 256}))
        ->capture_default_str();
    tps_ = run->add_option("--tp", ro.tps, "tensor-parallel sizes (as a rank of `indexcp launch --tp W`: W)")
        ->delimiter(',')
        ->check(CLI::IsMember({1, 2, 4, 8}))
        ->capture_default_str();
    run->add_option("--sharding", ro.shardings, "index cache sharding")
        ->delimiter(',')
        ->check(CLI::IsMember({"off", "on"}))
        ->capture_default_str();
    run->add_option("--score-precision", ro.score_precisions,
                    "indexer_score_precision values: fp32 (default) and/or the opt-in fp8_mma (FP8 tensor cores on "
                    "the cuda backend; the cpu backend computes exact scores); fp8_mma rows report the share of "
                    "(row, head) selections that differ from fp32")
        ->delimiter(',')
        ->check(CLI::IsMember({"fp32", "fp8_mma"}))
        ->capture_default_str();
    run->add_option("--capacity-budget-gib", ro.capacity_budget_gib,
                    "memory budget per rank for the report's capacity section (minimax-m3, TP2 P128, NVFP4); "
                    "> 0, at most 1048576")
        ->capture_default_str();
    run->add_option("--json", ro.json_path, "write the report as JSON to FILE")->check(non_empty_path());
    run->add_flag("-q,--quiet", ro.quiet, "no progress lines on stderr");
    run->footer(
        "Per request of L tokens: positions 0 .. L-C-S*Q-1 are inserted directly, the next C (--prefill-tokens) are "
        "inserted and prefilled as one chunk (gather mode when sharded), then S (--steps) decode steps each insert Q "
        "(--query-len) tokens and decode them. The default real data has 33024 tokens per request and queries for the "
        "last 256 positions, so C + S*Q must be <= 256 (default 128 + 3*8 = 152: 32872 tokens inserted directly). "
        "Sharding-on selections are compared bit for bit with the sharding-off run of the same dtype, P and TP; "
        "recall_vs_fp32 compares with a selection from unquantized keys scored in double. Exit status 3 if any "
        "sharded selection differs.");
    return run;
  }
  int run(int, char**) override {
    o_.heads_given = heads_->count() > 0;
    o_.tps_given = tps_->count() > 0;
    return run_command(o_);
  }

 private:
  RunOptions o_;
  CLI::Option *heads_ = nullptr, *tps_ = nullptr;
};

}  // namespace

INDEXCP_SUBCOMMAND(10, "run", RunCommand)

}  // namespace indexcp::cli
