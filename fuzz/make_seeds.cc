// Writes the fuzz targets' seed corpora (<root>/<target>/, `make fuzz`: build-fuzz/seeds):
// well-formed inputs of each kind, from the project's own writers, for libFuzzer to mutate.
// Written afresh by every `make fuzz`, so they follow the formats, into an ignored directory:
// a tagged frame's salt is random, and a tracked corpus would change with every test run. What
// fuzz/corpus/<target>/ holds is committed by hand: inputs that found a bug (regressions).
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "bridge/prefill_request.h"
#include "bridge/wire.h"
#include "common/auth.h"
#include "common/safetensors.h"
#include "fuzz_inputs.h"
#include "fuzz_layouts.h"

namespace fs = std::filesystem;
using namespace hetero;

namespace {

void put(const fs::path& dir, const std::string& name, const std::string& bytes) {
  fs::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary) << bytes;
}

// A llama segment of rows [pos0, pos0 + n) in fuzz::llama_layout's shapes.
Segment llama_segment(int64_t seq, int64_t pos0, int64_t n) {
  const DecoderCacheLayout l = fuzz::llama_layout();
  Segment s;
  s.seq = seq, s.family = l.family, s.fingerprint = l.fingerprint, s.pos0 = pos0, s.n_tokens = n;
  for (int64_t layer = 0; layer < l.layers; ++layer)
    for (const char* kind : {".keys", ".values"}) {
      Tensor t(DType::kBF16, {l.kv_heads, n, l.head_dim});
      for (int64_t i = 0; i < t.numel(); ++i) t.data<uint16_t>()[i] = static_cast<uint16_t>(i);
      s.arrays.push_back({"layers." + std::to_string(layer) + kind, std::move(t)});
    }
  return s;
}

// The auth target's seeds: signed requests (checked as they are, and re-signed by the target),
// a bearer token, and headers that are nearly right.
void auth_seeds(const fs::path& dir) {
  const std::string body = prefill_request_json({.ids = {1, 2, 3}, .fingerprint = "fp"}).dump();
  // Each its own nonce, so that each passes once (the target's verifier lives across inputs).
  char nonce_digit = '0';
  const auto sign = [&](std::string_view m, std::string_view t, std::string_view b, int64_t at) {
    return signed_authorization_at(fuzz::kAuthSecret, m, t, b, at,
                                   std::string(31, 'a') + nonce_digit++);
  };
  const int64_t now = fuzz::kAuthNowS;
  put(dir, "signed-post",
      fuzz::auth_input(true, 64, sign("POST", "/v1/prefill", body, now), "POST", "/v1/prefill",
                       body));
  put(dir, "signed-get-early",
      fuzz::auth_input(true, 0, sign("GET", "/health", "", now - 300), "GET", "/health", ""));
  put(dir, "signed-late",
      fuzz::auth_input(true, 127, sign("POST", "/v1/prefill", body, now + 301), "POST",
                       "/v1/prefill", body));
  put(dir, "signed-other-body",
      fuzz::auth_input(false, 64, sign("POST", "/v1/prefill", "{}", now), "POST", "/v1/prefill",
                       body));
  put(dir, "bearer",
      fuzz::auth_input(false, 64, "Bearer sk-0123456789abcdef", "POST", "/v1/chat/completions",
                       "0123456789abcdef"));
  put(dir, "bad-fields",
      fuzz::auth_input(true, 64,
                       "Hetero-HMAC-SHA256 t=1700000000,n=00112233445566778899"
                       "aabbccddeeff, s=" +
                           std::string(64, 'A'),
                       "POST", "/v1/prefill", body));
  put(dir, "long-time",
      fuzz::auth_input(false, 64,
                       "Hetero-HMAC-SHA256 t=1234567890123, n=" + std::string(fuzz::kNonce) +
                           ", s=" + std::string(64, '0'),
                       "GET", "/", ""));
}

