// The decode side of one bridged request, in one place. `hetero front` (for every cold long
// prompt it serves) and `hetero verify` (for the prompt it checks) both call run_bridge:
//   1. POST /v1/prefill ids[:B] (B = T - 1: the decoder keeps one token to process) to the
//      prefill host, every frame verified into the family's assembler as it arrives; when the
//      decoder already holds ids[:C] (a warm turn; llama), only the tail's rows [C, B) are asked
//      for, and the seam mounts them onto the decoder's own cache of ids[:C];
//   2. decide: the whole prefix (complete), the longest verified prefix of a broken stream
//      (partial, when it covers enough and beats what the decoder already holds), or nothing;
//   3. write the decoder-store entry, mount it through the seam (pinned until the decoder has
//      looked it up), remove the entry (the decoder holds its own copy);
//   4. check the decoder now sees the prefix.
// The verdict it returns is a prediction; the caller confirms it with the decoder's own usage
// (confirm_verdict) and unpins when the decoder has answered.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "decode/prefill_client.h"
#include "decode/seam_client.h"
#include "decode/verdict.h"

namespace hetero {

// Set by the caller from its options (front_options(), verify's); no policy defaults here.
struct BridgeParams {
  std::string prefill_host = "127.0.0.1";
  int prefill_port = 0;
  std::string store_dir;            // the decoder seam's store: it mounts only from there
  int64_t chunk_tokens = 0;         // 0: the prefill host's default
  double partial_min_fraction = 1;  // salvage a broken stream covering this much of B
  int64_t stall_ms = 0;             // no byte from the prefill host this long: stalled
  int64_t deadline_ms = 0;          // the whole stream's budget
  bool keep_entry = false;          // leave the store entry in place after the mount
  bool tails = true;                // a warm prompt's bridge asks for its tail only (llama)
  std::string secret;               // the stack's shared secret for the prefill host ("": none)
  // Asked every 100 ms while the prefill streams: true once the client that wants this bridge
  // has gone, which ends the stream (the prefill host then stops at its next chunk). Null: never.
  std::function<bool()> client_gone;
  // The decoder's own prefill calls for this request, [first row, tokens] each with the last
  // token's call last, and whether they are on its batch path: what the llama seam's
  // /hetero/tokenize reported (take_decoder_calls). A dynamic rope past its reach needs them.
  std::vector<std::pair<int64_t, int64_t>> decoder_calls;
  bool decoder_batched = true;
};

// Reads /hetero/tokenize's "calls" and "path" into p (nothing when the reply has none).
void take_decoder_calls(const nlohmann::json& tokenize_reply, BridgeParams* p);

struct BridgeOutcome {
  Verdict verdict;         // complete, partial or declined; not yet confirmed by the decoder
  std::string pin;         // the seam's pin on the mounted entry ("" when nothing was mounted)
  std::string entry_path;  // the store entry (kept only with keep_entry)
  FetchResult fetch;
};

// ids: the decoder's own tokenization of the request (T >= 2); info: its /hetero/info;
// decoder_cached: what the decoder already holds of ids (cached_prefix): a tail bridge starts
// there, and a partial that would not beat it is not mounted.
BridgeOutcome run_bridge(const SeamClient& seam, const nlohmann::json& info,
                         const std::vector<int32_t>& ids, int64_t decoder_cached,
                         const BridgeParams& params);

}  // namespace hetero
