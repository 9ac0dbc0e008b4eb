// The request contract between the two hosts: what the decode side asks the prefill host for
// (POST /v1/prefill), and how that body is written and checked. Both hosts include this file;
// neither includes the other's code.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bridge/decoder_weights.h"
#include "common/status.h"

namespace hetero {

// On a 200 answer: how long the request waited for its turn at the prefill host, in ms (it runs
// one request at a time and queues the rest; a full queue answers 503 with Retry-After).
inline constexpr char kQueuedMsHeader[] = "X-Hetero-Queued-Ms";

struct PrefillRequest {
  std::vector<int32_t> ids;
  std::string fingerprint;   // the decoder's, as the caller knows it
  int64_t chunk_tokens = 0;  // 0: the prefill host's default
  // deepseek_v4 (required there): the decoder's own call schedule for these ids (for a tail, for
  // ids[start:], which the decoder runs on its cache of the rest), on which its cache depends.
  std::vector<int64_t> decoder_calls;
  // Between hosts that share the stack's secret: the decode side's fresh nonce for this stream,
  // from which the frames' tags are keyed (frame_tag.h). "" without a secret.
  std::string stream_nonce;
  // The tenant's partition of the prefill host's prefix caches (docs/design/auth.md, "Tenants"):
  // state kept for one salt is never resumed for another. 1 to 64 lowercase hex digits; "": the
  // shared partition.
  std::string cache_salt;
  // The rows the decoder already holds: only rows [start, ids.size()) are wanted (a warm turn's
  // tail). The prefill host still needs the engine's state for [0, start): llama's from its own
  // prefix cache or computed again; deepseek_v4's from its checkpoint of exactly ids[:start]
  // (HTTP 409 "prefix_state_missing" without one). 0: the whole prefix.
  int64_t start = 0;
  // Which of mlx-lm's prefill paths those calls are on (llama: a dynamic rope's base per call is
  // float32 arithmetic on the batch path, doubles on the single one). Wire: "decoder_path",
  // "batch" (the default) or "single".
  bool decoder_batched = true;
};

// The body the decode side sends.
nlohmann::json prefill_request_json(const PrefillRequest& req);

// Parses and validates a /v1/prefill body against the prefill host's model and export:
// ids in [0, vocab), at most max_tokens of them, the caller's fingerprint equal to the export's
// (else kFailedPrecondition naming both), start in [0, len(ids)), decoder_calls covering the ids
// from start exactly.
Result<PrefillRequest> parse_prefill_request(const std::string& body, int64_t vocab,
                                             const DecoderCacheLayout& layout, int64_t max_tokens);

}  // namespace hetero
