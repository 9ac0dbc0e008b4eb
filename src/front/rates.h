// What a tail costs each way, as measured: the front door's route for a warm prompt follows
// these instead of a fixed minimum once both are known (routing.h).
//   bridge: the bridge's own wall time (prefill, verify, store, mount) against the rows it
//           bridged (B - start), from every bridge the decoder confirmed;
//   native: the decoder's time to its first token against the prompt tokens it processed
//           itself (T - reused), from every stream that was not bridged.
// Each is a line, ms = fixed + per_token x n, fitted by least squares over exponentially
// weighted samples (recent traffic counts most), so a short tail's fixed costs (a bridge's
// connection, store and mount) are not spread as if they grew with it. Thread-safe.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>

#include "decode/verdict.h"

namespace hetero {

class CostLine {
 public:
  // A sample: n tokens took ms. Samples older by `half_life` later ones weigh half.
  void add(double n, double ms);
  // The predicted ms for n tokens once there are at least min_samples (a line through the
  // origin while the samples' sizes barely differ); nullopt before.
  std::optional<double> predict(double n) const;
  int64_t samples() const { return samples_; }

  static constexpr int64_t kMinSamples = 2;
  static constexpr double kHalfLife = 16;  // samples

 private:
  double w_ = 0, sn_ = 0, sms_ = 0, snn_ = 0, snms_ = 0;  // weighted sums
  int64_t samples_ = 0;
};

class MeasuredRates {
 public:
  // From a request's settled verdict (confirmed or not; only confirmed numbers are used).
  void record(const Verdict& v);
  // Predicted ms for a tail of n tokens each way (nullopt: not measured yet).
  std::optional<double> bridge_ms(int64_t n) const;
  std::optional<double> native_ms(int64_t n) const;

 private:
  mutable std::mutex mu_;
  CostLine bridge_, native_;
};

}  // namespace hetero