// The http_server target's seeds (byte 0: the pieces, fuzz_inputs.h): requests each route
// answers, kept-alive pairs, 100-continue, a signed request, and the ones it must refuse.
void http_server_seeds(const fs::path& dir) {
  const std::string echo = "POST /echo HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nhello";
  const std::string chunked =
      "POST /echo HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
      "5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n";
  const std::string health = "GET /health HTTP/1.1\r\nHost: h\r\n\r\n";
  const std::string close = "Connection: close\r\n";
  const std::string body = R"({"ids":[1,2,3],"fingerprint":"fp"})";
  put(dir, "health",
      fuzz::http_input(1, false, "GET /health HTTP/1.1\r\nHost: h\r\n" + close + "\r\n"));
  put(dir, "keep-alive-pair", fuzz::http_input(2, true, health + echo));
  put(dir, "echo-bytewise", fuzz::http_input(4, true, echo));
  put(dir, "chunked-then-stream",
      fuzz::http_input(3, false,
                       chunked + "POST /stream HTTP/1.1\r\nHost: h\r\nContent-Length: 11\r\n" +
                           close + "\r\nhello world"));
  put(dir, "stream-chunked",
      fuzz::http_input(1, false,
                       "POST /stream HTTP/1.1\r\nHost: h\r\n"
                       "Transfer-Encoding: chunked\r\n\r\n"
                       "3\r\nabc\r\n0\r\n\r\n"));
  put(dir, "expect-100-continue",
      fuzz::http_input(2, true,
                       "POST /echo HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\n"
                       "Content-Length: 4\r\n\r\nabcd"));
  put(dir, "signed",
      fuzz::http_input(1, false,
                       "POST /echo HTTP/1.1\r\nHost: h\r\nAuthorization: " +
                           signed_authorization_at(fuzz::kAuthSecret, "POST", "/echo", body,
                                                   fuzz::kAuthNowS, fuzz::kNonce) +
                           "\r\nContent-Type: application/json\r\nContent-Length: " +
                           std::to_string(body.size()) + "\r\n\r\n" + body));
  put(dir, "denied-before-body",
      fuzz::http_input(1, false,
                       "POST /echo HTTP/1.1\r\nHost: h\r\nX-Deny: 1\r\n"
                       "Content-Length: 5\r\n\r\nhello"));
  put(dir, "denied-after-body",
      fuzz::http_input(1, false,
                       "POST /echo HTTP/1.1\r\nHost: h\r\n"
                       "X-Deny-Whole: 1\r\nContent-Length: 5\r\n\r\n"
                       "hello" +
                           health));
  put(dir, "oversize-headers",
      fuzz::http_input(
          2, false,
          "GET /health HTTP/1.1\r\nHost: h\r\nX-Big: " + std::string(5000, 'a') + "\r\n\r\n"));
  put(dir, "many-header-lines", [&] {
    std::string r = "GET /health HTTP/1.1\r\n";
    for (int i = 0; i < 400; ++i) r += "X-" + std::to_string(i) + ": v\r\n";
    return fuzz::http_input(1, false, r + "\r\n");
  }());
  put(dir, "bad-chunk-size",
      fuzz::http_input(1, false,
                       "POST /echo HTTP/1.1\r\nHost: h\r\n"
                       "Transfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n"
                       "0\r\n\r\n"));
  put(dir, "huge-chunk-size",
      fuzz::http_input(2, false,
                       "POST /echo HTTP/1.1\r\nHost: h\r\n"
                       "Transfer-Encoding: chunked\r\n\r\n"
                       "ffffffffffffffffff\r\nab\r\n0\r\n\r\n"));
  put(dir, "chunks-past-limit",
      fuzz::http_input(1, false,
                       "POST /echo HTTP/1.1\r\nHost: h\r\n"
                       "Transfer-Encoding: chunked\r\n\r\n"
                       "800\r\n" +
                           std::string(2048, 'x') + "\r\n801\r\n" + std::string(2049, 'y') +
                           "\r\n0\r\n\r\n"));
  put(dir, "length-past-limit",
      fuzz::http_input(1, false,
                       "POST /echo HTTP/1.1\r\nHost: h\r\n"
                       "Content-Length: 4097\r\n\r\nabc"));
  put(dir, "unknown-and-wrong-method",
      fuzz::http_input(1, false,
                       "GET /nowhere?x=1 HTTP/1.1\r\nHost: h\r\n\r\n"
                       "GET /echo HTTP/1.1\r\nHost: h\r\n\r\n"));
  put(dir, "http10-head",
      fuzz::http_input(1, false,
                       "HEAD /health HTTP/1.0\r\n\r\n"
                       "GET /health HTTP/1.0\r\nConnection: keep-alive\r\n"
                       "\r\n"));
  put(dir, "truncated", fuzz::http_input(1, false, "POST /echo HTTP/1.1\r\nContent-Len"));
}

}  // namespace

