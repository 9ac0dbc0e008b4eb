// The tapped rows' readers on other streams (TapEvent::x_read, engine/tap.h): an engine hands
// slot() with each tap and calls before_write() before it writes the rows' memory again and at
// the end of the call that tapped, so its stream waits for the copies without the host waiting
// and no consumer's event is needed after that call.
#pragma once

#include <cuda_runtime.h>

#include "common/status.h"
#include "kernels/cuda/resource.h"

namespace hetero::cuda {

class TapReaders {
 public:
  // For TapEvent::x_read. A consumer leaves its event here; the slot is cleared by before_write.
  void** slot() { return &pending_; }
  // The engine's stream waits for the readers left since the last call (none: nothing to do).
  Status before_write(cudaStream_t stream) {
    if (pending_ == nullptr) return Status::ok();
    const auto readers = static_cast<cudaEvent_t>(pending_);
    pending_ = nullptr;
    HETERO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, readers, 0));
    return Status::ok();
  }

 private:
  void* pending_ = nullptr;
};

}  // namespace hetero::cuda
