// A decoder's projection (bridge/decoder_weights.h DecoderLinear) on the device, computed as the
// decoder computes it: dense weights in MLX's CPU matmul order (ordered f32 sums, one rounding),
// quantized ones (mx, affine) with MLX's CPU quantized-matmul recipes (kernels/cuda/dsv4_ops.h).
// Bit-identical to DecoderLinear::apply on the host. Shared by the llama and DeepSeek-V4 cache
// programs on the GPU.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "bridge/decoder_weights.h"
#include "common/status.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/resource.h"

namespace hetero::cuda {

// Dense: wt f32 [k, n]; quantized: q f32 [n, k] with scales (and affine biases) f32 [n, k/group]
// — the host's arrays.
struct GpuDecoderLinear {
  DecoderLinear::Mode mode = DecoderLinear::Mode::kDense;
  int64_t n = 0, k = 0, group = 0;
  DeviceBuffer wt, q, scales, biases;
  BF16Range range;  // dense: for the exact-products check (FMA in the ordered GEMM)
  bool dense() const { return mode == DecoderLinear::Mode::kDense; }
};

// Copies `bytes` of host memory into a new device buffer (synchronously; nothing is allocated
// for 0 bytes) and adds them to *total. Every cache program uploads its weights this way.
Status upload_weights(const void* host, size_t bytes, DeviceBuffer* out, size_t* total);

// Copies l to the current device (synchronously); adds its bytes to *total.
Status upload_decoder_linear(const DecoderLinear& l, GpuDecoderLinear* g, size_t* total);

// out [m, n] bf16 = the decoder's x @ W^T (+ bias, bf16 [n] or null, as the decoder adds it: in
// the f32 sum for dense weights, a separate bf16 add after a quantized matmul), enqueued on
// `stream`. xf: x as f32 (read by dense weights only); acc: f32 scratch [m, n] (dense); flags:
// 4 ints of device scratch (dense). A failed enqueue is the CUDA error's Status.
Status apply_decoder_linear(const GpuDecoderLinear& l, const uint16_t* x, const float* xf,
                            int64_t m, float* acc, int* flags, const uint16_t* bias, uint16_t* out,
                            cudaStream_t stream);

}  // namespace hetero::cuda
