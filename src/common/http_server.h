// The HTTP/1.1 server every component of the project serves on (the front door, the prefill
// host): Boost.Beast's parser on sockets the server owns, a thread per connection.
//
// Why not cpp-httplib's server (which the project used before; docs/design/http-server.md):
// version 0.11 (Debian's) bounds neither a chunked body (a 600 MiB chunked body grew the front
// door by 2.2 GB before its 413) nor the number of header lines (64 MiB of headers accepted),
// and hands its callers no socket, so deadlines and hang-ups had to be found in /proc. Beast's
// parser bounds the header bytes and the body (chunked too) while it reads, and owning the
// socket makes deadlines, per-client caps and hang-up checks plain POSIX.
//
// Every request is read whole, headers then body, each within its limit, before its handler
// runs; the request's gate runs between the two (authentication that costs no memory refuses
// a request before its body is read). Errors the server answers itself (400, 404, 405, 408,
// 413, 431, 500) carry a JSON body. Handlers run on the connection's thread and never throw
// across it: an exception becomes a 500 with the server's error body, logged.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "common/options.h"
#include "common/status.h"

namespace hetero {

class ConnectionIo;
using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

// One request. Header names compare case-insensitively.
struct HttpRequest {
  std::string method;  // as sent: "GET", "POST", ...
  std::string target;  // as sent: path and query
  std::string path;    // target without its query
  HttpHeaders headers;
  std::string body;  // empty until the body is read (a gate sees none)
  std::string remote_addr;
  int remote_port = 0;
  uint64_t connection = 0;  // the server's name for the connection (client_gone)

  std::string header(std::string_view name) const;  // "" when absent
  bool has_header(std::string_view name) const;
};

// Where a streamed response's body goes, chunk by chunk.
class ChunkSink {
 public:
  virtual ~ChunkSink() = default;
  // False once the client is gone (a write failed, or the connection was cut); then stop.
  virtual bool write(const char* data, size_t n) = 0;
  bool write(std::string_view s) { return write(s.data(), s.size()); }
  // Whether the client has hung up, without writing.
  virtual bool client_gone() = 0;
};

struct HttpResponse {
  int status = 200;
  HttpHeaders headers;
  std::string body;

  void set_header(std::string name, std::string value);  // replaces one of the same name
  bool has_header(std::string_view name) const;
  std::string header(std::string_view name) const;
  void set_content(std::string content, std::string content_type);
  // The body is written after the head, in chunks (Transfer-Encoding: chunked): provider
  // writes it and returns true when it is whole; false ends the connection without the last
  // chunk, so the client sees a broken stream, not a short one. on_end(whole) runs exactly once
  // afterwards, also when the provider never ran (the head could not be written).
  void set_chunked(std::string content_type, std::function<bool(ChunkSink&)> provider,
                   std::function<void(bool whole)> on_end = {});
  bool chunked() const { return static_cast<bool>(provider_); }

