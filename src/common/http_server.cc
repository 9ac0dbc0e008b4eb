// The HTTP server: see http_server.h.
#include "common/http_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <algorithm>
#include <array>
#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "common/log.h"

namespace hetero {
namespace beast = boost::beast;
namespace http = boost::beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

namespace {

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool same_name(std::string_view a, std::string_view b) {
  return a.size() == b.size() && strncasecmp(a.data(), b.data(), a.size()) == 0;
}

std::string find_header(const HttpHeaders& headers, std::string_view name) {
  for (const auto& [k, v] : headers)
    if (same_name(k, name)) return v;
  return "";
}

bool numeric_address(const sockaddr_storage& a, socklen_t len, std::string* host, int* port) {
  char h[NI_MAXHOST], p[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&a), len, h, sizeof h, p, sizeof p,
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return false;
  *host = h;
  *port = std::atoi(p);
  return true;
}

}  // namespace

// ---- requests and responses ------------------------------------------------------------

std::string HttpRequest::header(std::string_view name) const { return find_header(headers, name); }

bool HttpRequest::has_header(std::string_view name) const {
  for (const auto& [k, v] : headers)
    if (same_name(k, name)) return true;
  return false;
}

void HttpResponse::set_header(std::string name, std::string value) {
  for (auto& [k, v] : headers)
    if (same_name(k, name)) {
      v = std::move(value);
      return;
    }
  headers.emplace_back(std::move(name), std::move(value));
}

bool HttpResponse::has_header(std::string_view name) const {
  for (const auto& [k, v] : headers)
    if (same_name(k, name)) return true;
  return false;
}

std::string HttpResponse::header(std::string_view name) const { return find_header(headers, name); }

void HttpResponse::set_content(std::string content, std::string content_type) {
  body = std::move(content);
  set_header("Content-Type", std::move(content_type));
}

void HttpResponse::set_chunked(std::string content_type, std::function<bool(ChunkSink&)> provider,
                               std::function<void(bool)> on_end) {
  set_header("Content-Type", std::move(content_type));
  provider_ = std::move(provider);
  on_end_ = std::move(on_end);
}

// ---- options ---------------------------------------------------------------------------

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
      {"max-header-kb", "HETERO_MAX_HEADER_KB", std::to_string(d.max_header_bytes >> 10),
       "the request line and header fields of one request, in KiB; more is refused with 431"},
  };
}

