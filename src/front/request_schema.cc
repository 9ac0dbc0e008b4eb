// Request schema: see request_schema.h. Each bound names the decoder code it guards:
// mlx_lm/server.py (APIHandler.validate_model_parameters, ResponseGenerator), mlx_lm's
// sample_utils.py and generate.py, mlx_vlm/server/schemas.py (ChatRequest) and
// request_normalization.py. mlx-lm checks types and lower bounds only, in the request's thread;
// what it leaves unchecked fails later inside its one generation thread, which then serves no
// request again. Refusals never quote the client's strings: a cut one may not be UTF-8, and the
// error body must dump.
#include "front/request_schema.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <optional>
#include <string_view>

#include "common/json_text.h"

namespace hetero {
using nlohmann::json;

namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
// When the decoder's limits are unknown. No model this project serves has a smaller vocabulary
// (Llama 2 and Mistral: 32000; Llama 3, DeepSeek V4, the tiny models' SmolLM2 tokenizer:
// more), and token counts reach 2M (STYLE.md).
constexpr int64_t kFallbackVocab = 32000;
constexpr int64_t kFallbackContext = int64_t{1} << 21;

constexpr size_t kMaxMessages = 4096;
constexpr size_t kMaxParts = 1024;  // content parts of one message
constexpr size_t kMaxTools = 128;   // OpenAI's limit
constexpr size_t kMaxToolCalls = 128;
// mlx-lm takes any number (one Aho-Corasick automaton) and caches up to 101 of them keyed by
// the stop list: bounding the list bounds that cache. OpenAI allows 4; more costs nothing.
constexpr size_t kMaxStops = 16;
constexpr size_t kMaxStopBytes = 1024;
constexpr size_t kMaxLogitBias = 300;  // OpenAI's limit
constexpr size_t kMaxTemplateKwargs = 32;
constexpr size_t kMaxRoleMapping = 32;
constexpr size_t kMaxMetadata = 16;       // OpenAI's limit
constexpr size_t kMaxNameBytes = 256;     // names, ids, user, cache_salt, service tiers
constexpr size_t kMaxToolNameBytes = 64;  // OpenAI's limit

bool is_llama(const ServedLimits& s) { return s.family == "llama"; }
bool is_dsv4(const ServedLimits& s) { return s.family == "deepseek_v4"; }

std::string q(std::string_view path) { return "'" + std::string(path) + "'"; }

// nlohmann keeps integers beyond int64 as unsigned or double (seed 1e30, max_tokens 2^64-1).
std::optional<int64_t> as_int64(const json& v) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(kInt64Max)) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  return std::nullopt;
}

// A member that is present and not null: OpenAI's optional fields are nullable, and null
// means absent (mlx-lm's body.get would otherwise pass None on).
const json* field(const json& obj, const char* name) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(name);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

const std::string* str_at(const json& obj, const char* name) {
  const json* v = field(obj, name);
  return v && v->is_string() ? &v->get_ref<const std::string&>() : nullptr;
}

bool short_string(const json& v, size_t max_bytes = kMaxNameBytes) {
  return v.is_string() && v.get_ref<const std::string&>().size() <= max_bytes;
}

// ---- numbers: one row per field ----------------------------------------------------------

// Where an upper bound comes from: a constant, or the served model.
enum class Bound { kFixed, kContext, kLastTokenId };

struct IntRule {
  const char* name;
  int64_t lo, hi;  // hi for Bound::kFixed
  Bound hi_from;
  const char* why;  // appended to a refusal
};

