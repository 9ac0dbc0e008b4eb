// The decoder-cache program for DeepSeek-V4 (decoder: mlx-vlm 0.7.10's deepseek_v4 on MLX's CPU
// backend). From each layer's attention input x and the decoder's exported weights it computes
// what the decoder's own cache holds after prefilling the same tokens:
//   - the window: the last rows of kv = rope(kv_norm(wkv x)) at the layer's rope, in the slot
//     order the decoder's RotatingKVCache leaves for its call sequence;
//   - per compressor (ratio 4 or 128, and the ratio-4 indexer's): pooled rows
//     rope_r(norm(pool(wkv x, wgate x, ape))) at window starts, and the raw rows of the
//     incomplete window (the buffers).
// The ratio-4 overlap lane depends on the decoder's call boundaries (a window pools with its
// predecessor only when both complete in one multi-token call; calls of 2..8 tokens run token
// by token in the decoder), so the program takes the decoder's call schedule, not the prefill's
// chunking, which may differ freely. Arithmetic in decoder order: given the decoder's own x the
// arrays are bit-identical to its cache. Spec: docs/design/cache-program-dsv4.md.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bridge/decoder_weights.h"
#include "common/checkpoint.h"
#include "common/status.h"
#include "common/tensor.h"
#include "kernels/dsv4_ops.h"
#include "model/dsv4_calls.h"

