// The cache programs on the GPU, as the bridge producer drives them: a capture store that keeps
// the tap's rows in a few device slots, and the two families' programs as segment programs on a
// side stream. The engine's stream never waits on them; the program's stream waits on each
// slot's copy (an event), and the producer emits a segment once every layer has passed it.
#pragma once

#include <cuda_runtime.h>

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "bridge/cuda/dsv4_program_gpu.h"
#include "bridge/decoder_weights.h"
#include "bridge/dsv4_stream.h"
#include "bridge/llama_program.h"
#include "bridge/producer.h"
#include "engine/cuda/device_rope_by_call.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/device_rope.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/resource.h"

namespace hetero::cuda {

// A ring of device slots. A slot grows to the largest rows it has held (chunk x hidden bf16),
// so the memory held is slots x the largest chunk's rows: bounded by the chunk size, flat in the
// prompt's length. A slot is taken by the tap and given back once the program has enqueued its
// reads; the next copy into it waits for those reads on the device (an event), not on the host,
// so the engine's host thread blocks only while every slot is still waiting for its program.
//
// The program may run on another GPU than the engine (program_device): the slots then live on
// the program's GPU and the tap's copy crosses to it peer to peer (over NVLink where the GPUs
// have it), still enqueued on the engine's stream, so the program's work takes none of the
// engine's SMs. Construct the store with the engine's device current.
// Where the capture's copies run, for an engine that offers TapEvent::x_read (else always on
// the engine's stream). kAuto: on the capture's own stream where the program has a GPU of its own
// (a peer copy, by the copy engines: the forward no longer waits behind it), on the engine's
// stream where they share one (there a copy beside the forward waits for SMs behind the
// program's kernels, and the forward then waits for it: RESULTS §49). kOwn and kEngine force one
// (tests and benches).
enum class CaptureCopies { kAuto, kOwn, kEngine };

class GpuCaptureStore : public CaptureStore {
 public:
  // A store of `slots` slots (their events created, no rows yet); fails where the events cannot
  // be made.
  static Result<std::unique_ptr<GpuCaptureStore>> create(
      int slots = 4, int program_device = -1, CaptureCopies copies = CaptureCopies::kAuto);
  ~GpuCaptureStore() override;
  GpuCaptureStore(const GpuCaptureStore&) = delete;
  GpuCaptureStore& operator=(const GpuCaptureStore&) = delete;

  // Out of device memory for a slot's rows is kResourceExhausted; any failure gives the slot
  // back.
  Result<int> capture(const TapEvent& e) override;
  Result<const uint16_t*> ready(int slot, void* stream) override;
  void release(int slot, void* stream) override;
  // Device bytes held by the slots now (the most the capture has held).
  size_t device_bytes() const;