constexpr IntRule kIntRules[] = {
    // A completion longer than the window cannot be produced (the prompt is checked after
    // tokenization: completion_length_error).
    {"max_tokens", 1, 0, Bound::kContext, ""},
    {"max_completion_tokens", 1, 0, Bound::kContext, ""},
    // apply_top_k raises for top_k >= the vocabulary, inside the generation thread.
    {"top_k", 0, 0, Bound::kLastTokenId, ""},
    // More context than the window holds means nothing.
    {"repetition_context_size", 0, 0, Bound::kContext, ""},
    {"presence_context_size", 0, 0, Bound::kContext, ""},
    {"frequency_context_size", 0, 0, Bound::kContext, ""},
    // mlx-lm's own range (OpenAI's is 0..20); -1, its "off", is the field's absence here.
    {"top_logprobs", 0, 11, Bound::kFixed, ""},
    // Each draft round runs the draft model that many steps; more only wastes them.
    {"num_draft_tokens", 0, 64, Bound::kFixed, ""},
    // mx.random.seed takes an unsigned 64-bit seed; OpenAI's is a signed 64-bit integer.
    {"seed", 0, kInt64Max, Bound::kFixed, ""},
    {"n", 1, 1, Bound::kFixed, ": the decoder produces one choice per request"},
    {"best_of", 1, 1, Bound::kFixed, ": the decoder produces one choice per request"},
};

struct RealRule {
  const char* name;
  double lo, hi;
};

constexpr RealRule kRealRules[] = {
    // OpenAI's range; mlx-lm takes any t >= 0, but past 2 sampling is near-uniform noise and no
    // OpenAI client sends more.
    {"temperature", 0, 2},
    {"top_p", 0, 1},
    {"min_p", 0, 1},  // apply_min_p raises outside [0, 1]
    // Multiplicative: 1 is neutral, mlx-lm's 0 is off, and it refuses less. Past 2 every
    // repeated token is all but banned.
    {"repetition_penalty", 0, 2},
    {"presence_penalty", -2, 2},  // OpenAI's range
    {"frequency_penalty", -2, 2},
    {"xtc_probability", 0, 1},
    // mlx-lm's validator allows up to 1, but apply_xtc raises above 0.5 in the generation
    // thread (issue 50's failure mode).
    {"xtc_threshold", 0, 0.5},
};

int64_t upper_bound(const IntRule& r, const ServedLimits& served) {
  switch (r.hi_from) {
    case Bound::kContext:
      return served.context_window > 0 ? served.context_window : kFallbackContext;
    case Bound::kLastTokenId:
      return (served.vocab_size > 0 ? served.vocab_size : kFallbackVocab) - 1;
    case Bound::kFixed:
      break;
  }
  return r.hi;
}

std::string number_error(const json& body, const ServedLimits& served) {
  for (const IntRule& r : kIntRules) {
    const json* v = field(body, r.name);
    if (!v) continue;
    const int64_t hi = upper_bound(r, served);
    const std::optional<int64_t> x = as_int64(*v);
    if (x && *x >= r.lo && *x <= hi) continue;
    if (r.lo == hi) return q(r.name) + " must be " + std::to_string(hi) + r.why;
    return q(r.name) + " must be an integer in [" + std::to_string(r.lo) + ", " +
           std::to_string(hi) + "]" + r.why;
  }
  for (const RealRule& r : kRealRules) {
    const json* v = field(body, r.name);
    if (!v) continue;
    const double x = v->is_number() ? v->get<double>() : NAN;
    if (!(x >= r.lo && x <= r.hi))  // NaN fails too
      return q(r.name) + " must be a number in [" + json(r.lo).dump() + ", " + json(r.hi).dump() +
             "]";
  }
  return "";
}

// ---- other fields: one checker per shape ---------------------------------------------------

// "" or the refusal, naming `name`. A required field that is absent is checked as null.
using Check = std::string (*)(const json& v, const std::string& name, const ServedLimits& served);

std::string check_bool(const json& v, const std::string& name, const ServedLimits&) {
  return v.is_boolean() ? "" : q(name) + " must be a boolean";
}

std::string check_string(const json& v, const std::string& name, const ServedLimits&) {
  return v.is_string() ? "" : q(name) + " must be a string";
}

std::string check_short_string(const json& v, const std::string& name, const ServedLimits&) {
  return short_string(v)
             ? ""
             : q(name) + " must be a string of at most " + std::to_string(kMaxNameBytes) + " bytes";
}

// The front reads include_usage itself (value("include_usage", false)): null is refused too.
std::string check_stream_options(const json& v, const std::string& name, const ServedLimits&) {
  if (!v.is_object()) return q(name) + " must be an object";
  auto usage = v.find("include_usage");
  return usage == v.end() || usage->is_boolean()
             ? ""
             : q(name + ".include_usage") + " must be a boolean";
}

