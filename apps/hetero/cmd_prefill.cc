// `hetero prefill`: the prefill host. Serves POST /v1/prefill, or with --ids-file runs one
// prefill offline through the same producer, wire and verifier and writes the assembled cache.
// For a deepseek_v4 checkpoint the offline mode runs the CPU forward alone and writes each
// layer's attention input (layers.{i}.x, bf16 [T, hidden]) under --out.
#include <sys/stat.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "bridge/assembler.h"
#include "commands.h"
#include "common/http_server.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "common/secret.h"
#include "decode/prefill_client.h"
#include "engine/dsv4_cpu.h"
#include "model/dsv4.h"
#include "prefill/backend_options.h"
#include "prefill/service.h"

namespace hetero {
namespace {

// "N" (chunks of N) or "a,b,c" (then c repeated) as the chunk sizes covering T tokens.
Result<std::vector<int64_t>> chunk_schedule(const std::string& spec, int64_t T) {
  std::vector<int64_t> sizes;
  std::stringstream ss(spec);
  for (std::string item; std::getline(ss, item, ',');) {
    char* end = nullptr;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v <= 0)
      return invalid_argument(
          "--chunk must be a positive integer or a comma-separated list of them");
    sizes.push_back(v);
  }
  if (sizes.empty()) return invalid_argument("--chunk is empty");
  std::vector<int64_t> out;
  for (int64_t done = 0, i = 0; done < T; ++i) {
    const int64_t n = std::min(sizes[std::min<size_t>(i, sizes.size() - 1)], T - done);
    out.push_back(n);
    done += n;
  }
  return out;
}

// Offline DeepSeek-V4: the forward alone, its attention inputs written for comparison.
int run_dsv4_offline(const Options& opts) {
  if (!opts.has("ids-file") || !opts.has("out"))
    return std::fprintf(stderr,
                        "prefill: a deepseek_v4 model runs offline only: --ids-file and "
                        "--out are required\n"),
           2;
  std::ifstream in(opts.get("ids-file"));
  nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded() || !j.is_array() || j.empty())
    return std::fprintf(stderr, "prefill: --ids-file must hold a non-empty JSON array of ids\n"), 2;
  std::vector<int32_t> ids;
  for (auto& v : j) {
    if (!v.is_number_integer()) return std::fprintf(stderr, "prefill: ids must be integers\n"), 2;
    ids.push_back(v.get<int32_t>());
  }
  const int64_t T = static_cast<int64_t>(ids.size());
  // --chunk 0 (the default) offline: the whole prompt in one chunk.
  auto schedule =
      chunk_schedule(opts.get("chunk") == "0" ? std::to_string(T) : opts.get("chunk"), T);
  if (!schedule.is_ok())
    return std::fprintf(stderr, "prefill: %s\n", schedule.status().message().c_str()), 2;
  auto arith = parse_dsv4_quant_arith(opts.get("quant-arith"));
  if (!arith.is_ok())
    return std::fprintf(stderr, "prefill: --quant-arith: %s\n", arith.status().message().c_str()),
           2;
  Dsv4EngineOptions engine_options;
  engine_options.quant_arith = arith.value();
  auto engine = Dsv4CpuEngine::load(opts.get("model"), engine_options);
  if (!engine.is_ok())
    return std::fprintf(stderr, "prefill: %s\n", engine.status().to_string().c_str()), 1;
  std::vector<int64_t> calls;  // empty: each chunk is one decoder call
  if (opts.has("decoder-calls")) {
    auto parsed = chunk_schedule(opts.get("decoder-calls"), T);
    if (!parsed.is_ok())
      return std::fprintf(stderr, "prefill: --decoder-calls: %s\n",
                          parsed.status().message().c_str()),
             2;
    calls = std::move(parsed.value());
  }
  if (Status st = engine.value()->set_decoder_calls(calls); !st.is_ok())
    return std::fprintf(stderr, "prefill: %s\n", st.to_string().c_str()), 1;
  const Dsv4Config& c = engine.value()->config();
  TensorMap out;
  for (int64_t l = 0; l < c.layers; ++l)
    out["layers." + std::to_string(l) + ".x"] = Tensor(DType::kBF16, {T, c.hidden});
  auto tap = [&](const TapEvent& e) {
    uint16_t* dst = out["layers." + std::to_string(e.layer) + ".x"].data<uint16_t>();
    std::memcpy(dst + e.pos0 * e.hidden, e.x_bf16, static_cast<size_t>(e.n_tokens * e.hidden) * 2);
  };
  const auto t0 = std::chrono::steady_clock::now();
  int64_t done = 0;
  for (int64_t n : schedule.value()) {
    std::vector<int32_t> part(ids.begin() + done, ids.begin() + done + n);
    if (Status st = engine.value()->prefill_chunk(part, tap); !st.is_ok())
      return std::fprintf(stderr, "prefill: %s\n", st.to_string().c_str()), 2;
    done += n;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::error_code ec;
  std::filesystem::create_directories(opts.get("out"), ec);
  const std::string dir = opts.get("out");
  if (Status st = write_safetensors(dir + "/attention_inputs.safetensors", out); !st.is_ok())
    return std::fprintf(stderr, "prefill: %s\n", st.to_string().c_str()), 1;
  nlohmann::json info = {{"model_type", c.model_type},
                         {"T", T},
                         {"layers", c.layers},
                         {"hidden", c.hidden},
                         {"schedule", schedule.value()},
                         {"decoder_calls", calls},
                         {"quant_arith", dsv4_quant_arith_name(arith.value())},
                         {"seconds", secs}};
  std::ofstream(dir + "/prefill.json") << info.dump(1) << "\n";
  std::printf("%s\n", info.dump().c_str());
  return 0;
}

}  // namespace

