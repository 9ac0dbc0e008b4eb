// HTTP server settings and the connection guard: see http_server.h.
#include "common/http_server.h"

#include <dirent.h>
#include <httplib.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <deque>

#include "common/log.h"

namespace hetero {
namespace {

// cpp-httplib's TaskQueue, one thread per connection. A connection's thread takes the next
// waiting connection when its own ends, so at most max_live threads exist. The state is shared
// with the threads: they outlive neither it nor shutdown(), which waits for all of them.
class ConnectionThreads : public httplib::TaskQueue {
 public:
  ConnectionThreads(int max_live, std::function<void()> on_accept)
      : state_(std::make_shared<State>()), on_accept_(std::move(on_accept)) {
    state_->max_live = std::max(1, max_live);
  }

  // Called on the listening thread right after accept(), before the connection is served.
  void enqueue(std::function<void()> fn) override {
    if (on_accept_) on_accept_();
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
  std::function<void()> on_accept_;
};

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The numeric host and port of a socket address, as cpp-httplib writes a request's remote_addr.
bool numeric_address(const sockaddr_storage& a, socklen_t len, std::string* host, int* port) {
  char h[NI_MAXHOST], p[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&a), len, h, sizeof h, p, sizeof p,
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return false;
  *host = h;
  *port = std::atoi(p);
  return true;
}

// The socket's inode, or 0 when fd is not (or no longer) a socket.
ino_t socket_inode(int fd) {
  struct stat st {};
  return fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode) ? st.st_ino : 0;
}

// Calls fn(fd, inode, listening) for each of this process's sockets bound to local `port`.
template <typename Fn>
void for_each_socket_on(int port, Fn fn) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return;
  const int own = dirfd(dir);
  while (const dirent* e = readdir(dir)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    const int fd = std::atoi(e->d_name);
    const ino_t ino = fd == own ? 0 : socket_inode(fd);
    sockaddr_storage local{};
    socklen_t llen = sizeof local, olen = sizeof(int);
    int listening = 0, local_port = 0;
    std::string host;
    if (ino != 0 && getsockname(fd, reinterpret_cast<sockaddr*>(&local), &llen) == 0 &&
        numeric_address(local, llen, &host, &local_port) && local_port == port &&
        getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &olen) == 0)
      fn(fd, ino, listening != 0);
  }
  closedir(dir);
}

}  // namespace

std::vector<OptionSpec> connection_options() {
  const ConnectionLimits d;
  return {
      {"max-connections", "HETERO_MAX_CONNECTIONS", std::to_string(d.max_connections),
       "connections served at once, each on its own thread; more wait for one to end"},
      {"max-connections-per-client", "HETERO_MAX_CONNECTIONS_PER_CLIENT",
       std::to_string(d.per_client),
       "connections from one address at once (all of this machine's clients are one); more are "
       "closed as they arrive"},
      {"request-deadline-s", "HETERO_REQUEST_DEADLINE_S",
       std::to_string(d.request_deadline_ms / 1000),
       "a client must send each whole request (headers and body) within this many seconds of "
       "connecting or of its last response; slower connections are closed"},
  };
}

Result<ConnectionLimits> connection_limits_from(const Options& opts) {
  struct Field {
    const char* name;
    int64_t lo, hi;
  };
  int64_t v[3] = {};
  const Field fields[3] = {{"max-connections", 4, 65536},
                           {"max-connections-per-client", 1, 65536},
                           {"request-deadline-s", 1, 86400}};
  for (int i = 0; i < 3; ++i) {
    auto got = opts.get_int(fields[i].name);
    if (!got.is_ok() || got.value() < fields[i].lo || got.value() > fields[i].hi)
      return invalid_argument(std::string("--") + fields[i].name + " must be an integer in [" +
                              std::to_string(fields[i].lo) + ", " + std::to_string(fields[i].hi) +
                              "]");
    v[i] = got.value();
  }
  ConnectionLimits limits;
  limits.max_connections = static_cast<int>(v[0]);
  limits.per_client = static_cast<int>(v[1]);
  limits.request_deadline_ms = v[2] * 1000;
  return limits;
}

ConnectionGuard::ConnectionGuard(httplib::Server& server, ConnectionLimits limits)
    : limits_(limits) {
  server.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  const int max_live = limits_.max_connections;
  server.new_task_queue = [this, max_live] {
    return new ConnectionThreads(max_live, [this] { on_accept(); });
  };
  // Called once a response has been written: the connection waits for its next request.
  server.set_logger(
      [this](const httplib::Request& req, const httplib::Response&) { mark(req, true); });
}

