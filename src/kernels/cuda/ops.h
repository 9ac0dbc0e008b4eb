// CUDA ops in the decoder's arithmetic: the GPU twins of kernels/cpu_ops.h, bit-identical to
// them (and so to MLX 0.32.4 on CPU). Every sum keeps its order per output element; parallelism
// goes across outputs; no FMA contraction outside MLX's own exp and sin/cos (built with
// --fmad=false, fmaf only where MLX calls fma). This is the correctness-first slice of the CUDA
// backend: simple kernels whose outputs are the contract; fast kernels must match them.
// All pointers are device pointers; every op is enqueued on `stream` and returns at once.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace hetero::cuda {

// C[M,N] += A[M,K] @ B[K,N], float32, ascending k per element, one rounding per multiply and
// per add. fma_ok (device int, optional): when it reads nonzero — every product exact, as
// exact_products_flag checks — each multiply-add is one FMA, which gives the same bits faster.
void gemm_ordered(const float* a, int64_t m, int64_t k, const float* b, int64_t n, float* c,
                  cudaStream_t stream, const int* fma_ok = nullptr);

// The exponent range of a weight's values (host side, once per weight).
struct BF16Range {
  int min_lsb_exponent = 1 << 20;  // of the last significand bit, over nonzero values
  int max_exponent = -(1 << 20);   // largest biased exponent
  bool exact_bf16 = true;          // every value a finite bf16 (else no product is known exact)
};
BF16Range weight_range(const float* w, int64_t count);
// flag = 1 when every product of an element of x (bf16 [count]) with a weight in range w is
// exact in float32 (and finite), else 0 — so gemm_ordered may fuse its multiply-adds. stats:
// 3 device ints of scratch. Enqueued on stream; the host never waits for it.
void exact_products_flag(const uint16_t* x, int64_t count, const BF16Range& w, int* stats,
                         int* flag, cudaStream_t stream);
// bf16 <-> f32 conversions (round to nearest even).
void bf16_to_f32(const uint16_t* x, int64_t n, float* out, cudaStream_t stream);
// out[i, j] = bf16(out[i, j] + bias[j]) for out [m, n]: a separate bf16 add (a QuantizedLinear's
// bias after its quantized matmul).
void add_bias_bf16(uint16_t* out, int64_t m, int64_t n, const uint16_t* bias, cudaStream_t stream);
// out = bf16(acc (+ bias[j])) for acc [m, n].
void round_linear_output(const float* acc, int64_t m, int64_t n, const uint16_t* bias,
                         uint16_t* out, cudaStream_t stream);
void rms_norm(const uint16_t* x, int64_t m, int64_t d, const uint16_t* w, float eps, uint16_t* out,
              cudaStream_t stream);
// hetero::RopeSpec on the device (kernels/cuda/device_rope.h makes one): its inverse
// frequencies, computed on the host as the CPU op computes them, and its scalars.
struct RopeTable {
  const float* inv = nullptr;  // [dims / 2]
  int dims = 0;
  bool traditional = false;
  float scale = 1.0f;  // position multiplier
  bool scales_input = false;
  float input_scale = 1.0f;  // already rounded to bf16
};
// The CPU op rope_apply on [tokens, heads, head_dim] rows at positions pos0...
void rope_apply(uint16_t* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t pos0,
                const RopeTable& r, cudaStream_t stream);
void silu_mul(const uint16_t* gate, const uint16_t* up, int64_t n, uint16_t* out,
              cudaStream_t stream);
void add_bf16(const uint16_t* a, const uint16_t* b, int64_t n, uint16_t* out, cudaStream_t stream);
// Data movement only: [n, heads, d] token-major rows -> [heads, n, d] (the decoder's cache
// layout).
void heads_major(const uint16_t* x, int64_t n, int64_t heads, int64_t d, uint16_t* out,
                 cudaStream_t stream);
// Causal GQA attention, same layouts and window as the CPU op. scratch: float
// [q_heads, n, pos0 + n].
void attention_causal(const uint16_t* q, int64_t n, int64_t q_heads, const uint16_t* k,
                      const uint16_t* v, int64_t kv_heads, int64_t d, int64_t pos0, float scale,
                      float* scratch, uint16_t* out, cudaStream_t stream, int64_t window = 0);

}  // namespace hetero::cuda
