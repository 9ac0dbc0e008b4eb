// The front door: see front.h.
#include "front/front.h"

#include <httplib.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <atomic>
#include <chrono>
#include <filesystem>
#include <string_view>

#include "bridge/assembler.h"
#include "common/auth.h"
#include "common/http_json.h"
#include "common/http_server.h"
#include "common/json_text.h"
#include "common/log.h"
#include "common/secret.h"
#include "front/sse_relay.h"

namespace hetero {
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

json error_json(const std::string& type, const std::string& code, const std::string& message) {
  return {{"error", {{"type", type}, {"code", code}, {"message", message}}}};
}

std::string canonical(const std::string& dir) {
  std::error_code ec;
  auto p = std::filesystem::weakly_canonical(dir, ec);
  return ec ? dir : p.string();
}

}  // namespace

Options front_options() {
  std::vector<OptionSpec> rows = {
      {"host", "HETERO_FRONT_HOST", "127.0.0.1", "address to listen on"},
      {"port", "HETERO_FRONT_PORT", "8012", "port to listen on (0: any free port)"},
      {"decoder-host", "HETERO_DECODER_HOST", "127.0.0.1", "decoder (with seam) address"},
      {"decoder-port", "HETERO_DECODER_PORT", "8011", "decoder (with seam) port"},
      {"prefill-host", "HETERO_PREFILL_HOST", "127.0.0.1", "prefill host address"},
      {"prefill-port", "HETERO_PREFILL_PORT", "8010", "prefill host port"},
      {"store", "HETERO_STORE", "", "decoder store directory (the seam's --store)"},
      {"bridge-min-tokens", "HETERO_BRIDGE_MIN_TOKENS", "256",
       "prompts shorter than this go straight to the decoder"},
      {"bridge-min-tail", "HETERO_BRIDGE_MIN_TAIL", "256",
       "uncached tails shorter than this go straight to the decoder"},
      {"route-by",
       "HETERO_ROUTE_BY",
       "rates",
       "how a prompt of at least --bridge-min-tokens is routed: rates (bridged when the bridge's "
       "measured cost for its uncached tail is below the decoder's; --bridge-min-tail until both "
       "are measured) or min-tail (always --bridge-min-tail)",
       false,
       {"rates", "min-tail"}},
      {"bridge-tails",
       "HETERO_BRIDGE_TAILS",
       "on",
       "a prompt whose start the decoder already holds (a conversation's earlier turns) is "
       "bridged by its tail only, mounted onto the decoder's own cache (llama); off: the whole "
       "prefix again",
       false,
       {"on", "off"}},
      {"partial-min-fraction", "HETERO_PARTIAL_MIN_FRACTION", "0.5",
       "a broken stream is mounted when its verified prefix covers this fraction"},
      {"deadline-base-ms", "HETERO_DEADLINE_BASE_MS", "30000", "bridge deadline: base"},
      {"deadline-per-token-ms", "HETERO_DEADLINE_PER_TOKEN_MS", "100",
       "bridge deadline: added per prompt token"},
      {"stall-ms", "HETERO_STALL_MS", "30000", "no bytes from the prefill host this long: stall"},
      {"decoder-timeout-ms", "HETERO_DECODER_TIMEOUT_MS", "1800000",
       "longest wait for one decoder reply"},
      {"completions", "HETERO_FRONT_COMPLETIONS", "30",
       "completions served at once (at least 1); more get 503 with Retry-After"},
      {"bridge-queue", "HETERO_FRONT_BRIDGE_QUEUE", "8",
       "bridges that may be under way beside the one prefilling (the prefill host queues their "
       "prefills; their transfers and mounts overlap); more get 503 with Retry-After"},
      {"max-body-mb", "HETERO_FRONT_MAX_BODY_MB", "64",
       "largest request body accepted, in MiB (a 2M-token prompt is ~10 MiB of text)"},
      secret_file_option("the stack's shared secret (hetero up writes one): requests to the "
                         "decoder seam and the prefill host are signed with it; none: both must "
                         "be open"),
      {"api-key-file", "HETERO_API_KEY_FILE", "",
       "API keys, one per line (mode 0600): every /v1/ request then needs "
       "'Authorization: Bearer <key>', and each key's prompts are cached apart from every "
       "other's; none: open"},
      {"forced-bridges",
       "HETERO_FORCED_BRIDGES",
       "signed",
       "who may force a bridge with X-PD-Bridge-Mode: bridge: signed (requests signed with the "
       "stack's secret, as hetero doctor and the benches sign them) or anyone",
       false,
       {"signed", "anyone"}},
  };
  for (OptionSpec& s : connection_options()) rows.push_back(std::move(s));
  return Options("front",
                 "The OpenAI-compatible front door: routes cold long prompts through the prefill "
                 "host, mounts the result into the decoder, relays the decoder's own answer with "
                 "a verdict.",
                 std::move(rows));
}

