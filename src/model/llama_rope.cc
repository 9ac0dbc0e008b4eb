// llama-family rope construction: see llama_rope.h. Each step is written in the precision and
// order the decoder's Python/MLX code runs it: Python doubles where mlx-lm computes scalars,
// float32 (rounded per operation) where it computes arrays, scalars meeting an array rounded to
// float32 first.
#include "model/llama_rope.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace hetero {
namespace {

using nlohmann::json;

constexpr double kPi = 3.141592653589793;

Result<double> number(const json& s, const char* key) {
  if (!s.contains(key) || !s[key].is_number())
    return invalid_argument(std::string("rope_scaling needs a number '") + key + "' for type '" +
                            rope_type_of(s) + "'");
  return s[key].get<double>();
}

double number_or(const json& s, const char* key, double fallback) {
  return s.contains(key) && s[key].is_number() ? s[key].get<double>() : fallback;
}

// base ** (arange(0, rotated, 2) / dims) in float32: mx.power of the base rounded to f32.
std::vector<float> powers(double base, int64_t rotated, int64_t dims) {
  std::vector<float> p;
  for (int64_t i = 0; i < rotated; i += 2)
    p.push_back(
        std::pow(static_cast<float>(base), static_cast<float>(i) / static_cast<float>(dims)));
  return p;
}

RopeSpec base_path(const LlamaRopeConfig& c, double scale) {
  RopeSpec r;
  r.dims = c.dims, r.traditional = c.traditional;
  r.base = static_cast<float>(c.base), r.scale = static_cast<float>(scale);
  return r;
}

RopeSpec freqs_path(const LlamaRopeConfig& c, std::vector<float> freqs) {
  RopeSpec r;
  r.dims = c.dims, r.traditional = c.traditional;
  r.freqs = std::move(freqs);
  return r;
}

Result<RopeSpec> llama3(const LlamaRopeConfig& c) {
  const json& s = c.scaling;
  HETERO_ASSIGN_OR_RETURN(const double factor, number(s, "factor"));
  const double lf = number_or(s, "low_freq_factor", 1.0),
               hf = number_or(s, "high_freq_factor", 4.0);
  const double old_len = number_or(s, "original_max_position_embeddings", 8192);
  const float low_w = static_cast<float>(old_len / lf), high_w = static_cast<float>(old_len / hf);
  const float two_pi = static_cast<float>(2 * kPi), f_factor = static_cast<float>(factor);
  std::vector<float> freqs = powers(c.base, c.dims, c.dims);
  for (float& f : freqs) {
    const float w = two_pi * f;
    const float scaled = w > low_w ? f * f_factor : f;
    const bool medium = w > high_w && w < low_w;
    const float smooth =
        (static_cast<float>(old_len) / w - static_cast<float>(lf)) / static_cast<float>(hf - lf);
    f = medium ? scaled / ((1.0f - smooth) / f_factor + smooth) : scaled;
  }
  return freqs_path(c, std::move(freqs));
}

double yarn_mscale(double scale, double m) {
  return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
}

Result<RopeSpec> yarn(const LlamaRopeConfig& c) {
  const json& s = c.scaling;
  HETERO_ASSIGN_OR_RETURN(const double factor, number(s, "factor"));
  const double orig = number_or(s, "original_max_position_embeddings", 4096);
  const double beta_fast = number_or(s, "beta_fast", 32), beta_slow = number_or(s, "beta_slow", 1);
  const double mscale = number_or(s, "mscale", 1), mscale_all = number_or(s, "mscale_all_dim", 0);
  const auto correction = [&](double rotations) {
    return (static_cast<double>(c.dims) * std::log(orig / (rotations * 2 * kPi))) /
           (2 * std::log(c.base));
  };
  const double low = std::max(std::floor(correction(beta_fast)), 0.0);
  double high = std::min(std::ceil(correction(beta_slow)), static_cast<double>(c.dims - 1));
  if (low == high) high += 0.001;
  const float f_low = static_cast<float>(low), span = static_cast<float>(high - low);
  const float f_factor = static_cast<float>(factor);
  std::vector<float> extra = powers(c.base, c.dims, c.dims), freqs(extra.size());
  for (size_t i = 0; i < extra.size(); ++i) {
    const float ramp = std::min(std::max((static_cast<float>(i) - f_low) / span, 0.0f), 1.0f);
    const float mask = 1.0f - ramp;
    const float inter = f_factor * extra[i];
    freqs[i] = (inter * extra[i]) / (inter * mask + extra[i] * (1.0f - mask));
  }
  RopeSpec r = freqs_path(c, std::move(freqs));
  const double m = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all);
  if (m != 1.0) r.scales_input = true, r.input_scale = static_cast<float>(m);
  return r;
}

