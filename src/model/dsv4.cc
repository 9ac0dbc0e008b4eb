// Loading DeepSeek-V4 checkpoints: config.json with the decoder's defaults and checks, and the
// official tensor layout with its FP8/FP4 formats dequantized to bf16 (or a dense conversion by
// mlx-vlm, folded back onto the official names). Every tensor's presence
// and shape is checked against the config, so a mismatched checkpoint fails at load with the
// tensor's name.
#include "model/dsv4.h"

#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/bf16.h"
#include "common/safetensors.h"

namespace hetero {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

int64_t get_int(const json& j, const char* key, int64_t dflt) {
  return j.contains(key) && !j[key].is_null() ? j[key].get<int64_t>() : dflt;
}
double get_num(const json& j, const char* key, double dflt) {
  return j.contains(key) && !j[key].is_null() ? j[key].get<double>() : dflt;
}
bool get_bool(const json& j, const char* key, bool dflt) {
  return j.contains(key) && !j[key].is_null() ? j[key].get<bool>() : dflt;
}

Status parse_rope_scaling(const json& j, YarnScaling* yarn) {
  if (!j.contains("rope_scaling") || j["rope_scaling"].is_null()) return Status::ok();
  const json& rs = j["rope_scaling"];
  if (!rs.is_object()) return invalid_argument("rope_scaling must be an object or null");
  std::string type = rs.value("type", "");
  if (type.empty()) type = rs.value("rope_type", "");
  if (type.empty() || type == "default") return Status::ok();
  if (type != "yarn" && type != "deepseek_yarn")
    return invalid_argument("unsupported DeepSeek-V4 rope_scaling type '" + type + "'");
  if (!rs.contains("factor") || !rs.contains("original_max_position_embeddings"))
    return invalid_argument("yarn rope_scaling needs factor and original_max_position_embeddings");
  yarn->enabled = true;
  yarn->factor = rs["factor"].get<double>();
  yarn->original_max_position_embeddings = rs["original_max_position_embeddings"].get<double>();
  yarn->beta_fast = get_num(rs, "beta_fast", 32.0);
  yarn->beta_slow = get_num(rs, "beta_slow", 1.0);
  return Status::ok();
}

}  // namespace

