// Supervision of the stack's children: see supervisor.h.
#include "supervisor.h"

#include <algorithm>
#include <chrono>

#include "common/http_json.h"
#include "common/log.h"
#include "stack.h"

namespace hetero {
namespace {

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

Supervisor::Supervisor(
    std::vector<SupervisedChild> children, SupervisorPolicy policy,
    std::function<void(const std::string&, const std::string&, const std::string&)> on_event)
    : policy_(policy), on_event_(std::move(on_event)) {
  for (SupervisedChild& s : children) {
    Child c;
    c.spec = std::move(s);
    c.process = std::make_unique<ChildProcess>();
    children_.push_back(std::move(c));
  }
}

Supervisor::~Supervisor() { stop(); }

Status Supervisor::start() {
  for (Child& c : children_) {
    if (Status st = c.process->start(c.spec.argv, c.spec.env, c.spec.log_path); !st.is_ok())
      return Status(st.code(), c.spec.name + ": " + st.message());
    c.state = State::kStarting;
    c.since_ms = now_ms();
  }
  for (Child& c : children_) {
    if (Status st = wait_http_ok(c.spec.port, c.spec.health_path, c.process.get(),
                                 policy_.start_timeout_ms, c.spec.log_path, c.spec.secret);
        !st.is_ok())
      return Status(st.code(), c.spec.name + ": " + st.message());
    c.state = State::kRunning;
    c.since_ms = now_ms();
    c.next_check_ms = c.since_ms + policy_.health_every_ms;
  }
  return Status::ok();
}

void Supervisor::watch() {
  thread_ = std::thread([this] { run(); });
}

std::string Supervisor::fatal() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fatal_;
}

int64_t Supervisor::restarts(const std::string& child) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Child& c : children_)
    if (c.spec.name == child) return c.restarts;
  return 0;
}

void Supervisor::stop() {
  stopping_ = true;
  if (thread_.joinable()) thread_.join();
  for (Child& c : children_) c.process->stop();
}

void Supervisor::emit(const std::string& child, const std::string& event,
                      const std::string& detail) {
  log_line("up", "the " + child + ": " + event + (detail.empty() ? "" : " (" + detail + ")"));
  if (on_event_) on_event_(child, event, detail);
}

void Supervisor::run() {
  while (!stopping_.load() && fatal().empty()) {
    const int64_t now = now_ms();
    for (Child& c : children_) {
      if (stopping_.load()) return;
      step(c, now);
      if (!fatal().empty()) return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

std::string Supervisor::check(const Child& c) const {
  auto r = http_json("127.0.0.1", c.spec.port, c.spec.health_path, nlohmann::json(),
                     policy_.health_timeout_ms, c.spec.secret);
  if (!r.is_ok()) return r.status().message();
  if (r->status == 200) return "";
  const nlohmann::json& b = r->body;
  if (b.is_object() && b.contains("error") && b["error"].is_object())
    return "HTTP " + std::to_string(r->status) + " " + b["error"].value("code", std::string()) +
           ": " + b["error"].value("message", std::string());
  return "HTTP " + std::to_string(r->status);
}

void Supervisor::step(Child& c, int64_t now) {
  if (c.state == State::kBackoff) {
    if (now < c.next_check_ms) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++c.restarts;
    }
    emit(c.spec.name, "restart", "log " + c.spec.log_path);
    c.process = std::make_unique<ChildProcess>();
    if (Status st = c.process->start(c.spec.argv, c.spec.env, c.spec.log_path); !st.is_ok())
      return failed(c, now, st.message());
    c.state = State::kStarting;
    c.since_ms = now;
    c.next_check_ms = now + 500;
    return;
  }
  if (!c.process->running())
    return failed(
        c, now,
        c.process->exit_reason() + " (log " + c.spec.log_path + ")" + log_tail(c.spec.log_path, 3));
  if (now < c.next_check_ms) return;
  const std::string seen = check(c);
  if (c.state == State::kStarting) {
    if (seen.empty()) {
      c.state = State::kRunning;
      c.since_ms = now;
      c.missed = 0;
      c.next_check_ms = now + policy_.health_every_ms;
      emit(c.spec.name, "up", "");
    } else if (now - c.since_ms > policy_.start_timeout_ms) {
      failed(c, now,
             "not healthy " + std::to_string(policy_.start_timeout_ms / 1000) +
                 " s after its start: " + seen);
    } else {
      c.next_check_ms = now + 500;
    }
    return;
  }
  c.next_check_ms = now + policy_.health_every_ms;
  if (seen.empty()) {
    c.missed = 0;
    return;
  }
  // It answers that it cannot work (a decoder whose generation died): restarted at once. No
  // answer at all: after health_failures checks in a row (a child busy for a moment is not
  // killed).
  const bool answered_broken = seen.rfind("HTTP ", 0) == 0;
  if (answered_broken || ++c.missed >= policy_.health_failures)
    failed(c, now,
           answered_broken
               ? seen
               : "no answer to " + std::to_string(c.missed) + " health checks in a row: " + seen);
}

void Supervisor::failed(Child& c, int64_t now, const std::string& why) {
  emit(c.spec.name, "down", why);
  if (c.process->running()) c.process->stop(/*grace_ms=*/3000);
  c.missed = 0;
  c.failures_ms.push_back(now);
  c.failures_ms.erase(std::remove_if(c.failures_ms.begin(), c.failures_ms.end(),
                                     [&](int64_t t) { return now - t > policy_.window_ms; }),
                      c.failures_ms.end());
  const int recent = static_cast<int>(c.failures_ms.size());
  if (recent > policy_.max_failures) {
    std::lock_guard<std::mutex> lock(mu_);
    fatal_ = "the " + c.spec.name + " failed " + std::to_string(recent) + " times in " +
             std::to_string(policy_.window_ms / 1000) + " s; the last time: " + why;
    return;
  }
  const int64_t backoff = std::min<int64_t>(policy_.backoff_max_ms,
                                            policy_.backoff_first_ms << std::min(recent - 1, 16));
  log_line("up", "the " + c.spec.name + " failed: " + why + "; starting it again in " +
                     std::to_string(backoff) + " ms");
  c.state = State::kBackoff;
  c.since_ms = now;
  c.next_check_ms = now + backoff;
}

}  // namespace hetero
