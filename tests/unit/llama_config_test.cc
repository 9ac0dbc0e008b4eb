// The llama family's config.json as mlx-lm reads it: tied embeddings when the key is absent
// (llama, mistral, qwen2), untied for null (None), a clear refusal where mlx-lm itself would not
// load (qwen3 without the key), the rope types mlx-lm builds (their bits are checked against the
// decoder in tests/py/test_exactness.py) and a clear refusal for the ones that cannot be bridged.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "../common/temp_dir.h"
#include "bridge/decoder_weights.h"
#include "model/llama.h"

namespace hetero {
namespace {

Result<LlamaConfig> config_of(nlohmann::json j) {
  TempDir dir;
  std::ofstream(dir.path + "/config.json") << j.dump();
  return load_llama_config(dir.path);
}

nlohmann::json base(const std::string& type) {
  return {{"model_type", type},     {"hidden_size", 64},        {"intermediate_size", 128},
          {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
          {"vocab_size", 100}};
}

TEST(LlamaConfig, TiedEmbeddingsDefaultAsInMlxLm) {
  for (const char* type : {"llama", "mistral", "qwen2"}) {
    auto c = config_of(base(type));
    ASSERT_TRUE(c.is_ok()) << type << ": " << c.status().to_string();
    EXPECT_TRUE(c->tie_embeddings) << type;
    auto j = base(type);
    j["tie_word_embeddings"] = false;
    EXPECT_FALSE(config_of(j)->tie_embeddings) << type;
    j["tie_word_embeddings"] = nullptr;  // None in mlx-lm: falsy
    EXPECT_FALSE(config_of(j)->tie_embeddings) << type;
    j["tie_word_embeddings"] = "yes";
    EXPECT_FALSE(config_of(j).is_ok()) << type;
  }
  auto q = base("qwen3");
  q["rope_theta"] = 1e6;
  auto missing = config_of(q);
  ASSERT_FALSE(missing.is_ok());
  EXPECT_EQ(missing.status().code(), Code::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("tie_word_embeddings"), std::string::npos);
  q["tie_word_embeddings"] = true;
  EXPECT_TRUE(config_of(q)->tie_embeddings);
}

TEST(LlamaConfig, RopeThetaDefaultsAsInMlxLm) {
  EXPECT_EQ(config_of(base("llama"))->rope_theta, 10000.0);
  EXPECT_EQ(config_of(base("qwen2"))->rope_theta, 1000000.0);
  auto q = base("qwen3");
  q["tie_word_embeddings"] = true;
  auto missing = config_of(q);
  ASSERT_FALSE(missing.is_ok());
  EXPECT_NE(missing.status().message().find("rope_theta"), std::string::npos);
  // transformers v5 nests it (and the scaling) under rope_parameters.
  q["rope_parameters"] = {{"rope_theta", 5e6}, {"rope_type", "linear"}, {"factor", 2.0}};
  auto c = config_of(q);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->rope_theta, 5e6);
  EXPECT_EQ(c->rope.scale, 0.5f);
  EXPECT_FALSE(c->rope.traditional);
}

TEST(LlamaConfig, RopeTypesBecomeTheDecodersSpec) {
  auto with = [](nlohmann::json scaling) {
    auto j = base("llama");
    j["rope_scaling"] = std::move(scaling);
    j["max_position_embeddings"] = 131072;
    return config_of(j);
  };
  auto plain = config_of(base("llama"));
  ASSERT_TRUE(plain.is_ok());
  EXPECT_TRUE(plain->rope.freqs.empty());
  EXPECT_EQ(plain->rope.dims, 16);
  EXPECT_EQ(plain->rope.scale, 1.0f);

  auto linear = with({{"type", "linear"}, {"factor", 4.0}});
  ASSERT_TRUE(linear.is_ok());
  EXPECT_EQ(linear->rope.scale, 0.25f);

  // llama3: the highest frequencies keep their wavelength, the lowest are stretched by factor.
  auto l3 =
      with({{"rope_type", "llama3"}, {"factor", 8.0}, {"original_max_position_embeddings", 64}});
  ASSERT_TRUE(l3.is_ok()) << l3.status().to_string();
  ASSERT_EQ(l3->rope.freqs.size(), 8u);
  EXPECT_EQ(l3->rope.freqs[0], 1.0f);
  const float last = std::pow(10000.0f, 14.0f / 16.0f);
  EXPECT_EQ(l3->rope.freqs[7], last * 8.0f);

  // yarn with factor > 1 scales its input by 0.1 ln(factor) + 1.
  auto y = with({{"rope_type", "yarn"}, {"factor", 4.0}});
  ASSERT_TRUE(y.is_ok()) << y.status().to_string();
  EXPECT_TRUE(y->rope.scales_input);
  EXPECT_FLOAT_EQ(y->rope.input_scale, static_cast<float>(0.1 * std::log(4.0) + 1.0));

  auto longrope = with({{"type", "longrope"},
                        {"original_max_position_embeddings", 4096},
                        {"short_factor", 1.0},
                        {"long_factor", std::vector<double>(8, 2.0)}});
  ASSERT_TRUE(longrope.is_ok()) << longrope.status().to_string();
  EXPECT_TRUE(longrope->rope.scales_input);
  EXPECT_EQ(longrope->rope.freqs[0], 2.0f);

  auto prop = with({{"rope_type", "proportional"}, {"partial_rotary_factor", 0.5}});
  ASSERT_TRUE(prop.is_ok());
  EXPECT_TRUE(std::isinf(prop->rope.freqs[7]));
  EXPECT_FALSE(std::isinf(prop->rope.freqs[3]));

  // Refused by name: an unknown one, a missing key.
  for (const auto& [scaling, word] : std::vector<std::pair<nlohmann::json, std::string>>{
           {{{"type", "dynamic"}}, "factor"},
           {{{"rope_type", "su"}}, "'su'"},
           {{{"rope_type", "llama3"}}, "factor"},
           {{{"type", "longrope"}, {"original_max_position_embeddings", 4096}}, "short_factor"}}) {
    auto c = with(scaling);
    ASSERT_FALSE(c.is_ok()) << scaling.dump();
    EXPECT_NE(c.status().message().find(word), std::string::npos) << c.status().message();
  }
}

// Within max_position_embeddings every call of the decoder's dynamic rope has one base, the
// config's times the bracket at seq_len = mpe (1 up to a double rounding); past it, no prompt is
// bridged, whatever its schedule would have been.
TEST(LlamaConfig, DynamicRopeIsExactWithinMaxPositionEmbeddings) {
  auto j = base("llama");
  j["rope_scaling"] = {{"type", "dynamic"}, {"factor", 5.7}};
  j["max_position_embeddings"] = 3333;
  auto c = config_of(j);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  const double bracket = 5.7 * 3333.0 / 3333.0 - (5.7 - 1);
  EXPECT_NE(bracket, 1.0);  // the case where the formula, not a shortcut, decides
  EXPECT_EQ(c->rope.base, static_cast<float>(10000.0 * std::pow(bracket, 16.0 / 14.0)));
  EXPECT_EQ(c->rope.scale, 1.0f);
  EXPECT_TRUE(c->rope.freqs.empty());
  EXPECT_EQ(rope_reach(c->rope_config), 3333);
  EXPECT_TRUE(check_rope_reach(c->rope_config, 3333).is_ok());
  const Status past = check_rope_reach(c->rope_config, 3334);
  ASSERT_FALSE(past.is_ok());
  EXPECT_NE(past.message().find("3334 tokens"), std::string::npos) << past.message();
  EXPECT_NE(past.message().find("dynamic (factor 5.7)"), std::string::npos) << past.message();
  // Other ropes reach any length.
  EXPECT_EQ(rope_reach(config_of(base("llama"))->rope_config), 0);
  EXPECT_TRUE(check_rope_reach(config_of(base("llama"))->rope_config, int64_t{1} << 40).is_ok());

  j.erase("max_position_embeddings");  // mlx-lm's llama has no default for it
  auto none = config_of(j);
  ASSERT_FALSE(none.is_ok());
  EXPECT_NE(none.status().message().find("max_position_embeddings"), std::string::npos);
}

// Past max_position_embeddings each of the decoder's calls ropes its rows with a base of its own
// (seq_len = the call's end), computed as mlx-lm's server computes it: MLX float32 on its batch
// path (from end == mpe on), Python doubles on its single path (past mpe). RopeByCall gives each
// row its call's spec; tests/py/test_rope_served.py holds the caches to the decoder's bits.
TEST(LlamaConfig, DynamicRopePastMaxPositionEmbeddingsFollowsEachCall) {
  auto j = base("llama");
  j["rope_scaling"] = {{"type", "dynamic"}, {"factor", 2.0}};
  j["max_position_embeddings"] = 1500;
  auto c = config_of(j);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  const LlamaRopeConfig& r = c->rope_config;
  auto base_of = [&](int64_t offset, int64_t n, bool batched) {
    auto spec = llama_rope_for_call(r, offset, n, batched);
    EXPECT_TRUE(spec.is_ok()) << spec.status().to_string();
    return spec.is_ok() ? spec->base : 0.0f;
  };
  const auto f32 = [&](int64_t end) {
    const float t = std::pow(2.0f * static_cast<float>(end) / 1500.0f - 1.0f,
                             static_cast<float>(16.0 / 14.0));  // Python exponent, as float32
    return 10000.0f * t;
  };
  const auto f64 = [&](int64_t end) {
    return static_cast<float>(10000.0 * std::pow(2.0 * end / 1500.0 - 1.0, 16.0 / 14.0));
  };
  EXPECT_EQ(base_of(0, 1499, true), c->rope.base);     // ends within: the plain spec
  EXPECT_EQ(base_of(1000, 500, false), c->rope.base);  // single path: ends at mpe, still plain
  EXPECT_EQ(base_of(1000, 500, true), f32(1500));      // batch path: from end == mpe
  EXPECT_EQ(base_of(2048, 1727, true), f32(3775));
  EXPECT_EQ(base_of(2048, 1727, false), f64(3775));
  EXPECT_NE(f32(3775), f64(3775));  // where the two paths' keys part

  // Rows by their call: a chunk across a call's edge gets each side's spec.
  auto byc = RopeByCall::make(r, c->rope, 0, {2048, 1727}, true);
  ASSERT_TRUE(byc.is_ok()) << byc.status().to_string();
  EXPECT_TRUE(byc->per_call());
  const int64_t heads = 2, hd = 16, n = 100, pos0 = 2000;  // rows 2000..2099
  std::vector<uint16_t> x(static_cast<size_t>(n * heads * hd));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<uint16_t>(0x3c00 + (i * 37) % 500);
  std::vector<uint16_t> want = x, got = x;
  const RopeSpec first = *llama_rope_for_call(r, 0, 2048, true);
  const RopeSpec second = *llama_rope_for_call(r, 2048, 1727, true);
  rope_apply(want.data(), 48, heads, hd, 2000, first);
  rope_apply(want.data() + 48 * heads * hd, 52, heads, hd, 2048, second);
  byc->apply(got.data(), n, heads, hd, pos0);
  EXPECT_EQ(got, want);
  // Within reach, or another rope: no row has a spec of its own.
  EXPECT_FALSE(RopeByCall::make(r, c->rope, 0, {1000, 498}, true)->per_call());
  auto plain = config_of(base("llama"));
  EXPECT_FALSE(
      RopeByCall::make(plain->rope_config, plain->rope, 0, {2048, 2048}, true)->per_call());
  EXPECT_FALSE(RopeByCall::make(r, c->rope, 0, {0}, true).is_ok());
}

// Sliding-window layers (llama and mistral, the types whose mlx-lm code reads layer_types) need
// the window their caches are sized by, and are the layers their types name.
TEST(LlamaConfig, SlidingWindowLayersNeedTheirWindow) {
  for (const char* type : {"llama", "mistral"}) {
    auto j = base(type);
    j["layer_types"] = {"full_attention", "sliding_attention"};
    auto c = config_of(j);
    ASSERT_FALSE(c.is_ok()) << type;
    EXPECT_NE(c.status().message().find("sliding_window"), std::string::npos);
    j["sliding_window"] = 512;
    c = config_of(j);
    ASSERT_TRUE(c.is_ok()) << type << ": " << c.status().message();
    EXPECT_EQ(c->sliding_window, 512);
    EXPECT_EQ(c->window_of(0), 0) << type;  // each layer as its type says
    EXPECT_EQ(c->window_of(1), 512) << type;
    j["layer_types"] = {"full_attention", "sliding_attention", "full_attention"};
    c = config_of(j);  // mlx-lm builds one layer per type: another count is another model
    ASSERT_FALSE(c.is_ok()) << type;
    EXPECT_NE(c.status().message().find("names 3 layers, the model has 2"), std::string::npos)
        << c.status().message();
    // mlx-lm's llama needs one full-attention layer to load at all.
    j["layer_types"] = {"chunked_attention"};
    c = config_of(j);
    ASSERT_FALSE(c.is_ok()) << type;
    EXPECT_NE(c.status().message().find("full_attention"), std::string::npos);
    j["layer_types"] = {"full_attention", "full_attention"};
    ASSERT_TRUE(config_of(j).is_ok()) << type;
    EXPECT_EQ(config_of(j)->sliding_window, 0) << type;
  }
}

// Past the window, a sliding layer's rows are the decoder's for calls of more than one token
// (they sum the window in temporal order); a one-token call there sums it in its rotating
// cache's order, and a request with one, or a tail after rows made so, is refused. Within the
// window any call is fine.
TEST(LlamaConfig, OneTokenCallsPastTheSlidingWindowAreRefused) {
  LlamaDecoderWeights w;
  EXPECT_TRUE(check_sliding_calls(w, 5000, 5002, {1, 1}).is_ok());  // no sliding layers
  w.sliding_window = 300;
  EXPECT_TRUE(check_sliding_calls(w, 0, 2500, {2048, 452}).is_ok());
  EXPECT_FALSE(check_sliding_calls(w, 0, 301, {299, 1, 1}).is_ok());  // row 300 alone
  EXPECT_TRUE(check_sliding_calls(w, 0, 306, {298, 1, 7}).is_ok());   // row 298: within it
  // Calls unknown: fine within the window, refused past it (any cut could hide one).
  EXPECT_TRUE(check_sliding_calls(w, 0, 300, {}).is_ok());
  auto st = check_sliding_calls(w, 0, 301, {});
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("names no decoder calls"), std::string::npos) << st.message();
  st = check_sliding_calls(w, 200, 2254, {2048, 1, 5});
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("row 2248 in a call of its own"), std::string::npos) << st.message();
  // A warm tail: from within the window the rows before it are the same however the decoder
  // made them; from past it they include its answers', made by one-token calls.
  EXPECT_TRUE(check_sliding_calls(w, 300, 2348, {2048}).is_ok());
  st = check_sliding_calls(w, 301, 2349, {2048});
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("a warm tail from row 301 is past"), std::string::npos)
      << st.message();
}

// mlx-lm's qwen2 and qwen3 ignore layer_types (their attention is always full), so a checkpoint
// that lists sliding layers loads in the decoder with full attention, and here too.
TEST(LlamaConfig, QwenIgnoresLayerTypesAsTheDecoderDoes) {
  for (const char* type : {"qwen2", "qwen3"}) {
    auto j = base(type);
    j["layer_types"] = {"sliding_attention", "full_attention"};
    j["use_sliding_window"] = true;
    j["sliding_window"] = 4096;
    j["tie_word_embeddings"] = true;  // qwen3 has no default for these two
    j["rope_theta"] = 1e6;
    ASSERT_TRUE(config_of(j).is_ok()) << type << ": " << config_of(j).status().message();
    EXPECT_EQ(config_of(j)->sliding_window, 0) << type;
  }
}

}  // namespace
}  // namespace hetero
