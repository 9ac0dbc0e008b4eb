// The official checkpoint formats on the device: scale widening, FP4 -> FP8 widening, FP8 -> bf16
// dequantization and the two power-of-two quantizers (checkpoint_formats.h).
#include <cuda_fp8.h>

#include "kernels/cuda/checkpoint_formats.h"
#include "kernels/cuda/fp4_widen.cuh"
#include "kernels/cuda/fp8_block.cuh"

namespace hetero::cuda {
namespace {

__device__ __forceinline__ float bf(uint16_t v) { return __uint_as_float(uint32_t(v) << 16); }

__device__ __forceinline__ float ue8m0(uint8_t e) {
  return e == 0xff ? __int_as_float(0x7fc00000) : ldexpf(1.f, int(e) - 127);
}

__device__ __forceinline__ float e4m3(uint8_t v) {
  const int exp = (v >> 3) & 0xf, mant = v & 0x7;
  const float sign = (v & 0x80u) ? -1.f : 1.f;
  if (exp == 0xf && mant == 0x7) return __int_as_float(0x7fc00000);
  if (exp == 0) return sign * ldexpf(float(mant), -9);
  return sign * ldexpf(float(8 + mant), exp - 10);
}

__device__ __forceinline__ uint16_t round_bf16(float f) {
  const uint32_t u = __float_as_uint(f);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// The UE8M0 byte of the smallest power of two p with amax / p <= top (127: amax is zero).
__device__ __forceinline__ uint8_t pow2_scale_byte(float amax, float top) {
  if (!(amax > 0.f)) return 127;
  int ex = 0;
  const float m = frexpf(amax / top, &ex);  // amax / top = m * 2^ex, m in [0.5, 1)
  const int e = 127 + (m == 0.5f ? ex - 1 : ex);
  return static_cast<uint8_t>(e < 0 ? 0 : e > 254 ? 254 : e);
}

// x / 2^(e-127), exactly.
__device__ __forceinline__ float unscale(float x, uint8_t e) { return ldexpf(x, 127 - int(e)); }

// e2m1 code of v (round to nearest, ties to the even code; saturating to ±6).
__device__ __forceinline__ uint32_t to_e2m1(float v) {
  const float a = fabsf(v);
  uint32_t c;
  if (a <= 0.25f)
    c = 0;
  else if (a < 0.75f)
    c = 1;
  else if (a <= 1.25f)
    c = 2;
  else if (a < 1.75f)
    c = 3;
  else if (a <= 2.5f)
    c = 4;
  else if (a < 3.5f)
    c = 5;
  else if (a <= 5.f)
    c = 6;
  else
    c = 7;
  return (v < 0.f && c != 0 ? 8u : 0u) | c;
}

constexpr int kThreads = 256;

__global__ void ue8m0_scales_kernel(const uint8_t* __restrict__ e8m0, int64_t nb, int64_t kb,
                                    int64_t ld, float* __restrict__ scale) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= nb * ld) return;
  const int64_t r = i / ld, c = i % ld;
  scale[i] = c < kb ? ue8m0(e8m0[r * kb + c]) : 1.f;
}

// One CUDA block of 128 threads per 128x128 block of the weight. Thread t widens the 32-element
// group t % 4 of rows t / 4 + 32 j (j < 4): a warp's loads cover 8 rows' 64 contiguous bytes
// each. Every load (four codes of 16 bytes, four scale bytes) is issued before the block's
// exponent is known: the kernel is bound by memory, and the earlier form (two passes over the
// scales around a barrier, one group in flight per thread) ran at under half the bandwidth.
constexpr int kWidenThreads = 128;
constexpr int kWidenUnits = kFp8Block * (kFp8Block / kFp4Group) / kWidenThreads;  // 4

__global__ void __launch_bounds__(kWidenThreads)
    widen_fp4_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ sc, int64_t n,
                     int64_t k, uint8_t* __restrict__ q, float* __restrict__ scale,
                     int64_t scale_ld, unsigned long long* lossy,
                     const int32_t* __restrict__ experts) {
  const int64_t bk = blockIdx.x, bn = blockIdx.y;
  if (experts) {
    const int64_t e = experts[blockIdx.z];
    codes += e * n * (k / 2), sc += e * n * (k / kFp4Group);
    q += e * n * k, scale += e * ((n + kFp8Block - 1) / kFp8Block) * scale_ld;
  }
  const int64_t r0 = bn * kFp8Block, c0 = bk * kFp8Block;
  const int64_t rows = n - r0 < kFp8Block ? n - r0 : kFp8Block;
  const int64_t gpr = k / kFp4Group;  // groups per row
  const int64_t g = c0 / kFp4Group + threadIdx.x % 4;
  uint4 raw[kWidenUnits];
  int e8[kWidenUnits];
  int mx = 0;
#pragma unroll
  for (int j = 0; j < kWidenUnits; ++j) {
    const int64_t r = threadIdx.x / 4 + 32 * j;
    e8[j] = 0;
    if (r < rows) {
      raw[j] = *reinterpret_cast<const uint4*>(codes + (r0 + r) * (k / 2) + g * (kFp4Group / 2));
      e8[j] = sc[(r0 + r) * gpr + g];
    }
  }
#pragma unroll
  for (int j = 0; j < kWidenUnits; ++j) mx = max(mx, e8[j]);
  __shared__ int part[kWidenThreads / 32];
  for (int o = 16; o > 0; o >>= 1) mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = mx;
  __syncthreads();
  mx = max(max(part[0], part[1]), max(part[2], part[3]));
  if (threadIdx.x == 0) scale[bn * scale_ld + bk] = ldexpf(1.f, mx - 133);
  if (bk == 0)
    for (int64_t j = gridDim.x + threadIdx.x; j < scale_ld; j += kWidenThreads)
      scale[bn * scale_ld + j] = 1.f;
  unsigned long long lost = 0;
#pragma unroll
  for (int j = 0; j < kWidenUnits; ++j) {
    const int64_t r = threadIdx.x / 4 + 32 * j;
    if (r >= rows) continue;
    const int d = e8[j] - mx + 6;
    const uint32_t w[4] = {raw[j].x, raw[j].y, raw[j].z, raw[j].w};
    uint32_t out[8];
    const bool lost_bits = widen_fp4_group(w, d, out);
    uint4* dst = reinterpret_cast<uint4*>(q + (r0 + r) * k + g * kFp4Group);
    dst[0] = make_uint4(out[0], out[1], out[2], out[3]);
    dst[1] = make_uint4(out[4], out[5], out[6], out[7]);
    lost += lost_bits;
  }
  if (lossy && lost) atomicAdd(lossy, lost);
}

