// CUDA ops in the decoder's arithmetic: see ops.h. Compiled with --fmad=false; the explicit
// __fmaf_rn calls (in mlx_math.cuh) are exactly MLX's fma steps.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cuda/mlx_math.cuh"
#include "kernels/cuda/mma_sm80.cuh"
#include "kernels/cuda/ops.h"

namespace hetero::cuda {
namespace {

// The ordered GEMM's tiles (gemm_ordered_kernel below).
constexpr int kBm = 128, kBn = 128, kBk = 16, kTm = 8, kTn = 8;
constexpr int kPadA = 4;  // A's transposed tile rows, padded: fewer bank conflicts on its stores
// The column of C a thread's accumulator j holds, within the block's tile.
__device__ __forceinline__ int tile_col(int tx, int j) {
  return (j / 4) * (kBn / 2) + tx * 4 + j % 4;
}

template <bool kFma>
__device__ __forceinline__ float mac(float s, float a, float b) {
  return kFma ? __fmaf_rn(a, b, s) : __fadd_rn(s, __fmul_rn(a, b));
}

// One k step of 16 (lim == kBk) or the tail (lim < kBk) on the thread's 8 x 8 accumulators.
template <bool kFma>
__device__ __forceinline__ void gemm_step(const float (&as)[kBk][kBm + kPadA],
                                          const float (&bs)[kBk][kBn], int lim, int tx, int ty,
                                          float (&acc)[kTm][kTn]) {
  if (lim == kBk) {
#pragma unroll
    for (int kk = 0; kk < kBk; ++kk) {
      float av[kTm], bv[kTn];
      *reinterpret_cast<float4*>(&av[0]) = *reinterpret_cast<const float4*>(&as[kk][ty * kTm]);
      *reinterpret_cast<float4*>(&av[4]) = *reinterpret_cast<const float4*>(&as[kk][ty * kTm + 4]);
      *reinterpret_cast<float4*>(&bv[0]) = *reinterpret_cast<const float4*>(&bs[kk][tx * 4]);
      *reinterpret_cast<float4*>(&bv[4]) =
          *reinterpret_cast<const float4*>(&bs[kk][kBn / 2 + tx * 4]);
#pragma unroll
      for (int i = 0; i < kTm; ++i)
#pragma unroll
        for (int j = 0; j < kTn; ++j) acc[i][j] = mac<kFma>(acc[i][j], av[i], bv[j]);
    }
  } else {
    for (int kk = 0; kk < lim; ++kk) {
#pragma unroll
      for (int i = 0; i < kTm; ++i)
#pragma unroll
        for (int j = 0; j < kTn; ++j)
          acc[i][j] = mac<kFma>(acc[i][j], as[kk][ty * kTm + i], bs[kk][tile_col(tx, j)]);
    }
  }
}

// The next k tile's A (128 rows x 16 k) into registers, two float4 a thread (vector loads where
// the tile is whole and aligned; zeros outside the matrix, which the k loop never reads and the
// store never writes).
__device__ __forceinline__ void load_a_tile(const float* __restrict__ a, int64_t m, int64_t k,
                                            int64_t m0, int64_t k0, bool vec_a, int tid,
                                            float4 (&ra)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int f = tid + h * 256;
    const int r = f >> 2, kq = (f & 3) * 4;  // row, first k of its quad
    const int64_t gr = m0 + r, gk = k0 + kq;
    if (vec_a) {
      ra[h] = gr < m ? *reinterpret_cast<const float4*>(a + gr * k + gk) : make_float4(0, 0, 0, 0);
    } else {
      float v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = (gr < m && gk + u < k) ? a[gr * k + gk + u] : 0.0f;
      ra[h] = make_float4(v[0], v[1], v[2], v[3]);
    }
  }
}

// The next k tile's B (16 k x 128 columns) straight into shared memory: cp.async where B's rows
// are whole 16-byte pieces (zero fill outside the matrix), else plain loads and stores. Either
// way it needs no registers across the tile's multiply, which the A tile's staging does.
__device__ __forceinline__ void load_b_tile(const float* __restrict__ b, int64_t n, int64_t k,
                                            int64_t n0, int64_t k0, bool vec_b, int tid,
                                            float (&bs)[kBk][kBn]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int f = tid + h * 256;
    const int kk = f >> 5, nq = (f & 31) * 4;  // k row, first column of its quad
    const int64_t gk = k0 + kk, gc = n0 + nq;
    if (vec_b) {  // n % 4 == 0: a quad is wholly inside or wholly outside
      const bool in = gk < k && gc < n;
      mma::cp_async16(&bs[kk][nq], in ? b + gk * n + gc : b, in ? 16 : 0);
    } else {
      float v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = (gk < k && gc + u < n) ? b[gk * n + gc + u] : 0.0f;
      *reinterpret_cast<float4*>(&bs[kk][nq]) = make_float4(v[0], v[1], v[2], v[3]);
    }
  }
  mma::cp_async_commit();
}

