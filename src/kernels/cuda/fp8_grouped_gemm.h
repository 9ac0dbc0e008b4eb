// One launch for many FP8 block-scaled GEMMs of the same (n, k) and different row counts: an MoE's
// routed experts, each expert's rows against its own weight. Hopper's warp-specialized TMA +
// wgmma kernel with per-128-K scale promotion, from CUTLASS (its grouped "FP8 blockwise" kernel,
// sm_90a; 128x128 output tiles, 128 deep, two warp groups cooperating on a tile, clusters of two
// along n: of the six tile and schedule configurations measured this one was fastest at Flash's
// expert shapes, RESULTS §39); the formats are fp8_gemm.h's, except for two layouts it reads:
//   activation scales  [ceil(k/128)][rows] per group: the group's rows contiguous, with the
//                      group's own row count as the stride (quantize_act_fp8_segments with
//                      tight_scales = true writes them so);
//   weight scales      [ceil(k/128)][ceil(n/128)] per weight: the transpose of fp8_gemm.h's
//                      weight scale (transpose_fp8_weight_scales makes it).
// The per-128-K promotion is the one cuBLASLt's block-scaled GEMM does, but the two kernels
// order their sums differently: outputs agree to float32 rounding of the accumulators, not bit
// for bit (tests/gpu/fp8_grouped_gemm_test.cc). The kernel is deterministic.
//
// CUTLASS is optional (`make cutlass` fetches its headers from PyPI into .deps/): a build without
// it has no grouped kernel, fp8_grouped_gemm_available() says why, and create() refuses.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "kernels/cuda/resource.h"

namespace hetero::cuda {

// Ok where this build has the grouped kernel, else failed_precondition saying why not.
Status fp8_grouped_gemm_available();

// One GEMM of the launch: out [rows, n] (bf16, row-major) = dequant(act) · dequant(W)^T.
struct Fp8GemmGroup {
  const uint8_t* act_q = nullptr;    // [rows, k] e4m3, 16-byte aligned
  const float* act_scale = nullptr;  // [ceil(k/128)][rows]
  int64_t rows = 0;                  // > 0
  const uint8_t* w_q = nullptr;      // [n, k] e4m3, 16-byte aligned
  const float* w_scale_t = nullptr;  // [ceil(k/128)][ceil(n/128)]
  uint16_t* out = nullptr;           // [rows, n] bf16, 16-byte aligned
};

// scale [mats][ceil(n/128)][fp8_weight_scale_ld(k)] (fp8_gemm.h's, matrix after matrix) ->
// out [mats][ceil(k/128)][ceil(n/128)]. Enqueued on `stream`.
void transpose_fp8_weight_scales(const float* scale, int64_t mats, int64_t n, int64_t k, float* out,
                                 cudaStream_t stream);

class Fp8GroupedGemm {
 public:
  // Up to max_groups GEMMs a launch; the device-side argument arrays and the kernel's workspace
  // are allocated here (counted against budget when given). Refused where the build has no
  // grouped kernel or the device is not sm_90.
  static Result<std::unique_ptr<Fp8GroupedGemm>> create(int64_t max_groups,
                                                        DeviceMemoryBudget* budget = nullptr);
  ~Fp8GroupedGemm();
  Fp8GroupedGemm(const Fp8GroupedGemm&) = delete;
  Fp8GroupedGemm& operator=(const Fp8GroupedGemm&) = delete;

  // Enqueues every group's GEMM on `stream` as one launch; returns once the arguments are
  // copied into a staging slot (two slots alternate: a call may follow the previous one before
  // the stream has run it; the third waits for the first's launch). Every call on one stream:
  // the launches share the kernel's workspace. n and k multiples of 16; more groups than
  // max_groups, a group with no rows or a misaligned pointer is invalid_argument; a shape the
  // kernel cannot run is failed_precondition, naming it.
  Status run(const Fp8GemmGroup* groups, int64_t count, int64_t n, int64_t k, cudaStream_t stream);

  struct Impl;

 private:
  explicit Fp8GroupedGemm(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace hetero::cuda
