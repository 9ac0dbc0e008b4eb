// The DeepSeek-V4 cache-program ops on the GPU against their CPU twins, bit for bit (memcmp of
// the bf16 outputs): rope, weightless rms_norm, both poolings and the quantized matmuls. The CPU
// ops are proven against the decoder (docs/findings/dsv4-mlx-numerics.md), so this chains the
// GPU to the decoder's arithmetic. Inputs hold no NaN or Inf: a NaN's bits are not portable
// between x86 and CUDA (see docs/findings/gpu-exactness-vs-tensor-cores.md). Skips itself, with
// the reason, without a GPU.
#include "kernels/cuda/dsv4_ops.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "cuda_test_base.h"
#include "kernels/cpu_ops.h"
#include "kernels/dsv4_ops.h"

namespace hetero {
namespace {

class Dsv4CudaOps : public CudaDeviceTest {};

// Bit-exact comparison (the contract of these ops); on failure names the first differing index.
void expect_same_bits(const std::vector<uint16_t>& gpu, const std::vector<uint16_t>& cpu,
                      const std::string& what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  if (std::memcmp(gpu.data(), cpu.data(), cpu.size() * sizeof(uint16_t)) == 0) return;
  size_t first = 0, count = 0;
  for (size_t i = cpu.size(); i-- > 0;)
    if (gpu[i] != cpu[i]) first = i, ++count;
  ADD_FAILURE() << what << ": " << count << " of " << cpu.size() << " bf16 values differ; first at "
                << first << ": gpu " << bf16_to_f32(gpu[first]) << " (0x" << std::hex << gpu[first]
                << ") cpu " << bf16_to_f32(cpu[first]) << " (0x" << cpu[first] << ")";
}

// Random bf16 values with some exact +0 and -0: the signs of zero are bits too.
std::vector<uint16_t> random_bf16_with_zeros(size_t n, float scale, uint32_t seed) {
  auto v = random_bf16(n, scale, seed);
  std::mt19937 rng(seed + 1000);
  for (auto& x : v) {
    const uint32_t u = rng() % 16;
    if (u == 0) x = 0x0000;
    if (u == 1) x = 0x8000;
  }
  return v;
}

// Values spread over 2^-6..2^6 times a normal draw, so the order of a sum shows in its bits.
std::vector<uint16_t> random_bf16_wide(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16(std::ldexp(nd(rng), int(rng() % 13) - 6));
  return v;
}

std::vector<float> random_f32(size_t n, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

TEST_F(Dsv4CudaOps, RopeIsBitIdentical) {
  const std::vector<float> local = dsv4_rope_freqs(64, 10000.0, YarnScaling{});
  YarnScaling yarn;
  yarn.enabled = true;
  yarn.factor = 16.0;
  yarn.original_max_position_embeddings = 65536.0;
  const std::vector<float> compressed = dsv4_rope_freqs(64, 160000.0, yarn);
  struct Case {
    int64_t rows, heads, head_dim, pos0;
    const std::vector<float>* freqs;
    int freq_scale;
    bool inverse;
  };
  const Case cases[] = {
      {5, 64, 512, 0, &local, 1, false},           // queries
      {5, 64, 512, 999995, &local, 1, true},       // output de-rotation near 1e6
      {129, 1, 512, 2047, &local, 1, false},       // window kv
      {33, 8, 128, 123457, &local, 1, false},      // indexer heads
      {1, 1, 512, 250000, &compressed, 4, false},  // ratio-4 row at position 1e6
      {3, 1, 512, 7810, &compressed, 128, false},  // ratio-128 rows near 1e6
      {17, 1, 512, 0, &compressed, 4, true},
      {3, 2, 64, 1000000, &compressed, 1, false},  // every pair rotated
      {4, 3, 130, 17, &local, 1, true},            // odd pair count before the rope
  };
  uint32_t seed = 1;
  for (const Case& c : cases) {
    auto x = random_bf16_with_zeros(size_t(c.rows * c.heads * c.head_dim), 1.f, seed++);
    DeviceArray<uint16_t> dx(x);
    DeviceArray<float> df(*c.freqs);
    dsv4_rope(x.data(), c.rows, c.heads, c.head_dim, c.pos0, *c.freqs, c.freq_scale, c.inverse);
    cuda::dsv4_rope(dx.get(), c.rows, c.heads, c.head_dim, c.pos0, df.get(),
                    int64_t(c.freqs->size()), c.freq_scale, c.inverse, nullptr);
    expect_same_bits(dx.to_host(), x,
                     "rope rows=" + std::to_string(c.rows) + " heads=" + std::to_string(c.heads) +
                         " hd=" + std::to_string(c.head_dim) + " pos0=" + std::to_string(c.pos0) +
                         " scale=" + std::to_string(c.freq_scale) + (c.inverse ? " inverse" : ""));
  }
}

TEST_F(Dsv4CudaOps, RmsNormNoWeightIsBitIdentical) {
  struct Case {
    int64_t m, d;
  };
  uint32_t seed = 20;
  // The 4096-row and 512 x 4096 cases are there for their count: a sum of squares taken in
  // another order changes only a few dozen outputs of them.
  for (const Case c : {Case{1, 512},
                       {67, 512},
                       {300, 128},
                       {3, 5003},
                       {2, 4096},
                       {5, 1},
                       {4096, 512},
                       {512, 4096}}) {
    auto x = c.m > 64 ? random_bf16_wide(size_t(c.m * c.d), seed++)
                      : random_bf16_with_zeros(size_t(c.m * c.d), 3.f, seed++);
    std::vector<uint16_t> cpu(x.size());
    rms_norm_noweight(x.data(), c.m, c.d, 1e-6f, cpu.data());
    DeviceArray<uint16_t> dx(x), dout(std::vector<uint16_t>(x.size()));
    cuda::rms_norm_noweight(dx.get(), c.m, c.d, 1e-6f, dout.get(), nullptr);
    const std::string what = "rms_norm_noweight " + std::to_string(c.m) + "x" + std::to_string(c.d);
    expect_same_bits(dout.to_host(), cpu, what);
    // In place, as the engine calls it on the queries.
    cuda::rms_norm_noweight(dx.get(), c.m, c.d, 1e-6f, dx.get(), nullptr);
    expect_same_bits(dx.to_host(), cpu, what + " in place");
  }
}

TEST_F(Dsv4CudaOps, PoolSimpleIsBitIdentical) {
  struct Case {
    int64_t windows, r, d;
  };
  uint32_t seed = 40;
  for (const Case c : {Case{1, 128, 512}, {3, 128, 129}, {64, 128, 512}, {5, 16, 7}}) {
    const size_t rows = size_t(c.windows * c.r);
    auto kv = random_bf16_with_zeros(rows * c.d, 1.f, seed++);
    auto gate = random_bf16(rows * c.d, 2.f, seed++);
    auto ape = random_f32(size_t(c.r * c.d), 0.5f, seed++);
    std::vector<uint16_t> cpu(size_t(c.windows * c.d));
    dsv4_pool_simple(kv.data(), gate.data(), ape.data(), c.windows, c.r, c.d, cpu.data());
    DeviceArray<uint16_t> dkv(kv), dgate(gate), dout(std::vector<uint16_t>(cpu.size()));
    DeviceArray<float> dape(ape);
    cuda::dsv4_pool_simple(dkv.get(), dgate.get(), dape.get(), c.windows, c.r, c.d, dout.get(),
                           nullptr);
    expect_same_bits(dout.to_host(), cpu,
                     "pool_simple windows=" + std::to_string(c.windows) +
                         " r=" + std::to_string(c.r) + " d=" + std::to_string(c.d));
  }
}

TEST_F(Dsv4CudaOps, PoolOverlapIsBitIdentical) {
  struct Case {
    int64_t r, hd;
    std::vector<uint8_t> has_prev;  // one per window
  };
  // 4096 windows with random flags: a softmax by reciprocal-multiply instead of division changes
  // only 15 of this case's 2M pooled values (and none of the small cases'), so it must be large.
  std::vector<uint8_t> many(4096);
  std::mt19937 flag_rng(59);
  for (auto& f : many) f = uint8_t(flag_rng() % 4 != 0);
  const Case cases[] = {
      {4, 512, {0, 1, 1, 1, 0, 1, 0, 0, 1}},
      {4, 512, many},
      {4, 512, {1}},  // the first window's lane reaches into the rows before `kv`
      {4, 129, {1, 0, 1, 1}},
      {4, 512, {0}},
      {8, 64, {1, 1, 0, 1}},
  };
  uint32_t seed = 60;
  for (const Case& c : cases) {
    const int64_t windows = int64_t(c.has_prev.size()), width = 2 * c.hd;
    // One extra window in front, so a has_prev lane of window 0 reads real rows.
    const size_t lead = size_t(c.r * width), total = lead + size_t(windows * c.r * width);
    auto kv = random_bf16_with_zeros(total, 1.f, seed++);
    auto gate = random_bf16(total, 1.f, seed++);
    auto ape = random_f32(size_t(c.r * width), 0.5f, seed++);
    std::vector<uint16_t> cpu(size_t(windows * c.hd));
    dsv4_pool_overlap(kv.data() + lead, gate.data() + lead, ape.data(), c.has_prev.data(), windows,
                      c.r, c.hd, cpu.data());
    DeviceArray<uint16_t> dkv(kv), dgate(gate), dout(std::vector<uint16_t>(cpu.size()));
    DeviceArray<float> dape(ape);
    DeviceArray<uint8_t> dprev(c.has_prev);
    cuda::dsv4_pool_overlap(dkv.get() + lead, dgate.get() + lead, dape.get(), dprev.get(), windows,
                            c.r, c.hd, dout.get(), nullptr);
    std::string flags = std::to_string(windows) + " random";
    if (windows <= 16) {
      flags.clear();
      for (uint8_t f : c.has_prev) flags += char('0' + f);
    }
    expect_same_bits(dout.to_host(), cpu,
                     "pool_overlap r=" + std::to_string(c.r) + " hd=" + std::to_string(c.hd) +
                         " has_prev=" + flags);
  }
}

// FP8 E4M3 (the OCP format mxfp8 uses) decoded to its value; the NaN codes are not produced.
float e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 0xf, mant = b & 7;
  const float mag = e == 0 ? std::ldexp(float(mant), -9) : std::ldexp(1.0f + mant / 8.0f, e - 7);
  return (b & 0x80) ? -mag : mag;
}

// Element values of an mx-quantized weight [n, k] and its scales 2^(s-127) [n, k/group],
// including the bf16-subnormal scale 2^-127 (byte 0).
void random_mx(int64_t n, int64_t k, int64_t group, bool fp4, uint32_t seed, std::vector<float>* q,
               std::vector<float>* scales) {
  static const float kFp4[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  std::mt19937 rng(seed);
  q->resize(size_t(n * k));
  for (auto& v : *q) {
    if (fp4) {
      v = kFp4[rng() % 16];
    } else {
      uint8_t b = uint8_t(rng());
      if ((b & 0x7f) == 0x7f) b &= 0xfe;  // not NaN
      v = e4m3_value(b);
    }
  }
  scales->resize(size_t(n * (k / group)));
  for (auto& s : *scales) {
    const uint32_t u = rng() % 32;
    const int e = u == 0 ? 0 : 112 + int(u % 20);
    s = std::ldexp(1.0f, e - 127);
  }
}

struct LinearCase {
  int64_t m, k, n, group;
};

TEST_F(Dsv4CudaOps, LinearQuantizedMxIsBitIdentical) {
  // m >= 8 takes the CPU's 8-row vector path and its scalar tail; k = 100 has a partial group.
  const LinearCase cases[] = {
      {1, 4096, 512, 32}, {13, 4096, 512, 32}, {8, 512, 96, 32},
      {37, 1024, 33, 32}, {3, 100, 5, 32},     {9, 256, 40, 64},
  };
  uint32_t seed = 80;
  for (const LinearCase& c : cases) {
    for (bool fp4 : {true, false}) {
      auto x = random_bf16_with_zeros(size_t(c.m * c.k), 1.f, seed++);
      std::vector<float> q, scales;
      random_mx(c.n, c.k, c.group, fp4, seed++, &q, &scales);
      std::vector<uint16_t> cpu(size_t(c.m * c.n));
      linear_quantized_mx(x.data(), c.m, c.k, q.data(), scales.data(), c.n, c.group, cpu.data());
      DeviceArray<uint16_t> dx(x), dout(std::vector<uint16_t>(cpu.size()));
      DeviceArray<float> dq(q), ds(scales);
      cuda::linear_quantized_mx(dx.get(), c.m, c.k, dq.get(), ds.get(), c.n, c.group, dout.get(),
                                nullptr);
      expect_same_bits(dout.to_host(), cpu,
                       std::string(fp4 ? "mxfp4" : "mxfp8") + " m=" + std::to_string(c.m) +
                           " k=" + std::to_string(c.k) + " n=" + std::to_string(c.n) +
                           " group=" + std::to_string(c.group));
    }
  }
}

TEST_F(Dsv4CudaOps, LinearQuantizedAffineIsBitIdentical) {
  const LinearCase cases[] = {
      {1, 4096, 512, 64}, {13, 4096, 512, 32}, {37, 1024, 33, 128},
      {5, 96, 7, 32},     {8, 512, 64, 64},
  };
  uint32_t seed = 120;
  for (const LinearCase& c : cases) {
    for (int bits : {4, 8}) {
      auto x = random_bf16_with_zeros(size_t(c.m * c.k), 1.f, seed++);
      std::mt19937 rng(seed++);
      std::vector<float> q(size_t(c.n * c.k));
      for (auto& v : q) v = float(rng() % (1u << bits));
      // Scales and biases are bf16 in the checkpoint, handed over as f32.
      const size_t groups = size_t(c.n * (c.k / c.group));
      std::vector<float> scales(groups), biases(groups);
      const auto s16 = random_bf16(groups, 0.02f, seed++), b16 = random_bf16(groups, 0.1f, seed++);
      for (size_t i = 0; i < groups; ++i)
        scales[i] = bf16_to_f32(s16[i]), biases[i] = bf16_to_f32(b16[i]);
      std::vector<uint16_t> cpu(size_t(c.m * c.n));
      linear_quantized_affine(x.data(), c.m, c.k, q.data(), scales.data(), biases.data(), c.n,
                              c.group, cpu.data());
      DeviceArray<uint16_t> dx(x), dout(std::vector<uint16_t>(cpu.size()));
      DeviceArray<float> dq(q), ds(scales), db(biases);
      cuda::linear_quantized_affine(dx.get(), c.m, c.k, dq.get(), ds.get(), db.get(), c.n, c.group,
                                    dout.get(), nullptr);
      expect_same_bits(dout.to_host(), cpu,
                       "affine" + std::to_string(bits) + " m=" + std::to_string(c.m) +
                           " k=" + std::to_string(c.k) + " n=" + std::to_string(c.n) +
                           " group=" + std::to_string(c.group));
    }
  }
}

}  // namespace
}  // namespace hetero
