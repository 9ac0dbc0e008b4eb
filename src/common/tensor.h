// A plain host tensor: dtype, shape and owned bytes. The unit that crosses module boundaries
// (safetensors files, wire segments, comparisons). Row-major, no strides.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace hetero {

// kI8, kF8E4M3 and kF8E8M0 are the storage types of FP8/FP4 checkpoints (DeepSeek-V4's official
// release): e4m3 weights, e2m1 pairs packed in int8, and power-of-two (UE8M0) block scales.
enum class DType : int32_t {
  kF32 = 0,
  kF16 = 1,
  kBF16 = 2,
  kI32 = 3,
  kI64 = 4,
  kU8 = 5,
  kI8 = 6,
  kF8E4M3 = 7,  // OCP e4m3fn: bias 7, no infinities, 0x7f/0xff are NaN
  kF8E8M0 = 8,  // unsigned exponent only: 2^(e - 127), 0xff is NaN
  kU32 = 9,     // MLX's packed quantized weights
};

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
  // Element i as float32 (any dtype; F8 types decoded exactly).
  float at_f32(int64_t i) const;
  std::string shape_string() const;
};

// Convert any float tensor to float32 (copy).
std::vector<float> to_f32(const Tensor& t);

// Exact decodings of the narrow float formats (every value is representable in float32).
float fp8_e4m3_to_f32(uint8_t v);
float fp8_e8m0_to_f32(uint8_t v);
// One e2m1 (FP4) code in the low 4 bits: sign, 2 exponent bits (bias 1), 1 mantissa bit.
float fp4_e2m1_to_f32(uint8_t nibble);

}  // namespace hetero
