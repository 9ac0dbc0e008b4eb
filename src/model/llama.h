// The llama family as Hugging Face defines it (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with
// q/k RMSNorm; tied or untied embeddings; any GQA ratio): its configuration and its weights as
// loaded from an HF checkpoint directory (config.json + safetensors, bf16/f16/f32).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"
#include "model/llama_rope.h"
#include "model/mlx_quant.h"

namespace hetero {

struct LlamaConfig {
  std::string model_type;  // "llama", "mistral", "qwen2", "qwen3"
  int64_t hidden = 0, intermediate = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0;
  int64_t vocab = 0;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  bool tie_embeddings = false;
  bool qkv_bias = false;        // Qwen2: q/k/v projections carry a bias
  bool qk_norm = false;         // Qwen3: RMSNorm over head_dim of q and k before RoPE
  LlamaRopeConfig rope_config;  // as the config gives it (rope_scaling, max_position_embeddings)
  RopeSpec rope;                // what the decoder's rope module computes with
  // > 0: the layers marked in `sliding` are mlx-lm's "sliding_attention": a query at p sees the
  // keys at (p - sliding_window, p] only. Within the window that is full attention.
  int64_t sliding_window = 0;
  std::vector<bool> sliding;  // per layer (empty: none slides)

  // The window layer l attends over (0: all of the past).
  int64_t window_of(int64_t layer) const {
    return static_cast<size_t>(layer) < sliding.size() && sliding[static_cast<size_t>(layer)]
               ? sliding_window
               : 0;
  }
};

// Parses config.json as mlx-lm reads it (defaults per model type). Unsupported features (a rope
// type mlx-lm lacks) are refused with a message rather than silently computed wrong.
Result<LlamaConfig> load_llama_config(const std::string& model_dir);

// Weights in bf16 as stored (converted from f16/f32 with round-to-nearest-even when needed):
// the engine keeps bf16 master copies and widens to float32 per GEMM panel.
struct LlamaLayerWeights {
  Tensor input_norm, post_norm;  // [hidden]
  Tensor wq, wk, wv, wo;         // [out, in]
  Tensor bq, bk, bv;             // [out] when qkv_bias
  Tensor q_norm, k_norm;         // [head_dim] when qk_norm
  Tensor w_gate, w_up, w_down;   // [inter, hidden], [inter, hidden], [hidden, inter]
  // An mlx-lm-quantized checkpoint's projections as stored (model/mlx_quant.h); each one in
  // place of its dense tensor above, which is then empty (mlx-lm may leave some modules dense).
  QuantizedWeight qwq, qwk, qwv, qwo, qw_gate, qw_up, qw_down;
};

struct LlamaWeights {
  LlamaConfig config;
  Tensor embed;  // [vocab, hidden]
  Tensor final_norm;
  Tensor lm_head;  // [vocab, hidden]; empty when tied to embed
  // "" for a dense checkpoint, else how its first quantized projection is stored ("4-bit
  // affine, group 64"). A quantized embedding and lm_head are dequantized at load (the decoder's
  // embedding lookup dequantizes its rows the same way).
  std::string quantization;
  std::vector<LlamaLayerWeights> layers;
};

Result<LlamaWeights> load_llama_weights(const std::string& model_dir);

// Any float tensor as bf16 (round-to-nearest-even from f32/f16).
Tensor as_bf16(const Tensor& t);

}  // namespace hetero
