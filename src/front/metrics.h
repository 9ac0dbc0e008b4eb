// Prometheus metrics of the front door: requests by confirmed verdict kind, bytes bridged, stage
// time sums and counts. Thread-safe; rendered as text exposition format on GET /metrics.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "decode/verdict.h"

namespace hetero {

class FrontMetrics {
 public:
  void record(const Verdict& v, int http_status);
  void inflight(int delta);
  // A stage timed after the response headers left (a stream's decoder first token).
  void record_stage(const std::string& stage, double ms);
  // A supervised child of the stack (hetero up): restarted, or up/down.
  void child_restarted(const std::string& child);
  void child_up(const std::string& child, bool up);
  std::string render() const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, int64_t> requests_by_kind_;
  std::map<int, int64_t> responses_by_status_;
  std::map<std::string, double> stage_ms_sum_;
  std::map<std::string, int64_t> stage_count_;
  std::map<std::string, int64_t> child_restarts_;
  std::map<std::string, bool> child_up_;
  int64_t bytes_ = 0, bridged_tokens_ = 0, inflight_ = 0;
};

}  // namespace hetero
