// CUDA backend of the prefill engine for the llama family: chunked prefill on one GPU with
// bf16 weights in device memory, tensor-core GEMMs through cuBLAS (q|k|v and gate|up fused into
// one GEMM each; optionally FP8 block-scaled projection weights, kernels/cuda/fp8_gemm.h), the
// engine's own paged KV cache (pages of 64 rows, FP8 e4m3 with a scale per row and head, or bf16),
// flash attention over it, and the attention-input tap.
//
// All work of a chunk is enqueued on the engine's compute stream; prefill_chunk returns once it
// is enqueued and the host waits only where it must (a host tap, last_logits, or a consumer's
// back-pressure). The tap hands x on the device (TapEvent::x_device, ordered on stream()); with
// host_tap it also copies x back and waits, for tests and the CPU cache programs.
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
#include "engine/tap.h"
#include "kernels/cuda/fast_ops.h"
#include "kernels/cuda/fp8_gemm.h"
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

struct LlamaCudaOptions {
  KvDtype kv_dtype = KvDtype::kFp8;  // kFast only
  bool host_tap = false;
  int device = 0;
  LlamaCudaArith arith = LlamaCudaArith::kFast;
  WeightDtype weight_dtype = WeightDtype::kBf16;
};

// "fp8" or "bf16".
Result<KvDtype> parse_kv_dtype(const std::string& name);
const char* kv_dtype_name(KvDtype dtype);
// "fast" or "exact".
Result<LlamaCudaArith> parse_llama_cuda_arith(const std::string& name);

class LlamaCudaEngine {
 public:
  // Fails (unavailable) without a CUDA device, or when the weights do not fit.
  static Result<std::unique_ptr<LlamaCudaEngine>> load(const std::string& model_dir,
                                                       const LlamaCudaOptions& options = {});
  static Result<std::unique_ptr<LlamaCudaEngine>> create(const LlamaWeights& weights,
                                                         const LlamaCudaOptions& options = {});
  ~LlamaCudaEngine();
  LlamaCudaEngine(const LlamaCudaEngine&) = delete;
  LlamaCudaEngine& operator=(const LlamaCudaEngine&) = delete;

  const LlamaConfig& config() const { return config_; }
  const LlamaCudaOptions& options() const { return options_; }
  cudaStream_t stream() const { return stream_; }
  // Forgets the sequence; the cache pages stay allocated for the next one.
  void reset();
  int64_t cached_tokens() const { return n_cached_; }
  // Enqueues the next chunk: ids are positions [cached_tokens(), +ids.size()). Ids outside the
  // vocabulary are refused before anything changes; out of device memory is unavailable.
  Status prefill_chunk(const std::vector<int32_t>& ids, const AttentionInputTap& tap);
  // Waits for the enqueued work; reports any device error.
  Status synchronize();
  // Logits of the last processed token (float32 [vocab]); waits for the stream.
  Result<std::vector<float>> last_logits();

  // Device memory held: weights (FP8 projections count their e4m3 bytes and scales), cache pages,
  // activations.
  size_t weight_bytes() const { return weight_bytes_; }
  size_t cache_bytes() const;
  size_t activation_bytes() const { return act_bytes_; }

 private:
  struct Proj;
  struct Layer;
  struct Pages;
  struct Exact;
  Status prefill_exact(const std::vector<int32_t>& ids, const AttentionInputTap& tap);
  Status deliver_tap(const AttentionInputTap& tap, int64_t layer, int64_t pos0, int64_t n,
                     const uint16_t* x);
  LlamaCudaEngine(LlamaConfig config, LlamaCudaOptions options);
  Status upload(const LlamaWeights& w);
  Status ensure_activations(int64_t n);
  Status ensure_pages(int64_t tokens);
  Status upload_projection(std::initializer_list<const Tensor*> parts, Proj* out);
  Status linear(const uint16_t* x, int64_t m, const Proj& w, uint16_t* out);
  Status device_status(const char* what) const;

  LlamaConfig config_;
  LlamaCudaOptions options_;
  cudaStream_t stream_ = nullptr;
  void* cublas_ = nullptr;  // cublasHandle_t
  std::unique_ptr<Fp8Gemm> fp8_;
  void* staging_ = nullptr;  // bf16 projection weights on their way to FP8 (upload only)
  size_t staging_bytes_ = 0;
  std::vector<void*> allocations_;
  std::vector<Layer> layers_;
  const uint16_t* embed_ = nullptr;
  const uint16_t* lm_head_ = nullptr;
  const uint16_t* final_norm_ = nullptr;
  size_t weight_bytes_ = 0;

  std::unique_ptr<Pages> pages_;
  std::unique_ptr<Exact> exact_;
  int64_t n_cached_ = 0;
  int64_t last_rows_ = 0;  // rows of the last chunk

  // Activations, sized for the largest chunk so far.
  int64_t act_rows_ = 0;
  size_t act_bytes_ = 0;
  void *h_ = nullptr, *xn_ = nullptr, *qkv_ = nullptr, *q_ = nullptr, *attn_ = nullptr,
       *tmp_ = nullptr, *gate_up_ = nullptr, *act_ = nullptr, *ids_ = nullptr;
  void *act_q_ = nullptr, *act_scale_ = nullptr;  // a GEMM input in FP8 (fp8 weights only)
  void *logits_ = nullptr, *pinned_x_ = nullptr;
  size_t pinned_x_bytes_ = 0;
};

}  // namespace hetero::cuda
