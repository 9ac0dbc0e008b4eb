// Device code shared by the 128x128 block quantizers (fp8_gemm.cu: float32 scales;
// checkpoint_formats.cu: power-of-two scales).
#pragma once

#include <cstdint>

#include "kernels/cuda/fp8_gemm.h"

namespace hetero::cuda {

// The largest |w| over the 128x128 block at (r0, c0) of the bf16 matrix w [n, k] (cut at the
// matrix's edges), returned to every thread of a CUDA block of kThreads threads (a multiple of
// 32, at most 1024). Every thread must call it.
template <int kThreads>
__device__ float block_amax(const uint16_t* __restrict__ w, int64_t n, int64_t k, int64_t r0,
                            int64_t c0) {
  const int64_t rows = n - r0 < kFp8Block ? n - r0 : kFp8Block;
  const int64_t cols = k - c0 < kFp8Block ? k - c0 : kFp8Block;
  float amax = 0.f;
  for (int i = threadIdx.x; i < kFp8Block * kFp8Block; i += kThreads) {
    const int r = i / kFp8Block, c = i % kFp8Block;
    if (r < rows && c < cols)
      amax = fmaxf(amax, fabsf(__uint_as_float(uint32_t(w[(r0 + r) * k + c0 + c]) << 16)));
  }
  __shared__ float part[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = 0.f;
  for (int i = 0; i < kThreads / 32; ++i) amax = fmaxf(amax, part[i]);
  return amax;
}

}  // namespace hetero::cuda
