// The prefill host's service: POST /v1/prefill {ids, fingerprint, chunk?} runs a chunked
// prefill with the attention-input tap feeding the bridge producer, and streams the segments
// back (chunked transfer encoding) while the prefill runs, closed by a manifest.
// GET /health reports the model, the decoder fingerprint the export carries and the queue
// (running, waiting, max_waiting). With a secret
// (set_secret), POST /v1/prefill must be signed with it (common/auth.h; HTTP 401 otherwise);
// /health stays open.
// One prefill runs at a time; later requests wait their turn in a bounded queue, first come first
// served (set_queue: a request beyond it is answered 503 with Retry-After, and a waiting request
// whose receiver hangs up leaves the queue). A request is admitted before any
// byte of its response: the engine takes the request's memory (PrefillEngine::reserve) or the
// request is refused with an error body (HTTP 507 for kResourceExhausted), and the host serves
// the next one. With the memory floor on (set_memory_floor; a family whose prefix mounts
// partially), a request whose whole prompt would not fit is admitted for the longest prefix of
// its chunks that does, and its stream is sealed there: the manifest declares that prefix and
// says "sealed at the memory floor" with the numbers, so the decode side mounts it and the
// decoder goes on natively. A failure after admission ends the stream with a manifest that says
// why.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "bridge/decoder_weights.h"
#include "bridge/prefill_request.h"
#include "bridge/producer.h"
#include "common/http_server.h"
#include "engine/llama_cpu.h"
#include "prefill/state_cache.h"

