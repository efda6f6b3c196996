// `indexcp capacity`: KV-cache capacity in tokens with index-cache sharding off and on.
#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "core/file_util.hpp"
#include "core/json_util.hpp"
#include "indexcp/capacity.hpp"
#include "indexcp/config.hpp"
#include "indexcp/error.hpp"
#include "subcommand.hpp"
#include "validators.hpp"

namespace indexcp::cli {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

struct CapacityOptions {
  std::string model = "minimax-m3";
  double budget_gib = 100.0;
  std::string budget_bytes;  ///< --budget-bytes as typed, parsed by the command (overrides budget_gib)
  bool budget_bytes_given = false;
  std::string kv_dtype = "nvfp4", index_dtype = "nvfp4";
  int32_t tp = 2, page_size = 128;
  std::string json_path;
};

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

namespace {

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

class CapacityCommand final : public Subcommand {
 public:
  CLI::App* add(CLI::App& app) override {
    CapacityOptions& co = o_;
    auto* cap = app.add_subcommand("capacity", "KV-cache capacity in tokens with index-cache sharding off and on");
    cap->add_option("--model", co.model, "built-in model name (minimax-m3) or a model JSON file")->capture_default_str();
    // (the limits are checked by the command, with one message: commands.hpp kMaxBudgetBytes)
    auto* gib = cap->add_option("--budget-gib", co.budget_gib, "KV-cache memory budget per rank in GiB (> 0, at most 1048576)")
                    ->capture_default_str();
    bytes_ = cap->add_option("--budget-bytes", co.budget_bytes,
                             "KV-cache memory budget per rank in bytes (> 0, at most 2^50)");
    gib->excludes(bytes_);
    cap->add_option("--kv-dtype", co.kv_dtype, "KV cache dtype")
        ->check(CLI::IsMember({"bf16", "fp8", "nvfp4"}))
        ->capture_default_str();
    cap->add_option("--index-dtype", co.index_dtype, "index cache dtype")
        ->check(CLI::IsMember({"bf16", "fp8", "nvfp4"}))
        ->capture_default_str();
    cap->add_option("--tp", co.tp, "tensor-parallel size")->check(CLI::IsMember({1, 2, 4, 8}))->capture_default_str();
    cap->add_option("--page-size", co.page_size, "page size (engines' --block-size)")
        ->check(CLI::IsMember({128, 256}))
        ->capture_default_str();
    cap->add_option("--json", co.json_path, "also write the plan as JSON to FILE")->check(non_empty_path());
    return cap;
  }
  int run(int, char**) override {
    o_.budget_bytes_given = bytes_->count() > 0;
    return capacity_command(o_);
  }

 private:
  CapacityOptions o_;
  CLI::Option* bytes_ = nullptr;
};

}  // namespace

INDEXCP_SUBCOMMAND(30, "capacity", CapacityCommand)

}  // namespace indexcp::cli
