// The served DeepSeek-V4 GPU stack (a layer pipeline, the staged bridge's GPU programs, the
// prefill service) keeping checkpoints: a request that gives up its turn resumes from the
// pipeline's checkpoint, and a later turn's tail resumes from the first turn's engine and program
// checkpoints; each stream gives the arrays the uninterrupted, whole request gives (the GPU twins
// of tests/unit/dsv4_tail_test.cc's service tests). Skips itself without a GPU.
#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>

#include "../common/dsv4_model_weights.h"
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

std::vector<int64_t> join(std::vector<int64_t> a, const std::vector<int64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

int64_t total(const std::vector<int64_t>& calls) {
  int64_t n = 0;
  for (int64_t c : calls) n += c;
  return n;
}

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

  // A response's frames into the assembler, keep-alives skipped (status of the assembly).
  static Status assemble_bytes(const std::string& bytes, Dsv4Assembler* a) {
    FrameParser parser(int64_t{1} << 28);
    parser.feed(bytes.data(), bytes.size());
    for (;;) {
      HETERO_ASSIGN_OR_RETURN(auto frame, parser.next());
      if (!frame) return data_loss("no manifest");
      const std::string kind = frame->header.value("kind", "");
      if (kind == "keepalive") continue;
      if (kind == "manifest") {
        HETERO_ASSIGN_OR_RETURN(Manifest got, decode_manifest(*frame));
        return a->finish(got);
      }
      HETERO_ASSIGN_OR_RETURN(Segment seg, decode_segment(*frame));
      HETERO_RETURN_IF_ERROR(a->accept(seg));
    }
  }

  // Runs a request in-process and assembles its stream (the manifest's reason in *reason).
  Status run(int64_t T, int64_t start, const std::vector<int64_t>& calls, Dsv4Assembler* a,
             std::string* reason) {
    PrefillRequest req;
    req.ids.assign(ids_.begin(), ids_.begin() + T);
    req.fingerprint = decoder_.layout.fingerprint;
    req.start = start;
    req.decoder_calls = calls;
    std::string bytes;
    const Manifest m = service_->run(req, [&](std::string f) {
      bytes += f;
      return true;
    });
    *reason = m.reason;
    return assemble_bytes(bytes, a);
  }

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
  const int64_t T = 4000, S = 40;
  std::vector<int64_t> calls(T / 64, 64);
  calls.push_back(T - 64 * (T / 64) - 1);
  calls.push_back(1);
  const std::vector<int64_t> short_calls = {39, 1};
  Dsv4Assembler alone(decoder_.layout, T);
  std::string reason;
  Status st = run(T, 0, calls, &alone, &reason);  // no queue: never gives the engine up
  ASSERT_TRUE(st.is_ok()) << st.to_string() << "; " << reason;
  service_->set_turn_ms(1);
  ASSERT_TRUE(service_->start("127.0.0.1", 0).is_ok());
  auto post = [&](int64_t n, const std::vector<int64_t>& cs, Dsv4Assembler* a,
                  std::chrono::steady_clock::time_point* done) {
    httplib::Client cli("127.0.0.1", service_->bound_port());
    cli.set_read_timeout(120, 0);
    const nlohmann::json body = {{"ids", std::vector<int32_t>(ids_.begin(), ids_.begin() + n)},
                                 {"fingerprint", decoder_.layout.fingerprint},
                                 {"decoder_calls", cs}};
    auto res = cli.Post("/v1/prefill", body.dump(), "application/json");
    *done = std::chrono::steady_clock::now();
    if (!res || res->status != 200) return internal_error(res ? res->body : "no response");
    return assemble_bytes(res->body, a);
  };
  Dsv4Assembler long_one(decoder_.layout, T), short_one(decoder_.layout, S);
  std::chrono::steady_clock::time_point long_done, short_done;
  Status long_st, short_st;
  std::thread first([&] { long_st = post(T, calls, &long_one, &long_done); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the long one holds the engine
  std::thread second([&] { short_st = post(S, short_calls, &short_one, &short_done); });
  first.join();
  second.join();
  service_->stop();
  ASSERT_TRUE(long_st.is_ok()) << long_st.to_string();
  ASSERT_TRUE(short_st.is_ok()) << short_st.to_string();
  EXPECT_LT(short_done, long_done);  // the short one did not wait for the whole long one
  const TensorMap want = alone.arrays(T).value(), got = long_one.arrays(T).value();
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, t] : want) EXPECT_EQ(got.at(name).bytes, t.bytes) << name;
}

// Tails: a first turn leaves the pipeline's and the programs' checkpoints, and a second turn's
// tail streams, from them, the rows the whole request gives past the first turn (its pooled rows
// are the whole request's after the first turn's) and the same state at its end.
TEST_F(Dsv4ServedGpuTest, ASecondTurnStreamsItsTailFromTheFirstTurnsCheckpoints) {
  const std::vector<int64_t> turn1 = {64, 64, 64, 3}, turn2 = {1, 64, 64, 41, 1};
  const int64_t C = total(turn1), T = C + total(turn2);
  std::string reason;
  Dsv4Assembler none(decoder_.layout, T, "", C);  // nothing to resume from yet: refused
  EXPECT_FALSE(run(T, C, turn2, &none, &reason).is_ok());
  EXPECT_NE(reason.find("no checkpoint of exactly the first 195 tokens"), std::string::npos)
      << reason;
  Dsv4Assembler whole(decoder_.layout, T);
  Status st = run(T, 0, join(turn1, turn2), &whole, &reason);
  ASSERT_TRUE(st.is_ok()) << st.to_string() << "; " << reason;
  Dsv4Assembler first(decoder_.layout, C);
  st = run(C, 0, turn1, &first, &reason);
  ASSERT_TRUE(st.is_ok()) << st.to_string() << "; " << reason;
  Dsv4Assembler tail(decoder_.layout, T, "", C);
  st = run(T, C, turn2, &tail, &reason);
  ASSERT_TRUE(st.is_ok()) << st.to_string() << "; " << reason;
  ASSERT_TRUE(tail.can_mount(T));
  EXPECT_EQ(tail.entry_extra()["start"].get<int64_t>(), C);
  const TensorMap want = whole.arrays(T).value(), got = tail.arrays(T).value(),
                  head = first.arrays(C).value();
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, t] : want) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(got.count(name));
    if (name.ends_with(".pooled")) {  // the first turn's rows, then the tail's
      std::vector<uint8_t> joined = head.at(name).bytes;
      joined.insert(joined.end(), got.at(name).bytes.begin(), got.at(name).bytes.end());
      EXPECT_EQ(joined, t.bytes);
    } else {
      EXPECT_EQ(got.at(name).shape, t.shape);
      EXPECT_EQ(got.at(name).bytes, t.bytes);
    }
  }
}

}  // namespace
}  // namespace hetero
