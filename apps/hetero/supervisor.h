// `hetero up`'s children (the decoder with its seam, the prefill host), kept serving: a child
// that exits, or stops answering its health check, or answers that it cannot work (the
// decoder's generation thread died: /hetero/info 503 generation_dead), is stopped and started
// again after a backoff (1 s, doubling, at most 30 s), while the front door goes on serving
// (natively while the prefill host is down; 503 with its own JSON error while the decoder is).
// The stack stops, with a message naming the child, its last failure and its log, only when a
// child fails more than `max_failures` times within `window_ms`.
// Thread-safe: a thread of its own watches; stop() ends it and stops the children.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/process.h"
#include "common/status.h"

namespace hetero {

struct SupervisedChild {
  std::string name;  // "decoder", "prefill host": for messages and metrics
  std::vector<std::string> argv, env;
  std::string log_path;
  int port = 0;
  std::string health_path;  // GET, signed with the secret when there is one; 200: healthy
  std::string secret;
};

struct SupervisorPolicy {
  // A child busy serving (a decoder with 80 clients on two cores) may take seconds to answer:
  // only a long silence is a hang. A child that answers it cannot work, or exits, is restarted
  // at once.
  int64_t health_every_ms = 5000;
  int64_t health_timeout_ms = 10000;
  int health_failures = 6;            // unanswered checks in a row (a hung child): restarted
  int64_t start_timeout_ms = 300000;  // from a start to its first healthy answer
  int max_failures = 5;               // within window_ms: the stack stops
  int64_t window_ms = 300000;
  int64_t backoff_first_ms = 1000, backoff_max_ms = 30000;
};

class Supervisor {
 public:
  // on_event(child, event, detail): event is "restart" (a child is being started again after
  // a failure, detail says why) or "up" / "down" (it answers, or stopped answering).
  Supervisor(std::vector<SupervisedChild> children, SupervisorPolicy policy,
             std::function<void(const std::string&, const std::string&, const std::string&)>
                 on_event = {});
  ~Supervisor();
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  // Starts every child and waits until each answers (start_timeout_ms): an error names the
  // child, how it ended and its log's last lines; nothing is left running then.
  Status start();
  // Watches from now on, on a thread of its own.
  void watch();
  // Non-empty once the stack must stop: why.
  std::string fatal() const;
  int64_t restarts(const std::string& child) const;
  // Stops watching, then every child (by pid).
  void stop();

 private:
  enum class State { kStarting, kRunning, kBackoff };
  struct Child {
    SupervisedChild spec;
    std::unique_ptr<ChildProcess> process;
    State state = State::kStarting;
    int64_t since_ms = 0;       // of the state
    int64_t next_check_ms = 0;  // kRunning: the next health check; kBackoff: the next start
    int missed = 0;             // health checks unanswered in a row
    std::vector<int64_t> failures_ms;
    int64_t restarts = 0;
  };
  void run();
  void step(Child& c, int64_t now);
  // The child failed (why): stopped if still running, and started again after a backoff, or
  // the stack's fatal error once it failed too often.
  void failed(Child& c, int64_t now, const std::string& why);
  // "" healthy; else what the check saw.
  std::string check(const Child& c) const;
  void emit(const std::string& child, const std::string& event, const std::string& detail);

  std::vector<Child> children_;
  SupervisorPolicy policy_;
  std::function<void(const std::string&, const std::string&, const std::string&)> on_event_;
  mutable std::mutex mu_;
  std::string fatal_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace hetero