Options prefill_options() {
  std::vector<OptionSpec> rows = {
      {"model", "HETERO_PREFILL_MODEL", "", "HF checkpoint directory of the model to prefill"},
      {"weights", "HETERO_DECODER_WEIGHTS", "",
       "decoder-weights export (python -m hetero_mlx export)"},
      {"host", "HETERO_PREFILL_LISTEN_HOST", "127.0.0.1", "address to listen on"},
      {"port", "HETERO_PREFILL_PORT", "8010", "port to listen on (0: any free port)"},
      {"max-tokens", "HETERO_PREFILL_MAX_TOKENS", "0",
       "longest accepted prompt (0: what the machine holds: 2097152, or for the CPU llama "
       "engine half the host's available memory's worth of its cache)"},
      {"quant-arith",
       "HETERO_PREFILL_QUANT_ARITH",
       "mlx-cpu",
       "deepseek_v4, offline: how FP8/FP4 projections are computed. mlx-cpu: as the native "
       "decoder (mxfp8/mxfp4 on MLX's CPU backend, bf16 sums; bf16 ape); dequant: "
       "dequantized bf16 weights, float32 sums (a decoder on a dense bf16 conversion)",
       false,
       {"mlx-cpu", "dequant"}},
      {"fault", "HETERO_PREFILL_FAULT", "",
       "fault injection for tests: exit-after:N, stall-after:N, truncate-after:N, corrupt:N, "
       "gap:N, wrong-t, refuse-memory"},
      {"ids-file", "", "", "offline: JSON array of token ids to prefill instead of serving"},
      {"fingerprint", "", "", "offline: the decoder fingerprint to require (default: export's)"},
      {"decoder-calls", "", "",
       "offline: the decoder's call lengths a,b,c for the ids (deepseek_v4: the last repeated; "
       "required with --weights; without, --chunk's chunks may then span several calls; llama: "
       "all of them, for a dynamic rope past max_position_embeddings)"},
      {"decoder-path",
       "",
       "batch",
       "offline, llama: the decoder's prefill path the calls are on (batch: mlx-lm server's "
       "batch generator; single: a request with a seed)",
       false,
       {"batch", "single"}},
      {"out", "", "",
       "offline: where to write the assembled cache (safetensors); for deepseek_v4 without "
       "--weights a directory for the attention inputs (--chunk may then be a list a,b,c, the "
       "last repeated)"},
      secret_file_option("the stack's shared secret (hetero up writes one): POST /v1/prefill "
                         "requires it as a bearer token; none: open"),
  };
  for (OptionSpec& s : connection_options()) rows.push_back(std::move(s));
  for (OptionSpec& s : prefill_backend_specs()) rows.push_back(std::move(s));
  return Options("prefill",
                 "The prefill engine (CPU or CUDA backend): chunked prefill with the "
                 "attention-input tap feeding the decoder-cache program; segments stream back "
                 "while it runs.",
                 std::move(rows));
}