// mlx-lm: the legacy completions API's integer logprobs would be refused there with a 400.
std::string check_logprobs(const json& v, const std::string& name, const ServedLimits&) {
  return v.is_boolean() ? ""
                        : q(name) +
                              " must be a boolean (this decoder answers with chat-style "
                              "logprobs; top_logprobs asks for alternatives)";
}

// Issue 50: mlx-lm hashes the stop list in its generation thread (_make_state_machine), so
// anything but strings there killed it for every later request.
std::string check_stop(const json& v, const std::string& name, const ServedLimits& served) {
  const std::string shape = q(name) + " must be a string or an array of at most " +
                            std::to_string(kMaxStops) + " strings of at most " +
                            std::to_string(kMaxStopBytes) + " bytes";
  bool any = false;
  if (v.is_string()) {
    if (!short_string(v, kMaxStopBytes)) return shape;
    any = !v.get_ref<const std::string&>().empty();
  } else if (v.is_array() && v.size() <= kMaxStops) {
    for (const json& s : v) {
      if (!short_string(s, kMaxStopBytes)) return shape;
      any = any || !s.get_ref<const std::string&>().empty();
    }
  } else {
    return shape;
  }
  // mlx-vlm's chat endpoint has no stop field; it would run past every stop string.
  if (any && is_dsv4(served))
    return q(name) + " is not supported by this decoder (mlx-vlm ignores stop sequences)";
  return "";
}

// A token id as OpenAI writes it: a decimal string, no sign, no leading zero.
bool is_token_id(const std::string& k, int64_t vocab) {
  if (k.empty() || k.size() > 10 || (k.size() > 1 && k[0] == '0')) return false;
  int64_t id = 0;
  for (char ch : k) {
    if (ch < '0' || ch > '9') return false;
    id = id * 10 + (ch - '0');
  }
  return id < vocab;
}

// mlx-lm adds the biases with logits.at[:, ids]: an id past the vocabulary is never checked.
std::string check_logit_bias(const json& v, const std::string& name, const ServedLimits& served) {
  if (!v.is_object() || v.size() > kMaxLogitBias)
    return q(name) + " must be an object of at most " + std::to_string(kMaxLogitBias) + " entries";
  const int64_t vocab = served.vocab_size > 0 ? served.vocab_size : kFallbackVocab;
  for (const auto& [k, b] : v.items()) {
    if (!is_token_id(k, vocab))
      return q(name) + " keys must be token ids in [0, " + std::to_string(vocab) +
             "), written in decimal";
    const double x = b.is_number() ? b.get<double>() : NAN;
    if (!(x >= -100 && x <= 100)) return q(name) + " values must be numbers in [-100, 100]";
  }
  return "";
}

bool is_identifier(const std::string& k) {
  if (k.empty() || k.size() > 64 || std::isdigit(static_cast<unsigned char>(k[0]))) return false;
  for (char ch : k)
    if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '_') return false;
  return true;
}

