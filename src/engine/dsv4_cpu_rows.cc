// The CPU engine's per-row pieces of DeepSeek-V4 in the decoder's arithmetic. See dsv4_cpu_rows.h.
// Compiled, like dsv4_cpu.cc, without FMA contraction and without fast-math.
#include "engine/dsv4_cpu_rows.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "common/bf16.h"
#include "kernels/cpu_ops.h"
#include "kernels/mlx_math.h"

namespace hetero::dsv4_cpu_rows {
namespace {

constexpr float kBf16Lowest = -3.38953139e38f;  // finfo(bfloat16).min: a masked bf16 score

// logaddexp on bf16 operands, every step rounded to bf16 as the decoder's bf16 arrays are.
float logaddexp_bf16(float a, float b) {
  const float hi = a > b ? a : b, lo = a < b ? a : b;
  if (lo == -INFINITY || hi == INFINITY) return hi;
  const float d = round_bf16(lo - hi);
  const float e = round_bf16(mlx_exp(d));
  return round_bf16(hi + round_bf16(std::log1p(e)));
}

// mx.logsumexp over bf16 values: max and a sequential sum of exp in float32, rounded once.
float logsumexp_bf16(const float* v, int64_t n) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, v[i]);
  float tot = 0.0f;
  for (int64_t i = 0; i < n; ++i) tot = tot + mlx_exp(v[i] - mx);
  return std::isinf(mx) ? mx : round_bf16(std::log(tot) + mx);
}

}  // namespace

// MLX's float32 sigmoid: 1/(1 + exp|x|), mirrored for x >= 0.
float sigmoid_f32(float x) {
  const float y = 1.0f / (1.0f + mlx_exp(std::fabs(x)));
  return x < 0.0f ? y : 1.0f - y;
}

// mx.argpartition(-score, kth=k-1)[:k] on the CPU: nth_element over iota with the decoder's
// comparator, so the k indices come out in the decoder's order (its later sums follow it).
void top_k_indices(const float* score, int64_t n, int64_t k, uint32_t* out,
                   std::vector<uint32_t>& idx) {
  idx.resize(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0u);
  auto less = [score](uint32_t a, uint32_t b) {
    const float v1 = -score[a], v2 = -score[b];
    if (std::isnan(v1)) return false;
    if (std::isnan(v2)) return true;
    return v1 < v2 || (v1 == v2 && a < b);
  };
  std::nth_element(idx.begin(), idx.begin() + (k - 1), idx.end(), less);
  std::copy(idx.begin(), idx.begin() + k, out);
}

