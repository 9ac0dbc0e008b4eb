// The start-time check that the prefill checkpoint holds the decoder's weights: see pairing.h.
#include "prefill/pairing.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "bridge/decoder_weights.h"
#include "common/bf16.h"
#include "model/llama.h"
#include "model/mlx_quant.h"

namespace hetero {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string lower_dtype(DType d) {
  std::string s = dtype_name(d);
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

std::string value_text(float v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.8g", static_cast<double>(v));
  return buf;
}

// "97.3%", "0.0027%": enough digits to tell one flipped value from none, never "100%" for less.
std::string share_text(int64_t differing, int64_t total) {
  const double pct = total > 0 ? 100.0 * static_cast<double>(differing) / total : 100.0;
  char buf[32];
  if (differing < total && pct > 99.9)
    std::snprintf(buf, sizeof buf, "99.9%%");
  else if (pct >= 0.1)
    std::snprintf(buf, sizeof buf, "%.1f%%", pct);
  else
    std::snprintf(buf, sizeof buf, "%.2g%%", pct);
  return buf;
}

std::string index_text(int64_t flat, const std::vector<int64_t>& shape) {
  std::vector<int64_t> idx(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    idx[d] = shape[d] > 0 ? flat % shape[d] : 0;
    flat = shape[d] > 0 ? flat / shape[d] : 0;
  }
  std::string s = "[";
  for (size_t d = 0; d < idx.size(); ++d) s += (d ? ", " : "") + std::to_string(idx[d]);
  return s + "]";
}

WeightDifference missing(const std::string& name, bool in_export) {
  WeightDifference d;
  d.name = name;
  d.detail = in_export ? "is in the decoder's export but not in the prefill checkpoint"
                       : "is in the prefill checkpoint but the decoder has no such weight";
  return d;
}

// What the decoder's module stands for, as float32 values: a dense `weight` as is; a quantized one
// (python/hetero_mlx/dsv4.py `_linear_weights`) as qvalues x scales (+ biases for affine), group
// by group. Exact for the mx modes (power-of-two scales); affine rounds once in float32.
Result<Tensor> decoder_projection(const TensorMap& exported, const std::string& prefix) {
  if (auto w = exported.find(prefix + "weight"); w != exported.end()) return w->second;
  auto q = exported.find(prefix + "qvalues"), s = exported.find(prefix + "scales");
  if (q == exported.end() || s == exported.end())
    return not_found("the decoder's export has no '" + prefix + "weight' nor its quantized form");
  const Tensor& qv = q->second;
  const Tensor& sc = s->second;
  if (qv.shape.size() != 2 || sc.shape.size() != 2 || sc.shape[0] != qv.shape[0] ||
      sc.shape[1] <= 0 || qv.shape[1] % sc.shape[1] != 0)
    return invalid_argument("the decoder's export has '" + prefix + "qvalues' of shape " +
                            qv.shape_string() + " with scales " + sc.shape_string());
  auto b = exported.find(prefix + "biases");
  const int64_t n = qv.shape[0], k = qv.shape[1], groups = sc.shape[1], group = k / groups;
  Tensor out(DType::kF32, {n, k});
  float* o = out.data<float>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < k; ++c) {
      const int64_t g = r * groups + c / group, i = r * k + c;
      float v = qv.at_f32(i) * sc.at_f32(g);
      if (b != exported.end()) v += b->second.at_f32(g);
      o[i] = v;
    }
  return out;
}

}  // namespace

std::optional<WeightDifference> compare_weight(const std::string& name, const Tensor& decoder,
                                               const Tensor& prefill) {
  WeightDifference d;
  d.name = name;
  d.shape = decoder.shape;
  if (decoder.shape != prefill.shape) {
    d.detail = "has shape " + decoder.shape_string() + " in the decoder and " +
               prefill.shape_string() + " in the prefill checkpoint";
    return d;
  }
  d.total = decoder.numel();
  for (int64_t i = 0; i < d.total; ++i) {
    const float a = decoder.at_f32(i), b = prefill.at_f32(i);
    if (a == b || (std::isnan(a) && std::isnan(b))) continue;
    if (d.differing++ == 0) d.first = i, d.decoder_value = a, d.prefill_value = b;
  }
  if (d.differing == 0) return std::nullopt;
  return d;
}

Status refuse_weights_differ(const WeightDifference& d, const PairingSides& sides,
                             const std::string& prefill_storage, const std::string& why) {
  std::string what = d.name + " ";
  if (!d.detail.empty()) {
    what += d.detail;
  } else {
    what += "differs in " + share_text(d.differing, d.total) + " of its values (" +
            std::to_string(d.differing) + " of " + std::to_string(d.total) + "; the first at " +
            index_text(d.first, d.shape) + ": " + value_text(d.decoder_value) +
            " in the decoder, " + value_text(d.prefill_value) + " in the prefill checkpoint)";
  }
  std::string decoder = describe_quantization(sides.decoder_quantization);
  if (!sides.decoder_model.empty()) decoder += ", from " + sides.decoder_model;
  return failed_precondition("the prefill checkpoint " + sides.prefill_model +
                             " does not hold the decoder's weights: " + what + " (decoder: " +
                             decoder + "; prefill: " + prefill_storage + "). " + why);
}

