#include "bridge/cuda/decoder_linear_gpu.h"

#include <vector>

#include "kernels/cuda/dsv4_ops.h"

namespace hetero::cuda {

Status upload_weights(const void* host, size_t bytes, DeviceBuffer* out, size_t* total) {
  if (bytes == 0) return Status::ok();
  HETERO_RETURN_IF_ERROR(out->allocate(bytes, "the decoder's weights"));
  HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpy(out->get(), host, bytes, cudaMemcpyHostToDevice));
  *total += bytes;
  return Status::ok();
}

namespace {

Status upload_floats(const std::vector<float>& host, DeviceBuffer* out, size_t* total) {
  return upload_weights(host.data(), host.size() * sizeof(float), out, total);
}

}  // namespace

Status upload_decoder_linear(const DecoderLinear& l, GpuDecoderLinear* g, size_t* total) {
  g->mode = l.mode;
  g->n = l.n;
  g->k = l.k;
  g->group = l.group;
  const auto nk = static_cast<size_t>(l.n * l.k);
  if (l.mode == DecoderLinear::Mode::kDense) {
    HETERO_CHECK(l.wt.size() == nk);
    g->range = weight_range(l.wt.data(), static_cast<int64_t>(nk));
    return upload_floats(l.wt, &g->wt, total);
  }
  HETERO_CHECK(l.group > 0 && l.q.size() == nk &&
               l.scales.size() == static_cast<size_t>(l.n * (l.k / l.group)));
  HETERO_RETURN_IF_ERROR(upload_floats(l.q, &g->q, total));
  HETERO_RETURN_IF_ERROR(upload_floats(l.scales, &g->scales, total));
  if (l.mode == DecoderLinear::Mode::kAffine) {
    HETERO_CHECK(l.biases.size() == l.scales.size());
    HETERO_RETURN_IF_ERROR(upload_floats(l.biases, &g->biases, total));
  }
  return Status::ok();
}

Status apply_decoder_linear(const GpuDecoderLinear& l, const uint16_t* x, const float* xf,
                            int64_t m, float* acc, int* flags, const uint16_t* bias, uint16_t* out,
                            cudaStream_t stream) {
  switch (l.mode) {
    case DecoderLinear::Mode::kDense:
      // The CPU's linear_decoder_order: a zeroed f32 accumulator, ascending-k sums, one rounding
      // (as FMAs where every product is exact: the same bits).
      exact_products_flag(x, m * l.k, l.range, flags, flags + 3, stream);
      HETERO_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(acc, 0, static_cast<size_t>(m * l.n) * 4, stream));
      gemm_ordered(xf, m, l.k, l.wt.get<float>(), l.n, acc, stream, flags + 3);
      round_linear_output(acc, m, l.n, bias, out, stream);
      return Status::ok();
    case DecoderLinear::Mode::kMx:
      linear_quantized_mx(x, m, l.k, l.q.get<float>(), l.scales.get<float>(), l.n, l.group, out,
                          stream);
      break;
    case DecoderLinear::Mode::kAffine:
      linear_quantized_affine(x, m, l.k, l.q.get<float>(), l.scales.get<float>(),
                              l.biases.get<float>(), l.n, l.group, out, stream);
      break;
  }
  if (bias) add_bias_bf16(out, m, l.n, bias, stream);
  return Status::ok();
}

}  // namespace hetero::cuda