Result<FrontConfig> front_config(const Options& opts) {
  FrontConfig c;
  c.host = opts.get("host");
  c.decoder_host = opts.get("decoder-host");
  c.prefill_host = opts.get("prefill-host");
  c.store_dir = opts.get("store");
  struct IntField {
    const char* name;
    int64_t* out;
  };
  int64_t port = 0, dport = 0, pport = 0, completions = 0, max_body_mb = 0;
  for (IntField f : {IntField{"port", &port},
                     {"decoder-port", &dport},
                     {"prefill-port", &pport},
                     {"bridge-min-tokens", &c.route.min_tokens},
                     {"bridge-min-tail", &c.route.min_tail},
                     {"deadline-base-ms", &c.deadline_base_ms},
                     {"deadline-per-token-ms", &c.deadline_per_token_ms},
                     {"stall-ms", &c.stall_ms},
                     {"decoder-timeout-ms", &c.decoder_timeout_ms},
                     {"completions", &completions},
                     {"max-body-mb", &max_body_mb},
                     {"bridge-queue", &c.bridge_queue}}) {
    auto v = opts.get_int(f.name);
    if (!v.is_ok()) return v.status();
    if (v.value() < 0) return invalid_argument(std::string("--") + f.name + " must be >= 0");
    *f.out = v.value();
  }
  for (int64_t p : {port, dport, pport})
    if (p > 65535) return invalid_argument("ports must be in [0, 65535]");
  c.port = static_cast<int>(port), c.decoder_port = static_cast<int>(dport);
  c.prefill_port = static_cast<int>(pport);
  c.completions = static_cast<int>(std::clamp<int64_t>(completions, 1, 4096));
  auto limits = connection_limits_from(opts);
  if (!limits.is_ok()) return limits.status();
  c.connections = limits.value();
  if (max_body_mb < 1 || max_body_mb > 65536)
    return invalid_argument("--max-body-mb must be in [1, 65536]");
  c.max_body_bytes = max_body_mb << 20;
  auto frac = opts.get_double("partial-min-fraction");
  if (!frac.is_ok()) return frac.status();
  if (frac.value() < 0 || frac.value() > 1)
    return invalid_argument("--partial-min-fraction must be in [0, 1]");
  c.partial_min_fraction = frac.value();
  c.tails = opts.get("bridge-tails") == "on";
  c.route_by_rates = opts.get("route-by") == "rates";
  auto secret = read_secret_file(opts.get("secret-file"));
  if (!secret.is_ok()) return secret.status();
  c.secret = std::move(secret.value());
  auto tenants = Tenants::load(opts.get("api-key-file"), c.secret);
  if (!tenants.is_ok()) return tenants.status();
  c.tenants = std::move(tenants.value());
  c.forced_bridges_from_anyone = opts.get("forced-bridges") == "anyone";
  return c;
}

FrontServer::FrontServer(FrontConfig config)
    : cfg_(std::move(config)),
      seam_(cfg_.decoder_host, cfg_.decoder_port, 60000, cfg_.secret),
      tool_signatures_(std::make_shared<RequestVerifier>(cfg_.secret)) {}
FrontServer::~FrontServer() { stop(); }

