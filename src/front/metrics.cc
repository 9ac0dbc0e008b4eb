// Front metrics: see metrics.h.
#include "front/metrics.h"

#include <sstream>

namespace hetero {

void FrontMetrics::record(const Verdict& v, int http_status) {
  std::lock_guard<std::mutex> lock(mu_);
  ++requests_by_kind_[v.kind_name()];
  ++responses_by_status_[http_status];
  bytes_ += v.bytes;
  if (v.bridged()) bridged_tokens_ += v.b;
  for (const auto& [stage, ms] : v.timings_ms) {
    stage_ms_sum_[stage] += ms;
    ++stage_count_[stage];
  }
}

void FrontMetrics::record_stage(const std::string& stage, double ms) {
  std::lock_guard<std::mutex> lock(mu_);
  stage_ms_sum_[stage] += ms;
  ++stage_count_[stage];
}

void FrontMetrics::child_restarted(const std::string& child) {
  std::lock_guard<std::mutex> lock(mu_);
  ++child_restarts_[child];
  child_up_[child] = false;
}

void FrontMetrics::child_up(const std::string& child, bool up) {
  std::lock_guard<std::mutex> lock(mu_);
  child_restarts_.emplace(child, 0);
  child_up_[child] = up;
}

void FrontMetrics::inflight(int delta) {
  std::lock_guard<std::mutex> lock(mu_);
  inflight_ += delta;
}

std::string FrontMetrics::render() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::ostringstream o;
  o << "# HELP hetero_requests_total Front-door responses by bridge verdict.\n"
    << "# TYPE hetero_requests_total counter\n";
  for (const char* k : {"complete", "partial", "skipped", "declined", "unconfirmed"}) {
    auto it = requests_by_kind_.find(k);
    o << "hetero_requests_total{verdict=\"" << k << "\"} "
      << (it == requests_by_kind_.end() ? 0 : it->second) << "\n";
  }
  o << "# HELP hetero_responses_total Front-door responses by HTTP status.\n"
    << "# TYPE hetero_responses_total counter\n";
  for (const auto& [s, n] : responses_by_status_)
    o << "hetero_responses_total{status=\"" << s << "\"} " << n << "\n";
  o << "# HELP hetero_bridge_bytes_total Segment bytes received from the prefill host.\n"
    << "# TYPE hetero_bridge_bytes_total counter\nhetero_bridge_bytes_total " << bytes_ << "\n"
    << "# HELP hetero_bridged_tokens_total Prompt tokens mounted and reused by the decoder.\n"
    << "# TYPE hetero_bridged_tokens_total counter\nhetero_bridged_tokens_total " << bridged_tokens_
    << "\n"
    << "# HELP hetero_inflight_requests Requests being served now.\n"
    << "# TYPE hetero_inflight_requests gauge\nhetero_inflight_requests " << inflight_ << "\n"
    << "# HELP hetero_stage_seconds Time spent per request stage.\n"
    << "# TYPE hetero_stage_seconds summary\n";
  if (!child_restarts_.empty())
    o << "# HELP hetero_child_restarts_total Restarts of the stack's children by hetero up.\n"
      << "# TYPE hetero_child_restarts_total counter\n";
  for (const auto& [child, n] : child_restarts_)
    o << "hetero_child_restarts_total{child=\"" << child << "\"} " << n << "\n";
  if (!child_up_.empty())
    o << "# HELP hetero_child_up Whether the stack's child answers its health check.\n"
      << "# TYPE hetero_child_up gauge\n";
  for (const auto& [child, up] : child_up_)
    o << "hetero_child_up{child=\"" << child << "\"} " << (up ? 1 : 0) << "\n";
  for (const auto& [stage, ms] : stage_ms_sum_) {
    o << "hetero_stage_seconds_sum{stage=\"" << stage << "\"} " << ms / 1000.0 << "\n";
    o << "hetero_stage_seconds_count{stage=\"" << stage << "\"} " << stage_count_.at(stage) << "\n";
  }
  return o.str();
}

}  // namespace hetero
