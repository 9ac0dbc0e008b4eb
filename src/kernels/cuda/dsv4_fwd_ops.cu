// Fast CUDA ops of the DeepSeek-V4 prefill forward: weights drawn on the device,
// hyper-connections and the MoE's routing, grouping and combination. See dsv4_fwd_ops.h; the
// norms and rope are in dsv4_fwd_norm.cu, the attention in dsv4_fwd_attention.cu, the indexer in
// dsv4_fwd_index.cu.
#include <algorithm>
#include <cfloat>
#include <string>

#include "kernels/cuda/dsv4_fwd_common.cuh"
#include "kernels/cuda/dsv4_fwd_ops.h"
#include "kernels/cuda/fp8_act_quant.cuh"
#include "kernels/cuda/mlx_math.cuh"
#include "kernels/cuda/mma_sm80.cuh"

namespace hetero::cuda {
namespace {

using namespace dsv4_fwd;

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
// Sum of four uniforms on [-0.5, 0.5), times sqrt(3): mean 0, variance 1.
__device__ __forceinline__ float hashed_normal(uint64_t seed, int64_t i) {
  const uint64_t z = mix64(seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(i));
  float s = 0.0f;
  for (int k = 0; k < 4; ++k) s += static_cast<float>((z >> (16 * k)) & 0xffff) / 65536.0f - 0.5f;
  return s * 1.7320508f;
}

__global__ void fill_bf16_kernel(uint16_t* x, int64_t n, float scale, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] = f2b(hashed_normal(seed, i) * scale);
}
__global__ void fill_f32_kernel(float* x, int64_t n, float scale, float offset, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] = offset + hashed_normal(seed, i) * scale;
}
__global__ void fill_i32_kernel(int32_t* x, int64_t n, int32_t modulo, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] = static_cast<int32_t>(mix64(seed + static_cast<uint64_t>(i)) % uint64_t(modulo));
}

__global__ void embed_kernel(const uint16_t* embed, const int32_t* ids, int64_t hc, int64_t hidden,
                             uint16_t* h) {
  const int64_t t = blockIdx.x;
  const uint4* src = reinterpret_cast<const uint4*>(embed + int64_t(ids[t]) * hidden);
  for (int64_t k = 0; k < hc; ++k) {
    uint4* dst = reinterpret_cast<uint4*>(h + (t * hc + k) * hidden);
    for (int64_t j = threadIdx.x; j < hidden / 8; j += blockDim.x) dst[j] = src[j];
  }
}

// ---- hyper-connections -------------------------------------------------------------------

constexpr int kHcTile = 128, kHcMaxMix = 32, kHcSplits = 16;

// Per token, mix_out holds: mixes [mix], pre [hc], post [hc], comb [hc*hc], then the partial
// sums of each column split [kHcSplits][mix + 1] (the last one the sum of squares).
__host__ __device__ inline int64_t hc_partial_offset(int64_t hc) {
  return (2 + hc) * hc + 2 * hc + hc * hc;
}

// Partial mixes over one split of the hc*hidden columns on the tensor cores: the mixes are a
// skinny GEMM [tokens, hc*hidden] x [hc*hidden, (2 + K) K] whose float32 fn would lose bits as a
// bf16 operand, so each fn value goes in as two bf16 terms, hi = bf16(fn) and lo = bf16(fn - hi)
// (what is left is below 2^-16 of fn), each product exact in the float32 accumulator. h is bf16
// already. 128 tokens per block, 16 per warp; columns in chunks of 32: h by cp.async three
// chunks deep (two left each block waiting on its copies: DRAM at 39% under Nsight Compute), fn's
// hi and lo terms staged through registers; the sum of squares from the A fragments.
// The CUDA-core form this replaced (one thread per token, 24 sums in registers) ran at an eighth
// of the memory bandwidth, two thirds of the hyper-connections' time (Nsight Compute, 8K tokens).
// hc_params_kernel adds the splits in order.
constexpr int kHcMixTok = 128, kHcMixCols = 32, kHcMixLd = kHcMixCols + 8, kHcMixRows = 32,
              kHcMixStages = 3;
static_assert(kHcMaxMix <= kHcMixRows, "the fn tile holds every mix");

__device__ __forceinline__ uint32_t hi_lo_bf16(float f, uint16_t* lo) {
  const __nv_bfloat16 hi = __float2bfloat16_rn(f);
  *lo = __bfloat16_as_ushort(__float2bfloat16_rn(f - __bfloat162float(hi)));
  return __bfloat16_as_ushort(hi);
}

