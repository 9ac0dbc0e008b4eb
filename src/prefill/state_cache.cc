// The prefill host's prefix cache of engine state: see state_cache.h.
#include "prefill/state_cache.h"

#include <algorithm>
#include <tuple>

#include "common/hash.h"
#include "common/log.h"
#include "prefill/service.h"

namespace hetero {

namespace {
uint64_t chain_checksum(const void* data, size_t bytes, uint64_t seed) {
  return checksum64(data, bytes, seed);
}
}  // namespace

PrefixStateCache::PrefixStateCache(int64_t block_tokens, int64_t max_bytes, ChainHash hash)
    : block_tokens_(block_tokens), max_bytes_(max_bytes), hash_(hash ? hash : chain_checksum) {
  HETERO_CHECK(block_tokens_ > 0 && max_bytes_ >= 0);
}

std::vector<uint64_t> PrefixStateCache::keys_of(const std::vector<int32_t>& ids, int64_t limit,
                                                const std::string& salt) const {
  std::vector<uint64_t> keys;
  const int64_t n = std::min<int64_t>(limit, static_cast<int64_t>(ids.size()));
  uint64_t key = 0x6865746572u;  // the chain's seed: any fixed value, then the tenant's salt
  if (!salt.empty()) key = hash_(salt.data(), salt.size(), key);
  for (int64_t at = 0; at + block_tokens_ <= n; at += block_tokens_) {
    key = hash_(ids.data() + at, static_cast<size_t>(block_tokens_) * sizeof(int32_t), key);
    keys.push_back(key);
  }
  return keys;
}

const PrefixStateCache::Block* PrefixStateCache::find(uint64_t k, const std::vector<int32_t>& ids,
                                                      int64_t d) const {
  auto it = blocks_.find(k);
  if (it == blocks_.end() || it->second.depth != d) return nullptr;
  const auto first = ids.begin() + static_cast<std::ptrdiff_t>(d * block_tokens_);
  if (!std::equal(it->second.ids.begin(), it->second.ids.end(), first)) return nullptr;
  return &it->second;
}

int64_t PrefixStateCache::lookup(const std::vector<int32_t>& ids, int64_t limit,
                                 const std::string& salt) {
  const std::vector<uint64_t> keys = keys_of(ids, limit, salt);
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t tick = ++tick_;
  int64_t d = 0;
  for (; d < static_cast<int64_t>(keys.size()); ++d) {
    const Block* b = find(keys[static_cast<size_t>(d)], ids, d);
    if (!b || (d > 0 && b->parent != keys[static_cast<size_t>(d - 1)])) break;
    blocks_[keys[static_cast<size_t>(d)]].used = tick;
  }
  return d * block_tokens_;
}

Status PrefixStateCache::restore(const std::vector<int32_t>& ids, int64_t n, PrefillEngine* engine,
                                 const std::string& salt) {
  const std::vector<uint64_t> keys = keys_of(ids, n, salt);
  if (static_cast<int64_t>(keys.size()) * block_tokens_ != n)
    return invalid_argument("restore: " + std::to_string(n) + " is not whole blocks of " +
                            std::to_string(block_tokens_));
  std::lock_guard<std::mutex> lock(mu_);
  for (int64_t d = 0; d < static_cast<int64_t>(keys.size()); ++d) {
    const Block* b = find(keys[static_cast<size_t>(d)], ids, d);
    if (!b || (d > 0 && b->parent != keys[static_cast<size_t>(d - 1)]))
      return not_found("the state of tokens from " + std::to_string(d * block_tokens_) +
                       " was evicted since the lookup");
    HETERO_RETURN_IF_ERROR(engine->load_state(d * block_tokens_, block_tokens_, b->state.data()));
  }
  return Status::ok();
}

Status PrefixStateCache::save(const std::vector<int32_t>& ids, int64_t n, PrefillEngine* engine,
                              const std::string& salt) {
  const int64_t row = engine->state_row_bytes();
  if (row <= 0 || max_bytes_ == 0) return Status::ok();
  const int64_t block_bytes = row * block_tokens_;
  if (block_bytes > max_bytes_) return Status::ok();  // not even one block fits
  const std::vector<uint64_t> keys = keys_of(ids, n, salt);
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t tick = ++tick_;
  for (int64_t d = 0; d < static_cast<int64_t>(keys.size()); ++d) {
    const uint64_t k = keys[static_cast<size_t>(d)];
    if (find(k, ids, d)) {
      blocks_[k].used = tick;
      continue;
    }
    // A collision (or another depth): the newer state wins, and the blocks chained below the
    // old one go with it. Their keys chained through k, so they would otherwise pass for this
    // prefix's continuation (issue 50, finding 7).
    if (blocks_.count(k)) erase_chain(k);
    Block b;
    b.parent = d > 0 ? keys[static_cast<size_t>(d - 1)] : 0;
    const auto first = ids.begin() + static_cast<std::ptrdiff_t>(d * block_tokens_);
    b.ids.assign(first, first + static_cast<std::ptrdiff_t>(block_tokens_));
    b.depth = d;
    b.used = tick;
    try {
      b.state.resize(static_cast<size_t>(block_bytes));
    } catch (const std::bad_alloc&) {
      break;  // a cache that cannot grow keeps what it has: it only saves work
    }
    HETERO_RETURN_IF_ERROR(engine->save_state(d * block_tokens_, block_tokens_, b.state.data()));
    bytes_ += block_bytes;
    blocks_.emplace(k, std::move(b));
  }
  evict_to(max_bytes_);
  return Status::ok();
}

void PrefixStateCache::erase_chain(uint64_t k) {
  std::vector<uint64_t> doomed = {k};
  for (size_t i = 0; i < doomed.size(); ++i) {
    const auto it = blocks_.find(doomed[i]);
    if (it == blocks_.end()) continue;
    const int64_t depth = it->second.depth;
    for (const auto& [key, b] : blocks_)
      if (b.parent == doomed[i] && b.depth == depth + 1) doomed.push_back(key);
  }
  for (uint64_t key : doomed) {
    const auto it = blocks_.find(key);
    if (it == blocks_.end()) continue;
    bytes_ -= static_cast<int64_t>(it->second.state.size());
    blocks_.erase(it);
  }
}

void PrefixStateCache::evict_to(int64_t max_bytes) {
  if (bytes_ <= max_bytes) return;
  // Least recently used first; among blocks used together, the deepest first.
  std::vector<std::tuple<uint64_t, int64_t, uint64_t>> order;  // (used, -depth, key)
  order.reserve(blocks_.size());
  for (const auto& [k, b] : blocks_) order.emplace_back(b.used, -b.depth, k);
  std::sort(order.begin(), order.end());
  for (const auto& [used, neg_depth, k] : order) {
    if (bytes_ <= max_bytes) break;
    bytes_ -= static_cast<int64_t>(blocks_[k].state.size());
    blocks_.erase(k);
  }
}

int64_t PrefixStateCache::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

int64_t PrefixStateCache::blocks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(blocks_.size());
}

