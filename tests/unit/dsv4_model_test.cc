// DeepSeek-V4 model loading: the narrow checkpoint formats (FP8 e4m3 with 128x128 UE8M0 block
// scales, FP4 e2m1 pairs with per-32 UE8M0 scales) dequantize exactly, including blocks cut by
// the matrix edge; the safetensors reader keeps their dtypes; config.json parsing applies the
// decoder's defaults and refuses what the forward cannot compute, with a message. The MX forms kept
// for the decoder-arithmetic profile carry the same codes with per-32 scales, and the blocked
// quantized matmul gives the bits of its row-at-a-time recipe.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>

#include "common/bf16.h"
#include "common/safetensors.h"
#include "engine/dsv4_cpu.h"
#include "kernels/cpu_ops.h"
#include "model/dsv4.h"

namespace hetero {
namespace {

TEST(Dsv4Formats, E4m3AndE8m0DecodeExactly) {
  EXPECT_EQ(fp8_e4m3_to_f32(0x38), 1.0f);                  // exponent 7 = bias, mantissa 0
  EXPECT_EQ(fp8_e4m3_to_f32(0xB8), -1.0f);                 // sign bit
  EXPECT_EQ(fp8_e4m3_to_f32(0x7E), 448.0f);                // the largest finite value
  EXPECT_EQ(fp8_e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(fp8_e4m3_to_f32(0x0F), 7.0f / 8.0f * std::ldexp(1.0f, -6) + std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0x7F)));
  EXPECT_EQ(fp8_e8m0_to_f32(127), 1.0f);
  EXPECT_EQ(fp8_e8m0_to_f32(120), std::ldexp(1.0f, -7));
  EXPECT_EQ(fp8_e8m0_to_f32(0), std::ldexp(1.0f, -127));
  EXPECT_TRUE(std::isnan(fp8_e8m0_to_f32(0xff)));
  const float fp4[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0f, -0.5, -1, -1.5, -2, -3, -4, -6};
  for (int c = 0; c < 16; ++c) EXPECT_EQ(fp4_e2m1_to_f32(static_cast<uint8_t>(c)), fp4[c]) << c;
}

// A 130 x 257 weight covers 2 x 3 scale blocks, the last row and column blocks cut short.
TEST(Dsv4Formats, Fp8BlockDequantizationCoversEdgeBlocks) {
  const int64_t rows = 130, cols = 257;
  Tensor w(DType::kF8E4M3, {rows, cols}), s(DType::kF8E8M0, {2, 3});
  std::mt19937 rng(11);
  for (auto& b : w.bytes) {
    b = static_cast<uint8_t>(rng() & 0xff);
    if ((b & 0x7f) == 0x7f) b = 0x38;  // no NaN codes in the data
  }
  const uint8_t exps[6] = {127, 120, 130, 100, 140, 127 - 20};
  for (int i = 0; i < 6; ++i) s.bytes[static_cast<size_t>(i)] = exps[i];
  auto out = dequant_fp8_block(w, s);
  ASSERT_TRUE(out.is_ok()) << out.status().message();
  ASSERT_EQ(out->dtype, DType::kBF16);
  ASSERT_EQ(out->shape, (std::vector<int64_t>{rows, cols}));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      const float want = fp8_e4m3_to_f32(w.bytes[static_cast<size_t>(i * cols + j)]) *
                         std::ldexp(1.0f, exps[(i / 128) * 3 + j / 128] - 127);
      ASSERT_EQ(round_bf16(want), want) << "e4m3 times a power of two fits bf16";
      ASSERT_EQ(bf16_to_f32(out->data<uint16_t>()[i * cols + j]), want) << i << "," << j;
    }
  Tensor short_scale(DType::kF8E8M0, {1, 3});
  auto bad = dequant_fp8_block(w, short_scale);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("does not cover"), std::string::npos);
}

