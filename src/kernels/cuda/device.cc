#include "kernels/cuda/device.h"

#include <cuda_runtime.h>

namespace hetero::cuda {

DeviceGuard::DeviceGuard(int device) {
  if (device < 0) return;
  previous_ = current_device();
  if (previous_ != device) cudaSetDevice(device);
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0 && previous_ != current_device()) cudaSetDevice(previous_);
}

int current_device() {
  int d = 0;
  cudaGetDevice(&d);
  return d;
}

}  // namespace hetero::cuda
