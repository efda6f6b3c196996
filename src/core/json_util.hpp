// Strict JSON parsing for outside input (attention config, model descriptions). Internal.
#pragma once

#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "indexcp/error.hpp"

namespace indexcp::detail {

/// Parses `text`; refuses invalid JSON and duplicate keys in any object (naming `what` and the
/// key), so that `{"a": 1, "a": 2}` cannot silently mean 2.
inline nlohmann::json parse_json_strict(const std::string& text, const std::string& what) {
  using nlohmann::json;
  std::vector<std::set<std::string>> keys;
  const json::parser_callback_t cb = [&](int, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::object_start) {
      keys.emplace_back();
    } else if (ev == json::parse_event_t::object_end) {
      if (!keys.empty()) keys.pop_back();
    } else if (ev == json::parse_event_t::key && !keys.empty()) {
      const std::string k = parsed.get<std::string>();
      if (!keys.back().insert(k).second)
        throw Error(ErrorCode::kInvalidArgument,
                    what + ": key \"" + (k.size() > 64 ? k.substr(0, 64) + "..." : k) + "\" appears twice");
    }
    return true;
  };
  try {
    return json::parse(text, cb);
  } catch (const json::exception& e) {
    throw Error(ErrorCode::kInvalidArgument, what + " is not valid JSON: " + e.what());
  }
}

/// A JSON value as text, cut to `max` characters (error messages stay one short line).
inline std::string short_dump(const nlohmann::json& v, std::size_t max = 80) {
  std::string s = v.dump();
  if (s.size() > max) s = s.substr(0, max) + "... (" + std::to_string(s.size()) + " characters)";
  return s;
}

}  // namespace indexcp::detail
