// Wire frames: self-describing payloads (each value encodes layer, array and token, so a
// misrouted byte names itself), byte-at-a-time feeding, and every corruption refused.
#include "bridge/wire.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>

#include "common/hash.h"

namespace hetero {

// Value of element (layer l, array a, head h, token t, dim d) in a test segment.
uint16_t tag(int64_t l, int a, int64_t h, int64_t t, int64_t d) {
  return static_cast<uint16_t>((l * 7 + a * 3 + h * 5 + t * 11 + d) & 0x7fff);
}

Segment make_segment(int64_t seq, int64_t pos0, int64_t n, int64_t layers, int64_t kvh, int64_t hd,
                     const std::string& fp = "fp") {
  Segment s;
  s.seq = seq, s.family = "llama", s.fingerprint = fp, s.pos0 = pos0, s.n_tokens = n;
  for (int64_t l = 0; l < layers; ++l)
    for (int a = 0; a < 2; ++a) {
      Tensor t(DType::kBF16, {kvh, n, hd});
      for (int64_t h = 0; h < kvh; ++h)
        for (int64_t i = 0; i < n; ++i)
          for (int64_t d = 0; d < hd; ++d)
            t.data<uint16_t>()[(h * n + i) * hd + d] = tag(l, a, h, pos0 + i, d);
      s.arrays.push_back({"layers." + std::to_string(l) + (a ? ".values" : ".keys"), std::move(t)});
    }
  return s;
}

TEST(Wire, RoundTripByteAtATime) {
  Segment s = make_segment(0, 5, 3, 2, 2, 4);
  std::string bytes = encode_segment(s) + encode_manifest({"fp", 8, 8, 1, true, "", "exact"});
  FrameParser p(1 << 20);
  std::vector<Frame> frames;
  for (char c : bytes) {
    p.feed(&c, 1);
    auto f = p.next();
    ASSERT_TRUE(f.is_ok()) << f.status().to_string();
    if (f.value()) frames.push_back(*f.value());
  }
  ASSERT_EQ(frames.size(), 2u);
  auto d = decode_segment(frames[0]);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_EQ(d->pos0, 5);
  ASSERT_EQ(d->arrays.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(d->arrays[i].name, s.arrays[i].name);
    EXPECT_EQ(d->arrays[i].tensor.bytes, s.arrays[i].tensor.bytes);
  }
  auto m = decode_manifest(frames[1]);
  ASSERT_TRUE(m.is_ok());
  EXPECT_TRUE(m->complete);
  EXPECT_EQ(m->covered_tokens, 8);
  EXPECT_EQ(m->arith, "exact");
}

// A segment whose arrays all have no rows (a DeepSeek-V4 call of a few tokens that completes no
// compressed row) has an empty payload, and decodes.
TEST(Wire, ASegmentOfEmptyArraysRoundTrips) {
  Segment s;
  s.seq = 2, s.family = "deepseek_v4", s.fingerprint = "fp", s.pos0 = 128, s.n_tokens = 2;
  s.arrays.push_back({"layers.1.pool.pooled", Tensor(DType::kBF16, {1, 0, 16})});
  s.arrays.push_back({"layers.1.index.pooled", Tensor(DType::kBF16, {1, 0, 8})});
  FrameParser p(1 << 20);
  const std::string bytes = encode_segment(s);
  p.feed(bytes.data(), bytes.size());
  auto f = p.next();
  ASSERT_TRUE(f.is_ok() && f.value()) << f.status().to_string();
  auto d = decode_segment(*f.value());
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  ASSERT_EQ(d->arrays.size(), 2u);
  EXPECT_EQ(d->arrays[1].tensor.shape, (std::vector<int64_t>{1, 0, 8}));
}

// An array that views memory it does not own (a GPU program's page-locked staging) encodes to the
// same bytes as one that owns a copy.
TEST(Wire, ViewArraysEncodeAsOwnedOnes) {
  const Segment owned = make_segment(2, 8, 5, 3, 2, 4);
  Segment viewed = owned;
  auto keep = std::make_shared<std::vector<Tensor>>();
  keep->reserve(viewed.arrays.size());  // the views point into these tensors
  for (WireArray& a : viewed.arrays) {
    keep->push_back(std::move(a.tensor));
    a.tensor = Tensor();
    a.tensor.dtype = keep->back().dtype;
    a.tensor.shape = keep->back().shape;
    a.view = keep->back().bytes.data();
    a.keep = keep;
  }
  EXPECT_EQ(encode_segment(viewed), encode_segment(owned));
}

// Frames written into a pool's buffers are the same bytes; a buffer given back is reused (its
// memory, not fresh), a smaller one when it fits, and the pool keeps no more than it may.
TEST(Wire, PooledFramesReuseTheirBuffers) {
  const Segment big = make_segment(0, 0, 96, 4, 2, 64);  // ~200 KB
  const Segment small = make_segment(1, 96, 8, 4, 2, 64);
  FrameBufferPool pool(2, 1024);
  std::string f = encode_segment(big, &pool);
  EXPECT_EQ(f, encode_segment(big));
  const char* memory = f.data();
  const size_t capacity = f.capacity();
  pool.give(std::move(f));
  EXPECT_EQ(pool.kept(), 1u);
  std::string g = encode_segment(small, &pool);  // fits in the kept buffer: reuses it
  EXPECT_EQ(g, encode_segment(small));
  EXPECT_EQ(g.data(), memory);
  EXPECT_EQ(pool.kept(), 0u);
  std::string h = encode_segment(big, &pool);  // none kept: new memory
  EXPECT_NE(h.data(), memory);
  EXPECT_EQ(h, encode_segment(big));
  pool.give(std::move(g));
  pool.give(std::move(h));
  pool.give(std::string(4096, 'x'));  // full: a buffer smaller than every kept one is dropped
  EXPECT_EQ(pool.kept(), 2u);
  EXPECT_GE(pool.kept_bytes(), 2 * capacity);
  pool.give(std::string(100, 'x'));  // under min_bytes: never kept
  EXPECT_EQ(pool.kept(), 2u);
  const std::string taken = pool.take(capacity);
  EXPECT_GE(taken.capacity(), capacity);
}

// A receiver's frames come back to its parser's pool once done with (here: once the segment
// decoded from a frame, whose arrays view it, is gone), and the next frame of the stream is
// received into that memory, byte for byte as it was sent, though its header is longer (pos0).
TEST(Wire, AStreamsFramesAreReceivedIntoReusedMemory) {
  const std::string a = encode_segment(make_segment(0, 0, 600, 4, 2, 64));  // ~1.2 MB each
  const std::string b = encode_segment(make_segment(1, 600, 600, 4, 2, 64));
  ASSERT_GT(b.size(), a.size());
  auto pool = std::make_shared<FrameBufferPool>(2, 1024);
  FrameParser p(int64_t{1} << 30, nullptr, pool);
  auto receive = [&p](const std::string& bytes) {
    for (size_t at = 0; at < bytes.size(); at += 4096)
      p.feed(bytes.data() + at, std::min<size_t>(4096, bytes.size() - at));
    auto f = p.next();
    EXPECT_TRUE(f.is_ok() && f->has_value());
    return std::move(**f);
  };
  const char* memory = nullptr;
  {
    auto s = decode_segment(receive(a));
    ASSERT_TRUE(s.is_ok()) << s.status().to_string();
    memory = reinterpret_cast<const char*>(s->arrays[0].data());
    EXPECT_EQ(pool->kept(), 0u);  // the segment's arrays still view it
  }
  EXPECT_EQ(pool->kept(), 1u);
  Frame f = receive(b);
  EXPECT_EQ(pool->kept(), 0u);
  EXPECT_LE(f.buffer.data(), memory);
  EXPECT_GT(f.buffer.data() + f.buffer.size(), memory);  // the same memory, taken again
  auto s = decode_segment(f);
  ASSERT_TRUE(s.is_ok());
  EXPECT_EQ(encode_segment(*s), b);
}

// Decoding a frame it takes over, the receiver's arrays view the frame's buffer: the same bytes
// as a copying decode, still valid once the parser has moved on to later frames.
TEST(Wire, TakenOverFrameDecodesIntoViews) {
  const Segment a = make_segment(0, 0, 7, 3, 2, 4), b = make_segment(1, 7, 5, 3, 2, 4);
  const std::string bytes = encode_segment(a) + encode_segment(b);
  FrameParser p(1 << 20);
  std::vector<Segment> views, copies;
  for (size_t at = 0; at < bytes.size(); at += 13) {  // pieces that split every boundary
    p.feed(bytes.data() + at, std::min<size_t>(13, bytes.size() - at));
    for (;;) {
      auto f = p.next();
      ASSERT_TRUE(f.is_ok()) << f.status().to_string();
      if (!f->has_value()) break;
      auto c = decode_segment(**f);
      ASSERT_TRUE(c.is_ok());
      copies.push_back(std::move(*c));
      auto v = decode_segment(std::move(**f));
      ASSERT_TRUE(v.is_ok());
      views.push_back(std::move(*v));
    }
  }
  ASSERT_EQ(views.size(), 2u);
  for (size_t s = 0; s < 2; ++s) {
    ASSERT_EQ(views[s].arrays.size(), copies[s].arrays.size());
    for (size_t i = 0; i < views[s].arrays.size(); ++i) {
      const WireArray& v = views[s].arrays[i];
      EXPECT_NE(v.view, nullptr);
      EXPECT_TRUE(v.tensor.bytes.empty());
      EXPECT_EQ(v.owned().bytes, copies[s].arrays[i].tensor.bytes) << s << " " << v.name;
      EXPECT_EQ(v.owned().bytes, (s ? b : a).arrays[i].tensor.bytes) << s << " " << v.name;
    }
  }
}

// A frame that fills the parser's buffer alone is handed over without copying its payload; the
// parser stays usable, and a frame behind another still comes out whole.
TEST(Wire, WholeFrameHandOverKeepsTheParserUsable) {
  const Segment a = make_segment(0, 0, 3, 2, 2, 4), b = make_segment(1, 3, 3, 2, 2, 4);
  FrameParser p(1 << 20);
  const std::string fa = encode_segment(a);
  p.feed(fa.data(), fa.size());
  auto f1 = p.next();
  ASSERT_TRUE(f1.is_ok() && f1->has_value());
  EXPECT_EQ(p.buffered_bytes(), 0u);
  const std::string both = encode_segment(b) + encode_segment(a);
  p.feed(both.data(), both.size());
  auto f2 = p.next(), f3 = p.next();
  ASSERT_TRUE(f2.is_ok() && f2->has_value() && f3.is_ok() && f3->has_value());
  for (const auto& [frame, want] :
       {std::pair{&**f1, &a}, std::pair{&**f2, &b}, std::pair{&**f3, &a}}) {
    auto d = decode_segment(*frame);
    ASSERT_TRUE(d.is_ok()) << d.status().to_string();
    EXPECT_EQ(d->pos0, want->pos0);
    ASSERT_EQ(d->arrays.size(), want->arrays.size());
    for (size_t i = 0; i < want->arrays.size(); ++i)
      EXPECT_EQ(d->arrays[i].tensor.bytes, want->arrays[i].tensor.bytes);
  }
  auto none = p.next();
  ASSERT_TRUE(none.is_ok());
  EXPECT_FALSE(none->has_value());
}

TEST(Wire, EveryFlippedByteIsCaught) {
  const std::string good = encode_segment(make_segment(0, 0, 2, 1, 1, 2));
  for (size_t i = 0; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] ^= 0x10;
    FrameParser p(1 << 20);
    p.feed(bad.data(), bad.size());
    auto f = p.next();
    // A flip in the length fields may leave the frame incomplete (waiting for bytes that never
    // come); anything else must be an error. It must never yield a frame.
    if (f.is_ok()) {
      EXPECT_FALSE(f.value().has_value()) << "byte " << i;
    }
  }
}

