// What every GPU test shares: a fixture that skips (with the reason) where no CUDA device is
// present, which is how CI runs them.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "common/bf16.h"

namespace hetero {

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0)
      GTEST_SKIP() << "no CUDA device (" << cudaGetErrorString(e) << ")";
    cudaDeviceProp p{};
    cudaGetDeviceProperties(&p, 0);
    std::printf("[ device ] %s, sm_%d%d\n", p.name, p.major, p.minor);
  }
};

// A device copy of a host array, freed with the object.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(const std::vector<T>& host) : n_(host.size()) {
    EXPECT_EQ(cudaMalloc(&p_, n_ * sizeof(T) + 16), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceArray() { cudaFree(p_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return p_; }
  // Waits for the device and copies the whole array back; a failed launch fails the test.
  std::vector<T> to_host() const {
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<T> v(n_);
    EXPECT_EQ(cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }

 private:
  T* p_ = nullptr;
  size_t n_;
};

// n normal(0, scale) values rounded to bf16, reproducible from the seed.
inline std::vector<uint16_t> random_bf16(size_t n, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, scale);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16(nd(rng));
  return v;
}

// Relative RMS error of bf16 values a against the reference b: sqrt(sum (a-b)^2 / sum b^2).
inline double rel_rms(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = bf16_to_f32(a[i]), y = bf16_to_f32(b[i]);
    num += (x - y) * (x - y), den += y * y;
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

}  // namespace hetero