// collapse: x[t] = bf16(sum_k pre[t][k] * h[t][k]) with pre/post/comb from the Sinkhorn-
// normalised mixing of rms_norm(h[t] as one hc*hidden row) @ fn^T.
HcMix hc_collapse(const Dsv4HyperConnection& hc, const Dsv4Config& c, const uint16_t* h, int64_t n,
                  uint16_t* x) {
  const int64_t K = c.hc_mult, H = c.hidden, W = K * H, mix = c.hc_mix();
  const float eps = static_cast<float>(c.hc_eps), norm_eps = static_cast<float>(c.rms_norm_eps);
  const float inv_w = static_cast<float>(1.0 / static_cast<double>(W));
  std::vector<float> z(static_cast<size_t>(n * W)), mixes(static_cast<size_t>(n * mix), 0.0f);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n; ++t) {
    const uint16_t* row = h + t * W;
    float s = 0.0f;
    for (int64_t i = 0; i < W; ++i) {
      const float v = bf16_to_f32(row[i]);
      s = s + v * v;
    }
    const float r = 1.0f / std::sqrt(s * inv_w + norm_eps);
    for (int64_t i = 0; i < W; ++i) z[static_cast<size_t>(t * W + i)] = bf16_to_f32(row[i]) * r;
  }
  std::vector<float> fnt(static_cast<size_t>(W * mix));
  for (int64_t j = 0; j < mix; ++j)
    for (int64_t i = 0; i < W; ++i) fnt[static_cast<size_t>(i * mix + j)] = hc.fn[j * W + i];
  gemm_ordered(z.data(), n, W, fnt.data(), mix, mixes.data());

  HcMix out;
  out.pre.resize(static_cast<size_t>(n * K));
  out.post.resize(static_cast<size_t>(n * K));
  out.comb.resize(static_cast<size_t>(n * K * K));
  const float s0 = hc.scale[0], s1 = hc.scale[1], s2 = hc.scale[2];
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n; ++t) {
    const float* m = &mixes[static_cast<size_t>(t * mix)];
    float* pre = &out.pre[static_cast<size_t>(t * K)];
    float* post = &out.post[static_cast<size_t>(t * K)];
    float* cb = &out.comb[static_cast<size_t>(t * K * K)];
    for (int64_t k = 0; k < K; ++k) {
      pre[k] = sigmoid_f32(m[k] * s0 + hc.base[k]) + eps;
      post[k] = 2.0f * sigmoid_f32(m[K + k] * s1 + hc.base[K + k]);
    }
    for (int64_t j = 0; j < K; ++j) {  // softmax over each row (the primitive: e * (1/sum))
      float* r = cb + j * K;
      float mx = -INFINITY;
      for (int64_t k = 0; k < K; ++k) {
        r[k] = m[2 * K + j * K + k] * s2 + hc.base[2 * K + j * K + k];
        mx = std::max(mx, r[k]);
      }
      float tot = 0.0f;
      for (int64_t k = 0; k < K; ++k) tot = tot + (r[k] = mlx_exp(r[k] - mx));
      const float inv = 1.0f / tot;
      for (int64_t k = 0; k < K; ++k) r[k] = r[k] * inv + eps;
    }
    // Sinkhorn: each line of comb (a column: (1, K); a row: (K, 1)) divided by its sum + eps,
    // the sum in the line's order.
    auto normalize = [&](int64_t line_stride, int64_t step) {
      for (int64_t a = 0; a < K; ++a) {
        float* v = cb + a * line_stride;
        float s = 0.0f;
        for (int64_t b = 0; b < K; ++b) s = s + v[b * step];
        const float d = s + eps;
        for (int64_t b = 0; b < K; ++b) v[b * step] = v[b * step] / d;
      }
    };
    normalize(1, K);
    for (int64_t it = 1; it < c.hc_sinkhorn_iters; ++it) {
      normalize(K, 1);  // rows
      normalize(1, K);  // columns
    }
    for (int64_t d = 0; d < H; ++d) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc = acc + pre[k] * bf16_to_f32(h[t * W + k * H + d]);
      x[t * H + d] = f32_to_bf16(acc);
    }
  }
  return out;
}

// expand: h'[t][k] = bf16(post[k] * y[t] + sum_j comb[j][k] * h[t][j]), all in float32.
void hc_expand(const HcMix& m, const Dsv4Config& c, const uint16_t* y, int64_t n, uint16_t* h) {
  const int64_t K = c.hc_mult, H = c.hidden;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n; ++t) {
    uint16_t* row = h + t * K * H;
    const float* post = &m.post[static_cast<size_t>(t * K)];
    const float* cb = &m.comb[static_cast<size_t>(t * K * K)];
    std::vector<float> res(static_cast<size_t>(K * H));
    for (int64_t i = 0; i < K * H; ++i) res[static_cast<size_t>(i)] = bf16_to_f32(row[i]);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t d = 0; d < H; ++d) {
        float mixed = 0.0f;
        for (int64_t j = 0; j < K; ++j)
          mixed = mixed + cb[j * K + k] * res[static_cast<size_t>(j * H + d)];
        row[k * H + d] = f32_to_bf16(post[k] * bf16_to_f32(y[t * H + d]) + mixed);
      }
  }
}