// apply_chat_template's own arguments: mlx-lm passes chat_template_kwargs beside them, so one
// of these either collides with its own (tokenize, add_generation_prompt: a TypeError it
// answers with a 404) or changes what tokenization returns.
// clang-format off
constexpr const char* kTemplateArgs[] = {
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"};
// clang-format on

std::string check_template_kwargs(const json& v, const std::string& name, const ServedLimits&) {
  if (!v.is_object() || v.size() > kMaxTemplateKwargs)
    return q(name) + " must be an object of at most " + std::to_string(kMaxTemplateKwargs) +
           " entries";
  for (const auto& [k, x] : v.items()) {
    for (const char* arg : kTemplateArgs)
      if (k == arg) return q(name) + " may not set '" + k + "': the decoder sets it";
    if (!is_identifier(k))
      return q(name) + " keys must be identifiers (letters, digits, '_'; at most 64)";
    // Template switches are scalars (enable_thinking, reasoning_effort); shallow stays cheap.
    if (x.is_structured()) return q(name) + " values must be strings, numbers, booleans or null";
  }
  return "";
}

// Used only when the tokenizer has no chat template: prefixes per role, pasted as text.
std::string check_role_mapping(const json& v, const std::string& name, const ServedLimits&) {
  if (!v.is_object() || v.size() > kMaxRoleMapping)
    return q(name) + " must be an object of at most " + std::to_string(kMaxRoleMapping) +
           " strings";
  for (const auto& [k, x] : v.items())
    if (!x.is_string()) return q(name) + " values must be strings";
  return "";
}

std::string check_metadata(const json& v, const std::string& name, const ServedLimits&) {
  if (!v.is_object() || v.size() > kMaxMetadata)
    return q(name) + " must be an object of at most " + std::to_string(kMaxMetadata) + " strings";
  for (const auto& [k, x] : v.items())
    if (k.size() > 64 || !short_string(x, 512))
      return q(name) + " keys must have at most 64 bytes and values be strings of at most 512";
  return "";
}

// mlx-lm has no structured output: a JSON format there would silently come back as free text.
std::string check_response_format(const json& v, const std::string& name,
                                  const ServedLimits& served) {
  const std::string* type = str_at(v, "type");
  if (!type) return q(name) + " must be an object with a string 'type'";
  if (*type == "text") return "";
  if (*type != "json_object" && *type != "json_schema")
    return q(name + ".type") + " must be 'text', 'json_object' or 'json_schema'";
  if (is_llama(served))
    return q(name) + " of type '" + *type +
           "' is not supported by this decoder (mlx-lm has no structured output)";
  const json* schema = field(v, "json_schema");
  if (*type == "json_schema" &&
      !(schema && field(*schema, "schema") && field(*schema, "schema")->is_object()))
    return q(name + ".json_schema.schema") + " must be an object";
  return "";
}

// mlx-vlm enforces tool_choice; mlx-lm ignores it, so only what it does anyway is accepted
// there ("none" is honoured by not forwarding the tools).
std::string check_tool_choice(const json& v, const std::string& name, const ServedLimits& served) {
  const std::string shape = q(name) +
                            " must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                            "\"function\": {\"name\": ...}}";
  const bool forced = v.is_string() ? v == "required" : true;
  if (v.is_string() && v != "none" && v != "auto" && !forced) return shape;
  if (!v.is_string()) {
    const std::string* type = str_at(v, "type");
    const json* function = field(v, "function");
    const std::string* fname = function ? str_at(*function, "name") : nullptr;
    if (!type || *type != "function" || !fname || fname->empty()) return shape;
  }
  if (forced && is_llama(served))
    return q(name) + " can only be 'auto' or 'none' here (mlx-lm cannot force a tool call)";
  return "";
}

std::string check_tools(const json& v, const std::string& name, const ServedLimits&) {
  if (!v.is_array() || v.size() > kMaxTools)
    return q(name) + " must be an array of at most " + std::to_string(kMaxTools) + " tools";
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string at = name + "[" + std::to_string(i) + "]";
    const std::string* type = str_at(v[i], "type");
    if (!type || *type != "function") return q(at + ".type") + " must be 'function'";
    const json* f = field(v[i], "function");
    if (!f || !f->is_object()) return q(at + ".function") + " must be an object";
    const json* fname = field(*f, "name");
    if (!fname || !short_string(*fname, kMaxToolNameBytes) || fname->get<std::string>().empty())
      return q(at + ".function.name") + " must be a non-empty string of at most 64 bytes";
    if (const json* d = field(*f, "description"); d && !d->is_string())
      return q(at + ".function.description") + " must be a string";
    if (const json* p = field(*f, "parameters"); p && !p->is_object())
      return q(at + ".function.parameters") + " must be an object (a JSON schema)";
    if (const json* s = field(*f, "strict"); s && !s->is_boolean())
      return q(at + ".function.strict") + " must be a boolean";
  }
  return "";
}

