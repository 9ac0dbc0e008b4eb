// The verdict every front-door response carries in X-PD-Bridge: what happened to the bridge
// for this request, with B, T, bytes moved and per-stage timings. A bridged number is only
// reported when the decoder actually reused the mounted rows.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

namespace hetero {

enum class VerdictKind { kComplete, kPartial, kSkipped, kDeclined };

struct Verdict {
  VerdictKind kind = VerdictKind::kSkipped;
  std::string reason;  // for skipped/declined: short, stable words ("short", "prefill host down")
  int64_t b = 0, t = 0, bytes = 0;
  std::map<std::string, double> timings_ms;  // stage -> milliseconds
  std::string arith;  // the rows' arithmetic, as the prefill host's manifest says ("" unknown)

  static Verdict skipped(std::string why) { return {VerdictKind::kSkipped, std::move(why)}; }
  static Verdict declined(std::string why) { return {VerdictKind::kDeclined, std::move(why)}; }
  // "complete", "partial B/T", "skipped: reason", "declined: reason"
  std::string label() const;
  const char* kind_name() const;
  nlohmann::json to_json() const;
  std::string header_value() const;  // one line of ASCII JSON
};

}  // namespace hetero