TEST(Dsv4Formats, Fp4GroupDequantizationLowNibbleFirst) {
  const int64_t rows = 3, cols = 96;  // three 32-groups per row
  Tensor w(DType::kI8, {rows, cols / 2}), s(DType::kF8E8M0, {rows, cols / 32});
  for (int64_t i = 0; i < w.numel(); ++i)
    w.bytes[static_cast<size_t>(i)] = static_cast<uint8_t>(i * 37 + 5);
  for (int64_t i = 0; i < s.numel(); ++i)
    s.bytes[static_cast<size_t>(i)] = static_cast<uint8_t>(125 + i);
  auto out = dequant_fp4_group(w, s);
  ASSERT_TRUE(out.is_ok()) << out.status().message();
  ASSERT_EQ(out->shape, (std::vector<int64_t>{rows, cols}));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      const uint8_t byte = w.bytes[static_cast<size_t>(i * cols / 2 + j / 2)];
      const uint8_t code = j % 2 ? byte >> 4 : byte & 0xf;
      const float want =
          fp4_e2m1_to_f32(code) * std::ldexp(1.0f, 125 + static_cast<int>(i * 3 + j / 32) - 127);
      ASSERT_EQ(bf16_to_f32(out->data<uint16_t>()[i * cols + j]), want) << i << "," << j;
    }
  // Hand-made: byte 0x21 holds 0.5 (low nibble, first) then 1.0.
  Tensor one(DType::kU8, {1, 16}), unit(DType::kF8E8M0, {1, 1});
  one.bytes[0] = 0x21;
  unit.bytes[0] = 127;
  auto o = dequant_fp4_group(one, unit);
  ASSERT_TRUE(o.is_ok());
  EXPECT_EQ(bf16_to_f32(o->data<uint16_t>()[0]), 0.5f);
  EXPECT_EQ(bf16_to_f32(o->data<uint16_t>()[1]), 1.0f);
  Tensor wrong(DType::kF8E8M0, {rows, 2});
  EXPECT_FALSE(dequant_fp4_group(w, wrong).is_ok());
}

// mlx-vlm's converter turns a 128x128-block FP8 matrix into mxfp8: the same e4m3 codes, each
// block's scale repeated for its four 32-groups (edge blocks included).
TEST(Dsv4Formats, Fp8BlockMxFormRepeatsBlockScalesPer32) {
  const int64_t rows = 130, cols = 288;  // 2 x 3 blocks, the last ones cut short
  Tensor w(DType::kF8E4M3, {rows, cols}), s(DType::kF8E8M0, {2, 3});
  for (int64_t i = 0; i < w.numel(); ++i) {
    uint8_t b = static_cast<uint8_t>(i * 29 + 3);
    w.bytes[static_cast<size_t>(i)] = (b & 0x7f) == 0x7f ? 0x38 : b;
  }
  for (int i = 0; i < 6; ++i) s.bytes[static_cast<size_t>(i)] = static_cast<uint8_t>(120 + i);
  auto mx = mx_from_fp8_block(w, s);
  ASSERT_TRUE(mx.is_ok()) << mx.status().message();
  ASSERT_TRUE(mx->present());
  ASSERT_EQ(mx->group, 32);
  ASSERT_EQ(mx->scales.size(), static_cast<size_t>(rows * cols / 32));
  auto dq = dequant_fp8_block(w, s);
  ASSERT_TRUE(dq.is_ok());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      const float v = mx->values[static_cast<size_t>(i * cols + j)];
      const float sc = mx->scales[static_cast<size_t>(i * (cols / 32) + j / 32)];
      ASSERT_EQ(v, fp8_e4m3_to_f32(w.bytes[static_cast<size_t>(i * cols + j)]));
      ASSERT_EQ(sc, std::ldexp(1.0f, 120 + static_cast<int>((i / 128) * 3 + j / 128) - 127));
      ASSERT_EQ(v * sc, bf16_to_f32(dq->data<uint16_t>()[i * cols + j])) << i << "," << j;
    }
  // No MX form when the columns do not split into 32-groups, or a scale is not a power of two.
  Tensor odd(DType::kF8E4M3, {4, 257}), odd_s(DType::kF8E8M0, {1, 3});
  auto none = mx_from_fp8_block(odd, odd_s);
  ASSERT_TRUE(none.is_ok());
  EXPECT_FALSE(none->present());
  Tensor f32s(DType::kF32, {2, 3});
  for (int i = 0; i < 6; ++i) f32s.data<float>()[i] = i == 4 ? 0.75f : 1.0f;
  auto npot = mx_from_fp8_block(w, f32s);
  ASSERT_TRUE(npot.is_ok());
  EXPECT_FALSE(npot->present());
  EXPECT_NE(npot->no_form.find("power of two"), std::string::npos);
  // The mlx-cpu profile refuses such weights, naming the matrix, instead of computing it dense.
  Dsv4Weights weights;
  weights.layers.resize(2);
  EXPECT_TRUE(check_mx_forms(weights).is_ok());
  weights.layers[1].mx.wkv = npot.value();
  Status st = check_mx_forms(weights);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("layers.1.attn.wkv"), std::string::npos) << st.message();
}

