// The consumer side of the wire: trusts nothing it has not verified. Each segment must carry
// the expected fingerprint and family, start where the previous one ended (no gap, no
// overlap), stay within the requested T, and hold exactly the arrays of the decoder's layout
// with the right shapes and dtype. Verified rows are copied into per-layer buffers in the
// decoder's layout; the longest verified contiguous prefix is what can be mounted.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bridge/decoder_weights.h"
#include "bridge/store_file.h"
#include "bridge/wire.h"
#include "common/safetensors.h"

namespace hetero {

struct StoreEntry {
  std::string path;  // directory holding entry.json and cache.safetensors
  int64_t bytes = 0;
};

// The decode side's receiver for one bridged request, whatever the family.
class Assembler {
 public:
  virtual ~Assembler() = default;
  // Verifies and appends; on error nothing is appended and the stream should be abandoned.
  virtual Status accept(const Segment& s) = 0;
  // Checks the manifest agrees with what arrived.
  virtual Status finish(const Manifest& m) = 0;
  virtual int64_t covered_tokens() const = 0;
  virtual int64_t segments() const = 0;
  // The most payload one segment of this request can carry (all of the requested prefix at
  // once): the receiver's cap on a frame, so no peer can make it reserve more on its word.
  virtual int64_t max_segment_bytes() const = 0;
  // Whether a prefix of b verified tokens can be mounted (llama: any b <= covered; a family
  // whose cache carries end-of-prefix state: a b whose segment carried it).
  virtual bool can_mount(int64_t b) const = 0;
  // The store arrays for the prefix [0, b) (can_mount(b) must hold); an error when rows written
  // to the store cannot be read back.
  virtual Result<TensorMap> arrays(int64_t b) const = 0;
  // Extra fields for the store entry's entry.json (e.g. the window slot index).
  virtual nlohmann::json entry_extra() const { return nlohmann::json::object(); }
  // Publishes the prefix [0, b) (can_mount(b)) as a decoder-store entry for ids[:b] (default:
  // write_store_entry of arrays(b)). Once per assembler.
  virtual Result<StoreEntry> store(const std::string& store_dir, const DecoderCacheLayout& layout,
                                   const std::vector<int32_t>& ids, int64_t b,
                                   int64_t requested_tokens);
};

// The assembler for the layout's family. With a store_dir, a family that can write its rows
// into the store as they verify (llama) does so, and holds none of them in memory. start: a
// tail's first row (PrefillRequest::start).
std::unique_ptr<Assembler> make_assembler(const DecoderCacheLayout& layout,
                                          int64_t requested_tokens,
                                          const std::string& store_dir = "", int64_t start = 0);

// The checks every family shares: fingerprint, family, sequence, contiguity, bounds.
Status check_segment_order(const DecoderCacheLayout& layout, int64_t requested, int64_t covered,
                           int64_t segments, const Segment& s);

// A store entry's file written as rows verify: created under
// "<store>/<fingerprint>/incoming-*.partial", published once as the entry for a prefix, and
// removed if it never is (the assembler that owns it went away, or publishing failed).
class IncomingEntry {
 public:
  static Result<std::unique_ptr<IncomingEntry>> create(
      const std::string& store_dir, const DecoderCacheLayout& layout,
      std::vector<StoreArray> arrays, const std::vector<std::string>& tail_names = {});
  ~IncomingEntry();
  IncomingEntry(const IncomingEntry&) = delete;
  IncomingEntry& operator=(const IncomingEntry&) = delete;
  StoreFile& file() { return file_; }
  const StoreFile& file() const { return file_; }
  const std::string& store_dir() const { return store_dir_; }
  // Seals the file to `kept` rows of each array and the tail (StoreFile::seal), then publishes
  // it as the entry for ids[:b] with `extra` in its entry.json.
  Result<StoreEntry> publish(const DecoderCacheLayout& layout, const std::vector<int32_t>& ids,
                             int64_t b, int64_t requested_tokens, const nlohmann::json& extra,
                             const std::map<std::string, int64_t>& kept,
                             const TensorViews& tail = {});