template <int K>
__global__ void __launch_bounds__(256)
    hc_mix_kernel(HcParams p, const uint16_t* h, int64_t n, float* mix_out, int64_t stride,
                  int64_t splits) {
  constexpr int kMix = (2 + K) * K;
  __shared__ __align__(16) uint16_t hs[kHcMixStages][kHcMixTok][kHcMixLd];
  __shared__ __align__(16) uint16_t fs[2][2][kHcMixRows][kHcMixLd];  // [buffer][hi, lo][mix][col]
  const int64_t W = p.hc * p.hidden, cols = W / splits;
  const int64_t t0 = int64_t(blockIdx.x) * kHcMixTok, c0 = int64_t(blockIdx.y) * cols;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int mi = lane / 8, mr = lane % 8, g = lane / 4, c2 = (lane % 4) * 2;
  const int chunks = int(cols / kHcMixCols);
  // h: 128 rows x 4 pieces of 16 bytes per chunk, 2 a thread; rows past n read as zeros.
  constexpr int kPieces = kHcMixCols / 8;
  auto issue_h = [&](int ch, int buf) {
#pragma unroll
    for (int u = 0; u < kHcMixTok * kPieces / 256; ++u) {
      const int e = tid + u * 256, r = e / kPieces, c = (e % kPieces) * 8;
      const bool in = t0 + r < n;
      mma::cp_async16(&hs[buf][r][c], h + (in ? (t0 + r) * W : 0) + c0 + ch * kHcMixCols + c,
                      in ? 16 : 0);
    }
    mma::cp_async_commit();
  };
  // fn: kHcMixRows x 32 floats per chunk, a float4 a thread, rows past kMix as zeros.
  constexpr int kFnLoads = kHcMixRows * kHcMixCols / 4 / 256;
  float4 fv[kFnLoads];
  auto load_fn = [&](int ch) {
#pragma unroll
    for (int u = 0; u < kFnLoads; ++u) {
      const int e = tid + u * 256, j = e / (kHcMixCols / 4), c = (e % (kHcMixCols / 4)) * 4;
      fv[u] = j < kMix ? *reinterpret_cast<const float4*>(p.fn + j * W + c0 + ch * kHcMixCols + c)
                       : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  auto store_fn = [&](int buf) {
#pragma unroll
    for (int u = 0; u < kFnLoads; ++u) {
      const int e = tid + u * 256, j = e / (kHcMixCols / 4), c = (e % (kHcMixCols / 4)) * 4;
      uint16_t lo[4];
      const uint32_t h0 = hi_lo_bf16(fv[u].x, &lo[0]), h1 = hi_lo_bf16(fv[u].y, &lo[1]);
      const uint32_t h2 = hi_lo_bf16(fv[u].z, &lo[2]), h3 = hi_lo_bf16(fv[u].w, &lo[3]);
      *reinterpret_cast<uint2*>(&fs[buf][0][j][c]) = make_uint2(h0 | h1 << 16, h2 | h3 << 16);
      *reinterpret_cast<uint2*>(&fs[buf][1][j][c]) = make_uint2(
          uint32_t(lo[0]) | uint32_t(lo[1]) << 16, uint32_t(lo[2]) | uint32_t(lo[3]) << 16);
    }
  };
  float acc[kHcMixRows / 8][4] = {};
  float sq[2] = {0.f, 0.f};  // rows g and g + 8 of this warp, this lane's columns
  // Every trip commits one group (empty past the last chunk), so that all but the newest
  // kHcMixStages - 1 groups landed means chunk ch's h is in.
  for (int s = 0; s < kHcMixStages - 1; ++s) s < chunks ? issue_h(s, s) : mma::cp_async_commit();
  load_fn(0);
  store_fn(0);
  for (int ch = 0; ch < chunks; ++ch) {
    const int buf = ch % 2, hb = ch % kHcMixStages;
    const bool more = ch + 1 < chunks;
    const int next = ch + kHcMixStages - 1;  // into the buffer chunk ch - 1 was read from
    next < chunks ? issue_h(next, next % kHcMixStages) : mma::cp_async_commit();
    if (more) load_fn(ch + 1);
    mma::cp_async_wait<kHcMixStages - 1>();
    __syncthreads();  // chunk ch's h and fn are in
#pragma unroll
    for (int ks = 0; ks < kHcMixCols / 16; ++ks) {
      uint32_t a[4];
      mma::ldsm_x4(a, &hs[hb][warp * 16 + (mi % 2) * 8 + mr][ks * 16 + (mi / 2) * 8]);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float x = __uint_as_float(a[q] << 16), y = __uint_as_float(a[q] & 0xffff0000u);
        sq[q % 2] = fmaf(x, x, fmaf(y, y, sq[q % 2]));
      }
#pragma unroll
      for (int part = 0; part < 2; ++part)
#pragma unroll
        for (int nb = 0; nb < kHcMixRows / 16; ++nb) {
          uint32_t b[4];
          mma::ldsm_x4(b, &fs[buf][part][nb * 16 + (mi / 2) * 8 + mr][ks * 16 + (mi % 2) * 8]);
          mma::mma16816(acc[2 * nb], a, b[0], b[1]);
          mma::mma16816(acc[2 * nb + 1], a, b[2], b[3]);
        }
    }
    if (more) store_fn(buf ^ 1);  // its last readers passed the barrier above
    __syncthreads();              // every warp is done with buffers `buf` and `hb`
  }
  mma::cp_async_wait_all();  // the empty groups
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    sq[r] += __shfl_xor_sync(0xffffffffu, sq[r], 1);
    sq[r] += __shfl_xor_sync(0xffffffffu, sq[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t t = t0 + warp * 16 + g + 8 * r;
    if (t >= n) continue;
    float* part = mix_out + t * stride + hc_partial_offset(K) + blockIdx.y * (kMix + 1);
#pragma unroll
    for (int nt = 0; nt < kHcMixRows / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = nt * 8 + c2 + e;
        if (j < kMix) part[j] = acc[nt][2 * r + e];
      }
    if (c2 == 0) part[kMix] = sq[r];
  }
}

__device__ __forceinline__ float sigmoid_mlx(float x) {
  const float y = 1.0f / (1.0f + mlx_exp(fabsf(x)));
  return x < 0.0f ? y : 1.0f - y;
}

// One thread per token: pre, post and the Sinkhorn-normalised comb, the comb held in registers
// (K a template argument) and written once at the end.
template <int K>
__global__ void hc_params_kernel(HcParams p, int64_t n, float* mix_out, int64_t stride,
                                 int64_t splits) {
  const int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (t >= n) return;
  constexpr int kMix = (2 + K) * K;
  float* m = mix_out + t * stride;
  float mixes[kMix];
  {  // mixes = (h . fn) / rms(h), from the splits' partial sums
    const float* part = m + hc_partial_offset(K);
    float sq = 0.0f;
    for (int64_t s = 0; s < splits; ++s) sq += part[s * (kMix + 1) + kMix];
    const float r = 1.0f / sqrtf(sq / float(K * p.hidden) + p.norm_eps);
#pragma unroll
    for (int j = 0; j < kMix; ++j) {
      float a = 0.0f;
      for (int64_t s = 0; s < splits; ++s) a += part[s * (kMix + 1) + j];
      m[j] = mixes[j] = a * r;
    }
  }
  float* pre = m + kMix;
  float* post = pre + K;
  const float s0 = p.scale[0], s1 = p.scale[1], s2 = p.scale[2], eps = p.eps;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    pre[k] = sigmoid_mlx(mixes[k] * s0 + p.base[k]) + eps;
    post[k] = 2.0f * sigmoid_mlx(mixes[K + k] * s1 + p.base[K + k]);
  }
  float cb[K][K];
#pragma unroll
  for (int j = 0; j < K; ++j) {
    float mx = -INFINITY;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      cb[j][k] = mixes[2 * K + j * K + k] * s2 + p.base[2 * K + j * K + k];
      mx = fmaxf(mx, cb[j][k]);
    }
    float tot = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) tot += (cb[j][k] = mlx_exp(cb[j][k] - mx));
    const float inv = 1.0f / tot;
#pragma unroll
    for (int k = 0; k < K; ++k) cb[j][k] = cb[j][k] * inv + eps;
  }
  for (int64_t it = 0; it < p.sinkhorn_iters; ++it) {
    if (it > 0) {
#pragma unroll
      for (int j = 0; j < K; ++j) {
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < K; ++k) s += cb[j][k];
        const float d = s + eps;
#pragma unroll
        for (int k = 0; k < K; ++k) cb[j][k] = cb[j][k] / d;
      }
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      float s = 0.0f;
#pragma unroll
      for (int j = 0; j < K; ++j) s += cb[j][k];
      const float d = s + eps;
#pragma unroll
      for (int j = 0; j < K; ++j) cb[j][k] = cb[j][k] / d;
    }
  }
  float* out = post + K;
