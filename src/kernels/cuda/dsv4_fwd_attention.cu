// The DeepSeek-V4 forward's attention over the local window and the (selected) compressed rows,
// and the indexer's selection of those rows. See dsv4_fwd_ops.h.
#include <cuda_bf16.h>
#include <mma.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <string>

#include "kernels/cuda/dsv4_fwd_common.cuh"
#include "kernels/cuda/dsv4_fwd_ops.h"
#include "kernels/cuda/mlx_math.cuh"

namespace hetero::cuda {
namespace {

using namespace dsv4_fwd;

// ---- attention -----------------------------------------------------------------------------

namespace wmma = nvcuda::wmma;
constexpr int kAttnHeads = 16, kAttnKeys = 32, kAttnThreads = 128;
constexpr int kPsLd = kAttnKeys + 16;

struct AttnSmem {
  int64_t ldb, ldo;
  size_t q_off, k_off, o_off, s_off, p_off, row_off, ptr_off, bytes;
};
__host__ __device__ inline AttnSmem attn_smem(int64_t D) {
  AttnSmem s;
  s.ldb = D + 16;
  s.ldo = D + 8;
  s.q_off = 0;
  s.k_off = s.q_off + size_t(kAttnHeads * s.ldb) * 2;
  s.o_off = s.k_off + size_t(kAttnKeys * s.ldb) * 2;
  s.s_off = s.o_off + size_t(kAttnHeads * s.ldo) * 4;
  s.p_off = s.s_off + size_t(2 * kAttnHeads * kAttnKeys) * 4;
  s.row_off = s.p_off + size_t(kAttnHeads * kPsLd) * 2;
  s.ptr_off = s.row_off + size_t(3 * kAttnHeads) * 4;
  s.bytes = s.ptr_off + size_t(kAttnKeys) * 8;
  return s;
}

// One block per (query, group of 16 heads): keys in tiles of 32 through shared memory, scores
// and P.V on tensor cores, an online softmax whose running max starts at the sink.
__global__ void __launch_bounds__(kAttnThreads) online_attention_kernel(SparseAttnParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int64_t D = p.head_dim;
  const AttnSmem L = attn_smem(D);
  __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(smem + L.q_off);
  __nv_bfloat16* Ks = reinterpret_cast<__nv_bfloat16*>(smem + L.k_off);
  float* Os = reinterpret_cast<float*>(smem + L.o_off);
  float* Sp = reinterpret_cast<float*>(smem + L.s_off);
  __nv_bfloat16* Ps = reinterpret_cast<__nv_bfloat16*>(smem + L.p_off);
  float* row_m = reinterpret_cast<float*>(smem + L.row_off);
  float* row_l = row_m + kAttnHeads;
  float* row_a = row_l + kAttnHeads;
  const uint16_t** kptr = reinterpret_cast<const uint16_t**>(smem + L.ptr_off);

  const int64_t i = blockIdx.x, h0 = int64_t(blockIdx.y) * kAttnHeads;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t pos = p.off + i;
  const int64_t lo = pos - p.window + 1 > 0 ? pos - p.window + 1 : 0;
  const int64_t nloc = pos - lo + 1;
  int64_t vis = p.ratio > 0 ? (pos + 1) / p.ratio : 0;
  if (vis > p.pooled_rows) vis = p.pooled_rows;
  const int64_t ncomp = p.ratio > 0 ? (p.topk ? p.k : vis) : 0;
  const int64_t nk = nloc + ncomp;

  for (int64_t e = tid; e < kAttnHeads * D; e += blockDim.x) {
    const int64_t r = e / D, c = e % D, h = h0 + r;
    const float v = h < p.heads ? rb(b2f(p.q[(i * p.heads + h) * D + c]) * p.scale) : 0.0f;
    Qs[r * L.ldb + c] = __float2bfloat16_rn(v);
    Os[r * L.ldo + c] = 0.0f;
  }
  if (tid < kAttnHeads) {
    row_m[tid] = h0 + tid < p.heads ? p.sinks[h0 + tid] : 0.0f;
    row_l[tid] = 1.0f;  // the sink's own weight, exp(sink - sink)
  }
  for (int64_t t0 = 0; t0 < nk; t0 += kAttnKeys) {
    if (tid < kAttnKeys) {
      const int64_t j = t0 + tid;
      const uint16_t* ptr = nullptr;
      if (j < nloc) {
        ptr = p.lk + (lo - p.lk_pos0 + j) * D;
      } else if (j < nk) {
        const int64_t c = j - nloc;
        const int64_t r = p.topk ? int64_t(p.topk[i * p.k + c]) : c;
        if (r < vis) ptr = p.pooled + r * D;
      }
      kptr[tid] = ptr;
    }
    __syncthreads();
    for (int64_t e = tid; e < kAttnKeys * D / 8; e += blockDim.x) {
      const int64_t r = e / (D / 8), c = (e % (D / 8)) * 8;
      const uint16_t* src = kptr[r];
      uint4 v = make_uint4(0, 0, 0, 0);
      if (src) v = *reinterpret_cast<const uint4*>(src + c);
      *reinterpret_cast<uint4*>(Ks + r * L.ldb + c) = v;
    }
    __syncthreads();
    {  // S = Q K^T: warp w computes key tile (w & 1) over half (w >> 1) of the head dim.
      const int nt = warp & 1, kh = warp >> 1;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
      const int64_t steps = D / 32;
      for (int64_t s = kh * steps; s < (kh + 1) * steps; ++s) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b;
        wmma::load_matrix_sync(a, Qs + s * 16, L.ldb);
        wmma::load_matrix_sync(b, Ks + nt * 16 * L.ldb + s * 16, L.ldb);
        wmma::mma_sync(acc, a, b, acc);
      }
      wmma::store_matrix_sync(Sp + kh * kAttnHeads * kAttnKeys + nt * 16, acc, kAttnKeys,
                              wmma::mem_row_major);
    }
    __syncthreads();
    // Online softmax: warp w owns rows 4w..4w+3, lane = key.
    for (int rr = 0; rr < kAttnHeads / 4; ++rr) {
      const int r = warp * (kAttnHeads / 4) + rr;
      const bool valid = kptr[lane] != nullptr;
      const float s = valid ? rb(Sp[r * kAttnKeys + lane] + Sp[(kAttnHeads + r) * kAttnKeys + lane])
                            : -INFINITY;
      const float m_old = row_m[r];
      const float m_new = fmaxf(m_old, warp_max(s));
      const float e = valid ? mlx_exp(s - m_new) : 0.0f;
      const float tot = warp_sum(e);
      Ps[r * kPsLd + lane] = __float2bfloat16_rn(e);
      __syncwarp();
      if (lane == 0) {
        const float a = mlx_exp(m_old - m_new);
        row_a[r] = a;
        row_l[r] = row_l[r] * a + tot;
        row_m[r] = m_new;
      }
    }
    __syncthreads();
    for (int64_t e = tid; e < kAttnHeads * D; e += blockDim.x) {
      const int64_t r = e / D, c = e % D;
      Os[r * L.ldo + c] *= row_a[r];
    }
    __syncthreads();
    for (int64_t nt = warp; nt < D / 16; nt += kAttnThreads / 32) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::load_matrix_sync(acc, Os + nt * 16, L.ldo, wmma::mem_row_major);
      for (int ks = 0; ks < kAttnKeys / 16; ++ks) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> b;
        wmma::load_matrix_sync(a, Ps + ks * 16, kPsLd);
        wmma::load_matrix_sync(b, Ks + ks * 16 * L.ldb + nt * 16, L.ldb);
        wmma::mma_sync(acc, a, b, acc);
      }
      wmma::store_matrix_sync(Os + nt * 16, acc, L.ldo, wmma::mem_row_major);
    }
    __syncthreads();
  }
  for (int64_t e = tid; e < kAttnHeads * D; e += blockDim.x) {
    const int64_t r = e / D, c = e % D, h = h0 + r;
    if (h < p.heads) p.out[(i * p.heads + h) * D + c] = f2b(Os[r * L.ldo + c] / row_l[r]);
  }
}