ConnectionGuard::~ConnectionGuard() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

ConnectionGuard::Handler ConnectionGuard::handler(Handler h) {
  return [this, h = std::move(h)](const httplib::Request& req, httplib::Response& res) {
    mark(req, false);
    h(req, res);
  };
}

void ConnectionGuard::watch(int port, std::string component) {
  component_ = std::move(component);
  port_.store(port);
  // cpp-httplib 0.11 listens with a backlog of 5: past 5 connections not yet accepted, the
  // kernel drops a client's handshake and the client waits a second or more to retry. Calling
  // listen() again on the bound socket raises it (Linux).
  for_each_socket_on(port, [](int fd, ino_t, bool listening) {
    if (listening) ::listen(fd, SOMAXCONN);
  });
  thread_ = std::thread([this] { run(); });
}

void ConnectionGuard::mark(const httplib::Request& req, bool reading) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_peer_.find(req.remote_addr + " " + std::to_string(req.remote_port));
  if (it == by_peer_.end()) return;
  auto c = conns_.find(it->second);
  if (c == conns_.end()) return;
  c->second.reading = reading;
  c->second.since_ms = now_ms();
}

bool ConnectionGuard::client_gone(const httplib::Request& req) {
  return client_gone(req.remote_addr, req.remote_port);
}

bool ConnectionGuard::client_gone(const std::string& addr, int port) {
  int fd = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_peer_.find(addr + " " + std::to_string(port));
    if (it == by_peer_.end()) return false;
    auto c = conns_.find(it->second);
    if (c == conns_.end()) return false;
    fd = c->second.fd;
  }
  // The server's thread owns the socket and reads nothing from it while it answers: a peer
  // that closed shows as RDHUP or HUP (data it sent ahead, POLLIN alone, is not a hang-up).
  pollfd p{fd, POLLRDHUP, 0};
  return ::poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

void ConnectionGuard::on_accept() {
  const int port = port_.load();
  if (port == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  forget_closed();
  for_each_socket_on(port, [this](int fd, ino_t ino, bool listening) {
    sockaddr_storage peer{};
    socklen_t plen = sizeof peer;
    std::string addr;
    int peer_port = 0;
    if (listening || conns_.count(ino) ||
        getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &plen) != 0 ||
        !numeric_address(peer, plen, &addr, &peer_port))
      return;
    int64_t same = 0;
    for (const auto& [_, other] : conns_) same += other.addr == addr;
    Conn c{fd, addr, addr + " " + std::to_string(peer_port), now_ms(), true};
    if (same >= limits_.per_client) {
      // Served by nobody: its thread reads the end of the stream and closes it. Counted and
      // logged before the client can see the close.
      if (cut_crowded_.fetch_add(1) % 100 == 0)
        log_line(component_, "closed a connection from " + addr + ": it already has " +
                                 std::to_string(same) + " (--max-connections-per-client)");
      shutdown(fd, SHUT_RDWR);
      c.reading = false;
    }
    by_peer_[c.peer] = ino;
    conns_.emplace(ino, std::move(c));
  });
}

void ConnectionGuard::forget_closed() {
  for (auto it = conns_.begin(); it != conns_.end();) {
    if (socket_inode(it->second.fd) == it->first) {
      ++it;
      continue;
    }
    if (auto p = by_peer_.find(it->second.peer); p != by_peer_.end() && p->second == it->first)
      by_peer_.erase(p);
    it = conns_.erase(it);
  }
}

void ConnectionGuard::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    wake_.wait_for(lock, std::chrono::milliseconds(200));
    forget_closed();
    const int64_t now = now_ms();
    for (auto& [_, c] : conns_) {
      if (c.reading && now - c.since_ms > limits_.request_deadline_ms) {
        if (cut_late_.fetch_add(1) % 100 == 0)  // counted and logged before the close
          log_line(component_, "closed a connection from " + c.addr + ": no whole request in " +
                                   std::to_string(limits_.request_deadline_ms) +
                                   " ms (--request-deadline-s)");
        shutdown(c.fd, SHUT_RDWR);
        c.reading = false;
      }
    }
  }
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

}  // namespace hetero
