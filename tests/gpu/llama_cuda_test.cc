// The llama CUDA engine against the CPU engine (the decoder's arithmetic): every layer's
// attention input within a stated tolerance, for every variant of the family, both cache dtypes
// and several chunk schedules.
//
// Tolerance: the relative RMS error ||gpu - cpu|| / ||cpu|| of each layer's tap. The GPU sums in
// another order (tensor cores, flash attention), so bf16 roundings differ by an ulp here and
// there (about 4e-3 relative) and the differences grow through the layers; an FP8 cache adds
// e4m3's 2^-4 relative rounding of K and V. A wrong position, head or mask shows as an error of
// tens of percent, far above both bounds.
#include "engine/cuda/llama_cuda.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

#include "common/bf16.h"
#include "cuda_test_base.h"
#include "engine/llama_cpu.h"
#include "llama_test_weights.h"

namespace hetero {
namespace {

constexpr double kTolBf16Cache = 1.5e-2;
constexpr double kTolFp8Cache = 6e-2;

// Every layer's tap rows for the whole sequence, [layer][T * hidden].
using Taps = std::vector<std::vector<uint16_t>>;

template <class Engine>
Status run_schedule(Engine& engine, const std::vector<int32_t>& ids,
                    const std::vector<int64_t>& chunks, int64_t layers, int64_t hidden,
                    Taps* taps) {
  taps->assign(static_cast<size_t>(layers),
               std::vector<uint16_t>(ids.size() * static_cast<size_t>(hidden)));
  auto tap = [&](const TapEvent& e) {
    ASSERT_NE(e.x_bf16, nullptr);
    std::memcpy(&(*taps)[static_cast<size_t>(e.layer)][static_cast<size_t>(e.pos0 * hidden)],
                e.x_bf16, static_cast<size_t>(e.n_tokens * hidden) * 2);
  };
  int64_t pos = 0;
  for (int64_t n : chunks) {
    std::vector<int32_t> part(ids.begin() + pos, ids.begin() + pos + n);
    HETERO_RETURN_IF_ERROR(engine.prefill_chunk(part, tap));
    pos += n;
  }
  return Status::ok();
}

double rel_rms(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = bf16_to_f32(a[i]), y = bf16_to_f32(b[i]);
    num += (x - y) * (x - y), den += y * y;
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

struct Case {
  std::string type;
  int64_t head_dim;
  cuda::KvDtype kv;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.type << " head_dim " << c.head_dim << " " << cuda::kv_dtype_name(c.kv);
}

class LlamaCudaVsCpu : public CudaDeviceTest, public ::testing::WithParamInterface<Case> {};

TEST_P(LlamaCudaVsCpu, AttentionInputsWithinTolerance) {
  const Case& k = GetParam();
  const LlamaWeights w = tiny_llama(k.type, k.head_dim, 7);
  const LlamaConfig& c = w.config;
  const std::vector<int32_t> ids = random_ids(300, c.vocab, 11);
  LlamaCpuEngine cpu(w, LlamaCpuEngine::Gemm::kOrdered);
  Taps want;
  ASSERT_TRUE(run_schedule(cpu, ids, {300}, c.layers, c.hidden, &want).is_ok());
  const double tol = k.kv == cuda::KvDtype::kFp8 ? kTolFp8Cache : kTolBf16Cache;
  for (const std::vector<int64_t>& chunks :
       {std::vector<int64_t>{300}, std::vector<int64_t>{64, 64, 172},
        std::vector<int64_t>{37, 200, 5, 1, 57}}) {
    auto gpu = cuda::LlamaCudaEngine::create(w, {k.kv, /*host_tap=*/true, 0});
    ASSERT_TRUE(gpu.is_ok()) << gpu.status().to_string();
    Taps got;
    ASSERT_TRUE(run_schedule(**gpu, ids, chunks, c.layers, c.hidden, &got).is_ok());
    ASSERT_TRUE((*gpu)->synchronize().is_ok());
    for (int64_t l = 0; l < c.layers; ++l) {
      const double e = rel_rms(got[static_cast<size_t>(l)], want[static_cast<size_t>(l)]);
      std::printf("[ %s d%lld %s chunks %zu ] layer %lld rel rms %.2e\n", k.type.c_str(),
                  static_cast<long long>(k.head_dim), cuda::kv_dtype_name(k.kv), chunks.size(),
                  static_cast<long long>(l), e);
      EXPECT_LT(e, tol) << "layer " << l;
      if (l == 0) {
        EXPECT_LT(e, 2e-3) << "layer 0's input is the embedding's norm";
      }
    }
    // The logits of the last token, the same measure.
    auto logits = (*gpu)->last_logits();
    ASSERT_TRUE(logits.is_ok());
    const std::vector<float> ref = cpu.last_logits();
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); ++i)
      num += std::pow((*logits)[i] - ref[i], 2), den += std::pow(ref[i], 2);
    EXPECT_LT(std::sqrt(num / den), 2 * tol);
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, LlamaCudaVsCpu,
                         ::testing::Values(Case{"llama", 64, cuda::KvDtype::kBf16},
                                           Case{"llama", 64, cuda::KvDtype::kFp8},
                                           Case{"llama", 128, cuda::KvDtype::kFp8},
                                           Case{"qwen2", 64, cuda::KvDtype::kBf16},
                                           Case{"qwen3", 128, cuda::KvDtype::kBf16}),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return i.param.type + "_d" + std::to_string(i.param.head_dim) + "_" +
                                  cuda::kv_dtype_name(i.param.kv);
                         });

class LlamaCudaEngineTest : public CudaDeviceTest {};

// The exact path reproduces the CPU engine (and so the decoder) bit for bit, whatever the chunks.
TEST_F(LlamaCudaEngineTest, ExactArithmeticIsBitIdenticalToCpu) {
  for (const std::string type : {"llama", "qwen2", "qwen3"}) {
    const LlamaWeights w = tiny_llama(type, 64, 13);
    const LlamaConfig& c = w.config;
    const std::vector<int32_t> ids = random_ids(260, c.vocab, 17);
    LlamaCpuEngine cpu(w, LlamaCpuEngine::Gemm::kOrdered);
    Taps want;
    ASSERT_TRUE(run_schedule(cpu, ids, {100, 160}, c.layers, c.hidden, &want).is_ok());
    cuda::LlamaCudaOptions o;
    o.host_tap = true;
    o.arith = cuda::LlamaCudaArith::kExact;
    for (const std::vector<int64_t>& chunks :
         {std::vector<int64_t>{100, 160}, std::vector<int64_t>{260},
          std::vector<int64_t>{7, 250, 3}}) {
      auto gpu = cuda::LlamaCudaEngine::create(w, o);
      ASSERT_TRUE(gpu.is_ok()) << gpu.status().to_string();
      Taps got;
      ASSERT_TRUE(run_schedule(**gpu, ids, chunks, c.layers, c.hidden, &got).is_ok());
      for (int64_t l = 0; l < c.layers; ++l)
        EXPECT_TRUE(got[static_cast<size_t>(l)] == want[static_cast<size_t>(l)])
            << type << " layer " << l << " chunks " << chunks.size();
    }
  }
}

// The device tap and the host tap carry the same rows; the device rows are ready in the
// engine's stream order (copied by work enqueued there, as a consumer must).
TEST_F(LlamaCudaEngineTest, DeviceTapMatchesHostTap) {
  const LlamaWeights w = tiny_llama("llama", 64, 3);
  auto gpu = cuda::LlamaCudaEngine::create(w, {cuda::KvDtype::kFp8, true, 0});
  ASSERT_TRUE(gpu.is_ok());
  const int64_t H = w.config.hidden;
  std::vector<uint16_t> dev_rows;
  int events = 0;
  auto tap = [&](const TapEvent& e) {
    ++events;
    ASSERT_NE(e.x_device, nullptr);
    ASSERT_NE(e.stream, nullptr);
    std::vector<uint16_t> back(static_cast<size_t>(e.n_tokens * H));
    cudaMemcpyAsync(back.data(), e.x_device, back.size() * 2, cudaMemcpyDeviceToHost,
                    static_cast<cudaStream_t>(e.stream));
    cudaStreamSynchronize(static_cast<cudaStream_t>(e.stream));
    EXPECT_EQ(0, std::memcmp(back.data(), e.x_bf16, back.size() * 2)) << "layer " << e.layer;
  };
  ASSERT_TRUE((*gpu)->prefill_chunk(random_ids(70, w.config.vocab, 1), tap).is_ok());
  EXPECT_EQ(events, w.config.layers);
}

TEST_F(LlamaCudaEngineTest, RefusesBadInputBeforeChangingAnything) {
  const LlamaWeights w = tiny_llama("llama", 64, 3);
  auto gpu = cuda::LlamaCudaEngine::create(w);
  ASSERT_TRUE(gpu.is_ok());
  const Status st = (*gpu)->prefill_chunk({1, 2, 512}, nullptr);
  EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.to_string();
  EXPECT_EQ((*gpu)->cached_tokens(), 0);
  LlamaWeights odd = tiny_llama("llama", 64, 3);
  odd.config.head_dim = 32;
  auto refused = cuda::LlamaCudaEngine::create(odd);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find("head_dim"), std::string::npos);
}

// A cache that spans many pages and grows across chunks (and a reset that reuses it) gives the
// same rows as one chunk, within the tolerance.
TEST_F(LlamaCudaEngineTest, LongSequenceAcrossPagesAndReset) {
  const LlamaWeights w = tiny_llama("llama", 128, 5);
  const LlamaConfig& c = w.config;
  const std::vector<int32_t> ids = random_ids(2000, c.vocab, 2);
  auto gpu = cuda::LlamaCudaEngine::create(w, {cuda::KvDtype::kBf16, true, 0});
  ASSERT_TRUE(gpu.is_ok());
  Taps one, many;
  ASSERT_TRUE(run_schedule(**gpu, ids, {2000}, c.layers, c.hidden, &one).is_ok());
  (*gpu)->reset();
  ASSERT_TRUE(run_schedule(**gpu, ids, {700, 64, 63, 1173}, c.layers, c.hidden, &many).is_ok());
  for (int64_t l = 0; l < c.layers; ++l)
    EXPECT_LT(rel_rms(many[static_cast<size_t>(l)], one[static_cast<size_t>(l)]), kTolBf16Cache);
  EXPECT_GT((*gpu)->cache_bytes(), 0u);
}

}  // namespace
}  // namespace hetero
