// Fast CUDA ops of the DeepSeek-V4 prefill forward (engine/cuda/dsv4_cuda.*): the GPU engine's
// own kernels for everything that is not a dense GEMM (those go to cuBLAS). Unlike ops.h and
// dsv4_ops.h these are not bit-identical twins of the CPU ops: sums run in parallel orders and
// attention uses tensor cores. Where cheap they keep the decoder's bf16 rounding points (scores,
// SwiGLU, the MoE weighting), so that the engine stays within a tight tolerance of the CPU
// reference (tests/gpu/dsv4_cuda_test.cc states it).
// All pointers are device pointers, bf16 is uint16_t; every op is enqueued on `stream`.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/status.h"

namespace hetero::cuda {

// Whether the forward's kernels take a model of these shapes (hidden size, hyper-connection copies,
// routed experts and experts per token; the attention's head_dim and the indexer's heads): the
// engine asks before it runs anything, the launchers assume it (a failing check aborts, a bug).
Status check_forward_shapes(int64_t hidden, int64_t hc, int64_t experts, int64_t top_k);
Status check_attention_shapes(int64_t head_dim, int64_t index_heads);
// Whether index_select takes `rows` compressed rows (HISA blocks of `block` rows keeping `keep`;
// block 0: no HISA): its per-query sort holds 8192 keys. failed_precondition names the numbers.
Status check_index_select(int64_t rows, int64_t block, int64_t keep);

// Deterministic pseudo-random fills (a hash of seed and index): normal-ish values of the given
// scale (the sum of four uniforms), for benchmark weights built on the device.
void fill_random_bf16(uint16_t* x, int64_t n, float scale, uint64_t seed, cudaStream_t stream);
void fill_random_f32(float* x, int64_t n, float scale, float offset, uint64_t seed,
                     cudaStream_t stream);
void fill_random_i32(int32_t* x, int64_t n, int32_t modulo, uint64_t seed, cudaStream_t stream);

// y = bf16(bf16(x * r) * w) per row (w may be null: no weight), r = 1/sqrt(mean(x^2) + eps).
// x [m, d]; in place allowed.
void fast_rms_norm(const uint16_t* x, int64_t m, int64_t d, const uint16_t* w, float eps,
                   uint16_t* out, cudaStream_t stream);
// fast_rms_norm over tokens * heads rows of d, then rope_pairs_only over them (heads a token,
// positions from pos0, not inverse): one pass where d is a multiple of 256, else the two kernels.
// The same values either way, up to the order of the norm's sum of squares.
void fast_rms_norm_rope(const uint16_t* x, int64_t tokens, int64_t heads, int64_t d,
                        const uint16_t* w, float eps, uint16_t* out, int64_t pos0,
                        const float* freqs, int64_t rope_pairs, int freq_scale,
                        cudaStream_t stream);

// dsv4_rope (kernels/cuda/dsv4_ops.h) over the rope pairs only, each pair one 32-bit access: the
// forward's q, kv and output carry 256 pairs a head of which 32 rotate, and the exact op rotates
// the rest by +-0 (the same values, up to the sign of a zero; an inf there stays inf where the
// exact op's product with 0 gives NaN). The rope pairs' arithmetic is the exact op's.
void rope_pairs_only(uint16_t* x, int64_t rows, int64_t heads, int64_t head_dim, int64_t pos0,
                     const float* freqs, int64_t rope_pairs, int freq_scale, bool inverse,
                     cudaStream_t stream);

// h [n][hc][hidden] = embed[ids[t]] for every copy.
void embed_rows(const uint16_t* embed, const int32_t* ids, int64_t n, int64_t hc, int64_t hidden,
                uint16_t* h, cudaStream_t stream);

// Hyper-connection mixing: for h [n][hc*hidden] bf16, mixes [n][mix] = (h @ fn^T) / rms(h) with
// fn [mix][hc*hidden] f32, then pre [n][hc], post [n][hc], comb [n][hc][hc] by the sigmoid /
// Sinkhorn recipe of the CPU engine; x [n][hidden] = bf16(sum_k pre[k] * h[k]).
struct HcParams {
  const float* fn;     // [mix][hc*hidden]
  const float* base;   // [mix]
  const float* scale;  // [3]
  int64_t hc, hidden, sinkhorn_iters;
  float eps, norm_eps;
};
// mix_out: f32 [n * hc_mix_floats(hc)], receives the mixes, pre/post/comb (its layout is
// private to these two functions).
void hc_collapse(const HcParams& p, const uint16_t* h, int64_t n, float* mix_out, uint16_t* x,
                 cudaStream_t stream);
// h[t][k] = bf16(post[k] * y[t] + sum_j comb[j][k] * h[t][j]).
void hc_expand(const HcParams& p, const float* mix_out, const uint16_t* y, int64_t n, uint16_t* h,
               cudaStream_t stream);
int64_t hc_mix_floats(int64_t hc);  // per token floats mix_out holds

// out [n][cols] = broadcast of bias [cols] (the C of a beta=1 GEMM that adds it in float32).
void broadcast_rows(const uint16_t* bias, int64_t n, int64_t cols, uint16_t* out,
                    cudaStream_t stream);

// gu [m][2*inter]: gate then up. act [m][inter] = silu(min(g, l)) * clip(u, -l, l) with the CPU
// engine's bf16 roundings; limit <= 0: no clamp.
void swiglu(const uint16_t* gu, int64_t m, int64_t inter, float limit, uint16_t* act,
            cudaStream_t stream);

// swiglu's act, never written, quantized as quantize_act_fp8_segments (fp8_gemm.h) quantizes act
// with k = inter: the same bytes and scales in one pass (the routed experts' w2 input: at 8K
// tokens of DeepSeek-V4-Flash ~400 MB a layer less to write and read). inter % 16 == 0.
void swiglu_quantize_fp8_segments(const uint16_t* gu, int64_t inter, float limit,
                                  const int32_t* off, const int32_t* pad, int64_t segments,
                                  int64_t total_rows, uint8_t* q, float* scale, cudaStream_t stream,
                                  bool tight_scales = false);

// MoE router: logits [n][E] bf16 -> inds [n][K], weights [n][K] (f32, normalised and scaled).
struct RouterParams {
  int64_t experts, top_k;
  int scoring;  // 0 sqrtsoftplus, 1 sigmoid, 2 softmax
  bool norm_topk_prob;
  float routed_scaling;
  const float* bias;       // [E] or null (hash routing)
  const int32_t* tid2eid;  // [vocab][K] or null (score routing)
};
void moe_route(const RouterParams& p, const uint16_t* logits, const int32_t* ids, int64_t n,
               int32_t* inds, float* weights, cudaStream_t stream);
// Groups the n*K slots by expert, stably: counts [E], offsets [E+1], perm [n*K] (row of the
// grouped layout -> slot), and xe [n*K][hidden] = x[slot / K] (xe null: no gathered copy).
void moe_group(const int32_t* inds, int64_t slots, int64_t top_k, int64_t experts,
               const uint16_t* x, int64_t hidden, int32_t* counts, int32_t* offsets, int32_t* perm,
               int32_t* slot_row, uint16_t* xe, cudaStream_t stream);
// out[t] = bf16(bf16(sum_k bf16(ye[slot_row[t*K+k]] * bf16(w))) + shared[t]) (shared may be null).
void moe_combine(const uint16_t* ye, const int32_t* slot_row, const float* weights,
                 const uint16_t* shared, int64_t n, int64_t top_k, int64_t hidden, uint16_t* out,
                 cudaStream_t stream);

// One call's attention over the local window and the compressed rows, with the sink as an extra
// logit: for query i (position off + i) and head h,
//   keys = local rows at positions (p - window, p] (lk holds positions lk_pos0 ...), then
//          compressed rows r < (p + 1) / ratio: all such rows (topk null), or the topk[i][*]
//          ones among them.
// q, out [m][heads][head_dim] bf16; keys are values too (one shared kv head). head_dim a multiple
// of 64, at most 512.
struct SparseAttnParams {
  const uint16_t* q;
  uint16_t* out;
  int64_t m, heads, head_dim;
  int64_t off, window;
  const uint16_t* lk;  // [..][head_dim]
  int64_t lk_pos0;
  const uint16_t* pooled;  // [pooled_rows][head_dim] or null
  int64_t pooled_rows, ratio;
  const uint32_t* topk;  // [m][k] or null
  int64_t k;
  const float* sinks;  // [heads] (bf16-rounded values)
  float scale;         // bf16-rounded 1/sqrt(head_dim)
  // Use the online-softmax kernel even where the two-pass kernel's scores fit in shared memory
  // (it otherwise runs only for longer key lists): lets the tests reach it.
  bool online_only = false;
  // The output's last derope_pairs pairs a head rotated back (rope_pairs_only, inverse, at
  // position off + i): in the two-pass kernel's epilogue, else by rope_pairs_only after it.
  const float* derope_freqs = nullptr;
  int64_t derope_pairs = 0;
};
void sparse_attention(const SparseAttnParams& p, cudaStream_t stream);

// The indexer's selection for one call of m queries (index head dim 128): top k pooled rows
// by sum_h relu(q_h . row) * scale * w_h, with the CPU engine's masks; HISA (block > 0) first
// keeps the best `keep` blocks of `block` rows by their mean rows (rep, from hisa_block_means).
// The pooled rows are scored on tensor cores (each dot and the head sum in another order than the
// CPU engine's, so a near-tie can order differently); the float32 block means as the CPU engine
// scores them. topk [m][k].
struct IndexSelectParams {
  const uint16_t* q;       // [m][heads][128], roped
  const uint16_t* w;       // [m][heads] weights_proj output (bf16)
  const uint16_t* pooled;  // [rows][128]
  int64_t m, heads, rows;
  int64_t off;  // position of query 0
  float scale, wscale;
  int64_t k;
  bool one_token;
  int64_t block, keep;  // HISA when block > 0
  const float* rep;     // [rows / block][128]
};
void index_select(const IndexSelectParams& p, uint32_t* topk, cudaStream_t stream);
void hisa_block_means(const uint16_t* pooled, int64_t rows, int64_t block, bool one_token,
                      float* rep, cudaStream_t stream);

}  // namespace hetero::cuda
