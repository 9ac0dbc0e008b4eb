// Admission on both CUDA engines (llama, DeepSeek-V4; the small random models of their own
// tests): reserve() takes all the memory a request's chunks use, a device-memory budget refuses a
// prompt past it with kResourceExhausted saying the bytes asked and free, and the same engine
// then serves a short request with the same attention inputs as an engine that never failed.
// Regression guard: a failed allocation used to abort the process (HETERO_CUDA_OK).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "../common/dsv4_model_weights.h"
#include "bridge/llama_program.h"
#include "cuda_test_base.h"
#include "decode/prefill_client.h"
#include "engine/cuda/dsv4_cuda.h"
#include "engine/cuda/llama_cuda.h"
#include "kernels/cuda/resource.h"
#include "llama_test_weights.h"
#include "prefill/service.h"

namespace hetero {
namespace {

class EngineMemoryTest : public CudaDeviceTest {};

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// A refusal that reads as an out-of-memory report for the budget: what was asked and what is
// free of it.
void expect_budget_refusal(const Status& st, int64_t budget) {
  EXPECT_EQ(st.code(), Code::kResourceExhausted) << st.to_string();
  EXPECT_TRUE(contains(st.message(), "asked ")) << st.message();
  EXPECT_TRUE(contains(st.message(), " free of the " + format_bytes(budget) + " budget"))
      << st.message();
}

// Every layer's tap rows over the chunks, [layer][T * hidden] (host tap).
template <class Engine>
Status llama_taps(Engine& e, const std::vector<int32_t>& ids, const std::vector<int64_t>& chunks,
                  int64_t layers, int64_t hidden, std::vector<std::vector<uint16_t>>* taps) {
  taps->assign(static_cast<size_t>(layers),
               std::vector<uint16_t>(ids.size() * static_cast<size_t>(hidden)));
  auto tap = [&](const TapEvent& ev) {
    std::memcpy(&(*taps)[static_cast<size_t>(ev.layer)][static_cast<size_t>(ev.pos0 * hidden)],
                ev.x_bf16, static_cast<size_t>(ev.n_tokens * hidden) * 2);
  };
  int64_t pos = 0;
  for (int64_t n : chunks) {
    std::vector<int32_t> part(ids.begin() + pos, ids.begin() + pos + n);
    HETERO_RETURN_IF_ERROR(e.prefill_chunk(part, tap));
    pos += n;
  }
  return e.synchronize();
}

TEST_F(EngineMemoryTest, LlamaRefusesAPromptPastItsBudgetThenServesTheNextRequest) {
  for (cuda::LlamaCudaArith arith : {cuda::LlamaCudaArith::kFast, cuda::LlamaCudaArith::kExact}) {
    SCOPED_TRACE(arith == cuda::LlamaCudaArith::kFast ? "fast" : "exact");
    const LlamaWeights w = tiny_llama("llama", 64, 7);
    const LlamaConfig& c = w.config;
    const std::vector<int32_t> ids = random_ids(300, c.vocab, 11);
    const std::vector<int64_t> chunks = {128, 128, 44};
    cuda::LlamaCudaOptions o;
    o.host_tap = true;
    o.arith = arith;
    // An engine without a budget: what a 300-token request holds once reserved, and its taps.
    auto fresh = cuda::LlamaCudaEngine::create(w, o);
    ASSERT_TRUE(fresh.is_ok()) << fresh.status().to_string();
    ASSERT_TRUE((*fresh)->reserve(300, 128).is_ok());
    const int64_t held = (*fresh)->device_bytes();
    std::vector<std::vector<uint16_t>> want, got;
    ASSERT_TRUE(llama_taps(**fresh, ids, chunks, c.layers, c.hidden, &want).is_ok());
    EXPECT_EQ((*fresh)->device_bytes(), held) << "the chunks allocated past their reservation";

    // Exactly that much as the budget: a long prompt is refused, the short one fits.
    o.device_memory_budget_bytes = held;
    auto engine = cuda::LlamaCudaEngine::create(w, o);
    ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
    cuda::LlamaCudaEngine& e = **engine;
    expect_budget_refusal(e.reserve(int64_t{1} << 20, 128), held);
    EXPECT_LT(e.device_bytes(), held) << "the refusal kept memory the next request needs";
    ASSERT_TRUE(e.reserve(300, 128).is_ok());
    ASSERT_TRUE(llama_taps(e, ids, chunks, c.layers, c.hidden, &got).is_ok());
    EXPECT_EQ(e.device_bytes(), held);
    for (int64_t l = 0; l < c.layers; ++l)
      EXPECT_EQ(got[static_cast<size_t>(l)], want[static_cast<size_t>(l)]) << "layer " << l;
  }
}

// The memory floor on the GPU: a prompt past the device budget is sealed at the longest prefix of
// whole chunks the engine can reserve, its rows verified on the decode side; the engine then
// serves a request that fits, whole.
TEST_F(EngineMemoryTest, LlamaPastItsBudgetTheServiceSealsAtTheLongestPrefixThatFits) {
  const LlamaWeights w = tiny_llama("llama", 64, 7);
  cuda::LlamaCudaOptions o;
  o.host_tap = true;
  o.arith = cuda::LlamaCudaArith::kFast;
  auto fresh = cuda::LlamaCudaEngine::create(w, o);
  ASSERT_TRUE(fresh.is_ok()) << fresh.status().to_string();
  ASSERT_TRUE((*fresh)->reserve(256, 128).is_ok());
  o.device_memory_budget_bytes = (*fresh)->device_bytes();  // what 256 tokens hold
  auto engine = cuda::LlamaCudaEngine::create(w, o);
  ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
  EngineAdapter<cuda::LlamaCudaEngine> adapter(engine->get());
  const LlamaDecoderWeights d = llama_decoder_weights_of(w, "test");
  LlamaCacheProgram program(&d);
  PrefillService service(
      &adapter, d.layout,
      [&](const PrefillRequest&) -> Result<std::unique_ptr<SegmentProgram>> {
        return std::unique_ptr<SegmentProgram>(std::make_unique<LlamaSegmentProgram>(&program));
      },
      /*default_chunk_tokens=*/128, /*max_tokens=*/1 << 20);
  service.set_memory_floor(true);
  PrefillRequest req;
  req.ids = random_ids(4096, w.config.vocab, 3);
  req.fingerprint = d.layout.fingerprint;
  auto run = [&](const PrefillRequest& r, int64_t* verified) {
    auto assembler = make_assembler(d.layout, static_cast<int64_t>(r.ids.size()));
    StreamReceiver receiver(assembler.get(), std::nullopt);
    const Manifest m = service.run(r, [&](std::string f) {
      receiver.feed(f.data(), f.size());
      return true;
    });
    *verified = assembler->covered_tokens();
    return m;
  };
  int64_t verified = 0;
  const Manifest sealed = run(req, &verified);
  EXPECT_FALSE(sealed.complete);
  EXPECT_GE(sealed.covered_tokens, 256);
  EXPECT_LT(sealed.covered_tokens, 4096);
  EXPECT_EQ(sealed.covered_tokens % 128, 0);
  EXPECT_EQ(verified, sealed.covered_tokens);
  EXPECT_TRUE(contains(sealed.reason, "sealed at the memory floor: " +
                                          std::to_string(sealed.covered_tokens) + " of 4096 "))
      << sealed.reason;
  EXPECT_TRUE(contains(sealed.reason, " budget")) << sealed.reason;
  // One more chunk would not have fitted.
  EXPECT_FALSE((*engine)->reserve(sealed.covered_tokens + 128, 128).is_ok());
  PrefillRequest fits = req;
  fits.ids.resize(200);
  const Manifest whole = run(fits, &verified);
  EXPECT_TRUE(whole.complete) << whole.reason;
  EXPECT_EQ(verified, 200);
}

// Without a budget the device itself refuses: the same Status from a real cudaMalloc, and the
// engine goes on.
TEST_F(EngineMemoryTest, LlamaRefusesAPromptPastTheDeviceThenServesTheNextRequest) {
  const LlamaWeights w = tiny_llama("qwen3", 128, 3);
  const LlamaConfig& c = w.config;
  cuda::LlamaCudaOptions o;
  o.host_tap = true;
  auto engine = cuda::LlamaCudaEngine::create(w, o);
  ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
  cuda::LlamaCudaEngine& e = **engine;
  // 2^31 tokens of FP8 cache: hundreds of GiB per layer, more than any GPU has.
  const Status st = e.reserve(int64_t{1} << 31, 256);
  EXPECT_EQ(st.code(), Code::kResourceExhausted) << st.to_string();
  EXPECT_TRUE(contains(st.message(), "out of device memory on GPU 0: asked ")) << st.message();
  EXPECT_TRUE(contains(st.message(), "for the KV cache")) << st.message();
  EXPECT_TRUE(contains(st.message(), " free of ")) << st.message();
  const std::vector<int32_t> ids = random_ids(200, c.vocab, 5);
  auto fresh = cuda::LlamaCudaEngine::create(w, o);
  ASSERT_TRUE(fresh.is_ok());
  std::vector<std::vector<uint16_t>> want, got;
  ASSERT_TRUE(llama_taps(**fresh, ids, {200}, c.layers, c.hidden, &want).is_ok());
  ASSERT_TRUE(e.reserve(200, 200).is_ok());
  ASSERT_TRUE(llama_taps(e, ids, {200}, c.layers, c.hidden, &got).is_ok());
  EXPECT_EQ(got, want);
}

TEST_F(EngineMemoryTest, Dsv4RefusesAPromptPastItsBudgetThenServesTheNextRequest) {
  const Dsv4Config c = tiny_dsv4_config(/*hash_routed=*/true);
  const Dsv4Weights w = random_dsv4_model(c, 11);
  const std::vector<int32_t> ids = [&] {
    std::vector<int32_t> v(300);
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int32_t>((i * 7919) % c.vocab);
    return v;
  }();
  const std::vector<int64_t> schedule = {100, 100, 100};
  Dsv4CudaOptions o;
  o.host_tap = true;
  auto fresh = Dsv4CudaEngine::create(w, o);
  ASSERT_TRUE(fresh.is_ok()) << fresh.status().to_string();
  ASSERT_TRUE((*fresh)->reserve(300, 100).is_ok());
  const int64_t held = (*fresh)->device_bytes();
  Status st;
  const auto want = dsv4_taps(**fresh, ids, schedule, &st);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ((*fresh)->device_bytes(), held) << "the chunks allocated past their reservation";

  o.device_memory_budget_bytes = held;
  auto engine = Dsv4CudaEngine::create(w, o);
  ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
  Dsv4CudaEngine& e = **engine;
  // 200K tokens: the compressed rows alone are megabytes past the budget (and within what the
  // indexer kernel selects over, which would be a different refusal).
  expect_budget_refusal(e.reserve(200000, 100), held);
  EXPECT_LT(e.device_bytes(), held) << "the refusal kept memory the next request needs";
  ASSERT_TRUE(e.reserve(300, 100).is_ok());
  const auto got = dsv4_taps(e, ids, schedule, &st);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  ASSERT_TRUE(e.synchronize().is_ok());
  EXPECT_EQ(e.device_bytes(), held);
  for (size_t l = 0; l < got.size(); ++l) EXPECT_EQ(got[l], want[l]) << "layer " << l;
}

// A prompt the indexer kernel cannot select over is refused at admission, not mid-stream.
TEST_F(EngineMemoryTest, Dsv4RefusesAPromptTheIndexerCannotTakeAtAdmission) {
  const Dsv4Config c = tiny_dsv4_config(/*hash_routed=*/true);
  auto e = Dsv4CudaEngine::create(random_dsv4_model(c, 2), {});
  ASSERT_TRUE(e.is_ok()) << e.status().to_string();
  // 4M tokens: 1M ratio-4 rows, 131072 HISA block means to sort, past the kernel's 8192.
  const Status st = (*e)->reserve(int64_t{1} << 22, 512);
  EXPECT_EQ(st.code(), Code::kFailedPrecondition) << st.to_string();
  EXPECT_TRUE(contains(st.message(), "8192")) << st.message();
  EXPECT_TRUE((*e)->reserve(64, 64).is_ok());
}

}  // namespace
}  // namespace hetero
