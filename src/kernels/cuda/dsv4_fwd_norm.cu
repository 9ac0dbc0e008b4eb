// The DeepSeek-V4 forward's RMS norms and its rope over the rope pairs, and the two in one pass
// where a norm's output is roped next (q, kv, the compressed rows). See dsv4_fwd_ops.h.
#include <cstdint>

#include "kernels/cuda/dsv4_fwd_common.cuh"
#include "kernels/cuda/dsv4_fwd_ops.h"
#include "kernels/cuda/mlx_math.cuh"
#include "kernels/cuda/mma_sm80.cuh"

namespace hetero::cuda {
namespace {

using namespace dsv4_fwd;

// One warp per row, any d: 2-byte accesses. The fallback of norm_rope_kernel.
__global__ void rms_norm_kernel(const uint16_t* x, int64_t m, int64_t d, const uint16_t* w,
                                float eps, uint16_t* out) {
  const int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= m) return;
  const uint16_t* xr = x + row * d;
  float s = 0.0f;
  for (int64_t j = lane; j < d; j += 32) {
    const float v = b2f(xr[j]);
    s += v * v;
  }
  s = warp_sum(s);
  const float r = 1.0f / sqrtf(s / float(d) + eps);
  uint16_t* o = out + row * d;
  for (int64_t j = lane; j < d; j += 32) {
    const float y = rb(b2f(xr[j]) * r);
    o[j] = w ? f2b(y * b2f(w[j])) : f2b(y);
  }
}

// One block per row t: the rope pairs' cos and sin into shared memory (as dsv4_rope_kernel
// computes them), then every (head, rope pair) of the row, a pair a 32-bit word.
__global__ void rope_pairs_kernel(uint16_t* x, int64_t heads, int64_t head_dim, int64_t pos0,
                                  const float* freqs, int64_t rope_pairs, int freq_scale,
                                  bool inverse) {
  extern __shared__ float trig[];  // [rope_pairs] cos, then [rope_pairs] sin, bf16-rounded
  float* cs = trig;
  float* sn = trig + rope_pairs;
  const int64_t t = blockIdx.x;
  const float pos = __fadd_rn(float(t), float(pos0));
  for (int64_t p = threadIdx.x; p < rope_pairs; p += blockDim.x)
    mlx_rope_trig(pos, freqs[p], freq_scale, inverse, &cs[p], &sn[p]);
  __syncthreads();
  const int64_t half = head_dim / 2, nope = half - rope_pairs;
  uint32_t* xt = reinterpret_cast<uint32_t*>(x + t * heads * head_dim);
  for (int64_t id = threadIdx.x; id < heads * rope_pairs; id += blockDim.x) {
    const int64_t h = id / rope_pairs, p = id % rope_pairs;
    uint32_t* pair = xt + h * half + nope + p;
    *pair = rope_pair(*pair, cs[p], sn[p]);
  }
}

struct NormRope {
  const uint16_t* x;
  uint16_t* out;
  int64_t m, heads, d;  // m rows, `heads` of them a token
  const uint16_t* w;    // [d] or null
  float eps;
  int64_t pos0;
  const float* freqs;  // [rope_pairs]; rope_pairs 0: the norm alone
  int64_t rope_pairs;
  int freq_scale;
};
constexpr int kNormWarps = 8, kNormMaxPairs = 64;

// The norm, then the rope of the last rope_pairs pairs, in one pass: a warp R rows of d = 256 C
// (lane l holds columns 8 (l + 32 c) .. + 7 of each, 16-byte accesses; the rows stay in
// registers, so each is read once, where rms_norm_kernel read it twice 2 bytes a lane), or, with
// S = 2, two warps a row, each holding half its pieces (wide rows: a whole 4,096-column row a
// warp held 91 registers a thread, too few warps a multiprocessor to keep enough loads in
// flight). The same rounding points as rms_norm_kernel then rope_pairs_kernel; the sum of
// squares is ordered by this layout (the fast forward's norms promise no order), and a NaN comes
// out as the conversion instruction's canonical one, not with its payload. The block's rows span
// at most kNormWarps tokens (R > 1 only where a token has a multiple of 8 R heads: then one
// token), whose cos and sin it computes once into shared memory while the rows load: R = 8 makes
// q's 64 heads a block, so its cos and sin are made once a token, not once every 8 heads. Row and
// token indices in 32-bit arithmetic (m < 2^31, checked by the launcher): 64-bit divisions here
// made the kernel slower than the two it replaced.
template <int C, int R, int S>
__global__ void __launch_bounds__(32 * kNormWarps) norm_rope_kernel(NormRope p) {
  static_assert(S == 1 || R == 1, "a row split over warps is a block's only row a warp");
  constexpr int P = C / S;  // 16-byte pieces a lane
  __shared__ float2 trig[kNormWarps][kNormMaxPairs];
  __shared__ float part[kNormWarps];  // S > 1: each warp's share of its row's sum of squares
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, piece0 = (warp % S) * P;
  const uint32_t m = uint32_t(p.m), heads = uint32_t(p.heads), pairs = uint32_t(p.rope_pairs);
  constexpr uint32_t kRows = kNormWarps / S * R;  // the block's
  const uint32_t row0 = blockIdx.x * kRows, first = row0 + (warp / S) * R;
  uint4 v[R][P];
#pragma unroll
  for (int rr = 0; rr < R; ++rr)
    if (first + rr < m) {
      const uint4* xr = reinterpret_cast<const uint4*>(p.x + int64_t(first + rr) * p.d);
#pragma unroll
      for (int c = 0; c < P; ++c) v[rr][c] = xr[lane + 32 * (piece0 + c)];
    }
  const uint32_t t0 = row0 / heads;
  if (pairs > 0) {
    const uint32_t last = (row0 + kRows < m ? row0 + kRows : m) - 1;
    const uint32_t entries = (last / heads - t0 + 1) * pairs;
    for (uint32_t e = threadIdx.x; e < entries; e += blockDim.x) {
      const uint32_t tt = e / pairs, pp = e - tt * pairs;
      float c, s;
      mlx_rope_trig(__fadd_rn(float(t0 + tt), float(p.pos0)), p.freqs[pp], p.freq_scale, false, &c,
                    &s);
      trig[tt][pp] = make_float2(c, s);
    }
    __syncthreads();
  }
  const int first_rope_pair = int(p.d / 2 - p.rope_pairs);  // pairs (2j, 2j + 1) of the row
#pragma unroll
  for (int rr = 0; rr < R; ++rr) {
    const uint32_t row = first + rr;
    float s = 0.0f;
#pragma unroll
    for (int c = 0; c < P; ++c) {
      const uint32_t u[4] = {v[rr][c].x, v[rr][c].y, v[rr][c].z, v[rr][c].w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float a = __uint_as_float(u[k] << 16), b = __uint_as_float(u[k] & 0xffff0000u);
        s += a * a;
        s += b * b;
      }
    }
    s = warp_sum(s);
    if constexpr (S > 1) {  // every warp reaches the barrier, its row real or not
      if (lane == 0) part[warp] = s;
      __syncthreads();
      s = 0.0f;
#pragma unroll
      for (int j = 0; j < S; ++j) s += part[warp / S * S + j];
    }
    if (row >= m) return;
    const float r = 1.0f / sqrtf(s / float(p.d) + p.eps);
    const float2* tr = trig[row / heads - t0];
    uint4* o = reinterpret_cast<uint4*>(p.out + int64_t(row) * p.d);
#pragma unroll
    for (int c = 0; c < P; ++c) {
      const int col = 8 * (lane + 32 * (piece0 + c));
      uint32_t u[4] = {v[rr][c].x, v[rr][c].y, v[rr][c].z, v[rr][c].w};
      uint32_t wv[4] = {0u, 0u, 0u, 0u};
      if (p.w) {
        const uint4 w4 = *reinterpret_cast<const uint4*>(p.w + col);
        wv[0] = w4.x, wv[1] = w4.y, wv[2] = w4.z, wv[3] = w4.w;
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        // Both halves rounded by one conversion instruction (f2b's bits for every finite value).
        u[k] =
            mma::pack_bf2(__uint_as_float(u[k] << 16) * r, __uint_as_float(u[k] & 0xffff0000u) * r);
        if (p.w)
          u[k] = mma::pack_bf2(
              __uint_as_float(u[k] << 16) * __uint_as_float(wv[k] << 16),
              __uint_as_float(u[k] & 0xffff0000u) * __uint_as_float(wv[k] & 0xffff0000u));
        const int pair = col / 2 + k;
        if (pair >= first_rope_pair) {
          const float2 cs = tr[pair - first_rope_pair];
          u[k] = rope_pair(u[k], cs.x, cs.y);
        }
      }
      o[lane + 32 * (piece0 + c)] = make_uint4(u[0], u[1], u[2], u[3]);
    }
  }
}

// A block of 8 warps a token where a token's heads fill it (q: 64 heads); rows of 2,048 columns
// and more two warps a row; else a row a warp.
template <int C>
void launch_norm_rope(const NormRope& p, cudaStream_t stream) {
  constexpr int kTokenRows = 8;  // rows a warp in the block-a-token form
  if constexpr (C <= 2) {        // (more columns a lane would not hold 8 rows in registers)
    if (p.rope_pairs > 0 && p.heads % (kNormWarps * kTokenRows) == 0)
      return norm_rope_kernel<C, kTokenRows, 1>
          <<<blocks_for(p.m, kNormWarps * kTokenRows), 32 * kNormWarps, 0, stream>>>(p);
  }
  if constexpr (C >= 8)
    norm_rope_kernel<C, 1, 2><<<blocks_for(p.m, kNormWarps / 2), 32 * kNormWarps, 0, stream>>>(p);
  else
    norm_rope_kernel<C, 1, 1><<<blocks_for(p.m, kNormWarps), 32 * kNormWarps, 0, stream>>>(p);
}

}  // namespace

