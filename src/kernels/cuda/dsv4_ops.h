// CUDA twins of the DeepSeek-V4 cache-program ops (kernels/dsv4_ops.h) and of MLX's CPU
// quantized matmuls (kernels/cpu_ops.h: linear_quantized_mx / _affine), bit-identical to the CPU
// functions and so to the decoder. Same contracts, layouts and dtypes as those; what differs is
// listed per op. Every order-sensitive sum runs in one thread in the CPU order; parallelism goes
// across rows, features and output columns only.
// All pointers are device pointers; every op is enqueued on `stream` and returns at once. The ops
// keep no state and are safe to call from any host thread.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace hetero::cuda {

// In place on x [rows][heads][head_dim] bf16, row t at position pos0 + t. freqs: device f32
// [rope_pairs], the output of hetero::dsv4_rope_freqs (rope_pairs = its size, <= head_dim/2).
// freq_scale and inverse as the CPU op; the head_dim/2 - rope_pairs leading pairs are the no-rope
// pairs and go through the rotation with angle +-0, as on the CPU.
void dsv4_rope(uint16_t* x, int64_t rows, int64_t heads, int64_t head_dim, int64_t pos0,
               const float* freqs, int64_t rope_pairs, int freq_scale, bool inverse,
               cudaStream_t stream);

// y = bf16(x * 1/sqrt(mean(x^2) + eps)) per row of x [m, d]. In place is allowed.
void rms_norm_noweight(const uint16_t* x, int64_t m, int64_t d, float eps, uint16_t* out,
                       cudaStream_t stream);

// Ratio-r pooling of complete windows: kv, gate [windows * r][d] bf16, ape [r][d] f32,
// out [windows][d] bf16.
void dsv4_pool_simple(const uint16_t* kv, const uint16_t* gate, const float* ape, int64_t windows,
                      int64_t r, int64_t d, uint16_t* out, cudaStream_t stream);

// Overlapping pooling (ratio 4): rows 2*hd wide, has_prev: device uint8 [windows]; where
// has_prev[w] != 0 the r rows before window w must be readable (kv - r*2*hd, gate likewise).
// out [windows][hd] bf16.
void dsv4_pool_overlap(const uint16_t* kv, const uint16_t* gate, const float* ape,
                       const uint8_t* has_prev, int64_t windows, int64_t r, int64_t hd,
                       uint16_t* out, cudaStream_t stream);

// out [m, n] bf16 = x [m, k] bf16 @ W^T with W quantized: q f32 element values [n, k], scales
// (and biases) f32 [n, k/group]. mx: bf16 products summed in bf16 per group, each group folded
// in as bf16(sum + bf16(scale * gsum)); affine: w = bf16(bf16(scale*q) + bias), one bf16 sum
// over k.
void linear_quantized_mx(const uint16_t* x, int64_t m, int64_t k, const float* q,
                         const float* scales, int64_t n, int64_t group, uint16_t* out,
                         cudaStream_t stream);
void linear_quantized_affine(const uint16_t* x, int64_t m, int64_t k, const float* q,
                             const float* scales, const float* biases, int64_t n, int64_t group,
                             uint16_t* out, cudaStream_t stream);

}  // namespace hetero::cuda
