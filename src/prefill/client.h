// Calling the prefill host: POST /v1/prefill and verify the segment stream into a
// CacheAssembler as it arrives. Used by `hetero verify` and the front door.
#pragma once

#include <cstdint>
#include <string>

#include "bridge/assembler.h"
#include "prefill/service.h"

namespace hetero {

struct FetchResult {
  Status status;      // ok only when the manifest arrived complete and agreed
  int64_t bytes = 0;  // bytes received on the wire
  double first_segment_ms = -1, last_segment_ms = -1, total_ms = 0;
  double verify_ms = 0;  // time spent parsing and verifying frames
  // False when the stream contradicted itself or the request (fingerprint, family, a manifest
  // that disagrees with what arrived): then no row of it is trusted, verified or not. True
  // for breaks that leave the verified prefix sound (killed, truncated, stalled, corrupt, gap).
  bool salvageable = true;
  bool have_manifest = false;
  std::string arith;  // the manifest's word on the rows' arithmetic
};

// stall_ms: longest silence tolerated between bytes; deadline_ms: the whole stream's budget.
// Both end the stream with kDeadlineExceeded; rows verified so far stay in the assembler.
FetchResult fetch_prefill(const std::string& host, int port, const PrefillRequest& req,
                          Assembler* assembler, int64_t stall_ms, int64_t deadline_ms);

}  // namespace hetero
