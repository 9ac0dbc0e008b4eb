// Measured costs of a tail: see rates.h.
#include "front/rates.h"

#include <cmath>

namespace hetero {

void CostLine::add(double n, double ms) {
  if (!(n > 0) || !(ms >= 0) || !std::isfinite(ms)) return;
  const double keep = std::exp2(-1.0 / kHalfLife);
  w_ = w_ * keep + 1, sn_ = sn_ * keep + n, sms_ = sms_ * keep + ms;
  snn_ = snn_ * keep + n * n, snms_ = snms_ * keep + n * ms;
  ++samples_;
}

std::optional<double> CostLine::predict(double n) const {
  if (samples_ < kMinSamples) return std::nullopt;
  const double mean_n = sn_ / w_, mean_ms = sms_ / w_;
  const double var = snn_ / w_ - mean_n * mean_n, cov = snms_ / w_ - mean_n * mean_ms;
  // Sizes too alike to tell a fixed cost from a per-token one: all of it per token.
  if (var <= 0.01 * mean_n * mean_n) return mean_ms / mean_n * n;
  const double per_token = cov / var, fixed = mean_ms - per_token * mean_n;
  // A fit that says tokens cost nothing, or that time runs backwards, is noise: per token only.
  if (per_token <= 0 || fixed < 0) return mean_ms / mean_n * n;
  return fixed + per_token * n;
}

void MeasuredRates::record(const Verdict& v) {
  if (!v.confirmed) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (v.bridged()) {
    double ms = 0;
    for (const char* stage : {"prefill", "store", "mount"}) {
      const auto it = v.timings_ms.find(stage);
      if (it != v.timings_ms.end()) ms += it->second;
    }
    bridge_.add(static_cast<double>(v.b - v.start), ms);
    return;
  }
  const auto first = v.timings_ms.find("decoder_first_token");
  const int64_t processed = v.t - v.reused;
  if (first != v.timings_ms.end() && v.reused >= 0 && processed > 0)
    native_.add(static_cast<double>(processed), first->second);
}

std::optional<double> MeasuredRates::bridge_ms(int64_t n) const {
  std::lock_guard<std::mutex> lock(mu_);
  return bridge_.predict(static_cast<double>(n));
}

std::optional<double> MeasuredRates::native_ms(int64_t n) const {
  std::lock_guard<std::mutex> lock(mu_);
  return native_.predict(static_cast<double>(n));
}

}  // namespace hetero
