// Verification, assembly and the decoder store: see assembler.h.
#include "bridge/assembler.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/hash.h"

namespace hetero {
namespace fs = std::filesystem;

namespace {

std::string array_name(int64_t layer, int which) {
  return "layers." + std::to_string(layer) + (which ? ".values" : ".keys");
}

// A name no other writer in this store uses: the process, a counter and the clock.
std::string incoming_name() {
  static std::atomic<uint64_t> counter{0};
  return "incoming-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + "-" +
         std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()) +
         kPartialSuffix;
}

}  // namespace

CacheAssembler::CacheAssembler(DecoderCacheLayout expected, int64_t requested_tokens,
                               std::string store_dir, int64_t start)
    : layout_(std::move(expected)),
      requested_(requested_tokens),
      start_(start),
      covered_(start),
      store_dir_(std::move(store_dir)) {
  HETERO_CHECK(start_ >= 0 && start_ < requested_);
  if (!store_dir_.empty()) return;  // rows go to the store's file
  const size_t per_layer = static_cast<size_t>(layout_.kv_heads * rows() * layout_.head_dim);
  keys_.assign(static_cast<size_t>(layout_.layers), std::vector<uint16_t>(per_layer));
  values_.assign(static_cast<size_t>(layout_.layers), std::vector<uint16_t>(per_layer));
}

CacheAssembler::~CacheAssembler() = default;  // an unpublished entry removes itself

Status check_segment_order(const DecoderCacheLayout& layout, int64_t requested, int64_t covered,
                           int64_t segments, const Segment& s) {
  if (s.fingerprint != layout.fingerprint)
    return failed_precondition("segment fingerprint " + s.fingerprint +
                               " does not match the decoder's " + layout.fingerprint);
  if (s.family != layout.family)
    return failed_precondition("segment family '" + s.family + "' is not '" + layout.family + "'");
  if (s.seq != segments)
    return data_loss("segment seq " + std::to_string(s.seq) + " arrived, expected " +
                     std::to_string(segments));
  if (s.pos0 != covered)
    return data_loss("gap in positions: segment starts at " + std::to_string(s.pos0) +
                     ", verified rows end at " + std::to_string(covered));
  if (s.n_tokens <= 0 || s.pos0 + s.n_tokens > requested)
    return data_loss("segment rows [" + std::to_string(s.pos0) + "," +
                     std::to_string(s.pos0 + s.n_tokens) +
                     ") exceed T=" + std::to_string(requested));
  return Status::ok();
}

Status check_manifest(const DecoderCacheLayout& layout, int64_t requested, int64_t covered,
                      int64_t segments, const Manifest& m, int64_t start) {
  if (m.fingerprint != layout.fingerprint)
    return failed_precondition("manifest fingerprint " + m.fingerprint + " does not match " +
                               layout.fingerprint);
  if (m.start != start)
    return data_loss("manifest says the rows start at " + std::to_string(m.start) +
                     ", requested from " + std::to_string(start));
  if (m.requested_tokens != requested)
    return data_loss("manifest says T=" + std::to_string(m.requested_tokens) + ", requested " +
                     std::to_string(requested));
  if (m.covered_tokens != covered || m.segments != segments)
    return data_loss("manifest claims " + std::to_string(m.covered_tokens) + " rows in " +
                     std::to_string(m.segments) + " segments; verified " + std::to_string(covered) +
                     " in " + std::to_string(segments));
  if (!m.complete) return unavailable("prefill ended early: " + m.reason);
  return Status::ok();
}

Status CacheAssembler::accept(const Segment& s) {
  HETERO_RETURN_IF_ERROR(check_segment_order(layout_, requested_, covered_, segments_, s));
  if (static_cast<int64_t>(s.arrays.size()) != 2 * layout_.layers)
    return data_loss("segment has " + std::to_string(s.arrays.size()) + " arrays, expected " +
                     std::to_string(2 * layout_.layers));
  const std::vector<int64_t> want = {layout_.kv_heads, s.n_tokens, layout_.head_dim};
  for (int64_t l = 0; l < layout_.layers; ++l) {
    for (int which = 0; which < 2; ++which) {
      const WireArray& a = s.arrays[static_cast<size_t>(2 * l + which)];
      const std::string name = "layers." + std::to_string(l) + (which ? ".values" : ".keys");
      if (a.name != name)
        return data_loss("segment array '" + a.name + "' where '" + name + "' belongs");
      if (a.tensor.dtype != DType::kBF16 || a.tensor.shape != want)
        return data_loss("segment array '" + name + "' is " + dtype_name(a.tensor.dtype) +
                         a.tensor.shape_string() + ", expected BF16 [kv_heads, n, head_dim]");
    }
  }
  // Everything checked: rows into place, in the store's file or in memory.
  if (!store_dir_.empty()) {
    if (!entry_) {
      std::vector<StoreArray> arrays;
      for (int64_t l = 0; l < layout_.layers; ++l)
        for (int which = 0; which < 2; ++which)
          arrays.push_back({array_name(l, which), layout_.kv_heads, rows(), layout_.head_dim});
      HETERO_ASSIGN_OR_RETURN(entry_, IncomingEntry::create(store_dir_, layout_, arrays));
    }
    for (int64_t l = 0; l < layout_.layers; ++l)
      for (int which = 0; which < 2; ++which)
        HETERO_RETURN_IF_ERROR(
            entry_->file().write_rows(array_name(l, which), s.pos0 - start_, s.n_tokens,
                                      reinterpret_cast<const uint16_t*>(
                                          s.arrays[static_cast<size_t>(2 * l + which)].data())));
    covered_ += s.n_tokens;
    ++segments_;
    return Status::ok();
  }
  const int64_t hd = layout_.head_dim;
  for (int64_t l = 0; l < layout_.layers; ++l) {
    for (int which = 0; which < 2; ++which) {
      const auto* src =
          reinterpret_cast<const uint16_t*>(s.arrays[static_cast<size_t>(2 * l + which)].data());
      auto& dst = (which ? values_ : keys_)[static_cast<size_t>(l)];
      for (int64_t h = 0; h < layout_.kv_heads; ++h)
        std::memcpy(&dst[static_cast<size_t>((h * rows() + s.pos0 - start_) * hd)],
                    src + h * s.n_tokens * hd, static_cast<size_t>(s.n_tokens * hd * 2));
    }
  }
  covered_ += s.n_tokens;
  ++segments_;
  return Status::ok();
}

