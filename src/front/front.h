// hetero front: the OpenAI-compatible front door on the decode host.
//   POST /v1/chat/completions, /v1/completions   relayed to the decoder (SSE event by event)
//   GET  /v1/models, /health, /metrics
// For each completion request: ids from the decoder seam, a route (routing.h), for a cold long
// prompt the decode side of a bridge (decode/bridge.h: prefill host -> verify -> store ->
// mount ids[:B]), then the original request to the decoder. Every response carries
// X-PD-Bridge (decode/verdict.h). A bridge failure falls back to the decoder's native answer
// with a `declined` verdict saying why.
//
// Verdicts are confirmed by the decoder's own accounting: a non-streaming reply's header holds
// the confirmed verdict; a stream's header leaves before decoding and holds the prediction
// ("confirmed": false), and the confirmed one goes to /metrics, the request's log line, and to
// the client in the stream's usage event when it asked for usage.
// A request header X-PD-Bridge-Mode: native|bridge forces the route (bench, doctor): native from
// anyone; bridge only from a request signed with the stack's secret (X-Hetero-Signature, as the
// stack's tools sign), or from anyone with --forced-bridges anyone.
// With --api-key-file, every /v1/ request needs one of its keys (front/tenants.h), checked
// before its body is read.
// Thread-safety: HTTP handling is threaded; bridges run one at a time (others queue), and
// requests that do not bridge never wait for one.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "common/http_server.h"
#include "common/options.h"
#include "decode/bridge.h"
#include "front/metrics.h"
#include "front/rates.h"
#include "front/routing.h"
#include "front/tenants.h"

namespace httplib {
class Client;
}  // namespace httplib

namespace hetero {

// Filled from front_options() (the defaults live in that table only).
struct FrontConfig {
  std::string host;
  int port = 0;
  std::string decoder_host;
  int decoder_port = 0;
  std::string prefill_host;
  int prefill_port = 0;
  std::string store_dir;  // the decoder store; the seam must be started on it too
  RoutePolicy route;
  double partial_min_fraction = 0;  // salvage a broken stream when it covers this much of B
  bool tails = true;                // a warm prompt's bridge asks for its tail only
  bool route_by_rates = true;       // route by measured costs once known (front/rates.h)
  int64_t deadline_base_ms = 0;     // bridge deadline = base + per_token * T
  int64_t deadline_per_token_ms = 0;
  int64_t stall_ms = 0;  // no bytes from the prefill host for this long: stalled
  int64_t decoder_timeout_ms = 0;
  int completions = 30;          // completions served at once; more get 503 busy
  ConnectionLimits connections;  // at once, per client, how fast requests must come
  int64_t max_body_bytes = 0;    // larger request bodies get 413 (chunked ones as they arrive)
  int64_t bridge_queue = 0;      // bridges under way beside the one prefilling; more get 503
  std::string secret;            // the stack's shared secret: requests to the seam and
                                 // /v1/prefill are signed with it (common/auth.h)
  Tenants tenants;               // API keys and cache salts (front/tenants.h)
  // X-PD-Bridge-Mode: bridge (a prefill on the prefill host's GPU) from anyone, not only from
  // requests the stack's tools sign (X-Hetero-Signature).
  bool forced_bridges_from_anyone = false;
};

Options front_options();
Result<FrontConfig> front_config(const Options& opts);

// The decoder calls in flight, so a stop can cut them: a request waiting on the decoder would
// otherwise hold the server's stop for up to --decoder-timeout-ms.
class DecoderCalls {
 public:
  // Registers cli for the scope of one call; false once stopping (the call must not start).
  bool add(httplib::Client* cli);
  void remove(httplib::Client* cli);
  // Stopping from now on: each registered call's socket is shut down (it ends with an error).
  void cut_all();

  struct Scope {  // add() for the caller's scope; ok says whether the call may start
    Scope(DecoderCalls* calls, httplib::Client* cli)
        : calls(calls), cli(cli), ok(calls->add(cli)) {}
    ~Scope() {
      if (ok) calls->remove(cli);
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    DecoderCalls* calls;
    httplib::Client* cli;
    bool ok;
  };

 private:
  std::mutex mu_;
  std::set<httplib::Client*> live_;
  bool stopping_ = false;
};

class FrontServer {
 public:
  explicit FrontServer(FrontConfig config);
  ~FrontServer();
  // Checks the pairing (when both hosts answer: the decoder's and the prefill host's
  // fingerprints must agree, and the seam's store must be --store), then binds and serves on
  // a thread; port 0 picks a free port.
  Status start();
  int bound_port() const { return port_; }
  void stop();
  // Thread-safe; `hetero up` reports its children's restarts here.
  FrontMetrics& metrics() { return metrics_; }

 private:
  Status check_pairing() const;
  void handle_completion(const HttpRequest& req, HttpResponse& res, const std::string& path);
  // The seam's /hetero/info, kept for a second (never an error).
  Result<nlohmann::json> decoder_info();
  // The bridge for ids, one at a time; decoder_cached: what the decoder holds of ids; tokenized:
  // the seam's /hetero/tokenize reply (its calls). A client that hangs up meanwhile ends it (its
  // prefill stops; HttpServer::client_gone).
  BridgeOutcome bridge(const HttpRequest& req, const SeamClient& seam,
                       const std::vector<int32_t>& ids, const nlohmann::json& info,
                       int64_t decoder_cached, const nlohmann::json& tokenized);

  FrontConfig cfg_;
  SeamClient seam_;
  FrontMetrics metrics_;
  MeasuredRates rates_;  // what a tail costs each way, from the requests served
  // Completions being served (streams until their end) and bridges running or waiting: each
  // capped, so /health and /metrics always find a worker thread, and a full queue is a 503 with
  // Retry-After instead of a request holding a thread for minutes.
  std::atomic<int64_t> active_{0}, bridges_in_flight_{0};
  std::shared_ptr<DecoderCalls> decoder_calls_ = std::make_shared<DecoderCalls>();
  std::mutex info_mu_;
  bool info_ok_ = false;
  nlohmann::json info_;
  std::chrono::steady_clock::time_point info_at_;
  // What a request that forces a bridge must carry, unless forced_bridges_from_anyone.
  std::shared_ptr<RequestVerifier> tool_signatures_;
  std::unique_ptr<HttpServer> server_;
  int port_ = 0;
};

}  // namespace hetero
