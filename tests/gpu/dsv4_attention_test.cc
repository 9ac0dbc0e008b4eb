// The DeepSeek-V4 forward's sparse attention kernels against a host reference with the decoder's
// rounding points: q * scale to bf16, each score to bf16, a softmax with the sink as an extra
// logit and P = exp(s - max) to bf16, out = bf16(sum_j P_j v_j / l). The kernels sum each dot
// product in another order, so a score can round to its bf16 neighbour: compared by relative RMS
// and by the share of outputs bit-equal to the reference. Shapes: DeepSeek-V4-Flash's (64 heads
// of 512, window 128, ratio-4 layers' top-512 with rows the query may not see yet, ratio-128
// layers' dense list past a thousand rows), a top-768 list (the wide kernel's key buffers two,
// three and four deep across the cases), the first positions (a partial window, every
// compressed row masked), and 72 heads of 192 (a second block of rows, mostly empty). A broken
// fragment layout or tile schedule is off by a relative RMS near 1. The output's rope pairs
// rotated back inside the attention against rope_pairs_only after it: bit-identical. And the
// indexer's selection against a host reference that scores in the CPU engine's order: the same
// top-k sets, a near-tie aside, with and without HISA (blocks of 64, 8 and 48 rows; 32 to 8,192
// keys sorted, in registers and in shared memory). Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_base.h"
#include "kernels/cuda/dsv4_fwd_ops.h"
#include "kernels/mlx_math.h"

