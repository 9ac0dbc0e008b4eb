// The per-token, per-128-column FP8 activation quantizer of fp8_gemm.h, as device code shared by
// fp8_gemm.cu (a bf16 matrix's rows) and the ops that make a GEMM's input and quantize it in the
// same pass (dsv4_fwd_ops.cu: the routed experts' SwiGLU, whose bf16 output is never written).
// One kernel template over where a lane's eight values come from, so the bytes and the scales
// are the same whichever op made the values.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "common/status.h"
#include "kernels/cuda/fp8_gemm.h"
#include "kernels/cuda/mlx_math.cuh"

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

// A Source's values: a bf16 matrix's rows. Every Source has load(row, col, v): the eight values
// of the input's row `row` from column `col` (col a multiple of 8, inside the row).
struct Bf16Rows {
  const uint16_t* x;
  int64_t k;
  __device__ __forceinline__ void load(int64_t row, int64_t col, float (&v)[8]) const {
    unpack_bf16x8(*reinterpret_cast<const uint4*>(x + row * k + col), v);
  }
};

// quantize_act_fp8_segments (fp8_gemm.h) with the values from src: row p of the packed padded
// rows belongs to the segment e with pad[e] <= p < pad[e + 1]. A warp per row: the segment, the
// source row and the scales' place are found once a row, not once per 128 columns, and the row's
// 128-column groups go two at a time (a half-warp a group, eight columns a lane), kUnroll pairs
// loaded before any is quantized. A warp per (row, group), with the search and three 64-bit
// divisions a lane, was bound by issuing that integer work at 3x the pass's bandwidth time (the
// kernel times in RESULTS §45).
constexpr int kUnroll = 4;

template <class Source>
__global__ void segments_kernel(Source src, const int32_t* __restrict__ off,
                                const int32_t* __restrict__ pad, int32_t segments, int32_t total,
                                int64_t k, int32_t groups, const int32_t* __restrict__ rows_from,
                                int32_t per, bool tight, uint8_t* __restrict__ q,
                                float* __restrict__ scale) {
  const int32_t p =
      static_cast<int32_t>(blockIdx.x) * (kThreads / 32) + static_cast<int32_t>(threadIdx.x / 32);
  if (p >= total) return;  // the whole warp: the shuffles below need every lane
  const int half = (threadIdx.x / 16) % 2, sub = threadIdx.x % 16;
  int32_t lo = 0, hi = segments;  // the last e with pad[e] <= p (empty segments are skipped)
  while (hi - lo > 1) {
    const int32_t mid = (lo + hi) / 2;
    if (pad[mid] <= p)
      lo = mid;
    else
      hi = mid;
  }
  const int32_t e = lo, i = p - pad[e], rows = pad[e + 1] - pad[e];
  const int32_t at = off[e] + i, real = off[e + 1] - off[e];
  const bool real_row = i < real;
  const int64_t from = real_row ? (rows_from ? rows_from[at] / per : at) : 0;
  // Tight: the segment's scales strided by its real rows, the padding rows' scales not written.
  float* const scale_row = scale + static_cast<int64_t>(pad[e]) * groups + i;
  const int64_t stride = tight ? real : rows;
  const bool write_scale = !tight || real_row;
  uint8_t* const q_row = q + static_cast<int64_t>(p) * k;
  for (int32_t g0 = 0; g0 < groups; g0 += 2 * kUnroll) {
    float v[kUnroll][8];
    bool in[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int32_t g = g0 + 2 * u + half;
      const int64_t col = static_cast<int64_t>(g) * kFp8Block + sub * 8;
      // k % 16 == 0: a lane's eight columns are all in or all out.
      in[u] = g < groups && col < k;
#pragma unroll
      for (float& x : v[u]) x = 0.f;
      if (in[u] && real_row) src.load(from, col, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int32_t g = g0 + 2 * u + half;
      quantize_values(v[u], in[u], sub, q_row + static_cast<int64_t>(g) * kFp8Block + sub * 8,
                      scale_row + g * stride, g < groups && write_scale);
    }
  }
}

template <class Source>
void quantize_segments(Source src, const int32_t* off, const int32_t* pad, int64_t segments,
                       int64_t total_rows, int64_t k, uint8_t* q, float* scale, cudaStream_t stream,
                       const int32_t* rows_from, int64_t per, bool tight_scales) {
  if (total_rows == 0 || segments == 0 || k == 0) return;
  // Rows, segments, a row's groups and the row indices are int32 on the device.
  HETERO_CHECK(total_rows <= INT32_MAX && segments < INT32_MAX && per > 0 && per <= INT32_MAX);
  const int64_t blocks = (total_rows + kThreads / 32 - 1) / (kThreads / 32);
  segments_kernel<Source><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      src, off, pad, static_cast<int32_t>(segments), static_cast<int32_t>(total_rows), k,
      static_cast<int32_t>(fp8_blocks(k)), rows_from, static_cast<int32_t>(per), tight_scales, q,
      scale);
}

}  // namespace hetero::cuda::fp8_act
