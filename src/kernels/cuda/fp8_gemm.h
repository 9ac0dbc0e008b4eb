// FP8 weight GEMMs for the GPU prefill engine's fast path: the block-scaled weight format of
// DeepSeek's FP8 checkpoints, a per-token-group activation quantizer, and out = act · W^T on
// Hopper's FP8 tensor cores through cuBLASLt's block-scaling modes (VEC128_32F for the
// activation, BLK128x128_32F for the weight; cuBLAS 12.9+, sm_90).
//
// Formats (all device memory, row-major):
//   weight     q [n, k] e4m3, scale [ceil(n/128), scale_ld] float32 with
//              scale_ld = fp8_weight_scale_ld(k) = ceil(k/128) rounded up to a multiple of 4
//              (cuBLASLt wants 16-byte rows; the padding is never read). dequantized
//              W[i][j] = e4m3(q[i][j]) * scale[i/128][j/128].
//   activation q [fp8_act_rows(m), k] e4m3, scale [ceil(k/128)][fp8_act_rows(m)] float32: one
//              scale per (row, 128-column group), stored group-major (the rows of a group are
//              contiguous, as cuBLASLt reads VEC128 scales). Rows past m are zero with scale 1.
// Quantization: amax of the block (group), scale = amax / 448, q = e4m3_rn_satfinite(x / scale);
// an all-zero block gets scale 1. k must be a multiple of 16 (FP8 GEMM alignment).
// Every kernel is enqueued on `stream` and returns at once.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "common/status.h"
#include "kernels/cuda/resource.h"

namespace hetero::cuda {

// How an engine's large projection weights live on the device: bf16, quantized at upload into
// the block-scaled e4m3 format below (each engine says which of its weights), or as the
// checkpoint stores them (DeepSeek-V4's official FP8 and FP4 forms, kernels/cuda/
// checkpoint_formats.h; only engines whose checkpoints have such forms accept it).
enum class WeightDtype { kBf16, kFp8, kCheckpoint };
// "bf16", "fp8" or "checkpoint".
Result<WeightDtype> parse_weight_dtype(const std::string& name);
const char* weight_dtype_name(WeightDtype dtype);
// Ok where this device runs the FP8 block-scaled GEMMs (Hopper, sm_90), else why not.
Status check_fp8_device(int device);

constexpr int64_t kFp8Block = 128;
constexpr float kE4m3Max = 448.f;

inline int64_t fp8_blocks(int64_t x) { return (x + kFp8Block - 1) / kFp8Block; }
inline int64_t fp8_weight_scale_ld(int64_t k) { return (fp8_blocks(k) + 3) / 4 * 4; }
// Activation rows are padded to a multiple of 16 so that the scale tensor's groups stay 16-byte
// aligned for any chunk length; GEMM outputs hold this many rows too.
inline int64_t fp8_act_rows(int64_t m) { return (m + 15) / 16 * 16; }

// A block-scaled FP8 weight [n, k] (see above); views device memory it does not own.
struct Fp8BlockWeight {
  const uint8_t* q = nullptr;
  const float* scale = nullptr;
  int64_t n = 0, k = 0;
  size_t bytes() const {
    return static_cast<size_t>(n * k) +
           static_cast<size_t>(fp8_blocks(n) * fp8_weight_scale_ld(k)) * 4;
  }
};

// w bf16 [n, k] -> q e4m3 [n, k] and scale [ceil(n/128), fp8_weight_scale_ld(k)].
void quantize_weight_fp8_block(const uint16_t* w, int64_t n, int64_t k, uint8_t* q, float* scale,
                               cudaStream_t stream);

// x bf16 [m, k] -> q e4m3 [fp8_act_rows(m), k] and scale [ceil(k/128)][fp8_act_rows(m)]; x and
// q 16-byte aligned (cudaMalloc'd buffers are).
void quantize_act_fp8_group(const uint16_t* x, int64_t m, int64_t k, uint8_t* q, float* scale,
                            cudaStream_t stream);

// quantize_act_fp8_group on each of `segments` runs of rows at once (an MoE's rows grouped by
// expert): segment e is x's rows [off[e], off[e+1]), quantized as if alone, and packed with the
// others: its q at q + pad[e] * k ([fp8_act_rows(rows_e), k]) and its scales at
// scale + pad[e] * ceil(k/128) ([ceil(k/128)][fp8_act_rows(rows_e)]), where
// pad[e] = the sum of fp8_act_rows(rows_j) for j < e and total_rows = pad[segments].
// off and pad: device int32 [segments + 1]. With rows_from (device int32, one per row), row j of
// the segments is x's row rows_from[j] / per instead of row j: an MoE's rows gathered from the
// tokens as they are quantized (rows_from the slot permutation, per the experts per token), with
// no gathered copy in between. With tight_scales, segment e's scales are
// [ceil(k/128)][rows_e] (strided by its real rows, as fp8_grouped_gemm.h reads them), still at
// scale + pad[e] * ceil(k/128).
void quantize_act_fp8_segments(const uint16_t* x, const int32_t* off, const int32_t* pad,
                               int64_t segments, int64_t total_rows, int64_t k, uint8_t* q,
                               float* scale, cudaStream_t stream,
                               const int32_t* rows_from = nullptr, int64_t per = 1,
                               bool tight_scales = false);

// out bf16 [fp8_act_rows(m), n] = dequant(act) · dequant(W)^T with float32 accumulation, through
// cuBLASLt. The plan (descriptors, layouts, heuristic algorithm) is chosen once per (m, n, k) and
// cached; the workspace is allocated once. Not thread-safe: one instance per stream user.
class Fp8Gemm {
 public:
  // Fails where cuBLASLt cannot be initialized or its workspace does not fit (counted against
  // budget when given).
  static Result<std::unique_ptr<Fp8Gemm>> create(DeviceMemoryBudget* budget = nullptr);
  ~Fp8Gemm();
  Fp8Gemm(const Fp8Gemm&) = delete;
  Fp8Gemm& operator=(const Fp8Gemm&) = delete;

  // Chooses and caches the plan for m rows of act against a weight [n, k] without running it:
  // failed_precondition where cuBLASLt has none (an engine asks at load time).
  Status prepare(int64_t m, int64_t n, int64_t k);
  // act_q / act_scale as quantize_act_fp8_group wrote them for m rows. A shape or mode that
  // cuBLASLt does not support is failed_precondition, with its status; nothing falls back. A
  // device failure is kInternal, out of memory kResourceExhausted.
  Status run(const uint8_t* act_q, const float* act_scale, int64_t m, const Fp8BlockWeight& w,
             uint16_t* out, cudaStream_t stream);

  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;

 private:
  struct Plan;
  Fp8Gemm();
  Result<Plan*> plan(int64_t m, int64_t n, int64_t k);

  void* lt_ = nullptr;  // cublasLtHandle_t
  DeviceBuffer workspace_;
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::unique_ptr<Plan>> plans_;
};

}  // namespace hetero::cuda
