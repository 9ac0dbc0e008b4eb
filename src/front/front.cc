// The front door: see front.h.
#include "front/front.h"

#include <httplib.h>

#include <chrono>
#include <filesystem>
#include <string_view>

#include "bridge/assembler.h"
#include "common/http_json.h"
#include "common/log.h"
#include "prefill/client.h"

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

// Field-type checks the decoder would otherwise answer with a crash or a 500 mid-stream.
std::string validate_request(const json& body, bool chat) {
  if (!body.is_object()) return "the request body must be a JSON object";
  if (chat) {
    if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty())
      return "'messages' must be a non-empty array";
    for (const auto& m : body["messages"])
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
        return "every message must be an object with a string 'role'";
  } else {
    if (!body.contains("prompt") || !body["prompt"].is_string() ||
        body["prompt"].get<std::string>().empty())
      return "'prompt' must be a non-empty string";
  }
  if (body.contains("model") && !body["model"].is_string()) return "'model' must be a string";
  if (body.contains("stream") && !body["stream"].is_boolean()) return "'stream' must be a boolean";
  if (body.contains("max_tokens") &&
      (!body["max_tokens"].is_number_integer() || body["max_tokens"].get<int64_t>() < 1))
    return "'max_tokens' must be a positive integer";
  for (const char* f : {"temperature", "top_p"})
    if (body.contains(f) && !body[f].is_number())
      return std::string("'") + f + "' must be a number";
  return "";
}

}  // namespace

Options front_options() {
  return Options(
      "front",
      "The OpenAI-compatible front door: routes cold long prompts through the prefill host, "
      "mounts the result into the decoder, relays the decoder's own answer with a verdict.",
      {
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
          {"partial-min-fraction", "HETERO_PARTIAL_MIN_FRACTION", "0.5",
           "a broken stream is mounted when its verified prefix covers this fraction"},
          {"deadline-base-ms", "HETERO_DEADLINE_BASE_MS", "30000", "bridge deadline: base"},
          {"deadline-per-token-ms", "HETERO_DEADLINE_PER_TOKEN_MS", "100",
           "bridge deadline: added per prompt token"},
          {"stall-ms", "HETERO_STALL_MS", "30000",
           "no bytes from the prefill host this long: stall"},
          {"threads", "HETERO_FRONT_THREADS", "32", "HTTP worker threads"},
      });
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
  int64_t port = 0, dport = 0, pport = 0, threads = 0;
  for (IntField f : {IntField{"port", &port},
                     {"decoder-port", &dport},
                     {"prefill-port", &pport},
                     {"bridge-min-tokens", &c.bridge_min_tokens},
                     {"bridge-min-tail", &c.bridge_min_tail},
                     {"deadline-base-ms", &c.deadline_base_ms},
                     {"deadline-per-token-ms", &c.deadline_per_token_ms},
                     {"stall-ms", &c.stall_ms},
                     {"threads", &threads}}) {
    auto v = opts.get_int(f.name);
    if (!v.is_ok()) return v.status();
    if (v.value() < 0) return invalid_argument(std::string("--") + f.name + " must be >= 0");
    *f.out = v.value();
  }
  c.port = static_cast<int>(port), c.decoder_port = static_cast<int>(dport);
  c.prefill_port = static_cast<int>(pport),
  c.threads = static_cast<int>(std::max<int64_t>(threads, 2));
  auto frac = opts.get_double("partial-min-fraction");
  if (!frac.is_ok()) return frac.status();
  c.partial_min_fraction = frac.value();
  return c;
}

FrontServer::FrontServer(FrontConfig config) : cfg_(std::move(config)) {}
FrontServer::~FrontServer() { stop(); }

