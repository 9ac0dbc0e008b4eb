// DeepSeek-V4 cache-program ops and the quantized matmuls on the GPU: see dsv4_ops.h. Each
// kernel mirrors its CPU function in kernels/dsv4_ops.cc or kernels/cpu_ops.cc operation for
// operation (every rounding an explicit _rn intrinsic, no contraction: built with --fmad=false).
#include <cmath>

#include "kernels/cuda/dsv4_ops.h"
#include "kernels/cuda/mlx_math.cuh"

namespace hetero::cuda {
namespace {

unsigned blocks(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

// One block per row t. The cos/sin of each pair are computed once per row into shared memory
// (the CPU op does the same per row), then every (head, pair) of the row is rotated.
__global__ void dsv4_rope_kernel(uint16_t* x, int64_t heads, int64_t head_dim, int64_t pos0,
                                 const float* freqs, int64_t nope, int freq_scale, bool inverse) {
  extern __shared__ float trig[];  // [pairs] cos, then [pairs] sin, both bf16-rounded
  const int64_t pairs = head_dim / 2, t = blockIdx.x;
  float* cs = trig;
  float* sn = trig + pairs;
  const float pos = __fadd_rn(float(t), float(pos0));
  // No-rope pairs carry +inf (their reciprocal, a signed zero, makes the angle +-0; +inf divided
  // by freq_scale stays +inf).
  for (int64_t p = threadIdx.x; p < pairs; p += blockDim.x)
    mlx_rope_trig(pos, p >= nope ? freqs[p - nope] : INFINITY, freq_scale, inverse, &cs[p], &sn[p]);
  __syncthreads();
  uint16_t* xt = x + t * heads * head_dim;
  for (int64_t id = threadIdx.x; id < heads * pairs; id += blockDim.x) {
    const int64_t h = id / pairs, p = id % pairs;
    uint16_t* row = xt + h * head_dim;
    const float x1 = b2f(row[2 * p]), x2 = b2f(row[2 * p + 1]);
    const float c = cs[p], s = sn[p];
    row[2 * p] = f2b(__fsub_rn(rb(__fmul_rn(x1, c)), rb(__fmul_rn(x2, s))));
    row[2 * p + 1] = f2b(__fadd_rn(rb(__fmul_rn(x1, s)), rb(__fmul_rn(x2, c))));
  }
}

constexpr int kNormChunk = 1024;

// One block per row. The squares are computed in parallel into shared memory, a chunk at a time;
// thread 0 adds them in ascending j (the CPU order); the outputs are parallel again.
__global__ void rms_norm_noweight_kernel(const uint16_t* x, int64_t d, float inv_n, float eps,
                                         uint16_t* out) {
  __shared__ float sq[kNormChunk];
  __shared__ float r;
  const uint16_t* xr = x + int64_t(blockIdx.x) * d;
  float s = 0.0f;  // meaningful in thread 0 only
  for (int64_t j0 = 0; j0 < d; j0 += kNormChunk) {
    const int64_t lim = d - j0 < kNormChunk ? d - j0 : kNormChunk;
    for (int64_t j = threadIdx.x; j < lim; j += blockDim.x) {
      const float v = b2f(xr[j0 + j]);
      sq[j] = __fmul_rn(v, v);
    }
    __syncthreads();
    if (threadIdx.x == 0)
      for (int64_t j = 0; j < lim; ++j) s = __fadd_rn(s, sq[j]);
    __syncthreads();
  }
  if (threadIdx.x == 0) r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fmul_rn(s, inv_n), eps)));
  __syncthreads();
  // In place is safe: every input was read before the barrier, and each output is written by
  // the thread that reads the same element.
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
    out[int64_t(blockIdx.x) * d + j] = f2b(__fmul_rn(b2f(xr[j]), r));
}

// The CPU's pool_column for one feature: softmax over `rows` logits (max in row order as
// std::max does, exp(l - max), an f32 sum in row order, an f32 division), each weight rounded to
// bf16, then the f32 row-order sum of bf16(value * weight), rounded to bf16. The exps are
// recomputed in the last pass instead of stored: the same function of the same inputs, the
// same bits.
template <typename LOGIT, typename VALUE>
__device__ uint16_t pool_column(const LOGIT& logit, const VALUE& value, int64_t rows) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < rows; ++i) {
    const float l = logit(i);
    mx = (mx < l) ? l : mx;
  }
  float total = 0.0f;
  for (int64_t i = 0; i < rows; ++i) total = __fadd_rn(total, mlx_exp(__fsub_rn(logit(i), mx)));
  float acc = 0.0f;
  for (int64_t i = 0; i < rows; ++i) {
    const float w = rb(__fdiv_rn(mlx_exp(__fsub_rn(logit(i), mx)), total));
    acc = __fadd_rn(acc, rb(__fmul_rn(value(i), w)));
  }
  return f2b(acc);
}

