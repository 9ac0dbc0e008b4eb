// The DeepSeek-V4 decoder's cache-program weights at DeepSeek-V4-Flash's shapes (hidden 4096,
// head_dim 512, window 128, rope 64, indexer 128), random, for layers of the given compression
// ratios: what the GPU benches feed the cache program with.
#pragma once

#include <cstdint>
#include <vector>

#include "bench_common.h"
#include "bridge/dsv4_program.h"
#include "common/bf16.h"

namespace hetero::bench {

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