namespace hetero {

struct Dsv4ProgramCompressor {
  int64_t ratio = 0, head_dim = 0, out_dim = 0;  // out_dim = 2*head_dim at ratio 4 (overlap)
  DecoderLinear wkv, wgate;                      // [out_dim, hidden]
  std::vector<float> ape;                        // [ratio, out_dim], values as the decoder holds
  Tensor norm;                                   // bf16 [head_dim]
};

struct Dsv4ProgramLayer {
  int64_t ratio = 0;            // 0, 4 or 128
  DecoderLinear wkv;            // [head_dim, hidden]
  Tensor kv_norm;               // bf16 [head_dim]
  Dsv4ProgramCompressor pool;   // ratio > 0
  Dsv4ProgramCompressor index;  // ratio 4 only (the indexer's compressor)
  bool has_index = false;
};

struct Dsv4DecoderWeights {
  DecoderCacheLayout layout;  // family "deepseek_v4"; kv_heads 1
  double rms_norm_eps = 1e-6;
  int64_t window = 128, rope_dims = 64, index_head_dim = 0;
  std::string decoder_rope_json;  // the decoder's rope parameters as exported (for messages)
  double rope_theta = 0, compress_rope_theta = 0;
  YarnScaling yarn;
  std::vector<float> freqs_local;       // ratio-0 layers: rope_theta, no YaRN
  std::vector<float> freqs_compressed;  // compressed layers and compressors: theta' + YaRN
  std::vector<Dsv4ProgramLayer> layers;
};

// Reads the export of `python -m hetero_mlx export` for a deepseek_v4 decoder. The rope
// frequencies are recomputed here from the exported parameters and must equal the decoder's own
// exported `_freqs` bit for bit, or the export is refused.
Result<Dsv4DecoderWeights> load_dsv4_decoder_weights(const std::string& dir);

// Calls of 2..tokenwise_max tokens run one token at a time in the decoder: the effective calls.
std::vector<int64_t> dsv4_effective_calls(const std::vector<int64_t>& calls,
                                          int64_t tokenwise_max = kDsv4DecodeBlock);
// A generate-style call schedule for a prompt of n tokens (mlx-lm's generate_step, and mlx-vlm
// for a cold prompt): chunks of `step` for all but the last token, then the last token alone.
// What a mount needs is the server's schedule for the prefix it checkpoints, which the seam
// reports (decoder_calls_from_info); this one serves tests and benchmarks.
std::vector<int64_t> dsv4_server_calls(int64_t n, int64_t step);

// Where the RotatingKVCache's rows end up after `calls` (effective calls): position per slot.
struct Dsv4WindowLayout {
  std::vector<int64_t> slot_pos;  // S slots
  int64_t idx = 0;                // the cache's _idx
  int64_t offset = 0;
};
// from: the window as the decoder holds it before the calls (its state arrays: a cache mounted
// or checkpointed there); null: a fresh cache.
Dsv4WindowLayout dsv4_window_layout(const std::vector<int64_t>& calls, int64_t max_size,
                                    const Dsv4WindowLayout* from = nullptr);
// has_prev[j] for each complete window j of `ratio` rows under `calls` (effective calls).
std::vector<uint8_t> dsv4_overlap_flags(const std::vector<int64_t>& calls, int64_t ratio);

// Everything the decoder's call schedule decides, derived once per request: the tokens it
// covers, where the ring's rows end up, the first position any slot holds, and the ratio-4 and
// ratio-128 overlap flags. Shared by the CPU and GPU programs.
struct Dsv4Schedule {
  int64_t tokens = 0;
  Dsv4WindowLayout window;
  int64_t window_first = 0;
  std::vector<uint8_t> flags4, flags128;
};
// A tail's schedule (start > 0): decoder_calls run over [start, T) on the decoder's cache of the
// first `start` tokens, whose window is `at_start`; the overlap flags hold for the windows the
// tail completes (a window the tail's first call starts inside, or at, pools without its
// predecessor, as in the decoder).
Dsv4Schedule dsv4_schedule(const std::vector<int64_t>& decoder_calls, int64_t window,
                           int64_t start = 0, const Dsv4WindowLayout* at_start = nullptr);
// A tail's schedule until its program resumes (the window's slots depend on the prefix's): only
// the tokens, start plus the calls'.
Dsv4Schedule dsv4_pending_tail(int64_t start, const std::vector<int64_t>& decoder_calls);

// What every DeepSeek-V4 program (CPU and GPU) refuses: a layer outside [0, layers); rows
// [pos0, pos0+n) that do not follow the `fed` rows already taken or run past T; finishing a layer
// before all T rows arrived.
Status check_dsv4_layer(int64_t layer, int64_t layers);
Status check_dsv4_rows(int64_t layer, int64_t fed, int64_t pos0, int64_t n, int64_t tokens);
Status check_dsv4_complete(int64_t layer, int64_t fed, int64_t tokens);

// One layer's finished cache, as arrays in the decoder's layout (B = 1 dropped where noted).
struct Dsv4PoolArrays {
  Tensor buf_kv, buf_gate;  // bf16 [1, rem, out_dim]
  Tensor pooled;            // bf16 [1, P, head_dim]
};
struct Dsv4LayerArrays {
  Tensor window;  // bf16 [1, 1, S, head_dim] in slot order
  int64_t ratio = 0;
  Dsv4PoolArrays pool, index;
};

// Pooled rows completed by one feed, for streaming: rows [first, first + count) of the layer's
// pools ([count, head_dim] bf16 each; index empty where the layer has no indexer).
struct Dsv4NewRows {
  int64_t first = 0, count = 0;
  std::vector<uint16_t> pool, index;
};

// What a DeepSeek-V4 cache program keeps of a prefix for a later tail, once every layer has all
// n rows: the window's rows from the first position a slot of the prefix holds, its layout, and
// per compressor the raw rows of the last complete and the incomplete window (a tail's pooled
// rows need no earlier ones: the decoder's cache holds them). The CPU and GPU programs make and
// take the same kind, for the same decoder weights.
struct Dsv4ProgramCheckpoint : Checkpoint {
  struct Raw {
    std::vector<uint16_t> kv, gate;  // rows [base, n), out_dim wide
    int64_t base = 0;
  };
  struct Layer {
    std::vector<uint16_t> window_rows;  // positions [window_first, n), head_dim wide
    Raw pool, index;
  };
  const Dsv4DecoderWeights* weights = nullptr;
  Dsv4WindowLayout window;
  int64_t window_first = 0, n = 0, held = 0;
  std::vector<Layer> layers;
  int64_t tokens() const override { return n; }
  int64_t bytes() const override { return held; }
  void count(const Layer& L) {
    held += static_cast<int64_t>(L.window_rows.size() + L.pool.kv.size() + L.pool.gate.size() +
                                 L.index.kv.size() + L.index.gate.size()) *
            2;
  }
};

class Dsv4CacheProgram {
 public:
  // decoder_calls: the decoder's call lengths for the prefix (sum = T), before expansion.
  // A tail (start > 0): the calls cover [start, T), and the program resumes (below) from its own
  // checkpoint at start before any row arrives.
  Dsv4CacheProgram(const Dsv4DecoderWeights* weights, const std::vector<int64_t>& decoder_calls,
                   int64_t start = 0);
  const DecoderCacheLayout& layout() const { return w_->layout; }
  int64_t tokens() const { return sched_.tokens; }
  int64_t window_idx() const { return sched_.window.idx; }