 private:
  IncomingEntry(std::string store_dir, StoreFile file)
      : store_dir_(std::move(store_dir)), file_(std::move(file)) {}
  std::string store_dir_;
  StoreFile file_;
  bool published_ = false;
};

// llama: per layer keys and values rows, any verified prefix mountable. Without a store_dir the
// rows are kept in memory; with one they go straight into the entry's file in the store
// (StoreFile, under "<store>/<fingerprint>/incoming-*.partial" until store() publishes it; an
// assembler destroyed unpublished removes it).
// A tail (start > 0) holds rows [start, R) only: its entry says "start", and the seam mounts it
// onto the decoder's own cache of ids[:start].
class CacheAssembler : public Assembler {
 public:
  CacheAssembler(DecoderCacheLayout expected, int64_t requested_tokens, std::string store_dir = "",
                 int64_t start = 0);
  ~CacheAssembler() override;
  Status accept(const Segment& s) override;
  Status finish(const Manifest& m) override;
  int64_t covered_tokens() const override { return covered_; }
  int64_t segments() const override { return segments_; }
  int64_t max_segment_bytes() const override {
    return 2 * layout_.layers * layout_.kv_heads * rows() * layout_.head_dim * 2;  // bf16 K, V
  }
  bool can_mount(int64_t b) const override { return b >= 1 && b > start_ && b <= covered_; }
  // Per layer `layers.{i}.keys` / `.values`, bf16 [kv_heads, b - start, head_dim], for rows
  // [start, b) (read back from the file when the rows went to the store).
  Result<TensorMap> arrays(int64_t b) const override;
  nlohmann::json entry_extra() const override;
  Result<StoreEntry> store(const std::string& store_dir, const DecoderCacheLayout& layout,
                           const std::vector<int32_t>& ids, int64_t b,
                           int64_t requested_tokens) override;

 private:
  int64_t rows() const { return requested_ - start_; }  // the most this assembler holds
  DecoderCacheLayout layout_;
  int64_t requested_, start_, covered_, segments_ = 0;
  // in memory: per layer [kv_heads, R - start, hd]
  std::vector<std::vector<uint16_t>> keys_, values_;
  std::string store_dir_;
  std::unique_ptr<IncomingEntry> entry_;  // in the store: created with the first segment
};

// The manifest checks every family shares (start: the rows' first, as requested).
Status check_manifest(const DecoderCacheLayout& layout, int64_t requested, int64_t covered,
                      int64_t segments, const Manifest& m, int64_t start = 0);

// A store entry is written under "<entry>.partial" and renamed when whole.
inline constexpr const char* kPartialSuffix = ".partial";

// Writes ids[:b] and the assembled rows as a decoder-store entry under
// store_dir/<fingerprint>/<prefix key>/ (atomically: written aside, then renamed).
// `extra` adds family fields to entry.json.
Result<StoreEntry> write_store_entry(const std::string& store_dir, const DecoderCacheLayout& layout,
                                     const std::vector<int32_t>& ids, int64_t b,
                                     int64_t requested_tokens, const TensorMap& arrays,
                                     const nlohmann::json& extra = nlohmann::json::object());
// The same from arrays held elsewhere (written as they are, no copy).
Result<StoreEntry> write_store_entry(const std::string& store_dir, const DecoderCacheLayout& layout,
                                     const std::vector<int32_t>& ids, int64_t b,
                                     int64_t requested_tokens, const TensorViews& arrays,
                                     const nlohmann::json& extra = nlohmann::json::object());

// Removes the "<entry>.partial" directories a process that died mid-write left in the store
// (the front door's start: it is the store's only writer). Returns how many.
int64_t remove_partial_store_entries(const std::string& store_dir);

}  // namespace hetero
