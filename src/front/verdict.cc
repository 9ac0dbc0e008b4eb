// Verdict rendering: see verdict.h.
#include "front/verdict.h"

#include <cmath>

namespace hetero {

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
  }
  return "?";
}

std::string Verdict::label() const {
  switch (kind) {
    case VerdictKind::kComplete:
      return "complete";
    case VerdictKind::kPartial:
      return "partial " + std::to_string(b) + "/" + std::to_string(t);
    case VerdictKind::kSkipped:
      return "skipped: " + reason;
    case VerdictKind::kDeclined:
      return "declined: " + reason;
  }
  return "?";
}

nlohmann::json Verdict::to_json() const {
  nlohmann::json j = {{"verdict", label()}, {"B", b}, {"T", t}, {"bytes", bytes}};
  nlohmann::json tm = nlohmann::json::object();
  for (const auto& [k, v] : timings_ms) tm[k] = std::round(v * 10.0) / 10.0;
  j["timings_ms"] = tm;
  if (!arith.empty()) j["arith"] = arith;
  return j;
}

std::string Verdict::header_value() const {
  return to_json().dump(-1, ' ', /*ensure_ascii=*/true, nlohmann::json::error_handler_t::replace);
}

}  // namespace hetero