Result<Dsv4Config> parse_dsv4_config(const std::string& json_text) {
  json j = json::parse(json_text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return invalid_argument("config is not a JSON object");
  Dsv4Config c;
  c.model_type = j.value("model_type", "");
  if (c.model_type != "deepseek_v4")
    return invalid_argument("model_type '" + c.model_type + "' is not deepseek_v4");
  try {
    // Defaults are the decoder's (mlx_vlm/models/deepseek_v4/config.py).
    c.vocab = get_int(j, "vocab_size", 129280);
    c.hidden = get_int(j, "hidden_size", 4096);
    c.layers = get_int(j, "num_hidden_layers", 43);
    c.heads = get_int(j, "num_attention_heads", 64);
    c.head_dim = get_int(j, "head_dim", 512);
    c.rope_head_dim = get_int(j, "qk_rope_head_dim", 64);
    c.q_lora_rank = get_int(j, "q_lora_rank", 1024);
    c.o_groups = get_int(j, "o_groups", 8);
    c.o_lora_rank = get_int(j, "o_lora_rank", 1024);
    c.n_routed_experts = get_int(j, "n_routed_experts", 256);
    c.n_shared_experts = get_int(j, "n_shared_experts", 1);
    c.experts_per_tok = get_int(j, "num_experts_per_tok", 6);
    c.moe_inter = get_int(j, "moe_intermediate_size", 2048);
    c.num_hash_layers = get_int(j, "num_hash_layers", 3);
    c.sliding_window = get_int(j, "sliding_window", 128);
    c.index_n_heads = get_int(j, "index_n_heads", 64);
    c.index_head_dim = get_int(j, "index_head_dim", 128);
    c.index_topk = get_int(j, "index_topk", 512);
    c.index_block = get_int(j, "index_block", 64);
    c.index_keep = get_int(j, "index_keep", 16);
    c.hc_mult = get_int(j, "hc_mult", 4);
    c.hc_sinkhorn_iters = get_int(j, "hc_sinkhorn_iters", 20);
    c.rms_norm_eps = get_num(j, "rms_norm_eps", 1e-6);
    c.hc_eps = get_num(j, "hc_eps", 1e-6);
    c.rope_theta = get_num(j, "rope_theta", 10000.0);
    c.compress_rope_theta = get_num(j, "compress_rope_theta", 160000.0);
    c.routed_scaling_factor = get_num(j, "routed_scaling_factor", 1.5);
    c.swiglu_limit = get_num(j, "swiglu_limit", 10.0);
    c.norm_topk_prob = get_bool(j, "norm_topk_prob", true);
    c.attention_bias = get_bool(j, "attention_bias", false);
    c.scoring_func = j.value("scoring_func", "sqrtsoftplus");
    if (j.contains("compress_ratios") && !j["compress_ratios"].is_null())
      for (auto& r : j["compress_ratios"]) c.compress_ratios.push_back(r.get<int32_t>());
    if (get_int(j, "vision_n_layers", 0) > 0)
      return invalid_argument("DeepSeek-V4 vision layers are not supported by the CPU engine");
  } catch (const json::exception& e) {
    return invalid_argument(std::string("config: ") + e.what());
  }
  HETERO_RETURN_IF_ERROR(parse_rope_scaling(j, &c.yarn));

  if (c.layers <= 0) return invalid_argument("num_hidden_layers must be positive");
  if (c.compress_ratios.empty()) {  // the decoder's default pattern
    c.compress_ratios.push_back(0);
    for (int64_t i = 0; i < std::max<int64_t>(c.layers - 2, 0); ++i)
      c.compress_ratios.push_back(i % 2 ? 4 : 128);
    if (c.layers >= 2) c.compress_ratios.push_back(0);
  }
  // The official configs list one more ratio than layers (the MTP block): cut, as the decoder.
  if (static_cast<int64_t>(c.compress_ratios.size()) > c.layers)
    c.compress_ratios.resize(static_cast<size_t>(c.layers));
  if (static_cast<int64_t>(c.compress_ratios.size()) != c.layers)
    return invalid_argument("compress_ratios has " + std::to_string(c.compress_ratios.size()) +
                            " entries for " + std::to_string(c.layers) + " layers");
  for (int32_t r : c.compress_ratios)
    if (r != 0 && r != 4 && r != 128)
      return invalid_argument("unsupported compress ratio " + std::to_string(r) +
                              " (DeepSeek-V4 has 0, 4 and 128)");
  if (c.scoring_func != "sqrtsoftplus" && c.scoring_func != "sigmoid" &&
      c.scoring_func != "softmax")
    return invalid_argument("unsupported scoring_func '" + c.scoring_func + "'");
  for (auto [v, name] : {std::pair{c.vocab, "vocab_size"},
                         {c.hidden, "hidden_size"},
                         {c.heads, "num_attention_heads"},
                         {c.head_dim, "head_dim"},
                         {c.q_lora_rank, "q_lora_rank"},
                         {c.o_groups, "o_groups"},
                         {c.o_lora_rank, "o_lora_rank"},
                         {c.n_routed_experts, "n_routed_experts"},
                         {c.experts_per_tok, "num_experts_per_tok"},
                         {c.moe_inter, "moe_intermediate_size"},
                         {c.hc_mult, "hc_mult"},
                         {c.sliding_window, "sliding_window"},
                         {c.index_n_heads, "index_n_heads"},
                         {c.index_head_dim, "index_head_dim"},
                         {c.index_topk, "index_topk"}})
    if (v <= 0) return invalid_argument(std::string(name) + " must be positive");
  if (c.rope_head_dim <= 0 || c.rope_head_dim % 2 != 0 || c.rope_head_dim > c.head_dim ||
      c.rope_head_dim > c.index_head_dim)
    return invalid_argument("qk_rope_head_dim must be even and at most head_dim/index_head_dim");
  if (c.heads % c.o_groups != 0)
    return invalid_argument("num_attention_heads must be a multiple of o_groups");
  if (c.experts_per_tok > c.n_routed_experts)
    return invalid_argument("num_experts_per_tok exceeds n_routed_experts");
  if (c.hc_sinkhorn_iters < 0) return invalid_argument("hc_sinkhorn_iters must be >= 0");
  return c;
}

Result<Dsv4Config> load_dsv4_config(const std::string& model_dir) {
  std::ifstream in(fs::path(model_dir) / "config.json");
  if (!in) return not_found("no config.json in " + model_dir);
  std::stringstream ss;
  ss << in.rdbuf();
  auto c = parse_dsv4_config(ss.str());
  if (!c.is_ok()) return invalid_argument(model_dir + "/config.json: " + c.status().message());
  return c;
}

bool is_dsv4_checkpoint(const std::string& model_dir) {
  std::ifstream in(fs::path(model_dir) / "config.json");
  if (!in) return false;
  json j = json::parse(in, nullptr, false);
  return j.is_object() && j.value("model_type", "") == "deepseek_v4";
}

Result<Tensor> dequant_fp8_block(const Tensor& w, const Tensor& scale, int64_t block) {
  if (w.shape.size() != 2 || scale.shape.size() != 2)
    return invalid_argument("FP8 weight and scale must be 2-D, got " + w.shape_string() + " and " +
                            scale.shape_string());
  if (w.dtype != DType::kF8E4M3 && w.dtype != DType::kU8 && w.dtype != DType::kI8)
    return invalid_argument(std::string("FP8 weight has dtype ") + dtype_name(w.dtype));
  const int64_t rows = w.shape[0], cols = w.shape[1];
  const int64_t srows = (rows + block - 1) / block, scols = (cols + block - 1) / block;
  if (scale.shape[0] != srows || scale.shape[1] != scols)
    return invalid_argument("FP8 scale " + scale.shape_string() + " does not cover weight " +
                            w.shape_string() + " in " + std::to_string(block) + "-blocks");
  const std::vector<float> s = to_f32(scale);
  Tensor out(DType::kBF16, w.shape);
  const uint8_t* src = w.data<uint8_t>();
  uint16_t* dst = out.data<uint16_t>();
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      dst[i * cols + j] = f32_to_bf16(fp8_e4m3_to_f32(src[i * cols + j]) *
                                      s[static_cast<size_t>((i / block) * scols + j / block)]);
  return out;
}

Result<Tensor> dequant_fp4_group(const Tensor& w, const Tensor& scale, int64_t group) {
  if (w.shape.size() != 2 || scale.shape.size() != 2)
    return invalid_argument("FP4 weight and scale must be 2-D, got " + w.shape_string() + " and " +
                            scale.shape_string());
  if (w.dtype != DType::kI8 && w.dtype != DType::kU8)
    return invalid_argument(std::string("FP4 weight has dtype ") + dtype_name(w.dtype));
  const int64_t rows = w.shape[0], cols = w.shape[1] * 2;
  if (cols % group != 0 || scale.shape[0] != rows || scale.shape[1] != cols / group)
    return invalid_argument("FP4 scale " + scale.shape_string() + " does not cover weight " +
                            w.shape_string() + " (" + std::to_string(cols) + " columns) in " +
                            std::to_string(group) + "-groups");
  const std::vector<float> s = to_f32(scale);
  Tensor out(DType::kBF16, {rows, cols});
  const uint8_t* src = w.data<uint8_t>();
  uint16_t* dst = out.data<uint16_t>();
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      const uint8_t byte = src[i * (cols / 2) + j / 2];
      const uint8_t code = (j % 2 == 0) ? (byte & 0x0f) : (byte >> 4);
      dst[i * cols + j] = f32_to_bf16(fp4_e2m1_to_f32(code) *
                                      s[static_cast<size_t>(i * (cols / group) + j / group)]);
    }
  return out;
}

