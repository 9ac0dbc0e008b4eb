// The llama-family forward on CPU. See llama_cpu.h for the contract.
#include "engine/llama_cpu.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <new>

#include "common/bf16.h"
#include "common/sysmem.h"
#include "kernels/cpu_ops.h"

namespace hetero {
namespace {

constexpr int64_t kKvBlockTokens = 256;  // the engine's cache grows in blocks of this many rows

// float32 copy of a [out, in] weight, transposed to [in, out] when asked.
std::vector<float> widen(const Tensor& t, bool transpose) {
  if (t.numel() == 0 || t.shape.size() != 2) return {};  // a quantized projection's dense slot
  std::vector<float> f = to_f32(t);
  if (!transpose) return f;
  const int64_t n = t.shape[0], k = t.shape[1];
  std::vector<float> out(f.size());
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < k; ++j)
      out[static_cast<size_t>(j * n + i)] = f[static_cast<size_t>(i * k + j)];
  return out;
}
const uint16_t* bf16_or_null(const Tensor& t) {
  return t.numel() > 0 && !t.shape.empty() ? t.data<uint16_t>() : nullptr;
}

}  // namespace

Result<std::unique_ptr<LlamaCpuEngine>> LlamaCpuEngine::load(const std::string& model_dir,
                                                             Gemm gemm) {
  HETERO_ASSIGN_OR_RETURN(LlamaWeights w, load_llama_weights(model_dir));
  return std::make_unique<LlamaCpuEngine>(std::move(w), gemm);
}

LlamaCpuEngine::LlamaCpuEngine(LlamaWeights weights, Gemm gemm)
    : w_(std::move(weights)), gemm_(gemm), rope_(w_.config.rope) {
  const bool t = gemm_ == Gemm::kOrdered;
  f32_.resize(w_.layers.size());
  for (size_t i = 0; i < w_.layers.size(); ++i) {
    auto& L = w_.layers[i];
    auto& F = f32_[i];
    F.wq = widen(L.wq, t), F.wk = widen(L.wk, t), F.wv = widen(L.wv, t), F.wo = widen(L.wo, t);
    F.w_gate = widen(L.w_gate, t), F.w_up = widen(L.w_up, t), F.w_down = widen(L.w_down, t);
  }
  k_cache_.resize(w_.layers.size());
  v_cache_.resize(w_.layers.size());
}

void LlamaCpuEngine::reset() {
  n_cached_ = 0;
  rope_ = RopeByCall(w_.config.rope);
}

Status LlamaCpuEngine::set_decoder_calls(const std::vector<int64_t>& calls, int64_t start,
                                         bool batched) {
  HETERO_ASSIGN_OR_RETURN(
      rope_, RopeByCall::for_engine(w_.config.rope_config, w_.config.rope, start, calls, batched));
  return Status::ok();
}

bool LlamaCpuEngine::rows_follow_calls(const std::vector<int64_t>& calls, int64_t start,
                                       bool batched) const {
  return RopeByCall::follows_calls(w_.config.rope_config, w_.config.rope, start, calls, batched);
}

int64_t LlamaCpuEngine::state_row_bytes() const {
  return 2 * static_cast<int64_t>(k_cache_.size()) * w_.config.kv_heads * w_.config.head_dim * 2;
}

Status LlamaCpuEngine::save_state(int64_t pos0, int64_t n, uint8_t* out) const {
  if (pos0 < 0 || n < 0 || pos0 + n > n_cached_)
    return invalid_argument("save_state: rows [" + std::to_string(pos0) + ", " +
                            std::to_string(pos0 + n) + ") are not all in the cache of " +
                            std::to_string(n_cached_));
  const size_t row = static_cast<size_t>(w_.config.kv_heads * w_.config.head_dim);
  for (size_t l = 0; l < k_cache_.size(); ++l)
    for (const auto* cache : {&k_cache_[l], &v_cache_[l]}) {
      const size_t bytes = static_cast<size_t>(n) * row * 2;
      std::memcpy(out, cache->data() + static_cast<size_t>(pos0) * row, bytes);
      out += bytes;
    }
  return Status::ok();
}

