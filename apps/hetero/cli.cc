// What every hetero binary's commands share: the repository root, option parsing with --help,
// and stopping on SIGINT/SIGTERM (children are stopped by pid, never by name).
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "commands.h"

namespace hetero {
namespace {

volatile std::sig_atomic_t g_stop = 0;

}  // namespace

std::string repo_root() {
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return ".";
  return exe.parent_path().parent_path().string();
}

void install_stop_handlers() {
  std::signal(SIGINT, [](int) { g_stop = 1; });
  std::signal(SIGTERM, [](int) { g_stop = 1; });
}

void wait_for_signal() {
  wait_for_signal_or([] { return false; });
}

bool wait_for_signal_or(const std::function<bool()>& give_up) {
  install_stop_handlers();
  while (!g_stop) {
    if (give_up()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return true;
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

}  // namespace hetero
