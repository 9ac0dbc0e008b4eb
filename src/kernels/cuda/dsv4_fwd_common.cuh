// What the DeepSeek-V4 forward's CUDA files (dsv4_fwd_ops.cu, dsv4_fwd_attention.cu,
// dsv4_fwd_index.cu) share: the launch-size helper, warp reductions, the indexer's head limit.
// Their launchers check the shapes they were given with HETERO_CHECK: the engine asked
// check_forward_shapes / check_index_select (dsv4_fwd_ops.h) first, so a failing check is a bug,
// not a request the kernels cannot take.
#pragma once

#include <cstdint>

#include "common/status.h"
#include "kernels/cuda/mlx_math.cuh"

namespace hetero::cuda::dsv4_fwd {

// The indexer's query heads a block holds (DeepSeek-V4-Flash has 64); the attention's shape
// check names it too.
constexpr int kIdxMaxHeads = 64;

inline int blocks_for(int64_t n, int threads) {
  return static_cast<int>((n + threads - 1) / threads);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// One rope pair (x1, x2), the low and high halves of v, rotated by (c, s) from mlx_rope_trig
// with the decoder's rounding points: each product to bf16, then their difference and sum.
__device__ __forceinline__ uint32_t rope_pair(uint32_t v, float c, float s) {
  const float x1 = b2f(uint16_t(v & 0xffffu)), x2 = b2f(uint16_t(v >> 16));
  const uint16_t y1 = f2b(__fsub_rn(rb(__fmul_rn(x1, c)), rb(__fmul_rn(x2, s))));
  const uint16_t y2 = f2b(__fadd_rn(rb(__fmul_rn(x1, s)), rb(__fmul_rn(x2, c))));
  return uint32_t(y1) | (uint32_t(y2) << 16);
}

}  // namespace hetero::cuda::dsv4_fwd
