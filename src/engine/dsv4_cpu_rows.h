// The DeepSeek-V4 CPU engine's row-level pieces, each in the decoder's arithmetic (mlx-vlm's
// deepseek_v4 on MLX's CPU backend): the hyper-connections' collapse and expand, one query row of
// the dense and the sparse attention, HISA's two-stage selection, and the decoder's top-k order.
// They hold no state; the engine (dsv4_cpu.cc) owns the caches and calls them. Like the engine,
// this code is compiled without FMA contraction and without fast-math.
#pragma once

#include <cstdint>
#include <vector>

#include "model/dsv4.h"

namespace hetero::dsv4_cpu_rows {

// MLX's float32 sigmoid.
float sigmoid_f32(float x);

// mx.argpartition(-score, kth=k-1)[:k]: the k best indices in the decoder's order. `idx` is
// scratch.
void top_k_indices(const float* score, int64_t n, int64_t k, uint32_t* out,
                   std::vector<uint32_t>& idx);

// A hyper-connection's mixing for n tokens of K = hc_mult streams.
struct HcMix {
  std::vector<float> pre, post, comb;  // [n][hc], [n][hc], [n][hc][hc] (comb[j][k] at j*hc+k)
};
// Collapses h [n][hc][hidden] into x [n][hidden] and returns the mixing for hc_expand.
HcMix hc_collapse(const Dsv4HyperConnection& hc, const Dsv4Config& c, const uint16_t* h, int64_t n,
                  uint16_t* x);
// Expands a block's output y [n][hidden] back into h with the mixing of its collapse.
void hc_expand(const HcMix& m, const Dsv4Config& c, const uint16_t* y, int64_t n, uint16_t* h);

// One query row of the dense SDPA fallback over `keys` (K = V); `s` is [keys] scratch.
void sdpa_row(const uint16_t* q, const std::vector<const uint16_t*>& keys, const uint8_t* visible,
              int64_t d, float scale_b, float sink, float* s, uint16_t* out);
// One query row of the sparse path over local keys and gathered pooled rows.
void sparse_row(const uint16_t* q, const std::vector<const uint16_t*>& local,
                const uint8_t* local_visible, const std::vector<const uint16_t*>& pooled,
                const uint8_t* pooled_visible, int64_t d, float scale_b, float sink, uint16_t* out);

// One query of HISA's selection.
struct HisaQuery {
  const uint16_t* q;  // [heads][head_dim] bf16, roped
  const float* w;     // [heads]: bf16 weights_proj output * heads^-0.5
  int64_t visible;    // pooled rows this query may see (the longer-call mask)
};
// The top k pooled rows of each query, k a query, into out [queries][k].
void hisa_select(const std::vector<HisaQuery>& queries, bool one_token, const uint16_t* pooled,
                 int64_t Np, int64_t heads, int64_t d, int64_t block, int64_t keep, int64_t k,
                 float scale, uint32_t* out);

}  // namespace hetero::dsv4_cpu_rows