__device__ __forceinline__ void store_a_tile(const float4 (&ra)[2], int tid,
                                             float (&as)[kBk][kBm + kPadA]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int f = tid + h * 256;
    const int r = f >> 2, kq = (f & 3) * 4;
    as[kq + 0][r] = ra[h].x, as[kq + 1][r] = ra[h].y, as[kq + 2][r] = ra[h].z,
            as[kq + 3][r] = ra[h].w;
  }
}

// C += A @ B with every C element's sum in ascending k, one rounding per multiply and per add:
// the CPU op's order. Register-blocked: a 128 x 128 tile of C per block of 256 threads, 8 x 8
// elements per thread (rows 8 ty .. + 7; columns 4 tx .. + 3 and 64 + 4 tx .. + 3, so a warp's
// 16-byte reads of a B row are 16 consecutive pieces, free of bank conflicts), k in steps of 16
// through shared memory, double-buffered (the next A tile is loaded into registers and the next
// B tile copied asynchronously while this one is multiplied). kBlocksPerSm 2 caps it at 128
// registers a thread, two blocks a multiprocessor, for grids of more blocks than multiprocessors
// (+8-12% alone on an H100 at 8K x 4K x 1K and 2K x 2K x 8K); a grid that one block a
// multiprocessor holds runs the 1 form (183 registers, more loads in flight a warp): in the 2
// form it shared half the multiprocessors two blocks each, 30% slower on 8K x 4K x 256 (RESULTS
// §47.1). The tail of k is not padded (an added 0 * b could turn -0 into +0, or inf into NaN): the
// last step runs only the valid k.
//
// Where every product a*b is exact in float32 (the caller's flag, exact_products_flag), the
// multiply-add runs as one FMA: fma(a, b, s) rounds a*b + s once, which is round(round(a*b) + s)
// when round(a*b) == a*b, so the sums are the same bits at half the instructions.
template <int kBlocksPerSm>
__global__ void __launch_bounds__(256, kBlocksPerSm)
    gemm_ordered_kernel(const float* __restrict__ a, int64_t m, int64_t k,
                        const float* __restrict__ b, int64_t n, float* __restrict__ c,
                        const int* __restrict__ fma_ok) {
  __shared__ __align__(16) float as[2][kBk][kBm + kPadA];  // A tile transposed: as[kk][row]
  __shared__ __align__(16) float bs[2][kBk][kBn];
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int64_t m0 = int64_t(blockIdx.y) * kBm, n0 = int64_t(blockIdx.x) * kBn;
  const bool fma = fma_ok != nullptr && *fma_ok != 0;  // the same for every thread
  const bool a_aligned = (k % 4 == 0) && (reinterpret_cast<uintptr_t>(a) % 16 == 0);
  const bool vec_b = (n % 4 == 0) && (reinterpret_cast<uintptr_t>(b) % 16 == 0);
  float acc[kTm][kTn];
#pragma unroll
  for (int i = 0; i < kTm; ++i)
#pragma unroll
    for (int j = 0; j < kTn; ++j) {
      const int64_t r = m0 + ty * kTm + i, col = n0 + tile_col(tx, j);
      acc[i][j] = (r < m && col < n) ? c[r * n + col] : 0.0f;
    }
  float4 ra[2];
  load_a_tile(a, m, k, m0, 0, a_aligned && kBk <= k, tid, ra);
  load_b_tile(b, n, k, n0, 0, vec_b, tid, bs[0]);
  store_a_tile(ra, tid, as[0]);
  mma::cp_async_wait_all();
  __syncthreads();
  int cur = 0;
  for (int64_t k0 = 0; k0 < k; k0 += kBk) {
    const int64_t next = k0 + kBk;
    // The other buffers were last read before the previous barrier.
    if (next < k) {
      load_a_tile(a, m, k, m0, next, a_aligned && next + kBk <= k, tid, ra);
      load_b_tile(b, n, k, n0, next, vec_b, tid, bs[cur ^ 1]);
    }
    const int lim = (k - k0 < kBk) ? int(k - k0) : kBk;
    if (fma)
      gemm_step<true>(as[cur], bs[cur], lim, tx, ty, acc);
    else
      gemm_step<false>(as[cur], bs[cur], lim, tx, ty, acc);
    if (next < k) store_a_tile(ra, tid, as[cur ^ 1]);
    mma::cp_async_wait_all();
    __syncthreads();
    cur ^= 1;
  }
#pragma unroll
  for (int i = 0; i < kTm; ++i)
#pragma unroll
    for (int j = 0; j < kTn; ++j) {
      const int64_t r = m0 + ty * kTm + i, col = n0 + tile_col(tx, j);
      if (r < m && col < n) c[r * n + col] = acc[i][j];
    }
}