namespace hetero {

// A prefill engine of any family, as the service drives it. Every failure is a Status; after a
// failed call the engine serves the next request, which starts with reset().
class PrefillEngine {
 public:
  virtual ~PrefillEngine() = default;
  // Forgets the previous sequence (a GPU engine first waits for its device: its errors).
  virtual Status reset() = 0;
  // Takes, before the first chunk, the memory a sequence of `tokens` tokens run in chunks of at
  // most `max_chunk_tokens` needs: kResourceExhausted, its message saying the bytes asked and
  // free, when it does not fit. Default: nothing to take.
  virtual Status reserve(int64_t tokens, int64_t max_chunk_tokens) {
    (void)tokens, (void)max_chunk_tokens;
    return Status::ok();
  }
  // The decoder's call schedule for this request (PrefillRequest::decoder_calls, from row
  // `start`, on its batch path or not), after reserve(): an engine whose arithmetic follows the
  // decoder's calls runs each of them as the decoder did (DeepSeek-V4's calls inside a chunk,
  // llama's per-call rope). Default: the calls change nothing.
  virtual Status set_decoder_calls(const std::vector<int64_t>& calls, int64_t start, bool batched) {
    (void)calls, (void)start, (void)batched;
    return Status::ok();
  }
  // Whether this request's rows depend on those calls in a way the prefix cache's states do not
  // record (a dynamic rope past its reach): then no state is looked up, kept or yielded for it.
  virtual bool rows_follow_calls(const std::vector<int64_t>& calls, int64_t start,
                                 bool batched) const {
    (void)calls, (void)start, (void)batched;
    return false;
  }
  virtual Status prefill_chunk(const std::vector<int32_t>& ids, const AttentionInputTap& tap) = 0;
  // A request's ids in chunks of the plan's lengths (they sum to ids.size()); stop is asked
  // before each chunk, and once it says true no further chunk starts (OK: the caller knows why
  // it stopped). Default: prefill_chunk for each chunk in turn. An engine that overlaps chunks
  // (a layer pipeline) runs the plan its own way.
  virtual Status prefill_plan(const std::vector<int32_t>& ids, const std::vector<int64_t>& plan,
                              const AttentionInputTap& tap, const std::function<bool()>& stop) {
    size_t at = 0;
    for (int64_t n : plan) {
      if (stop()) break;
      const std::vector<int32_t> part(ids.begin() + static_cast<std::ptrdiff_t>(at),
                                      ids.begin() + static_cast<std::ptrdiff_t>(at + n));
      HETERO_RETURN_IF_ERROR(prefill_chunk(part, tap));
      at += static_cast<size_t>(n);
    }
    return Status::ok();
  }
  virtual int64_t vocab() const = 0;
  // Waits for work the engine enqueued asynchronously (a GPU engine) and reports its errors.
  virtual Status finish() { return Status::ok(); }
  // The engine's own state per token, for the prefill host's prefix cache (state_cache.h): its
  // bytes per token, 0 (the default) when the engine does not hand it out (a tail's prefix is
  // then computed again). save_state copies rows [pos0, pos0 + n) of the sequence's state;
  // load_state, after reserve(), appends rows at the sequence's end pos0 as if prefilled.
  virtual int64_t state_row_bytes() const { return 0; }
  virtual Status save_state(int64_t pos0, int64_t n, uint8_t* out) {
    (void)pos0, (void)n, (void)out;
    return failed_precondition("this engine does not hand out its state");
  }
  virtual Status load_state(int64_t pos0, int64_t n, const uint8_t* in) {
    (void)pos0, (void)n, (void)in;
    return failed_precondition("this engine does not take state");
  }
  // An engine whose state is not rows (DeepSeek-V4) hands out whole checkpoints instead
  // (common/checkpoint.h): the state after the sequence so far (null: none), and, after
  // reserve(), a restore that goes on from a checkpoint's end as if its tokens had run here.
  virtual std::shared_ptr<const Checkpoint> checkpoint() const { return nullptr; }
  // The bytes checkpoint() would hold now, known without making it (0: not known).
  virtual int64_t checkpoint_bytes() const { return 0; }
  virtual bool keeps_checkpoints() const { return false; }
  virtual Status restore(const Checkpoint& c) {
    (void)c;
    return failed_precondition("this engine does not take checkpoints");
  }
};

template <class Engine>
class EngineAdapter : public PrefillEngine {
 public:
  explicit EngineAdapter(Engine* engine) : engine_(engine) {}
  Status reset() override {
    if constexpr (std::is_same_v<decltype(engine_->reset()), Status>) {
      return engine_->reset();
    } else {
      engine_->reset();
      return Status::ok();
    }
  }
  Status reserve(int64_t tokens, int64_t max_chunk_tokens) override {
    if constexpr (requires(Engine & e) { e.reserve(tokens, max_chunk_tokens); })
      return engine_->reserve(tokens, max_chunk_tokens);
    else
      return Status::ok();
  }
  Status set_decoder_calls(const std::vector<int64_t>& calls, int64_t start,
                           bool batched) override {
    if constexpr (requires(Engine & e) { e.set_decoder_calls(calls, start, batched); })
      return engine_->set_decoder_calls(calls, start, batched);
    else if constexpr (requires(Engine & e) { e.set_decoder_calls(calls); })
      return engine_->set_decoder_calls(calls);  // from its cached rows, which are `start`
    else
      return Status::ok();
  }
  bool rows_follow_calls(const std::vector<int64_t>& calls, int64_t start,
                         bool batched) const override {
    if constexpr (requires(const Engine& e) { e.rows_follow_calls(calls, start, batched); })
      return engine_->rows_follow_calls(calls, start, batched);
    else
      return false;
  }
  Status prefill_chunk(const std::vector<int32_t>& ids, const AttentionInputTap& tap) override {
    if constexpr (requires(Engine & e) { e.prefill_chunk(ids, tap); })
      return engine_->prefill_chunk(ids, tap);
    else
      return engine_->prefill(ids, {static_cast<int64_t>(ids.size())}, tap);
  }
  Status prefill_plan(const std::vector<int32_t>& ids, const std::vector<int64_t>& plan,
                      const AttentionInputTap& tap, const std::function<bool()>& stop) override {
    if constexpr (requires(Engine & e) { e.prefill(ids, plan, tap, stop); })
      return engine_->prefill(ids, plan, tap, stop);
    else
      return PrefillEngine::prefill_plan(ids, plan, tap, stop);
  }
  int64_t vocab() const override { return engine_->config().vocab; }
  int64_t state_row_bytes() const override {
    if constexpr (requires(const Engine& e) { e.state_row_bytes(); })
      return engine_->state_row_bytes();
    else
      return 0;
  }
  Status save_state(int64_t pos0, int64_t n, uint8_t* out) override {
    if constexpr (requires(Engine & e) { e.save_state(pos0, n, out); })
      return engine_->save_state(pos0, n, out);
    else
      return PrefillEngine::save_state(pos0, n, out);
  }
  Status load_state(int64_t pos0, int64_t n, const uint8_t* in) override {
    if constexpr (requires(Engine & e) { e.load_state(pos0, n, in); })
      return engine_->load_state(pos0, n, in);
    else
      return PrefillEngine::load_state(pos0, n, in);
  }
  std::shared_ptr<const Checkpoint> checkpoint() const override {
    if constexpr (requires(const Engine& e) { e.checkpoint(); })
      return engine_->checkpoint();
    else
      return nullptr;
  }
  int64_t checkpoint_bytes() const override {
    if constexpr (requires(const Engine& e) { e.checkpoint_bytes(); })
      return engine_->checkpoint_bytes();
    else
      return 0;
  }
  bool keeps_checkpoints() const override {
    return requires(const Engine& e) { e.checkpoint(); };
  }
  Status restore(const Checkpoint& c) override {
    if constexpr (requires(Engine & e) { e.restore(c); })
      return engine_->restore(c);
    else
      return PrefillEngine::restore(c);
  }
  Status finish() override {
    if constexpr (requires(Engine & e) { e.synchronize(); })
      return engine_->synchronize();
    else
      return Status::ok();
  }