TEST(Dsv4Formats, Fp4MxFormKeepsCodesAndScales) {
  const int64_t rows = 3, cols = 96;
  Tensor w(DType::kI8, {rows, cols / 2}), s(DType::kF8E8M0, {rows, cols / 32});
  for (int64_t i = 0; i < w.numel(); ++i)
    w.bytes[static_cast<size_t>(i)] = static_cast<uint8_t>(i * 37 + 5);
  for (int64_t i = 0; i < s.numel(); ++i)
    s.bytes[static_cast<size_t>(i)] = static_cast<uint8_t>(i == 4 ? 0 : 125 + i);  // 0: 2^-127
  auto mx = mx_from_fp4_group(w, s);
  auto dq = dequant_fp4_group(w, s);
  ASSERT_TRUE(mx.is_ok() && dq.is_ok());
  ASSERT_TRUE(mx->present());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      const uint8_t byte = w.bytes[static_cast<size_t>(i * cols / 2 + j / 2)];
      const float v = mx->values[static_cast<size_t>(i * cols + j)];
      ASSERT_EQ(v, fp4_e2m1_to_f32(j % 2 ? byte >> 4 : byte & 0xf));
      const float sc = mx->scales[static_cast<size_t>(i * 3 + j / 32)];
      ASSERT_EQ(sc, fp8_e8m0_to_f32(s.bytes[static_cast<size_t>(i * 3 + j / 32)]));
      ASSERT_EQ(round_bf16(v * sc), bf16_to_f32(dq->data<uint16_t>()[i * cols + j]));
    }
}

// linear_quantized_mx runs rows in blocks of 8 (one vector lane per row) and the rest one at a
// time; every row must come out as the one-row call computes it, including rows whose sums
// overflow to inf or meet a NaN (the vector bf16 rounding must keep NaN quiet and inf exact).
TEST(Dsv4Kernels, QuantizedMxBlockedRowsMatchOneRowCalls) {
  const int64_t m = 19, k = 96, n = 7, group = 32;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> x(static_cast<size_t>(m * k));
  for (auto& v : x) v = f32_to_bf16(normal(rng));
  x[3 * k + 5] = f32_to_bf16(NAN);
  x[9 * k + 7] = f32_to_bf16(3e38f);
  x[9 * k + 8] = f32_to_bf16(3e38f);
  x[10 * k + 40] = f32_to_bf16(-INFINITY);
  x[17 * k + 1] = f32_to_bf16(1e-40f);  // a bf16 subnormal
  std::vector<float> q(static_cast<size_t>(n * k)), sc(static_cast<size_t>(n * k / group));
  for (auto& v : q) v = fp8_e4m3_to_f32(static_cast<uint8_t>(rng() & 0x7e));
  for (auto& v : sc) v = std::ldexp(1.0f, static_cast<int>(rng() % 9) - 4);
  std::vector<uint16_t> all(static_cast<size_t>(m * n)), one(static_cast<size_t>(n));
  linear_quantized_mx(x.data(), m, k, q.data(), sc.data(), n, group, all.data());
  int64_t nan_rows = 0;
  for (int64_t i = 0; i < m; ++i) {
    linear_quantized_mx(x.data() + i * k, 1, k, q.data(), sc.data(), n, group, one.data());
    for (int64_t j = 0; j < n; ++j) {
      ASSERT_EQ(all[static_cast<size_t>(i * n + j)], one[static_cast<size_t>(j)]) << i << "," << j;
      nan_rows += std::isnan(bf16_to_f32(one[static_cast<size_t>(j)]));
    }
  }
  EXPECT_GT(nan_rows, 0);  // the special lanes were exercised
}

TEST(Dsv4Engine, QuantArithNames) {
  auto a = parse_dsv4_quant_arith("mlx-cpu");
  auto b = parse_dsv4_quant_arith("dequant");
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  EXPECT_EQ(a.value(), Dsv4QuantArith::kMlxCpu);
  EXPECT_EQ(b.value(), Dsv4QuantArith::kDequant);
  EXPECT_STREQ(dsv4_quant_arith_name(a.value()), "mlx-cpu");
  EXPECT_EQ(Dsv4EngineOptions{}.quant_arith, Dsv4QuantArith::kMlxCpu);  // the default
  auto bad = parse_dsv4_quant_arith("bf16");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("mlx-cpu"), std::string::npos);
}

