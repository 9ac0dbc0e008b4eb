// The start-time pairing check (prefill/pairing.h): a prefill checkpoint passes only when every
// weight the decoder's export carries is equal, value for value, to the checkpoint's tensor of
// the same name after each side's dequantization. Equal weights pass; one flipped value is
// refused naming the tensor, the share and the first index; a decoder quantized from the
// checkpoint (4-bit affine, group 64, as mlx-lm's converter makes it) is refused naming both
// sides, even against its own values stored dense; the same quantized checkpoint passes.
#include "prefill/pairing.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>

#include "common/bf16.h"

namespace hetero {
namespace {

constexpr int64_t kLayers = 2, kKvDim = 128, kHidden = 64;

Tensor bf16_tensor(const std::vector<int64_t>& shape, const std::vector<float>& v) {
  Tensor t(DType::kBF16, shape);
  for (size_t i = 0; i < v.size(); ++i) t.data<uint16_t>()[i] = f32_to_bf16(v[i]);
  return t;
}

std::vector<float> random_values(int64_t n, uint32_t seed, float scale = 0.05f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = round_bf16(dist(rng));
  return v;
}

void set_value(Tensor* t, int64_t i, float v) { t->data<uint16_t>()[i] = f32_to_bf16(v); }

// A llama checkpoint's k/v tensors (with k_norm, as Qwen3) and the export of the same weights.
struct LlamaPair {
  TensorMap exported, checkpoint;
  PairingSides sides{"/x/decoder", nlohmann::json(), "/x/prefill"};
};

LlamaPair llama_pair() {
  LlamaPair p;
  uint32_t seed = 1;
  for (int64_t i = 0; i < kLayers; ++i) {
    const std::string e = "layers." + std::to_string(i) + ".";
    const std::string c = "model.layers." + std::to_string(i) + ".self_attn.";
    for (const char* proj : {"k_proj", "v_proj"}) {
      Tensor w = bf16_tensor({kKvDim, kHidden}, random_values(kKvDim * kHidden, seed++));
      p.exported[e + proj + ".weight"] = w;
      p.checkpoint[c + proj + ".weight"] = w;
    }
    Tensor norm = bf16_tensor({64}, random_values(64, seed++, 1.f));
    p.exported[e + "k_norm.weight"] = norm;
    p.checkpoint[c + "k_norm.weight"] = norm;
  }
  return p;
}

// What mlx-lm's converter does to a weight at 4 bits, affine, group 64: per group scale
// (max - min) / 15 and bias min (bf16, the model's dtype), codes round((w - bias) / scale). As
// the export carries it (python/hetero_mlx/quantized.py: codes, scales and biases as float32
// values) and as the converted checkpoint stores it (codes packed 8 to a U32 word, bf16 scales
// and biases); `values` is what the decoder's dequantize gives, bf16(bf16(code * s) + b).
struct Q4 {
  Tensor codes, scales, biases;       // export: F32 [n, k], [n, k/64], [n, k/64]
  Tensor packed, scales16, biases16;  // checkpoint: U32 [n, k/8], BF16 [n, k/64] twice
  Tensor values;                      // BF16 [n, k]
};

Q4 q4_affine(const Tensor& w) {
  const int64_t n = w.shape[0], k = w.shape[1], group = 64, groups = k / group;
  const std::vector<float> v = to_f32(w);
  Q4 q{Tensor(DType::kF32, {n, k}),       Tensor(DType::kF32, {n, groups}),
       Tensor(DType::kF32, {n, groups}),  Tensor(DType::kU32, {n, k / 8}),
       Tensor(DType::kBF16, {n, groups}), Tensor(DType::kBF16, {n, groups}),
       Tensor(DType::kBF16, {n, k})};
  for (int64_t g = 0; g < n * groups; ++g) {
    float lo = v[g * group], hi = lo;
    for (int64_t i = g * group; i < (g + 1) * group; ++i)
      lo = std::min(lo, v[i]), hi = std::max(hi, v[i]);
    const float scale = round_bf16((hi - lo) / 15.f), bias = round_bf16(lo);
    q.scales.data<float>()[g] = scale, q.biases.data<float>()[g] = bias;
    q.scales16.data<uint16_t>()[g] = f32_to_bf16(scale);
    q.biases16.data<uint16_t>()[g] = f32_to_bf16(bias);
    for (int64_t i = g * group; i < (g + 1) * group; ++i) {
      const float code = std::clamp(std::round((v[i] - bias) / scale), 0.f, 15.f);
      q.codes.data<float>()[i] = code;
      q.packed.data<uint32_t>()[i / 8] |= static_cast<uint32_t>(code) << (4 * (i % 8));
      q.values.data<uint16_t>()[i] = f32_to_bf16(round_bf16(code * scale) + bias);
    }
  }
  return q;
}

const nlohmann::json kQ4 = {
    {"mode", "affine"}, {"bits", 4}, {"group_size", 64}, {"modules", 4}, {"overrides", {}}};

// The pair with the decoder quantized: its export carries the q4 form of each projection; the
// checkpoint keeps what the test puts there.
LlamaPair quantized_pair(bool checkpoint_packed) {
  LlamaPair p = llama_pair();
  p.sides.decoder_quantization = kQ4;
  for (int64_t i = 0; i < kLayers; ++i)
    for (const char* proj : {"k_proj.", "v_proj."}) {
      const std::string e = "layers." + std::to_string(i) + "." + proj;
      const std::string c = "model.layers." + std::to_string(i) + ".self_attn." + proj;
      const Q4 q = q4_affine(p.exported[e + "weight"]);
      p.exported.erase(e + "weight");
      p.exported[e + "qvalues"] = q.codes, p.exported[e + "scales"] = q.scales;
      p.exported[e + "biases"] = q.biases;
      if (checkpoint_packed) {
        p.checkpoint[c + "weight"] = q.packed;
        p.checkpoint[c + "scales"] = q.scales16, p.checkpoint[c + "biases"] = q.biases16;
      } else {
        p.checkpoint[c + "weight"] = q.values;  // the decoder's own values, dense
      }
    }
  return p;
}

TEST(LlamaPairing, EqualWeightsPass) {
  LlamaPair p = llama_pair();
  EXPECT_TRUE(check_llama_pairing(p.exported, p.checkpoint, kLayers, p.sides).is_ok());
}

// The engine computes with a float32 checkpoint as bf16, so equal values in another storage
// dtype pass too.
TEST(LlamaPairing, EqualValuesInFloat32Pass) {
  LlamaPair p = llama_pair();
  for (auto& [name, t] : p.checkpoint) {
    Tensor f(DType::kF32, t.shape);
    for (int64_t i = 0; i < t.numel(); ++i) f.data<float>()[i] = t.at_f32(i);
    t = f;
  }
  EXPECT_TRUE(check_llama_pairing(p.exported, p.checkpoint, kLayers, p.sides).is_ok());
}

TEST(LlamaPairing, OneFlippedValueIsRefusedNamingTheTensor) {
  LlamaPair p = llama_pair();
  Tensor& v = p.checkpoint["model.layers.1.self_attn.v_proj.weight"];
  const int64_t i = 3 * kHidden + 5;
  set_value(&v, i, v.at_f32(i) + 0.25f);
  Status st = check_llama_pairing(p.exported, p.checkpoint, kLayers, p.sides);
  ASSERT_EQ(st.code(), Code::kFailedPrecondition);
  const std::string m = st.message();
  EXPECT_NE(m.find("the prefill checkpoint /x/prefill does not hold the decoder's weights"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("model.layers.1.self_attn.v_proj.weight differs in"), std::string::npos) << m;
  EXPECT_NE(m.find("(1 of 8192; the first at [3, 5]"), std::string::npos) << m;
  EXPECT_NE(m.find("decoder: unquantized, from /x/decoder; prefill: bf16"), std::string::npos) << m;
}

// mlx-lm's conversion of the checkpoint, against the checkpoint itself.
TEST(LlamaPairing, AQuantizedDecoderAgainstItsDenseOriginalIsRefusedNamingBoth) {
  LlamaPair p = quantized_pair(false);
  const LlamaPair dense = llama_pair();
  p.checkpoint = dense.checkpoint;
  Status st = check_llama_pairing(p.exported, p.checkpoint, kLayers, p.sides);
  ASSERT_EQ(st.code(), Code::kFailedPrecondition);
  const std::string m = st.message();
  EXPECT_NE(m.find("the decoder (4-bit affine, group 64, from /x/decoder)"), std::string::npos)
      << m;
  EXPECT_NE(m.find("/x/prefill (model.layers.0.self_attn.k_proj.weight: bf16)"), std::string::npos)
      << m;
  EXPECT_NE(m.find("the decoder is quantized and the prefill checkpoint is not"), std::string::npos)
      << m;
}

// Equal k/v values do not make a quantized decoder's caches reproducible by a dense forward: its
// k and v come out of quantized matmuls.
TEST(LlamaPairing, AQuantizedDecoderAgainstItsOwnValuesDenseIsStillRefused) {
  LlamaPair p = quantized_pair(false);
  Status st = check_llama_pairing(p.exported, p.checkpoint, kLayers, p.sides);
  ASSERT_EQ(st.code(), Code::kFailedPrecondition);
  EXPECT_NE(st.message().find("quantized matmul"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("4-bit affine, group 64, from /x/decoder"), std::string::npos);
}

// The quantized checkpoint the decoder was loaded from: the prefill host runs it as stored.
TEST(LlamaPairing, TheSameQuantizedCheckpointPassesAndOneCodeIsNot) {
  LlamaPair p = quantized_pair(true);
  EXPECT_TRUE(check_llama_pairing(p.exported, p.checkpoint, kLayers, p.sides).is_ok());
  // The dense decoder against the quantized checkpoint: refused the other way round.
  LlamaPair dense = llama_pair();
  Status reverse = check_llama_pairing(dense.exported, p.checkpoint, kLayers, dense.sides);
  ASSERT_EQ(reverse.code(), Code::kFailedPrecondition);
  EXPECT_NE(reverse.message().find("decoder (unquantized, from /x/decoder)"), std::string::npos)
      << reverse.message();
  EXPECT_NE(reverse.message().find("4-bit affine, group 64"), std::string::npos);
  // One code moved in the checkpoint's packed words.
  p.checkpoint["model.layers.1.self_attn.v_proj.weight"].data<uint32_t>()[3] ^= 1u;
  Status st = check_llama_pairing(p.exported, p.checkpoint, kLayers, p.sides);
  ASSERT_EQ(st.code(), Code::kFailedPrecondition);
  EXPECT_NE(st.message().find("model.layers.1.self_attn.v_proj.weight differs in"),
            std::string::npos)
      << st.message();
}

TEST(LlamaPairing, ABiasOnOneSideOnlyIsRefused) {
  LlamaPair p = llama_pair();
  p.exported["layers.0.k_proj.bias"] = bf16_tensor({kKvDim}, random_values(kKvDim, 99));
  Status st = check_llama_pairing(p.exported, p.checkpoint, kLayers, p.sides);
  ASSERT_EQ(st.code(), Code::kFailedPrecondition);
  EXPECT_NE(st.message().find("model.layers.0.self_attn.k_proj.bias is in the decoder's export but "
                              "not in the prefill checkpoint"),
            std::string::npos)
      << st.message();
}

TEST(LlamaPairing, ShapesThatDifferAreRefused) {
  LlamaPair p = llama_pair();
  p.checkpoint["model.layers.1.self_attn.k_norm.weight"] =
      bf16_tensor({32}, random_values(32, 5, 1.f));
  Status st = check_llama_pairing(p.exported, p.checkpoint, kLayers, p.sides);
  ASSERT_EQ(st.code(), Code::kFailedPrecondition);
  EXPECT_NE(
      st.message().find("k_norm.weight has shape [64] in the decoder and [32] in the prefill"),
      std::string::npos)
      << st.message();
}

TEST(ComparePairing, NanMatchesNanAndSignedZerosMatch) {
  Tensor a(DType::kF32, {4}), b(DType::kBF16, {4});
  const float av[4] = {NAN, 0.f, -0.f, 1.5f};
  const float bv[4] = {NAN, -0.f, 0.f, 1.5f};
  for (int i = 0; i < 4; ++i) a.data<float>()[i] = av[i], set_value(&b, i, bv[i]);
  EXPECT_FALSE(compare_weight("t", a, b).has_value());
  set_value(&b, 0, 1.f);
  auto d = compare_weight("t", a, b);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->differing, 1);
  EXPECT_EQ(d->first, 0);
}

// deepseek_v4: layer 0 (ratio 0) and layer 1 (ratio 4, with the indexer's compressor). The
// export holds wkv in mxfp8 form (element values x power-of-two group scales) and ape rounded to
// bf16, as mlx-vlm's conversion that keeps the FP8 codes does; the checkpoint its dequantized
// values and the float32 ape.
struct Dsv4Pair {
  TensorMap exported;
  Dsv4CacheTensors checkpoint;
  std::vector<int64_t> ratios{0, 4};
  PairingSides sides{"/x/native", nlohmann::json(), "/x/fp8"};
};

Dsv4Pair dsv4_pair() {
  Dsv4Pair p;
  p.sides.decoder_quantization = {
      {"mode", "mxfp8"}, {"bits", 8}, {"group_size", 32}, {"modules", 3}, {"overrides", {}}};
  const int64_t hd = 64, H = 64;
  uint32_t seed = 7;
  auto both = [&](const std::string& name, const Tensor& t) {
    p.exported[name] = t;
    p.checkpoint.tensors[name] = t;
    p.checkpoint.storage[name] = "bf16";
  };
  auto compressor = [&](const std::string& c, int64_t width) {
    both(c + "wkv.weight", bf16_tensor({width, H}, random_values(width * H, seed++)));
    both(c + "wgate.weight", bf16_tensor({width, H}, random_values(width * H, seed++)));
    both(c + "norm.weight", bf16_tensor({hd}, random_values(hd, seed++, 1.f)));
    Tensor ape(DType::kF32, {4, width});
    std::mt19937 rng(seed++);
    std::normal_distribution<float> dist(0.f, 0.5f);
    for (int64_t i = 0; i < ape.numel(); ++i) ape.data<float>()[i] = dist(rng);
    p.checkpoint.tensors[c + "ape"] = ape;
    p.checkpoint.storage[c + "ape"] = "f32";
    Tensor cast(DType::kBF16, ape.shape);
    for (int64_t i = 0; i < ape.numel(); ++i) set_value(&cast, i, ape.data<float>()[i]);
    p.exported[c + "ape"] = cast;
  };
  for (int64_t i = 0; i < 2; ++i) {
    const std::string a = "layers." + std::to_string(i) + ".attn.";
    // wkv: e4m3 element values (here multiples of 1/8 up to 4) times 2^-6 per 32-group.
    Tensor q(DType::kF32, {hd, H}), s(DType::kF32, {hd, H / 32});
    Tensor dense(DType::kBF16, {hd, H});
    std::mt19937 rng(seed++);
    for (int64_t j = 0; j < q.numel(); ++j) {
      const float v = static_cast<float>(static_cast<int>(rng() % 65) - 32) / 8.f;
      q.data<float>()[j] = v;
      set_value(&dense, j, std::ldexp(v, -6));
    }
    for (int64_t j = 0; j < s.numel(); ++j) s.data<float>()[j] = std::ldexp(1.f, -6);
    p.exported[a + "wkv.qvalues"] = q;
    p.exported[a + "wkv.scales"] = s;
    p.checkpoint.tensors[a + "wkv.weight"] = dense;
    p.checkpoint.storage[a + "wkv.weight"] = "fp8 e4m3, 128x128 block scales";
    both(a + "kv_norm.weight", bf16_tensor({hd}, random_values(hd, seed++, 1.f)));
    if (p.ratios[static_cast<size_t>(i)] == 4) {
      compressor(a + "compressor.", 2 * hd);
      compressor(a + "indexer.compressor.", 2 * hd);
    }
  }
  return p;
}

TEST(Dsv4Pairing, TheCheckpointsOwnValuesPass) {
  Dsv4Pair p = dsv4_pair();
  EXPECT_TRUE(check_dsv4_pairing(p.exported, p.checkpoint, p.ratios, p.sides).is_ok());
}

TEST(Dsv4Pairing, OneFlippedWkvValueIsRefused) {
  Dsv4Pair p = dsv4_pair();
  p.exported["layers.1.attn.wkv.qvalues"].data<float>()[70] += 0.125f;
  Status st = check_dsv4_pairing(p.exported, p.checkpoint, p.ratios, p.sides);
  ASSERT_EQ(st.code(), Code::kFailedPrecondition);
  EXPECT_NE(st.message().find("layers.1.attn.wkv.weight differs in"), std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find("(decoder: 8-bit mxfp8, group 32, from /x/native; prefill: fp8 e4m3"),
            std::string::npos)
      << st.message();
}

// mlx-vlm's mxfp4 conversion requantizes the compressors from their bf16 values.
TEST(Dsv4Pairing, ARequantizedCompressorIsRefused) {
  Dsv4Pair p = dsv4_pair();
  Tensor& w = p.exported["layers.1.attn.indexer.compressor.wgate.weight"];
  for (int64_t i = 0; i < w.numel(); ++i)
    set_value(&w, i, std::round(w.at_f32(i) * 32.f) / 32.f);  // a coarser grid
  Status st = check_dsv4_pairing(p.exported, p.checkpoint, p.ratios, p.sides);
  ASSERT_EQ(st.code(), Code::kFailedPrecondition);
  EXPECT_NE(st.message().find("layers.1.attn.indexer.compressor.wgate.weight differs in"),
            std::string::npos)
      << st.message();
}

// ape: the decoder's bf16 values are the checkpoint's float32 ones after the converter's cast;
// one that is not is refused.
TEST(Dsv4Pairing, ApeComparesAtTheDecodersPrecision) {
  Dsv4Pair p = dsv4_pair();
  Tensor& ape = p.exported["layers.1.attn.compressor.ape"];
  set_value(&ape, 3, ape.at_f32(3) * 2.f + 1.f);
  Status st = check_dsv4_pairing(p.exported, p.checkpoint, p.ratios, p.sides);
  ASSERT_EQ(st.code(), Code::kFailedPrecondition);
  EXPECT_NE(st.message().find("layers.1.attn.compressor.ape differs in"), std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find("prefill: f32, compared as bf16"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace hetero