 private:
  Engine* engine_;
};

// How one request's ids are cut into engine chunks, given the chunk size it asked for (or the
// service default). Default: equal chunks of that size.
using ChunkPlan = std::function<std::vector<int64_t>(const PrefillRequest& req, int64_t chunk)>;

// The cache program for one request (llama: one shared program; deepseek_v4: one per request,
// built for its decoder call schedule).
using ProgramFactory =
    std::function<Result<std::unique_ptr<SegmentProgram>>(const PrefillRequest& req)>;

// Fault injection for the failure tests of the front door (a wrapper around the real stream,
// applied as frames leave): "exit-after:N" (the process dies after N segments), "stall-after:N"
// (silence after N segments), "truncate-after:N" (the response ends after N segments, no
// manifest), "corrupt:N" (a payload byte of segment N flipped), "gap:N" (segment N never
// sent), "wrong-t" (the manifest claims another T), "refuse-memory" (every request refused at
// admission as an engine out of memory refuses it: HTTP 507). Empty: none.
struct FaultSpec {
  std::string kind;
  int64_t n = 0;
};
Result<FaultSpec> parse_fault(const std::string& text);

// The decoder's calls from row `at` on, of `calls` that begin at row `start` (at must be a call
// boundary, as a chunk boundary of a family that chunks by the decoder's calls is).
Result<std::vector<int64_t>> decoder_calls_after(const std::vector<int64_t>& calls, int64_t start,
                                                 int64_t at);

// The export must describe this model: same layer count, hidden size, kv heads and head dim.
// A mismatch would make the program read tap rows with the wrong width; it is refused here.
Status check_export_matches_model(const LlamaConfig& model, const LlamaDecoderWeights& exported);

// Device memory a GPU stack holds on one GPU (GET /health's "gpu_memory", `hetero doctor`): the
// engine's weights, the rest of the engine's allocations (its state and activations), the
// capture's slots; and what the driver says the device has free and in all.
struct GpuMemory {
  int device = 0;
  int64_t weights = 0, state_and_activations = 0, capture = 0;
  int64_t free = 0, total = 0;
};
using GpuMemoryReport = std::function<std::vector<GpuMemory>()>;

class PrefillService {
 public:
  PrefillService(PrefillEngine* engine, DecoderCacheLayout layout, ProgramFactory programs,
                 int64_t default_chunk_tokens, int64_t max_tokens);
  ~PrefillService();
  void set_fault(FaultSpec fault) { fault_ = std::move(fault); }
  void set_chunk_plan(ChunkPlan plan) { chunk_plan_ = std::move(plan); }
  // For GPU cache programs: the device capture their producer uses (must outlive the service).
  void set_capture(CaptureStore* capture) { capture_ = capture; }
  // What every manifest says of the rows' arithmetic (PrefillStack::arith).
  void set_arith(std::string arith) { arith_ = std::move(arith); }
  // A GPU stack's memory, reported by GET /health (safe to call while a prefill runs).
  void set_gpu_memory(GpuMemoryReport report) { gpu_memory_ = std::move(report); }
  // The stack's shared secret (common/auth.h): requests to /v1/prefill must be signed with it,
  // and frames are tagged with its frame key; "" leaves /v1/prefill open. Before start().
  void set_secret(std::string secret) { secret_ = std::move(secret); }
  // Connections served at once, per client, and how fast requests must come
  // (common/http_server.h). Before start().
  void set_connection_limits(ConnectionLimits limits) { limits_ = limits; }
  // Seal a request that does not fit at the longest prefix that does, instead of refusing it
  // (only for a family whose decoder can mount a prefix shorter than the request).
  void set_memory_floor(bool on) { memory_floor_ = on; }
  // Keep the engine's state of finished requests in a prefix cache of this many bytes (blocks
  // of block_tokens), from which a later request sharing their prefix resumes (state_cache.h).
  // 0 bytes, or an engine that hands out no state: every request computes from position 0.
  // An engine and program that keep whole checkpoints instead (DeepSeek-V4) keep them in a cache
  // of the same bytes, for exactly each finished request's ids; a tail resumes only from one
  // of exactly its start (PrefixCheckpoints), and without one it is refused (HTTP 409
  // "prefix_state_missing": the decode side asks for the whole prefix instead).
  void set_state_cache(int64_t block_tokens, int64_t max_bytes) {
    states_ = std::make_unique<PrefixStateCache>(block_tokens, max_bytes);
    checkpoints_ = std::make_unique<PrefixCheckpoints>(max_bytes);
  }
  const PrefixStateCache* state_cache() const { return states_.get(); }
  // Requests that may wait for the running one (>= 0); more are answered 503 with Retry-After.
  void set_queue(int64_t max_waiting) { max_waiting_ = max_waiting; }
  // A streamed prefill that has held the engine this long while another request waits gives
  // it up at its next chunk boundary: its state so far goes to the prefix cache (a family
  // whose tails need checkpoints: the engine's checkpoint, kept by the request), and it waits
  // at the back of the queue (sending keep-alive frames) to resume from there. Only for an
  // engine that hands out its state and a prefix cache that can hold it, or an engine that
  // keeps checkpoints; 0: never.
  void set_turn_ms(int64_t ms) { turn_ms_limit_ = ms; }
  // A stream quiet this long gets a keep-alive frame: at a layer the engine reaches (a chunk deep
  // in a long context can outlast the receiver's --stall-ms on a slow host; an engine that makes
  // no progress sends nothing, so a hung one still reads as stalled), and while it waits for its
  // turn. 0: none.
  void set_keepalive_ms(int64_t ms) { keepalive_ms_ = ms; }

