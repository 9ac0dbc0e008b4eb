// DeepSeek-V4 decoder-order ops: see dsv4_ops.h and docs/findings/dsv4-mlx-numerics.md.
#include "kernels/dsv4_ops.h"

#include <cmath>
#include <limits>

#include "common/bf16.h"
#include "kernels/cpu_ops.h"
#include "kernels/mlx_math.h"

namespace hetero {

std::vector<float> dsv4_rope_freqs(int rope_dims, double base, const YarnScaling& yarn) {
  const int pairs = rope_dims / 2;
  const float fbase = static_cast<float>(base);
  std::vector<float> inv(static_cast<size_t>(pairs));
  for (int i = 0; i < pairs; ++i) {
    // arange(0, dims, 2) / dims, then base ** that: one f32 division, one powf.
    const float e = static_cast<float>(2 * i) / static_cast<float>(rope_dims);
    inv[static_cast<size_t>(i)] = 1.0f / std::pow(fbase, e);
  }
  if (yarn.enabled) {
    // The correction range is computed in double precision (Python floats), then used as f32.
    const double two_pi = 2.0 * M_PI;
    auto correction = [&](double rotations) {
      return rope_dims * std::log(yarn.original_max_position_embeddings / (rotations * two_pi)) /
             (2.0 * std::log(base));
    };
    const double low = std::max(std::floor(correction(yarn.beta_fast)), 0.0);
    double high =
        std::min(std::ceil(correction(yarn.beta_slow)), static_cast<double>(rope_dims - 1));
    if (low == high) high += 0.001;
    const float flow = static_cast<float>(low), span = static_cast<float>(high - low);
    const float factor = static_cast<float>(yarn.factor);
    for (int i = 0; i < pairs; ++i) {
      const float ramp = (static_cast<float>(i) - flow) / span;
      const float smooth = 1.0f - std::min(std::max(ramp, 0.0f), 1.0f);
      const float f = inv[static_cast<size_t>(i)];
      const float scaled = (f / factor) * (1.0f - smooth);
      inv[static_cast<size_t>(i)] = scaled + f * smooth;
    }
  }
  std::vector<float> freqs(static_cast<size_t>(pairs));
  for (int i = 0; i < pairs; ++i)
    freqs[static_cast<size_t>(i)] = 1.0f / inv[static_cast<size_t>(i)];
  return freqs;
}

void dsv4_rope(uint16_t* x, int64_t rows, int64_t heads, int64_t head_dim, int64_t pos0,
               const std::vector<float>& freqs, int freq_scale, bool inverse) {
  const int64_t pairs = head_dim / 2;
  const int64_t nope = pairs - static_cast<int64_t>(freqs.size());
  // Per pair: the reciprocal of the (scaled, signed) frequency; the no-rope pairs carry +-inf
  // frequencies, whose reciprocal is a signed zero: their angle is 0 and they still go through
  // the rotation arithmetic (which matters only for the sign of zeros, but that is bits).
  std::vector<float> inv(static_cast<size_t>(pairs));
  for (int64_t p = 0; p < pairs; ++p) {
    float f;
    if (p < nope) {
      f = std::numeric_limits<float>::infinity();
    } else {
      f = freqs[static_cast<size_t>(p - nope)];
      if (freq_scale != 1) f = f / static_cast<float>(freq_scale);
    }
    if (inverse) f = -f;
    inv[static_cast<size_t>(p)] = 1.0f / f;
  }
  std::vector<float> cs(static_cast<size_t>(pairs)), sn(static_cast<size_t>(pairs));
  for (int64_t t = 0; t < rows; ++t) {
    const float pos = static_cast<float>(t) + static_cast<float>(pos0);
    for (int64_t p = 0; p < pairs; ++p) {
      const float theta = pos * inv[static_cast<size_t>(p)];
      cs[static_cast<size_t>(p)] = round_bf16(mlx_sincos(theta, false));
      sn[static_cast<size_t>(p)] = round_bf16(mlx_sincos(theta, true));
    }
    for (int64_t h = 0; h < heads; ++h) {
      uint16_t* row = x + (t * heads + h) * head_dim;
      for (int64_t p = 0; p < pairs; ++p) {
        const float x1 = bf16_to_f32(row[2 * p]), x2 = bf16_to_f32(row[2 * p + 1]);
        const float c = cs[static_cast<size_t>(p)], s = sn[static_cast<size_t>(p)];
        row[2 * p] = f32_to_bf16(round_bf16(x1 * c) - round_bf16(x2 * s));
        row[2 * p + 1] = f32_to_bf16(round_bf16(x1 * s) + round_bf16(x2 * c));
      }
    }
  }
}

void rms_norm_noweight(const uint16_t* x, int64_t m, int64_t d, float eps, uint16_t* out) {
  for (int64_t i = 0; i < m; ++i) {
    const uint16_t* xr = x + i * d;
    const float r = rms_scale(xr, d, eps);
    for (int64_t j = 0; j < d; ++j) out[i * d + j] = f32_to_bf16(bf16_to_f32(xr[j]) * r);
  }
}

namespace {

// Softmax over `rows` logits of one feature column (composed ops: max, exp(x - max), a
// sequential f32 sum, an f32 division), then each weight rounded to bf16; returns the bf16
// sum over rows of bf16(kv * weight), accumulated in f32 in row order.
uint16_t pool_column(const float* logits, const float* values, int64_t rows, float* e) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < rows; ++i) mx = std::max(mx, logits[i]);
  float total = 0.0f;
  for (int64_t i = 0; i < rows; ++i) {
    e[i] = mlx_exp(logits[i] - mx);
    total = total + e[i];
  }
  float acc = 0.0f;
  for (int64_t i = 0; i < rows; ++i) {
    const float w = round_bf16(e[i] / total);
    acc = acc + round_bf16(values[i] * w);
  }
  return f32_to_bf16(acc);
}

}  // namespace