#pragma unroll
  for (int j = 0; j < K; ++j)
#pragma unroll
    for (int k = 0; k < K; ++k) out[j * K + k] = cb[j][k];
}

// The collapse and the expand: one thread per 8 columns of a token (16-byte loads and stores),
// its mix coefficients in registers (K = hc_mult a template argument); each element's arithmetic
// in the CPU engine's order.
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) w[e] = uint32_t(f2b(f[2 * e])) | (uint32_t(f2b(f[2 * e + 1])) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <int K>
__global__ void hc_collapse_kernel(HcParams p, const uint16_t* h, int64_t n, const float* mix_out,
                                   int64_t stride, uint16_t* x) {
  const int64_t H = p.hidden, groups = H / 8;
  const int64_t id = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (id >= n * groups) return;
  const int64_t t = id / groups, d0 = (id % groups) * 8;
  const float* pre = mix_out + t * stride + (2 + K) * K;
  float acc[8] = {};
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float v[8];
    unpack_bf16x8(*reinterpret_cast<const uint4*>(h + (t * K + k) * H + d0), v);
    const float w = pre[k];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], __fmul_rn(w, v[e]));
  }
  *reinterpret_cast<uint4*>(x + t * H + d0) = pack8(acc);
}

template <int K>
__global__ void hc_expand_kernel(HcParams p, const float* mix_out, int64_t stride,
                                 const uint16_t* y, int64_t n, uint16_t* h) {
  const int64_t H = p.hidden, groups = H / 8;
  const int64_t id = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (id >= n * groups) return;
  const int64_t t = id / groups, d0 = (id % groups) * 8;
  const float* post = mix_out + t * stride + (2 + K) * K + K;
  const float* cb = post + K;
  float res[K][8], yv[8];
#pragma unroll
  for (int j = 0; j < K; ++j)
    unpack_bf16x8(*reinterpret_cast<const uint4*>(h + (t * K + j) * H + d0), res[j]);
  unpack_bf16x8(*reinterpret_cast<const uint4*>(y + t * H + d0), yv);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float out[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float mixed = 0.0f;
#pragma unroll
      for (int j = 0; j < K; ++j) mixed = __fadd_rn(mixed, __fmul_rn(cb[j * K + k], res[j][e]));
      out[e] = __fadd_rn(__fmul_rn(post[k], yv[e]), mixed);
    }
    *reinterpret_cast<uint4*>(h + (t * K + k) * H + d0) = pack8(out);
  }
}

