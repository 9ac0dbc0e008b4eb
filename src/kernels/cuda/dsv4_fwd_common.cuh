// What the DeepSeek-V4 forward's CUDA files (dsv4_fwd_ops.cu, dsv4_fwd_attention.cu,
// dsv4_fwd_index.cu) share: the launch-size helper, warp reductions, the indexer's head limit.
// Their launchers check the shapes they were given with HETERO_CHECK: the engine asked
// check_forward_shapes / check_index_select (dsv4_fwd_ops.h) first, so a failing check is a bug,
// not a request the kernels cannot take.
#pragma once

#include <cstdint>

#include "common/status.h"

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

}  // namespace hetero::cuda::dsv4_fwd
