// The prefill request contract: see prefill_request.h.
#include "bridge/prefill_request.h"

#include "bridge/frame_tag.h"
#include "common/auth.h"
#include "common/json_text.h"

namespace hetero {
using nlohmann::json;

json prefill_request_json(const PrefillRequest& req) {
  json body = {{"ids", req.ids}, {"fingerprint", req.fingerprint}};
  if (req.chunk_tokens > 0) body["chunk"] = req.chunk_tokens;
  if (req.start > 0) body["start"] = req.start;
  if (!req.decoder_calls.empty()) body["decoder_calls"] = req.decoder_calls;
  if (!req.decoder_batched) body["decoder_path"] = "single";
  if (!req.stream_nonce.empty()) body["stream_nonce"] = req.stream_nonce;
  if (!req.cache_salt.empty()) body["cache_salt"] = req.cache_salt;
  return body;
}

Result<PrefillRequest> parse_prefill_request(const std::string& body, int64_t vocab,
                                             const DecoderCacheLayout& layout, int64_t max_tokens) {
  auto parsed = parse_untrusted_json(body);
  if (!parsed.is_ok()) return invalid_argument("request body: " + parsed.status().message());
  json& j = parsed.value();
  if (!j.is_object()) return invalid_argument("request body must be a JSON object");
  PrefillRequest r;
  if (!j.contains("ids") || !j["ids"].is_array())
    return invalid_argument("'ids' must be an array of token ids");
  if (j["ids"].empty()) return invalid_argument("'ids' is empty: nothing to prefill");
  if (static_cast<int64_t>(j["ids"].size()) > max_tokens)
    return invalid_argument("'ids' has " + std::to_string(j["ids"].size()) +
                            " tokens, more than the limit " + std::to_string(max_tokens));
  for (size_t i = 0; i < j["ids"].size(); ++i) {
    const json& v = j["ids"][i];
    if (!v.is_number_integer())
      return invalid_argument("ids[" + std::to_string(i) + "] is not an integer");
    const int64_t id = v.get<int64_t>();
    if (id < 0 || id >= vocab)
      return invalid_argument("ids[" + std::to_string(i) + "] = " + std::to_string(id) +
                              " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    r.ids.push_back(static_cast<int32_t>(id));
  }
  if (!j.contains("fingerprint") || !j["fingerprint"].is_string())
    return invalid_argument("'fingerprint' (the decoder's) is required");
  r.fingerprint = j["fingerprint"].get<std::string>();
  if (r.fingerprint != layout.fingerprint)
    return failed_precondition("fingerprint mismatch: the decoder has " + r.fingerprint +
                               ", this prefill host's export has " + layout.fingerprint);
  if (j.contains("chunk")) {
    if (!j["chunk"].is_number_integer() || j["chunk"].get<int64_t>() <= 0)
      return invalid_argument("'chunk' must be a positive integer");
    r.chunk_tokens = j["chunk"].get<int64_t>();
  }
  if (j.contains("start")) {
    const json& v = j["start"];
    if (!v.is_number_integer() || v.get<int64_t>() < 0 ||
        v.get<int64_t>() >= static_cast<int64_t>(r.ids.size()))
      return invalid_argument("'start' must be an integer in [0, " + std::to_string(r.ids.size()) +
                              ") (the rows the decoder already holds)");
    r.start = v.get<int64_t>();
  }
  if (j.contains("stream_nonce")) {
    if (!j["stream_nonce"].is_string() || !valid_stream_nonce(j["stream_nonce"].get<std::string>()))
      return invalid_argument("'stream_nonce' must be 16 to 128 hex digits");
    r.stream_nonce = j["stream_nonce"].get<std::string>();
  }
  if (j.contains("cache_salt")) {
    const json& v = j["cache_salt"];
    if (!v.is_string() || !valid_cache_salt(v.get<std::string>()))
      return invalid_argument("'cache_salt' must be 1 to 64 lowercase hex digits");
    r.cache_salt = v.get<std::string>();
  }
  if (j.contains("decoder_path")) {
    const json& v = j["decoder_path"];
    if (!v.is_string() || (v != "batch" && v != "single"))
      return invalid_argument("'decoder_path' must be \"batch\" or \"single\"");
    r.decoder_batched = v == "batch";
  }
  if (j.contains("decoder_calls")) {
    const json& c = j["decoder_calls"];
    int64_t total = 0;
    if (!c.is_array()) return invalid_argument("'decoder_calls' must be an array of lengths");
    // A tail's calls cover its rows [start, n): the decoder runs them on its cache of the rest.
    const int64_t n = static_cast<int64_t>(r.ids.size()) - r.start;
    for (const json& v : c) {
      if (!v.is_number_integer() || v.get<int64_t>() <= 0)
        return invalid_argument("'decoder_calls' entries must be positive integers");
      if (v.get<int64_t>() > n - total)  // checked before adding: the sum cannot wrap
        return invalid_argument("'decoder_calls' cover more than the " + std::to_string(n) +
                                " ids");
      r.decoder_calls.push_back(v.get<int64_t>());
      total += r.decoder_calls.back();
    }
    if (total != n)
      return invalid_argument("'decoder_calls' cover " + std::to_string(total) + " tokens, 'ids' " +
                              (r.start > 0 ? "from 'start' " : "") + "has " + std::to_string(n));
  }
  return r;
}

}  // namespace hetero
