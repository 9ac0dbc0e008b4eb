// Host references for the FP8 block-scaled formats of kernels/cuda/fp8_gemm.h, shared by the FP8
// GEMM tests: e4m3 rounding written from the format's definition, both quantizers in the device
// layouts, block-scaled test data, and a scoped device buffer.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/bf16.h"
#include "kernels/cuda/fp8_gemm.h"

namespace hetero::fp8_test {

using cuda::fp8_act_rows;
using cuda::fp8_blocks;
using cuda::fp8_weight_scale_ld;

// e4m3 (the "fn" variant: no infinities, max 448), round to nearest even, saturating: written
// from the format's definition, independently of cuda_fp8.h.
inline uint8_t e4m3_rn(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float a = std::fabs(x);
  if (a >= 448.f) return sign | 0x7e;
  if (a < 0.015625f)  // below 2^-6: subnormals, steps of 2^-9 (8 rounds up to the first normal)
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.f));
  int ex = 0;
  std::frexp(a, &ex);
  int e = ex - 1;  // a in [2^e, 2^(e+1))
  int m = static_cast<int>(std::nearbyint((std::ldexp(a, -e) - 1.f) * 8.f));
  if (m == 8) m = 0, ++e;
  return sign | static_cast<uint8_t>(((e + 7) << 3) | m);
}

inline double e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (b & 0x80) ? -v : v;
}

inline float block_scale(float amax) { return amax > 0.f ? amax / 448.f : 1.f; }

// Host quantization, in the device layouts.
struct HostFp8 {
  std::vector<uint8_t> q;
  std::vector<float> scale;
};

inline HostFp8 host_quantize_weight(const std::vector<uint16_t>& w, int64_t n, int64_t k) {
  const int64_t ld = fp8_weight_scale_ld(k);
  HostFp8 r{std::vector<uint8_t>(static_cast<size_t>(n * k)),
            std::vector<float>(static_cast<size_t>(fp8_blocks(n) * ld), 1.f)};
  for (int64_t bn = 0; bn < fp8_blocks(n); ++bn)
    for (int64_t bk = 0; bk < fp8_blocks(k); ++bk) {
      const int64_t r1 = std::min(n, (bn + 1) * 128), c1 = std::min(k, (bk + 1) * 128);
      float amax = 0.f;
      for (int64_t i = bn * 128; i < r1; ++i)
        for (int64_t j = bk * 128; j < c1; ++j)
          amax = std::max(amax, std::fabs(bf16_to_f32(w[static_cast<size_t>(i * k + j)])));
      const float s = block_scale(amax);
      r.scale[static_cast<size_t>(bn * ld + bk)] = s;
      for (int64_t i = bn * 128; i < r1; ++i)
        for (int64_t j = bk * 128; j < c1; ++j)
          r.q[static_cast<size_t>(i * k + j)] =
              e4m3_rn(bf16_to_f32(w[static_cast<size_t>(i * k + j)]) / s);
    }
  return r;
}

inline HostFp8 host_quantize_act(const std::vector<uint16_t>& x, int64_t m, int64_t k) {
  const int64_t rows = fp8_act_rows(m), groups = fp8_blocks(k);
  HostFp8 r{std::vector<uint8_t>(static_cast<size_t>(rows * k), 0),
            std::vector<float>(static_cast<size_t>(groups * rows), 1.f)};
  for (int64_t i = 0; i < m; ++i)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t c1 = std::min(k, (g + 1) * 128);
      float amax = 0.f;
      for (int64_t j = g * 128; j < c1; ++j)
        amax = std::max(amax, std::fabs(bf16_to_f32(x[static_cast<size_t>(i * k + j)])));
      const float s = block_scale(amax);
      r.scale[static_cast<size_t>(g * rows + i)] = s;
      for (int64_t j = g * 128; j < c1; ++j)
        r.q[static_cast<size_t>(i * k + j)] =
            e4m3_rn(bf16_to_f32(x[static_cast<size_t>(i * k + j)]) / s);
    }
  return r;
}

// bf16 [rows, cols] normal values, each 128x128 block (block_rows = 128) or each row's
// 128-column group (block_rows = 1) scaled by its own power of two in 2^-4..2^4. One block is
// all zero (scale 1 by definition).
inline std::vector<uint16_t> blocky_bf16(int64_t rows, int64_t cols, int64_t block_rows,
                                         uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> ex(-4, 4);
  const int64_t br = (rows + block_rows - 1) / block_rows, bc = fp8_blocks(cols);
  std::vector<float> mag(static_cast<size_t>(br * bc));
  for (auto& v : mag) v = std::ldexp(1.f, ex(rng));
  mag[std::min<size_t>(1, mag.size() - 1)] = 0.f;
  std::vector<uint16_t> v(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      v[static_cast<size_t>(i * cols + j)] =
          f32_to_bf16(nd(rng) * mag[static_cast<size_t>((i / block_rows) * bc + j / 128)]);
  return v;
}

// A device buffer freed at scope exit.
struct Dev {
  void* p = nullptr;
  explicit Dev(size_t bytes) { EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(bytes, 1)), cudaSuccess); }
  ~Dev() { cudaFree(p); }
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

template <class T>
void put(Dev& d, const std::vector<T>& v) {
  ASSERT_EQ(cudaMemcpy(d.p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
}
template <class T>
std::vector<T> get(const Dev& d, size_t n) {
  std::vector<T> v(n);
  EXPECT_EQ(cudaMemcpy(v.data(), d.p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

}  // namespace hetero::fp8_test
