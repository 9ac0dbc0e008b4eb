// DeepSeek-V4 bridge pieces without the decoder: the replay of the decoder's rotating window
// and overlap rule on positions, and the stream (program -> producer -> wire -> assembler)
// carrying exactly what the program computes, with malformed segments refused. Bit-exactness
// against the decoder itself is tests/py/test_dsv4_exactness.py.
#include "bridge/dsv4_stream.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "../common/dsv4_test_weights.h"
#include "../common/temp_dir.h"
#include "common/bf16.h"

namespace hetero {
namespace {

TEST(Dsv4Schedule, TokenwiseCallsExpand) {
  EXPECT_EQ(dsv4_effective_calls({9, 8, 1, 2}),
            (std::vector<int64_t>{9, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(dsv4_server_calls(1, 2048), (std::vector<int64_t>{1}));
  EXPECT_EQ(dsv4_server_calls(5000, 2048), (std::vector<int64_t>{2048, 2048, 903, 1}));
}

TEST(Dsv4Schedule, WindowAfterPrefillAndLastToken) {
  // A 200-token call then the last token alone: slot 0 holds the last position, slots 1..127
  // the 127 before it, _idx 1.
  auto w = dsv4_window_layout({200, 1}, 128);
  ASSERT_EQ(w.slot_pos.size(), 128u);
  EXPECT_EQ(w.slot_pos[0], 200);
  for (int64_t s = 1; s < 128; ++s) EXPECT_EQ(w.slot_pos[static_cast<size_t>(s)], 72 + s);
  EXPECT_EQ(w.idx, 1);
  EXPECT_EQ(w.offset, 201);
  // One multi-token call keeps everything it got, in order.
  auto one = dsv4_window_layout({300}, 128);
  EXPECT_EQ(one.slot_pos.size(), 300u);
  EXPECT_EQ(one.idx, 300);
  // Short: single tokens into a fresh cache.
  auto few = dsv4_window_layout({1, 1, 1}, 128);
  EXPECT_EQ(few.slot_pos, (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(few.idx, 3);
}

TEST(Dsv4Schedule, OverlapOnlyWithinOneMultiTokenCall) {
  // Calls: 13 single tokens (0..12), then [13, 213): windows of 4.
  std::vector<int64_t> calls(13, 1);
  calls.push_back(200);
  auto f = dsv4_overlap_flags(calls, 4);
  ASSERT_EQ(f.size(), 53u);
  EXPECT_EQ(f[0], 0);  // never
  EXPECT_EQ(f[1], 0);  // completed by a single-token call
  EXPECT_EQ(f[3], 0);  // [12, 16): completed in the big call, its predecessor was not
  EXPECT_EQ(f[4], 1);  // [16, 20): both in the big call
  EXPECT_EQ(f[52], 1);
}

struct Streamed {
  std::vector<std::string> frames;
};

// Runs the producer over per-layer inputs in `chunk`-sized boundaries, collecting frames.
Streamed stream(const Dsv4DecoderWeights& w, const std::vector<std::vector<uint16_t>>& xs,
                int64_t T, int64_t chunk, const std::vector<int64_t>& calls) {
  Dsv4SegmentProgram program(&w, calls);
  Streamed out;
  BridgeProducer producer(&program, [&](std::string f) {
    out.frames.push_back(std::move(f));
    return true;
  });
  auto tap = producer.tap();
  for (int64_t p = 0; p < T; p += chunk) {
    const int64_t n = std::min(chunk, T - p);
    for (int32_t l = 0; l < w.layout.layers; ++l) {
      TapEvent e{l, p, n, w.layout.hidden, xs[static_cast<size_t>(l)].data() + p * w.layout.hidden};
      tap(e);
    }
  }
  Manifest m = producer.finish(T, Status::ok());
  EXPECT_TRUE(m.complete) << m.reason;
  return out;
}

Status assemble(const std::vector<std::string>& frames, Dsv4Assembler* a) {
  FrameParser parser(1 << 26);
  for (const auto& f : frames) parser.feed(f.data(), f.size());
  while (true) {
    HETERO_ASSIGN_OR_RETURN(auto frame, parser.next());
    if (!frame) return Status::ok();
    if (frame->header.value("kind", "") == "manifest") {
      HETERO_ASSIGN_OR_RETURN(Manifest m, decode_manifest(*frame));
      return a->finish(m);
    }
    HETERO_ASSIGN_OR_RETURN(Segment s, decode_segment(*frame));
    HETERO_RETURN_IF_ERROR(a->accept(s));
  }
}

TEST(Dsv4Stream, AssembledArraysEqualTheProgramRunAlone) {
  const auto w = random_dsv4_weights();
  const int64_t T = 301;
  const std::vector<int64_t> calls = dsv4_server_calls(T, 64);
  std::vector<std::vector<uint16_t>> xs;
  for (uint32_t l = 0; l < 3; ++l) xs.push_back(random_dsv4_x(T, w.layout.hidden, 100 + l));

  // The program alone, fed in one piece per layer.
  Dsv4CacheProgram direct(&w, calls);
  std::map<std::string, Tensor> want;
  for (int64_t l = 0; l < 3; ++l) {
    ASSERT_TRUE(direct.feed(l, 0, T, xs[static_cast<size_t>(l)].data(), nullptr).is_ok());
    auto a = direct.finish_layer(l);
    ASSERT_TRUE(a.is_ok());
    const std::string p = "layers." + std::to_string(l) + ".";
    want[p + "window"] = a->window;
    if (a->ratio > 0) {
      want[p + "pool.pooled"] = a->pool.pooled;
      want[p + "pool.buf_kv"] = a->pool.buf_kv;
      want[p + "pool.buf_gate"] = a->pool.buf_gate;
    }
    if (a->ratio == 4) {
      want[p + "index.pooled"] = a->index.pooled;
      want[p + "index.buf_kv"] = a->index.buf_kv;
      want[p + "index.buf_gate"] = a->index.buf_gate;
    }
  }
  EXPECT_GT(want["layers.2.pool.pooled"].shape[1], 1);  // ratio 128 rows exist at T=301

  auto s = stream(w, xs, T, 50, calls);
  Dsv4Assembler asmb(w.layout, T);
  ASSERT_TRUE(assemble(s.frames, &asmb).is_ok());
  EXPECT_FALSE(asmb.can_mount(T - 1));
  ASSERT_TRUE(asmb.can_mount(T));
  EXPECT_EQ(asmb.entry_extra()["window_idx"].get<int64_t>(), direct.window_idx());
  TensorMap got = asmb.arrays(T).value();
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, t] : want) {
    ASSERT_TRUE(got.count(name)) << name;
    EXPECT_EQ(got[name].shape, t.shape) << name;
    EXPECT_EQ(got[name].bytes, t.bytes) << name;
  }
}

TEST(Dsv4Stream, MalformedSegmentsAreRefused) {
  const auto w = random_dsv4_weights();
  const int64_t T = 40;
  std::vector<std::vector<uint16_t>> xs;
  for (uint32_t l = 0; l < 3; ++l) xs.push_back(random_dsv4_x(T, w.layout.hidden, l));
  auto s = stream(w, xs, T, 16, dsv4_server_calls(T, 2048));
  FrameParser parser(1 << 26);
  std::vector<Segment> segs;
  for (const auto& f : s.frames) parser.feed(f.data(), f.size());
  while (auto fr = parser.next().value()) {
    if (fr->header.value("kind", "") == "manifest") break;
    segs.push_back(decode_segment(*fr).value());
  }
  ASSERT_EQ(segs.size(), 3u);
  {  // a pooled array one row short
    Dsv4Assembler a(w.layout, T);
    Segment bad = segs[0];
    for (auto& arr : bad.arrays)
      if (arr.name == "layers.1.pool.pooled") arr.tensor = Tensor(DType::kBF16, {1, 3, 16});
    EXPECT_FALSE(a.accept(bad).is_ok());
    EXPECT_EQ(a.covered_tokens(), 0);
  }
  {  // the last segment without its window_idx
    Dsv4Assembler a(w.layout, T);
    ASSERT_TRUE(a.accept(segs[0]).is_ok());
    ASSERT_TRUE(a.accept(segs[1]).is_ok());
    Segment bad = segs[2];
    bad.arrays.pop_back();
    EXPECT_FALSE(a.accept(bad).is_ok());
    EXPECT_FALSE(a.can_mount(T));
  }
  {  // a window with more rows than tokens
    Dsv4Assembler a(w.layout, T);
    ASSERT_TRUE(a.accept(segs[0]).is_ok());
    ASSERT_TRUE(a.accept(segs[1]).is_ok());
    Segment bad = segs[2];
    for (auto& arr : bad.arrays)
      if (arr.name.find(".window") != std::string::npos)
        arr.tensor = Tensor(DType::kBF16, {1, 1, T + 1, 16});
    EXPECT_FALSE(a.accept(bad).is_ok());
  }
}

// A stream that breaks after a segment mounts the rows up to that segment's end b: the pooled
// rows the decoder's calls up to b make, its pending rows, and the window's last rows up to b in
// temporal order (slot index = their count), from which the decoder goes on as from its own.
TEST(Dsv4Stream, ABrokenStreamMountsItsLongestVerifiedPrefix) {
  const auto w = random_dsv4_weights();  // an 8-row window
  const int64_t T = 301, chunk = 50;
  const std::vector<int64_t> calls = dsv4_server_calls(T, 50);  // calls end at the chunks' ends
  std::vector<std::vector<uint16_t>> xs;
  for (uint32_t l = 0; l < 3; ++l) xs.push_back(random_dsv4_x(T, w.layout.hidden, 60 + l));
  const auto s = stream(w, xs, T, chunk, calls);
  ASSERT_EQ(s.frames.size(), 8u);  // 7 segments and the manifest
  for (int64_t kept : {1, 3, 6}) {
    const int64_t b = kept * chunk;
    SCOPED_TRACE("b = " + std::to_string(b));
    Dsv4Assembler a(w.layout, T);
    ASSERT_TRUE(assemble({s.frames.begin(), s.frames.begin() + kept}, &a).is_ok());
    EXPECT_EQ(a.covered_tokens(), b);
    ASSERT_TRUE(a.can_mount(b));
    EXPECT_FALSE(a.can_mount(b - 1));
    EXPECT_EQ(a.entry_extra()["window_idx"].get<int64_t>(), std::min<int64_t>(b, w.window));
    const TensorMap got = a.arrays(b).value();
    // The truth: the decoder's calls cut at b, and its window's rows from one call over [0, b).
    const std::vector<int64_t> cut(calls.begin(), calls.begin() + kept);
    Dsv4CacheProgram upto(&w, cut), one(&w, {b});
    for (int64_t l = 0; l < 3; ++l) {
      const uint16_t* x = xs[static_cast<size_t>(l)].data();
      ASSERT_TRUE(upto.feed(l, 0, b, x, nullptr).is_ok());
      ASSERT_TRUE(one.feed(l, 0, b, x, nullptr).is_ok());
      auto want = upto.finish_layer(l);
      auto rows = one.finish_layer(l);
      ASSERT_TRUE(want.is_ok() && rows.is_ok());
      const std::string p = "layers." + std::to_string(l) + ".";
      const Tensor& win = got.at(p + "window");
      const int64_t S = std::min<int64_t>(b, w.window), hd = w.layout.head_dim;
      ASSERT_EQ(win.shape, (std::vector<int64_t>{1, 1, S, hd}));
      EXPECT_TRUE(std::equal(win.bytes.begin(), win.bytes.end(),
                             rows->window.bytes.end() - static_cast<std::ptrdiff_t>(S * hd * 2)));
      if (want->ratio == 0) continue;
      EXPECT_EQ(got.at(p + "pool.pooled").bytes, want->pool.pooled.bytes);
      EXPECT_EQ(got.at(p + "pool.buf_kv").bytes, want->pool.buf_kv.bytes);
      EXPECT_EQ(got.at(p + "pool.buf_gate").bytes, want->pool.buf_gate.bytes);
      if (want->ratio != 4) continue;
      EXPECT_EQ(got.at(p + "index.pooled").bytes, want->index.pooled.bytes);
      EXPECT_EQ(got.at(p + "index.buf_kv").bytes, want->index.buf_kv.bytes);
    }
  }
}

// The front door's store entry is written straight from the assembler's own rows (no copy of
// them into a TensorMap first): the same file, byte for byte, and the same entry.json as the
// entry written from arrays(b), for a broken stream's prefixes and the whole request; a B the
// assembler cannot mount writes nothing. With a store, the pooled rows go into the entry's file
// as they verify: the published entry holds the same arrays and entry.json, no incoming file is
// left beside it, and an assembler that never publishes leaves nothing.
TEST(Dsv4Stream, TheStoreEntryIsWrittenFromTheAssemblersOwnRows) {
  const auto w = random_dsv4_weights();
  const int64_t T = 301, chunk = 50;
  const std::vector<int64_t> calls = dsv4_server_calls(T, 50);
  std::vector<std::vector<uint16_t>> xs;
  for (uint32_t l = 0; l < 3; ++l) xs.push_back(random_dsv4_x(T, w.layout.hidden, 90 + l));
  const auto s = stream(w, xs, T, chunk, calls);
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (int64_t i = 0; i < T; ++i) ids[static_cast<size_t>(i)] = static_cast<int32_t>(i % 97);
  auto slurp = [](const std::filesystem::path& p) {
    std::ifstream in(p, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  for (int64_t kept : {1, 4, 7}) {
    const int64_t b = std::min(kept * chunk, T);
    SCOPED_TRACE("b = " + std::to_string(b));
    Dsv4Assembler a(w.layout, T);
    ASSERT_TRUE(assemble({s.frames.begin(), s.frames.begin() + kept}, &a).is_ok());
    ASSERT_TRUE(a.can_mount(b));
    TempDir direct, via_map;
    EXPECT_EQ(a.store(direct.path, w.layout, ids, b - 1, T).status().code(),
              Code::kInvalidArgument);
    EXPECT_TRUE(std::filesystem::is_empty(direct.path));
    auto got = a.store(direct.path, w.layout, ids, b, T);
    ASSERT_TRUE(got.is_ok()) << got.status().to_string();
    auto want =
        write_store_entry(via_map.path, w.layout, ids, b, T, a.arrays(b).value(), a.entry_extra());
    ASSERT_TRUE(want.is_ok()) << want.status().to_string();
    EXPECT_EQ(got->bytes, want->bytes);
    for (const char* f : {"cache.safetensors", "entry.json"})
      EXPECT_EQ(slurp(std::filesystem::path(got->path) / f),
                slurp(std::filesystem::path(want->path) / f))
          << f;

    // With a store: the pooled rows went into the entry's file as they verified, and the
    // published entry holds the same arrays and the same entry.json.
    TempDir store;
    {
      Dsv4Assembler unpublished(w.layout, T, store.path);
      ASSERT_TRUE(assemble({s.frames.begin(), s.frames.begin() + kept}, &unpublished).is_ok());
    }
    EXPECT_TRUE(std::filesystem::is_empty(std::filesystem::path(store.path) / w.layout.fingerprint))
        << "an assembler that never published left its file";
    Dsv4Assembler streamed(w.layout, T, store.path);
    ASSERT_TRUE(assemble({s.frames.begin(), s.frames.begin() + kept}, &streamed).is_ok());
    ASSERT_TRUE(streamed.can_mount(b));
    const TensorMap held = streamed.arrays(b).value();  // read back from the file
    auto published = streamed.store(store.path, w.layout, ids, b, T);
    ASSERT_TRUE(published.is_ok()) << published.status().to_string();
    EXPECT_EQ(slurp(std::filesystem::path(published->path) / "entry.json"),
              slurp(std::filesystem::path(want->path) / "entry.json"));
    auto file = read_safetensors(published->path + "/cache.safetensors");
    ASSERT_TRUE(file.is_ok()) << file.status().to_string();
    const TensorMap mine = a.arrays(b).value();
    ASSERT_EQ(file->tensors.size(), mine.size());
    for (const auto& [name, t] : mine) {
      ASSERT_TRUE(file->tensors.count(name)) << name;
      EXPECT_EQ(file->tensors.at(name).shape, t.shape) << name;
      EXPECT_EQ(file->tensors.at(name).bytes, t.bytes) << name;
      EXPECT_EQ(held.at(name).bytes, t.bytes) << name;
    }
    size_t left = 0;  // only the entry: no incoming file beside it
    for (const auto& e : std::filesystem::directory_iterator(std::filesystem::path(store.path) /
                                                             w.layout.fingerprint))
      left += e.path().filename().string().ends_with(".partial");
    EXPECT_EQ(left, 0u);
  }
}

}  // namespace
}  // namespace hetero