// mlx-lm turns string arguments into objects with json.loads for the chat template.
std::string check_tool_calls(const json& v, const std::string& path) {
  if (!v.is_array() || v.size() > kMaxToolCalls)
    return q(path) + " must be an array of at most " + std::to_string(kMaxToolCalls) +
           " tool calls";
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string at = path + "[" + std::to_string(i) + "]";
    if (!v[i].is_object()) return q(at) + " must be an object";
    if (const json* id = field(v[i], "id"); id && !short_string(*id))
      return q(at + ".id") + " must be a string of at most 256 bytes";
    if (const json* t = field(v[i], "type"); t && *t != "function")
      return q(at + ".type") + " must be 'function'";
    const json* f = field(v[i], "function");
    const json* fname = f ? field(*f, "name") : nullptr;
    if (!fname || !short_string(*fname, kMaxToolNameBytes) || fname->get<std::string>().empty())
      return q(at + ".function.name") + " must be a non-empty string of at most 64 bytes";
    const json* args = field(*f, "arguments");
    if (!args || args->is_object()) continue;
    const bool is_object = args->is_string() && [&] {
      auto parsed = parse_untrusted_json(args->get_ref<const std::string&>());
      return parsed.is_ok() && parsed.value().is_object();
    }();
    if (!is_object)
      return q(at + ".function.arguments") + " must be a JSON object, or one encoded as a string";
  }
  return "";
}

bool is_media_part(const std::string& type) {
  for (const char* t : {"image_url", "input_image", "image", "input_audio", "audio", "video",
                        "video_url", "input_video", "file"})
    if (type == t) return true;
  return false;
}

// Text parts only: mlx-lm raises on any other part for a text model and fetches http image
// URLs itself; neither decoder's seam tokenizes images for the front door.
std::string check_content(const json& m, const std::string& path, bool assistant) {
  const std::string at = path + ".content";
  const json* content = field(m, "content");
  if (!content) return assistant ? "" : q(at) + " must be a string or an array of text parts";
  if (content->is_string()) return "";
  if (!content->is_array() || content->size() > kMaxParts)
    return q(at) + " must be a string or an array of at most " + std::to_string(kMaxParts) +
           " text parts";
  for (size_t j = 0; j < content->size(); ++j) {
    const std::string part = at + "[" + std::to_string(j) + "]";
    const std::string* type = str_at((*content)[j], "type");
    if (type && is_media_part(*type))
      return q(part) + " is not text: this server takes text parts only";
    if (!type || *type != "text") return q(part + ".type") + " must be 'text'";
    if (!str_at((*content)[j], "text")) return q(part + ".text") + " must be a string";
  }
  return "";
}

// mlx-vlm's ChatMessage takes exactly these roles; mlx-lm passes any to the chat template.
constexpr const char* kRoles[] = {"system", "developer", "user", "assistant", "tool"};

std::string check_message(const json& m, const std::string& path) {
  if (!m.is_object()) return q(path) + " must be an object";
  const std::string* role = str_at(m, "role");
  bool known = false;
  for (const char* r : kRoles) known = known || (role && *role == r);
  if (!known)
    return q(path + ".role") + " must be 'system', 'developer', 'user', 'assistant' or 'tool'";
  const bool assistant = *role == "assistant";
  if (std::string why = check_content(m, path, assistant); !why.empty()) return why;
  for (const char* k : {"name", "tool_call_id"})
    if (const json* x = field(m, k); x && !short_string(*x))
      return q(path + "." + k) + " must be a string of at most 256 bytes";
  for (const char* k : {"reasoning_content", "reasoning", "thinking"})
    if (const json* x = field(m, k); x && !x->is_string())
      return q(path + "." + k) + " must be a string";
  const json* calls = field(m, "tool_calls");
  if (calls && !assistant) return q(path + ".tool_calls") + " is for assistant messages only";
  return calls ? check_tool_calls(*calls, path + ".tool_calls") : "";
}

std::string check_messages(const json& v, const std::string& name, const ServedLimits&) {
  if (!v.is_array() || v.empty() || v.size() > kMaxMessages)
    return q(name) + " must be a non-empty array of at most " + std::to_string(kMaxMessages) +
           " messages";
  for (size_t i = 0; i < v.size(); ++i)
    if (std::string why = check_message(v[i], name + "[" + std::to_string(i) + "]"); !why.empty())
      return why;
  return "";
}

