// Verification, assembly and the decoder store: see assembler.h.
#include "bridge/assembler.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/hash.h"

namespace hetero {
namespace fs = std::filesystem;

CacheAssembler::CacheAssembler(DecoderCacheLayout expected, int64_t requested_tokens)
    : layout_(std::move(expected)), requested_(requested_tokens) {
  const size_t per_layer = static_cast<size_t>(layout_.kv_heads * requested_ * layout_.head_dim);
  keys_.assign(static_cast<size_t>(layout_.layers), std::vector<uint16_t>(per_layer));
  values_.assign(static_cast<size_t>(layout_.layers), std::vector<uint16_t>(per_layer));
}

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
                      int64_t segments, const Manifest& m) {
  if (m.fingerprint != layout.fingerprint)
    return failed_precondition("manifest fingerprint " + m.fingerprint + " does not match " +
                               layout.fingerprint);
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
  // Everything checked: copy rows into place.
  const int64_t hd = layout_.head_dim;
  for (int64_t l = 0; l < layout_.layers; ++l) {
    for (int which = 0; which < 2; ++which) {
      const auto* src =
          reinterpret_cast<const uint16_t*>(s.arrays[static_cast<size_t>(2 * l + which)].data());
      auto& dst = (which ? values_ : keys_)[static_cast<size_t>(l)];
      for (int64_t h = 0; h < layout_.kv_heads; ++h)
        std::memcpy(&dst[static_cast<size_t>((h * requested_ + s.pos0) * hd)],
                    src + h * s.n_tokens * hd, static_cast<size_t>(s.n_tokens * hd * 2));
    }
  }
  covered_ += s.n_tokens;
  ++segments_;
  return Status::ok();
}

Status CacheAssembler::finish(const Manifest& m) {
  return check_manifest(layout_, requested_, covered_, segments_, m);
}

TensorMap CacheAssembler::arrays(int64_t b) const {
  HETERO_CHECK(b >= 0 && b <= covered_);
  TensorMap out;
  const int64_t hd = layout_.head_dim;
  for (int64_t l = 0; l < layout_.layers; ++l) {
    for (int which = 0; which < 2; ++which) {
      Tensor t(DType::kBF16, {layout_.kv_heads, b, hd});
      const auto& src = (which ? values_ : keys_)[static_cast<size_t>(l)];
      for (int64_t h = 0; h < layout_.kv_heads; ++h)
        std::memcpy(t.data<uint16_t>() + h * b * hd, &src[static_cast<size_t>(h * requested_ * hd)],
                    static_cast<size_t>(b * hd * 2));
      out.emplace("layers." + std::to_string(l) + (which ? ".values" : ".keys"), std::move(t));
    }
  }
  return out;
}

Result<StoreEntry> write_store_entry(const std::string& store_dir, const DecoderCacheLayout& layout,
                                     const std::vector<int32_t>& ids, int64_t b,
                                     int64_t requested_tokens, const TensorMap& arrays,
                                     const nlohmann::json& extra) {
  if (b <= 0 || b > static_cast<int64_t>(ids.size()))
    return invalid_argument("store entry needs 0 < B <= len(ids)");
  std::vector<int32_t> prefix(ids.begin(), ids.begin() + b);
  const fs::path dir =
      fs::path(store_dir) / layout.fingerprint / prefix_key(layout.fingerprint, prefix);
  const fs::path tmp = dir.string() + kPartialSuffix;
  std::error_code ec;
  fs::remove_all(tmp, ec);
  // Whatever goes wrong below (disk full, a write refused) leaves no half-written entry.
  struct RemoveOnFailure {
    fs::path path;
    bool done = false;
    ~RemoveOnFailure() {
      std::error_code ignored;
      if (!done) fs::remove_all(path, ignored);
    }
  } guard{tmp};
  fs::create_directories(tmp, ec);
  if (ec) return unavailable("cannot create " + tmp.string() + ": " + ec.message());
  HETERO_RETURN_IF_ERROR(write_safetensors((tmp / "cache.safetensors").string(), arrays));
  nlohmann::json meta = {{"format", "hetero-store-v1"},
                         {"family", layout.family},
                         {"fingerprint", layout.fingerprint},
                         {"B", b},
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
  fs::remove_all(dir, ec);
  fs::rename(tmp, dir, ec);
  if (ec) return unavailable("cannot publish store entry " + dir.string() + ": " + ec.message());
  guard.done = true;
  StoreEntry e;
  e.path = dir.string();
  e.bytes = static_cast<int64_t>(fs::file_size(dir / "cache.safetensors", ec));
  return e;
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
