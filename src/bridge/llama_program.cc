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

// The model's projection as the decoder holds it: dense, or quantized as stored.
DecoderLinear decoder_linear(const Tensor& dense, const QuantizedWeight& q) {
  DecoderLinear l;
  if (!q.empty()) {
    l.mode = q.mx() ? DecoderLinear::Mode::kMx : DecoderLinear::Mode::kAffine;
    l.n = q.n, l.k = q.k, l.group = q.group;
    l.q = q.q, l.scales = q.scales, l.biases = q.biases;
    return l;
  }
  const Tensor w = as_bf16(dense);
  l.n = w.shape[0], l.k = w.shape[1];
  l.wt = transposed_f32(w.data<uint16_t>(), l.n, l.k);
  return l;
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
    p.wk = decoder_linear(L.wk, L.qwk);
    p.wv = decoder_linear(L.wv, L.qwv);
    p.bk = L.bk, p.bv = L.bv, p.k_norm = L.k_norm;
    d.layers.push_back(std::move(p));
  }
  return d;
}

KvRows LlamaCacheProgram::run(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x,
                              const RopeByCall* rope) const {
  const auto& L = w_->layers[static_cast<size_t>(layer)];
  const int64_t kvh = w_->layout.kv_heads, hd = w_->layout.head_dim;
  const int64_t kvd = kvh * hd;
  std::vector<uint16_t> k(static_cast<size_t>(n * kvd)), v(k.size());
  L.wk.apply(x, n, k.data(), maybe(L.bk));
  L.wv.apply(x, n, v.data(), maybe(L.bv));
  if (maybe(L.k_norm))
    rms_norm(k.data(), n * kvh, hd, L.k_norm.data<uint16_t>(), static_cast<float>(w_->rms_norm_eps),
             k.data());
  if (rope)
    rope->apply(k.data(), n, kvh, hd, pos0);
  else
    rope_apply(k.data(), n, kvh, hd, pos0, w_->rope);
  return KvRows{kv_rows_head_major(k, n, kvh, hd), kv_rows_head_major(v, n, kvh, hd)};
}

}  // namespace hetero
