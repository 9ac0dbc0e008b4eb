// Small random DeepSeek-V4 decoder weights, for tests that run the cache program without an
// export (tests/unit/dsv4_stream_test.cc on the CPU, tests/gpu/dsv4_program_gpu_test.cc against
// the GPU program): layers of the given ratios, projections dense bf16 or quantized the way the
// decoder holds them (mx: fp4 element values with power-of-two scales; affine: 4-bit integers
// with bf16 scales and biases). Values are finite and fixed by the seed.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "bridge/dsv4_program.h"
#include "common/bf16.h"
#include "kernels/dsv4_ops.h"

namespace hetero {

struct Dsv4TestShape {
  int64_t hidden = 32, head_dim = 16, index_head_dim = 8, window = 8, rope_dims = 4;
  std::vector<int64_t> ratios = {0, 4, 128};
  DecoderLinear::Mode mode = DecoderLinear::Mode::kDense;
  int64_t group = 32;  // quantized modes; divides hidden
  uint32_t seed = 7;
};

inline Dsv4DecoderWeights random_dsv4_weights(const Dsv4TestShape& shape = {}) {
  std::mt19937 rng(shape.seed);
  std::normal_distribution<float> nd(0.0f, 0.3f);
  const int64_t H = shape.hidden, hd = shape.head_dim, ihd = shape.index_head_dim;
  Dsv4DecoderWeights w;
  w.layout.family = "deepseek_v4";
  w.layout.fingerprint = "f00d";
  w.layout.hidden = H;
  w.layout.head_dim = hd;
  w.layout.kv_heads = 1;
  w.index_head_dim = w.layout.index_head_dim = ihd;
  w.window = w.layout.window = shape.window;
  w.rope_dims = shape.rope_dims;
  w.rope_theta = 10000.0;
  w.compress_rope_theta = 160000.0;
  w.freqs_local = dsv4_rope_freqs(static_cast<int>(shape.rope_dims), w.rope_theta, YarnScaling{});
  w.yarn.enabled = true;
  w.yarn.factor = 4;
  w.yarn.original_max_position_embeddings = 64;
  w.freqs_compressed =
      dsv4_rope_freqs(static_cast<int>(shape.rope_dims), w.compress_rope_theta, w.yarn);
  w.layout.ratios = shape.ratios;
  w.layout.layers = static_cast<int64_t>(shape.ratios.size());
  auto linear = [&](int64_t n, int64_t k) {
    DecoderLinear l;
    l.n = n, l.k = k, l.mode = shape.mode;
    if (shape.mode == DecoderLinear::Mode::kDense) {
      l.wt.resize(static_cast<size_t>(n * k));
      for (auto& v : l.wt) v = round_bf16(nd(rng));
      return l;
    }
    static const float kFp4[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    l.group = shape.group;
    l.q.resize(static_cast<size_t>(n * k));
    l.scales.resize(static_cast<size_t>(n * (k / l.group)));
    const bool mx = shape.mode == DecoderLinear::Mode::kMx;
    for (auto& v : l.q)
      v = mx ? (rng() % 2 ? -1.0f : 1.0f) * kFp4[rng() % 8] : static_cast<float>(rng() % 16);
    for (auto& s : l.scales)
      s = mx ? std::ldexp(1.0f, -3 - static_cast<int>(rng() % 4))
             : round_bf16(0.01f + 0.02f * static_cast<float>(rng() % 1000) / 1000.0f);
    if (!mx) {
      l.biases.resize(l.scales.size());
      for (size_t i = 0; i < l.biases.size(); ++i)
        l.biases[i] = round_bf16(-7.5f * l.scales[i] + 0.1f * nd(rng));
    }
    return l;
  };
  auto norm = [&](int64_t d) {
    Tensor t(DType::kBF16, {d});
    for (int64_t i = 0; i < d; ++i) t.data<uint16_t>()[i] = f32_to_bf16(1.0f + nd(rng));
    return t;
  };
  auto comp = [&](int64_t r, int64_t d) {
    Dsv4ProgramCompressor c;
    c.ratio = r, c.head_dim = d, c.out_dim = r == 4 ? 2 * d : d;
    c.wkv = linear(c.out_dim, H);
    c.wgate = linear(c.out_dim, H);
    c.ape.resize(static_cast<size_t>(r * c.out_dim));
    for (auto& v : c.ape) v = round_bf16(nd(rng));
    c.norm = norm(d);
    return c;
  };
  for (int64_t r : shape.ratios) {
    Dsv4ProgramLayer L;
    L.ratio = r;
    L.wkv = linear(hd, H);
    L.kv_norm = norm(hd);
    if (r > 0) L.pool = comp(r, hd);
    if (r == 4) L.index = comp(4, ihd), L.has_index = true;
    w.layers.push_back(std::move(L));
  }
  return w;
}

// T rows of a random attention input, bf16 [T, hidden].
inline std::vector<uint16_t> random_dsv4_x(int64_t T, int64_t hidden, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> x(static_cast<size_t>(T * hidden));
  for (auto& v : x) v = f32_to_bf16(nd(rng));
  return x;
}

}  // namespace hetero