 private:
  struct Slot {
    DeviceBuffer rows;
    Event tapped;  // x ready, on the engine's stream (for a copy on copy_)
    Event copied;  // the tap's copy into rows, on the engine's stream or copy_
    Event read;    // the program's last reads of rows, on its stream
    bool busy = false, read_pending = false;
  };
  GpuCaptureStore(int slots, int program_device, CaptureCopies copies);
  Status fill(Slot& s, const TapEvent& e, size_t bytes);
  std::vector<Slot> slots_;
  Stream copy_;  // on the engine's GPU: the copies of an engine that offers TapEvent::x_read
  int engine_device_ = 0, program_device_ = 0;
  bool own_stream_ = false;  // the copies of an engine that offers x_read on copy_
  mutable std::mutex mu_;
  std::condition_variable freed_;
};

// The llama decoder's K/V rows on the GPU, in the decoder's arithmetic (the exact ops of
// kernels/cuda/ops.h; an mlx-lm-quantized decoder's k/v through MLX's quantized-matmul recipe,
// bridge/cuda/decoder_linear_gpu.h): bit-identical to LlamaCacheProgram given the same x.
struct LlamaGpuWeights {
  DecoderCacheLayout layout;
  float eps = 1e-5f;
  DeviceRope rope;
  struct Layer {
    GpuDecoderLinear wk, wv;      // dense or quantized, as the decoder holds them
    DeviceBuffer bk, bv, k_norm;  // bf16, empty when absent
  };
  std::vector<Layer> layers;
  size_t device_bytes = 0;
};
Result<std::unique_ptr<LlamaGpuWeights>> upload_llama_weights(const LlamaDecoderWeights& w);

class LlamaGpuCacheProgram {
 public:
  // weights and stream (and rope, when given: each of the decoder's calls' own rope, else the
  // weights' one) must outlive the program.
  LlamaGpuCacheProgram(const LlamaGpuWeights* weights, cudaStream_t stream,
                       const DeviceRopeByCall* rope = nullptr);
  ~LlamaGpuCacheProgram();
  LlamaGpuCacheProgram(const LlamaGpuCacheProgram&) = delete;
  LlamaGpuCacheProgram& operator=(const LlamaGpuCacheProgram&) = delete;
  const DecoderCacheLayout& layout() const { return w_->layout; }
  // Enqueues one layer's rows on the stream: x (device bf16 [n, hidden], ready in the stream's
  // order, read by the first kernel) -> K and V in the decoder's layout ([kv_heads, n, head_dim]
  // bf16 each), copied to keys_host and values_host (page-locked, n*kv_heads*head_dim each),
  // which hold them once the stream gets there. Returns at once. Calls serialize.
  Status enqueue(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x, uint16_t* keys_host,
                 uint16_t* values_host);
  // enqueue, then wait: the rows as tensors (tests, and the synchronous callers).
  Result<KvRows> run_device(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x);
  size_t device_bytes() const;

 private:
  const LlamaGpuWeights* w_;
  cudaStream_t stream_;
  const DeviceRopeByCall* rope_;
  DeviceBuffer xf_, acc_, k_, v_, kt_, vt_, flags_;
  int64_t rows_ = 0;
  PinnedBuffer pinned_;  // run_device's page-locked staging (k then v)
  int64_t pinned_rows_ = 0;
  std::mutex mu_;
};

// Page-locked host blocks, reused: a GPU program's rows land in one straight from the device and
// leave in the segment's frame from there (WireArray views), so the host copies them once. A
// block goes back to the pool when the last array viewing it is gone; the pool outlives its
// program while any is out.
class PinnedPool {
 public:
  struct Block {
    PinnedBuffer memory;
    Event landed;                     // recorded after each copy into the block
    std::vector<Event> layer_landed;  // per layer: after that layer's copies
    uint8_t* data() const { return memory.get<uint8_t>(); }
  };
  ~PinnedPool();
  // A block of at least `bytes` (grows, or allocates, page-locked memory; out of it is
  // kResourceExhausted).
  Result<std::shared_ptr<Block>> take(size_t bytes);
  size_t host_bytes() const;  // page-locked bytes held, free or out

 private:
  void give_back(Block* b);
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Block>> free_;
  size_t held_ = 0;
  std::weak_ptr<PinnedPool> self_;
  friend std::shared_ptr<PinnedPool> make_pinned_pool();
};
std::shared_ptr<PinnedPool> make_pinned_pool();

// The llama program behind the producer: each segment's K/V rows are computed on the side
// stream and copied into one page-locked block; run() returns once they are enqueued, and
// segment_ready() waits for the block's last copy.
class LlamaGpuSegmentProgram : public SegmentProgram {
 public:
  // pool: page-locked blocks shared with other requests' programs (null: its own). The program
  // runs on the device current at creation (weights must be there), whichever thread calls it;
  // a pool serves programs of one device (its events are that device's).
  // rope: the request's rows roped by the decoder's calls (a dynamic rope past its reach; null
  // or not per_call(): the weights' one rope).
  static Result<std::unique_ptr<LlamaGpuSegmentProgram>> create(
      const LlamaGpuWeights* weights, std::shared_ptr<PinnedPool> pool = nullptr,
      const RopeByCall* rope = nullptr);
  const DecoderCacheLayout& layout() const override { return program_.layout(); }
  Status run(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x,
             std::vector<WireArray>* arrays) override;
  Status segment_ready(int64_t pos0, int64_t n) override;
  std::optional<std::vector<ArraySpec>> planned_arrays(int64_t pos0, int64_t n) const override {
    (void)pos0;
    return llama_segment_specs(layout(), n);
  }
  Status layer_ready(int64_t layer, int64_t pos0, int64_t n) override;
  void* device_stream() const override { return stream_.get(); }
  // Page-locked host memory held for segments on their way out.
  size_t host_staging_bytes() const { return pool_->host_bytes(); }