std::string check_prompt(const json& v, const std::string& name, const ServedLimits&) {
  if (v.is_string() && !v.get_ref<const std::string&>().empty()) return "";
  return q(name) +
         " must be a non-empty string (this decoder takes one prompt: no arrays of prompts or "
         "token ids)";
}

// Only the served model's default draft: mlx-lm loads any other name from disk or a hub.
std::string check_draft_model(const json& v, const std::string& name, const ServedLimits&) {
  return v == "default_model" ? "" : q(name) + " cannot be chosen per request here";
}

std::string check_echo(const json& v, const std::string& name, const ServedLimits&) {
  return v == false ? "" : q(name) + " must be false (the decoder does not echo the prompt)";
}

std::string check_suffix(const json& v, const std::string& name, const ServedLimits&) {
  return v == "" ? "" : q(name) + " is not supported by this decoder (no insertion)";
}

std::string check_refused(const json&, const std::string& name, const ServedLimits&) {
  if (name == "functions" || name == "function_call")
    return q(name) + " is not supported (deprecated by OpenAI): use 'tools' and 'tool_choice'";
  // adapters (mlx-lm), adapter_path (mlx-vlm): either loads weights named by the client.
  return q(name) + " cannot be chosen per request: this server serves one model";
}

enum class Endpoint { kBoth, kChat, kText };
// Optional: null counts as absent. kNotNull: the front itself reads the field, so null is
// refused. kRequired: must be present, not null.
enum class Presence { kOptional, kNotNull, kRequired };

struct FieldRule {
  const char* name;
  Check check;
  Endpoint where;
  Presence presence;
};

constexpr FieldRule kFieldRules[] = {
    {"messages", check_messages, Endpoint::kChat, Presence::kRequired},
    {"prompt", check_prompt, Endpoint::kText, Presence::kRequired},
    {"model", check_string, Endpoint::kBoth, Presence::kNotNull},
    {"stream", check_bool, Endpoint::kBoth, Presence::kNotNull},
    {"stream_options", check_stream_options, Endpoint::kBoth, Presence::kNotNull},
    {"stop", check_stop, Endpoint::kBoth, Presence::kOptional},
    {"logprobs", check_logprobs, Endpoint::kBoth, Presence::kOptional},
    {"logit_bias", check_logit_bias, Endpoint::kBoth, Presence::kOptional},
    {"draft_model", check_draft_model, Endpoint::kBoth, Presence::kOptional},
    {"adapters", check_refused, Endpoint::kBoth, Presence::kOptional},
    {"adapter_path", check_refused, Endpoint::kBoth, Presence::kOptional},
    {"functions", check_refused, Endpoint::kChat, Presence::kOptional},
    {"function_call", check_refused, Endpoint::kChat, Presence::kOptional},
    {"chat_template_kwargs", check_template_kwargs, Endpoint::kChat, Presence::kOptional},
    {"role_mapping", check_role_mapping, Endpoint::kChat, Presence::kOptional},
    {"tools", check_tools, Endpoint::kChat, Presence::kOptional},
    {"tool_choice", check_tool_choice, Endpoint::kChat, Presence::kOptional},
    {"response_format", check_response_format, Endpoint::kChat, Presence::kOptional},
    {"parallel_tool_calls", check_bool, Endpoint::kChat, Presence::kOptional},
    {"enable_thinking", check_bool, Endpoint::kChat, Presence::kOptional},
    {"reasoning_effort", check_short_string, Endpoint::kChat, Presence::kOptional},
    {"echo", check_echo, Endpoint::kText, Presence::kOptional},
    {"suffix", check_suffix, Endpoint::kText, Presence::kOptional},
    // Read by nobody downstream; their types are still OpenAI's.
    {"user", check_short_string, Endpoint::kBoth, Presence::kOptional},
    {"cache_salt", check_short_string, Endpoint::kBoth, Presence::kOptional},
    {"service_tier", check_short_string, Endpoint::kBoth, Presence::kOptional},
    {"store", check_bool, Endpoint::kBoth, Presence::kOptional},
    {"metadata", check_metadata, Endpoint::kBoth, Presence::kOptional},
};

