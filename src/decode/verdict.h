// The verdict every front-door response carries in X-PD-Bridge: what happened to the bridge
// for this request, with B, T, bytes moved and per-stage timings.
//
// A verdict starts as a prediction (made before the decoder runs: the mount took, the seam
// says the decoder would reuse B rows) and becomes a fact only once the decoder's own reply
// says how many prompt tokens it took from its cache (usage.prompt_tokens_details.
// cached_tokens): confirm_verdict. A bridged kind (complete, partial) is only ever confirmed
// when the decoder reused exactly the mounted rows; a decoder that re-prefilled turns it into
// `declined`, and a reply without that number into `unconfirmed`.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

namespace hetero {

enum class VerdictKind { kComplete, kPartial, kSkipped, kDeclined, kUnconfirmed };

struct Verdict {
  VerdictKind kind = VerdictKind::kSkipped;
  // for skipped/declined/unconfirmed: short words ("short", "host down"); for partial: why the
  // stream ended before T (to_json's "reason")
  std::string reason;
  int64_t b = 0, t = 0, bytes = 0;
  // A tail bridge: the rows [start, B) were bridged onto the decoder's own cache of ids[:start]
  // (0: the whole prefix). computed: tokens the prefill host's forward ran for them (less than
  // B - 0 when its prefix cache held the start of the prompt); -1 when not known.
  int64_t start = 0, computed = -1;
  // How the route was decided for a prompt the decoder could have taken whole: "rates" (the
  // measured cost of the tail each way, front/rates.h) or "min_tail" (a fixed minimum, before
  // both were measured); "" when no such decision was made (native asked, short). The tail and
  // the predicted costs (-1: not known) go with it.
  std::string route_by;
  int64_t route_tail = -1;
  double route_bridge_ms = -1, route_native_ms = -1;
  // The decoder's own count of prompt tokens it took from its cache for this request; -1
  // until its reply said so (then confirmed is true).
  int64_t reused = -1;
  bool confirmed = false;
  std::map<std::string, double> timings_ms;  // stage -> milliseconds
  std::string arith;  // the rows' arithmetic, as the prefill host's manifest says ("" unknown)

  static Verdict skipped(std::string why);
  static Verdict declined(std::string why);
  // A declined verdict that keeps what this one measured (T, bytes, timings, arith).
  Verdict declined_from(std::string why) const;
  bool bridged() const { return kind == VerdictKind::kComplete || kind == VerdictKind::kPartial; }
  // "complete", "partial B/T", "skipped: reason", "declined: reason", "unconfirmed: reason"
  std::string label() const;
  const char* kind_name() const;
  nlohmann::json to_json() const;
  std::string header_value() const;  // one line of ASCII JSON
};

// What a decoder reply said about its prompt cache.
struct DecoderUsage {
  bool present = false;  // the reply carried usage.prompt_tokens_details.cached_tokens
  int64_t cached_tokens = -1;
  std::string missing_why;  // when absent: why ("the decoder answered HTTP 500", ...)
};

// usage.prompt_tokens_details.cached_tokens of an OpenAI reply or stream chunk, when there.
DecoderUsage usage_from_reply(const nlohmann::json& reply);

// The verdict the decoder's own accounting supports, from the predicted one.
Verdict confirm_verdict(Verdict predicted, const DecoderUsage& usage);

}  // namespace hetero
