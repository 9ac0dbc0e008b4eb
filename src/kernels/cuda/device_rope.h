// A rope (hetero::RopeSpec) uploaded for the CUDA kernels: the same inverse frequencies the CPU
// op uses, computed once on the host, so GPU and CPU keys share their bits.
#pragma once

#include "common/status.h"
#include "kernels/cpu_ops.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/resource.h"

namespace hetero::cuda {

class DeviceRope {
 public:
  // Synchronous copy onto the current device.
  Status upload(const RopeSpec& r);
  const RopeTable& table() const { return table_; }
  size_t bytes() const { return inv_.bytes(); }

 private:
  DeviceBuffer inv_;
  RopeTable table_;
};

}  // namespace hetero::cuda
