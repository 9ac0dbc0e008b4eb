// MLX's quantization as mlx-lm's converter writes it (`mlx_lm.convert -q`): a [n, k] weight
// stored as uint32 words, each packing 32/bits element codes (element c of a row in bits
// [(c % per) * bits, +bits) of word c / per), with per-group scales [n, k / group].
//   - affine (2, 4 or 8 bits, any group): integer codes, bf16 `scales` and `biases`; the value
//     the decoder computes with is bf16(bf16(scale * q) + bias).
//   - mxfp4 / mxfp8 (4 or 8 bits, group 32): e2m1 / e4m3 codes and uint8 UE8M0 `scales`
//     (2^(s - 127)), no biases; the value is scale * q, exact in bf16.
// Its quantized matmul sums bf16 products in bf16 (kernels/cpu_ops.h, linear_quantized_affine
// and linear_quantized_mx). nvfp4 (group 16, e4m3 scales) is refused by name.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"

namespace hetero {

struct QuantizedWeight {
  std::string mode = "affine";  // or "mxfp4", "mxfp8"
  int64_t n = 0, k = 0, group = 0, bits = 0;
  std::vector<float> q;               // element values [n, k]
  std::vector<float> scales, biases;  // [n, k / group] as values; biases: affine only
  bool empty() const { return n == 0; }
  bool mx() const { return mode == "mxfp4" || mode == "mxfp8"; }
  // "4-bit affine, group 64", "4-bit mxfp4, group 32"
  std::string describe() const;
};

// From a checkpoint's `name.weight` (uint32 [n, k * bits / 32]), `name.scales` and, for affine,
// `name.biases` (null: an mx mode), for a weight of k columns. Bits and group follow from the
// shapes; anything the decoder's modes do not make is refused with the tensor's name.
Result<QuantizedWeight> unpack_quantized(const std::string& name, const Tensor& packed,
                                         const Tensor& scales, const Tensor* biases, int64_t k);

// Row r as mx.dequantize gives it (bf16).
void dequantize_row(const QuantizedWeight& w, int64_t r, uint16_t* out);
// The whole weight so (bf16 [n, k]): the values the decoder's quantized matmul multiplies by.
Tensor dequantize(const QuantizedWeight& w);

// out[m, n] = x @ w^T as the decoder's quantized matmul computes it, then + bias (bf16 [n], or
// null) as its QuantizedLinear adds one: a separate bf16 add.
void quantized_linear(const uint16_t* x, int64_t m, const QuantizedWeight& w, const uint16_t* bias,
                      uint16_t* out);

}  // namespace hetero