namespace hetero {
namespace {

class Dsv4CudaAttention : public CudaDeviceTest {};

struct AttnCase {
  std::string name;
  int64_t heads, head_dim, off, m, window, ratio, pooled_rows, k;  // k 0: dense (no top-k)
};

struct AttnInputs {
  std::vector<uint16_t> q, lk, pooled;
  std::vector<uint32_t> topk;
  std::vector<float> sinks;
  int64_t lk_pos0 = 0;
  float scale = 0;
};

AttnInputs make_inputs(const AttnCase& c, uint32_t seed) {
  AttnInputs in;
  const int64_t D = c.head_dim;
  in.q = random_bf16(size_t(c.m * c.heads * D), 1.0f, seed);
  in.lk_pos0 = std::max<int64_t>(0, c.off - c.window + 1);
  in.lk = random_bf16(size_t((c.off + c.m - in.lk_pos0) * D), 1.0f, seed + 1);
  in.pooled = random_bf16(size_t(std::max<int64_t>(c.pooled_rows, 1) * D), 1.0f, seed + 2);
  std::mt19937 rng(seed + 3);
  if (c.k > 0) {  // distinct rows per query, some past what the query may see
    std::vector<uint32_t> rows(size_t(c.pooled_rows));
    for (size_t r = 0; r < rows.size(); ++r) rows[r] = uint32_t(r);
    for (int64_t i = 0; i < c.m; ++i) {
      std::shuffle(rows.begin(), rows.end(), rng);
      in.topk.insert(in.topk.end(), rows.begin(), rows.begin() + c.k);
    }
  }
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t h = 0; h < c.heads; ++h) in.sinks.push_back(bf16_to_f32(f32_to_bf16(nd(rng))));
  in.scale = bf16_to_f32(f32_to_bf16(1.0f / std::sqrt(float(D))));
  return in;
}

float rbf(float x) { return bf16_to_f32(f32_to_bf16(x)); }

std::vector<uint16_t> reference(const AttnCase& c, const AttnInputs& in) {
  const int64_t D = c.head_dim;
  std::vector<uint16_t> out(size_t(c.m * c.heads * D));
  std::vector<const uint16_t*> keys;
  std::vector<float> qs(static_cast<size_t>(D)), s, o(static_cast<size_t>(D));
  for (int64_t i = 0; i < c.m; ++i) {
    const int64_t pos = c.off + i, lo = std::max<int64_t>(0, pos - c.window + 1);
    keys.clear();
    for (int64_t p = lo; p <= pos; ++p) keys.push_back(&in.lk[size_t((p - in.lk_pos0) * D)]);
    if (c.ratio > 0) {
      const int64_t vis = std::min(c.pooled_rows, (pos + 1) / c.ratio);
      if (c.k > 0) {
        for (int64_t j = 0; j < c.k; ++j) {
          const int64_t r = in.topk[size_t(i * c.k + j)];
          if (r < vis) keys.push_back(&in.pooled[size_t(r * D)]);
        }
      } else {
        for (int64_t r = 0; r < vis; ++r) keys.push_back(&in.pooled[size_t(r * D)]);
      }
    }
    for (int64_t h = 0; h < c.heads; ++h) {
      const uint16_t* qh = &in.q[size_t((i * c.heads + h) * D)];
      for (int64_t d = 0; d < D; ++d) qs[d] = rbf(bf16_to_f32(qh[d]) * in.scale);
      s.assign(keys.size(), 0.0f);
      const float sink = in.sinks[size_t(h)];
      float mx = sink;
      for (size_t j = 0; j < keys.size(); ++j) {
        float acc = 0.0f;
        for (int64_t d = 0; d < D; ++d) acc += qs[d] * bf16_to_f32(keys[j][d]);
        s[j] = rbf(acc);
        mx = std::max(mx, s[j]);
      }
      float tot = 0.0f;
      std::fill(o.begin(), o.end(), 0.0f);
      for (size_t j = 0; j < keys.size(); ++j) {
        const float e = mlx_exp(s[j] - mx);
        tot += e;
        const float pj = rbf(e);
        for (int64_t d = 0; d < D; ++d) o[d] += pj * bf16_to_f32(keys[j][d]);
      }
      const float inv = 1.0f / (tot + mlx_exp(sink - mx));
      for (int64_t d = 0; d < D; ++d)
        out[size_t((i * c.heads + h) * D + d)] = f32_to_bf16(o[d] * inv);
    }
  }
  return out;
}

std::vector<uint16_t> run_kernel(const AttnCase& c, const AttnInputs& in, bool online_only,
                                 const float* derope_freqs = nullptr, int64_t derope_pairs = 0) {
  DeviceArray<uint16_t> q(in.q), lk(in.lk), pooled(in.pooled);
  DeviceArray<uint32_t> topk(c.k > 0 ? in.topk : std::vector<uint32_t>(1));
  DeviceArray<float> sinks(in.sinks);
  DeviceArray<uint16_t> out(std::vector<uint16_t>(in.q.size()));
  cuda::SparseAttnParams p{};
  p.q = q.get(), p.out = out.get();
  p.m = c.m, p.heads = c.heads, p.head_dim = c.head_dim;
  p.off = c.off, p.window = c.window;
  p.lk = lk.get(), p.lk_pos0 = in.lk_pos0;
  p.pooled = c.ratio > 0 ? pooled.get() : nullptr;
  p.pooled_rows = c.ratio > 0 ? c.pooled_rows : 0, p.ratio = c.ratio;
  p.topk = c.k > 0 ? topk.get() : nullptr, p.k = c.k;
  p.sinks = sinks.get(), p.scale = in.scale;
  p.online_only = online_only;
  p.derope_freqs = derope_freqs, p.derope_pairs = derope_pairs;
  cuda::sparse_attention(p, nullptr);
  return out.to_host();
}

// The output's rope pairs rotated back inside the attention (the two-pass kernel's epilogue; the
// online kernel then rope_pairs_only) equal the attention then rope_pairs_only, bit for bit.
TEST_F(Dsv4CudaAttention, TheOutputIsDeropedAsTheRopeKernelDoesIt) {
  const AttnCase c{"flash ratio 4, top-512", 64, 512, 4000, 12, 128, 4, 1024, 512};
  const AttnInputs in = make_inputs(c, 77);
  std::vector<float> freqs;
  for (int p = 0; p < 32; ++p) freqs.push_back(std::pow(10000.0f, float(p) / 32.0f));
  DeviceArray<float> df(freqs);
  for (bool online : {false, true}) {
    const std::vector<uint16_t> plain = run_kernel(c, in, online);
    DeviceArray<uint16_t> want(plain);
    cuda::rope_pairs_only(want.get(), c.m, c.heads, c.head_dim, c.off, df.get(), 32, 1, true,
                          nullptr);
    const std::vector<uint16_t> got = run_kernel(c, in, online, df.get(), 32);
    EXPECT_EQ(got, want.to_host()) << (online ? "online" : "wide");
    EXPECT_NE(got, plain) << "nothing rotated";
  }
}

TEST_F(Dsv4CudaAttention, BothKernelsMatchTheDecodersRoundingPoints) {
  const AttnCase cases[] = {
      {"flash ratio 4, top-512", 64, 512, 4000, 12, 128, 4, 1024, 512},
      {"flash ratio 128, dense", 64, 512, 130000, 6, 128, 128, 1100, 0},
      {"first positions", 64, 512, 0, 40, 128, 4, 64, 16},
      // 896 keys a query: the wide kernel's buffers, three deep (two for the dense list above,
      // four elsewhere).
      {"ratio 4, top-768, three stages", 64, 512, 6000, 8, 128, 4, 1500, 768},
      {"72 heads of 192, window only", 72, 192, 50, 20, 128, 0, 0, 0},
  };
  uint32_t seed = 500;
  for (const AttnCase& c : cases) {
    const AttnInputs in = make_inputs(c, seed += 10);
    const std::vector<uint16_t> want = reference(c, in);
    for (bool online : {false, true}) {
      const std::vector<uint16_t> got = run_kernel(c, in, online);
      size_t equal = 0;
      for (size_t e = 0; e < want.size(); ++e) equal += got[e] == want[e];
      const double err = rel_rms(got, want), share = double(equal) / double(want.size());
      std::printf("[ attn ] %-30s %-7s rel RMS %.3g, bit-equal %.2f%%\n", c.name.c_str(),
                  online ? "online" : "wide", err, 100.0 * share);
      // The online kernel rounds P against a running maximum, so it is looser by construction.
      EXPECT_LE(err, online ? 8e-3 : 1e-3) << c.name << (online ? " (online)" : " (wide)");
      if (!online) {
        EXPECT_GE(share, 0.9) << c.name;
      }
    }
  }
}

struct IndexCase {
  std::string name;
  int64_t heads, rows, off, m, k, block, keep;
  bool one_token;
};

// The selection as the CPU engine makes it: per head relu(float32 dot in order) * w * wscale *
// scale, summed in head order; masks; HISA's block means (float32 sums in row order, times
// 1/block; bf16-rounded for one token); ties to the lower row.
std::vector<std::vector<uint32_t>> reference_topk(const IndexCase& c,
                                                  const std::vector<uint16_t>& q,
                                                  const std::vector<uint16_t>& w,
                                                  const std::vector<uint16_t>& pooled, float scale,
                                                  float wscale) {
  constexpr int64_t D = 128;
  std::vector<std::vector<uint32_t>> out;
  auto top = [](const std::vector<float>& s, const std::vector<uint32_t>& ids, int64_t k) {
    std::vector<size_t> order(s.size());
    for (size_t j = 0; j < order.size(); ++j) order[j] = j;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return s[a] > s[b] || (s[a] == s[b] && ids[a] < ids[b]);
    });
    std::vector<uint32_t> r;
    for (int64_t j = 0; j < k && j < int64_t(order.size()); ++j) r.push_back(ids[order[size_t(j)]]);
    return r;
  };
  const int64_t nb = c.block > 0 ? c.rows / c.block : 0;
  std::vector<float> rep(size_t(nb * D));
  for (int64_t j = 0; j < nb; ++j)
    for (int64_t d = 0; d < D; ++d) {
      float acc = 0.0f;
      for (int64_t r = 0; r < c.block; ++r)
        acc += bf16_to_f32(pooled[size_t((j * c.block + r) * D + d)]);
      rep[size_t(j * D + d)] =
          c.one_token ? rbf(rbf(acc) * rbf(1.0f / float(c.block))) : acc * (1.0f / float(c.block));
    }
  std::vector<float> row(D);
  for (int64_t i = 0; i < c.m; ++i) {
    const int64_t vis = std::min(c.rows, (c.off + i + 1) / 4);
    auto score = [&](const float* x) {
      float s = 0.0f;
      for (int64_t h = 0; h < c.heads; ++h) {
        float acc = 0.0f;
        for (int64_t d = 0; d < D; ++d)
          acc += bf16_to_f32(q[size_t((i * c.heads + h) * D + d)]) * x[d];
        s += std::max(acc, 0.0f) * (bf16_to_f32(w[size_t(i * c.heads + h)]) * wscale * scale);
      }
      return s;
    };
    auto pooled_score = [&](int64_t r, float masked_value) {
      for (int64_t d = 0; d < D; ++d) row[size_t(d)] = bf16_to_f32(pooled[size_t(r * D + d)]);
      return !c.one_token && !(r < vis) ? masked_value : score(row.data());
    };
    std::vector<float> s;
    std::vector<uint32_t> ids;
    if (c.block > 0) {
      for (int64_t j = 0; j < nb; ++j) {
        s.push_back(!c.one_token && !(j * c.block < vis) ? -1e30f : score(&rep[size_t(j * D)]));
        ids.push_back(uint32_t(j));
      }
      const auto kept = top(s, ids, std::min(c.keep, nb));
      s.clear(), ids.clear();
      for (uint32_t b : kept)
        for (int64_t r = 0; r < c.block; ++r) {
          const int64_t pos = int64_t(b) * c.block + r;
          s.push_back(pooled_score(pos, -1e30f)), ids.push_back(uint32_t(pos));
        }
    } else {
      for (int64_t r = 0; r < c.rows; ++r)
        s.push_back(pooled_score(r, -FLT_MAX)), ids.push_back(uint32_t(r));
    }
    out.push_back(top(s, ids, c.k));
  }
  return out;
}

