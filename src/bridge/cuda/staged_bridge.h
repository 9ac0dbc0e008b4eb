// The deepseek_v4 bridge behind a layer pipeline (engine/cuda/dsv4_pipeline.h): each stage's
// attention inputs are captured on its own GPU and its layers' cache program runs there, so no
// stage's rows cross to another GPU and no GPU runs another stage's program; one producer
// (bridge/producer.h) still emits the segments in order. One stage is the one-GPU bridge (its
// program may then sit on another GPU than the forward: program_device).
#pragma once

#include <memory>
#include <vector>

#include "bridge/cuda/gpu_programs.h"

namespace hetero::cuda {

// A stage of the bridge: the forward's GPU for layers [first_layer, end_layer), and the GPU its
// cache program runs on.
struct BridgeStage {
  int engine_device = 0, program_device = 0;
  int64_t first_layer = 0, end_layer = 0;
};

// One GpuCaptureStore per stage (its copies on the stage's engine GPU, its slots on its program
// GPU); a layer's rows go to its stage's store. Thread-safe: the stages tap from their threads.
class StagedCaptureStore : public CaptureStore {
 public:
  static Result<std::unique_ptr<StagedCaptureStore>> create(const std::vector<BridgeStage>& stages,
                                                            int slots_per_stage = 4);
  Result<int> capture(const TapEvent& e) override;
  Result<const uint16_t*> ready(int slot, void* stream) override;
  void release(int slot, void* stream) override;
  // The slots' bytes on a program GPU.
  size_t device_bytes(int device) const;

 private:
  StagedCaptureStore() = default;
  std::vector<BridgeStage> stages_;
  std::vector<std::unique_ptr<GpuCaptureStore>> stores_;  // per stage
};

// What a served pipeline holds for every request: the decoder's weights, each stage's layers on
// its program GPU, and the capture. program() makes one request's program from it.
class Dsv4StagedBridge {
 public:
  // stages: cover the export's layers in order. host must outlive the bridge.
  static Result<std::unique_ptr<Dsv4StagedBridge>> create(const Dsv4DecoderWeights* host,
                                                          const std::vector<BridgeStage>& stages);
  ~Dsv4StagedBridge();
  StagedCaptureStore* capture() const { return capture_.get(); }
  // start > 0: a tail's program (decoder_calls cover [start, T); it resumes from a checkpoint).
  Result<std::unique_ptr<Dsv4GpuSegmentProgram>> program(const std::vector<int64_t>& decoder_calls,
                                                         int64_t start = 0) const;
  const std::vector<BridgeStage>& stages() const { return stages_; }
  // The decoder weights' bytes on a program GPU.
  size_t weight_bytes(int device) const;

 private:
  Dsv4StagedBridge() = default;
  const Dsv4DecoderWeights* host_ = nullptr;
  std::vector<BridgeStage> stages_;
  std::vector<std::unique_ptr<Dsv4GpuWeights>> weights_;  // per stage, on its program GPU
  std::unique_ptr<StagedCaptureStore> capture_;
};

}  // namespace hetero::cuda