int main(int argc, char** argv) {
  const fs::path root = argc > 1 ? argv[1] : "build-fuzz/seeds";
  const int64_t T = fuzz::kRequestedTokens;
  const std::string whole = encode_segment(llama_segment(0, 0, 16)) +
                            encode_segment(llama_segment(1, 16, T - 16)) +
                            encode_manifest({"fp", T, T, 2, true, "", "exact"});
  const std::string broken = encode_segment(llama_segment(0, 0, 16)) +
                             encode_manifest({"fp", T, 16, 1, false, "engine failed", "exact"});
  // The first byte: bit 0 the family (llama 0), bit 1 tagged frames, the rest the piece length.
  put(root / "wire", "llama-whole-bytewise", std::string(1, '\x00') + whole);
  put(root / "wire", "llama-whole-8", std::string(1, '\x1c') + whole);
  put(root / "wire", "llama-ended-early", std::string(1, '\x3c') + broken);
  put(root / "wire", "dsv4-manifest-only",
      std::string(1, '\x01') + encode_manifest({"fp", T, 0, 0, false, "refused", "fast"}));
  // The whole stream as a host holding the secret sends it: each frame, then its salt and tag
  // (the salts are random: the seed differs each time it is made).
  const FrameTagger tagger(fuzz::kSecret, fuzz::kNonce);
  std::string tagged;
  uint64_t index = 0;
  for (std::string f : {encode_segment(llama_segment(0, 0, 16), nullptr, &tagger),
                        encode_segment(llama_segment(1, 16, T - 16), nullptr, &tagger),
                        encode_manifest({"fp", T, T, 2, true, "", "exact"}, &tagger)}) {
    tagger.seal(index++, &f);
    tagged += f;
  }
  put(root / "wire", "llama-whole-tagged-8", std::string(1, '\x1e') + tagged);

  put(root / "prefill_request", "plain",
      prefill_request_json({.ids = {1, 2, 3}, .fingerprint = "fp"}).dump());
  put(root / "prefill_request", "scheduled",
      prefill_request_json({.ids = {5, 6, 7, 8},
                            .fingerprint = "fp",
                            .chunk_tokens = 2,
                            .decoder_calls = {3, 1},
                            .stream_nonce = fuzz::kNonce})
          .dump());
  put(root / "prefill_request", "wrong-fingerprint", R"({"ids":[1],"fingerprint":"other"})");
  put(root / "prefill_request", "cache-salt",
      prefill_request_json({.ids = {9, 8, 7, 6},
                            .fingerprint = "fp",
                            .stream_nonce = fuzz::kNonce,
                            .cache_salt = "0123456789abcdef0123456789abcdef",
                            .start = 2})
          .dump());

  put(root / "front_request", "chat",
      R"({"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4,)"
      R"("stream":true,"stream_options":{"include_usage":true},"temperature":0.5})");
  put(root / "front_request", "completion", R"({"prompt":"hello","max_tokens":8,"top_p":1})");
  // Bodies exactly as the official openai Python client (3.57.0) sends them, captured from the
  // wire (tests/unit/request_schema_test.cc holds the same).
  put(root / "front_request", "openai-chat",
      R"({"model":"tiny","messages":[{"role":"system","content":"You are terse."},)"
      R"({"role":"user","content":"Say hi."}],"frequency_penalty":0.2,"logit_bias":{"15":-100},)"
      R"("logprobs":true,"max_tokens":64,"n":1,"presence_penalty":0.1,"seed":42,"stop":["\n\n"],)"
      R"("temperature":0.7,"top_logprobs":3,"top_p":0.9,"user":"u1"})");
  put(root / "front_request", "openai-stream",
      R"({"model":"tiny","stream":true,"messages":[{"role":"system","content":"You are terse."},)"
      R"({"role":"user","content":"Say hi."}],"max_completion_tokens":32,)"
      R"("stream_options":{"include_usage":true}})");
  put(root / "front_request", "openai-tools",
      R"({"model":"tiny","messages":[{"role":"user","content":"Weather in Paris?"},)"
      R"({"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function",)"
      R"("function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},)"
      R"({"role":"tool","tool_call_id":"call_1","content":"sunny"}],"max_tokens":16,)"
      R"("parallel_tool_calls":false,"tool_choice":"auto","tools":[{"type":"function","function":)"
      R"({"name":"get_weather","description":"Weather for a city.","parameters":{"type":"object",)"
      R"("properties":{"city":{"type":"string"}},"required":["city"]}}}]})");
  put(root / "front_request", "openai-completion",
      R"({"model":"tiny","prompt":"Once upon a time","echo":false,"max_tokens":16,"n":1,"seed":7,)"
      R"("stop":"\n","temperature":0})");
  put(root / "front_request", "openai-extra-body",
      R"({"model":"tiny","messages":[{"role":"user","content":[{"type":"text","text":"Hi"}]}],)"
      R"("top_k":20,"min_p":0.05,"repetition_penalty":1.1,)"
      R"("chat_template_kwargs":{"enable_thinking":false}})");
  put(root / "front_request", "cache-salt",
      R"({"model":"tiny","messages":[{"role":"user","content":"hi"}],"cache_salt":"tenant-a/x"})");

  auth_seeds(root / "auth");
  http_server_seeds(root / "http_server");

  const fs::path st = fs::temp_directory_path() / "hetero-fuzz-seed.safetensors";
  TensorMap tensors;
  tensors.emplace("w", Tensor(DType::kBF16, {2, 3}));
  tensors.emplace("b", Tensor(DType::kF32, {3}));
  if (!write_safetensors(st.string(), tensors, {{"format", "pt"}}).is_ok()) return 1;
  std::ifstream in(st, std::ios::binary);
  put(root / "safetensors", "two-tensors", std::string(std::istreambuf_iterator<char>(in), {}));
  fs::remove(st);
  std::printf("seeds written under %s\n", root.c_str());
  return 0;
}
