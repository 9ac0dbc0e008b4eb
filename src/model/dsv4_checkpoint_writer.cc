// The official-layout checkpoint writer (dsv4_checkpoint_writer.h). Each tensor is drawn from
// its own stream (seed and name), so shards can be written in any order and the values do not
// depend on the sharding.
#include "model/dsv4_checkpoint_writer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "common/bf16.h"
#include "common/safetensors.h"

namespace hetero {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// splitmix64: a fast, well-mixed stream per tensor (and per thread slice of it).
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Roughly N(0, 1): the sum of four uniforms, centred and scaled.
  float normal() {
    const uint64_t r = next();
    float u = 0;
    for (int i = 0; i < 4; ++i) u += static_cast<float>((r >> (16 * i)) & 0xffff) / 65536.f;
    return (u - 2.f) * 1.7320508f;
  }
};

uint64_t stream_seed(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull;
  for (char ch : name) h = (h ^ static_cast<uint8_t>(ch)) * 1099511628211ull;
  return h ^ (seed * 0x9e3779b97f4a7c15ull);
}

// fn(i, rng) for i in [0, n), over the host's cores in contiguous slices, each slice its own
// stream (the values depend on the seed, the name and the number of slices, fixed below).
// Small tensors (most of a tiny model's) run their slices in the calling thread: the same
// streams, without a thread per slice.
template <class F>
void parallel_fill(int64_t n, uint64_t seed, F&& fn) {
  constexpr int64_t kSlices = 16, kThreadedFrom = int64_t{1} << 20;
  const int64_t per = (n + kSlices - 1) / kSlices;
  auto slice = [&](int64_t s) {
    Rng rng{seed + static_cast<uint64_t>(s) * 0x632be59bd9b4e019ull};
    for (int64_t i = s * per; i < std::min(n, (s + 1) * per); ++i) fn(i, rng);
  };
  if (n < kThreadedFrom) {
    for (int64_t s = 0; s < kSlices; ++s) slice(s);
    return;
  }
  std::vector<std::thread> threads;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  for (int64_t s0 = 0; s0 < kSlices; s0 += cores) {
    for (int64_t s = s0; s < std::min<int64_t>(kSlices, s0 + cores); ++s)
      threads.emplace_back(slice, s);
    for (auto& t : threads) t.join();
    threads.clear();
  }
}

// The UE8M0 byte of 2^e.
uint8_t ue8m0(int e) { return static_cast<uint8_t>(std::clamp(e + 127, 0, 254)); }

class Shard {
 public:
  Shard(uint64_t seed, const std::string& prefix) : seed_(seed), prefix_(prefix) {}
  TensorMap& tensors() { return t_; }

  void bf16(const std::string& name, std::vector<int64_t> shape, float scale, float offset = 0) {
    Tensor& t = add(name, DType::kBF16, std::move(shape));
    uint16_t* d = t.data<uint16_t>();
    parallel_fill(t.numel(), key(name),
                  [&](int64_t i, Rng& r) { d[i] = f32_to_bf16(offset + scale * r.normal()); });
  }
  void f32(const std::string& name, std::vector<int64_t> shape, float scale, float offset = 0) {
    Tensor& t = add(name, DType::kF32, std::move(shape));
    float* d = t.data<float>();
    parallel_fill(t.numel(), key(name),
                  [&](int64_t i, Rng& r) { d[i] = offset + scale * r.normal(); });
  }
  void matrix(const std::string& name, int64_t rows, int64_t cols) {
    bf16(name + ".weight", {rows, cols}, 1.f / std::sqrt(static_cast<float>(cols)));
  }
  void norm(const std::string& name, int64_t n) { bf16(name + ".weight", {n}, 0.1f, 1.f); }
  void ids(const std::string& name, int64_t rows, int64_t cols, int64_t modulo) {
    Tensor& t = add(name, DType::kI64, {rows, cols});
    int64_t* d = t.data<int64_t>();
    parallel_fill(t.numel(), key(name), [&](int64_t i, Rng& r) {
      d[i] = static_cast<int64_t>(r.next() % static_cast<uint64_t>(modulo));
    });
  }
  // FP8 e4m3 codes with magnitudes 2^-3 .. 2^3 (RMS ~ 4), block scales 2^e with
  // 2^e * 4 ~ 1/sqrt(cols), jittered by one.
  void fp8(const std::string& name, int64_t rows, int64_t cols) {
    Tensor& q = add(name + ".weight", DType::kF8E4M3, {rows, cols});
    uint8_t* d = q.data<uint8_t>();
    parallel_fill(q.numel(), key(name + ".weight"), [&](int64_t i, Rng& r) {
      const uint64_t x = r.next();
      d[i] = static_cast<uint8_t>(((x & 1) << 7) | ((4 + (x >> 8) % 7) << 3) | ((x >> 16) & 7));
    });
    const int e = static_cast<int>(std::floor(std::log2(0.25 / std::sqrt(double(cols)))));
    scales(name + ".scale", (rows + 127) / 128, (cols + 127) / 128, e);
  }
  // FP4 e2m1 codes uniform over the 16 values (RMS ~ 2.9), per-32 scales 2^e with
  // 2^e * 2.9 ~ 1/sqrt(cols), jittered by one.
  void fp4(const std::string& name, int64_t rows, int64_t cols) {
    Tensor& q = add(name + ".weight", DType::kI8, {rows, cols / 2});
    uint8_t* d = q.data<uint8_t>();
    parallel_fill(q.numel(), key(name + ".weight"),
                  [&](int64_t i, Rng& r) { d[i] = static_cast<uint8_t>(r.next() & 0xff); });
    const int e = static_cast<int>(std::floor(std::log2(0.34 / std::sqrt(double(cols)))));
    scales(name + ".scale", rows, cols / 32, e);
  }

