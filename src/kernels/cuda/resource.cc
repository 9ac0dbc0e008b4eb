// CUDA resources and errors: see resource.h.
#include "kernels/cuda/resource.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace hetero::cuda {
namespace {

const char* base_name(const char* file) {
  const char* slash = std::strrchr(file, '/');
  return slash ? slash + 1 : file;
}

std::string where(const char* call, const char* file, int line) {
  return std::string(call) + " (" + base_name(file) + ":" + std::to_string(line) + ")";
}

// "4.1 GiB free of 139.8 GiB" on the current device, after `prefix`; nothing where the runtime
// cannot say (a lost context).
std::string free_of_total(const char* prefix) {
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
    cudaGetLastError();
    return "";
  }
  return prefix + format_bytes(static_cast<int64_t>(free_bytes)) + " free of " +
         format_bytes(static_cast<int64_t>(total_bytes));
}

int device_now() {
  int d = 0;
  if (cudaGetDevice(&d) != cudaSuccess) cudaGetLastError();
  return d;
}

}  // namespace

Status out_of_device_memory(size_t asked, std::string_view what) {
  return resource_exhausted("out of device memory on GPU " + std::to_string(device_now()) +
                            ": asked " + format_bytes(static_cast<int64_t>(asked)) + " for " +
                            std::string(what) + free_of_total("; "));
}

Status cuda_call_status(cudaError_t e, const char* call, const char* file, int line) {
  // Not sticky errors are also the thread's last error until read: clear it here, where it is
  // reported. A sticky one (the context is lost) stays whatever is called.
  cudaGetLastError();
  if (e == cudaErrorMemoryAllocation)
    return resource_exhausted("out of device memory on GPU " + std::to_string(device_now()) +
                              " in " + where(call, file, line) + free_of_total("; "));
  return internal_error(where(call, file, line) + ": " + cudaGetErrorString(e) + " (" +
                        cudaGetErrorName(e) + ")");
}

const char* cublas_status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "an unknown cuBLAS status";
}

Status cublas_call_status(cublasStatus_t s, const char* call, const char* file, int line) {
  if (s == CUBLAS_STATUS_ALLOC_FAILED)
    return resource_exhausted("out of device memory on GPU " + std::to_string(device_now()) +
                              " in " + where(call, file, line) + free_of_total("; "));
  return internal_error(where(call, file, line) + ": " + cublas_status_name(s));
}

// ------------------------------------------------------------------------------- budget

Status DeviceMemoryBudget::charge(size_t bytes, std::string_view what) {
  const auto b = static_cast<int64_t>(bytes);
  int64_t used = used_.load();
  do {
    if (limit_ > 0 && used + b > limit_) {
      const std::string device = free_of_total(" (the device: ");
      return resource_exhausted(
          "out of the device-memory budget on GPU " + std::to_string(device_now()) + ": asked " +
          format_bytes(b) + " for " + std::string(what) + "; " +
          format_bytes(std::max<int64_t>(0, limit_ - used)) + " free of the " +
          format_bytes(limit_) + " budget" + (device.empty() ? "" : device + ")"));
    }
  } while (!used_.compare_exchange_weak(used, used + b));
  return Status::ok();
}

void DeviceMemoryBudget::refund(size_t bytes) { used_.fetch_sub(static_cast<int64_t>(bytes)); }

// ------------------------------------------------------------------------------- buffers

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    p_ = std::exchange(o.p_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    stream_ = o.stream_;
    stream_ordered_ = o.stream_ordered_;
    budget_ = std::exchange(o.budget_, nullptr);
  }
  return *this;
}

Status DeviceBuffer::allocate(size_t bytes, std::string_view what, DeviceMemoryBudget* budget) {
  return take(bytes, nullptr, false, what, budget);
}

Status DeviceBuffer::allocate_async(size_t bytes, cudaStream_t stream, std::string_view what,
                                    DeviceMemoryBudget* budget) {
  return take(bytes, stream, true, what, budget);
}

