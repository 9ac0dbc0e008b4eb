// CUDA resources and errors for host code, shared by every engine, program and kernel host: one
// RAII family (device buffer, page-locked host buffer, stream, event, cuBLAS handle; all
// move-only) and one macro, HETERO_CUDA_RETURN_IF_ERROR, that turns a failing CUDA runtime, cuBLAS
// or cuBLASLt call into a Status returned from the enclosing function.
//
// A failure a request can cause is a Status, never an abort: running out of device memory is
// kResourceExhausted with the bytes asked and what the device has free (it is not a sticky CUDA
// error: the next allocation may succeed), anything else is kInternal naming the call.
// HETERO_CHECK stays for broken invariants; destructors log nothing and ignore errors (they
// cannot report them, and the device may already be gone at exit).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "common/status.h"
#include "common/sysmem.h"

namespace hetero::cuda {

// kResourceExhausted for `asked` bytes of device memory refused on the current device: "out of
// device memory on GPU 0: asked 12.3 GiB for <what>; 4.1 GiB free of 139.8 GiB".
Status out_of_device_memory(size_t asked, std::string_view what);

// The Status for a call that returned e (ok for cudaSuccess). Out of memory is
// kResourceExhausted; anything else kInternal with the call's text, where it was made and the
// runtime's description. An error that is not sticky is cleared from the thread's last error, so
// a later cudaGetLastError() does not report it twice.
Status cuda_call_status(cudaError_t e, const char* call, const char* file, int line);
// The same for cuBLAS and cuBLASLt (which share cublasStatus_t): CUBLAS_STATUS_ALLOC_FAILED is
// kResourceExhausted.
Status cublas_call_status(cublasStatus_t s, const char* call, const char* file, int line);
const char* cublas_status_name(cublasStatus_t s);

inline Status call_status(cudaError_t e, const char* call, const char* file, int line) {
  return e == cudaSuccess ? Status() : cuda_call_status(e, call, file, line);
}
inline Status call_status(cublasStatus_t s, const char* call, const char* file, int line) {
  return s == CUBLAS_STATUS_SUCCESS ? Status() : cublas_call_status(s, call, file, line);
}

// Returns the Status of a failing CUDA runtime, cuBLAS or cuBLASLt call from the enclosing
// function (which returns Status or Result<T>); does nothing when the call succeeds.
#define HETERO_CUDA_RETURN_IF_ERROR(expr)                               \
  do {                                                                  \
    ::hetero::Status hetero_cuda_status_ =                              \
        ::hetero::cuda::call_status((expr), #expr, __FILE__, __LINE__); \
    if (!hetero_cuda_status_.is_ok()) return hetero_cuda_status_;       \
  } while (0)

// A cap on the device memory one owner's allocations hold (an engine's: weights, cache and
// scratch), below what the device has: an allocation that would pass it fails as a cudaMalloc out
// of memory does (kResourceExhausted, the message naming the budget). Thread-safe.
class DeviceMemoryBudget {
 public:
  // limit_bytes 0: no budget beyond the device.
  explicit DeviceMemoryBudget(int64_t limit_bytes = 0) : limit_(limit_bytes) {}
  DeviceMemoryBudget(const DeviceMemoryBudget&) = delete;
  DeviceMemoryBudget& operator=(const DeviceMemoryBudget&) = delete;

  int64_t limit_bytes() const { return limit_; }
  int64_t used_bytes() const { return used_.load(); }
  // Counts `bytes` against the budget, or refuses them (nothing counted).
  Status charge(size_t bytes, std::string_view what);
  void refund(size_t bytes);

 private:
  const int64_t limit_;
  std::atomic<int64_t> used_{0};
};

// Device memory owned by the object, on the device current when it was allocated. Plain
// (cudaMalloc) or stream-ordered (cudaMallocAsync / cudaFreeAsync on a stream that must outlive
// the buffer). Counted against a budget when one is given (which must outlive the buffer).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Frees what is held, then takes `bytes` (0: holds nothing). `what` names the memory in an
  // out-of-memory message. Work still queued that reads the old memory must be done (plain) or
  // ordered before this on the stream (stream-ordered).
  Status allocate(size_t bytes, std::string_view what, DeviceMemoryBudget* budget = nullptr);
  Status allocate_async(size_t bytes, cudaStream_t stream, std::string_view what,
                        DeviceMemoryBudget* budget = nullptr);
  void reset();

  template <typename T = void>
  T* get() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return bytes_; }
  explicit operator bool() const { return p_ != nullptr; }

