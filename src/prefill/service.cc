// Prefill service: see service.h.
#include "prefill/service.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <new>
#include <nlohmann/json.hpp>

#include "common/auth.h"
#include "common/http_server.h"
#include "common/log.h"
#include "common/queue.h"

namespace hetero {
using nlohmann::json;

namespace {

// code: the refusal's own name where the caller acts on it ("queue_full",
// "prefix_state_missing"); empty: the status code's.
std::string error_body(const Status& s, const std::string& code = "") {
  return json{
      {"error", {{"code", code.empty() ? code_name(s.code()) : code}, {"message", s.message()}}}}
      .dump();
}

}  // namespace

Result<std::vector<int64_t>> decoder_calls_after(const std::vector<int64_t>& calls, int64_t start,
                                                 int64_t at) {
  int64_t pos = start;
  size_t i = 0;
  while (i < calls.size() && pos < at) pos += calls[i++];
  if (pos != at) return invalid_argument("row " + std::to_string(at) + " is inside a decoder call");
  return std::vector<int64_t>(calls.begin() + static_cast<std::ptrdiff_t>(i), calls.end());
}

namespace {

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

std::vector<int64_t> PrefillService::plan_for(const PrefillRequest& req, int64_t from) const {
  const int64_t T = static_cast<int64_t>(req.ids.size());
  const int64_t chunk = req.chunk_tokens > 0 ? req.chunk_tokens : default_chunk_;
  // A family with a chunk plan (its decoder's calls) runs a tail from its checkpoint at start.
  if (chunk_plan_ && from == req.start) return chunk_plan_(req, chunk);
  HETERO_CHECK(!chunk_plan_ && from <= req.start);
  std::vector<int64_t> plan;
  for (int64_t p = from; p < req.start; p += chunk) plan.push_back(std::min(chunk, req.start - p));
  for (int64_t p = req.start; p < T; p += chunk) plan.push_back(std::min(chunk, T - p));
  return plan;
}

Status PrefillService::reserve_plan(int64_t from, const std::vector<int64_t>& plan) {
  HETERO_RETURN_IF_ERROR(engine_->reset());
  int64_t tokens = from, longest = 0;
  for (int64_t n : plan) tokens += n, longest = std::max(longest, n);
  try {
    return engine_->reserve(tokens, longest);
  } catch (const std::bad_alloc&) {  // an engine without a reserve of its own
    return resource_exhausted("out of host memory while admitting " + std::to_string(tokens) +
                              " tokens");
  }
}

Status PrefillService::admit(const PrefillRequest& req, Admission* a,
                             std::shared_ptr<const Checkpoint> paused) {
  a->sealed.clear();
  a->resume.reset();
  a->engine_state = std::move(paused);
  a->missing_state = false;
  a->follows_calls = engine_->rows_follow_calls(req.decoder_calls, req.start, req.decoder_batched);
  if (req.start > 0 && tails_need_checkpoints() && !a->engine_state) {
    a->resume = checkpoints_ ? checkpoints_->find(req.ids, req.start, req.cache_salt) : nullptr;
    if (a->resume) a->engine_state = a->resume->engine;
    if (!a->resume) {
      a->missing_state = true;
      return failed_precondition("this prefill host holds no checkpoint of exactly the first " +
                                 std::to_string(req.start) + " tokens (a " + layout_.family +
                                 " tail resumes only from one); ask for the whole prefix");
    }
  }
  // Where the forward can start: the tail's checkpointed start, or the longest prefix of the
  // tail's start whose state the prefix cache holds.
  if (a->engine_state)
    a->from = req.start;
  else
    a->from = states_ && engine_->state_row_bytes() > 0 && !a->follows_calls
                  ? states_->lookup(req.ids, req.start, req.cache_salt)
                  : 0;
  a->plan = plan_for(req, a->from);
  std::vector<int64_t>* plan = &a->plan;
  const int64_t from = a->from;
  Status st;
  if (fault_.kind == "refuse-memory") {  // as an engine out of memory refuses (tests)
    HETERO_RETURN_IF_ERROR(engine_->reset());
    st = resource_exhausted("injected fault refuse-memory: out of device memory for " +
                            std::to_string(req.ids.size()) + " tokens");
  } else {
    st = reserve_plan(from, *plan);
  }
  // The memory floor: the longest prefix of whole chunks that fits (what fits is monotone in
  // the prefix's length, so a bisection over the chunk boundaries finds it). It must reach past
  // the tail's start, or there is nothing to send.
  if (st.code() == Code::kResourceExhausted && memory_floor_ && plan->size() > 1 &&
      fault_.kind != "refuse-memory") {
    size_t lo = 0, hi = plan->size();  // [1, lo] chunks fit; hi chunks do not
    while (hi - lo > 1) {
      const size_t mid = (lo + hi) / 2;
      if (reserve_plan(from, {plan->begin(), plan->begin() + static_cast<std::ptrdiff_t>(mid)})
              .is_ok())
        lo = mid;
      else
        hi = mid;
    }
    int64_t b = from;
    for (size_t i = 0; i < lo; ++i) b += (*plan)[i];
    if (lo >= 1 && b > req.start) {
      const std::vector<int64_t> fits(plan->begin(),
                                      plan->begin() + static_cast<std::ptrdiff_t>(lo));
      Status again =
          reserve_plan(from, fits);  // the last attempt may have been one that did not fit
      if (again.is_ok()) {
        a->sealed = "sealed at the memory floor: " + std::to_string(b) + " of " +
                    std::to_string(req.ids.size()) + " tokens fit (" + st.message() + ")";
        log_line("prefill", a->sealed);
        *plan = fits;
        st = Status::ok();
      }
    }
  }
  if (st.is_ok() && a->engine_state) {
    st = engine_->restore(*a->engine_state);
  } else if (st.is_ok() && from > 0) {
    st = states_->restore(req.ids, from, engine_, req.cache_salt);
    if (!st.is_ok()) {  // evicted meanwhile: compute it all (admission again, from 0)
      log_line("prefill", "the cached state is gone (" + st.message() + "); computing from 0");
      states_->clear();
      return admit(req, a);
    }
  }
  if (st.is_ok())
    st = engine_->set_decoder_calls(req.decoder_calls, req.start, req.decoder_batched);
  if (!st.is_ok())
    log_line("prefill", "refused a request of " + std::to_string(req.ids.size()) +
                            " tokens: " + st.to_string());
  return st;
}

Manifest PrefillService::refusal(const PrefillRequest& req) const {
  Manifest m;
  m.fingerprint = layout_.fingerprint;
  m.requested_tokens = static_cast<int64_t>(req.ids.size());
  m.start = req.start;
  m.covered_tokens = req.start;  // a tail's rows before its start are the decoder's own
  m.arith = arith_;
  return m;
}

Manifest PrefillService::run(const PrefillRequest& req, const BridgeProducer::FrameSink& sink) {
  Manifest m = refusal(req);
  if (const Turn turn = take_turn(); !turn.status.is_ok()) {
    m.reason = turn.status.message();
    sink(encode_manifest(m));
    return m;
  }
  Admission a;
  const Status admitted = admit(req, &a);
  if (admitted.is_ok()) return run_admitted(req, a, sink);
  give_turn();
  m.reason = "the engine refused the request: " + admitted.to_string();
  sink(encode_manifest(m));
  return m;
}

Manifest PrefillService::run_admitted(const PrefillRequest& req, const Admission& a,
                                      const BridgeProducer::FrameSink& stream,
                                      const std::function<bool()>& receiver_gone, bool may_yield,
                                      const std::function<void()>& stream_ended,
                                      const FrameTagger* tags) {
  // When the stream last had a frame (the producer's frames come from its own thread).
  using Clock = std::chrono::steady_clock;
  std::atomic<Clock::rep> last_frame{Clock::now().time_since_epoch().count()};
  const BridgeProducer::FrameSink sink = [&stream, &last_frame](std::string f) {
    last_frame.store(Clock::now().time_since_epoch().count());
    return stream(std::move(f));
  };
  const auto keep_alive = [&] {  // false: the receiver stopped reading
    const Clock::duration quiet =
        Clock::now().time_since_epoch() - Clock::duration(last_frame.load());
    if (keepalive_ms_ <= 0 || quiet < std::chrono::milliseconds(keepalive_ms_)) return true;
    return sink(encode_keepalive(tags));
  };
  // The turn is this request's until it ends (or gives it up to wait for the next one).
  struct Holding {
    PrefillService* service;
    bool held = true;
    ~Holding() {
      if (held) service->give_turn();
    }
  } holding{this};
  const int64_t T = static_cast<int64_t>(req.ids.size());
  int64_t planned = a.from;
  for (int64_t n : a.plan) planned += n;
  auto program = programs_(req);
  if (program.is_ok() && a.resume) {  // a tail: the program's own state at its start
    if (Status r = program.value()->resume(*a.resume->program); !r.is_ok()) program = r;
  }
  if (!program.is_ok()) {
    Manifest m = refusal(req);
    m.reason = "cache program refused the request: " + program.status().to_string();
    sink(encode_manifest(m, tags));
    return m;
  }
  BridgeProducer producer(program.value().get(), sink, 4,
                          program.value()->device_stream() ? capture_ : nullptr, buffers_.get(),
                          tags);
  producer.set_arith(arith_);
  producer.set_tail(req.start, a.from);
  Status st;
  // A receiver that hung up is noticed before the next chunk, not at the next frame's write (a
  // chunk's frame comes only once every layer has passed it).
  bool gone = false;
  Admission now = a;
  std::string sealed = a.sealed;
  try {
    for (int64_t emitted = req.start;;) {
      // The engine sees the ids it computes: from where its restored state ends to the end of a
      // (possibly sealed) plan. Rows before `emitted` were streamed in an earlier turn.
      const std::vector<int32_t> ids(req.ids.begin() + now.from, req.ids.begin() + planned);
      const AttentionInputTap to_producer = producer.tap();
      const AttentionInputTap tap = [&](const TapEvent& e) {
        if (e.pos0 + e.n_tokens > emitted) to_producer(e);
        keep_alive();  // a layer done is progress, even where a chunk's frame is far off
      };
      size_t chunks_done = 0;
      bool yield = false;
      st = engine_->prefill_plan(ids, now.plan, tap, [&] {
        gone = gone || (receiver_gone && receiver_gone());
        int64_t at = now.from;
        for (size_t i = 0; i < chunks_done && i < now.plan.size(); ++i) at += now.plan[i];
        // Only after a chunk of its own in this turn (one it had not sent before): two
        // requests that took turns recomputing what the cache lost would never get on.
        yield = !gone && may_yield && !now.follows_calls && at > emitted &&
                chunks_done < now.plan.size() && should_yield(at);
        ++chunks_done;
        return gone || producer.cancelled() || yield;
      });
      if (st.is_ok()) st = engine_->finish();
      if (!st.is_ok() || !yield) break;
      // Its turn is up and another request waits: the state so far goes to the prefix cache,
      // the turn to the next in line, and this request to the back of the queue.
      int64_t at = now.from;
      for (size_t i = 0; i + 1 < chunks_done; ++i) at += now.plan[i];
      std::shared_ptr<const Checkpoint> paused;  // families whose tails need checkpoints
      std::vector<int64_t> calls_after;          // ... and the decoder's calls from `at` on
      if (tails_need_checkpoints()) {
        paused = engine_->checkpoint();
        auto calls = decoder_calls_after(req.decoder_calls, req.start, at);
        if (!paused || paused->tokens() != at || !calls.is_ok()) {
          st = internal_error("no engine checkpoint at the chunk boundary " + std::to_string(at) +
                              (calls.is_ok() ? "" : ": " + calls.status().message()));
          break;
        }
        calls_after = std::move(calls.value());
      } else if (const Status kept = states_->save(req.ids, at, engine_, req.cache_salt);
                 !kept.is_ok()) {
        log_line("prefill", "the prefix cache kept nothing: " + kept.to_string());
      }
      log_line("prefill", "gave the engine to the next request at " + std::to_string(at) + " of " +
                              std::to_string(T) + " tokens");
      give_turn();
      holding.held = false;
      const Turn turn = take_turn([&] {
        if (!keep_alive()) return true;  // the receiver stopped reading
        return receiver_gone && receiver_gone();
      });
      if (!turn.status.is_ok()) {  // stopping, or the receiver left: the stream ends here
        st = turn.status;
        break;
      }
      holding.held = true;
      // Resume: from the longest prefix the cache still holds (recomputing what it lost), the
      // chunks after `at` as planned before.
      PrefillRequest rest;
      rest.ids.assign(req.ids.begin(), req.ids.begin() + planned);
      rest.start = at;
      rest.chunk_tokens = req.chunk_tokens;
      rest.decoder_calls = paused ? calls_after : req.decoder_calls;
      st = admit(rest, &now, paused);
      if (!st.is_ok()) break;
      if (!now.sealed.empty()) sealed = now.sealed;
      planned = now.from;
      for (int64_t n : now.plan) planned += n;
      emitted = at;
      log_line("prefill", "resumed at " + std::to_string(at) + " of " + std::to_string(T) +
                              " tokens (from " + std::to_string(now.from) +
                              (paused ? ", its own checkpoint)" : ", the prefix cache)"));
    }
  } catch (const std::bad_alloc&) {  // the request ends, sealed by its manifest; the host serves on
    st = resource_exhausted("out of host memory during the prefill of " + std::to_string(T) +
                            " tokens");
  }
  if (!st.is_ok()) log_line("prefill", "a prefill failed: " + st.to_string());
  const bool cancelled = producer.cancelled() || gone;
  Manifest m = producer.finish(T, st, sealed);
  if (stream_ended) stream_ended();  // what follows is kept for later requests, sent to no one
  if (cancelled)                     // its state is the engine's, which the next request resets
    log_line("prefill", "the receiver went away: stopped after " +
                            std::to_string(m.covered_tokens) + " of " + std::to_string(T) +
                            " tokens");
  // A forward that ran its whole plan leaves the state of ids[0, planned) for later requests.
  if (st.is_ok() && !cancelled && states_ && holding.held && !now.follows_calls) {
    const Status kept = states_->save(req.ids, planned, engine_, req.cache_salt);
    if (!kept.is_ok()) log_line("prefill", "the prefix cache kept nothing: " + kept.to_string());
  }
  // A family whose tails resume from whole checkpoints: the engine's and the program's, for
  // exactly these ids (what the decoder checkpoints once it holds them).
  if (st.is_ok() && !cancelled && checkpoints_ && tails_need_checkpoints() && m.complete) {
    // The program's first: a GPU engine's checkpoint is a copy of its whole state to the host,
    // not worth making when the program keeps none.
    auto program_state = program.value()->checkpoint();
    const int64_t known =
        engine_->checkpoint_bytes() + (program_state.is_ok() ? program_state.value()->bytes() : 0);
    auto engine_state = program_state.is_ok() && known <= checkpoints_->max_bytes()
                            ? engine_->checkpoint()
                            : nullptr;
    if (program_state.is_ok() && known > checkpoints_->max_bytes())
      log_line("prefill", "no checkpoint for a later tail: its " + std::to_string(known) +
                              " bytes exceed the prefix cache");
    else if (!engine_state || !program_state.is_ok())
      log_line("prefill", "no checkpoint for a later tail: " +
                              (program_state.is_ok() ? std::string("the engine keeps none")
                                                     : program_state.status().message()));
    else if (!checkpoints_->put(req.ids, engine_state, program_state.value(), req.cache_salt))
      log_line("prefill",
               "no checkpoint for a later tail: its " +
                   std::to_string(engine_state->bytes() + program_state.value()->bytes()) +
                   " bytes exceed the prefix cache");
  }
  return m;
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
        return json{{"error", {{"code", code}, {"message", message}}}}.dump();
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
