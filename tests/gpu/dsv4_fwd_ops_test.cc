// Small ops of the DeepSeek-V4 fast forward against what they replace or a host reference.
// The RMS norm with the rope of its last pairs in one pass (fast_rms_norm_rope) against the two
// kernels run one after the other (the norm's output, then rope_pairs_only over it):
// bit-identical; and the norm against a host reference (r from a double sum of squares): within
// one bf16 step where the float sum rounds r to a neighbour, nearly all equal. Shapes: q (64
// heads of 512), kv (one head of 512, rows not a multiple of a block's 8), heads of 256 that
// straddle a block's tokens with a compressor's frequency scale, a hidden row of 4096 without
// rope, and a head_dim of 384 (the two-kernel fallback); in place and not. The MoE's stable
// grouping by expert (moe_group) against a host counting sort, with experts nobody picked and
// slot counts not a multiple of a pass. Skips without a GPU.
#include "kernels/cuda/dsv4_fwd_ops.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_base.h"

namespace hetero {
namespace {

class Dsv4CudaFwdOps : public CudaDeviceTest {};

struct NormCase {
  std::string name;
  int64_t tokens, heads, d;
  bool weight;
  int64_t rope_pairs, pos0;
  int freq_scale;
};

TEST_F(Dsv4CudaFwdOps, NormAndRopeInOnePassEqualTheTwoKernels) {
  const NormCase cases[] = {
      {"q", 37, 64, 512, false, 32, 1000, 1},
      {"q, 128 heads of 256, half a token a block", 5, 128, 256, true, 32, 70000, 1},
      {"kv", 45, 1, 512, true, 32, 7, 1},
      {"straddling heads, ratio 4", 21, 3, 256, true, 16, 5, 4},
      {"hidden, no rope", 13, 2, 4096, true, 0, 0, 1},
      {"2,048 columns, two warps a row, a block's rows not all real", 7, 1, 2048, false, 0, 0, 1},
      {"2,048 columns with a rope", 3, 2, 2048, true, 32, 9, 1},
      {"head_dim 384 (two kernels)", 9, 2, 384, true, 32, 3, 1},
  };
  const float eps = 1e-6f;
  uint32_t seed = 11;
  for (const NormCase& c : cases) {
    SCOPED_TRACE(c.name);
    const int64_t m = c.tokens * c.heads, n = m * c.d;
    const std::vector<uint16_t> x = random_bf16(size_t(n), 2.0f, seed++);
    std::vector<uint16_t> w = random_bf16(size_t(c.d), 1.0f, seed++);
    std::vector<float> freqs;
    for (int64_t p = 0; p < c.rope_pairs; ++p)
      freqs.push_back(std::pow(10000.0f, float(p) / float(c.rope_pairs)));
    freqs.push_back(1.0f);  // never empty
    DeviceArray<uint16_t> dx(x), dw(w), fused(x), two(x), in_place(x);
    DeviceArray<float> df(freqs);
    const uint16_t* wp = c.weight ? dw.get() : nullptr;
    cuda::fast_rms_norm_rope(dx.get(), c.tokens, c.heads, c.d, wp, eps, fused.get(), c.pos0,
                             df.get(), c.rope_pairs, c.freq_scale, nullptr);
    cuda::fast_rms_norm(dx.get(), m, c.d, wp, eps, two.get(), nullptr);
    const std::vector<uint16_t> norm_only = two.to_host();
    cuda::rope_pairs_only(two.get(), c.tokens, c.heads, c.d, c.pos0, df.get(), c.rope_pairs,
                          c.freq_scale, false, nullptr);
    cuda::fast_rms_norm_rope(in_place.get(), c.tokens, c.heads, c.d, wp, eps, in_place.get(),
                             c.pos0, df.get(), c.rope_pairs, c.freq_scale, nullptr);
    const std::vector<uint16_t> a = fused.to_host(), b = two.to_host(), ip = in_place.to_host();
    EXPECT_EQ(a, b) << "the one pass differs from the norm then the rope";
    EXPECT_EQ(a, ip) << "in place differs";
    if (c.rope_pairs > 0) {
      EXPECT_NE(a, norm_only) << "the rope changed nothing";
    }

    // The norm against the host: r from a double sum; y = bf16(x r), out = bf16(y w).
    int64_t equal = 0, off_by_more = 0;
    for (int64_t row = 0; row < m; ++row) {
      double ss = 0;
      for (int64_t j = 0; j < c.d; ++j) {
        const double v = bf16_to_f32(x[size_t(row * c.d + j)]);
        ss += v * v;
      }
      const float r = 1.0f / std::sqrt(float(ss / double(c.d)) + eps);
      for (int64_t j = 0; j < c.d; ++j) {
        const size_t i = size_t(row * c.d + j);
        const float y = bf16_to_f32(f32_to_bf16(bf16_to_f32(x[i]) * r));
        const uint16_t want = f32_to_bf16(c.weight ? y * bf16_to_f32(w[size_t(j)]) : y);
        const int diff = std::abs(int(norm_only[i]) - int(want));
        equal += diff == 0;
        off_by_more += diff > 1;
      }
    }
    EXPECT_EQ(off_by_more, 0);
    EXPECT_GE(double(equal), 0.99 * double(n)) << equal << " of " << n << " equal";
  }
}

TEST_F(Dsv4CudaFwdOps, GroupingByExpertIsStable) {
  struct Case {
    int64_t n, top_k, experts;
  };
  uint32_t seed = 5;
  for (const Case c : {Case{8192, 6, 256}, Case{1, 6, 256}, Case{333, 6, 64}, Case{1000, 2, 7}}) {
    SCOPED_TRACE(std::to_string(c.n) + " tokens, top-" + std::to_string(c.top_k) + " of " +
                 std::to_string(c.experts));
    const int64_t slots = c.n * c.top_k;
    std::mt19937 rng(seed++);
    // Skewed: the first half of the experts are picked four times as often; the last is never.
    std::uniform_int_distribution<int32_t> pick(0, int32_t(c.experts * 5 / 2) - 1);
    std::vector<int32_t> inds(static_cast<size_t>(slots));
    for (auto& v : inds) {
      const int32_t r = pick(rng);
      v = std::min<int32_t>(
          r < 2 * c.experts ? r / 4 : r - int32_t(2 * c.experts) + int32_t(c.experts / 2),
          int32_t(c.experts) - 2);
    }
    std::vector<int32_t> want_off(size_t(c.experts + 1), 0), want_perm, want_row(inds.size());
    for (int32_t e = 0; e < c.experts; ++e) {
      want_off[size_t(e)] = static_cast<int32_t>(want_perm.size());
      for (int64_t s = 0; s < slots; ++s)
        if (inds[size_t(s)] == e) {
          want_row[size_t(s)] = static_cast<int32_t>(want_perm.size());
          want_perm.push_back(static_cast<int32_t>(s));
        }
    }
    want_off[size_t(c.experts)] = static_cast<int32_t>(slots);
    DeviceArray<int32_t> di(inds), counts(std::vector<int32_t>(size_t(c.experts))),
        off(std::vector<int32_t>(size_t(c.experts + 1))), perm(std::vector<int32_t>(inds.size())),
        row(std::vector<int32_t>(inds.size()));
    cuda::moe_group(di.get(), slots, c.top_k, c.experts, nullptr, 0, counts.get(), off.get(),
                    perm.get(), row.get(), nullptr, nullptr);
    EXPECT_EQ(off.to_host(), want_off);
    EXPECT_EQ(perm.to_host(), want_perm);
    EXPECT_EQ(row.to_host(), want_row);
  }
}

}  // namespace
}  // namespace hetero