int cmd_prefill(int argc, char** argv) {
  ::umask(077);  // what it writes (attention inputs, logs) holds prompts: the user's alone
  Options opts = prefill_options();
  if (int rc = parse_options(opts, argc, argv); rc >= 0) return rc;
  if (opts.has("model") && is_dsv4_checkpoint(opts.get("model")) && !opts.has("weights")) {
    // No decoder export: the forward alone, writing each layer's attention input.
    log_line("prefill", "options " + opts.effective().dump());
    return run_dsv4_offline(opts);
  }
  if (!opts.has("model") || !opts.has("weights")) {
    std::fprintf(stderr, "prefill: --model and --weights are required\n");
    return 2;
  }
  log_line("prefill", "options " + opts.effective().dump());
  auto parsed = prefill_backend_from(opts);
  if (!parsed.is_ok())
    return std::fprintf(stderr, "prefill: %s\n", parsed.status().message().c_str()), 2;
  const PrefillBackend& backend = parsed->backend;
  auto stack = load_prefill_stack(opts.get("model"), opts.get("weights"), backend);
  if (!stack.is_ok())
    return std::fprintf(stderr, "prefill: %s\n", stack.status().to_string().c_str()), 1;
  const DecoderCacheLayout layout = stack->layout;
  const int64_t chunk = parsed->chunk_tokens > 0 ? parsed->chunk_tokens : stack->default_chunk;
  auto max_tokens = opts.get_int("max-tokens");
  if (!max_tokens.is_ok() || max_tokens.value() < 0)
    return std::fprintf(stderr, "prefill: --max-tokens must be an integer >= 0\n"), 2;
  if (max_tokens.value() == 0) {
    max_tokens = machine_max_tokens(stack.value(), backend);
    log_line("prefill", "longest prompt: " + std::to_string(max_tokens.value()) + " tokens");
  }
  PrefillService service(stack->engine.get(), layout, stack->programs, chunk, max_tokens.value());
  configure_service(&service, stack.value(), backend);
  auto fault = parse_fault(opts.get("fault"));
  if (!fault.is_ok())
    return std::fprintf(stderr, "prefill: %s\n", fault.status().message().c_str()), 2;
  service.set_fault(fault.value());
  if (!fault->kind.empty()) log_line("prefill", "FAULT INJECTION ACTIVE: " + opts.get("fault"));

  if (opts.has("ids-file")) {
    std::ifstream in(opts.get("ids-file"));
    nlohmann::json ids = nlohmann::json::parse(in, nullptr, false);
    if (ids.is_discarded()) return std::fprintf(stderr, "prefill: --ids-file is not JSON\n"), 2;
    nlohmann::json body = {
        {"ids", ids},
        {"fingerprint", opts.has("fingerprint") ? opts.get("fingerprint") : layout.fingerprint},
        {"chunk", chunk}};
    if (opts.has("decoder-calls"))
      body["decoder_calls"] =
          nlohmann::json::parse("[" + opts.get("decoder-calls") + "]", nullptr, false);
    body["decoder_path"] = opts.get("decoder-path");
    auto req =
        parse_prefill_request(body.dump(), stack->engine->vocab(), layout, max_tokens.value());
    if (!req.is_ok())
      return std::fprintf(stderr, "prefill: %s\n", req.status().to_string().c_str()), 2;
    // The same path as over HTTP, minus the socket: the decode side's receiver verifies every
    // frame into the family's assembler.
    const int64_t T = static_cast<int64_t>(req->ids.size());
    auto assembler = make_assembler(layout, T);
    StreamReceiver receiver(assembler.get());
    service.run(req.value(), [&](std::string f) { return receiver.feed(f.data(), f.size()); });
    Status st = receiver.status();
    if (st.is_ok() && !receiver.have_manifest())
      st = data_loss("the stream ended without a manifest");
    if (!st.is_ok()) return std::fprintf(stderr, "prefill: %s\n", st.to_string().c_str()), 1;
    if (opts.has("out")) {
      std::map<std::string, std::string> meta;
      const nlohmann::json extra = assembler->entry_extra();
      for (const auto& [k, v] : extra.items()) meta[k] = v.dump();
      auto rows = assembler->arrays(T);
      Status w =
          rows.is_ok() ? write_safetensors(opts.get("out"), rows.value(), meta) : rows.status();
      if (!w.is_ok()) return std::fprintf(stderr, "prefill: %s\n", w.to_string().c_str()), 1;
    }
    std::printf("%s\n",
                nlohmann::json({{"T", T}, {"segments", assembler->segments()}}).dump().c_str());
    return 0;
  }

  auto port = opts.get_int("port");
  if (!port.is_ok())
    return std::fprintf(stderr, "prefill: %s\n", port.status().message().c_str()), 2;
  auto secret = read_secret_file(opts.get("secret-file"));
  if (!secret.is_ok())
    return std::fprintf(stderr, "prefill: %s\n", secret.status().message().c_str()), 2;
  service.set_secret(secret.value());
  auto connections = connection_limits_from(opts);
  if (!connections.is_ok())
    return std::fprintf(stderr, "prefill: %s\n", connections.status().message().c_str()), 2;
  service.set_connection_limits(connections.value());
  Status st = service.start(opts.get("host"), static_cast<int>(port.value()));
  if (!st.is_ok()) return std::fprintf(stderr, "prefill: %s\n", st.to_string().c_str()), 1;
  log_line("prefill", "serving POST /v1/prefill on " + opts.get("host") + ":" +
                          std::to_string(service.bound_port()) + " fingerprint " +
                          layout.fingerprint +
                          (secret->empty() ? ", open (no --secret-file)" : ", secret required"));
  wait_for_signal();
  service.stop();
  return 0;
}

}  // namespace hetero