// The exponent of a bf16 value's last significand bit (its unit in the last place), as
// exact_products_flag needs it; subnormals have the smallest normal's.
__device__ __forceinline__ int bf16_lsb_exponent(uint32_t bits) {
  const int e = int((bits >> 7) & 0xffu);
  return (e == 0 ? 1 : e) - 134;
}

// stats[0] = min lsb exponent over nonzero x, stats[1] = max biased exponent, stats[2] = any
// non-finite. A block reduces in shared memory, then one atomic per block.
__global__ void bf16_range_kernel(const uint16_t* __restrict__ x, int64_t count, int* stats) {
  int lo = 1 << 20, hi = -(1 << 20), bad = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t v = x[i];
    const int e = int((v >> 7) & 0xffu);
    if (e == 0xff) bad = 1;
    if ((v & 0x7fffu) == 0) continue;
    lo = min(lo, bf16_lsb_exponent(v));
    hi = max(hi, e);
  }
  __shared__ int s_lo[256], s_hi[256], s_bad[256];
  s_lo[threadIdx.x] = lo, s_hi[threadIdx.x] = hi, s_bad[threadIdx.x] = bad;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (int(threadIdx.x) < w) {
      s_lo[threadIdx.x] = min(s_lo[threadIdx.x], s_lo[threadIdx.x + w]);
      s_hi[threadIdx.x] = max(s_hi[threadIdx.x], s_hi[threadIdx.x + w]);
      s_bad[threadIdx.x] |= s_bad[threadIdx.x + w];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    atomicMin(&stats[0], s_lo[0]);
    atomicMax(&stats[1], s_hi[0]);
    atomicOr(&stats[2], s_bad[0]);
  }
}

__global__ void bf16_range_init_kernel(int* stats) {
  stats[0] = 1 << 20, stats[1] = -(1 << 20), stats[2] = 0;
}

// A product x*w of two bf16 values is exact in float32 when its last bit is at or above 2^-149
// (float32's smallest subnormal: the 16-bit product significand always fits in 24 bits) and it
// stays below 2^128. Bounds of |x| * |w| from the exponents: lsb(x) + lsb(w) >= -149, and
// (hi_x - 126) + (hi_w - 126) <= 128 with hi the largest biased exponent.
__global__ void exact_flag_kernel(const int* stats, int w_min_lsb, int w_max_exp, int* flag) {
  const bool finite = stats[2] == 0;
  const bool low_ok = stats[0] == (1 << 20) || stats[0] + w_min_lsb >= -149;
  const bool high_ok = stats[1] + w_max_exp <= 380;
  *flag = finite && low_ok && high_ok ? 1 : 0;
}

__global__ void heads_major_kernel(const uint16_t* x, int64_t n, int64_t heads, int64_t d,
                                   uint16_t* out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n * heads * d) return;
  const int64_t t = i / (heads * d), h = (i / d) % heads, j = i % d;
  out[(h * n + t) * d + j] = x[i];
}