__global__ void broadcast_rows_kernel(const uint16_t* bias, int64_t n, int64_t cols,
                                      uint16_t* out) {
  const int64_t id = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (id < n * cols) out[id] = bias[id % cols];
}

// ---- MoE -----------------------------------------------------------------------------------

__device__ __forceinline__ float swiglu_one(float g, float u, float limit) {
  if (limit > 0.0f) {
    const float lb = rb(limit);
    g = fminf(g, lb);
    u = fminf(fmaxf(u, -lb), lb);
  }
  const float e = rb(mlx_exp(fabsf(g)));
  const float y = __fdiv_rn(1.0f, __fadd_rn(1.0f, e));
  const float sig = rb(g < 0 ? y : __fsub_rn(1.0f, y));
  const float silu = rb(__fmul_rn(g, sig));
  return __fmul_rn(silu, u);
}
// V consecutive outputs a thread (V = 8: 16-byte loads and stores, where inter % 8 == 0).
template <int V>
__global__ void swiglu_kernel(const uint16_t* gu, int64_t m, int64_t inter, float limit,
                              uint16_t* act) {
  const int64_t id = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * V;
  if (id >= m * inter) return;
  const int64_t row = id / inter, j = id % inter;
  const uint16_t* g = gu + row * 2 * inter + j;
  if constexpr (V == 8) {
    float gv[8], uv[8], y[8];
    unpack_bf16x8(*reinterpret_cast<const uint4*>(g), gv);
    unpack_bf16x8(*reinterpret_cast<const uint4*>(g + inter), uv);
#pragma unroll
    for (int e = 0; e < 8; ++e) y[e] = swiglu_one(gv[e], uv[e], limit);
    *reinterpret_cast<uint4*>(act + id) = pack8(y);
  } else {
    act[id] = f2b(swiglu_one(b2f(g[0]), b2f(g[inter]), limit));
  }
}

