// The DeepSeek-V4 cache program on the GPU. Same contract as Dsv4CacheProgram
// (bridge/dsv4_program.h): built from the decoder's weights and call schedule, fed each layer's
// attention input in order, it returns the same arrays bit for bit (the same Dsv4NewRows per
// feed, the same Dsv4LayerArrays per layer). The arithmetic is the kernels/cuda twins of the
// CPU ops (ordered f32 GEMM for dense weights, MLX's quantized recipes for mx/affine), enqueued
// on a stream the caller gives — a side stream next to the prefill's.
//
// Memory: Dsv4GpuWeights is uploaded once and shared read-only by every request's program. A
// program keeps its request's state on the device: per layer the window rows and, per
// compressor, the carry (the last complete window, which the next one's overlap lane reads, and
// the incomplete one). Rows cross back to the host only when final: the pooled rows each feed
// completes, then the window and the buffers at finish_layer. The schedule (window slot order,
// overlap flags) is the CPU program's own replay (dsv4_window_layout, dsv4_overlap_flags).
// Spec: docs/design/cache-program-dsv4.md, "On the GPU".
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "bridge/cuda/decoder_linear_gpu.h"
#include "bridge/dsv4_program.h"
#include "common/status.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/resource.h"

namespace hetero::cuda {

struct Dsv4GpuCompressor {
  int64_t ratio = 0, head_dim = 0, out_dim = 0;
  GpuDecoderLinear wkv, wgate;
  DeviceBuffer ape;   // f32 [ratio, out_dim]
  DeviceBuffer norm;  // bf16 [head_dim]
};

struct Dsv4GpuLayer {
  int64_t ratio = 0;
  GpuDecoderLinear wkv;
  DeviceBuffer kv_norm;  // bf16 [head_dim]
  Dsv4GpuCompressor pool, index;
  bool has_index = false;
};

// Every weight the program reads, on the device. Read-only once uploaded: any number of
// programs, on any streams and threads, may share it. Must outlive them.
struct Dsv4GpuWeights {
  DecoderCacheLayout layout;
  float eps = 1e-6f;  // as the CPU program passes it: float(rms_norm_eps)
  int64_t window = 0;
  int64_t rope_pairs_local = 0, rope_pairs_compressed = 0;
  DeviceBuffer freqs_local, freqs_compressed;  // f32, dsv4_rope_freqs as exported
  std::vector<Dsv4GpuLayer> layers;  // every layer's slot; only [first_layer, end_layer) filled
  int64_t first_layer = 0, end_layer = 0;
  size_t device_bytes = 0;
};

// Copies w's layers [first_layer, end_layer) (end_layer -1: through the last) to the current
// device (synchronously, plain cudaMalloc): a pipeline stage's program holds its own layers
// only. Out of device memory is kResourceExhausted; the host weights may be freed afterwards.
Result<std::unique_ptr<Dsv4GpuWeights>> upload_dsv4_weights(const Dsv4DecoderWeights& w,
                                                            int64_t first_layer = 0,
                                                            int64_t end_layer = -1);

class Dsv4GpuCacheProgram {
 public:
  // Rows per internal step: bounds the shared scratch (x in f32, GEMM accumulators) whatever
  // the caller's chunk; any value gives the same bits.
  static constexpr int64_t kDefaultBlockRows = 4096;

  // decoder_calls: the decoder's call lengths (sum = T), before expansion, as the CPU program.
  // weights and stream must outlive the program. Takes no device memory yet: each layer's
  // state is allocated at its first feed (so an out-of-memory is a Status from feed).
  // A tail (start > 0): the calls cover [start, T), and the program resumes (below) from a
  // checkpoint of exactly the first start tokens before any row arrives, as the CPU program.
  Dsv4GpuCacheProgram(const Dsv4GpuWeights* weights, const std::vector<int64_t>& decoder_calls,
                      cudaStream_t stream, int64_t block_rows = kDefaultBlockRows,
                      int64_t start = 0);
  ~Dsv4GpuCacheProgram();
  Dsv4GpuCacheProgram(const Dsv4GpuCacheProgram&) = delete;
  Dsv4GpuCacheProgram& operator=(const Dsv4GpuCacheProgram&) = delete;

  const DecoderCacheLayout& layout() const { return w_->layout; }
  int64_t tokens() const { return sched_.tokens; }
  int64_t window_idx() const { return sched_.window.idx; }

  // Layer `layer`'s attention input rows [pos0, pos0+n), bf16 [n, hidden], in host memory
  // (feed) or device memory (feed_device; it must be ready in `stream`'s order — make the
  // stream wait on the producer's event). Each layer's rows must arrive in order. Returns once
  // the stream has done this feed's work, so x may be reused at once and `out` is complete.
  // Thread-safe; calls serialize (they share the stream and the scratch).
  Status feed(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x, Dsv4NewRows* out);
  Status feed_device(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x, Dsv4NewRows* out);
  // After all T rows of the layer arrived: its window and buffers (and every pooled row). The
  // layer's device state is released; a second call for the same layer is refused.
  Result<Dsv4LayerArrays> finish_layer(int64_t layer);