namespace {

// A power of two (what a UE8M0 scale decodes to), so that scale * element is exact in bf16.
bool is_power_of_two(float v) {
  if (!(v > 0.0f) || !std::isfinite(v)) return false;
  int e = 0;
  return std::frexp(v, &e) == 0.5f;
}

}  // namespace

Status check_mx_forms(const Dsv4Weights& w) {
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const Dsv4LayerMx& M = w.layers[i].mx;
    const std::pair<const char*, const Dsv4MxMatrix*> named[] = {
        {"attn.wq_a", &M.wq_a},
        {"attn.wq_b", &M.wq_b},
        {"attn.wkv", &M.wkv},
        {"attn.wo_a", &M.wo_a},
        {"attn.wo_b", &M.wo_b},
        {"attn.indexer.wq_b", &M.index_wq_b},
        {"ffn.shared_experts.w1", &M.shared_w1},
        {"ffn.shared_experts.w2", &M.shared_w2},
        {"ffn.shared_experts.w3", &M.shared_w3}};
    std::vector<std::pair<std::string, const Dsv4MxMatrix*>> all(std::begin(named),
                                                                 std::end(named));
    for (const auto* experts : {&M.w1, &M.w2, &M.w3})
      for (size_t e = 0; e < experts->size(); ++e)
        all.push_back({"ffn.experts." + std::to_string(e), &(*experts)[e]});
    for (const auto& [name, m] : all)
      if (!m->no_form.empty())
        return failed_precondition("layers." + std::to_string(i) + "." + name + ": " + m->no_form +
                                   ", so the decoder's quantized arithmetic cannot be reproduced "
                                   "for it (--quant-arith dequant computes it dense)");
  }
  return Status::ok();
}

