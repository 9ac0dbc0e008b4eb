// CUDA backend of the prefill engine for the llama family: chunked prefill on one GPU with
// bf16 weights in device memory, tensor-core GEMMs through cuBLAS (q|k|v and gate|up fused into
// one GEMM each; optionally FP8 block-scaled projection weights, kernels/cuda/fp8_gemm.h), the
// engine's own paged KV cache (pages of 64 rows, FP8 e4m3 with a scale per row and head, or bf16),
// flash attention over it (the engine's own kernel, or cuDNN's over a bf16 cache), and the
// attention-input tap.
//
// All work of a chunk is enqueued on the engine's compute stream; prefill_chunk returns once it
// is enqueued and the host waits only where it must (a host tap, last_logits, or a consumer's
// back-pressure). The tap hands x on the device (TapEvent::x_device, ordered on stream()); with
// host_tap it also copies x back and waits, for tests and the CPU cache programs.
//
// Memory: weights uploaded once; the cache pages and the activations grow with the sequences and
// chunks seen and are kept for the next; reserve() takes a request's memory before its first
// chunk. Every allocation counts against device_memory_budget_bytes when one is set.
// Errors: every CUDA failure is a Status, nothing aborts. Out of device memory (or past the
// budget) is kResourceExhausted with the bytes asked and free, and leaves the engine usable.
//
// Results agree with the CPU engine (engine/llama_cpu.h) within a tolerance, not bit for bit:
// the GEMMs and the attention sum in another order, and an FP8 cache rounds K and V
// (tests/gpu/llama_cuda_test.cc states and checks the bounds). FP8 weights round every projection
// weight and its input activations to e4m3 as well.
// Thread-safety: one engine serves one sequence at a time.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/cuda/device_rope_by_call.h"
#include "engine/cuda/tap_readers.h"
#include "engine/tap.h"
#include "kernels/cuda/cudnn_attention.h"
#include "kernels/cuda/device_rope.h"
#include "kernels/cuda/fast_ops.h"
#include "kernels/cuda/fp8_gemm.h"
#include "kernels/cuda/resource.h"
#include "model/llama.h"

namespace hetero::cuda {

// How the forward computes.
enum class LlamaCudaArith {
  // Tensor cores and the paged cache (above): the fast path, within a tolerance of the CPU
  // engine.
  kFast,
  // The decoder's arithmetic, as the CPU engine computes it (kernels/cuda/ops.h: float32 sums in
  // ascending k, one thread per sum; a contiguous bf16 cache): attention inputs bit-identical to
  // LlamaCpuEngine's, at CUDA-core speed. For `hetero verify` with the prefill on the GPU.
  kExact,
};

// WeightDtype (kernels/cuda/fp8_gemm.h): kFp8 quantizes the projection weights (q|k|v, o,
// gate|up, down) at upload into the 128x128 block-scaled e4m3 format (no bf16 copy is kept) and
// runs those GEMMs on the FP8 tensor cores, quantizing their inputs per token and 128 columns; the
// embedding, the norms and lm_head stay bf16. kFast only, Hopper (sm_90) only.

// The fast path's attention: the engine's own flash kernel (fast_ops.h: any cache) or cuDNN's
// fused SDPA (cudnn_attention.h: a bf16 cache, read in place). kAuto: cuDNN where the build has it,
// it loads on the device and the cache is bf16; the engine's own kernel otherwise, saying why
// (attention_name()). kCudnn refuses to start without it.
enum class AttentionKernel { kAuto, kOwn, kCudnn };

struct LlamaCudaOptions {
  KvDtype kv_dtype = KvDtype::kFp8;  // kFast only
  bool host_tap = false;
  int device = 0;
  LlamaCudaArith arith = LlamaCudaArith::kFast;
  WeightDtype weight_dtype = WeightDtype::kBf16;
  // Device memory the engine's allocations (weights, cache, activations) may hold, in bytes; 0:
  // no budget beyond the device. An allocation past it fails as a cudaMalloc out of memory does.
  int64_t device_memory_budget_bytes = 0;
  AttentionKernel attention = AttentionKernel::kAuto;  // kFast only
};

// "fp8" or "bf16".
Result<KvDtype> parse_kv_dtype(const std::string& name);
const char* kv_dtype_name(KvDtype dtype);
// "fast" or "exact".
Result<LlamaCudaArith> parse_llama_cuda_arith(const std::string& name);
// "auto", "own" or "cudnn".
Result<AttentionKernel> parse_attention_kernel(const std::string& name);

class LlamaCudaEngine {
 public:
  // Fails (unavailable) without a CUDA device; kResourceExhausted when the weights do not fit.
  static Result<std::unique_ptr<LlamaCudaEngine>> load(const std::string& model_dir,
                                                       const LlamaCudaOptions& options = {});
  static Result<std::unique_ptr<LlamaCudaEngine>> create(const LlamaWeights& weights,
                                                         const LlamaCudaOptions& options = {});
  ~LlamaCudaEngine();
  LlamaCudaEngine(const LlamaCudaEngine&) = delete;
  LlamaCudaEngine& operator=(const LlamaCudaEngine&) = delete;

