// GPU ops against the CPU ops, bit for bit (the CPU ops are proven against the decoder, so this
// chains the GPU to the decoder's arithmetic). Skips itself, with the reason, without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "common/bf16.h"
#include "cuda_test_base.h"
#include "kernels/cpu_ops.h"
#include "kernels/cuda/device_rope.h"
#include "kernels/cuda/ops.h"
#include "model/llama_rope.h"

namespace hetero {
namespace {

class CudaOps : public CudaDeviceTest {};

template <typename T>
T* to_device(const std::vector<T>& v) {
  T* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, v.size() * sizeof(T) + 16), cudaSuccess);
  cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  return d;
}

template <typename T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> v(n);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost);
  return v;
}

size_t count_diff(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  size_t d = 0;
  for (size_t i = 0; i < a.size(); ++i) d += a[i] != b[i];
  return d;
}

TEST_F(CudaOps, LinearIsBitIdentical) {
  for (auto [m, k, n] : {std::tuple{1, 576, 192}, {129, 576, 1536}, {37, 1536, 576}, {5, 33, 19}}) {
    auto x = random_bf16(size_t(m) * k, 1.f, 1), w = random_bf16(size_t(n) * k, 0.05f, 2),
         bias = random_bf16(n, 0.1f, 3);
    std::vector<float> wt(size_t(k) * n), xf(size_t(m) * k);
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < k; ++j) wt[size_t(j) * n + i] = bf16_to_f32(w[size_t(i) * k + j]);
    for (size_t i = 0; i < xf.size(); ++i) xf[i] = bf16_to_f32(x[i]);
    std::vector<uint16_t> cpu(size_t(m) * n);
    linear_decoder_order(x.data(), m, k, wt.data(), n, bias.data(), cpu.data());
    float *dx = to_device(xf), *dw = to_device(wt),
          *dc = to_device(std::vector<float>(size_t(m) * n, 0.f));
    uint16_t *db = to_device(bias), *dout = to_device(std::vector<uint16_t>(size_t(m) * n));
    cuda::gemm_ordered(dx, m, k, dw, n, dc, nullptr);
    cuda::round_linear_output(dc, m, n, db, dout, nullptr);
    EXPECT_EQ(count_diff(to_host(dout, cpu.size()), cpu), 0u) << m << "x" << k << "x" << n;
    // The same sums as FMAs, where the check finds every product exact (it must, here).
    int* flags = to_device(std::vector<int>(4, -1));
    cuda::exact_products_flag(to_device(x), int64_t(m) * k, cuda::weight_range(wt.data(), k * n),
                              flags, flags + 3, nullptr);
    ASSERT_EQ(to_host(flags + 3, 1)[0], 1) << "products of bf16 values of this range are exact";
    cudaMemset(dc, 0, size_t(m) * n * 4);
    cuda::gemm_ordered(dx, m, k, dw, n, dc, nullptr, flags + 3);
    cuda::round_linear_output(dc, m, n, db, dout, nullptr);
    EXPECT_EQ(count_diff(to_host(dout, cpu.size()), cpu), 0u)
        << "fma " << m << "x" << k << "x" << n;
    for (void* p : {(void*)dx, (void*)dw, (void*)dc, (void*)db, (void*)dout, (void*)flags})
      cudaFree(p);
  }
}

// The check that lets gemm_ordered fuse multiply-adds says yes exactly when every product is
// exact in float32: down to a last product bit of 2^-149, below 2^128, all finite, weights that
// are bf16 values.
TEST_F(CudaOps, ExactProductsFlagHoldsItsBounds) {
  auto bits = [](int biased_exp, int mantissa = 0) {
    return uint16_t((biased_exp << 7) | mantissa);
  };
  auto flag = [&](std::vector<uint16_t> x, std::vector<float> w) {
    int* f = to_device(std::vector<int>(4, -1));
    uint16_t* dx = to_device(x);
    cuda::exact_products_flag(dx, int64_t(x.size()),
                              cuda::weight_range(w.data(), int64_t(w.size())), f, f + 3, nullptr);
    const int v = to_host(f + 3, 1)[0];
    cudaFree(f), cudaFree(dx);
    return v;
  };
  const float w_small = std::ldexp(1.f, -20);  // biased 107: last bit 2^-27
  // x with biased exponent 12: last bit 2^-122, and -122 - 27 = -149: exact.
  EXPECT_EQ(flag({bits(127), bits(12, 5), 0x8000}, {1.f, w_small, 0.f}), 1);
  // One step lower (2^-150): a product could round.
  EXPECT_EQ(flag({bits(127), bits(11, 5)}, {1.f, w_small}), 0);
  // Subnormal x counts as the smallest normal exponent's last bit (2^-133).
  EXPECT_EQ(flag({bits(0, 3)}, {std::ldexp(1.f, -10)}), 0);  // w's last bit 2^-17: -150
  EXPECT_EQ(flag({bits(0, 3)}, {std::ldexp(1.f, -9)}), 1);   // ... 2^-16: -149
  // Overflow: 2^127 * [1, 2) could reach 2^128; 2^127 * [0.5, 1) cannot.
  EXPECT_EQ(flag({bits(254)}, {1.f}), 0);
  EXPECT_EQ(flag({bits(254)}, {0.5f}), 1);
  // Non-finite x, a weight with more than bf16's bits.
  EXPECT_EQ(flag({bits(255)}, {1.f}), 0);
  EXPECT_EQ(flag({bits(127)}, {1.f + std::ldexp(1.f, -12)}), 0);
  // Only zeros in x: every product is an exact zero.
  EXPECT_EQ(flag({0, 0x8000}, {1.f}), 1);
}

