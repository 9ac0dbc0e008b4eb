// The FP8 quantizers of fp8_gemm.h: a 128x128 block-scaled weight quantizer (once, at upload) and
// the per-token-group activation quantizer that runs before every FP8 GEMM.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kernels/cuda/fp8_act_quant.cuh"
#include "kernels/cuda/fp8_block.cuh"
#include "kernels/cuda/fp8_gemm.h"

namespace hetero::cuda {
namespace {

using fp8_act::block_scale;
using fp8_act::e4m3x2;

__device__ __forceinline__ float bf(uint16_t v) { return __uint_as_float(uint32_t(v) << 16); }

constexpr int kWeightThreads = 256;

// One CUDA block per 128x128 weight block: its amax, its scale, its e4m3 values.
__global__ void quantize_weight_kernel(const uint16_t* __restrict__ w, int64_t n, int64_t k,
                                       uint8_t* __restrict__ q, float* __restrict__ scale,
                                       int64_t scale_ld) {
  const int64_t bk = blockIdx.x, bn = blockIdx.y;
  const int64_t r0 = bn * kFp8Block, c0 = bk * kFp8Block;
  const int64_t rows = n - r0 < kFp8Block ? n - r0 : kFp8Block;
  const int64_t cols = k - c0 < kFp8Block ? k - c0 : kFp8Block;
  const float s = block_scale(block_amax<kWeightThreads>(w, n, k, r0, c0));
  if (threadIdx.x == 0) scale[bn * scale_ld + bk] = s;
  // The row's padding past ceil(k/128) is never read; keep it defined.
  if (bk == 0)
    for (int64_t j = gridDim.x + threadIdx.x; j < scale_ld; j += kWeightThreads)
      scale[bn * scale_ld + j] = 1.f;
  // Pairs of columns: cols is a multiple of 16 (k is).
  for (int i = threadIdx.x; i < kFp8Block * kFp8Block / 2; i += kWeightThreads) {
    const int r = i / (kFp8Block / 2), c = 2 * (i % (kFp8Block / 2));
    if (r < rows && c < cols) {
      const int64_t at = (r0 + r) * k + c0 + c;
      const uint16_t v = e4m3x2(bf(w[at]) / s, bf(w[at + 1]) / s);
      q[at] = static_cast<uint8_t>(v & 0xff);
      q[at + 1] = static_cast<uint8_t>(v >> 8);
    }
  }
}

constexpr int kActThreads = fp8_act::kThreads;

// One half-warp per (row, 128-column group), eight columns (16 bytes) per lane: wide loads keep
// this memory-bound pass near bandwidth. Rows in [m, rows) are padding.
__global__ void quantize_act_kernel(const uint16_t* __restrict__ x, int64_t m, int64_t rows,
                                    int64_t k, int64_t groups, uint8_t* __restrict__ q,
                                    float* __restrict__ scale) {
  const int64_t unit = (static_cast<int64_t>(blockIdx.x) * kActThreads + threadIdx.x) / 16;
  const int sub = threadIdx.x % 16;
  const int64_t row = unit / groups, g = unit % groups;
  const int64_t col = g * kFp8Block + sub * 8;
  // k % 16 == 0: a lane's eight columns are all in or all out. No early return: both halves of
  // the warp take part in the shuffles.
  const bool exists = unit < rows * groups, in = exists && col < k;
  float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (in && row < m) unpack_bf16x8(*reinterpret_cast<const uint4*>(x + row * k + col), v);
  fp8_act::quantize_values(v, in, sub, q + row * k + col, scale + g * rows + row, exists);
}

}  // namespace

void quantize_weight_fp8_block(const uint16_t* w, int64_t n, int64_t k, uint8_t* q, float* scale,
                               cudaStream_t stream) {
  if (n <= 0 || k <= 0) return;
  const dim3 grid(static_cast<unsigned>(fp8_blocks(k)), static_cast<unsigned>(fp8_blocks(n)));
  quantize_weight_kernel<<<grid, kWeightThreads, 0, stream>>>(w, n, k, q, scale,
                                                              fp8_weight_scale_ld(k));
}

void quantize_act_fp8_group(const uint16_t* x, int64_t m, int64_t k, uint8_t* q, float* scale,
                            cudaStream_t stream) {
  const int64_t rows = fp8_act_rows(m), groups = fp8_blocks(k);
  const int64_t units = rows * groups;  // 16 threads each
  if (units == 0) return;
  const int64_t blocks = (units * 16 + kActThreads - 1) / kActThreads;
  quantize_act_kernel<<<static_cast<unsigned>(blocks), kActThreads, 0, stream>>>(x, m, rows, k,
                                                                                 groups, q, scale);
}

void quantize_act_fp8_segments(const uint16_t* x, const int32_t* off, const int32_t* pad,
                               int64_t segments, int64_t total_rows, int64_t k, uint8_t* q,
                               float* scale, cudaStream_t stream, const int32_t* rows_from,
                               int64_t per, bool tight_scales) {
  fp8_act::quantize_segments(fp8_act::Bf16Rows{x, k}, off, pad, segments, total_rows, k, q, scale,
                             stream, rows_from, per, tight_scales);
}

}  // namespace hetero::cuda