Result<RopeSpec> longrope(const LlamaRopeConfig& c) {
  const json& s = c.scaling;
  HETERO_ASSIGN_OR_RETURN(const double orig, number(s, "original_max_position_embeddings"));
  if (!s.contains("short_factor"))
    return invalid_argument("rope_scaling needs 'short_factor' for type 'longrope'");
  if (c.max_position_embeddings <= 0)
    return invalid_argument("longrope needs max_position_embeddings in the config");
  std::vector<float> freqs = powers(c.base, c.dims, c.dims);
  const json& lf = s.contains("long_factor") ? s["long_factor"] : json();
  if (lf.is_number()) {
    for (float& f : freqs) f = static_cast<float>(lf.get<double>()) * f;
  } else if (lf.is_array() && lf.size() == freqs.size()) {
    for (size_t i = 0; i < freqs.size(); ++i) {
      if (!lf[i].is_number()) return invalid_argument("rope_scaling.long_factor must be numbers");
      freqs[i] = static_cast<float>(lf[i].get<double>()) * freqs[i];
    }
  } else {
    return invalid_argument("rope_scaling.long_factor must be a number or " +
                            std::to_string(freqs.size()) + " numbers (head_dim / 2)");
  }
  const double ratio = static_cast<double>(c.max_position_embeddings) / orig;
  RopeSpec r = freqs_path(c, std::move(freqs));
  r.traditional = false;  // SuScaledRoPE always rotates halves
  r.scales_input = true;  // it multiplies its input even by 1 (a no-op then)
  r.input_scale =
      static_cast<float>(ratio <= 1.0 ? 1.0 : std::sqrt(1 + std::log(ratio) / std::log(orig)));
  return r;
}

Result<RopeSpec> proportional(const LlamaRopeConfig& c) {
  const json& s = c.scaling;
  const double prf = number_or(s, "partial_rotary_factor", 1.0),
               factor = number_or(s, "factor", 1.0);
  const auto rotated = static_cast<int64_t>(static_cast<double>(c.dims) * prf);
  if (rotated > c.dims || rotated < 0)
    return invalid_argument("rope_scaling.partial_rotary_factor must be in [0, 1]");
  std::vector<float> freqs = powers(c.base, rotated, c.dims);
  for (float& f : freqs) f = static_cast<float>(factor) * f;
  freqs.resize(freqs.size() + static_cast<size_t>((c.dims - rotated) / 2), INFINITY);
  return freqs_path(c, std::move(freqs));
}

// DynamicNTKScalingRoPE: the base of a call of L tokens at offset o is
// base * (factor * s / mpe - (factor - 1)) ** (dims / (dims - 2)) with s = max(L + o, mpe), in
// Python doubles (the libm pow Python's ** calls), rounded to float32 by mx.fast.rope. Within
// mpe, s is mpe for every call: one base, whatever the schedule.
// The base of a call ending at `end` (seq_len = L + offset) on the server's single path, whose
// offset is an int: Python doubles, s = max(end, mpe).
double dynamic_base_doubles(const LlamaRopeConfig& c, double factor, int64_t end) {
  const auto mpe = static_cast<double>(c.max_position_embeddings);
  const auto s = static_cast<double>(std::max(end, c.max_position_embeddings));
  const double bracket = factor * s / mpe - (factor - 1);
  const double exponent = static_cast<double>(c.dims) / static_cast<double>(c.dims - 2);
  return c.base * std::pow(bracket, exponent);
}

// The same on the batch path once end >= mpe: the cache's offset is an mx.array, so
// max(L + offset, mpe) is that int32 array and the base MLX's float32 arithmetic, each Python
// scalar rounded to float32 where it meets the array (docs/findings/dynamic-rope-needs-the-
// decoders-calls.md). MLX's CPU power of two float32 arrays is powf.
double dynamic_base_float32(const LlamaRopeConfig& c, double factor, int64_t end) {
  float t = static_cast<float>(factor) * static_cast<float>(end);
  t = t / static_cast<float>(c.max_position_embeddings);
  t = t - static_cast<float>(factor - 1);
  t = std::pow(t,
               static_cast<float>(static_cast<double>(c.dims) / static_cast<double>(c.dims - 2)));
  return static_cast<double>(static_cast<float>(c.base) * t);
}

Result<RopeSpec> dynamic(const LlamaRopeConfig& c) {
  HETERO_ASSIGN_OR_RETURN(const double factor, number(c.scaling, "factor"));
  if (c.max_position_embeddings <= 0)
    return invalid_argument("rope_scaling type 'dynamic' needs max_position_embeddings");
  if (c.dims <= 2) return invalid_argument("rope_scaling type 'dynamic' needs head_dim > 2");
  LlamaRopeConfig at = c;
  at.base = dynamic_base_doubles(c, factor, c.max_position_embeddings);
  return base_path(at, 1.0);
}

}  // namespace

int64_t rope_reach(const LlamaRopeConfig& c) {
  return rope_type_of(c.scaling) == "dynamic" ? c.max_position_embeddings : 0;
}

