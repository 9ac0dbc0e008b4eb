// A store entry's cache.safetensors written in place as rows verify, so the decode side never
// holds a whole cache in memory: the file is laid out for the requested prefix (each array bf16
// [outer, rows, width] at its most rows, in the name order safetensors keeps), rows are written
// at their place as segments arrive, and seal() shortens every array to its verified rows in
// place (rows move only towards the file's start), appends the small arrays a family keeps in
// memory until then (DeepSeek-V4's state at the prefix's end), and writes the header last. Until
// then the file lives under a "<name>.partial" directory the store's start-up sweep removes.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/safetensors.h"
#include "common/status.h"

namespace hetero {

// One array written row by row: bf16 [outer, rows, width], rows at their most.
struct StoreArray {
  std::string name;
  int64_t outer = 1, rows = 0, width = 0;
};

class StoreFile {
 public:
  // Creates dir (which must not exist) and dir/cache.safetensors sized for every array's rows
  // (sparse until written). tail_names: the arrays seal() will append (their header is reserved).
  static Result<StoreFile> create(const std::string& dir, std::vector<StoreArray> arrays,
                                  const std::vector<std::string>& tail_names = {});
  // Every array [heads, rows, head_dim] (llama's keys and values).
  static Result<StoreFile> create(const std::string& dir, const std::vector<std::string>& names,
                                  int64_t heads, int64_t rows, int64_t head_dim);
  StoreFile(StoreFile&& o) noexcept;
  StoreFile& operator=(StoreFile&& o) noexcept;
  StoreFile(const StoreFile&) = delete;
  StoreFile& operator=(const StoreFile&) = delete;
  ~StoreFile();  // closes; the directory stays (the owner removes or publishes it)

  // Rows [pos0, pos0 + n) of array `name`, bf16 [outer, n, width].
  Status write_rows(const std::string& name, int64_t pos0, int64_t n, const uint16_t* src) {
    return rows(name, pos0, n, const_cast<uint16_t*>(src), /*write=*/true);
  }
  // The same rows back (before seal()).
  Status read_rows(const std::string& name, int64_t pos0, int64_t n, uint16_t* dst) const {
    return rows(name, pos0, n, dst, /*write=*/false);
  }
  // Keeps rows [0, kept[name]) of every array (each within its most rows; an array kept with 0
  // rows stays, empty), appends `tail` (named at create), writes the header, closes the file.
  Status seal(const std::map<std::string, int64_t>& kept, const TensorViews& tail = {});
  // Keeps rows [0, b) of every array.
  Status seal(int64_t b);
  const std::string& dir() const { return dir_; }
  const std::string& path() const { return path_; }

 private:
  StoreFile() = default;
  int64_t index_of(const std::string& name) const;  // -1 when unknown
  // Rows of one array to (write) or from the file; `data` is only read when writing.
  Status rows(const std::string& name, int64_t pos0, int64_t n, uint16_t* data, bool write) const;
  static int64_t bytes(const StoreArray& a, int64_t rows) { return a.outer * rows * a.width * 2; }
  // The header for `rows` rows of each array and the tail, padded to header_bytes_ when set.
  Result<std::string> header(const std::vector<int64_t>& rows, const TensorViews& tail) const;
  int fd_ = -1;
  std::string dir_, path_;
  std::vector<StoreArray> arrays_;  // sorted by name: the order of the arrays in the file
  std::vector<int64_t> offsets_;    // each array's place in the data, at its most rows
  std::vector<std::string> tail_names_;
  int64_t header_bytes_ = 0;  // reserved for the longest header
};

}  // namespace hetero