 private:
  uint64_t key(const std::string& name) const { return stream_seed(seed_, prefix_ + name); }
  Tensor& add(const std::string& name, DType dtype, std::vector<int64_t> shape) {
    return t_[prefix_ + name] = Tensor(dtype, std::move(shape));
  }
  void scales(const std::string& name, int64_t rows, int64_t cols, int e) {
    Tensor& s = add(name, DType::kF8E8M0, {rows, cols});
    uint8_t* d = s.data<uint8_t>();
    parallel_fill(s.numel(), key(name),
                  [&](int64_t i, Rng& r) { d[i] = ue8m0(e + static_cast<int>(r.next() % 2)); });
  }

  uint64_t seed_;
  std::string prefix_;
  TensorMap t_;
};

void write_layer(Shard& s, const Dsv4Config& c, int64_t l) {
  const int64_t H = c.hidden, hd = c.head_dim, W = c.hc_mult * H, mix = c.hc_mix();
  const int64_t E = c.n_routed_experts, I = c.moe_inter, S = c.moe_inter * c.n_shared_experts;
  const int64_t QL = c.q_lora_rank, G = c.o_groups, R = c.o_lora_rank;
  const int32_t ratio = c.compress_ratios[static_cast<size_t>(l)];
  s.norm("attn_norm", H);
  s.norm("ffn_norm", H);
  for (const char* hc : {"hc_attn", "hc_ffn"}) {
    s.f32(std::string(hc) + "_fn", {mix, W}, 1.f / std::sqrt(static_cast<float>(W)));
    s.f32(std::string(hc) + "_base", {mix}, 0.1f);
    s.f32(std::string(hc) + "_scale", {3}, 0.1f, 1.f);
  }
  s.fp8("attn.wq_a", QL, H);
  s.norm("attn.q_norm", QL);
  s.fp8("attn.wq_b", c.heads * hd, QL);
  s.fp8("attn.wkv", hd, H);
  s.norm("attn.kv_norm", hd);
  s.fp8("attn.wo_a", G * R, c.heads * hd / G);
  s.fp8("attn.wo_b", H, G * R);
  s.f32("attn.attn_sink", {c.heads}, 1.f);
  auto comp = [&](const std::string& p, int64_t d) {
    const int64_t out = ratio == 4 ? 2 * d : d;
    s.matrix(p + "wkv", out, H);
    s.matrix(p + "wgate", out, H);
    s.f32(p + "ape", {ratio, out}, 0.1f);
    s.norm(p + "norm", d);
  };
  if (ratio > 0) comp("attn.compressor.", hd);
  if (ratio == 4) {
    comp("attn.indexer.compressor.", c.index_head_dim);
    s.fp8("attn.indexer.wq_b", c.index_n_heads * c.index_head_dim, QL);
    s.matrix("attn.indexer.weights_proj", c.index_n_heads, H);
  }
  s.matrix("ffn.gate", E, H);
  if (l < c.num_hash_layers)
    s.ids("ffn.gate.tid2eid", c.vocab, c.experts_per_tok, E);
  else
    s.f32("ffn.gate.bias", {E}, 0.1f);
  for (int64_t e = 0; e < E; ++e) {
    const std::string p = "ffn.experts." + std::to_string(e) + ".";
    s.fp4(p + "w1", I, H);
    s.fp4(p + "w3", I, H);
    s.fp4(p + "w2", H, I);
  }
  if (S > 0) {
    s.fp8("ffn.shared_experts.w1", S, H);
    s.fp8("ffn.shared_experts.w3", S, H);
    s.fp8("ffn.shared_experts.w2", H, S);
  }
}

}  // namespace