// fp8_act's Source: act's row `row` from column `col`, as swiglu_kernel writes it (each value
// rounded to bf16), from gu's gate and up halves.
struct SwigluRows {
  const uint16_t* gu;
  int64_t inter;
  float limit;
  __device__ __forceinline__ void load(int64_t row, int64_t col, float (&v)[8]) const {
    float g[8], u[8];
    unpack_bf16x8(*reinterpret_cast<const uint4*>(gu + row * 2 * inter + col), g);
    unpack_bf16x8(*reinterpret_cast<const uint4*>(gu + row * 2 * inter + inter + col), u);
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = rb(swiglu_one(g[e], u[e], limit));
  }
};

// One warp per token; E <= 32 * kRouteMaxPerLane.
constexpr int kRouteMaxPerLane = 16, kRouteMaxK = 16;
__global__ void route_kernel(RouterParams p, const uint16_t* logits, const int32_t* ids, int64_t n,
                             int32_t* inds, float* weights) {
  const int64_t t = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= n) return;
  const int64_t E = p.experts, K = p.top_k;
  float score[kRouteMaxPerLane], biased[kRouteMaxPerLane];
  float lmax = -INFINITY;
  for (int q = 0; q < kRouteMaxPerLane; ++q) {
    const int64_t e = lane + 32 * q;
    const float lg = e < E ? b2f(logits[t * E + e]) : -INFINITY;
    score[q] = lg;
    lmax = fmaxf(lmax, lg);
  }
  float tot = 0.0f;
  if (p.scoring == 2) lmax = warp_max(lmax);
  for (int q = 0; q < kRouteMaxPerLane; ++q) {
    const int64_t e = lane + 32 * q;
    if (e >= E) continue;
    const float lg = score[q];
    if (p.scoring == 0) {
      const float hi = fmaxf(lg, 0.0f), lo = fminf(lg, 0.0f);
      const float sp = (lo == -INFINITY || hi == INFINITY) ? hi : hi + log1pf(mlx_exp(lo - hi));
      score[q] = sqrtf(sp);
    } else if (p.scoring == 1) {
      score[q] = sigmoid_mlx(lg);
    } else {
      score[q] = mlx_exp(lg - lmax);
      tot += score[q];
    }
  }
  if (p.scoring == 2) {
    const float inv = 1.0f / warp_sum(tot);
    for (int q = 0; q < kRouteMaxPerLane; ++q) score[q] *= inv;
  }
  for (int q = 0; q < kRouteMaxPerLane; ++q) {
    const int64_t e = lane + 32 * q;
    biased[q] = e < E ? score[q] + (p.bias ? p.bias[e] : 0.0f) : -INFINITY;
  }
  int32_t sel[kRouteMaxK];
  float w[kRouteMaxK];
  for (int64_t k = 0; k < K; ++k) {
    if (p.tid2eid) {
      sel[k] = p.tid2eid[int64_t(ids[t]) * K + k];
    } else {
      // Highest biased score, lowest index on ties (the CPU engine's comparator).
      float best = -INFINITY;
      int32_t bi = INT32_MAX;
      for (int q = 0; q < kRouteMaxPerLane; ++q) {
        const int32_t e = lane + 32 * q;
        if (e < E && (biased[q] > best || (biased[q] == best && e < bi))) best = biased[q], bi = e;
      }
      for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int32_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ob > best || (ob == best && oi < bi)) best = ob, bi = oi;
      }
      sel[k] = bi;
      if (bi % 32 == lane) biased[bi / 32] = -INFINITY;
    }
    // The selected expert's score lives in lane sel % 32.
    float sv = 0.0f;
    for (int q = 0; q < kRouteMaxPerLane; ++q)
      if (lane + 32 * q == sel[k]) sv = score[q];
    w[k] = __shfl_sync(0xffffffffu, sv, sel[k] % 32);
  }
  if (lane != 0) return;
  if (p.scoring != 2 && p.norm_topk_prob) {
    float s = 0.0f;
    for (int64_t k = 0; k < K; ++k) s += w[k];
    const float d = s + 1e-20f;
    for (int64_t k = 0; k < K; ++k) w[k] = w[k] / d;
  }
  for (int64_t k = 0; k < K; ++k) {
    inds[t * K + k] = sel[k];
    weights[t * K + k] = w[k] * p.routed_scaling;
  }
}

