// Child processes the hetero command starts (the decoder with its seam): spawn with argv and
// extra environment, stop by pid (SIGTERM, then SIGKILL after a grace period), never by name.
// A child gets SIGTERM when its parent dies.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "common/status.h"

namespace hetero {

class ChildProcess {
 public:
  ChildProcess() = default;
  ~ChildProcess() { stop(); }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // log_path: where the child's stdout and stderr go ("" keeps ours).
  Status start(const std::vector<std::string>& argv, const std::vector<std::string>& env,
               const std::string& log_path);
  // False once the child has exited (and then reaped; exit_reason() says how it ended).
  bool running();
  void stop(int grace_ms = 5000);
  // "exited with status N" or "killed by signal N (name)"; "" while it runs or before start.
  const std::string& exit_reason() const { return exit_reason_; }
  pid_t pid() const { return pid_; }

 private:
  void reaped(int wait_status);
  pid_t pid_ = -1;
  std::string exit_reason_;
};

// A free TCP port on 127.0.0.1 (bound and released: racy but fine for tests and tools).
int free_port();

}  // namespace hetero
