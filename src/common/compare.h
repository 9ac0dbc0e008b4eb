// The one tensor-comparison helper every test and `hetero verify` use. Same shape and dtype,
// NaN/Inf at the same places, then per element: pass if the distance in ULPs of the dtype is
// within max_ulp OR the absolute difference within max_abs; and globally a cosine floor.
// A default CompareSpec is bit-exact. Every looser spec must carry a one-line reason.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "common/tensor.h"

namespace hetero {

struct CompareSpec {
  int64_t max_ulp = 0;
  double max_abs = 0.0;
  double min_cosine = -2.0;  // below any real cosine: off unless set
  std::string reason = "bit-exact";
};

struct CompareReport {
  bool pass = false;
  std::string message;  // why it failed, naming the worst element
  int64_t numel = 0;
  int64_t max_ulp = 0;
  double equal_fraction = 0.0;  // elements with identical bits
  double max_abs = 0.0;
  double cosine = 1.0;
  double nmse = 0.0;
  int64_t worst_index = -1;
  float worst_got = 0.f, worst_want = 0.f;

  nlohmann::json to_json() const;
};

CompareReport compare_tensors(const Tensor& got, const Tensor& want, const CompareSpec& spec);

// ULP distance between two values of a float dtype given as float32 (bf16/f16 values must be
// exactly representable). Sign-crossing distances count through zero.
int64_t ulp_distance(float a, float b, DType dtype);

}  // namespace hetero
