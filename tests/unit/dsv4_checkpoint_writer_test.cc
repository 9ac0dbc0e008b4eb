// The official-layout checkpoint writer against the loaders that read it: the CPU model loader
// (every tensor present, shaped and quantized as the official release, every quantized matrix
// with its MX form) and the streaming reader (the shards' headers, byte ranges by pread).
#include "model/dsv4_checkpoint_writer.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "../common/dsv4_model_weights.h"
#include "../common/temp_dir.h"
#include "common/safetensors.h"

namespace hetero {
namespace {

TEST(Dsv4CheckpointWriter, WritesTheOfficialLayoutTheLoadersRead) {
  const Dsv4Config c = tiny_dsv4_config(/*hash_routed=*/false);
  TempDir dir;
  ASSERT_TRUE(write_dsv4_official_checkpoint(dir.path, c, 7).is_ok());
  auto config = load_dsv4_config(dir.path);
  ASSERT_TRUE(config.is_ok()) << config.status().to_string();
  EXPECT_EQ(config->hidden, c.hidden);
  EXPECT_EQ(config->compress_ratios, c.compress_ratios);
  EXPECT_EQ(config->index_keep, c.index_keep);
  EXPECT_EQ(config->yarn.factor, c.yarn.factor);

  auto w = load_dsv4_weights(dir.path);
  ASSERT_TRUE(w.is_ok()) << w.status().to_string();
  EXPECT_TRUE(check_mx_forms(*w).is_ok());
  const Dsv4LayerWeights& L = w->layers[1];
  ASSERT_EQ(L.w1.size(), static_cast<size_t>(c.n_routed_experts));
  EXPECT_TRUE(L.mx.w1[0].present());
  EXPECT_EQ(L.mx.w1[0].group, 32);
  EXPECT_TRUE(L.mx.wq_a.present());

  auto r = CheckpointReader::open(dir.path);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->files().size(), static_cast<size_t>(c.layers + 1));
  const TensorEntry* e = r->find("layers.1.ffn.experts.3.w2.weight");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->dtype, DType::kI8);
  EXPECT_EQ(e->shape, (std::vector<int64_t>{c.hidden, c.moe_inter / 2}));
  const TensorEntry* s = r->find("layers.2.attn.wq_b.scale");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->dtype, DType::kF8E8M0);
  EXPECT_EQ(s->shape, (std::vector<int64_t>{c.heads * c.head_dim / 128, 1}));
  // pread of a range: the same bytes the whole-file reader gives.
  auto whole = read_checkpoint_tensors(
      dir.path, [](const std::string& n) { return n == "layers.1.ffn.experts.3.w2.weight"; });
  ASSERT_TRUE(whole.is_ok());
  const Tensor& t = whole->at("layers.1.ffn.experts.3.w2.weight");
  std::vector<uint8_t> part(100);
  ASSERT_TRUE(r->read(*e, 17, 100, part.data()).is_ok());
  EXPECT_EQ(0, std::memcmp(part.data(), t.bytes.data() + 17, 100));
  EXPECT_EQ(r->read(*e, e->bytes - 10, 11, part.data()).code(), Code::kInvalidArgument);
  // The same seed draws the same checkpoint.
  TempDir again;
  ASSERT_TRUE(write_dsv4_official_checkpoint(again.path, c, 7).is_ok());
  auto w2 = load_dsv4_weights(again.path);
  ASSERT_TRUE(w2.is_ok());
  EXPECT_EQ(w2->layers[3].w2[5].bytes, w->layers[3].w2[5].bytes);
}

TEST(Dsv4CheckpointWriter, RefusesWhatTheFormatsCannotHold) {
  Dsv4Config c = tiny_dsv4_config();
  c.moe_inter = 96;
  TempDir dir;
  EXPECT_EQ(write_dsv4_official_checkpoint(dir.path, c, 1).code(), Code::kInvalidArgument);
}

TEST(CheckpointReader, RefusesATensorInTwoShards) {
  TempDir dir;
  TensorMap t;
  t["a"] = Tensor(DType::kF32, {2});
  ASSERT_TRUE(write_safetensors(dir.path + "/x-1.safetensors", t).is_ok());
  ASSERT_TRUE(write_safetensors(dir.path + "/x-2.safetensors", t).is_ok());
  auto r = CheckpointReader::open(dir.path);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), Code::kDataLoss);
  EXPECT_NE(r.status().message().find("'a'"), std::string::npos) << r.status().to_string();
}

}  // namespace
}  // namespace hetero
