// The served DeepSeek-V4 GPU stack (a layer pipeline, the staged bridge's GPU programs, the
// prefill service) keeping checkpoints: a request that gives up its turn resumes from the
// pipeline's checkpoint, and a later turn's tail resumes from the first turn's engine and program
// checkpoints; each stream gives the arrays the uninterrupted, whole request gives (the GPU twins
// of tests/unit/dsv4_tail_test.cc's service tests). Skips itself without a GPU.
#include <gtest/gtest.h>

#include <random>

#include "../common/dsv4_model_weights.h"
#include "../common/dsv4_served_checks.h"
#include "../common/dsv4_test_weights.h"
#include "bridge/cuda/staged_bridge.h"
#include "bridge/dsv4_stream.h"
#include "bridge/wire.h"
#include "cuda_test_base.h"
#include "engine/cuda/dsv4_pipeline.h"
#include "model/dsv4_calls.h"
#include "prefill/service.h"

namespace hetero {
namespace {

class Dsv4ServedGpuTest : public CudaDeviceTest {
 protected:
  void SetUp() override {
    CudaDeviceTest::SetUp();
    if (IsSkipped()) return;
    Dsv4TestShape shape;
    shape.hidden = config_.hidden;
    shape.ratios = {config_.compress_ratios.begin(), config_.compress_ratios.end()};
    decoder_ = random_dsv4_weights(shape);
    Dsv4PipelineOptions po;
    po.devices = {0, 0};
    auto p = Dsv4Pipeline::create(random_dsv4_model(config_, 23), po);
    ASSERT_TRUE(p.is_ok()) << p.status().to_string();
    pipeline_ = std::move(p.value());
    std::vector<cuda::BridgeStage> stages;
    for (int64_t s = 0; s < pipeline_->stages(); ++s)
      stages.push_back({pipeline_->device(s), pipeline_->device(s), pipeline_->first_layer(s),
                        pipeline_->end_layer(s)});
    auto bridge = cuda::Dsv4StagedBridge::create(&decoder_, stages);
    ASSERT_TRUE(bridge.is_ok()) << bridge.status().to_string();
    bridge_ = std::move(bridge.value());
    adapter_ = std::make_unique<EngineAdapter<Dsv4Pipeline>>(pipeline_.get());
    ASSERT_TRUE(adapter_->keeps_checkpoints());
    const cuda::Dsv4StagedBridge* b = bridge_.get();
    service_ = std::make_unique<PrefillService>(
        adapter_.get(), decoder_.layout,
        [b](const PrefillRequest& req) -> Result<std::unique_ptr<SegmentProgram>> {
          HETERO_ASSIGN_OR_RETURN(auto program, b->program(req.decoder_calls, req.start));
          return std::unique_ptr<SegmentProgram>(std::move(program));
        },
        /*default_chunk_tokens=*/64, /*max_tokens=*/100000);
    service_->set_chunk_plan([](const PrefillRequest& req, int64_t chunk) {
      return dsv4_group_calls(req.decoder_calls, chunk);
    });
    service_->set_capture(b->capture());
    service_->set_arith("fast");
    service_->set_state_cache(256, int64_t{1} << 28);
    std::mt19937 rng(8);
    ids_.resize(5000);
    for (auto& v : ids_) v = static_cast<int32_t>(rng() % static_cast<uint32_t>(config_.vocab));
  }

  Dsv4Served served() { return {service_.get(), &decoder_, &ids_}; }

  Dsv4Config config_ = tiny_dsv4_config(/*hash_routed=*/false);
  Dsv4DecoderWeights decoder_;
  std::unique_ptr<Dsv4Pipeline> pipeline_;
  std::unique_ptr<cuda::Dsv4StagedBridge> bridge_;
  std::unique_ptr<EngineAdapter<Dsv4Pipeline>> adapter_;
  std::unique_ptr<PrefillService> service_;
  std::vector<int32_t> ids_;
};

// Turns: a long request that has held the pipeline past --turn-ms while a short one waits gives it
// up at a chunk boundary with the pipeline's checkpoint, and resumes from it after the short one
// (its GPU programs keep their state meanwhile): its stream gives the arrays it gives alone.
TEST_F(Dsv4ServedGpuTest, ALongRequestGivesItsTurnToAShortOneAndSendsTheSameArrays) {
  std::vector<int64_t> calls(4000 / 64, 64);
  calls.push_back(4000 - 64 * (4000 / 64) - 1);
  calls.push_back(1);
  expect_turn_given_and_same_arrays(served(), 4000, calls, 40, {39, 1});
}

// Tails: a first turn leaves the pipeline's and the programs' checkpoints, and a second turn's
// tail streams from them the rows the whole request gives past the first turn.
TEST_F(Dsv4ServedGpuTest, ASecondTurnStreamsItsTailFromTheFirstTurnsCheckpoints) {
  expect_tail_from_first_turn(served(), {64, 64, 64, 3}, {1, 64, 64, 41, 1});
}

}  // namespace
}  // namespace hetero
