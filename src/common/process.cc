// Child process management: see process.h.
#include "common/process.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

namespace hetero {

Status ChildProcess::start(const std::vector<std::string>& argv,
                           const std::vector<std::string>& env, const std::string& log_path) {
  HETERO_CHECK(pid_ < 0 && !argv.empty());
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) return unavailable("fork failed");
  if (pid == 0) {
    setpgid(0, 0);  // own process group, so stop() reaches its children too
    // The child dies with its parent (`hetero up` killed, crashed): never an orphan holding a
    // port and memory. A parent already gone before this line is caught by the check after it.
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(1);
    if (!log_path.empty()) {
      int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) dup2(fd, 1), dup2(fd, 2), close(fd);
    }
    for (const auto& kv : env) putenv(const_cast<char*>(kv.c_str()));
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    _exit(127);
  }
  pid_ = pid;
  exit_reason_.clear();
  return Status::ok();
}

void ChildProcess::reaped(int wait_status) {
  pid_ = -1;
  if (WIFSIGNALED(wait_status)) {
    const int sig = WTERMSIG(wait_status);
    exit_reason_ = "killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  } else {
    exit_reason_ = "exited with status " + std::to_string(WEXITSTATUS(wait_status));
  }
}

bool ChildProcess::running() {
  if (pid_ < 0) return false;
  int st;
  if (waitpid(pid_, &st, WNOHANG) == pid_) {
    reaped(st);
    return false;
  }
  return true;
}

void ChildProcess::stop(int grace_ms) {
  if (pid_ < 0) return;
  kill(-pid_, SIGTERM);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(grace_ms);
  while (std::chrono::steady_clock::now() < deadline) {
    int st;
    if (waitpid(pid_, &st, WNOHANG) == pid_) return reaped(st);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  kill(-pid_, SIGKILL);
  int st;
  waitpid(pid_, &st, 0);
  reaped(st);
}

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

}  // namespace hetero
