// `hetero up`: the whole served stack on one machine — prefill host, decoder with its seam,
// front door — on the default model. Prints the endpoint and a sample request; Ctrl-C stops
// all three (children by pid, never by name). `up` supervises (supervisor.h): a child that
// dies, hangs, or cannot work (a decoder whose generation died) is started again after a
// backoff while the front door goes on serving, and /metrics counts the restarts; the stack
// stops and `up` exits 1, naming the child and its log, only when restarts keep failing.
// Everything it writes (the work dir: logs, store, secret, exports) is its user's alone.
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <tuple>

#include "commands.h"
#include "common/log.h"
#include "common/secret.h"
#include "front/front.h"
#include "prefill/backend_options.h"
#include "stack.h"
#include "supervisor.h"

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
      {"decoder-test-faults", "", "",
       "start the decoder's seam with --test-faults (POST /hetero/fault; for tests only)", true},
  };
  // The three ports: the front door's own rows (one default each).
  const Options front = front_options();
  for (const char* name :
       {"port", "decoder-port", "prefill-port", "api-key-file", "forced-bridges"})
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
  // Logs, the store and the exported weights hold prompts and the model: the user's alone
  // (issue 50, finding 8), for this process and the children it starts.
  ::umask(077);
  fs::create_directories(work / "store");
  std::error_code perm_ec;
  for (const fs::path& d : {work, work / "store"})
    fs::permissions(d, fs::perms::owner_all, fs::perm_options::replace, perm_ec);
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

  const std::string dlog = (work / "decoder.log").string(), plog = (work / "prefill.log").string();
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
  std::vector<std::string> dargv = decoder_argv(python, model, static_cast<int>(dport.value()),
                                                (work / "store").string(), secret_file);
  if (opts.get_bool("decoder-test-faults")) dargv.push_back("--test-faults");
  std::vector<SupervisedChild> children = {{"decoder",
                                            dargv,
                                            {seam_pythonpath()},
                                            dlog,
                                            static_cast<int>(dport.value()),
                                            "/hetero/info",
                                            secret.value()},
                                           {"prefill host",
                                            prefill_argv,
                                            {},
                                            plog,
                                            static_cast<int>(pport.value()),
                                            "/health",
                                            secret.value()}};
  // The children's events reach the front door's /metrics once it serves.
  std::atomic<FrontServer*> front_for_events{nullptr};
  Supervisor supervisor(
      std::move(children), SupervisorPolicy{},
      [&front_for_events](const std::string& child, const std::string& event, const std::string&) {
        FrontServer* f = front_for_events.load();
        if (f == nullptr) return;
        if (event == "restart")
          f->metrics().child_restarted(child);
        else
          f->metrics().child_up(child, event == "up");
      });
  std::printf("starting decoder (log %s) and prefill host (log %s)...\n", dlog.c_str(),
              plog.c_str());
  std::fflush(stdout);
  if (Status st = supervisor.start(); !st.is_ok())
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
  auto tenants = Tenants::load(opts.get("api-key-file"), secret.value());
  if (!tenants.is_ok())
    return std::fprintf(stderr, "up: %s\n", tenants.status().message().c_str()), 2;
  cfg->tenants = std::move(tenants.value());
  cfg->forced_bridges_from_anyone = opts.get("forced-bridges") == "anyone";
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
  front_for_events = &front;
  for (const char* child : {"decoder", "prefill host"}) front.metrics().child_up(child, true);
  std::string fatal;
  if (!opts.get_bool("exit-when-ready")) {
    supervisor.watch();
    wait_for_signal_or([&] { return !(fatal = supervisor.fatal()).empty(); });
  }
  if (!fatal.empty()) std::fprintf(stderr, "up: %s; stopping the stack\n", fatal.c_str());
  // The children first: the front door's stop waits for its requests in flight, and one that
  // waits on the decoder would hold it for the decoder's timeout. With the decoder gone they
  // end at once, each with its error.
  supervisor.stop();
  front_for_events = nullptr;
  front.stop();
  std::printf("stopped.\n");
  return fatal.empty() ? 0 : 1;
}

}  // namespace hetero
