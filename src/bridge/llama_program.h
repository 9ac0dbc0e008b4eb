// The decoder-cache program for the llama family: from one layer's attention input x (bf16
// [n, hidden], positions [pos0, pos0+n)) and the decoder's exported weights, the K and V rows
// the decoder would store, in its layout [kv_heads, n, head_dim] bf16: k_proj (+bias)
// (+k_norm), RoPE at the row's position; v_proj (+bias). Arithmetic in decoder order, so given
// the decoder's own x the rows are bit-identical to its cache.
// Thread-safety: const after construction; run() may be called from any thread.
#pragma once

#include <cstdint>

#include "bridge/decoder_weights.h"
#include "common/tensor.h"

namespace hetero {

struct KvRows {
  Tensor keys, values;  // bf16 [kv_heads, n, head_dim]
};

class LlamaCacheProgram {
 public:
  explicit LlamaCacheProgram(const LlamaDecoderWeights* weights) : w_(weights) {}
  const DecoderCacheLayout& layout() const { return w_->layout; }
  KvRows run(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x) const;

 private:
  const LlamaDecoderWeights* w_;
};

}  // namespace hetero
