// MLX affine quantization: see mlx_quant.h.
#include "model/mlx_quant.h"

#include "common/bf16.h"
#include "kernels/cpu_ops.h"

namespace hetero {

std::string AffineWeight::describe() const {
  return std::to_string(bits) + "-bit affine, group " + std::to_string(group);
}

Result<AffineWeight> unpack_affine(const std::string& name, const Tensor& packed,
                                   const Tensor& scales, const Tensor& biases, int64_t k) {
  if (packed.dtype != DType::kU32 || packed.shape.size() != 2)
    return invalid_argument("quantized tensor '" + name + ".weight' must be U32 [n, packed], is " +
                            std::string(dtype_name(packed.dtype)) + " " + packed.shape_string());
  const int64_t n = packed.shape[0], words = packed.shape[1];
  if (words <= 0 || k <= 0 || (32 * words) % k != 0)
    return invalid_argument("quantized tensor '" + name + ".weight' " + packed.shape_string() +
                            " does not pack " + std::to_string(k) + " columns");
  const int64_t bits = 32 * words / k;
  if (bits != 2 && bits != 4 && bits != 8)
    return invalid_argument("quantized tensor '" + name + "' has " + std::to_string(bits) +
                            " bits; only 2, 4 and 8-bit affine are read");
  for (const Tensor* t : {&scales, &biases})
    if (t->shape.size() != 2 || t->shape[0] != n || t->shape[1] <= 0 || k % t->shape[1] != 0 ||
        t->shape != scales.shape)
      return invalid_argument("quantized tensor '" + name + "' has scales " +
                              scales.shape_string() + " and biases " + biases.shape_string() +
                              " for a weight of " + std::to_string(n) + " x " + std::to_string(k));
  AffineWeight w;
  w.n = n, w.k = k, w.bits = bits, w.group = k / scales.shape[1];
  const int64_t per = 32 / bits;
  const uint32_t mask = (1u << bits) - 1;
  const uint32_t* p = packed.data<uint32_t>();
  w.q.resize(static_cast<size_t>(n * k));
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < k; ++c)
      w.q[static_cast<size_t>(r * k + c)] =
          static_cast<float>((p[r * words + c / per] >> ((c % per) * bits)) & mask);
  w.scales = to_f32(scales);
  w.biases = to_f32(biases);
  return w;
}

void dequantize_row(const AffineWeight& w, int64_t r, uint16_t* out) {
  const int64_t groups = w.k / w.group;
  for (int64_t c = 0; c < w.k; ++c) {
    const size_t g = static_cast<size_t>(r * groups + c / w.group);
    out[c] =
        f32_to_bf16(round_bf16(w.scales[g] * w.q[static_cast<size_t>(r * w.k + c)]) + w.biases[g]);
  }
}

Tensor dequantize_affine(const AffineWeight& w) {
  Tensor t(DType::kBF16, {w.n, w.k});
  for (int64_t r = 0; r < w.n; ++r) dequantize_row(w, r, t.data<uint16_t>() + r * w.k);
  return t;
}

void affine_linear(const uint16_t* x, int64_t m, const AffineWeight& w, const uint16_t* bias,
                   uint16_t* out) {
  linear_quantized_affine(x, m, w.k, w.q.data(), w.scales.data(), w.biases.data(), w.n, w.group,
                          out);
  if (bias) add_bias_bf16(out, m, w.n, bias);
}

}  // namespace hetero