// The key list of query i (position pos): local rows first, then the compressed ones.
struct KeyList {
  int64_t lo, nloc, vis, nk;
};
__device__ inline KeyList key_list(const SparseAttnParams& p, int64_t i) {
  KeyList k;
  const int64_t pos = p.off + i;
  k.lo = pos - p.window + 1 > 0 ? pos - p.window + 1 : 0;
  k.nloc = pos - k.lo + 1;
  k.vis = p.ratio > 0 ? (pos + 1) / p.ratio : 0;
  if (k.vis > p.pooled_rows) k.vis = p.pooled_rows;
  k.nk = k.nloc + (p.ratio > 0 ? (p.topk ? p.k : k.vis) : 0);
  return k;
}
// Row of key j, or null where it is masked.
__device__ inline const uint16_t* key_row(const SparseAttnParams& p, int64_t i, const KeyList& k,
                                          int64_t j) {
  if (j < k.nloc) return p.lk + (k.lo - p.lk_pos0 + j) * p.head_dim;
  if (j >= k.nk) return nullptr;
  const int64_t c = j - k.nloc;
  const int64_t r = p.topk ? int64_t(p.topk[i * p.k + c]) : c;
  return r < k.vis ? p.pooled + r * p.head_dim : nullptr;
}

__device__ inline void load_key_tile(const SparseAttnParams& p, int64_t i, const KeyList& kl,
                                     int64_t t0, __nv_bfloat16* Ks, int64_t ldb) {
  const int64_t D = p.head_dim;
  for (int64_t e = threadIdx.x; e < kAttnKeys * D / 8; e += blockDim.x) {
    const int64_t r = e / (D / 8), c = (e % (D / 8)) * 8;
    const uint16_t* src = key_row(p, i, kl, t0 + r);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (src) v = *reinterpret_cast<const uint4*>(src + c);
    *reinterpret_cast<uint4*>(Ks + r * ldb + c) = v;
  }
}

