// The CUDA error macro and the device-memory budget, on the host side that needs no GPU (CI): which
// Status each failing call becomes, what the messages say, and that a budget refuses before the
// device is asked. tests/gpu/cuda_errors_test.cc drives the same code with real failing calls.
#include <gtest/gtest.h>

#include <string>

#include "kernels/cuda/resource.h"

namespace hetero::cuda {
namespace {

Status failing_runtime_call(cudaError_t e) {
  HETERO_CUDA_RETURN_IF_ERROR(e);
  return Status::ok();
}

Result<int> failing_blas_call(cublasStatus_t s) {
  HETERO_CUDA_RETURN_IF_ERROR(s);
  return 7;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(CudaResource, OutOfMemoryIsResourceExhaustedAndOtherErrorsAreInternal) {
  EXPECT_TRUE(failing_runtime_call(cudaSuccess).is_ok());
  const Status oom = failing_runtime_call(cudaErrorMemoryAllocation);
  EXPECT_EQ(oom.code(), Code::kResourceExhausted) << oom.to_string();
  EXPECT_TRUE(contains(oom.message(), "out of device memory on GPU")) << oom.message();
  const Status bad = failing_runtime_call(cudaErrorInvalidValue);
  EXPECT_EQ(bad.code(), Code::kInternal) << bad.to_string();
  // The call's text (here the macro's argument, `e`), where it was made and the runtime's name
  // for the error.
  EXPECT_EQ(bad.message().rfind("e (cuda_resource_test.cc:", 0), 0u) << bad.message();
  EXPECT_TRUE(contains(bad.message(), "cudaErrorInvalidValue")) << bad.message();
}

TEST(CudaResource, CublasStatusesMapTheSameWay) {
  EXPECT_EQ(*failing_blas_call(CUBLAS_STATUS_SUCCESS), 7);
  const auto oom = failing_blas_call(CUBLAS_STATUS_ALLOC_FAILED);
  EXPECT_EQ(oom.status().code(), Code::kResourceExhausted) << oom.status().to_string();
  const auto bad = failing_blas_call(CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(bad.status().code(), Code::kInternal);
  EXPECT_TRUE(contains(bad.status().message(), "CUBLAS_STATUS_NOT_SUPPORTED"))
      << bad.status().message();
}

TEST(CudaResource, BudgetRefusesPastItsLimitAndCountsWhatIsHeld) {
  DeviceMemoryBudget budget(int64_t{1} << 20);
  EXPECT_TRUE(budget.charge(size_t{768} << 10, "the first part").is_ok());
  const Status refused = budget.charge(size_t{512} << 10, "the KV cache");
  EXPECT_EQ(refused.code(), Code::kResourceExhausted);
  // What was asked, for what, and what the budget has left: as a cudaMalloc refusal reads.
  EXPECT_TRUE(contains(refused.message(), "budget")) << refused.message();
  EXPECT_TRUE(contains(refused.message(), "asked 512.0 KiB for the KV cache")) << refused.message();
  EXPECT_TRUE(contains(refused.message(), "256.0 KiB free of the 1.0 MiB budget"))
      << refused.message();
  EXPECT_EQ(budget.used_bytes(), int64_t{768} << 10);  // the refusal counted nothing
  budget.refund(size_t{768} << 10);
  EXPECT_TRUE(budget.charge(size_t{1} << 20, "all of it").is_ok());
  DeviceMemoryBudget none;  // no limit beyond the device
  EXPECT_TRUE(none.charge(size_t{1} << 50, "anything").is_ok());
}

// A buffer past its budget is refused before the device is asked: true without a GPU too.
TEST(CudaResource, BufferPastTheBudgetIsRefusedBeforeTheDevice) {
  DeviceMemoryBudget budget(int64_t{1} << 20);
  DeviceBuffer b;
  const Status st = b.allocate(size_t{2} << 20, "activations", &budget);
  EXPECT_EQ(st.code(), Code::kResourceExhausted) << st.to_string();
  EXPECT_TRUE(contains(st.message(), "asked 2.0 MiB for activations")) << st.message();
  EXPECT_FALSE(b);
  EXPECT_EQ(b.bytes(), 0u);
  EXPECT_EQ(budget.used_bytes(), 0);
}

}  // namespace
}  // namespace hetero::cuda
