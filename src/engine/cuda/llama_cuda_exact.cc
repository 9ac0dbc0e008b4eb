// The llama CUDA engine's exact path (LlamaCudaArith::kExact): the CPU engine's forward op for op
// with the ops' CUDA twins (kernels/cuda/ops.h), its float32 transposed weights, its contiguous
// bf16 cache, and the state it hands the prefill host's prefix cache. See llama_cuda.h.
#include <algorithm>
#include <cmath>
#include <vector>

#include "engine/cuda/llama_cuda_impl.h"
#include "kernels/cpu_ops.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/ops.h"

namespace hetero::cuda {

// The exact path's weights: each projection float32 and transposed, as gemm_ordered reads it.
Status LlamaCudaEngine::upload_exact(const LlamaWeights& w) {
  const LlamaConfig& c = config_;
  exact_ = std::make_unique<Exact>();
  auto put_t = [&](const Tensor& t, const float** out) -> Status {
    const Tensor b = as_bf16(t);
    const std::vector<float> f = transposed_f32(b.data<uint16_t>(), t.shape[0], t.shape[1]);
    DeviceBuffer& d = exact_->owned.emplace_back();
    HETERO_RETURN_IF_ERROR(d.allocate(f.size() * 4, "the weights", &budget_));
    HETERO_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(d.get(), f.data(), f.size() * 4, cudaMemcpyHostToDevice));
    weight_bytes_ += f.size() * 4;
    *out = d.get<const float>();
    return Status::ok();
  };
  exact_->layers.resize(static_cast<size_t>(c.layers));
  for (int64_t l = 0; l < c.layers; ++l) {
    const LlamaLayerWeights& L = w.layers[static_cast<size_t>(l)];
    Exact::Layer& E = exact_->layers[static_cast<size_t>(l)];
    HETERO_RETURN_IF_ERROR(put_t(L.wq, &E.wq));
    HETERO_RETURN_IF_ERROR(put_t(L.wk, &E.wk));
    HETERO_RETURN_IF_ERROR(put_t(L.wv, &E.wv));
    HETERO_RETURN_IF_ERROR(put_t(L.wo, &E.wo));
    HETERO_RETURN_IF_ERROR(put_t(L.w_gate, &E.gate));
    HETERO_RETURN_IF_ERROR(put_t(L.w_up, &E.up));
    HETERO_RETURN_IF_ERROR(put_t(L.w_down, &E.down));
  }
  return Status::ok();
}

int64_t LlamaCudaEngine::state_row_bytes() const {
  return exact_ ? 2 * config_.layers * config_.kv_heads * config_.head_dim * 2 : 0;
}

Status LlamaCudaEngine::save_state(int64_t pos0, int64_t n, uint8_t* out) {
  if (!exact_) return failed_precondition("the fast path does not hand out its cache");
  if (pos0 < 0 || n < 0 || pos0 + n > n_cached_)
    return invalid_argument("save_state: rows [" + std::to_string(pos0) + ", " +
                            std::to_string(pos0 + n) + ") are not all in the cache of " +
                            std::to_string(n_cached_));
  DeviceGuard on_engine(options_.device);
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_.get()));
  const size_t row = static_cast<size_t>(config_.kv_heads * config_.head_dim) * 2;
  for (const DeviceBuffer& kv : exact_->kv) {  // [layer][k, v]
    HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpy(out, kv.get<uint8_t>() + static_cast<size_t>(pos0) * row,
                                           static_cast<size_t>(n) * row, cudaMemcpyDeviceToHost));
    out += static_cast<size_t>(n) * row;
  }
  return Status::ok();
}

Status LlamaCudaEngine::load_state(int64_t pos0, int64_t n, const uint8_t* in) {
  if (!exact_) return failed_precondition("the fast path does not take a cache");
  if (pos0 != n_cached_ || n < 0 || pos0 + n > exact_->capacity)
    return invalid_argument("load_state: rows [" + std::to_string(pos0) + ", " +
                            std::to_string(pos0 + n) + ") do not continue the cache of " +
                            std::to_string(n_cached_) + " within its reserved " +
                            std::to_string(exact_->capacity));
  DeviceGuard on_engine(options_.device);
  const size_t row = static_cast<size_t>(config_.kv_heads * config_.head_dim) * 2;
  for (DeviceBuffer& kv : exact_->kv) {
    HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(kv.get<uint8_t>() + static_cast<size_t>(pos0) * row,
                                                in, static_cast<size_t>(n) * row,
                                                cudaMemcpyHostToDevice, stream_.get()));
    in += static_cast<size_t>(n) * row;
  }
  // The host rows are the caller's: they must be read before it reuses them.
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_.get()));
  n_cached_ += n;
  return Status::ok();
}

