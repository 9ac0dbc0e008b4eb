// The decoder-weights export as the prefill host reads it: `decoder.json` (layout, rope, eps,
// fingerprint) and `weights.safetensors` with exactly the weights the cache program needs, as
// the decoder holds them (dense, or a quantized module's element values and scales). Written by
// `python -m hetero_mlx export`.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/safetensors.h"
#include "common/status.h"
#include "common/tensor.h"
#include "kernels/cpu_ops.h"
#include "model/llama_rope.h"

namespace hetero {

// What the decoder's cache looks like, per layer: the small descriptor the bridge and the
// decode side agree on (ARCHITECTURE.md, "the seam ... plus a small descriptor").
struct DecoderCacheLayout {
  std::string family;  // "llama" or "deepseek_v4"
  std::string fingerprint;
  int64_t layers = 0, kv_heads = 0, head_dim = 0, hidden = 0;
  // deepseek_v4 only: per-layer compress ratio (0, 4, 128), the indexer's head dim, the window.
  std::vector<int64_t> ratios;
  int64_t index_head_dim = 0, window = 0;
  // How the decoder's modules are quantized, as the seam reads them from the loaded model
  // (python/hetero_mlx/llama.py `quantization`): null when none is, else the most common
  // {mode, bits, group_size}, the count of quantized `modules` and per-module `overrides`.
  // Part of the fingerprint.
  nlohmann::json quantization;
};

// The layout from the seam's /hetero/info (or an export's decoder.json): the fields above.
Result<DecoderCacheLayout> layout_from_json(const nlohmann::json& j);

// A quantization (as in DecoderCacheLayout) for people: "unquantized", "4-bit affine, group 64",
// or with overrides "8-bit mxfp8, group 32 (50 modules); 4-bit mxfp4, group 32 (18 modules);
// 16 quantizable modules dense".
std::string describe_quantization(const nlohmann::json& q);

// A projection as the decoder holds it: dense bf16, or quantized (MLX mx or affine modes),
// applied with the decoder's own arithmetic for that kind.
struct DecoderLinear {
  enum class Mode { kDense, kMx, kAffine };
  Mode mode = Mode::kDense;
  int64_t n = 0, k = 0, group = 0;
  std::vector<float> wt;                 // dense: f32 [k, n] (transposed)
  std::vector<float> q, scales, biases;  // quantized: [n, k] element values, [n, k/group]
  // out[m, n] = x @ W^T, + bias (bf16 [n], or null) as the decoder adds one: inside the float32
  // sum for a dense Linear (addmm), a separate bf16 add after a QuantizedLinear's matmul.
  void apply(const uint16_t* x, int64_t m, uint16_t* out, const uint16_t* bias = nullptr) const;
  // "dense", "4-bit affine, group 64"-style, for messages.
  std::string describe() const;
};

// `p.weight` (dense bf16 [n, k]) or `p.qvalues` [n, k] + `p.scales` (+ `p.biases` for affine), as
// python/hetero_mlx/quantized.py `linear_weights` exports a module; moved out of `all`.
Status load_decoder_linear(TensorMap& all, const std::string& p, int64_t n, int64_t k,
                           DecoderLinear* l);

struct LlamaProgramLayer {
  DecoderLinear wk, wv;  // [kv_heads*head_dim, hidden]
  Tensor bk, bv;         // bf16 [kv_heads*head_dim] or empty
  Tensor k_norm;         // bf16 [head_dim] or empty
};

struct LlamaDecoderWeights {
  DecoderCacheLayout layout;
  double rms_norm_eps = 1e-5;
  RopeSpec rope;  // the decoder's rope, checked against the frequencies its export carries
  LlamaRopeConfig rope_config;  // what it was built from (check_rope_reach, per request)
  int64_t sliding_window = 0;   // LlamaConfig::sliding_window, as the decoder has it
  std::vector<LlamaProgramLayer> layers;
};

// Sliding-window layers past their window. Their rows are the decoder's whatever its calls
// while every call that makes them has more than one token: such a call sums its window in
// temporal order. A one-token call at or past the window (a tail of two, or the single path's
// remainder) sums it in the rotated order of mlx-lm's RotatingKVCache, newest row first, which
// no engine reproduces: a request for rows [start, end) whose decoder calls (lengths from
// `start`) include one, or that names none past the window, is refused, and the decoder answers
// it natively. So is a warm tail from past the window: the
// decoder's rows before it include its answers', made by such calls, which the engine's own
// rows there would not equal. Rows before the window are the same however they were made.
Status check_sliding_calls(const LlamaDecoderWeights& w, int64_t start, int64_t end,
                           const std::vector<int64_t>& calls);

Result<LlamaDecoderWeights> load_llama_decoder_weights(const std::string& dir);

// The decoder's own call schedule for prefilling n tokens, as its /hetero/info describes it
// ("prefill": {"step", "checkpoint_interval", "last_alone"}, and where it keeps only its latest
// interval checkpoints, "checkpoint_entries", "block_size", "min_tokens"); empty when it says
// nothing (the prefill host's default). start > 0: the calls over [start, n) that follow a
// cached prefix of `start` tokens (steps count from start; the interval cuts stay absolute).
std::vector<int64_t> decoder_calls_from_info(const nlohmann::json& info, int64_t n,
                                             int64_t start = 0);

// Moves the tensor `name` out of `all` into *out after checking its shape (and, with
// want_bf16, that it is bf16 like the decoder's own weights); a clear error otherwise.
Status take_weight(TensorMap& all, const std::string& name, const std::vector<int64_t>& shape,
                   bool want_bf16, Tensor* out);

// An export's decoder.json, checked for its format and for the family the caller reads.
Result<std::string> read_export_json(const std::string& dir, const std::string& family);

// The "family" of an export's decoder.json, or "" when it cannot be read.
std::string decoder_family(const std::string& dir);

}  // namespace hetero
