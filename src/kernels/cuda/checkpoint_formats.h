// DeepSeek's official checkpoint formats on the device, kept as stored (docs/design/
// dsv4-flash-full-size-brief.md §1.4), and their conversions for the FP8 GEMMs of fp8_gemm.h:
//
//   FP8  codes [n, k] e4m3 with UE8M0 scales [ceil(n/128), ceil(k/128)] (one per 128x128 block).
//        The codes are Fp8BlockWeight's as they are; only the scales are widened to float32
//        (exactly: a UE8M0 byte e is 2^(e-127)) into Fp8BlockWeight's padded rows.
//   FP4  codes [n, k/2] (e2m1, element 2j in the low nibble of byte j) with UE8M0 scales
//        [n, k/32]: the routed experts. Hopper has no FP4 tensor cores, so a layer's active
//        experts are widened just before their GEMMs into a scratch of Fp8BlockWeights (one
//        launch for all of them): per 128x128 block the float32 scale
//        is 2^(max exponent - 133), and each element q * 2^(s-127) becomes the e4m3 code
//        q * 2^d with d = s - 127 - (max - 133) <= 6 (6 * 2^6 = 384 <= 448). That is exact
//        whenever d >= -8 (e4m3's subnormals are multiples of 2^-9 and q a multiple of 0.5),
//        i.e. when a block's 512 group exponents span at most 14; a group further below its
//        block's largest loses its low bits and is counted (Fp4Widen::lossy_groups).
//
// Quantizers into both formats (power-of-two scales: 2^ceil(log2(amax / max code)), round to
// nearest even, saturating) draw random weights in the official precision and build test inputs.
// Every kernel is enqueued on `stream` and returns at once.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/fp8_gemm.h"

namespace hetero::cuda {

constexpr int64_t kFp4Group = 32;

// UE8M0 block scales [ceil(n/128), ceil(k/128)] -> scale [ceil(n/128), fp8_weight_scale_ld(k)]
// float32 (the padding set to 1).
void ue8m0_to_fp8_scales(const uint8_t* e8m0, int64_t n, int64_t k, float* scale,
                         cudaStream_t stream);

// A routed expert's FP4 weight [n, k]; views device memory it does not own.
struct Fp4GroupWeight {
  const uint8_t* codes = nullptr;  // [n, k/2]
  const uint8_t* scale = nullptr;  // [n, k/32] UE8M0
  int64_t n = 0, k = 0;
  static size_t code_bytes(int64_t n, int64_t k) { return static_cast<size_t>(n * (k / 2)); }
  static size_t scale_bytes(int64_t n, int64_t k) {
    return static_cast<size_t>(n * (k / kFp4Group));
  }
};

// w -> dst (q [n, k] e4m3 and its float32 block scales, Fp8BlockWeight's layout; dst.n == w.n,
// dst.k == w.k, k a multiple of 128). Adds to *lossy_groups (device int64; may be null) the
// number of 32-element groups with a nonzero code whose widening was not exact.
void widen_fp4_to_fp8(const Fp4GroupWeight& w, uint8_t* q, float* scale,
                      unsigned long long* lossy_groups, cudaStream_t stream);

// widen_fp4_to_fp8 for several matrices in one launch: of the FP4 matrices [n, k] laid back to
// back from w0 (codes, then scales, each matrix's after the last's), those listed in experts
// (device int32 [count]), each into its own place: matrix e's codes at q + e * n * k and its
// scales at scale + e * fp8_blocks(n) * fp8_weight_scale_ld(k).
void widen_fp4_experts_to_fp8(const Fp4GroupWeight& w0, const int32_t* experts, int64_t count,
                              uint8_t* q, float* scale, unsigned long long* lossy_groups,
                              cudaStream_t stream);

// FP8 codes [n, k] with UE8M0 block scales -> bf16 [n, k] (exact: every product is a bf16).
void dequant_fp8_ue8m0_to_bf16(const uint8_t* codes, const uint8_t* e8m0, int64_t n, int64_t k,
                               uint16_t* out, cudaStream_t stream);

// bf16 w [n, k] -> FP8 codes [n, k] and UE8M0 scales [ceil(n/128), ceil(k/128)].
void quantize_fp8_ue8m0(const uint16_t* w, int64_t n, int64_t k, uint8_t* codes, uint8_t* e8m0,
                        cudaStream_t stream);
// bf16 w [n, k] -> FP4 codes [n, k/2] and UE8M0 scales [n, k/32] (k a multiple of 32).
void quantize_fp4_ue8m0(const uint16_t* w, int64_t n, int64_t k, uint8_t* codes, uint8_t* e8m0,
                        cudaStream_t stream);

}  // namespace hetero::cuda
