// Routing: see routing.h.
#include "front/routing.h"

#include <cmath>

namespace hetero {
using nlohmann::json;

std::string completion_request_error(const nlohmann::json& body, bool chat) {
  if (!body.is_object()) return "the request body must be a JSON object";
  if (chat) {
    if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty())
      return "'messages' must be a non-empty array";
    for (const auto& m : body["messages"])
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
        return "every message must be an object with a string 'role'";
  } else {
    if (!body.contains("prompt") || !body["prompt"].is_string() ||
        body["prompt"].get<std::string>().empty())
      return "'prompt' must be a non-empty string";
  }
  if (body.contains("model") && !body["model"].is_string()) return "'model' must be a string";
  if (body.contains("stream") && !body["stream"].is_boolean()) return "'stream' must be a boolean";
  if (body.contains("stream_options") && !body["stream_options"].is_object())
    return "'stream_options' must be an object";
  if (body.contains("stream_options") && body["stream_options"].contains("include_usage") &&
      !body["stream_options"]["include_usage"].is_boolean())
    return "'stream_options.include_usage' must be a boolean";
  if (body.contains("max_tokens") &&
      (!body["max_tokens"].is_number_integer() || body["max_tokens"].get<int64_t>() < 1))
    return "'max_tokens' must be a positive integer";
  for (const char* f : {"temperature", "top_p"})
    if (body.contains(f) && !body[f].is_number())
      return std::string("'") + f + "' must be a number";
  return "";
}

Result<BridgeMode> parse_bridge_mode(const std::string& header) {
  if (header.empty()) return BridgeMode::kAuto;
  if (header == "native") return BridgeMode::kNative;
  if (header == "bridge") return BridgeMode::kBridge;
  return invalid_argument("X-PD-Bridge-Mode must be 'native' or 'bridge', got '" + header + "'");
}

Route route_request(int64_t t, BridgeMode mode, const RoutePolicy& policy,
                    const std::function<Result<int64_t>()>& cached_prefix,
                    const std::function<TailCosts(int64_t tail, int64_t cached)>& costs) {
  Route r;
  if (mode == BridgeMode::kNative) {
    r.verdict = Verdict::skipped("native requested");
  } else if (t < 2 || (mode == BridgeMode::kAuto && t < policy.min_tokens)) {
    r.verdict = Verdict::skipped("short (T=" + std::to_string(t) + " < " +
                                 std::to_string(std::max<int64_t>(policy.min_tokens, 2)) + ")");
  } else if (auto cached = cached_prefix(); !cached.is_ok()) {
    r.verdict = Verdict::declined("cached prefix unknown: " + cached.status().message());
  } else {
    r.cached = cached.value();
    const int64_t tail = t - r.cached;
    const TailCosts c = costs && mode == BridgeMode::kAuto ? costs(tail, r.cached) : TailCosts{};
    const bool measured = c.bridge_ms.has_value() && c.native_ms.has_value();
    if (mode == BridgeMode::kAuto && measured && *c.bridge_ms >= *c.native_ms) {
      r.verdict = Verdict::skipped("the decoder is faster (" + std::to_string(tail) +
                                   "-token tail: " + std::to_string(std::lround(*c.native_ms)) +
                                   " ms native, " + std::to_string(std::lround(*c.bridge_ms)) +
                                   " ms bridged)");
    } else if (mode == BridgeMode::kAuto && !measured && tail < policy.min_tail) {
      r.verdict = Verdict::skipped("warm (" + std::to_string(r.cached) + " of " +
                                   std::to_string(t) + " cached)");
    } else {
      r.bridge = true;
    }
    if (mode == BridgeMode::kAuto) {
      r.verdict.route_by = measured ? "rates" : "min_tail";
      r.verdict.route_tail = tail;
      r.verdict.route_bridge_ms = c.bridge_ms.value_or(-1);
      r.verdict.route_native_ms = c.native_ms.value_or(-1);
    }
  }
  r.verdict.t = t;
  return r;
}

}  // namespace hetero
