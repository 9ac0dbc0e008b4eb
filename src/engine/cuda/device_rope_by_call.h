// A request's rope by the decoder's calls (hetero::RopeByCall) on the device: one uploaded table
// per spec, and the rows of each call roped with its own, as the CPU engine and program do.
// Header-only, beside the engine (the CUDA kernel library may not see the model): the llama
// engine and the GPU cache program use it.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/cuda/device_rope.h"
#include "model/llama_rope.h"

namespace hetero::cuda {

class DeviceRopeByCall {
 public:
  // Synchronous copies onto the current device; `plain` is the table already uploaded for every
  // row outside the calls with their own specs (kept by its owner, which must outlive this).
  // On failure nothing changes.
  Status upload(const RopeByCall& r, const DeviceRope* plain) {
    std::vector<DeviceRope> tables(r.specs() - 1);
    for (size_t i = 1; i < r.specs(); ++i) HETERO_RETURN_IF_ERROR(tables[i - 1].upload(r.spec(i)));
    spans_ = r;
    plain_ = plain;
    tables_ = std::move(tables);
    return Status::ok();
  }
  // Back to the plain table for every row.
  void clear(const DeviceRope* plain) {
    spans_ = RopeByCall(RopeSpec{});
    plain_ = plain;
    tables_.clear();
  }
  // f(offset from pos0, rows, table) for each run of [pos0, pos0 + tokens) under one rope.
  template <class F>
  void for_each_span(int64_t tokens, int64_t pos0, F&& f) const {
    spans_.for_each_span(tokens, pos0, [&](int64_t off, int64_t rows, size_t i) {
      f(off, rows, i == 0 ? plain_->table() : tables_[i - 1].table());
    });
  }
  // rope_apply over [tokens, heads, head_dim] rows from pos0, each run with its table.
  void apply(uint16_t* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t pos0,
             cudaStream_t stream) const {
    for_each_span(tokens, pos0, [&](int64_t off, int64_t rows, const RopeTable& t) {
      rope_apply(x + off * heads * head_dim, rows, heads, head_dim, pos0 + off, t, stream);
    });
  }
  size_t bytes() const {
    size_t b = 0;
    for (const DeviceRope& t : tables_) b += t.bytes();
    return b;
  }

 private:
  RopeByCall spans_{RopeSpec{}};
  const DeviceRope* plain_ = nullptr;
  std::vector<DeviceRope> tables_;  // the calls' own specs, in RopeByCall::spec order from 1
};

}  // namespace hetero::cuda