__global__ void bf16_to_f32_kernel(const uint16_t* x, int64_t n, float* out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = b2f(x[i]);
}

__global__ void round_linear_kernel(const float* acc, int64_t m, int64_t n, const uint16_t* bias,
                                    uint16_t* out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= m * n) return;
  float v = acc[i];
  if (bias) v = __fadd_rn(v, b2f(bias[i % n]));
  out[i] = f2b(v);
}

__global__ void add_bias_kernel(uint16_t* out, int64_t m, int64_t n, const uint16_t* bias) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= m * n) return;
  out[i] = f2b(__fadd_rn(b2f(out[i]), b2f(bias[i % n])));
}

// One block per row: the sum of squares is sequential (thread 0), the outputs parallel.
__global__ void rms_norm_kernel(const uint16_t* x, int64_t d, const uint16_t* w, float eps,
                                uint16_t* out) {
  __shared__ float r;
  const uint16_t* xr = x + int64_t(blockIdx.x) * d;
  if (threadIdx.x == 0) {
    float s = 0.0f;
    for (int64_t j = 0; j < d; ++j) {
      const float v = b2f(xr[j]);
      s = __fadd_rn(s, __fmul_rn(v, v));
    }
    const float inv_n = float(1.0 / double(d));
    r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fmul_rn(s, inv_n), eps)));
  }
  __syncthreads();
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    const float y = rb(__fmul_rn(b2f(xr[j]), r));
    out[int64_t(blockIdx.x) * d + j] = f2b(__fmul_rn(y, b2f(w[j])));
  }
}

// One thread per (token, head, rotated pair).
__global__ void rope_kernel(uint16_t* x, int64_t tokens, int64_t heads, int64_t head_dim,
                            int64_t pos0, RopeTable r) {
  const int64_t half = r.dims / 2;
  const int64_t id = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (id >= tokens * heads * half) return;
  const int64_t i = id % half, h = (id / half) % heads, t = id / (half * heads);
  const float pos = __fmul_rn(__fadd_rn(float(t), float(pos0)), r.scale);
  const float theta = __fmul_rn(pos, r.inv[i]);
  const float co = rb(mlx_sincos(theta, false)), si = rb(mlx_sincos(theta, true));
  uint16_t* row = x + (t * heads + h) * head_dim;
  const int64_t a = r.traditional ? 2 * i : i, b = r.traditional ? 2 * i + 1 : i + half;
  float x1 = b2f(row[a]), x2 = b2f(row[b]);
  if (r.scales_input) x1 = rb(__fmul_rn(x1, r.input_scale)), x2 = rb(__fmul_rn(x2, r.input_scale));
  row[a] = f2b(__fsub_rn(rb(__fmul_rn(x1, co)), rb(__fmul_rn(x2, si))));
  row[b] = f2b(__fadd_rn(rb(__fmul_rn(x1, si)), rb(__fmul_rn(x2, co))));
}

__global__ void silu_mul_kernel(const uint16_t* gate, const uint16_t* up, int64_t n,
                                uint16_t* out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float g = b2f(gate[i]);
  const float e = rb(mlx_exp(fabsf(g)));
  const float y = __fdiv_rn(1.0f, __fadd_rn(1.0f, e));
  const float sig = rb(g < 0 ? y : __fsub_rn(1.0f, y));
  const float silu = rb(__fmul_rn(g, sig));
  out[i] = f2b(__fmul_rn(silu, b2f(up[i])));
}

__global__ void add_kernel(const uint16_t* a, const uint16_t* b, int64_t n, uint16_t* out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = f2b(__fadd_rn(b2f(a[i]), b2f(b[i])));
}

