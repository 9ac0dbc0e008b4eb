// The prefill service's HTTP side and its turns: POST /v1/prefill checked, queued for its turn,
// admitted and streamed (faults injected as frames leave, for tests), GET /health, and the
// first-come queue that gives one request at a time the engine. See service.h;
// service_request.cc holds a request's admission and run.
#include "prefill/service.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "common/auth.h"
#include "common/http_server.h"
#include "common/json_text.h"
#include "common/log.h"
#include "common/queue.h"

namespace hetero {
using nlohmann::json;

namespace {

// code: the refusal's own name where the caller acts on it ("queue_full",
// "prefix_state_missing"); empty: the status code's.
std::string error_body(const Status& s, const std::string& code = "") {
  return json_text(json{
      {"error", {{"code", code.empty() ? code_name(s.code()) : code}, {"message", s.message()}}}});
}

int http_status_for(const Status& s) {
  switch (s.code()) {
    case Code::kInvalidArgument:
      return 400;
    case Code::kNotFound:
      return 404;
    case Code::kFailedPrecondition:
      return 409;
    case Code::kResourceExhausted:  // Insufficient Storage: the request's memory does not fit
      return 507;
    case Code::kUnavailable:
      return 503;
    default:
      return 500;
  }
}

// Applies a fault to the outgoing frame with index i (segments count from 0). Returns false
// when the frame must be dropped.
bool apply_fault(const FaultSpec& f, int64_t i, std::string* frame, const FrameTagger* tags) {
  if (f.kind == "corrupt" && i == f.n && frame_size(*frame) > 40) {
    (*frame)[frame_size(*frame) - 9] ^= 0x5a;  // last payload byte, before the checksum
  } else if (f.kind == "gap" && i == f.n) {
    return false;
  } else if (f.kind == "wrong-t") {
    FrameParser p(int64_t{8} << 30);
    p.feed(frame->data(), frame->size());
    auto fr = p.next();
    if (fr.is_ok() && fr.value() && fr.value()->header.value("kind", "") == "manifest") {
      auto m = decode_manifest(*fr.value());
      if (m.is_ok()) {
        m.value().requested_tokens += 1;
        *frame = encode_manifest(m.value(), tags);
      }
    }
  }
  return true;
}

}  // namespace

Result<FaultSpec> parse_fault(const std::string& text) {
  FaultSpec f;
  if (text.empty()) return f;
  const auto colon = text.find(':');
  f.kind = text.substr(0, colon);
  if ((f.kind == "wrong-t" || f.kind == "refuse-memory") && colon == std::string::npos) return f;
  if (colon == std::string::npos) return invalid_argument("--fault '" + text + "' needs ':N'");
  char* end = nullptr;
  f.n = std::strtoll(text.c_str() + colon + 1, &end, 10);
  if (*end != '\0' || f.n < 0) return invalid_argument("--fault '" + text + "': bad N");
  for (const char* k : {"exit-after", "stall-after", "truncate-after", "corrupt", "gap"})
    if (f.kind == k) return f;
  return invalid_argument("--fault kind '" + f.kind + "' is unknown");
}

Status check_export_matches_model(const LlamaConfig& model, const LlamaDecoderWeights& exported) {
  const DecoderCacheLayout& layout = exported.layout;
  auto mismatch = [&](const char* what, int64_t m, int64_t e) {
    return failed_precondition(std::string("decoder-weights export does not match the model: ") +
                               what + " " + std::to_string(e) + " in the export, " +
                               std::to_string(m) + " in the model");
  };
  if (model.layers != layout.layers) return mismatch("layers", model.layers, layout.layers);
  if (model.hidden != layout.hidden) return mismatch("hidden", model.hidden, layout.hidden);
  if (model.kv_heads != layout.kv_heads)
    return mismatch("kv_heads", model.kv_heads, layout.kv_heads);
  if (model.head_dim != layout.head_dim)
    return mismatch("head_dim", model.head_dim, layout.head_dim);
  if (model.sliding_window != exported.sliding_window)
    return mismatch("sliding_window", model.sliding_window, exported.sliding_window);
  return Status::ok();
}

PrefillService::PrefillService(PrefillEngine* engine, DecoderCacheLayout layout,
                               ProgramFactory programs, int64_t default_chunk_tokens,
                               int64_t max_tokens)
    : engine_(engine),
      layout_(std::move(layout)),
      programs_(std::move(programs)),
      default_chunk_(default_chunk_tokens),
      max_tokens_(max_tokens) {}

PrefillService::~PrefillService() { stop(); }

PrefillService::Turn PrefillService::take_turn(const std::function<bool()>& gone) {
  const auto t0 = std::chrono::steady_clock::now();
  Turn t;
  std::unique_lock<std::mutex> lock(turn_mu_);
  if (busy_ && static_cast<int64_t>(waiting_.size()) >= max_waiting_) {
    const double ahead_ms = turn_ms_ * static_cast<double>(waiting_.size() + 1);
    t.retry_after_s = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(ahead_ms / 1000)));
    t.status = unavailable("the prefill host's queue is full: one request runs and " +
                           std::to_string(waiting_.size()) + " wait (--queue " +
                           std::to_string(max_waiting_) + "); retry in about " +
                           std::to_string(t.retry_after_s) + " s");
    return t;
  }
  const uint64_t ticket = next_ticket_++;
  waiting_.push_back(ticket);
  auto leave = [&](Status why) {
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), ticket));
    turn_free_.notify_all();  // the next in line may be first now
    t.status = std::move(why);
    return t;
  };
  while (busy_ || waiting_.front() != ticket) {
    if (stopping_->load()) return leave(unavailable("the prefill host is stopping"));
    turn_free_.wait_for(lock, std::chrono::milliseconds(100));
    if (gone && (busy_ || waiting_.front() != ticket)) {
      lock.unlock();
      const bool left = gone();
      lock.lock();
      if (left) return leave(unavailable("the receiver went away while the request waited"));
    }
  }
  if (stopping_->load()) return leave(unavailable("the prefill host is stopping"));
  waiting_.pop_front();
  busy_ = true;
  turn_began_ = std::chrono::steady_clock::now();
  t.waited_ms = std::chrono::duration<double, std::milli>(turn_began_ - t0).count();
  return t;
}