Status DeviceBuffer::take(size_t bytes, cudaStream_t stream, bool stream_ordered,
                          std::string_view what, DeviceMemoryBudget* budget) {
  reset();
  if (bytes == 0) return Status::ok();
  if (budget) HETERO_RETURN_IF_ERROR(budget->charge(bytes, what));
  const cudaError_t e =
      stream_ordered ? cudaMallocAsync(&p_, bytes, stream) : cudaMalloc(&p_, bytes);
  if (e != cudaSuccess) {
    p_ = nullptr;
    if (budget) budget->refund(bytes);
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // not sticky: the next allocation may succeed
      return out_of_device_memory(bytes, what);
    }
    return cuda_call_status(e, stream_ordered ? "cudaMallocAsync" : "cudaMalloc", __FILE__,
                            __LINE__);
  }
  bytes_ = bytes;
  stream_ = stream;
  stream_ordered_ = stream_ordered;
  budget_ = budget;
  return Status::ok();
}

void DeviceBuffer::reset() {
  if (p_) {
    if (stream_ordered_)
      cudaFreeAsync(p_, stream_);
    else
      cudaFree(p_);
    if (budget_) budget_->refund(bytes_);
  }
  p_ = nullptr;
  bytes_ = 0;
  budget_ = nullptr;
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    p_ = std::exchange(o.p_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

Status PinnedBuffer::allocate(size_t bytes, std::string_view what) {
  reset();
  if (bytes == 0) return Status::ok();
  const cudaError_t e = cudaMallocHost(&p_, bytes);
  if (e != cudaSuccess) {
    p_ = nullptr;
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      return resource_exhausted("out of page-locked host memory: asked " +
                                format_bytes(static_cast<int64_t>(bytes)) + " for " +
                                std::string(what));
    }
    return cuda_call_status(e, "cudaMallocHost", __FILE__, __LINE__);
  }
  bytes_ = bytes;
  return Status::ok();
}

void PinnedBuffer::reset() {
  if (p_) cudaFreeHost(p_);
  p_ = nullptr;
  bytes_ = 0;
}

// ------------------------------------------------------------------------------- streams, events

Result<Stream> Stream::create() {
  cudaStream_t made = nullptr;
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&made, cudaStreamNonBlocking));
  Stream s;
  s.s_ = made;
  return s;
}

Stream::~Stream() {
  if (s_) {
    cudaStreamSynchronize(s_);
    cudaStreamDestroy(s_);
  }
}

Stream& Stream::operator=(Stream&& o) noexcept {
  std::swap(s_, o.s_);
  return *this;
}

Result<Event> Event::create(bool timing) {
  cudaEvent_t made = nullptr;
  HETERO_CUDA_RETURN_IF_ERROR(
      cudaEventCreateWithFlags(&made, timing ? cudaEventDefault : cudaEventDisableTiming));
  Event e;
  e.e_ = made;
  return e;
}

Status ArgumentSlots::allocate(size_t bytes, std::string_view what, DeviceMemoryBudget* budget) {
  for (int s = 0; s < 2; ++s) {
    HETERO_RETURN_IF_ERROR(host_[s].allocate(bytes, what));
    HETERO_RETURN_IF_ERROR(dev_[s].allocate(bytes, what, budget));
    HETERO_ASSIGN_OR_RETURN(copied_[s], Event::create());
    used_[s] = false;
  }
  return Status::ok();
}

Result<int> ArgumentSlots::next() {
  const int s = slot_;
  slot_ ^= 1;
  if (used_[s]) HETERO_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(copied_[s].get()));
  return s;
}

Status ArgumentSlots::queued(int slot, cudaStream_t stream) {
  used_[slot] = true;
  if (cudaEventRecord(copied_[slot].get(), stream) != cudaSuccess) {
    const cudaError_t e = cudaGetLastError();
    cudaStreamSynchronize(stream);
    HETERO_CUDA_RETURN_IF_ERROR(e);
  }
  return Status::ok();
}

Event::~Event() {
  if (e_) cudaEventDestroy(e_);
}

Event& Event::operator=(Event&& o) noexcept {
  std::swap(e_, o.e_);
  return *this;
}

}  // namespace hetero::cuda