__global__ void count_kernel(const int32_t* inds, int64_t slots, int32_t* counts) {
  const int64_t s = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (s < slots) atomicAdd(&counts[inds[s]], 1);
}
__global__ void scan_kernel(const int32_t* counts, int64_t experts, int32_t* offsets) {
  if (threadIdx.x != 0) return;
  int32_t acc = 0;
  for (int64_t e = 0; e < experts; ++e) offsets[e] = acc, acc += counts[e];
  offsets[experts] = acc;
}
// One block per expert: its slots in slot order (a stable grouping). Each pass takes 4 slots a
// thread (1,024 a block), their matches counted, ranked by a warp scan and the warps' totals: at
// 8K tokens x top-6 that is 48 passes a block where a slot a thread took 192, each behind two
// barriers.
constexpr int kPermPer = 4;
__global__ void perm_kernel(const int32_t* inds, int64_t slots, const int32_t* offsets,
                            int32_t* perm, int32_t* slot_row) {
  __shared__ int32_t warp_tot[32];
  const int32_t e = blockIdx.x;
  const int lane = threadIdx.x % 32, wid = threadIdx.x / 32, nw = blockDim.x / 32;
  int32_t running = offsets[e];
  for (int64_t base = 0; base < slots; base += int64_t(blockDim.x) * kPermPer) {
    const int64_t s0 = base + int64_t(threadIdx.x) * kPermPer;
    bool f[kPermPer];
    int32_t c = 0;
#pragma unroll
    for (int j = 0; j < kPermPer; ++j) {
      f[j] = s0 + j < slots && inds[s0 + j] == e;
      c += f[j];
    }
    int32_t incl = c;  // inclusive scan over the warp's lanes
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    if (lane == 31) warp_tot[wid] = incl;
    __syncthreads();
    int32_t before = 0, total = 0;
    for (int w = 0; w < nw; ++w) {
      if (w < wid) before += warp_tot[w];
      total += warp_tot[w];
    }
    int32_t row = running + before + incl - c;
#pragma unroll
    for (int j = 0; j < kPermPer; ++j) {
      if (f[j]) {
        perm[row] = static_cast<int32_t>(s0 + j);
        slot_row[s0 + j] = row;
        ++row;
      }
    }
    running += total;
    __syncthreads();
  }
}
__global__ void gather_kernel(const uint16_t* x, const int32_t* perm, int64_t top_k, int64_t hidden,
                              uint16_t* xe) {
  const int64_t row = blockIdx.x;
  const uint4* src = reinterpret_cast<const uint4*>(x + int64_t(perm[row] / top_k) * hidden);
  uint4* dst = reinterpret_cast<uint4*>(xe + row * hidden);
  for (int64_t j = threadIdx.x; j < hidden / 8; j += blockDim.x) dst[j] = src[j];
}
// Eight columns of a token a thread (hidden % 8 == 0), each column's sum in the expert order.
__global__ void combine_kernel(const uint16_t* ye, const int32_t* slot_row, const float* weights,
                               const uint16_t* shared, int64_t n, int64_t K, int64_t H,
                               uint16_t* out) {
  const int64_t id = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * 8;
  if (id >= n * H) return;
  const int64_t t = id / H, d = id % H;
  float acc[8] = {};
  for (int64_t k = 0; k < K; ++k) {
    float v[8];
    unpack_bf16x8(*reinterpret_cast<const uint4*>(ye + int64_t(slot_row[t * K + k]) * H + d), v);
    const float w = rb(weights[t * K + k]);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], rb(__fmul_rn(v[e], w)));
  }
  float y[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) y[e] = rb(acc[e]);
  if (shared) {
    float sh[8];
    unpack_bf16x8(*reinterpret_cast<const uint4*>(shared + id), sh);
#pragma unroll
    for (int e = 0; e < 8; ++e) y[e] = __fadd_rn(y[e], sh[e]);
  }
  *reinterpret_cast<uint4*>(out + id) = pack8(y);
}

}  // namespace

