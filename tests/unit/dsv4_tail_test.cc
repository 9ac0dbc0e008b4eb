// DeepSeek-V4 tails on the prefill side: the cache program and the CPU engine resumed from their
// checkpoints at a prefix's end go on exactly as one run over the whole prompt with the same
// decoder calls (the tail's first call starting at the prefix's end, as the decoder runs a warm
// request); the prefill service keeps the checkpoints of finished requests and streams a later
// request's tail from them, and refuses a tail whose start it holds no checkpoint of; a long
// request gives its turn to a short one and resumes from its engine's checkpoint; at the memory
// floor a request is sealed at the longest prefix of whole chunks whose state fits. Against the
// decoder itself: tests/py/test_dsv4_front.py (warm turns, the memory floor).
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "../common/dsv4_model_weights.h"
#include "../common/dsv4_served_checks.h"
#include "../common/dsv4_test_weights.h"
#include "bridge/dsv4_stream.h"
#include "engine/dsv4_cpu.h"
#include "model/dsv4_calls.h"
#include "prefill/service.h"

namespace hetero {
namespace {

// [1, rows, width] rows [from, to) of a pooled array.
std::vector<uint8_t> row_bytes(const Tensor& t, int64_t from, int64_t to) {
  const int64_t width = t.shape[2] * 2;
  return {t.bytes.begin() + from * width, t.bytes.begin() + to * width};
}

TEST(Dsv4Tail, AResumedProgramMakesTheWholeRunsArrays) {
  const auto w = random_dsv4_weights();  // ratios 0, 4, 128; an 8-row window
  struct Case {
    std::vector<int64_t> prefix, tail;
  };
  // Tails that start inside a window of 4, on one, with token-by-token calls (2..8 tokens), after
  // a prefix whose ring had rotated, and with a ratio-128 window completed in the tail.
  const std::vector<Case> cases = {{{100}, {60, 140, 1}},
                                   {{37, 1, 2}, {3, 50, 1}},
                                   {{64, 64, 1}, {171, 1}},
                                   {{200}, {1, 1, 99}},
                                   {{129, 1, 1, 2}, {6, 161, 1}}};
  for (const Case& c : cases) {
    const int64_t C = total_calls(c.prefix), T = C + total_calls(c.tail);
    SCOPED_TRACE("prefix " + std::to_string(C) + ", T " + std::to_string(T));
    std::vector<std::vector<uint16_t>> xs;
    for (uint32_t l = 0; l < 3; ++l) xs.push_back(random_dsv4_x(T, w.layout.hidden, 40 + l));
    Dsv4CacheProgram whole(&w, join_calls(c.prefix, c.tail));
    Dsv4CacheProgram first(&w, c.prefix);
    Dsv4CacheProgram tail(&w, c.tail, C);
    const int64_t H = w.layout.hidden;
    for (int64_t l = 0; l < 3; ++l) {
      const uint16_t* x = xs[static_cast<size_t>(l)].data();
      ASSERT_TRUE(whole.feed(l, 0, T, x, nullptr).is_ok());
      ASSERT_TRUE(first.feed(l, 0, C, x, nullptr).is_ok());
    }
    // A tail program takes no row before it resumed.
    EXPECT_EQ(tail.feed(0, C, 1, xs[0].data() + C * H, nullptr).code(), Code::kFailedPrecondition);
    auto cp = first.checkpoint();
    ASSERT_TRUE(cp.is_ok()) << cp.status().to_string();
    EXPECT_EQ(cp.value()->tokens(), C);
    ASSERT_TRUE(tail.resume(*cp.value()).is_ok());
    EXPECT_EQ(tail.resume(*cp.value()).code(), Code::kFailedPrecondition);  // once
    const int64_t mid = C + (T - C) / 3;  // rows arrive in two pieces
    for (int64_t l = 0; l < 3; ++l) {
      const uint16_t* x = xs[static_cast<size_t>(l)].data();
      ASSERT_TRUE(tail.feed(l, C, mid - C, x + C * H, nullptr).is_ok());
      ASSERT_TRUE(tail.feed(l, mid, T - mid, x + mid * H, nullptr).is_ok());
    }
    EXPECT_EQ(tail.window_idx(), whole.window_idx());
    for (int64_t l = 0; l < 3; ++l) {
      SCOPED_TRACE("layer " + std::to_string(l));
      auto want = whole.finish_layer(l);
      auto got = tail.finish_layer(l);
      ASSERT_TRUE(want.is_ok() && got.is_ok());
      EXPECT_EQ(got->window.shape, want->window.shape);
      EXPECT_EQ(got->window.bytes, want->window.bytes);
      if (want->ratio == 0) continue;
      const int64_t r = want->ratio;
      for (auto [g, e] :
           {std::pair{&got->pool, &want->pool}, std::pair{&got->index, &want->index}}) {
        if (r != 4 && g == &got->index) continue;
        EXPECT_EQ(g->buf_kv.bytes, e->buf_kv.bytes);
        EXPECT_EQ(g->buf_gate.bytes, e->buf_gate.bytes);
        // Only the windows completed from C on: the decoder holds the others.
        ASSERT_EQ(g->pooled.shape[1], T / r - C / r);
        EXPECT_EQ(row_bytes(g->pooled, 0, T / r - C / r), row_bytes(e->pooled, C / r, T / r));
      }
    }
  }
}

TEST(Dsv4Tail, AProgramResumesOnlyFromACheckpointOfItsStart) {
  const auto w = random_dsv4_weights();
  const auto x = random_dsv4_x(60, w.layout.hidden, 5);
  Dsv4CacheProgram first(&w, {50});
  EXPECT_FALSE(first.checkpoint().is_ok());  // rows still missing
  for (int64_t l = 0; l < 3; ++l) ASSERT_TRUE(first.feed(l, 0, 50, x.data(), nullptr).is_ok());
  auto cp = first.checkpoint();
  ASSERT_TRUE(cp.is_ok());
  Dsv4CacheProgram elsewhere(&w, {10}, 49);
  EXPECT_EQ(elsewhere.resume(*cp.value()).code(), Code::kFailedPrecondition);
  const auto other = random_dsv4_weights();
  Dsv4CacheProgram foreign(&other, {10}, 50);
  EXPECT_EQ(foreign.resume(*cp.value()).code(), Code::kInvalidArgument);
}

TEST(Dsv4Tail, ARestoredCpuEngineGoesOnBitForBit) {
  const Dsv4Config c = tiny_dsv4_config();
  Dsv4EngineOptions dense;  // the random model's projections are dense bf16
  dense.quant_arith = Dsv4QuantArith::kDequant;
  Dsv4CpuEngine engine(random_dsv4_model(c, 11), dense);
  const std::vector<int64_t> prefix = {5, 3, 120, 1, 1}, tail = {2, 8, 9, 31, 4, 1, 115};
  const int64_t C = total_calls(prefix), T = C + total_calls(tail), H = c.hidden;
  std::mt19937 rng(3);
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (auto& v : ids) v = static_cast<int32_t>(rng() % static_cast<uint32_t>(c.vocab));
  Status st;
  const auto want = dsv4_taps(engine, ids, {T}, &st, join_calls(prefix, tail));
  ASSERT_TRUE(st.is_ok()) << st.message();

  engine.reset();
  ASSERT_TRUE(engine.set_decoder_calls(prefix).is_ok());
  ASSERT_TRUE(engine.prefill_chunk({ids.begin(), ids.begin() + C}, {}).is_ok());
  const auto cp = engine.checkpoint();
  ASSERT_TRUE(cp);
  EXPECT_EQ(cp->tokens(), C);
  EXPECT_GT(cp->bytes(), 0);
  engine.reset();  // another sequence in between
  ASSERT_TRUE(engine.prefill_chunk({ids.begin(), ids.begin() + 40}, {}).is_ok());
  ASSERT_TRUE(engine.restore(*cp).is_ok());
  EXPECT_EQ(engine.cached_tokens(), C);
  ASSERT_TRUE(engine.set_decoder_calls(tail).is_ok());
  std::vector<std::vector<uint16_t>> got(static_cast<size_t>(c.layers));
  const auto tap = [&](const TapEvent& e) {
    if (e.x_bf16)
      got[static_cast<size_t>(e.layer)].insert(got[static_cast<size_t>(e.layer)].end(), e.x_bf16,
                                               e.x_bf16 + e.n_tokens * e.hidden);
  };
  ASSERT_TRUE(engine.prefill_chunk({ids.begin() + C, ids.begin() + C + 50}, tap).is_ok());
  EXPECT_EQ(engine.set_decoder_calls(tail).code(), Code::kFailedPrecondition);
  ASSERT_TRUE(engine.prefill_chunk({ids.begin() + C + 50, ids.end()}, tap).is_ok());
  for (size_t l = 0; l < want.size(); ++l) {
    const std::vector<uint16_t> rows(want[l].begin() + C * H, want[l].end());
    EXPECT_EQ(got[l], rows) << "layer " << l;
  }
  // Only its own kind of checkpoint.
  const auto w = random_dsv4_weights();
  Dsv4CacheProgram program(&w, {4});
  const auto x = random_dsv4_x(4, w.layout.hidden, 1);
  for (int64_t l = 0; l < 3; ++l) ASSERT_TRUE(program.feed(l, 0, 4, x.data(), nullptr).is_ok());
  EXPECT_EQ(engine.restore(*program.checkpoint().value()).code(), Code::kInvalidArgument);
}

// The service over the CPU engine and the program: a first turn's request leaves checkpoints, and
// a second turn's tail streams the whole request's arrays from them.
class Dsv4TailServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Dsv4TestShape shape;
    shape.hidden = config_.hidden;
    shape.ratios.assign(config_.compress_ratios.begin(), config_.compress_ratios.end());
    shape.window = 16;
    weights_ = random_dsv4_weights(shape);
    Dsv4EngineOptions dense;
    dense.quant_arith = Dsv4QuantArith::kDequant;
    engine_ = std::make_unique<Dsv4CpuEngine>(random_dsv4_model(config_, 11), dense);
    adapter_ = std::make_unique<EngineAdapter<Dsv4CpuEngine>>(engine_.get());
    const Dsv4DecoderWeights* w = &weights_;
    service_ = std::make_unique<PrefillService>(
        adapter_.get(), weights_.layout,
        [w](const PrefillRequest& req) -> Result<std::unique_ptr<SegmentProgram>> {
          return std::unique_ptr<SegmentProgram>(
              std::make_unique<Dsv4SegmentProgram>(w, req.decoder_calls, req.start));
        },
        /*default_chunk_tokens=*/64, /*max_tokens=*/10000);
    service_->set_chunk_plan([](const PrefillRequest& req, int64_t chunk) {
      return dsv4_group_calls(req.decoder_calls, chunk);
    });
    service_->set_state_cache(256, int64_t{1} << 26);
    std::mt19937 rng(9);
    ids_.resize(300);
    for (auto& v : ids_) v = static_cast<int32_t>(rng() % static_cast<uint32_t>(config_.vocab));
  }

