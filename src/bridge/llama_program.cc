// llama cache program: see llama_program.h.
#include "bridge/llama_program.h"

#include <cstring>
#include <vector>

#include "kernels/cpu_ops.h"

namespace hetero {
namespace {

const uint16_t* maybe(const Tensor& t) {
  return t.numel() > 0 && !t.shape.empty() ? t.data<uint16_t>() : nullptr;
}

}  // namespace

Tensor kv_rows_head_major(const std::vector<uint16_t>& rows, int64_t n, int64_t heads, int64_t hd) {
  Tensor t(DType::kBF16, {heads, n, hd});
  auto* o = t.data<uint16_t>();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(o + (h * n + i) * hd, rows.data() + (i * heads + h) * hd, hd * 2);
  return t;
}

LlamaDecoderWeights llama_decoder_weights_of(const LlamaWeights& w, std::string fingerprint) {
  const LlamaConfig& c = w.config;
  LlamaDecoderWeights d;
  d.layout.family = "llama";
  d.layout.fingerprint = std::move(fingerprint);
  d.layout.layers = c.layers, d.layout.kv_heads = c.kv_heads, d.layout.head_dim = c.head_dim;
  d.layout.hidden = c.hidden;
  d.rms_norm_eps = c.rms_norm_eps, d.rope = c.rope;
  for (const LlamaLayerWeights& L : w.layers) {
    LlamaProgramLayer p;
    const Tensor wk = as_bf16(L.wk), wv = as_bf16(L.wv);
    p.wk_t = transposed_f32(wk.data<uint16_t>(), wk.shape[0], wk.shape[1]);
    p.wv_t = transposed_f32(wv.data<uint16_t>(), wv.shape[0], wv.shape[1]);
    p.bk = L.bk, p.bv = L.bv, p.k_norm = L.k_norm;
    d.layers.push_back(std::move(p));
  }
  return d;
}

KvRows LlamaCacheProgram::run(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x) const {
  const auto& L = w_->layers[static_cast<size_t>(layer)];
  const int64_t H = w_->layout.hidden, kvh = w_->layout.kv_heads, hd = w_->layout.head_dim;
  const int64_t kvd = kvh * hd;
  std::vector<uint16_t> k(static_cast<size_t>(n * kvd)), v(k.size());
  linear_decoder_order(x, n, H, L.wk_t.data(), kvd, maybe(L.bk), k.data());
  linear_decoder_order(x, n, H, L.wv_t.data(), kvd, maybe(L.bv), v.data());
  if (maybe(L.k_norm))
    rms_norm(k.data(), n * kvh, hd, L.k_norm.data<uint16_t>(), static_cast<float>(w_->rms_norm_eps),
             k.data());
  rope_apply(k.data(), n, kvh, hd, pos0, w_->rope);
  return KvRows{kv_rows_head_major(k, n, kvh, hd), kv_rows_head_major(v, n, kvh, hd)};
}

}  // namespace hetero
