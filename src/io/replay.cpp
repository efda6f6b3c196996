// Replay of one indexer step stored on disk (spec/cases.md; include/indexcp/replay.hpp).
#include "indexcp/replay.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <system_error>

#include <nlohmann/json.hpp>

#include "indexcp/cache.hpp"
#include "indexcp/comm.hpp"
#include "indexcp/config.hpp"
#include "indexcp/error.hpp"
#include "indexcp/icp.hpp"
#include "core/file_util.hpp"
#include "core/json_util.hpp"
#include "indexcp/indexer.hpp"
#include "indexcp/npy.hpp"
#include "indexcp/tp_group.hpp"
#include "core/clock.hpp"
#include "case.hpp"

namespace indexcp {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string TopkDifference::describe(const std::string& name_a, const std::string& name_b) const {
  if (!found) return "no difference";
  const auto list = [](const std::vector<int32_t>& v) {
    std::string s = "[";
    for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "]";
  };
  return "row " + std::to_string(row) + ", head " + std::to_string(head) + ": " + name_a + " " + list(a) + " vs " +
         name_b + " " + list(b);
}

TopkDifference first_difference(const int32_t* a, const int32_t* b, int64_t rows, int32_t heads, int32_t topk) {
  TopkDifference d;
  for (int64_t r = 0; r < rows; ++r)
    for (int32_t h = 0; h < heads; ++h) {
      const int64_t o = (r * heads + h) * topk;
      if (!std::equal(a + o, a + o + topk, b + o)) {
        d.found = true;
        d.row = r;
        d.head = h;
        d.a.assign(a + o, a + o + topk);
        d.b.assign(b + o, b + o + topk);
        return d;
      }
    }
  return d;
}

int ReplayResult::exit_code() const {
  if (!selections_equal_replicated) return 3;
  if (has_expected && !expected_equal) return 4;
  return 0;
}

std::string ReplayResult::summary() const {
  std::string s = std::to_string(rows) + " rows x " + std::to_string(heads) + " heads x top-" +
                  std::to_string(topk_k) + " on " + backend + " (" + path + ")";
  if (compared_with_replicated)
    s += selections_equal_replicated ? "; equal to the replicated path" : "; DIFFERS from the replicated path";
  if (has_expected) s += expected_equal ? "; equal to expected_topk.npy" : "; DIFFERS from expected_topk.npy";
  return s;
}

namespace {

using detail::now_us;
using io::Case;
using io::invalid;
using io::with_file;
using io::load_case_json;
using io::load_arrays;
using io::decode_batch;
using io::prefill_batch;

std::string path_name(const Case& c, const ResolvedConfig& rc) {
  const std::string W = std::to_string(rc.engine.tp);
  if (c.decode) {
    if (rc.sharding) return "icp_decode over " + W + " rank shards";
    if (rc.decode_cp) return "decode_cp_replicated over " + W + " ranks";
    return "replicated decode on " + W + " ranks";
  }
  if (rc.sharding && rc.prefill_cp == PrefillCp::kGather) return "prefill_gather over " + W + " rank shards";
  if (rc.sharding) return "prefill_local_score over " + W + " rank shards";
  return "replicated prefill on " + W + " ranks";
}

// The CPU group for cache.npy cases: the replicated cache and (with sharding) W rank shards,
// filled from the replicated page bytes through the library's PageLayout.
struct CacheGroup {
  std::unique_ptr<IndexCache> repl;
  std::vector<IndexCache> shards;

  CacheGroup(const Case& c, bool sharded) {
    const KvDtype dt = c.rc.kv_dtype;
    const int32_t P = c.page_size;
    const PageLayout lr = make_page_layout(dt, P, 1);
    const int64_t pb = c.cache.shape[1];
    repl = std::make_unique<IndexCache>(lr, c.num_pages, 1, 0);
    for (int64_t p = 0; p < c.num_pages; ++p)
      std::memcpy(repl->page_ptr(0, p), c.cache.bytes.data() + p * pb, static_cast<std::size_t>(pb));
    if (!sharded) return;
    const int32_t W = c.tp;
    const PageLayout ls = make_page_layout(dt, P, W);
    const int64_t data_bytes = dt == KvDtype::kNvfp4 ? kNvfp4DataBytesPerKey : key_bytes(dt);
    for (int32_t r = 0; r < W; ++r) {
      shards.emplace_back(ls, c.num_pages, 1, r);
      IndexCache& s = shards.back();
      for (int64_t p = 0; p < c.num_pages; ++p) {
        const uint8_t* src = repl->page_ptr(0, p);
        uint8_t* dst = s.page_ptr(0, p);
        for (int32_t j = 0; j < ls.rows(); ++j) {
          const int32_t u = ls.offset_of_local_row(r, j);
          std::memcpy(dst + ls.row_data_offset(j), src + lr.row_data_offset(u), static_cast<std::size_t>(data_bytes));
          if (dt == KvDtype::kNvfp4)
            std::memcpy(dst + ls.row_scale_offset(j), src + lr.row_scale_offset(u), kNvfp4ScalesPerKey);
        }
      }
    }
  }

