// Stack process helpers: see stack.h.
#include "stack.h"

#include <chrono>
#include <deque>
#include <filesystem>
#include <fstream>
#include <thread>

#include "commands.h"
#include "common/http_json.h"

namespace hetero {
namespace fs = std::filesystem;

std::string resolve_path(const std::string& p) {
  if (p.empty() || fs::path(p).is_absolute() || fs::exists(p)) return p;
  fs::path r = fs::path(repo_root()) / p;
  return fs::exists(r) ? r.string() : p;
}

std::string seam_pythonpath() {
  return "PYTHONPATH=" + (fs::path(repo_root()) / "python").string();
}

std::string log_tail(const std::string& log_path, size_t lines) {
  std::ifstream in(log_path);
  std::deque<std::string> last;
  for (std::string line; std::getline(in, line);) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    last.push_back(line.size() > 2000 ? line.substr(0, 2000) + " ..." : line);
    if (last.size() > lines) last.pop_front();
  }
  std::string out;
  for (const auto& line : last) out += "\n  " + line;
  return out;
}

std::vector<std::string> decoder_argv(const std::string& python, const std::string& model, int port,
                                      const std::string& store, const std::string& secret_file) {
  std::vector<std::string> argv = {python,    "-m",  "hetero_mlx", "serve",
                                   "--model", model, "--port",     std::to_string(port)};
  if (!store.empty()) argv.insert(argv.end(), {"--store", store});
  if (!secret_file.empty()) argv.insert(argv.end(), {"--secret-file", secret_file});
  return argv;
}

Status start_decoder(ChildProcess* child, const std::string& python, const std::string& model,
                     int port, const std::string& store, const std::string& log_path,
                     const std::string& secret_file) {
  return child->start(decoder_argv(python, model, port, store, secret_file), {seam_pythonpath()},
                      log_path);
}

Status export_decoder_weights(const std::string& python, const std::string& model,
                              const std::string& out, const std::string& log_path) {
  ChildProcess exporter;
  HETERO_RETURN_IF_ERROR(
      exporter.start({python, "-m", "hetero_mlx", "export", "--model", model, "--out", out},
                     {seam_pythonpath()}, log_path));
  while (exporter.running()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  if (!fs::exists(fs::path(out) / "decoder.json"))
    return unavailable("decoder-weights export failed; see " + log_path + log_tail(log_path, 3));
  return Status::ok();
}

Status wait_http_ok(int port, const std::string& path, ChildProcess* child, int64_t timeout_ms,
                    const std::string& log_path, const std::string& secret) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < deadline) {
    if (child && !child->running())
      return unavailable("process exited during start; see " + log_path + log_tail(log_path, 3));
    auto r = http_json("127.0.0.1", port, path, nlohmann::json(), 2000, secret);
    if (r.is_ok() && r->status == 200) return Status::ok();
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return unavailable("no answer on port " + std::to_string(port) + path +
                     " within the deadline; see " + log_path);
}

}  // namespace hetero
