// `hetero verify`: one bridge for a prompt, checked against the decoder natively on the same
// ids. Starts the decoder with its seam and store (unless --attach-decoder-port names a running
// one) and an in-process prefill host with any backend `hetero prefill` takes, then:
//   1. ids = the decoder's own tokenization; B = T - 1 (the decoder keeps >= 1 token)
//   2. native: cold request (greedy, K tokens); the decoder's own cache for ids[:B] is dumped
//      (into the seam's dump directory, <store>/dumps; read back from the path it answers)
//   3. bridge: run_bridge (decode/bridge.h), the same function the front door calls: prefill
//      ids[:B] over POST /v1/prefill, verify, store, mount ids[:B], check
//   4. the mounted cache is dumped; the same request again, from the mounted prefix, and its
//      verdict confirmed by the decoder's usage as the front door confirms it
// and compares every array, the continuation and the decoder's own token accounting.
// Prints one JSON object; exit 0 only when all of it passes.
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "commands.h"
#include "common/compare.h"
#include "common/process.h"
#include "common/safetensors.h"
#include "common/secret.h"
#include "decode/bridge.h"
#include "prefill/backend_options.h"
#include "prefill/service.h"
#include "stack.h"

namespace hetero {
namespace fs = std::filesystem;
using nlohmann::json;

Options verify_options() {
  std::vector<OptionSpec> rows = {
      {"model", "HETERO_MODEL", "models/smollm2-135m-instruct",
       "the decoder's checkpoint directory"},
      {"prefill-model", "", "",
       "the prefill host's checkpoint (default: --model; deepseek_v4: the official FP8 "
       "layout the decoder's variant was converted from)"},
      {"weights", "HETERO_DECODER_WEIGHTS", "",
       "decoder-weights export (default: exported into the work dir from the decoder)"},
      {"prompt-file", "", "", "plain text (one user message) or a JSON chat/completion request"},
      {"max-tokens", "", "64", "greedy tokens to compare"},
      {"python", "HETERO_PYTHON", ".venv/bin/python", "interpreter with the pinned decoder"},
      {"attach-decoder-port", "", "0",
       "use the decoder seam already running on this port (0: start one); its prompt cache is "
       "cleared"},
      {"work-dir", "", "", "where logs, dumps and the store go (default: a temp dir)"},
      {"max-ulp", "", "0", "allowed bf16 ULP distance of the cache arrays (0: bit-exact)"},
      {"min-cosine", "", "-2", "cosine floor of the cache arrays (-2: off)"},
      {"reason", "", "", "why a tolerance looser than bit-exact is allowed (required then)"},
      {"timeout-ms", "", "1800000", "deadline for each decoder or prefill call"},
      secret_file_option("the decoder seam's shared secret: given to the decoder verify starts "
                         "(and its own prefill host), or the one the attached decoder requires"),
  };
  // The in-process prefill host takes every backend option `hetero prefill` does.
  for (OptionSpec& s : prefill_backend_specs()) rows.push_back(std::move(s));
  return Options("verify",
                 "One bridge vs the decoder natively on the same ids: every cache array, the "
                 "greedy continuation and the decoder's own count of prompt tokens processed.",
                 std::move(rows));
}

namespace {

// The request body the client would send, and the endpoint it goes to.
Result<std::pair<std::string, json>> load_prompt(const std::string& path) {
  std::ifstream in(path);
  if (!in) return not_found("cannot read prompt file " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  if (text.find_first_not_of(" \t\r\n") == std::string::npos)
    return invalid_argument("prompt file " + path + " is empty");
  json j = json::parse(text, nullptr, false);
  if (!j.is_discarded() && j.is_object()) {
    if (j.contains("messages")) return std::make_pair(std::string("/v1/chat/completions"), j);
    if (j.contains("prompt")) return std::make_pair(std::string("/v1/completions"), j);
    return invalid_argument(path + ": a JSON prompt needs 'messages' or 'prompt'");
  }
  json chat = {{"messages", json::array({{{"role", "user"}, {"content", text}}})}};
  return std::make_pair(std::string("/v1/chat/completions"), chat);
}

struct Answer {
  std::string text;
  std::vector<std::string> tokens;  // per generated token: its id, or its text (mlx-vlm)
  int64_t prompt_tokens = -1, cached_tokens = -1;
  double ms = 0;
};

// secret: the stack's (the decoder's port takes only signed requests when it has one).
Result<Answer> ask(int port, const std::string& endpoint, json body, int64_t max_tokens,
                   int64_t timeout_ms, const std::string& secret) {
  body["max_tokens"] = max_tokens;
  body["temperature"] = 0.0;
  body["stream"] = false;
  body["logprobs"] = true;
  const auto t0 = std::chrono::steady_clock::now();
  HETERO_ASSIGN_OR_RETURN(json r,
                          http_json_ok("127.0.0.1", port, endpoint, body, timeout_ms, secret));
  Answer a;
  a.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  try {
    const json& c = r.at("choices").at(0);
    a.text = c.contains("message") ? c["message"].value("content", json("")).is_string()
                                         ? c["message"]["content"].get<std::string>()
                                         : ""
                                   : c.value("text", "");
    if (c.contains("logprobs") && c["logprobs"].is_object())
      for (const auto& t : c["logprobs"]["content"]) {
        if (t.contains("id"))
          a.tokens.push_back(std::to_string(t["id"].get<int64_t>()));
        else if (t.contains("token") && t["token"].is_string())
          a.tokens.push_back(t["token"].get<std::string>());
      }
    a.prompt_tokens = r.at("usage").at("prompt_tokens").get<int64_t>();
    if (r["usage"].contains("prompt_tokens_details"))
      a.cached_tokens = r["usage"]["prompt_tokens_details"].value("cached_tokens", int64_t{-1});
  } catch (const json::exception& e) {
    return data_loss(std::string("unexpected decoder reply: ") + e.what());
  }
  return a;
}

int fail(const std::string& what, const Status& st) {
  json j = {
      {"pass", false},
      {"error", {{"stage", what}, {"code", code_name(st.code())}, {"message", st.message()}}}};
  std::printf("%s\n", j.dump(2).c_str());
  return st.code() == Code::kInvalidArgument || st.code() == Code::kNotFound ? 2 : 1;
}

}  // namespace

int cmd_verify(int argc, char** argv) {
  Options opts = verify_options();
  if (int rc = parse_options(opts, argc, argv); rc >= 0) return rc;
  if (!opts.has("prompt-file"))
    return std::fprintf(stderr, "verify: --prompt-file is required\n"), 2;
  auto max_new = opts.get_int("max-tokens");
  auto max_ulp = opts.get_int("max-ulp");
  auto min_cos = opts.get_double("min-cosine");
  auto timeout = opts.get_int("timeout-ms");
  auto dport = opts.get_int("attach-decoder-port");
  auto parsed = prefill_backend_from(opts);
  for (const Status& s : {max_new.status(), max_ulp.status(), min_cos.status(), timeout.status(),
                          dport.status(), parsed.status()})
    if (!s.is_ok()) return fail("options", s);
  if (max_new.value() <= 0)
    return fail("options", invalid_argument("--max-tokens must be positive"));
  const PrefillBackend& backend = parsed->backend;
  const int64_t tmo = timeout.value();
  const std::string model = resolve_path(opts.get("model"));
  if (!fs::exists(fs::path(model) / "config.json"))
    return fail("options", not_found("no model at " + model + " (run: make up)"));
  auto prompt = load_prompt(opts.get("prompt-file"));
  if (!prompt.is_ok()) return fail("prompt", prompt.status());

  std::string work = opts.get("work-dir");
  if (work.empty()) {
    char tmpl[] = "/tmp/hetero-verify-XXXXXX";
    work = mkdtemp(tmpl);
  }
  fs::create_directories(work);
  const std::string python = resolve_path(opts.get("python"));
  std::string secret_file = opts.get("secret-file");
  if (!secret_file.empty()) secret_file = fs::absolute(secret_file).string();
  auto secret = read_secret_file(secret_file);
  if (!secret.is_ok()) return fail("options", secret.status());

  // The decoder, with its seam and a store, as `hetero up` starts it.
  ChildProcess decoder;
  int port = static_cast<int>(dport.value());
  const bool attached = port != 0;
  const std::string log = work + "/decoder.log";
  if (!attached) {
    port = free_port();
    fs::create_directories(work + "/store");
    if (Status st = start_decoder(&decoder, python, model, port, work + "/store", log, secret_file);
        !st.is_ok())
      return fail("decoder", st);
  }
  if (Status st = wait_http_ok(port, "/hetero/info", attached ? nullptr : &decoder, 300000, log,
                               secret.value());
      !st.is_ok())
    return fail("decoder", st);
  const SeamClient seam("127.0.0.1", port, tmo, secret.value());
  auto info = seam.info();
  if (!info.is_ok()) return fail("decoder info", info.status());
  if (!info->contains("store") || !(*info)["store"].is_string())
    return fail("decoder", failed_precondition("the decoder seam on port " + std::to_string(port) +
                                               " has no store to mount from (start it with "
                                               "--store)"));
  const std::string store = (*info)["store"].get<std::string>();

  // The decoder's exported weights for the cache program.
  std::string weights_dir = resolve_path(opts.get("weights"));
  if (weights_dir.empty()) {
    weights_dir = work + "/decoder-weights";
    if (Status st = export_decoder_weights(python, model, weights_dir, work + "/export.log");
        !st.is_ok())
      return fail("decoder weights", st);
  }
  const std::string prefill_model =
      opts.has("prefill-model") ? resolve_path(opts.get("prefill-model")) : model;
  auto stack = load_prefill_stack(prefill_model, weights_dir, backend);
  if (!stack.is_ok()) return fail("prefill host", stack.status());
  const int64_t chunk = parsed->chunk_tokens > 0 ? parsed->chunk_tokens : stack->default_chunk;
  PrefillService service(stack->engine.get(), stack->layout, stack->programs, chunk,
                         machine_max_tokens(stack.value(), backend));
  configure_service(&service, stack.value(), backend);
  service.set_secret(secret.value());
  if (Status st = service.start("127.0.0.1", 0); !st.is_ok()) return fail("prefill host", st);
  const std::string endpoint = prompt.value().first;
  json request = prompt.value().second;
  // A decoder that requires the exact served name in requests says so in its info.
  if (info.value().contains("forward_model") && info.value()["forward_model"].is_string())
    request["model"] = info.value()["forward_model"];
  auto tok = seam.call("/hetero/tokenize", request);
  if (!tok.is_ok()) return fail("tokenize", tok.status());
  std::vector<int32_t> ids = tok.value()["ids"].get<std::vector<int32_t>>();
  const int64_t T = static_cast<int64_t>(ids.size());
  if (T < 2)
    return fail("tokenize", invalid_argument("the prompt has " + std::to_string(T) +
                                             " token(s); a bridge needs at least 2"));
  const int64_t B = T - 1;

  // Native leg: cold.
  if (auto c = seam.call("/hetero/clear", json::object()); !c.is_ok())
    return fail("clear", c.status());
  auto native = ask(port, endpoint, request, max_new.value(), tmo, secret.value());
  if (!native.is_ok()) return fail("native request", native.status());
  // mlx-lm's single path (a request with "seed") stores its cache only after the reply has gone
  // out: wait (a minute at most) until the decoder holds ids[:B]; the dump says what it covers.
  for (const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
       std::chrono::steady_clock::now() < until;
       std::this_thread::sleep_for(std::chrono::milliseconds(50))) {
    auto held = seam.call("/hetero/cached_prefix", {{"ids", ids}});
    if (held.is_ok() && held.value().value("cached_tokens", int64_t{0}) >= B) break;
  }
  // The decoder's own cache for ids[:B], written by the seam into its dump directory under a
  // name of this run's own (an attached decoder's may hold others'); its path comes back.
  auto dump = [&](const std::string& leg) -> Result<std::string> {
    const std::string name = "verify-" + std::to_string(getpid()) + "-" + leg + ".safetensors";
    HETERO_ASSIGN_OR_RETURN(json r,
                            seam.call("/hetero/cache", {{"ids", ids}, {"B", B}, {"out", name}}));
    if (!r.contains("path") || !r["path"].is_string())
      return data_loss("/hetero/cache answered without a path");
    return r["path"].get<std::string>();
  };
  auto native_dump = dump("native");
  if (!native_dump.is_ok()) return fail("native cache dump", native_dump.status());
  if (auto c = seam.call("/hetero/clear", json::object()); !c.is_ok())
    return fail("clear", c.status());

  // Bridged leg: the decode side's own bridge, as the front door runs it.
  BridgeParams params;
  params.prefill_port = service.bound_port();
  params.store_dir = store;
  params.chunk_tokens = parsed->chunk_tokens;
  params.partial_min_fraction = 1.0;  // verify checks whole prefixes only
  params.stall_ms = params.deadline_ms = tmo;
  params.secret = secret.value();
  take_decoder_calls(tok.value(), &params);  // as it was asked: from a cold cache
  BridgeOutcome bridged_leg = run_bridge(seam, info.value(), ids, /*decoder_cached=*/0, params);
  const FetchResult& fetched = bridged_leg.fetch;
  if (bridged_leg.verdict.kind != VerdictKind::kComplete)
    return fail("bridge", data_loss(bridged_leg.verdict.label()));
  auto layout_or = layout_from_json(info.value());
  if (!layout_or.is_ok()) return fail("decoder info", layout_or.status());
  const DecoderCacheLayout layout = layout_or.value();
  auto mounted_dump = dump("mounted");
  if (!mounted_dump.is_ok()) return fail("mounted cache dump", mounted_dump.status());
  auto bridged = ask(port, endpoint, request, max_new.value(), tmo, secret.value());
  seam.unpin(bridged_leg.pin);
  if (!bridged.is_ok()) return fail("bridged request", bridged.status());
  const Verdict verdict =
      confirm_verdict(bridged_leg.verdict, {bridged->cached_tokens >= 0, bridged->cached_tokens,
                                            "the decoder's reply carried no cached_tokens"});

  // Compare: every array, the continuation, the accounting.
  auto want = read_safetensors(native_dump.value());
  auto got = read_safetensors(mounted_dump.value());
  if (attached) {  // an attached decoder's store is not ours to fill; a started one's is
    std::error_code ec;
    fs::remove(native_dump.value(), ec);
    fs::remove(mounted_dump.value(), ec);
  }
  if (!want.is_ok() || !got.is_ok())
    return fail("read dumps", want.is_ok() ? got.status() : want.status());
  CompareSpec spec;
  spec.max_ulp = max_ulp.value();
  spec.min_cosine = min_cos.value();
  spec.reason = opts.get("reason");
  if (spec.max_ulp == 0 && spec.min_cosine <= -2) {
    spec.reason = "bit-exact: engine and program reproduce the decoder's arithmetic";
  } else if (spec.reason.empty()) {
    return fail("options", invalid_argument("a tolerance looser than bit-exact needs --reason"));
  }
  json per_layer = json::array(), failures = json::array();
  int64_t worst_ulp = 0, exact = 0, numel = 0, equal = 0;  // equal: elements with identical bits
  double min_eq = 1.0, min_cosine = 1.0;
  // Every array of the decoder's own dump, whatever the family's layout.
  std::map<int64_t, json> rows;
  for (const auto& [name, wt] : want->tensors) {
    auto gi = got->tensors.find(name);
    if (gi == got->tensors.end()) {
      failures.push_back(name + " missing from the mounted cache");
      continue;
    }
    CompareReport r = compare_tensors(gi->second, wt, spec);
    int64_t layer = -1;
    std::string kind = name;
    if (std::sscanf(name.c_str(), "layers.%lld.", reinterpret_cast<long long*>(&layer)) == 1)
      kind = name.substr(name.find('.', 7) + 1);
    json& row = rows[layer];
    row["layer"] = layer;
    row[kind] = {
        {"max_ulp", r.max_ulp}, {"equal_fraction", r.equal_fraction}, {"cosine", r.cosine}};
    worst_ulp = std::max(worst_ulp, r.max_ulp);
    min_eq = std::min(min_eq, r.equal_fraction);
    min_cosine = std::min(min_cosine, r.cosine);
    numel += r.numel;
    equal += std::llround(r.equal_fraction * static_cast<double>(r.numel));
    if (r.equal_fraction == 1.0) ++exact;
    if (!r.pass) failures.push_back(name + ": " + r.message);
  }
  for (auto& [layer, row] : rows) per_layer.push_back(row);
  if (got->metadata.count("window_idx") || want->metadata.count("window_idx")) {
    const std::string a = want->metadata.count("window_idx") ? want->metadata["window_idx"] : "-";
    const std::string b = got->metadata.count("window_idx") ? got->metadata["window_idx"] : "-";
    if (a != b) failures.push_back("window_idx: native " + a + ", mounted " + b);
  }
  const bool same_text = native->text == bridged->text;
  const bool same_tokens = native->tokens == bridged->tokens;
  int64_t diverge = -1;
  for (size_t i = 0; i < std::max(native->tokens.size(), bridged->tokens.size()); ++i)
    if (i >= native->tokens.size() || i >= bridged->tokens.size() ||
        native->tokens[i] != bridged->tokens[i]) {
      diverge = static_cast<int64_t>(i);
      break;
    }
  if (!same_tokens || !same_text)
    failures.push_back("continuation differs at token " + std::to_string(diverge));
  const int64_t processed = bridged->prompt_tokens - bridged->cached_tokens;
  if (verdict.kind != VerdictKind::kComplete)
    failures.push_back("confirmed verdict: " + verdict.label());
  if (bridged->cached_tokens != B || processed != T - B)
    failures.push_back("decoder reports cached_tokens=" + std::to_string(bridged->cached_tokens) +
                       ", expected B=" + std::to_string(B));
  if (native->cached_tokens != 0)
    failures.push_back("native leg was not cold: cached_tokens=" +
                       std::to_string(native->cached_tokens));

  json out = {
      {"pass", failures.empty()},
      {"model", model},
      {"prefill_model", prefill_model},
      {"prefill_backend",
       {{"name", backend.name},
        {"arith", backend.name == "cuda" ? backend.arith : "ordered"},
        {"kv_dtype", backend.name == "cuda" && backend.arith == "fast" ? backend.kv_dtype : "-"},
        {"attention", backend.name == "cuda" && backend.arith == "fast" ? backend.attention : "-"},
        {"weights", backend.name == "cuda" && backend.arith == "fast" ? backend.weights : "-"},
        {"device", backend.name == "cuda" ? backend.device : -1},
        {"program_device", backend.name == "cuda" ? backend.program_device : -1},
        {"gpus", backend.gpus}}},
      {"family", layout.family},
      {"fingerprint", layout.fingerprint},
      {"T", T},
      {"B", B},
      {"chunk", chunk},
      {"verdict", verdict.to_json()},
      {"arrays",
       {{"count", static_cast<int64_t>(want->tensors.size())},
        {"bit_exact", exact},
        {"max_ulp", worst_ulp},
        {"min_equal_fraction", min_eq},
        {"elements", numel},
        {"equal_fraction", numel > 0 ? static_cast<double>(equal) / numel : 1.0},
        {"min_cosine", min_cosine},
        {"tolerance",
         {{"max_ulp", spec.max_ulp}, {"min_cosine", spec.min_cosine}, {"reason", spec.reason}}},
        {"per_layer", per_layer}}},
      {"continuation",
       {{"tokens", max_new.value()},
        {"identical", same_text && same_tokens},
        {"diverges_at", diverge},
        {"native", native->text},
        {"bridged", bridged->text}}},
      {"decoder_accounting",
       {{"native",
         {{"prompt_tokens", native->prompt_tokens}, {"cached_tokens", native->cached_tokens}}},
        {"bridged",
         {{"prompt_tokens", bridged->prompt_tokens},
          {"cached_tokens", bridged->cached_tokens},
          {"processed", processed}}}}},
      {"timings_ms",
       {{"native_request", native->ms},
        {"bridge_prefill", fetched.total_ms},
        {"first_segment", fetched.first_segment_ms},
        {"last_segment", fetched.last_segment_ms},
        {"bridged_request", bridged->ms}}},
      {"bytes", fetched.bytes},
      {"work_dir", work},
      {"dumps", attached
                    ? json()
                    : json{{"native", native_dump.value()}, {"mounted", mounted_dump.value()}}},
      {"failures", failures},
  };
  std::printf("%s\n", out.dump(2).c_str());
  service.stop();
  decoder.stop();
  return failures.empty() ? 0 : 1;
}

}  // namespace hetero
