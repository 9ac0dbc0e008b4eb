// The deepseek_v4 bridge behind a layer pipeline: see staged_bridge.h.
#include "bridge/cuda/staged_bridge.h"

namespace hetero::cuda {

// A slot's number says its stage: local * stages + stage.
Result<std::unique_ptr<StagedCaptureStore>> StagedCaptureStore::create(
    const std::vector<BridgeStage>& stages, int slots_per_stage) {
  if (stages.empty()) return invalid_argument("a capture needs at least one stage");
  std::unique_ptr<StagedCaptureStore> c(new StagedCaptureStore());
  c->stages_ = stages;
  for (const BridgeStage& s : stages) {
    DeviceGuard on_engine(s.engine_device);  // the store's copies are the engine's
    HETERO_ASSIGN_OR_RETURN(auto store, GpuCaptureStore::create(slots_per_stage, s.program_device));
    c->stores_.push_back(std::move(store));
  }
  return c;
}

Result<int> StagedCaptureStore::capture(const TapEvent& e) {
  const int S = static_cast<int>(stages_.size());
  for (int s = 0; s < S; ++s) {
    const BridgeStage& st = stages_[static_cast<size_t>(s)];
    if (e.layer < st.first_layer || e.layer >= st.end_layer) continue;
    DeviceGuard on_engine(st.engine_device);  // the stage's stream and its copy
    HETERO_ASSIGN_OR_RETURN(int local, stores_[static_cast<size_t>(s)]->capture(e));
    return local * S + s;
  }
  return invalid_argument("layer " + std::to_string(e.layer) + " is in no stage of the capture");
}

Result<const uint16_t*> StagedCaptureStore::ready(int slot, void* stream) {
  const int S = static_cast<int>(stages_.size());
  DeviceGuard on_program(stages_[static_cast<size_t>(slot % S)].program_device);
  return stores_[static_cast<size_t>(slot % S)]->ready(slot / S, stream);
}

void StagedCaptureStore::release(int slot, void* stream) {
  const int S = static_cast<int>(stages_.size());
  DeviceGuard on_program(stages_[static_cast<size_t>(slot % S)].program_device);
  stores_[static_cast<size_t>(slot % S)]->release(slot / S, stream);
}

size_t StagedCaptureStore::device_bytes(int device) const {
  size_t b = 0;
  for (size_t s = 0; s < stages_.size(); ++s)
    if (stages_[s].program_device == device) b += stores_[s]->device_bytes();
  return b;
}

Result<std::unique_ptr<Dsv4StagedBridge>> Dsv4StagedBridge::create(
    const Dsv4DecoderWeights* host, const std::vector<BridgeStage>& stages) {
  std::unique_ptr<Dsv4StagedBridge> b(new Dsv4StagedBridge());
  b->host_ = host;
  b->stages_ = stages;
  for (const BridgeStage& s : stages) {
    DeviceGuard on_program(s.program_device);
    HETERO_ASSIGN_OR_RETURN(auto w, upload_dsv4_weights(*host, s.first_layer, s.end_layer));
    b->weights_.push_back(std::move(w));
  }
  HETERO_ASSIGN_OR_RETURN(b->capture_, StagedCaptureStore::create(stages));
  return b;
}

// Each stage's weights are freed on their own GPU.
Dsv4StagedBridge::~Dsv4StagedBridge() {
  capture_.reset();
  for (size_t s = 0; s < weights_.size(); ++s) {
    DeviceGuard on_program(stages_[s].program_device);
    weights_[s].reset();
  }
}

Result<std::unique_ptr<Dsv4GpuSegmentProgram>> Dsv4StagedBridge::program(
    const std::vector<int64_t>& decoder_calls, int64_t start) const {
  std::vector<Dsv4GpuSegmentProgram::Part> parts;
  for (size_t s = 0; s < stages_.size(); ++s)
    parts.push_back({weights_[s].get(), stages_[s].program_device});
  return Dsv4GpuSegmentProgram::create(host_, parts, decoder_calls, start);
}

size_t Dsv4StagedBridge::weight_bytes(int device) const {
  size_t b = 0;
  for (size_t s = 0; s < stages_.size(); ++s)
    if (stages_[s].program_device == device) b += weights_[s]->device_bytes;
  return b;
}

}  // namespace hetero::cuda
