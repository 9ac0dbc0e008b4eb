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

Result<StoreFile> StoreFile::create(const std::string& dir, std::vector<StoreArray> arrays,
                                    const std::vector<std::string>& tail_names) {
  if (arrays.empty()) return invalid_argument("a store file needs arrays");
  for (const StoreArray& a : arrays)
    if (a.outer <= 0 || a.rows < 0 || a.width <= 0)
      return invalid_argument("store file: array '" + a.name + "' has no positive shape");
  std::error_code ec;
  if (!std::filesystem::create_directories(dir, ec) || ec)
    return unavailable("cannot create " + dir + (ec ? ": " + ec.message() : ": it exists"));
  StoreFile f;
  f.dir_ = dir;
  f.path_ = dir + "/cache.safetensors";
  std::sort(arrays.begin(), arrays.end(),
            [](const StoreArray& x, const StoreArray& y) { return x.name < y.name; });
  f.arrays_ = std::move(arrays);
  f.tail_names_ = tail_names;
  int64_t end = 0;
  std::vector<int64_t> most;
  for (const StoreArray& a : f.arrays_) {
    f.offsets_.push_back(end);
    end += bytes(a, a.rows);
    most.push_back(a.rows);
  }
  // The longest header: every array at its most rows, every tail array with a shape and offsets
  // of as many digits as any can have.
  TensorViews widest;
  for (const std::string& name : tail_names)
    widest.emplace(
        name,
        TensorView{
            DType::kBF16, {1, 1, int64_t{1} << 40, int64_t{1} << 40}, nullptr, int64_t{1} << 50});
  HETERO_ASSIGN_OR_RETURN(std::string h, f.header(most, widest));
  f.header_bytes_ = static_cast<int64_t>(h.size());
  f.fd_ = ::open(f.path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (f.fd_ < 0) return io_error("cannot create", f.path_);
  if (::ftruncate(f.fd_, kPrefix + f.header_bytes_ + end) != 0)
    return io_error("cannot size", f.path_);
  return f;
}

Result<StoreFile> StoreFile::create(const std::string& dir, const std::vector<std::string>& names,
                                    int64_t heads, int64_t rows, int64_t head_dim) {
  std::vector<StoreArray> arrays;
  for (const std::string& name : names) arrays.push_back({name, heads, rows, head_dim});
  if (rows <= 0) return invalid_argument("a store file needs arrays of a positive shape");
  return create(dir, std::move(arrays));
}

StoreFile::StoreFile(StoreFile&& o) noexcept { *this = std::move(o); }

StoreFile& StoreFile::operator=(StoreFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(o.fd_, -1);
    dir_ = std::move(o.dir_), path_ = std::move(o.path_), arrays_ = std::move(o.arrays_);
    offsets_ = std::move(o.offsets_), tail_names_ = std::move(o.tail_names_);
    header_bytes_ = o.header_bytes_;
  }
  return *this;
}

StoreFile::~StoreFile() {
  if (fd_ >= 0) ::close(fd_);
}

int64_t StoreFile::index_of(const std::string& name) const {
  auto it = std::lower_bound(arrays_.begin(), arrays_.end(), name,
                             [](const StoreArray& a, const std::string& n) { return a.name < n; });
  return it != arrays_.end() && it->name == name ? it - arrays_.begin() : -1;
}

Result<std::string> StoreFile::header(const std::vector<int64_t>& rows,
                                      const TensorViews& tail) const {
  nlohmann::json h = nlohmann::json::object();
  int64_t offset = 0;
  for (size_t i = 0; i < arrays_.size(); ++i) {
    const StoreArray& a = arrays_[i];
    h[a.name] = {{"dtype", "BF16"},
                 {"shape", {a.outer, rows[i], a.width}},
                 {"data_offsets", {offset, offset + bytes(a, rows[i])}}};
    offset += bytes(a, rows[i]);
  }
  for (const auto& [name, v] : tail) {
    if (h.contains(name) ||
        std::find(tail_names_.begin(), tail_names_.end(), name) == tail_names_.end())
      return invalid_argument("store file: '" + name + "' is not one of its tail arrays");
    h[name] = {{"dtype", dtype_name(v.dtype)},
               {"shape", v.shape},
               {"data_offsets", {offset, offset + v.nbytes}}};
    offset += v.nbytes;
  }
  std::string s = h.dump();
  // Padded with spaces (safetensors allows it) to the reserved length, which keeps the data
  // 8-byte aligned; a shorter prefix's header is never longer than the reserved one.
  if (header_bytes_ > 0 && static_cast<int64_t>(s.size()) > header_bytes_)
    return internal_error("store file: the header outgrew its reserved " +
                          std::to_string(header_bytes_) + " bytes");
  const size_t want =
      header_bytes_ > 0 ? static_cast<size_t>(header_bytes_) : (s.size() + 7) / 8 * 8;
  s.resize(std::max(want, s.size()), ' ');
  return s;
}