void dsv4_pool_simple(const uint16_t* kv, const uint16_t* gate, const float* ape, int64_t windows,
                      int64_t r, int64_t d, uint16_t* out) {
  std::vector<float> logits(static_cast<size_t>(r)), values(logits.size()), e(logits.size());
  for (int64_t w = 0; w < windows; ++w) {
    const uint16_t* kw = kv + w * r * d;
    const uint16_t* gw = gate + w * r * d;
    for (int64_t j = 0; j < d; ++j) {
      for (int64_t i = 0; i < r; ++i) {
        logits[static_cast<size_t>(i)] = bf16_to_f32(gw[i * d + j]) + ape[i * d + j];
        values[static_cast<size_t>(i)] = bf16_to_f32(kw[i * d + j]);
      }
      out[w * d + j] = pool_column(logits.data(), values.data(), r, e.data());
    }
  }
}

void dsv4_pool_overlap(const uint16_t* kv, const uint16_t* gate, const float* ape,
                       const uint8_t* has_prev, int64_t windows, int64_t r, int64_t hd,
                       uint16_t* out) {
  const int64_t width = 2 * hd;
  std::vector<float> logits(static_cast<size_t>(2 * r)), values(logits.size()), e(logits.size());
  // gate' = bf16(gate + bf16(ape)) for a row at relative position k of its window.
  auto gated = [&](const uint16_t* g, int64_t k, int64_t j) {
    return round_bf16(bf16_to_f32(g[k * width + j]) + round_bf16(ape[k * width + j]));
  };
  for (int64_t w = 0; w < windows; ++w) {
    const uint16_t* kw = kv + w * r * width;
    const uint16_t* gw = gate + w * r * width;
    const bool prev = has_prev[w] != 0;
    for (int64_t j = 0; j < hd; ++j) {
      for (int64_t k = 0; k < r; ++k) {
        if (prev) {
          logits[static_cast<size_t>(k)] = gated(gw - r * width, k, j);
          values[static_cast<size_t>(k)] = bf16_to_f32(kw[(k - r) * width + j]);
        } else {
          logits[static_cast<size_t>(k)] = -std::numeric_limits<float>::infinity();
          values[static_cast<size_t>(k)] = 0.0f;
        }
        logits[static_cast<size_t>(r + k)] = gated(gw, k, hd + j);
        values[static_cast<size_t>(r + k)] = bf16_to_f32(kw[k * width + hd + j]);
      }
      out[w * hd + j] = pool_column(logits.data(), values.data(), 2 * r, e.data());
    }
  }
}

}  // namespace hetero