Status check_rope_reach(const LlamaRopeConfig& c, int64_t tokens) {
  const int64_t reach = rope_reach(c);
  if (reach <= 0 || tokens <= reach) return Status::ok();
  return failed_precondition(
      "a prompt of " + std::to_string(tokens) + " tokens is past max_position_embeddings (" +
      std::to_string(reach) + ") of the decoder's rope_scaling '" + describe_rope(c) +
      "', which recomputes its base per call there: its keys depend on how the decoder cuts the "
      "prompt, so it is left to the decoder");
}

std::string rope_type_of(const json& scaling) {
  if (!scaling.is_object()) return "default";
  for (const char* key : {"type", "rope_type"})
    if (scaling.contains(key) && scaling[key].is_string() &&
        !scaling[key].get<std::string>().empty())
      return scaling[key].get<std::string>();
  return "default";
}

std::string describe_rope(const LlamaRopeConfig& c) {
  const std::string type = rope_type_of(c.scaling);
  if (c.scaling.is_object() && c.scaling.contains("factor") && c.scaling["factor"].is_number())
    return type + " (factor " + c.scaling["factor"].dump() + ")";
  return type;
}

Result<RopeSpec> llama_rope(const LlamaRopeConfig& c) {
  if (c.dims <= 0 || c.dims % 2) return invalid_argument("rope dims must be positive and even");
  if (!(c.base > 0)) return invalid_argument("rope_theta must be positive");
  if (!c.scaling.is_null() && !c.scaling.is_object())
    return invalid_argument("rope_scaling must be an object or null");
  const std::string type = rope_type_of(c.scaling);
  if (type == "default") return base_path(c, 1.0);
  if (type == "linear") {
    HETERO_ASSIGN_OR_RETURN(const double factor, number(c.scaling, "factor"));
    return base_path(c, 1 / factor);
  }
  if (type == "mrope") {
    const json& sec = c.scaling.contains("mrope_section") ? c.scaling["mrope_section"] : json();
    if (!sec.is_array() || sec.size() != 3)
      return invalid_argument("rope_scaling type 'mrope' needs a 3-entry mrope_section");
    return base_path(c, 1.0);
  }
  if (type == "llama3") return llama3(c);
  if (type == "yarn" || type == "deepseek_yarn" || type == "telechat3-yarn") return yarn(c);
  if (type == "longrope") return longrope(c);
  if (type == "proportional") return proportional(c);
  if (type == "dynamic") return dynamic(c);
  return invalid_argument("rope_scaling type '" + type + "' is not one mlx-lm implements");
}

Result<RopeSpec> llama_rope_for_call(const LlamaRopeConfig& c, int64_t offset, int64_t length,
                                     bool batched) {
  const int64_t end = offset + length;
  const int64_t mpe = c.max_position_embeddings;
  // Python's max(a, b) keeps a unless b > a: on the batch path the array wins from end == mpe.
  const bool per_call = rope_type_of(c.scaling) == "dynamic" && (batched ? end >= mpe : end > mpe);
  if (!per_call) return llama_rope(c);
  HETERO_RETURN_IF_ERROR(llama_rope(c).status());  // the config's own checks
  HETERO_ASSIGN_OR_RETURN(const double factor, number(c.scaling, "factor"));
  LlamaRopeConfig at = c;
  at.base = batched ? dynamic_base_float32(c, factor, end) : dynamic_base_doubles(c, factor, end);
  return base_path(at, 1.0);
}

RopeByCall::RopeByCall(RopeSpec plain) : plain_(std::move(plain)) {}

Result<RopeByCall> RopeByCall::make(const LlamaRopeConfig& c, RopeSpec plain, int64_t start,
                                    const std::vector<int64_t>& calls, bool batched) {
  RopeByCall r(std::move(plain));
  int64_t pos = start;
  for (int64_t n : calls) {
    if (n <= 0) return invalid_argument("a decoder call of " + std::to_string(n) + " tokens");
    HETERO_ASSIGN_OR_RETURN(RopeSpec spec, llama_rope_for_call(c, pos, n, batched));
    if (!(spec == r.plain_)) r.calls_.push_back(Call{pos, pos + n, std::move(spec)});
    pos += n;
  }
  return r;
}

Result<RopeByCall> RopeByCall::for_engine(const LlamaRopeConfig& c, RopeSpec plain, int64_t start,
                                          const std::vector<int64_t>& calls, bool batched) {
  HETERO_ASSIGN_OR_RETURN(RopeByCall r, make(c, std::move(plain), start, calls, batched));
  if (r.per_call() && start > 0)
    return failed_precondition(
        "a tail from row " + std::to_string(start) + " past the reach of the decoder's rope (" +
        describe_rope(c) +
        ", recomputed per call): its earlier rows' ropes came from calls this request does not "
        "name; it is left to the decoder");
  return r;
}

void RopeByCall::apply(uint16_t* x, int64_t tokens, int64_t heads, int64_t head_dim,
                       int64_t pos0) const {
  const int64_t row = heads * head_dim;
  for_each_span(tokens, pos0, [&](int64_t off, int64_t rows, size_t i) {
    rope_apply(x + off * row, rows, heads, head_dim, pos0 + off, spec(i));
  });
}

}  // namespace hetero