TEST(Wire, TruncatedStreamYieldsNoFrame) {
  const std::string good = encode_segment(make_segment(0, 0, 2, 1, 1, 2));
  FrameParser p(1 << 20);
  p.feed(good.data(), good.size() - 1);
  auto f = p.next();
  ASSERT_TRUE(f.is_ok());
  EXPECT_FALSE(f.value().has_value());
}

TEST(Wire, OversizedPayloadRefusedBeforeBuffering) {
  const std::string good = encode_segment(make_segment(0, 0, 64, 1, 1, 64));
  FrameParser p(100);
  p.feed(good.data(), 32);
  auto f = p.next();
  EXPECT_FALSE(f.is_ok());
  EXPECT_EQ(f.status().code(), Code::kDataLoss);
}

TEST(Wire, GarbageIsNotAStream) {
  FrameParser p(1 << 20);
  const std::string junk = "HTTP/1.1 500 oops\r\n\r\n";
  p.feed(junk.data(), junk.size());
  EXPECT_FALSE(p.next().is_ok());
}

}  // namespace hetero

namespace hetero {
namespace {

// A segment frame whose header `edit` changed, with a checksum that matches again: what a
// hostile or broken prefill host could send (the checksum is no MAC).
std::string forged(const std::function<void(nlohmann::json&)>& edit) {
  const std::string good = encode_segment(make_segment(0, 0, 3, 1, 2, 4));
  uint32_t hb;
  uint64_t pb;
  std::memcpy(&hb, good.data() + 4, 4);
  std::memcpy(&pb, good.data() + 8, 8);
  nlohmann::json h = nlohmann::json::parse(good.substr(16, hb));
  edit(h);
  const std::string header = h.dump(), payload = good.substr(16 + hb, pb);
  std::string out = good.substr(0, 4);
  const uint32_t nhb = static_cast<uint32_t>(header.size());
  out.append(reinterpret_cast<const char*>(&nhb), 4);
  out.append(reinterpret_cast<const char*>(&pb), 8);
  out += header + payload;
  const uint64_t sum = body_checksum(header + payload);
  out.append(reinterpret_cast<const char*>(&sum), 8);
  return out;
}

Status decode_forged(const std::string& bytes) {
  FrameParser p(1 << 20);
  p.feed(bytes.data(), bytes.size());
  auto f = p.next();
  if (!f.is_ok()) return f.status();
  if (!f.value()) return data_loss("no frame");
  return decode_segment(*f.value()).status();
}

TEST(Wire, HostileHeadersAreRefusedNeverTrusted) {
  // Regression (hardening issue): an offset near INT64_MAX made offset + bytes wrap negative
  // and pass the bounds check; a non-integer version threw out of the parser.
  const std::vector<std::pair<std::string, std::function<void(nlohmann::json&)>>> cases = {
      {"offset wraps", [](auto& h) { h["arrays"][0]["offset"] = INT64_MAX - 4; }},
      {"negative offset", [](auto& h) { h["arrays"][0]["offset"] = -8; }},
      {"dims overflow",
       [](auto& h) {
         h["arrays"][0]["shape"] = {1LL << 31, 1LL << 31, 1LL << 31};
       }},
      {"bytes lie", [](auto& h) { h["arrays"][0]["bytes"] = 1LL << 62; }},
      {"version a string", [](auto& h) { h["v"] = "1"; }},
      {"arrays not a list", [](auto& h) { h["arrays"] = 7; }},
      {"seq a string", [](auto& h) { h["seq"] = "zero"; }},
      {"shape of strings", [](auto& h) { h["arrays"][0]["shape"] = {"a"}; }},
  };
  for (const auto& [what, edit] : cases) {
    const Status st = decode_forged(forged(edit));
    EXPECT_FALSE(st.is_ok()) << what;
    EXPECT_EQ(st.code(), Code::kDataLoss) << what << ": " << st.to_string();
  }
  EXPECT_TRUE(decode_forged(forged([](auto&) {})).is_ok());  // the forging itself is sound
}

}  // namespace
// ---- frame tags (frame_tag.h) --------------------------------------------------------------

// A stream as a prefill host holding `secret` sends it for `nonce`: each frame framed with the
// stream's tagger, then sealed with its place in the stream.
std::vector<std::string> tagged_frames(const std::string& secret, const std::string& nonce) {
  const FrameTagger tagger(secret, nonce);
  std::vector<std::string> frames = {
      encode_segment(make_segment(0, 0, 3, 2, 2, 4), nullptr, &tagger),
      encode_segment(make_segment(1, 3, 5, 2, 2, 4), nullptr, &tagger),
      encode_manifest({"fp", 8, 8, 2, true, "", "exact"}, &tagger)};
  for (size_t i = 0; i < frames.size(); ++i) tagger.seal(i, &frames[i]);
  return frames;
}

std::string joined(const std::vector<std::string>& frames) {
  std::string out;
  for (const std::string& f : frames) out += f;
  return out;
}

// How many frames a parser with the tagger for (secret, nonce) hands out; the error, if any.
std::pair<int, Status> parse_tagged(const std::string& bytes, const std::string& secret,
                                    const std::string& nonce) {
  const FrameTagger tagger(secret, nonce);
  FrameParser p(1 << 20, &tagger);
  int n = 0;
  for (size_t at = 0; at < bytes.size(); at += 7) {  // in odd pieces
    p.feed(bytes.data() + at, std::min<size_t>(7, bytes.size() - at));
    while (true) {
      auto f = p.next();
      if (!f.is_ok()) return {n, f.status()};
      if (!f.value()) break;
      ++n;
    }
  }
  return {n, Status::ok()};
}

TEST(FrameTags, AStreamFromTheSecretsHolderPassesWhole) {
  const std::string nonce = new_stream_nonce();
  EXPECT_TRUE(valid_stream_nonce(nonce)) << nonce;
  EXPECT_NE(nonce, new_stream_nonce());
  auto [n, st] = parse_tagged(joined(tagged_frames("s3cret", nonce)), "s3cret", nonce);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(n, 3);
}

TEST(FrameTags, ForgedReplayedReorderedOrAlteredFramesAreRefused) {
  const std::string nonce = new_stream_nonce();
  const std::vector<std::string> piece = tagged_frames("s3cret", nonce);
  auto refused_at = [&](const std::string& bytes, int frame) {
    auto [n, st] = parse_tagged(bytes, "s3cret", nonce);
    EXPECT_EQ(n, frame);
    EXPECT_EQ(st.code(), Code::kDataLoss) << st.to_string();
    EXPECT_NE(st.message().find("no valid tag"), std::string::npos) << st.to_string();
  };
  refused_at(joined(tagged_frames("guess", nonce)), 0);                // no secret
  refused_at(joined(tagged_frames("s3cret", new_stream_nonce())), 0);  // another request's
  // The secret holder's own frames, put together again in another order or with one left out.
  refused_at(piece[1] + piece[0] + piece[2], 0);  // reordered
  refused_at(piece[0] + piece[2], 1);             // a segment dropped
  // A payload byte changed and the checksum recomputed, as anyone can: the tag still catches it.
  std::string altered = piece[1];
  const size_t size = frame_size(altered);
  altered[size - 9] ^= 1;
  const uint64_t sum = body_checksum(std::string_view(altered).substr(16, size - 24));
  std::memcpy(altered.data() + size - 8, &sum, 8);
  refused_at(piece[0] + altered + piece[2], 1);
  // The salt of another frame, or its own salt and the tag of another place: refused.
  std::string salted = piece[1];
  std::memcpy(salted.data() + frame_size(salted), piece[0].data() + frame_size(piece[0]), 16);
  refused_at(piece[0] + salted + piece[2], 1);
  // Untagged frames, to a receiver that expects tags: refused at the first.
  refused_at(encode_segment(make_segment(0, 0, 3, 2, 2, 4)) +
                 encode_segment(make_segment(1, 3, 5, 2, 2, 4)) +
                 encode_manifest({"fp", 8, 8, 2, true, "", "exact"}),
             0);
}

// A frame of several pieces (wire.h: each checksummed and tagged on its own, in parallel):
// framed in uneven parts it is the same bytes as framed whole, it passes, and a byte changed in
// any piece is refused, untagged by the checksum and tagged by the tag.
TEST(Wire, AFrameOfManyPiecesIsCheckedPieceByPiece) {
  // 2 layers x K and V x [4, 37,000, 16] bf16: ~19 MB, pieces cut across arrays.
  const Segment s = make_segment(0, 0, 37000, 2, 4, 16);
  const std::string whole = encode_segment(s);
  SegmentFrameWriter w(s, specs_of(s.arrays));
  for (const WireArray& a : s.arrays) ASSERT_TRUE(w.append(a).is_ok());
  auto parts = w.finish();
  ASSERT_TRUE(parts.is_ok());
  EXPECT_EQ(parts.value(), whole);
  const size_t pieces = (frame_size(whole) - 24 + kWirePieceBytes - 1) / kWirePieceBytes;
  ASSERT_GE(pieces, 9u);
  auto parse = [](const std::string& bytes, const FrameTagger* tags) {
    FrameParser p(int64_t{1} << 30, tags);
    for (size_t at = 0; at < bytes.size(); at += 100003)
      p.feed(bytes.data() + at, std::min<size_t>(100003, bytes.size() - at));
    auto f = p.next();
    return f.is_ok() ? Status(f.value() ? Status::ok() : data_loss("no frame")) : f.status();
  };
  EXPECT_TRUE(parse(whole, nullptr).is_ok());
  const std::string nonce = new_stream_nonce();
  const FrameTagger tagger("s3cret", nonce);
  std::string tagged = encode_segment(s, nullptr, &tagger);
  tagger.seal(0, &tagged);
  EXPECT_EQ(tagged.substr(0, whole.size()), whole);  // the tag follows the same frame
  EXPECT_TRUE(parse(tagged, &tagger).is_ok());
  for (size_t j = 0; j < pieces; ++j) {
    const size_t at = 16 + std::min(j * kWirePieceBytes + 12345, frame_size(whole) - 25);
    std::string bad = whole;
    bad[at] ^= 0x10;
    const Status st = parse(bad, nullptr);
    EXPECT_NE(st.message().find("checksum mismatch"), std::string::npos) << j << st.to_string();
    std::string bad_tagged = tagged;
    bad_tagged[at] ^= 0x10;
    const Status ts = parse(bad_tagged, &tagger);
    EXPECT_NE(ts.message().find("no valid tag"), std::string::npos) << j << ts.to_string();
  }
}

// A frame of the wire's first version is named as such, not taken for garbage.
TEST(Wire, AFrameOfTheFirstWireVersionIsNamed) {
  std::string v1 = encode_manifest({"fp", 8, 8, 2, true, "", "exact"});
  v1[3] = '1';
  FrameParser p(1 << 20);
  p.feed(v1.data(), v1.size());
  auto f = p.next();
  ASSERT_FALSE(f.is_ok());
  EXPECT_NE(f.status().message().find("wire version 1"), std::string::npos)
      << f.status().to_string();
}

}  // namespace hetero
