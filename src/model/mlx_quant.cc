// MLX quantization: see mlx_quant.h.
#include "model/mlx_quant.h"

#include <cmath>

#include "common/bf16.h"
#include "kernels/cpu_ops.h"

namespace hetero {

std::string QuantizedWeight::describe() const {
  return std::to_string(bits) + "-bit " + mode + ", group " + std::to_string(group);
}

Result<QuantizedWeight> unpack_quantized(const std::string& name, const Tensor& packed,
                                         const Tensor& scales, const Tensor* biases, int64_t k) {
  if (packed.dtype != DType::kU32 || packed.shape.size() != 2)
    return invalid_argument("quantized tensor '" + name + ".weight' must be U32 [n, packed], is " +
                            std::string(dtype_name(packed.dtype)) + " " + packed.shape_string());
  const int64_t n = packed.shape[0], words = packed.shape[1];
  if (words <= 0 || k <= 0 || (32 * words) % k != 0)
    return invalid_argument("quantized tensor '" + name + ".weight' " + packed.shape_string() +
                            " does not pack " + std::to_string(k) + " columns");
  const int64_t bits = 32 * words / k;
  for (const Tensor* t : {&scales, biases})
    if (t && (t->shape.size() != 2 || t->shape[0] != n || t->shape[1] <= 0 ||
              k % t->shape[1] != 0 || t->shape != scales.shape))
      return invalid_argument("quantized tensor '" + name + "' has scales " +
                              scales.shape_string() +
                              (biases ? " and biases " + biases->shape_string() : std::string()) +
                              " for a weight of " + std::to_string(n) + " x " + std::to_string(k));
  QuantizedWeight w;
  w.n = n, w.k = k, w.bits = bits, w.group = k / scales.shape[1];
  if (biases) {
    w.mode = "affine";
    if (bits != 2 && bits != 4 && bits != 8)
      return invalid_argument("quantized tensor '" + name + "' has " + std::to_string(bits) +
                              " bits; only 2, 4 and 8-bit affine are read");
  } else {
    // No biases: an mx mode. MLX's nvfp4 is 4 bits in groups of 16 with e4m3 scales.
    if (bits == 4 && w.group == 16)
      return invalid_argument("quantized tensor '" + name +
                              "' is nvfp4 (4 bits, groups of 16): not supported (affine, mxfp4 "
                              "and mxfp8 are)");
    if ((bits != 4 && bits != 8) || w.group != 32 || scales.dtype != DType::kU8)
      return invalid_argument("quantized tensor '" + name + "' has no biases (an mx mode) but " +
                              std::to_string(bits) + " bits, groups of " + std::to_string(w.group) +
                              " and " + dtype_name(scales.dtype) +
                              " scales; mxfp4 and mxfp8 are 4 and 8 bits in groups of 32 with "
                              "uint8 scales");
    w.mode = bits == 4 ? "mxfp4" : "mxfp8";
  }
  const int64_t per = 32 / bits;
  const uint32_t mask = (1u << bits) - 1;
  const uint32_t* p = packed.data<uint32_t>();
  w.q.resize(static_cast<size_t>(n * k));
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < k; ++c) {
      const auto code = static_cast<uint8_t>((p[r * words + c / per] >> ((c % per) * bits)) & mask);
      w.q[static_cast<size_t>(r * k + c)] =
          !biases ? (bits == 4 ? fp4_e2m1_to_f32(code) : fp8_e4m3_to_f32(code))
                  : static_cast<float>(code);
    }
  if (biases) {
    w.scales = to_f32(scales);
    w.biases = to_f32(*biases);
  } else {
    // UE8M0: byte s is 2^(s - 127) (byte 0 the subnormal 2^-127, as the decoder reads it).
    const uint8_t* s = scales.data<uint8_t>();
    w.scales.resize(static_cast<size_t>(scales.numel()));
    for (size_t i = 0; i < w.scales.size(); ++i)
      w.scales[i] = std::ldexp(1.0f, static_cast<int>(s[i]) - 127);
  }
  return w;
}

void dequantize_row(const QuantizedWeight& w, int64_t r, uint16_t* out) {
  const int64_t groups = w.k / w.group;
  for (int64_t c = 0; c < w.k; ++c) {
    const size_t g = static_cast<size_t>(r * groups + c / w.group);
    const float v = w.scales[g] * w.q[static_cast<size_t>(r * w.k + c)];
    out[c] = w.mx() ? f32_to_bf16(v) : f32_to_bf16(round_bf16(v) + w.biases[g]);
  }
}

Tensor dequantize(const QuantizedWeight& w) {
  Tensor t(DType::kBF16, {w.n, w.k});
  for (int64_t r = 0; r < w.n; ++r) dequantize_row(w, r, t.data<uint16_t>() + r * w.k);
  return t;
}

void quantized_linear(const uint16_t* x, int64_t m, const QuantizedWeight& w, const uint16_t* bias,
                      uint16_t* out) {
  if (w.mx())
    linear_quantized_mx(x, m, w.k, w.q.data(), w.scales.data(), w.n, w.group, out);
  else
    linear_quantized_affine(x, m, w.k, w.q.data(), w.scales.data(), w.biases.data(), w.n, w.group,
                            out);
  if (bias) add_bias_bf16(out, m, w.n, bias);
}

}  // namespace hetero
