// The grouped kernel fp8_grouped_gemm.h runs (fp8_grouped_gemm_kernel.cuh; sm_90a, CUTLASS):
// 128x128x128 tiles, cooperative, clusters of two along n.
#define HETERO_GROUPED_KERNEL_DEFINITIONS
#include "kernels/cuda/fp8_grouped_gemm_kernel.cuh"

namespace hetero::cuda::grouped_detail {

std::unique_ptr<Runner> make_runner() {
  return std::make_unique<
      GroupedKernel<Cfg<Shape<_128, _128, _128>, Shape<_1, _2, _1>,
                        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                        cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>>>();
}

}  // namespace hetero::cuda::grouped_detail
