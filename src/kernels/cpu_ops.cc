// CPU ops: see cpu_ops.h for the contract of each. This file must be compiled without FMA
// contraction (-ffp-contract=off) and without fast-math: the order of float operations here is
// the contract with the decoder.
#include "kernels/cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/bf16.h"
#include "kernels/mlx_math.h"

namespace hetero {
namespace {

typedef float V8 __attribute__((vector_size(32)));
constexpr int64_t kMr = 4, kNr = 16, kNc = 256;

inline V8 load8(const float* p) {
  V8 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void store8(float* p, V8 v) { __builtin_memcpy(p, &v, sizeof v); }

// One MR x 16 tile of C, all of K, in ascending k: acc = acc + a*b, separately rounded.
template <int MR>
void tile(const float* a, int64_t lda, int64_t k, const float* b, int64_t ldb, float* c,
          int64_t ldc) {
  V8 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = load8(c + r * ldc), acc[r][1] = load8(c + r * ldc + 8);
  for (int64_t l = 0; l < k; ++l) {
    const V8 b0 = load8(b + l * ldb), b1 = load8(b + l * ldb + 8);
    for (int r = 0; r < MR; ++r) {
      const float s = a[r * lda + l];
      const V8 av = {s, s, s, s, s, s, s, s};
      const V8 p0 = av * b0, p1 = av * b1;
      acc[r][0] = acc[r][0] + p0;
      acc[r][1] = acc[r][1] + p1;
    }
  }
  for (int r = 0; r < MR; ++r) store8(c + r * ldc, acc[r][0]), store8(c + r * ldc + 8, acc[r][1]);
}

void scalar_block(const float* a, int64_t lda, int64_t rows, int64_t k, const float* b, int64_t ldb,
                  int64_t cols, float* c, int64_t ldc) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      float acc = c[i * ldc + j];
      for (int64_t l = 0; l < k; ++l) {
        const float p = a[i * lda + l] * b[l * ldb + j];
        acc = acc + p;
      }
      c[i * ldc + j] = acc;
    }
}

typedef uint32_t U8 __attribute__((vector_size(32)));

// round_bf16 on 8 lanes: round to nearest even, NaN kept quiet (common/bf16.h's rounding).
inline V8 round_bf16_v(V8 f) {
  U8 b;
  __builtin_memcpy(&b, &f, sizeof b);
  const U8 rounded = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
  const U8 quiet = (b & 0xffff0000u) | 0x00400000u;
  const U8 nan = (U8)((b & 0x7fffffffu) > 0x7f800000u);  // all ones in NaN lanes
  const U8 r = (rounded & ~nan) | (quiet & nan);
  V8 out;
  __builtin_memcpy(&out, &r, sizeof out);
  return out;
}

}  // namespace

// The decoder's addmm epilogue: the bias joins the float32 sum, then one bf16 rounding.
void round_linear_output(const std::vector<float>& acc, int64_t m, int64_t n, const uint16_t* bias,
                         uint16_t* out) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      float v = acc[static_cast<size_t>(i * n + j)];
      if (bias) v = v + bf16_to_f32(bias[j]);
      out[i * n + j] = f32_to_bf16(v);
    }
}

void gemm_ordered(const float* a, int64_t m, int64_t k, const float* b, int64_t n, float* c) {
  const int64_t n_full = n / kNr * kNr;
  const int64_t col_blocks = (n_full + kNc - 1) / kNc;
  const int64_t row_blocks = (m + kMr - 1) / kMr;
#pragma omp parallel for collapse(2) schedule(static) if (m * n * k > (1 << 16))
  for (int64_t cb = 0; cb < col_blocks; ++cb) {
    for (int64_t rb = 0; rb < row_blocks; ++rb) {
      const int64_t j0 = cb * kNc, j1 = std::min(n_full, j0 + kNc), i = rb * kMr;
      const int64_t rows = std::min(kMr, m - i);
      for (int64_t j = j0; j < j1; j += kNr) {
        const float* ap = a + i * k;
        float* cp = c + i * n + j;
        switch (rows) {
          case 4:
            tile<4>(ap, k, k, b + j, n, cp, n);
            break;
          case 3:
            tile<3>(ap, k, k, b + j, n, cp, n);
            break;
          case 2:
            tile<2>(ap, k, k, b + j, n, cp, n);
            break;
          default:
            tile<1>(ap, k, k, b + j, n, cp, n);
            break;
        }
      }
    }
  }
  if (n_full < n) scalar_block(a, k, m, k, b + n_full, n, n - n_full, c + n_full, n);
}