void fill_random_bf16(uint16_t* x, int64_t n, float scale, uint64_t seed, cudaStream_t stream) {
  if (n > 0) fill_bf16_kernel<<<4096, 256, 0, stream>>>(x, n, scale, seed);
}
void fill_random_f32(float* x, int64_t n, float scale, float offset, uint64_t seed,
                     cudaStream_t stream) {
  if (n > 0) fill_f32_kernel<<<1024, 256, 0, stream>>>(x, n, scale, offset, seed);
}
void fill_random_i32(int32_t* x, int64_t n, int32_t modulo, uint64_t seed, cudaStream_t stream) {
  if (n > 0) fill_i32_kernel<<<1024, 256, 0, stream>>>(x, n, modulo, seed);
}

Status check_forward_shapes(int64_t hidden, int64_t hc, int64_t experts, int64_t top_k) {
  if (hidden % 8 != 0)
    return invalid_argument("the CUDA forward needs hidden a multiple of 8, not " +
                            std::to_string(hidden));
  if ((2 + hc) * hc > kHcMaxMix || hc > 8 || (hc * hidden) % kHcTile != 0)
    return invalid_argument(
        "the CUDA hyper-connection kernels take hc_mult <= 4 with hc_mult * "
        "hidden a multiple of " +
        std::to_string(kHcTile) + ", not hc_mult " + std::to_string(hc) + ", hidden " +
        std::to_string(hidden));
  if (experts > 32 * kRouteMaxPerLane || top_k > kRouteMaxK)
    return invalid_argument("the CUDA router takes at most " +
                            std::to_string(32 * kRouteMaxPerLane) + " experts and top-" +
                            std::to_string(kRouteMaxK) + ", not " + std::to_string(experts) +
                            " and top-" + std::to_string(top_k));
  return Status::ok();
}

void embed_rows(const uint16_t* embed, const int32_t* ids, int64_t n, int64_t hc, int64_t hidden,
                uint16_t* h, cudaStream_t stream) {
  HETERO_CHECK(hidden % 8 == 0);
  if (n > 0) embed_kernel<<<static_cast<int>(n), 128, 0, stream>>>(embed, ids, hc, hidden, h);
}

int64_t hc_mix_floats(int64_t hc) {
  return hc_partial_offset(hc) + kHcSplits * ((2 + hc) * hc + 1);
}

namespace {
// The mixes, the coefficients and the collapse for hc_mult = K.
template <int K>
void hc_collapse_steps(const HcParams& p, const uint16_t* h, int64_t n, float* mix_out,
                       int64_t stride, int64_t splits, uint16_t* x, dim3 grid, int pb, int blocks,
                       cudaStream_t stream) {
  hc_mix_kernel<K><<<grid, 256, 0, stream>>>(p, h, n, mix_out, stride, splits);
  // One warp a block: each thread's Sinkhorn is a long dependent chain, so the tokens go to
  // every SM rather than to a few blocks of four warps.
  hc_params_kernel<K><<<pb, 32, 0, stream>>>(p, n, mix_out, stride, splits);
  hc_collapse_kernel<K><<<blocks, 256, 0, stream>>>(p, h, n, mix_out, stride, x);
}
}  // namespace

void hc_collapse(const HcParams& p, const uint16_t* h, int64_t n, float* mix_out, uint16_t* x,
                 cudaStream_t stream) {
  if (n == 0) return;
  HETERO_CHECK((2 + p.hc) * p.hc <= kHcMaxMix && p.hc >= 1 && p.hc <= 4);
  HETERO_CHECK((p.hc * p.hidden) % kHcTile == 0 && p.hidden % 8 == 0);
  const int64_t stride = hc_mix_floats(p.hc);
  int64_t splits = kHcSplits;
  while (splits > 1 && (p.hc * p.hidden) % (splits * kHcTile) != 0) splits /= 2;
  const dim3 grid(static_cast<unsigned>(blocks_for(n, kHcMixTok)), static_cast<unsigned>(splits));
  const int pb = blocks_for(n, 32), blocks = blocks_for(n * p.hidden / 8, 256);
  switch (p.hc) {
    case 1:
      hc_collapse_steps<1>(p, h, n, mix_out, stride, splits, x, grid, pb, blocks, stream);
      break;
    case 2:
      hc_collapse_steps<2>(p, h, n, mix_out, stride, splits, x, grid, pb, blocks, stream);
      break;
    case 3:
      hc_collapse_steps<3>(p, h, n, mix_out, stride, splits, x, grid, pb, blocks, stream);
      break;
    default:
      hc_collapse_steps<4>(p, h, n, mix_out, stride, splits, x, grid, pb, blocks, stream);
      break;
  }
}

