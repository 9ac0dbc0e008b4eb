// CPU ops on bf16 activations, shared by the prefill engine and the cache programs. All of them
// reproduce the decoder's (MLX 0.32.4 CPU) arithmetic bit for bit — reduction order, rounding
// points, its exp and sin/cos — as established in docs/findings/mlx-cpu-numerics.md, while
// running fast: sums keep their order per output element and parallelism goes across outputs.
// linear_blas is the exception: OpenBLAS, float32 accumulation in its own order, kept for
// measurement (bench) and as the engine's --gemm=blas option.
// All pointers are row-major; no op allocates what the caller passes in. Thread-safe.
#pragma once

#include <cstdint>
#include <vector>

namespace hetero {

// C[M,N] += A[M,K] @ B[K,N] in float32; each C element adds its K products in ascending k, one
// rounding per add and no fused multiply-add (the reference order). Parallel over rows/columns.
// A bf16 [n, k] weight as float32 [k, n], the layout linear_decoder_order takes.
std::vector<float> transposed_f32(const uint16_t* w, int64_t n, int64_t k);

void gemm_ordered(const float* a, int64_t m, int64_t k, const float* b, int64_t n, float* c);

// out[m, n] = bf16(sum_k x[m,k] * w[n,k]) or bf16(sum + bias[n]) (bias added once, at the end).
// wt is float32 [k, n] (w transposed once at load).
void linear_decoder_order(const uint16_t* x, int64_t m, int64_t k, const float* wt, int64_t n,
                          const uint16_t* bias, uint16_t* out);
// Same contract with OpenBLAS (w float32 [n, k]); not bit-exact with the decoder.
void linear_blas(const uint16_t* x, int64_t m, int64_t k, const float* w, int64_t n,
                 const uint16_t* bias, uint16_t* out);

// out = bf16(acc[i, j] (+ bias[j])): the decoder's addmm epilogue (bias joins the float32 sum).
// MLX 0.32.4's CPU quantized matmul (x @ W^T with W quantized, bf16 activations): every
// product and every running sum is a bf16 operation. mx modes (mxfp4/mxfp8): per group,
// gsum += x*q in bf16, then sum += scale*gsum in bf16. Affine: w = bf16(bf16(scale*q) + bias),
// sum += x*w in bf16. q: element values [n, k] (fp4/fp8 values, or affine integers), scales
// (and biases) [n, k/group].
void linear_quantized_mx(const uint16_t* x, int64_t m, int64_t k, const float* q,
                         const float* scales, int64_t n, int64_t group, uint16_t* out);
void linear_quantized_affine(const uint16_t* x, int64_t m, int64_t k, const float* q,
                             const float* scales, const float* biases, int64_t n, int64_t group,
                             uint16_t* out);

void round_linear_output(const std::vector<float>& acc, int64_t m, int64_t n, const uint16_t* bias,
                         uint16_t* out);
// out[i, j] = bf16(out[i, j] + bias[j]) for out [m, n]: a QuantizedLinear's bias, added to its
// quantized matmul's bf16 output as a separate bf16 add.
void add_bias_bf16(uint16_t* out, int64_t m, int64_t n, const uint16_t* bias);

// RMSNorm over the last dim d of x [m, d], weight bf16 [d]. In place is allowed.
void rms_norm(const uint16_t* x, int64_t m, int64_t d, const uint16_t* w, float eps, uint16_t* out);
// The factor mx.fast.rms_norm scales one row by: 1/sqrt(sequential f32 sum of squares * (1/d)
// + eps), each step rounded as MLX's CPU backend rounds it.
float rms_scale(const uint16_t* x, int64_t d, float eps);

// mx.fast.rope as the decoder calls it (MLX's CPU fallback, docs/findings/rope-variants-in-mlx.md):
// either the base path (inverse frequencies from `base`) or the freqs path (one frequency per
// rotated pair; +inf leaves the pair as it is), the position multiplied by `scale`, and for the
// rope classes that scale their input first (YaRN's mscale, longrope) `input_scale` applied to
// the rotated dims, rounded to bf16 as the decoder rounds it.
struct RopeSpec {
  int64_t dims = 0;          // the leading dims of each head that rotate (even)
  bool traditional = false;  // pairs (2i, 2i+1) instead of (i, i + dims/2)
  float base = 10000.0f;     // base path, when freqs is empty
  float scale = 1.0f;        // position multiplier (linear scaling: 1/factor)
  std::vector<float> freqs;  // freqs path: dims/2 entries
  bool scales_input = false;
  float input_scale = 1.0f;  // x[..., :dims] *= bf16(input_scale) before the rotation

  bool operator==(const RopeSpec&) const = default;
};

// The per-pair inverse frequencies mx.fast.rope uses: mlx_exp(-i * logf(base) / (dims/2)) on the
// base path, 1/freqs[i] on the freqs path.
std::vector<float> rope_inverse_frequencies(const RopeSpec& r);

// Applies the rope in place to [tokens, heads, head_dim] bf16 rows, row t at position pos0 + t.
void rope_apply(uint16_t* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t pos0,
                const RopeSpec& r);

// out = bf16(silu(gate) * up) with the decoder's sigmoid. In place is allowed.
void silu_mul(const uint16_t* gate, const uint16_t* up, int64_t n, uint16_t* out);
// out = bf16(a + b). In place is allowed.
void add_bf16(const uint16_t* a, const uint16_t* b, int64_t n, uint16_t* out);

// Causal GQA attention for n queries at positions [pos0, pos0+n) over keys [0, pos0+n), or
// with window > 0 over the keys at (p - window, p] of each query p (mlx-lm's sliding layers).
// q: [n, q_heads, d] bf16 (roped); k, v: token-major caches [>= pos0+n, kv_heads, d] bf16;
// out: [n, q_heads, d] bf16. scale is rounded to bf16 first, as the decoder does.
void attention_causal(const uint16_t* q, int64_t n, int64_t q_heads, const uint16_t* k,
                      const uint16_t* v, int64_t kv_heads, int64_t d, int64_t pos0, float scale,
                      uint16_t* out, int64_t window = 0);

}  // namespace hetero
