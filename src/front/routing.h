// What a completion request must be, and where it goes: straight to the decoder, or through a
// bridge first. The route is a pure decision on the prompt's length, the client's
// X-PD-Bridge-Mode header and what the decoder already holds of it; the lookup of the latter is
// a callback, made only when the decision needs it (a short prompt never costs a lookup).
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "common/status.h"
#include "decode/verdict.h"

namespace hetero {

// Why a parsed request body is not a completion request the decoder can take ("" when it is):
// the field types the decoder would otherwise answer with a crash or a 500 mid-stream.
std::string completion_request_error(const nlohmann::json& body, bool chat);

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
