// Where a completion request goes: straight to the decoder, or through a bridge first
// (request_schema.h says what it must be to get this far). The route is a pure decision on the
// prompt's length, the client's X-PD-Bridge-Mode header and what the decoder already holds of
// it; the lookup of the latter is a callback, made only when the decision needs it (a short
// prompt never costs a lookup).
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "common/status.h"
#include "decode/verdict.h"
#include "front/request_schema.h"  // what a request must be before it is routed

namespace hetero {

enum class BridgeMode { kAuto, kNative, kBridge };

// The X-PD-Bridge-Mode header: "" (auto), "native" or "bridge"; anything else is an error.
Result<BridgeMode> parse_bridge_mode(const std::string& header);

struct RoutePolicy {
  int64_t min_tokens = 256;  // shorter prompts go straight to the decoder
  int64_t min_tail = 256;    // until costs are measured: uncached tails shorter go straight too
};

// The predicted cost of a tail each way (front/rates.h); nullopt: not measured.
struct TailCosts {
  std::optional<double> bridge_ms, native_ms;
};

struct Route {
  bool bridge = false;
  int64_t cached = 0;  // the decoder's own cached prefix, when it was looked up
  Verdict verdict;     // for a request that does not bridge: why (skipped or declined)
};

// t: the prompt's tokens; cached_prefix: asks the decoder how many leading tokens it holds.
// costs (null: never measured): what the uncached tail after the cached prefix would cost
// each way. In auto mode a
// prompt of at least min_tokens is bridged when the bridge is predicted faster for its tail;
// while either cost is unmeasured, when the tail is at least min_tail. The verdict says which
// rule decided and its inputs (Verdict::route_*).
Route route_request(int64_t t, BridgeMode mode, const RoutePolicy& policy,
                    const std::function<Result<int64_t>()>& cached_prefix,
                    const std::function<TailCosts(int64_t tail, int64_t cached)>& costs = {});

}  // namespace hetero
