// libFuzzer target: the project's HTTP server (common/http_server.h) over a real loopback
// socket. One server, started once with small limits (4 KiB of request line and headers, a 2 s
// request deadline, 4 KiB bodies), serves GET /health, POST /echo and POST /stream (answered
// chunked) behind a check that refuses a request carrying X-Deny before its body is read (and
// one carrying X-Deny-Whole after). Each input goes out on a fresh connection, in up to four
// pieces (fuzz_inputs.h), then the connection's write side is shut and the reply read until the
// server closes. The server must not crash, must close within its deadline, and every byte it
// sends must be whole HTTP/1.1 responses one after another (a reset may cut only the last); a
// fresh GET /health must be answered 200 after every 1000th input. A failed property aborts.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/buffer.hpp>
#include <boost/beast/http.hpp>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "common/http_server.h"
#include "fuzz_inputs.h"

namespace {

namespace http = boost::beast::http;

constexpr int64_t kDeadlineMs = 2000;
constexpr int64_t kBodyBytes = 4096;
// Past the server's deadline, how long a close may take on a loaded machine before it is a hang.
constexpr int64_t kSlackMs = 1500;
constexpr int kHealthEvery = 1000;

hetero::HttpServer* server = nullptr;

[[noreturn]] void fail(const char* what, std::string_view reply) {
  // The reply's first 4 KiB, bytes outside printable ASCII as \xNN (CR LF as \r\n).
  std::string shown;
  for (unsigned char c : reply.substr(0, 4096)) {
    char esc[8];
    if (c == '\r' || c == '\n')
      shown += c == '\r' ? "\\r" : "\\n\n";
    else if (c >= 0x20 && c < 0x7f)
      shown += static_cast<char>(c);
    else
      shown.append(esc, std::snprintf(esc, sizeof esc, "\\x%02x", c));
  }
  std::fprintf(stderr, "http_server_fuzz: %s; the reply (%zu bytes):\n%s\n", what, reply.size(),
               shown.c_str());
  std::abort();
}

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The server's own error bodies are JSON dumped strictly: a message quoting bytes that are not
// UTF-8 throws. This target found that a request target of such bytes ended the process (the
// seed regression-target-not-utf8): the server now quotes targets escaped, and catches what
// leaves a connection's thread.
std::string error_body(int status, const std::string& message) {
  return nlohmann::json{{"error", {{"status", status}, {"message", message}}}}.dump();
}

void start_server() {
  hetero::ConnectionLimits limits;
  limits.request_deadline_ms = kDeadlineMs;
  limits.write_timeout_ms = kDeadlineMs;
  limits.max_header_bytes = 4096;
  server = new hetero::HttpServer("fuzz", limits, error_body);
  server->get("/health", [](const hetero::HttpRequest&, hetero::HttpResponse& res) {
    res.set_content(R"({"status":"ok"})", "application/json");
  });
  server->post(
      "/echo",
      [](const hetero::HttpRequest& req, hetero::HttpResponse& res) {
        res.set_content(req.body, "application/octet-stream");
      },
      kBodyBytes);
  server->post(
      "/stream",
      [](const hetero::HttpRequest& req, hetero::HttpResponse& res) {
        const std::string body = req.body;
        res.set_chunked("text/event-stream", [body](hetero::ChunkSink& sink) {
          for (size_t at = 0; at < body.size(); at += 1000)
            if (!sink.write("data: " + body.substr(at, 1000) + "\n\n")) return false;
          return sink.write("data: [DONE]\n\n");
        });
      },
      kBodyBytes);
  hetero::RequestCheck check;
  check.head = [](const hetero::HttpRequest& req, hetero::HttpResponse& refusal) {
    if (!req.has_header("X-Deny")) return true;
    refusal.status = 403;
    refusal.set_content(error_body(403, "denied before the body"), "application/json");
    return false;
  };
  check.whole = [](const hetero::HttpRequest& req, hetero::HttpResponse& refusal) {
    if (!req.has_header("X-Deny-Whole")) return true;
    refusal.status = 401;
    refusal.set_content(error_body(401, "denied after the body"), "application/json");
    return false;
  };
  server->set_check(std::move(check));
  server->set_after(
      [](const hetero::HttpRequest&, hetero::HttpResponse& res) { res.set_header("X-Fuzz", "1"); });
  if (!server->start("127.0.0.1", 0).is_ok()) {
    std::fprintf(stderr, "http_server_fuzz: the server did not start\n");
    std::abort();
  }
}

// One connection: `bytes` sent in `plan.pieces` pieces while the reply is read (a server that
// answers as it reads never waits on this client), the write side shut after the last. Returns
// the reply; *reset: the connection ended with a reset rather than the server's close.
std::string exchange(std::string_view bytes, hetero::fuzz::HttpPlan plan, bool* reset) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) fail("no socket", "");
  // Closed with a reset: a million connections leave nothing in TIME_WAIT.
  const linger no_linger{1, 0};
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &no_linger, sizeof no_linger);
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(server->port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const int64_t t0 = now_ms();
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0 &&
      errno != EINPROGRESS)
    fail("cannot connect", "");

  std::string reply;
  *reset = false;
  const size_t piece = (bytes.size() + plan.pieces - 1) / plan.pieces;
  size_t sent = 0, piece_end = std::min(piece, bytes.size());
  bool sending = true;
  while (true) {
    const int64_t now = now_ms();
    if (now - t0 > kDeadlineMs + kSlackMs) fail("the server neither answered nor closed", reply);
    if (sending && sent == bytes.size()) {
      ::shutdown(fd, SHUT_WR);
      sending = false;
    }
    pollfd p{fd, static_cast<short>(POLLIN | (sending ? POLLOUT : 0)), 0};
    ::poll(&p, 1, 50);
    if (sending && (p.revents & (POLLOUT | POLLERR | POLLHUP))) {
      const ssize_t n = ::send(fd, bytes.data() + sent, piece_end - sent, MSG_NOSIGNAL);
      if (n > 0) {
        sent += static_cast<size_t>(n);
        if (sent == piece_end && sent < bytes.size()) {
          piece_end = std::min(sent + piece, bytes.size());
          if (plan.pause) ::usleep(100);
        }
      } else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        // The server closed without reading all: a reset, which may also have dropped the end
        // of what it wrote. This send took the socket's error, so a read now ends as if at a
        // clean close: remember it.
        sending = false;
        *reset = true;
      }
    }
    if (p.revents & (POLLIN | POLLERR | POLLHUP)) {
      char buf[16384];
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n > 0) {
        reply.append(buf, static_cast<size_t>(n));
      } else if (n == 0) {
        break;
      } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        *reset = true;
        break;
      }
    }
  }
  ::close(fd);
  return reply;
}

