// The cache programs on the GPU, as the bridge producer drives them: a capture store that keeps
// the tap's rows in a few device slots, and the two families' programs as segment programs on a
// side stream. The engine's stream never waits on them; the program's stream waits on each
// slot's copy (an event), and the producer emits a segment once every layer has passed it.
#pragma once

#include <cuda_runtime.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

#include "bridge/cuda/dsv4_program_gpu.h"
#include "bridge/decoder_weights.h"
#include "bridge/llama_program.h"
#include "bridge/producer.h"

namespace hetero::cuda {

// A ring of device slots. A slot grows to the largest rows it has held (chunk x hidden bf16),
// so the memory held is slots x the largest chunk's rows: bounded by the chunk size, flat in the
// prompt's length.
class GpuCaptureStore : public CaptureStore {
 public:
  explicit GpuCaptureStore(int slots = 4);
  ~GpuCaptureStore() override;
  GpuCaptureStore(const GpuCaptureStore&) = delete;
  GpuCaptureStore& operator=(const GpuCaptureStore&) = delete;

  Result<int> capture(const TapEvent& e) override;
  const uint16_t* ready(int slot, void* stream) override;
  void release(int slot) override;
  // Device bytes held by the slots now (the most the capture has held).
  size_t device_bytes() const;

 private:
  struct Slot {
    DeviceBuffer rows;
    cudaEvent_t copied = nullptr;
    bool busy = false;
  };
  std::vector<Slot> slots_;
  mutable std::mutex mu_;
  std::condition_variable freed_;
};

// The llama decoder's K/V rows on the GPU, in the decoder's arithmetic (the exact ops of
// kernels/cuda/ops.h): bit-identical to LlamaCacheProgram given the same x.
struct LlamaGpuWeights {
  DecoderCacheLayout layout;
  float eps = 1e-5f, rope_base = 10000.f;
  struct Layer {
    DeviceBuffer wk_t, wv_t;      // f32 [hidden, kv_heads*head_dim]
    DeviceBuffer bk, bv, k_norm;  // bf16, empty when absent
  };
  std::vector<Layer> layers;
  size_t device_bytes = 0;
};
Result<std::unique_ptr<LlamaGpuWeights>> upload_llama_weights(const LlamaDecoderWeights& w);

class LlamaGpuCacheProgram {
 public:
  // weights and stream must outlive the program.
  LlamaGpuCacheProgram(const LlamaGpuWeights* weights, cudaStream_t stream);
  ~LlamaGpuCacheProgram();
  LlamaGpuCacheProgram(const LlamaGpuCacheProgram&) = delete;
  LlamaGpuCacheProgram& operator=(const LlamaGpuCacheProgram&) = delete;
  const DecoderCacheLayout& layout() const { return w_->layout; }
  // x: device bf16 [n, hidden], ready in the stream's order. Returns when the rows are on the
  // host (x may be reused then). Calls serialize.
  Result<KvRows> run_device(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x);
  size_t device_bytes() const;

 private:
  const LlamaGpuWeights* w_;
  cudaStream_t stream_;
  DeviceBuffer xf_, acc_, k_, v_, kt_, vt_;
  int64_t rows_ = 0;
  uint16_t* pinned_ = nullptr;  // k then v, head-major, on their way to the host (page-locked)
  std::mutex mu_;
};

// A side stream owned by a program wrapper (non-blocking, so it never orders against the
// engine's stream except through events).
class SideStream {
 public:
  SideStream();
  ~SideStream();
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

class LlamaGpuSegmentProgram : public SegmentProgram {
 public:
  explicit LlamaGpuSegmentProgram(const LlamaGpuWeights* weights)
      : program_(weights, stream_.get()) {}
  const DecoderCacheLayout& layout() const override { return program_.layout(); }
  Status run(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x,
             std::vector<WireArray>* arrays) override;
  void* device_stream() const override { return stream_.get(); }

 private:
  SideStream stream_;
  LlamaGpuCacheProgram program_;
};

class Dsv4GpuSegmentProgram : public SegmentProgram {
 public:
  // host: the export (for names and widths); weights: its device copy.
  Dsv4GpuSegmentProgram(const Dsv4DecoderWeights* host, const Dsv4GpuWeights* weights,
                        const std::vector<int64_t>& decoder_calls)
      : host_(host), program_(weights, decoder_calls, stream_.get()) {}
  const DecoderCacheLayout& layout() const override { return host_->layout; }
  Status run(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x,
             std::vector<WireArray>* arrays) override;
  Status close_segment(int64_t pos0, int64_t n, std::vector<WireArray>* arrays) override;
  void* device_stream() const override { return stream_.get(); }

 private:
  const Dsv4DecoderWeights* host_;
  SideStream stream_;
  Dsv4GpuCacheProgram program_;
};

}  // namespace hetero::cuda
