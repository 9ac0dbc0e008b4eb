// HTTP server settings: see http_server.h.
#include "common/http_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "common/log.h"

namespace hetero {
namespace {

// cpp-httplib's TaskQueue, one thread per connection. A connection's thread takes the next
// waiting connection when its own ends, so at most max_live threads exist. The state is shared
// with the threads: they outlive neither it nor shutdown(), which waits for all of them.
class ConnectionThreads : public httplib::TaskQueue {
 public:
  explicit ConnectionThreads(int max_live) : state_(std::make_shared<State>()) {
    state_->max_live = std::max(1, max_live);
  }

  void enqueue(std::function<void()> fn) override {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->live >= state_->max_live) {
      state_->waiting.push_back(std::move(fn));
      return;
    }
    ++state_->live;
    std::thread(run, state_, std::move(fn)).detach();
  }

  // As cpp-httplib's own pool: every accepted connection is still served (and closed).
  void shutdown() override {
    std::unique_lock<std::mutex> lock(state_->mu);
    state_->idle.wait(lock, [this] { return state_->live == 0 && state_->waiting.empty(); });
  }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable idle;
    std::deque<std::function<void()>> waiting;
    int live = 0, max_live = 1;
  };

  static void run(std::shared_ptr<State> state, std::function<void()> fn) {
    while (true) {
      fn();
      std::lock_guard<std::mutex> lock(state->mu);
      if (state->waiting.empty()) {
        --state->live;
        state->idle.notify_all();
        return;
      }
      fn = std::move(state->waiting.front());
      state->waiting.pop_front();
    }
  }

  std::shared_ptr<State> state_;
};

}  // namespace

OptionSpec max_connections_option() {
  return {"max-connections", "HETERO_MAX_CONNECTIONS", std::to_string(kDefaultMaxConnections),
          "connections served at once, each on its own thread; more wait for one to end"};
}

void answer_exceptions_with(httplib::Server& server, std::string component, std::string json_body) {
  server.set_exception_handler(
      [component = std::move(component), body = std::move(json_body)](
          const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown exception";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        log_line(component, "internal error in " + req.method + " " + req.path + ": " + what);
        res.status = 500;
        res.set_content(body, "application/json");
      });
}

void configure_server(httplib::Server& server, int max_connections) {
  server.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  server.new_task_queue = [max_connections] { return new ConnectionThreads(max_connections); };
}

}  // namespace hetero
