// A cache program for the prefill service's tests: each layer's tap rows become the layer's keys
// and values [1, n, 2] (the first two columns of x), so a test can read back which rows went out.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "bridge/producer.h"

namespace hetero {

// The small llama layout these tests stream: 2 layers of width 4, one kv head of 2.
inline constexpr int64_t kEchoLayers = 2, kEchoHidden = 4;
inline DecoderCacheLayout echo_layout(std::string fingerprint) {
  DecoderCacheLayout l;
  l.family = "llama", l.fingerprint = std::move(fingerprint);
  l.layers = kEchoLayers, l.hidden = kEchoHidden, l.kv_heads = 1, l.head_dim = 2;
  return l;
}

class EchoProgram : public SegmentProgram {
 public:
  explicit EchoProgram(DecoderCacheLayout layout) : layout_(std::move(layout)) {}
  const DecoderCacheLayout& layout() const override { return layout_; }
  Status run(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x,
             std::vector<WireArray>* arrays) override {
    (void)pos0;
    Tensor t(DType::kBF16, {1, n, 2});
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < 2; ++j) t.data<uint16_t>()[i * 2 + j] = x[i * layout_.hidden + j];
    arrays->emplace_back("layers." + std::to_string(layer) + ".keys", t);
    arrays->emplace_back("layers." + std::to_string(layer) + ".values", std::move(t));
    return Status::ok();
  }

 private:
  DecoderCacheLayout layout_;
};

}  // namespace hetero