// One query row of the decoder's SDPA fallback over `keys` (K = V): bf16 scores, masked scores
// at finfo(bf16).min, the sink as logit column 0 of a precise softmax, bf16 weights, bf16 output.
void sdpa_row(const uint16_t* q, const std::vector<const uint16_t*>& keys, const uint8_t* visible,
              int64_t d, float scale_b, float sink, float* s, uint16_t* out) {
  const int64_t S = static_cast<int64_t>(keys.size());
  std::vector<float> qs(static_cast<size_t>(d));
  for (int64_t i = 0; i < d; ++i)
    qs[static_cast<size_t>(i)] = round_bf16(bf16_to_f32(q[i]) * scale_b);
  float mx = sink;
  for (int64_t j = 0; j < S; ++j) {
    if (visible && !visible[j]) {
      s[j] = kBf16Lowest;
      continue;
    }
    float acc = 0.0f;
    for (int64_t i = 0; i < d; ++i)
      acc = acc + qs[static_cast<size_t>(i)] * bf16_to_f32(keys[j][i]);
    s[j] = round_bf16(acc);
    mx = std::max(mx, s[j]);
  }
  float tot = mlx_exp(sink - mx);
  for (int64_t j = 0; j < S; ++j) tot = tot + (s[j] = mlx_exp(s[j] - mx));
  const float inv = 1.0f / tot;
  std::vector<float> o(static_cast<size_t>(d), 0.0f);
  for (int64_t j = 0; j < S; ++j) {
    if (visible && !visible[j]) continue;  // weight exactly 0: adds nothing
    const float p = round_bf16(s[j] * inv);
    for (int64_t i = 0; i < d; ++i)
      o[static_cast<size_t>(i)] = o[static_cast<size_t>(i)] + p * bf16_to_f32(keys[j][i]);
  }
  for (int64_t i = 0; i < d; ++i) out[i] = f32_to_bf16(o[static_cast<size_t>(i)]);
}

// One query row of the decoder's sparse path: local keys and the gathered pooled rows get
// separate bf16 logsumexps, merged with the sink by bf16 logaddexp; weights exp(s - lse) in bf16.
void sparse_row(const uint16_t* q, const std::vector<const uint16_t*>& local,
                const uint8_t* local_visible, const std::vector<const uint16_t*>& pooled,
                const uint8_t* pooled_visible, int64_t d, float scale_b, float sink,
                uint16_t* out) {
  const int64_t S = static_cast<int64_t>(local.size()), P = static_cast<int64_t>(pooled.size());
  std::vector<float> qs(static_cast<size_t>(d)), ls(static_cast<size_t>(S)),
      ps(static_cast<size_t>(P));
  for (int64_t i = 0; i < d; ++i)
    qs[static_cast<size_t>(i)] = round_bf16(bf16_to_f32(q[i]) * scale_b);
  auto scores = [&](const std::vector<const uint16_t*>& rows, const uint8_t* vis, float* s) {
    for (size_t j = 0; j < rows.size(); ++j) {
      float acc = 0.0f;
      for (int64_t i = 0; i < d; ++i)
        acc = acc + qs[static_cast<size_t>(i)] * bf16_to_f32(rows[j][i]);
      s[j] = (vis && !vis[j]) ? kBf16Lowest : round_bf16(acc);
    }
  };
  scores(local, local_visible, ls.data());
  scores(pooled, pooled_visible, ps.data());
  float lse = logaddexp_bf16(logsumexp_bf16(ls.data(), S), logsumexp_bf16(ps.data(), P));
  lse = logaddexp_bf16(lse, sink);
  auto weighted = [&](const std::vector<const uint16_t*>& rows, const float* s) {
    std::vector<float> o(static_cast<size_t>(d), 0.0f);
    for (size_t j = 0; j < rows.size(); ++j) {
      const float p = round_bf16(mlx_exp(round_bf16(s[j] - lse)));
      if (p == 0.0f) continue;
      for (int64_t i = 0; i < d; ++i)
        o[static_cast<size_t>(i)] = o[static_cast<size_t>(i)] + p * bf16_to_f32(rows[j][i]);
    }
    return o;
  };
  const std::vector<float> a = weighted(local, ls.data()), b = weighted(pooled, ps.data());
  for (int64_t i = 0; i < d; ++i)
    out[i] =
        f32_to_bf16(round_bf16(a[static_cast<size_t>(i)]) + round_bf16(b[static_cast<size_t>(i)]));
}