  // Runs one prefill and emits frames to sink, manifest last: waits for its turn, resets the
  // engine and reserves the request's memory (a refusal is a manifest whose reason says why),
  // then runs the chunks.
  Manifest run(const PrefillRequest& req, const BridgeProducer::FrameSink& sink);

  // Serves HTTP until stop(). port 0 picks a free port; bound_port() says which.
  Status start(const std::string& host, int port);
  int bound_port() const { return port_; }
  void stop();

 private:
  PrefillEngine* engine_;
  DecoderCacheLayout layout_;
  ProgramFactory programs_;
  ChunkPlan chunk_plan_;
  CaptureStore* capture_ = nullptr;
  // Segment frames are written here and given back once sent, so a stream's frames reuse
  // memory that is already faulted in (idle: up to 3 frames, ~0.8 GB at 8K-token 1B segments).
  std::shared_ptr<FrameBufferPool> buffers_ = std::make_shared<FrameBufferPool>(3);
  std::string arith_ = "exact";
  GpuMemoryReport gpu_memory_;
  std::string secret_;
  int64_t default_chunk_, max_tokens_;
  ConnectionLimits limits_;
  FaultSpec fault_;
  bool memory_floor_ = false;
  std::shared_ptr<std::atomic<bool>> stopping_ = std::make_shared<std::atomic<bool>>(false);