Verdict FrontServer::bridge(const std::vector<int32_t>& ids, const json& info) {
  const auto t_wait = Clock::now();
  std::lock_guard<std::mutex> lock(bridge_mu_);
  Verdict v;
  v.t = static_cast<int64_t>(ids.size());
  v.timings_ms["bridge_queue"] = ms_since(t_wait);
  auto layout_or = layout_from_json(info);
  if (!layout_or.is_ok())
    return Verdict::declined("decoder info incomplete: " + layout_or.status().message());
  const DecoderCacheLayout& layout = layout_or.value();
  const int64_t want = v.t - 1;  // the decoder keeps at least one token to process
  auto assembler = make_assembler(layout, want);
  PrefillRequest preq{std::vector<int32_t>(ids.begin(), ids.begin() + want), layout.fingerprint, 0,
                      decoder_calls_from_info(info, want)};
  const int64_t deadline = cfg_.deadline_base_ms + cfg_.deadline_per_token_ms * v.t;
  FetchResult f = fetch_prefill(cfg_.prefill_host, cfg_.prefill_port, preq, assembler.get(),
                                cfg_.stall_ms, deadline);
  v.bytes = f.bytes;
  v.timings_ms["prefill"] = f.total_ms;
  if (f.first_segment_ms >= 0) v.timings_ms["first_segment"] = f.first_segment_ms;
  if (f.last_segment_ms >= 0) v.timings_ms["last_segment"] = f.last_segment_ms;
  v.timings_ms["verify"] = f.verify_ms;
  v.arith = f.arith;
  const int64_t covered = assembler->covered_tokens();
  if (f.status.is_ok() && assembler->can_mount(want)) {
    v.kind = VerdictKind::kComplete;
    v.b = want;
  } else if (f.status.is_ok()) {
    return Verdict::declined("the verified rows cannot be mounted as a " + std::to_string(want) +
                             "-token prefix");
  } else if (f.salvageable && assembler->can_mount(covered) &&
             covered >= cfg_.partial_min_fraction * static_cast<double>(want)) {
    v.kind = VerdictKind::kPartial;  // salvage the longest verified contiguous prefix
    v.b = covered;
    v.reason = f.status.message();
  } else {
    const bool family_no_partial = covered >= 1 && !assembler->can_mount(covered);
    Verdict d = Verdict::declined(
        f.status.message() + " (verified " + std::to_string(covered) + "/" + std::to_string(want) +
        " rows" +
        (family_no_partial ? "; a " + layout.family + " prefix cannot be mounted partially" : "") +
        ")");
    d.t = v.t, d.bytes = v.bytes, d.timings_ms = v.timings_ms;
    return d;
  }
  const auto t_store = Clock::now();
  auto entry = write_store_entry(cfg_.store_dir, layout, ids, v.b, want, assembler->arrays(v.b),
                                 assembler->entry_extra());
  v.timings_ms["store"] = ms_since(t_store);
  if (!entry.is_ok()) {
    Verdict d = Verdict::declined("store failed: " + entry.status().message());
    d.t = v.t, d.bytes = v.bytes, d.timings_ms = v.timings_ms;
    return d;
  }
  const auto t_mount = Clock::now();
  auto m = http_json_ok(cfg_.decoder_host, cfg_.decoder_port, "/hetero/mount",
                        {{"entry", entry->path}, {"ids", ids}}, cfg_.decoder_timeout_ms);
  v.timings_ms["mount"] = ms_since(t_mount);
  std::error_code ec;
  std::filesystem::remove_all(entry->path, ec);  // the decoder holds its own copy now
  if (!m.is_ok()) {
    Verdict d = Verdict::declined("mount failed: " + m.status().message());
    d.t = v.t, d.bytes = v.bytes, d.timings_ms = v.timings_ms;
    return d;
  }
  return v;
}