Status LlamaCpuEngine::load_state(int64_t pos0, int64_t n, const uint8_t* in) {
  if (pos0 != n_cached_ || n < 0 || pos0 + n > kv_capacity_)
    return invalid_argument("load_state: rows [" + std::to_string(pos0) + ", " +
                            std::to_string(pos0 + n) + ") do not continue the cache of " +
                            std::to_string(n_cached_) + " within its reserved " +
                            std::to_string(kv_capacity_));
  const size_t row = static_cast<size_t>(w_.config.kv_heads * w_.config.head_dim);
  for (size_t l = 0; l < k_cache_.size(); ++l)
    for (auto* cache : {&k_cache_[l], &v_cache_[l]}) {
      const size_t bytes = static_cast<size_t>(n) * row * 2;
      std::memcpy(cache->data() + static_cast<size_t>(pos0) * row, in, bytes);
      in += bytes;
    }
  n_cached_ += n;
  return Status::ok();
}

void LlamaCpuEngine::linear(const uint16_t* x, int64_t m, int64_t k, const std::vector<float>& w,
                            const QuantizedWeight& q, int64_t n, const uint16_t* bias,
                            uint16_t* out) const {
  if (!q.empty()) {  // the decoder's quantized matmul, whichever GEMM was asked for
    quantized_linear(x, m, q, bias, out);
  } else if (gemm_ == Gemm::kOrdered) {
    linear_decoder_order(x, m, k, w.data(), n, bias, out);
  } else {
    linear_blas(x, m, k, w.data(), n, bias, out);
  }
}

Status LlamaCpuEngine::reserve(int64_t tokens, int64_t max_chunk_tokens) {
  (void)max_chunk_tokens;  // a chunk's activations are small beside the cache
  const int64_t blocks = (tokens + kKvBlockTokens - 1) / kKvBlockTokens;
  const int64_t row_bytes = w_.config.kv_heads * w_.config.head_dim * 2;  // bf16
  const int64_t layers = static_cast<int64_t>(k_cache_.size());
  const int64_t whole = 2 * layers * row_bytes * blocks * kKvBlockTokens;
  const int64_t held = 2 * layers * row_bytes * kv_capacity_;
  const std::string what = "the cache of " + std::to_string(tokens) + " tokens";
  HETERO_RETURN_IF_ERROR(check_host_memory(whole, held, budget_, what));
  const int64_t more = whole - held;
  if (more <= 0) return Status::ok();
  try {
    ensure_kv_capacity(tokens);
  } catch (const std::bad_alloc&) {
    return resource_exhausted("out of host memory: could not allocate " + format_bytes(more) +
                              " for " + what);
  }
  return Status::ok();
}

void LlamaCpuEngine::ensure_kv_capacity(int64_t tokens) {
  if (tokens <= kv_capacity_) return;
  const int64_t blocks = (tokens + kKvBlockTokens - 1) / kKvBlockTokens;
  kv_capacity_ = blocks * kKvBlockTokens;
  const int64_t row = w_.config.kv_heads * w_.config.head_dim;
  for (size_t l = 0; l < k_cache_.size(); ++l) {
    k_cache_[l].resize(static_cast<size_t>(kv_capacity_ * row));
    v_cache_[l].resize(static_cast<size_t>(kv_capacity_ * row));
  }
}

