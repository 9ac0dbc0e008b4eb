// The DeepSeek-V4 layer pipeline (engine/cuda/dsv4_pipeline.h) against one engine: every layer's
// attention input, bit for bit, with the stages on one GPU (device-copy links) and, where the
// machine has two GPUs, on two (NCCL), while chunks overlap across the stages. The bridge behind
// it (bridge/cuda/staged_bridge.h: each stage's layers captured and programmed on its GPU, one
// producer) against the one-stage bridge: the same frames, byte for byte; each segment carries
// the state at its end, so the stream cut after any segment mounts there. A stop mid-prompt.
#include "engine/cuda/dsv4_pipeline.h"

#include <gtest/gtest.h>

#include <mutex>
#include <random>
#include <set>
#include <string>

#include "../common/dsv4_model_weights.h"
#include "../common/dsv4_test_weights.h"
#include "bridge/cuda/staged_bridge.h"
#include "bridge/dsv4_stream.h"
#include "bridge/producer.h"
#include "bridge/wire.h"
#include "cuda_test_base.h"

namespace hetero {
namespace {

class Dsv4PipelineTest : public CudaDeviceTest {};

std::vector<std::vector<uint16_t>> pipeline_taps(Dsv4Pipeline& p, const std::vector<int32_t>& ids,
                                                 const std::vector<int64_t>& chunks, Status* st) {
  const Dsv4Config& c = p.config();
  const int64_t T = static_cast<int64_t>(ids.size());
  std::vector<std::vector<uint16_t>> out(static_cast<size_t>(c.layers),
                                         std::vector<uint16_t>(static_cast<size_t>(T * c.hidden)));
  *st = p.reset();
  if (!st->is_ok()) return out;
  // Each layer's taps come from one stage's thread: the layers' arrays are disjoint.
  *st = p.prefill(ids, chunks, [&](const TapEvent& ev) {
    std::copy(ev.x_bf16, ev.x_bf16 + ev.n_tokens * ev.hidden,
              out[static_cast<size_t>(ev.layer)].begin() + ev.pos0 * c.hidden);
  });
  return out;
}

void expect_same_as_one_engine(const std::vector<int>& devices, cuda::WeightDtype dtype) {
  const Dsv4Config c = tiny_dsv4_config(/*hash_routed=*/false);
  const Dsv4Weights w = random_dsv4_model(c, 23);
  Dsv4CudaOptions o;
  o.host_tap = true;
  o.weight_dtype = dtype;
  auto one = dtype == cuda::WeightDtype::kBf16 ? Dsv4CudaEngine::create(w, o)
                                               : Dsv4CudaEngine::random(c, 9, o);
  ASSERT_TRUE(one.is_ok()) << one.status().to_string();
  Dsv4PipelineOptions po;
  po.devices = devices;
  po.engine = o;
  auto p = dtype == cuda::WeightDtype::kBf16 ? Dsv4Pipeline::create(w, po)
                                             : Dsv4Pipeline::random(c, 9, po);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  std::printf("[ pipeline ] %lld stages, %s\n", static_cast<long long>((*p)->stages()),
              (*p)->transport());
  const int64_t T = 250;
  std::mt19937 rng(4);
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (auto& v : ids) v = static_cast<int32_t>(rng() % static_cast<uint32_t>(c.vocab));
  for (const std::vector<int64_t>& chunks :
       std::vector<std::vector<int64_t>>{{T}, {37, 37, 37, 37, 37, 37, 28}, {5, 3, 120, 1, 60}}) {
    Status st;
    const auto want = dsv4_taps(**one, ids, chunks, &st);
    ASSERT_TRUE(st.is_ok()) << st.message();
    const auto got = pipeline_taps(**p, ids, chunks, &st);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    EXPECT_EQ((*p)->cached_tokens(), T);
    for (size_t l = 0; l < got.size(); ++l)
      EXPECT_EQ(got[l], want[l]) << devices.size() << " stages, " << chunks.size()
                                 << " chunks, layer " << l;
  }
}

TEST_F(Dsv4PipelineTest, StagesOnOneGpuGiveOneEnginesBits) {
  expect_same_as_one_engine({0, 0}, cuda::WeightDtype::kBf16);
  expect_same_as_one_engine({0, 0, 0}, cuda::WeightDtype::kCheckpoint);
}

TEST_F(Dsv4PipelineTest, StagesOnTwoGpusOverNcclGiveOneEnginesBits) {
  int n = 0;
  cudaGetDeviceCount(&n);
  if (n < 2) GTEST_SKIP() << "one GPU: no second device for the second stage";
  expect_same_as_one_engine({0, 1}, cuda::WeightDtype::kBf16);
  expect_same_as_one_engine({0, 1}, cuda::WeightDtype::kCheckpoint);
}

// The frames a bridged prefill streams, with the pipeline's stages on `devices` and each stage's
// program on its own GPU.
std::vector<std::string> bridged_frames(const std::vector<int>& devices) {
  const Dsv4Config c = tiny_dsv4_config(/*hash_routed=*/false);
  const Dsv4Weights w = random_dsv4_model(c, 23);
  Dsv4TestShape shape;
  shape.hidden = c.hidden;
  shape.ratios = {c.compress_ratios.begin(), c.compress_ratios.end()};
  const Dsv4DecoderWeights decoder = random_dsv4_weights(shape);
  Dsv4PipelineOptions po;
  po.devices = devices;
  auto p = Dsv4Pipeline::create(w, po);
  EXPECT_TRUE(p.is_ok()) << p.status().to_string();
  if (!p.is_ok()) return {};
  std::vector<cuda::BridgeStage> stages;
  for (int64_t s = 0; s < (*p)->stages(); ++s)
    stages.push_back({(*p)->device(s), (*p)->device(s), (*p)->first_layer(s), (*p)->end_layer(s)});
  auto bridge = cuda::Dsv4StagedBridge::create(&decoder, stages);
  EXPECT_TRUE(bridge.is_ok()) << bridge.status().to_string();
  if (!bridge.is_ok()) return {};
  // Each stage's program weights hold its layers only, on its GPU.
  size_t held = 0;
  for (int d : std::set<int>(devices.begin(), devices.end())) held += (*bridge)->weight_bytes(d);
  EXPECT_GT(held, 0u);
  const int64_t T = 301;
  std::mt19937 rng(5);
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (auto& v : ids) v = static_cast<int32_t>(rng() % static_cast<uint32_t>(c.vocab));
  const std::vector<int64_t> calls = {64, 64, 3, 1, 100, 69};  // the decoder's, as served
  auto program = (*bridge)->program(calls);
  EXPECT_TRUE(program.is_ok()) << program.status().to_string();
  if (!program.is_ok()) return {};
  std::vector<std::string> frames;
  BridgeProducer producer(
      program->get(),
      [&](std::string f) {
        frames.push_back(std::move(f));
        return true;
      },
      4, (*bridge)->capture());
  EXPECT_TRUE((*p)->reset().is_ok());
  const Status ran = (*p)->prefill(ids, calls, producer.tap());
  EXPECT_TRUE(ran.is_ok()) << ran.to_string();
  const Manifest m = producer.finish(T, ran);
  EXPECT_TRUE(m.complete) << m.reason;
  EXPECT_EQ(m.segments, static_cast<int64_t>(calls.size()));
  return frames;
}

TEST_F(Dsv4PipelineTest, BridgeAcrossStagesStreamsTheOneStageFrames) {
  const auto want = bridged_frames({0});
  ASSERT_EQ(want.size(), 7u);  // six segments and the manifest
  {
    // The GPU programs' segments carry the state at their end: cut after any of them, the
    // stream mounts its verified prefix (the state's bits against the CPU program's:
    // Dsv4GpuProgram tests).
    const Dsv4Config c = tiny_dsv4_config(/*hash_routed=*/false);
    Dsv4TestShape shape;
    shape.hidden = c.hidden;
    shape.ratios = {c.compress_ratios.begin(), c.compress_ratios.end()};
    Dsv4Assembler a(random_dsv4_weights(shape).layout, 301);
    FrameParser parser(int64_t{1} << 26);
    for (size_t i = 0; i + 1 < want.size(); ++i) {
      parser.feed(want[i].data(), want[i].size());
      auto frame = parser.next();
      ASSERT_TRUE(frame.is_ok() && frame.value()) << "frame " << i;
      auto seg = decode_segment(*frame.value());
      ASSERT_TRUE(seg.is_ok()) << seg.status().to_string();
      const Status st = a.accept(seg.value());
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      EXPECT_TRUE(a.can_mount(a.covered_tokens())) << "cut at " << a.covered_tokens();
      EXPECT_TRUE(a.arrays(a.covered_tokens()).is_ok()) << "cut at " << a.covered_tokens();
    }
    EXPECT_EQ(a.covered_tokens(), 301);
  }
  for (const std::vector<int>& devices : {std::vector<int>{0, 0}, std::vector<int>{0, 0, 0}}) {
    const auto got = bridged_frames(devices);
    ASSERT_EQ(got.size(), want.size()) << devices.size() << " stages";
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_TRUE(got[i] == want[i]) << devices.size() << " stages, frame " << i;
  }
}

TEST_F(Dsv4PipelineTest, BridgeAcrossTwoGpusStreamsTheOneStageFrames) {
  int n = 0;
  cudaGetDeviceCount(&n);
  if (n < 2) GTEST_SKIP() << "one GPU: no second device for the second stage";
  const auto want = bridged_frames({0});
  ASSERT_EQ(want.size(), 7u);
  EXPECT_TRUE(bridged_frames({0, 1}) == want) << "stages on GPUs 0 and 1";
}

TEST_F(Dsv4PipelineTest, StopLetsNoFurtherChunkInAndFinishesTheOnesInFlight) {
  const Dsv4Config c = tiny_dsv4_config();
  Dsv4PipelineOptions po;
  po.devices = {0, 0, 0};
  auto p = Dsv4Pipeline::random(c, 3, po);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  std::vector<int32_t> ids(200, 7);
  int asked = 0;
  std::mutex mu;
  std::vector<int64_t> tapped(static_cast<size_t>(c.layers), 0);
  const Status st = (*p)->prefill(
      ids, {50, 50, 50, 50},
      [&](const TapEvent& e) {
        std::lock_guard<std::mutex> lock(mu);
        tapped[static_cast<size_t>(e.layer)] += e.n_tokens;
      },
      [&] { return ++asked > 2; });
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  for (int64_t s = 0; s < (*p)->stages(); ++s) EXPECT_EQ((*p)->stage(s).cached_tokens(), 100);
  for (int64_t t : tapped) EXPECT_EQ(t, 100);
  // The next prompt runs whole.
  ASSERT_TRUE((*p)->reset().is_ok());
  ASSERT_TRUE((*p)->prefill(ids, {50, 50, 50, 50}, {}).is_ok());
  EXPECT_EQ((*p)->cached_tokens(), 200);
}

// A request that gives up its turn, or a later tail, resumes from the pipeline's checkpoint: a
// sequence restored there (after another prompt ran on the engines) and continued with the
// decoder's remaining calls gives every layer's attention input the uninterrupted run gives.
void expect_restored_run_continues(const std::vector<int>& devices, cuda::WeightDtype dtype) {
  const Dsv4Config c = tiny_dsv4_config(/*hash_routed=*/false);
  const Dsv4Weights w = random_dsv4_model(c, 29);
  Dsv4PipelineOptions po;
  po.devices = devices;
  po.engine.host_tap = true;
  po.engine.weight_dtype = dtype;
  auto p = dtype == cuda::WeightDtype::kBf16 ? Dsv4Pipeline::create(w, po)
                                             : Dsv4Pipeline::random(c, 9, po);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  Dsv4Pipeline& pipe = **p;
  const int64_t T = 250, at = 131;
  const std::vector<int64_t> head = {64, 64, 3}, tail = {1, 100, 18};  // the decoder's calls
  std::vector<int64_t> calls = head;
  calls.insert(calls.end(), tail.begin(), tail.end());
  std::mt19937 rng(6);
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (auto& v : ids) v = static_cast<int32_t>(rng() % static_cast<uint32_t>(c.vocab));
  using Taps = std::vector<std::vector<uint16_t>>;
  auto record = [&](Taps* out) {
    return [out, &c](const TapEvent& ev) {
      std::copy(ev.x_bf16, ev.x_bf16 + ev.n_tokens * ev.hidden,
                (*out)[static_cast<size_t>(ev.layer)].begin() + ev.pos0 * c.hidden);
    };
  };
  const Taps empty(static_cast<size_t>(c.layers),
                   std::vector<uint16_t>(static_cast<size_t>(T * c.hidden)));
  Taps want = empty, got = empty;
  ASSERT_TRUE(pipe.reserve(T, 128).is_ok());
  ASSERT_TRUE(pipe.set_decoder_calls(calls).is_ok());
  ASSERT_TRUE(pipe.prefill(ids, calls, record(&want)).is_ok());

  ASSERT_TRUE(pipe.reserve(T, 128).is_ok());
  ASSERT_TRUE(pipe.set_decoder_calls(calls).is_ok());
  ASSERT_TRUE(pipe.prefill({ids.begin(), ids.begin() + at}, head, record(&got)).is_ok());
  const std::shared_ptr<const Checkpoint> cp = pipe.checkpoint();
  ASSERT_TRUE(cp);
  EXPECT_EQ(cp->tokens(), at);
  EXPECT_GT(cp->bytes(), 0);
  EXPECT_EQ(cp->bytes(), pipe.checkpoint_bytes());  // what the service priced is what it holds
  // Another prompt in between, as when the turn went to the next request.
  ASSERT_TRUE(pipe.reserve(90, 128).is_ok());
  ASSERT_TRUE(pipe.prefill(std::vector<int32_t>(90, 5), {90}, {}).is_ok());

  ASSERT_TRUE(pipe.reserve(T, 128).is_ok());
  const Status restored = pipe.restore(*cp);
  ASSERT_TRUE(restored.is_ok()) << restored.to_string();
  EXPECT_EQ(pipe.cached_tokens(), at);
  ASSERT_TRUE(pipe.set_decoder_calls(tail).is_ok());
  ASSERT_TRUE(pipe.prefill({ids.begin() + at, ids.end()}, tail, record(&got)).is_ok());
  EXPECT_EQ(pipe.cached_tokens(), T);
  for (size_t l = 0; l < got.size(); ++l)
    EXPECT_EQ(got[l], want[l]) << devices.size() << " stages, layer " << l;
}

TEST_F(Dsv4PipelineTest, ACheckpointRestoredContinuesTheSequenceBitForBit) {
  expect_restored_run_continues({0}, cuda::WeightDtype::kBf16);
  expect_restored_run_continues({0, 0}, cuda::WeightDtype::kBf16);
  expect_restored_run_continues({0, 0, 0}, cuda::WeightDtype::kCheckpoint);
}

TEST_F(Dsv4PipelineTest, ACheckpointOfAnotherSplitIsRefused) {
  const Dsv4Config c = tiny_dsv4_config();
  Dsv4PipelineOptions two, three;
  two.devices = {0, 0};
  three.devices = {0, 0, 0};
  auto a = Dsv4Pipeline::random(c, 3, two);
  auto b = Dsv4Pipeline::random(c, 3, three);
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  ASSERT_TRUE((*a)->reserve(40, 40).is_ok());
  ASSERT_TRUE((*a)->prefill(std::vector<int32_t>(40, 7), {40}, {}).is_ok());
  auto cp = (*a)->checkpoint();
  ASSERT_TRUE(cp);
  ASSERT_TRUE((*b)->reserve(80, 40).is_ok());
  EXPECT_FALSE((*b)->restore(*cp).is_ok());
  // One stage's checkpoint is not another stage's.
  ASSERT_TRUE((*a)->reserve(80, 40).is_ok());
  auto stage0 = (*a)->stage(0).checkpoint();
  ASSERT_TRUE(stage0);
  const Status st = (*a)->stage(1).restore(*stage0);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("another shape"), std::string::npos) << st.message();
}

TEST_F(Dsv4PipelineTest, SplitsAndRefusals) {
  EXPECT_EQ(Dsv4Pipeline::even_split(43, 2), (std::vector<int64_t>{0, 21}));
  EXPECT_EQ(Dsv4Pipeline::even_split(43, 4), (std::vector<int64_t>{0, 10, 21, 32}));
  EXPECT_EQ(Dsv4Pipeline::even_split(6, 3), (std::vector<int64_t>{0, 2, 4}));
  const Dsv4Config c = tiny_dsv4_config();
  Dsv4PipelineOptions po;
  po.devices = {0, 0};
  po.first_layer = {0, 7};
  auto bad = Dsv4Pipeline::random(c, 1, po);
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument) << bad.status().to_string();
  po.first_layer = {1, 3};
  EXPECT_EQ(Dsv4Pipeline::random(c, 1, po).status().code(), Code::kInvalidArgument);
  po.first_layer = {};
  po.devices = {0, 0, 1};
  EXPECT_EQ(Dsv4Pipeline::random(c, 1, po).status().code(), Code::kInvalidArgument);
  po.devices = {};
  EXPECT_EQ(Dsv4Pipeline::random(c, 1, po).status().code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace hetero
