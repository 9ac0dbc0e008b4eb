// A store entry's cache file written in place: see store_file.h.
#include "bridge/store_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

namespace hetero {
namespace {

constexpr int64_t kPrefix = 8;  // the header's length, little-endian u64

Status io_error(const std::string& what, const std::string& path) {
  return unavailable(what + " " + path + ": " + std::strerror(errno));
}

// All n bytes at `at`, written from or read into data, through short transfers and EINTR.
Status transfer_all(int fd, void* data, int64_t n, int64_t at, const std::string& path,
                    bool write) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t done = write ? ::pwrite(fd, p, static_cast<size_t>(n), at)
                               : ::pread(fd, p, static_cast<size_t>(n), at);
    if (done < 0 && errno == EINTR) continue;
    if (done <= 0) return io_error(write ? "cannot write" : "cannot read", path);
    p += done, n -= done, at += done;
  }
  return Status::ok();
}

Status pwrite_all(int fd, const void* data, int64_t n, int64_t at, const std::string& path) {
  return transfer_all(fd, const_cast<void*>(data), n, at, path, /*write=*/true);
}

Status pread_all(int fd, void* data, int64_t n, int64_t at, const std::string& path) {
  return transfer_all(fd, data, n, at, path, /*write=*/false);
}

}  // namespace

Result<StoreFile> StoreFile::create(const std::string& dir, std::vector<std::string> names,
                                    int64_t heads, int64_t rows, int64_t head_dim) {
  if (names.empty() || heads <= 0 || rows <= 0 || head_dim <= 0)
    return invalid_argument("a store file needs arrays of a positive shape");
  std::error_code ec;
  if (!std::filesystem::create_directories(dir, ec) || ec)
    return unavailable("cannot create " + dir + (ec ? ": " + ec.message() : ": it exists"));
  StoreFile f;
  f.dir_ = dir;
  f.path_ = dir + "/cache.safetensors";
  std::sort(names.begin(), names.end());
  f.names_ = std::move(names);
  f.heads_ = heads, f.rows_ = rows, f.head_dim_ = head_dim;
  f.header_bytes_ = static_cast<int64_t>(f.header(rows).size());
  f.fd_ = ::open(f.path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (f.fd_ < 0) return io_error("cannot create", f.path_);
  const int64_t size =
      kPrefix + f.header_bytes_ + f.array_bytes(rows) * static_cast<int64_t>(f.names_.size());
  if (::ftruncate(f.fd_, size) != 0) return io_error("cannot size", f.path_);
  return f;
}

StoreFile::StoreFile(StoreFile&& o) noexcept { *this = std::move(o); }

StoreFile& StoreFile::operator=(StoreFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(o.fd_, -1);
    dir_ = std::move(o.dir_), path_ = std::move(o.path_), names_ = std::move(o.names_);
    heads_ = o.heads_, rows_ = o.rows_, head_dim_ = o.head_dim_, header_bytes_ = o.header_bytes_;
  }
  return *this;
}

StoreFile::~StoreFile() {
  if (fd_ >= 0) ::close(fd_);
}

int64_t StoreFile::index_of(const std::string& name) const {
  auto it = std::lower_bound(names_.begin(), names_.end(), name);
  return it != names_.end() && *it == name ? it - names_.begin() : -1;
}

std::string StoreFile::header(int64_t rows) const {
  nlohmann::json h = nlohmann::json::object();
  int64_t offset = 0;
  for (const std::string& name : names_) {
    h[name] = {{"dtype", "BF16"},
               {"shape", {heads_, rows, head_dim_}},
               {"data_offsets", {offset, offset + array_bytes(rows)}}};
    offset += array_bytes(rows);
  }
  std::string s = h.dump();
  // Padded with spaces (safetensors allows it) to the reserved length, which keeps the data
  // 8-byte aligned; a shorter prefix's header is never longer than the reserved one.
  const size_t want =
      header_bytes_ > 0 ? static_cast<size_t>(header_bytes_) : (s.size() + 7) / 8 * 8;
  s.resize(std::max(want, s.size()), ' ');
  return s;
}

Status StoreFile::rows(const std::string& name, int64_t pos0, int64_t n, uint16_t* data,
                       bool write) const {
  const int64_t i = index_of(name);
  if (fd_ < 0 || i < 0 || pos0 < 0 || n < 0 || pos0 + n > rows_)
    return invalid_argument("store file: rows [" + std::to_string(pos0) + ", " +
                            std::to_string(pos0 + n) + ") of '" + name + "' are not in it");
  const int64_t base = kPrefix + header_bytes_ + i * array_bytes(rows_);
  const int64_t row = head_dim_ * 2;
  for (int64_t h = 0; h < heads_; ++h) {
    const int64_t at = base + (h * rows_ + pos0) * row;
    HETERO_RETURN_IF_ERROR(transfer_all(fd_, data + h * n * head_dim_, n * row, at, path_, write));
  }
  return Status::ok();
}

Status StoreFile::seal(int64_t b) {
  if (fd_ < 0) return failed_precondition("store file " + path_ + " is already sealed");
  if (b < 1 || b > rows_)
    return invalid_argument("store file: cannot keep " + std::to_string(b) + " rows");
  const int64_t data = kPrefix + header_bytes_, row = head_dim_ * 2;
  if (b < rows_) {
    // Each head's first b rows move to their place in the shorter layout. Destinations never
    // lie past their sources, so copying in file order, a bounded piece at a time, is safe.
    std::vector<char> buf(static_cast<size_t>(std::min<int64_t>(b * row, int64_t{8} << 20)));
    for (int64_t i = 0; i < static_cast<int64_t>(names_.size()); ++i)
      for (int64_t h = 0; h < heads_; ++h) {
        const int64_t src = data + i * array_bytes(rows_) + h * rows_ * row;
        const int64_t dst = data + i * array_bytes(b) + h * b * row;
        if (src == dst) continue;
        for (int64_t done = 0; done < b * row;) {
          const int64_t n = std::min<int64_t>(static_cast<int64_t>(buf.size()), b * row - done);
          HETERO_RETURN_IF_ERROR(pread_all(fd_, buf.data(), n, src + done, path_));
          HETERO_RETURN_IF_ERROR(pwrite_all(fd_, buf.data(), n, dst + done, path_));
          done += n;
        }
      }
    if (::ftruncate(fd_, data + array_bytes(b) * static_cast<int64_t>(names_.size())) != 0)
      return io_error("cannot shorten", path_);
  }
  const std::string h = header(b);
  const uint64_t len = h.size();
  HETERO_RETURN_IF_ERROR(pwrite_all(fd_, &len, kPrefix, 0, path_));
  HETERO_RETURN_IF_ERROR(pwrite_all(fd_, h.data(), static_cast<int64_t>(h.size()), kPrefix, path_));
  const int rc = ::close(std::exchange(fd_, -1));
  if (rc != 0) return io_error("cannot close", path_);
  return Status::ok();
}

}  // namespace hetero
