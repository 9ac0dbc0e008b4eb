// A store entry's cache.safetensors written in place as rows verify, so the decode side never
// holds a whole cache in memory: the file is laid out for the requested prefix (R rows per
// array, every array [kv_heads, R, head_dim] bf16, in the name order safetensors keeps), rows
// are written at their place as segments arrive, and seal(b) shortens it to the verified prefix
// [0, b) in place (rows move only towards the file's start) and writes the header last. Until
// then the file lives under a "<name>.partial" directory the store's start-up sweep removes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace hetero {

class StoreFile {
 public:
  // Creates dir (which must not exist) and dir/cache.safetensors sized for `rows` rows of every
  // array (sparse until written). names: the arrays, any order.
  static Result<StoreFile> create(const std::string& dir, std::vector<std::string> names,
                                  int64_t heads, int64_t rows, int64_t head_dim);
  StoreFile(StoreFile&& o) noexcept;
  StoreFile& operator=(StoreFile&& o) noexcept;
  StoreFile(const StoreFile&) = delete;
  StoreFile& operator=(const StoreFile&) = delete;
  ~StoreFile();  // closes; the directory stays (the owner removes or publishes it)

  // Rows [pos0, pos0 + n) of array `name`, bf16 [heads, n, head_dim].
  Status write_rows(const std::string& name, int64_t pos0, int64_t n, const uint16_t* src) {
    return rows(name, pos0, n, const_cast<uint16_t*>(src), /*write=*/true);
  }
  // The same rows back (before seal()).
  Status read_rows(const std::string& name, int64_t pos0, int64_t n, uint16_t* dst) const {
    return rows(name, pos0, n, dst, /*write=*/false);
  }
  // Keeps rows [0, b) of every array, writes the header for them, closes the file.
  Status seal(int64_t b);
  const std::string& dir() const { return dir_; }
  const std::string& path() const { return path_; }

 private:
  StoreFile() = default;
  int64_t index_of(const std::string& name) const;  // -1 when unknown
  // Rows of one array to (write) or from the file; `data` is only read when writing.
  Status rows(const std::string& name, int64_t pos0, int64_t n, uint16_t* data, bool write) const;
  int64_t array_bytes(int64_t rows) const { return heads_ * rows * head_dim_ * 2; }
  std::string header(int64_t rows) const;  // padded to header_bytes_ when it is set
  int fd_ = -1;
  std::string dir_, path_;
  std::vector<std::string> names_;  // sorted: the order of the arrays in the file
  int64_t heads_ = 0, rows_ = 0, head_dim_ = 0;
  int64_t header_bytes_ = 0;  // reserved for the header of `rows_` rows (the longest one)
};

}  // namespace hetero
