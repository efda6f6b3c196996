// `indexcp capacity`, `indexcp config`, and the small file helpers of the command.
#include <unistd.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "core/file_util.hpp"
#include "core/json_util.hpp"
#include "indexcp/capacity.hpp"
#include "indexcp/config.hpp"
#include "indexcp/error.hpp"

namespace indexcp::cli {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// The upstream design's reference point (spec/config.md section 3).
constexpr int64_t kUpstreamOff = 5492736;
constexpr int64_t kUpstreamOn = 6030720;

ModelDesc load_model(const std::string& m) {
  if (m == "minimax-m3") return ModelDesc::builtin(m);
  std::error_code ec;
  if (fs::exists(m, ec) || (m.size() > 5 && m.substr(m.size() - 5) == ".json")) {
    // a missing file, a directory, a FIFO or a device is refused, naming the path and --model
    const std::string text = detail::read_text_file(m, "--model");
    try {
      return ModelDesc::from_json(text);
    } catch (const Error& e) {
      throw Error(e.code(), m + ": " + e.what());
    }
  }
  return ModelDesc::builtin(m);  // throws, naming --model and the built-ins
}

}  // namespace

void check_output_path(const std::string& path, const std::string& flag) {
  if (path.empty()) throw Error(ErrorCode::kInvalidArgument, flag + ": empty file name");
  std::error_code ec;
  const fs::path p(path);
  if (fs::is_directory(p, ec)) throw Error(ErrorCode::kInvalidArgument, path + ": is a directory (" + flag + ")");
  const fs::path dir = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  if (!fs::is_directory(dir, ec))
    throw Error(ErrorCode::kInvalidArgument, path + ": directory " + dir.string() + " does not exist (" + flag + ")");
}

void write_file_atomic(const std::string& path, const std::string& text) {
  const fs::path p(path);
  std::error_code sec;
  const fs::file_status lst = fs::symlink_status(p, sec);
  if (!sec && fs::exists(lst) && !fs::is_regular_file(lst)) {
    // a symlink, device (/dev/null), FIFO...: write through it, never replace it
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out) throw Error(ErrorCode::kIo, path + ": cannot open for writing");
    out << text;
    out.close();
    if (!out) throw Error(ErrorCode::kIo, path + ": write error");
    return;
  }
  std::string tmp_name(1, '.');  // (built in steps: GCC 12 warns falsely on "." + string)
  tmp_name += p.filename().string();
  tmp_name += ".tmp";
  tmp_name += std::to_string(::getpid());
  const fs::path tmp = p.parent_path() / tmp_name;
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw Error(ErrorCode::kIo, path + ": cannot open for writing");
    out << text;
    out.close();
    if (!out) {
      std::error_code ec;
      fs::remove(tmp, ec);
      throw Error(ErrorCode::kIo, path + ": write error");
    }
  }
  std::error_code ec;
  fs::rename(tmp, p, ec);
  if (ec) {
    std::error_code ec2;
    fs::remove(tmp, ec2);
    throw Error(ErrorCode::kIo, path + ": cannot write (" + ec.message() + ")");
  }
}

int64_t budget_bytes_from_gib(double gib, const std::string& flag) {
  const std::string limits = " must be > 0 and at most " + fmt("%.0f", kMaxBudgetGib) + " (GiB per rank)";
  if (!std::isfinite(gib) || !(gib > 0) || gib > kMaxBudgetGib)
    throw Error(ErrorCode::kInvalidArgument, flag + " = " + fmt("%g", gib) + limits);
  const int64_t bytes = static_cast<int64_t>(std::llround(gib * 1073741824.0));
  if (bytes < 1)
    throw Error(ErrorCode::kInvalidArgument, flag + " = " + fmt("%g", gib) + " is less than one byte;" + limits);
  return bytes;
}