constexpr int kTwoPassHeads = 32, kTwoPassThreads = 256;

struct TwoPassSmem {
  int64_t ldb, lds;
  size_t q_off, k_off, s_off, v_off, x_off, row_off, bytes;
};
__host__ __device__ inline TwoPassSmem two_pass_smem(int64_t D, int64_t nk_max) {
  TwoPassSmem s;
  s.ldb = D + 8;
  s.lds = (nk_max + kAttnKeys - 1) / kAttnKeys * kAttnKeys + 16;  // bf16 per score row
  s.q_off = 0;
  s.k_off = s.q_off + size_t(kTwoPassHeads * s.ldb) * 2;
  s.s_off = s.k_off + size_t(kAttnKeys * s.ldb) * 2;
  s.v_off = s.s_off + size_t(kTwoPassHeads * s.lds) * 2;
  s.x_off = s.v_off + (size_t(s.lds) + 31) / 32 * 32;
  s.row_off = s.x_off + size_t(kTwoPassThreads / 32) * 256 * 4;
  s.bytes = s.row_off + size_t(kTwoPassHeads) * 4;
  return s;
}

// Two passes over the keys: every score of the query into shared memory (as the bf16 values the
// decoder rounds them to), an exact softmax with the sink as an extra logit, then P.V with the
// output accumulators held in registers for the whole pass. One block per (query, 32 heads), so
// each key tile is read once per 32 heads; head_dim a multiple of 64, at most 512.
__global__ void __launch_bounds__(kTwoPassThreads)
    two_pass_attention_kernel(SparseAttnParams p, int64_t nk_max) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int64_t D = p.head_dim;
  const TwoPassSmem L = two_pass_smem(D, nk_max);
  __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(smem + L.q_off);
  __nv_bfloat16* Ks = reinterpret_cast<__nv_bfloat16*>(smem + L.k_off);
  __nv_bfloat16* Ss = reinterpret_cast<__nv_bfloat16*>(smem + L.s_off);
  uint8_t* valid = smem + L.v_off;
  float* Xs = reinterpret_cast<float*>(smem + L.x_off);
  float* inv_l = reinterpret_cast<float*>(smem + L.row_off);
  const int64_t i = blockIdx.x, h0 = int64_t(blockIdx.y) * kTwoPassHeads;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const KeyList kl = key_list(p, i);
  const int64_t tiles = (kl.nk + kAttnKeys - 1) / kAttnKeys;

  for (int64_t e = tid; e < kTwoPassHeads * D; e += blockDim.x) {
    const int64_t r = e / D, c = e % D, h = h0 + r;
    const float v = h < p.heads ? rb(b2f(p.q[(i * p.heads + h) * D + c]) * p.scale) : 0.0f;
    Qs[r * L.ldb + c] = __float2bfloat16_rn(v);
  }
  // Pass 1: warp w computes rows (w & 1), key sub-tile ((w >> 1) & 1), half (w >> 2) of the
  // head dim; the halves meet in Xs.
  const int rt = warp & 1, kt = (warp >> 1) & 1, kh = warp >> 2;
  float* x_part = Xs + (rt * 2 + kt) * 256;        // the upper half's partial
  float* x_sum = Xs + 1024 + (rt * 2 + kt) * 256;  // the sum, before rounding to bf16
  for (int64_t t = 0; t < tiles; ++t) {
    __syncthreads();
    load_key_tile(p, i, kl, t * kAttnKeys, Ks, L.ldb);
    if (tid < kAttnKeys)
      valid[t * kAttnKeys + tid] = key_row(p, i, kl, t * kAttnKeys + tid) != nullptr;
    __syncthreads();
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    const int64_t steps = D / 32;
    for (int64_t s = kh * steps; s < (kh + 1) * steps; ++s) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b;
      wmma::load_matrix_sync(a, Qs + rt * 16 * L.ldb + s * 16, L.ldb);
      wmma::load_matrix_sync(b, Ks + kt * 16 * L.ldb + s * 16, L.ldb);
      wmma::mma_sync(acc, a, b, acc);
    }
    if (kh == 1) wmma::store_matrix_sync(x_part, acc, 16, wmma::mem_row_major);
    __syncthreads();
    if (kh == 0) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> other;
      wmma::load_matrix_sync(other, x_part, 16, wmma::mem_row_major);
      for (int e = 0; e < acc.num_elements; ++e) acc.x[e] += other.x[e];
      wmma::store_matrix_sync(x_sum, acc, 16, wmma::mem_row_major);
      __syncwarp();
      for (int e = lane; e < 256; e += 32) {
        const int r = rt * 16 + e / 16, c = int(t * kAttnKeys) + kt * 16 + e % 16;
        Ss[r * L.lds + c] = __float2bfloat16_rn(x_sum[e]);
      }
    }
  }
  __syncthreads();
  // Softmax per row (warp w: rows 4w..4w+3) over the bf16 scores, the sink's mass in the sum;
  // P = exp(s - max) in bf16, in place.
  for (int rr = 0; rr < kTwoPassHeads / 8; ++rr) {
    const int r = warp * (kTwoPassHeads / 8) + rr;
    __nv_bfloat16* srow = Ss + r * L.lds;
    const float sink = h0 + r < p.heads ? p.sinks[h0 + r] : 0.0f;
    float mx = sink;
    for (int64_t j = lane; j < kl.nk; j += 32)
      if (valid[j]) mx = fmaxf(mx, __bfloat162float(srow[j]));
    mx = warp_max(mx);
    float tot = 0.0f;
    for (int64_t j = lane; j < tiles * kAttnKeys; j += 32) {
      const float e = (j < kl.nk && valid[j]) ? mlx_exp(__bfloat162float(srow[j]) - mx) : 0.0f;
      tot += e;
      srow[j] = __float2bfloat16_rn(e);
    }
    tot = warp_sum(tot) + mlx_exp(sink - mx);
    if (lane == 0) inv_l[r] = 1.0f / tot;
  }
  // Pass 2: O = P V; warp w owns rows (w & 1) and column tiles (w >> 1) + 4f.
  constexpr int kMaxFrag = 8;
  const int64_t nfrag = D / 64;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> o[kMaxFrag];