Result<Dsv4MxMatrix> mx_from_fp8_block(const Tensor& w, const Tensor& scale, int64_t block) {
  // Validates shapes and dtypes the same way (and with the same messages) as the dequantization.
  HETERO_RETURN_IF_ERROR(dequant_fp8_block(w, scale, block).status());
  const int64_t rows = w.shape[0], cols = w.shape[1], scols = scale.shape[1];
  constexpr int64_t kGroup = 32;
  Dsv4MxMatrix m;
  if (cols % kGroup != 0 || block % kGroup != 0) {
    m.no_form = "width " + std::to_string(cols) + " or block " + std::to_string(block) +
                " is not a multiple of 32";
    return m;
  }
  const std::vector<float> s = to_f32(scale);
  for (float v : s)
    if (!is_power_of_two(v)) return m.no_form = "a block scale is not a power of two", m;
  m.rows = rows, m.cols = cols, m.group = kGroup;
  m.values.resize(static_cast<size_t>(rows * cols));
  m.scales.resize(static_cast<size_t>(rows * (cols / kGroup)));
  const uint8_t* src = w.data<uint8_t>();
  for (int64_t i = 0; i < rows * cols; ++i)
    m.values[static_cast<size_t>(i)] = fp8_e4m3_to_f32(src[i]);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t g = 0; g < cols / kGroup; ++g)
      m.scales[static_cast<size_t>(i * (cols / kGroup) + g)] =
          s[static_cast<size_t>((i / block) * scols + g * kGroup / block)];
  return m;
}

Result<Dsv4MxMatrix> mx_from_fp4_group(const Tensor& w, const Tensor& scale) {
  constexpr int64_t kGroup = 32;
  HETERO_RETURN_IF_ERROR(dequant_fp4_group(w, scale, kGroup).status());
  const int64_t rows = w.shape[0], cols = w.shape[1] * 2;
  Dsv4MxMatrix m;
  std::vector<float> s = to_f32(scale);
  for (float v : s)
    if (!is_power_of_two(v)) return m.no_form = "a group scale is not a power of two", m;
  m.rows = rows, m.cols = cols, m.group = kGroup;
  m.scales = std::move(s);
  m.values.resize(static_cast<size_t>(rows * cols));
  const uint8_t* src = w.data<uint8_t>();
  for (int64_t i = 0; i < rows * cols; ++i) {
    const uint8_t byte = src[i / 2];
    m.values[static_cast<size_t>(i)] = fp4_e2m1_to_f32(i % 2 == 0 ? (byte & 0x0f) : (byte >> 4));
  }
  return m;
}

namespace {

// The decoder's key normalisation: the transformers namespace folds onto the official one.
std::string normalize_key(std::string k) {
  auto replace_all = [&k](const std::string& a, const std::string& b) {
    for (size_t p = k.find(a); p != std::string::npos; p = k.find(a, p + b.size()))
      k.replace(p, a.size(), b);
  };
  if (k.rfind("model.", 0) == 0) {
    k = k.substr(6);
    if (k == "embed_tokens.weight") k = "embed.weight";
  }
  replace_all(".self_attn.", ".attn.");
  replace_all(".mlp.", ".ffn.");
  replace_all(".weight_scale_inv", ".scale");
  if (k.find(".ffn.experts.") != std::string::npos) {
    replace_all(".gate_proj.", ".w1.");
    replace_all(".down_proj.", ".w2.");
    replace_all(".up_proj.", ".w3.");
  }
  return k;
}

// Names only mlx-vlm's converted layout has (stacked experts, hyper-connection modules).
bool is_mlx_layout_name(const std::string& k) {
  return k.find("switch_mlp") != std::string::npos || k.find("_hc.fn") != std::string::npos;
}

// The layout mlx-vlm's converter writes (language_model.model.layers.N.attn_hc.fn, stacked
// switch_mlp experts, 3-D wo_a, ...) folded back onto the official names; dense only.
Status fold_mlx_layout(TensorMap& t) {
  TensorMap out;
  for (auto& [key, v] : t) {
    std::string k = key;
    if (k.rfind("language_model.", 0) == 0) k = k.substr(15);
    if (k.ends_with(".scales") || k.ends_with(".biases"))
      return invalid_argument("'" + key +
                              "': MLX-quantized checkpoints are not supported "
                              "(use the official FP8 or a dense bf16 conversion)");
    if (k == "lm_head.weight") k = "head.weight";
    if (k.rfind("model.", 0) == 0) k = k.substr(6);
    if (k == "embed_tokens.weight") k = "embed.weight";
    if (k.rfind("hc_head.", 0) == 0) k = "hc_head_" + k.substr(8);
    for (const char* sub : {"attn", "ffn"}) {
      const std::string from = std::string(".") + sub + "_hc.",
                        to = std::string(".hc_") + sub + "_";
      if (auto p = k.find(from); p != std::string::npos) k.replace(p, from.size(), to);
    }
    if (k.ends_with(".ffn.gate.e_score_correction_bias")) k = k.substr(0, k.size() - 23) + "bias";
    for (auto [from, to] : {std::pair{".shared_experts.gate_proj.", ".shared_experts.w1."},
                            {".shared_experts.down_proj.", ".shared_experts.w2."},
                            {".shared_experts.up_proj.", ".shared_experts.w3."}})
      if (auto p = k.find(from); p != std::string::npos) k.replace(p, std::string(from).size(), to);
    if (k.ends_with(".attn.wo_a.weight") && v.shape.size() == 3)
      v.shape = {v.shape[0] * v.shape[1], v.shape[2]};
    const auto sw = k.find(".ffn.switch_mlp.");
    if (sw != std::string::npos && v.shape.size() == 3) {
      const std::string proj = k.substr(sw + 16);
      const char* w = proj == "gate_proj.weight"   ? "w1"
                      : proj == "down_proj.weight" ? "w2"
                      : proj == "up_proj.weight"   ? "w3"
                                                   : nullptr;
      if (!w) return invalid_argument("unexpected expert tensor '" + key + "'");
      const int64_t E = v.shape[0], per = v.nbytes() / E;
      for (int64_t e = 0; e < E; ++e) {
        Tensor one(v.dtype, {v.shape[1], v.shape[2]});
        std::memcpy(one.bytes.data(), v.bytes.data() + e * per, static_cast<size_t>(per));
        out.emplace(k.substr(0, sw) + ".ffn.experts." + std::to_string(e) + "." + w + ".weight",
                    std::move(one));
      }
      continue;
    }
    out.emplace(k, std::move(v));
  }
  t = std::move(out);
  return Status::ok();
}

class Loader {
 public:
  explicit Loader(TensorMap all) {
    for (auto& [k, v] : all) t_.emplace(normalize_key(k), std::move(v));
  }
  bool has(const std::string& name) const { return t_.count(name) > 0; }

