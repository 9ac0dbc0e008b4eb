// Device code shared by the FP4 -> FP8 widening kernel (checkpoint_formats.cu) and the W4A8
// grouped GEMM that widens inside its main loop (w4a8_grouped_gemm.cu): one definition of the
// conversion, so that both produce the same e4m3 codes for the same FP4 group.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

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

// PTX's prmt in its default mode: byte n of the result is byte (s >> 4n) & 7 of {y, x}, or that
// byte's sign bit replicated where bit 3 of the selector nibble is set. (__byte_perm reads only
// the low three bits of each nibble, so it cannot ask for the sign.)
__device__ __forceinline__ uint32_t prmt_sign(uint32_t x, uint32_t s) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %1, %2;" : "=r"(r) : "r"(x), "r"(s));
  return r;
}

// One 32-element FP4 group (w: its 16 bytes as words, element 2j in the low nibble of byte j) ->
// out: its 32 e4m3 codes (byte i of the 32 = element i), each e2m1 value times 2^d, rounded to
// nearest even (exact for d >= -8, checkpoint_formats.h). Returns whether the group lost bits:
// d < -8 and a nonzero code.
__device__ __forceinline__ bool widen_fp4_group(const uint32_t (&w)[4], int d, uint32_t (&out)[8]) {
  if (d >= -5) {
    // Every value is an e4m3 normal (or zero). An e2m1 magnitude code m (1..7) is
    // 2^((m >> 1) - 1) * (1 + (m odd and m > 1) / 2), so its e4m3 code has the exponent field
    // (m >> 1) + d + 6 and the e2m1 mantissa bit as its top mantissa bit: at d = 0 the codes
    // 0x30 0x38 0x3c 0x40 0x44 0x48 0x4c, and 8d more for any d (no byte carries: d >= -5). The
    // eight magnitude codes sit in a byte table (two words; magnitude 0 stays 0) and each nibble
    // selects its byte with a byte permute, four at a time. A second permute of 0x80 bytes,
    // selected by the whole nibble, gives 0xff where the sign bit is set (the permute's
    // sign-replicate mode), whose bit 6 shifted up is the code's sign. Four instructions for four
    // elements: the W4A8 GEMM widens in its main loop, where issue slots are what it runs short of.
    const uint32_t step = static_cast<uint32_t>(8 * d);
    const uint32_t lut_lo = 0x3c383000u + step * 0x01010100u;
    const uint32_t lut_hi = 0x4c484440u + step * 0x01010101u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t mags = w[i] & 0x77777777u;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t mag = __byte_perm(lut_lo, lut_hi, mags >> (16 * h));
        const uint32_t neg = prmt_sign(0x80808080u, w[i] >> (16 * h));
        out[2 * i + h] = mag | ((neg << 1) & 0x80808080u);
      }
    }
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