// One thread per (window, feature).
__global__ void dsv4_pool_simple_kernel(const uint16_t* kv, const uint16_t* gate, const float* ape,
                                        int64_t windows, int64_t r, int64_t d, uint16_t* out) {
  const int64_t id = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (id >= windows * d) return;
  const int64_t w = id / d, j = id % d;
  const uint16_t* kw = kv + w * r * d;
  const uint16_t* gw = gate + w * r * d;
  auto logit = [&](int64_t i) { return __fadd_rn(b2f(gw[i * d + j]), ape[i * d + j]); };
  auto value = [&](int64_t i) { return b2f(kw[i * d + j]); };
  out[id] = pool_column(logit, value, r);
}

// One thread per (window, feature): 2r rows, the A half of the previous window's rows (or an
// empty lane: logit -inf, value 0) then the B half of the window's own.
__global__ void dsv4_pool_overlap_kernel(const uint16_t* kv, const uint16_t* gate, const float* ape,
                                         const uint8_t* has_prev, int64_t windows, int64_t r,
                                         int64_t hd, uint16_t* out) {
  const int64_t id = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (id >= windows * hd) return;
  const int64_t w = id / hd, j = id % hd, width = 2 * hd;
  const uint16_t* kw = kv + w * r * width;
  const uint16_t* gw = gate + w * r * width;
  const bool prev = has_prev[w] != 0;
  // gate' = bf16(gate + bf16(ape)) for the row at relative position k of its window.
  auto gated = [&](const uint16_t* g, int64_t k, int64_t f) {
    return rb(__fadd_rn(b2f(g[k * width + f]), rb(ape[k * width + f])));
  };
  auto logit = [&](int64_t i) {
    if (i < r) return prev ? gated(gw - r * width, i, j) : -INFINITY;
    return gated(gw, i - r, hd + j);
  };
  auto value = [&](int64_t i) {
    if (i < r) return prev ? b2f(kw[(i - r) * width + j]) : 0.0f;
    return b2f(kw[(i - r) * width + hd + j]);
  };
  out[id] = pool_column(logit, value, 2 * r);
}

constexpr int kTile = 32;

// Quantized matmul, one thread per output (row, column), each walking k in ascending order as
// the CPU's scalar recipe does. A 32x32 tile of x and of the (dequantized, for affine) weights
// is staged in shared memory per k step. The affine weight bf16(bf16(scale*q) + bias) depends
// only on (column, k), so computing it at staging time changes no bit.
template <bool AFFINE>
__global__ void linear_quantized_kernel(const uint16_t* x, int64_t m, int64_t k, const float* q,
                                        const float* scales, const float* biases, int64_t n,
                                        int64_t group, uint16_t* out) {
  __shared__ float xs[kTile][kTile + 1], ws[kTile][kTile + 1];
  const int64_t row0 = int64_t(blockIdx.x) * kTile, col0 = int64_t(blockIdx.y) * kTile;
  const int64_t row = row0 + threadIdx.y, col = col0 + threadIdx.x;
  const int64_t groups = k / group;
  // The mx recipe runs over whole groups only; affine over all of k (as the CPU loops do).
  const int64_t k_used = AFFINE ? k : groups * group;
  float sum = 0.0f, gsum = 0.0f;
  int64_t in_group = 0, g = 0;
  for (int64_t k0 = 0; k0 < k_used; k0 += kTile) {
    const int64_t t = k0 + threadIdx.x;
    xs[threadIdx.y][threadIdx.x] = (row < m && t < k_used) ? b2f(x[row * k + t]) : 0.0f;
    const int64_t wc = col0 + threadIdx.y;  // the weight row this thread stages
    float wv = 0.0f;
    if (wc < n && t < k_used) {
      wv = q[wc * k + t];
      if (AFFINE) {
        const int64_t wg = wc * groups + t / group;
        wv = rb(__fadd_rn(rb(__fmul_rn(scales[wg], wv)), biases[wg]));
      }
    }
    ws[threadIdx.y][threadIdx.x] = wv;
    __syncthreads();
    const int lim = (k_used - k0 < kTile) ? int(k_used - k0) : kTile;
    if (row < m && col < n) {
      for (int l = 0; l < lim; ++l) {
        const float p = rb(__fmul_rn(xs[threadIdx.y][l], ws[threadIdx.x][l]));
        if (AFFINE) {
          sum = rb(__fadd_rn(sum, p));
        } else {
          gsum = rb(__fadd_rn(gsum, p));
          if (++in_group == group) {
            sum = rb(__fadd_rn(sum, rb(__fmul_rn(scales[col * groups + g], gsum))));
            gsum = 0.0f;
            in_group = 0;
            ++g;
          }
        }
      }
    }
    __syncthreads();
  }
  if (row < m && col < n) out[row * n + col] = f2b(sum);
}