TEST(Dsv4Formats, SafetensorsKeepsNarrowDtypes) {
  const std::string path =
      (std::filesystem::temp_directory_path() / "hetero_dsv4_dtypes.safetensors").string();
  TensorMap m;
  m["a"] = Tensor(DType::kF8E4M3, {2, 3});
  m["b"] = Tensor(DType::kF8E8M0, {1, 1});
  m["c"] = Tensor(DType::kI8, {4});
  m["a"].bytes[1] = 0x38;
  m["c"].bytes[3] = 0xff;
  ASSERT_TRUE(write_safetensors(path, m).is_ok());
  auto r = read_safetensors(path);
  std::remove(path.c_str());
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r->tensors["a"].dtype, DType::kF8E4M3);
  EXPECT_EQ(r->tensors["b"].dtype, DType::kF8E8M0);
  EXPECT_EQ(r->tensors["c"].dtype, DType::kI8);
  EXPECT_EQ(r->tensors["a"].at_f32(1), 1.0f);
  EXPECT_EQ(r->tensors["c"].at_f32(3), -1.0f);
  EXPECT_EQ(std::string(dtype_name(DType::kF8E8M0)), "F8_E8M0");
}

const char* kTinyConfig = R"({
  "model_type": "deepseek_v4", "vocab_size": 1000, "hidden_size": 256, "num_hidden_layers": 6,
  "num_attention_heads": 4, "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 128,
  "o_groups": 2, "o_lora_rank": 128, "n_routed_experts": 8, "n_shared_experts": 1,
  "num_experts_per_tok": 2, "moe_intermediate_size": 128, "num_hash_layers": 2,
  "compress_ratios": [0, 0, 4, 128, 4, 128, 0], "index_n_heads": 4, "index_head_dim": 128,
  "index_topk": 16, "sliding_window": 128, "hc_mult": 4, "hc_sinkhorn_iters": 20,
  "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                   "beta_fast": 32, "beta_slow": 1},
  "quantization_config": {"quant_method": "fp8"}
})";

TEST(Dsv4Config, ParsesAndCutsRatiosToLayers) {
  auto c = parse_dsv4_config(kTinyConfig);
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->compress_ratios, (std::vector<int32_t>{0, 0, 4, 128, 4, 128}));
  EXPECT_EQ(c->hidden, 256);
  EXPECT_EQ(c->experts_per_tok, 2);
  EXPECT_EQ(c->index_topk, 16);
  EXPECT_EQ(c->hc_mix(), 24);
  EXPECT_TRUE(c->yarn.enabled);
  EXPECT_EQ(c->yarn.factor, 16.0);
  EXPECT_EQ(c->yarn.original_max_position_embeddings, 65536.0);
  EXPECT_EQ(c->scoring_func, "sqrtsoftplus");  // the decoder's defaults
  EXPECT_EQ(c->routed_scaling_factor, 1.5);
  EXPECT_EQ(c->swiglu_limit, 10.0);
  EXPECT_EQ(c->compress_rope_theta, 160000.0);
  EXPECT_EQ(c->index_block, 64);
}

TEST(Dsv4Config, EmptyRatiosTakeTheDecoderDefaultPattern) {
  auto c = parse_dsv4_config(
      R"({"model_type": "deepseek_v4", "num_hidden_layers": 5, "compress_ratios": []})");
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->compress_ratios, (std::vector<int32_t>{0, 128, 4, 128, 0}));
}

TEST(Dsv4Config, RefusesBadConfigsWithReasons) {
  auto err = [](const std::string& text) {
    auto c = parse_dsv4_config(text);
    return c.is_ok() ? std::string("accepted") : c.status().message();
  };
  const std::string head = R"({"model_type": "deepseek_v4", "num_hidden_layers": 3, )";
  EXPECT_NE(err(head + R"("compress_ratios": [0, 4, 64]})").find("unsupported compress ratio 64"),
            std::string::npos);
  EXPECT_NE(err(head + R"("compress_ratios": [0, 4]})").find("2 entries for 3 layers"),
            std::string::npos);
  EXPECT_NE(err(R"({"model_type": "llama"})").find("not deepseek_v4"), std::string::npos);
  EXPECT_NE(err(head + R"("rope_scaling": {"type": "linear", "factor": 2}})")
                .find("rope_scaling type 'linear'"),
            std::string::npos);
  EXPECT_NE(err(head + R"("scoring_func": "relu"})").find("scoring_func"), std::string::npos);
  EXPECT_NE(err(head + R"("num_attention_heads": 6, "o_groups": 4})").find("o_groups"),
            std::string::npos);
  EXPECT_NE(err(head + R"("hidden_size": "wide"})").find("config:"), std::string::npos);
  EXPECT_NE(err("[1, 2]").find("not a JSON object"), std::string::npos);
}

TEST(Dsv4Config, MissingDirectoryIsNotFound) {
  auto c = load_dsv4_config("/nonexistent/dsv4");
  ASSERT_FALSE(c.is_ok());
  EXPECT_EQ(c.status().code(), Code::kNotFound);
  EXPECT_FALSE(is_dsv4_checkpoint("/nonexistent/dsv4"));
}

}  // namespace
}  // namespace hetero
