// `indexcp config`: resolve an attention config under the policy and print it (or the refusal).
#include <CLI/CLI.hpp>

#include <iostream>
#include <string>

#include "core/file_util.hpp"
#include "indexcp/config.hpp"
#include "indexcp/error.hpp"
#include "subcommand.hpp"

namespace indexcp::cli {

namespace {

struct ConfigOptions {
  std::string attention_config;  ///< JSON text, or @FILE
  int32_t tp = 1, page_size = 128, heads = 4, query_len = 1;
  std::string speculative_method;
  bool kv_connector = false;
};

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

class ConfigCommand final : public Subcommand {
 public:
  CLI::App* add(CLI::App& app) override {
    ConfigOptions& cfg = o_;
    auto* con = app.add_subcommand("config", "Resolve an attention config under the policy and print it (or the refusal)");
    con->add_option("--attention-config", cfg.attention_config, "the attention config as a JSON object, or @FILE")
        ->required();
    con->add_option("--tp", cfg.tp, "tensor-parallel size W")->required()->check(CLI::Range(1, 1024));
    con->add_option("--page-size", cfg.page_size, "page size P (engines' --block-size)")
        ->required()
        ->check(CLI::Range(1, 1 << 20));
    con->add_option("--heads", cfg.heads, "index heads H")->check(CLI::Range(1, 1024))->capture_default_str();
    con->add_option("--query-len", cfg.query_len, "decode query length Q")->check(CLI::Range(1, 1024))->capture_default_str();
    con->add_option("--speculative-method", cfg.speculative_method, "speculative decoding method (informational)");
    con->add_flag("--kv-connector", cfg.kv_connector, "a KV connector / CPU offload is configured");
    return con;
  }
  int run(int, char**) override { return config_command(o_); }

 private:
  ConfigOptions o_;
};

}  // namespace

INDEXCP_SUBCOMMAND(40, "config", ConfigCommand)

}  // namespace indexcp::cli