 private:
  Status take(size_t bytes, cudaStream_t stream, bool stream_ordered, std::string_view what,
              DeviceMemoryBudget* budget);

  void* p_ = nullptr;
  size_t bytes_ = 0;
  cudaStream_t stream_ = nullptr;
  bool stream_ordered_ = false;
  DeviceMemoryBudget* budget_ = nullptr;
};

// Page-locked host memory owned by the object (device copies to and from it run asynchronously).
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() { reset(); }
  PinnedBuffer(PinnedBuffer&& o) noexcept { *this = std::move(o); }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  // Frees what is held, then takes `bytes`; out of page-locked memory is kResourceExhausted.
  Status allocate(size_t bytes, std::string_view what);
  void reset();
  template <typename T = void>
  T* get() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// A non-blocking stream on the device current at creation: it orders against other streams only
// through events. The destructor waits for its work, then destroys it.
class Stream {
 public:
  static Result<Stream> create();
  Stream() = default;
  ~Stream();
  Stream(Stream&& o) noexcept : s_(o.s_) { o.s_ = nullptr; }
  Stream& operator=(Stream&& o) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// An event on the device current at creation (no timing unless asked).
class Event {
 public:
  static Result<Event> create(bool timing = false);
  Event() = default;
  ~Event();
  Event(Event&& o) noexcept : e_(o.e_) { o.e_ = nullptr; }
  Event& operator=(Event&& o) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return e_; }
  explicit operator bool() const { return e_ != nullptr; }

 private:
  cudaEvent_t e_ = nullptr;
};

// Two page-locked host slots and their device copies for a kernel's per-launch arguments (the
// grouped GEMMs' group lists), used in turn: a launch may be queued before the previous one ran,
// and the third waits until the stream has passed the first (its copy and its launch).
class ArgumentSlots {
 public:
  Status allocate(size_t bytes, std::string_view what, DeviceMemoryBudget* budget = nullptr);
  // The slot to fill next, once the stream has passed what was queued from it two calls ago.
  Result<int> next();
  void* host(int slot) const { return host_[slot].get(); }
  void* device(int slot) const { return dev_[slot].get(); }
  // After the slot's copy and launch were enqueued on `stream`, or failed to be: its host side
  // may be written again once the stream gets here (where that cannot be recorded, the stream
  // is drained and the error returned).
  Status queued(int slot, cudaStream_t stream);

 private:
  PinnedBuffer host_[2];
  DeviceBuffer dev_[2];
  Event copied_[2];
  bool used_[2] = {false, false};
  int slot_ = 0;
};

// A cuBLAS handle whose work goes to `stream`. Only code that creates one links cuBLAS.
class BlasHandle {
 public:
  static Result<BlasHandle> create(cudaStream_t stream);
  BlasHandle() = default;
  ~BlasHandle() {
    if (h_) cublasDestroy(h_);
  }
  BlasHandle(BlasHandle&& o) noexcept : h_(o.h_) { o.h_ = nullptr; }
  BlasHandle& operator=(BlasHandle&& o) noexcept {
    std::swap(h_, o.h_);
    return *this;
  }
  BlasHandle(const BlasHandle&) = delete;
  BlasHandle& operator=(const BlasHandle&) = delete;
  cublasHandle_t get() const { return h_; }

 private:
  cublasHandle_t h_ = nullptr;
};

inline Result<BlasHandle> BlasHandle::create(cudaStream_t stream) {
  cublasHandle_t made = nullptr;
  HETERO_CUDA_RETURN_IF_ERROR(cublasCreate(&made));
  BlasHandle b;
  b.h_ = made;
  HETERO_CUDA_RETURN_IF_ERROR(cublasSetStream(b.h_, stream));
  // Spelled out: nvcc's C++17 would copy `b` into Result's converting constructor.
  return Result<BlasHandle>(std::move(b));
}

}  // namespace hetero::cuda
