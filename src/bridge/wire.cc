// Wire encoding and parsing: see wire.h and docs/design/wire.md.
#include "bridge/wire.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "common/hash.h"
#include "common/json_text.h"
#include "common/sysmem.h"

namespace hetero {
using nlohmann::json;

namespace {

constexpr char kMagic[4] = {'H', 'S', 'G', '1'};
constexpr size_t kPrefixBytes = 4 + 4 + 8;

// An empty buffer with room for `bytes`, huge pages asked for.
std::string fresh_buffer(size_t bytes) {
  std::string buf;
  buf.reserve(bytes);
  prefer_huge_pages(buf.data(), buf.capacity());
  return buf;
}

// The frame's fixed prefix: magic, header length, payload length.
void append_prefix(std::string* out, size_t header_bytes, uint64_t payload_bytes) {
  out->append(kMagic, 4);
  const auto hb = static_cast<uint32_t>(header_bytes);
  out->append(reinterpret_cast<const char*>(&hb), 4);
  out->append(reinterpret_cast<const char*>(&payload_bytes), 8);
}

// A frame with no payload (a manifest).
std::string frame(const json& header) {
  const std::string h = header.dump();
  std::string out;
  append_prefix(&out, h.size(), 0);
  out += h;
  const uint64_t sum = checksum64(out.data() + kPrefixBytes, h.size());
  out.append(reinterpret_cast<const char*>(&sum), 8);
  return out;
}

json segment_header(const Segment& s, const std::vector<ArraySpec>& specs) {
  json arrays = json::array();
  size_t offset = 0;
  for (const ArraySpec& a : specs) {
    arrays.push_back({{"name", a.name},
                      {"dtype", dtype_name(a.dtype)},
                      {"shape", a.shape},
                      {"offset", offset},
                      {"bytes", a.nbytes()}});
    offset += a.nbytes();
  }
  return {{"v", kWireVersion},
          {"kind", "segment"},
          {"seq", s.seq},
          {"family", s.family},
          {"fingerprint", s.fingerprint},
          {"pos0", s.pos0},
          {"n_tokens", s.n_tokens},
          {"arrays", arrays}};
}

}  // namespace

size_t ArraySpec::nbytes() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return static_cast<size_t>(n * dtype_size(dtype));
}

std::vector<ArraySpec> specs_of(const std::vector<WireArray>& arrays) {
  std::vector<ArraySpec> specs;
  for (const WireArray& a : arrays) specs.push_back({a.name, a.tensor.dtype, a.tensor.shape});
  return specs;
}

std::string FrameBufferPool::take(size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The smallest kept buffer that holds the frame.
    auto best = kept_.end();
    for (auto it = kept_.begin(); it != kept_.end(); ++it)
      if (it->capacity() >= bytes && (best == kept_.end() || it->capacity() < best->capacity()))
        best = it;
    if (best != kept_.end()) {
      std::string buf = std::move(*best);
      kept_.erase(best);
      buf.clear();  // keeps its capacity, and its pages
      return buf;
    }
  }
  return fresh_buffer(bytes);
}

void FrameBufferPool::give(std::string buf) {
  if (buf.capacity() < min_bytes_ || max_kept_ == 0) return;
  std::string dropped;  // freed outside the lock
  std::lock_guard<std::mutex> lock(mu_);
  if (kept_.size() < max_kept_) {
    kept_.push_back(std::move(buf));
    return;
  }
  auto smallest = std::min_element(kept_.begin(), kept_.end(), [](const auto& a, const auto& b) {
    return a.capacity() < b.capacity();
  });
  if (smallest->capacity() >= buf.capacity()) return;
  dropped = std::move(*smallest);
  *smallest = std::move(buf);
}

size_t FrameBufferPool::kept() const {
  std::lock_guard<std::mutex> lock(mu_);
  return kept_.size();
}

size_t FrameBufferPool::kept_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const std::string& b : kept_) n += b.capacity();
  return n;
}

SegmentFrameWriter::SegmentFrameWriter(const Segment& s, std::vector<ArraySpec> specs,
                                       FrameBufferPool* buffers)
    : specs_(std::move(specs)) {
  const std::string h = segment_header(s, specs_).dump();
  uint64_t pb = 0;
  for (const ArraySpec& a : specs_) pb += a.nbytes();
  const size_t bytes = kPrefixBytes + h.size() + pb + 8;
  out_ = buffers ? buffers->take(bytes) : fresh_buffer(bytes);
  append_prefix(&out_, h.size(), pb);
  out_ += h;
  sum_.update(h.data(), h.size());
}