// The exact path's buffers for chunks of n rows, a cache of `tokens` rows and scores of
// scratch_bytes. Each is replaced only when it grows; the cache keeps its rows.
Status LlamaCudaEngine::ensure_exact(int64_t n, int64_t tokens, size_t scratch_bytes) {
  const LlamaConfig& c = config_;
  Exact& X = *exact_;
  const int64_t H = c.hidden, qd = c.heads * c.head_dim, kvd = c.kv_heads * c.head_dim;
  const int64_t I = c.intermediate, widest = std::max({H, qd, I});
  // The work still queued may read the buffers replaced below.
  if (n > X.rows || scratch_bytes > X.scratch.bytes() || tokens > X.capacity)
    HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_.get()));
  if (n > X.rows) {
    const size_t N = static_cast<size_t>(n);
    X.rows = 0;  // until every buffer holds n rows
    for (auto [b, bytes] : {std::pair{&X.xf, N * static_cast<size_t>(widest) * 4},
                            std::pair{&X.acc, N * static_cast<size_t>(widest) * 4},
                            std::pair{&X.k, N * static_cast<size_t>(kvd) * 2},
                            std::pair{&X.v, N * static_cast<size_t>(kvd) * 2},
                            std::pair{&X.gate, N * static_cast<size_t>(I) * 2},
                            std::pair{&X.up, N * static_cast<size_t>(I) * 2}})
      HETERO_RETURN_IF_ERROR(b->allocate(bytes, "the exact path's activations", &budget_));
    X.rows = n;
  }
  if (scratch_bytes > X.scratch.bytes())
    HETERO_RETURN_IF_ERROR(X.scratch.allocate(scratch_bytes, "attention scores", &budget_));
  if (tokens > X.capacity) {
    const int64_t exact_cap = (tokens + 255) / 256 * 256;
    // Doubling where it fits, else what is needed; the rows so far move to the new buffers.
    for (int64_t cap : {std::max(2 * X.capacity, exact_cap), exact_cap}) {
      std::vector<DeviceBuffer> grown(static_cast<size_t>(2 * c.layers));
      Status st;
      for (DeviceBuffer& b : grown) {
        st = b.allocate(static_cast<size_t>(cap * kvd) * 2, "the exact path's cache", &budget_);
        if (!st.is_ok()) break;
      }
      if (st.code() == Code::kResourceExhausted && cap != exact_cap) continue;
      HETERO_RETURN_IF_ERROR(st);
      for (size_t i = 0; i < X.kv.size(); ++i)
        HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpy(grown[i].get(), X.kv[i].get(),
                                               static_cast<size_t>(n_cached_ * kvd) * 2,
                                               cudaMemcpyDeviceToDevice));
      X.kv = std::move(grown);
      X.capacity = cap;
      break;
    }
  }
  return Status::ok();
}

