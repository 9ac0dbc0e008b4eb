// The connection guard (common/http_server.h) on a real cpp-httplib server over loopback: a
// client that trickles its request is cut at the deadline, a handler that runs longer than the
// deadline is not, a kept-alive connection gets a fresh deadline after each response, and an
// address past its connection cap has its new connections closed.
#include "common/http_server.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>

namespace hetero {
namespace {

using Clock = std::chrono::steady_clock;

class GuardedServer {
 public:
  explicit GuardedServer(ConnectionLimits limits) {
    guard_ = std::make_unique<ConnectionGuard>(server_, limits);
    server_.Get("/ok", guard_->handler([](const httplib::Request&, httplib::Response& res) {
      res.set_content("ok", "text/plain");
    }));
    server_.Get("/slow", guard_->handler([](const httplib::Request&, httplib::Response& res) {
      std::this_thread::sleep_for(std::chrono::milliseconds(900));
      res.set_content("slow", "text/plain");
    }));
    port_ = server_.bind_to_any_port("127.0.0.1");
    guard_->watch(port_, "test");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~GuardedServer() {
    server_.stop();
    thread_.join();
    guard_.reset();
  }
  int port() const { return port_; }
  const ConnectionGuard& guard() const { return *guard_; }

 private:
  httplib::Server server_;
  std::unique_ptr<ConnectionGuard> guard_;
  std::thread thread_;
  int port_ = 0;
};

int connect_to(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  return fd;
}

void send_text(int fd, const std::string& s) { (void)::send(fd, s.data(), s.size(), MSG_NOSIGNAL); }

// Waits up to `ms` for the server's end of the stream on fd (after whatever it sent): true if
// the connection was closed by then.
bool closed_within(int fd, int ms) {
  const auto end = Clock::now() + std::chrono::milliseconds(ms);
  char buf[4096];
  while (Clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    const int left = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count());
    if (::poll(&p, 1, std::max(left, 1)) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return true;
  }
  return false;
}

// Reads one small response (headers and a short body) from fd.
std::string read_response(int fd) {
  std::string got;
  char buf[4096];
  const auto end = Clock::now() + std::chrono::seconds(5);
  while (Clock::now() < end && got.find("\r\n\r\n") == std::string::npos) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    got.append(buf, static_cast<size_t>(n));
  }
  return got;
}

ConnectionLimits fast_limits() {
  ConnectionLimits l;
  l.max_connections = 16;
  l.per_client = 8;
  l.request_deadline_ms = 400;
  return l;
}

TEST(ConnectionGuard, TricklingClientIsCutAtTheDeadline) {
  GuardedServer server(fast_limits());
  const int fd = connect_to(server.port());
  send_text(fd, "GET /ok HTTP/1.1\r\nHost: x\r\n");
  const auto t0 = Clock::now();
  bool closed = false;
  // One header byte every 100 ms: cpp-httplib's per-read timeout alone would never end it.
  for (int i = 0; i < 30 && !closed; ++i) {
    send_text(fd, "X");
    closed = closed_within(fd, 100);
  }
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  EXPECT_TRUE(closed);
  EXPECT_GE(ms, 300);
  EXPECT_LT(ms, 1500);
  EXPECT_EQ(server.guard().cut_late(), 1);
  ::close(fd);
}

TEST(ConnectionGuard, HandlersLongerThanTheDeadlineAndKeptAliveConnectionsAreNotCut) {
  GuardedServer server(fast_limits());
  httplib::Client cli("127.0.0.1", server.port());
  cli.set_keep_alive(true);
  auto slow = cli.Get("/slow");  // 900 ms in its handler, past the 400 ms deadline
  ASSERT_TRUE(slow);
  EXPECT_EQ(slow->body, "slow");
  // Two more requests on the same connection, each 300 ms after the last response: every
  // response re-arms the deadline, so 600 ms in all is fine.
  for (int i = 0; i < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    auto ok = cli.Get("/ok");
    ASSERT_TRUE(ok) << i;
    EXPECT_EQ(ok->body, "ok");
  }
  EXPECT_EQ(server.guard().cut_late(), 0);
}

TEST(ConnectionGuard, AnAddressPastItsCapHasNewConnectionsClosed) {
  GuardedServer server(fast_limits());
  std::vector<int> held;
  for (int i = 0; i < 8; ++i) held.push_back(connect_to(server.port()));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const int extra = connect_to(server.port());
  EXPECT_TRUE(closed_within(extra, 300));
  EXPECT_EQ(server.guard().cut_crowded(), 1);
  // The held ones still get answers.
  send_text(held[0], "GET /ok HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_NE(read_response(held[0]).find("200 OK"), std::string::npos);
  for (int fd : held) ::close(fd);
  ::close(extra);
}

TEST(ConnectionGuard, LimitsComeFromOneOptionSpec) {
  std::vector<OptionSpec> specs = connection_options();
  Options opts("t", "t", specs);
  char a0[] = "t", a1[] = "--request-deadline-s", a2[] = "0";
  char* argv[] = {a0, a1, a2};
  ASSERT_TRUE(opts.parse(3, argv).is_ok());
  auto bad = connection_limits_from(opts);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("--request-deadline-s"), std::string::npos);
  Options defaults("t", "t", connection_options());
  char* argv0[] = {a0};
  ASSERT_TRUE(defaults.parse(1, argv0).is_ok());
  auto d = connection_limits_from(defaults);
  ASSERT_TRUE(d.is_ok());
  EXPECT_EQ(d->max_connections, 512);
  EXPECT_EQ(d->per_client, 256);
  EXPECT_EQ(d->request_deadline_ms, 60000);
}

}  // namespace
}  // namespace hetero
