// llama cache program: see llama_program.h.
#include "bridge/llama_program.h"

#include <cstring>
#include <vector>

#include "kernels/cpu_ops.h"

namespace hetero {
namespace {

// [n, heads, hd] token-major -> [heads, n, hd], the decoder's cache layout.
Tensor to_head_major(const std::vector<uint16_t>& rows, int64_t n, int64_t heads, int64_t hd) {
  Tensor t(DType::kBF16, {heads, n, hd});
  auto* o = t.data<uint16_t>();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(o + (h * n + i) * hd, rows.data() + (i * heads + h) * hd, hd * 2);
  return t;
}

const uint16_t* maybe(const Tensor& t) {
  return t.numel() > 0 && !t.shape.empty() ? t.data<uint16_t>() : nullptr;
}

}  // namespace

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
  rope_rotate_half(k.data(), n, kvh, hd, pos0, static_cast<float>(w_->rope_base));
  return KvRows{to_head_major(k, n, kvh, hd), to_head_major(v, n, kvh, hd)};
}

}  // namespace hetero
