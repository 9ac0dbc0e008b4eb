// Verdicts: rendering and confirmation; see verdict.h.
#include "decode/verdict.h"

#include <cmath>

namespace hetero {

Verdict Verdict::skipped(std::string why) {
  Verdict v;
  v.kind = VerdictKind::kSkipped;
  v.reason = std::move(why);
  return v;
}

Verdict Verdict::declined(std::string why) {
  Verdict v;
  v.kind = VerdictKind::kDeclined;
  v.reason = std::move(why);
  return v;
}

Verdict Verdict::declined_from(std::string why) const {
  Verdict d = *this;
  d.kind = VerdictKind::kDeclined;
  d.reason = std::move(why);
  d.b = 0;  // nothing bridged was reused
  return d;
}

const char* Verdict::kind_name() const {
  switch (kind) {
    case VerdictKind::kComplete:
      return "complete";
    case VerdictKind::kPartial:
      return "partial";
    case VerdictKind::kSkipped:
      return "skipped";
    case VerdictKind::kDeclined:
      return "declined";
    case VerdictKind::kUnconfirmed:
      return "unconfirmed";
  }
  return "?";
}

std::string Verdict::label() const {
  switch (kind) {
    case VerdictKind::kComplete:
      return "complete";
    case VerdictKind::kPartial:
      return "partial " + std::to_string(b) + "/" + std::to_string(t);
    default:
      return std::string(kind_name()) + ": " + reason;
  }
}

nlohmann::json Verdict::to_json() const {
  nlohmann::json j = {
      {"verdict", label()}, {"B", b}, {"T", t}, {"bytes", bytes}, {"confirmed", confirmed}};
  if (confirmed) j["reused"] = reused;
  nlohmann::json tm = nlohmann::json::object();
  for (const auto& [k, v] : timings_ms) tm[k] = std::round(v * 10.0) / 10.0;
  j["timings_ms"] = tm;
  if (!arith.empty()) j["arith"] = arith;
  if (start > 0) j["start"] = start;
  if (!route_by.empty()) {
    nlohmann::json r = {{"by", route_by}, {"tail", route_tail}};
    if (route_bridge_ms >= 0) r["bridge_ms"] = std::round(route_bridge_ms * 10.0) / 10.0;
    if (route_native_ms >= 0) r["native_ms"] = std::round(route_native_ms * 10.0) / 10.0;
    j["route"] = std::move(r);
  }
  if (computed >= 0) j["computed"] = computed;
  // A partial's label is its numbers; why the rest was not bridged is said beside it.
  if (bridged() && !reason.empty()) j["reason"] = reason;
  return j;
}

std::string Verdict::header_value() const {
  return to_json().dump(-1, ' ', /*ensure_ascii=*/true, nlohmann::json::error_handler_t::replace);
}

DecoderUsage usage_from_reply(const nlohmann::json& reply) {
  DecoderUsage u;
  if (!reply.is_object() || !reply.contains("usage") || !reply["usage"].is_object()) {
    u.missing_why = "the decoder's reply carried no usage";
    return u;
  }
  const nlohmann::json& usage = reply["usage"];
  const auto details = usage.find("prompt_tokens_details");
  if (details == usage.end() || !details->is_object() || !details->contains("cached_tokens") ||
      !(*details)["cached_tokens"].is_number_integer()) {
    u.missing_why = "the decoder's usage has no prompt_tokens_details.cached_tokens";
    return u;
  }
  u.present = true;
  u.cached_tokens = (*details)["cached_tokens"].get<int64_t>();
  return u;
}

Verdict confirm_verdict(Verdict v, const DecoderUsage& usage) {
  if (!usage.present) {
    v.confirmed = false;
    v.reused = -1;
    if (v.bridged()) {
      // Rows were mounted, but nothing says the decoder used them: never report them as used.
      v.reason = std::to_string(v.b) + " rows were mounted but the decoder did not confirm them (" +
                 usage.missing_why + ")";
      v.kind = VerdictKind::kUnconfirmed;
    }
    return v;
  }
  const int64_t c = usage.cached_tokens;
  if (v.bridged() && c != v.b) {
    v = v.declined_from(c < v.b ? "the decoder re-prefilled: it reused " + std::to_string(c) +
                                      " of the " + std::to_string(v.b) + " mounted tokens"
                                : "the decoder reused its own " + std::to_string(c) +
                                      "-token prefix, longer than the " + std::to_string(v.b) +
                                      " bridged rows");
  }
  v.confirmed = true;
  v.reused = c;
  return v;
}

}  // namespace hetero