Result<ConnectionLimits> connection_limits_from(const Options& opts) {
  struct Field {
    const char* name;
    int64_t lo, hi;
  };
  int64_t v[4] = {};
  const Field fields[4] = {{"max-connections", 4, 65536},
                           {"max-connections-per-client", 1, 65536},
                           {"request-deadline-s", 1, 86400},
                           {"max-header-kb", 1, 1024}};
  for (int i = 0; i < 4; ++i) {
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
  limits.max_header_bytes = v[3] << 10;
  return limits;
}

// ---- one connection's reads and writes ---------------------------------------------------

// A connection's socket, with the phase marks the watch thread reads: every write is timed.
class ConnectionIo : public ChunkSink {
 public:
  ConnectionIo(HttpServer* server, uint64_t id, int fd, int family, size_t buffer_bytes)
      : server_(server), id_(id), sock_(ioc_), buf_(buffer_bytes) {
    boost::system::error_code ec;
    sock_.assign(family == AF_INET6 ? tcp::v6() : tcp::v4(), fd, ec);
    HETERO_CHECK(!ec);
  }
  ~ConnectionIo() override {
    boost::system::error_code ec;
    sock_.close(ec);
  }

  tcp::socket& socket() { return sock_; }
  // Bounded: a header must fit (the parser stops at its header limit first); a body streams
  // through it into the request.
  beast::flat_buffer& buffer() { return buf_; }

  template <typename Msg>
  bool write_message(Msg& msg) {
    server_->set_phase(id_, HttpServer::Phase::kWriting);
    boost::system::error_code ec;
    http::write(sock_, msg, ec);
    server_->set_phase(id_, HttpServer::Phase::kHandling);
    return !ec;
  }

  template <typename Buffers>
  bool write_raw(const Buffers& buf) {
    server_->set_phase(id_, HttpServer::Phase::kWriting);
    boost::system::error_code ec;
    net::write(sock_, buf, ec);
    server_->set_phase(id_, HttpServer::Phase::kHandling);
    return !ec;
  }

  bool write_head(http::response_serializer<http::empty_body>& sr) {
    server_->set_phase(id_, HttpServer::Phase::kWriting);
    boost::system::error_code ec;
    http::write_header(sock_, sr, ec);
    server_->set_phase(id_, HttpServer::Phase::kHandling);
    failed_ = static_cast<bool>(ec);
    return !failed_;
  }

  // One chunk, written in slices of at most 1 MiB, each timed on its own: a frame of hundreds
  // of MB over a slow link is progress, not a stuck client.
  bool write(const char* data, size_t n) override {
    if (failed_) return false;
    if (n == 0) return true;  // an empty chunk would end the body
    char size[24];
    const int len = std::snprintf(size, sizeof size, "%zx\r\n", n);
    const net::const_buffer head(size, static_cast<size_t>(len)), tail("\r\n", 2);
    bool ok = true;
    if (n <= kSlice) {  // one write: a token's event leaves in one segment
      const std::array<net::const_buffer, 3> parts = {head, net::const_buffer(data, n), tail};
      ok = write_raw(parts);
    } else {
      ok = write_raw(head);
      for (size_t at = 0; ok && at < n; at += kSlice)
        ok = write_raw(net::const_buffer(data + at, std::min(kSlice, n - at)));
      ok = ok && write_raw(tail);
    }
    failed_ = !ok;
    return ok;
  }

  // Ends the connection so that what was written arrives whole: closing a socket with unread
  // input makes the kernel reset it, which drops a response still in flight (a refusal sent
  // before the client's body was read, say). So the write side first, then what the client
  // still sends is read and dropped, for at most 2 s and 1 MiB (RFC 9112, section 9.6).
  void linger_close() {
    const int fd = sock_.native_handle();
    ::shutdown(fd, SHUT_WR);
    char drop[16384];
    size_t total = 0;
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (total < (1u << 20)) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                            end - std::chrono::steady_clock::now())
                            .count();
      pollfd p{fd, POLLIN, 0};
      if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) break;
      const ssize_t got = ::recv(fd, drop, sizeof drop, 0);
      if (got <= 0) break;
      total += static_cast<size_t>(got);
    }
  }

  bool finish_chunks() {
    if (failed_) return false;
    server_->set_phase(id_, HttpServer::Phase::kWriting);
    boost::system::error_code ec;
    net::write(sock_, http::make_chunk_last(), ec);
    server_->set_phase(id_, HttpServer::Phase::kHandling);
    return !ec;
  }

  bool client_gone() override { return failed_ || server_->client_gone(id_); }

 private:
  static constexpr size_t kSlice = 1 << 20;
  HttpServer* server_;
  uint64_t id_;
  net::io_context ioc_;
  tcp::socket sock_;
  beast::flat_buffer buf_;
  bool failed_ = false;
};