  // How the checkpoint stores base + suffix, for messages.
  std::string storage(const std::string& base, const char* suffix = ".weight") const {
    auto it = t_.find(base + suffix);
    if (it == t_.end()) return "absent";
    std::string name = dtype_name(it->second.dtype);
    for (char& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (!t_.count(base + ".scale")) return name;
    if (it->second.dtype == DType::kF8E4M3) return "fp8 e4m3, 128x128 block scales";
    return "fp4 e2m1 (" + name + " pairs), per-32 scales";
  }

  // A matrix or vector as bf16; FP8/FP4 storage is dequantized with its `.scale` sibling.
  Status bf16(const std::string& base, std::vector<int64_t> shape, Tensor* out,
              const char* suffix = ".weight") {
    const std::string name = base + suffix;
    auto it = t_.find(name);
    if (it == t_.end()) return not_found("checkpoint has no tensor '" + name + "'");
    Tensor& w = it->second;
    auto sc = t_.find(base + ".scale");
    const bool narrow = w.dtype == DType::kF8E4M3 || w.dtype == DType::kI8 || w.dtype == DType::kU8;
    if (narrow) {
      if (sc == t_.end()) return not_found("'" + name + "' is quantized but has no '.scale'");
      const bool fp4 = w.shape.size() == 2 && sc->second.shape.size() == 2 &&
                       w.dtype != DType::kF8E4M3 && sc->second.shape[1] * 16 == w.shape[1];
      auto r = fp4 ? dequant_fp4_group(w, sc->second) : dequant_fp8_block(w, sc->second);
      if (!r.is_ok()) return invalid_argument("'" + name + "': " + r.status().message());
      *out = std::move(r.value());
    } else if (w.dtype == DType::kBF16 || w.dtype == DType::kF16 || w.dtype == DType::kF32) {
      *out = w.dtype == DType::kBF16 ? std::move(w) : to_bf16(w);
    } else {
      return invalid_argument("'" + name + "' has unsupported dtype " + dtype_name(w.dtype));
    }
    if (out->shape != shape) {
      Tensor want;
      want.shape = shape;
      return invalid_argument("tensor '" + name + "' has shape " + out->shape_string() +
                              ", config wants " + want.shape_string());
    }
    return Status::ok();
  }

  // A projection: its bf16 dequantization as bf16() gives it and, when the checkpoint stores it
  // FP8 or FP4, its MX form (left empty for dense storage).
  Status projection(const std::string& base, std::vector<int64_t> shape, Tensor* out,
                    Dsv4MxMatrix* mx) {
    auto it = t_.find(base + ".weight");
    auto sc = t_.find(base + ".scale");
    if (it != t_.end() && sc != t_.end()) {
      const Tensor& w = it->second;
      const bool fp8 = w.dtype == DType::kF8E4M3;
      const bool fp4 = !fp8 && (w.dtype == DType::kI8 || w.dtype == DType::kU8) &&
                       w.shape.size() == 2 && sc->second.shape.size() == 2 &&
                       sc->second.shape[1] * 16 == w.shape[1];
      if (fp8 || fp4) {
        auto r = fp8 ? mx_from_fp8_block(w, sc->second) : mx_from_fp4_group(w, sc->second);
        if (!r.is_ok()) return invalid_argument("'" + base + ".weight': " + r.status().message());
        *mx = std::move(r.value());
      }
    }
    return bf16(base, std::move(shape), out);
  }

  // A float parameter as its stored values widened to float32.
  Status f32(const std::string& name, std::vector<int64_t> shape, std::vector<float>* out) {
    auto it = t_.find(name);
    if (it == t_.end()) return not_found("checkpoint has no tensor '" + name + "'");
    const Tensor& w = it->second;
    if (w.shape != shape) {
      Tensor want;
      want.shape = shape;
      return invalid_argument("tensor '" + name + "' has shape " + w.shape_string() +
                              ", config wants " + want.shape_string());
    }
    if (w.dtype != DType::kF32 && w.dtype != DType::kBF16 && w.dtype != DType::kF16)
      return invalid_argument("'" + name + "' has unsupported dtype " + dtype_name(w.dtype));
    *out = to_f32(w);
    return Status::ok();
  }

  Status ids(const std::string& name, std::vector<int64_t> shape, int64_t limit,
             std::vector<int32_t>* out) {
    auto it = t_.find(name);
    if (it == t_.end()) return not_found("checkpoint has no tensor '" + name + "'");
    const Tensor& w = it->second;
    if (w.shape != shape)
      return invalid_argument("tensor '" + name + "' has shape " + w.shape_string());
    if (w.dtype != DType::kI32 && w.dtype != DType::kI64 && w.dtype != DType::kI8 &&
        w.dtype != DType::kU8)
      return invalid_argument("'" + name + "' has non-integer dtype " + dtype_name(w.dtype));
    out->resize(static_cast<size_t>(w.numel()));
    for (int64_t i = 0; i < w.numel(); ++i) {
      int64_t v = w.dtype == DType::kI64 ? w.data<int64_t>()[i] : static_cast<int64_t>(w.at_f32(i));
      if (v < 0 || v >= limit)
        return invalid_argument("'" + name + "' holds expert " + std::to_string(v) +
                                " outside [0, " + std::to_string(limit) + ")");
      (*out)[static_cast<size_t>(i)] = static_cast<int32_t>(v);
    }
    return Status::ok();
  }

 private:
  static Tensor to_bf16(const Tensor& t) {
    Tensor out(DType::kBF16, t.shape);
    auto* o = out.data<uint16_t>();
    for (int64_t i = 0; i < t.numel(); ++i) o[i] = f32_to_bf16(t.at_f32(i));
    return out;
  }
  TensorMap t_;
};

Status load_hc(Loader& ld, const std::string& p, int64_t mix, int64_t width, int64_t n_scale,
               Dsv4HyperConnection* hc) {
  HETERO_RETURN_IF_ERROR(ld.f32(p + "_fn", {mix, width}, &hc->fn));
  HETERO_RETURN_IF_ERROR(ld.f32(p + "_base", {mix}, &hc->base));
  return ld.f32(p + "_scale", {n_scale}, &hc->scale);
}

Status load_compressor(Loader& ld, const std::string& p, const Dsv4Config& c, int32_t ratio,
                       int64_t head_dim, Dsv4Compressor* cm) {
  cm->ratio = ratio;
  cm->head_dim = head_dim;
  cm->out_dim = head_dim * (ratio == 4 ? 2 : 1);
  HETERO_RETURN_IF_ERROR(ld.bf16(p + ".wkv", {cm->out_dim, c.hidden}, &cm->wkv));
  HETERO_RETURN_IF_ERROR(ld.bf16(p + ".wgate", {cm->out_dim, c.hidden}, &cm->wgate));
  HETERO_RETURN_IF_ERROR(ld.bf16(p + ".norm", {head_dim}, &cm->norm));
  return ld.f32(p + ".ape", {ratio, cm->out_dim}, &cm->ape);
}

Status load_layer(Loader& ld, const Dsv4Config& c, int64_t i, Dsv4LayerWeights* L) {
  const std::string p = "layers." + std::to_string(i) + ".";
  const int64_t H = c.hidden, qd = c.heads * c.head_dim;
  L->ratio = c.compress_ratios[static_cast<size_t>(i)];
  HETERO_RETURN_IF_ERROR(ld.bf16(p + "attn_norm", {H}, &L->attn_norm));
  HETERO_RETURN_IF_ERROR(ld.bf16(p + "ffn_norm", {H}, &L->ffn_norm));
  HETERO_RETURN_IF_ERROR(load_hc(ld, p + "hc_attn", c.hc_mix(), c.hc_mult * H, 3, &L->hc_attn));
  HETERO_RETURN_IF_ERROR(load_hc(ld, p + "hc_ffn", c.hc_mix(), c.hc_mult * H, 3, &L->hc_ffn));
  const std::string a = p + "attn.";
  HETERO_RETURN_IF_ERROR(ld.projection(a + "wq_a", {c.q_lora_rank, H}, &L->wq_a, &L->mx.wq_a));
  HETERO_RETURN_IF_ERROR(ld.bf16(a + "q_norm", {c.q_lora_rank}, &L->q_norm));
  HETERO_RETURN_IF_ERROR(ld.projection(a + "wq_b", {qd, c.q_lora_rank}, &L->wq_b, &L->mx.wq_b));
  HETERO_RETURN_IF_ERROR(ld.projection(a + "wkv", {c.head_dim, H}, &L->wkv, &L->mx.wkv));
  HETERO_RETURN_IF_ERROR(ld.bf16(a + "kv_norm", {c.head_dim}, &L->kv_norm));
  HETERO_RETURN_IF_ERROR(ld.projection(a + "wo_a", {c.o_groups * c.o_lora_rank, qd / c.o_groups},
                                       &L->wo_a, &L->mx.wo_a));
  HETERO_RETURN_IF_ERROR(
      ld.projection(a + "wo_b", {H, c.o_groups * c.o_lora_rank}, &L->wo_b, &L->mx.wo_b));
  if (c.attention_bias) HETERO_RETURN_IF_ERROR(ld.bf16(a + "wo_b", {H}, &L->wo_b_bias, ".bias"));
  HETERO_RETURN_IF_ERROR(ld.f32(a + "attn_sink", {c.heads}, &L->attn_sink));
  if (L->ratio > 0)
    HETERO_RETURN_IF_ERROR(
        load_compressor(ld, a + "compressor", c, L->ratio, c.head_dim, &L->compressor));
  if (L->ratio == 4) {
    HETERO_RETURN_IF_ERROR(load_compressor(ld, a + "indexer.compressor", c, 4, c.index_head_dim,
                                           &L->index_compressor));
    HETERO_RETURN_IF_ERROR(ld.projection(a + "indexer.wq_b",
                                         {c.index_n_heads * c.index_head_dim, c.q_lora_rank},
                                         &L->index_wq_b, &L->mx.index_wq_b));
    HETERO_RETURN_IF_ERROR(
        ld.bf16(a + "indexer.weights_proj", {c.index_n_heads, H}, &L->index_weights_proj));
  }
  const std::string f = p + "ffn.";
  const int64_t E = c.n_routed_experts, I = c.moe_inter, S = c.moe_inter * c.n_shared_experts;
  HETERO_RETURN_IF_ERROR(ld.bf16(f + "gate", {E, H}, &L->gate));
  if (i < c.num_hash_layers) {
    HETERO_RETURN_IF_ERROR(
        ld.ids(f + "gate.tid2eid", {c.vocab, c.experts_per_tok}, E, &L->tid2eid));
  } else {
    HETERO_RETURN_IF_ERROR(ld.f32(f + "gate.bias", {E}, &L->gate_bias));
  }
  L->w1.resize(static_cast<size_t>(E));
  L->w2.resize(static_cast<size_t>(E));
  L->w3.resize(static_cast<size_t>(E));
  L->mx.w1.resize(static_cast<size_t>(E));
  L->mx.w2.resize(static_cast<size_t>(E));
  L->mx.w3.resize(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    const std::string x = f + "experts." + std::to_string(e) + ".";
    HETERO_RETURN_IF_ERROR(ld.projection(x + "w1", {I, H}, &L->w1[static_cast<size_t>(e)],
                                         &L->mx.w1[static_cast<size_t>(e)]));
    HETERO_RETURN_IF_ERROR(ld.projection(x + "w2", {H, I}, &L->w2[static_cast<size_t>(e)],
                                         &L->mx.w2[static_cast<size_t>(e)]));
    HETERO_RETURN_IF_ERROR(ld.projection(x + "w3", {I, H}, &L->w3[static_cast<size_t>(e)],
                                         &L->mx.w3[static_cast<size_t>(e)]));
  }
  if (c.n_shared_experts > 0) {
    HETERO_RETURN_IF_ERROR(
        ld.projection(f + "shared_experts.w1", {S, H}, &L->shared_w1, &L->mx.shared_w1));
    HETERO_RETURN_IF_ERROR(
        ld.projection(f + "shared_experts.w2", {H, S}, &L->shared_w2, &L->mx.shared_w2));
    HETERO_RETURN_IF_ERROR(
        ld.projection(f + "shared_experts.w3", {S, H}, &L->shared_w3, &L->mx.shared_w3));
  }
  return Status::ok();
}

}  // namespace

Result<Dsv4Weights> load_dsv4_weights(const std::string& model_dir) {
  Dsv4Weights w;
  HETERO_ASSIGN_OR_RETURN(w.config, load_dsv4_config(model_dir));
  HETERO_ASSIGN_OR_RETURN(TensorMap all, read_checkpoint_tensors(model_dir));
  bool mlx_layout = false;
  for (auto& [k, v] : all) mlx_layout = mlx_layout || is_mlx_layout_name(k);
  if (mlx_layout) HETERO_RETURN_IF_ERROR(fold_mlx_layout(all));
  Loader ld(std::move(all));
  const Dsv4Config& c = w.config;
  HETERO_RETURN_IF_ERROR(ld.bf16("embed", {c.vocab, c.hidden}, &w.embed));
  HETERO_RETURN_IF_ERROR(ld.bf16("norm", {c.hidden}, &w.final_norm));
  HETERO_RETURN_IF_ERROR(ld.bf16("head", {c.vocab, c.hidden}, &w.head));
  HETERO_RETURN_IF_ERROR(load_hc(ld, "hc_head", c.hc_mult, c.hc_mult * c.hidden, 1, &w.hc_head));
  w.layers.resize(static_cast<size_t>(c.layers));
  for (int64_t i = 0; i < c.layers; ++i)
    HETERO_RETURN_IF_ERROR(load_layer(ld, c, i, &w.layers[static_cast<size_t>(i)]));
  return w;
}

Result<Dsv4CacheTensors> load_dsv4_cache_tensors(const std::string& model_dir) {
  HETERO_ASSIGN_OR_RETURN(Dsv4Config c, load_dsv4_config(model_dir));
  bool mlx_layout = false;
  auto keep = [&mlx_layout](const std::string& name) {
    mlx_layout = mlx_layout || is_mlx_layout_name(name);
    std::string k = name.rfind("language_model.", 0) == 0 ? name.substr(15) : name;
    k = normalize_key(k);
    if (k.rfind("layers.", 0) != 0) return false;
    const size_t attn = k.find(".attn.");
    if (attn == std::string::npos) return false;
    const std::string rest = k.substr(attn + 6);
    for (const char* part : {"wkv.", "kv_norm.", "compressor.", "indexer.compressor."})
      if (rest.rfind(part, 0) == 0) return true;
    return false;
  };
  HETERO_ASSIGN_OR_RETURN(TensorMap all, read_checkpoint_tensors(model_dir, keep));
  if (mlx_layout) HETERO_RETURN_IF_ERROR(fold_mlx_layout(all));
  Loader ld(std::move(all));
  Dsv4CacheTensors out;
  auto matrix = [&](const std::string& base, std::vector<int64_t> shape) -> Status {
    out.storage[base + ".weight"] = ld.storage(base);
    Tensor t;
    HETERO_RETURN_IF_ERROR(ld.bf16(base, std::move(shape), &t));
    out.tensors[base + ".weight"] = std::move(t);
    return Status::ok();
  };
  auto compressor = [&](const std::string& p, int64_t ratio, int64_t hd) -> Status {
    const int64_t width = ratio == 4 ? 2 * hd : hd;
    HETERO_RETURN_IF_ERROR(matrix(p + "wkv", {width, c.hidden}));
    HETERO_RETURN_IF_ERROR(matrix(p + "wgate", {width, c.hidden}));
    HETERO_RETURN_IF_ERROR(matrix(p + "norm", {hd}));
    out.storage[p + "ape"] = ld.storage(p + "ape", "");
    std::vector<float> ape;
    HETERO_RETURN_IF_ERROR(ld.f32(p + "ape", {ratio, width}, &ape));
    Tensor t(DType::kF32, {ratio, width});
    std::memcpy(t.bytes.data(), ape.data(), ape.size() * sizeof(float));
    out.tensors[p + "ape"] = std::move(t);
    return Status::ok();
  };
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string a = "layers." + std::to_string(i) + ".attn.";
    const int32_t ratio = c.compress_ratios[static_cast<size_t>(i)];
    HETERO_RETURN_IF_ERROR(matrix(a + "wkv", {c.head_dim, c.hidden}));
    HETERO_RETURN_IF_ERROR(matrix(a + "kv_norm", {c.head_dim}));
    if (ratio > 0) HETERO_RETURN_IF_ERROR(compressor(a + "compressor.", ratio, c.head_dim));
    if (ratio == 4)
      HETERO_RETURN_IF_ERROR(compressor(a + "indexer.compressor.", 4, c.index_head_dim));
  }
  return out;
}

}  // namespace hetero
