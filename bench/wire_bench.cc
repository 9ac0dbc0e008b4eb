// What one segment costs on the host, either end of the wire: encode (frame + checksum) on the
// prefill host, parse + verify + decode on the receiver. Default: one 8192-token segment of a
// 1B llama (16 layers x K and V x [8, 8192, 64] bf16 = 268 MB), the unit the GPU prefill emits
// per chunk. The receiver is fed --piece bytes at a time, as a socket hands them over (0: the
// whole frame at once), and decodes as the prefill client does (arrays viewing the frame).
// Median and spread of --repeat runs; one JSON line on stdout, with the encode's parts apart:
// a fresh frame-sized buffer, a copy into a warm one, the checksum alone.
//
// usage: hetero_wire_bench [--layers 16] [--kv-heads 8] [--head-dim 64] [--tokens 8192]
//                          [--piece 65536] [--repeat 5] [--rev REV]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bridge/wire.h"

int main(int argc, char** argv) {
  using namespace hetero;
  int64_t layers = 16, kv_heads = 8, head_dim = 64, tokens = 8192;
  int repeat = 5;
  int64_t piece = 65536;
  std::string rev = "unknown";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const char* v = argv[i + 1];
    if (k == "--layers")
      layers = std::atoll(v);
    else if (k == "--kv-heads")
      kv_heads = std::atoll(v);
    else if (k == "--head-dim")
      head_dim = std::atoll(v);
    else if (k == "--tokens")
      tokens = std::atoll(v);
    else if (k == "--repeat")
      repeat = std::atoi(v);
    else if (k == "--piece")
      piece = std::atoll(v);
    else if (k == "--rev")
      rev = v;
    else
      return std::fprintf(stderr, "unknown option %s\n", k.c_str()), 2;
  }
  Segment s;
  s.family = "llama", s.fingerprint = "bench", s.pos0 = 0, s.n_tokens = tokens;
  for (int64_t l = 0; l < layers; ++l)
    for (const char* kind : {"keys", "values"}) {
      Tensor t(DType::kBF16, {kv_heads, tokens, head_dim});
      for (size_t i = 0; i < t.bytes.size(); ++i) t.bytes[i] = static_cast<uint8_t>(i * 31 + l);
      s.arrays.push_back({"layers." + std::to_string(l) + "." + kind, std::move(t)});
    }
  using Clock = std::chrono::steady_clock;
  auto ms = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  };
  std::vector<double> enc, dec;
  size_t bytes = 0;
  for (int r = 0; r < repeat + 1; ++r) {  // run 0 warms up
    const auto t0 = Clock::now();
    const std::string frame = encode_segment(s);
    const auto t1 = Clock::now();
    FrameParser parser(int64_t{1} << 40);
    const size_t step = piece > 0 ? static_cast<size_t>(piece) : frame.size();
    for (size_t at = 0; at < frame.size(); at += step)
      parser.feed(frame.data() + at, std::min(step, frame.size() - at));
    auto f = parser.next();
    if (!f.is_ok() || !f->has_value()) return std::fprintf(stderr, "parse failed\n"), 1;
    auto d = decode_segment(std::move(**f));
    if (!d.is_ok()) return std::fprintf(stderr, "%s\n", d.status().to_string().c_str()), 1;
    const auto t2 = Clock::now();
    if (r == 0) continue;
    enc.push_back(ms(t0, t1)), dec.push_back(ms(t1, t2)), bytes = frame.size();
  }
  // Where an encode's time goes: a fresh buffer of the frame's size (allocated, its pages
  // faulted in and zeroed), a copy into a buffer already faulted in, and the checksum alone;
  // beside them, the frame's tag (frame_tag.h), which a host with the stack's secret adds.
  std::vector<double> fresh, copy, hash, tag;
  const FrameTagger tagger("bench secret", new_stream_nonce());
  {
    const std::string frame = encode_segment(s);
    std::string warm(frame.size(), '\0');
    for (int r = 0; r < repeat + 1; ++r) {
      const auto t0 = Clock::now();
      std::string buf(frame.size(), '\0');
      const auto t1 = Clock::now();
      std::memcpy(warm.data(), frame.data(), frame.size());
      const auto t2 = Clock::now();
      volatile uint64_t sum = checksum64(frame.data(), frame.size());
      (void)sum;
      const auto t3 = Clock::now();
      volatile uint8_t first = tagger.tag(1, frame.data(), frame.size())[0];
      (void)first;
      const auto t4 = Clock::now();
      if (r == 0) continue;
      fresh.push_back(ms(t0, t1)), copy.push_back(ms(t1, t2)), hash.push_back(ms(t2, t3));
      tag.push_back(ms(t3, t4));
    }
  }
  for (auto* v : {&enc, &dec, &fresh, &copy, &hash, &tag}) std::sort(v->begin(), v->end());
  std::printf(
      "{\"bench\":\"wire_segment\",\"rev\":\"%s\",\"layers\":%lld,\"kv_heads\":%lld,"
      "\"head_dim\":%lld,\"tokens\":%lld,\"bytes\":%zu,\"piece\":%lld,\"repeat\":%d,"
      "\"encode_ms_median\":%.1f,"
      "\"encode_ms_min\":%.1f,\"encode_ms_max\":%.1f,\"receive_ms_median\":%.1f,"
      "\"receive_ms_min\":%.1f,\"receive_ms_max\":%.1f,\"encode_gb_s\":%.2f,"
      "\"receive_gb_s\":%.2f,\"fresh_buffer_ms\":%.1f,\"copy_ms\":%.1f,\"checksum_ms\":%.1f,"
      "\"tag_ms\":%.1f}\n",
      rev.c_str(), static_cast<long long>(layers), static_cast<long long>(kv_heads),
      static_cast<long long>(head_dim), static_cast<long long>(tokens), bytes,
      static_cast<long long>(piece), repeat, enc[enc.size() / 2], enc.front(), enc.back(),
      dec[dec.size() / 2], dec.front(), dec.back(), bytes / enc[enc.size() / 2] / 1e6,
      bytes / dec[dec.size() / 2] / 1e6, fresh[fresh.size() / 2], copy[copy.size() / 2],
      hash[hash.size() / 2], tag[tag.size() / 2]);
  return 0;
}
