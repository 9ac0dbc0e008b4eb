// The bridge producer: the tap's consumer on the prefill host. It copies each attention input
// into a bounded queue (so the forward does not wait on it unless the program falls a few
// layers behind), runs the family's cache program on its own thread, and hands a segment to a
// second thread, which encodes and sends it, as soon as every layer has passed a chunk boundary
// (so the program's next layers overlap the encoding); then a manifest.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "bridge/decoder_weights.h"
#include "bridge/llama_program.h"
#include "bridge/wire.h"
#include "common/checkpoint.h"
#include "common/queue.h"
#include "engine/tap.h"

namespace hetero {

// What the producer needs from a family's cache program, for one request.
class SegmentProgram {
 public:
  virtual ~SegmentProgram() = default;
  virtual const DecoderCacheLayout& layout() const = 0;
  // One layer's attention input rows [pos0, pos0+n): the arrays this layer adds to the
  // segment of that range (each layer's rows arrive in order).
  virtual Status run(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x,
                     std::vector<WireArray>* arrays) = 0;
  // Arrays added once every layer has passed [pos0, pos0+n), after the layers' own (e.g. a
  // family's final state on the last segment). Default: none.
  virtual Status close_segment(int64_t pos0, int64_t n, std::vector<WireArray>* arrays) {
    (void)pos0, (void)n, (void)arrays;
    return Status::ok();
  }
  // A program whose state at a sequence's end is not rows (DeepSeek-V4) keeps it for a later
  // tail: checkpoint() once every row arrived, and resume() on a new program for the tail
  // before its first row. Default: a program that needs no state of the prefix (llama), or
  // cannot give it (kFailedPrecondition).
  virtual Result<std::shared_ptr<const Checkpoint>> checkpoint() const {
    return failed_precondition("this cache program keeps no checkpoints");
  }
  virtual Status resume(const Checkpoint& c) {
    (void)c;
    return failed_precondition("this cache program does not resume from checkpoints");
  }
  // A GPU program reads x in device memory and runs on its own stream (a cudaStream_t), which
  // it returns here; run() then gets a device pointer that is ready in that stream's order, and
  // must have enqueued every read of it on that stream when it returns (the rows' slot is reused
  // once those reads are done). Null (the default): x is in host memory.
  virtual void* device_stream() const { return nullptr; }
  // The stream that reads a layer's rows, where a program's layers run on several (a layer
  // pipeline's stages, each on its GPU). Default: device_stream().
  virtual void* layer_stream(int64_t layer) const {
    (void)layer;
    return device_stream();
  }
  // Called on the encoding thread before a segment's arrays are read: a program whose arrays
  // are still being filled asynchronously (a GPU program's device-to-host copies) waits for them
  // here, and reports a device error. Default: the arrays are ready when run() returns.
  virtual Status segment_ready(int64_t pos0, int64_t n) {
    (void)pos0, (void)n;
    return Status::ok();
  }
  // Every array that [pos0, pos0+n)'s segment will carry, in order, when the program knows them
  // before it runs and close_segment adds none. The producer then frames the segment layer by
  // layer as each layer's arrays are ready, so only the last layer's share of the framing is
  // left once the forward ends. Default: not known (the segment is framed whole at the end).
  virtual std::optional<std::vector<ArraySpec>> planned_arrays(int64_t pos0, int64_t n) const {
    (void)pos0, (void)n;
    return std::nullopt;
  }
  // Called on the encoding thread before a layer's arrays are read, when framing layer by layer
  // (segment_ready follows once all are in). Default: ready when run() returns.
  virtual Status layer_ready(int64_t layer, int64_t pos0, int64_t n) {
    (void)layer, (void)pos0, (void)n;
    return Status::ok();
  }
};

// Where the producer keeps the tap's rows on the device until a GPU program has read them: a
// few slots, each filled by work enqueued on the engine's stream, so that the tap never waits
// for the program — unless every slot is still unread, which bounds the memory the capture
// holds whatever the prompt's length.
class CaptureStore {
 public:
  virtual ~CaptureStore() = default;
  // Copies e's device rows into a free slot (waiting for one if none is), ordered after the
  // engine's work on e.stream; returns the slot.
  virtual Result<int> capture(const TapEvent& e) = 0;
  // The slot's rows, once `stream` has been made to wait for their copy (a device error if it
  // cannot be).
  virtual Result<const uint16_t*> ready(int slot, void* stream) = 0;
  // The program has enqueued every read of the slot on `stream` (null: it has finished them):
  // the slot can take new rows once those reads are done.
  virtual void release(int slot, void* stream) = 0;
};

// A layer's K/V rows as the llama segment arrays `layers.{i}.keys` / `.values`.
void append_kv_arrays(int64_t layer, KvRows rows, std::vector<WireArray>* arrays);

// The llama program as a segment program: per layer `layers.{i}.keys` / `.values`.
// The llama segment's arrays: per layer `layers.{i}.keys` and `.values`, bf16 [kv_heads, n,
// head_dim].
std::vector<ArraySpec> llama_segment_specs(const DecoderCacheLayout& layout, int64_t n);

class LlamaSegmentProgram : public SegmentProgram {
 public:
  // rope: this request's rope by the decoder's calls (RopeByCall), when it needs one.
  explicit LlamaSegmentProgram(const LlamaCacheProgram* program,
                               std::optional<RopeByCall> rope = std::nullopt)
      : program_(program), rope_(std::move(rope)) {}
  const DecoderCacheLayout& layout() const override { return program_->layout(); }
  std::optional<std::vector<ArraySpec>> planned_arrays(int64_t pos0, int64_t n) const override {
    (void)pos0;
    return llama_segment_specs(layout(), n);
  }
  Status run(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x,
             std::vector<WireArray>* arrays) override;

