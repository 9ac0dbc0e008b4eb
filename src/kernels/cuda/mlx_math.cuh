// The decoder's scalar arithmetic on the device, shared by the CUDA op files: bf16 conversions
// (round to nearest even, NaN kept quiet, as common/bf16.h) and MLX's own exp and Cephes sin/cos
// (the device twins of kernels/mlx_math.h). Every rounding is an explicit intrinsic and
// __fmaf_rn appears exactly where MLX calls fma, so the results do not depend on --fmad.
#pragma once

#include <cmath>
#include <cstdint>

namespace hetero::cuda {

__device__ __forceinline__ float b2f(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }

__device__ __forceinline__ uint16_t f2b(float f) {
  uint32_t bits = __float_as_uint(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

// Eight bf16 values (16 bytes, the low half of each word first) as floats.
__device__ __forceinline__ void unpack_bf16x8(const uint4& u, float (&f)[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int e = 0; e < 4; ++e)
    f[2 * e] = __uint_as_float(w[e] << 16), f[2 * e + 1] = __uint_as_float(w[e] & 0xffff0000u);
}

// Round to the nearest bf16 value, kept in f32.
__device__ __forceinline__ float rb(float f) { return b2f(f2b(f)); }

__device__ __forceinline__ float mlx_exp(float xin) {
  if (isnan(xin)) return xin;
  if (xin > 88.0f) return INFINITY;
  if (xin < -88.0f) return 0.0f;
  const float x = __fmul_rn(xin, 1.442695f);
  // floor(x + 0.5) as MLX computes it (in double, where x + 0.5 is exact), in float: the nearest
  // integer, one up where x lies halfway and rintf went to the even one below (|x| <= 128 here,
  // so x - ip is exact): the same integer for every float x, without the double conversions and
  // rounding, long-latency on the GPU, that the softmax of DeepSeek-V4's attention waited on.
  float ip = rintf(x);
  if (__fsub_rn(x, ip) == 0.5f) ip = __fadd_rn(ip, 1.0f);
  const float f = __fsub_rn(x, ip);
  float p = 1.535336188319500e-4f;
  p = __fmaf_rn(p, f, 1.339887440266574e-3f);
  p = __fmaf_rn(p, f, 9.618437357674640e-3f);
  p = __fmaf_rn(p, f, 5.550332471162809e-2f);
  p = __fmaf_rn(p, f, 2.402264791363012e-1f);
  p = __fmaf_rn(p, f, 6.931472028550421e-1f);
  p = __fmaf_rn(p, f, 1.0f);
  return __fmul_rn(__uint_as_float(uint32_t(int32_t(ip) + 127) << 23), p);
}

// Valid for |x| <= 2^23, as the CPU version.
__device__ __forceinline__ float mlx_sincos(float xin, bool sine) {
  bool sign_sin = xin < 0;
  float x = fabsf(xin);
  float y = __fmul_rn(x, 1.27323954473516f);
  uint32_t emm2 = uint32_t(y);
  emm2 = (emm2 + 1u) & ~1u;
  y = float(emm2);
  const bool poly = (emm2 & 2u) != 0;
  x = __fmaf_rn(y, -0.78515625f, x);
  x = __fmaf_rn(y, -2.4187564849853515625e-4f, x);
  x = __fmaf_rn(y, -3.77489497744594108e-8f, x);
  sign_sin = sign_sin ^ ((emm2 & 4u) != 0);
  const bool sign_cos = ((emm2 - 2u) & 4u) != 0;
  const float z = __fmul_rn(x, x);
  float y1 = __fmaf_rn(z, 2.443315711809948e-5f, -1.388731625493765e-3f);
  float y2 = __fmaf_rn(z, -1.9515295891e-4f, 8.3321608736e-3f);
  y1 = __fmaf_rn(y1, z, 4.166664568298827e-2f);
  y2 = __fmaf_rn(y2, z, -1.6666654611e-1f);
  y1 = __fmul_rn(y1, z);
  y2 = __fmul_rn(y2, z);
  y1 = __fmul_rn(y1, z);
  y2 = __fmaf_rn(x, y2, x);
  y1 = __fmaf_rn(z, -0.5f, y1);
  y1 = __fadd_rn(y1, 1.0f);
  if (sine) {
    const float s = poly ? y1 : y2;
    return sign_sin ? -s : s;
  }
  const float c = poly ? y2 : y1;
  return sign_cos ? c : -c;
}

// The bf16-rounded cos and sin of a rope angle as the decoder computes them: theta = pos *
// (1 / f') with f' = f / freq_scale, negated for the inverse rotation (f = +inf: angle +-0).
__device__ __forceinline__ void mlx_rope_trig(float pos, float f, int freq_scale, bool inverse,
                                              float* c, float* s) {
  if (freq_scale != 1) f = __fdiv_rn(f, float(freq_scale));
  if (inverse) f = -f;
  const float theta = __fmul_rn(pos, __fdiv_rn(1.0f, f));
  *c = rb(mlx_sincos(theta, false));
  *s = rb(mlx_sincos(theta, true));
}

}  // namespace hetero::cuda