namespace {

// Writes `res` (whole, or its head and then the provider's chunks); whether the connection may
// serve another request.
bool write_response(ConnectionIo& io, HttpResponse& res, bool keep_alive) {
  if (!res.chunked()) {
    http::response<http::string_body> msg;
    msg.version(11);
    msg.result(static_cast<unsigned>(res.status));
    for (const auto& [k, v] : res.headers) msg.insert(k, v);
    msg.body() = std::move(res.body);
    msg.keep_alive(keep_alive);
    msg.prepare_payload();
    return io.write_message(msg) && keep_alive;
  }
  http::response<http::empty_body> msg;
  msg.version(11);
  msg.result(static_cast<unsigned>(res.status));
  for (const auto& [k, v] : res.headers) msg.insert(k, v);
  msg.keep_alive(keep_alive);
  msg.chunked(true);
  http::response_serializer<http::empty_body> sr{msg};
  bool whole = false;
  if (io.write_head(sr)) {
    whole = res.provider_(io);
    // A provider that gave up leaves the body without its last chunk: the client sees a broken
    // stream, never a short one that looks whole.
    whole = whole && io.finish_chunks();
  }
  if (res.on_end_) res.on_end_(whole);
  return whole && keep_alive;
}

// The status and message for a request the parser refused.
std::pair<int, std::string> read_error(const boost::system::error_code& ec) {
  if (ec == http::error::header_limit || ec == http::error::buffer_overflow)
    return {431, "request header fields too large"};
  if (ec == http::error::body_limit) return {413, "request body too large"};
  return {400, "malformed HTTP request: " + ec.message()};
}

// A request target or method as the server's own messages quote it: printable ASCII, anything
// else as \xNN, at most 200 characters (a client controls every byte of it).
std::string printable(std::string_view s) {
  std::string out;
  for (unsigned char c : s.substr(0, 200)) {
    if (c >= 0x20 && c < 0x7f) {
      out.push_back(static_cast<char>(c));
    } else {
      char hex[5];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    }
  }
  return s.size() > 200 ? out + "..." : out;
}

bool quiet_end(const boost::system::error_code& ec) {
  return ec == http::error::end_of_stream || ec == net::error::eof ||
         ec == net::error::connection_reset || ec == net::error::broken_pipe ||
         ec == net::error::not_connected || ec == net::error::bad_descriptor ||
         ec == net::error::operation_aborted || ec == http::error::partial_message;
}

}  // namespace

// ---- the server ------------------------------------------------------------------------

HttpServer::HttpServer(std::string component, ConnectionLimits limits,
                       std::function<std::string(int, const std::string&)> error_body)
    : component_(std::move(component)), limits_(limits), error_body_(std::move(error_body)) {}

HttpServer::~HttpServer() { stop(); }

void HttpServer::get(std::string path, HttpHandler h) {
  routes_["GET"][std::move(path)] = Route{std::move(h), 0};
}

void HttpServer::post(std::string path, HttpHandler h, int64_t max_body_bytes) {
  max_body_bytes = std::max<int64_t>(max_body_bytes, 0);
  max_body_bytes_ = std::max(max_body_bytes_, static_cast<uint64_t>(max_body_bytes));
  routes_["POST"][std::move(path)] = Route{std::move(h), max_body_bytes};
}

void HttpServer::set_check(RequestCheck check) { check_ = std::move(check); }

void HttpServer::set_after(std::function<void(const HttpRequest&, HttpResponse&)> after) {
  after_ = std::move(after);
}

Status HttpServer::start(const std::string& host, int port) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  const std::string where = host + ":" + std::to_string(port);
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res)
    return unavailable("cannot resolve " + where);
  int fd = ::socket(res->ai_family, res->ai_socktype, res->ai_protocol);
  if (fd >= 0) ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  // SO_REUSEADDR only: SO_REUSEPORT would let a second server bind this port and take half
  // its connections.
  int yes = 1;
  const bool ok = fd >= 0 && setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes) == 0 &&
                  ::bind(fd, res->ai_addr, res->ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0;
  freeaddrinfo(res);
  if (!ok) {
    const std::string why = std::strerror(errno);
    if (fd >= 0) ::close(fd);
    return unavailable("cannot bind " + where + ": " + why);
  }
  sockaddr_storage local{};
  socklen_t len = sizeof local;
  std::string bound_host;
  getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len);
  numeric_address(local, len, &bound_host, &port_);
  listen_fd_ = fd;
  stopping_ = false;
  accept_thread_ = std::thread([this] { accept_loop(); });
  watch_thread_ = std::thread([this] { watch_loop(); });
  return Status::ok();
}