Status StoreFile::rows(const std::string& name, int64_t pos0, int64_t n, uint16_t* data,
                       bool write) const {
  const int64_t i = index_of(name);
  if (fd_ < 0 || i < 0 || pos0 < 0 || n < 0 || pos0 + n > arrays_[static_cast<size_t>(i)].rows)
    return invalid_argument("store file: rows [" + std::to_string(pos0) + ", " +
                            std::to_string(pos0 + n) + ") of '" + name + "' are not in it");
  const StoreArray& a = arrays_[static_cast<size_t>(i)];
  const int64_t base = kPrefix + header_bytes_ + offsets_[static_cast<size_t>(i)];
  const int64_t row = a.width * 2;
  for (int64_t h = 0; h < a.outer; ++h) {
    const int64_t at = base + (h * a.rows + pos0) * row;
    HETERO_RETURN_IF_ERROR(transfer_all(fd_, data + h * n * a.width, n * row, at, path_, write));
  }
  return Status::ok();
}

Status StoreFile::seal(int64_t b) {
  std::map<std::string, int64_t> kept;
  for (const StoreArray& a : arrays_) kept[a.name] = b;
  if (b < 1) return invalid_argument("store file: cannot keep " + std::to_string(b) + " rows");
  return seal(kept);
}

Status StoreFile::seal(const std::map<std::string, int64_t>& kept, const TensorViews& tail) {
  if (fd_ < 0) return failed_precondition("store file " + path_ + " is already sealed");
  std::vector<int64_t> rows;
  for (const StoreArray& a : arrays_) {
    auto it = kept.find(a.name);
    const int64_t b = it == kept.end() ? -1 : it->second;
    if (b < 0 || b > a.rows)
      return invalid_argument("store file: cannot keep " + std::to_string(b) + " rows of '" +
                              a.name + "'");
    rows.push_back(b);
  }
  HETERO_ASSIGN_OR_RETURN(const std::string h, header(rows, tail));
  const int64_t data = kPrefix + header_bytes_;
  // Each array's (and each outer slice's) first rows move to their place in the shorter layout.
  // Destinations never lie past their sources, so copying in file order, a bounded piece at a
  // time, is safe.
  std::vector<char> buf(size_t{8} << 20);
  int64_t end = 0;
  for (size_t i = 0; i < arrays_.size(); ++i) {
    const StoreArray& a = arrays_[i];
    const int64_t row = a.width * 2, b = rows[i];
    for (int64_t o = 0; o < a.outer; ++o) {
      const int64_t src = data + offsets_[i] + o * a.rows * row;
      const int64_t dst = data + end + o * b * row;
      if (src == dst) continue;
      for (int64_t done = 0; done < b * row;) {
        const int64_t n = std::min<int64_t>(static_cast<int64_t>(buf.size()), b * row - done);
        HETERO_RETURN_IF_ERROR(pread_all(fd_, buf.data(), n, src + done, path_));
        HETERO_RETURN_IF_ERROR(pwrite_all(fd_, buf.data(), n, dst + done, path_));
        done += n;
      }
    }
    end += bytes(a, b);
  }
  for (const auto& [name, v] : tail) {  // in the header's order
    HETERO_RETURN_IF_ERROR(pwrite_all(fd_, v.data, v.nbytes, data + end, path_));
    end += v.nbytes;
  }
  if (::ftruncate(fd_, data + end) != 0) return io_error("cannot shorten", path_);
  const uint64_t len = h.size();
  HETERO_RETURN_IF_ERROR(pwrite_all(fd_, &len, kPrefix, 0, path_));
  HETERO_RETURN_IF_ERROR(pwrite_all(fd_, h.data(), static_cast<int64_t>(h.size()), kPrefix, path_));
  const int rc = ::close(std::exchange(fd_, -1));
  if (rc != 0) return io_error("cannot close", path_);
  return Status::ok();
}

}  // namespace hetero
