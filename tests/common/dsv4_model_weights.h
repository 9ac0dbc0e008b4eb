// A small random DeepSeek-V4 model built in memory (config and Dsv4Weights, dense bf16
// projections), and the helpers that run an engine over a chunk schedule and compare two
// engines' attention inputs layer by layer. Shared by tests/gpu/dsv4_cuda_test.cc and the
// layer benchmark's --refcheck (bench/gpu/dsv4_layer_bench.cc). Values are fixed by the seed.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "common/compare.h"
#include "common/tensor.h"
#include "engine/tap.h"
#include "model/dsv4.h"

namespace hetero {

// Every mechanism of the forward at small sizes: a hash-routed layer, ratio 0/4/128 layers, a
// 32-row window that a few hundred tokens wrap many times, index_topk 16 with HISA blocks of 8
// (keep 4) so that the plain and the HISA selection both run, sixteen indexer heads (few exact
// score ties), heads that do not fill the GPU kernel's group of 16.
// hash_routed: every layer routes by token id, so no expert choice depends on the arithmetic.
inline Dsv4Config tiny_dsv4_config(bool hash_routed = false) {
  Dsv4Config c;
  c.model_type = "deepseek_v4";
  c.vocab = 512, c.hidden = 256, c.layers = 5;
  c.heads = 8, c.head_dim = 128, c.rope_head_dim = 64;
  c.q_lora_rank = 128, c.o_groups = 2, c.o_lora_rank = 64;
  c.n_routed_experts = 8, c.n_shared_experts = 1, c.experts_per_tok = 2, c.moe_inter = 128;
  c.num_hash_layers = hash_routed ? 5 : 1;
  c.sliding_window = 32;
  c.index_n_heads = 16, c.index_head_dim = 128, c.index_topk = 16;
  c.index_block = 8, c.index_keep = 4;
  c.hc_mult = 4, c.hc_sinkhorn_iters = 20;
  c.rms_norm_eps = 1e-6, c.hc_eps = 1e-6;
  c.rope_theta = 10000.0, c.compress_rope_theta = 160000.0;
  c.routed_scaling_factor = 1.5, c.swiglu_limit = 10.0;
  c.norm_topk_prob = true;
  c.scoring_func = "sqrtsoftplus";
  c.yarn.enabled = true, c.yarn.factor = 16, c.yarn.original_max_position_embeddings = 64;
  c.compress_ratios = {0, 4, 128, 4, 0};
  return c;
}

inline Dsv4Weights random_dsv4_model(const Dsv4Config& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto mat = [&](int64_t rows, int64_t cols) {
    Tensor t(DType::kBF16, {rows, cols});
    const float s = 1.0f / std::sqrt(static_cast<float>(cols));
    for (int64_t i = 0; i < t.numel(); ++i) t.data<uint16_t>()[i] = f32_to_bf16(nd(rng) * s);
    return t;
  };
  auto norm = [&](int64_t d) {
    Tensor t(DType::kBF16, {d});
    for (int64_t i = 0; i < d; ++i) t.data<uint16_t>()[i] = f32_to_bf16(1.0f + 0.1f * nd(rng));
    return t;
  };
  auto f32s = [&](int64_t n, float scale, float offset) {
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = offset + scale * nd(rng);
    return v;
  };
  auto hc = [&] {
    Dsv4HyperConnection h;
    const int64_t W = c.hc_mult * c.hidden;
    h.fn = f32s(c.hc_mix() * W, 1.0f / std::sqrt(static_cast<float>(W)), 0.0f);
    h.base = f32s(c.hc_mix(), 0.1f, 0.0f);
    h.scale = f32s(3, 0.1f, 1.0f);
    return h;
  };
  auto comp = [&](int32_t ratio, int64_t d) {
    Dsv4Compressor cm;
    cm.ratio = ratio, cm.head_dim = d, cm.out_dim = ratio == 4 ? 2 * d : d;
    cm.wkv = mat(cm.out_dim, c.hidden);
    cm.wgate = mat(cm.out_dim, c.hidden);
    cm.ape = f32s(ratio * cm.out_dim, 0.3f, 0.0f);
    cm.norm = norm(d);
    return cm;
  };
  Dsv4Weights w;
  w.config = c;
  w.embed = mat(c.vocab, c.hidden);
  for (int64_t i = 0; i < w.embed.numel(); ++i)  // unit-scale embeddings
    w.embed.data<uint16_t>()[i] =
        f32_to_bf16(bf16_to_f32(w.embed.data<uint16_t>()[i]) * std::sqrt(float(c.hidden)));
  const int64_t H = c.hidden, hd = c.head_dim, E = c.n_routed_experts, I = c.moe_inter;
  const int64_t S = c.moe_inter * c.n_shared_experts;
  for (int64_t l = 0; l < c.layers; ++l) {
    Dsv4LayerWeights L;
    L.ratio = c.compress_ratios[static_cast<size_t>(l)];
    L.attn_norm = norm(H), L.ffn_norm = norm(H);
    L.hc_attn = hc(), L.hc_ffn = hc();
    L.wq_a = mat(c.q_lora_rank, H), L.q_norm = norm(c.q_lora_rank);
    L.wq_b = mat(c.heads * hd, c.q_lora_rank);
    L.wkv = mat(hd, H), L.kv_norm = norm(hd);
    L.wo_a = mat(c.o_groups * c.o_lora_rank, c.heads * hd / c.o_groups);
    L.wo_b = mat(H, c.o_groups * c.o_lora_rank);
    L.attn_sink = f32s(c.heads, 1.0f, 0.0f);
    if (L.ratio > 0) L.compressor = comp(L.ratio, hd);
    if (L.ratio == 4) {
      L.index_compressor = comp(4, c.index_head_dim);
      L.index_wq_b = mat(c.index_n_heads * c.index_head_dim, c.q_lora_rank);
      L.index_weights_proj = mat(c.index_n_heads, H);
    }
    L.gate = mat(E, H);
    if (l < c.num_hash_layers) {
      L.tid2eid.resize(static_cast<size_t>(c.vocab * c.experts_per_tok));
      for (size_t i = 0; i < L.tid2eid.size(); ++i)  // distinct experts per token
        L.tid2eid[i] = static_cast<int32_t>(
            (i / c.experts_per_tok * 3 + i % c.experts_per_tok + rng() % 2 * c.experts_per_tok) %
            E);
    } else {
      L.gate_bias = f32s(E, 0.1f, 0.0f);
    }
    for (int64_t e = 0; e < E; ++e) {
      L.w1.push_back(mat(I, H));
      L.w2.push_back(mat(H, I));
      L.w3.push_back(mat(I, H));
    }
    if (S > 0) L.shared_w1 = mat(S, H), L.shared_w2 = mat(H, S), L.shared_w3 = mat(S, H);
    w.layers.push_back(std::move(L));
  }
  return w;
}

// Runs ids through `engine` (fresh) in the chunks of `schedule` (the last chunk takes the rest)
// and returns each layer's attention inputs, bf16 [T, hidden], from the host tap. With
// decoder_calls, the engine is told the decoder's calls first (set_decoder_calls), so a chunk
// may span several of them.
template <typename Engine>
std::vector<std::vector<uint16_t>> dsv4_taps(Engine& engine, const std::vector<int32_t>& ids,
                                             const std::vector<int64_t>& schedule, Status* status,
                                             const std::vector<int64_t>& decoder_calls = {}) {
  const Dsv4Config& c = engine.config();
  const int64_t T = static_cast<int64_t>(ids.size()), H = c.hidden;
  std::vector<std::vector<uint16_t>> out(static_cast<size_t>(c.layers),
                                         std::vector<uint16_t>(static_cast<size_t>(T * H)));
  engine.reset();
  *status = engine.set_decoder_calls(decoder_calls);
  if (!status->is_ok()) return out;
  auto tap = [&](const TapEvent& ev) {
    if (!ev.x_bf16) return;
    std::copy(ev.x_bf16, ev.x_bf16 + ev.n_tokens * ev.hidden,
              out[static_cast<size_t>(ev.layer)].begin() + ev.pos0 * H);
  };
  int64_t at = 0;
  for (size_t i = 0; at < T; ++i) {
    const int64_t len = i < schedule.size() ? std::min(schedule[i], T - at) : T - at;
    std::vector<int32_t> chunk(ids.begin() + at, ids.begin() + at + len);
    *status = engine.prefill_chunk(chunk, tap);
    if (!status->is_ok()) return out;
    at += len;
  }
  return out;
}

// Per-layer comparison of two runs' attention inputs.
inline std::vector<CompareReport> dsv4_compare_taps(const std::vector<std::vector<uint16_t>>& got,
                                                    const std::vector<std::vector<uint16_t>>& want,
                                                    int64_t hidden, const CompareSpec& spec) {
  std::vector<CompareReport> reports;
  for (size_t l = 0; l < got.size(); ++l) {
    const int64_t rows = static_cast<int64_t>(got[l].size()) / hidden;
    Tensor a(DType::kBF16, {rows, hidden}), b(DType::kBF16, {rows, hidden});
    std::copy(got[l].begin(), got[l].end(), a.data<uint16_t>());
    std::copy(want[l].begin(), want[l].end(), b.data<uint16_t>());
    reports.push_back(compare_tensors(a, b, spec));
  }
  return reports;
}

// Per-token cosine similarity of two bf16 [T, hidden] runs.
inline std::vector<double> dsv4_token_cosines(const std::vector<uint16_t>& got,
                                              const std::vector<uint16_t>& want, int64_t hidden) {
  std::vector<double> cos;
  for (size_t t = 0; t * hidden < got.size(); ++t) {
    double ab = 0, aa = 0, bb = 0;
    for (int64_t d = 0; d < hidden; ++d) {
      const double a = bf16_to_f32(got[t * hidden + d]), b = bf16_to_f32(want[t * hidden + d]);
      ab += a * b, aa += a * a, bb += b * b;
    }
    cos.push_back(aa > 0 && bb > 0 ? ab / std::sqrt(aa * bb) : (aa == bb ? 1.0 : 0.0));
  }
  return cos;
}

// How one layer's tokens compare: the fraction of tokens whose cosine falls below 0.9999 and
// below 0.999, and the worst token.
struct Dsv4TokenStats {
  double frac_below_4 = 0, frac_below_3 = 0, worst = 1;
  int64_t worst_token = -1;
};
inline Dsv4TokenStats dsv4_token_stats(const std::vector<uint16_t>& got,
                                       const std::vector<uint16_t>& want, int64_t hidden) {
  const std::vector<double> cos = dsv4_token_cosines(got, want, hidden);
  Dsv4TokenStats s;
  for (size_t t = 0; t < cos.size(); ++t) {
    s.frac_below_4 += cos[t] < 0.9999, s.frac_below_3 += cos[t] < 0.999;
    if (cos[t] < s.worst) s.worst = cos[t], s.worst_token = static_cast<int64_t>(t);
  }
  if (!cos.empty()) s.frac_below_4 /= cos.size(), s.frac_below_3 /= cos.size();
  return s;
}

// What a layer's attention inputs may deviate by between the CUDA engine and the CPU engine's
// dequant arithmetic (tests/gpu/dsv4_cuda_test.cc says why and what was measured).
struct Dsv4Tolerance {
  double min_layer_cosine;  // over all of a layer's elements
  double max_frac_below_4;  // tokens with cosine < 0.9999
  double max_frac_below_3;  // tokens with cosine < 0.999
};
// Every layer routed by token id (tiny_dsv4_config(true)): only indexer choices can flip.
constexpr Dsv4Tolerance kDsv4HashRoutedTolerance = {0.9993, 0.75, 0.15};
// Score-routed layers (tiny_dsv4_config(false)): expert choices flip too.
constexpr Dsv4Tolerance kDsv4ScoreRoutedTolerance = {0.99, 1.0, 0.30};

inline bool dsv4_within(const Dsv4Tolerance& tol, double layer_cosine, const Dsv4TokenStats& s) {
  return layer_cosine >= tol.min_layer_cosine && s.frac_below_4 <= tol.max_frac_below_4 &&
         s.frac_below_3 <= tol.max_frac_below_3;
}

}  // namespace hetero