Status CacheAssembler::finish(const Manifest& m) {
  return check_manifest(layout_, requested_, covered_, segments_, m, start_);
}

nlohmann::json CacheAssembler::entry_extra() const {
  if (start_ == 0) return nlohmann::json::object();
  return {{"start", start_}};
}

Result<TensorMap> CacheAssembler::arrays(int64_t b) const {
  HETERO_CHECK(b >= start_ && b <= covered_);
  TensorMap out;
  const int64_t hd = layout_.head_dim, n = b - start_;
  for (int64_t l = 0; l < layout_.layers; ++l) {
    for (int which = 0; which < 2; ++which) {
      Tensor t(DType::kBF16, {layout_.kv_heads, n, hd});
      if (entry_) {
        HETERO_RETURN_IF_ERROR(
            entry_->file().read_rows(array_name(l, which), 0, n, t.data<uint16_t>()));
        out.emplace(array_name(l, which), std::move(t));
        continue;
      }
      const auto& src = (which ? values_ : keys_)[static_cast<size_t>(l)];
      for (int64_t h = 0; h < layout_.kv_heads; ++h)
        std::memcpy(t.data<uint16_t>() + h * n * hd, &src[static_cast<size_t>(h * rows() * hd)],
                    static_cast<size_t>(n * hd * 2));
      out.emplace("layers." + std::to_string(l) + (which ? ".values" : ".keys"), std::move(t));
    }
  }
  return out;
}

namespace {

// The entry's directory, and `tmp`, its "<dir>.partial" twin, where it is written.
fs::path entry_dir(const std::string& store_dir, const DecoderCacheLayout& layout,
                   const std::vector<int32_t>& prefix) {
  return fs::path(store_dir) / layout.fingerprint / prefix_key(layout.fingerprint, prefix);
}

// `tmp` holds cache.safetensors: entry.json beside it, then renamed into place as the entry for
// ids[:b]. tmp is gone afterwards either way.
Result<StoreEntry> publish_entry(const fs::path& tmp, const std::string& store_dir,
                                 const DecoderCacheLayout& layout,
                                 const std::vector<int32_t>& prefix, int64_t requested_tokens,
                                 const nlohmann::json& extra) {
  // Whatever goes wrong below (disk full, a write refused) leaves no half-written entry.
  struct RemoveOnFailure {
    fs::path path;
    bool done = false;
    ~RemoveOnFailure() {
      std::error_code ignored;
      if (!done) fs::remove_all(path, ignored);
    }
  } guard{tmp};
  const fs::path dir = entry_dir(store_dir, layout, prefix);
  nlohmann::json meta = {{"format", "hetero-store-v1"},
                         {"family", layout.family},
                         {"fingerprint", layout.fingerprint},
                         {"B", static_cast<int64_t>(prefix.size())},
                         {"T", requested_tokens},
                         {"layers", layout.layers},
                         {"ids", prefix}};
  for (const auto& [key, value] : extra.items()) meta[key] = value;
  {
    std::ofstream out(tmp / "entry.json");
    out << meta.dump();
    out.flush();
    if (!out) return unavailable("cannot write entry.json in " + tmp.string());
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::rename(tmp, dir, ec);
  if (ec) return unavailable("cannot publish store entry " + dir.string() + ": " + ec.message());
  guard.done = true;
  StoreEntry e;
  e.path = dir.string();
  e.bytes = static_cast<int64_t>(fs::file_size(dir / "cache.safetensors", ec));
  return e;
}

}  // namespace

Result<StoreEntry> write_store_entry(const std::string& store_dir, const DecoderCacheLayout& layout,
                                     const std::vector<int32_t>& ids, int64_t b,
                                     int64_t requested_tokens, const TensorMap& arrays,
                                     const nlohmann::json& extra) {
  TensorViews views;
  for (const auto& [name, t] : arrays) views.emplace(name, TensorView::of(t));
  return write_store_entry(store_dir, layout, ids, b, requested_tokens, views, extra);
}

Result<StoreEntry> write_store_entry(const std::string& store_dir, const DecoderCacheLayout& layout,
                                     const std::vector<int32_t>& ids, int64_t b,
                                     int64_t requested_tokens, const TensorViews& arrays,
                                     const nlohmann::json& extra) {
  if (b <= 0 || b > static_cast<int64_t>(ids.size()))
    return invalid_argument("store entry needs 0 < B <= len(ids)");
  const std::vector<int32_t> prefix(ids.begin(), ids.begin() + b);
  const fs::path tmp = entry_dir(store_dir, layout, prefix).string() + kPartialSuffix;
  std::error_code ec;
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) return unavailable("cannot create " + tmp.string() + ": " + ec.message());
  if (Status st = write_safetensors((tmp / "cache.safetensors").string(), arrays); !st.is_ok()) {
    fs::remove_all(tmp, ec);
    return st;
  }
  return publish_entry(tmp, store_dir, layout, prefix, requested_tokens, extra);
}

