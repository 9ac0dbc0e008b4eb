// The attention-input tap: the one seam between the prefill engine and the bridge.
// After each layer's pre-attention norm the engine hands (layer, positions, x) to the consumer.
// x is bf16 [n_tokens, hidden], row-major, valid only for the duration of the call: a consumer
// that works asynchronously copies it (the bridge producer does, into a bounded queue), so the
// forward never waits on the cache program.
//
// A GPU engine hands x where it lives: x_device (device memory) is ready in the order of
// `stream` (its cudaStream_t, the compute stream) and may be overwritten by the next work
// enqueued there, so a consumer copies it by work enqueued on that same stream before it
// returns (the GPU capture does: a device-to-device copy and an event, never a host wait).
// x_bf16 (host) is null from a GPU engine unless it was asked for a host tap, for which it
// copies x back and waits — for tests and the CPU programs, not for serving.
//
// Or, where the engine offers x_read, the consumer copies x by work on a stream of its own, so
// the copy (a peer copy over NVLink where the program has a GPU of its own) runs beside the
// engine's next kernels instead of in their line: it makes its stream wait for an event recorded
// on `stream` after x, enqueues its reads, records an event after them and leaves it (a
// cudaEvent_t) in *x_read. The engine's stream waits for that event before it next writes x's
// memory, and at the latest before the call that tapped returns, so the event is not needed after
// that call (and a consumer may record it again once its next tap comes). A consumer that finds
// *x_read already set (another consumer of the same tap) makes its event follow that one.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"

namespace hetero {

struct TapEvent {
  int32_t layer = 0;
  int64_t pos0 = 0;                    // position of the first row
  int64_t n_tokens = 0;                // rows
  int64_t hidden = 0;                  // columns
  const uint16_t* x_bf16 = nullptr;    // host; null from a GPU engine without a host tap
  const uint16_t* x_device = nullptr;  // device; null from a CPU engine
  void* stream = nullptr;              // cudaStream_t that x_device is ordered on
  void** x_read = nullptr;             // where a consumer leaves its reads' event; null: none
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