#pragma unroll
  for (int f = 0; f < kMaxFrag; ++f) wmma::fill_fragment(o[f], 0.0f);
  for (int64_t t = 0; t < tiles; ++t) {
    __syncthreads();
    load_key_tile(p, i, kl, t * kAttnKeys, Ks, L.ldb);
    __syncthreads();
    for (int ks = 0; ks < kAttnKeys / 16; ++ks) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
      wmma::load_matrix_sync(a, Ss + rt * 16 * L.lds + t * kAttnKeys + ks * 16, L.lds);
#pragma unroll
      for (int f = 0; f < kMaxFrag; ++f) {
        if (f >= nfrag) break;
        const int64_t ct = (warp >> 1) + 4 * f;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> b;
        wmma::load_matrix_sync(b, Ks + ks * 16 * L.ldb + ct * 16, L.ldb);
        wmma::mma_sync(o[f], a, b, o[f]);
      }
    }
  }
  __syncthreads();
  float* stage = Xs + warp * 256;
#pragma unroll
  for (int f = 0; f < kMaxFrag; ++f) {
    if (f >= nfrag) break;
    const int64_t ct = (warp >> 1) + 4 * f;
    wmma::store_matrix_sync(stage, o[f], 16, wmma::mem_row_major);
    __syncwarp();
    for (int e = lane; e < 256; e += 32) {
      const int64_t r = rt * 16 + e / 16, c = ct * 16 + e % 16, h = h0 + r;
      if (h < p.heads) p.out[(i * p.heads + h) * D + c] = f2b(stage[e] * inv_l[r]);
    }
    __syncwarp();
  }
}

