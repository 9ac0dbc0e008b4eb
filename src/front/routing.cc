// Routing: see routing.h.
#include "front/routing.h"

namespace hetero {

Result<BridgeMode> parse_bridge_mode(const std::string& header) {
  if (header.empty()) return BridgeMode::kAuto;
  if (header == "native") return BridgeMode::kNative;
  if (header == "bridge") return BridgeMode::kBridge;
  return invalid_argument("X-PD-Bridge-Mode must be 'native' or 'bridge', got '" + header + "'");
}

Route route_request(int64_t t, BridgeMode mode, const RoutePolicy& policy,
                    const std::function<Result<int64_t>()>& cached_prefix) {
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
    if (mode == BridgeMode::kAuto && t - r.cached < policy.min_tail) {
      r.verdict = Verdict::skipped("warm (" + std::to_string(r.cached) + " of " +
                                   std::to_string(t) + " cached)");
    } else {
      r.bridge = true;
    }
  }
  r.verdict.t = t;
  return r;
}

}  // namespace hetero