void HttpServer::accept_loop() {
  while (!stopping_.load()) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    sockaddr_storage peer{};
    socklen_t plen = sizeof peer;
    const int fd = ::accept(listen_fd_, reinterpret_cast<sockaddr*>(&peer), &plen);
    if (fd < 0) continue;
    ::fcntl(fd, F_SETFD, FD_CLOEXEC);  // children (the decoder) do not inherit connections
    // Streamed events are small writes: sent as they come, not held back for the next ACK.
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    std::string addr;
    int peer_port = 0;
    if (!numeric_address(peer, plen, &addr, &peer_port)) {
      ::close(fd);
      continue;
    }
    std::unique_lock<std::mutex> lock(mu_);
    if (!make_room_locked(addr)) {
      lock.unlock();
      ::close(fd);
      continue;
    }
    const uint64_t id = next_id_++;
    conns_[id] = Conn{fd, addr, peer_port, Phase::kReading, now_ms(), false};
    if (live_threads_ >= limits_.max_connections) {
      waiting_.emplace_back(id, fd);
      continue;
    }
    ++live_threads_;
    std::thread([this, id, fd] {
      uint64_t next = id;
      int next_fd = fd;
      while (true) {
        serve(next, next_fd);
        std::lock_guard<std::mutex> lock(mu_);
        if (waiting_.empty()) {
          --live_threads_;
          changed_.notify_all();
          return;
        }
        std::tie(next, next_fd) = waiting_.front();
        waiting_.erase(waiting_.begin());
      }
    }).detach();
  }
}

int64_t HttpServer::held_locked(const std::string* addr) const {
  int64_t n = 0;
  for (const auto& [_, c] : conns_) n += !c.cut && (addr == nullptr || c.addr == *addr);
  return n;
}

bool HttpServer::make_room_locked(const std::string& addr) {
  // Past a cap, the connection that has waited longest for its request makes room: a client
  // that sends its request at once always gets in, one that trickles loses its oldest. Only
  // when every connection of the kind is being answered is the new one closed.
  const std::pair<const std::string*, int64_t> caps[] = {
      {&addr, limits_.per_client}, {nullptr, 2 * int64_t{limits_.max_connections}}};
  for (const auto& [who, cap] : caps) {
    if (held_locked(who) < cap) continue;
    Conn* victim = nullptr;
    for (auto& [_, c] : conns_)
      if (!c.cut && c.phase == Phase::kReading && (who == nullptr || c.addr == *who) &&
          (victim == nullptr || c.since_ms < victim->since_ms))
        victim = &c;
    const std::string what = who ? "--max-connections-per-client" : "2 x --max-connections";
    if (victim == nullptr) {
      if (cut_crowded_.fetch_add(1) % 100 == 0)  // counted and logged before the close
        log_line(component_, "closed a new connection from " + addr + ": every one of its " +
                                 std::to_string(cap) + " (" + what + ") is being answered");
      return false;
    }
    if (evicted_.fetch_add(1) % 100 == 0)
      log_line(component_, "closed the connection from " + victim->addr +
                               " that waited longest for its request, to make room (" + what + ")");
    ::shutdown(victim->fd, SHUT_RDWR);
    victim->cut = true;
  }
  return true;
}

void HttpServer::watch_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_.load()) {
    changed_.wait_for(lock, std::chrono::milliseconds(100));
    const int64_t now = now_ms();
    for (auto& [_, c] : conns_) {
      if (c.cut) continue;
      const bool late_read =
          c.phase == Phase::kReading && now - c.since_ms > limits_.request_deadline_ms;
      const bool late_write =
          c.phase == Phase::kWriting && now - c.since_ms > limits_.write_timeout_ms;
      if (!late_read && !late_write) continue;
      if (cut_late_.fetch_add(1) % 100 == 0)  // counted and logged before the close
        log_line(component_,
                 "closed a connection from " + c.addr +
                     (late_read
                          ? ": no whole request in " + std::to_string(limits_.request_deadline_ms) +
                                " ms (--request-deadline-s)"
                          : ": a write blocked for " + std::to_string(limits_.write_timeout_ms) +
                                " ms (the client stopped reading)"));
      ::shutdown(c.fd, SHUT_RDWR);
      c.cut = true;
    }
  }
}

