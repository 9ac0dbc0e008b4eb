// JSON from outside the process (a client's request, a peer's reply, a frame header), parsed
// with a nesting limit checked first: nlohmann's values destroy and dump themselves
// recursively, so a deeply nested document (100k levels in 200 KB) would overflow the stack
// after a successful parse. Every untrusted JSON text goes through parse_untrusted_json.
#pragma once

#include <nlohmann/json.hpp>
#include <string_view>

#include "common/status.h"

namespace hetero {

// Deeper than any request, reply or header this project reads.
constexpr int kMaxJsonDepth = 64;

// The deepest nesting of arrays and objects in `text` (strings skipped), stopping at `limit`+1.
int json_depth(std::string_view text, int limit = kMaxJsonDepth);

// Parses `text`; kInvalidArgument when it is not JSON or nests deeper than max_depth.
Result<nlohmann::json> parse_untrusted_json(std::string_view text, int max_depth = kMaxJsonDepth);

// `j` as JSON text, never throwing: a string that is not UTF-8 (a request target or header a
// client sent, quoted in an error message) has its bad bytes replaced by U+FFFD. nlohmann's
// dump() throws on them, and an exception on a connection thread ended the process (the fuzz
// finding fuzz/findings/http_server-target-not-utf8). Every reply body built from what a
// client sent goes through it.
std::string json_text(const nlohmann::json& j);

}  // namespace hetero
