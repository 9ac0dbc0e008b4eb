// Tensor comparison: see compare.h.
#include "common/compare.h"

#include <cmath>
#include <cstring>

#include "common/bf16.h"

namespace hetero {
namespace {

// Map the bits of a float to an integer line on which neighbours differ by one.
int64_t ordered_bits(float v, DType dtype) {
  int64_t mag, sign;
  if (dtype == DType::kBF16) {
    uint16_t b = f32_to_bf16(v);
    mag = b & 0x7fff;
    sign = b >> 15;
  } else if (dtype == DType::kF16) {
    uint16_t b = f32_to_f16(v);
    mag = b & 0x7fff;
    sign = b >> 15;
  } else {
    uint32_t b;
    std::memcpy(&b, &v, 4);
    mag = b & 0x7fffffff;
    sign = b >> 31;
  }
  return sign ? -mag : mag;
}

}  // namespace

int64_t ulp_distance(float a, float b, DType dtype) {
  return std::llabs(ordered_bits(a, dtype) - ordered_bits(b, dtype));
}

nlohmann::json CompareReport::to_json() const {
  nlohmann::json j = {{"pass", pass},       {"numel", numel},
                      {"max_ulp", max_ulp}, {"equal_fraction", equal_fraction},
                      {"max_abs", max_abs}, {"cosine", cosine},
                      {"nmse", nmse}};
  if (!message.empty()) j["message"] = message;
  if (worst_index >= 0)
    j["worst"] = {{"index", worst_index}, {"got", worst_got}, {"want", worst_want}};
  return j;
}

CompareReport compare_tensors(const Tensor& got, const Tensor& want, const CompareSpec& spec) {
  CompareReport r;
  if (got.dtype != want.dtype) {
    r.message = std::string("dtype ") + dtype_name(got.dtype) + " vs " + dtype_name(want.dtype);
    return r;
  }
  if (got.shape != want.shape) {
    r.message = "shape " + got.shape_string() + " vs " + want.shape_string();
    return r;
  }
  r.numel = got.numel();
  const bool is_float =
      got.dtype == DType::kF32 || got.dtype == DType::kF16 || got.dtype == DType::kBF16;
  int64_t equal = 0, worst_ulp = -1;
  double dot = 0, ng = 0, nw = 0, err = 0;
  const size_t esz = static_cast<size_t>(dtype_size(got.dtype));
  for (int64_t i = 0; i < r.numel; ++i) {
    const bool same_bits =
        std::memcmp(got.bytes.data() + i * esz, want.bytes.data() + i * esz, esz) == 0;
    if (same_bits) ++equal;
    const float g = got.at_f32(i), w = want.at_f32(i);
    if (std::isfinite(g) != std::isfinite(w) || std::isnan(g) != std::isnan(w)) {
      r.message = "non-finite mismatch at index " + std::to_string(i);
      r.worst_index = i, r.worst_got = g, r.worst_want = w;
      return r;
    }
    if (!std::isfinite(g)) continue;
    const int64_t ulp = is_float ? ulp_distance(g, w, got.dtype) : (same_bits ? 0 : 1);
    const double diff = std::fabs(static_cast<double>(g) - w);
    if (ulp > worst_ulp) worst_ulp = ulp, r.worst_index = i, r.worst_got = g, r.worst_want = w;
    r.max_abs = std::max(r.max_abs, diff);
    dot += static_cast<double>(g) * w, ng += static_cast<double>(g) * g;
    nw += static_cast<double>(w) * w, err += diff * diff;
  }
  r.max_ulp = std::max<int64_t>(worst_ulp, 0);
  r.equal_fraction = r.numel ? static_cast<double>(equal) / r.numel : 1.0;
  r.cosine = (ng > 0 && nw > 0) ? dot / std::sqrt(ng * nw) : (ng == nw ? 1.0 : 0.0);
  r.nmse = nw > 0 ? err / nw : err;
  // Element test: every element within max_ulp OR max_abs.
  bool elements_ok = true;
  for (int64_t i = 0; i < r.numel && elements_ok; ++i) {
    const float g = got.at_f32(i), w = want.at_f32(i);
    if (!std::isfinite(g)) continue;
    const int64_t ulp = is_float ? ulp_distance(g, w, got.dtype) : (g == w ? 0 : 1);
    if (ulp > spec.max_ulp && std::fabs(static_cast<double>(g) - w) > spec.max_abs) {
      elements_ok = false;
      r.message = "index " + std::to_string(i) + ": got " + std::to_string(g) + " want " +
                  std::to_string(w) + " (" + std::to_string(ulp) + " ulp; allowed " +
                  std::to_string(spec.max_ulp) + " ulp or abs " + std::to_string(spec.max_abs) +
                  ": " + spec.reason + ")";
    }
  }
  if (elements_ok && r.cosine < spec.min_cosine)
    r.message = "cosine " + std::to_string(r.cosine) + " below " + std::to_string(spec.min_cosine);
  r.pass = elements_ok && r.cosine >= spec.min_cosine;
  return r;
}

}  // namespace hetero
