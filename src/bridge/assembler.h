// The consumer side of the wire: trusts nothing it has not verified. Each segment must carry
// the expected fingerprint and family, start where the previous one ended (no gap, no
// overlap), stay within the requested T, and hold exactly the arrays of the decoder's layout
// with the right shapes and dtype. Verified rows are copied into per-layer buffers in the
// decoder's layout; the longest verified contiguous prefix is what can be mounted.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bridge/decoder_weights.h"
#include "bridge/wire.h"
#include "common/safetensors.h"

namespace hetero {

class CacheAssembler {
 public:
  CacheAssembler(DecoderCacheLayout expected, int64_t requested_tokens);
  // Verifies and appends; on error nothing is appended and the stream should be abandoned.
  Status accept(const Segment& s);
  // Checks the manifest agrees with what arrived.
  Status finish(const Manifest& m);
  int64_t covered_tokens() const { return covered_; }
  int64_t segments() const { return segments_; }
  // Per layer `layers.{i}.keys` / `.values`, bf16 [kv_heads, b, head_dim], for rows [0, b).
  TensorMap arrays(int64_t b) const;

 private:
  DecoderCacheLayout layout_;
  int64_t requested_, covered_ = 0, segments_ = 0;
  std::vector<std::vector<uint16_t>> keys_, values_;  // per layer [kv_heads, requested, hd]
};

struct StoreEntry {
  std::string path;  // directory holding entry.json and cache.safetensors
  int64_t bytes = 0;
};

// Writes ids[:b] and the assembled rows as a decoder-store entry under
// store_dir/<fingerprint>/<prefix key>/ (atomically: written aside, then renamed).
Result<StoreEntry> write_store_entry(const std::string& store_dir, const DecoderCacheLayout& layout,
                                     const std::vector<int32_t>& ids, int64_t b,
                                     int64_t requested_tokens, const TensorMap& arrays);

}  // namespace hetero