  // One prefill at a time: a request holds the turn from its admission (on the HTTP handler's
  // thread) to the end of its prefill (on its worker thread), so a turn is a flag, not a lock.
  // Waiting requests are served in the order they came.
  struct Turn {
    Status status;              // ok: the turn is the caller's; else why not
    double waited_ms = 0;       // how long it waited for it
    int64_t retry_after_s = 0;  // > 0: the queue was full; when to come back, estimated
  };
  // gone (null: never) is asked every 100 ms while the request waits: true takes it out.
  Turn take_turn(const std::function<bool()>& gone = {});
  void give_turn();
  // What admission decided for a request: the engine's forward starts at `from` (its state
  // before that restored from the prefix cache) and runs `plan`'s chunks (a tail's start is a
  // chunk boundary); `sealed` says why a plan ends before the request does (the memory floor).
  struct Admission {
    int64_t from = 0;
    std::vector<int64_t> plan;
    std::string sealed;
    std::shared_ptr<const PrefixCheckpoints::Entry> resume;  // a tail's start, checkpointed
    std::shared_ptr<const Checkpoint> engine_state;          // what the engine restores
    bool missing_state = false;  // a tail refused for want of a checkpoint of its start
    // The rows depend on the decoder's calls (PrefillEngine::rows_follow_calls): computed from
    // 0, no state kept or yielded.
    bool follows_calls = false;
  };
  // A family whose tail cannot be computed again from position 0 without the decoder's calls
  // for its prefix (DeepSeek-V4): a tail resumes from a checkpoint of exactly its start or not
  // at all. llama's tails resume from the row cache, or are computed from 0.
  bool tails_need_checkpoints() const { return layout_.family != "llama"; }
  // The manifest of a request that streams no segment (its reason still to be said): nothing
  // past its start covered.
  Manifest refusal(const PrefillRequest& req) const;
  // The chunks of ids[from, len) (a boundary at the request's start).
  std::vector<int64_t> plan_for(const PrefillRequest& req, int64_t from) const;
  // With the turn: the engine reset, the request's memory reserved and the cached state loaded,
  // or why not. With the memory floor, the plan may come back shorter than the request.
  // paused: the engine's own checkpoint at req.start, taken when this request gave up its turn
  // (families whose tails need checkpoints); else the prefix cache's.
  Status admit(const PrefillRequest& req, Admission* a,
               std::shared_ptr<const Checkpoint> paused = nullptr);
  // Reserves `from` tokens of state and the whole of `plan` (reset first).
  Status reserve_plan(int64_t from, const std::vector<int64_t>& plan);
  // After `refused` (out of memory) for a's whole plan: a's plan cut to the longest prefix of
  // whole chunks that fits and sealed there (ok), or `refused`.
  Status seal_at_memory_floor(const PrefillRequest& req, Admission* a, const Status& refused);
  // An admitted request's run in its steps (service_request.cc): its program opened, its chunks
  // turn by turn, its manifest, the state it keeps for later requests.
  class AdmittedRun;
  // With the turn, after admit(): the chunks, frames to sink, manifest last; the turn given
  // back at the end. receiver_gone (null: never) is asked before each chunk, as a receiver that
  // stopped reading. may_yield: the request may give the engine up between chunks (set_turn_ms;
  // sink must then take frames from any thread).
  // stream_ended: called once the manifest, the stream's last frame, has gone to the sink, before
  // the state is kept for later requests (so the receiver need not wait for that copy).
  // tags: the stream's tagger where it is tagged (frames go to sink framed for
  // FrameTagger::seal), else null.
  Manifest run_admitted(const PrefillRequest& req, const Admission& a,
                        const BridgeProducer::FrameSink& sink,
                        const std::function<bool()>& receiver_gone = {}, bool may_yield = false,
                        const std::function<void()>& stream_ended = {},
                        const FrameTagger* tags = nullptr);
  // With the turn: whether the running request's turn is up (set_turn_ms) for a state of
  // `tokens` tokens.
  bool should_yield(int64_t tokens);
  std::unique_ptr<PrefixStateCache> states_;
  std::unique_ptr<PrefixCheckpoints> checkpoints_;
  std::mutex turn_mu_;
  std::condition_variable turn_free_;
  bool busy_ = false;
  std::deque<uint64_t> waiting_;  // tickets of the requests waiting, oldest first
  uint64_t next_ticket_ = 0;
  int64_t max_waiting_ = 16;
  std::chrono::steady_clock::time_point turn_began_;
  double turn_ms_ = 0;  // how long a turn lasts, a moving average (for Retry-After)
  int64_t turn_ms_limit_ = 0;
  int64_t keepalive_ms_ = 5000;
  // POST /v1/prefill: the request checked, its turn and memory taken, its stream answered.
  void serve_prefill(const HttpRequest& req, HttpResponse& res);
  std::unique_ptr<HttpServer> server_;
  int port_ = 0;
};

}  // namespace hetero
