// DeepSeek-V4 ops in the decoder's arithmetic (mlx-vlm 0.7.10's deepseek_v4 on MLX 0.32.4's CPU
// backend): the interleaved RoPE with precomputed frequencies (mx.fast.rope, traditional, freqs),
// the weightless per-head rms_norm, and the compressor's window pooling (simple for ratio 128,
// overlapping for ratio 4). Shared by the cache program (which must match the decoder bit for
// bit) and the CPU prefill engine. Recipes and their evidence: docs/findings/dsv4-mlx-numerics.md.
#pragma once

#include <cstdint>
#include <vector>

namespace hetero {

struct YarnScaling {
  bool enabled = false;
  double factor = 1.0;
  double original_max_position_embeddings = 0.0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
};

// The rope's `_freqs` (one f32 per rotated pair, rope_dims/2 of them) exactly as the decoder's
// DeepseekV4RoPE computes them: 1/inv_freq with inv_freq = 1/base^(2i/dims), YaRN-blended when
// enabled, every step in f32 as MLX's CPU ops do.
std::vector<float> dsv4_rope_freqs(int rope_dims, double base, const YarnScaling& yarn);

// In place, x laid out [rows][heads][head_dim] bf16: rotates the last 2*freqs.size() features of
// every head as interleaved pairs; row t sits at position pos0 + t. freq_scale divides the
// frequencies (the compressors pass their ratio r and pos0 = pool_base / r); inverse negates them
// (the attention output's de-rotation). Features before the rotated ones are left untouched,
// which is what the decoder's +inf "no-rope" frequencies amount to.
void dsv4_rope(uint16_t* x, int64_t rows, int64_t heads, int64_t head_dim, int64_t pos0,
               const std::vector<float>& freqs, int freq_scale, bool inverse);

// mx.fast.rms_norm(x, None, eps): y = bf16(x * 1/sqrt(mean(x^2) + eps)), no weight multiply.
void rms_norm_noweight(const uint16_t* x, int64_t m, int64_t d, float eps, uint16_t* out);

// Ratio-128 pooling of `windows` complete windows of r rows: per feature,
// w = bf16(softmax_f32(gate + ape) over the r rows), pooled = bf16 sum of bf16(kv * w) over rows.
// kv, gate: [windows * r][d] bf16; ape: [r][d] (values, already as the decoder holds them);
// out: [windows][d] bf16 (before the norm and the rope).
void dsv4_pool_simple(const uint16_t* kv, const uint16_t* gate, const float* ape, int64_t windows,
                      int64_t r, int64_t d, uint16_t* out);

// Ratio-4 pooling with the overlap lane. Rows are 2*hd wide; gate' = bf16(gate + bf16(ape)).
// Window w pools 2r rows of hd features: the A half ([:hd]) of window w-1's rows and the B half
// ([hd:]) of its own, with w = softmax_precise(gate') in bf16 and a bf16 row sum. has_prev[w] = 0
// gives window w an empty A lane (kv 0, gate -inf), as the decoder does for the first window
// completed by a call; when has_prev[w] != 0 the rows of window w-1 must be readable just
// before window w's (kv - r*2*hd). out: [windows][hd] bf16.
void dsv4_pool_overlap(const uint16_t* kv, const uint16_t* gate, const float* ape,
                       const uint8_t* has_prev, int64_t windows, int64_t r, int64_t hd,
                       uint16_t* out);

}  // namespace hetero
