// Host references for the FP8 block-scaled formats of kernels/cuda/fp8_gemm.h, shared by the FP8
// GEMM tests: e4m3 rounding written from the format's definition, both quantizers in the device
// layouts, block-scaled test data, and a scoped device buffer.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
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

// One expert's output of a grouped GEMM against the float64 product of its dequantized operands
// (ref, and mag = sum |a b| per element) and against another kernel's output of the same
// operands, all `count` elements: the worst error over fp8_gemm_test's bound
// (|got - ref| <= 2^-8 |ref| + 2^-10 mag; 1 passes), the relative RMS against each, the share of
// elements bit-equal to the other kernel's; checked against the limits the grouped GEMM tests
// hold (the bf16 output's rounding alone is about 1.1e-3 relative RMS) and printed after `what`.
inline void expect_expert_agrees(const uint16_t* got, const double* ref, const double* mag,
                                 const uint16_t* other, int64_t count, const std::string& what) {
  double worst = 0, num = 0, den = 0, dn = 0;
  int64_t equal = 0;
  for (int64_t i = 0; i < count; ++i) {
    const double g = bf16_to_f32(got[i]), want = ref[i], o = bf16_to_f32(other[i]);
    const double bound = std::ldexp(std::fabs(want), -8) + std::ldexp(mag[i], -10) + 1e-30;
    worst = std::max(worst, std::fabs(g - want) / bound);
    num += (g - want) * (g - want), den += want * want;
    equal += g == o;
    dn += (g - o) * (g - o);
  }
  const double rel = std::sqrt(num / std::max(den, 1e-300));
  const double vs_other = std::sqrt(dn / std::max(den, 1e-300));
  std::printf(
      "[ %s ] worst/bound %.3f, rel rms vs float64 %.2e; vs the other kernel: %.1f%% "
      "equal, rel rms %.2e\n",
      what.c_str(), worst, rel, 100.0 * static_cast<double>(equal) / static_cast<double>(count),
      vs_other);
  EXPECT_GT(den, 0.0) << what << ": a zero reference tests nothing";
  EXPECT_LE(worst, 1.0) << what;
  EXPECT_LT(rel, 3e-3) << what;
  EXPECT_LT(vs_other, 3e-3) << what;
}

// The staging-slot check of the grouped GEMMs (two argument slots used in turn):
// launch(set, out) enqueues on the default stream one launch of argument set 0 or 1 writing `out`
// (bf16, out_bytes, of which the first `real` elements are the launch's). While a host callback
// holds the stream for 200 ms, sets 0, 1, 1 are queued (the third reusing the first's slot with
// other arguments), then set 0 again once the stream is free: the first and last outputs must be
// equal (a launch reading another's arguments, or not deterministic, would differ), the middle
// two equal, the sets' outputs different, and nothing past `real` written.
template <class Launch>
void check_queued_launches(Launch&& launch, size_t out_bytes, size_t real) {
  Dev o1(out_bytes), o2(out_bytes), o3(out_bytes), o4(out_bytes);
  for (Dev* o : {&o1, &o2, &o3, &o4}) ASSERT_EQ(cudaMemset(o->p, 0xff, out_bytes), cudaSuccess);
  ASSERT_EQ(cudaLaunchHostFunc(
                nullptr, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(200)); },
                nullptr),
            cudaSuccess);
  ASSERT_TRUE(launch(0, o1.as<uint16_t>()).is_ok());  // slot 0
  ASSERT_TRUE(launch(1, o2.as<uint16_t>()).is_ok());  // slot 1
  ASSERT_TRUE(launch(1, o3.as<uint16_t>()).is_ok());  // slot 0 again
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_TRUE(launch(0, o4.as<uint16_t>()).is_ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const size_t all = out_bytes / 2;
  const auto x1 = get<uint16_t>(o1, all), x2 = get<uint16_t>(o2, all);
  const auto x3 = get<uint16_t>(o3, all), x4 = get<uint16_t>(o4, all);
  EXPECT_EQ(x1, x4) << "the first launch read another's arguments, or is not deterministic";
  EXPECT_EQ(x2, x3);
  EXPECT_NE(x1, x2);
  for (const auto* x : {&x1, &x2, &x3, &x4})
    EXPECT_TRUE(std::all_of(x->begin() + static_cast<ptrdiff_t>(real), x->end(), [](uint16_t v) {
      return v == 0xffff;
    })) << "a write past the group's rows";
}

}  // namespace hetero::fp8_test