  // Runs one step through `rc`'s path on W threads; each head from its owner rank.
  std::vector<int32_t> run(const Case& c, const ResolvedConfig& rc, double* wall_us, double* us_per_rank) const {
    const int32_t W = rc.engine.tp, H = c.heads, K = c.sel.topk;
    const DecodeBatch db = decode_batch(c);
    const PrefillBatch pb = prefill_batch(c);
    std::vector<std::vector<int32_t>> per(static_cast<std::size_t>(W));
    std::vector<double> busy(static_cast<std::size_t>(W), 0.0);
    const double t0 = now_us();
    run_ranks(W, [&](int rank, Communicator& comm) {
      int32_t h0, nh;
      owned_heads(H, W, rank, &h0, &nh);
      per[rank].assign(static_cast<std::size_t>(c.rows) * nh * K, -1);
      int32_t* out = per[rank].data();
      const double a = now_us();
      if (c.decode) {
        if (rc.sharding) icp_decode(comm, shards[rank], 0, db, c.sel, rc.k_rounding, out);
        else if (rc.decode_cp) decode_cp_replicated(comm, *repl, 0, db, c.sel, rc.k_rounding, out);
        else decode_select(*repl, 0, db, h0, nh, c.sel, rc.k_rounding, out);
      } else {
        if (rc.sharding && rc.prefill_cp == PrefillCp::kGather)
          prefill_gather(comm, shards[rank], 0, pb, c.sel, rc.prefill_gather_budget_bytes, out);
        else if (rc.sharding) prefill_local_score(comm, shards[rank], 0, pb, c.sel, out);
        else prefill_select(*repl, 0, pb, h0, nh, c.sel, out);
      }
      busy[rank] = now_us() - a;
    });
    *wall_us = now_us() - t0;
    *us_per_rank = 0;
    for (double b : busy) *us_per_rank += b / W;
    std::vector<int32_t> all(static_cast<std::size_t>(c.rows) * H * K, -1);
    for (int32_t rank = 0; rank < W; ++rank) {
      int32_t h0, nh;
      owned_heads(H, W, rank, &h0, &nh);
      if (W > H && rank != h0 * W / H) continue;  // the first rank sharing a head
      for (int64_t r = 0; r < c.rows; ++r)
        for (int32_t h = 0; h < nh; ++h)
          std::copy_n(per[rank].data() + (r * nh + h) * K, K, all.data() + (r * H + h0 + h) * K);
    }
    return all;
  }
};

// Block scores of the replicated path on the CPU (prefill scores E4M3-rounded NVFP4 keys).
std::vector<float> cpu_scores(const Case& c, const IndexCache& repl) {
  if (c.decode) {
    const DecodeBatch db = decode_batch(c);
    const auto rows = decode_rows(db, repl.num_pages(), c.page_size);
    return score_blocks(repl, 0, rows, db.block_table, db.max_pages, db.q, c.heads, 0, c.heads, c.rc.k_rounding).score;
  }
  const PrefillBatch pb = prefill_batch(c);
  const auto rows = prefill_rows(pb, repl.num_pages(), c.page_size);
  return score_blocks(repl, 0, rows, pb.block_table, pb.max_pages, pb.q, c.heads, 0, c.heads, KRounding::kE4m3).score;
}

json diff_json(const TopkDifference& d, const char* name_a, const char* name_b) {
  if (!d.found) return nullptr;
  return json{{"row", d.row}, {"head", d.head}, {name_a, d.a}, {name_b, d.b}};
}

// The output files of a replay (written into --out).
constexpr const char* kTopkFile = "topk.npy";
constexpr const char* kScoresFile = "scores.npy";
constexpr const char* kReportFile = "report.json";
std::vector<std::string> output_names(bool scores) {
  std::vector<std::string> n = {kTopkFile, kReportFile};
  if (scores) n.push_back(kScoresFile);
  return n;
}

// Throws Error naming --out unless the outputs `names` can be written into out_dir: the directory
// is usable (detail::check_output_directory) and no output exists as anything but a regular file,
// or a symbolic link to one (a directory or a FIFO there would fail the write half way).
void check_outputs(const fs::path& out_dir, const std::vector<std::string>& names) {
  detail::check_output_directory(out_dir, "--out");
  std::error_code ec;
  for (const auto& n : names) {
    const fs::file_status st = fs::status(out_dir / n, ec);
    if (fs::exists(st) && !fs::is_regular_file(st))
      throw Error(ErrorCode::kIo, (out_dir / n).string() + ": exists and is not a regular file (--out)");
  }
}

// Writes `files` (name -> bytes) into out_dir: each to a temporary file first, then all renamed,
// after check_outputs (so that nothing is written when one of them cannot be; only a rename that
// fails after the checks, e.g. on a vanishing file system, can leave part of them written).
void write_outputs(const fs::path& out_dir, const std::vector<std::pair<std::string, std::vector<uint8_t>>>& files) {
  std::vector<std::string> names;
  for (const auto& f : files) names.push_back(f.first);
  check_outputs(out_dir, names);
  std::error_code ec;
  const bool created = !fs::exists(out_dir, ec);
  if (created) fs::create_directory(detail::directory_name(out_dir), ec);
  if (ec || !fs::is_directory(out_dir, ec))
    throw Error(ErrorCode::kIo, out_dir.string() + ": cannot create the output directory (" + ec.message() + ")");
  std::vector<fs::path> tmps;
  try {
    for (const auto& f : files) {
      const fs::path tmp = out_dir / ("." + f.first + ".tmp" + std::to_string(::getpid()));
      tmps.push_back(tmp);
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      if (!out) throw Error(ErrorCode::kIo, (out_dir / f.first).string() + ": cannot open for writing");
      out.write(reinterpret_cast<const char*>(f.second.data()), static_cast<std::streamsize>(f.second.size()));
      out.close();
      if (!out) throw Error(ErrorCode::kIo, (out_dir / f.first).string() + ": write error");
    }
    for (std::size_t i = 0; i < files.size(); ++i) {
      fs::rename(tmps[i], out_dir / files[i].first, ec);
      if (ec) throw Error(ErrorCode::kIo, (out_dir / files[i].first).string() + ": cannot write (" + ec.message() + ")");
    }
  } catch (...) {
    for (const auto& t : tmps) fs::remove(t, ec);
    if (created) {
      for (const auto& f : files) fs::remove(out_dir / f.first, ec);
      fs::remove(detail::directory_name(out_dir), ec);
    }
    throw;
  }
}

}  // namespace

ReplayResult replay_case(const std::string& case_dir, const std::string& out_dir, const ReplayOptions& opts) {
  const double t_start = now_us();
  if (opts.backend != "cpu" && opts.backend != "cuda" && opts.backend != "auto")
    throw Error(ErrorCode::kInvalidArgument, "--backend = \"" + opts.backend + "\" is not supported; use cpu, cuda or auto");
  if (out_dir.empty()) throw Error(ErrorCode::kInvalidArgument, "--out: the output directory is empty");
  check_outputs(out_dir, output_names(opts.scores));  // before any work; write_outputs checks again
  Case c;
  c.dir = case_dir;
  {
    std::error_code ec;
    if (!fs::exists(c.dir, ec)) throw Error(ErrorCode::kIo, case_dir + ": no such case directory");
    if (!fs::is_directory(c.dir, ec)) throw Error(ErrorCode::kInvalidArgument, case_dir + ": is not a directory");
  }
  // the environment (INDEXCP_P256_STOCK_DECODE) is checked on its own first, so that its error is
  // not attributed to case.json
  (void)resolve_config(AttentionConfig{}, EngineParams{});
  load_case_json(c);
  load_arrays(c);

  ReplayResult res;
  res.rows = c.rows;
  res.heads = c.heads;
  res.topk_k = c.sel.topk;
  std::string backend = opts.backend;
  if (c.from_cache) {
    if (backend == "cuda")
      throw Error(ErrorCode::kUnsupported, c.file("cache.npy") +
                                               ": a case given as raw cache bytes replays on the cpu backend only "
                                               "(--backend cuda); use --backend cpu, or give keys.npy");
    if (backend == "auto" && cuda_available())
      c.notes.push_back("cache.npy cases replay on the cpu backend; --backend auto chose cpu");
    backend = "cpu";
  }
  const bool cp = c.rc.sharding || (c.decode && c.rc.decode_cp);
  res.compared_with_replicated = cp;
  res.path = path_name(c, c.rc);

  std::vector<int32_t> ref;
  std::vector<float> scores;
  double step_wall = 0, step_rank = 0, repl_wall = 0, insert_wall = 0;
  if (!c.from_cache) {
    // keys.npy: through TpIndexer on the chosen backend
    std::vector<float> kbuf(c.used_slots.size() * kHeadDim);
    for (std::size_t i = 0; i < c.used_slots.size(); ++i)
      std::copy_n(c.keys() + c.used_slots[i] * kHeadDim, kHeadDim, kbuf.data() + i * kHeadDim);
    const int64_t n = static_cast<int64_t>(c.used_slots.size());
    auto main = make_tp_indexer(backend, c.rc, c.num_pages);
    res.backend = main->backend();
    double t = now_us();
    main->insert(kbuf.data(), c.used_slots.data(), n, c.encode_scale);
    insert_wall = now_us() - t;
    StepStats st;
    const DecodeBatch db = decode_batch(c);
    const PrefillBatch pb = prefill_batch(c);
    res.topk = c.decode ? main->decode(db, c.sel, &st) : main->prefill(pb, c.sel, &st);
    step_wall = st.wall_us;
    step_rank = st.us_per_rank;
    std::unique_ptr<TpIndexer> rep;
    if (cp) {
      rep = make_tp_indexer(backend, c.rc_repl, c.num_pages);
      rep->insert(kbuf.data(), c.used_slots.data(), n, c.encode_scale);
      StepStats st2;
      ref = c.decode ? rep->decode(db, c.sel, &st2) : rep->prefill(pb, c.sel, &st2);
      repl_wall = st2.wall_us;
    }
    if (opts.scores) {
      if (c.decode) {
        scores = (cp ? rep : main)->decode_scores(db);
      } else {
        IndexCache repl(make_page_layout(c.rc.kv_dtype, c.page_size, 1), c.num_pages, 1, 0);
        InsertOptions io;
        io.encode_scale = c.encode_scale;
        insert_keys(repl, 0, kbuf.data(), c.used_slots.data(), n, io);
        scores = cpu_scores(c, repl);
        if (res.backend != "cpu") c.notes.push_back("scores.npy of a prefill case is computed on the cpu backend");
      }
    }
  } else {
    res.backend = "cpu";
    double t = now_us();
    const CacheGroup g(c, c.rc.sharding);
    insert_wall = now_us() - t;
    res.topk = g.run(c, c.rc, &step_wall, &step_rank);
    if (cp) {
      double r1 = 0;
      ref = g.run(c, c.rc_repl, &repl_wall, &r1);
    }
    if (opts.scores) scores = cpu_scores(c, *g.repl);
  }

  if (cp) {
    res.replicated_difference = first_difference(res.topk.data(), ref.data(), c.rows, c.heads, c.sel.topk);
    res.selections_equal_replicated = !res.replicated_difference.found;
  }
  if (c.has_expected) {
    res.has_expected = true;
    res.expected_difference = first_difference(c.expected.data(), res.topk.data(), c.rows, c.heads, c.sel.topk);
    res.expected_equal = !res.expected_difference.found;
  }

  // outputs
  std::vector<std::pair<std::string, std::vector<uint8_t>>> files;
  files.emplace_back(kTopkFile, npy::serialize(npy::Dtype::kInt32, {c.rows, c.heads, c.sel.topk}, res.topk.data()));
  const int64_t max_blocks = static_cast<int64_t>(c.max_pages) * c.page_size / kBlockTokens;
  if (opts.scores)
    files.emplace_back(kScoresFile, npy::serialize(npy::Dtype::kFloat32, {c.rows, c.heads, max_blocks}, scores.data()));
  json rep;
  rep["case"] = fs::absolute(c.dir).lexically_normal().string();
  rep["phase"] = c.decode ? "decode" : "prefill";
  rep["backend"] = res.backend;
  rep["config"] = json::parse(c.rc.to_json());
  rep["keys_from"] = c.from_cache ? "cache.npy" : "keys.npy";
  rep["requests"] = c.B;
  rep["rows"] = c.rows;
  rep["heads"] = c.heads;
  rep["topk"] = c.sel.topk;
  rep["init_blocks"] = c.sel.init_blocks;
  if (c.decode) rep["query_len"] = c.query_len;
  rep["num_pages"] = c.num_pages;
  rep["path"] = res.path;
  rep["compared_with_replicated"] = cp;
  rep["selections_equal_replicated"] = res.selections_equal_replicated;
  rep["first_difference_vs_replicated"] = diff_json(res.replicated_difference, "sharded", "replicated");
  if (c.has_expected)
    rep["expected_topk"] = json{{"equal", res.expected_equal}, {"first_difference", diff_json(res.expected_difference, "expected", "got")}};
  else
    rep["expected_topk"] = nullptr;
  rep["time"] = json{{"step_wall_us", step_wall},
                     {"step_us_per_rank", step_rank},
                     {"replicated_step_wall_us", cp ? json(repl_wall) : json(nullptr)},
                     {"insert_wall_us", insert_wall},
                     {"total_wall_us", now_us() - t_start}};
  json outs = json::array();
  for (const auto& f : files) outs.push_back(f.first);
  outs.push_back(kReportFile);
  rep["outputs"] = outs;
  rep["notes"] = c.notes;
  res.report_json = detail::dump_text(rep, 2) + "\n";
  files.emplace_back(kReportFile, std::vector<uint8_t>(res.report_json.begin(), res.report_json.end()));
  write_outputs(out_dir, files);
  for (const auto& f : files) res.written.push_back(f.first);
  return res;
}

}  // namespace indexcp
