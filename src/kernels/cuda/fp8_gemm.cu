// The FP8 quantizers of fp8_gemm.h: a 128x128 block-scaled weight quantizer (once, at upload) and
// the per-token-group activation quantizer that runs before every FP8 GEMM.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kernels/cuda/fp8_block.cuh"
#include "kernels/cuda/fp8_gemm.h"

namespace hetero::cuda {
namespace {

__device__ __forceinline__ float bf(uint16_t v) { return __uint_as_float(uint32_t(v) << 16); }

// Round to nearest even, saturating to ±448: what cvt.rn.satfinite.e4m3x2 does. Low byte = a.
__device__ __forceinline__ uint16_t e4m3x2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}

// x / (amax / 448): the division as DeepSeek's quantizers write it (not a reciprocal multiply),
// so the bytes match a host reference exactly.
__device__ __forceinline__ float block_scale(float amax) {
  return amax > 0.f ? amax / kE4m3Max : 1.f;
}

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

constexpr int kActThreads = 256;

// One lane's share of a (row, 128-column group): eight columns (16 bytes) of src (null: a padding
// row, zeros), the group's amax across its half-warp, the e4m3 bytes to dst and (lane 0) the
// scale. `in`: the unit exists and the lane's columns are inside k. Every lane of the warp must
// call it (the shuffles).
__device__ __forceinline__ void quantize_unit(const uint16_t* __restrict__ src, bool in, int sub,
                                              uint8_t* __restrict__ dst, float* scale_at,
                                              bool unit_exists) {
  float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (in && src) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src);
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
    for (int i = 0; i < 4; ++i) v[2 * i] = bf(w[i] & 0xffff), v[2 * i + 1] = bf(w[i] >> 16);
  }
  float amax = 0.f;
  for (float f : v) amax = fmaxf(amax, fabsf(f));
  for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float s = block_scale(amax);
  if (in) {
    uint32_t packed[2];
    for (int i = 0; i < 2; ++i)
      packed[i] = e4m3x2(v[4 * i] / s, v[4 * i + 1] / s) |
                  (uint32_t(e4m3x2(v[4 * i + 2] / s, v[4 * i + 3] / s)) << 16);
    *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
  }
  if (sub == 0 && unit_exists) *scale_at = s;
}

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
  const bool exists = unit < rows * groups;
  quantize_unit(row < m ? x + row * k + col : nullptr, exists && col < k, sub, q + row * k + col,
                scale + g * rows + row, exists);
}

// The same per segment of rows (quantize_act_fp8_segments): unit p of the packed padded rows
// belongs to the segment e with pad[e] <= p < pad[e + 1].
__global__ void quantize_act_segments_kernel(const uint16_t* __restrict__ x,
                                             const int32_t* __restrict__ off,
                                             const int32_t* __restrict__ pad, int64_t segments,
                                             int64_t total, int64_t k, int64_t groups,
                                             const int32_t* __restrict__ rows_from, int64_t per,
                                             bool tight, uint8_t* __restrict__ q,
                                             float* __restrict__ scale) {
  const int64_t unit = (static_cast<int64_t>(blockIdx.x) * kActThreads + threadIdx.x) / 16;
  const int sub = threadIdx.x % 16;
  const bool exists = unit < total * groups;
  const int64_t p = exists ? unit / groups : 0, g = unit % groups;
  int64_t lo = 0, hi = segments;  // the last e with pad[e] <= p (empty segments are skipped)
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (pad[mid] <= p)
      lo = mid;
    else
      hi = mid;
  }
  const int64_t e = lo, i = p - pad[e], rows = pad[e + 1] - pad[e];
  const int64_t col = g * kFp8Block + sub * 8;
  const int64_t at = off[e] + i, real = off[e + 1] - off[e];
  const uint16_t* src = i < real ? x + (rows_from ? rows_from[at] / per : at) * k + col : nullptr;
  // Tight: the segment's scales strided by its real rows, the padding rows' scales not written.
  quantize_unit(src, exists && col < k, sub, q + p * k + col,
                scale + pad[e] * groups + g * (tight ? real : rows) + i,
                exists && (!tight || i < real));
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
  const int64_t groups = fp8_blocks(k), units = total_rows * groups;
  if (units == 0 || segments == 0) return;
  const int64_t blocks = (units * 16 + kActThreads - 1) / kActThreads;
  quantize_act_segments_kernel<<<static_cast<unsigned>(blocks), kActThreads, 0, stream>>>(
      x, off, pad, segments, total_rows, k, groups, rows_from, per, tight_scales, q, scale);
}

}  // namespace hetero::cuda