Result<StoreEntry> Assembler::store(const std::string& store_dir, const DecoderCacheLayout& layout,
                                    const std::vector<int32_t>& ids, int64_t b,
                                    int64_t requested_tokens) {
  HETERO_ASSIGN_OR_RETURN(TensorMap rows, arrays(b));
  return write_store_entry(store_dir, layout, ids, b, requested_tokens, rows, entry_extra());
}

Result<StoreEntry> CacheAssembler::store(const std::string& store_dir,
                                         const DecoderCacheLayout& layout,
                                         const std::vector<int32_t>& ids, int64_t b,
                                         int64_t requested_tokens) {
  if (!entry_ || store_dir != store_dir_)
    return Assembler::store(store_dir, layout, ids, b, requested_tokens);
  if (b <= start_ || b > covered_ || b > static_cast<int64_t>(ids.size()))
    return invalid_argument("store entry needs start < B <= the verified rows");
  const std::unique_ptr<IncomingEntry> entry = std::move(entry_);  // published or removed, once
  std::map<std::string, int64_t> kept;
  for (int64_t l = 0; l < layout_.layers; ++l)
    for (int which = 0; which < 2; ++which) kept[array_name(l, which)] = b - start_;
  return entry->publish(layout, ids, b, requested_tokens, entry_extra(), kept);
}

Result<std::unique_ptr<IncomingEntry>> IncomingEntry::create(
    const std::string& store_dir, const DecoderCacheLayout& layout, std::vector<StoreArray> arrays,
    const std::vector<std::string>& tail_names) {
  const std::string dir = (fs::path(store_dir) / layout.fingerprint / incoming_name()).string();
  auto f = StoreFile::create(dir, std::move(arrays), tail_names);
  if (!f.is_ok()) {
    std::error_code ignored;
    fs::remove_all(dir, ignored);
    return f.status();
  }
  return std::unique_ptr<IncomingEntry>(new IncomingEntry(store_dir, std::move(f.value())));
}

IncomingEntry::~IncomingEntry() {
  if (published_) return;
  const std::string dir = file_.dir();
  std::error_code ignored;
  fs::remove_all(dir, ignored);  // never published: nothing of it is an entry
}

Result<StoreEntry> IncomingEntry::publish(const DecoderCacheLayout& layout,
                                          const std::vector<int32_t>& ids, int64_t b,
                                          int64_t requested_tokens, const nlohmann::json& extra,
                                          const std::map<std::string, int64_t>& kept,
                                          const TensorViews& tail) {
  if (published_) return failed_precondition("the entry was published already");
  published_ = true;  // once: publish_entry removes the directory itself when it fails
  const fs::path tmp = file_.dir();
  if (Status st = file_.seal(kept, tail); !st.is_ok()) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    return st;
  }
  return publish_entry(tmp, store_dir_, layout, {ids.begin(), ids.begin() + b}, requested_tokens,
                       extra);
}

int64_t remove_partial_store_entries(const std::string& store_dir) {
  int64_t removed = 0;
  std::error_code ec;
  for (fs::directory_iterator fp(store_dir, ec), end; !ec && fp != end; fp.increment(ec)) {
    if (!fp->is_directory(ec)) continue;
    std::error_code ec2;
    std::vector<fs::path> leftovers;
    for (fs::directory_iterator e(fp->path(), ec2); !ec2 && e != end; e.increment(ec2))
      if (e->path().filename().string().ends_with(kPartialSuffix)) leftovers.push_back(e->path());
    for (const fs::path& p : leftovers) removed += fs::remove_all(p, ec2) > 0 ? 1 : 0;
  }
  return removed;
}

}  // namespace hetero