__global__ void dequant_fp8_kernel(const uint8_t* __restrict__ codes,
                                   const uint8_t* __restrict__ e8m0, int64_t n, int64_t k,
                                   uint16_t* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n * k) return;
  const int64_t r = i / k, c = i % k, kb = (k + kFp8Block - 1) / kFp8Block;
  out[i] = round_bf16(e4m3(codes[i]) * ue8m0(e8m0[(r / kFp8Block) * kb + c / kFp8Block]));
}

// One CUDA block per 128x128 block: its amax, its power-of-two scale, its codes.
__global__ void quantize_fp8_kernel(const uint16_t* __restrict__ w, int64_t n, int64_t k,
                                    uint8_t* __restrict__ codes, uint8_t* __restrict__ e8m0) {
  const int64_t bk = blockIdx.x, bn = blockIdx.y;
  const int64_t r0 = bn * kFp8Block, c0 = bk * kFp8Block;
  const int64_t rows = n - r0 < kFp8Block ? n - r0 : kFp8Block;
  const int64_t cols = k - c0 < kFp8Block ? k - c0 : kFp8Block;
  const uint8_t e = pow2_scale_byte(block_amax<kThreads>(w, n, k, r0, c0), kE4m3Max);
  if (threadIdx.x == 0) e8m0[bn * gridDim.x + bk] = e;
  for (int i = threadIdx.x; i < kFp8Block * kFp8Block; i += kThreads) {
    const int r = i / kFp8Block, c = i % kFp8Block;
    if (r < rows && c < cols) {
      const int64_t at = (r0 + r) * k + c0 + c;
      codes[at] = static_cast<uint8_t>(e4m3x2(unscale(bf(w[at]), e), 0.f) & 0xff);
    }
  }
}

