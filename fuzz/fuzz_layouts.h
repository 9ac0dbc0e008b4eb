// The small decoder layouts the fuzz targets and their seeds share.
#pragma once

#include "bridge/decoder_weights.h"

namespace hetero::fuzz {

constexpr int64_t kRequestedTokens = 24;
// The secret and stream nonce of tagged streams (frame_tag.h): the seeds are tagged with them.
constexpr char kSecret[] = "fuzz-secret";
constexpr char kNonce[] = "00112233445566778899aabbccddeeff";

inline DecoderCacheLayout llama_layout() {
  DecoderCacheLayout l;
  l.family = "llama", l.fingerprint = "fp", l.layers = 2, l.kv_heads = 2, l.head_dim = 4;
  l.hidden = 8;
  return l;
}

inline DecoderCacheLayout dsv4_layout() {
  DecoderCacheLayout l;
  l.family = "deepseek_v4", l.fingerprint = "fp", l.layers = 3, l.kv_heads = 1, l.head_dim = 8;
  l.hidden = 16, l.ratios = {0, 4, 128}, l.index_head_dim = 8, l.window = 8;
  return l;
}

}  // namespace hetero::fuzz