  // What a later tail needs of this prefix, once every layer has all T rows: the window's rows
  // and slots, and the compressors' raw rows of the last complete and the incomplete window (a
  // tail's pooled rows need no earlier ones: the decoder's cache holds them).
  Result<std::shared_ptr<const Checkpoint>> checkpoint() const;
  // A tail program's state at start, from checkpoint() of a program over exactly those tokens
  // (of these weights). Rows then arrive from start; the pooled rows it makes are those of the
  // windows completed from start on (finish_layer's `pooled` too).
  Status resume(const Checkpoint& c);

  // Layer `layer`'s attention input rows [pos0, pos0+n), bf16 [n, hidden]; each layer's rows
  // must arrive in order. Different layers may be fed from different threads.
  Status feed(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x, Dsv4NewRows* out);
  // After all T rows of the layer arrived: its window and buffers (and every pooled row).
  Result<Dsv4LayerArrays> finish_layer(int64_t layer);
  // The layer's state at the end b < T of the rows fed so far, for a stream that breaks there
  // (partial salvage): the window's last min(b, window) rows in temporal order, whose slot index
  // is their count, and the compressors' pending rows (no pooled rows). The decoder goes on from
  // that window exactly as from the one its own calls leave (docs/design/cache-program-dsv4.md,
  // "State at a boundary"); a call from b needs no overlap rows before b.
  Result<Dsv4LayerArrays> boundary_layer(int64_t layer) const;

 private:
  struct PoolState {
    std::vector<uint16_t> raw_kv, raw_gate;  // rows [raw_base, fed) (out_dim wide)
    int64_t raw_base = 0;
    std::vector<uint16_t> pooled;  // every pooled row so far
    int64_t pooled_rows = 0;
  };
  struct LayerState {
    int64_t fed = 0;
    std::vector<uint16_t> window_rows;  // head_dim wide, one per needed position
    std::vector<uint16_t> recent;       // the last min(fed, window) rows, temporal
    PoolState pool, index;
  };
  // The pending rows [fed - fed % ratio, fed) of a compressor, as buffers.
  Dsv4PoolArrays pending_rows(const Dsv4ProgramCompressor& c, const PoolState& s,
                              int64_t fed) const;
  void feed_pool(const Dsv4ProgramCompressor& c, PoolState& s, int64_t pos0, int64_t n,
                 const uint16_t* x, std::vector<uint16_t>* new_rows);
  Dsv4PoolArrays pool_arrays(const Dsv4ProgramCompressor& c, const PoolState& s) const;

  const Dsv4DecoderWeights* w_;
  std::vector<int64_t> tail_calls_;  // a tail's calls, scheduled once resume() gives the window
  int64_t start_ = 0;
  bool resumed_ = false;
  Dsv4Schedule sched_;
  std::vector<LayerState> state_;
};

}  // namespace hetero