void fast_rms_norm(const uint16_t* x, int64_t m, int64_t d, const uint16_t* w, float eps,
                   uint16_t* out, cudaStream_t stream) {
  fast_rms_norm_rope(x, m, 1, d, w, eps, out, 0, nullptr, 0, 1, stream);
}

void fast_rms_norm_rope(const uint16_t* x, int64_t tokens, int64_t heads, int64_t d,
                        const uint16_t* w, float eps, uint16_t* out, int64_t pos0,
                        const float* freqs, int64_t rope_pairs, int freq_scale,
                        cudaStream_t stream) {
  HETERO_CHECK(d % 2 == 0 && rope_pairs <= d / 2);
  const int64_t m = tokens * heads;
  if (m <= 0) return;
  const NormRope p{x, out, m, heads, d, w, eps, pos0, freqs, rope_pairs, freq_scale};
  const bool one_pass = d % 256 == 0 && rope_pairs <= kNormMaxPairs && m < (int64_t(1) << 31) &&
                        (reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(out) |
                         reinterpret_cast<uintptr_t>(w)) %
                                16 ==
                            0;
  if (one_pass) {
    switch (d / 256) {
      case 1:
        return launch_norm_rope<1>(p, stream);
      case 2:
        return launch_norm_rope<2>(p, stream);
      case 4:
        return launch_norm_rope<4>(p, stream);
      case 8:
        return launch_norm_rope<8>(p, stream);
      case 16:
        return launch_norm_rope<16>(p, stream);
      default:
        break;
    }
  }
  rms_norm_kernel<<<blocks_for(m, 8), 256, 0, stream>>>(x, m, d, w, eps, out);
  rope_pairs_only(out, tokens, heads, d, pos0, freqs, rope_pairs, freq_scale, false, stream);
}

void rope_pairs_only(uint16_t* x, int64_t rows, int64_t heads, int64_t head_dim, int64_t pos0,
                     const float* freqs, int64_t rope_pairs, int freq_scale, bool inverse,
                     cudaStream_t stream) {
  HETERO_CHECK(head_dim % 2 == 0 && rope_pairs <= head_dim / 2);
  if (rows <= 0 || heads <= 0 || rope_pairs <= 0) return;
  const size_t smem = size_t(2 * rope_pairs) * sizeof(float);
  rope_pairs_kernel<<<unsigned(rows), 256, smem, stream>>>(x, heads, head_dim, pos0, freqs,
                                                           rope_pairs, freq_scale, inverse);
}

}  // namespace hetero::cuda