Status SegmentFrameWriter::append(const WireArray& a) {
  if (next_ >= specs_.size())
    return internal_error("segment array '" + a.name + "' beyond the " +
                          std::to_string(specs_.size()) + " planned");
  const ArraySpec& want = specs_[next_];
  if (a.name != want.name || a.tensor.dtype != want.dtype || a.tensor.shape != want.shape ||
      a.nbytes() != want.nbytes())
    return internal_error("segment array '" + a.name + "' " + a.tensor.shape_string() +
                          " where the plan has '" + want.name + "'");
  // Copy and checksum 256 KB at a time, while the piece is still in cache (34 ms per 268 MB
  // segment on the cpp-kernels machine; 37 ms with 1 MB or 4 MB pieces).
  constexpr size_t kPiece = size_t{1} << 18;
  const auto* p = reinterpret_cast<const char*>(a.data());
  for (size_t at = 0; at < want.nbytes(); at += kPiece) {
    const size_t n = std::min(kPiece, want.nbytes() - at);
    out_.append(p + at, n);
    sum_.update(out_.data() + out_.size() - n, n);
  }
  ++next_;
  return Status::ok();
}

Result<std::string> SegmentFrameWriter::finish() {
  if (next_ != specs_.size())
    return internal_error("segment frame finished with " + std::to_string(next_) + " of " +
                          std::to_string(specs_.size()) + " arrays");
  const uint64_t sum = sum_.digest();
  out_.append(reinterpret_cast<const char*>(&sum), 8);
  return std::move(out_);
}

std::string encode_segment(const Segment& s, FrameBufferPool* buffers) {
  SegmentFrameWriter w(s, specs_of(s.arrays), buffers);
  for (const WireArray& a : s.arrays) HETERO_CHECK(w.append(a).is_ok());
  return std::move(w.finish().value());
}

std::string encode_manifest(const Manifest& m) {
  json h = {{"v", kWireVersion},
            {"kind", "manifest"},
            {"fingerprint", m.fingerprint},
            {"requested_tokens", m.requested_tokens},
            {"covered_tokens", m.covered_tokens},
            {"start", m.start},
            {"computed_from", m.computed_from},
            {"segments", m.segments},
            {"complete", m.complete},
            {"reason", m.reason},
            {"arith", m.arith}};
  return frame(h);
}

std::string encode_keepalive() { return frame({{"v", kWireVersion}, {"kind", "keepalive"}}); }

void FrameParser::feed(const char* data, size_t n) {
  const size_t have = buf_.size() - pos_;
  if (failed_.is_ok() && have + n >= kPrefixBytes) {
    // The frame at pos_: its prefix, from what is buffered and what arrives now.
    char prefix[kPrefixBytes];
    const size_t from_buf = std::min(have, kPrefixBytes);
    std::memcpy(prefix, buf_.data() + pos_, from_buf);
    std::memcpy(prefix + from_buf, data, kPrefixBytes - from_buf);
    uint32_t hb;
    uint64_t pb;
    std::memcpy(&hb, prefix + 4, 4);
    std::memcpy(&pb, prefix + 8, 8);
    // A bad magic or size is next()'s to report; here it only means no growing.
    if (std::memcmp(prefix, kMagic, 4) == 0 && hb <= kMaxHeaderBytes &&
        pb <= static_cast<uint64_t>(max_payload_)) {
      const size_t tag = tags_ ? kFrameTagBytes : 0;
      const size_t total = std::max<size_t>(kPrefixBytes + hb + pb + 8 + tag, have + n);
      if (buf_.capacity() - pos_ < total) {
        std::string grown = fresh_buffer(total);
        grown.append(buf_, pos_, have);  // drops what earlier frames left
        buf_ = std::move(grown);
        pos_ = 0;
      }
    }
  }
  buf_.append(data, n);
}

Result<std::optional<Frame>> FrameParser::next() {
  if (!failed_.is_ok()) return failed_;
  const size_t avail = buf_.size() - pos_;
  if (avail < kPrefixBytes) return std::optional<Frame>();
  const char* p = buf_.data() + pos_;
  if (std::memcmp(p, kMagic, 4) != 0)
    return failed_ = data_loss("bad frame magic: not a hetero segment stream");
  uint32_t hb;
  uint64_t pb;
  std::memcpy(&hb, p + 4, 4);
  std::memcpy(&pb, p + 8, 8);
  if (hb > kMaxHeaderBytes)
    return failed_ =
               data_loss("frame header of " + std::to_string(hb) + " bytes exceeds the limit");
  if (pb > static_cast<uint64_t>(max_payload_))
    return failed_ =
               data_loss("frame payload of " + std::to_string(pb) + " bytes exceeds the limit");
  const size_t total = kPrefixBytes + hb + pb + 8;
  const size_t tagged = total + (tags_ ? kFrameTagBytes : 0);
  if (avail < tagged) return std::optional<Frame>();
  // The tag first: nothing of a frame the secret's holder did not write is looked at.
  if (tags_ && !tags_->verify(index_, p, total, reinterpret_cast<const uint8_t*>(p + total)))
    return failed_ = data_loss("frame " + std::to_string(index_) +
                               " has no valid tag: it is not from a prefill host holding the "
                               "stack's secret, or it was altered on the way");
  ++index_;
  uint64_t sum;
  std::memcpy(&sum, p + kPrefixBytes + hb + pb, 8);
  if (checksum64(p + kPrefixBytes, hb + pb) != sum)
    return failed_ = data_loss("frame checksum mismatch (corrupted segment)");
  Frame f;
  auto header = parse_untrusted_json(std::string_view(p + kPrefixBytes, hb));
  f.header = header.is_ok() ? std::move(header.value()) : json(json::value_t::discarded);
  if (f.header.is_discarded() || !f.header.is_object())
    return failed_ = data_loss("frame header is not a JSON object");
  const json& version = f.header.contains("v") ? f.header["v"] : json();
  if (!version.is_number_integer() || version.get<int64_t>() != kWireVersion)
    return failed_ = data_loss("unsupported wire version " + version.dump());
  f.payload_size = pb;
  if (pos_ == 0 && avail == tagged) {  // the buffer holds exactly this frame: hand it over
    f.buffer = std::move(buf_);
    f.payload_offset = kPrefixBytes + hb;
    buf_.clear();
    return std::optional<Frame>(std::move(f));
  }
  f.buffer.assign(p + kPrefixBytes + hb, pb);
  pos_ += tagged;
  if (pos_ > (1u << 24) && pos_ * 2 > buf_.size()) {  // compact now and then
    buf_.erase(0, pos_);
    pos_ = 0;
  }
  return std::optional<Frame>(std::move(f));
}