// ---- indexer -------------------------------------------------------------------------------

constexpr int kIdxDim = 128, kIdxThreads = 256, kIdxMaxHeads = 64, kIdxMaxSort = 8192;

__device__ __forceinline__ uint64_t order_key(float score, uint32_t idx) {
  uint32_t u = __float_as_uint(score);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (uint64_t(u) << 32) | uint64_t(0xffffffffu - idx);
}
__device__ __forceinline__ uint32_t key_index(uint64_t k) {
  return 0xffffffffu - uint32_t(k & 0xffffffffu);
}

// Descending bitonic sort of keys[0, n2) (n2 a power of two) by the whole block.
__device__ void bitonic_desc(uint64_t* keys, int64_t n2) {
  for (int64_t size = 2; size <= n2; size <<= 1)
    for (int64_t stride = size >> 1; stride > 0; stride >>= 1) {
      __syncthreads();
      for (int64_t i = threadIdx.x; i < n2; i += blockDim.x) {
        const int64_t j = i ^ stride;
        if (j > i) {
          const bool desc = (i & size) == 0;
          const uint64_t a = keys[i], b = keys[j];
          if (desc ? a < b : a > b) keys[i] = b, keys[j] = a;
        }
      }
    }
  __syncthreads();
}

__host__ __device__ inline int64_t pow2_at_least(int64_t n) {
  int64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

// Score of one row by one warp: lane holds 4 of its 128 values; lanes own heads lane, lane+32.
template <typename ROW>
__device__ float score_row(const ROW* row, const float* qT, const float* wk, int64_t heads,
                           int lane) {
  float v[4];
  if constexpr (sizeof(ROW) == 2) {
    const uint2 u = *reinterpret_cast<const uint2*>(row + lane * 4);
    v[0] = b2f(uint16_t(u.x & 0xffff)), v[1] = b2f(uint16_t(u.x >> 16));
    v[2] = b2f(uint16_t(u.y & 0xffff)), v[3] = b2f(uint16_t(u.y >> 16));
  } else {
    const float4 f = *reinterpret_cast<const float4*>(row + lane * 4);
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
  }
  float a0 = 0.0f, a1 = 0.0f;
  const bool h1 = lane + 32 < heads;
#pragma unroll 4
  for (int d = 0; d < kIdxDim; ++d) {
    const float x = __shfl_sync(0xffffffffu, v[d & 3], d >> 2);
    a0 += qT[d * kIdxMaxHeads + lane] * x;
    if (h1) a1 += qT[d * kIdxMaxHeads + lane + 32] * x;
  }
  float s = lane < heads ? fmaxf(a0, 0.0f) * wk[lane] : 0.0f;
  if (h1) s += fmaxf(a1, 0.0f) * wk[lane + 32];
  return warp_sum(s);
}

__global__ void __launch_bounds__(kIdxThreads)
    index_select_kernel(IndexSelectParams p, uint32_t* topk) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* qT = reinterpret_cast<float*>(smem);  // [128][64]
  float* wk = qT + kIdxDim * kIdxMaxHeads;     // [64]
  uint64_t* keys = reinterpret_cast<uint64_t*>(wk + kIdxMaxHeads);
  const int64_t i = blockIdx.x;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = kIdxThreads / 32;
  for (int64_t e = threadIdx.x; e < kIdxDim * kIdxMaxHeads; e += blockDim.x) {
    const int64_t d = e / kIdxMaxHeads, h = e % kIdxMaxHeads;
    qT[e] = h < p.heads ? b2f(p.q[(i * p.heads + h) * kIdxDim + d]) : 0.0f;
  }
  for (int64_t h = threadIdx.x; h < kIdxMaxHeads; h += blockDim.x)
    wk[h] = h < p.heads ? b2f(p.w[i * p.heads + h]) * p.wscale * p.scale : 0.0f;
  __syncthreads();
  int64_t vis = (p.off + i + 1) / 4;
  if (vis > p.rows) vis = p.rows;
  const bool masked = !p.one_token;
  if (p.block > 0) {
    const int64_t nb = p.rows / p.block, kb = p.keep < nb ? p.keep : nb, cand = kb * p.block;
    int64_t n2 = pow2_at_least(nb);
    for (int64_t j = warp; j < n2; j += nw) {
      uint64_t key = 0;
      if (j < nb) {
        float s = score_row(p.rep + j * kIdxDim, qT, wk, p.heads, lane);
        if (masked && !(j * p.block < vis)) s = -1e30f;
        key = order_key(s, uint32_t(j));
      }
      if (lane == 0) keys[j] = key;
    }
    bitonic_desc(keys, n2);
    // Candidates: the rows of the kept blocks (their order does not matter for the set).
    uint32_t* blocks = reinterpret_cast<uint32_t*>(keys + kIdxMaxSort);
    for (int64_t b = threadIdx.x; b < kb; b += blockDim.x) blocks[b] = key_index(keys[b]);
    __syncthreads();
    n2 = pow2_at_least(cand);
    for (int64_t c = warp; c < n2; c += nw) {
      uint64_t key = 0;
      if (c < cand) {
        const int64_t pos = int64_t(blocks[c / p.block]) * p.block + c % p.block;
        float s = score_row(p.pooled + pos * kIdxDim, qT, wk, p.heads, lane);
        if (masked && !(pos < vis)) s = -1e30f;
        key = order_key(s, uint32_t(pos));
      }
      if (lane == 0) keys[c] = key;
    }
    bitonic_desc(keys, n2);
  } else {
    const int64_t n2 = pow2_at_least(p.rows);
    for (int64_t r = warp; r < n2; r += nw) {
      uint64_t key = 0;
      if (r < p.rows) {
        float s = score_row(p.pooled + r * kIdxDim, qT, wk, p.heads, lane);
        if (masked && !(r < vis)) s = -FLT_MAX;
        key = order_key(s, uint32_t(r));
      }
      if (lane == 0) keys[r] = key;
    }
    bitonic_desc(keys, n2);
  }
  for (int64_t t = threadIdx.x; t < p.k; t += blockDim.x) topk[i * p.k + t] = key_index(keys[t]);
}

