// The cuBLASLt side of fp8_gemm.h: one plan per GEMM shape (descriptors, layouts and the
// heuristic's algorithm), reused across calls; only the operand and scale pointers change.
//
// Row-major out [m, n] = act [m, k] · W^T is column-major D [n, m] = op(A) B with A = W stored
// column-major as [k, n] (transposed: the "TN" layout FP8 needs on Hopper) and B = act stored
// column-major as [k, m]. So cuBLASLt's A carries the 128x128 block scales and B the 1x128 ones.
#include "kernels/cuda/fp8_gemm.h"

#include <cublasLt.h>

#include <string>

namespace hetero::cuda {

struct Fp8Gemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

namespace {

cublasLtHandle_t as_lt(void* p) { return static_cast<cublasLtHandle_t>(p); }

// A shape or mode cuBLASLt refuses: an expected refusal (failed_precondition), not a device error.
Status refused(const std::string& what, cublasStatus_t st) {
  return failed_precondition(what + ": " + cublas_status_name(st));
}

template <class T>
cublasStatus_t set(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& v) {
  return cublasLtMatmulDescSetAttribute(desc, attr, &v, sizeof(v));
}

}  // namespace

Result<WeightDtype> parse_weight_dtype(const std::string& name) {
  if (name == "bf16") return WeightDtype::kBf16;
  if (name == "fp8") return WeightDtype::kFp8;
  if (name == "checkpoint") return WeightDtype::kCheckpoint;
  return invalid_argument("the weight dtype must be bf16, fp8 or checkpoint, not '" + name + "'");
}

const char* weight_dtype_name(WeightDtype dtype) {
  switch (dtype) {
    case WeightDtype::kFp8:
      return "fp8";
    case WeightDtype::kCheckpoint:
      return "checkpoint";
    default:
      return "bf16";
  }
}

Status check_fp8_device(int device) {
  cudaDeviceProp p{};
  const cudaError_t e = cudaGetDeviceProperties(&p, device);
  if (e != cudaSuccess) {
    cudaGetLastError();  // reported here, not again by a later check
    return failed_precondition(std::string("fp8 weights: no CUDA device ") +
                               std::to_string(device) + ": " + cudaGetErrorString(e));
  }
  if (p.major != 9)
    return failed_precondition(
        "fp8 block-scaled weights need a Hopper GPU (sm_90) for cuBLASLt's block-scaling modes, "
        "not sm_" +
        std::to_string(p.major * 10 + p.minor));
  return Status::ok();
}

Fp8Gemm::Fp8Gemm() = default;

Fp8Gemm::~Fp8Gemm() {
  plans_.clear();
  if (lt_) cublasLtDestroy(as_lt(lt_));
}

Result<std::unique_ptr<Fp8Gemm>> Fp8Gemm::create(DeviceMemoryBudget* budget) {
  std::unique_ptr<Fp8Gemm> g(new Fp8Gemm());
  cublasLtHandle_t h = nullptr;
  HETERO_CUDA_RETURN_IF_ERROR(cublasLtCreate(&h));
  g->lt_ = h;
  HETERO_RETURN_IF_ERROR(g->workspace_.allocate(kWorkspaceBytes, "the cuBLASLt workspace", budget));
  return g;
}

Result<Fp8Gemm::Plan*> Fp8Gemm::plan(int64_t rows, int64_t n, int64_t k) {
  auto& slot = plans_[{rows, n, k}];
  if (slot) return slot.get();
  auto p = std::make_unique<Plan>();
  const std::string shape = "FP8 block-scaled GEMM m=" + std::to_string(rows) +
                            " n=" + std::to_string(n) + " k=" + std::to_string(k);
  auto fail = [&](const char* step, cublasStatus_t st) -> Status {
    plans_.erase({rows, n, k});
    return refused(shape + ", " + step, st);
  };
  cublasStatus_t st = cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  if (st != CUBLAS_STATUS_SUCCESS) return fail("descriptor", st);
  const int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  const int32_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  // The heuristic refuses a scale mode without a scale pointer; run() sets the real ones.
  const void* dummy = workspace_.get();
  for (cublasStatus_t s : {set(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T),
                           set(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N),
                           set(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, a_mode),
                           set(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, b_mode),
                           set(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, dummy),
                           set(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, dummy)})
    if (s != CUBLAS_STATUS_SUCCESS) return fail("setting the block-scaling modes", s);
  const auto u = [](int64_t v) { return static_cast<uint64_t>(v); };
  st = cublasLtMatrixLayoutCreate(&p->a, CUDA_R_8F_E4M3, u(k), u(n), k);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatrixLayoutCreate(&p->b, CUDA_R_8F_E4M3, u(k), u(rows), k);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatrixLayoutCreate(&p->d, CUDA_R_16BF, u(n), u(rows), n);
  if (st != CUBLAS_STATUS_SUCCESS) return fail("layouts", st);
  cublasLtMatmulPreference_t pref = nullptr;
  st = cublasLtMatmulPreferenceCreate(&pref);
  if (st != CUBLAS_STATUS_SUCCESS) return fail("preference", st);
  const uint64_t ws = kWorkspaceBytes;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                       sizeof(ws));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  st = cublasLtMatmulAlgoGetHeuristic(as_lt(lt_), p->desc, p->a, p->b, p->d, p->d, pref, 1, &result,
                                      &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st == CUBLAS_STATUS_SUCCESS && found == 0) st = CUBLAS_STATUS_NOT_SUPPORTED;
  if (st != CUBLAS_STATUS_SUCCESS) return fail("no algorithm (heuristic)", st);
  p->algo = result.algo;
  slot = std::move(p);
  return slot.get();
}

Status Fp8Gemm::prepare(int64_t m, int64_t n, int64_t k) {
  if (k % 16 != 0 || n % 16 != 0)
    return invalid_argument("the FP8 GEMM needs n and k multiples of 16, not n=" +
                            std::to_string(n) + " k=" + std::to_string(k));
  HETERO_ASSIGN_OR_RETURN(Plan * p, plan(fp8_act_rows(m), n, k));
  (void)p;
  return Status::ok();
}

Status Fp8Gemm::run(const uint8_t* act_q, const float* act_scale, int64_t m,
                    const Fp8BlockWeight& w, uint16_t* out, cudaStream_t stream) {
  if (m <= 0) return Status::ok();
  HETERO_RETURN_IF_ERROR(prepare(m, w.n, w.k));
  Plan* p = plans_.at({fp8_act_rows(m), w.n, w.k}).get();
  const void* ws = w.scale;
  const void* xs = act_scale;
  set(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, ws);
  set(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, xs);
  const float one = 1.f, zero = 0.f;
  const cublasStatus_t st =
      cublasLtMatmul(as_lt(lt_), p->desc, &one, w.q, p->a, act_q, p->b, &zero, out, p->d, out, p->d,
                     &p->algo, workspace_.get(), kWorkspaceBytes, stream);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE)
    return refused("cublasLtMatmul, FP8 block-scaled GEMM m=" + std::to_string(m) +
                       " n=" + std::to_string(w.n) + " k=" + std::to_string(w.k),
                   st);
  HETERO_CUDA_RETURN_IF_ERROR(st);  // a device error, or out of memory
  return Status::ok();
}

}  // namespace hetero::cuda