  const LlamaConfig& config() const { return config_; }
  const LlamaCudaOptions& options() const { return options_; }
  // Which attention the fast path runs, and under kAuto why not cuDNN's ("-" for kExact).
  std::string attention_name() const;
  cudaStream_t stream() const { return stream_.get(); }
  // Forgets the sequence once the device has finished its work (whose errors it returns); the
  // cache pages stay allocated for the next one.
  Status reset();
  // Starts a sequence (reset()) and takes the memory one of `tokens` tokens run in chunks of at
  // most `max_chunk_tokens` needs (cache pages, activations, the exact path's scores), so that
  // its chunks allocate nothing. kResourceExhausted (bytes asked and free) when it does not fit
  // on the device or in the budget; the engine then holds no more than its weights and serves
  // the next request.
  Status reserve(int64_t tokens, int64_t max_chunk_tokens);
  // As LlamaCpuEngine's: past a dynamic rope's reach each of the decoder's calls ropes its rows
  // with its own base (a tail there is refused); reset() goes back to the config's rope.
  Status set_decoder_calls(const std::vector<int64_t>& calls, int64_t start, bool batched);
  bool rows_follow_calls(const std::vector<int64_t>& calls, int64_t start, bool batched) const;
  int64_t cached_tokens() const { return n_cached_; }
  // Enqueues the next chunk: ids are positions [cached_tokens(), +ids.size()). Ids outside the
  // vocabulary are refused before anything changes; out of device memory is
  // kResourceExhausted. After a failed chunk the sequence is lost: reset() before the next.
  Status prefill_chunk(const std::vector<int32_t>& ids, const AttentionInputTap& tap);
  // Waits for the enqueued work; reports any device error.
  Status synchronize();
  // The engine's state for the prefill host's prefix cache, as the CPU engine hands it out
  // (LlamaCpuEngine::save_state: per layer keys then values, token-major bf16): the exact path
  // only, whose cache has that layout; 0 bytes on the fast path (its pages are its own; a tail's
  // prefix is computed again). save_state waits for the stream; load_state follows reserve().
  int64_t state_row_bytes() const;
  Status save_state(int64_t pos0, int64_t n, uint8_t* out);
  Status load_state(int64_t pos0, int64_t n, const uint8_t* in);
  // Logits of the last processed token (float32 [vocab]); waits for the stream.
  Result<std::vector<float>> last_logits();

  // Device memory held: weights (FP8 projections count their e4m3 bytes and scales), cache pages,
  // activations.
  size_t weight_bytes() const { return weight_bytes_; }
  size_t cache_bytes() const;
  size_t activation_bytes() const { return act_bytes_; }
  // Everything the engine holds on the device now (what counts against the budget).
  int64_t device_bytes() const { return budget_.used_bytes(); }

 private:
  // Defined in llama_cuda_impl.h.
  struct Proj;
  struct Layer;
  struct Pages;
  struct Exact;
  Status prefill_exact(const std::vector<int32_t>& ids, const AttentionInputTap& tap);
  Status deliver_tap(const AttentionInputTap& tap, int64_t layer, int64_t pos0, int64_t n,
                     const uint16_t* x);
  LlamaCudaEngine(LlamaConfig config, LlamaCudaOptions options);
  Status upload(const LlamaWeights& w);
  Status upload_exact(const LlamaWeights& w);
  Status ensure_activations(int64_t n);
  Status ensure_pages(int64_t tokens);
  Status grow_pages(int64_t add);
  Status choose_attention();
  Status ensure_exact(int64_t n, int64_t tokens, size_t scratch_bytes);
  Status upload_projection(std::initializer_list<const Tensor*> parts, Proj* out);
  Status linear(const uint16_t* x, int64_t m, const Proj& w, uint16_t* out);
  void release_sequence_memory();

  LlamaConfig config_;
  LlamaCudaOptions options_;
  // Before every buffer: they give their bytes back to it when freed.
  DeviceMemoryBudget budget_;
  Stream stream_;
  BlasHandle cublas_;
  std::unique_ptr<Fp8Gemm> fp8_;
  DeviceBuffer staging_;  // bf16 projection weights on their way to FP8 (upload only)
  std::vector<DeviceBuffer> weights_;
  DeviceRope rope_;
  DeviceRopeByCall call_rope_;  // rope_, or the decoder's calls' (set_decoder_calls)
  std::vector<Layer> layers_;
  const uint16_t* embed_ = nullptr;
  const uint16_t* lm_head_ = nullptr;
  const uint16_t* final_norm_ = nullptr;
  size_t weight_bytes_ = 0;

  std::unique_ptr<Pages> pages_;
  std::unique_ptr<Exact> exact_;
  std::unique_ptr<CudnnAttention> cudnn_;  // set when the fast path attends through cuDNN
  std::string attention_note_;             // why not, under kAuto
  int64_t n_cached_ = 0;
  int64_t last_rows_ = 0;  // rows of the last chunk

  // Activations, sized for the largest chunk so far.
  int64_t act_rows_ = 0;
  size_t act_bytes_ = 0;
  DeviceBuffer h_, xn_, qkv_, q_, attn_, tmp_, gate_up_, act_, ids_;
  DeviceBuffer act_q_, act_scale_;  // a GEMM input in FP8 (fp8 weights only)
  DeviceBuffer logits_;
  PinnedBuffer pinned_x_;
  TapReaders tap_readers_;  // the tap's readers of xn on their own streams
};

}  // namespace hetero::cuda
