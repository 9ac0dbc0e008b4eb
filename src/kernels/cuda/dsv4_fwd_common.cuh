// What the DeepSeek-V4 forward's CUDA files (dsv4_fwd_ops.cu, dsv4_fwd_attention.cu) share: a
// check macro for broken invariants, the launch-size helper and warp reductions.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace hetero::cuda::dsv4_fwd {

#define HETERO_FWD_CHECK(cond, msg)                                                           \
  do {                                                                                        \
    if (!(cond)) {                                                                            \
      std::fprintf(stderr, "%s:%d: check failed: %s (%s)\n", __FILE__, __LINE__, #cond, msg); \
      std::abort();                                                                           \
    }                                                                                         \
  } while (0)

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