// The CPU engine's forward (engine/llama_cpu.cc), op for op, with the ops' CUDA twins.
Status LlamaCudaEngine::prefill_exact(const std::vector<int32_t>& ids,
                                      const AttentionInputTap& tap) {
  const LlamaConfig& c = config_;
  Exact& X = *exact_;
  const int64_t n = static_cast<int64_t>(ids.size()), pos0 = n_cached_, H = c.hidden;
  const int64_t hd = c.head_dim, qd = c.heads * hd, kvd = c.kv_heads * hd, I = c.intermediate;
  HETERO_RETURN_IF_ERROR(
      ensure_exact(n, pos0 + n, static_cast<size_t>(c.heads * n * (pos0 + n)) * 4));
  cudaStream_t st = stream_.get();
  auto* h = h_.get<uint16_t>();
  auto* xn = xn_.get<uint16_t>();
  auto* q = q_.get<uint16_t>();
  auto* attn = attn_.get<uint16_t>();
  auto* tmp = tmp_.get<uint16_t>();
  auto* k = X.k.get<uint16_t>();
  auto* v = X.v.get<uint16_t>();
  auto* gate = X.gate.get<uint16_t>();
  auto* up = X.up.get<uint16_t>();
  auto* xf = X.xf.get<float>();
  auto* acc = X.acc.get<float>();
  // out [n, out_dim] = bf16(x [n, in_dim] @ wt (+ bias)), as linear_decoder_order.
  auto linear = [&](const uint16_t* x, int64_t in_dim, const float* wt, int64_t out_dim,
                    const uint16_t* bias, uint16_t* out) -> Status {
    bf16_to_f32(x, n * in_dim, xf, st);
    HETERO_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(acc, 0, static_cast<size_t>(n * out_dim) * 4, st));
    gemm_ordered(xf, n, in_dim, wt, out_dim, acc, st);
    round_linear_output(acc, n, out_dim, bias, out, st);
    return Status::ok();
  };
  HETERO_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(ids_.get(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice, st));
  embed_rows(embed_, ids_.get<const int32_t>(), n, H, h, st);
  const float eps = static_cast<float>(c.rms_norm_eps);
  for (int64_t l = 0; l < c.layers; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    const Exact::Layer& E = X.layers[static_cast<size_t>(l)];
    auto* kc = X.kv[static_cast<size_t>(2 * l)].get<uint16_t>();
    auto* vc = X.kv[static_cast<size_t>(2 * l + 1)].get<uint16_t>();
    HETERO_RETURN_IF_ERROR(tap_readers_.before_write(st));  // none, unless a call failed midway
    hetero::cuda::rms_norm(h, n, H, L.in_norm, eps, xn, st);
    HETERO_RETURN_IF_ERROR(deliver_tap(tap, l, pos0, n, xn));
    HETERO_RETURN_IF_ERROR(linear(xn, H, E.wq, qd, L.extra.bq, q));
    HETERO_RETURN_IF_ERROR(linear(xn, H, E.wk, kvd, L.extra.bk, k));
    HETERO_RETURN_IF_ERROR(linear(xn, H, E.wv, kvd, L.extra.bv, v));
    if (L.extra.q_norm) {
      hetero::cuda::rms_norm(q, n * c.heads, hd, L.extra.q_norm, eps, q, st);
      hetero::cuda::rms_norm(k, n * c.kv_heads, hd, L.extra.k_norm, eps, k, st);
    }
    call_rope_.apply(q, n, c.heads, hd, pos0, st);
    call_rope_.apply(k, n, c.kv_heads, hd, pos0, st);
    HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        kc + pos0 * kvd, k, static_cast<size_t>(n * kvd) * 2, cudaMemcpyDeviceToDevice, st));
    HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        vc + pos0 * kvd, v, static_cast<size_t>(n * kvd) * 2, cudaMemcpyDeviceToDevice, st));
    attention_causal(q, n, c.heads, kc, vc, c.kv_heads, hd, pos0,
                     1.0f / std::sqrt(static_cast<float>(hd)), X.scratch.get<float>(), attn, st,
                     c.window_of(l));
    HETERO_RETURN_IF_ERROR(linear(attn, qd, E.wo, H, nullptr, tmp));
    add_bf16(h, tmp, n * H, h, st);
    HETERO_RETURN_IF_ERROR(tap_readers_.before_write(st));  // xn, read by the tap's copies
    hetero::cuda::rms_norm(h, n, H, L.post_norm, eps, xn, st);
    HETERO_RETURN_IF_ERROR(linear(xn, H, E.gate, I, nullptr, gate));
    HETERO_RETURN_IF_ERROR(linear(xn, H, E.up, I, nullptr, up));
    hetero::cuda::silu_mul(gate, up, n * I, gate, st);
    HETERO_RETURN_IF_ERROR(linear(gate, I, E.down, H, nullptr, tmp));
    add_bf16(h, tmp, n * H, h, st);
  }
  hetero::cuda::rms_norm(h, n, H, final_norm_, eps, xn, st);
  HETERO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  n_cached_ += n;
  last_rows_ = n;
  return Status::ok();
}

}  // namespace hetero::cuda
