// One launch for an MoE's routed experts whose weights are FP4 (DeepSeek-V4's checkpoint form,
// checkpoint_formats.h) against FP8 activations: each expert's FP4 codes are widened to e4m3
// inside the GEMM's main loop, in shared memory, right before the tensor cores read them, so
// the experts are never written out widened (the per-chunk path otherwise widens every active
// expert to device memory first: at DeepSeek-V4-Flash's shapes that pass took as long as the
// GEMMs, RESULTS §39).
//
// The widened codes and the weight's block scale are widen_fp4_to_fp8's: per 128x128 block the
// scale 2^(max - 133) over the block's group exponents (block_max below, computed once), and each
// element's code from fp4_widen.cuh. So the GEMM reads the same FP8 operands as the widened path;
// Hopper's FP8 tensor cores (wgmma, sm_90a) take them with float32 accumulation over each 128
// of k, promoted by (activation scale x weight scale) as fp8_grouped_gemm.h's kernel does. The
// kernel is deterministic; output rows past a group's rows are not written.
//
// Tiles: 64 or 128 weight rows (the MMA's M: the operands are swapped, so the output's columns)
// by 64 or 128 of a group's rows, or 64 by 256, 128 deep; a consumer warp group per 64 weight
// rows and 128 group rows. Warp-specialized: two producer warp groups copy the operands
// (cp.async, four stages) and widen each k tile into one of two swizzled buffers, with the
// promotion factors; the consumer warp groups run wgmma on them and promote; named barriers hand
// each buffer over and back, one pair a consumer warp group, so the two need not run in step.
// The 64x256 tile's two consumer warp groups share one widened weight tile, so an expert of up
// to 256 rows has its weights widened once, where 128-row tiles widen them once per 128 rows.
// A launch has a block a tile, or (set_max_blocks) fewer blocks each taking tiles in turn, its
// copies and widening running on into the next tile while the consumers finish one. Neither
// the 64x256 tile nor the persistent launch beat 128x128 a block a tile in the forward (RESULTS
// §45.1: uneven routing leaves 64x256 tiles half empty; persistence gained nothing), so nothing
// chooses them; they stay for benches and tests.
//
// Bit-equal to the widened path (widen_fp4_experts_to_fp8, then cuBLASLt or the grouped FP8
// kernel) in every test. At DeepSeek-V4-Flash's shapes 1.01-1.03x the widened path's speed at 8K
// tokens (~192 rows an expert), 0.64x at 32K (~768: each row tile re-widens its weight tile),
// RESULTS §43: the engine's kAuto runs it for chunks of few rows an expert
// (Dsv4CudaOptions::kW4a8MaxMeanRows), kW4a8 for every chunk.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "common/status.h"
#include "kernels/cuda/checkpoint_formats.h"
#include "kernels/cuda/resource.h"

namespace hetero::cuda {

// FP4 matrices [mats][n, k] laid back to back (codes, then scales, as widen_fp4_experts_to_fp8
// reads them) and their block exponents; views device memory it does not own.
struct Fp4Experts {
  Fp4GroupWeight w0;                   // matrix 0; matrix e's codes at w0.codes + e * n * k / 2
  const uint8_t* block_max = nullptr;  // [mats][ceil(n/128)][k/128], fp4_block_max's
  int64_t mats = 0;
  static size_t block_max_bytes(int64_t mats, int64_t n, int64_t k) {
    return static_cast<size_t>(mats * ((n + 127) / 128) * (k / 128));
  }
};

// out [mats][ceil(n/128)][k/128]: each 128x128 block's largest UE8M0 group exponent, the one
// widen_fp4_to_fp8 derives the block's scale from. k a multiple of 128. Enqueued on `stream`.
void fp4_block_max(const Fp4GroupWeight& w0, int64_t mats, uint8_t* out, cudaStream_t stream);

// Ok where this build and device run the W4A8 kernel (sm_90), else why not.
Status w4a8_grouped_gemm_available(int device);

// One GEMM of the launch: out [rows, n] (bf16, row-major) = dequant(act) · widen(W_expert)^T.
struct W4a8Group {
  const uint8_t* act_q = nullptr;    // [fp8_act_rows(rows), k] e4m3, 16-byte aligned
  const float* act_scale = nullptr;  // [k/128][fp8_act_rows(rows)], fp8_gemm.h's layout
  int64_t rows = 0;                  // > 0
  int64_t expert = 0;                // which matrix of the Fp4Experts
  uint16_t* out = nullptr;           // [rows, n] bf16, 16-byte aligned
};

class W4a8GroupedGemm {
 public:
  // Up to max_groups GEMMs a launch; argument staging allocated here (counted against budget
  // when given). Refused where the device is not sm_90.
  static Result<std::unique_ptr<W4a8GroupedGemm>> create(int64_t max_groups,
                                                         DeviceMemoryBudget* budget = nullptr);
  ~W4a8GroupedGemm();
  W4a8GroupedGemm(const W4a8GroupedGemm&) = delete;
  W4a8GroupedGemm& operator=(const W4a8GroupedGemm&) = delete;

  // Whether run() takes matrices of this shape: n a multiple of 64, k a multiple of 128 and at
  // most 8192.
  static Status supports(int64_t n, int64_t k);
  // The tile, of those built: 64 or 128 weight rows by 64 or 128 group rows, or 64 by 256.
  // Anything else, or weight rows that do not divide n: 128x128 where n is a multiple of 128,
  // else 64x128 (the default). For benches and tests.
  void set_tile(int weight_rows, int group_rows);
  // At most `blocks` blocks a launch, each taking every blocks-th tile, its pipeline running on
  // from one tile into the next (persistent: e.g. a block per multiprocessor, one fitting each);
  // 0, the default: a block per tile. The same bits either way. For benches and tests.
  void set_max_blocks(int64_t blocks);
  // Whether the kernel is built for this tile (set_tile takes it).
  static bool has_tile(int weight_rows, int group_rows);

  // Enqueues every group's GEMM on `stream` as one launch; returns once the arguments are
  // copied into a staging slot (two alternate; the third call waits for the first's launch).
  // lossy_groups (device, may be null) counts, once per group's expert, the FP4 groups whose
  // widening was not exact, as widen_fp4_to_fp8 does. Bad arguments are invalid_argument.
  Status run(const W4a8Group* groups, int64_t count, const Fp4Experts& w,
             unsigned long long* lossy_groups, cudaStream_t stream);

  struct Impl;

 private:
  explicit W4a8GroupedGemm(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace hetero::cuda
