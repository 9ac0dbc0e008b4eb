// What every HTTP server of the project sets on cpp-httplib before it binds, and the guard that
// watches its connections while it serves.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/options.h"
#include "common/status.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace hetero {

// How many connections a server serves and how long a client may take to send a request.
struct ConnectionLimits {
  // Connections served at once, each on its own thread; more wait for one to end.
  int max_connections = 512;
  // Connections from one address at once; more are closed as they arrive. Every client on the
  // server's own machine is one address (127.0.0.1).
  int per_client = 256;
  // From a connection's start, or the end of its last response, to its next request read whole
  // (headers and body): a client slower than this is cut off. cpp-httplib's own timeout is per
  // read, so a client sending a byte every few seconds held a connection for ever.
  int64_t request_deadline_ms = 60000;
};

// The options for them, one spec each for every server: --max-connections,
// --max-connections-per-client, --request-deadline-s (HETERO_* beside each).
std::vector<OptionSpec> connection_options();
Result<ConnectionLimits> connection_limits_from(const Options& opts);

// Configures `server` for `limits` and watches its connections once watch() has its port:
// - SO_REUSEADDR only: cpp-httplib's default also sets SO_REUSEPORT, which let a second prefill
//   host bind the port of a running one and take half its connections.
// - Each connection on its own thread, up to max_connections at once. cpp-httplib's default
//   pool has 8 threads, one per connection: 8 clients that trickled their headers starved
//   /health for as long as they kept trickling. Work is bounded where it is done (the front
//   door's completion slots and bridge queue, the prefill host's one prefill at a time).
// - The per-client cap and the request deadline above. cpp-httplib hands no socket to its
//   callers, so the guard finds each accepted socket in /proc/self/fd as the connection is
//   queued (by its local port), learns that a request was read whole when its handler starts
//   (register handlers through handler()), re-arms when the response is written (the logger,
//   which the guard owns), and shuts down late sockets from a watch thread.
class ConnectionGuard {
 public:
  ConnectionGuard(httplib::Server& server, ConnectionLimits limits);
  ~ConnectionGuard();  // stops the watch thread; call after the server has stopped
  ConnectionGuard(const ConnectionGuard&) = delete;
  ConnectionGuard& operator=(const ConnectionGuard&) = delete;

  using Handler = std::function<void(const httplib::Request&, httplib::Response&)>;
  // `h`, first marking its request read whole (the deadline stops until the response is sent).
  Handler handler(Handler h);
  // Starts watching the connections of the server bound to `port`. `component` names the log.
  void watch(int port, std::string component);
  // Whether the client that sent `req` has closed its side of the connection (hung up) while
  // its request is being answered. False when the connection is not known.
  bool client_gone(const httplib::Request& req);
  // The same for the connection from addr:port (req.remote_addr, req.remote_port).
  bool client_gone(const std::string& addr, int port);

  // Closed by the guard so far (for tests and logs).
  int64_t cut_late() const { return cut_late_.load(); }
  int64_t cut_crowded() const { return cut_crowded_.load(); }

 private:
  struct Conn {
    int fd = -1;
    std::string addr;  // the peer's address
    std::string peer;  // address and port: how a request names its connection
    int64_t since_ms = 0;
    bool reading = true;  // waiting for a whole request
  };
  void on_accept();      // on the listening thread, just after accept(): registers new sockets
  void forget_closed();  // with mu_: drops connections whose socket has been closed
  void mark(const httplib::Request& req, bool reading);
  void run();

  ConnectionLimits limits_;
  std::string component_;
  std::atomic<int> port_{0};
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::map<ino_t, Conn> conns_;  // by the socket's inode: fds are reused
  std::map<std::string, ino_t> by_peer_;
  std::atomic<int64_t> cut_late_{0}, cut_crowded_{0};
  std::thread thread_;
};

// A handler that throws is a bug: the client gets HTTP 500 with `json_body` (which names no
// internals), `component`'s log line gets the exception's text, and the server keeps serving.
void answer_exceptions_with(httplib::Server& server, std::string component, std::string json_body);

}  // namespace hetero