namespace {

Tensor f32_tensor(const std::vector<float>& v, std::vector<int64_t> shape) {
  Tensor t(DType::kF32, std::move(shape));
  std::copy(v.begin(), v.end(), t.data<float>());
  return t;
}

// One k or v projection: the decoder's (dense, or its quantized module's values) against the
// checkpoint's as the engine loads it (dense as bf16; mlx-lm-quantized unpacked, its values
// formed the way the decoder's are). A quantized decoder against a dense checkpoint, or the
// reverse, is refused naming both: their matmuls differ even where the values agree.
Status check_llama_projection(const TensorMap& exported, const TensorMap& checkpoint,
                              const std::string& e, const std::string& c, const PairingSides& sides,
                              const std::string& why) {
  auto w = checkpoint.find(c + "weight");
  if (w == checkpoint.end()) {
    if (exported.count(e + "weight") == 0 && exported.count(e + "qvalues") == 0)
      return Status::ok();
    return refuse_weights_differ(missing(c + "weight", true), sides, "absent", why);
  }
  HETERO_ASSIGN_OR_RETURN(Tensor decoder, decoder_projection(exported, e));
  const bool decoder_quantized = exported.count(e + "qvalues") > 0;
  auto s = checkpoint.find(c + "scales");
  Tensor prefill;
  std::string storage;
  if (s != checkpoint.end()) {
    auto b = checkpoint.find(c + "biases");  // affine only
    const int64_t k = decoder.shape.size() == 2 ? decoder.shape[1] : 0;
    HETERO_ASSIGN_OR_RETURN(QuantizedWeight q,
                            unpack_quantized(c.substr(0, c.size() - 1), w->second, s->second,
                                             b == checkpoint.end() ? nullptr : &b->second, k));
    storage = q.describe();
    const int64_t groups = q.k / q.group;
    TensorMap as_export = {{"qvalues", f32_tensor(q.q, {q.n, q.k})},
                           {"scales", f32_tensor(q.scales, {q.n, groups})}};
    if (!q.mx()) as_export["biases"] = f32_tensor(q.biases, {q.n, groups});
    HETERO_ASSIGN_OR_RETURN(prefill, decoder_projection(as_export, ""));
  } else {
    storage = lower_dtype(w->second.dtype);
    prefill = as_bf16(w->second);
  }
  if (decoder_quantized != (s != checkpoint.end())) {
    std::string decoder = describe_quantization(sides.decoder_quantization);
    if (!sides.decoder_model.empty()) decoder += ", from " + sides.decoder_model;
    return failed_precondition(
        "the decoder (" + decoder + ") and the prefill checkpoint " + sides.prefill_model + " (" +
        c + "weight: " + storage + ") are not the same checkpoint: " +
        (decoder_quantized ? "the decoder is quantized and the prefill checkpoint is not"
                           : "the prefill checkpoint is quantized and the decoder is not") +
        ", and a quantized matmul's outputs differ from a dense one's. " + why);
  }
  if (auto d = compare_weight(c + "weight", decoder, prefill))
    return refuse_weights_differ(*d, sides, storage, why);
  return Status::ok();
}

}  // namespace

Status check_llama_pairing(const TensorMap& exported, const TensorMap& checkpoint, int64_t layers,
                           const PairingSides& sides) {
  const std::string why = "Serve the decoder and the prefill host from one checkpoint";
  for (int64_t i = 0; i < layers; ++i) {
    const std::string e = "layers." + std::to_string(i) + ".";
    const std::string c = "model.layers." + std::to_string(i) + ".self_attn.";
    for (const char* proj : {"k_proj.", "v_proj."})
      HETERO_RETURN_IF_ERROR(
          check_llama_projection(exported, checkpoint, e + proj, c + proj, sides, why));
    for (const char* part : {"k_proj.bias", "v_proj.bias", "k_norm.weight"}) {
      auto x = exported.find(e + part);
      auto y = checkpoint.find(c + part);
      if (x == exported.end() && y == checkpoint.end()) continue;
      if (x == exported.end() || y == checkpoint.end())
        return refuse_weights_differ(
            missing(c + part, x != exported.end()), sides,
            y == checkpoint.end() ? "absent" : lower_dtype(y->second.dtype), why);
      // The engine computes with the checkpoint's tensors as bf16 (model/llama.cc).
      if (auto d = compare_weight(c + part, x->second, as_bf16(y->second)))
        return refuse_weights_differ(*d, sides, lower_dtype(y->second.dtype), why);
    }
  }
  return Status::ok();
}

