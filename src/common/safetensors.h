// Reading and writing safetensors files (the HF checkpoint format, the decoder-weights export
// and the decoder store all use it). Spec: 8-byte little-endian header length, a JSON header
// {name: {dtype, shape, data_offsets:[begin,end]}, "__metadata__": {str: str}}, then the data.
#pragma once

#include <functional>
#include <map>
#include <string>

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
// Writes atomically (temp file + rename) so a reader never sees half a file.
Status write_safetensors(const std::string& path, const TensorMap& tensors,
                         const std::map<std::string, std::string>& metadata = {});

}  // namespace hetero
