// The per-token, per-128-column FP8 activation quantizer of fp8_gemm.h, as device code shared by
// fp8_gemm.cu (a bf16 matrix's rows) and the ops that make a GEMM's input and quantize it in the
// same pass (dsv4_fwd_ops.cu: the routed experts' SwiGLU, whose bf16 output is never written).
// One kernel template over where a lane's eight values come from, so the bytes and the scales
// are the same whichever op made the values.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/cuda/fp8_gemm.h"

namespace hetero::cuda::fp8_act {

// Round to nearest even, saturating to ±448: what cvt.rn.satfinite.e4m3x2 does. Low byte = a.
__device__ __forceinline__ uint16_t e4m3x2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}

// x / (amax / 448): the division as DeepSeek's quantizers write it (not a reciprocal multiply),
// so the bytes match a host reference exactly.
__device__ __forceinline__ float block_scale(float amax) {
  return amax > 0.f ? amax / kE4m3Max : 1.f;
}

constexpr int kThreads = 256;

// One lane's share of a (row, 128-column group): its eight values v (zeros for a padding row),
// the group's amax across its half-warp, the e4m3 bytes to dst and (lane 0) the scale. `in`:
// the unit exists and the lane's columns are inside k. Every lane of the warp must call it (the
// shuffles).
__device__ __forceinline__ void quantize_values(const float (&v)[8], bool in, int sub,
                                                uint8_t* __restrict__ dst, float* scale_at,
                                                bool unit_exists) {
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

// Eight bf16 values from 16 bytes at p, as floats.
__device__ __forceinline__ void load_bf16x8(const uint16_t* __restrict__ p, float (&v)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  for (int i = 0; i < 4; ++i)
    v[2 * i] = __uint_as_float(w[i] << 16), v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
}

// A Source's values: a bf16 matrix's rows. Every Source has load(row, col, v): the eight values
// of the input's row `row` from column `col` (col a multiple of 8, inside the row).
struct Bf16Rows {
  const uint16_t* x;
  int64_t k;
  __device__ __forceinline__ void load(int64_t row, int64_t col, float (&v)[8]) const {
    load_bf16x8(x + row * k + col, v);
  }
};

// quantize_act_fp8_segments (fp8_gemm.h) with the values from src: unit p of the packed padded
// rows belongs to the segment e with pad[e] <= p < pad[e + 1]; a half-warp per (row, 128-column
// group), eight columns (16 bytes) a lane, so that the pass stays near bandwidth.
template <class Source>
__global__ void segments_kernel(Source src, const int32_t* __restrict__ off,
                                const int32_t* __restrict__ pad, int64_t segments, int64_t total,
                                int64_t k, int64_t groups, const int32_t* __restrict__ rows_from,
                                int64_t per, bool tight, uint8_t* __restrict__ q,
                                float* __restrict__ scale) {
  const int64_t unit = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 16;
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
  // k % 16 == 0: a lane's eight columns are all in or all out. No early return: both halves of
  // the warp take part in the shuffles.
  const bool in = exists && col < k;
  float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (in && i < real) src.load(rows_from ? rows_from[at] / per : at, col, v);
  // Tight: the segment's scales strided by its real rows, the padding rows' scales not written.
  quantize_values(v, in, sub, q + p * k + col,
                  scale + pad[e] * groups + g * (tight ? real : rows) + i,
                  exists && (!tight || i < real));
}

template <class Source>
void quantize_segments(Source src, const int32_t* off, const int32_t* pad, int64_t segments,
                       int64_t total_rows, int64_t k, uint8_t* q, float* scale, cudaStream_t stream,
                       const int32_t* rows_from, int64_t per, bool tight_scales) {
  const int64_t groups = fp8_blocks(k), units = total_rows * groups;
  if (units == 0 || segments == 0) return;
  const int64_t blocks = (units * 16 + kThreads - 1) / kThreads;
  segments_kernel<Source><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      src, off, pad, segments, total_rows, k, groups, rows_from, per, tight_scales, q, scale);
}

}  // namespace hetero::cuda::fp8_act