Status FrontServer::check_pairing() const {
  auto info = seam_.info();
  auto health =
      http_json_ok(cfg_.prefill_host, cfg_.prefill_port, "/health", json(), /*timeout_ms=*/5000);
  if (!info.is_ok() || !health.is_ok()) {
    // Either may start later; then each request finds out (the prefill host refuses another
    // decoder's fingerprint with 409, and the front falls back natively).
    log_line("front", "pairing not checked at start: " +
                          (info.is_ok() ? health.status().message() : info.status().message()));
    return Status::ok();
  }
  const std::string dfp = info->value("fingerprint", ""), pfp = health->value("fingerprint", "");
  if (dfp != pfp)
    return failed_precondition(
        "the prefill host does not compute this decoder's cache: the decoder (" +
        info->value("model", std::string("?")) + ", " + cfg_.decoder_host + ":" +
        std::to_string(cfg_.decoder_port) + ") has fingerprint " + dfp + ", the prefill host (" +
        cfg_.prefill_host + ":" + std::to_string(cfg_.prefill_port) + ") " + pfp);
  if (info->contains("store") && (*info)["store"].is_string() &&
      canonical((*info)["store"].get<std::string>()) != canonical(cfg_.store_dir))
    return failed_precondition("--store " + cfg_.store_dir + " is not the decoder seam's store " +
                               (*info)["store"].get<std::string>() +
                               "; the seam mounts only entries inside its own store");
  return Status::ok();
}

BridgeOutcome FrontServer::bridge(const HttpRequest& req, const SeamClient& seam,
                                  const std::vector<int32_t>& ids, const json& info,
                                  int64_t decoder_cached, const json& tokenized) {
  struct InFlight {  // counted by the caller before it came here, until this bridge is done
    std::atomic<int64_t>* n;
    ~InFlight() { --*n; }
  } in_flight{&bridges_in_flight_};
  // Bridges run side by side: the prefill host queues their prefills and runs one at a time,
  // while the streams, stores and mounts of others go on.
  BridgeParams p;
  p.prefill_host = cfg_.prefill_host;
  p.prefill_port = cfg_.prefill_port;
  p.store_dir = cfg_.store_dir;
  p.secret = cfg_.secret;
  p.partial_min_fraction = cfg_.partial_min_fraction;
  p.tails = cfg_.tails;
  p.stall_ms = cfg_.stall_ms;
  p.deadline_ms =
      cfg_.deadline_base_ms + cfg_.deadline_per_token_ms * static_cast<int64_t>(ids.size());
  p.client_gone = [this, &req] { return server_->client_gone(req); };
  take_decoder_calls(tokenized, &p);
  BridgeOutcome out = run_bridge(seam, info, ids, decoder_cached, p);
  out.verdict.timings_ms["bridge_queue"] = out.fetch.queued_ms;
#ifdef __GLIBC__
  // A bridge's rows (megabytes to gigabytes) were freed on whichever connection thread ran
  // it; glibc keeps freed memory in that thread's arena. Give it back, or the front door's
  // RSS climbs towards arenas x the largest bridge (soak, RESULTS §15).
  malloc_trim(0);
#endif
  return out;
}

Result<json> FrontServer::decoder_info() {
  // What the decoder says of itself changes only when it restarts, and asking costs its HTTP
  // threads work under load: one answer serves every request for a second. An error is never
  // kept (the next request asks again).
  std::lock_guard<std::mutex> lock(info_mu_);
  if (info_ok_ && ms_since(info_at_) < 1000) return info_;
  auto fresh = seam_.info();
  info_ok_ = fresh.is_ok();
  if (info_ok_) info_ = fresh.value(), info_at_ = Clock::now();
  return fresh;
}