int64_t parse_budget_bytes(const std::string& text, const std::string& flag) {
  int64_t bytes = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, bytes);
  const bool digits = !text.empty() && text.find_first_not_of("-0123456789") == std::string::npos;
  if (!digits || (ec != std::errc() && ec != std::errc::result_out_of_range) || (ec == std::errc() && ptr != end))
    throw Error(ErrorCode::kInvalidArgument, flag + " = " + text + " is not a whole number of bytes");
  if (ec == std::errc::result_out_of_range || bytes < 1 || bytes > kMaxBudgetBytes)
    throw Error(ErrorCode::kInvalidArgument, flag + " = " + text + " must be > 0 and at most " +
                                                 std::to_string(kMaxBudgetBytes) + " (1 PiB per rank)");
  return bytes;
}

std::string upstream_reference_note(const std::string& model, int64_t budget_bytes) {
  const ModelDesc m = load_model(model);
  const CapacityReport r = plan_capacity(m, budget_bytes, KvDtype::kNvfp4, KvDtype::kNvfp4, 2, 128);
  const double ru = static_cast<double>(kUpstreamOn) / static_cast<double>(kUpstreamOff);
  const int64_t kv = r.off.kv_bytes_per_token, ioff = r.off.index_bytes_per_token, ion = r.on.index_bytes_per_token;
  std::string s = "upstream reference (MiniMax-M3.1-Flash, GB300, TP2, P128, NVFP4 KV + index): " + fmt_int(kUpstreamOff) +
                  " -> " + fmt_int(kUpstreamOn) + " tokens (x" + fmt("%.3f", ru) + "); ";
  if (r.off.tokens == 0)
    return s + "at this budget " + m.name + " holds fewer than one page (128 tokens) with sharding off, so the "
               "planner gives no ratio to compare";
  s += "the planner gives x" + fmt("%.3f", r.ratio()) + " for " + m.name +
       " at those settings because it counts only K/V (" + fmt_int(kv) + " B/token/rank) and the index (" +
       fmt_int(ioff) + " -> " + fmt_int(ion) + " B)";
  // bytes per token per rank that the upstream figure must hold besides K/V and the index for its ratio
  const double extra = (static_cast<double>(ioff) - ru * static_cast<double>(ion)) / (ru - 1.0) - static_cast<double>(kv);
  if (extra > 0)
    s += "; the upstream ratio implies about " + fmt_int(static_cast<int64_t>(std::llround(extra))) +
         " more B/token/rank that sharding does not shrink (draft-model/MTP KV and reserved memory), which dilutes "
         "the gain; page rounding moves the ratio by < 0.01%";
  else
    s += "; page rounding moves the ratio by < 0.01%";
  return s;
}

