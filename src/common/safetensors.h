// Reading and writing safetensors files (the HF checkpoint format, the decoder-weights export
// and the decoder store all use it). Spec: 8-byte little-endian header length, a JSON header
// {name: {dtype, shape, data_offsets:[begin,end]}, "__metadata__": {str: str}}, then the data.
#pragma once

#include <map>
#include <string>

#include "common/status.h"
#include "common/tensor.h"

namespace hetero {

using TensorMap = std::map<std::string, Tensor>;

struct SafetensorsFile {
  TensorMap tensors;
  std::map<std::string, std::string> metadata;
};

// Reads every tensor of one file. Errors name the file and what is wrong with it.
Result<SafetensorsFile> read_safetensors(const std::string& path);
// Reads a checkpoint directory: model.safetensors, or the shards listed by
// model.safetensors.index.json, or every *.safetensors file in it.
Result<TensorMap> read_checkpoint_tensors(const std::string& dir);
// Writes atomically (temp file + rename) so a reader never sees half a file.
Status write_safetensors(const std::string& path, const TensorMap& tensors,
                         const std::map<std::string, std::string>& metadata = {});

}  // namespace hetero