void FrontServer::handle_completion(const HttpRequest& req, HttpResponse& res,
                                    const std::string& path) {
  const auto t0 = Clock::now();
  metrics_.inflight(+1);
  ++active_;
  Verdict v = Verdict::skipped("error");
  auto finish = [&](int status) {
    res.status = status;
    res.set_header("X-PD-Bridge", v.header_value());
    metrics_.record(v, status);
    metrics_.inflight(-1);
    --active_;
    log_line("front", "POST " + path + " status=" + std::to_string(status) + " " +
                          v.header_value() + " total_ms=" + std::to_string(ms_since(t0)));
  };
  auto fail = [&](int status, const std::string& type, const std::string& code,
                  const std::string& msg) {
    res.set_content(json_text(error_json(type, code, msg)), "application/json");
    finish(status);
  };

  auto parsed = parse_untrusted_json(req.body);
  if (!parsed.is_ok())
    return fail(400, "invalid_request_error", "invalid_json",
                "request body: " + parsed.status().message());
  json body = std::move(parsed.value());
  // Each connection has its own thread (HttpServer), so /health and /metrics answer
  // whatever runs; completions beyond the slots are refused rather than left to pile up.
  if (const int64_t slots = cfg_.completions; active_.load() > slots) {
    res.set_header("Retry-After", "1");
    return fail(503, "server_error", "busy",
                "all " + std::to_string(slots) + " completion slots are taken; retry shortly");
  }
  const bool chat = path == "/v1/chat/completions";
  if (std::string why = completion_request_error(body, chat); !why.empty())
    return fail(400, "invalid_request_error", "invalid_field", why);
  auto mode = parse_bridge_mode(req.header("X-PD-Bridge-Mode"));
  if (!mode.is_ok())
    return fail(400, "invalid_request_error", "invalid_header", mode.status().message());
  // A forced bridge costs the prefill host a prefill: only the stack's own tools may ask for
  // one (issue 50, finding 8), unless --forced-bridges anyone.
  if (mode.value() == BridgeMode::kBridge && !cfg_.forced_bridges_from_anyone &&
      !tool_signatures_->open()) {
    auto refused = tool_signatures_->check_whole(req.header("X-Hetero-Signature"), req.method,
                                                 req.target, req.body, unix_now_s());
    if (refused)
      return fail(403, "invalid_request_error", "bridge_not_allowed",
                  "X-PD-Bridge-Mode: bridge needs a request signed with the stack's secret "
                  "(X-Hetero-Signature): " +
                      refused->message);
  }
  // The tenant's partition of every prefix cache (its key was checked before the body).
  auto key = cfg_.tenants.authenticate(req.header("Authorization"));
  if (!key.is_ok())
    return fail(401, "invalid_request_error", "invalid_api_key", key.status().message());
  auto salt = cfg_.tenants.salt(key.value(), body);
  if (!salt.is_ok())
    return fail(400, "invalid_request_error", "invalid_field", salt.status().message());
  const SeamClient seam = seam_.salted(salt.value());

  auto info = decoder_info();
  if (!info.is_ok())
    return fail(503, "server_error", "decoder_unavailable", info.status().message());
  // Again with the decoder's own limits (its vocabulary, context window and family).
  const ServedLimits served = served_limits(info.value());
  if (std::string why = completion_request_error(body, chat, served); !why.empty())
    return fail(400, "invalid_request_error", "invalid_field", why);
  if (body.contains("model")) {
    const std::string want = body["model"].get<std::string>();
    const std::string have = info.value().value("model", "");
    if (want != have && want != std::filesystem::path(have).filename().string() &&
        want != "default_model")
      return fail(404, "invalid_request_error", "model_not_found",
                  "model '" + want + "' is not served here; this server serves '" +
                      std::filesystem::path(have).filename().string() + "'");
  }

  // The client may name the served model as /v1/models lists it. mlx-lm knows it as its
  // default model and would try to fetch any other name from a hub, so forward that; a
  // decoder whose seam names the exact string it serves under ("forward_model": mlx-vlm, which
  // requires the field and would unload its model for any other name) gets that string.
  // Only the fields checked above travel on (request_schema.h); the seam tokenizes exactly
  // what the decoder will get.
  body = forwarded_completion_body(body, chat, served);
  if (info.value().contains("forward_model") && info.value()["forward_model"].is_string())
    body["model"] = info.value()["forward_model"];
  else if (body.contains("model"))
    body["model"] = "default_model";
  if (!salt.value().empty()) body["hetero_cache_salt"] = salt.value();

  // 1. The decoder's own ids.
  const auto t_tok = Clock::now();
  auto tok = seam.tokenize(body);
  if (!tok.is_ok()) return fail(503, "server_error", "decoder_unavailable", tok.status().message());
  if (tok->status != 200) {
    const json& e = tok->body.contains("error") ? tok->body["error"] : tok->body;
    return fail(tok->status / 100 == 4 ? tok->status : 502, "invalid_request_error",
                "rejected_by_decoder", e.is_object() ? e.value("message", e.dump()) : e.dump());
  }
  std::vector<int32_t> ids;
  try {
    ids = tok->body.at("ids").get<std::vector<int32_t>>();
  } catch (const json::exception& e) {
    return fail(502, "server_error", "bad_tokenize_reply", e.what());
  }
  const double tokenize_ms = ms_since(t_tok);
  const int64_t T = static_cast<int64_t>(ids.size());
  const int64_t ctx = info.value().value("context_window", int64_t{0});
  if (ctx > 0 && T >= ctx)
    return fail(400, "invalid_request_error", "context_length_exceeded",
                "the prompt has " + std::to_string(T) + " tokens; the context window is " +
                    std::to_string(ctx));
  if (std::string why = completion_length_error(body, T, served); !why.empty())
    return fail(400, "invalid_request_error", "context_length_exceeded", why);

  // 2. Route; for a cold long prompt, the bridge (mounted and pinned when it worked).
  Route route = route_request(
      T, mode.value(), cfg_.route, [&] { return seam.cached_prefix(ids); },
      [&](int64_t tail, int64_t cached) {
        if (!cfg_.route_by_rates) return TailCosts{};
        // A bridge computes the tail alone where it can (run_bridge), else the whole prompt.
        const bool tail_only =
            cfg_.tails && cached > 0 && info.value().value("family", "") == "llama";
        return TailCosts{
            tail_only ? rates_.bridge_ms(tail, cached) : rates_.bridge_ms(tail + cached - 1, 0),
            rates_.native_ms(tail, cached)};
      });
  std::string pin;
  v = route.verdict;
  if (route.bridge && bridges_in_flight_.fetch_add(1) >= cfg_.bridge_queue + 1) {
    // The decoder can still answer it: natively, saying why (issue 50, finding 8).
    --bridges_in_flight_;
    route.bridge = false;
    v = Verdict::declined("bridge queue full: a bridge is running and " +
                          std::to_string(cfg_.bridge_queue) + " wait for the prefill host");
  }
  if (route.bridge) {
    BridgeOutcome b = bridge(req, seam, ids, info.value(), route.cached, tok->body);
    v = std::move(b.verdict);
    v.route_by = route.verdict.route_by, v.route_tail = route.verdict.route_tail;
    v.route_bridge_ms = route.verdict.route_bridge_ms;
    v.route_native_ms = route.verdict.route_native_ms;
    pin = std::move(b.pin);
    if (server_->client_gone(req)) {  // nobody to answer: the decoder is not asked
      seam_.unpin(pin, /*evict=*/true);
      log_line("front",
               "POST " + path + ": the client went away during its bridge; " + v.header_value());
      return finish(499);  // as servers log a request its client closed
    }
  }
  v.t = T;
  v.timings_ms["tokenize"] = tokenize_ms;

  // 3. The original request, to the decoder; its answer relayed and the verdict confirmed by
  // its own count of cached prompt tokens.
  const bool stream = body.value("stream", false);
  if (!stream) {
    httplib::Client cli(cfg_.decoder_host, cfg_.decoder_port);
    cli.set_read_timeout(std::chrono::milliseconds(cfg_.decoder_timeout_ms));
    const DecoderCalls::Scope call(decoder_calls_.get(), &cli);
    if (!call.ok) {
      seam_.unpin(pin);
      v = confirm_verdict(v, {false, -1, "the front door is stopping"});
      return fail(503, "server_error", "decoder_unavailable", "the front door is stopping");
    }
    const auto t_dec = Clock::now();
    const std::string forward = body.dump();
    httplib::Headers headers;
    if (!cfg_.secret.empty())
      headers.emplace("Authorization", signed_authorization(cfg_.secret, "POST", path, forward));
    // A client that hangs up while the decoder works ends the call: the seam then stops the
    // generation (issue 50, finding 4: abandoned requests held every slot).
    std::atomic<bool> answered{false}, client_left{false};
    std::thread watch([&] {
      while (!answered.load()) {
        if (server_->client_gone(req)) {
          client_left = true;
          cli.stop();
          return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    });
    auto r = cli.Post(path.c_str(), headers, forward, "application/json");
    answered = true;
    watch.join();
    v.timings_ms["decoder"] = ms_since(t_dec);
    if (client_left.load()) {
      seam_.unpin(pin);
      v = confirm_verdict(v, {false, -1, "the client left before the decoder answered"});
      log_line("front", "POST " + path + ": the client went away while the decoder answered");
      return finish(499);
    }
    seam_.unpin(pin);
    if (!r) {
      v = confirm_verdict(v, {false, -1, "the decoder did not answer"});
      return fail(503, "server_error", "decoder_unavailable", httplib::to_string(r.error()));
    }
    auto reply = parse_untrusted_json(r->body);
    DecoderUsage usage = usage_from_reply(reply.is_ok() ? reply.value() : json());
    if (r->status != 200)
      usage = {false, -1, "the decoder answered HTTP " + std::to_string(r->status)};
    v = confirm_verdict(v, usage);
    rates_.record(v);
    // A decoder that cannot generate any more (its generation thread died: mlx-lm answers 404
    // to everything) is down, not the request wrong: the front's own 503 while it is restarted.
    if (r->status != 200) {
      {
        std::lock_guard<std::mutex> lock(info_mu_);
        info_ok_ = false;  // asked afresh below, and by the next request
      }
      auto now = decoder_info();
      if (!now.is_ok())
        return fail(503, "server_error", "decoder_unavailable",
                    "the decoder stopped generating: " + now.status().message());
    }
    const std::string type = r->get_header_value("Content-Type");
    res.set_content(r->body, type.empty() ? "application/json" : type);
    return finish(r->status);
  }

  // Streaming: the decoder's usage is asked for whatever the client asked; the relay passes
  // events on as they complete and takes the usage event out unless the client wanted it.
  const bool client_wants_usage = body.contains("stream_options") &&
                                  body["stream_options"].value("include_usage", false) == true;
  body["stream_options"]["include_usage"] = true;
  res.set_header("X-PD-Bridge", v.header_value());  // the prediction: "confirmed": false
  res.set_header("Cache-Control", "no-cache");
  log_line("front", "POST " + path + " stream started " + v.header_value());

  // What the stream's end (or a client gone before it began) must settle exactly once.
  struct StreamEnd {
    StreamEnd(FrontMetrics* m, MeasuredRates* r, std::atomic<int64_t>* a, SeamClient s,
              std::string pin_, std::string path_, Clock::time_point t)
        : metrics(m),
          rates(r),
          active(a),
          seam(std::move(s)),
          pin(std::move(pin_)),
          path(std::move(path_)),
          t0(t) {}
    FrontMetrics* metrics;
    MeasuredRates* rates;
    std::atomic<int64_t>* active;
    SeamClient seam;
    std::string pin, path;
    Clock::time_point t0;
    std::atomic<bool> done{false}, released{false};
    // The completion slot goes back before the client can see the stream end: a client that
    // sends its next request on [DONE] must find its slot free (soak: bench/soak.py).
    void release_slot() {
      if (!released.exchange(true)) --*active;
    }
    void settle(const Verdict& confirmed) {
      if (done.exchange(true)) return;
      release_slot();
      seam.unpin(pin);
      metrics->record(confirmed, 200);
      rates->record(confirmed);
      metrics->inflight(-1);
      log_line("front", "POST " + path + " stream status=200 " + confirmed.header_value() +
                            " total_ms=" + std::to_string(ms_since(t0)));
    }
  };
  auto end = std::make_shared<StreamEnd>(&metrics_, &rates_, &active_, seam_, pin, path, t0);
  auto relay = std::make_shared<SseUsageRelay>(v, client_wants_usage);
  auto cfg = cfg_;
  auto forward = std::make_shared<std::string>(body.dump());
  res.set_chunked(
      "text/event-stream",
      [cfg, forward, path, relay, end, calls = decoder_calls_](ChunkSink& sink) {
        httplib::Client cli(cfg.decoder_host, cfg.decoder_port);
        cli.set_read_timeout(std::chrono::milliseconds(cfg.decoder_timeout_ms));
        const DecoderCalls::Scope call(calls.get(), &cli);  // refused: the stream says so below
        httplib::Request dreq;
        dreq.method = "POST";
        dreq.path = path;
        dreq.body = *forward;
        dreq.set_header("Content-Type", "application/json");
        if (!cfg.secret.empty())
          dreq.set_header("Authorization",
                          signed_authorization(cfg.secret, "POST", path, *forward));
        bool client_gone = false;
        const auto t_send = Clock::now();
        double first_ms = -1;
        std::string out;
        dreq.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
          // SSE keep-alive comments precede the first token; time the first data event.
          if (first_ms < 0 && std::string_view(data, n).find("data:") != std::string_view::npos)
            first_ms = ms_since(t_send);
          out.clear();
          relay->feed(std::string_view(data, n), &out);
          if (out.find("data: [DONE]") != std::string::npos) end->release_slot();
          if (!out.empty() && !sink.write(out.data(), out.size()))
            return (client_gone = true), false;
          return true;
        };
        auto r = call.ok ? cli.send(dreq) : httplib::Result(nullptr, httplib::Error::Canceled);
        if (first_ms >= 0) end->metrics->record_stage("decoder_first_token", first_ms);
        std::string rest = relay->flush();
        if (!client_gone && !rest.empty()) sink.write(rest.data(), rest.size());
        if (!client_gone && !relay->saw_done()) {
          // The decoder died or stalled mid-stream (a chunked reply cut off can still look
          // whole to the client library): say so in the stream and end it as an OpenAI stream
          // ends, so a client never hangs on, or mistakes, a silent close.
          const std::string why =
              !r ? httplib::to_string(r.error()) : "it ended without its [DONE] event";
          const std::string ev = "data: " +
                                 error_json("server_error", "decoder_unavailable",
                                            "the decoder's stream broke: " + why)
                                     .dump() +
                                 "\n\ndata: [DONE]\n\n";
          sink.write(ev.data(), ev.size());
        }
        Verdict settled =
            relay->confirmed(client_gone ? "the client left before the decoder's usage"
                             : !r        ? "the decoder's stream broke before its usage"
                                         : "the decoder's stream carried no usage");
        if (first_ms >= 0) settled.timings_ms["decoder_first_token"] = first_ms;
        end->settle(settled);
        return !client_gone;
      },
      [relay, end](bool) {
        end->settle(relay->confirmed("the client left before the stream began"));
      });
}

Status FrontServer::start() {
  if (cfg_.store_dir.empty()) return invalid_argument("--store is required (the seam's --store)");
  HETERO_RETURN_IF_ERROR(check_pairing());
  if (int64_t n = remove_partial_store_entries(cfg_.store_dir); n > 0)
    log_line("front",
             "removed " + std::to_string(n) + " half-written store entries left by an earlier run");
  const int64_t max_body_mb = cfg_.max_body_bytes >> 20;
  server_ = std::make_unique<HttpServer>(
      "front", cfg_.connections, [max_body_mb](int status, const std::string& message) {
        const bool too_large = status == 413;
        return json_text(error_json(
            status >= 500 ? "server_error" : "invalid_request_error",
            too_large       ? "payload_too_large"
            : status == 404 ? "not_found"
            : status == 405 ? "method_not_allowed"
            : status == 431 ? "headers_too_large"
            : status == 500 ? "internal_error"
                            : "bad_request",
            too_large ? "request body larger than this front door takes (" +
                            std::to_string(max_body_mb) + " MiB, --max-body-mb)"
            : status == 404 ? message + "; see /v1/chat/completions, /v1/completions, /v1/models"
                            : message));
      });
  for (const char* p : {"/v1/chat/completions", "/v1/completions"}) {
    const std::string path = p;
    // Bounded while it is read, chunked or not (issue 50, finding 3).
    server_->post(
        p,
        [this, path](const HttpRequest& req, HttpResponse& res) {
          handle_completion(req, res, path);
        },
        cfg_.max_body_bytes);
  }
  server_->get("/v1/models", [this](const HttpRequest&, HttpResponse& res) {
    auto info = seam_.info();
    if (!info.is_ok()) {
      res.status = 503;
      res.set_content(
          json_text(error_json("server_error", "decoder_unavailable", info.status().message())),
          "application/json");
      return;
    }
    const std::string name = std::filesystem::path(info.value().value("model", "")).filename();
    json j = {{"object", "list"},
              {"data",
               json::array(
                   {{{"id", name}, {"object", "model"}, {"owned_by", "hetero"}, {"created", 0}}})}};
    res.set_content(json_text(j), "application/json");
  });
  server_->get("/health", [this](const HttpRequest&, HttpResponse& res) {
    auto d =
        http_json(cfg_.decoder_host, cfg_.decoder_port, "/hetero/info", json(), 3000, cfg_.secret);
    auto p = http_json(cfg_.prefill_host, cfg_.prefill_port, "/health", json(), 3000);
    const bool dok = d.is_ok() && d->status == 200, pok = p.is_ok() && p->status == 200;
    // A decoder that answers but cannot generate (its generation thread died: 503
    // generation_dead) is as down as one that does not answer.
    auto why = [](Result<HttpJsonReply>& r) -> std::string {
      if (!r.is_ok()) return r.status().message();
      const json& body = r->body;
      if (body.is_object() && body.contains("error") && body["error"].is_object())
        return body["error"].value("code", std::string("error"));
      return "HTTP " + std::to_string(r->status);
    };
    json j = {{"status", dok ? "ok" : "degraded"},
              {"decoder", dok ? "ok" : why(d)},
              {"prefill", pok ? "ok" : why(p)}};
    if (dok && pok)
      j["fingerprints_agree"] =
          d->body.value("fingerprint", "") == p->body.value("fingerprint", "-");
    res.status = dok ? 200 : 503;
    res.set_content(j.dump(), "application/json");
  });
  server_->get("/metrics", [this](const HttpRequest&, HttpResponse& res) {
    res.set_content(metrics_.render(), "text/plain; version=0.0.4");
  });
  // With API keys, every /v1/ request shows one before its body is read.
  if (!cfg_.tenants.open()) {
    RequestCheck keys;
    keys.head = [this](const HttpRequest& req, HttpResponse& res) {
      if (req.path.rfind("/v1/", 0) != 0) return true;
      auto key = cfg_.tenants.authenticate(req.header("Authorization"));
      if (key.is_ok()) return true;
      res.status = 401;
      res.set_header("WWW-Authenticate", "Bearer");
      res.set_content(
          json_text(error_json("invalid_request_error", "invalid_api_key", key.status().message())),
          "application/json");
      return false;
    };
    server_->set_check(std::move(keys));
  }
  // Every response carries a verdict; the completion handlers set their own first.
  server_->set_after([](const HttpRequest&, HttpResponse& res) {
    if (!res.has_header("X-PD-Bridge"))
      res.set_header("X-PD-Bridge", Verdict::skipped("not a completion").header_value());
  });
  if (Status st = server_->start(cfg_.host, cfg_.port); !st.is_ok()) return st;
  port_ = server_->port();
  return Status::ok();
}

bool DecoderCalls::add(httplib::Client* cli) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return false;
  live_.insert(cli);
  return true;
}

void DecoderCalls::remove(httplib::Client* cli) {
  std::lock_guard<std::mutex> lock(mu_);
  live_.erase(cli);
}

void DecoderCalls::cut_all() {
  std::lock_guard<std::mutex> lock(mu_);  // a call's client lives until it is removed
  stopping_ = true;
  for (httplib::Client* cli : live_) cli->stop();
}

void FrontServer::stop() {
  if (server_) decoder_calls_->cut_all();
  // The server's thread ends once its requests have; a call registered just before the cut
  // but not yet connected then had no socket to shut down, so the cut is repeated meanwhile.
  std::atomic<bool> ended{false};
  std::thread sweeper([&] {
    while (!ended.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (!ended.load()) decoder_calls_->cut_all();
    }
  });
  if (server_) server_->stop();
  ended.store(true);
  sweeper.join();
}

}  // namespace hetero