void FrontServer::handle_completion(const httplib::Request& req, httplib::Response& res,
                                    const std::string& path) {
  const auto t0 = Clock::now();
  metrics_.inflight(+1);
  Verdict v = Verdict::skipped("error");
  auto finish = [&](int status) {
    res.status = status;
    res.set_header("X-PD-Bridge", v.header_value());
    metrics_.record(v, status);
    metrics_.inflight(-1);
    log_line("front", "POST " + path + " status=" + std::to_string(status) + " " +
                          v.header_value() + " total_ms=" + std::to_string(ms_since(t0)));
  };
  auto fail = [&](int status, const std::string& type, const std::string& code,
                  const std::string& msg) {
    res.set_content(error_json(type, code, msg).dump(), "application/json");
    finish(status);
  };

  json body = json::parse(req.body, nullptr, false);
  if (body.is_discarded())
    return fail(400, "invalid_request_error", "invalid_json", "request body is not valid JSON");
  const bool chat = path == "/v1/chat/completions";
  if (std::string why = validate_request(body, chat); !why.empty())
    return fail(400, "invalid_request_error", "invalid_field", why);

  auto info = http_json_ok(cfg_.decoder_host, cfg_.decoder_port, "/hetero/info", json(), 10000);
  if (!info.is_ok())
    return fail(503, "server_error", "decoder_unavailable", info.status().message());
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
  if (info.value().contains("forward_model") && info.value()["forward_model"].is_string())
    body["model"] = info.value()["forward_model"];
  else if (body.contains("model"))
    body["model"] = "default_model";
  const std::string forward_body = body.dump();

  // 1. The decoder's own ids.
  const auto t_tok = Clock::now();
  auto tok = http_json(cfg_.decoder_host, cfg_.decoder_port, "/hetero/tokenize", body, 60000);
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

  // 2. Route.
  const std::string mode = req.get_header_value("X-PD-Bridge-Mode");
  if (mode == "native") {
    v = Verdict::skipped("native requested");
  } else if (T < 2 || (mode != "bridge" && T < cfg_.bridge_min_tokens)) {
    v = Verdict::skipped("short (T=" + std::to_string(T) + " < " +
                         std::to_string(cfg_.bridge_min_tokens) + ")");
  } else {
    auto cp = http_json_ok(cfg_.decoder_host, cfg_.decoder_port, "/hetero/cached_prefix",
                           {{"ids", ids}}, 10000);
    const int64_t cached = cp.is_ok() ? cp.value().value("cached_tokens", int64_t{0}) : 0;
    if (!cp.is_ok()) {
      v = Verdict::declined("cached prefix unknown: " + cp.status().message());
    } else if (mode != "bridge" && T - cached < cfg_.bridge_min_tail) {
      v = Verdict::skipped("warm (" + std::to_string(cached) + " of " + std::to_string(T) +
                           " cached)");
    } else {
      v = bridge(ids, info.value());
      if (v.kind == VerdictKind::kComplete || v.kind == VerdictKind::kPartial) {
        // Trust, but check: the decoder must now see the mounted prefix.
        auto after = http_json_ok(cfg_.decoder_host, cfg_.decoder_port, "/hetero/cached_prefix",
                                  {{"ids", ids}}, 10000);
        const int64_t now = after.is_ok() ? after.value().value("cached_tokens", int64_t{0}) : -1;
        if (now < v.b) {
          Verdict d = Verdict::declined("mounted " + std::to_string(v.b) +
                                        " rows but the decoder would reuse " + std::to_string(now));
          d.bytes = v.bytes, d.timings_ms = v.timings_ms;
          v = d;
        }
      }
    }
  }
  v.t = T;
  v.timings_ms["tokenize"] = tokenize_ms;

  // 3. The original request, to the decoder; its answer relayed.
  const bool stream = body.value("stream", false);
  if (!stream) {
    httplib::Client cli(cfg_.decoder_host, cfg_.decoder_port);
    cli.set_read_timeout(std::chrono::milliseconds(cfg_.decoder_timeout_ms));
    const auto t_dec = Clock::now();
    auto r = cli.Post(path.c_str(), forward_body, "application/json");
    v.timings_ms["decoder"] = ms_since(t_dec);
    if (!r) return fail(503, "server_error", "decoder_unavailable", httplib::to_string(r.error()));
    json out = json::parse(r->body, nullptr, false);
    if (!out.is_discarded() && out.contains("usage") && out["usage"].is_object() &&
        (v.kind == VerdictKind::kComplete || v.kind == VerdictKind::kPartial)) {
      const int64_t reused = out["usage"]
                                 .value("prompt_tokens_details", json::object())
                                 .value("cached_tokens", int64_t{-1});
      if (reused < v.b) {  // a bridged number is never reported for a native run
        Verdict d = Verdict::declined("decoder reused " + std::to_string(reused) + " of " +
                                      std::to_string(v.b) + " mounted tokens");
        d.t = v.t, d.bytes = v.bytes, d.timings_ms = v.timings_ms;
        v = d;
      }
    }
    res.set_content(r->body, r->get_header_value("Content-Type").empty()
                                 ? "application/json"
                                 : r->get_header_value("Content-Type"));
    return finish(r->status);
  }

  // Streaming: relay every byte as it arrives, unbuffered.
  res.set_header("X-PD-Bridge", v.header_value());
  res.set_header("Cache-Control", "no-cache");
  metrics_.record(v, 200);
  log_line("front", "POST " + path + " stream " + v.header_value());
  auto cfg = cfg_;
  auto body_copy = std::make_shared<std::string>(forward_body);
  FrontMetrics* metrics = &metrics_;
  res.set_chunked_content_provider("text/event-stream", [cfg, body_copy, path, metrics](
                                                            size_t, httplib::DataSink& sink) {
    httplib::Client cli(cfg.decoder_host, cfg.decoder_port);
    cli.set_read_timeout(std::chrono::milliseconds(cfg.decoder_timeout_ms));
    httplib::Request dreq;
    dreq.method = "POST";
    dreq.path = path;
    dreq.body = *body_copy;
    dreq.set_header("Content-Type", "application/json");
    bool client_gone = false;
    const auto t_send = Clock::now();
    double first_ms = -1;
    dreq.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
      // SSE keep-alive comments precede the first token; time the first data event.
      if (first_ms < 0 && std::string_view(data, n).find("data:") != std::string_view::npos)
        first_ms = ms_since(t_send);
      if (!sink.write(data, n)) return (client_gone = true), false;
      return true;
    };
    auto r = cli.send(dreq);
    if (first_ms >= 0) {
      metrics->record_stage("decoder_first_token", first_ms);
      log_line("front", "POST " + path +
                            " stream decoder_first_token_ms=" + std::to_string(first_ms) +
                            " decoder_total_ms=" + std::to_string(ms_since(t_send)));
    }
    if (!r && !client_gone) {
      const std::string ev =
          "data: " +
          error_json("server_error", "decoder_unavailable", httplib::to_string(r.error())).dump() +
          "\n\n";
      sink.write(ev.data(), ev.size());
    }
    metrics->inflight(-1);
    if (!client_gone) sink.done();
    return !client_gone;
  });
}