  Status run(int64_t T, int64_t start, const std::vector<int64_t>& calls, Dsv4Assembler* a,
             std::string* reason = nullptr) {
    return served().run(T, start, calls, a, reason);
  }
  Dsv4Served served() { return {service_.get(), &weights_, &ids_}; }

  Dsv4Config config_ = tiny_dsv4_config();
  Dsv4DecoderWeights weights_;
  std::unique_ptr<Dsv4CpuEngine> engine_;
  std::unique_ptr<EngineAdapter<Dsv4CpuEngine>> adapter_;
  std::unique_ptr<PrefillService> service_;
  std::vector<int32_t> ids_;
};

TEST_F(Dsv4TailServiceTest, ASecondTurnStreamsItsTailFromTheFirstTurnsCheckpoints) {
  expect_tail_from_first_turn(served(), {64, 64, 2}, {64, 64, 41, 1});
}

// A state larger than the prefix cache is not kept (nor copied): a later tail is refused and the
// decode side asks for the whole prefix.
TEST_F(Dsv4TailServiceTest, AStateLargerThanThePrefixCacheIsNotKept) {
  service_->set_state_cache(256, 1024);
  Dsv4Assembler first(weights_.layout, 130);
  std::string reason;
  ASSERT_TRUE(run(130, 0, {64, 64, 2}, &first, &reason).is_ok()) << reason;
  ASSERT_GT(engine_->checkpoint_bytes(), 1024);
  Dsv4Assembler tail(weights_.layout, 300, "", 130);
  EXPECT_FALSE(run(300, 130, {64, 64, 41, 1}, &tail, &reason).is_ok());
  EXPECT_NE(reason.find("no checkpoint of exactly the first 130 tokens"), std::string::npos)
      << reason;
}

