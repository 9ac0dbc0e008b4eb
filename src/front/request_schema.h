// What a completion request must be before the front door lets it near the decoder: the
// OpenAI chat and completions schema it serves, narrowed to what the served decoder (mlx-lm for
// llama, mlx-vlm for deepseek_v4) takes without misbehaving. A value a decoder would crash on,
// hang on or silently ignore is refused here with a 400 that names the field (issue 50: a
// `stop` of [1] killed mlx-lm's generation thread and every later request failed), and the body
// the decoder gets holds only fields this file checked.
//
// Pure functions of their arguments; safe to call from any thread.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace hetero {

// What the served decoder can take. A zero or empty member is unknown (the decoder's
// /hetero/info was not read): bounds that need it then fall back to conservative constants
// (request_schema.cc) and only the checks common to both families run.
struct ServedLimits {
  int64_t vocab_size = 0;      // rows of the decoder's logits (token ids are below it)
  int64_t context_window = 0;  // tokens: prompt + completion
  std::string family;          // "llama" (mlx-lm) or "deepseek_v4" (mlx-vlm)
};

// The limits a decoder's /hetero/info reply states (vocab_size, context_window, family);
// members it lacks or gives a wrong type stay unknown.
ServedLimits served_limits(const nlohmann::json& info);

// "" when `body` is a completion request the served decoder may take (chat:
// /v1/chat/completions, else /v1/completions); else why not, naming the field (the front
// answers 400 invalid_request_error with it). Unknown fields are no error: they are dropped by
// forwarded_completion_body. A null field counts as absent, except the few the front itself
// reads (model, stream, stream_options), which must have their type.
std::string completion_request_error(const nlohmann::json& body, bool chat,
                                     const ServedLimits& served);

// Until the front passes the decoder's limits: every limit unknown.
std::string completion_request_error(const nlohmann::json& body, bool chat);

// After tokenization: "" when prompt_tokens plus the requested completion length
// (max_completion_tokens, else max_tokens; absent: fine) fit the context window, or the window
// is unknown; else why not (the front answers 400 context_length_exceeded).
std::string completion_length_error(const nlohmann::json& body, int64_t prompt_tokens,
                                    const ServedLimits& served);

// The body forwarded to the decoder, for a body completion_request_error accepted: only the
// fields the served decoder reads, every other field dropped (cache_salt, user, n, metadata,
// anything unknown, nulls), so a field the front does not check never reaches the decoder.
// Values are forwarded unchanged, except where the decoder reads the same meaning differently:
// xtc_* become floats (mlx-lm refuses an integer 0), stream_options always states
// include_usage (mlx-lm indexes it), mlx-vlm gets max_completion_tokens as max_tokens (the only
// name it reads), and for mlx-lm tool_choice "none" drops the tools. An unknown family gets the
// fields either decoder reads.
nlohmann::json forwarded_completion_body(const nlohmann::json& body, bool chat,
                                         const ServedLimits& served);

}  // namespace hetero
