// Which GPU a thread's CUDA runtime calls go to. A stream, an event or an allocation belongs to
// one device; kernels and most calls on it need that device current in the calling thread, and
// a new thread starts on device 0. Engines and programs that may live on another GPU than the
// caller's hold a DeviceGuard in each call that enqueues work.
#pragma once

namespace hetero::cuda {

// Makes `device` the calling thread's current CUDA device while the guard lives (negative: no
// change); the previous one is current again after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// The calling thread's current CUDA device.
int current_device();

}  // namespace hetero::cuda