  // From now on (before the first feed) each feed that ends at b < T also keeps the layer's
  // last min(b, window) window rows (a projection of at most `window` rows a feed, on the
  // device), so that boundary_layer() can give the state at b: the CPU program's contract,
  // bit for bit, for a stream that breaks or is sealed there.
  Status keep_boundary_state();
  // The layer's state at the end b < T of the rows fed so far (Dsv4CacheProgram::boundary_layer):
  // the window's last rows in temporal order and the compressors' pending rows, no pooled rows.
  Result<Dsv4LayerArrays> boundary_layer(int64_t layer) const;

  // Once every layer it holds is finished: their part of the checkpoint a later tail resumes
  // from (Dsv4CacheProgram::checkpoint's, bit for bit; the caller sets c->weights and sizes
  // c->layers to every layer). finish_layer keeps what it needs on the host.
  Status checkpoint_into(Dsv4ProgramCheckpoint* c) const;
  // A tail program's state at start for the layers it holds, from a checkpoint of exactly those
  // tokens (made by a CPU or GPU program): before the first feed.
  Status resume(const Dsv4ProgramCheckpoint& c);

  // Device bytes held now (state and scratch).
  size_t device_bytes() const;

 private:
  struct PoolState {
    DeviceBuffer carry_kv, carry_gate;  // rows [carry_base, fed), out_dim wide, < 2*ratio rows
    int64_t carry_base = 0;
    std::vector<uint16_t> pooled;  // pooled rows [pooled_first, pooled_rows), host
    int64_t pooled_first = 0;      // a tail's first window (start / ratio)
    int64_t pooled_rows = 0;
  };
  struct LayerState {
    int64_t fed = 0;
    bool allocated = false, finished = false;
    DeviceBuffer window_rows;  // bf16 [T - window_first, head_dim]
    PoolState pool, index;
    // With keep_boundary_state: the last recent_rows (<= window) rows in temporal order, and
    // the buffer the next feed builds its own in.
    DeviceBuffer recent, recent_next;
    int64_t recent_rows = 0;
  };

  // The layer exists and its weights are in w_ (a stage's program holds only its own).
  Status check_held(int64_t layer) const;
  Status feed_any(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x, bool on_device,
                  Dsv4NewRows* out);
  Status prepare(const Dsv4GpuLayer& L, LayerState& s);
  Status feed_block(const Dsv4GpuLayer& L, LayerState& s, int64_t pos0, int64_t m,
                    const uint16_t* x);
  Status apply(const GpuDecoderLinear& l, const uint16_t* x, const float* xf, int64_t m,
               uint16_t* out);
  Status feed_pool(const Dsv4GpuCompressor& c, PoolState& s, int64_t pos0, int64_t m,
                   const uint16_t* x, const float* xf);
  // The rows [end - end % r, end) of the carry as buffers, and (with_pooled) every pooled row.
  Status pool_arrays(const Dsv4GpuCompressor& c, const PoolState& s, int64_t end, bool with_pooled,
                     Dsv4PoolArrays* a) const;
  // keep_boundary_state's window rows after a feed [pos0, pos0 + n) ending before T.
  Status keep_recent(const Dsv4GpuLayer& L, LayerState& s, int64_t pos0, int64_t n,
                     const uint16_t* x, bool on_device);
  // Rows the scratch holds: a block, or a window's worth for keep_recent.
  int64_t scratch_rows() const;

  const Dsv4GpuWeights* w_;
  cudaStream_t stream_;
  int64_t block_rows_;
  bool boundaries_ = false;
  std::vector<int64_t> tail_calls_;  // a tail's calls, scheduled once resume() gives the window
  int64_t start_ = 0;
  bool resumed_ = false;
  Dsv4Schedule sched_;
  std::vector<LayerState> state_;
  std::vector<Dsv4ProgramCheckpoint::Layer> kept_;  // per finished layer, for checkpoint_into

  // Shared by every layer's feeds (serialized by mu_): staged x, x in f32, GEMM accumulators,
  // a compressor's rows (carry then the block's projections), pooled rows before copy-back.
  DeviceBuffer flags4_dev_, flags128_dev_, x_dev_, xf_, acc_, work_kv_, work_gate_, pooled_;
  DeviceBuffer fma_;  // 3 ints of scratch and the flag, for the dense linears
  bool scratch_ready_ = false;
  mutable std::mutex mu_;
};

}  // namespace hetero::cuda