bool applies(Endpoint where, bool chat) {
  return where == Endpoint::kBoth || (where == Endpoint::kChat) == chat;
}

// ---- forwarding ------------------------------------------------------------------------------

enum Family : uint8_t { kLlama = 1, kDsv4 = 2, kAnyFamily = 3 };

struct Forwarded {
  const char* name;
  uint8_t families;
  Endpoint where;
};

// What mlx-lm's APIHandler.do_POST and handlers read (llama), and what mlx-vlm's ChatRequest
// reads and this file checks (deepseek_v4). Fields either would ignore are not forwarded.
constexpr Forwarded kForwarded[] = {
    {"model", kAnyFamily, Endpoint::kBoth},
    {"stream", kAnyFamily, Endpoint::kBoth},
    {"stream_options", kAnyFamily, Endpoint::kBoth},
    {"max_tokens", kAnyFamily, Endpoint::kBoth},
    {"max_completion_tokens", kAnyFamily, Endpoint::kBoth},  // mlx-vlm: renamed below
    {"temperature", kAnyFamily, Endpoint::kBoth},
    {"top_p", kAnyFamily, Endpoint::kBoth},
    {"top_k", kAnyFamily, Endpoint::kBoth},
    {"min_p", kAnyFamily, Endpoint::kBoth},
    {"repetition_penalty", kAnyFamily, Endpoint::kBoth},
    {"repetition_context_size", kAnyFamily, Endpoint::kBoth},
    {"presence_penalty", kAnyFamily, Endpoint::kBoth},
    {"presence_context_size", kAnyFamily, Endpoint::kBoth},
    {"frequency_penalty", kAnyFamily, Endpoint::kBoth},
    {"frequency_context_size", kAnyFamily, Endpoint::kBoth},
    {"logit_bias", kAnyFamily, Endpoint::kBoth},
    {"logprobs", kAnyFamily, Endpoint::kBoth},
    {"top_logprobs", kAnyFamily, Endpoint::kBoth},
    {"seed", kAnyFamily, Endpoint::kBoth},
    {"xtc_probability", kLlama, Endpoint::kBoth},
    {"xtc_threshold", kLlama, Endpoint::kBoth},
    {"num_draft_tokens", kLlama, Endpoint::kBoth},
    {"stop", kLlama, Endpoint::kBoth},
    {"prompt", kLlama, Endpoint::kText},
    {"messages", kAnyFamily, Endpoint::kChat},
    {"tools", kAnyFamily, Endpoint::kChat},
    {"chat_template_kwargs", kLlama, Endpoint::kChat},
    {"role_mapping", kLlama, Endpoint::kChat},
    {"tool_choice", kDsv4, Endpoint::kChat},
    {"response_format", kDsv4, Endpoint::kChat},
    {"enable_thinking", kDsv4, Endpoint::kChat},
    {"reasoning_effort", kDsv4, Endpoint::kChat},
};

uint8_t family_mask(const ServedLimits& served) {
  return is_llama(served) ? kLlama : is_dsv4(served) ? kDsv4 : kAnyFamily;
}

// Copies `keys` of `from` that are present; "content" even when null (an assistant's turn
// with tool calls), as the chat templates see it.
json pick(const json& from, std::initializer_list<const char*> keys) {
  json out = json::object();
  for (const char* k : keys)
    if (const json* v = field(from, k))
      out[k] = *v;
    else if (std::string_view(k) == "content" && from.is_object() && from.contains(k))
      out[k] = nullptr;
  return out;
}

json forwarded_message(const json& m) {
  json out = pick(
      m, {"role", "content", "name", "tool_call_id", "reasoning_content", "reasoning", "thinking"});
  if (out.contains("content") && out["content"].is_array())
    for (json& part : out["content"]) part = pick(part, {"type", "text"});
  if (const json* calls = field(m, "tool_calls"); calls && calls->is_array()) {
    json& to = out["tool_calls"] = json::array();
    for (const json& c : *calls) {
      json call = pick(c, {"id", "type"});
      if (const json* f = field(c, "function")) call["function"] = pick(*f, {"name", "arguments"});
      to.push_back(std::move(call));
    }
  }
  return out;
}

