// The llama CUDA engine against the CPU engine (the decoder's arithmetic): every layer's
// attention input within a stated tolerance, for every variant of the family, both cache dtypes
// and several chunk schedules.
//
// Tolerance: the relative RMS error ||gpu - cpu|| / ||cpu|| of each layer's tap. The GPU sums in
// another order (tensor cores, flash attention), so bf16 roundings differ by an ulp here and
// there (about 4e-3 relative) and the differences grow through the layers; an FP8 cache adds
// e4m3's 2^-4 relative rounding of K and V. A wrong position, head or mask shows as an error of
// tens of percent, far above both bounds.
//
// FP8 weights (WeightDtype::kFp8) round every projection weight and its input to e4m3 (3 mantissa
// bits: about 3e-2 relative RMS per GEMM output, tests/gpu/fp8_gemm_test.cc), on the residual
// branches only: the embedding, the norms and lm_head stay bf16.
#include "engine/cuda/llama_cuda.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>

#include "common/bf16.h"
#include "cuda_test_base.h"
#include "engine/llama_cpu.h"
#include "kernels/cuda/device.h"
#include "llama_test_weights.h"

namespace hetero {
namespace {

constexpr double kTolBf16Cache = 1.5e-2;
constexpr double kTolFp8Cache = 6e-2;
constexpr double kTolFp8Weights = 8e-2;          // bf16 cache
constexpr double kTolFp8WeightsFp8Cache = 1e-1;  // both roundings, adding about in quadrature

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

struct Case {
  std::string type;
  int64_t head_dim;
  cuda::KvDtype kv;
  bool scaled = false;  // llama: llama3 rope on traditional pairs; qwen2: YaRN
  int quant_bits = 0;   // > 0: an mlx-lm-quantized checkpoint (affine, group 64, unless mx)
  bool mx = false;      // quantized to mxfp4 / mxfp8 (groups of 32)
  int64_t window = 0;   // > 0: layer 1 of 3 is a sliding-window layer over this many positions
};

// Layer 1 of tiny_llama's 3 slides over `window` positions, as mlx-lm's layer_types would say.
void slide_middle_layer(LlamaWeights& w, int64_t window) {
  w.config.sliding_window = window;
  w.config.sliding = {false, true, false};
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.type << " head_dim " << c.head_dim << " " << cuda::kv_dtype_name(c.kv)
      << (c.scaled ? " scaled rope" : "")
      << (c.quant_bits ? " q" + std::to_string(c.quant_bits) : "") << (c.mx ? " mx" : "")
      << (c.window ? " window " + std::to_string(c.window) : "");
}

std::string case_name(const ::testing::TestParamInfo<Case>& i) {
  return i.param.type + "_d" + std::to_string(i.param.head_dim) + "_" +
         cuda::kv_dtype_name(i.param.kv) + (i.param.scaled ? "_scaled" : "") +
         (i.param.quant_bits ? "_q" + std::to_string(i.param.quant_bits) : "") +
         (i.param.mx ? "_mx" : "") + (i.param.window ? "_w" + std::to_string(i.param.window) : "");
}

nlohmann::json scaling_of(const Case& k) {
  if (!k.scaled) return nullptr;
  if (k.type == "llama")
    return {{"rope_type", "llama3"}, {"factor", 8.0}, {"original_max_position_embeddings", 64}};
  return {{"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 128}};
}

class LlamaCudaVsCpu : public CudaDeviceTest, public ::testing::WithParamInterface<Case> {};

// The GPU engine with options o against the CPU engine over each chunk schedule: every layer's
// attention input and the last token's logits within tol (2 tol for the logits) in relative RMS.
void expect_close_to_cpu(const Case& k, const cuda::LlamaCudaOptions& o, double tol,
                         const std::vector<std::vector<int64_t>>& schedules, const char* label) {
  LlamaWeights w = tiny_llama(k.type, k.head_dim, 7, scaling_of(k), k.scaled && k.type == "llama");
  if (k.quant_bits)
    quantize_projections(w, k.quant_bits, k.mx ? 32 : 64,
                         !k.mx               ? "affine"
                         : k.quant_bits == 4 ? "mxfp4"
                                             : "mxfp8");
  if (k.window) slide_middle_layer(w, k.window);
  const LlamaConfig& c = w.config;
  const std::vector<int32_t> ids = random_ids(300, c.vocab, 11);
  LlamaCpuEngine cpu(w, LlamaCpuEngine::Gemm::kOrdered);
  Taps want;
  ASSERT_TRUE(run_schedule(cpu, ids, {300}, c.layers, c.hidden, &want).is_ok());
  for (const std::vector<int64_t>& chunks : schedules) {
    auto gpu = cuda::LlamaCudaEngine::create(w, o);
    ASSERT_TRUE(gpu.is_ok()) << gpu.status().to_string();
    Taps got;
    ASSERT_TRUE(run_schedule(**gpu, ids, chunks, c.layers, c.hidden, &got).is_ok());
    ASSERT_TRUE((*gpu)->synchronize().is_ok());
    for (int64_t l = 0; l < c.layers; ++l) {
      const double e = rel_rms(got[static_cast<size_t>(l)], want[static_cast<size_t>(l)]);
      std::printf("[ %s%s d%lld %s cache, chunks %zu ] layer %lld rel rms %.2e\n", label,
                  k.type.c_str(), static_cast<long long>(k.head_dim), cuda::kv_dtype_name(k.kv),
                  chunks.size(), static_cast<long long>(l), e);
      EXPECT_LT(e, tol) << "layer " << l;
      if (l == 0) {
        EXPECT_LT(e, 2e-3) << "layer 0's input is the embedding's norm: no projection yet";
      }
    }
    auto logits = (*gpu)->last_logits();
    ASSERT_TRUE(logits.is_ok());
    const std::vector<float> ref = cpu.last_logits();
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); ++i)
      num += std::pow((*logits)[i] - ref[i], 2), den += std::pow(ref[i], 2);
    std::printf("[ %s%s ] logits rel rms %.2e\n", label, k.type.c_str(), std::sqrt(num / den));
    EXPECT_LT(std::sqrt(num / den), 2 * tol);
  }
}

// The engine options every tolerance test starts from: the case's cache dtype, the host tap.
cuda::LlamaCudaOptions tap_options(const Case& k) {
  cuda::LlamaCudaOptions o;
  o.kv_dtype = k.kv;
  o.host_tap = true;
  return o;
}

TEST_P(LlamaCudaVsCpu, AttentionInputsWithinTolerance) {
  const Case& k = GetParam();
  const cuda::LlamaCudaOptions o = tap_options(k);
  expect_close_to_cpu(k, o, k.kv == cuda::KvDtype::kFp8 ? kTolFp8Cache : kTolBf16Cache,
                      {{300}, {64, 64, 172}, {37, 200, 5, 1, 57}}, "");
}

INSTANTIATE_TEST_SUITE_P(
    Variants, LlamaCudaVsCpu,
    ::testing::Values(
        Case{"llama", 64, cuda::KvDtype::kBf16}, Case{"llama", 64, cuda::KvDtype::kFp8},
        Case{"llama", 128, cuda::KvDtype::kFp8}, Case{"qwen2", 64, cuda::KvDtype::kBf16},
        Case{"qwen3", 128, cuda::KvDtype::kBf16}, Case{"llama", 64, cuda::KvDtype::kBf16, true},
        Case{"qwen2", 64, cuda::KvDtype::kFp8, true},
        // windows within a key tile and across tiles
        Case{"llama", 64, cuda::KvDtype::kBf16, false, 0, false, 40},
        Case{"llama", 128, cuda::KvDtype::kFp8, false, 0, false, 100}),
    case_name);

// Both attention kernels over a bf16 cache, each named: cuDNN's where the build has it (a build
// with it that cannot run it on this GPU fails here), the engine's own always. The schedules
// cover one chunk, page-aligned chunks and ragged ones down to a single row.
class LlamaCudaAttention : public CudaDeviceTest, public ::testing::WithParamInterface<Case> {};

TEST_P(LlamaCudaAttention, OwnAndCudnnWithinTolerance) {
  const Case& k = GetParam();
  for (const cuda::AttentionKernel kernel :
       {cuda::AttentionKernel::kOwn, cuda::AttentionKernel::kCudnn}) {
    if (kernel == cuda::AttentionKernel::kCudnn && !cuda::cudnn_attention_built()) {
      std::printf("[ this build has no cuDNN attention: the own kernel only ]\n");
      continue;
    }
    cuda::LlamaCudaOptions o = tap_options(k);
    o.attention = kernel;
    expect_close_to_cpu(
        k, o, kTolBf16Cache, {{300}, {64, 64, 172}, {37, 200, 5, 1, 57}},
        kernel == cuda::AttentionKernel::kOwn ? "own attention " : "cuDNN attention ");
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, LlamaCudaAttention,
                         ::testing::Values(Case{"llama", 64, cuda::KvDtype::kBf16},
                                           Case{"qwen3", 128, cuda::KvDtype::kBf16},
                                           Case{"llama", 64, cuda::KvDtype::kBf16, true}),
                         case_name);

class LlamaCudaFp8Weights : public CudaDeviceTest, public ::testing::WithParamInterface<Case> {};

TEST_P(LlamaCudaFp8Weights, AttentionInputsWithinTolerance) {
  const Case& k = GetParam();
  cuda::LlamaCudaOptions o = tap_options(k);
  o.weight_dtype = cuda::WeightDtype::kFp8;
  // One chunk, and chunks of awkward lengths (the FP8 GEMMs pad rows to 16).
  expect_close_to_cpu(k, o, k.kv == cuda::KvDtype::kFp8 ? kTolFp8WeightsFp8Cache : kTolFp8Weights,
                      {{300}, {37, 200, 5, 1, 57}}, "fp8 weights ");
}

INSTANTIATE_TEST_SUITE_P(Variants, LlamaCudaFp8Weights,
                         ::testing::Values(Case{"llama", 64, cuda::KvDtype::kBf16},
                                           Case{"qwen2", 64, cuda::KvDtype::kFp8},
                                           Case{"qwen3", 128, cuda::KvDtype::kBf16}),
                         case_name);

// An mlx-lm-quantized checkpoint in fast arithmetic: the engine runs the projections' dequantized
// values (exactly the decoder's) through bf16 GEMMs with f32 sums, while the decoder's (and the
// CPU engine's) quantized matmul rounds every running sum to bf16. That difference is the tap's
// gap against the quantized decoder's attention inputs, printed per layer. An H200 run at
// 4f794b8 measured 0 at layer 0, 2.2-2.3e-2 at layer 1 and 3.1-3.3e-2 at layer 2 (logits
// 3.0-3.7e-2) for the three cases below; a wrong dequantization (a scale or bias misplaced) is
// off by O(1).
constexpr double kTolQuantized = 5e-2;

class LlamaCudaQuantized : public CudaDeviceTest, public ::testing::WithParamInterface<Case> {};

TEST_P(LlamaCudaQuantized, AttentionInputsWithinTolerance) {
  const Case& k = GetParam();
  cuda::LlamaCudaOptions o = tap_options(k);
  o.arith = cuda::LlamaCudaArith::kFast;
  expect_close_to_cpu(k, o, kTolQuantized, {{300}, {37, 200, 5, 1, 57}}, "quantized ");
}

INSTANTIATE_TEST_SUITE_P(Variants, LlamaCudaQuantized,
                         ::testing::Values(Case{"llama", 64, cuda::KvDtype::kBf16, false, 4},
                                           Case{"qwen2", 64, cuda::KvDtype::kBf16, false, 8},
                                           Case{"qwen3", 128, cuda::KvDtype::kFp8, false, 4},
                                           Case{"llama", 64, cuda::KvDtype::kBf16, false, 4, true},
                                           Case{"qwen2", 64, cuda::KvDtype::kBf16, false, 8, true}),
                         case_name);

class LlamaCudaEngineTest : public CudaDeviceTest {};

TEST_F(LlamaCudaEngineTest, ExactArithmeticRefusesAQuantizedCheckpoint) {
  LlamaWeights w = tiny_llama("llama", 64, 7);
  quantize_projections(w, 4, 64);
  cuda::LlamaCudaOptions o;
  o.arith = cuda::LlamaCudaArith::kExact;
  auto e = cuda::LlamaCudaEngine::create(w, o);
  ASSERT_FALSE(e.is_ok());
  EXPECT_NE(e.status().message().find("4-bit affine, group 64"), std::string::npos)
      << e.status().message();
}

// FP8 weights replace the bf16 projections on the device (e4m3 bytes plus one float32 scale per
// 128x128 block, rows padded to 4 scales); everything else is unchanged.
TEST_F(LlamaCudaEngineTest, Fp8WeightsHoldOnlyTheQuantizedProjections) {
  const LlamaWeights w = tiny_llama("llama", 64, 3);
  const LlamaConfig& c = w.config;
  cuda::LlamaCudaOptions o;
  auto bf16 = cuda::LlamaCudaEngine::create(w, o);
  ASSERT_TRUE(bf16.is_ok());
  o.weight_dtype = cuda::WeightDtype::kFp8;
  auto fp8 = cuda::LlamaCudaEngine::create(w, o);
  ASSERT_TRUE(fp8.is_ok()) << fp8.status().to_string();
  const int64_t H = c.hidden, qd = c.heads * c.head_dim, kvd = c.kv_heads * c.head_dim;
  const int64_t I = c.intermediate;
  size_t bf16_bytes = 0, fp8_bytes = 0;
  for (auto [n, k] : {std::pair<int64_t, int64_t>{qd + 2 * kvd, H}, {H, qd}, {2 * I, H}, {H, I}}) {
    bf16_bytes += static_cast<size_t>(n * k) * 2;
    fp8_bytes +=
        static_cast<size_t>(n * k + cuda::fp8_blocks(n) * cuda::fp8_weight_scale_ld(k) * 4);
  }
  const size_t layers = static_cast<size_t>(c.layers);
  EXPECT_EQ((*fp8)->weight_bytes(),
            (*bf16)->weight_bytes() - layers * bf16_bytes + layers * fp8_bytes);
}

TEST_F(LlamaCudaEngineTest, Fp8WeightsRefuseTheExactArithmetic) {
  const LlamaWeights w = tiny_llama("llama", 64, 3);
  cuda::LlamaCudaOptions o;
  o.arith = cuda::LlamaCudaArith::kExact;
  o.weight_dtype = cuda::WeightDtype::kFp8;
  auto gpu = cuda::LlamaCudaEngine::create(w, o);
  ASSERT_FALSE(gpu.is_ok());
  EXPECT_EQ(gpu.status().code(), Code::kInvalidArgument);
  EXPECT_NE(gpu.status().message().find("fp8 weights"), std::string::npos);
}

// No device needed.
TEST(LlamaCudaOptionsTest, WeightDtypeNames) {
  EXPECT_EQ(*cuda::parse_weight_dtype("bf16"), cuda::WeightDtype::kBf16);
  EXPECT_EQ(*cuda::parse_weight_dtype("fp8"), cuda::WeightDtype::kFp8);
  EXPECT_EQ(cuda::parse_weight_dtype("int4").status().code(), Code::kInvalidArgument);
  EXPECT_STREQ(cuda::weight_dtype_name(cuda::WeightDtype::kFp8), "fp8");
  EXPECT_STREQ(cuda::weight_dtype_name(cuda::WeightDtype::kBf16), "bf16");
}

// The exact path reproduces the CPU engine (and so the decoder) bit for bit, whatever the chunks.
// The exact path over each chunk schedule gives `want`'s taps (the CPU engine's), bit for bit.
void expect_exact_taps(const LlamaWeights& w, const std::vector<int32_t>& ids, const Taps& want,
                       const std::vector<std::vector<int64_t>>& schedules,
                       const std::string& label) {
  const LlamaConfig& c = w.config;
  cuda::LlamaCudaOptions o;
  o.host_tap = true;
  o.arith = cuda::LlamaCudaArith::kExact;
  for (const std::vector<int64_t>& chunks : schedules) {
    auto gpu = cuda::LlamaCudaEngine::create(w, o);
    ASSERT_TRUE(gpu.is_ok()) << gpu.status().to_string();
    Taps got;
    ASSERT_TRUE(run_schedule(**gpu, ids, chunks, c.layers, c.hidden, &got).is_ok());
    for (int64_t l = 0; l < c.layers; ++l)
      EXPECT_TRUE(got[static_cast<size_t>(l)] == want[static_cast<size_t>(l)])
          << label << " layer " << l << " chunks " << chunks.size();
  }
}

TEST_F(LlamaCudaEngineTest, ExactArithmeticIsBitIdenticalToCpu) {
  for (const VariantCase& v : variant_cases()) {
    const std::string& type = v.type;
    const nlohmann::json& scaling = v.scaling;
    const LlamaWeights w = tiny_llama(type, 64, 13, scaling, v.traditional);
    const LlamaConfig& c = w.config;
    const std::vector<int32_t> ids = random_ids(260, c.vocab, 17);
    LlamaCpuEngine cpu(w, LlamaCpuEngine::Gemm::kOrdered);
    Taps want;
    ASSERT_TRUE(run_schedule(cpu, ids, {100, 160}, c.layers, c.hidden, &want).is_ok());
    expect_exact_taps(w, ids, want, {{100, 160}, {260}, {7, 250, 3}}, type + " " + scaling.dump());
  }
}

// A sliding-window layer past its window: the exact path sums each query's window as the CPU
// engine does (the decoder's multi-token calls), bit for bit, whatever the chunks; and the
// window matters here (the CPU engine without it gives other inputs to the layer after it).
TEST_F(LlamaCudaEngineTest, ExactSlidingWindowIsBitIdenticalToCpu) {
  LlamaWeights w = tiny_llama("llama", 64, 13);
  slide_middle_layer(w, 40);
  const LlamaConfig& c = w.config;
  const std::vector<int32_t> ids = random_ids(260, c.vocab, 17);
  LlamaCpuEngine cpu(w, LlamaCpuEngine::Gemm::kOrdered);
  Taps want;
  ASSERT_TRUE(run_schedule(cpu, ids, {100, 160}, c.layers, c.hidden, &want).is_ok());
  LlamaWeights full = w;
  full.config.sliding_window = 0, full.config.sliding.clear();
  LlamaCpuEngine cpu_full(full, LlamaCpuEngine::Gemm::kOrdered);
  Taps unwindowed;
  ASSERT_TRUE(run_schedule(cpu_full, ids, {260}, c.layers, c.hidden, &unwindowed).is_ok());
  EXPECT_TRUE(unwindowed[1] == want[1]);  // layer 1's input: before its attention
  EXPECT_FALSE(unwindowed[2] == want[2]);
  expect_exact_taps(w, ids, want, {{100, 160}, {260}, {7, 250, 3}, {39, 1, 1, 219}}, "window 40");
}

// A dynamic rope past max_position_embeddings (100 here): every decoder call ropes its rows with
// its own base. With the same calls the exact path is the CPU engine's bit for bit on both of
// mlx-lm's paths, the fast one within its tolerance; a tail there is refused, as on the CPU.
TEST_F(LlamaCudaEngineTest, DynamicRopeFollowsTheDecodersCallsAsCpu) {
  LlamaWeights w = tiny_llama("llama", 64, 13, {{"type", "dynamic"}, {"factor", 3.0}});
  w.config.rope_config.max_position_embeddings = 100;
  w.config.rope = llama_rope(w.config.rope_config).value();
  const LlamaConfig& c = w.config;
  const std::vector<int32_t> ids = random_ids(260, c.vocab, 17);
  for (const bool batched : {true, false}) {
    const std::vector<int64_t> calls =
        batched ? std::vector<int64_t>{128, 100, 32} : std::vector<int64_t>{128, 100, 31, 1};
    LlamaCpuEngine cpu(w, LlamaCpuEngine::Gemm::kOrdered);
    ASSERT_TRUE(cpu.set_decoder_calls(calls, 0, batched).is_ok());
    Taps want;
    ASSERT_TRUE(run_schedule(cpu, ids, {100, 160}, c.layers, c.hidden, &want).is_ok());
    LlamaCpuEngine plain(w, LlamaCpuEngine::Gemm::kOrdered);
    Taps unroped;
    ASSERT_TRUE(run_schedule(plain, ids, {260}, c.layers, c.hidden, &unroped).is_ok());
    EXPECT_FALSE(unroped[1] == want[1]) << "the calls' bases change what layer 1 sees";
    for (const cuda::LlamaCudaArith arith :
         {cuda::LlamaCudaArith::kExact, cuda::LlamaCudaArith::kFast}) {
      cuda::LlamaCudaOptions o;
      o.host_tap = true;
      o.kv_dtype = cuda::KvDtype::kBf16;
      o.arith = arith;
      for (const std::vector<int64_t>& chunks :
           {std::vector<int64_t>{100, 160}, std::vector<int64_t>{7, 250, 3}}) {
        auto gpu = cuda::LlamaCudaEngine::create(w, o);
        ASSERT_TRUE(gpu.is_ok()) << gpu.status().to_string();
        ASSERT_TRUE((*gpu)->set_decoder_calls(calls, 0, batched).is_ok());
        EXPECT_TRUE((*gpu)->rows_follow_calls(calls, 0, batched));
        Taps got;
        ASSERT_TRUE(run_schedule(**gpu, ids, chunks, c.layers, c.hidden, &got).is_ok());
        ASSERT_TRUE((*gpu)->synchronize().is_ok());
        for (int64_t l = 0; l < c.layers; ++l) {
          if (arith == cuda::LlamaCudaArith::kExact) {
            EXPECT_TRUE(got[static_cast<size_t>(l)] == want[static_cast<size_t>(l)])
                << "batched " << batched << " layer " << l << " chunks " << chunks.size();
          } else {
            EXPECT_LT(rel_rms(got[static_cast<size_t>(l)], want[static_cast<size_t>(l)]),
                      kTolBf16Cache)
                << "batched " << batched << " layer " << l;
          }
        }
        auto tail = (*gpu)->set_decoder_calls({100, 32}, 128, batched);
        ASSERT_FALSE(tail.is_ok());
        EXPECT_NE(tail.message().find("a tail from row 128"), std::string::npos) << tail.message();
      }
    }
  }
}

// The exact path's state, handed out and loaded into a fresh engine (the prefill host's prefix
// cache), continues the sequence bit for bit; and it is the CPU engine's state, byte for byte.
TEST_F(LlamaCudaEngineTest, ExactStateSavedAndLoadedContinuesTheSequence) {
  const LlamaWeights w = tiny_llama("llama", 64, 13, nlohmann::json(), false);
  const LlamaConfig& c = w.config;
  const std::vector<int32_t> ids = random_ids(400, c.vocab, 23);
  const std::vector<int32_t> head(ids.begin(), ids.begin() + 256),
      tail(ids.begin() + 256, ids.end());
  cuda::LlamaCudaOptions o;
  o.host_tap = true;
  o.arith = cuda::LlamaCudaArith::kExact;
  // Rows of the tail's taps, per layer, from whichever engine ran it.
  auto tail_taps = [&](cuda::LlamaCudaEngine& e, std::vector<std::vector<uint16_t>>* out) {
    out->assign(static_cast<size_t>(c.layers), {});
    return e.prefill_chunk(tail, [&](const TapEvent& ev) {
      ASSERT_EQ(ev.pos0, 256);
      auto& v = (*out)[static_cast<size_t>(ev.layer)];
      v.assign(ev.x_bf16, ev.x_bf16 + ev.n_tokens * c.hidden);
    });
  };
  auto whole = cuda::LlamaCudaEngine::create(w, o);
  ASSERT_TRUE(whole.is_ok()) << whole.status().to_string();
  ASSERT_TRUE((*whole)->reserve(400, 256).is_ok());
  ASSERT_TRUE((*whole)->prefill_chunk(head, {}).is_ok());
  ASSERT_GT((*whole)->state_row_bytes(), 0);
  std::vector<uint8_t> state(static_cast<size_t>(256 * (*whole)->state_row_bytes()));
  ASSERT_TRUE((*whole)->save_state(0, 256, state.data()).is_ok());
  std::vector<std::vector<uint16_t>> want, got;
  ASSERT_TRUE(tail_taps(**whole, &want).is_ok());

  auto resumed = cuda::LlamaCudaEngine::create(w, o);
  ASSERT_TRUE(resumed.is_ok());
  ASSERT_TRUE((*resumed)->reserve(400, 144).is_ok());
  EXPECT_FALSE((*resumed)->load_state(8, 256, state.data()).is_ok());  // not at the end
  ASSERT_TRUE((*resumed)->load_state(0, 256, state.data()).is_ok());
  EXPECT_EQ((*resumed)->cached_tokens(), 256);
  ASSERT_TRUE(tail_taps(**resumed, &got).is_ok());
  for (int64_t l = 0; l < c.layers; ++l)
    EXPECT_TRUE(got[static_cast<size_t>(l)] == want[static_cast<size_t>(l)]) << "layer " << l;

  LlamaCpuEngine cpu(w, LlamaCpuEngine::Gemm::kOrdered);
  ASSERT_TRUE(cpu.reserve(256, 256).is_ok());
  ASSERT_TRUE(cpu.prefill_chunk(head, {}).is_ok());
  ASSERT_EQ(cpu.state_row_bytes(), (*whole)->state_row_bytes());
  std::vector<uint8_t> cpu_state(state.size());
  ASSERT_TRUE(cpu.save_state(0, 256, cpu_state.data()).is_ok());
  EXPECT_TRUE(cpu_state == state);

  cuda::LlamaCudaOptions fast = o;
  fast.arith = cuda::LlamaCudaArith::kFast;
  auto f = cuda::LlamaCudaEngine::create(w, fast);
  ASSERT_TRUE(f.is_ok());
  EXPECT_EQ((*f)->state_row_bytes(), 0);  // its pages are its own: a tail's prefix is recomputed
}

// The device tap and the host tap carry the same rows; the device rows are ready in the
// engine's stream order (copied by work enqueued there, as a consumer must).
// An engine on the second GPU runs there whichever thread calls it (a new thread starts on
// device 0, as the service's do), gives the same bits as one on the first (exact arithmetic),
// and leaves the creating thread's current device alone.
TEST_F(LlamaCudaEngineTest, RunsOnItsOwnDeviceFromAnyThread) {
  int devices = 0;
  cudaGetDeviceCount(&devices);
  if (devices < 2) GTEST_SKIP() << "one GPU: no second device to run on";
  const LlamaWeights w = tiny_llama("qwen3", 64, 31);
  const LlamaConfig& c = w.config;
  const std::vector<int32_t> ids = random_ids(150, c.vocab, 8);
  cuda::LlamaCudaOptions o;
  o.host_tap = true;
  o.arith = cuda::LlamaCudaArith::kExact;
  auto first = cuda::LlamaCudaEngine::create(w, o);
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  o.device = 1;
  auto second = cuda::LlamaCudaEngine::create(w, o);
  ASSERT_TRUE(second.is_ok()) << second.status().to_string();
  EXPECT_EQ(cuda::current_device(), 0);
  Taps want, got;
  ASSERT_TRUE(run_schedule(**first, ids, {150}, c.layers, c.hidden, &want).is_ok());
  Status st;
  std::thread caller([&] {
    st = run_schedule(**second, ids, {100, 50}, c.layers, c.hidden, &got);
  });
  caller.join();
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  for (int64_t l = 0; l < c.layers; ++l)
    EXPECT_EQ(got[static_cast<size_t>(l)], want[static_cast<size_t>(l)]) << "layer " << l;
  o.device = devices;
  EXPECT_EQ(cuda::LlamaCudaEngine::create(w, o).status().code(), Code::kInvalidArgument);
}

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
// One long chunk against chunks whose cache grows mid-sequence (a fresh engine: 700 rows take 16
// pages, the last chunk grows them, by copy where cuDNN reads one slab per layer), then the
// same engine again after reset (no growth), for each attention kernel this build has.
TEST_F(LlamaCudaEngineTest, LongSequenceAcrossPagesAndReset) {
  const LlamaWeights w = tiny_llama("llama", 128, 5);
  const LlamaConfig& c = w.config;
  const std::vector<int32_t> ids = random_ids(2000, c.vocab, 2);
  for (const cuda::AttentionKernel kernel :
       {cuda::AttentionKernel::kOwn, cuda::AttentionKernel::kCudnn}) {
    if (kernel == cuda::AttentionKernel::kCudnn && !cuda::cudnn_attention_built()) continue;
    cuda::LlamaCudaOptions o{cuda::KvDtype::kBf16, true, 0};
    o.attention = kernel;
    auto gpu = cuda::LlamaCudaEngine::create(w, o);
    ASSERT_TRUE(gpu.is_ok()) << gpu.status().to_string();
    Taps one, many, again;
    ASSERT_TRUE(run_schedule(**gpu, ids, {2000}, c.layers, c.hidden, &one).is_ok());
    auto fresh = cuda::LlamaCudaEngine::create(w, o);
    ASSERT_TRUE(fresh.is_ok());
    ASSERT_TRUE(run_schedule(**fresh, ids, {700, 64, 63, 1173}, c.layers, c.hidden, &many).is_ok());
    ASSERT_TRUE((*fresh)->reset().is_ok());
    ASSERT_TRUE(
        run_schedule(**fresh, ids, {700, 64, 63, 1173}, c.layers, c.hidden, &again).is_ok());
    for (int64_t l = 0; l < c.layers; ++l) {
      EXPECT_LT(rel_rms(many[static_cast<size_t>(l)], one[static_cast<size_t>(l)]), kTolBf16Cache)
          << (*gpu)->attention_name() << ", layer " << l;
      EXPECT_EQ(again[static_cast<size_t>(l)], many[static_cast<size_t>(l)])
          << "the same schedule after reset, layer " << l;
    }
    EXPECT_GT((*gpu)->cache_bytes(), 0u);
  }
}

TEST_F(LlamaCudaEngineTest, TheAttentionKernelIsChosenAndNamed) {
  const LlamaWeights w = tiny_llama("llama", 64, 3);
  cuda::LlamaCudaOptions o;  // kAuto, an fp8 cache
  auto fp8 = cuda::LlamaCudaEngine::create(w, o);
  ASSERT_TRUE(fp8.is_ok());
  EXPECT_NE((*fp8)->attention_name().find("own flash kernel"), std::string::npos);
  EXPECT_NE((*fp8)->attention_name().find("fp8"), std::string::npos) << "says why not cuDNN's";
  o.attention = cuda::AttentionKernel::kCudnn;
  auto refused = cuda::LlamaCudaEngine::create(w, o);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find("bf16"), std::string::npos);
  o.kv_dtype = cuda::KvDtype::kBf16;
  o.attention = cuda::AttentionKernel::kAuto;
  auto bf16 = cuda::LlamaCudaEngine::create(w, o);
  ASSERT_TRUE(bf16.is_ok());
  const std::string name = (*bf16)->attention_name();
  std::printf("[ auto over a bf16 cache: %s ]\n", name.c_str());
  if (cuda::cudnn_attention_built())
    EXPECT_EQ(name.rfind("cuDNN", 0), 0u) << "this build has cuDNN attention: " << name;
  else
    EXPECT_NE(name.find("own flash kernel"), std::string::npos);
  o.arith = cuda::LlamaCudaArith::kExact;
  auto exact = cuda::LlamaCudaEngine::create(w, o);
  ASSERT_TRUE(exact.is_ok());
  EXPECT_EQ((*exact)->attention_name(), "-");
  // cuDNN's graph here attends over the whole past: a model with sliding layers gets the own
  // kernel, and saying cuDNN is refused.
  LlamaWeights sliding = tiny_llama("llama", 64, 3);
  slide_middle_layer(sliding, 40);
  o.arith = cuda::LlamaCudaArith::kFast;
  o.attention = cuda::AttentionKernel::kAuto;
  auto own = cuda::LlamaCudaEngine::create(sliding, o);
  ASSERT_TRUE(own.is_ok());
  EXPECT_NE((*own)->attention_name().find("own flash kernel"), std::string::npos);
  EXPECT_NE((*own)->attention_name().find("sliding window"), std::string::npos);
  o.attention = cuda::AttentionKernel::kCudnn;
  auto no = cuda::LlamaCudaEngine::create(sliding, o);
  ASSERT_FALSE(no.is_ok());
  EXPECT_NE(no.status().message().find("sliding-window"), std::string::npos);
}

}  // namespace
}  // namespace hetero
