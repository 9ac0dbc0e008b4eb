// The llama family's config.json as mlx-lm reads it: tied embeddings when the key is absent
// (llama, mistral, qwen2), untied for null (None), a clear refusal where mlx-lm itself would not
// load (qwen3 without the key), and rope scaling refused by name until it is built.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "../common/temp_dir.h"
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
  auto missing = config_of(q);
  ASSERT_FALSE(missing.is_ok());
  EXPECT_EQ(missing.status().code(), Code::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("tie_word_embeddings"), std::string::npos);
  q["tie_word_embeddings"] = true;
  EXPECT_TRUE(config_of(q)->tie_embeddings);
}

TEST(LlamaConfig, RopeScalingIsRefused) {
  auto j = base("llama");
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
  auto c = config_of(j);
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("rope_scaling"), std::string::npos);
}

}  // namespace
}  // namespace hetero
