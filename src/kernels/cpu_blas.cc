// The engine's OpenBLAS GEMM (--gemm blas): float32 accumulation in OpenBLAS's own order, so
// not bit-exact with the decoder; kept apart so the exact ops carry no BLAS dependency.
#include <cblas.h>

#include <vector>

#include "common/bf16.h"
#include "kernels/cpu_ops.h"

namespace hetero {

void linear_blas(const uint16_t* x, int64_t m, int64_t k, const float* w, int64_t n,
                 const uint16_t* bias, uint16_t* out) {
  std::vector<float> xf(static_cast<size_t>(m * k)), y(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m * k; ++i) xf[static_cast<size_t>(i)] = bf16_to_f32(x[i]);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), 1.0f, xf.data(), static_cast<int>(k), w, static_cast<int>(k),
              0.0f, y.data(), static_cast<int>(n));
  round_linear_output(y, m, n, bias, out);
}

}  // namespace hetero
