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
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "data_search.hpp"
#include "core/file_util.hpp"
#include "core/json_util.hpp"
#include "indexcp/cache.hpp"
#include "indexcp/capacity.hpp"
#include "indexcp/config.hpp"
#include "indexcp/comm.hpp"
#include "indexcp/error.hpp"
#include "indexcp/nccl.hpp"
#include "indexcp/npy.hpp"
#include "indexcp/rendezvous.hpp"
#include "indexcp/replay.hpp"
#include "indexcp/tp_group.hpp"
#include "reference.hpp"
#include "core/knobs.hpp"
#include "core/clock.hpp"

#ifndef INDEXCP_DEFAULT_DATA_DIR
#define INDEXCP_DEFAULT_DATA_DIR "data/minilm_stdlib"
#endif
#ifndef INDEXCP_VERSION
#define INDEXCP_VERSION "0"
#endif

namespace indexcp::cli {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using detail::now_s;

[[noreturn]] void bad(const std::string& msg) { throw Error(ErrorCode::kInvalidArgument, msg); }

// ---------------------------------------------------------------------------------------------
// Data: keys [R][T][128] and queries [R][Qn][H][128] for the last Qn positions of each request.

struct Data {
  std::string source, name, keys_path, queries_path;
  json meta;
  int32_t R = 0, T = 0, Qn = 0, H = 0;
  std::string keys_dtype = "float32", queries_dtype = "float32";
  std::vector<float> keys, queries;
  const float* key(int32_t r, int64_t pos) const { return keys.data() + (static_cast<int64_t>(r) * T + pos) * kHeadDim; }
  // query of request r at data position pos (pos >= T - Qn), head 0
  const float* query(int32_t r, int64_t pos) const {
    return queries.data() + ((static_cast<int64_t>(r) * Qn + (pos - (T - Qn))) * H) * kHeadDim;
  }
};

Data load_files(const std::string& keys_path, const std::string& queries_path) {
  Data d;
  d.keys_path = keys_path;
  d.queries_path = queries_path;
  const npy::Array k = npy::load(keys_path);
  if (k.dtype != npy::Dtype::kFloat16 && k.dtype != npy::Dtype::kFloat32)
    bad(keys_path + ": dtype is " + npy::dtype_name(k.dtype) + ", expected float16 or float32");
  if (k.ndim() != 3 || k.shape[2] != kHeadDim || k.shape[0] < 1 || k.shape[1] < 1)
    bad(keys_path + ": shape " + npy::shape_string(k.shape) + " must be [requests, tokens, 128]");
  if (k.shape[0] > 4096 || k.shape[1] > (1 << 28)) bad(keys_path + ": shape " + npy::shape_string(k.shape) + " is too large");
  const npy::Array q = npy::load(queries_path);
  if (q.dtype != npy::Dtype::kFloat16 && q.dtype != npy::Dtype::kFloat32)
    bad(queries_path + ": dtype is " + npy::dtype_name(q.dtype) + ", expected float16 or float32");
  if (q.ndim() != 4 || q.shape[3] != kHeadDim || q.shape[1] < 1 || q.shape[2] < 1 || q.shape[2] > 64)
    bad(queries_path + ": shape " + npy::shape_string(q.shape) + " must be [requests, positions, heads (1..64), 128]");
  if (q.shape[0] != k.shape[0])
    bad(queries_path + ": shape " + npy::shape_string(q.shape) + " has " + std::to_string(q.shape[0]) +
        " requests but " + keys_path + " has " + std::to_string(k.shape[0]));
  if (q.shape[1] > k.shape[1])
    bad(queries_path + ": " + std::to_string(q.shape[1]) + " query positions per request, more than the " +
        std::to_string(k.shape[1]) + " tokens of " + keys_path);
  d.R = static_cast<int32_t>(k.shape[0]);
  d.T = static_cast<int32_t>(k.shape[1]);
  d.Qn = static_cast<int32_t>(q.shape[1]);
  d.H = static_cast<int32_t>(q.shape[2]);
  d.keys_dtype = npy::dtype_name(k.dtype);
  d.queries_dtype = npy::dtype_name(q.dtype);
  d.keys = npy::to_float32(k, keys_path);
  d.queries = npy::to_float32(q, queries_path);
  for (std::size_t i = 0; i < d.keys.size(); ++i)
    if (!std::isfinite(d.keys[i])) {
      const int64_t tok = static_cast<int64_t>(i / kHeadDim);
      bad(keys_path + ": non-finite value at request " + std::to_string(tok / d.T) + ", position " +
          std::to_string(tok % d.T) + ", dim " + std::to_string(i % kHeadDim));
    }
  for (std::size_t i = 0; i < d.queries.size(); ++i)
    if (!std::isfinite(d.queries[i])) {
      const int64_t v = static_cast<int64_t>(i / kHeadDim);
      bad(queries_path + ": non-finite value at request " + std::to_string(v / d.H / d.Qn) + ", query " +
          std::to_string((v / d.H) % d.Qn) + ", head " + std::to_string(v % d.H) + ", dim " +
          std::to_string(i % kHeadDim));
    }
  return d;
}

// Synthetic keys with block-level structure (each 128-token block has its own mean direction)
// and queries that point at a few earlier blocks, so that selections are not a coin toss.
Data make_synthetic(int32_t R, int32_t T, int32_t Qn, int32_t H, uint32_t seed) {
  Data d;
  d.source = "synthetic";
  d.name = "synthetic-seed" + std::to_string(seed);
  d.R = R;
  d.T = T;
  d.Qn = Qn;
  d.H = H;
  d.keys.resize(static_cast<std::size_t>(R) * T * kHeadDim);
  d.queries.resize(static_cast<std::size_t>(R) * Qn * H * kHeadDim);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int32_t nblocks = (T + kBlockTokens - 1) / kBlockTokens;
  std::vector<float> mean(static_cast<std::size_t>(nblocks) * kHeadDim);
  for (int32_t r = 0; r < R; ++r) {
    for (auto& m : mean) m = 0.7f * nd(rng);
    for (int64_t p = 0; p < T; ++p) {
      float* k = d.keys.data() + (static_cast<int64_t>(r) * T + p) * kHeadDim;
      const float* m = mean.data() + (p / kBlockTokens) * kHeadDim;
      for (int i = 0; i < kHeadDim; ++i) k[i] = m[i] + nd(rng);
    }
    for (int32_t j = 0; j < Qn; ++j) {
      const int64_t pos = T - Qn + j;
      const int64_t nb = std::max<int64_t>(1, pos / kBlockTokens);
      for (int32_t h = 0; h < H; ++h) {
        float* q = d.queries.data() + ((static_cast<int64_t>(r) * Qn + j) * H + h) * kHeadDim;
        for (int i = 0; i < kHeadDim; ++i) q[i] = nd(rng);
        for (int a = 0; a < 3; ++a) {
          const int64_t b = static_cast<int64_t>(rng() % static_cast<uint64_t>(nb));
          for (int i = 0; i < kHeadDim; ++i) q[i] += mean[b * kHeadDim + i];
        }
      }
    }
  }
  return d;
}

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

// Row order of every selection vector: the prefill rows (request-major), then each decode step's
// rows (request-major). Returns the window position of row `row`'s request r and index.
void quantize_rows(const Data& d, const Workload& w, int32_t r, int64_t pos0, int32_t n, uint8_t* out) {
  std::vector<float> tmp(static_cast<std::size_t>(n) * w.H * kHeadDim);
  for (int32_t i = 0; i < n; ++i)
    std::copy_n(d.query(r, w.offset + pos0 + i), static_cast<std::size_t>(w.H) * kHeadDim,
                tmp.data() + static_cast<std::size_t>(i) * w.H * kHeadDim);
  quantize_queries(tmp.data(), n, w.H, KeyPreprocess{}, out);
}

void build_workload(const Data& d, Workload& w) {
  const int32_t rows_per_req = w.pt + w.S * w.Q;
  w.rows_total = static_cast<int64_t>(w.R) * rows_per_req;
  const std::size_t vec = static_cast<std::size_t>(w.H) * kHeadDim;
  w.q_prefill.assign(static_cast<std::size_t>(w.R) * w.pt * vec, 0);
  for (int32_t r = 0; r < w.R; ++r)
    if (w.pt) quantize_rows(d, w, r, w.ctx0, w.pt, w.q_prefill.data() + static_cast<std::size_t>(r) * w.pt * vec);
  w.q_decode.assign(static_cast<std::size_t>(w.S), std::vector<uint8_t>(static_cast<std::size_t>(w.R) * w.Q * vec));
  for (int32_t s = 0; s < w.S; ++s)
    for (int32_t r = 0; r < w.R; ++r)
      quantize_rows(d, w, r, w.ctx0 + w.pt + static_cast<int64_t>(s) * w.Q, w.Q,
                    w.q_decode[s].data() + static_cast<std::size_t>(r) * w.Q * vec);
  // fp32 reference for every row, in the same row order
  w.reference.assign(static_cast<std::size_t>(w.rows_total) * w.H * w.K, -1);
  std::vector<int32_t> tmp(static_cast<std::size_t>(rows_per_req) * w.H * w.K);
  std::vector<float> qf(static_cast<std::size_t>(rows_per_req) * vec);
  for (int32_t r = 0; r < w.R; ++r) {
    for (int32_t i = 0; i < rows_per_req; ++i)
      std::copy_n(d.query(r, w.offset + w.ctx0 + i), vec, qf.data() + static_cast<std::size_t>(i) * vec);
    reference_select(d.key(r, w.offset), qf.data(), w.ctx0, rows_per_req, w.H, w.K, 0, tmp.data());
    const std::size_t per_row = static_cast<std::size_t>(w.H) * w.K;
    for (int32_t i = 0; i < rows_per_req; ++i) {
      int64_t row;
      if (i < w.pt) {
        row = static_cast<int64_t>(r) * w.pt + i;
      } else {
        const int32_t s = (i - w.pt) / w.Q, j = (i - w.pt) % w.Q;
        row = static_cast<int64_t>(w.R) * w.pt + static_cast<int64_t>(s) * w.R * w.Q + static_cast<int64_t>(r) * w.Q + j;
      }
      std::copy_n(tmp.data() + i * per_row, per_row, w.reference.data() + row * per_row);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// One configuration.

struct Combo {
  KvDtype dtype;
  int32_t P, W;
  bool on;
};

std::string combo_name(const Combo& c) {
  return to_string(c.dtype) + " P" + std::to_string(c.P) + " TP" + std::to_string(c.W) + " sharding " +
         (c.on ? "on" : "off");
}

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

// Aggregated over layers, per listed configuration.
struct ConfigReport {
  Combo combo;
  ResolvedConfig rc;
  bool equal = true;
  std::string compared_with;
  std::vector<double> recall_per_head;
  double insert_us = 0, prefill_us = 0, decode_us = 0;
  int64_t decode_bytes = 0, gather_reserved = 0, cache_bytes = 0, num_pages = 0;
  std::string decode_timing, prefill_timing;
  int layers = 0;
};


}  // namespace

// ---------------------------------------------------------------------------------------------

// The values of a repeated flag (--tp 2 --tp 2, --kv-dtype nvfp4,nvfp4) once each, in order.
template <class T>
std::vector<T> unique_in_order(const std::vector<T>& v) {
  std::vector<T> out;
  for (const T& x : v)
    if (std::find(out.begin(), out.end(), x) == out.end()) out.push_back(x);
  return out;
}

int run_command(const RunOptions& opts) {
  const double t_start = now_s();
  RunOptions o = opts;
  o.kv_dtypes = unique_in_order(o.kv_dtypes);
  o.page_sizes = unique_in_order(o.page_sizes);
  o.tps = unique_in_order(o.tps);
  o.shardings = unique_in_order(o.shardings);
  if (!o.json_path.empty()) check_output_path(o.json_path, "--json");
  const auto progress = [&](const std::string& s) {
    if (!o.quiet) std::cerr << "indexcp run: " << s << std::endl;
  };
  // validate the options that the parser cannot
  if (o.steps < 0) bad("--steps = " + std::to_string(o.steps) + " must be >= 0");
  if (o.prefill_tokens < 0) bad("--prefill-tokens = " + std::to_string(o.prefill_tokens) + " must be >= 0");
  if (o.steps == 0 && o.prefill_tokens == 0) bad("--steps 0 and --prefill-tokens 0 leave nothing to run");
  if (o.query_len < 1 || o.query_len > 16) bad("--query-len = " + std::to_string(o.query_len) + " is out of range 1..16");
  if (o.layers < 1 || o.layers > 64) bad("--layers = " + std::to_string(o.layers) + " is out of range 1..64");
  if (o.topk < 2 || o.topk > 1024) bad("--topk = " + std::to_string(o.topk) + " is out of range 2..1024");
  if (o.kv_dtypes.empty() || o.page_sizes.empty() || o.tps.empty() || o.shardings.empty())
    bad("--kv-dtype, --page-size, --tp and --sharding each need at least one value");
  if (o.synthetic && (!o.keys_file.empty() || !o.queries_file.empty() || !o.data_dir.empty()))
    bad("--synthetic cannot be combined with --data, --keys or --queries");
  if (o.keys_file.empty() != o.queries_file.empty()) bad("--keys and --queries go together");
  if (!o.keys_file.empty() && !o.data_dir.empty()) bad("--data cannot be combined with --keys/--queries");
  const int64_t budget = budget_bytes_from_gib(o.capacity_budget_gib, "--capacity-budget-gib");

  // ---- one rank of a group of processes (`indexcp launch --tp W -- indexcp run ...`): this process
  // runs every configuration at TP W as rank INDEXCP_RANK on its own GPU, exchanging through NCCL;
  // rank 0 prints the table and writes --json, every rank writes its rank report for the launcher
  const std::optional<RankEnv> env = rank_env_from_env();
  const bool as_rank = env && env->world > 1;
  if (as_rank) {
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

  // the environment (INDEXCP_P256_STOCK_DECODE) fails now, on its own, not as a policy refusal of
  // every combination; an unavailable backend fails now, not after the data is loaded (one
  // process: a probe; a rank: the checks below, before any CUDA call, which must come after the
  // communicator has made the rank's device current)
  const ResolvedConfig rc_default = resolve_config(AttentionConfig{}, EngineParams{});
  if (!as_rank && o.backend != "cpu") (void)make_tp_indexer(o.backend, rc_default, 1);

  // ---- the grid
  std::vector<KvDtype> dts;
  for (const auto& s : o.kv_dtypes) dts.push_back(parse_kv_dtype(s, "--kv-dtype"));
  bool want_off = false, want_on = false;
  for (const auto& s : o.shardings) {
    if (s == "off") want_off = true;
    else if (s == "on") want_on = true;
    else bad("--sharding = \"" + s + "\" is not supported; use off, on or off,on");
  }
  for (int32_t P : o.page_sizes)
    if (P != 128 && P != 256) bad("--page-size = " + std::to_string(P) + " is not supported; use 128, 256");
  for (int32_t W : o.tps)
    if (W != 1 && W != 2 && W != 4 && W != 8) bad("--tp = " + std::to_string(W) + " is not supported; use 1, 2, 4, 8");
  // ---- data
  const int32_t rows_per_req = o.prefill_tokens + o.steps * o.query_len;
  Data data;
  if (o.synthetic) {
    if (o.requests < 0 || o.requests > 4096) bad("--requests = " + std::to_string(o.requests) + " is out of range");
    if (o.tokens < 0) bad("--tokens = " + std::to_string(o.tokens) + " must be > 0");
    if (o.heads < 1 || o.heads > 64) bad("--heads = " + std::to_string(o.heads) + " is out of range 1..64");
    const int32_t R = o.requests ? o.requests : 4, T = o.tokens ? o.tokens : 33024;
    if (rows_per_req > T)
      bad("--prefill-tokens " + std::to_string(o.prefill_tokens) + " + --steps " + std::to_string(o.steps) +
          " x --query-len " + std::to_string(o.query_len) + " = " + std::to_string(rows_per_req) +
          " query positions exceed --tokens " + std::to_string(T));
    if (static_cast<int64_t>(R) * T > (int64_t{1} << 23))
      bad("--requests x --tokens = " + std::to_string(static_cast<int64_t>(R) * T) +
          " synthetic tokens is too large (at most 8,388,608)");
    // generated once the policy accepts some combination (an error then is the only output)
    data.R = R;
    data.T = T;
    data.Qn = rows_per_req;
    data.H = o.heads;
  } else {
    std::string kp = o.keys_file, qp = o.queries_file;
    if (kp.empty()) {
      const std::string dir =
          o.data_dir.empty() ? find_default_data(self_executable(), INDEXCP_INSTALLED_DATA_DIR, INDEXCP_DEFAULT_DATA_DIR).string() : o.data_dir;
      std::error_code ec;
      if (!fs::is_directory(dir, ec)) throw Error(ErrorCode::kIo, dir + ": no such data directory (--data)");
      kp = (fs::path(dir) / "keys.npy").string();
      qp = (fs::path(dir) / "queries.npy").string();
      data = load_files(kp, qp);
      data.source = "real";
      data.name = fs::path(dir).lexically_normal().filename().string();
      if (data.name.empty()) data.name = fs::path(dir).lexically_normal().parent_path().filename().string();
      const fs::path meta = fs::path(dir) / "meta.json";
      if (fs::exists(meta, ec)) {
        try {
          data.meta = detail::parse_json_strict(detail::read_text_file(meta.string(), "--data"), meta.string());
          if (data.meta.is_object() && data.meta.contains("name") && data.meta["name"].is_string())
            data.name = data.meta["name"].get<std::string>();
        } catch (const json::exception& e) {
          bad(meta.string() + ": not valid JSON (" + e.what() + ")");
        }
      }
    } else {
      data = load_files(kp, qp);
      data.source = "files";
      data.name = fs::path(kp).parent_path().filename().string();
      if (data.name.empty()) data.name = fs::path(kp).stem().string();
    }
    if (o.requests < 0 || o.requests > data.R)
      bad("--requests = " + std::to_string(o.requests) + " is out of range 1.." + std::to_string(data.R) +
          " (the data holds " + std::to_string(data.R) + " requests)");
    if (o.tokens < 0 || o.tokens > data.T)
      bad("--tokens = " + std::to_string(o.tokens) + " is out of range 1.." + std::to_string(data.T) +
          " (the data holds " + std::to_string(data.T) + " tokens per request)");
    if (rows_per_req > data.Qn)
      bad("--prefill-tokens " + std::to_string(o.prefill_tokens) + " + --steps " + std::to_string(o.steps) +
          " x --query-len " + std::to_string(o.query_len) + " = " + std::to_string(rows_per_req) +
          " query positions, but " + data.queries_path + " holds queries for the last " + std::to_string(data.Qn) +
          " positions of each request");
    if (o.heads_given && o.heads != data.H)
      bad("--heads = " + std::to_string(o.heads) + " applies to --synthetic data only; " + data.queries_path +
          " holds " + std::to_string(data.H) + " query heads");
  }
  Workload w;
  w.R = o.requests ? o.requests : data.R;
  w.L = o.tokens ? o.tokens : data.T;
  w.pt = o.prefill_tokens;
  w.S = o.steps;
  w.Q = o.query_len;
  w.H = data.H;
  w.K = o.topk;
  w.offset = data.T - w.L;
  w.ctx0 = w.L - rows_per_req;
  if (w.ctx0 < 0)
    bad("--tokens = " + std::to_string(w.L) + " is shorter than the " + std::to_string(rows_per_req) +
        " prefill and decode positions");
  if (rows_per_req > w.L || rows_per_req > data.Qn) bad("not enough query positions for the workload");

  std::vector<ConfigReport> reports;
  json skipped = json::array();
  struct Planned {
    Combo combo;
    ResolvedConfig rc;
    bool listed;      // reported (else only the replicated reference of an "on" run)
    int report = -1;  // index into reports
  };
  std::vector<Planned> plan;
  for (KvDtype dt : dts)
    for (int32_t P : o.page_sizes)
      for (int32_t W : o.tps) {
        EngineParams ep;
        ep.tp = W;
        ep.page_size = P;
        ep.heads = w.H;
        ep.query_len = w.Q;
        AttentionConfig off;
        off.kv_dtype = dt;
        ResolvedConfig rc_off;
        try {
          check_heads_tp(w.H, W);
          rc_off = resolve_config(off, ep);
        } catch (const Error& e) {
          for (bool on : {false, true})
            if ((on && want_on) || (!on && want_off))
              skipped.push_back({{"kv_dtype", to_string(dt)}, {"page_size", P}, {"tp", W},
                                 {"sharding", on ? "on" : "off"}, {"reason", e.what()}});
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
                               {"reason", e.what()}});
          }
        }
        if (!want_off && !rc_on) continue;
        plan.push_back({{dt, P, W, false}, rc_off, want_off});
        if (rc_on) plan.push_back({{dt, P, W, true}, *rc_on, true});
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
  if (o.synthetic) {
    progress("generating synthetic data (" + std::to_string(data.R) + " requests x " + std::to_string(data.T) +
             " tokens)");
    data = make_synthetic(data.R, data.T, rows_per_req, o.heads, o.seed);
  } else {
    progress("loaded " + data.keys_path + " (" + std::to_string(data.R) + " requests x " + std::to_string(data.T) +
             " tokens, " + data.keys_dtype + ") and " + data.queries_path + " (last " + std::to_string(data.Qn) +
             " positions x " + std::to_string(data.H) + " heads, " + data.queries_dtype + ")");
  }
  for (auto& p : plan)
    if (p.listed) {
      p.report = static_cast<int>(reports.size());
      ConfigReport r;
      r.combo = p.combo;
      r.rc = p.rc;
      r.recall_per_head.assign(static_cast<std::size_t>(w.H), 0.0);
      reports.push_back(r);
    }
  const int n_runs = static_cast<int>(plan.size());

  // ---- the group (as a rank): formed once the arguments and data are known to be good
  std::unique_ptr<nccl::NcclCommunicator> group;
  if (as_rank) {
    progress("joining the TP" + std::to_string(env->world) + " group (rank " + std::to_string(env->rank) + ", GPU " +
             std::to_string(env->device) + ")");
    group = nccl::make_communicator(*env);  // also makes env->device the current device
  }

  // ---- layers
  std::string backend_used;
  for (int32_t layer = 0; layer < o.layers; ++layer) {
    const std::string lname = o.layers > 1 ? "layer " + std::to_string(layer) + ": " : "";
    if (o.synthetic && layer > 0) data = make_synthetic(w.R, w.L, rows_per_req, w.H, o.seed + static_cast<uint32_t>(layer));
    if (layer == 0 || o.synthetic) {
      const double t = now_s();
      build_workload(data, w);
      progress(lname + "fp32 reference selections: " + fmt("%.1f s", now_s() - t));
    }
    const std::size_t per_row = static_cast<std::size_t>(w.H) * w.K;
    std::map<int, std::vector<int32_t>> first_off;  // dtype -> the first replicated run's selections
    std::vector<int32_t> last_off;
    std::string last_off_name;
    for (int i = 0; i < n_runs; ++i) {
      const Planned& p = plan[i];
      const double t = now_s();
      RunResult rr = run_combo(o.backend, p.rc, data, w, group.get());
      backend_used = rr.backend;
      progress(lname + "[" + std::to_string(i + 1) + "/" + std::to_string(n_runs) + "] " + combo_name(p.combo) +
               (p.listed ? "" : " (replicated reference)") + ": insert " + fmt("%.1f s", rr.insert_us * 1e-6) +
               ", prefill " + fmt("%.2f s", rr.prefill_us * 1e-6) + ", decode " +
               fmt("%.2f s", rr.decode_us * 1e-6) + " per rank; " + fmt("%.1f s", now_s() - t) + " wall");
      bool equal;
      std::string vs;
      if (!p.combo.on) {
        auto it = first_off.find(static_cast<int>(p.combo.dtype));
        if (it == first_off.end()) it = first_off.emplace(static_cast<int>(p.combo.dtype), rr.sel).first;
        equal = it->second == rr.sel;
        vs = "the first sharding-off run of this kv_dtype (replicated selections do not depend on P or TP)";
        last_off = rr.sel;
        last_off_name = combo_name(p.combo);
      } else {
        equal = last_off == rr.sel;
        vs = "sharding off at the same kv_dtype, page size and TP (every prefill and decode step)";
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

  // ---- capacity (stated budget, TP2 P128, NVFP4 KV and index)
  const ModelDesc m3 = ModelDesc::builtin("minimax-m3");
  const CapacityReport cap = plan_capacity(m3, budget, KvDtype::kNvfp4, KvDtype::kNvfp4, 2, 128);
  json capj = json::parse(cap.to_json());
  capj["budget_gib_per_rank"] = o.capacity_budget_gib;
  capj["note"] = upstream_reference_note("minimax-m3", budget);
  if (cap.off.tokens == 0) capj["ratio"] = nullptr;  // fewer than one page fits: no ratio

  // ---- report
  bool all_equal = true;
  int sharded_runs = 0;  // listed configurations whose index cache really was sharded
  json configs = json::array();
  for (const auto& r : reports) {
    if (r.combo.on && r.rc.sharding) ++sharded_runs;
    double recall = 0;
    for (double x : r.recall_per_head) recall += x / static_cast<double>(r.recall_per_head.size());
    all_equal = all_equal && r.equal;
    configs.push_back({{"kv_dtype", to_string(r.combo.dtype)},
                       {"page_size", r.combo.P},
                       {"tp", r.combo.W},
                       {"sharding", r.combo.on ? "on" : "off"},
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
      {"backend", backend_used},
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
      {"skipped", skipped},
      {"all_selections_equal_replicated", all_equal},
      {"sharded_configurations_run", sharded_runs},
      {"capacity", capj},
      {"definitions",
       {{"us_per_layer_per_rank",
         "mean over decode steps of one rank's busy time (StepStats.us_per_rank, averaged over ranks) for one "
         "decode step of one layer"},
        {"prefill_us_per_layer_per_rank", "the same for the prefill chunk"},
        {"recall_vs_fp32",
         "|fp32-reference blocks ∩ selected blocks| / |fp32-reference blocks| per (row, head), the forced local "
         "block included, averaged over all prefill and decode rows, then over heads; the reference scores blocks "
         "by max over tokens of dot(q, k) in double from the unquantized fp32 keys and queries"},
        {"selections_equal_replicated",
         "sharding on: bit-for-bit equal to the sharding-off run of the same kv_dtype, page size and TP on every "
         "prefill and decode step; sharding off: equal to the first sharding-off run of the same kv_dtype"}}},
      {"wall_s", now_s() - t_start}};
  {  // the commit that ran, as the bench records carry it (INDEXCP_GIT_REV, set by the device scripts)
    const char* rev = detail::knob_env("INDEXCP_GIT_REV");
    report["git_rev"] = (rev && *rev) ? rev : "unknown";
  }
  report["processes"] = as_rank ? env->world : 1;  // spec/bench.md's fields: ranks as processes, GPUs used
  report["num_gpus"] = as_rank ? env->world : (backend_used == "cuda" ? 1 : 0);
  if (as_rank) {
    report["nccl"] = nccl::version();
    report["definitions"]["us_per_layer_per_rank"] =
        "mean over decode steps of rank 0's busy time (its GPU work and its NCCL exchanges, one process per rank) "
        "for one decode step of one layer";
  }

  // ---- table
  std::ostringstream os;
  const auto plural = [](int64_t n, const char* one, const char* many) { return std::to_string(n) + (n == 1 ? one : many); };
  os << "indexcp run: " << data.source << " data \"" << data.name << "\", " << plural(w.R, " request", " requests") << " x "
     << w.L << " tokens, " << plural(o.layers, " layer", " layers") << ", backend " << backend_used
     << (as_rank ? ", TP" + std::to_string(env->world) + " across " + std::to_string(env->world) +
                       " processes (one GPU each, NCCL; times of rank 0)"
                 : std::string())
     << "\n";
  os << "  per request: " << w.ctx0 << " tokens inserted directly, a " << w.pt
     << "-token prefill chunk (gather mode when sharded), " << plural(w.S, " decode step", " decode steps") << " x "
     << plural(w.Q, " query", " queries") << "; H = " << w.H << ", top-" << w.K << "\n\n";
  char line[256];
  std::snprintf(line, sizeof line, "%-8s %5s %3s %-8s %12s %10s %9s %14s %14s\n", "kv_dtype", "P", "TP", "sharding",
                "B/token/rank", "sel==repl", "recall", "decode us/rank", "prefill us/rank");
  os << line;
  for (const auto& c : configs) {
    std::snprintf(line, sizeof line, "%-8s %5d %3d %-8s %12lld %10s %9.4f %14.0f %14.0f\n",
                  c["kv_dtype"].get<std::string>().c_str(), c["page_size"].get<int>(), c["tp"].get<int>(),
                  c["sharding"].get<std::string>().c_str(),
                  static_cast<long long>(c["bytes_per_token_per_layer_per_rank"].get<int64_t>()),
                  c["selections_equal_replicated"].get<bool>() ? "yes" : "NO", c["recall_vs_fp32"].get<double>(),
                  c["us_per_layer_per_rank"].get<double>(), c["prefill_us_per_layer_per_rank"].get<double>());
    os << line;
  }
  {  // how the times were taken (the same for every configuration of one backend)
    std::string dt, pt;
    for (const auto& c : configs) {
      if (dt.empty()) dt = c["decode_timing"].get<std::string>();
      if (pt.empty()) pt = c["prefill_timing"].get<std::string>();
    }
    if (!dt.empty()) os << "decode us/rank: " << dt << "\n";
    if (!pt.empty()) os << "prefill us/rank: " << pt << "\n";
  }
  for (const auto& s : skipped)
    os << "skipped: " << s["kv_dtype"].get<std::string>() << " P" << s["page_size"].get<int>() << " TP"
       << s["tp"].get<int>() << " sharding " << s["sharding"].get<std::string>() << ": "
       << s["reason"].get<std::string>() << "\n";
  if (sharded_runs > 0) {
    os << "\nsharded selections " << (all_equal ? "equal" : "DIFFER FROM") << " the replicated ones"
       << (all_equal ? " in every configuration" : "") << " (bit for bit, every prefill and decode step)\n";
  } else {
    bool any_on = false;
    for (const auto& r : reports) any_on = any_on || r.combo.on;
    const std::string why = !want_on ? "--sharding off"
                            : any_on ? "sharding on is a no-op at TP1: one rank keeps the whole cache"
                                     : "the policy refused every sharding-on configuration";
    os << "\nno sharded configuration ran (" << why << "); the replicated selections "
       << (all_equal ? "agree" : "DIFFER") << " across the configurations of each kv_dtype\n";
  }
  os << "capacity, minimax-m3 at " << fmt("%g", o.capacity_budget_gib) << " GiB per rank, TP2 P128, NVFP4 KV + index: "
     << fmt_int(cap.off.tokens) << " tokens with sharding off, " << fmt_int(cap.on.tokens) << " on ("
     << (cap.off.tokens ? "x" + fmt("%.3f", cap.ratio()) : std::string("no ratio: fewer than one page fits")) << ")\n";

  if (as_rank) {
    // this rank's outcome for the launcher's merged report ($INDEXCP_REPORT_DIR/rank<r>.json)
    if (const char* dir = detail::knob_env("INDEXCP_REPORT_DIR"); dir && *dir) {
      json rr = {{"rank", env->rank}, {"cuda_device", env->device}, {"all_selections_equal_replicated", all_equal},
                 {"configs", json::array()}};
      for (const auto& c : configs)
        rr["configs"].push_back({{"kv_dtype", c["kv_dtype"]}, {"page_size", c["page_size"]}, {"tp", c["tp"]},
                                 {"sharding", c["sharding"]}, {"selections_equal_replicated", c["selections_equal_replicated"]},
                                 {"us_per_layer_per_rank", c["us_per_layer_per_rank"]},
                                 {"prefill_us_per_layer_per_rank", c["prefill_us_per_layer_per_rank"]}});
      write_file_atomic(std::string(dir) + "/rank" + std::to_string(env->rank) + ".json", detail::dump_text(rr) + "\n");
    }
    group->finalize();
  }
  const bool lead = !as_rank || env->rank == 0;
  if (lead && !o.json_path.empty()) write_file_atomic(o.json_path, detail::dump_text(report, 2) + "\n");
  if (lead) std::cout << os.str() << std::flush;
  progress("done in " + fmt("%.1f s", now_s() - t_start));
  if (!all_equal) {  // the failure's one error line, last
    std::string which;
    for (const auto& r : reports)
      if (!r.equal) {
        which = combo_name(r.combo);
        break;
      }
    std::cerr << "indexcp: error: selections differ from the replicated ones (first: " << which
              << "; see the table and the MISMATCH lines)" << std::endl;
  }
  return all_equal ? 0 : 3;
}

}  // namespace indexcp::cli
