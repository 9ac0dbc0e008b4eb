// MLX's affine quantization as mlx-lm's converter writes it (`mlx_lm.convert -q`, mode "affine"):
// a [n, k] weight stored as uint32 words, each packing 32/bits element values (element c of a row
// in bits [(c % per) * bits, +bits) of word c / per), plus bf16 `scales` and `biases`
// [n, k / group]. The value the decoder computes with is bf16(bf16(scale * q) + bias); its
// quantized matmul sums bf16 products in bf16 (kernels/cpu_ops.h, linear_quantized_affine).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"

namespace hetero {

struct AffineWeight {
  int64_t n = 0, k = 0, group = 0, bits = 0;
  std::vector<float> q;               // element values [n, k]
  std::vector<float> scales, biases;  // [n, k / group]
  bool empty() const { return n == 0; }
  // "4-bit affine, group 64"
  std::string describe() const;
};

// From a checkpoint's `name.weight` (uint32 [n, k * bits / 32]), `name.scales` and
// `name.biases`, for a weight of k columns: bits and group follow from the shapes and must be
// 2, 4 or 8 bits and a group dividing k; anything else is refused with the tensor's name.
Result<AffineWeight> unpack_affine(const std::string& name, const Tensor& packed,
                                   const Tensor& scales, const Tensor& biases, int64_t k);

// Row r as mx.dequantize gives it (bf16).
void dequantize_row(const AffineWeight& w, int64_t r, uint16_t* out);
// The whole weight so (bf16 [n, k]): the values the decoder's quantized matmul multiplies by.
Tensor dequantize_affine(const AffineWeight& w);

// out[m, n] = x @ w^T as the decoder's quantized matmul computes it, then + bias (bf16 [n], or
// null) as its QuantizedLinear adds one: a separate bf16 add.
void affine_linear(const uint16_t* x, int64_t m, const AffineWeight& w, const uint16_t* bias,
                   uint16_t* out);

}  // namespace hetero
