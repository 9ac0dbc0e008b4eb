// CUDA failures as Status with real failing calls on the device: an absurd allocation is
// kResourceExhausted saying what was asked and what the device has free, and the device allocates
// again right after (out of memory is not sticky); any other failure is kInternal naming the call.
// The RAII family owns what it creates and gives the budget back what it frees.
#include <gtest/gtest.h>

#include <string>

#include "cuda_test_base.h"
#include "kernels/cuda/resource.h"

namespace hetero {
namespace {

class CudaErrorsTest : public CudaDeviceTest {};

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

Status absurd_malloc(void** p) {
  HETERO_CUDA_RETURN_IF_ERROR(cudaMalloc(p, size_t{1} << 60));
  return Status::ok();
}

Status no_such_device() {
  HETERO_CUDA_RETURN_IF_ERROR(cudaSetDevice(1 << 20));
  return Status::ok();
}

// cuBLAS refuses a negative size before touching any pointer.
Status gemm_of_negative_size(cublasHandle_t h) {
  const float one = 1.f;
  HETERO_CUDA_RETURN_IF_ERROR(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, -1, 1, 1, &one, nullptr, 1,
                                          nullptr, 1, &one, nullptr, 1));
  return Status::ok();
}

TEST_F(CudaErrorsTest, AbsurdMallocIsResourceExhaustedAndTheDeviceAllocatesAfter) {
  void* p = nullptr;
  const Status st = absurd_malloc(&p);
  EXPECT_EQ(st.code(), Code::kResourceExhausted) << st.to_string();
  EXPECT_TRUE(contains(st.message(), "out of device memory on GPU 0")) << st.message();
  EXPECT_TRUE(contains(st.message(), "cudaMalloc(p, size_t{1} << 60)")) << st.message();
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  EXPECT_TRUE(contains(st.message(), " free of " + format_bytes(static_cast<int64_t>(total_bytes))))
      << st.message();
  // Reported once: the thread's last error is clear, and the device still allocates and runs.
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  cuda::DeviceBuffer b;
  ASSERT_TRUE(b.allocate(size_t{1} << 20, "a small buffer").is_ok());
  EXPECT_EQ(cudaMemset(b.get(), 0, size_t{1} << 20), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST_F(CudaErrorsTest, DeviceBufferSaysWhatItAskedFor) {
  cuda::DeviceBuffer b;
  const Status st = b.allocate(size_t{1} << 60, "a test's absurd buffer");
  EXPECT_EQ(st.code(), Code::kResourceExhausted) << st.to_string();
  EXPECT_TRUE(contains(st.message(), "asked 1.0 EiB for a test's absurd buffer")) << st.message();
  EXPECT_TRUE(contains(st.message(), " free of ")) << st.message();
  EXPECT_FALSE(b);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST_F(CudaErrorsTest, OtherFailuresAreInternalAndNameTheCall) {
  const Status device = no_such_device();
  EXPECT_EQ(device.code(), Code::kInternal) << device.to_string();
  EXPECT_TRUE(contains(device.message(), "cudaSetDevice(1 << 20)")) << device.message();
  EXPECT_TRUE(contains(device.message(), "cudaErrorInvalidDevice")) << device.message();
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  auto handle = cuda::BlasHandle::create(nullptr);
  ASSERT_TRUE(handle.is_ok()) << handle.status().to_string();
  const Status blas = gemm_of_negative_size(handle->get());
  EXPECT_EQ(blas.code(), Code::kInternal) << blas.to_string();
  EXPECT_TRUE(contains(blas.message(), "cublasSgemm")) << blas.message();
  EXPECT_TRUE(contains(blas.message(), "CUBLAS_STATUS_INVALID_VALUE")) << blas.message();
}

TEST_F(CudaErrorsTest, BuffersGiveTheBudgetBackWhenFreed) {
  auto stream = cuda::Stream::create();
  ASSERT_TRUE(stream.is_ok()) << stream.status().to_string();
  cuda::DeviceMemoryBudget budget(int64_t{1} << 20);
  cuda::DeviceBuffer a, b;
  ASSERT_TRUE(a.allocate(size_t{512} << 10, "a", &budget).is_ok());
  ASSERT_TRUE(b.allocate_async(size_t{256} << 10, stream->get(), "b", &budget).is_ok());
  EXPECT_EQ(budget.used_bytes(), int64_t{768} << 10);
  // Past the budget: refused as the device would refuse it, nothing taken.
  cuda::DeviceBuffer c;
  const Status st = c.allocate(size_t{512} << 10, "c", &budget);
  EXPECT_EQ(st.code(), Code::kResourceExhausted) << st.to_string();
  EXPECT_TRUE(contains(st.message(), "the device: ")) << st.message();  // and what it has free
  EXPECT_EQ(budget.used_bytes(), int64_t{768} << 10);
  // Moving a buffer moves its charge; freeing it gives the bytes back.
  cuda::DeviceBuffer moved = std::move(a);
  EXPECT_FALSE(a);
  EXPECT_EQ(budget.used_bytes(), int64_t{768} << 10);
  moved.reset();
  b.reset();
  EXPECT_EQ(budget.used_bytes(), 0);
  EXPECT_EQ(cudaStreamSynchronize(stream->get()), cudaSuccess);
}

TEST_F(CudaErrorsTest, StreamsAndEventsAreOwnedAndMoveOnly) {
  auto s = cuda::Stream::create();
  auto e = cuda::Event::create();
  ASSERT_TRUE(s.is_ok() && e.is_ok());
  cuda::Stream stream = std::move(s.value());
  cuda::Event event = std::move(e.value());
  EXPECT_EQ(s->get(), nullptr);
  EXPECT_FALSE(*e);
  EXPECT_EQ(cudaEventRecord(event.get(), stream.get()), cudaSuccess);
  EXPECT_EQ(cudaEventSynchronize(event.get()), cudaSuccess);
  cuda::PinnedBuffer pinned;
  ASSERT_TRUE(pinned.allocate(4096, "a test's staging").is_ok());
  EXPECT_EQ(pinned.bytes(), 4096u);
}

}  // namespace
}  // namespace hetero