__global__ void block_means_kernel(const uint16_t* pooled, int64_t nb, int64_t block,
                                   bool one_token, float* rep) {
  const int64_t id = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (id >= nb * kIdxDim) return;
  const int64_t j = id / kIdxDim, d = id % kIdxDim;
  float acc = 0.0f;
  for (int64_t r = 0; r < block; ++r)
    acc = __fadd_rn(acc, b2f(pooled[(j * block + r) * kIdxDim + d]));
  if (one_token)
    rep[id] = rb(__fmul_rn(rb(acc), rb(__fdiv_rn(1.0f, float(block)))));
  else
    rep[id] = __fmul_rn(acc, __fdiv_rn(1.0f, float(block)));
}

}  // namespace

// The keys the selection sorts: every row, or with HISA the block means and the kept blocks' rows.
static int64_t index_sort_keys(int64_t rows, int64_t block, int64_t keep) {
  if (block <= 0) return rows;
  const int64_t nb = rows / block;
  return std::max<int64_t>(nb, (keep < nb ? keep : nb) * block);
}

Status check_attention_shapes(int64_t head_dim, int64_t index_heads) {
  if (head_dim % 64 != 0 || head_dim > 512)
    return invalid_argument("the CUDA attention takes head_dim a multiple of 64 up to 512, not " +
                            std::to_string(head_dim));
  if (index_heads > kIdxMaxHeads)
    return invalid_argument("the CUDA indexer takes at most " + std::to_string(kIdxMaxHeads) +
                            " heads, not " + std::to_string(index_heads));
  return Status::ok();
}

