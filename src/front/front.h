// hetero front: the OpenAI-compatible front door on the decode host.
//   POST /v1/chat/completions, /v1/completions   relayed to the decoder (SSE unbuffered)
//   GET  /v1/models, /health, /metrics
// For each completion request: ids from the decoder seam, route (short / warm / cold), for a
// cold long prompt a bridge (prefill host → verify → store → mount ids[:B]), then the original
// request to the decoder. Every response carries X-PD-Bridge (verdict.h). Any bridge failure
// falls back to the decoder's native answer with a `declined` verdict saying why; a stream that
// ends early is salvaged as `partial B/T` when it covers enough.
// A request header X-PD-Bridge-Mode: native|bridge forces the route (bench, doctor).
// Thread-safety: HTTP handling is threaded; bridges run one at a time (others queue), and
// requests that do not bridge never wait for one.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "bridge/decoder_weights.h"
#include "common/options.h"
#include "front/metrics.h"
#include "front/verdict.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace hetero {

struct FrontConfig {
  std::string host = "127.0.0.1";
  int port = 8012;
  std::string decoder_host = "127.0.0.1";
  int decoder_port = 8011;
  std::string prefill_host = "127.0.0.1";
  int prefill_port = 8010;
  std::string store_dir;              // the decoder store; the seam must be started on it too
  int64_t bridge_min_tokens = 256;    // shorter prompts go straight to the decoder
  int64_t bridge_min_tail = 256;      // uncached tails shorter than this go straight too
  double partial_min_fraction = 0.5;  // salvage a broken stream when it covers this much of B
  int64_t deadline_base_ms = 30000;   // bridge deadline = base + per_token * T
  int64_t deadline_per_token_ms = 100;
  int64_t stall_ms = 30000;  // no bytes from the prefill host for this long: stalled
  int64_t decoder_timeout_ms = 1800000;
  int threads = 32;
};

Options front_options();
Result<FrontConfig> front_config(const Options& opts);

class FrontServer {
 public:
  explicit FrontServer(FrontConfig config);
  ~FrontServer();
  Status start();  // binds and serves on a thread; port 0 picks a free port
  int bound_port() const { return port_; }
  void stop();
  const FrontMetrics& metrics() const { return metrics_; }

 private:
  void handle_completion(const httplib::Request& req, httplib::Response& res,
                         const std::string& path);
  Verdict bridge(const std::vector<int32_t>& ids, const nlohmann::json& info);

  FrontConfig cfg_;
  FrontMetrics metrics_;
  std::mutex bridge_mu_;  // one bridge at a time
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace hetero