void linear_decoder_order(const uint16_t* x, int64_t m, int64_t k, const float* wt, int64_t n,
                          const uint16_t* bias, uint16_t* out) {
  std::vector<float> xf(static_cast<size_t>(m * k)), acc(static_cast<size_t>(m * n), 0.0f);
  for (int64_t i = 0; i < m * k; ++i) xf[static_cast<size_t>(i)] = bf16_to_f32(x[i]);
  gemm_ordered(xf.data(), m, k, wt, n, acc.data());
  round_linear_output(acc, m, n, bias, out);
}

void linear_quantized_mx(const uint16_t* x, int64_t m, int64_t k, const float* q,
                         const float* scales, int64_t n, int64_t group, uint16_t* out) {
  const int64_t groups = k / group, blocks = m / 8;
  // Rows in blocks of 8, one vector lane per row: each lane runs the scalar recipe below, the
  // same operations in the same order, so the blocking changes no bit. xt: [block][k][8].
  std::vector<float> xt(static_cast<size_t>(blocks * k * 8));
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t t = 0; t < k; ++t)
      for (int64_t l = 0; l < 8; ++l)
        xt[static_cast<size_t>((b * k + t) * 8 + l)] = bf16_to_f32(x[(b * 8 + l) * k + t]);
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < n; ++j) {
    const float* qj = q + j * k;
    const float* sj = scales + j * groups;
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = xt.data() + b * k * 8;
      V8 sum = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t g = 0; g < groups; ++g) {
        V8 gsum = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t t = g * group; t < (g + 1) * group; ++t)
          gsum = round_bf16_v(gsum + round_bf16_v(load8(xb + t * 8) * qj[t]));
        sum = round_bf16_v(sum + round_bf16_v(sj[g] * gsum));
      }
      float lanes[8];
      store8(lanes, sum);
      for (int64_t l = 0; l < 8; ++l) out[(b * 8 + l) * n + j] = f32_to_bf16(lanes[l]);
    }
    for (int64_t i = blocks * 8; i < m; ++i) {
      const uint16_t* xi = x + i * k;
      float sum = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        float gsum = 0.0f;
        for (int64_t t = g * group; t < (g + 1) * group; ++t)
          gsum = round_bf16(gsum + round_bf16(bf16_to_f32(xi[t]) * qj[t]));
        sum = round_bf16(sum + round_bf16(sj[g] * gsum));
      }
      out[i * n + j] = f32_to_bf16(sum);
    }
  }
}

void add_bias_bf16(uint16_t* out, int64_t m, int64_t n, const uint16_t* bias) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      out[i * n + j] = f32_to_bf16(bf16_to_f32(out[i * n + j]) + bf16_to_f32(bias[j]));
}

void linear_quantized_affine(const uint16_t* x, int64_t m, int64_t k, const float* q,
                             const float* scales, const float* biases, int64_t n, int64_t group,
                             uint16_t* out) {
  // Each output's sum runs in ascending t as the decoder's does; kBlock outputs advance side by
  // side (independent sums: one vector lane each), their weights interleaved [t][block].
  constexpr int64_t kBlock = 16;
  const int64_t groups = k / group;
#pragma omp parallel for schedule(static)
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t nj = std::min(kBlock, n - j0);
    std::vector<float> w(static_cast<size_t>(k * kBlock), 0.0f);
    for (int64_t jj = 0; jj < nj; ++jj) {
      const int64_t j = j0 + jj;
      const float* qj = q + j * k;
      for (int64_t t = 0; t < k; ++t) {
        const int64_t g = j * groups + t / group;
        w[static_cast<size_t>(t * kBlock + jj)] =
            round_bf16(round_bf16(scales[g] * qj[t]) + biases[g]);
      }
    }
    for (int64_t i = 0; i < m; ++i) {
      const uint16_t* xi = x + i * k;
      float sum[kBlock] = {};
      for (int64_t t = 0; t < k; ++t) {
        const float xv = bf16_to_f32(xi[t]);
        const float* wt = &w[static_cast<size_t>(t * kBlock)];
        for (int64_t jj = 0; jj < kBlock; ++jj)
          sum[jj] = round_bf16(sum[jj] + round_bf16(xv * wt[jj]));
      }
      for (int64_t jj = 0; jj < nj; ++jj) out[i * n + j0 + jj] = f32_to_bf16(sum[jj]);
    }
  }
}