Status check_index_select(int64_t rows, int64_t block, int64_t keep) {
  const int64_t keys = index_sort_keys(rows, block, keep);
  if (pow2_at_least(keys) <= kIdxMaxSort) return Status::ok();
  return failed_precondition("the CUDA indexer sorts at most " + std::to_string(kIdxMaxSort) +
                             " keys per query; " + std::to_string(rows) + " compressed rows" +
                             (block > 0 ? " with HISA blocks of " + std::to_string(block) +
                                              ", keeping " + std::to_string(keep)
                                        : std::string(" without HISA")) +
                             " need " + std::to_string(keys));
}

void sparse_attention(const SparseAttnParams& p, cudaStream_t stream) {
  if (p.m == 0) return;
  HETERO_CHECK(p.head_dim % 64 == 0 && p.head_dim <= 512);
  static bool configured = false;
  if (!configured) {
    cudaFuncSetAttribute(online_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         220 * 1024);
    cudaFuncSetAttribute(two_pass_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         220 * 1024);
    configured = true;
  }
  // The most keys a query of this call has: the last one's (both counts grow with position).
  const int64_t last = p.off + p.m - 1;
  int64_t nk_max = std::min<int64_t>(p.window, last + 1);
  if (p.ratio > 0) nk_max += p.topk ? p.k : std::min<int64_t>(p.pooled_rows, (last + 1) / p.ratio);
  const TwoPassSmem L3 = two_pass_smem(p.head_dim, nk_max);
  if (L3.bytes <= 200 * 1024 && !p.online_only) {
    const dim3 grid3(static_cast<unsigned>(p.m),
                     static_cast<unsigned>((p.heads + kTwoPassHeads - 1) / kTwoPassHeads));
    two_pass_attention_kernel<<<grid3, kTwoPassThreads, L3.bytes, stream>>>(p, nk_max);
    return;
  }
  const AttnSmem L = attn_smem(p.head_dim);  // long key lists: the online-softmax kernel
  const dim3 grid(static_cast<unsigned>(p.m),
                  static_cast<unsigned>((p.heads + kAttnHeads - 1) / kAttnHeads));
  online_attention_kernel<<<grid, kAttnThreads, L.bytes, stream>>>(p);
}

void index_select(const IndexSelectParams& p, uint32_t* topk, cudaStream_t stream) {
  if (p.m == 0) return;
  HETERO_CHECK(p.heads <= kIdxMaxHeads);
  int64_t extra = 0;
  if (p.block > 0) {
    const int64_t nb = p.rows / p.block;
    extra = (p.keep < nb ? p.keep : nb) * 4;
  }
  HETERO_CHECK(pow2_at_least(index_sort_keys(p.rows, p.block, p.keep)) <= kIdxMaxSort);
  const size_t bytes = size_t(kIdxDim * kIdxMaxHeads + kIdxMaxHeads) * 4 + size_t(kIdxMaxSort) * 8 +
                       size_t(extra) + 16;
  static bool configured = false;
  if (!configured) {
    cudaFuncSetAttribute(index_select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         200 * 1024);
    configured = true;
  }
  index_select_kernel<<<static_cast<unsigned>(p.m), kIdxThreads, bytes, stream>>>(p, topk);
}

void hisa_block_means(const uint16_t* pooled, int64_t rows, int64_t block, bool one_token,
                      float* rep, cudaStream_t stream) {
  const int64_t nb = rows / block;
  if (nb > 0)
    block_means_kernel<<<blocks_for(nb * kIdxDim, 256), 256, 0, stream>>>(pooled, nb, block,
                                                                          one_token, rep);
}

}  // namespace hetero::cuda
