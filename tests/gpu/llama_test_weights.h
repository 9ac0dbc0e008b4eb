// Small llama-family models with random weights, built in memory, for the GPU tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/bf16.h"
#include "model/llama.h"
#include "model/llama_rope.h"
#include "model/mlx_quant.h"

namespace hetero {

inline Tensor random_tensor(std::vector<int64_t> shape, float scale, float mean,
                            std::mt19937& rng) {
  Tensor t(DType::kBF16, std::move(shape));
  std::normal_distribution<float> nd(mean, scale);
  uint16_t* p = t.data<uint16_t>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = f32_to_bf16(nd(rng));
  return t;
}

// A small model of the given variant with random weights (norm weights near 1), its rope built
// from `scaling` (a config's rope_scaling; null: plain) as the loader builds it.
inline LlamaWeights tiny_llama(const std::string& type, int64_t head_dim, uint32_t seed,
                               const nlohmann::json& scaling = nullptr, bool traditional = false) {
  std::mt19937 rng(seed);
  LlamaWeights w;
  LlamaConfig& c = w.config;
  c.model_type = type;
  c.heads = 4, c.kv_heads = 2, c.head_dim = head_dim, c.hidden = 256, c.intermediate = 512;
  c.layers = 3, c.vocab = 512, c.rms_norm_eps = 1e-5, c.rope_theta = 10000.0;
  c.qkv_bias = type == "qwen2";
  c.qk_norm = type == "qwen3";
  c.tie_embeddings = type != "llama";
  c.rope_config.scaling = scaling, c.rope_config.base = c.rope_theta;
  c.rope_config.dims = head_dim, c.rope_config.traditional = traditional;
  c.rope_config.max_position_embeddings = 131072;
  c.rope = llama_rope(c.rope_config).value();
  const int64_t H = c.hidden, qd = c.heads * head_dim, kvd = c.kv_heads * head_dim;
  const float ws = 1.f / std::sqrt(static_cast<float>(H));
  w.embed = random_tensor({c.vocab, H}, 1.f, 0.f, rng);
  w.final_norm = random_tensor({H}, 0.1f, 1.f, rng);
  if (!c.tie_embeddings) w.lm_head = random_tensor({c.vocab, H}, ws, 0.f, rng);
  for (int64_t l = 0; l < c.layers; ++l) {
    LlamaLayerWeights L;
    L.input_norm = random_tensor({H}, 0.1f, 1.f, rng);
    L.post_norm = random_tensor({H}, 0.1f, 1.f, rng);
    L.wq = random_tensor({qd, H}, ws, 0.f, rng);
    L.wk = random_tensor({kvd, H}, ws, 0.f, rng);
    L.wv = random_tensor({kvd, H}, ws, 0.f, rng);
    L.wo = random_tensor({H, qd}, 1.f / std::sqrt(static_cast<float>(qd)), 0.f, rng);
    L.w_gate = random_tensor({c.intermediate, H}, ws, 0.f, rng);
    L.w_up = random_tensor({c.intermediate, H}, ws, 0.f, rng);
    L.w_down = random_tensor({H, c.intermediate},
                             1.f / std::sqrt(static_cast<float>(c.intermediate)), 0.f, rng);
    if (c.qkv_bias) {
      L.bq = random_tensor({qd}, 0.1f, 0.f, rng);
      L.bk = random_tensor({kvd}, 0.1f, 0.f, rng);
      L.bv = random_tensor({kvd}, 0.1f, 0.f, rng);
    }
    if (c.qk_norm) {
      L.q_norm = random_tensor({head_dim}, 0.1f, 1.f, rng);
      L.k_norm = random_tensor({head_dim}, 0.1f, 1.f, rng);
    }
    w.layers.push_back(std::move(L));
  }
  return w;
}

// The family's variants, and the rope scalings checkpoints carry: llama3 on traditional pairs,
// YaRN with its input scale, linear.
struct VariantCase {
  std::string type;
  nlohmann::json scaling;
  bool traditional = false;
};
inline std::vector<VariantCase> variant_cases() {
  return {{"llama", nullptr},
          {"qwen2", nullptr},
          {"qwen3", nullptr},
          {"llama",
           {{"rope_type", "llama3"}, {"factor", 8.0}, {"original_max_position_embeddings", 64}},
           true},
          {"qwen2", {{"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 128}}},
          {"qwen3", {{"type", "linear"}, {"factor", 2.0}}}};
}

// mlx-lm's affine quantization of one dense bf16 [n, k] weight (per group of `group` columns:
// scale = (max - min) / (2^bits - 1), bias = min, both bf16; q = round((w - bias) / scale)),
// as `mlx_lm.convert -q` stores it.
inline QuantizedWeight quantize_affine(const Tensor& w, int64_t bits, int64_t group) {
  QuantizedWeight a;
  a.n = w.shape[0], a.k = w.shape[1], a.group = group, a.bits = bits;
  a.q.resize(static_cast<size_t>(a.n * a.k));
  a.scales.resize(static_cast<size_t>(a.n * a.k / group));
  a.biases.resize(a.scales.size());
  const float top = static_cast<float>((1 << bits) - 1);
  const uint16_t* p = w.data<uint16_t>();
  for (int64_t r = 0; r < a.n; ++r)
    for (int64_t g = 0; g < a.k / group; ++g) {
      float lo = INFINITY, hi = -INFINITY;
      for (int64_t c = g * group; c < (g + 1) * group; ++c)
        lo = std::min(lo, bf16_to_f32(p[r * a.k + c])),
        hi = std::max(hi, bf16_to_f32(p[r * a.k + c]));
      const float s = bf16_to_f32(f32_to_bf16(std::max((hi - lo) / top, 1e-6f)));
      const float b = bf16_to_f32(f32_to_bf16(lo));
      a.scales[static_cast<size_t>(r * (a.k / group) + g)] = s;
      a.biases[static_cast<size_t>(r * (a.k / group) + g)] = b;
      for (int64_t c = g * group; c < (g + 1) * group; ++c)
        a.q[static_cast<size_t>(r * a.k + c)] =
            std::clamp(std::nearbyint((bf16_to_f32(p[r * a.k + c]) - b) / s), 0.0f, top);
    }
  return a;
}

// An mx quantization (mxfp4: e2m1, mxfp8: e4m3; groups of 32) of one dense bf16 [n, k] weight:
// per group a power-of-two scale that brings its largest magnitude within the code's range, each
// value the nearest code. Not necessarily MLX's own choice of scale, but a weight of that form:
// what the programs and engines must compute with.
inline QuantizedWeight quantize_mx(const Tensor& w, int64_t bits) {
  QuantizedWeight a;
  a.mode = bits == 4 ? "mxfp4" : "mxfp8";
  a.n = w.shape[0], a.k = w.shape[1], a.group = 32, a.bits = bits;
  a.q.resize(static_cast<size_t>(a.n * a.k));
  a.scales.resize(static_cast<size_t>(a.n * a.k / a.group));
  std::vector<float> codes;
  for (int c = 0; c < (1 << bits); ++c) {
    const float v = bits == 4 ? fp4_e2m1_to_f32(static_cast<uint8_t>(c))
                              : fp8_e4m3_to_f32(static_cast<uint8_t>(c));
    if (std::isfinite(v)) codes.push_back(v);
  }
  const float top = *std::max_element(codes.begin(), codes.end());
  const uint16_t* p = w.data<uint16_t>();
  for (int64_t r = 0; r < a.n; ++r)
    for (int64_t g = 0; g < a.k / a.group; ++g) {
      float amax = 0;
      for (int64_t c = g * a.group; c < (g + 1) * a.group; ++c)
        amax = std::max(amax, std::fabs(bf16_to_f32(p[r * a.k + c])));
      const float s = std::exp2(std::ceil(std::log2(std::max(amax, 1e-30f) / top)));
      a.scales[static_cast<size_t>(r * (a.k / a.group) + g)] = s;
      for (int64_t c = g * a.group; c < (g + 1) * a.group; ++c) {
        const float v = bf16_to_f32(p[r * a.k + c]) / s;
        float best = codes.front();
        for (float code : codes)
          if (std::fabs(code - v) < std::fabs(best - v)) best = code;
        a.q[static_cast<size_t>(r * a.k + c)] = best;
      }
    }
  return a;
}

// Every projection of w quantized so (mode "affine", "mxfp4" or "mxfp8"; the mx modes take
// groups of 32), in place of its dense tensor, as a converted checkpoint loads (model/llama.h).
inline void quantize_projections(LlamaWeights& w, int64_t bits, int64_t group,
                                 const std::string& mode = "affine") {
  for (LlamaLayerWeights& L : w.layers) {
    for (auto [t, q] : {std::pair{&L.wq, &L.qwq},
                        {&L.wk, &L.qwk},
                        {&L.wv, &L.qwv},
                        {&L.wo, &L.qwo},
                        {&L.w_gate, &L.qw_gate},
                        {&L.w_up, &L.qw_up},
                        {&L.w_down, &L.qw_down}}) {
      *q = mode == "affine" ? quantize_affine(*t, bits, group) : quantize_mx(*t, bits);
      *t = Tensor();
    }
  }
  w.quantization = w.layers.front().qwq.describe();
}

inline std::vector<int32_t> random_ids(int64_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& id : ids) id = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
  return ids;
}

}  // namespace hetero