Status FrontServer::start() {
  if (cfg_.store_dir.empty()) return invalid_argument("--store is required (the seam's --store)");
  server_ = std::make_unique<httplib::Server>();
  const int threads = cfg_.threads;
  server_->new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  for (const char* p : {"/v1/chat/completions", "/v1/completions"}) {
    const std::string path = p;
    server_->Post(p, [this, path](const httplib::Request& req, httplib::Response& res) {
      handle_completion(req, res, path);
    });
  }
  server_->Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    auto info = http_json_ok(cfg_.decoder_host, cfg_.decoder_port, "/hetero/info", json(), 10000);
    if (!info.is_ok()) {
      res.status = 503;
      res.set_content(
          error_json("server_error", "decoder_unavailable", info.status().message()).dump(),
          "application/json");
      return;
    }
    const std::string name = std::filesystem::path(info.value().value("model", "")).filename();
    json j = {{"object", "list"},
              {"data",
               json::array(
                   {{{"id", name}, {"object", "model"}, {"owned_by", "hetero"}, {"created", 0}}})}};
    res.set_content(j.dump(), "application/json");
  });
  server_->Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    auto d = http_json("127.0.0.1", cfg_.decoder_port, "/hetero/info", json(), 3000);
    auto p = http_json(cfg_.prefill_host, cfg_.prefill_port, "/health", json(), 3000);
    const bool dok = d.is_ok() && d->status == 200, pok = p.is_ok() && p->status == 200;
    json j = {{"status", dok ? "ok" : "degraded"},
              {"decoder", dok ? "ok" : (d.is_ok() ? "error" : d.status().message())},
              {"prefill", pok ? "ok" : (p.is_ok() ? "error" : p.status().message())}};
    if (dok && pok)
      j["fingerprints_agree"] =
          d->body.value("fingerprint", "") == p->body.value("fingerprint", "-");
    res.status = dok ? 200 : 503;
    res.set_content(j.dump(), "application/json");
  });
  server_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_.render(), "text/plain; version=0.0.4");
  });
  // Every response carries a verdict; the completion handlers set their own first.
  server_->set_post_routing_handler([](const httplib::Request&, httplib::Response& res) {
    if (!res.has_header("X-PD-Bridge"))
      res.set_header("X-PD-Bridge", Verdict::skipped("not a completion").header_value());
  });
  server_->set_error_handler([](const httplib::Request&, httplib::Response& res) {
    if (!res.body.empty()) return;
    const bool too_large = res.status == 413;
    res.set_content(
        error_json("invalid_request_error", too_large ? "payload_too_large" : "not_found",
                   too_large ? "request body too large for its content type; send "
                               "Content-Type: application/json"
                             : "no route; see /v1/chat/completions, /v1/completions, /v1/models")
            .dump(),
        "application/json");
  });
  if (cfg_.port == 0) {
    port_ = server_->bind_to_any_port(cfg_.host.c_str());
    if (port_ < 0) return unavailable("cannot bind " + cfg_.host);
  } else {
    if (!server_->bind_to_port(cfg_.host.c_str(), cfg_.port))
      return unavailable("cannot bind " + cfg_.host + ":" + std::to_string(cfg_.port));
    port_ = cfg_.port;
  }
  thread_ = std::thread([this] { server_->listen_after_bind(); });
  // stop() right after start() must find a running server, or it would not stop it.
  while (!server_->is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return Status::ok();
}

void FrontServer::stop() {
  if (server_) server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace hetero
