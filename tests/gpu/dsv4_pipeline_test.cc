// The DeepSeek-V4 layer pipeline (engine/cuda/dsv4_pipeline.h) against one engine: every layer's
// attention input, bit for bit, with the stages on one GPU (device-copy links) and, where the
// machine has two GPUs, on two (NCCL), while chunks overlap across the stages.
#include "engine/cuda/dsv4_pipeline.h"

#include <gtest/gtest.h>

#include <mutex>
#include <random>

#include "../common/dsv4_model_weights.h"
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
