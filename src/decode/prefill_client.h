// The decode side's receiving end of a prefill stream: POST /v1/prefill to the prefill host, and
// every byte that comes back verified into an Assembler as it arrives (frames, checksums,
// order, the closing manifest). StreamReceiver is the verification alone, for any byte source:
// the HTTP client below, and `hetero prefill --ids-file`, which runs the service in-process.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "bridge/assembler.h"
#include "bridge/prefill_request.h"
#include "bridge/wire.h"

namespace hetero {

// Feeds a segment stream's bytes through the frame parser into an assembler. Not thread-safe.
// With a tagger, every frame must carry its valid tag (a stream from a holder of the secret).
class StreamReceiver {
 public:
  explicit StreamReceiver(Assembler* assembler, std::optional<FrameTagger> tags = std::nullopt);
  // Parses and verifies what the bytes complete. Returns false once the stream must stop:
  // an error (status() says which) or the manifest (status() ok when it agreed).
  bool feed(const char* data, size_t n);
  const Status& status() const { return status_; }
  bool have_manifest() const { return have_manifest_; }
  // False when the stream contradicted itself or the request (fingerprint, family, a manifest
  // that disagrees with what arrived): then no row of it is trusted, verified or not. True for
  // breaks that leave the verified prefix sound (killed, truncated, stalled, corrupt, gap).
  bool salvageable() const { return salvageable_; }
  const std::string& arith() const { return arith_; }  // the manifest's word on the arithmetic
  // Where the prefill host's forward began (the manifest's computed_from; -1 without one).
  int64_t computed_from() const { return computed_from_; }
  double first_segment_ms() const { return first_segment_ms_; }
  double last_segment_ms() const { return last_segment_ms_; }
  double verify_ms() const { return verify_ms_; }  // time spent parsing and verifying

 private:
  bool consume_frames();
  Assembler* assembler_;
  std::optional<FrameTagger> tags_;  // before parser_, which points at it
  FrameParser parser_;
  Status status_;
  bool have_manifest_ = false, salvageable_ = true;
  std::string arith_;
  int64_t computed_from_ = -1;
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
  double first_segment_ms_ = -1, last_segment_ms_ = -1, verify_ms_ = 0;
};

struct FetchResult {
  Status status;      // ok only when the manifest arrived complete and agreed
  int64_t bytes = 0;  // bytes received on the wire
  double first_segment_ms = -1, last_segment_ms = -1, total_ms = 0;
  double verify_ms = 0;
  bool salvageable = true;  // StreamReceiver::salvageable
  bool have_manifest = false;
  std::string arith;
  int64_t computed_from = -1;  // where the prefill host's forward began (-1: not said)
  double queued_ms = 0;        // how long the prefill host kept it waiting for its turn
  std::string error_code;      // a refusal's JSON "code" (e.g. "prefix_state_missing"), if any
};

// stall_ms: longest silence tolerated between bytes; deadline_ms: the whole stream's budget.
// Both end the stream with kDeadlineExceeded; rows verified so far stay in the assembler.
// secret: the stack's shared secret, sent as a bearer token ("" for a host without one); with
// one, the request carries a fresh stream nonce and every frame must come back tagged.
// The prefill host's refusals keep their meaning: 409 (fingerprint) is kFailedPrecondition,
// 507 (out of memory) kResourceExhausted, 503 (queue full) kUnavailable, other 4xx
// kInvalidArgument, other 5xx kInternal. Until its response starts (its turn may take a while:
// it queues requests), only the deadline bounds the wait; then stall_ms does.
// client_gone (null: never asked) is asked every 100 ms: once it says true the connection to the
// prefill host is shut (which stops its prefill at its next chunk) and the fetch ends kUnavailable,
// its rows not salvageable.
FetchResult fetch_prefill(const std::string& host, int port, const PrefillRequest& req,
                          Assembler* assembler, int64_t stall_ms, int64_t deadline_ms,
                          const std::string& secret = "",
                          const std::function<bool()>& client_gone = {});

}  // namespace hetero
