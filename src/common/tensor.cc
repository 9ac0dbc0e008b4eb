// Tensor helpers: sizes, names, conversions.
#include "common/tensor.h"

#include <cmath>
#include <cstring>

#include "common/bf16.h"

namespace hetero {

int64_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kF16:
      return 2;
    case DType::kBF16:
      return 2;
    case DType::kI32:
    case DType::kU32:
      return 4;
    case DType::kI64:
      return 8;
    case DType::kU8:
    case DType::kI8:
    case DType::kF8E4M3:
    case DType::kF8E8M0:
      return 1;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kI32:
      return "I32";
    case DType::kU32:
      return "U32";
    case DType::kI64:
      return "I64";
    case DType::kU8:
      return "U8";
    case DType::kI8:
      return "I8";
    case DType::kF8E4M3:
      return "F8_E4M3";
    case DType::kF8E8M0:
      return "F8_E8M0";
  }
  return "?";
}

Result<DType> dtype_from_name(const std::string& name) {
  if (name == "F32") return DType::kF32;
  if (name == "F16") return DType::kF16;
  if (name == "BF16") return DType::kBF16;
  if (name == "I32") return DType::kI32;
  if (name == "U32") return DType::kU32;
  if (name == "I64") return DType::kI64;
  if (name == "U8") return DType::kU8;
  if (name == "I8") return DType::kI8;
  if (name == "F8_E4M3") return DType::kF8E4M3;
  if (name == "F8_E8M0") return DType::kF8E8M0;
  return invalid_argument("unsupported dtype '" + name + "'");
}

Tensor::Tensor(DType d, std::vector<int64_t> s) : dtype(d), shape(std::move(s)) {
  bytes.assign(static_cast<size_t>(numel() * dtype_size(dtype)), 0);
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

float Tensor::at_f32(int64_t i) const {
  switch (dtype) {
    case DType::kF32:
      return data<float>()[i];
    case DType::kF16:
      return f16_to_f32(data<uint16_t>()[i]);
    case DType::kBF16:
      return bf16_to_f32(data<uint16_t>()[i]);
    case DType::kI32:
      return static_cast<float>(data<int32_t>()[i]);
    case DType::kU32:
      return static_cast<float>(data<uint32_t>()[i]);
    case DType::kI64:
      return static_cast<float>(data<int64_t>()[i]);
    case DType::kU8:
      return static_cast<float>(data<uint8_t>()[i]);
    case DType::kI8:
      return static_cast<float>(data<int8_t>()[i]);
    case DType::kF8E4M3:
      return fp8_e4m3_to_f32(data<uint8_t>()[i]);
    case DType::kF8E8M0:
      return fp8_e8m0_to_f32(data<uint8_t>()[i]);
  }
  return 0.f;
}

std::string Tensor::shape_string() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

float fp8_e4m3_to_f32(uint8_t v) {
  const float sign = (v & 0x80u) ? -1.0f : 1.0f;
  const int exp = (v >> 3) & 0xf, mant = v & 0x7;
  if (exp == 0xf && mant == 0x7) return NAN;
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -9);  // subnormal: m/8 * 2^-6
  return sign * std::ldexp(static_cast<float>(8 + mant), exp - 10);      // (1 + m/8) * 2^(e-7)
}

float fp8_e8m0_to_f32(uint8_t v) {
  if (v == 0xff) return NAN;
  return std::ldexp(1.0f, static_cast<int>(v) - 127);
}

float fp4_e2m1_to_f32(uint8_t nibble) {
  static constexpr float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float m = kMagnitude[nibble & 0x7u];
  return (nibble & 0x8u) ? -m : m;
}

std::vector<float> to_f32(const Tensor& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  if (t.dtype == DType::kF32) {
    std::memcpy(out.data(), t.bytes.data(), out.size() * 4);
    return out;
  }
  for (int64_t i = 0; i < t.numel(); ++i) out[static_cast<size_t>(i)] = t.at_f32(i);
  return out;
}

}  // namespace hetero