std::vector<float> transposed_f32(const uint16_t* w, int64_t n, int64_t k) {
  std::vector<float> out(static_cast<size_t>(n * k));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < k; ++j) out[static_cast<size_t>(j * n + i)] = bf16_to_f32(w[i * k + j]);
  return out;
}

float rms_scale(const uint16_t* x, int64_t d, float eps) {
  const float inv_n = static_cast<float>(1.0 / static_cast<double>(d));
  float s = 0.0f;
  for (int64_t j = 0; j < d; ++j) {
    const float v = bf16_to_f32(x[j]);
    const float sq = v * v;
    s = s + sq;
  }
  return 1.0f / std::sqrt(s * inv_n + eps);
}

void rms_norm(const uint16_t* x, int64_t m, int64_t d, const uint16_t* w, float eps,
              uint16_t* out) {
  for (int64_t i = 0; i < m; ++i) {
    const uint16_t* xr = x + i * d;
    const float r = rms_scale(xr, d, eps);
    for (int64_t j = 0; j < d; ++j) {
      const float y = round_bf16(bf16_to_f32(xr[j]) * r);
      out[i * d + j] = f32_to_bf16(y * bf16_to_f32(w[j]));
    }
  }
}

std::vector<float> rope_inverse_frequencies(const RopeSpec& r) {
  const int64_t half = r.dims / 2;
  std::vector<float> inv(static_cast<size_t>(half));
  if (!r.freqs.empty()) {
    for (int64_t i = 0; i < half; ++i) inv[static_cast<size_t>(i)] = 1.0f / r.freqs[i];
    return inv;
  }
  const float c = std::log(r.base) / static_cast<float>(half);
  for (int64_t i = 0; i < half; ++i)
    inv[static_cast<size_t>(i)] = mlx_exp(static_cast<float>(-i) * c);
  return inv;
}

void rope_apply(uint16_t* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t pos0,
                const RopeSpec& r) {
  const int64_t half = r.dims / 2;
  const std::vector<float> inv = rope_inverse_frequencies(r);
  const float in_scale = round_bf16(r.input_scale);
  // Rotate-half pairs (i, i + half); traditional pairs (2i, 2i + 1).
  const int64_t stride = r.traditional ? 2 : 1, second = r.traditional ? 1 : half;
  std::vector<float> cs(static_cast<size_t>(half)), sn(static_cast<size_t>(half));
  for (int64_t t = 0; t < tokens; ++t) {
    // The decoder multiplies the position by scale even when it is 1 (a no-op then).
    const float pos = (static_cast<float>(t) + static_cast<float>(pos0)) * r.scale;
    for (int64_t i = 0; i < half; ++i) {
      const float theta = pos * inv[static_cast<size_t>(i)];
      cs[static_cast<size_t>(i)] = round_bf16(mlx_sincos(theta, false));
      sn[static_cast<size_t>(i)] = round_bf16(mlx_sincos(theta, true));
    }
    for (int64_t h = 0; h < heads; ++h) {
      uint16_t* row = x + (t * heads + h) * head_dim;
      if (r.scales_input)
        for (int64_t j = 0; j < r.dims; ++j) row[j] = f32_to_bf16(bf16_to_f32(row[j]) * in_scale);
      for (int64_t i = 0; i < half; ++i) {
        uint16_t& a = row[i * stride];
        uint16_t& b = row[i * stride + second];
        const float x1 = bf16_to_f32(a), x2 = bf16_to_f32(b);
        const float co = cs[static_cast<size_t>(i)], si = sn[static_cast<size_t>(i)];
        a = f32_to_bf16(round_bf16(x1 * co) - round_bf16(x2 * si));
        b = f32_to_bf16(round_bf16(x1 * si) + round_bf16(x2 * co));
      }
    }
  }
}

