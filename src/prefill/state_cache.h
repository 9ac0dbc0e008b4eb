// The prefill host's prefix cache of its own engine state, so that a warm turn's tail is computed
// from where an earlier request left off instead of from position 0.
//
// State is kept in blocks of `block_tokens` tokens: a block's key chains a hash over every token
// up to its end (so a block stands for its whole prefix), and holds the engine's state rows for
// its tokens (PrefillEngine::save_state). A lookup walks a request's whole blocks from the start
// while their keys are held (each block's own ids are compared too: a hash collision is a miss,
// never a wrong state; a block replaced after a collision takes its descendants with it, whose
// keys chained through it). Each tenant's salt seeds its own chains (docs/design/auth.md): a
// salt's state is never resumed for another. Bounded in bytes; the least recently used block
// goes first, the deepest first among blocks used together (a chain is cut from its end, never
// left with a hole). Thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "common/checkpoint.h"
#include "common/status.h"

namespace hetero {

class PrefillEngine;

class PrefixStateCache {
 public:
  // How a block's key chains from its parent's (checksum64; a test plants collisions).
  using ChainHash = uint64_t (*)(const void* data, size_t bytes, uint64_t seed);
  PrefixStateCache(int64_t block_tokens, int64_t max_bytes, ChainHash hash = nullptr);

  // Tokens of ids' longest run of held whole blocks from position 0, at most `limit`, in the
  // partition of `salt` ("": the shared one).
  int64_t lookup(const std::vector<int32_t>& ids, int64_t limit, const std::string& salt = "");
  // Loads the state of ids[0, n) (n from lookup) into the engine, after its reserve().
  // A block evicted since the lookup is an error (kNotFound): the caller computes instead.
  Status restore(const std::vector<int32_t>& ids, int64_t n, PrefillEngine* engine,
                 const std::string& salt = "");
  // After a forward over ids[0, n): keeps the state of its whole blocks not yet held (the
  // engine's rows [0, n) must be this request's). Nothing when the engine hands out no state.
  Status save(const std::vector<int32_t>& ids, int64_t n, PrefillEngine* engine,
              const std::string& salt = "");

  int64_t block_tokens() const { return block_tokens_; }
  int64_t max_bytes() const { return max_bytes_; }
  int64_t bytes() const;
  int64_t blocks() const;
  void clear();

 private:
  struct Block {
    uint64_t parent = 0;
    std::vector<int32_t> ids;  // this block's own tokens
    std::vector<uint8_t> state;
    int64_t depth = 0;  // block index from the start
    uint64_t used = 0;  // the lookup tick that last touched it
  };
  // Keys of ids' whole blocks, in order, up to `limit` tokens.
  std::vector<uint64_t> keys_of(const std::vector<int32_t>& ids, int64_t limit,
                                const std::string& salt) const;
  // Drops the block at key k and every block chained below it. With mu_.
  void erase_chain(uint64_t k);
  // The held block for key k at depth d with these ids, or null.
  const Block* find(uint64_t k, const std::vector<int32_t>& ids, int64_t d) const;
  void evict_to(int64_t max_bytes);  // with mu_

  int64_t block_tokens_, max_bytes_;
  ChainHash hash_;
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, Block> blocks_;
  int64_t bytes_ = 0;
  uint64_t tick_ = 0;
};

// Whole checkpoints of finished requests, for an engine and a cache program whose state is not
// rows (common/checkpoint.h): each kept for exactly its request's ids, as the decoder's own
// prefix cache keeps DeepSeek-V4 prefixes. A tail resumes only from a checkpoint of exactly its
// start. Bounded in bytes, least recently used first out. Thread-safe.
class PrefixCheckpoints {
 public:
  struct Entry {
    std::vector<int32_t> ids;
    std::string salt;  // the tenant's partition (PrefixStateCache)
    std::shared_ptr<const Checkpoint> engine, program;
    int64_t bytes() const { return engine->bytes() + program->bytes(); }
  };
  explicit PrefixCheckpoints(int64_t max_bytes) : max_bytes_(max_bytes) {}
  int64_t max_bytes() const { return max_bytes_; }
  // Keeps the checkpoints of ids (replacing one of the same ids); false when they alone exceed
  // the bound.
  bool put(std::vector<int32_t> ids, std::shared_ptr<const Checkpoint> engine,
           std::shared_ptr<const Checkpoint> program, const std::string& salt = "");
  // The entry of exactly ids[0, n) in salt's partition, or null.
  std::shared_ptr<const Entry> find(const std::vector<int32_t>& ids, int64_t n,
                                    const std::string& salt = "");

 private:
  struct Held {
    std::shared_ptr<const Entry> entry;
    uint64_t used = 0;
  };
  int64_t max_bytes_;
  std::mutex mu_;
  std::vector<Held> held_;  // few, and large: found by a scan
  int64_t bytes_ = 0;
  uint64_t tick_ = 0;
};

}  // namespace hetero
