// Where a completion request goes: straight to the decoder, or through a bridge first. A pure
// decision on the prompt's length, the client's X-PD-Bridge-Mode header and what the decoder
// already holds of it; the lookup of the latter is a callback, made only when the decision
// needs it (a short prompt never costs a lookup).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "common/status.h"
#include "decode/verdict.h"

namespace hetero {

enum class BridgeMode { kAuto, kNative, kBridge };

// The X-PD-Bridge-Mode header: "" (auto), "native" or "bridge"; anything else is an error.
Result<BridgeMode> parse_bridge_mode(const std::string& header);

struct RoutePolicy {
  int64_t min_tokens = 256;  // shorter prompts go straight to the decoder
  int64_t min_tail = 256;    // uncached tails shorter than this go straight too
};

struct Route {
  bool bridge = false;
  int64_t cached = 0;  // the decoder's own cached prefix, when it was looked up
  Verdict verdict;     // for a request that does not bridge: why (skipped or declined)
};

// t: the prompt's tokens; cached_prefix: asks the decoder how many leading tokens it holds.
Route route_request(int64_t t, BridgeMode mode, const RoutePolicy& policy,
                    const std::function<Result<int64_t>()>& cached_prefix);

}  // namespace hetero
