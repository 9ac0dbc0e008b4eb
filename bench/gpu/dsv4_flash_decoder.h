// The DeepSeek-V4 decoder's cache-program weights at DeepSeek-V4-Flash's shapes (hidden 4096,
// head_dim 512, window 128, rope 64, indexer 128), random, for layers of the given compression
// ratios: what the GPU benches feed the cache program with.
#pragma once

#include <cstdint>
#include <vector>

#include "bench_common.h"
#include "bridge/dsv4_program.h"
#include "common/bf16.h"
#include "model/dsv4.h"

namespace hetero::bench {

// DeepSeek-V4-Flash's configuration with its first `layers` layers (the official ratios).
inline Dsv4Config flash_config(int64_t layers) {
  Dsv4Config c;
  c.model_type = "deepseek_v4";
  c.vocab = 129280, c.hidden = 4096, c.layers = layers;
  c.heads = 64, c.head_dim = 512, c.rope_head_dim = 64;
  c.q_lora_rank = 1024, c.o_groups = 8, c.o_lora_rank = 1024;
  c.n_routed_experts = 256, c.n_shared_experts = 1, c.experts_per_tok = 6, c.moe_inter = 2048;
  c.num_hash_layers = 3;
  c.sliding_window = 128;
  c.index_n_heads = 64, c.index_head_dim = 128, c.index_topk = 512;
  c.index_block = 64, c.index_keep = 16;
  c.hc_mult = 4, c.hc_sinkhorn_iters = 20;
  c.rms_norm_eps = 1e-6, c.hc_eps = 1e-6;
  c.rope_theta = 10000.0, c.compress_rope_theta = 160000.0;
  c.routed_scaling_factor = 1.5, c.swiglu_limit = 10.0;
  c.norm_topk_prob = true;
  c.scoring_func = "sqrtsoftplus";
  c.yarn.enabled = true, c.yarn.factor = 16, c.yarn.original_max_position_embeddings = 65536;
  c.yarn.beta_fast = 32, c.yarn.beta_slow = 1;
  for (int64_t l = 0; l < layers; ++l)  // the official layout: 0, 0, then 4 and 128 alternating
    c.compress_ratios.push_back(l < 2 ? 0 : (l % 2 == 0 ? 4 : 128));
  return c;
}

inline DecoderLinear dense(int64_t n, int64_t k, Draw& d) {
  DecoderLinear l;
  l.n = n, l.k = k;
  l.wt.resize(static_cast<size_t>(n * k));
  // bf16 values, as the decoder's unquantized projections hold (its export widens them to f32).
  for (auto& v : l.wt) v = bf16_to_f32(f32_to_bf16(d.next(0.03f)));
  return l;
}

inline Tensor norm_weight(int64_t n, Draw& d) {
  Tensor t(DType::kBF16, {n});
  for (int64_t i = 0; i < n; ++i) t.data<uint16_t>()[i] = f32_to_bf16(1.0f + d.next(0.1f));
  return t;
}

inline Dsv4ProgramCompressor compressor(int64_t r, int64_t hd, int64_t hidden, Draw& d) {
  Dsv4ProgramCompressor c;
  c.ratio = r, c.head_dim = hd, c.out_dim = r == 4 ? 2 * hd : hd;
  c.wkv = dense(c.out_dim, hidden, d);
  c.wgate = dense(c.out_dim, hidden, d);
  c.ape.resize(static_cast<size_t>(r * c.out_dim));
  for (auto& v : c.ape) v = d.next(0.5f);
  c.norm = norm_weight(hd, d);
  return c;
}

inline Dsv4DecoderWeights flash_decoder_weights(const std::vector<int64_t>& ratios) {
  Draw d{0x9e3779b97f4a7c15ull};
  Dsv4DecoderWeights w;
  const int64_t H = 4096, hd = 512, ihd = 128;
  w.layout.family = "deepseek_v4";
  w.layout.hidden = H;
  w.layout.head_dim = hd;
  w.layout.kv_heads = 1;
  w.index_head_dim = w.layout.index_head_dim = ihd;
  w.window = w.layout.window = 128;
  w.rope_dims = 64;
  w.freqs_local = dsv4_rope_freqs(64, 10000.0, YarnScaling{});
  YarnScaling yarn;
  yarn.enabled = true;
  yarn.factor = 16;
  yarn.original_max_position_embeddings = 65536;
  w.freqs_compressed = dsv4_rope_freqs(64, 160000.0, yarn);
  w.layout.ratios = ratios;
  w.layout.layers = static_cast<int64_t>(ratios.size());
  for (int64_t r : ratios) {
    Dsv4ProgramLayer L;
    L.ratio = r;
    L.wkv = dense(hd, H, d);
    L.kv_norm = norm_weight(hd, d);
    if (r > 0) L.pool = compressor(r, hd, H, d);
    if (r == 4) L.index = compressor(4, ihd, H, d), L.has_index = true;
    w.layers.push_back(std::move(L));
  }
  return w;
}

}  // namespace hetero::bench