namespace {

// Shared by both decode_segment overloads: header fields and bounds; `take` fills an array's
// bytes from its place in the payload.
template <typename Take>
Result<Segment> decode_segment_with(const Frame& f, Take take) {
  Segment s;
  try {
    if (f.header.at("kind") != "segment") return data_loss("frame is not a segment");
    s.seq = f.header.at("seq").get<int64_t>();
    s.family = f.header.at("family").get<std::string>();
    s.fingerprint = f.header.at("fingerprint").get<std::string>();
    s.pos0 = f.header.at("pos0").get<int64_t>();
    s.n_tokens = f.header.at("n_tokens").get<int64_t>();
    for (const auto& a : f.header.at("arrays")) {
      WireArray w;
      w.name = a.at("name").get<std::string>();
      HETERO_ASSIGN_OR_RETURN(w.tensor.dtype, dtype_from_name(a.at("dtype").get<std::string>()));
      // Every size from the header is checked without overflow against the payload that
      // arrived: a hostile header cannot make a bound wrap around.
      const std::string_view payload = f.payload();
      const int64_t payload_bytes = static_cast<int64_t>(payload.size());
      // (The bound is checked on the whole product: a zero-row array after a dim of 1 fits an
      // empty payload, as a segment whose tokens complete no compressed row has.)
      int64_t want = dtype_size(w.tensor.dtype);
      for (const auto& d : a.at("shape")) {
        const int64_t v = d.get<int64_t>();
        if (v < 0 || __builtin_mul_overflow(want, v, &want))
          return data_loss("array '" + w.name + "' has a bad dim");
        w.tensor.shape.push_back(v);
      }
      if (want > payload_bytes) return data_loss("array '" + w.name + "' does not fit the payload");
      const int64_t off = a.at("offset").get<int64_t>(), bytes = a.at("bytes").get<int64_t>();
      if (bytes != want || off < 0 || off > payload_bytes || bytes > payload_bytes - off)
        return data_loss("array '" + w.name + "' does not fit its shape or the payload");
      take(&w, payload.data() + off, static_cast<size_t>(bytes));
      s.arrays.push_back(std::move(w));
    }
  } catch (const nlohmann::json::exception& e) {
    return data_loss(std::string("malformed segment header: ") + e.what());
  }
  if (s.pos0 < 0 || s.n_tokens <= 0) return data_loss("segment has an empty or negative range");
  return s;
}

}  // namespace

Result<Segment> decode_segment(const Frame& f) {
  return decode_segment_with(
      f, [](WireArray* w, const char* p, size_t n) { w->tensor.bytes.assign(p, p + n); });
}

Result<Segment> decode_segment(Frame&& f) {
  auto owner = std::make_shared<Frame>(std::move(f));
  return decode_segment_with(*owner, [&owner](WireArray* w, const char* p, size_t) {
    w->view = reinterpret_cast<const uint8_t*>(p);
    w->keep = owner;
  });
}

Result<Manifest> decode_manifest(const Frame& f) {
  Manifest m;
  try {
    if (f.header.at("kind") != "manifest") return data_loss("frame is not a manifest");
    m.fingerprint = f.header.at("fingerprint").get<std::string>();
    m.requested_tokens = f.header.at("requested_tokens").get<int64_t>();
    m.covered_tokens = f.header.at("covered_tokens").get<int64_t>();
    m.start = f.header.value("start", int64_t{0});
    m.computed_from = f.header.value("computed_from", int64_t{0});
    m.segments = f.header.at("segments").get<int64_t>();
    m.complete = f.header.at("complete").get<bool>();
    m.reason = f.header.value("reason", "");
    m.arith = f.header.value("arith", "");
  } catch (const nlohmann::json::exception& e) {
    return data_loss(std::string("malformed manifest: ") + e.what());
  }
  return m;
}

}  // namespace hetero
