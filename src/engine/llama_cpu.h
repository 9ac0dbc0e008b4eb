// CPU backend of the prefill engine for the llama family: chunked prefill with the engine's own
// KV cache (token-major bf16 rows per layer, grown in blocks of kv_block_tokens), OpenBLAS for
// the GEMMs, and the attention-input tap. The activations are rounded to bf16 at the points the
// model's reference implementation rounds, so the tap sees what the decoder would compute up to
// the attention input; the arithmetic inside each op is the engine's own.
// Thread-safety: one LlamaCpuEngine serves one sequence at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"
#include "engine/tap.h"
#include "model/llama.h"

namespace hetero {

class LlamaCpuEngine {
 public:
  // kOrdered reproduces the decoder's GEMM order (bit-exact attention inputs); kBlas uses
  // OpenBLAS (its own order; kept to measure what exactness costs).
  enum class Gemm { kOrdered, kBlas };
  static Result<std::unique_ptr<LlamaCpuEngine>> load(const std::string& model_dir,
                                                      Gemm gemm = Gemm::kOrdered);
  LlamaCpuEngine(LlamaWeights weights, Gemm gemm);

  const LlamaConfig& config() const { return w_.config; }
  // Forgets the sequence (keeps the allocation).
  void reset();
  // Takes the cache a sequence of `tokens` tokens needs, before its first chunk: the engine's
  // cache never grows (nor copies itself) mid-request, and a prompt the host cannot hold is
  // refused up front (kResourceExhausted with the bytes asked and what the host has left)
  // instead of failing an allocation half-way or waking the OOM killer.
  Status reserve(int64_t tokens, int64_t max_chunk_tokens);
  // The most bytes the cache may take (0: half of what the host has free, counting what it holds);
  // reserve() refuses past it.
  void set_memory_budget(int64_t bytes) { budget_ = bytes; }
  int64_t cached_tokens() const { return n_cached_; }
  // Runs the next chunk of the sequence: ids are positions [cached_tokens(), +ids.size()).
  // Ids out of vocabulary are refused before anything changes.
  Status prefill_chunk(const std::vector<int32_t>& ids, const AttentionInputTap& tap);
  // The engine's state for the prefill host's prefix cache: its cache rows, state_row_bytes()
  // per token (per layer: keys then values, token-major [n][kv_heads][head_dim] bf16).
  int64_t state_row_bytes() const;
  // Copies rows [pos0, pos0 + n) of the sequence's state (pos0 + n <= cached_tokens()).
  Status save_state(int64_t pos0, int64_t n, uint8_t* out) const;
  // After reserve(): n rows of state appended at cached_tokens() == pos0, as if their tokens had
  // been prefilled (what the next chunk attends to; last_logits() stays the last computed one's).
  Status load_state(int64_t pos0, int64_t n, const uint8_t* in);
  // Logits of the last processed token (float32 [vocab]), for tests and greedy checks.
  std::vector<float> last_logits() const;
  // The decoder's calls for this sequence's rows from `start` (its batch path or not): each row
  // is roped with its call's spec (a dynamic rope past max_position_embeddings), every other
  // row with the config's. reset() forgets them. A schedule that needs per-call ropes is refused
  // for a tail (start > 0: the rows before it came from the decoder's earlier calls).
  Status set_decoder_calls(const std::vector<int64_t>& calls, int64_t start, bool batched);
  // Whether those calls give some row a rope of its own.
  bool rows_follow_calls(const std::vector<int64_t>& calls, int64_t start, bool batched) const;

 private:
  struct LayerF32 {
    // float32 copies: [in, out] for kOrdered, [out, in] for kBlas.
    std::vector<float> wq, wk, wv, wo, w_gate, w_up, w_down;
  };
  // The dense weight w (as LayerF32 holds it) or, when q is not empty, the quantized one.
  void linear(const uint16_t* x, int64_t m, int64_t k, const std::vector<float>& w,
              const QuantizedWeight& q, int64_t n, const uint16_t* bias, uint16_t* out) const;
  void ensure_kv_capacity(int64_t tokens);

  LlamaWeights w_;
  Gemm gemm_;
  RopeByCall rope_;  // the config's rope, or the decoder's calls' (set_decoder_calls)
  std::vector<LayerF32> f32_;
  int64_t n_cached_ = 0;
  int64_t kv_capacity_ = 0;
  int64_t budget_ = 0;
  // Engine-native cache: per layer, token-major [tokens][kv_heads][head_dim] bf16.
  std::vector<std::vector<uint16_t>> k_cache_, v_cache_;
  std::vector<uint16_t> last_hidden_;  // [hidden] of the last token (after the final norm)
};

}  // namespace hetero
