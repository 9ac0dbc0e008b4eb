// The DeepSeek-V4 decoder's calls inside an engine chunk (model/dsv4_calls.h), and the CPU
// engine running several decoder calls in one chunk: every layer's attention input bit for bit
// what one chunk per call gives (the CPU engine's arithmetic is row-wise outside the calls).
#include "model/dsv4_calls.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "../common/dsv4_model_weights.h"
#include "engine/dsv4_cpu.h"

namespace hetero {
namespace {

using Pieces = std::vector<std::pair<int64_t, int64_t>>;

TEST(Dsv4Calls, WithoutAScheduleAChunkIsOneCall) {
  Dsv4Calls calls;
  EXPECT_EQ(calls.within(0, 300), (Pieces{{0, 300}}));
  EXPECT_EQ(calls.within(40, 9), (Pieces{{0, 9}}));
  EXPECT_EQ(calls.within(40, 3), (Pieces{{0, 1}, {1, 1}, {2, 1}}));  // 2..8: token by token
  EXPECT_EQ(calls.within(40, 1), (Pieces{{0, 1}}));
}

TEST(Dsv4Calls, AChunkRunsTheDecoderCallsInsideIt) {
  Dsv4Calls calls;
  calls.set({2048, 2048, 903, 1});
  EXPECT_EQ(calls.within(0, 5000), (Pieces{{0, 2048}, {2048, 2048}, {4096, 903}, {4999, 1}}));
  EXPECT_EQ(calls.within(2048, 2048), (Pieces{{0, 2048}}));
  // A chunk edge inside a call cuts it there.
  EXPECT_EQ(calls.within(1000, 2000), (Pieces{{0, 1048}, {1048, 952}}));
  // Cut pieces are calls of their own: 6 and 4 tokens, each token by token.
  Pieces ten;
  for (int64_t t = 0; t < 10; ++t) ten.emplace_back(t, 1);
  EXPECT_EQ(calls.within(4090, 10), ten);
  // Past the schedule: one call.
  EXPECT_EQ(calls.within(5000, 20), (Pieces{{0, 20}}));
  calls.set({5, 3, 120, 1, 2});
  EXPECT_EQ(calls.within(0, 131), (Pieces{{0, 1},
                                          {1, 1},
                                          {2, 1},
                                          {3, 1},
                                          {4, 1},
                                          {5, 1},
                                          {6, 1},
                                          {7, 1},
                                          {8, 120},
                                          {128, 1},
                                          {129, 1},
                                          {130, 1}}));
  calls.clear();
  EXPECT_EQ(calls.within(0, 131), (Pieces{{0, 131}}));
}

TEST(Dsv4Calls, GroupingKeepsCallEdges) {
  EXPECT_EQ(dsv4_group_calls({2048, 2048, 2048, 2048, 903, 1}, 8192),
            (std::vector<int64_t>{8192, 904}));
  EXPECT_EQ(dsv4_group_calls({2048, 2048, 903, 1}, 2048), (std::vector<int64_t>{2048, 2048, 904}));
  EXPECT_EQ(dsv4_group_calls({3000, 10, 10}, 2048), (std::vector<int64_t>{3000, 20}));
  EXPECT_EQ(dsv4_group_calls({5, 3, 120, 1}, 1), (std::vector<int64_t>{5, 3, 120, 1}));
  EXPECT_EQ(dsv4_group_calls({}, 512), (std::vector<int64_t>{}));
}

TEST(Dsv4Calls, CpuEngineRunsSeveralDecoderCallsPerChunkBitForBit) {
  const Dsv4Config c = tiny_dsv4_config();
  Dsv4EngineOptions dense;  // the random model's projections are dense bf16
  dense.quant_arith = Dsv4QuantArith::kDequant;
  Dsv4CpuEngine engine(random_dsv4_model(c, 11), dense);
  const int64_t T = 300;
  std::mt19937 rng(3);
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (auto& v : ids) v = static_cast<int32_t>(rng() % static_cast<uint32_t>(c.vocab));
  // Token-by-token calls, calls that complete compression windows, the window wrapping.
  const std::vector<int64_t> calls = {5, 3, 120, 1, 1, 2, 8, 9, 31, 4, 1, 115};
  Status st;
  const auto want = dsv4_taps(engine, ids, calls, &st);
  ASSERT_TRUE(st.is_ok()) << st.message();
  for (const std::vector<int64_t>& chunks :
       {std::vector<int64_t>{T}, dsv4_group_calls(calls, 128), std::vector<int64_t>{128, 172}}) {
    const auto got = dsv4_taps(engine, ids, chunks, &st, calls);
    ASSERT_TRUE(st.is_ok()) << st.message();
    ASSERT_EQ(engine.cached_tokens(), T);
    for (size_t l = 0; l < want.size(); ++l)
      EXPECT_EQ(got[l], want[l]) << "layer " << l << ", chunks of " << chunks.size();
  }
  // The schedule matters: the same one chunk without it is another forward.
  const auto whole = dsv4_taps(engine, ids, {T}, &st);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_NE(whole.back(), want.back());
}

// A checkpoint with dense routed experts has no MX forms for them: the default (mlx-cpu)
// arithmetic computes them dense (it used to read past the empty forms).
TEST(Dsv4Calls, CpuEngineRunsDenseExpertsInTheDefaultArithmetic) {
  const Dsv4Config c = tiny_dsv4_config();
  Dsv4CpuEngine engine(random_dsv4_model(c, 11));
  Status st;
  const auto taps = dsv4_taps(engine, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, {12}, &st);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(engine.cached_tokens(), 12);
  for (const auto& layer : taps)
    for (uint16_t v : layer) ASSERT_TRUE(std::isfinite(bf16_to_f32(v)));
}

TEST(Dsv4Calls, CpuEngineTakesCallsOnlyBetweenSequences) {
  const Dsv4Config c = tiny_dsv4_config();
  Dsv4EngineOptions dense;
  dense.quant_arith = Dsv4QuantArith::kDequant;
  Dsv4CpuEngine engine(random_dsv4_model(c, 11), dense);
  ASSERT_TRUE(engine.prefill_chunk({1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, {}).is_ok());
  EXPECT_EQ(engine.set_decoder_calls({10}).code(), Code::kFailedPrecondition);
  engine.reset();
  EXPECT_TRUE(engine.set_decoder_calls({10}).is_ok());
}

}  // namespace
}  // namespace hetero
