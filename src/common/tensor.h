// A plain host tensor: dtype, shape and owned bytes. The unit that crosses module boundaries
// (safetensors files, wire segments, comparisons). Row-major, no strides.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace hetero {

enum class DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2, kI32 = 3, kI64 = 4, kU8 = 5 };

int64_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);  // safetensors spelling: "F32", "BF16", ...
Result<DType> dtype_from_name(const std::string& name);

struct Tensor {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;

  Tensor() = default;
  Tensor(DType d, std::vector<int64_t> s);  // zero-filled

  int64_t numel() const;
  int64_t nbytes() const { return static_cast<int64_t>(bytes.size()); }
  template <typename T>
  T* data() {
    return reinterpret_cast<T*>(bytes.data());
  }
  template <typename T>
  const T* data() const {
    return reinterpret_cast<const T*>(bytes.data());
  }
  // Element i as float32 (for F32/F16/BF16/I32/I64/U8).
  float at_f32(int64_t i) const;
  std::string shape_string() const;
};

// Convert any float tensor to float32 (copy).
std::vector<float> to_f32(const Tensor& t);

}  // namespace hetero
