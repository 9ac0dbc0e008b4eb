// Reading and writing safetensors files (the HF checkpoint format, the decoder-weights export
// and the decoder store all use it). Spec: 8-byte little-endian header length, a JSON header
// {name: {dtype, shape, data_offsets:[begin,end]}, "__metadata__": {str: str}}, then the data.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"

namespace hetero {

using TensorMap = std::map<std::string, Tensor>;
// Which tensors to read, by name (empty: all). The header is validated in full either way.
using TensorFilter = std::function<bool(const std::string& name)>;

struct SafetensorsFile {
  TensorMap tensors;
  std::map<std::string, std::string> metadata;
};

// Reads every tensor of one file (those `keep` accepts). Errors name the file and what is wrong
// with it.
Result<SafetensorsFile> read_safetensors(const std::string& path, const TensorFilter& keep = {});
// Reads a checkpoint directory: model.safetensors, or the shards listed by
// model.safetensors.index.json, or every *.safetensors file in it.
Result<TensorMap> read_checkpoint_tensors(const std::string& dir, const TensorFilter& keep = {});
// A checkpoint's tensors by name, read lazily: open() parses and validates every shard's header
// (as read_safetensors does) and keeps the files open; read() copies a byte range of one tensor
// with pread. For models larger than host memory: a loader streams each tensor through a bounded
// buffer, so the host holds the headers and that buffer, not the weights.
struct TensorEntry {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  int file = 0;        // index into files()
  int64_t offset = 0;  // of the data, from the start of the file
  int64_t bytes = 0;
  int64_t numel() const;
};
class CheckpointReader {
 public:
  // The files read_checkpoint_tensors would read; a name in two files is refused.
  static Result<CheckpointReader> open(const std::string& dir);
  CheckpointReader(CheckpointReader&&) noexcept;
  CheckpointReader& operator=(CheckpointReader&&) noexcept;
  ~CheckpointReader();

  const TensorEntry* find(const std::string& name) const;  // null when absent
  const std::map<std::string, TensorEntry>& entries() const { return entries_; }
  const std::vector<std::string>& files() const { return files_; }
  // bytes [offset, offset + n) of e's data into dst; data_loss on a short read.
  Status read(const TensorEntry& e, int64_t offset, int64_t n, void* dst) const;

 private:
  CheckpointReader() = default;
  std::vector<std::string> files_;
  std::vector<int> fds_;
  std::map<std::string, TensorEntry> entries_;
};

// A tensor's bytes held elsewhere (`data`, dtype and shape's size), to write without a copy.
struct TensorView {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  int64_t nbytes = 0;
  static TensorView of(const Tensor& t) { return {t.dtype, t.shape, t.bytes.data(), t.nbytes()}; }
};
using TensorViews = std::map<std::string, TensorView>;

// Writes atomically (temp file + rename) so a reader never sees half a file.
Status write_safetensors(const std::string& path, const TensorViews& tensors,
                         const std::map<std::string, std::string>& metadata = {});
Status write_safetensors(const std::string& path, const TensorMap& tensors,
                         const std::map<std::string, std::string>& metadata = {});

}  // namespace hetero
