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

/// `v` as JSON text for files and reports; strings that are not valid UTF-8 (a path or a rank's
/// message with arbitrary bytes) get U+FFFD in place of the bad bytes instead of an exception.
inline std::string dump_text(const nlohmann::json& v, int indent = -1) {
  return v.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

/// A JSON value as text, cut to `max` characters (error messages stay one short line).
inline std::string short_dump(const nlohmann::json& v, std::size_t max = 80) {
  std::string s = dump_text(v);
  if (s.size() > max) s = s.substr(0, max) + "... (" + std::to_string(s.size()) + " characters)";
  return s;
}

}  // namespace indexcp::detail