// Whether the reply is whole HTTP/1.1 responses one after another (interim 100 Continue
// included); after a reset the last may stop short. nullptr when it is, else what is wrong.
const char* reply_error(std::string_view reply, bool reset) {
  constexpr std::string_view kStart = "HTTP/1.1 ";
  size_t at = 0;
  while (at < reply.size()) {
    const std::string_view rest = reply.substr(at);
    if (rest.substr(0, kStart.size()) != kStart.substr(0, std::min(rest.size(), kStart.size())))
      return "a response does not start with \"HTTP/1.1 \"";
    http::response_parser<http::string_body> parser;
    parser.header_limit(1 << 20);
    parser.body_limit(uint64_t{1} << 30);
    parser.eager(true);
    boost::system::error_code ec;
    while (!parser.is_done()) {
      const size_t n = parser.put(boost::asio::buffer(reply.data() + at, reply.size() - at), ec);
      at += n;
      if (ec == http::error::need_more) break;
      if (ec) return "a response does not parse";
      if (n == 0) break;
    }
    if (!parser.is_done()) return reset ? nullptr : "the server closed inside a response";
    const auto& msg = parser.get();
    if (msg.version() != 11) return "a response is not HTTP/1.1";
    if (msg.result_int() >= 200 && !msg.has_content_length() && !msg.chunked())
      return "a final response has neither a length nor chunks";
  }
  return nullptr;
}

void check_health() {
  bool reset = false;
  const std::string reply = exchange(
      "GET /health HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n\r\n", {1, false}, &reset);
  if (reply.rfind("HTTP/1.1 200 ", 0) != 0) fail("GET /health was not answered 200", reply);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  // libFuzzer's leak check after each input races with the server's detached connection
  // threads, which free a connection's buffers just after its client has read the close: it
  // reported one such connection as leaked at run 88,377 of a 1M run (not reproduced in 3,000
  // runs of that input). Off, unless asked for; LeakSanitizer still checks the whole run at exit.
  bool leaks_flag = false;
  for (int i = 1; i < *argc; ++i)
    leaks_flag = leaks_flag || std::string_view((*argv)[i]).starts_with("-detect_leaks=");
  if (!leaks_flag) {
    static std::vector<char*> args(*argv, *argv + *argc);
    static char no_leak_check[] = "-detect_leaks=0";
    args.insert(args.begin() + 1, no_leak_check);
    args.push_back(nullptr);
    *argv = args.data();
    ++*argc;
  }
  start_server();
  check_health();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  bool reset = false;
  const std::string reply =
      exchange(std::string_view(reinterpret_cast<const char*>(data + 1), size - 1),
               hetero::fuzz::http_plan(data[0]), &reset);
  if (const char* why = reply_error(reply, reset)) fail(why, reply);
  static int count = 0;
  if (++count % kHealthEvery == 0) check_health();
  return 0;
}