// Scores for one (query row, q head) per block; keys across threads; each a d-long ordered sum.
__global__ void attn_scores_kernel(const uint16_t* q, int64_t n, int64_t q_heads, const uint16_t* k,
                                   int64_t kv_heads, int64_t d, int64_t pos0, float scale_b,
                                   int64_t window, float* s) {
  const int64_t i = blockIdx.x, hq = blockIdx.y, total = pos0 + n;
  const int64_t g = hq / (q_heads / kv_heads), visible = pos0 + i + 1;
  const int64_t first = window > 0 ? max(int64_t(0), visible - window) : 0;
  const uint16_t* qr = q + (i * q_heads + hq) * d;
  float* row = s + (hq * n + i) * total;
  for (int64_t j = first + threadIdx.x; j < visible; j += blockDim.x) {
    const uint16_t* kr = k + (j * kv_heads + g) * d;
    float acc = 0.0f;
    for (int64_t e = 0; e < d; ++e)
      acc = __fadd_rn(acc, __fmul_rn(rb(__fmul_rn(b2f(qr[e]), scale_b)), b2f(kr[e])));
    row[j] = rb(acc);
  }
}

// Softmax per row: max (order-free), exp, a sequential sum (thread 0), then probabilities. With
// a window, keys before it are the decoder's masked ones: exact zeros in its sums, skipped here.
__global__ void attn_softmax_kernel(int64_t n, int64_t pos0, int64_t window, float* s) {
  const int64_t i = blockIdx.x, hq = blockIdx.y, total = pos0 + n, visible = pos0 + i + 1;
  const int64_t first = window > 0 ? max(int64_t(0), visible - window) : 0;
  float* row = s + (hq * n + i) * total;
  __shared__ float mx, inv;
  if (threadIdx.x == 0) {
    float m = -INFINITY;
    for (int64_t j = first; j < visible; ++j) m = fmaxf(m, row[j]);
    mx = m;
  }
  __syncthreads();
  for (int64_t j = first + threadIdx.x; j < visible; j += blockDim.x)
    row[j] = mlx_exp(__fsub_rn(row[j], mx));
  __syncthreads();
  if (threadIdx.x == 0) {
    float tot = 0.0f;
    for (int64_t j = first; j < visible; ++j) tot = __fadd_rn(tot, row[j]);
    inv = __fdiv_rn(1.0f, tot);
  }
  __syncthreads();
  for (int64_t j = first + threadIdx.x; j < visible; j += blockDim.x)
    row[j] = rb(__fmul_rn(row[j], inv));
}

// Output: thread per dim, ordered sum over the visible keys.
__global__ void attn_pv_kernel(const float* s, int64_t n, int64_t q_heads, const uint16_t* v,
                               int64_t kv_heads, int64_t d, int64_t pos0, int64_t window,
                               uint16_t* out) {
  const int64_t i = blockIdx.x, hq = blockIdx.y, total = pos0 + n, visible = pos0 + i + 1;
  const int64_t first = window > 0 ? max(int64_t(0), visible - window) : 0;
  const int64_t g = hq / (q_heads / kv_heads);
  const float* row = s + (hq * n + i) * total;
  for (int64_t e = threadIdx.x; e < d; e += blockDim.x) {
    float acc = 0.0f;
    for (int64_t j = first; j < visible; ++j)
      acc = __fadd_rn(acc, __fmul_rn(row[j], b2f(v[(j * kv_heads + g) * d + e])));
    out[(i * q_heads + hq) * d + e] = f2b(acc);
  }
}

unsigned blocks(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

}  // namespace

void gemm_ordered(const float* a, int64_t m, int64_t k, const float* b, int64_t n, float* c,
                  cudaStream_t stream, const int* fma_ok) {
  if (m == 0 || n == 0) return;
  dim3 grid(unsigned((n + kBn - 1) / kBn), unsigned((m + kBm - 1) / kBm));
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    sms = 0;  // (the launch below reports a lost device)
  if (int64_t(grid.x) * grid.y > int64_t(sms))
    gemm_ordered_kernel<2><<<grid, 256, 0, stream>>>(a, m, k, b, n, c, fma_ok);
  else
    gemm_ordered_kernel<1><<<grid, 256, 0, stream>>>(a, m, k, b, n, c, fma_ok);
}

BF16Range weight_range(const float* w, int64_t count) {
  BF16Range r;
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &w[i], 4);
    if ((bits & 0xffffu) != 0) r.exact_bf16 = false;  // more bits than a bf16: products round
    const uint32_t v = bits >> 16;
    const int e = int((v >> 7) & 0xffu);
    if (e == 0xff) r.exact_bf16 = false;  // inf or NaN
    if ((v & 0x7fffu) == 0) continue;
    r.min_lsb_exponent = std::min(r.min_lsb_exponent, (e == 0 ? 1 : e) - 134);
    r.max_exponent = std::max(r.max_exponent, e);
  }
  return r;
}

