// DeepSeek-V4's forward as a layer pipeline: stage s is a Dsv4CudaEngine holding layers
// [first[s], first[s + 1]) on GPU devices[s]. A chunk passes the stages in order; between two
// stages its residual (bf16 [n, hc_mult, hidden]: 32 KiB per token at Flash's widths, the least
// any split moves) crosses a link, and while stage s + 1 runs chunk i, stage s runs chunk i + 1:
// one host thread per stage, lockstepped by the links.
//
// Links: stages on different GPUs send the residual with NCCL (ncclSend / ncclRecv on the
// stages' own streams: the transport between GPUs, in a box over NVLink or between boxes over
// the network; NVLink multicast is not used), built where NCCL is present. Stages on the same
// GPU hand it over through a device buffer guarded by two events (the same code apart from the
// transport, so the pipeline is tested on one GPU). A pipeline is one or the other: every stage
// on its own GPU, or all on one.
//
// Taps run on the stage's thread: a layer's taps come in chunk order from one thread, but two
// stages' taps come from two threads at once. Errors: the first failing stage's Status; the
// other stages stop at their next chunk. After a failure, reset() before the next prompt.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/cuda/dsv4_cuda.h"

namespace hetero {

struct Dsv4PipelineOptions {
  std::vector<int> devices;          // one per stage; all different, or all the same
  std::vector<int64_t> first_layer;  // stage s's first layer (empty: layers split evenly)
  Dsv4CudaOptions engine;            // every stage's options (its layer range is set per stage)
};

class Dsv4Pipeline {
 public:
  // As Dsv4CudaEngine's three constructors, one engine per stage on its device.
  static Result<std::unique_ptr<Dsv4Pipeline>> load(const std::string& model_dir,
                                                    const Dsv4PipelineOptions& options);
  static Result<std::unique_ptr<Dsv4Pipeline>> create(const Dsv4Weights& weights,
                                                      const Dsv4PipelineOptions& options);
  static Result<std::unique_ptr<Dsv4Pipeline>> random(const Dsv4Config& config, uint64_t seed,
                                                      const Dsv4PipelineOptions& options);
  // The stages' layer starts for `stages` stages of a config's layers: as even as whole layers
  // allow, the first stage one layer lighter when it cannot be even (it also embeds).
  static std::vector<int64_t> even_split(int64_t layers, int64_t stages);
  ~Dsv4Pipeline();
  Dsv4Pipeline(const Dsv4Pipeline&) = delete;
  Dsv4Pipeline& operator=(const Dsv4Pipeline&) = delete;

  const Dsv4Config& config() const;
  int64_t stages() const;
  Dsv4CudaEngine& stage(int64_t s);
  // "nccl" or "device copy".
  const char* transport() const;
  Status reset();
  Status reserve(int64_t tokens, int64_t max_chunk_tokens);
  // Every stage's Dsv4CudaEngine::set_decoder_calls (after reserve() and any restore()).
  Status set_decoder_calls(const std::vector<int64_t>& calls);
  // Every stage's Dsv4CudaEngine::checkpoint (null when one failed), and restore() of such a
  // checkpoint after reserve(): the pipeline's state after cached_tokens() tokens.
  std::shared_ptr<const Checkpoint> checkpoint() const;
  int64_t checkpoint_bytes() const;
  Status restore(const Checkpoint& c);
  // Runs ids in chunks of the given lengths (the last takes the rest), stages overlapping, and
  // returns once every stage has finished them (the device work too). stop (optional) is asked
  // before each chunk enters the first stage: once it says true no chunk enters, the chunks
  // already in flight finish, and prefill returns OK with cached_tokens() where they ended.
  Status prefill(const std::vector<int32_t>& ids, const std::vector<int64_t>& chunks,
                 const AttentionInputTap& tap, const std::function<bool()>& stop = {});
  // Stage s's GPU and its layers [first, end).
  int device(int64_t s) const { return devices_[static_cast<size_t>(s)]; }
  int64_t first_layer(int64_t s) const;
  int64_t end_layer(int64_t s) const;
  int64_t cached_tokens() const;

  struct Link;

 private:
  Dsv4Pipeline() = default;
  static Result<std::unique_ptr<Dsv4Pipeline>> make(
      const Dsv4Config& config, const Dsv4PipelineOptions& options,
      const std::function<Result<std::unique_ptr<Dsv4CudaEngine>>(const Dsv4CudaOptions&)>& one);

  // Every link's buffer holds a chunk of this many tokens.
  Status size_links(int64_t chunk_tokens);

  Dsv4Config config_;
  std::vector<int> devices_;
  std::vector<std::unique_ptr<Dsv4CudaEngine>> engines_;
  std::vector<std::unique_ptr<Link>> links_;  // links_[s]: stage s -> s + 1
  bool nccl_ = false;
  bool broken_ = false;    // a failure aborted the NCCL links
  void* comms_ = nullptr;  // ncclComm_t[stages] where NCCL links the stages
};

}  // namespace hetero
