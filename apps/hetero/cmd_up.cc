// `hetero up`: the whole served stack on one machine — prefill host, decoder with its seam,
// front door — on the default model. Prints the endpoint and a sample request; Ctrl-C stops
// all three (children by pid, never by name). `up` supervises: when the decoder or the prefill
// host dies, it says which, how and where its log is, stops the rest and exits 1 (a supervisor
// above it — systemd, a shell loop — restarts the whole stack, which has one secret and one store).
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <tuple>

#include "commands.h"
#include "common/log.h"
#include "common/secret.h"
#include "front/front.h"
#include "prefill/backend_options.h"
#include "stack.h"

namespace hetero {
namespace fs = std::filesystem;

Options up_options() {
  std::vector<OptionSpec> rows = {
      {"model", "HETERO_MODEL", "models/smollm2-135m-instruct",
       "the decoder's checkpoint directory"},
      {"prefill-model", "HETERO_PREFILL_MODEL", "",
       "the prefill host's checkpoint (default: --model; deepseek_v4: the official FP8 layout)"},
      {"python", "HETERO_PYTHON", ".venv/bin/python", "interpreter with the pinned decoder"},
      {"work-dir", "HETERO_WORK_DIR", "out/up", "logs, decoder weights, the store, the secret"},
      secret_file_option("the stack's shared secret; default: a new one per start in "
                         "<work-dir>/secret (mode 0600). Every process gets the file's path"),
      {"exit-when-ready", "", "", "start, print the endpoint, then stop (for tests)", true},
  };
  // The three ports: the front door's own rows (one default each).
  const Options front = front_options();
  for (const char* name : {"port", "decoder-port", "prefill-port"})
    rows.push_back(front.spec(name));
  // The prefill host's backend: the same rows `hetero prefill` reads, handed on as flags.
  for (OptionSpec& s : prefill_backend_specs()) rows.push_back(std::move(s));
  return Options("up", "Start prefill host, decoder (with seam) and front door on one model.",
                 std::move(rows));
}

int cmd_up(int argc, char** argv) {
  Options opts = up_options();
  if (int rc = parse_options(opts, argc, argv); rc >= 0) return rc;
  install_stop_handlers();  // a signal during start-up still stops the children cleanly
  const std::string model = resolve_path(opts.get("model"));
  const std::string python = resolve_path(opts.get("python"));
  const std::string prefill_model =
      opts.has("prefill-model") ? resolve_path(opts.get("prefill-model")) : model;
  if (!fs::exists(fs::path(model) / "config.json"))
    return std::fprintf(stderr, "up: no model at %s (run: make up)\n", model.c_str()), 2;
  fs::path work = opts.get("work-dir");
  if (work.is_relative()) work = fs::path(repo_root()) / work;
  fs::create_directories(work / "store");
  auto port = opts.get_int("port"), dport = opts.get_int("decoder-port"),
       pport = opts.get_int("prefill-port");
  if (!port.is_ok() || !dport.is_ok() || !pport.is_ok())
    return std::fprintf(stderr, "up: ports must be integers\n"), 2;
  if (auto backend = prefill_backend_from(opts); !backend.is_ok())
    return std::fprintf(stderr, "up: %s\n", backend.status().message().c_str()), 2;
  // One secret for the stack: the seam and the prefill host refuse calls without it.
  std::string secret_file = opts.get("secret-file");
  if (secret_file.empty()) {
    secret_file = (work / "secret").string();
    if (Status st = write_new_secret_file(secret_file); !st.is_ok())
      return std::fprintf(stderr, "up: %s\n", st.message().c_str()), 1;
  }
  secret_file = fs::absolute(secret_file).string();
  auto secret = read_secret_file(secret_file);
  if (!secret.is_ok())
    return std::fprintf(stderr, "up: %s\n", secret.status().message().c_str()), 2;

  std::printf("exporting decoder weights...\n");
  std::fflush(stdout);
  const std::string weights = (work / "decoder-weights").string();
  if (Status st = export_decoder_weights(python, model, weights, (work / "export.log").string());
      !st.is_ok())
    return std::fprintf(stderr, "up: %s\n", st.message().c_str()), 1;

  ChildProcess decoder, prefill;
  const std::string dlog = (work / "decoder.log").string(), plog = (work / "prefill.log").string();
  if (Status st = start_decoder(&decoder, python, model, static_cast<int>(dport.value()),
                                (work / "store").string(), dlog, secret_file);
      !st.is_ok())
    return std::fprintf(stderr, "up: decoder: %s\n", st.message().c_str()), 1;
  std::vector<std::string> prefill_argv = {(fs::path(repo_root()) / "build" / "hetero").string(),
                                           "prefill",
                                           "--model",
                                           prefill_model,
                                           "--weights",
                                           weights,
                                           "--port",
                                           std::to_string(pport.value()),
                                           "--secret-file",
                                           secret_file};
  for (std::string& f : prefill_backend_flags(opts)) prefill_argv.push_back(std::move(f));
  if (Status st = prefill.start(prefill_argv, {}, plog); !st.is_ok())
    return std::fprintf(stderr, "up: prefill: %s\n", st.message().c_str()), 1;
  std::printf("starting decoder (log %s) and prefill host (log %s)...\n", dlog.c_str(),
              plog.c_str());
  std::fflush(stdout);
  for (auto [p, path, child, log] : {std::tuple{dport.value(), "/hetero/info", &decoder, dlog},
                                     std::tuple{pport.value(), "/health", &prefill, plog}})
    if (Status st = wait_http_ok(static_cast<int>(p), path, child, 300000, log, secret.value());
        !st.is_ok())
      return std::fprintf(stderr, "up: %s\n", st.message().c_str()), 1;

  Options fo = front_options();  // the front's other knobs: defaults and HETERO_* env
  (void)fo.parse(0, nullptr);
  auto cfg = front_config(fo);
  if (!cfg.is_ok()) return std::fprintf(stderr, "up: %s\n", cfg.status().message().c_str()), 2;
  cfg->store_dir = (work / "store").string();
  cfg->port = static_cast<int>(port.value());
  cfg->decoder_port = static_cast<int>(dport.value());
  cfg->prefill_port = static_cast<int>(pport.value());
  cfg->secret = secret.value();
  FrontServer front(cfg.value());
  if (Status st = front.start(); !st.is_ok())
    return std::fprintf(stderr, "up: front: %s\n", st.to_string().c_str()), 1;
  const std::string url = "http://127.0.0.1:" + std::to_string(front.bound_port());
  std::printf(
      "\nhetero is up: %s/v1 (OpenAI-compatible)\n\n"
      "  curl -s %s/v1/chat/completions -H 'Content-Type: application/json' \\\n"
      "    -d '{\"messages\":[{\"role\":\"user\",\"content\":\"Hello!\"}],\"max_tokens\":32}' "
      "-i\n\n"
      "Every reply carries X-PD-Bridge (the bridge verdict). Check the links:\n"
      "  hetero doctor --secret-file %s\n"
      "Ctrl-C stops all three.\n",
      url.c_str(), url.c_str(), secret_file.c_str());
  std::fflush(stdout);
  std::string died;
  if (!opts.get_bool("exit-when-ready"))
    wait_for_signal_or([&] {
      for (auto [name, child, log] :
           {std::tuple{"decoder", &decoder, &dlog}, std::tuple{"prefill host", &prefill, &plog}})
        if (!child->running())
          died = std::string(name) + " " + child->exit_reason() + " (log " + *log + ")";
      return !died.empty();
    });
  if (!died.empty()) std::fprintf(stderr, "up: the %s; stopping the stack\n", died.c_str());
  // The children first: the front door's stop waits for its requests in flight, and one that
  // waits on the decoder would hold it for the decoder's timeout. With the decoder gone they
  // end at once, each with its error.
  decoder.stop();
  prefill.stop();
  front.stop();
  std::printf("stopped.\n");
  return died.empty() ? 0 : 1;
}

}  // namespace hetero