// One thread per 32-element group of a row.
__global__ void quantize_fp4_kernel(const uint16_t* __restrict__ w, int64_t groups,
                                    uint8_t* __restrict__ codes, uint8_t* __restrict__ e8m0) {
  const int64_t u = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (u >= groups) return;
  const uint16_t* src = w + u * kFp4Group;  // rows are k wide and k % 32 == 0: groups are dense
  float amax = 0.f;
  for (int i = 0; i < kFp4Group; ++i) amax = fmaxf(amax, fabsf(bf(src[i])));
  const uint8_t e = pow2_scale_byte(amax, 6.f);
  e8m0[u] = e;
  uint8_t* dst = codes + u * (kFp4Group / 2);
  for (int i = 0; i < kFp4Group; i += 2)
    dst[i / 2] = static_cast<uint8_t>(to_e2m1(unscale(bf(src[i]), e)) |
                                      (to_e2m1(unscale(bf(src[i + 1]), e)) << 4));
}

unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

}  // namespace

void ue8m0_to_fp8_scales(const uint8_t* e8m0, int64_t n, int64_t k, float* scale,
                         cudaStream_t stream) {
  const int64_t nb = fp8_blocks(n), ld = fp8_weight_scale_ld(k);
  if (nb * ld == 0) return;
  ue8m0_scales_kernel<<<blocks_for(nb * ld), kThreads, 0, stream>>>(e8m0, nb, fp8_blocks(k), ld,
                                                                    scale);
}

void widen_fp4_to_fp8(const Fp4GroupWeight& w, uint8_t* q, float* scale,
                      unsigned long long* lossy_groups, cudaStream_t stream) {
  if (w.n <= 0 || w.k <= 0) return;
  const dim3 grid(static_cast<unsigned>(fp8_blocks(w.k)), static_cast<unsigned>(fp8_blocks(w.n)));
  widen_fp4_kernel<<<grid, kWidenThreads, 0, stream>>>(
      w.codes, w.scale, w.n, w.k, q, scale, fp8_weight_scale_ld(w.k), lossy_groups, nullptr);
}

void widen_fp4_experts_to_fp8(const Fp4GroupWeight& w0, const int32_t* experts, int64_t count,
                              uint8_t* q, float* scale, unsigned long long* lossy_groups,
                              cudaStream_t stream) {
  if (w0.n <= 0 || w0.k <= 0 || count <= 0) return;
  const dim3 grid(static_cast<unsigned>(fp8_blocks(w0.k)), static_cast<unsigned>(fp8_blocks(w0.n)),
                  static_cast<unsigned>(count));
  widen_fp4_kernel<<<grid, kWidenThreads, 0, stream>>>(
      w0.codes, w0.scale, w0.n, w0.k, q, scale, fp8_weight_scale_ld(w0.k), lossy_groups, experts);
}

void dequant_fp8_ue8m0_to_bf16(const uint8_t* codes, const uint8_t* e8m0, int64_t n, int64_t k,
                               uint16_t* out, cudaStream_t stream) {
  if (n * k == 0) return;
  dequant_fp8_kernel<<<blocks_for(n * k), kThreads, 0, stream>>>(codes, e8m0, n, k, out);
}

void quantize_fp8_ue8m0(const uint16_t* w, int64_t n, int64_t k, uint8_t* codes, uint8_t* e8m0,
                        cudaStream_t stream) {
  if (n <= 0 || k <= 0) return;
  const dim3 grid(static_cast<unsigned>(fp8_blocks(k)), static_cast<unsigned>(fp8_blocks(n)));
  quantize_fp8_kernel<<<grid, kThreads, 0, stream>>>(w, n, k, codes, e8m0);
}

void quantize_fp4_ue8m0(const uint16_t* w, int64_t n, int64_t k, uint8_t* codes, uint8_t* e8m0,
                        cudaStream_t stream) {
  const int64_t groups = n * (k / kFp4Group);
  if (groups <= 0) return;
  quantize_fp4_kernel<<<blocks_for(groups), kThreads, 0, stream>>>(w, groups, codes, e8m0);
}

}  // namespace hetero::cuda
