// `indexcp run`'s data (run.hpp): loading or generating keys and queries, and one layer's workload
// (its window of the data, quantized queries and fp32 reference selections).
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>

#include "core/file_util.hpp"
#include "core/json_util.hpp"
#include "data_search.hpp"
#include "indexcp/error.hpp"
#include "indexcp/indexer.hpp"
#include "indexcp/npy.hpp"
#include "reference.hpp"
#include "run.hpp"

#ifndef INDEXCP_DEFAULT_DATA_DIR
#define INDEXCP_DEFAULT_DATA_DIR "data/minilm_stdlib"
#endif

namespace indexcp::cli {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

[[noreturn]] void bad(const std::string& msg) { throw Error(ErrorCode::kInvalidArgument, msg); }

// The queries of request r at window positions [pos0, pos0 + n), quantized to E4M3 rows
// [n][H][128] (what the indexer is given).
void quantize_rows(const Data& d, const Workload& w, int32_t r, int64_t pos0, int32_t n, uint8_t* out) {
  std::vector<float> tmp(static_cast<std::size_t>(n) * w.H * kHeadDim);
  for (int32_t i = 0; i < n; ++i)
    std::copy_n(d.query(r, w.offset + pos0 + i), static_cast<std::size_t>(w.H) * kHeadDim,
                tmp.data() + static_cast<std::size_t>(i) * w.H * kHeadDim);
  quantize_queries(tmp.data(), n, w.H, KeyPreprocess{}, out);
}

}  // namespace

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

Data load_run_data(const RunOptions& o, int32_t rows_per_req) {
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
  return data;
}

Workload make_workload(const RunOptions& o, const Data& data, int32_t rows_per_req) {
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

  return w;
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

}  // namespace indexcp::cli
