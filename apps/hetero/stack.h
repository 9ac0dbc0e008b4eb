// Starting the processes of a stack (decoder with seam, prefill host) and waiting for them:
// shared by `hetero verify`, `hetero up` and `hetero doctor`.
#pragma once

#include <string>
#include <vector>

#include "common/process.h"
#include "common/status.h"

namespace hetero {

// A path as given if it exists, else relative to the repository root.
std::string resolve_path(const std::string& p);
// PYTHONPATH=<repo>/python, so the seam package is importable by the pinned interpreter.
std::string seam_pythonpath();

// The command line of python -m hetero_mlx serve (store, secret_file: "" for none).
std::vector<std::string> decoder_argv(const std::string& python, const std::string& model, int port,
                                      const std::string& store, const std::string& secret_file);
// python -m hetero_mlx serve ... (store, secret_file: "" for none); output to log_path.
Status start_decoder(ChildProcess* child, const std::string& python, const std::string& model,
                     int port, const std::string& store, const std::string& log_path,
                     const std::string& secret_file = "");
// python -m hetero_mlx export: waits for it and checks decoder.json appeared.
Status export_decoder_weights(const std::string& python, const std::string& model,
                              const std::string& out, const std::string& log_path);
// The last `lines` non-empty lines of a log, each on its own indented line (for messages that
// say why a child failed); "" when there are none.
std::string log_tail(const std::string& log_path, size_t lines);
// Polls GET path (with the stack's secret, if any) until HTTP 200, the child exits (if given:
// the message ends with its log's last lines), or timeout.
Status wait_http_ok(int port, const std::string& path, ChildProcess* child, int64_t timeout_ms,
                    const std::string& log_path, const std::string& secret = "");

}  // namespace hetero
