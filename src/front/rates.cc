// Measured costs of a tail: see rates.h.
#include "front/rates.h"

#include <cmath>

namespace hetero {
namespace {

double attention_term(double n, double context) { return n * (context + n / 2); }

}  // namespace

void TailCost::add(double n, double context, double ms) {
  if (!(n > 0) || !(context >= 0) || !(ms >= 0) || !std::isfinite(ms)) return;
  const double keep = std::exp2(-1.0 / kHalfLife);
  const std::array<double, 3> x{1, n, attention_term(n, context)};
  for (size_t i = 0; i < 3; ++i) {
    for (size_t j = 0; j < 3; ++j) xx_[i][j] = xx_[i][j] * keep + x[i] * x[j];
    xy_[i] = xy_[i] * keep + x[i] * ms;
  }
  ++samples_;
}

std::optional<double> TailCost::predict(double n, double context) const {
  if (samples_ < kMinSamples) return std::nullopt;
  const double w = xx_[0][0];
  const double mean_n = xx_[0][1] / w, mean_ms = xy_[0] / w;
  const double var_n = xx_[1][1] / w - mean_n * mean_n;
  const double cov_n = xy_[1] / w - mean_n * mean_ms;
  const double per_token_only = mean_ms / mean_n * n;
  // Sizes too alike to tell a fixed cost from a per-token one: all of it per token.
  if (var_n <= 0.01 * mean_n * mean_n) return per_token_only;
  // The attention term, in deviations from the means; what of it the size explains is taken
  // out (a Schur complement), and the rest must vary enough to be measured.
  const double mean_a = xx_[0][2] / w;
  const double var_a = xx_[2][2] / w - mean_a * mean_a;
  const double cov_na = xx_[1][2] / w - mean_n * mean_a;
  const double cov_a = xy_[2] / w - mean_a * mean_ms;
  const double var_a_beyond_n = var_a - cov_na * cov_na / var_n;
  if (var_a_beyond_n > 1e-3 * var_a && var_a > 0) {
    const double attention = (cov_a - cov_na * cov_n / var_n) / var_a_beyond_n;
    const double per_token = (cov_n - attention * cov_na) / var_n;
    const double fixed = mean_ms - per_token * mean_n - attention * mean_a;
    if (attention >= 0 && per_token >= 0 && fixed >= 0)
      return fixed + per_token * n + attention * attention_term(n, context);
  }
  const double per_token = cov_n / var_n, fixed = mean_ms - per_token * mean_n;
  // A fit that says tokens cost nothing, or that time runs backwards, is noise: per token only.
  if (per_token <= 0 || fixed < 0) return per_token_only;
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
    bridge_.add(static_cast<double>(v.b - v.start), static_cast<double>(v.start), ms);
    return;
  }
  const auto first = v.timings_ms.find("decoder_first_token");
  const int64_t processed = v.t - v.reused;
  if (first != v.timings_ms.end() && v.reused >= 0 && processed > 0)
    native_.add(static_cast<double>(processed), static_cast<double>(v.reused), first->second);
}

std::optional<double> MeasuredRates::bridge_ms(int64_t n, int64_t context) const {
  std::lock_guard<std::mutex> lock(mu_);
  return bridge_.predict(static_cast<double>(n), static_cast<double>(context));
}

std::optional<double> MeasuredRates::native_ms(int64_t n, int64_t context) const {
  std::lock_guard<std::mutex> lock(mu_);
  return native_.predict(static_cast<double>(n), static_cast<double>(context));
}

}  // namespace hetero
