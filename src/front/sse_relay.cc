// The SSE relay: see sse_relay.h.
#include "front/sse_relay.h"

#include <nlohmann/json.hpp>

#include "common/json_text.h"

namespace hetero {
namespace {

// The end of the first complete event in s (just past its blank line), or npos.
size_t event_end(std::string_view s) {
  const size_t lf = s.find("\n\n"), crlf = s.find("\r\n\r\n");
  if (lf == std::string_view::npos && crlf == std::string_view::npos) return std::string_view::npos;
  if (crlf == std::string_view::npos || (lf != std::string_view::npos && lf < crlf)) return lf + 2;
  return crlf + 4;
}

// The JSON of an event's single data line, or a discarded value.
nlohmann::json event_json(std::string_view event) {
  size_t start = event.find("data:");
  if (start != 0) return nlohmann::json(nlohmann::json::value_t::discarded);
  start += 5;
  const size_t end = event.find_first_of("\r\n", start);
  const std::string_view payload = event.substr(start, end - start);
  auto j = parse_untrusted_json(payload);
  return j.is_ok() ? std::move(j.value()) : nlohmann::json(nlohmann::json::value_t::discarded);
}

bool is_usage_event(const nlohmann::json& j) {
  if (!j.is_object() || !j.contains("usage") || !j["usage"].is_object()) return false;
  return !j.contains("choices") || (j["choices"].is_array() && j["choices"].empty());
}

}  // namespace

void SseUsageRelay::feed(std::string_view data, std::string* out) {
  pending_.append(data);
  size_t done = 0;
  for (size_t end;
       (end = event_end(std::string_view(pending_).substr(done))) != std::string_view::npos;
       done += end)
    relay_event(std::string_view(pending_).substr(done, end), out);
  pending_.erase(0, done);
}

void SseUsageRelay::relay_event(std::string_view event, std::string* out) {
  if (event.substr(0, 12) == "data: [DONE]") saw_done_ = true;
  nlohmann::json j = event_json(event);
  if (j.is_discarded() || !is_usage_event(j)) {
    out->append(event);
    return;
  }
  usage_ = usage_from_reply(j);
  if (!client_wants_usage_) return;  // the front asked for it, not the client
  j["x_pd_bridge"] = confirmed("").to_json();
  out->append("data: " + j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n\n");
}

std::string SseUsageRelay::flush() {
  std::string rest;
  rest.swap(pending_);
  return rest;
}

Verdict SseUsageRelay::confirmed(const std::string& why_missing) const {
  DecoderUsage u = usage_;
  if (!u.present && u.missing_why.empty()) u.missing_why = why_missing;
  return confirm_verdict(predicted_, u);
}

}  // namespace hetero