void hc_expand(const HcParams& p, const float* mix_out, const uint16_t* y, int64_t n, uint16_t* h,
               cudaStream_t stream) {
  if (n == 0) return;
  HETERO_CHECK(p.hc >= 1 && p.hc <= 4 && p.hidden % 8 == 0);
  const int blocks = blocks_for(n * p.hidden / 8, 256);
  const int64_t stride = hc_mix_floats(p.hc);
  switch (p.hc) {
    case 1:
      hc_expand_kernel<1><<<blocks, 256, 0, stream>>>(p, mix_out, stride, y, n, h);
      break;
    case 2:
      hc_expand_kernel<2><<<blocks, 256, 0, stream>>>(p, mix_out, stride, y, n, h);
      break;
    case 3:
      hc_expand_kernel<3><<<blocks, 256, 0, stream>>>(p, mix_out, stride, y, n, h);
      break;
    default:
      hc_expand_kernel<4><<<blocks, 256, 0, stream>>>(p, mix_out, stride, y, n, h);
      break;
  }
}

void broadcast_rows(const uint16_t* bias, int64_t n, int64_t cols, uint16_t* out,
                    cudaStream_t stream) {
  if (n > 0)
    broadcast_rows_kernel<<<blocks_for(n * cols, 256), 256, 0, stream>>>(bias, n, cols, out);
}

void swiglu(const uint16_t* gu, int64_t m, int64_t inter, float limit, uint16_t* act,
            cudaStream_t stream) {
  if (m <= 0) return;
  if (inter % 8 == 0)
    swiglu_kernel<8><<<blocks_for(m * inter / 8, 256), 256, 0, stream>>>(gu, m, inter, limit, act);
  else
    swiglu_kernel<1><<<blocks_for(m * inter, 256), 256, 0, stream>>>(gu, m, inter, limit, act);
}

void swiglu_quantize_fp8_segments(const uint16_t* gu, int64_t inter, float limit,
                                  const int32_t* off, const int32_t* pad, int64_t segments,
                                  int64_t total_rows, uint8_t* q, float* scale, cudaStream_t stream,
                                  bool tight_scales) {
  fp8_act::quantize_segments(SwigluRows{gu, inter, limit}, off, pad, segments, total_rows, inter, q,
                             scale, stream, nullptr, 1, tight_scales);
}

void moe_route(const RouterParams& p, const uint16_t* logits, const int32_t* ids, int64_t n,
               int32_t* inds, float* weights, cudaStream_t stream) {
  HETERO_CHECK(p.experts <= 32 * kRouteMaxPerLane && p.top_k <= kRouteMaxK);
  if (n > 0) route_kernel<<<blocks_for(n, 8), 256, 0, stream>>>(p, logits, ids, n, inds, weights);
}

void moe_group(const int32_t* inds, int64_t slots, int64_t top_k, int64_t experts,
               const uint16_t* x, int64_t hidden, int32_t* counts, int32_t* offsets, int32_t* perm,
               int32_t* slot_row, uint16_t* xe, cudaStream_t stream) {
  cudaMemsetAsync(counts, 0, sizeof(int32_t) * experts, stream);
  if (slots == 0) {
    cudaMemsetAsync(offsets, 0, sizeof(int32_t) * (experts + 1), stream);
    return;
  }
  count_kernel<<<blocks_for(slots, 256), 256, 0, stream>>>(inds, slots, counts);
  scan_kernel<<<1, 32, 0, stream>>>(counts, experts, offsets);
  perm_kernel<<<static_cast<int>(experts), 256, 0, stream>>>(inds, slots, offsets, perm, slot_row);
  if (xe) gather_kernel<<<static_cast<int>(slots), 128, 0, stream>>>(x, perm, top_k, hidden, xe);
}

void moe_combine(const uint16_t* ye, const int32_t* slot_row, const float* weights,
                 const uint16_t* shared, int64_t n, int64_t top_k, int64_t hidden, uint16_t* out,
                 cudaStream_t stream) {
  HETERO_CHECK(hidden % 8 == 0);
  if (n > 0)
    combine_kernel<<<blocks_for(n * hidden / 8, 256), 256, 0, stream>>>(
        ye, slot_row, weights, shared, n, top_k, hidden, out);
}

}  // namespace hetero::cuda
