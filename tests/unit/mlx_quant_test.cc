// mlx-lm's quantization as the llama loader reads it: the word packing, the shapes that give bits
// and group, the refusals, and the decoder's dequantized value: bf16(bf16(s*q) + b) for affine,
// e2m1/e4m3 codes times 2^(s - 127) for mxfp4/mxfp8. (Against MLX itself: the quantized
// variants of tests/py/test_exactness.py.)
#include "model/mlx_quant.h"

#include <gtest/gtest.h>

#include <cmath>

#include "common/bf16.h"

namespace hetero {
namespace {

Tensor bf16_of(std::vector<float> v, std::vector<int64_t> shape) {
  Tensor t(DType::kBF16, std::move(shape));
  for (size_t i = 0; i < v.size(); ++i) t.data<uint16_t>()[i] = f32_to_bf16(v[i]);
  return t;
}

TEST(MlxQuant, UnpacksFourBitWordsLowNibbleFirst) {
  // One row of 16 values 0..15 in two words: element c in bits [4 (c % 8), +4) of word c / 8.
  Tensor packed(DType::kU32, {1, 2});
  packed.data<uint32_t>()[0] = 0x76543210u;
  packed.data<uint32_t>()[1] = 0xfedcba98u;
  const Tensor biases = bf16_of({-1.0f, 0.25f}, {1, 2});
  auto w = unpack_quantized("x", packed, bf16_of({0.5f, 2.0f}, {1, 2}), &biases, 16);
  ASSERT_TRUE(w.is_ok()) << w.status().to_string();
  EXPECT_EQ(w->bits, 4);
  EXPECT_EQ(w->group, 8);
  for (int c = 0; c < 16; ++c) EXPECT_EQ(w->q[c], static_cast<float>(c));
  std::vector<uint16_t> row(16);
  dequantize_row(*w, 0, row.data());
  EXPECT_EQ(bf16_to_f32(row[3]), 0.5f * 3 - 1.0f);
  EXPECT_EQ(bf16_to_f32(row[9]), 2.0f * 9 + 0.25f);
  EXPECT_EQ(w->describe(), "4-bit affine, group 8");
}

TEST(MlxQuant, EightBitAndItsRounding) {
  Tensor packed(DType::kU32, {1, 1});
  packed.data<uint32_t>()[0] = 0x000000ffu | (3u << 8);
  // 255 * 1.00390625 = 255.99609375: bf16 rounds it to 256 before the bias is added.
  const Tensor bias = bf16_of({0.5f}, {1, 1});
  auto w = unpack_quantized("x", packed, bf16_of({1.00390625f}, {1, 1}), &bias, 4);
  ASSERT_TRUE(w.is_ok()) << w.status().to_string();
  EXPECT_EQ(w->bits, 8);
  std::vector<uint16_t> row(4);
  dequantize_row(*w, 0, row.data());
  EXPECT_EQ(bf16_to_f32(row[0]), 256.0f);  // bf16(bf16(255.996) + 0.5) = bf16(256.5) = 256
  EXPECT_EQ(bf16_to_f32(row[1]), 3.5f);
}

TEST(MlxQuant, RefusesWhatItCannotRead) {
  const Tensor s = bf16_of({1.f}, {1, 1}), b = bf16_of({0.f}, {1, 1});
  Tensor three(DType::kU32, {1, 3});  // 32 columns in 3 words: 3 bits
  auto w = unpack_quantized("model.layers.0.mlp.up_proj", three, s, &b, 32);
  ASSERT_FALSE(w.is_ok());
  EXPECT_NE(w.status().message().find("3 bits"), std::string::npos) << w.status().message();
  EXPECT_NE(w.status().message().find("up_proj"), std::string::npos);
  Tensor f32(DType::kF32, {1, 4});
  EXPECT_FALSE(unpack_quantized("x", f32, s, &b, 32).is_ok());
  Tensor four(DType::kU32, {1, 4});
  EXPECT_FALSE(unpack_quantized("x", four, bf16_of({1.f, 1.f, 1.f}, {1, 3}), &b, 32).is_ok());
}

Tensor u8_of(std::vector<uint8_t> v, std::vector<int64_t> shape) {
  Tensor t(DType::kU8, std::move(shape));
  for (size_t i = 0; i < v.size(); ++i) t.data<uint8_t>()[i] = v[i];
  return t;
}

TEST(MlxQuant, MxFp4CodesTimesTheirPowerOfTwo) {
  // 32 e2m1 codes, 8 to a word, low nibble first: codes 0..15 twice (0..7 positive, 8..15 the
  // same magnitudes negative), scale byte 128 = 2^1.
  Tensor packed(DType::kU32, {1, 4});
  for (int i = 0; i < 4; ++i) packed.data<uint32_t>()[i] = i % 2 ? 0xfedcba98u : 0x76543210u;
  auto w = unpack_quantized("x", packed, u8_of({128}, {1, 1}), nullptr, 32);
  ASSERT_TRUE(w.is_ok()) << w.status().to_string();
  EXPECT_EQ(w->mode, "mxfp4");
  EXPECT_EQ(w->describe(), "4-bit mxfp4, group 32");
  const float e2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int c = 0; c < 32; ++c) EXPECT_EQ(w->q[c], (c % 16 < 8 ? 1.0f : -1.0f) * e2m1[c % 8]) << c;
  std::vector<uint16_t> row(32);
  dequantize_row(*w, 0, row.data());
  EXPECT_EQ(bf16_to_f32(row[7]), 12.0f);
  EXPECT_EQ(bf16_to_f32(row[13]), -6.0f);
}

TEST(MlxQuant, MxFp8CodesAndTheSubnormalScaleByte) {
  // e4m3 0x38 = 1.0, 0xc0 = -2.0; scale byte 0 is 2^-127 as the decoder reads it.
  Tensor packed(DType::kU32, {2, 8});
  for (int i = 0; i < 16; ++i) packed.data<uint32_t>()[i] = 0xc038c038u;
  auto w = unpack_quantized("x", packed, u8_of({127, 0}, {2, 1}), nullptr, 32);
  ASSERT_TRUE(w.is_ok()) << w.status().to_string();
  EXPECT_EQ(w->mode, "mxfp8");
  EXPECT_EQ(w->q[0], 1.0f);
  EXPECT_EQ(w->q[1], -2.0f);
  EXPECT_EQ(w->scales[0], 1.0f);
  EXPECT_EQ(w->scales[1], std::ldexp(1.0f, -127));
}

TEST(MlxQuant, RefusesNvfp4AndOtherModesItCannotRead) {
  Tensor packed(DType::kU32, {1, 4});
  auto nv = unpack_quantized("model.layers.0.self_attn.k_proj", packed, u8_of({1, 1}, {1, 2}),
                             nullptr, 32);
  ASSERT_FALSE(nv.is_ok());
  EXPECT_NE(nv.status().message().find("nvfp4"), std::string::npos) << nv.status().message();
  EXPECT_NE(nv.status().message().find("k_proj"), std::string::npos);
  // No biases, 4 bits, but bf16 scales: not an mx mode either.
  EXPECT_FALSE(unpack_quantized("x", packed, bf16_of({1.f}, {1, 1}), nullptr, 32).is_ok());
}

}  // namespace
}  // namespace hetero
