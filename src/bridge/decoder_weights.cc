// Loading and validating the decoder-weights export. Anything the program cannot reproduce
// exactly (a rope type it lacks, partial rotary dims) is refused with a message, and a rope whose
// computed frequencies or scales differ from the decoder module's own is refused too.
#include "bridge/decoder_weights.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "common/bf16.h"
#include "common/safetensors.h"
#include "kernels/cpu_ops.h"
#include "model/llama_rope.h"

namespace hetero {
namespace fs = std::filesystem;
using nlohmann::json;

Status take_weight(TensorMap& all, const std::string& name, const std::vector<int64_t>& shape,
                   bool want_bf16, Tensor* out) {
  auto it = all.find(name);
  if (it == all.end()) return not_found("decoder weights have no tensor '" + name + "'");
  if (it->second.shape != shape)
    return invalid_argument("decoder weight '" + name + "' has shape " + it->second.shape_string());
  if (want_bf16 && it->second.dtype != DType::kBF16)
    return invalid_argument("decoder weight '" + name + "' is " + dtype_name(it->second.dtype) +
                            ", not bf16 (the decoder's dtype)");
  *out = std::move(it->second);
  all.erase(it);
  return Status::ok();
}

Status load_decoder_linear(TensorMap& all, const std::string& p, int64_t n, int64_t k,
                           DecoderLinear* l) {
  l->n = n;
  l->k = k;
  if (all.count(p + "weight")) {
    Tensor w;
    HETERO_RETURN_IF_ERROR(take_weight(all, p + "weight", {n, k}, true, &w));
    l->mode = DecoderLinear::Mode::kDense;
    l->wt = transposed_f32(w.data<uint16_t>(), n, k);
    return Status::ok();
  }
  auto it = all.find(p + "scales");
  if (it == all.end() || it->second.shape.size() != 2 || it->second.shape[1] <= 0 ||
      k % it->second.shape[1] != 0)
    return not_found("decoder weights have neither '" + p + "weight' nor valid '" + p + "scales'");
  l->group = k / it->second.shape[1];
  Tensor q, s, b;
  HETERO_RETURN_IF_ERROR(take_weight(all, p + "qvalues", {n, k}, false, &q));
  HETERO_RETURN_IF_ERROR(take_weight(all, p + "scales", {n, k / l->group}, false, &s));
  l->q = to_f32(q);
  l->scales = to_f32(s);
  if (all.count(p + "biases")) {
    HETERO_RETURN_IF_ERROR(take_weight(all, p + "biases", {n, k / l->group}, false, &b));
    l->biases = to_f32(b);
    l->mode = DecoderLinear::Mode::kAffine;
  } else {
    l->mode = DecoderLinear::Mode::kMx;
  }
  return Status::ok();
}

void DecoderLinear::apply(const uint16_t* x, int64_t m, uint16_t* out, const uint16_t* bias) const {
  switch (mode) {
    case Mode::kDense:
      linear_decoder_order(x, m, k, wt.data(), n, bias, out);
      return;
    case Mode::kMx:
      linear_quantized_mx(x, m, k, q.data(), scales.data(), n, group, out);
      break;
    case Mode::kAffine:
      linear_quantized_affine(x, m, k, q.data(), scales.data(), biases.data(), n, group, out);
      break;
  }
  if (bias) add_bias_bf16(out, m, n, bias);
}

std::string DecoderLinear::describe() const {
  if (mode == Mode::kDense) return "dense";
  return std::string(mode == Mode::kMx ? "mx" : "affine") + ", group " + std::to_string(group);
}

Result<DecoderCacheLayout> layout_from_json(const json& j) {
  if (!j.is_object()) return invalid_argument("decoder layout is not a JSON object");
  DecoderCacheLayout l;
  try {
    l.family = j.at("family").get<std::string>();
    l.fingerprint = j.at("fingerprint").get<std::string>();
    l.layers = j.at("layers").get<int64_t>();
    l.kv_heads = j.at("kv_heads").get<int64_t>();
    l.head_dim = j.at("head_dim").get<int64_t>();
    l.hidden = j.at("hidden").get<int64_t>();
    l.quantization = j.value("quantization", json());
    if (l.family == "deepseek_v4") {
      l.ratios = j.at("ratios").get<std::vector<int64_t>>();
      l.index_head_dim = j.at("index_head_dim").get<int64_t>();
      l.window = j.at("window").get<int64_t>();
      if (static_cast<int64_t>(l.ratios.size()) != l.layers)
        return invalid_argument("decoder layout has " + std::to_string(l.ratios.size()) +
                                " ratios for " + std::to_string(l.layers) + " layers");
    }
  } catch (const json::exception& e) {
    return invalid_argument(std::string("decoder layout: ") + e.what());
  }
  return l;
}

std::string describe_quantization(const json& q) {
  if (!q.is_object()) return "unquantized";
  auto setting = [](const json& s) {
    if (!s.is_object()) return std::string("dense");
    return std::to_string(s.value("bits", 0)) + "-bit " + s.value("mode", std::string("affine")) +
           ", group " + std::to_string(s.value("group_size", 0));
  };
  const std::string common = setting(q);
  const json overrides = q.value("overrides", json::object());
  if (!overrides.is_object() || overrides.empty()) return common;
  // Modules per setting: the common one holds every quantized module no override names.
  std::map<std::string, int64_t> others;
  int64_t dense = 0, quantized_overrides = 0;
  for (const auto& [path, s] : overrides.items()) {
    if (!s.is_object()) {
      ++dense;
    } else {
      ++others[setting(s)];
      ++quantized_overrides;
    }
  }
  std::string out = common + " (" +
                    std::to_string(q.value("modules", int64_t{0}) - quantized_overrides) +
                    " modules)";
  for (const auto& [text, n] : others) out += "; " + text + " (" + std::to_string(n) + " modules)";
  if (dense > 0) out += "; " + std::to_string(dense) + " quantizable modules dense";
  return out;
}

std::vector<int64_t> decoder_calls_from_info(const json& info, int64_t n, int64_t start) {
  if (!info.is_object() || !info.contains("prefill") || !info["prefill"].is_object()) return {};
  const json& p = info["prefill"];
  auto integer = [&](const char* key) {
    return p.contains(key) && p[key].is_number_integer() ? p[key].get<int64_t>() : int64_t{0};
  };
  const int64_t step = integer("step"), entries = integer("checkpoint_entries");
  const int64_t block = integer("block_size"), min_tokens = integer("min_tokens");
  int64_t interval = integer("checkpoint_interval");
  const bool last_alone =
      p.contains("last_alone") && p["last_alone"].is_boolean() ? p["last_alone"].get<bool>() : true;
  if (step <= 0 || n <= 0 || start < 0 || start >= n) return {};
  const int64_t body = last_alone ? n - 1 : n;
  // The interval checkpoints the decoder cuts its calls at (mlx-vlm's checkpoint_lengths):
  // multiples of the interval (rounded up to its block) below the prompt's own checkpoint, or,
  // where it keeps only `entries` checkpoints, the latest entries - 1 of them.
  if (interval > 0 && block > 0) interval = (interval + block - 1) / block * block;
  // (A decoder that keeps no checkpoint entries in memory keeps one: its budget is 1, no cut.)
  const int64_t last_cut = interval > 0 ? (body - 1) / interval * interval : 0;
  int64_t first_cut = std::max<int64_t>(interval, min_tokens);
  if (p.contains("checkpoint_entries")) {
    const int64_t budget = std::max<int64_t>(entries, 1);
    if (budget <= 1) interval = 0;
    first_cut = std::max(first_cut, last_cut - (budget - 2) * interval);
  }
  std::vector<int64_t> calls;
  for (int64_t s = start; s < body;) {
    int64_t e = std::min(s + step, body);
    if (interval > 0) {  // the first cut past s
      const int64_t lo = std::max(first_cut, s + 1);
      const int64_t cut = (lo + interval - 1) / interval * interval;
      if (cut < e && cut <= last_cut) e = cut;
    }
    calls.push_back(e - s);
    s = e;
  }
  if (last_alone) calls.push_back(1);
  return calls;
}

Result<std::string> read_export_json(const std::string& dir, const std::string& family) {
  std::ifstream in(fs::path(dir) / "decoder.json");
  if (!in) return not_found("no decoder.json in " + dir + " (run: python -m hetero_mlx export)");
  json j = json::parse(in, nullptr, false);
  if (j.is_discarded() || !j.is_object())
    return invalid_argument(dir + "/decoder.json is not JSON");
  if (!j.contains("format") || j["format"] != "hetero-decoder-weights-v1")
    return invalid_argument(dir + ": unknown export format " + j.value("format", json()).dump());
  if (!j.contains("family") || j["family"] != family)
    return invalid_argument(dir + ": family " + j.value("family", json()).dump() + " is not " +
                            family);
  return j.dump();
}

std::string decoder_family(const std::string& dir) {
  std::ifstream in(fs::path(dir) / "decoder.json");
  json j = json::parse(in, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("family") || !j["family"].is_string())
    return "";
  return j["family"].get<std::string>();
}

Status check_sliding_calls(const LlamaDecoderWeights& w, int64_t start, int64_t end,
                           const std::vector<int64_t>& calls) {
  if (w.sliding_window <= 0) return Status::ok();
  if (calls.empty() && end > w.sliding_window)
    return failed_precondition(
        "rows up to " + std::to_string(end) + " reach past the decoder's sliding window of " +
        std::to_string(w.sliding_window) +
        " tokens, where a one-token call of the decoder's would sum the window in its rotating "
        "cache's order, and the request names no decoder calls ('decoder_calls') to rule that "
        "out; it is left to the decoder");
  if (start > w.sliding_window)
    return failed_precondition(
        "a warm tail from row " + std::to_string(start) +
        " is past the decoder's sliding "
        "window of " +
        std::to_string(w.sliding_window) +
        " tokens, where the rows of its own one-token calls (its answers) sum the window in "
        "its rotating cache's order; it is left to the decoder");
  int64_t pos = start;
  for (int64_t n : calls) {
    if (n == 1 && pos >= w.sliding_window)
      return failed_precondition(
          "the decoder prefills row " + std::to_string(pos) +
          " in a call of its own, past its sliding window of " + std::to_string(w.sliding_window) +
          " tokens, where such a call sums the window in its rotating cache's order; it is "
          "left to the decoder");
    pos += n;
  }
  return Status::ok();
}

Result<LlamaDecoderWeights> load_llama_decoder_weights(const std::string& dir) {
  HETERO_ASSIGN_OR_RETURN(std::string text, read_export_json(dir, "llama"));
  const json j = json::parse(text);
  LlamaDecoderWeights d;
  LlamaRopeConfig rope;
  double exported_scale = 1.0, exported_input_scale = 1.0;
  try {
    d.layout.family = "llama";
    d.layout.fingerprint = j.at("fingerprint").get<std::string>();
    d.layout.layers = j.at("layers").get<int64_t>();
    d.layout.kv_heads = j.at("kv_heads").get<int64_t>();
    d.layout.head_dim = j.at("head_dim").get<int64_t>();
    d.layout.hidden = j.at("hidden").get<int64_t>();
    d.layout.quantization = j.value("quantization", json());
    d.rms_norm_eps = j.at("rms_norm_eps").get<double>();
    if (j.contains("sliding_window") && !j["sliding_window"].is_null())
      d.sliding_window = j["sliding_window"].get<int64_t>();
    const json& r = j.at("rope");
    rope.base = r.at("base").get<double>();
    rope.dims = r.at("dims").get<int64_t>();
    rope.traditional = r.value("traditional", false);
    rope.scaling = r.contains("scaling") ? r["scaling"] : json();
    if (r.contains("max_position_embeddings") && r["max_position_embeddings"].is_number_integer())
      rope.max_position_embeddings = r["max_position_embeddings"].get<int64_t>();
    exported_scale = r.value("scale", 1.0);
    exported_input_scale = r.value("input_scale", 1.0);
  } catch (const json::exception& e) {
    return invalid_argument(dir + "/decoder.json: " + e.what());
  }
  if (rope.dims != d.layout.head_dim)
    return invalid_argument(dir + ": the decoder ropes " + std::to_string(rope.dims) + " of " +
                            std::to_string(d.layout.head_dim) +
                            " head dims; the llama family "
                            "cache program ropes whole heads");
  {
    Result<RopeSpec> spec = llama_rope(rope);
    if (!spec.is_ok()) return invalid_argument(dir + ": " + spec.status().message());
    d.rope = std::move(spec.value());
    d.rope_config = rope;
  }
  // The module's own numbers must be the ones computed here, or every key would be off.
  if (static_cast<float>(exported_scale) != d.rope.scale ||
      static_cast<float>(exported_input_scale) != (d.rope.scales_input ? d.rope.input_scale : 1.0f))
    return failed_precondition(dir + ": the decoder's rope (" + describe_rope(rope) +
                               ") scales by " + std::to_string(exported_scale) + " and " +
                               std::to_string(exported_input_scale) +
                               ", not what its config computes to; refusing to write caches");
  HETERO_ASSIGN_OR_RETURN(SafetensorsFile f,
                          read_safetensors((fs::path(dir) / "weights.safetensors").string()));
  if (!d.rope.freqs.empty()) {
    Tensor freqs;
    HETERO_RETURN_IF_ERROR(take_weight(f.tensors, "rope.freqs",
                                       {static_cast<int64_t>(d.rope.freqs.size())}, false, &freqs));
    if (freqs.dtype != DType::kF32)
      return invalid_argument(dir + ": rope.freqs is " + dtype_name(freqs.dtype) + ", not f32");
    for (size_t i = 0; i < d.rope.freqs.size(); ++i)
      if (std::memcmp(freqs.data<float>() + i, &d.rope.freqs[i], 4) != 0)
        return failed_precondition(dir + ": the decoder's rope frequency " + std::to_string(i) +
                                   " (" + std::to_string(freqs.data<float>()[i]) +
                                   ") differs from the one computed for " + describe_rope(rope) +
                                   " (" + std::to_string(d.rope.freqs[i]) +
                                   "); refusing to write caches with it");
  }
  const int64_t H = d.layout.hidden, kvd = d.layout.kv_heads * d.layout.head_dim;
  d.layers.resize(static_cast<size_t>(d.layout.layers));
  for (int64_t i = 0; i < d.layout.layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    auto& L = d.layers[static_cast<size_t>(i)];
    HETERO_RETURN_IF_ERROR(load_decoder_linear(f.tensors, p + "k_proj.", kvd, H, &L.wk));
    HETERO_RETURN_IF_ERROR(load_decoder_linear(f.tensors, p + "v_proj.", kvd, H, &L.wv));
    if (f.tensors.count(p + "k_proj.bias")) {
      HETERO_RETURN_IF_ERROR(take_weight(f.tensors, p + "k_proj.bias", {kvd}, true, &L.bk));
      HETERO_RETURN_IF_ERROR(take_weight(f.tensors, p + "v_proj.bias", {kvd}, true, &L.bv));
    }
    if (f.tensors.count(p + "k_norm.weight"))
      HETERO_RETURN_IF_ERROR(
          take_weight(f.tensors, p + "k_norm.weight", {d.layout.head_dim}, true, &L.k_norm));
  }
  return d;
}

}  // namespace hetero
