// MLX's own CPU transcendental functions (mlx 0.32.4, simd/math.h with one lane): its
// polynomial exp and its Cephes sin/cos. The decoder computes softmax, sigmoid and RoPE angles
// with these, not with libm, so reproducing its numbers means reproducing these functions,
// including their fma steps and truncating conversions. See docs/findings/mlx-cpu-numerics.md.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace hetero {

inline float mlx_exp(float xin) {
  if (std::isnan(xin)) return xin;
  if (xin > 88.0f) return INFINITY;
  if (xin < -88.0f) return 0.0f;
  const float x = xin * 1.442695f;
  const float ip = static_cast<float>(std::floor(static_cast<double>(x) + 0.5));
  const float f = x - ip;
  float p = 1.535336188319500e-4f;
  p = std::fma(p, f, 1.339887440266574e-3f);
  p = std::fma(p, f, 9.618437357674640e-3f);
  p = std::fma(p, f, 5.550332471162809e-2f);
  p = std::fma(p, f, 2.402264791363012e-1f);
  p = std::fma(p, f, 6.931472028550421e-1f);
  p = std::fma(p, f, 1.0f);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(ip) + 127) << 23;
  float two;
  std::memcpy(&two, &bits, 4);
  return two * p;
}

// Cephes sin/cos as MLX writes it; valid for |x| <= 2^23 (positions below 8M).
inline float mlx_sincos(float xin, bool sine) {
  bool sign_sin = xin < 0;
  float x = std::fabs(xin);
  float y = x * 1.27323954473516f;
  uint32_t emm2 = static_cast<uint32_t>(y);
  emm2 = (emm2 + 1u) & ~1u;
  y = static_cast<float>(emm2);
  const bool poly = (emm2 & 2u) != 0;
  x = std::fma(y, -0.78515625f, x);
  x = std::fma(y, -2.4187564849853515625e-4f, x);
  x = std::fma(y, -3.77489497744594108e-8f, x);
  sign_sin = sign_sin ^ ((emm2 & 4u) != 0);
  const bool sign_cos = ((emm2 - 2u) & 4u) != 0;
  const float z = x * x;
  float y1 = std::fma(z, 2.443315711809948e-5f, -1.388731625493765e-3f);
  float y2 = std::fma(z, -1.9515295891e-4f, 8.3321608736e-3f);
  y1 = std::fma(y1, z, 4.166664568298827e-2f);
  y2 = std::fma(y2, z, -1.6666654611e-1f);
  y1 = y1 * z;
  y2 = y2 * z;
  y1 = y1 * z;
  y2 = std::fma(x, y2, x);
  y1 = std::fma(z, -0.5f, y1);
  y1 = y1 + 1.0f;
  if (sine) {
    const float s = poly ? y1 : y2;
    return sign_sin ? -s : s;
  }
  const float c = poly ? y2 : y1;
  return sign_cos ? c : -c;
}

}  // namespace hetero
