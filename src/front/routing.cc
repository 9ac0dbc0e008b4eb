// Routing: see routing.h.
#include "front/routing.h"

#include <cmath>

namespace hetero {
using nlohmann::json;

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