Status check_dsv4_pairing(const TensorMap& exported, const Dsv4CacheTensors& checkpoint,
                          const std::vector<int64_t>& ratios, const PairingSides& sides) {
  const std::string why =
      "The decoder must hold this checkpoint's own values (for the official FP8 checkpoint: "
      "mlx-vlm's conversion that keeps its FP8/FP4 codes, as models/dsv4-tiny/native)";
  auto against = [&](const std::string& name, const Tensor& decoder) -> Status {
    auto y = checkpoint.tensors.find(name);
    if (y == checkpoint.tensors.end())
      return refuse_weights_differ(missing(name, true), sides, "absent", why);
    auto s = checkpoint.storage.find(name);
    const std::string storage = s == checkpoint.storage.end() ? "?" : s->second;
    if (auto d = compare_weight(name, decoder, y->second))
      return refuse_weights_differ(*d, sides, storage, why);
    return Status::ok();
  };
  auto projection = [&](const std::string& base) -> Status {
    HETERO_ASSIGN_OR_RETURN(Tensor w, decoder_projection(exported, base + "."));
    return against(base + ".weight", w);
  };
  auto plain = [&](const std::string& name) -> Status {
    auto x = exported.find(name);
    if (x == exported.end()) return not_found("the decoder's export has no '" + name + "'");
    return against(name, x->second);
  };
  auto compressor = [&](const std::string& p) -> Status {
    HETERO_RETURN_IF_ERROR(projection(p + "wkv"));
    HETERO_RETURN_IF_ERROR(projection(p + "wgate"));
    HETERO_RETURN_IF_ERROR(plain(p + "norm.weight"));
    auto x = exported.find(p + "ape");
    if (x == exported.end()) return not_found("the decoder's export has no '" + p + "ape'");
    if (x->second.dtype != DType::kBF16) return plain(p + "ape");
    // The converter's cast: the checkpoint's float32 ape rounded to bf16 is what it holds.
    auto y = checkpoint.tensors.find(p + "ape");
    if (y == checkpoint.tensors.end())
      return refuse_weights_differ(missing(p + "ape", true), sides, "absent", why);
    Tensor rounded(DType::kBF16, y->second.shape);
    for (int64_t i = 0; i < rounded.numel(); ++i)
      rounded.data<uint16_t>()[i] = f32_to_bf16(y->second.at_f32(i));
    if (auto d = compare_weight(p + "ape", x->second, rounded)) {
      auto s = checkpoint.storage.find(p + "ape");
      return refuse_weights_differ(
          *d, sides, (s == checkpoint.storage.end() ? "?" : s->second) + ", compared as bf16", why);
    }
    return Status::ok();
  };
  for (size_t i = 0; i < ratios.size(); ++i) {
    const std::string a = "layers." + std::to_string(i) + ".attn.";
    HETERO_RETURN_IF_ERROR(projection(a + "wkv"));
    HETERO_RETURN_IF_ERROR(plain(a + "kv_norm.weight"));
    if (ratios[i] > 0) HETERO_RETURN_IF_ERROR(compressor(a + "compressor."));
    if (ratios[i] == 4) HETERO_RETURN_IF_ERROR(compressor(a + "indexer.compressor."));
  }
  return Status::ok();
}

Status check_checkpoint_holds_decoder_weights(const std::string& family,
                                              const std::string& model_dir,
                                              const std::string& weights_dir) {
  HETERO_ASSIGN_OR_RETURN(std::string text, read_export_json(weights_dir, family));
  const json meta = json::parse(text);
  PairingSides sides;
  sides.decoder_model = meta.value("model", std::string());
  sides.decoder_quantization = meta.value("quantization", json());
  sides.prefill_model = model_dir;
  HETERO_ASSIGN_OR_RETURN(
      SafetensorsFile exported,
      read_safetensors((fs::path(weights_dir) / "weights.safetensors").string()));
  if (family == "deepseek_v4") {
    HETERO_ASSIGN_OR_RETURN(Dsv4CacheTensors checkpoint, load_dsv4_cache_tensors(model_dir));
    return check_dsv4_pairing(exported.tensors, checkpoint,
                              meta.value("ratios", std::vector<int64_t>{}), sides);
  }
  // Only the attention's k/v tensors of the checkpoint are read.
  auto keep = [](const std::string& name) {
    if (name.rfind("model.layers.", 0) != 0) return false;
    for (const char* part : {".self_attn.k_proj.", ".self_attn.v_proj.", ".self_attn.k_norm."})
      if (name.find(part) != std::string::npos) return true;
    return false;
  };
  HETERO_ASSIGN_OR_RETURN(TensorMap checkpoint, read_checkpoint_tensors(model_dir, keep));
  return check_llama_pairing(exported.tensors, checkpoint, meta.value("layers", int64_t{0}), sides);
}

}  // namespace hetero