 private:
  const LlamaCacheProgram* program_;
  std::optional<RopeByCall> rope_;
};

class BridgeProducer {
 public:
  // sink receives each encoded frame in order; returning false cancels the capture.
  using FrameSink = std::function<bool(std::string frame)>;
  // capture: for a GPU program (device_stream() non-null), where the tap's device rows wait
  // (must outlive the producer); null for a host program, which gets copies in host memory.
  // buffers: where segment frames are written (the sink's owner gives them back once sent, so
  // the next frames reuse their memory); null: fresh memory for every frame. tags: the stream's
  // tagger where the stream is tagged (frames leave framed for FrameTagger::seal; must outlive
  // the producer), else null.
  BridgeProducer(SegmentProgram* program, FrameSink sink, size_t max_queued_inputs = 4,
                 CaptureStore* capture = nullptr, FrameBufferPool* buffers = nullptr,
                 const FrameTagger* tags = nullptr);
  ~BridgeProducer();

  // A tail (PrefillRequest::start), before the first tap event: only rows from `start` are
  // programmed and sent (the engine's rows before it are its own business); the forward began
  // at computed_from <= start. The manifest says both.
  void set_tail(int64_t start, int64_t computed_from);
  AttentionInputTap tap();
  // Ends the stream: drains the queue, then sends the manifest. engine_status says whether
  // the forward finished; the manifest is complete only when it did and every row was sent.
  // sealed: why a forward that ran as planned covers less than the request (the memory floor),
  // the manifest's reason then.
  Manifest finish(int64_t requested_tokens, const Status& engine_status,
                  const std::string& sealed = {});
  // What the manifest says of the rows' arithmetic ("exact" or "fast"; Manifest::arith).
  void set_arith(std::string arith) { arith_ = std::move(arith); }
  bool cancelled() const { return cancelled_.load(); }

 private:
  struct Work {
    int32_t layer;
    int64_t pos0, n;
    std::vector<uint16_t> x;  // host rows, or
    int slot = -1;            // the capture slot holding them on the device
  };
  struct Pending {
    int64_t n = 0;
    int64_t layers_done = 0;
    bool by_layer = false;                       // framed layer by layer (planned arrays)
    std::vector<std::vector<WireArray>> arrays;  // per layer (framed whole)
  };
  // Worker -> encoder: a whole segment, or (planned programs) a segment opened, one layer's
  // arrays, and the segment closed.
  struct EncodeItem {
    enum class Kind { kWhole, kOpen, kLayer, kClose } kind = Kind::kWhole;
    Segment segment;  // kWhole: all of it; kOpen: its fields; kLayer: the layer's arrays
    int64_t layer = -1;
    std::vector<ArraySpec> specs;  // kOpen
  };
  void run();
  // One layer's rows of one chunk through the program; a finished segment to the encoder.
  void program_one(Work& w, const DecoderCacheLayout& layout, void* stream);
  void encode();

  void fail_capture(Status st);
  void fail_program(Status st);

  SegmentProgram* program_;
  CaptureStore* capture_;
  FrameBufferPool* buffers_;
  const FrameTagger* tags_;
  FrameSink sink_;
  BoundedQueue<Work> queue_;
  BoundedQueue<EncodeItem> segments_;  // worker -> encoder
  std::thread worker_, encoder_;
  std::map<int64_t, Pending> pending_;  // by pos0; touched by the worker only
  int64_t next_seq_ = 0;                // the worker's
  int64_t covered_ = 0;                 // the encoder's
  int64_t start_ = 0, computed_from_ = 0;
  std::mutex status_mu_;
  Status program_status_;  // the first program error, if any
  Status capture_status_;  // the first capture error, if any (set by the tap's thread)
  std::atomic<bool> cancelled_{false};
  bool finished_ = false;
  std::string arith_;
};

}  // namespace hetero