void PrefixStateCache::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  blocks_.clear();
  bytes_ = 0;
}

// ----------------------------------------------------------------------------- checkpoints

bool PrefixCheckpoints::put(std::vector<int32_t> ids, std::shared_ptr<const Checkpoint> engine,
                            std::shared_ptr<const Checkpoint> program, const std::string& salt) {
  HETERO_CHECK(engine && program);
  auto e =
      std::make_shared<Entry>(Entry{std::move(ids), salt, std::move(engine), std::move(program)});
  const int64_t need = e->bytes();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = held_.begin(); it != held_.end(); ++it)
    if (it->entry->ids == e->ids && it->entry->salt == e->salt) {
      bytes_ -= it->entry->bytes();
      held_.erase(it);
      break;
    }
  if (need > max_bytes_) return false;
  while (bytes_ + need > max_bytes_ && !held_.empty()) {
    auto oldest = std::min_element(held_.begin(), held_.end(),
                                   [](const Held& a, const Held& b) { return a.used < b.used; });
    bytes_ -= oldest->entry->bytes();
    held_.erase(oldest);
  }
  held_.push_back({std::move(e), ++tick_});
  bytes_ += need;
  return true;
}

std::shared_ptr<const PrefixCheckpoints::Entry> PrefixCheckpoints::find(
    const std::vector<int32_t>& ids, int64_t n, const std::string& salt) {
  if (n <= 0 || n > static_cast<int64_t>(ids.size())) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  for (Held& h : held_)
    if (static_cast<int64_t>(h.entry->ids.size()) == n && h.entry->salt == salt &&
        std::equal(h.entry->ids.begin(), h.entry->ids.end(), ids.begin())) {
      h.used = ++tick_;
      return h.entry;
    }
  return nullptr;
}

}  // namespace hetero
