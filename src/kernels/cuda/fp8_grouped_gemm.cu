// fp8_grouped_gemm.h: the weight-scale transpose, and the launch around the CUTLASS kernels of
// fp8_grouped_gemm_kernel.cuh (checks, two argument staging slots, the workspace). Without
// CUTLASS (HETERO_HAVE_CUTLASS unset) every kernel configuration is absent and create() refuses.
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/fp8_gemm.h"
#include "kernels/cuda/fp8_grouped_gemm.h"
#include "kernels/cuda/fp8_grouped_gemm_kernel.cuh"

namespace hetero::cuda {
namespace {

__global__ void transpose_scales_kernel(const float* __restrict__ scale, int64_t mats, int64_t nb,
                                        int64_t ld, int64_t kb, float* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= mats * nb * kb) return;
  const int64_t m = i / (nb * kb), r = i % (nb * kb), b = r / nb, a = r % nb;  // out [m][b][a]
  out[i] = scale[(m * nb + a) * ld + b];
}

}  // namespace

#if !defined(HETERO_HAVE_CUTLASS)
namespace grouped_detail {
std::unique_ptr<Runner> make_runner() { return nullptr; }
}  // namespace grouped_detail
#endif

void transpose_fp8_weight_scales(const float* scale, int64_t mats, int64_t n, int64_t k, float* out,
                                 cudaStream_t stream) {
  const int64_t total = mats * fp8_blocks(n) * fp8_blocks(k);
  if (total <= 0) return;
  transpose_scales_kernel<<<static_cast<unsigned>((total + 255) / 256), 256, 0, stream>>>(
      scale, mats, fp8_blocks(n), fp8_weight_scale_ld(k), fp8_blocks(k), out);
}

Status fp8_grouped_gemm_available() {
#if defined(HETERO_HAVE_CUTLASS)
  return Status::ok();
#else
  return failed_precondition(
      "this build has no grouped FP8 GEMM: CUTLASS's headers were absent at build time (`make "
      "cutlass` fetches them)");
#endif
}

struct Fp8GroupedGemm::Impl {
  std::unique_ptr<grouped_detail::Runner> runner;
  int64_t max_groups = 0;
  int device = 0, sm_count = 0;
  ArgumentSlots args;
  DeviceBuffer workspace;
};

Result<std::unique_ptr<Fp8GroupedGemm>> Fp8GroupedGemm::create(int64_t max_groups,
                                                               DeviceMemoryBudget* budget) {
  HETERO_RETURN_IF_ERROR(fp8_grouped_gemm_available());
  if (max_groups <= 0 || max_groups > (int64_t{1} << 20))
    return invalid_argument("the grouped FP8 GEMM needs max_groups in [1, 2^20], not " +
                            std::to_string(max_groups));
  auto impl = std::make_unique<Impl>();
  HETERO_CUDA_RETURN_IF_ERROR(cudaGetDevice(&impl->device));
  HETERO_RETURN_IF_ERROR(check_fp8_device(impl->device));
  impl->runner = grouped_detail::make_runner();
  if (!impl->runner)  // available() said yes: the build's kernel file is missing from the link
    return internal_error("the grouped FP8 GEMM has no kernel although this build has CUTLASS");
  impl->max_groups = max_groups;
  HETERO_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&impl->sm_count, cudaDevAttrMultiProcessorCount, impl->device));
  HETERO_RETURN_IF_ERROR(impl->args.allocate(impl->runner->arg_bytes(max_groups),
                                             "the grouped FP8 GEMM's arguments", budget));
  // The workspace (the scheduler's, and tensor maps per SM) depends on the group count and the
  // SMs, not on the shapes.
  const size_t ws = impl->runner->workspace_bytes(max_groups, impl->device, impl->sm_count);
  if (ws > 0)
    HETERO_RETURN_IF_ERROR(
        impl->workspace.allocate(ws, "the grouped FP8 GEMM's workspace", budget));
  return std::unique_ptr<Fp8GroupedGemm>(new Fp8GroupedGemm(std::move(impl)));
}

Status Fp8GroupedGemm::run(const Fp8GemmGroup* groups, int64_t count, int64_t n, int64_t k,
                           cudaStream_t stream) {
  Impl& m = *impl_;
  if (count == 0) return Status::ok();
  if (count < 0 || count > m.max_groups)
    return invalid_argument("the grouped FP8 GEMM takes up to " + std::to_string(m.max_groups) +
                            " groups, not " + std::to_string(count));
  if (n <= 0 || k <= 0 || n % 16 != 0 || k % 16 != 0 || n > INT32_MAX || k > INT32_MAX)
    return invalid_argument("the grouped FP8 GEMM needs n and k positive multiples of 16, not n=" +
                            std::to_string(n) + " k=" + std::to_string(k));
  auto aligned = [](const void* p) { return p && (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  for (int64_t g = 0; g < count; ++g) {
    const Fp8GemmGroup& x = groups[g];
    if (x.rows <= 0 || x.rows > INT32_MAX)
      return invalid_argument("grouped FP8 GEMM group " + std::to_string(g) + " has " +
                              std::to_string(x.rows) + " rows");
    if (!aligned(x.act_q) || !aligned(x.w_q) || !aligned(x.out) || !x.act_scale || !x.w_scale_t)
      return invalid_argument("grouped FP8 GEMM group " + std::to_string(g) +
                              ": operands must be 16-byte aligned and scales given");
  }
  HETERO_ASSIGN_OR_RETURN(const int s, m.args.next());
  const Status st =
      m.runner->run(groups, count, n, k, m.args.host(s), m.args.device(s), m.workspace.get(),
                    m.workspace.bytes(), m.device, m.sm_count, stream);
  // Whatever the launch did: the staging copy may be queued either way.
  HETERO_RETURN_IF_ERROR(m.args.queued(s, stream));
  return st;
}

Fp8GroupedGemm::Fp8GroupedGemm(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Fp8GroupedGemm::~Fp8GroupedGemm() = default;

}  // namespace hetero::cuda
