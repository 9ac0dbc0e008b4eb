// A whole-state checkpoint: what a stateful component (an engine, a cache program) holds after a
// sequence's first n tokens, kept so that a later request sharing exactly those tokens resumes
// there. For state that is not a set of per-token rows (DeepSeek-V4's windows and pools, which
// depend on where the decoder cut its calls), as the decoder's own prefix cache keeps it.
// Immutable once made; each component restores only its own kind.
#pragma once

#include <cstdint>

namespace hetero {

class Checkpoint {
 public:
  virtual ~Checkpoint() = default;
  virtual int64_t tokens() const = 0;  // n: the sequence's tokens it stands for
  virtual int64_t bytes() const = 0;   // what it holds in memory
};

}  // namespace hetero
