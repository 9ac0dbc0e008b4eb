// The wire between the prefill host and the decode host: a stream of self-describing,
// checksummed frames, one segment per prefill boundary, closed by a manifest.
// Format (docs/design/wire.md):
//   "HSG2" | u32 header_bytes | u64 payload_bytes | header (JSON) | payload | u64 checksum
// where header | payload is cut into pieces of kWirePieceBytes, each checksummed on its own
// (XXH3-64), and the checksum is XXH3-64 of those: both ends work on a frame's pieces in
// parallel. All integers little-endian. Between hosts that share the stack's secret, each frame
// is followed by its salt and tag (frame_tag.h).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "bridge/frame_tag.h"
#include "common/hash.h"
#include "common/status.h"
#include "common/tensor.h"

namespace hetero {

constexpr int32_t kWireVersion = 2;
// A frame's header | payload is checksummed (and tagged) in pieces of this many bytes; the last
// piece is shorter.
constexpr size_t kWirePieceBytes = size_t{1} << 20;
// How many threads work on one frame's pieces (framing, verifying): by default half the host's
// cores, 1 to 8; set_frame_threads (n >= 1) sets it for the process (a bench's --threads).
int frame_threads();
void set_frame_threads(int n);
constexpr int64_t kMaxHeaderBytes = 1 << 20;

struct WireArray {
  std::string name;  // "layers.{i}.keys" / "layers.{i}.values"
  // dtype and shape; the bytes are the tensor's own, or (a producer's view, when `view` is set)
  // tensor.numel() elements at `view`, kept alive by `keep` (e.g. a GPU program's page-locked
  // staging, which the encoder reads in place instead of copying into a tensor first).
  Tensor tensor;
  const uint8_t* view = nullptr;
  std::shared_ptr<const void> keep;

  WireArray() = default;
  WireArray(std::string n, Tensor t) : name(std::move(n)), tensor(std::move(t)) {}

  const uint8_t* data() const { return view ? view : tensor.bytes.data(); }
  // The tensor with its own bytes (a copy of a view's).
  Tensor owned() const {
    if (!view) return tensor;
    Tensor t;
    t.dtype = tensor.dtype, t.shape = tensor.shape;
    t.bytes.assign(view, view + nbytes());
    return t;
  }
  size_t nbytes() const {
    return view ? static_cast<size_t>(tensor.numel() * dtype_size(tensor.dtype))
                : tensor.bytes.size();
  }
};

struct Segment {
  int64_t seq = 0;  // 0, 1, 2, ... in send order
  std::string family, fingerprint;
  int64_t pos0 = 0, n_tokens = 0;  // token range [pos0, pos0 + n_tokens)
  std::vector<WireArray> arrays;
};

struct Manifest {
  std::string fingerprint;
  int64_t requested_tokens = 0;  // T asked for
  int64_t covered_tokens = 0;    // rows sent, contiguous from `start` to here
  int64_t segments = 0;
  bool complete = false;
  std::string reason;  // why not complete
  // How the rows were computed: "exact" (the decoder's arithmetic: the decoder's own cache, bit
  // for bit) or "fast" (within a tolerance of it); "" from a host that does not say.
  std::string arith;
  // A tail (PrefillRequest::start): the rows begin there. computed_from: where the engine's
  // forward began, its state before it coming from the prefill host's own prefix cache (the
  // tokens computed are covered_tokens - computed_from).
  int64_t start = 0;
  int64_t computed_from = 0;
};

// Frame-sized host buffers kept for the next frames. Writing a large frame into fresh memory
// pays for faulting its pages in; where the kernel gives no huge pages, that is most of the cost
// of framing a segment. A stream's segments are mostly of one size, so a buffer given back after
// its frame was sent fits the next. Thread-safe; keeps at most `max_kept` buffers idle (the
// largest), and none under `min_bytes`.
class FrameBufferPool {
 public:
  explicit FrameBufferPool(size_t max_kept = 4, size_t min_bytes = size_t{1} << 20)
      : max_kept_(max_kept), min_bytes_(min_bytes) {}
  // A buffer whose capacity holds `bytes`: a kept one if one is large enough (its size and stale
  // contents as they were, so that resizing it to a frame of the same size writes nothing), else
  // a new empty one.
  std::string take(size_t bytes);
  // A buffer whose frame is done with.
  void give(std::string buf);
  size_t kept() const;
  size_t kept_bytes() const;

 private:
  size_t max_kept_, min_bytes_;
  mutable std::mutex mu_;
  std::vector<std::string> kept_;
};

struct Frame {
  nlohmann::json header;
  // The payload is buffer[payload_offset, +payload_size): a frame that filled the parser's
  // buffer alone takes that buffer over whole instead of copying its payload out.
  std::string buffer;
  size_t payload_offset = 0, payload_size = 0;
  // Where the buffer goes once the frame is done with (its parser's pool), so that the next
  // frames are received into memory already faulted in; null: freed.
  std::shared_ptr<FrameBufferPool> pool;

