// One request's life on the prefill service (service.h), with the turn held: admission (its plan
// of chunks, its memory, the state it resumes from), then its run: the cache program, the chunks
// turn by turn (a turn given up at a chunk boundary while another request waits, and taken
// again), the manifest, and the state kept for later requests. service.cc holds the HTTP side
// and the turns themselves.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <new>
#include <optional>

#include "common/log.h"
#include "prefill/service.h"

namespace hetero {

Result<std::vector<int64_t>> decoder_calls_after(const std::vector<int64_t>& calls, int64_t start,
                                                 int64_t at) {
  int64_t pos = start;
  size_t i = 0;
  while (i < calls.size() && pos < at) pos += calls[i++];
  if (pos != at) return invalid_argument("row " + std::to_string(at) + " is inside a decoder call");
  return std::vector<int64_t>(calls.begin() + static_cast<std::ptrdiff_t>(i), calls.end());
}

// ---------------------------------------------------------------------------------- admission

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
  Status st;
  if (fault_.kind == "refuse-memory") {  // as an engine out of memory refuses (tests)
    HETERO_RETURN_IF_ERROR(engine_->reset());
    st = resource_exhausted("injected fault refuse-memory: out of device memory for " +
                            std::to_string(req.ids.size()) + " tokens");
  } else {
    st = reserve_plan(a->from, a->plan);
  }
  if (st.code() == Code::kResourceExhausted && memory_floor_ && a->plan.size() > 1 &&
      fault_.kind != "refuse-memory")
    st = seal_at_memory_floor(req, a, st);
  if (st.is_ok() && a->engine_state) {
    st = engine_->restore(*a->engine_state);
  } else if (st.is_ok() && a->from > 0) {
    st = states_->restore(req.ids, a->from, engine_, req.cache_salt);
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

// The memory floor: the longest prefix of whole chunks that fits (what fits is monotone in the
// prefix's length, so a bisection over the chunk boundaries finds it). It must reach past the
// tail's start, or there is nothing to send.
Status PrefillService::seal_at_memory_floor(const PrefillRequest& req, Admission* a,
                                            const Status& refused) {
  const std::vector<int64_t>& plan = a->plan;
  const int64_t from = a->from;
  size_t lo = 0, hi = plan.size();  // [1, lo] chunks fit; hi chunks do not
  while (hi - lo > 1) {
    const size_t mid = (lo + hi) / 2;
    if (reserve_plan(from, {plan.begin(), plan.begin() + static_cast<std::ptrdiff_t>(mid)}).is_ok())
      lo = mid;
    else
      hi = mid;
  }
  int64_t b = from;
  for (size_t i = 0; i < lo; ++i) b += plan[i];
  if (lo < 1 || b <= req.start) return refused;
  const std::vector<int64_t> fits(plan.begin(), plan.begin() + static_cast<std::ptrdiff_t>(lo));
  // Again: the last attempt may have been one that did not fit.
  if (!reserve_plan(from, fits).is_ok()) return refused;
  a->sealed = "sealed at the memory floor: " + std::to_string(b) + " of " +
              std::to_string(req.ids.size()) + " tokens fit (" + refused.message() + ")";
  log_line("prefill", a->sealed);
  a->plan = fits;
  return Status::ok();
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

// ---------------------------------------------------------------------------------- the run

// An admitted request's run with the turn held: its stream (a keep-alive frame where it has been
// quiet), its cache program and producer, and where its forward stands over the turns it gives
// up and takes again.
class PrefillService::AdmittedRun {
 public:
  AdmittedRun(PrefillService* service, const PrefillRequest& req, const Admission& a,
              const BridgeProducer::FrameSink& stream, const std::function<bool()>& receiver_gone,
              const FrameTagger* tags)
      : s_(*service),
        req_(req),
        stream_(stream),
        receiver_gone_(receiver_gone),
        tags_(tags),
        T_(static_cast<int64_t>(req.ids.size())),
        holding_{service},
        sink_([this](std::string f) {
          last_frame_.store(Clock::now().time_since_epoch().count());
          return stream_(std::move(f));
        }),
        now_(a),
        sealed_(a.sealed),
        planned_(planned_by(a)),
        emitted_(req.start) {}

  // The request's cache program (a tail's resumed from its own state at the start) and the
  // producer it feeds; or why not.
  Status open_program();
  // The manifest of a request whose program refused it, sent.
  Manifest refuse(const Status& why);
  // The chunks, turn by turn, until the plan is done, fails or the receiver leaves.
  // may_yield: the turn may go to a waiting request at a chunk boundary.
  Status compute(bool may_yield);
  // The manifest, the stream's last frame.
  Manifest finish(const Status& st);
  // What a finished forward leaves for later requests: the prefix cache's rows of ids[0,
  // planned), or a family's checkpoints of exactly these ids.
  void keep_for_later(const Status& st, const Manifest& m);

 private:
  using Clock = std::chrono::steady_clock;
  static int64_t planned_by(const Admission& a) {
    int64_t planned = a.from;
    for (int64_t n : a.plan) planned += n;
    return planned;
  }
  // False: the receiver stopped reading.
  bool keep_alive();
  // One turn's chunks; *yield_at: the chunk boundary where it stopped to give the turn up, or -1.
  Status run_turn(bool may_yield, int64_t* yield_at);
  // Gives the turn up at `at`, waits at the back of the queue, and is admitted again from there.
  Status yield_turn(int64_t at);
  void keep_checkpoints();

  PrefillService& s_;
  const PrefillRequest& req_;
  const BridgeProducer::FrameSink& stream_;
  const std::function<bool()>& receiver_gone_;
  const FrameTagger* tags_;
  const int64_t T_;
  // The turn is this request's until it ends (or gives it up to wait for the next one). Declared
  // before the program and the producer: the turn goes back after they are gone.
  struct Holding {
    PrefillService* service;
    bool held = true;
    ~Holding() {
      if (held) service->give_turn();
    }
  } holding_;
  // When the stream last had a frame (the producer's frames come from its own thread).
  std::atomic<Clock::rep> last_frame_{Clock::now().time_since_epoch().count()};
  const BridgeProducer::FrameSink sink_;
  std::unique_ptr<SegmentProgram> program_;
  std::optional<BridgeProducer> producer_;
  Admission now_;  // the latest admission: the request's, or its resumption's after a turn
  std::string sealed_;
  int64_t planned_;  // the end of now_'s plan
  int64_t emitted_;  // rows before it were streamed in an earlier turn
  // A receiver that hung up is noticed before the next chunk, not at the next frame's write (a
  // chunk's frame comes only once every layer has passed it).
  bool gone_ = false;
  bool cancelled_ = false;
};

Manifest PrefillService::run_admitted(const PrefillRequest& req, const Admission& a,
                                      const BridgeProducer::FrameSink& stream,
                                      const std::function<bool()>& receiver_gone, bool may_yield,
                                      const std::function<void()>& stream_ended,
                                      const FrameTagger* tags) {
  AdmittedRun run(this, req, a, stream, receiver_gone, tags);
  if (const Status opened = run.open_program(); !opened.is_ok()) return run.refuse(opened);
  const Status st = run.compute(may_yield);
  Manifest m = run.finish(st);
  if (stream_ended) stream_ended();  // what follows is kept for later requests, sent to no one
  run.keep_for_later(st, m);
  return m;
}

Status PrefillService::AdmittedRun::open_program() {
  auto program = s_.programs_(req_);
  if (program.is_ok() && now_.resume) {  // a tail: the program's own state at its start
    if (Status r = program.value()->resume(*now_.resume->program); !r.is_ok()) program = r;
  }
  if (!program.is_ok()) return program.status();
  program_ = std::move(program.value());
  producer_.emplace(program_.get(), sink_, 4, program_->device_stream() ? s_.capture_ : nullptr,
                    s_.buffers_.get(), tags_);
  producer_->set_arith(s_.arith_);
  producer_->set_tail(req_.start, now_.from);
  return Status::ok();
}

Manifest PrefillService::AdmittedRun::refuse(const Status& why) {
  Manifest m = s_.refusal(req_);
  m.reason = "cache program refused the request: " + why.to_string();
  sink_(encode_manifest(m, tags_));
  return m;
}

bool PrefillService::AdmittedRun::keep_alive() {
  const Clock::duration quiet =
      Clock::now().time_since_epoch() - Clock::duration(last_frame_.load());
  if (s_.keepalive_ms_ <= 0 || quiet < std::chrono::milliseconds(s_.keepalive_ms_)) return true;
  return sink_(encode_keepalive(tags_));
}

Status PrefillService::AdmittedRun::compute(bool may_yield) {
  Status st;
  try {
    for (;;) {
      int64_t yield_at = -1;
      st = run_turn(may_yield, &yield_at);
      if (!st.is_ok() || yield_at < 0) break;
      st = yield_turn(yield_at);
      if (!st.is_ok()) break;
    }
  } catch (const std::bad_alloc&) {  // the request ends, sealed by its manifest; the host serves on
    st = resource_exhausted("out of host memory during the prefill of " + std::to_string(T_) +
                            " tokens");
  }
  return st;
}

Status PrefillService::AdmittedRun::run_turn(bool may_yield, int64_t* yield_at) {
  // The engine sees the ids it computes: from where its restored state ends to the end of a
  // (possibly sealed) plan. Rows before `emitted_` were streamed in an earlier turn.
  const std::vector<int32_t> ids(req_.ids.begin() + now_.from, req_.ids.begin() + planned_);
  const AttentionInputTap to_producer = producer_->tap();
  const AttentionInputTap tap = [&](const TapEvent& e) {
    if (e.pos0 + e.n_tokens > emitted_) to_producer(e);
    keep_alive();  // a layer done is progress, even where a chunk's frame is far off
  };
  size_t chunks_done = 0;
  Status st = s_.engine_->prefill_plan(ids, now_.plan, tap, [&] {
    gone_ = gone_ || (receiver_gone_ && receiver_gone_());
    int64_t at = now_.from;
    for (size_t i = 0; i < chunks_done && i < now_.plan.size(); ++i) at += now_.plan[i];
    // Only after a chunk of its own in this turn (one it had not sent before): two
    // requests that took turns recomputing what the cache lost would never get on.
    const bool yield = !gone_ && may_yield && !now_.follows_calls && at > emitted_ &&
                       chunks_done < now_.plan.size() && s_.should_yield(at);
    *yield_at = yield ? at : -1;
    ++chunks_done;
    return gone_ || producer_->cancelled() || yield;
  });
  if (st.is_ok()) st = s_.engine_->finish();
  return st;
}

Status PrefillService::AdmittedRun::yield_turn(int64_t at) {
  // Its turn is up and another request waits: the state so far goes to the prefix cache,
  // the turn to the next in line, and this request to the back of the queue.
  std::shared_ptr<const Checkpoint> paused;  // families whose tails need checkpoints
  std::vector<int64_t> calls_after;          // ... and the decoder's calls from `at` on
  if (s_.tails_need_checkpoints()) {
    paused = s_.engine_->checkpoint();
    auto calls = decoder_calls_after(req_.decoder_calls, req_.start, at);
    if (!paused || paused->tokens() != at || !calls.is_ok())
      return internal_error("no engine checkpoint at the chunk boundary " + std::to_string(at) +
                            (calls.is_ok() ? "" : ": " + calls.status().message()));
    calls_after = std::move(calls.value());
  } else if (const Status kept = s_.states_->save(req_.ids, at, s_.engine_, req_.cache_salt);
             !kept.is_ok()) {
    log_line("prefill", "the prefix cache kept nothing: " + kept.to_string());
  }
  log_line("prefill", "gave the engine to the next request at " + std::to_string(at) + " of " +
                          std::to_string(T_) + " tokens");
  s_.give_turn();
  holding_.held = false;
  const Turn turn = s_.take_turn([&] {
    if (!keep_alive()) return true;  // the receiver stopped reading
    return receiver_gone_ && receiver_gone_();
  });
  // Stopping, or the receiver left: the stream ends here.
  if (!turn.status.is_ok()) return turn.status;
  holding_.held = true;
  // Resume: from the longest prefix the cache still holds (recomputing what it lost), the
  // chunks after `at` as planned before.
  PrefillRequest rest;
  rest.ids.assign(req_.ids.begin(), req_.ids.begin() + planned_);
  rest.start = at;
  rest.chunk_tokens = req_.chunk_tokens;
  rest.decoder_calls = paused ? calls_after : req_.decoder_calls;
  HETERO_RETURN_IF_ERROR(s_.admit(rest, &now_, paused));
  if (!now_.sealed.empty()) sealed_ = now_.sealed;
  planned_ = planned_by(now_);
  emitted_ = at;
  log_line("prefill", "resumed at " + std::to_string(at) + " of " + std::to_string(T_) +
                          " tokens (from " + std::to_string(now_.from) +
                          (paused ? ", its own checkpoint)" : ", the prefix cache)"));
  return Status::ok();
}

Manifest PrefillService::AdmittedRun::finish(const Status& st) {
  if (!st.is_ok()) log_line("prefill", "a prefill failed: " + st.to_string());
  cancelled_ = producer_->cancelled() || gone_;
  return producer_->finish(T_, st, sealed_);
}

void PrefillService::AdmittedRun::keep_for_later(const Status& st, const Manifest& m) {
  if (cancelled_)  // its state is the engine's, which the next request resets
    log_line("prefill", "the receiver went away: stopped after " +
                            std::to_string(m.covered_tokens) + " of " + std::to_string(T_) +
                            " tokens");
  if (!st.is_ok() || cancelled_) return;
  // A forward that ran its whole plan leaves the state of ids[0, planned) for later requests.
  if (s_.states_ && holding_.held && !now_.follows_calls) {
    const Status kept = s_.states_->save(req_.ids, planned_, s_.engine_, req_.cache_salt);
    if (!kept.is_ok()) log_line("prefill", "the prefix cache kept nothing: " + kept.to_string());
  }
  if (s_.checkpoints_ && s_.tails_need_checkpoints() && m.complete) keep_checkpoints();
}

// A family whose tails resume from whole checkpoints: the engine's and the program's, for
// exactly these ids (what the decoder checkpoints once it holds them).
void PrefillService::AdmittedRun::keep_checkpoints() {
  PrefixCheckpoints& checkpoints = *s_.checkpoints_;
  // The program's first: a GPU engine's checkpoint is a copy of its whole state to the host,
  // not worth making when the program keeps none.
  auto program_state = program_->checkpoint();
  const int64_t known =
      s_.engine_->checkpoint_bytes() + (program_state.is_ok() ? program_state.value()->bytes() : 0);
  auto engine_state = program_state.is_ok() && known <= checkpoints.max_bytes()
                          ? s_.engine_->checkpoint()
                          : nullptr;
  if (program_state.is_ok() && known > checkpoints.max_bytes())
    log_line("prefill", "no checkpoint for a later tail: its " + std::to_string(known) +
                            " bytes exceed the prefix cache");
  else if (!engine_state || !program_state.is_ok())
    log_line("prefill", "no checkpoint for a later tail: " +
                            (program_state.is_ok() ? std::string("the engine keeps none")
                                                   : program_state.status().message()));
  else if (!checkpoints.put(req_.ids, engine_state, program_state.value(), req_.cache_salt))
    log_line("prefill", "no checkpoint for a later tail: its " +
                            std::to_string(engine_state->bytes() + program_state.value()->bytes()) +
                            " bytes exceed the prefix cache");
}

}  // namespace hetero
