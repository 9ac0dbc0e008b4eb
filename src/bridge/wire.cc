// Wire encoding and parsing: see wire.h and docs/design/wire.md.
#include "bridge/wire.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "common/hash.h"
#include "common/json_text.h"
#include "common/sysmem.h"

namespace hetero {
using nlohmann::json;

namespace {

constexpr char kMagic[4] = {'H', 'S', 'G', '2'};
constexpr char kMagicV1[4] = {'H', 'S', 'G', '1'};
constexpr size_t kPrefixBytes = 4 + 4 + 8;
// Within a piece, bytes are copied and checksummed this many at a time, while they are still in
// cache (on the cpp-kernels machine 256 KB framed a 268 MB segment in 34 ms, 1 or 4 MB in 37).
constexpr size_t kBlockBytes = size_t{1} << 18;
static_assert(std::endian::native == std::endian::little, "the wire's integers are little-endian");

size_t pieces_of(size_t body) { return (body + kWirePieceBytes - 1) / kWirePieceBytes; }
// Piece j of a body of `body` bytes: its length (the last piece is shorter).
size_t piece_bytes(size_t body, size_t j) {
  return std::min(kWirePieceBytes, body - j * kWirePieceBytes);
}

// The header and payload lengths from a frame's prefix (p: at least kPrefixBytes).
struct Lengths {
  uint32_t header;
  uint64_t payload;
};
Lengths read_lengths(const char* p) {
  Lengths l;
  std::memcpy(&l.header, p + 4, 4);
  std::memcpy(&l.payload, p + 8, 8);
  return l;
}

std::atomic<int> g_frame_threads{
    std::clamp(static_cast<int>(std::thread::hardware_concurrency()) / 2, 1, 8)};

uint64_t payload_of(const std::vector<ArraySpec>& specs) {
  uint64_t pb = 0;
  for (const ArraySpec& a : specs) pb += a.nbytes();
  return pb;
}

// The frame's checksum over its pieces' (each a little-endian u64, in order).
uint64_t checksum_of(const std::vector<uint64_t>& sums) {
  return checksum3(sums.data(), sums.size() * sizeof(uint64_t));
}

// An empty buffer with room for `bytes`, huge pages asked for. A frame-sized one is rounded up
// (past a page's slack, to whole MiB), so that it still fits a later frame of the same rows
// whose header has grown a few bytes (a longer pos0) when it comes back to a pool.
std::string fresh_buffer(size_t bytes) {
  constexpr size_t kMiB = size_t{1} << 20;
  if (bytes >= kMiB) bytes = (bytes + 4096 + kMiB - 1) / kMiB * kMiB;
  std::string buf;
  buf.reserve(bytes);
  prefer_huge_pages(buf.data(), buf.capacity());
  return buf;
}

// A frame with no payload (a manifest, a keep-alive).
std::string frame(const json& header, const FrameTagger* tags) {
  return FrameWriter(header.dump(), 0, tags, nullptr).finish();
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

int frame_threads() { return g_frame_threads.load(std::memory_order_relaxed); }

void set_frame_threads(int n) {
  HETERO_CHECK(n >= 1);
  g_frame_threads.store(n, std::memory_order_relaxed);
}

uint64_t body_checksum(std::string_view body) {
  std::vector<uint64_t> sums(pieces_of(body.size()));
  for (size_t j = 0; j < sums.size(); ++j)
    sums[j] = checksum3(body.data() + j * kWirePieceBytes, piece_bytes(body.size(), j));
  return checksum_of(sums);
}

size_t frame_size(std::string_view f) {
  if (f.size() < kPrefixBytes) return 0;
  const Lengths l = read_lengths(f.data());
  return kPrefixBytes + l.header + l.payload + 8;
}

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
      std::string buf = std::move(*best);  // its capacity, its pages, and its size
      kept_.erase(best);
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

FrameWriter::FrameWriter(const std::string& header, uint64_t payload_bytes, const FrameTagger* tags,
                         FrameBufferPool* buffers)
    : tags_(tags), body_(header.size() + payload_bytes) {
  const size_t bytes = kPrefixBytes + body_ + 8 + (tags ? kFrameSealBytes : 0);
  out_ = buffers ? buffers->take(bytes) : fresh_buffer(bytes);
  out_.resize(bytes);  // a kept buffer of a frame this size: nothing written
  std::memcpy(out_.data(), kMagic, 4);
  const auto hb = static_cast<uint32_t>(header.size());
  std::memcpy(out_.data() + 4, &hb, 4);
  std::memcpy(out_.data() + 8, &payload_bytes, 8);
  pieces_.resize(pieces_of(body_));
  sums_.resize(pieces_.size());
  if (tags) salt_ = FrameTagger::new_salt(), macs_.resize(pieces_.size());
  write(header.data(), header.size());
}

void FrameWriter::append(const void* data, size_t n) {
  HETERO_CHECK(filled_ + n <= body_);
  write(static_cast<const char*>(data), n);
}

void FrameWriter::write(const char* src, size_t n) {
  if (n == 0) return;
  const size_t from = filled_, to = filled_ + n;
  const size_t first = from / kWirePieceBytes, last = (to - 1) / kWirePieceBytes;
  char* body = out_.data() + kPrefixBytes;
  // Each piece this write reaches is one task: its share copied, checksummed and MACed a block
  // at a time, and closed if this write completes it.
  const auto piece_count = static_cast<int64_t>(last - first + 1);
#pragma omp parallel for schedule(dynamic, 1) num_threads(frame_threads()) if (piece_count > 1)
  for (int64_t k = 0; k < piece_count; ++k) {
    const size_t j = first + static_cast<size_t>(k);
    const size_t lo = std::max(from, j * kWirePieceBytes);
    const size_t end = j * kWirePieceBytes + piece_bytes(body_, j);
    const size_t hi = std::min(to, end);
    Piece& p = pieces_[j];
    if (lo == j * kWirePieceBytes) {
      p.sum.emplace();
      if (tags_) p.mac = tags_->piece(salt_, j);
    }
    for (size_t at = lo; at < hi; at += kBlockBytes) {
      const size_t len = std::min(kBlockBytes, hi - at);
      std::memcpy(body + at, src + (at - from), len);
      p.sum->update(body + at, len);
      if (tags_) p.mac.update(body + at, len);
    }
    if (hi == end) {
      sums_[j] = p.sum->digest();
      p.sum.reset();
      if (tags_) macs_[j] = p.mac.final();
    }
  }
  filled_ = to;
}

std::string FrameWriter::finish() {
  HETERO_CHECK(filled_ == body_);
  const uint64_t sum = checksum_of(sums_);
  std::memcpy(out_.data() + kPrefixBytes + body_, &sum, 8);
  if (tags_) {
    char* seal = out_.data() + kPrefixBytes + body_ + 8;
    const FrameTag d = tags_->digest(salt_, out_.data(), sum, macs_);
    std::memcpy(seal, salt_.data(), kFrameSaltBytes);
    std::memcpy(seal + kFrameSaltBytes, d.data(), kFrameTagBytes);
  }
  return std::move(out_);
}

SegmentFrameWriter::SegmentFrameWriter(const Segment& s, std::vector<ArraySpec> specs,
                                       FrameBufferPool* buffers, const FrameTagger* tags)
    : specs_(std::move(specs)),
      out_(segment_header(s, specs_).dump(), payload_of(specs_), tags, buffers) {}

Status SegmentFrameWriter::append(const WireArray& a) {
  if (next_ >= specs_.size())
    return internal_error("segment array '" + a.name + "' beyond the " +
                          std::to_string(specs_.size()) + " planned");
  const ArraySpec& want = specs_[next_];
  if (a.name != want.name || a.tensor.dtype != want.dtype || a.tensor.shape != want.shape ||
      a.nbytes() != want.nbytes())
    return internal_error("segment array '" + a.name + "' " + a.tensor.shape_string() +
                          " where the plan has '" + want.name + "'");
  out_.append(a.data(), want.nbytes());
  ++next_;
  return Status::ok();
}

Result<std::string> SegmentFrameWriter::finish() {
  if (next_ != specs_.size())
    return internal_error("segment frame finished with " + std::to_string(next_) + " of " +
                          std::to_string(specs_.size()) + " arrays");
  return out_.finish();
}

std::string encode_segment(const Segment& s, FrameBufferPool* buffers, const FrameTagger* tags) {
  SegmentFrameWriter w(s, specs_of(s.arrays), buffers, tags);
  for (const WireArray& a : s.arrays) HETERO_CHECK(w.append(a).is_ok());
  return std::move(w.finish().value());
}

std::string encode_manifest(const Manifest& m, const FrameTagger* tags) {
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
  return frame(h, tags);
}

std::string encode_keepalive(const FrameTagger* tags) {
  return frame({{"v", kWireVersion}, {"kind", "keepalive"}}, tags);
}

void FrameParser::feed(const char* data, size_t n) {
  const size_t have = buf_.size() - pos_;
  if (failed_.is_ok() && have + n >= kPrefixBytes) {
    // The frame at pos_: its prefix, from what is buffered and what arrives now.
    char prefix[kPrefixBytes];
    const size_t from_buf = std::min(have, kPrefixBytes);
    std::memcpy(prefix, buf_.data() + pos_, from_buf);
    std::memcpy(prefix + from_buf, data, kPrefixBytes - from_buf);
    const auto [hb, pb] = read_lengths(prefix);
    // A bad magic or size is next()'s to report; here it only means no growing.
    if (std::memcmp(prefix, kMagic, 4) == 0 && hb <= kMaxHeaderBytes &&
        pb <= static_cast<uint64_t>(max_payload_)) {
      const size_t tag = tags_ ? kFrameSealBytes : 0;
      const size_t total = std::max<size_t>(kPrefixBytes + hb + pb + 8 + tag, have + n);
      if (buf_.capacity() - pos_ < total) {
        std::string grown = buffers_->take(total);
        grown.clear();                   // keeps its capacity and its pages
        grown.append(buf_, pos_, have);  // drops what earlier frames left
        buffers_->give(std::exchange(buf_, std::move(grown)));
        pos_ = 0;
      }
    }
  }
  buf_.append(data, n);
}

Status FrameParser::verify(const char* p, size_t body) {
  // Every piece's checksum and (tagged) MAC, in parallel; then the tag first: nothing of a frame
  // the secret's holder did not write is looked at.
  const char* b = p + kPrefixBytes;
  const size_t n = pieces_of(body);
  const char* seal = b + body + 8;
  FrameSalt salt{};
  if (tags_) std::memcpy(salt.data(), seal, kFrameSaltBytes);
  std::vector<uint64_t> sums(n);
  std::vector<FrameTag> macs(tags_ ? n : 0);
#pragma omp parallel for schedule(dynamic, 1) num_threads(frame_threads()) if (n > 1)
  for (int64_t k = 0; k < static_cast<int64_t>(n); ++k) {
    const size_t j = static_cast<size_t>(k), at = j * kWirePieceBytes;
    const size_t len = piece_bytes(body, j);
    sums[j] = checksum3(b + at, len);
    if (tags_) {
      PieceMac m = tags_->piece(salt, j);
      m.update(b + at, len);
      macs[j] = m.final();
    }
  }
  uint64_t sum;
  std::memcpy(&sum, b + body, 8);
  if (tags_) {
    const FrameTag d = tags_->digest(salt, p, sum, macs);
    const FrameTag t = tags_->tag(index_, salt, d);
    if (!FrameTagger::same(t, reinterpret_cast<const uint8_t*>(seal + kFrameSaltBytes)))
      return data_loss("frame " + std::to_string(index_) +
                       " has no valid tag: it is not from a prefill host holding the "
                       "stack's secret, or it was altered on the way");
  }
  if (checksum_of(sums) != sum) return data_loss("frame checksum mismatch (corrupted segment)");
  return Status::ok();
}

Result<std::optional<Frame>> FrameParser::next() {
  if (!failed_.is_ok()) return failed_;
  const size_t avail = buf_.size() - pos_;
  if (avail < kPrefixBytes) return std::optional<Frame>();
  const char* p = buf_.data() + pos_;
  if (std::memcmp(p, kMagicV1, 4) == 0)
    return failed_ = data_loss(
               "a wire version 1 frame (HSG1): this receiver reads version " +
               std::to_string(kWireVersion) +
               "; the prefill host and the decode side must run releases that speak the same wire");
  if (std::memcmp(p, kMagic, 4) != 0)
    return failed_ = data_loss("bad frame magic: not a hetero segment stream");
  const auto [hb, pb] = read_lengths(p);
  if (hb > kMaxHeaderBytes)
    return failed_ =
               data_loss("frame header of " + std::to_string(hb) + " bytes exceeds the limit");
  if (pb > static_cast<uint64_t>(max_payload_))
    return failed_ =
               data_loss("frame payload of " + std::to_string(pb) + " bytes exceeds the limit");
  const size_t total = kPrefixBytes + hb + pb + 8;
  const size_t tagged = total + (tags_ ? kFrameSealBytes : 0);
  if (avail < tagged) return std::optional<Frame>();
  if (Status st = verify(p, hb + pb); !st.is_ok()) return failed_ = st;
  ++index_;
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
    f.pool = buffers_;
    buf_ = std::string();
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
