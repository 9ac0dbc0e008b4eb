// `hetero prefill`: the prefill host. Serves POST /v1/prefill, or with --ids-file runs one
// prefill offline through the same producer, wire and verifier and writes the assembled cache.
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "bridge/assembler.h"
#include "commands.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "prefill/service.h"

namespace hetero {
namespace {

volatile std::sig_atomic_t g_stop = 0;

}  // namespace

void install_stop_handlers() {
  std::signal(SIGINT, [](int) { g_stop = 1; });
  std::signal(SIGTERM, [](int) { g_stop = 1; });
}

void wait_for_signal() {
  install_stop_handlers();
  while (!g_stop) std::this_thread::sleep_for(std::chrono::milliseconds(100));
}

int parse_options(Options& opts, int argc, char** argv) {
  Status st = opts.parse(argc, argv);
  if (opts.help_requested()) {
    std::fputs(opts.help_text().c_str(), stdout);
    return 0;
  }
  if (!st.is_ok()) {
    std::fprintf(stderr, "%s\n", st.message().c_str());
    return 2;
  }
  return -1;
}

Options prefill_options() {
  return Options(
      "prefill",
      "The prefill engine (CPU backend): chunked prefill with the attention-input tap "
      "feeding the decoder-cache program; segments stream back while it runs.",
      {
          {"model", "HETERO_MODEL", "", "HF checkpoint directory of the model to prefill"},
          {"weights", "HETERO_DECODER_WEIGHTS", "",
           "decoder-weights export (python -m hetero_mlx export)"},
          {"host", "HETERO_PREFILL_HOST", "127.0.0.1", "address to listen on"},
          {"port", "HETERO_PREFILL_PORT", "8010", "port to listen on (0: any free port)"},
          {"chunk", "HETERO_PREFILL_CHUNK", "512", "prefill chunk size in tokens"},
          {"max-tokens", "HETERO_PREFILL_MAX_TOKENS", "2097152", "longest accepted prompt"},
          {"gemm", "HETERO_PREFILL_GEMM", "ordered",
           "ordered: the decoder's GEMM order (bit-exact attention inputs); blas: OpenBLAS"},
          {"fault", "HETERO_PREFILL_FAULT", "",
           "fault injection for tests: exit-after:N, stall-after:N, truncate-after:N, corrupt:N, "
           "gap:N, wrong-t"},
          {"ids-file", "", "", "offline: JSON array of token ids to prefill instead of serving"},
          {"fingerprint", "", "",
           "offline: the decoder fingerprint to require (default: export's)"},
          {"out", "", "", "offline: where to write the assembled cache (safetensors)"},
      });
}

int cmd_prefill(int argc, char** argv) {
  Options opts = prefill_options();
  if (int rc = parse_options(opts, argc, argv); rc >= 0) return rc;
  if (!opts.has("model") || !opts.has("weights")) {
    std::fprintf(stderr, "prefill: --model and --weights are required\n");
    return 2;
  }
  log_line("prefill", "options " + opts.effective().dump());
  const std::string gemm = opts.get("gemm");
  if (gemm != "ordered" && gemm != "blas")
    return std::fprintf(stderr, "prefill: --gemm must be 'ordered' or 'blas'\n"), 2;
  auto engine =
      LlamaCpuEngine::load(opts.get("model"), gemm == "blas" ? LlamaCpuEngine::Gemm::kBlas
                                                             : LlamaCpuEngine::Gemm::kOrdered);
  if (!engine.is_ok())
    return std::fprintf(stderr, "prefill: %s\n", engine.status().to_string().c_str()), 1;
  auto weights = load_llama_decoder_weights(opts.get("weights"));
  if (!weights.is_ok())
    return std::fprintf(stderr, "prefill: %s\n", weights.status().to_string().c_str()), 1;
  if (Status st = check_export_matches_model(engine.value()->config(), weights->layout);
      !st.is_ok())
    return std::fprintf(stderr, "prefill: %s\n", st.to_string().c_str()), 1;
  auto chunk = opts.get_int("chunk");
  auto max_tokens = opts.get_int("max-tokens");
  if (!chunk.is_ok() || chunk.value() <= 0 || !max_tokens.is_ok())
    return std::fprintf(stderr, "prefill: --chunk and --max-tokens must be positive integers\n"), 2;
  PrefillService service(engine.value().get(), &weights.value(), chunk.value(), max_tokens.value());
  auto fault = parse_fault(opts.get("fault"));
  if (!fault.is_ok())
    return std::fprintf(stderr, "prefill: %s\n", fault.status().message().c_str()), 2;
  service.set_fault(fault.value());
  if (!fault->kind.empty()) log_line("prefill", "FAULT INJECTION ACTIVE: " + opts.get("fault"));

  if (opts.has("ids-file")) {
    std::ifstream in(opts.get("ids-file"));
    nlohmann::json ids = nlohmann::json::parse(in, nullptr, false);
    if (ids.is_discarded()) return std::fprintf(stderr, "prefill: --ids-file is not JSON\n"), 2;
    nlohmann::json body = {{"ids", ids},
                           {"fingerprint", opts.has("fingerprint") ? opts.get("fingerprint")
                                                                   : weights->layout.fingerprint},
                           {"chunk", chunk.value()}};
    auto req = parse_prefill_request(body.dump(), engine.value()->config(), weights->layout,
                                     max_tokens.value());
    if (!req.is_ok())
      return std::fprintf(stderr, "prefill: %s\n", req.status().to_string().c_str()), 2;
    // The same path as over HTTP, minus the socket: frames are parsed and verified.
    const int64_t T = static_cast<int64_t>(req->ids.size());
    CacheAssembler assembler(weights->layout, T);
    FrameParser parser(int64_t{8} << 30);
    Status st;
    service.run(req.value(), [&](std::string f) {
      parser.feed(f.data(), f.size());
      auto fr = parser.next();
      if (!fr.is_ok() || !fr.value())
        return (st = fr.is_ok() ? data_loss("partial frame") : fr.status()), false;
      if (fr.value()->header.value("kind", "") == "manifest") {
        auto m = decode_manifest(*fr.value());
        st = m.is_ok() ? assembler.finish(m.value()) : m.status();
        return st.is_ok();
      }
      auto seg = decode_segment(*fr.value());
      st = seg.is_ok() ? assembler.accept(seg.value()) : seg.status();
      return st.is_ok();
    });
    if (!st.is_ok()) return std::fprintf(stderr, "prefill: %s\n", st.to_string().c_str()), 1;
    if (opts.has("out")) {
      Status w = write_safetensors(opts.get("out"), assembler.arrays(T));
      if (!w.is_ok()) return std::fprintf(stderr, "prefill: %s\n", w.to_string().c_str()), 1;
    }
    std::printf("%s\n",
                nlohmann::json({{"T", T}, {"segments", assembler.segments()}}).dump().c_str());
    return 0;
  }

  auto port = opts.get_int("port");
  if (!port.is_ok())
    return std::fprintf(stderr, "prefill: %s\n", port.status().message().c_str()), 2;
  Status st = service.start(opts.get("host"), static_cast<int>(port.value()));
  if (!st.is_ok()) return std::fprintf(stderr, "prefill: %s\n", st.to_string().c_str()), 1;
  log_line("prefill", "serving POST /v1/prefill on " + opts.get("host") + ":" +
                          std::to_string(service.bound_port()) + " fingerprint " +
                          weights->layout.fingerprint);
  wait_for_signal();
  service.stop();
  return 0;
}

}  // namespace hetero