bool PrefillService::should_yield(int64_t tokens) {
  if (turn_ms_limit_ <= 0) return false;
  if (tails_need_checkpoints() ? !engine_->keeps_checkpoints()
                               : !states_ || engine_->state_row_bytes() <= 0 ||
                                     tokens * engine_->state_row_bytes() > states_->max_bytes())
    return false;  // its state would not be kept: giving the engine up would lose the work
  std::lock_guard<std::mutex> lock(turn_mu_);
  return !waiting_.empty() && std::chrono::steady_clock::now() - turn_began_ >=
                                  std::chrono::milliseconds(turn_ms_limit_);
}

void PrefillService::give_turn() {
  {
    std::lock_guard<std::mutex> lock(turn_mu_);
    busy_ = false;
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - turn_began_)
            .count();
    turn_ms_ = turn_ms_ == 0 ? ms : 0.75 * turn_ms_ + 0.25 * ms;
  }
  turn_free_.notify_all();  // FIFO: only the first in line takes it
}

Status PrefillService::start(const std::string& host, int port) {
  server_ = std::make_unique<HttpServer>("prefill", limits_, [](int status, const std::string& m) {
    return error_body(status == 413   ? invalid_argument(m)
                      : status == 404 ? not_found(m + "; see POST /v1/prefill, GET /health")
                      : status == 500 ? internal_error("internal error; see the prefill host's log")
                                      : invalid_argument(m));
  });
  // Signed requests only on /v1/prefill (docs/design/auth.md); /health stays open. The check
  // of the header and its time runs before the body is read.
  server_->set_check(signed_request_check(
      std::make_shared<RequestVerifier>(secret_),
      [](std::string_view path) { return path == "/v1/prefill"; },
      [](int, const std::string& code, const std::string& message) {
        return json_text(json{{"error", {{"code", code}, {"message", message}}}});
      }));
  server_->get("/health", [this](const HttpRequest&, HttpResponse& res) {
    json j = {{"status", "ok"},
              {"family", layout_.family},
              {"fingerprint", layout_.fingerprint},
              {"layers", layout_.layers}};
    {
      std::lock_guard<std::mutex> lock(turn_mu_);
      j["queue"] = {
          {"running", busy_ ? 1 : 0}, {"waiting", waiting_.size()}, {"max_waiting", max_waiting_}};
    }
    if (gpu_memory_) {
      json gpus = json::array();
      for (const GpuMemory& g : gpu_memory_())
        gpus.push_back({{"device", g.device},
                        {"weights_bytes", g.weights},
                        {"state_and_activations_bytes", g.state_and_activations},
                        {"capture_bytes", g.capture},
                        {"free_bytes", g.free},
                        {"total_bytes", g.total}});
      j["gpu_memory"] = std::move(gpus);
    }
    res.set_content(j.dump(), "application/json");
  });
  // A body larger than the longest accepted request could be (max_tokens ids of at most ten
  // digits, the decoder's schedule beside them) is refused with 413 while it is read.
  server_->post(
      "/v1/prefill", [this](const HttpRequest& req, HttpResponse& res) { serve_prefill(req, res); },
      4096 + 24 * max_tokens_);
  if (Status st = server_->start(host, port); !st.is_ok()) return st;
  port_ = server_->port();
  return Status::ok();
}

