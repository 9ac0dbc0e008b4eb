// Tensor helpers: sizes, names, conversions.
#include "common/tensor.h"

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
      return 4;
    case DType::kI64:
      return 8;
    case DType::kU8:
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
    case DType::kI64:
      return "I64";
    case DType::kU8:
      return "U8";
  }
  return "?";
}

Result<DType> dtype_from_name(const std::string& name) {
  if (name == "F32") return DType::kF32;
  if (name == "F16") return DType::kF16;
  if (name == "BF16") return DType::kBF16;
  if (name == "I32") return DType::kI32;
  if (name == "I64") return DType::kI64;
  if (name == "U8") return DType::kU8;
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
    case DType::kI64:
      return static_cast<float>(data<int64_t>()[i]);
    case DType::kU8:
      return static_cast<float>(data<uint8_t>()[i]);
  }
  return 0.f;
}

std::string Tensor::shape_string() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
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