void HttpServer::set_phase(uint64_t id, Phase phase) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = conns_.find(id);
  if (it == conns_.end()) return;
  it->second.phase = phase;
  it->second.since_ms = now_ms();
}

bool HttpServer::was_cut(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = conns_.find(id);
  return it == conns_.end() || it->second.cut;
}

bool HttpServer::peer_gone_locked(const Conn& c) const {
  if (c.cut) return true;
    // The connection's thread reads nothing while it answers: a peer that closed shows as a
    // hang-up, or as readable with nothing to read (data sent ahead is not a hang-up).
#ifdef POLLRDHUP
  pollfd p{c.fd, static_cast<short>(POLLIN | POLLRDHUP), 0};
#else
  pollfd p{c.fd, POLLIN, 0};
#endif
  if (::poll(&p, 1, 0) != 1) return false;
#ifdef POLLRDHUP
  if (p.revents & POLLRDHUP) return true;
#endif
  if (p.revents & (POLLHUP | POLLERR)) return true;
  char b;
  return (p.revents & POLLIN) && ::recv(c.fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

bool HttpServer::client_gone(uint64_t connection) {
  std::lock_guard<std::mutex> lock(mu_);  // the socket is closed only after its record goes
  auto it = conns_.find(connection);
  return it == conns_.end() || peer_gone_locked(it->second);
}

bool HttpServer::client_gone(const HttpRequest& req) { return client_gone(req.connection); }

void HttpServer::serve(uint64_t id, int fd) {
  std::string addr;
  int peer_port = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    addr = conns_[id].addr;
    peer_port = conns_[id].port;
  }
  sockaddr_storage local{};
  socklen_t llen = sizeof local;
  getsockname(fd, reinterpret_cast<sockaddr*>(&local), &llen);
  {
    ConnectionIo io(this, id, fd, local.ss_family,
                    static_cast<size_t>(limits_.max_header_bytes) + (64 << 10));
    bool keep = true;
    while (keep && !stopping_.load()) {
      // Nothing may leave a connection's thread: an exception there ends the process. The
      // handler's own are answered with a 500 inside; this catches the rest (a check, an error
      // body, the after hook) and closes the connection.
      try {
        keep = serve_one(io, id, addr, peer_port);
      } catch (const std::exception& e) {
        log_line(component_,
                 std::string("closed a connection after an internal error: ") + e.what());
        keep = false;
      } catch (...) {
        log_line(component_, "closed a connection after an internal error");
        keep = false;
      }
      set_phase(id, Phase::kReading);  // the deadline for the next request starts now
    }
    if (!was_cut(id)) io.linger_close();
    std::lock_guard<std::mutex> lock(mu_);  // forgotten before its socket closes (fd reuse)
    conns_.erase(id);
    changed_.notify_all();
  }
}

bool HttpServer::refuse(ConnectionIo& io, const HttpRequest& req, int status,
                        const std::string& message, bool keep_alive) {
  HttpResponse res;
  res.status = status;
  res.set_content(error_body_(status, message), "application/json");
  if (after_) after_(req, res);
  return write_response(io, res, keep_alive);
}

bool HttpServer::serve_one(ConnectionIo& io, uint64_t id, const std::string& addr, int port) {
  // A large body (tens of MiB, or a refused one read up to the limit) is freed on this
  // connection's thread, and glibc keeps freed memory in that thread's arena: given back once
  // the request's memory is gone (declared first: it runs last). A soak's refused chunked
  // bodies grew the front door by 650 MB without it.
  struct TrimAfterLargeBody {
    bool large = false;
    ~TrimAfterLargeBody() {
#ifdef __GLIBC__
      if (large) malloc_trim(0);
#endif
    }
  } trim;
  http::request_parser<http::string_body> parser;
  parser.header_limit(static_cast<std::uint32_t>(limits_.max_header_bytes));
  // The largest any route takes until the target is known, then the route's own. (Beast 1.74
  // compares a length with an unset limit as larger: "no limit" would refuse every body.)
  parser.body_limit(max_body_bytes_);
  boost::system::error_code ec;
  http::read_header(io.socket(), io.buffer(), parser, ec);
  HttpRequest req;
  req.remote_addr = addr;
  req.remote_port = port;
  req.connection = id;
  if (ec) {
    if (ec != http::error::body_limit && (quiet_end(ec) || was_cut(id) || !parser.got_some()))
      return false;
    const auto [status, message] = read_error(ec);
    return refuse(io, req, status, message, false);
  }
  const auto& head = parser.get();
  req.method = std::string(head.method_string());
  req.target = std::string(head.target());
  req.path = req.target.substr(0, req.target.find('?'));
  for (const auto& f : head) req.headers.emplace_back(f.name_string(), f.value());
  const bool has_body = parser.chunked() || parser.content_length().value_or(0) > 0;
  // A request whose body stays unread ends its connection once answered.
  auto methods = routes_.find(req.method);
  const Route* route = nullptr;
  if (methods != routes_.end()) {
    auto r = methods->second.find(req.path);
    if (r != methods->second.end()) route = &r->second;
  }
  if (route == nullptr) {
    bool elsewhere = false;
    for (const auto& [m, paths] : routes_) elsewhere = elsewhere || paths.count(req.path);
    return elsewhere
               ? refuse(io, req, 405,
                        printable(req.method) + " is not served on " + printable(req.path), false)
               : refuse(io, req, 404,
                        "no route " + printable(req.method) + " " + printable(req.path), false);
  }
  HttpResponse refusal;
  if (check_.head && !check_.head(req, refusal)) {
    if (after_) after_(req, refusal);
    return write_response(io, refusal, !has_body) && !has_body;
  }
  if (has_body) {
    const uint64_t limit = static_cast<uint64_t>(route->max_body_bytes);
    if (parser.content_length().value_or(0) > limit)
      return refuse(io, req, 413, "request body too large", false);
    parser.body_limit(limit);  // a chunked body is counted as it arrives
    if (same_name(req.header("Expect"), "100-continue") &&
        !io.write_raw(net::buffer(std::string_view("HTTP/1.1 100 Continue\r\n\r\n"))))
      return false;
    http::read(io.socket(), io.buffer(), parser, ec);
    trim.large = parser.get().body().capacity() >= (8u << 20);
    if (ec) {
      if (ec != http::error::body_limit && (quiet_end(ec) || was_cut(id))) return false;
      const auto [status, message] = read_error(ec);
      return refuse(io, req, status, message, false);
    }
    req.body = std::move(parser.get().body());
  }
  const bool keep_alive = parser.get().keep_alive() && !stopping_.load();
  set_phase(id, Phase::kHandling);
  if (check_.whole && !check_.whole(req, refusal)) {
    if (after_) after_(req, refusal);
    return write_response(io, refusal, keep_alive);
  }
  HttpResponse res;
  try {
    route->handler(req, res);
  } catch (const std::exception& e) {
    log_line(component_, "internal error in " + req.method + " " + req.path + ": " + e.what());
    res = HttpResponse();
    res.status = 500;
    res.set_content(error_body_(500, "internal error; see the " + component_ + "'s log"),
                    "application/json");
  }
  if (after_) after_(req, res);
  return write_response(io, res, keep_alive);
}

void HttpServer::stop() {
  stopping_.store(true);
  if (accept_thread_.joinable()) accept_thread_.join();
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    listen_fd_ = -1;
  }
  std::unique_lock<std::mutex> lock(mu_);
  // Every connection cut: reads and writes fail at once, a handler's next write too. Those
  // waiting for a thread end as soon as they get one.
  for (auto& [_, c] : conns_) {
    ::shutdown(c.fd, SHUT_RDWR);
    c.cut = true;
  }
  changed_.notify_all();
  changed_.wait(lock, [this] { return live_threads_ == 0 && waiting_.empty(); });
  lock.unlock();
  if (watch_thread_.joinable()) watch_thread_.join();
}

}  // namespace hetero