  std::function<bool(ChunkSink&)> provider_;
  std::function<void(bool)> on_end_;
};

using HttpHandler = std::function<void(const HttpRequest&, HttpResponse&)>;

// How many connections a server serves, and how much and how fast a client may send.
struct ConnectionLimits {
  // Connections served at once, each on its own thread; more wait for one to end.
  int max_connections = 512;
  // Connections from one address at once. Past it, the one that has waited longest for its
  // request is closed to make room (a trickling client's; one that sends its request at once
  // always gets in), and a new one is refused only while all of them are being answered. Every
  // client on the server's own machine is one address (127.0.0.1).
  int per_client = 256;
  // From a connection's start, or the end of its last response, to its next request read whole
  // (headers and body): a client slower than this is cut off.
  int64_t request_deadline_ms = 60000;
  // The request line and header fields together, in bytes; more is refused with 431.
  int64_t max_header_bytes = 64 << 10;
  // One write of a response that does not complete in this long (a client that stopped
  // reading) cuts the connection.
  int64_t write_timeout_ms = 60000;
};

// The options for them, one spec each for every server: --max-connections,
// --max-connections-per-client, --request-deadline-s, --max-header-kb (HETERO_* beside each).
std::vector<OptionSpec> connection_options();
Result<ConnectionLimits> connection_limits_from(const Options& opts);

// A check of a request in two steps: before its body is read (`head`: method, target,
// headers, no body) and after (`whole`). Returning false refuses the request with `refusal`;
// a refusal before the body closes the connection without reading it.
struct RequestCheck {
  std::function<bool(const HttpRequest& head, HttpResponse& refusal)> head;
  std::function<bool(const HttpRequest& whole, HttpResponse& refusal)> whole;
};

class HttpServer {
 public:
  // component names the log lines; error_body(status, message) makes the JSON body of the
  // errors the server answers itself.
  HttpServer(std::string component, ConnectionLimits limits,
             std::function<std::string(int status, const std::string& message)> error_body);
  ~HttpServer();  // stop()
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Exact paths. A POST's body may be at most max_body_bytes (413 past it, chunked or not).
  void get(std::string path, HttpHandler h);
  void post(std::string path, HttpHandler h, int64_t max_body_bytes);
  void set_check(RequestCheck check);
  // Runs after every handler, before the response is written.
  void set_after(std::function<void(const HttpRequest&, HttpResponse&)> after);

  // Binds host:port (0: any free port) and serves on threads of its own.
  Status start(const std::string& host, int port);
  int port() const { return port_; }
  // Stops accepting, cuts every connection (a handler's writes then fail), and waits for the
  // connection threads; handlers still running must end on their own (their writes fail).
  void stop();

  // Whether the client that sent `req` has hung up while its request is being answered.
  bool client_gone(const HttpRequest& req);
  bool client_gone(uint64_t connection);

  // Connections closed by the server so far (for tests and logs): past their deadline, refused
  // at once (every connection of their kind being answered), or closed to make room for a new
  // one (the one that waited longest for its request).
  int64_t cut_late() const { return cut_late_.load(); }
  int64_t cut_crowded() const { return cut_crowded_.load(); }
  int64_t evicted() const { return evicted_.load(); }

 private:
  struct Route {
    HttpHandler handler;
    int64_t max_body_bytes = 0;
  };
  enum class Phase { kReading, kHandling, kWriting };
  struct Conn {
    int fd = -1;
    std::string addr;
    int port = 0;
    Phase phase = Phase::kReading;
    int64_t since_ms = 0;
    bool cut = false;
  };
  friend class ConnectionIo;

  void accept_loop();
  void watch_loop();
  void serve(uint64_t id, int fd);
  // One request on the connection; whether the connection may serve another.
  bool serve_one(ConnectionIo& io, uint64_t id, const std::string& addr, int port);
  // Answers `res` for a request the server refused itself (no handler ran).
  bool refuse(ConnectionIo& io, const HttpRequest& req, int status, const std::string& message,
              bool keep_alive);
  void set_phase(uint64_t id, Phase phase);
  bool was_cut(uint64_t id);
  bool peer_gone_locked(const Conn& c) const;
  // Connections not cut, of addr (null: of anyone). With mu_.
  int64_t held_locked(const std::string* addr) const;
  // Room for a new connection from addr under the caps, or false. With mu_.
  bool make_room_locked(const std::string& addr);

  std::string component_;
  ConnectionLimits limits_;
  std::function<std::string(int, const std::string&)> error_body_;
  std::map<std::string, std::map<std::string, Route>> routes_;  // by method, then path
  uint64_t max_body_bytes_ = 0;                                 // the largest of the routes'
  RequestCheck check_;
  std::function<void(const HttpRequest&, HttpResponse&)> after_;

  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::condition_variable changed_;
  std::map<uint64_t, Conn> conns_;
  uint64_t next_id_ = 1;
  int live_threads_ = 0;
  std::vector<std::pair<uint64_t, int>> waiting_;  // accepted, waiting for a thread
  std::thread accept_thread_, watch_thread_;
  std::atomic<int64_t> cut_late_{0}, cut_crowded_{0}, evicted_{0};
};

}  // namespace hetero