Status LlamaCpuEngine::prefill_chunk(const std::vector<int32_t>& ids,
                                     const AttentionInputTap& tap) {
  const LlamaConfig& c = w_.config;
  HETERO_RETURN_IF_ERROR(check_token_ids(ids, c.vocab));
  if (c.rope.dims != c.head_dim)
    return failed_precondition("the config's rope was not built (llama_rope) for head_dim " +
                               std::to_string(c.head_dim));
  if (ids.empty()) return Status::ok();
  const int64_t n = static_cast<int64_t>(ids.size()), pos0 = n_cached_, H = c.hidden;
  const int64_t hd = c.head_dim, qd = c.heads * hd, kvd = c.kv_heads * hd;
  ensure_kv_capacity(pos0 + n);

  std::vector<uint16_t> h(static_cast<size_t>(n * H)), xn(h.size()), tmp(h.size());
  std::vector<uint16_t> q(static_cast<size_t>(n * qd)), k(static_cast<size_t>(n * kvd)),
      v(k.size()), attn(q.size());
  std::vector<uint16_t> gate(static_cast<size_t>(n * c.intermediate)), up(gate.size());
  const uint16_t* emb = w_.embed.data<uint16_t>();
  for (int64_t t = 0; t < n; ++t)
    std::memcpy(&h[static_cast<size_t>(t * H)], emb + static_cast<int64_t>(ids[t]) * H, H * 2);

  for (int64_t l = 0; l < c.layers; ++l) {
    const auto& L = w_.layers[static_cast<size_t>(l)];
    const auto& F = f32_[static_cast<size_t>(l)];
    const float eps = static_cast<float>(c.rms_norm_eps);
    rms_norm(h.data(), n, H, L.input_norm.data<uint16_t>(), eps, xn.data());
    if (tap) tap(TapEvent{static_cast<int32_t>(l), pos0, n, H, xn.data()});
    linear(xn.data(), n, H, F.wq, L.qwq, qd, bf16_or_null(L.bq), q.data());
    linear(xn.data(), n, H, F.wk, L.qwk, kvd, bf16_or_null(L.bk), k.data());
    linear(xn.data(), n, H, F.wv, L.qwv, kvd, bf16_or_null(L.bv), v.data());
    if (c.qk_norm) {
      rms_norm(q.data(), n * c.heads, hd, L.q_norm.data<uint16_t>(), eps, q.data());
      rms_norm(k.data(), n * c.kv_heads, hd, L.k_norm.data<uint16_t>(), eps, k.data());
    }
    rope_.apply(q.data(), n, c.heads, hd, pos0);
    rope_.apply(k.data(), n, c.kv_heads, hd, pos0);
    std::memcpy(&k_cache_[static_cast<size_t>(l)][static_cast<size_t>(pos0 * kvd)], k.data(),
                k.size() * 2);
    std::memcpy(&v_cache_[static_cast<size_t>(l)][static_cast<size_t>(pos0 * kvd)], v.data(),
                v.size() * 2);
    attention_causal(q.data(), n, c.heads, k_cache_[static_cast<size_t>(l)].data(),
                     v_cache_[static_cast<size_t>(l)].data(), c.kv_heads, hd, pos0,
                     1.0f / std::sqrt(static_cast<float>(hd)), attn.data(), c.window_of(l));
    linear(attn.data(), n, qd, F.wo, L.qwo, H, nullptr, tmp.data());
    add_bf16(h.data(), tmp.data(), n * H, h.data());
    rms_norm(h.data(), n, H, L.post_norm.data<uint16_t>(), eps, xn.data());
    linear(xn.data(), n, H, F.w_gate, L.qw_gate, c.intermediate, nullptr, gate.data());
    linear(xn.data(), n, H, F.w_up, L.qw_up, c.intermediate, nullptr, up.data());
    silu_mul(gate.data(), up.data(), n * c.intermediate, gate.data());
    linear(gate.data(), n, c.intermediate, F.w_down, L.qw_down, H, nullptr, tmp.data());
    add_bf16(h.data(), tmp.data(), n * H, h.data());
  }
  last_hidden_.resize(static_cast<size_t>(H));
  rms_norm(h.data() + (n - 1) * H, 1, H, w_.final_norm.data<uint16_t>(),
           static_cast<float>(c.rms_norm_eps), last_hidden_.data());
  n_cached_ += n;
  return Status::ok();
}

std::vector<float> LlamaCpuEngine::last_logits() const {
  const LlamaConfig& c = w_.config;
  std::vector<float> logits(static_cast<size_t>(c.vocab));
  if (last_hidden_.empty()) return logits;
  const Tensor& head = c.tie_embeddings ? w_.embed : w_.lm_head;
  const uint16_t* wrow = head.data<uint16_t>();
  for (int64_t v = 0; v < c.vocab; ++v) {
    float acc = 0.f;
    for (int64_t d = 0; d < c.hidden; ++d)
      acc +=
          bf16_to_f32(last_hidden_[static_cast<size_t>(d)]) * bf16_to_f32(wrow[v * c.hidden + d]);
    logits[static_cast<size_t>(v)] = acc;
  }
  return logits;
}

}  // namespace hetero
