// The DeepSeek-V4 family (model_type "deepseek_v4") as the decoder (mlx-vlm 0.7.10) defines it:
// its configuration and its weights, loaded from a checkpoint in the official tensor layout
// (layers.N.attn.wq_a.weight, layers.N.ffn.experts.E.w1.weight, hc_head_fn, ...). Weights may be
// stored as FP8 e4m3 with UE8M0 128x128 block scales (dense projections), FP4 e2m1 packed in
// int8 with UE8M0 per-32 scales (routed experts), or plain bf16/f16/f32; everything is
// dequantized to bf16 at load, which is exact for these formats. The FP8/FP4 projections also
// keep their own quantization in MX form (Dsv4MxMatrix) for the engine's decoder-arithmetic
// profile. float32 parameters (the hyper-connections, attention sinks, compressor ape, router
// bias) keep their stored values.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/safetensors.h"
#include "common/status.h"
#include "common/tensor.h"
#include "kernels/dsv4_ops.h"

namespace hetero {

struct Dsv4Config {
  std::string model_type;  // "deepseek_v4"
  int64_t vocab = 0, hidden = 0, layers = 0;
  int64_t heads = 0, head_dim = 0, rope_head_dim = 0;  // rope on the last rope_head_dim dims
  int64_t q_lora_rank = 0, o_groups = 0, o_lora_rank = 0;
  int64_t n_routed_experts = 0, n_shared_experts = 0, experts_per_tok = 0, moe_inter = 0;
  int64_t num_hash_layers = 0;
  int64_t sliding_window = 0;
  int64_t index_n_heads = 0, index_head_dim = 0, index_topk = 0;
  int64_t index_block = 0, index_keep = 0;  // the decoder's HISA selection (0: off)
  int64_t hc_mult = 0, hc_sinkhorn_iters = 0;
  double rms_norm_eps = 1e-6, hc_eps = 1e-6;
  double rope_theta = 10000.0, compress_rope_theta = 160000.0;
  double routed_scaling_factor = 1.0, swiglu_limit = 0.0;
  bool norm_topk_prob = true, attention_bias = false;
  std::string scoring_func;  // "sqrtsoftplus", "sigmoid" or "softmax"
  YarnScaling yarn;          // rope_scaling (yarn / deepseek_yarn), used by compressed layers
  std::vector<int32_t> compress_ratios;  // one per layer, each 0, 4 or 128