// mlx-vlm's HISA selection (index_block, index_keep) for the queries of one call, once a ratio-4
// layer holds at least index_block * index_keep pooled rows. Stage one scores the means of
// blocks of `block` pooled rows (only whole blocks), stage two the rows of the best `keep`
// blocks; the top k rows come back as pooled row indices in the decoder's order. A one-token
// call runs Indexer._hisa_select: bf16 block means, per head relu(dot) * scale * w, no mask. A
// longer call runs hisa_kernel.hisa_select: float32 block means, per head relu(dot) * (w *
// scale), blocks and rows at or past the query's visible count scored -1e30. Dots are float32
// sums in ascending order (the decoder's float32 matmul), head sums in head order.
void hisa_select(const std::vector<HisaQuery>& queries, bool one_token, const uint16_t* pooled,
                 int64_t Np, int64_t heads, int64_t d, int64_t block, int64_t keep, int64_t k,
                 float scale, uint32_t* out) {
  const int64_t nb = Np / block, kb = std::min(keep, nb), cand = kb * block;
  // mx.mean: the sum (float32, row order) in the array's dtype, times 1/n in that dtype.
  std::vector<float> rep(static_cast<size_t>(nb * d));
  const float inv =
      one_token ? round_bf16(1.0f / static_cast<float>(block)) : 1.0f / static_cast<float>(block);
  for (int64_t j = 0; j < nb; ++j)
    for (int64_t dd = 0; dd < d; ++dd) {
      float acc = 0.0f;
      for (int64_t r = 0; r < block; ++r) acc = acc + bf16_to_f32(pooled[(j * block + r) * d + dd]);
      rep[static_cast<size_t>(j * d + dd)] =
          one_token ? round_bf16(round_bf16(acc) * inv) : acc * inv;
    }
  const int64_t m = static_cast<int64_t>(queries.size());
#pragma omp parallel for schedule(dynamic)
  for (int64_t i = 0; i < m; ++i) {
    const HisaQuery& qi = queries[static_cast<size_t>(i)];
    std::vector<float> qf(static_cast<size_t>(heads * d)), wk(static_cast<size_t>(heads));
    for (int64_t t = 0; t < heads * d; ++t) qf[static_cast<size_t>(t)] = bf16_to_f32(qi.q[t]);
    for (int64_t h = 0; h < heads; ++h) wk[static_cast<size_t>(h)] = qi.w[h] * scale;
    auto score = [&](const float* row) {
      float s = 0.0f;
      for (int64_t h = 0; h < heads; ++h) {
        float acc = 0.0f;
        for (int64_t dd = 0; dd < d; ++dd)
          acc = acc + qf[static_cast<size_t>(h * d + dd)] * row[dd];
        const float relu = acc > 0.0f ? acc : 0.0f;
        s = s + (one_token ? relu * scale * qi.w[h] : relu * wk[static_cast<size_t>(h)]);
      }
      return s;
    };
    std::vector<float> cs(static_cast<size_t>(nb)), fs(static_cast<size_t>(cand)),
        row(static_cast<size_t>(d));
    std::vector<uint32_t> blocks(static_cast<size_t>(kb)), sel(static_cast<size_t>(k)), scratch;
    std::vector<int64_t> pos(static_cast<size_t>(cand));
    for (int64_t j = 0; j < nb; ++j) {
      cs[static_cast<size_t>(j)] = score(&rep[static_cast<size_t>(j * d)]);
      if (!one_token && !(j * block < qi.visible)) cs[static_cast<size_t>(j)] = -1e30f;
    }
    top_k_indices(cs.data(), nb, kb, blocks.data(), scratch);
    for (int64_t c = 0; c < cand; ++c) {
      const int64_t p = blocks[static_cast<size_t>(c / block)] * block + c % block;
      pos[static_cast<size_t>(c)] = p;
      for (int64_t dd = 0; dd < d; ++dd)
        row[static_cast<size_t>(dd)] = bf16_to_f32(pooled[p * d + dd]);
      fs[static_cast<size_t>(c)] = score(row.data());
      if (!one_token && !(p < qi.visible)) fs[static_cast<size_t>(c)] = -1e30f;
    }
    top_k_indices(fs.data(), cand, k, sel.data(), scratch);
    for (int64_t t = 0; t < k; ++t)
      out[i * k + t] = static_cast<uint32_t>(pos[static_cast<size_t>(sel[static_cast<size_t>(t)])]);
  }
}

}  // namespace hetero::dsv4_cpu_rows