json forwarded_tools(const json& tools) {
  json out = json::array();
  for (const json& t : tools) {
    json tool = pick(t, {"type"});
    if (const json* f = field(t, "function"))
      tool["function"] = pick(*f, {"name", "description", "parameters", "strict"});
    out.push_back(std::move(tool));
  }
  return out;
}

}  // namespace

ServedLimits served_limits(const json& info) {
  ServedLimits s;
  if (const json* v = field(info, "vocab_size"))
    s.vocab_size = std::max<int64_t>(as_int64(*v).value_or(0), 0);
  if (const json* v = field(info, "context_window"))
    s.context_window = std::max<int64_t>(as_int64(*v).value_or(0), 0);
  if (const std::string* f = str_at(info, "family")) s.family = *f;
  return s;
}

std::string completion_request_error(const json& body, bool chat, const ServedLimits& served) {
  if (!body.is_object()) return "the request body must be a JSON object";
  if (!chat && is_dsv4(served))
    return "'prompt' is not supported by this decoder: mlx-vlm serves /v1/chat/completions "
           "only; send 'messages' there";
  for (const FieldRule& r : kFieldRules) {
    if (!applies(r.where, chat)) continue;
    auto it = body.find(r.name);
    const bool present = it != body.end();
    if (!present || it->is_null()) {
      const bool refused =
          present ? r.presence != Presence::kOptional : r.presence == Presence::kRequired;
      if (refused) return r.check(json(), r.name, served);  // null fails every shape
      continue;
    }
    if (std::string why = r.check(*it, r.name, served); !why.empty()) return why;
  }
  return number_error(body, served);
}

std::string completion_request_error(const json& body, bool chat) {
  return completion_request_error(body, chat, ServedLimits{});
}

std::string completion_length_error(const json& body, int64_t prompt_tokens,
                                    const ServedLimits& served) {
  const char* name = field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  const json* v = field(body, name);
  const int64_t window = served.context_window;
  if (!v || window <= 0) return "";
  const std::optional<int64_t> n = as_int64(*v);
  if (!n || *n < 1) return q(name) + " must be a positive integer";
  const int64_t prompt = std::max<int64_t>(prompt_tokens, 0);
  if (*n <= window && prompt <= window - *n) return "";
  return "the prompt has " + std::to_string(prompt) + " tokens and " + q(name) + " asks for " +
         std::to_string(*n) + " more; the context window is " + std::to_string(window) +
         " tokens, so at most " + std::to_string(std::max<int64_t>(window - prompt, 0)) +
         " can follow this prompt";
}

json forwarded_completion_body(const json& body, bool chat, const ServedLimits& served) {
  json out = json::object();
  const uint8_t families = family_mask(served);
  for (const Forwarded& f : kForwarded)
    if ((f.families & families) && applies(f.where, chat))
      if (const json* v = field(body, f.name)) out[f.name] = *v;
  if (out.contains("messages") && out["messages"].is_array())
    for (json& m : out["messages"]) m = forwarded_message(m);
  if (out.contains("tools") && out["tools"].is_array())
    out["tools"] = forwarded_tools(out["tools"]);
  if (out.contains("stream_options")) {
    const json* usage = field(out["stream_options"], "include_usage");
    out["stream_options"] = {{"include_usage", usage && usage->is_boolean() && usage->get<bool>()}};
  }
  for (const char* k : {"xtc_probability", "xtc_threshold"})
    if (out.contains(k) && out[k].is_number()) out[k] = out[k].get<double>();
  if (is_dsv4(served) && out.contains("max_completion_tokens")) {
    out["max_tokens"] = out["max_completion_tokens"];
    out.erase("max_completion_tokens");
  }
  const json* choice = chat ? field(body, "tool_choice") : nullptr;
  if (is_llama(served) && choice && *choice == "none") out.erase("tools");
  return out;
}

}  // namespace hetero