int capacity_command(const CapacityOptions& o) {
  const int64_t budget = o.budget_bytes_given ? parse_budget_bytes(o.budget_bytes, "--budget-bytes")
                                              : budget_bytes_from_gib(o.budget_gib, "--budget-gib");
  if (!o.json_path.empty()) check_output_path(o.json_path, "--json");
  const ModelDesc m = load_model(o.model);
  const KvDtype kv = parse_kv_dtype(o.kv_dtype, "--kv-dtype");
  const KvDtype ix = parse_kv_dtype(o.index_dtype, "--index-dtype");
  const CapacityReport r = plan_capacity(m, budget, kv, ix, o.tp, o.page_size);
  // the upstream comparison holds only at its own settings (the built-in model, TP2, P128, NVFP4 KV + index)
  const bool reference_settings = o.model == "minimax-m3" && o.tp == 2 && o.page_size == 128 &&
                                  kv == KvDtype::kNvfp4 && ix == KvDtype::kNvfp4;
  const std::string note = reference_settings ? upstream_reference_note(o.model, budget) : "";
  // why "on" cannot shrink the index here (empty: it does)
  std::string no_shard;
  if (m.sparse_layers == 0) no_shard = "the model has no sparse layers, so it has no index cache";
  else if (ix == KvDtype::kBf16) no_shard = "a bf16 index cache is never sharded";
  else if (o.tp == 1) no_shard = "at TP1 one rank keeps the whole index";
  else if ((o.page_size / o.tp) % 16 != 0) no_shard = "page_size / tp rows per rank are not a multiple of 16";

  std::ostringstream os;
  os << "model " << m.name << ": " << m.layers << " layers (" << m.sparse_layers << " sparse), " << m.kv_heads
     << " KV heads x " << m.head_dim << ", " << m.index_heads << " index heads\n";
  os << "budget " << fmt_int(budget) << " bytes per rank (" << fmt("%.2f", static_cast<double>(budget) / 1073741824.0)
     << " GiB); TP" << o.tp << ", page size " << o.page_size << ", KV " << to_string(kv) << ", index " << to_string(ix)
     << "\n\n";
  char line[200];
  std::snprintf(line, sizeof line, "%-13s %14s %16s %16s %14s\n", "", "KV B/token", "index B/token", "total B/token",
                "tokens");
  os << line;
  for (const CapacityResult* c : {&r.off, &r.on}) {
    // the second row asks for sharding; "n/a" where it cannot apply (the note below says why)
    const char* label = c == &r.off ? "sharding off" : c->sharding ? "sharding on" : "sharding n/a";
    std::snprintf(line, sizeof line, "%-13s %14s %16s %16s %14s\n", label,
                  fmt_int(c->kv_bytes_per_token).c_str(), fmt_int(c->index_bytes_per_token).c_str(),
                  fmt_int(c->kv_bytes_per_token + c->index_bytes_per_token).c_str(), fmt_int(c->tokens).c_str());
    os << line;
  }
  if (r.off.tokens == 0 && r.on.tokens == 0)
    os << "ratio on/off: none (the budget holds fewer than one page of " << o.page_size
       << " tokens with sharding off or on)\n";
  else if (r.off.tokens == 0)
    os << "ratio on/off: none (the budget holds fewer than one page of " << o.page_size
       << " tokens with sharding off; " << fmt_int(r.on.tokens) << " with sharding on)\n";
  else
    os << "ratio on/off: x" << fmt("%.3f", r.ratio()) << "\n";
  if (!no_shard.empty()) os << "(sharding does not apply here: " << no_shard << ")\n";
  if (!note.empty()) os << note << "\n";
  if (!o.json_path.empty()) {
    json j = json::parse(r.to_json());
    j["budget_gib"] = static_cast<double>(budget) / 1073741824.0;
    if (r.off.tokens == 0) j["ratio"] = nullptr;
    if (!no_shard.empty()) j["sharding_does_not_apply"] = no_shard;
    if (reference_settings) {
      j["upstream_reference"] = {{"model", "MiniMax-M3.1-Flash"}, {"gpu", "GB300"}, {"tp", 2}, {"page_size", 128},
                                 {"kv_dtype", "nvfp4"}, {"index_dtype", "nvfp4"}, {"off_tokens", kUpstreamOff},
                                 {"on_tokens", kUpstreamOn},
                                 {"ratio", static_cast<double>(kUpstreamOn) / static_cast<double>(kUpstreamOff)}};
      j["note"] = note;
    }
    write_file_atomic(o.json_path, detail::dump_text(j, 2) + "\n");
  }
  std::cout << os.str() << std::flush;
  return 0;
}

int config_command(const ConfigOptions& o) {
  std::string text = o.attention_config;
  if (!text.empty() && text[0] == '@') {
    if (text.size() == 1) throw Error(ErrorCode::kInvalidArgument, "--attention-config: \"@\" needs a file name (@FILE)");
    text = detail::read_text_file(text.substr(1), "--attention-config");
  }
  AttentionConfig ac;
  try {
    ac = AttentionConfig::from_json(text);
  } catch (const Error& e) {
    throw Error(e.code(), std::string("--attention-config: ") + e.what());
  }
  EngineParams ep;
  ep.tp = o.tp;
  ep.page_size = o.page_size;
  ep.heads = o.heads;
  ep.query_len = o.query_len;
  ep.speculative_method = o.speculative_method;
  ep.kv_connector = o.kv_connector;
  const ResolvedConfig rc = resolve_config(ac, ep);
  std::cout << rc.to_json() << std::endl;
  return 0;
}

std::string fmt_int(int64_t v) {
  std::string s = std::to_string(v < 0 ? -v : v), out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return (v < 0 ? "-" : "") + out;
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

}  // namespace indexcp::cli