void PrefillService::serve_prefill(const HttpRequest& req, HttpResponse& res) {
  auto parsed = parse_prefill_request(req.body, engine_->vocab(), layout_, max_tokens_);
  if (!parsed.is_ok()) {
    res.status = http_status_for(parsed.status());
    res.set_content(error_body(parsed.status()), "application/json");
    return;
  }
  auto request = std::make_shared<PrefillRequest>(std::move(parsed.value()));
  // With the stack's secret, every frame leaves with its tag (frame_tag.h), keyed by the
  // caller's nonce: the decode side then knows the stream came from a holder of the secret.
  std::shared_ptr<const FrameTagger> tags;
  if (!secret_.empty()) {
    if (request->stream_nonce.empty()) {
      const Status st = invalid_argument(
          "this prefill host tags its frames with the stack's secret: the request needs a "
          "'stream_nonce'");
      res.status = http_status_for(st);
      res.set_content(error_body(st), "application/json");
      return;
    }
    tags = std::make_shared<const FrameTagger>(secret_, request->stream_nonce);
    res.set_header(kFrameTagsHeader, kFrameTagsScheme);
  }
  // Admission, before any byte of the response: this request's turn, then its memory. A
  // refusal answers with an error body and gives the turn to the next request.
  // A client that hung up (HttpServer::client_gone sees its socket's hang-up) leaves the queue or
  // cancels the stream.
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  std::function<bool()> receiver_gone = [server = server_.get(), conn = req.connection, cancelled] {
    if (!cancelled->load() && server->client_gone(conn)) cancelled->store(true);
    return cancelled->load();
  };
  const Turn turn = take_turn(receiver_gone);
  if (!turn.status.is_ok()) {
    res.status = http_status_for(turn.status);
    if (turn.retry_after_s > 0) res.set_header("Retry-After", std::to_string(turn.retry_after_s));
    res.set_content(error_body(turn.status, turn.retry_after_s > 0 ? "queue_full" : ""),
                    "application/json");
    return;
  }
  res.set_header(kQueuedMsHeader, std::to_string(turn.waited_ms));
  auto admission = std::make_shared<Admission>();
  if (Status admitted = admit(*request, admission.get()); !admitted.is_ok()) {
    give_turn();
    res.status = http_status_for(admitted);
    res.set_content(error_body(admitted, admission->missing_state ? "prefix_state_missing" : ""),
                    "application/json");
    return;
  }
  // The prefill runs on its own thread, which gives the turn back when it ends; this handler
  // thread writes frames as they come.
  auto frames = std::make_shared<BoundedQueue<std::string>>(4);
  auto buffers = buffers_;
  auto worker = std::make_shared<std::thread>(
      [this, frames, cancelled, request, admission, receiver_gone, tags] {
        run_admitted(
            *request, *admission,
            [frames, cancelled](std::string f) {
              return !cancelled->load() && frames->push(std::move(f));
            },
            receiver_gone, /*may_yield=*/true, [frames] { frames->close(); }, tags.get());
        frames->close();  // where the request ended before its stream began
      });
  const FaultSpec fault = fault_;
  auto stopping = stopping_;
  res.set_chunked(
      "application/x-hetero-segments",
      [frames, cancelled, fault, stopping, buffers, tags, receiver_gone](ChunkSink& sink) {
        int64_t i = 0;
        uint64_t sent = 0;  // the frame's place in the stream: its tag's key
        while (auto f = frames->pop()) {
          if (!fault.kind.empty()) {
            if (fault.kind == "exit-after" && i == fault.n) _exit(3);
            if (fault.kind == "truncate-after" && i == fault.n) break;
            if (fault.kind == "stall-after" && i == fault.n) {
              while (!receiver_gone())  // until the receiver hangs up
                std::this_thread::sleep_for(std::chrono::milliseconds(50));
              return false;
            }
            if (!apply_fault(fault, i++, &*f, tags.get())) continue;
          }
          // Framed with its salt and digest (the long part of its tag, done as it was
          // written): here the digest becomes the tag of the frame's place in the stream.
          if (tags) tags->seal(sent++, &*f);
          if (!sink.write(f->data(), f->size())) {
            cancelled->store(true);  // receiver gone: stop the prefill at the next chunk
            frames->close();
            return false;
          }
          buffers->give(std::move(*f));  // sent: its memory frames a later segment
        }
        return true;
      },
      [frames, cancelled, worker](bool) {
        cancelled->store(true);
        frames->close();
        if (worker->joinable()) worker->join();
      });
}

void PrefillService::stop() {
  {
    std::lock_guard<std::mutex> lock(turn_mu_);  // a waiter sees the flag once it wakes
    stopping_->store(true);
  }
  turn_free_.notify_all();
  if (server_) server_->stop();
}

}  // namespace hetero