  Frame() = default;
  Frame(Frame&&) = default;
  Frame& operator=(Frame&&) = default;
  Frame(const Frame&) = default;
  Frame& operator=(const Frame&) = default;
  ~Frame() {
    if (pool) pool->give(std::move(buffer));
  }
  std::string_view payload() const { return {buffer.data() + payload_offset, payload_size}; }
};

// What an array will be, before its bytes exist.
struct ArraySpec {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  size_t nbytes() const;
};
std::vector<ArraySpec> specs_of(const std::vector<WireArray>& arrays);

// One frame written as its payload arrives: the prefix and header first, then the payload's
// bytes in order, each piece checksummed (and, for a tagged stream, MACed) as it fills, the
// pieces an append() spans in parallel (frame_threads()). The frame's memory is written once.
class FrameWriter {
 public:
  // tags: the stream's tagger (null: an untagged stream); buffers: where the frame's memory
  // comes from (null: fresh memory).
  FrameWriter(const std::string& header, uint64_t payload_bytes, const FrameTagger* tags,
              FrameBufferPool* buffers);
  // The payload's next n bytes (in all, payload_bytes).
  void append(const void* data, size_t n);
  // Once the whole payload is in: the frame, and on a tagged stream its salt and digest D
  // (FrameTagger::seal makes D its tag when it is sent). The writer is spent.
  std::string finish();

 private:
  struct Piece {
    std::optional<Checksum3> sum;
    PieceMac mac;
  };
  void write(const char* src, size_t n);  // the body's next n bytes
  const FrameTagger* tags_;
  FrameSalt salt_{};
  std::string out_;
  size_t body_ = 0, filled_ = 0;  // header | payload: its size, and how much is written
  std::vector<Piece> pieces_;
  std::vector<uint64_t> sums_;
  std::vector<FrameTag> macs_;
};

// A segment's frame written array by array, as each becomes ready: the header first (from the
// specs), then each array's bytes in the specs' order. The frame is byte for byte
// encode_segment's for the same segment (and salt), so a producer can frame a segment while its
// last layers are still being computed.
class SegmentFrameWriter {
 public:
  // s: the segment's fields (its arrays are not read); specs: every array it will carry;
  // tags, buffers: as FrameWriter's.
  SegmentFrameWriter(const Segment& s, std::vector<ArraySpec> specs,
                     FrameBufferPool* buffers = nullptr, const FrameTagger* tags = nullptr);
  // The next array: its name, dtype and shape must be the next spec's.
  Status append(const WireArray& a);
  // Once every array is in: the frame (the writer is spent).
  Result<std::string> finish();

 private:
  std::vector<ArraySpec> specs_;
  size_t next_ = 0;
  FrameWriter out_;
};

// Frames as a stream's framing side writes them: with a tagger, each carries its salt and
// digest, ready for FrameTagger::seal at sending.
std::string encode_segment(const Segment& s, FrameBufferPool* buffers = nullptr,
                           const FrameTagger* tags = nullptr);
std::string encode_manifest(const Manifest& m, const FrameTagger* tags = nullptr);
// A frame that carries nothing: a stream waiting for its turn again stays audibly alive
// (receivers skip it; it is tagged and counted like any frame).
std::string encode_keepalive(const FrameTagger* tags = nullptr);
// The checksum of a frame whose header | payload is `body`: XXH3-64 of its pieces' XXH3-64s.
uint64_t body_checksum(std::string_view body);
// A frame's size on the wire without what follows it (salt and tag), from its prefix; 0 where
// `frame` does not start with a whole prefix.
size_t frame_size(std::string_view frame);

// Incremental frame parser for a byte stream arriving in arbitrary pieces. Verifies magic,
// bounds, tag (when given a tagger: every frame must carry a valid one) and checksum before
// handing out a frame, its pieces in parallel (frame_threads()); after an error it stays failed.
class FrameParser {
 public:
  // buffers: where frame-sized buffers come from and go back to (null: a pool of the parser's
  // own, keeping two).
  explicit FrameParser(int64_t max_payload_bytes, const FrameTagger* tags = nullptr,
                       std::shared_ptr<FrameBufferPool> buffers = nullptr)
      : max_payload_(max_payload_bytes),
        tags_(tags),
        buffers_(buffers ? std::move(buffers) : std::make_shared<FrameBufferPool>(2)) {}
  // Once a frame's size is known (its 16-byte prefix has arrived, within the limits), the
  // buffer is grown to hold all of it at once: a large segment arriving in small pieces is then
  // neither re-copied as the buffer doubles nor faulted in 4 KB at a time. The buffer comes from
  // the pool, where a frame taken over whole gives its own back once it is done with: a stream's
  // frames are received into memory already faulted in.
  void feed(const char* data, size_t n);
  // A complete verified frame, nothing yet (std::nullopt), or the error that ends the stream.
  Result<std::optional<Frame>> next();
  size_t buffered_bytes() const { return buf_.size() - pos_; }

 private:
  // The frame at p (its header | payload is `body` bytes): tag and checksum.
  Status verify(const char* p, size_t body);
  std::string buf_;
  size_t pos_ = 0;
  int64_t max_payload_;
  const FrameTagger* tags_;
  std::shared_ptr<FrameBufferPool> buffers_;
  uint64_t index_ = 0;  // the next frame's place in the stream (its tag's key)
  Status failed_;
};

// Decode a frame's header into a Segment (bounds-checked), arrays copied out of the payload.
Result<Segment> decode_segment(const Frame& f);
// The same, taking the frame over: the arrays are views into its buffer (WireArray::view), which
// they keep alive, so the payload is not copied again.
Result<Segment> decode_segment(Frame&& f);
Result<Manifest> decode_manifest(const Frame& f);

}  // namespace hetero