std::string dsv4_config_json(const Dsv4Config& c) {
  json j = {{"architectures", {"DeepseekV4ForCausalLM"}},
            {"model_type", "deepseek_v4"},
            {"vocab_size", c.vocab},
            {"hidden_size", c.hidden},
            {"num_hidden_layers", c.layers},
            {"num_attention_heads", c.heads},
            {"num_key_value_heads", 1},
            {"head_dim", c.head_dim},
            {"qk_rope_head_dim", c.rope_head_dim},
            {"q_lora_rank", c.q_lora_rank},
            {"o_groups", c.o_groups},
            {"o_lora_rank", c.o_lora_rank},
            {"n_routed_experts", c.n_routed_experts},
            {"n_shared_experts", c.n_shared_experts},
            {"num_experts_per_tok", c.experts_per_tok},
            {"moe_intermediate_size", c.moe_inter},
            {"num_hash_layers", c.num_hash_layers},
            {"sliding_window", c.sliding_window},
            {"index_n_heads", c.index_n_heads},
            {"index_head_dim", c.index_head_dim},
            {"index_topk", c.index_topk},
            {"index_block", c.index_block},
            {"index_keep", c.index_keep},
            {"hc_mult", c.hc_mult},
            {"hc_sinkhorn_iters", c.hc_sinkhorn_iters},
            {"rms_norm_eps", c.rms_norm_eps},
            {"hc_eps", c.hc_eps},
            {"rope_theta", c.rope_theta},
            {"compress_rope_theta", c.compress_rope_theta},
            {"routed_scaling_factor", c.routed_scaling_factor},
            {"swiglu_limit", c.swiglu_limit},
            {"norm_topk_prob", c.norm_topk_prob},
            {"attention_bias", c.attention_bias},
            {"scoring_func", c.scoring_func},
            {"compress_ratios", c.compress_ratios},
            {"expert_dtype", "fp4"},
            {"torch_dtype", "bfloat16"},
            {"quantization_config",
             {{"activation_scheme", "dynamic"},
              {"fmt", "e4m3"},
              {"quant_method", "fp8"},
              {"scale_fmt", "ue8m0"},
              {"weight_block_size", {128, 128}}}}};
  if (c.yarn.enabled)
    j["rope_scaling"] = {
        {"type", "yarn"},
        {"factor", c.yarn.factor},
        {"original_max_position_embeddings", c.yarn.original_max_position_embeddings},
        {"beta_fast", c.yarn.beta_fast},
        {"beta_slow", c.yarn.beta_slow}};
  return j.dump(2);
}

Status write_dsv4_official_checkpoint(const std::string& dir, const Dsv4Config& c, uint64_t seed) {
  const int64_t S = c.moe_inter * c.n_shared_experts;
  if (c.hidden % 128 != 0 || c.moe_inter % 128 != 0 || S % 128 != 0)
    return invalid_argument(
        "the official layout needs hidden and moe_intermediate_size multiples of 128");
  if (c.attention_bias) return invalid_argument("the official layout has no attention bias");
  if (static_cast<int64_t>(c.compress_ratios.size()) != c.layers)
    return invalid_argument("compress_ratios must have one entry per layer");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return unavailable("cannot create " + dir + ": " + ec.message());
  {
    std::ofstream cfg(fs::path(dir) / "config.json");
    cfg << dsv4_config_json(c) << "\n";
    if (!cfg) return unavailable("cannot write " + dir + "/config.json");
  }
  const int64_t shards = c.layers + 1;
  json weight_map = json::object();
  int64_t total = 0;
  for (int64_t i = 0; i < shards; ++i) {
    char file[64];
    std::snprintf(file, sizeof(file), "model-%05lld-of-%05lld.safetensors",
                  static_cast<long long>(i + 1), static_cast<long long>(shards));
    Shard s(seed, i == 0 ? "" : "layers." + std::to_string(i - 1) + ".");
    if (i == 0) {
      s.bf16("embed.weight", {c.vocab, c.hidden}, 1.f);
      s.bf16("head.weight", {c.vocab, c.hidden}, 1.f / std::sqrt(static_cast<float>(c.hidden)));
      s.norm("norm", c.hidden);
      s.f32("hc_head_fn", {c.hc_mult, c.hc_mult * c.hidden},
            1.f / std::sqrt(static_cast<float>(c.hc_mult * c.hidden)));
      s.f32("hc_head_base", {c.hc_mult}, 0.1f);
      s.f32("hc_head_scale", {1}, 0.1f, 1.f);
    } else {
      write_layer(s, c, i - 1);
    }
    for (auto& [name, t] : s.tensors()) weight_map[name] = file, total += t.nbytes();
    HETERO_RETURN_IF_ERROR(
        write_safetensors((fs::path(dir) / file).string(), s.tensors(), {{"format", "pt"}}));
  }
  std::ofstream idx(fs::path(dir) / "model.safetensors.index.json");
  idx << json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(1) << "\n";
  if (!idx) return unavailable("cannot write the index of " + dir);
  return Status::ok();
}

}  // namespace hetero