void exact_products_flag(const uint16_t* x, int64_t count, const BF16Range& w, int* stats,
                         int* flag, cudaStream_t stream) {
  if (!w.exact_bf16) {
    cudaMemsetAsync(flag, 0, sizeof(int), stream);
    return;
  }
  bf16_range_init_kernel<<<1, 1, 0, stream>>>(stats);
  const unsigned grid = std::min<unsigned>(blocks(count, 256), 264);
  if (count > 0) bf16_range_kernel<<<grid, 256, 0, stream>>>(x, count, stats);
  exact_flag_kernel<<<1, 1, 0, stream>>>(stats, w.min_lsb_exponent, w.max_exponent, flag);
}

void heads_major(const uint16_t* x, int64_t n, int64_t heads, int64_t d, uint16_t* out,
                 cudaStream_t stream) {
  if (n * heads * d == 0) return;
  heads_major_kernel<<<blocks(n * heads * d, 256), 256, 0, stream>>>(x, n, heads, d, out);
}

void bf16_to_f32(const uint16_t* x, int64_t n, float* out, cudaStream_t stream) {
  bf16_to_f32_kernel<<<blocks(n, 256), 256, 0, stream>>>(x, n, out);
}

void round_linear_output(const float* acc, int64_t m, int64_t n, const uint16_t* bias,
                         uint16_t* out, cudaStream_t stream) {
  round_linear_kernel<<<blocks(m * n, 256), 256, 0, stream>>>(acc, m, n, bias, out);
}

void add_bias_bf16(uint16_t* out, int64_t m, int64_t n, const uint16_t* bias, cudaStream_t stream) {
  if (m * n > 0) add_bias_kernel<<<blocks(m * n, 256), 256, 0, stream>>>(out, m, n, bias);
}

void rms_norm(const uint16_t* x, int64_t m, int64_t d, const uint16_t* w, float eps, uint16_t* out,
              cudaStream_t stream) {
  if (m > 0) rms_norm_kernel<<<unsigned(m), 128, 0, stream>>>(x, d, w, eps, out);
}

void rope_apply(uint16_t* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t pos0,
                const RopeTable& r, cudaStream_t stream) {
  const int64_t work = tokens * heads * (r.dims / 2);
  if (work > 0)
    rope_kernel<<<blocks(work, 256), 256, 0, stream>>>(x, tokens, heads, head_dim, pos0, r);
}

void silu_mul(const uint16_t* gate, const uint16_t* up, int64_t n, uint16_t* out,
              cudaStream_t stream) {
  silu_mul_kernel<<<blocks(n, 256), 256, 0, stream>>>(gate, up, n, out);
}

void add_bf16(const uint16_t* a, const uint16_t* b, int64_t n, uint16_t* out, cudaStream_t stream) {
  add_kernel<<<blocks(n, 256), 256, 0, stream>>>(a, b, n, out);
}

void attention_causal(const uint16_t* q, int64_t n, int64_t q_heads, const uint16_t* k,
                      const uint16_t* v, int64_t kv_heads, int64_t d, int64_t pos0, float scale,
                      float* scratch, uint16_t* out, cudaStream_t stream, int64_t window) {
  if (n <= 0) return;
  // The decoder rounds the scale to bf16 before multiplying (bit pattern as the CPU op).
  uint32_t bits;
  std::memcpy(&bits, &scale, 4);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  bits &= 0xffff0000u;
  float scale_b;
  std::memcpy(&scale_b, &bits, 4);
  const dim3 grid{unsigned(n), unsigned(q_heads), 1u};
  attn_scores_kernel<<<grid, 128, 0, stream>>>(q, n, q_heads, k, kv_heads, d, pos0, scale_b, window,
                                               scratch);
  attn_softmax_kernel<<<grid, 128, 0, stream>>>(n, pos0, window, scratch);
  attn_pv_kernel<<<grid, 64, 0, stream>>>(scratch, n, q_heads, v, kv_heads, d, pos0, window, out);
}

}  // namespace hetero::cuda
