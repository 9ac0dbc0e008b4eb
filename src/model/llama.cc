// Loading llama-family checkpoints. Every tensor's presence and shape is checked against the
// config so a mismatched checkpoint fails at load with the tensor's name, not later with NaNs.
#include "model/llama.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/bf16.h"
#include "common/safetensors.h"

namespace hetero {
namespace fs = std::filesystem;
using nlohmann::json;

Result<LlamaConfig> load_llama_config(const std::string& model_dir) {
  std::ifstream in(fs::path(model_dir) / "config.json");
  if (!in) return not_found("no config.json in " + model_dir);
  json j = json::parse(in, nullptr, false);
  if (j.is_discarded() || !j.is_object())
    return invalid_argument(model_dir + "/config.json is not JSON");
  LlamaConfig c;
  c.model_type = j.value("model_type", "");
  if (c.model_type != "llama" && c.model_type != "mistral" && c.model_type != "qwen2" &&
      c.model_type != "qwen3")
    return invalid_argument("model_type '" + c.model_type + "' is not in the llama family");
  try {
    c.hidden = j.at("hidden_size").get<int64_t>();
    c.intermediate = j.at("intermediate_size").get<int64_t>();
    c.layers = j.at("num_hidden_layers").get<int64_t>();
    c.heads = j.at("num_attention_heads").get<int64_t>();
    c.kv_heads = j.value("num_key_value_heads", c.heads);
    c.head_dim = j.contains("head_dim") && !j["head_dim"].is_null() ? j["head_dim"].get<int64_t>()
                                                                    : c.hidden / c.heads;
    c.vocab = j.at("vocab_size").get<int64_t>();
    c.rms_norm_eps = j.value("rms_norm_eps", 1e-6);
    // mlx-lm's defaults: llama (and mistral) 10000, qwen2 1e6; qwen3 requires it, taking it
    // from a transformers-v5 rope_parameters block when the top level lacks it.
    const json* rope_params = j.contains("rope_parameters") && j["rope_parameters"].is_object() &&
                                      !j["rope_parameters"].empty()
                                  ? &j["rope_parameters"]
                                  : nullptr;
    if (c.model_type == "qwen3") {
      const json* theta = j.contains("rope_theta") && !j["rope_theta"].is_null() ? &j["rope_theta"]
                          : rope_params && rope_params->contains("rope_theta")
                              ? &(*rope_params)["rope_theta"]
                              : nullptr;
      if (!theta)
        return invalid_argument(model_dir +
                                "/config.json has no rope_theta, which mlx-lm's qwen3 "
                                "requires");
      c.rope_theta = theta->get<double>();
    } else {
      c.rope_theta = j.value("rope_theta", c.model_type == "qwen2" ? 1000000.0 : 10000.0);
    }
    LlamaRopeConfig& r = c.rope_config;
    r.base = c.rope_theta, r.dims = c.head_dim;
    r.scaling = j.contains("rope_scaling") ? j["rope_scaling"] : json();
    if (r.scaling.is_null() && c.model_type == "qwen3" && rope_params) r.scaling = *rope_params;
    // qwen3 rotates halves whatever the config says; llama and qwen2 read rope_traditional.
    r.traditional = c.model_type != "qwen3" && j.value("rope_traditional", false);
    const char* mpe = "max_position_embeddings";
    r.max_position_embeddings = j.contains(mpe) && j[mpe].is_number_integer()
                                    ? j[mpe].get<int64_t>()
                                    : (c.model_type == "qwen2" ? 32768 : 0);
    // As mlx-lm reads it: llama (and mistral, which it loads as llama) and qwen2 tie when the
    // key is absent; its qwen3 has no default, so such a config loads in no decoder. A null
    // value is Python's None there: falsy, untied.
    const bool has_tie = j.contains("tie_word_embeddings");
    if (!has_tie && c.model_type == "qwen3")
      return invalid_argument(model_dir +
                              "/config.json has no tie_word_embeddings, which mlx-lm's qwen3 "
                              "requires");
    const json& tie = has_tie ? j["tie_word_embeddings"] : json(true);
    if (!tie.is_null() && !tie.is_boolean())
      return invalid_argument(model_dir +
                              "/config.json: tie_word_embeddings must be true or false");
    c.tie_embeddings = tie.is_boolean() && tie.get<bool>();
  } catch (const json::exception& e) {
    return invalid_argument(model_dir + "/config.json: " + e.what());
  }
  c.qkv_bias = c.model_type == "qwen2" || j.value("attention_bias", false);
  c.qk_norm = c.model_type == "qwen3";
  {
    Result<RopeSpec> rope = llama_rope(c.rope_config);
    if (!rope.is_ok())
      return invalid_argument(model_dir + "/config.json: " + rope.status().message());
    c.rope = std::move(rope.value());
  }
  if (j.contains("quantization") && j["quantization"].is_object()) {
    const std::string mode = j["quantization"].value("mode", "affine");
    if (mode != "affine" && mode != "mxfp4" && mode != "mxfp8")
      return invalid_argument(model_dir + "/config.json: quantization mode '" + mode +
                              "' is not read by the llama engine (affine, mxfp4 and mxfp8 are)");
  }
  // mlx-lm's llama (and mistral, which it loads as llama) reads layer_types: "sliding_attention"
  // gets a window and a RotatingKVCache, any other name full attention, and at least one
  // "full_attention" must be there. Its qwen2 and qwen3 ignore the key: full attention always.
  if ((c.model_type == "llama" || c.model_type == "mistral") && j.contains("layer_types") &&
      j["layer_types"].is_array()) {
    bool full = false, sliding = false;
    for (const json& t : j["layer_types"]) {
      c.sliding.push_back(t == "sliding_attention");
      sliding = sliding || c.sliding.back();
      full = full || t == "full_attention";
    }
    if (sliding) {
      const json* w = j.contains("sliding_window") ? &j["sliding_window"] : nullptr;
      if (!w || !w->is_number_integer() || w->get<int64_t>() <= 0)
        return invalid_argument(model_dir +
                                "/config.json: \"sliding_attention\" layers need a positive "
                                "integer sliding_window (mlx-lm sizes their caches by it)");
      c.sliding_window = w->get<int64_t>();
    }
    if (!full)
      return invalid_argument(model_dir +
                              "/config.json: layer_types has no \"full_attention\" layer, "
                              "which mlx-lm's llama requires");
    if (static_cast<int64_t>(c.sliding.size()) != c.layers)
      return invalid_argument(model_dir + "/config.json: layer_types names " +
                              std::to_string(c.sliding.size()) + " layers, the model has " +
                              std::to_string(c.layers));
  }
  if (c.heads % c.kv_heads != 0)
    return invalid_argument("num_attention_heads must be a multiple of num_key_value_heads");
  return c;
}

Tensor as_bf16(const Tensor& t) {
  if (t.dtype == DType::kBF16) return t;
  Tensor out(DType::kBF16, t.shape);
  auto* o = out.data<uint16_t>();
  for (int64_t i = 0; i < t.numel(); ++i) o[i] = f32_to_bf16(t.at_f32(i));
  return out;
}

namespace {

Status take(TensorMap& all, const std::string& name, std::vector<int64_t> shape, Tensor* out) {
  auto it = all.find(name);
  if (it == all.end()) return not_found("checkpoint has no tensor '" + name + "'");
  if (it->second.shape != shape) {
    Tensor want;
    want.shape = shape;
    return invalid_argument("tensor '" + name + "' has shape " + it->second.shape_string() +
                            ", config wants " + want.shape_string());
  }
  if (it->second.dtype != DType::kBF16 && it->second.dtype != DType::kF16 &&
      it->second.dtype != DType::kF32)
    return invalid_argument("tensor '" + name + "' has unsupported dtype");
  *out = as_bf16(it->second);
  all.erase(it);
  return Status::ok();
}

// `name.weight` dense, or quantized as mlx-lm stores it (`name.weight` U32 + `.scales`, and
// `.biases` for affine): into *q, with *dense left empty.
Status take_linear(TensorMap& all, const std::string& name, std::vector<int64_t> shape,
                   Tensor* dense, QuantizedWeight* q, std::string* quantization) {
  auto s = all.find(name + ".scales");
  if (s == all.end()) return take(all, name + ".weight", std::move(shape), dense);
  auto w = all.find(name + ".weight"), b = all.find(name + ".biases");
  if (w == all.end()) return not_found("quantized tensor '" + name + "' needs .weight");
  HETERO_ASSIGN_OR_RETURN(*q, unpack_quantized(name, w->second, s->second,
                                               b == all.end() ? nullptr : &b->second, shape[1]));
  if (q->n != shape[0])
    return invalid_argument("quantized tensor '" + name + "' has " + std::to_string(q->n) +
                            " rows, config wants " + std::to_string(shape[0]));
  if (quantization->empty()) *quantization = q->describe();
  all.erase(w), all.erase(s);
  if (b != all.end()) all.erase(b);
  return Status::ok();
}

// A table the decoder reads by rows (the embedding; lm_head for logits), dequantized when stored
// quantized.
Status take_table(TensorMap& all, const std::string& name, std::vector<int64_t> shape, Tensor* out,
                  std::string* quantization) {
  QuantizedWeight q;
  HETERO_RETURN_IF_ERROR(take_linear(all, name, shape, out, &q, quantization));
  if (q.empty()) return Status::ok();
  *out = dequantize(q);
  return Status::ok();
}

}  // namespace

Result<LlamaWeights> load_llama_weights(const std::string& model_dir) {
  LlamaWeights w;
  HETERO_ASSIGN_OR_RETURN(w.config, load_llama_config(model_dir));
  HETERO_ASSIGN_OR_RETURN(TensorMap all, read_checkpoint_tensors(model_dir));
  const LlamaConfig& c = w.config;
  const int64_t h = c.hidden, q = c.heads * c.head_dim, kv = c.kv_heads * c.head_dim;
  std::string* qz = &w.quantization;
  HETERO_RETURN_IF_ERROR(take_table(all, "model.embed_tokens", {c.vocab, h}, &w.embed, qz));
  HETERO_RETURN_IF_ERROR(take(all, "model.norm.weight", {h}, &w.final_norm));
  if (!c.tie_embeddings)
    HETERO_RETURN_IF_ERROR(take_table(all, "lm_head", {c.vocab, h}, &w.lm_head, qz));
  w.layers.resize(static_cast<size_t>(c.layers));
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    auto& L = w.layers[static_cast<size_t>(i)];
    HETERO_RETURN_IF_ERROR(take(all, p + "input_layernorm.weight", {h}, &L.input_norm));
    HETERO_RETURN_IF_ERROR(take(all, p + "post_attention_layernorm.weight", {h}, &L.post_norm));
    const std::string a = p + "self_attn.", m = p + "mlp.";
    HETERO_RETURN_IF_ERROR(take_linear(all, a + "q_proj", {q, h}, &L.wq, &L.qwq, qz));
    HETERO_RETURN_IF_ERROR(take_linear(all, a + "k_proj", {kv, h}, &L.wk, &L.qwk, qz));
    HETERO_RETURN_IF_ERROR(take_linear(all, a + "v_proj", {kv, h}, &L.wv, &L.qwv, qz));
    HETERO_RETURN_IF_ERROR(take_linear(all, a + "o_proj", {h, q}, &L.wo, &L.qwo, qz));
    if (c.qkv_bias) {
      HETERO_RETURN_IF_ERROR(take(all, p + "self_attn.q_proj.bias", {q}, &L.bq));
      HETERO_RETURN_IF_ERROR(take(all, p + "self_attn.k_proj.bias", {kv}, &L.bk));
      HETERO_RETURN_IF_ERROR(take(all, p + "self_attn.v_proj.bias", {kv}, &L.bv));
    }
    if (c.qk_norm) {
      HETERO_RETURN_IF_ERROR(take(all, p + "self_attn.q_norm.weight", {c.head_dim}, &L.q_norm));
      HETERO_RETURN_IF_ERROR(take(all, p + "self_attn.k_norm.weight", {c.head_dim}, &L.k_norm));
    }
    const int64_t f = c.intermediate;
    HETERO_RETURN_IF_ERROR(take_linear(all, m + "gate_proj", {f, h}, &L.w_gate, &L.qw_gate, qz));
    HETERO_RETURN_IF_ERROR(take_linear(all, m + "up_proj", {f, h}, &L.w_up, &L.qw_up, qz));
    HETERO_RETURN_IF_ERROR(take_linear(all, m + "down_proj", {h, f}, &L.w_down, &L.qw_down, qz));
  }
  return w;
}

}  // namespace hetero