void launch_linear_quantized(bool affine, const uint16_t* x, int64_t m, int64_t k, const float* q,
                             const float* scales, const float* biases, int64_t n, int64_t group,
                             uint16_t* out, cudaStream_t stream) {
  if (m <= 0 || n <= 0) return;
  // Rows on grid x (up to 2^31 - 1 blocks), columns on grid y (65535 blocks: n < 2M).
  const dim3 grid(blocks(m, kTile), blocks(n, kTile)), block(kTile, kTile);
  if (affine)
    linear_quantized_kernel<true>
        <<<grid, block, 0, stream>>>(x, m, k, q, scales, biases, n, group, out);
  else
    linear_quantized_kernel<false>
        <<<grid, block, 0, stream>>>(x, m, k, q, scales, nullptr, n, group, out);
}

}  // namespace

void dsv4_rope(uint16_t* x, int64_t rows, int64_t heads, int64_t head_dim, int64_t pos0,
               const float* freqs, int64_t rope_pairs, int freq_scale, bool inverse,
               cudaStream_t stream) {
  const int64_t pairs = head_dim / 2;
  if (rows <= 0 || heads <= 0 || pairs <= 0) return;
  const size_t smem = size_t(2 * pairs) * sizeof(float);
  dsv4_rope_kernel<<<unsigned(rows), 128, smem, stream>>>(x, heads, head_dim, pos0, freqs,
                                                          pairs - rope_pairs, freq_scale, inverse);
}

void rms_norm_noweight(const uint16_t* x, int64_t m, int64_t d, float eps, uint16_t* out,
                       cudaStream_t stream) {
  if (m <= 0) return;
  const float inv_n = float(1.0 / double(d));  // host, as the CPU op
  rms_norm_noweight_kernel<<<unsigned(m), 256, 0, stream>>>(x, d, inv_n, eps, out);
}

void dsv4_pool_simple(const uint16_t* kv, const uint16_t* gate, const float* ape, int64_t windows,
                      int64_t r, int64_t d, uint16_t* out, cudaStream_t stream) {
  if (windows * d <= 0) return;
  dsv4_pool_simple_kernel<<<blocks(windows * d, 128), 128, 0, stream>>>(kv, gate, ape, windows, r,
                                                                        d, out);
}

void dsv4_pool_overlap(const uint16_t* kv, const uint16_t* gate, const float* ape,
                       const uint8_t* has_prev, int64_t windows, int64_t r, int64_t hd,
                       uint16_t* out, cudaStream_t stream) {
  if (windows * hd <= 0) return;
  dsv4_pool_overlap_kernel<<<blocks(windows * hd, 128), 128, 0, stream>>>(kv, gate, ape, has_prev,
                                                                          windows, r, hd, out);
}

void linear_quantized_mx(const uint16_t* x, int64_t m, int64_t k, const float* q,
                         const float* scales, int64_t n, int64_t group, uint16_t* out,
                         cudaStream_t stream) {
  launch_linear_quantized(false, x, m, k, q, scales, nullptr, n, group, out, stream);
}

void linear_quantized_affine(const uint16_t* x, int64_t m, int64_t k, const float* q,
                             const float* scales, const float* biases, int64_t n, int64_t group,
                             uint16_t* out, cudaStream_t stream) {
  launch_linear_quantized(true, x, m, k, q, scales, biases, n, group, out, stream);
}

}  // namespace hetero::cuda
