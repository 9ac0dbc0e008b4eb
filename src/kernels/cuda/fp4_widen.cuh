// Device code shared by the FP4 -> FP8 widening kernel (checkpoint_formats.cu) and the W4A8
// grouped GEMM that widens inside its main loop (w4a8_grouped_gemm.cu): one definition of the
// conversion, so that both produce the same e4m3 codes for the same FP4 group.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/fp4_widen_bits.h"

namespace hetero::cuda {

__device__ __forceinline__ float e2m1(uint32_t nibble) {
  constexpr float kMag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  const float m = kMag[nibble & 7u];
  return (nibble & 8u) ? -m : m;
}

// Round to nearest even, saturating to ±448. Low byte = a.
__device__ __forceinline__ uint16_t e4m3x2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}

// One 32-element FP4 group (w: its 16 bytes as words, element 2j in the low nibble of byte j) ->
// out: its 32 e4m3 codes (byte i of the 32 = element i), each e2m1 value times 2^d, rounded to
// nearest even (exact for d >= -8, checkpoint_formats.h). Returns whether the group lost bits:
// d < -8 and a nonzero code. Where every value is an e4m3 normal (d >= -5: trained weights' groups
// sit within a few powers of two of their block's largest), integer operations alone
// (fp4_widen_bits.h); below, through float.
__device__ __forceinline__ bool widen_fp4_group(const uint32_t (&w)[4], int d, uint32_t (&out)[8]) {
  if (d >= -5) {
    widen_fp4_group_normal(w, d, out);
    return false;
  }
  bool nonzero = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float v[8];
#pragma unroll
    for (int b = 0; b < 8; ++b) {
      const uint32_t nib = (w[i] >> (4 * b)) & 0xfu;
      nonzero = nonzero || (nib & 7u) != 0;
      v[b] = ldexpf(e2m1(nib), d);
    }
    out[2 * i] = e4m3x2(v[0], v[1]) | (uint32_t(e4m3x2(v[2], v[3])) << 16);
    out[2 * i + 1] = e4m3x2(v[4], v[5]) | (uint32_t(e4m3x2(v[6], v[7])) << 16);
  }
  return nonzero && d < -8;
}

}  // namespace hetero::cuda