  int64_t hc_mix() const { return (2 + hc_mult) * hc_mult; }
};

// Parses config.json with the decoder's defaults and checks (compress_ratios cut to
// num_hidden_layers, or the default pattern when empty; every value in {0, 4, 128}).
// Configurations the forward cannot compute are refused with a message.
Result<Dsv4Config> parse_dsv4_config(const std::string& json_text);
Result<Dsv4Config> load_dsv4_config(const std::string& model_dir);
// True when model_dir/config.json says model_type "deepseek_v4" (no other checks).
bool is_dsv4_checkpoint(const std::string& model_dir);

// hc_{attn,ffn}_{fn,base,scale}: fn [mix, hc_mult*hidden], base [mix], scale [3] (float32).
struct Dsv4HyperConnection {
  std::vector<float> fn, base, scale;
};

// A compressor (the attention's own, or the indexer's): wkv/wgate [out_dim, hidden] bf16 with
// out_dim = head_dim * (ratio == 4 ? 2 : 1), ape [ratio, out_dim] (stored values), norm
// [head_dim] bf16.
struct Dsv4Compressor {
  int32_t ratio = 0;
  int64_t head_dim = 0, out_dim = 0;
  Tensor wkv, wgate, norm;
  std::vector<float> ape;
};

// A matrix's checkpoint quantization in the MX form mlx-vlm's converter writes for it (mxfp8 for
// FP8 e4m3 with 128x128 UE8M0 blocks, each block's scale repeated per 32 inputs; mxfp4 for FP4
// e2m1 with per-32 UE8M0 scales): values [rows, cols] are the e4m3/e2m1 element values
// (unscaled), scales [rows, cols/group] powers of two. Empty when the matrix is stored dense,
// its scales are not powers of two, or cols is not a multiple of the group.
struct Dsv4MxMatrix {
  int64_t rows = 0, cols = 0, group = 0;
  std::vector<float> values, scales;
  // Set when the checkpoint stores the matrix quantized but it has no MX form (a scale that is
  // not a power of two, a width not a multiple of 32): the decoder's quantized arithmetic
  // cannot be reproduced for it.
  std::string no_form;
  bool present() const { return !values.empty(); }
};

// The MX forms of a layer's projections (each empty where the checkpoint stores it dense).
// These are the matrices the official checkpoint quantizes; the router gate, the compressors and
// the indexer's weights_proj are bf16 there and have none.
struct Dsv4LayerMx {
  Dsv4MxMatrix wq_a, wq_b, wkv, wo_a, wo_b, index_wq_b, shared_w1, shared_w2, shared_w3;
  std::vector<Dsv4MxMatrix> w1, w2, w3;  // routed experts
};

// All matrices bf16 [out, in]. Empty tensors where the layer has no such part.
struct Dsv4LayerWeights {
  int32_t ratio = 0;
  Tensor attn_norm, ffn_norm;  // [hidden]
  Dsv4HyperConnection hc_attn, hc_ffn;
  Tensor wq_a, q_norm, wq_b;              // [q_lora, hidden], [q_lora], [heads*head_dim, q_lora]
  Tensor wkv, kv_norm;                    // [head_dim, hidden], [head_dim]
  Tensor wo_a;                            // [o_groups*o_lora, heads*head_dim/o_groups]
  Tensor wo_b, wo_b_bias;                 // [hidden, o_groups*o_lora], [hidden] when attention_bias
  std::vector<float> attn_sink;           // [heads]
  Dsv4Compressor compressor;              // ratio > 0
  Dsv4Compressor index_compressor;        // ratio 4
  Tensor index_wq_b, index_weights_proj;  // [ih*ihd, q_lora], [ih, hidden] (ratio 4)
  Tensor gate;                            // [experts, hidden]
  std::vector<float> gate_bias;           // [experts] (score-routed layers)
  std::vector<int32_t> tid2eid;           // [vocab, top_k] (hash-routed layers)
  std::vector<Tensor> w1, w2, w3;         // routed experts: gate, down, up
  Tensor shared_w1, shared_w2, shared_w3;  // shared expert: gate, down, up
  Dsv4LayerMx mx;                          // the same projections' MX forms, where quantized
};

struct Dsv4Weights {
  Dsv4Config config;
  Tensor embed;                 // [vocab, hidden] bf16
  Tensor final_norm;            // [hidden]
  Tensor head;                  // [vocab, hidden]
  Dsv4HyperConnection hc_head;  // fn [hc_mult, hc_mult*hidden], base [hc_mult], scale [1]
  std::vector<Dsv4LayerWeights> layers;
};

// Loads config.json and the safetensors of model_dir. Every tensor a layer needs is checked
// for presence and shape; layers at or past num_hidden_layers and mtp.* are ignored, as the
// decoder does.
// Refuses weights with a quantized matrix that has no MX form, naming it (the mlx-cpu
// arithmetic profile needs every one).
Status check_mx_forms(const Dsv4Weights& w);
Result<Dsv4Weights> load_dsv4_weights(const std::string& model_dir);

// The tensors of a checkpoint that the decoder's export also carries (the cache program's
// weights; python/hetero_mlx/dsv4.py `cache_weights`): per layer attn.wkv.weight and
// attn.kv_norm.weight, and each compressor's wkv.weight, wgate.weight, norm.weight and ape
// (attn.compressor.*, attn.indexer.compressor.*), under the official names, loaded as
// load_dsv4_weights loads them: matrices and norms bf16 (FP8/FP4 dequantized, exactly), ape as
// stored widened to F32. No other tensor is read. `storage` says how the checkpoint stores each
// ("bf16", "f32", "fp8 e4m3, 128x128 block scales", ...).
struct Dsv4CacheTensors {
  TensorMap tensors;
  std::map<std::string, std::string> storage;
};
Result<Dsv4CacheTensors> load_dsv4_cache_tensors(const std::string& model_dir);

// Dequantization of the checkpoint formats, exposed for tests.
// FP8: w [rows, cols] e4m3, scale [ceil(rows/block), ceil(cols/block)] UE8M0 (or f32).
Result<Tensor> dequant_fp8_block(const Tensor& w, const Tensor& scale, int64_t block = 128);
// FP4: w [rows, cols/2] int8/uint8, two e2m1 codes per byte (low nibble first),
// scale [rows, cols/group] UE8M0 (or f32).
Result<Tensor> dequant_fp4_group(const Tensor& w, const Tensor& scale, int64_t group = 32);
// The MX forms of the same two formats (group 32). Empty (not an error) where the format has no
// MX form: a scale that is not a power of two, or cols not a multiple of 32.
Result<Dsv4MxMatrix> mx_from_fp8_block(const Tensor& w, const Tensor& scale, int64_t block = 128);
Result<Dsv4MxMatrix> mx_from_fp4_group(const Tensor& w, const Tensor& scale);

}  // namespace hetero
