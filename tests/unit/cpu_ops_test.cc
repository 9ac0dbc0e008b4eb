// CPU ops: the decoder-order GEMM is a strict ascending-k float32 sum (checked against a plain
// scalar loop bit for bit), and the engine GEMM agrees with it to bf16 rounding.
#include "kernels/cpu_ops.h"

#include <gtest/gtest.h>

#include <random>

#include "common/bf16.h"

namespace hetero {

TEST(CpuOps, DecoderOrderLinearIsSequentialSum) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t m = 5, k = 97, n = 13;
  std::vector<uint16_t> x(m * k), bias(n), out(m * n);
  std::vector<float> w(n * k), wt(k * n);
  for (auto& v : x) v = f32_to_bf16(nd(rng));
  for (auto& v : bias) v = f32_to_bf16(nd(rng));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < k; ++j) wt[j * n + i] = w[i * k + j] = round_bf16(nd(rng) * 0.1f);
  linear_decoder_order(x.data(), m, k, wt.data(), n, bias.data(), out.data());
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      volatile float acc = bf16_to_f32(bias[j]);  // volatile: one rounding per add, no reorder
      for (int64_t l = 0; l < k; ++l) acc = acc + bf16_to_f32(x[i * k + l]) * w[j * k + l];
      ASSERT_EQ(out[i * n + j], f32_to_bf16(acc)) << i << "," << j;
    }
  std::vector<uint16_t> blas(m * n);
  linear_blas(x.data(), m, k, w.data(), n, bias.data(), blas.data());
  for (int64_t i = 0; i < m * n; ++i)
    EXPECT_NEAR(bf16_to_f32(blas[i]), bf16_to_f32(out[i]),
                0.02f + 0.01f * std::fabs(bf16_to_f32(out[i])));
}

// A sliding layer's query at p sees keys (p - W, p]: the same bits as attention over just those
// keys, whatever else is in the cache and wherever the call starts (the decoder's buffer holds
// other masked rows, which add exact zeros).
TEST(CpuOps, WindowedAttentionIsAttentionOverTheWindowAlone) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t qh = 4, kvh = 2, d = 16, W = 5;
  for (int64_t pos0 : {0, 3, 9}) {
    const int64_t n = 7, total = pos0 + n;
    std::vector<uint16_t> q(n * qh * d), k(total * kvh * d), v(k.size()), out(q.size());
    for (auto* t : {&q, &k, &v})
      for (auto& x : *t) x = f32_to_bf16(nd(rng));
    attention_causal(q.data(), n, qh, k.data(), v.data(), kvh, d, pos0, 0.25f, out.data(), W);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = pos0 + i, first = std::max<int64_t>(0, p - W + 1), seen = p - first + 1;
      std::vector<uint16_t> one(qh * d);
      attention_causal(q.data() + i * qh * d, 1, qh, k.data() + first * kvh * d,
                       v.data() + first * kvh * d, kvh, d, seen - 1, 0.25f, one.data());
      for (int64_t j = 0; j < qh * d; ++j)
        ASSERT_EQ(out[i * qh * d + j], one[j]) << "pos0 " << pos0 << " query " << i;
    }
    // Without the window the last query sees all of the past: a different answer.
    std::vector<uint16_t> full(q.size());
    attention_causal(q.data(), n, qh, k.data(), v.data(), kvh, d, pos0, 0.25f, full.data());
    EXPECT_NE(std::vector<uint16_t>(full.end() - qh * d, full.end()),
              std::vector<uint16_t>(out.end() - qh * d, out.end()));
  }
}

TEST(CpuOps, RopeAtPositionZeroIsIdentity) {
  std::vector<uint16_t> x(2 * 3 * 8);
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = f32_to_bf16(0.25f * static_cast<float>(i % 7) - 0.5f);
  auto y = x;
  RopeSpec r;
  r.dims = 8;
  rope_apply(y.data(), 1, 3, 8, 0, r);
  for (size_t i = 0; i < 24; ++i) EXPECT_EQ(y[i], x[i]);
}

TEST(CpuOps, RmsNormOfConstantRowIsWeight) {
  std::vector<uint16_t> x(8, f32_to_bf16(3.0f)), w(8), out(8);
  for (int i = 0; i < 8; ++i) w[i] = f32_to_bf16(0.5f * i);
  rms_norm(x.data(), 1, 8, w.data(), 0.f, out.data());
  for (int i = 0; i < 8; ++i) EXPECT_EQ(out[i], w[i]);
}

}  // namespace hetero