// Turns: a long request gives its turn to a short one at a chunk boundary, keeping its engine's
// checkpoint, and resumes from it with the decoder's calls from there: its stream is the one it
// sends alone.
TEST_F(Dsv4TailServiceTest, ALongRequestGivesItsTurnToAShortOneAndSendsTheSameArrays) {
  expect_turn_given_and_same_arrays(served(), 300, {64, 64, 64, 64, 43, 1}, 40, {39, 1});
}

// The memory floor: under a host budget that holds the state of 192 tokens in chunks of 64, a
// request of 300 is sealed at 192 with the reason, and the sealed stream mounts there with the
// same arrays as the whole request's stream broken after its third segment; a request that fits
// is served whole after it.
TEST_F(Dsv4TailServiceTest, AtTheMemoryFloorAStreamIsSealedAtTheLongestChunkPrefixThatFits) {
  const int64_t T = 300;
  const std::vector<int64_t> calls = {64, 64, 64, 64, 43, 1};
  PrefillRequest req;
  req.ids.assign(ids_.begin(), ids_.begin() + T);
  req.fingerprint = weights_.layout.fingerprint;
  req.decoder_calls = calls;
  std::vector<std::string> whole_frames;
  ASSERT_TRUE(service_
                  ->run(req,
                        [&](std::string f) {
                          whole_frames.push_back(std::move(f));
                          return true;
                        })
                  .complete);

  service_->set_memory_floor(true);
  engine_->set_memory_budget(engine_->reserve_bytes(192, 64));
  ASSERT_TRUE(engine_->reserve(192, 64).is_ok());
  ASSERT_EQ(engine_->reserve(256, 64).code(), Code::kResourceExhausted);
  Dsv4Assembler sealed(weights_.layout, T);
  std::string reason;
  const Status st = run(T, 0, calls, &sealed, &reason);
  EXPECT_FALSE(st.is_ok());
  EXPECT_EQ(reason.rfind("sealed at the memory floor: 192 of 300 tokens fit (over the host memory "
                         "budget: the state of 300 tokens and a chunk of 64 needs ",
                         0),
            0u)
      << reason;
  EXPECT_EQ(sealed.covered_tokens(), 192);
  ASSERT_TRUE(sealed.can_mount(192));

  // The whole request's stream, cut after the segment that ends at 192.
  Dsv4Assembler broken(weights_.layout, T);
  FrameParser parser(int64_t{1} << 26);
  for (const std::string& f : whole_frames) parser.feed(f.data(), f.size());
  while (broken.covered_tokens() < 192) {
    auto frame = parser.next();
    ASSERT_TRUE(frame.is_ok() && frame.value());
    auto seg = decode_segment(*frame.value());
    ASSERT_TRUE(seg.is_ok()) << seg.status().to_string();
    ASSERT_TRUE(broken.accept(seg.value()).is_ok());
  }
  ASSERT_EQ(broken.covered_tokens(), 192);
  const TensorMap want = broken.arrays(192).value(), got = sealed.arrays(192).value();
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, t] : want) {
    ASSERT_TRUE(got.count(name)) << name;
    EXPECT_EQ(got.at(name).shape, t.shape) << name;
    EXPECT_EQ(got.at(name).bytes, t.bytes) << name;
  }

  engine_->set_memory_budget(0);
  Dsv4Assembler after(weights_.layout, T);
  EXPECT_TRUE(run(T, 0, calls, &after, &reason).is_ok()) << reason;
  EXPECT_TRUE(after.can_mount(T));
}

}  // namespace
}  // namespace hetero
