// The attention-input tap: the one seam between the prefill engine and the bridge.
// After each layer's pre-attention norm the engine hands (layer, positions, x) to the consumer.
// x is bf16 [n_tokens, hidden], row-major, valid only for the duration of the call: a consumer
// that works asynchronously copies it (the bridge producer does, into a bounded queue), so the
// forward never waits on the cache program.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"

namespace hetero {

struct TapEvent {
  int32_t layer = 0;
  int64_t pos0 = 0;      // position of the first row
  int64_t n_tokens = 0;  // rows
  int64_t hidden = 0;    // columns
  const uint16_t* x_bf16 = nullptr;
};

using AttentionInputTap = std::function<void(const TapEvent&)>;

// Every engine refuses a chunk with an id outside [0, vocab) before changing anything.
inline Status check_token_ids(const std::vector<int32_t>& ids, int64_t vocab) {
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= vocab)
      return invalid_argument("token id " + std::to_string(ids[i]) + " at index " +
                              std::to_string(i) + " is outside the vocabulary [0, " +
                              std::to_string(vocab) + ")");
  return Status::ok();
}

}  // namespace hetero