TEST_F(Dsv4CudaAttention, TheIndexerKeepsTheReferenceSelection) {
  const IndexCase cases[] = {
      {"flash HISA 64/16, top-512", 64, 2048, 7900, 16, 512, 64, 16, false},
      {"flash without HISA, masked tail", 64, 700, 2700, 16, 512, 0, 0, false},
      // 2,048 and 8,192 keys to sort: eight a thread in registers; in shared memory.
      {"without HISA, 2,000 rows, masked tail", 64, 2000, 7000, 8, 512, 0, 0, false},
      {"without HISA, 5,000 rows", 64, 5000, 21000, 4, 512, 0, 0, false},
      {"16 heads, one token, HISA 8/4", 16, 256, 1500, 1, 16, 8, 4, true},
      // A block size that is not a power of two, 12 rows past the last whole block.
      {"HISA 48/8, top-256, masked tail", 64, 1500, 5990, 8, 256, 48, 8, false},
  };
  uint32_t seed = 900;
  for (const IndexCase& c : cases) {
    const auto q = random_bf16(size_t(c.m * c.heads * 128), 1.0f, seed += 10);
    const auto w = random_bf16(size_t(c.m * c.heads), 1.0f, seed + 1);
    const auto pooled = random_bf16(size_t(c.rows * 128), 1.0f, seed + 2);
    const float scale = 1.0f / std::sqrt(128.0f), wscale = 1.0f / std::sqrt(float(c.heads));
    const auto want = reference_topk(c, q, w, pooled, scale, wscale);

    DeviceArray<uint16_t> dq(q), dw(w), dp(pooled);
    const int64_t nb = c.block > 0 ? c.rows / c.block : 1;
    DeviceArray<float> rep(std::vector<float>(size_t(nb * 128)));
    DeviceArray<uint32_t> topk(std::vector<uint32_t>(size_t(c.m * c.k)));
    if (c.block > 0)
      cuda::hisa_block_means(dp.get(), c.rows, c.block, c.one_token, rep.get(), nullptr);
    cuda::IndexSelectParams p{};
    p.q = dq.get(), p.w = dw.get(), p.pooled = dp.get();
    p.m = c.m, p.heads = c.heads, p.rows = c.rows, p.off = c.off;
    p.scale = scale, p.wscale = wscale, p.k = c.k, p.one_token = c.one_token;
    p.block = c.block, p.keep = c.keep, p.rep = rep.get();
    ASSERT_TRUE(cuda::check_index_select(c.rows, c.block, c.keep).is_ok());
    cuda::index_select(p, topk.get(), nullptr);
    const auto got = topk.to_host();
    int64_t same_sets = 0, kept = 0;
    for (int64_t i = 0; i < c.m; ++i) {
      std::vector<uint32_t> a(got.begin() + i * c.k, got.begin() + (i + 1) * c.k),
          b = want[size_t(i)];
      std::sort(a.begin(), a.end()), std::sort(b.begin(), b.end());
      same_sets += a == b;
      std::vector<uint32_t> both;
      std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(both));
      kept += int64_t(both.size());
    }
    std::printf("[ index ] %-34s same set for %lld of %lld queries, %lld of %lld rows kept\n",
                c.name.c_str(), (long long)same_sets, (long long)c.m, (long long)kept,
                (long long)(c.m * c.k));
    // A flip needs two scores within float32 rounding of each other at the k-th place.
    EXPECT_GE(same_sets, c.m - 1) << c.name;
    EXPECT_GE(kept, c.m * c.k - 2) << c.name;
  }
}

}  // namespace
}  // namespace hetero
