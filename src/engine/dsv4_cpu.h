// CPU backend of the prefill engine for DeepSeek-V4: chunked prefill that computes, for every
// layer, the attention input x = attn_norm(collapse(h)) the decoder (mlx-vlm 0.7.10's
// deepseek_v4 on MLX 0.32.4's CPU backend) computes, and hands it to the attention-input tap.
//
// The engine keeps its own per-layer state, shaped like the decoder's caches so that any chunk
// schedule gives what the decoder gives for the same schedule: the local window of rope'd kv rows
// (a 128-slot window that grows past 128 rows during a multi-token call and rotates during
// one-token calls, in the decoder's row order), the compressor pools with their pending rows, and
// for ratio-4 layers the indexer's pool. Like the decoder, a chunk of 2..8 tokens runs its
// attention one token at a time (the decoder's decode-equivalent path), the ratio-4 overlap
// lane is empty for the first window each call completes, and the indexer switches to HISA block
// selection once a layer holds index_block * index_keep pooled rows.
//
// Arithmetic follows the decoder's op order and bf16 rounding points (docs/design/prefill-dsv4.md
// lists where it does not). Which decoder: Dsv4QuantArith picks how the checkpoint's FP8/FP4
// projections are computed (below). Heavy parts run on OpenMP threads; results do not depend on
// the thread count. Thread-safety: one engine serves one sequence at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "common/checkpoint.h"
#include "common/status.h"
#include "engine/tap.h"
#include "model/dsv4.h"
#include "model/dsv4_calls.h"

namespace hetero {

// How the projections a checkpoint stores as FP8/FP4 are computed.
enum class Dsv4QuantArith {
  // The decoder we serve: mlx-vlm's conversion that keeps the checkpoint's own quantization
  // (FP8 -> mxfp8, FP4 -> mxfp4, ape rounded to bf16), on MLX 0.32.4's CPU backend. Each such
  // projection runs MLX's CPU quantized-matmul recipe (linear_quantized_mx: bf16 products and
  // bf16 running sums per 32-group), and the compressors' ape is rounded to bf16.
  kMlxCpu,
  // A decoder on a dense bf16 conversion: weights dequantized to bf16, float32 sums in
  // ascending k, one rounding (linear_decoder_order); ape kept as stored.
  kDequant,
};
// "mlx-cpu" or "dequant".
Result<Dsv4QuantArith> parse_dsv4_quant_arith(const std::string& name);
const char* dsv4_quant_arith_name(Dsv4QuantArith arith);

struct Dsv4EngineOptions {
  Dsv4QuantArith quant_arith = Dsv4QuantArith::kMlxCpu;
};

class Dsv4CpuEngine {
 public:
  static Result<std::unique_ptr<Dsv4CpuEngine>> load(const std::string& model_dir,
                                                     const Dsv4EngineOptions& options = {});
  explicit Dsv4CpuEngine(Dsv4Weights weights, const Dsv4EngineOptions& options = {});
  ~Dsv4CpuEngine();

  const Dsv4Config& config() const { return w_.config; }
  const Dsv4EngineOptions& options() const { return options_; }
  // Forgets the sequence.
  void reset();
  // Takes what a sequence of `tokens` tokens run in chunks of at most `max_chunk_tokens` needs
  // before its first chunk: every layer's pooled rows (and the indexer's) are allocated for
  // the whole sequence, so the state never grows (nor copies itself) mid-request; the budget
  // counts them with the window and a chunk's largest working buffers. A prompt the host
  // cannot hold is refused up front (kResourceExhausted with the bytes), which the prefill
  // host's memory floor turns into a sealed prefix. Call after reset(), before restore().
  Status reserve(int64_t tokens, int64_t max_chunk_tokens);
  // What reserve() counts for such a sequence (monotone in both).
  int64_t reserve_bytes(int64_t tokens, int64_t max_chunk_tokens) const;
  // The most bytes reserve() may count (0: half of what the host has free, counting what the
  // state holds).
  void set_memory_budget(int64_t bytes) { budget_ = bytes; }
  int64_t cached_tokens() const { return n_cached_; }
  // By default a chunk stops after the last layer's tap (nothing downstream needs more). With
  // full_forward the last layer's attention and MoE run too, so that its state and the final
  // residual stream are those of the decoder. Settable only while no token is cached.
  Status set_full_forward(bool on);
  // The decoder's call schedule for this sequence (model/dsv4_calls.h): a chunk then runs each
  // decoder call inside it as the decoder did. Unset (and after reset()), every chunk is one
  // call. Settable only before the first chunk after reset() or restore(); after restore() the
  // calls cover the positions from cached_tokens() on.
  Status set_decoder_calls(const std::vector<int64_t>& calls);
  // The whole state after the tokens so far (every layer's window, pools and indexer pool, in
  // the decoder's shapes), for the prefill host's prefix checkpoints; restore() puts one back
  // in place of the current sequence, which then goes on from its end as if it had run here.
  std::shared_ptr<const Checkpoint> checkpoint() const;
  int64_t checkpoint_bytes() const;  // what checkpoint() would hold now
  Status restore(const Checkpoint& c);
  // Runs the next chunk: ids are positions [cached_tokens(), +ids.size()). Ids outside the
  // vocabulary are refused before anything changes.
  Status prefill_chunk(const std::vector<int32_t>& ids, const AttentionInputTap& tap);

  struct LayerState;  // the decoder-shaped caches of one layer (dsv4_cpu.cc)
  struct Prepared;    // float32 copies of the weights, laid out for the GEMMs (dsv4_cpu.cc)

 private:
  void attention(int64_t layer, const uint16_t* x, int64_t n, int64_t pos0, uint16_t* out);
  void moe(int64_t layer, const uint16_t* x, int64_t n, const int32_t* ids, uint16_t* out) const;

  Dsv4Weights w_;
  Dsv4EngineOptions options_;
  std::unique_ptr<Prepared> p_;
  std::vector<LayerState> state_;
  int64_t n_cached_ = 0;
  int64_t budget_ = 0;
  int64_t resumed_at_ = 0;  // where the sequence's first chunk (since reset/restore) begins
  bool full_forward_ = false;
  Dsv4Calls calls_;
};

}  // namespace hetero