TEST_F(CudaOps, RmsNormRopeSiluAddAreBitIdentical) {
  const int m = 67, d = 576;
  auto x = random_bf16(size_t(m) * d, 2.f, 4), w = random_bf16(d, 0.5f, 5);
  std::vector<uint16_t> cpu(x.size());
  rms_norm(x.data(), m, d, w.data(), 1e-5f, cpu.data());
  uint16_t *dx = to_device(x), *dw = to_device(w), *dout = to_device(cpu);
  cuda::rms_norm(dx, m, d, dw, 1e-5f, dout, nullptr);
  EXPECT_EQ(count_diff(to_host(dout, cpu.size()), cpu), 0u) << "rms_norm";

  // Every rope shape the llama family has: base path (plain, linear), freqs path (llama3, yarn
  // with its input scale, proportional's +inf pairs), traditional pairs.
  const nlohmann::json scalings[] = {
      nullptr,
      {{"type", "linear"}, {"factor", 3.0}},
      {{"rope_type", "llama3"}, {"factor", 8.0}, {"original_max_position_embeddings", 8192}},
      {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 4096}},
      {{"rope_type", "proportional"}, {"partial_rotary_factor", 0.5}}};
  for (const nlohmann::json& scaling : scalings)
    for (bool traditional : {false, true}) {
      LlamaRopeConfig rc;
      rc.scaling = scaling, rc.base = 100000.0, rc.dims = 64, rc.traditional = traditional;
      const RopeSpec spec = llama_rope(rc).value();
      cuda::DeviceRope rope;
      ASSERT_TRUE(rope.upload(spec).is_ok());
      for (int64_t pos0 : {0, 2047, 100000}) {
        auto q = random_bf16(size_t(5) * 9 * 64, 1.f, 6);
        auto cq = q;
        rope_apply(cq.data(), 5, 9, 64, pos0, spec);
        uint16_t* dq = to_device(q);
        cuda::rope_apply(dq, 5, 9, 64, pos0, rope.table(), nullptr);
        EXPECT_EQ(count_diff(to_host(dq, q.size()), cq), 0u)
            << "rope " << describe_rope(rc) << (traditional ? " traditional" : "") << " at "
            << pos0;
        cudaFree(dq);
      }
    }

  auto g = random_bf16(4096, 3.f, 7), u = random_bf16(4096, 1.f, 8);
  std::vector<uint16_t> s(4096), a(4096);
  silu_mul(g.data(), u.data(), 4096, s.data());
  add_bf16(g.data(), u.data(), 4096, a.data());
  uint16_t *dg = to_device(g), *du = to_device(u), *ds = to_device(s), *da = to_device(a);
  cuda::silu_mul(dg, du, 4096, ds, nullptr);
  cuda::add_bf16(dg, du, 4096, da, nullptr);
  EXPECT_EQ(count_diff(to_host(ds, 4096), s), 0u) << "silu_mul";
  EXPECT_EQ(count_diff(to_host(da, 4096), a), 0u) << "add";
  for (void* p : {(void*)dx, (void*)dw, (void*)dout, (void*)dg, (void*)du, (void*)ds, (void*)da})
    cudaFree(p);
}

TEST_F(CudaOps, AttentionIsBitIdentical) {
  for (auto [n, pos0] : {std::pair{1, 0}, {7, 100}, {129, 0}, {33, 2016}}) {
    const int qh = 9, kvh = 3, d = 64, total = pos0 + n;
    auto q = random_bf16(size_t(n) * qh * d, 1.f, 9),
         k = random_bf16(size_t(total) * kvh * d, 1.f, 10),
         v = random_bf16(size_t(total) * kvh * d, 1.f, 11);
    std::vector<uint16_t> cpu(size_t(n) * qh * d);
    attention_causal(q.data(), n, qh, k.data(), v.data(), kvh, d, pos0, 0.125f, cpu.data());
    uint16_t *dq = to_device(q), *dk = to_device(k), *dv = to_device(v), *dout = to_device(cpu);
    float* scratch = to_device(std::vector<float>(size_t(qh) * n * total));
    cuda::attention_causal(dq, n, qh, dk, dv, kvh, d, pos0, 0.125f, scratch, dout, nullptr);
    EXPECT_EQ(count_diff(to_host(dout, cpu.size()), cpu), 0u) << "n=" << n << " pos0=" << pos0;
    for (void* p : {(void*)dq, (void*)dk, (void*)dv, (void*)dout, (void*)scratch}) cudaFree(p);
  }
}

}  // namespace
}  // namespace hetero
