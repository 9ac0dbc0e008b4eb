// DeepSeek-V4 on the wire. Segments follow the prefill's chunk boundaries; each carries the
// compressed rows its range completed, per compressed layer (`layers.{i}.pool.pooled` and, at
// ratio 4, `layers.{i}.index.pooled`, bf16 [1, rows, head_dim]), then the state at its end b:
// per layer `layers.{i}.window` [1, 1, S, head_dim], the compressors' `buf_kv` / `buf_gate`
// [1, b mod r, out_dim], and `window_idx` (i64 [1]). At T the window is in the decoder's slot
// order for its calls; at an earlier b it is the last min(b, window) rows in temporal order
// (Dsv4CacheProgram::boundary_layer, and the GPU program's twin), from which the decoder goes on
// as from its own, so a stream that breaks, or is sealed at the memory floor, mounts its longest
// verified prefix.
// Names and shapes are those of the decoder store (python/hetero_mlx/dsv4.py).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "bridge/assembler.h"
#include "bridge/dsv4_program.h"
#include "bridge/producer.h"

namespace hetero {

// The arrays one layer's feed adds to its segment (the pooled rows it completed), and the
// end-of-prefix arrays of the last segment, from any program with Dsv4CacheProgram's contract
// (the CPU one and the GPU one share them).
void dsv4_feed_arrays(const Dsv4DecoderWeights& weights, int64_t layer, Dsv4NewRows rows,
                      std::vector<WireArray>* arrays);
Status dsv4_close_arrays(const Dsv4DecoderWeights& weights, int64_t window_idx,
                         const std::function<Result<Dsv4LayerArrays>(int64_t)>& finish_layer,
                         std::vector<WireArray>* arrays);

// Each layer's state at a segment's end b < T, kept from the layer's run() until the segment
// closes (any program with boundary_layer: the CPU one and the GPU one). The producer runs
// programs from one thread.
class Dsv4BoundaryStates {
 public:
  void keep(int64_t layers, int64_t end, int64_t layer, Dsv4LayerArrays state);
  // The segment that ends at `end` < T closes: its state's arrays (the window's rows are in
  // temporal order, so its slot index is their count).
  Status close(const Dsv4DecoderWeights& weights, int64_t end, std::vector<WireArray>* arrays);

 private:
  std::map<int64_t, std::vector<Dsv4LayerArrays>> at_;
};

class Dsv4SegmentProgram : public SegmentProgram {
 public:
  // decoder_calls: the decoder's own call schedule for the T tokens, or for [start, T) of a
  // tail (see Dsv4CacheProgram).
  Dsv4SegmentProgram(const Dsv4DecoderWeights* weights, const std::vector<int64_t>& decoder_calls,
                     int64_t start = 0)
      : weights_(weights), program_(weights, decoder_calls, start) {}
  const DecoderCacheLayout& layout() const override { return weights_->layout; }
  Status run(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x,
             std::vector<WireArray>* arrays) override;
  Status close_segment(int64_t pos0, int64_t n, std::vector<WireArray>* arrays) override;
  Result<std::shared_ptr<const Checkpoint>> checkpoint() const override {
    return program_.checkpoint();
  }
  Status resume(const Checkpoint& c) override { return program_.resume(c); }

 private:
  const Dsv4DecoderWeights* weights_;
  Dsv4CacheProgram program_;
  Dsv4BoundaryStates boundaries_;
};

// start > 0: a tail, rows [start, T) of the decoder's cache of ids[:start]; its pooled arrays
// hold the rows of the windows completed from start on, and its entry says "start" (the seam
// puts the decoder's own rows of the prefix before them). With a store_dir the pooled rows go
// straight into the entry's file in the store as they verify (IncomingEntry), and only the state
// at the last segment's end (a few window rows and buffers per layer) is held in memory.
class Dsv4Assembler : public Assembler {
 public:
  Dsv4Assembler(DecoderCacheLayout expected, int64_t requested_tokens, std::string store_dir = "",
                int64_t start = 0);
  ~Dsv4Assembler() override;
  Status accept(const Segment& s) override;
  Status finish(const Manifest& m) override;
  int64_t covered_tokens() const override { return covered_; }
  int64_t segments() const override { return segments_; }
  int64_t max_segment_bytes() const override;
  // The longest verified prefix, when its last segment carried the state at its end.
  bool can_mount(int64_t b) const override {
    return b > start_ && b == covered_ && state_at_ == covered_;
  }
  Result<TensorMap> arrays(int64_t b) const override;
  nlohmann::json entry_extra() const override;
  // Publishes the entry from the rows already in the store's file (or, in memory, writes it
  // straight from the rows held), for a b that can_mount.
  Result<StoreEntry> store(const std::string& store_dir, const DecoderCacheLayout& layout,
                           const std::vector<int32_t>& ids, int64_t b,
                           int64_t requested_tokens) override;

 private:
  // Each compressed layer's pooled arrays in order: name, row width, the most rows.
  void for_each_pooled_array(
      const std::function<void(const std::string&, int64_t, int64_t)>& fn) const;
  // The pooled rows verified so far, read back from the file when they went to the store.
  Result<TensorMap> pooled_arrays() const;
  DecoderCacheLayout layout_;
  int64_t requested_, start_, covered_, segments_ = 0, window_idx_ = 0;
  int64_t state_at_ = -1;  // where tail_'s state is from
  std::string store_dir_;
  std::unique_ptr<IncomingEntry> entry_;  // in the store: created with the first segment
  std::map<std::string, std::vector<uint16_t>> pooled_;  // in memory: sized for the request
  std::map<std::string, int64_t> rows_;                  // pooled rows verified, by array
  TensorMap tail_;  // window and buffers at state_at_ (the last segment that carried them)
};

}  // namespace hetero
