// What a tail costs each way, as measured: the front door's route for a warm prompt follows
// these instead of a fixed minimum once both are known (routing.h).
//   bridge: the bridge's own wall time from its turn at the prefill host (prefill, verify,
//           store, mount) against the rows it bridged (B - start) after the context `start`,
//           from every bridge the decoder confirmed;
//   native: the decoder's time to its first token against the prompt tokens it processed
//           itself (T - reused) after the context it reused, from every stream not bridged.
// Each is a cost model fitted by least squares over exponentially weighted samples (recent
// traffic counts most): ms = fixed + per_token x n + attention x n x (context + n/2). The last
// term is the tail's attention, which reads back over the context and the tail itself, so a
// tail after 100K tokens is predicted dearer than the same tail after 1K. While the samples
// cannot tell that term apart (contexts and sizes too alike), or the fit gives a negative cost,
// the line ms = fixed + per_token x n is used, and while sizes are alike, per token only; so a
// short tail's fixed costs (a bridge's connection, store and mount) are not spread as if they
// grew with it. Thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <optional>

#include "decode/verdict.h"

namespace hetero {

class TailCost {
 public:
  // A sample: n tokens after `context` tokens took ms. Samples older by `half_life` later ones
  // weigh half.
  void add(double n, double context, double ms);
  // The predicted ms for n tokens after `context` once there are at least min_samples; nullopt
  // before.
  std::optional<double> predict(double n, double context) const;
  int64_t samples() const { return samples_; }

  static constexpr int64_t kMinSamples = 2;
  static constexpr double kHalfLife = 16;  // samples

 private:
  // Weighted sums over the samples of x x^T and x ms, x = (1, n, n (context + n/2)).
  std::array<std::array<double, 3>, 3> xx_{};
  std::array<double, 3> xy_{};
  int64_t samples_ = 0;
};

class MeasuredRates {
 public:
  // From a request's settled verdict (confirmed or not; only confirmed numbers are used).
  void record(const Verdict& v);
  // Predicted ms for a tail of n tokens after `context` each way (nullopt: not measured yet).
  std::optional<double> bridge_ms(int64_t n, int64_t context) const;
  std::optional<double> native_ms(int64_t n, int64_t context) const;

 private:
  mutable std::mutex mu_;
  TailCost bridge_, native_;
};

}  // namespace hetero
