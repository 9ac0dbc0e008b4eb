// DeviceRope: see device_rope.h.
#include "kernels/cuda/device_rope.h"

#include <vector>

#include "common/bf16.h"

namespace hetero::cuda {

Status DeviceRope::upload(const RopeSpec& r) {
  if (r.dims <= 0 || r.dims % 2) return invalid_argument("rope dims must be positive and even");
  const std::vector<float> inv = rope_inverse_frequencies(r);
  HETERO_RETURN_IF_ERROR(inv_.allocate(inv.size() * sizeof(float), "rope frequencies"));
  HETERO_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(inv_.get(), inv.data(), inv.size() * sizeof(float), cudaMemcpyHostToDevice));
  table_.inv = inv_.get<float>();
  table_.dims = static_cast<int>(r.dims);
  table_.traditional = r.traditional;
  table_.scale = r.scale;
  table_.scales_input = r.scales_input;
  table_.input_scale = round_bf16(r.input_scale);
  return Status::ok();
}

}  // namespace hetero::cuda