void silu_mul(const uint16_t* gate, const uint16_t* up, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = bf16_to_f32(gate[i]);
    const float e = round_bf16(mlx_exp(std::fabs(g)));
    const float y = 1.0f / (1.0f + e);
    const float sig = round_bf16(g < 0 ? y : 1.0f - y);
    const float silu = round_bf16(g * sig);
    out[i] = f32_to_bf16(silu * bf16_to_f32(up[i]));
  }
}

void add_bf16(const uint16_t* a, const uint16_t* b, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
}

void attention_causal(const uint16_t* q, int64_t n, int64_t q_heads, const uint16_t* k,
                      const uint16_t* v, int64_t kv_heads, int64_t d, int64_t pos0, float scale,
                      uint16_t* out, int64_t window) {
  // Keys before `first` are outside every query's window. The decoder's buffer starts later or
  // earlier than ours, but a key it masks adds an exact +0 to sums that start at +0 (below), so
  // where the key range starts does not change a bit.
  const int64_t first = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  const int64_t total = pos0 + n - first, group = q_heads / kv_heads, kv_row = kv_heads * d;
  const float scale_b = round_bf16(scale);
#pragma omp parallel for schedule(dynamic)
  for (int64_t hq = 0; hq < q_heads; ++hq) {
    const int64_t g = hq / group;
    std::vector<float> qs(static_cast<size_t>(n * d)), kt(static_cast<size_t>(d * total)),
        vh(static_cast<size_t>(total * d)), s(static_cast<size_t>(n * total), 0.0f),
        o(static_cast<size_t>(n * d), 0.0f);
    for (int64_t t = 0; t < total; ++t)
      for (int64_t j = 0; j < d; ++j) {
        kt[static_cast<size_t>(j * total + t)] = bf16_to_f32(k[(first + t) * kv_row + g * d + j]);
        vh[static_cast<size_t>(t * d + j)] = bf16_to_f32(v[(first + t) * kv_row + g * d + j]);
      }
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < d; ++j)
        qs[static_cast<size_t>(t * d + j)] =
            round_bf16(bf16_to_f32(q[(t * q_heads + hq) * d + j]) * scale_b);
    // Scores: each a d-long sum in ascending order (masked ones are computed and discarded).
    gemm_ordered(qs.data(), n, d, kt.data(), total, s.data());
    for (int64_t i = 0; i < n; ++i) {
      float* row = s.data() + i * total;
      const int64_t end = pos0 + i + 1 - first;  // keys [lo, end) of the range are visible
      const int64_t lo = window > 0 ? std::max<int64_t>(0, end - window) : 0;
      float mx = -INFINITY;
      for (int64_t j = lo; j < end; ++j) mx = std::max(mx, row[j] = round_bf16(row[j]));
      // Masked keys contribute exactly 0 to the sum and to the output (exp underflows to 0),
      // and adding +0 never changes a float sum that started at +0, so they are skipped.
      float tot = 0.0f;
      for (int64_t j = lo; j < end; ++j) {
        row[j] = mlx_exp(row[j] - mx);
        tot = tot + row[j];
      }
      const float inv = 1.0f / tot;
      for (int64_t j = 0; j < lo; ++j) row[j] = 0.0f;
      for (int64_t j = lo; j < end; ++j) row[j] = round_bf16(row[j] * inv);
      for (int64_t j = end; j < total; ++j) row[j] = 0.0f;
    }
    gemm_ordered(s.data(), n, total, vh.data(), d, o.data());
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < d; ++j)
        out[(t * q_heads + hq) * d + j] = f32_to_bf16(o[static_cast<size_t>(t * d + j)]);
  }
}

}  // namespace hetero