 private:
  LlamaGpuSegmentProgram(const LlamaGpuWeights* weights, Stream stream,
                         std::shared_ptr<PinnedPool> pool, std::unique_ptr<DeviceRopeByCall> rope)
      : stream_(std::move(stream)),
        rope_(std::move(rope)),
        program_(weights, stream_.get(), rope_.get()),
        pool_(pool ? std::move(pool) : make_pinned_pool()) {}
  int device_ = current_device();
  Stream stream_;  // non-blocking: it orders against the engine's only through events
  std::unique_ptr<DeviceRopeByCall> rope_;  // null: the weights' rope
  LlamaGpuCacheProgram program_;
  std::shared_ptr<PinnedPool> pool_;
  std::shared_ptr<PinnedPool::Block> block_of(int64_t pos0);
  std::mutex mu_;
  std::map<int64_t, std::shared_ptr<PinnedPool::Block>> filling_;  // by pos0
};

// The deepseek_v4 program behind the producer, in parts: a part holds some layers' decoder
// weights (Dsv4GpuWeights::first_layer/end_layer) on one GPU, with its own stream and its own
// program state, and a layer's rows go to its part (a pipeline stage's layers to the program
// on that stage's GPU). One part holding every layer is the one-GPU program. The arrays are
// the same, bit for bit, however the layers are parted. Every segment carries the state at its
// end, as the CPU program's do (Dsv4GpuCacheProgram::boundary_layer), so a stream that breaks or
// is sealed mounts its longest verified prefix.
class Dsv4GpuSegmentProgram : public SegmentProgram {
 public:
  struct Part {
    const Dsv4GpuWeights* weights;  // on `device`; its layer range is the part's
    int device = 0;
  };
  // host: the export (for names and widths); parts: cover every layer once, in order. A tail
  // (start > 0): decoder_calls cover [start, T), and resume() comes before the first row.
  static Result<std::unique_ptr<Dsv4GpuSegmentProgram>> create(
      const Dsv4DecoderWeights* host, const std::vector<Part>& parts,
      const std::vector<int64_t>& decoder_calls, int64_t start = 0);
  // One part on the device current now, holding every layer.
  static Result<std::unique_ptr<Dsv4GpuSegmentProgram>> create(
      const Dsv4DecoderWeights* host, const Dsv4GpuWeights* weights,
      const std::vector<int64_t>& decoder_calls);
  ~Dsv4GpuSegmentProgram() override;
  const DecoderCacheLayout& layout() const override { return host_->layout; }
  Status run(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x,
             std::vector<WireArray>* arrays) override;
  Status close_segment(int64_t pos0, int64_t n, std::vector<WireArray>* arrays) override;
  void* device_stream() const override;  // the first part's
  void* layer_stream(int64_t layer) const override;
  // A Dsv4ProgramCheckpoint of every part's layers (the CPU program's kind: either resumes from
  // the other's), and resume() from one.
  Result<std::shared_ptr<const Checkpoint>> checkpoint() const override;
  Status resume(const Checkpoint& c) override;

 private:
  struct Running;  // a part's stream and program
  explicit Dsv4GpuSegmentProgram(const Dsv4DecoderWeights* host);
  Running& part_of(int64_t layer) const;
  const Dsv4DecoderWeights* host_;
  std::vector<std::unique_ptr<Running>> parts_;
  Dsv4BoundaryStates boundaries_;
};

}  // namespace hetero::cuda
