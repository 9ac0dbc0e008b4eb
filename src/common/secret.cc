// The stack's shared secret: see secret.h.
#include "common/secret.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

namespace hetero {

constexpr size_t kSecretBytes = 32;
constexpr size_t kMinSecretChars = 32;  // 128 bits as hex: a guessable secret is refused
constexpr size_t kMaxSecretChars = 4096;
constexpr size_t kMaxSecretFileBytes = 65536;

OptionSpec secret_file_option(std::string help) {
  return {"secret-file", "HETERO_SECRET_FILE", "", std::move(help)};
}

Status write_new_secret_file(const std::string& path) {
  unsigned char bytes[kSecretBytes];
  for (size_t got = 0; got < kSecretBytes;) {
    const ssize_t n = getrandom(bytes + got, kSecretBytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return internal_error(std::string("getrandom: ") + std::strerror(errno));
    got += static_cast<size_t>(n);
  }
  std::string hex;
  for (unsigned char b : bytes) {
    char two[3];
    std::snprintf(two, sizeof two, "%02x", b);
    hex += two;
  }
  hex += "\n";
  const std::string tmp = path + ".tmp";
  ::unlink(tmp.c_str());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return unavailable("cannot create " + tmp + ": " + std::strerror(errno));
  const bool written = ::write(fd, hex.data(), hex.size()) == static_cast<ssize_t>(hex.size());
  const bool closed = ::close(fd) == 0;
  if (!written || !closed || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    return unavailable("cannot write " + path + ": " + why);
  }
  return Status::ok();
}

Result<std::string> read_secret_file(const std::string& path) {
  if (path.empty()) return std::string();
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return not_found("cannot read the secret file " + path);
  // A secret others can read is no secret; one they can write could be swapped for theirs.
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%03o", static_cast<unsigned>(st.st_mode & 0777));
    return invalid_argument("the secret file " + path + " has mode " + mode +
                            ": others may read or change it (chmod 600 " + path + ")");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found("cannot read the secret file " + path);
  std::string text(kMaxSecretFileBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  const size_t begin = text.find_first_not_of(" \t\r\n");
  const size_t end = text.find_last_not_of(" \t\r\n");
  const std::string secret = begin == std::string::npos ? "" : text.substr(begin, end - begin + 1);
  bool printable = true;
  for (char c : secret) printable = printable && c > ' ' && c < 0x7f;
  if (text.size() > kMaxSecretFileBytes || secret.size() < kMinSecretChars ||
      secret.size() > kMaxSecretChars || !printable)
    return invalid_argument("the secret file " + path + " must hold one token of " +
                            std::to_string(kMinSecretChars) +
                            " to 4096 printable ASCII characters (hetero up writes 64 random hex "
                            "digits)");
  return secret;
}

}  // namespace hetero
