// The decoder-cache program for the llama family: from one layer's attention input x (bf16
// [n, hidden], positions [pos0, pos0+n)) and the decoder's exported weights, the K and V rows
// the decoder would store, in its layout [kv_heads, n, head_dim] bf16: k_proj (+bias)
// (+k_norm), RoPE at the row's position; v_proj (+bias). Arithmetic in decoder order, so given
// the decoder's own x the rows are bit-identical to its cache.
// Thread-safety: const after construction; run() may be called from any thread.
#pragma once

#include <cstdint>
#include <vector>

#include "bridge/decoder_weights.h"
#include "common/tensor.h"
#include "model/llama.h"

namespace hetero {

struct KvRows {
  Tensor keys, values;  // bf16 [kv_heads, n, head_dim]
};

// [n, heads, head_dim] token-major rows -> bf16 [heads, n, head_dim], the decoder's layout.
Tensor kv_rows_head_major(const std::vector<uint16_t>& rows, int64_t n, int64_t heads,
                          int64_t head_dim);

// What the decoder's export holds for a model with these weights (its K/V projections, norms and
// rope), for benchmarks and tests that have the model in memory rather than an export on disk.
LlamaDecoderWeights llama_decoder_weights_of(const LlamaWeights& w, std::string fingerprint);

class LlamaCacheProgram {
 public:
  explicit LlamaCacheProgram(const LlamaDecoderWeights* weights) : w_(weights) {}
  const DecoderCacheLayout& layout() const { return w_->layout; }
  // rope: each row's rope by the decoder's calls (a dynamic rope past its reach); null: the
  // export's one rope for every row.
  KvRows run(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x,
             const RopeByCall* rope = nullptr) const;

 private:
  const LlamaDecoderWeights* w_;
};

}  // namespace hetero
