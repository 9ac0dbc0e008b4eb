// Relays a decoder's server-sent-event stream to the client event by event, as each event
// completes, and takes out of it what confirms the stream's verdict: the decoder's usage event
// (the chunk with "usage" and no choices that OpenAI servers send when the request carries
// stream_options.include_usage, which the front always asks for). A client that asked for
// usage itself gets that event with the confirmed verdict added ("x_pd_bridge"); one that did
// not never sees it, so its stream is what the decoder would have sent it.
#pragma once

#include <string>
#include <string_view>

#include "decode/verdict.h"

namespace hetero {

class SseUsageRelay {
 public:
  SseUsageRelay(Verdict predicted, bool client_wants_usage)
      : predicted_(std::move(predicted)), client_wants_usage_(client_wants_usage) {}
  // Appends to *out every event the bytes complete, as the client should get it.
  void feed(std::string_view data, std::string* out);
  // At the stream's end: what is left of an unterminated event, passed on as it came.
  std::string flush();
  // The verdict the decoder's usage confirms; until the usage event arrived, the predicted
  // one marked unconfirmed with `why_missing`.
  Verdict confirmed(const std::string& why_missing) const;
  bool saw_usage() const { return usage_.present; }
  // Whether the stream's terminating "data: [DONE]" event went through: a stream that ends
  // without it was cut off (the decoder died), whatever the transport said.
  bool saw_done() const { return saw_done_; }

 private:
  void relay_event(std::string_view event, std::string* out);
  Verdict predicted_;
  bool client_wants_usage_;
  DecoderUsage usage_;
  std::string pending_;  // bytes of an event not yet terminated
  bool saw_done_ = false;
};

}  // namespace hetero
