// What one segment costs on the host, either end of the wire: encode (frame + checksums) on the
// prefill host, parse + verify + decode on the receiver, untagged and tagged (with the stack's
// secret: frame_tag.h). Default: one 8192-token segment of a 1B llama (16 layers x K and V x
// [8, 8192, 64] bf16 = 268 MB), the unit the GPU prefill emits per chunk. The receiver is fed
// --piece bytes at a time, as a socket hands them over (0: the whole frame at once), and decodes
// as the prefill client does (arrays viewing the frame). Median and spread of --repeat runs; one
// JSON line on stdout. "encode" and "receive" write into fresh memory; the "_warm" and "_tagged"
// runs into buffers given back by the frame before, as a stream's later frames are at both ends
// (their pages already in).
// Framing and verifying work on a frame's pieces with frame_threads() threads.
//
// usage: hetero_wire_bench [--layers 16] [--kv-heads 8] [--head-dim 64] [--tokens 8192]
//                          [--piece 65536] [--repeat 5] [--threads N] [--rev REV]
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bridge/wire.h"

namespace {

// What a raw line needs to stand alone (issue 53): the machine, each run's value, the median (an
// even count's: the mean of the middle two), the command.
std::string json_list(const std::vector<double>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? "," : "") + std::to_string(v[i]);
  return out + "]";
}

std::string json_quote(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) out += c;
  }
  return out + "\"";
}

double median_of_sorted(const std::vector<double>& v) {
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace hetero;
  std::string command;
  for (int i = 0; i < argc; ++i) command += (i ? " " : "") + std::string(argv[i]);
  char host[256] = "unknown";
  gethostname(host, sizeof(host) - 1);
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
    else if (k == "--threads" && std::atoi(v) >= 1)
      set_frame_threads(std::atoi(v));
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
  // One run: frame the segment, then feed it to a parser and decode it; the frame's buffer goes
  // back to `pool` (null: dropped).
  struct Run {
    double encode_ms, receive_ms;
    size_t bytes;
  };
  auto run = [&](FrameBufferPool* pool, const std::shared_ptr<FrameBufferPool>& rx,
                 const FrameTagger* tags) -> Result<Run> {
    const auto t0 = Clock::now();
    std::string frame = encode_segment(s, pool, tags);
    if (tags) tags->seal(0, &frame);
    const auto t1 = Clock::now();
    FrameParser parser(int64_t{1} << 40, tags, rx);
    const size_t step = piece > 0 ? static_cast<size_t>(piece) : frame.size();
    for (size_t at = 0; at < frame.size(); at += step)
      parser.feed(frame.data() + at, std::min(step, frame.size() - at));
    auto f = parser.next();
    if (!f.is_ok()) return f.status();
    if (!f->has_value()) return internal_error("parse: no frame");
    auto d = decode_segment(std::move(**f));
    if (!d.is_ok()) return d.status();
    const auto t2 = Clock::now();
    const size_t bytes = frame.size();
    if (pool) pool->give(std::move(frame));
    return Run{ms(t0, t1), ms(t1, t2), bytes};
  };
  const FrameTagger tagger("bench secret", new_stream_nonce());
  FrameBufferPool pool;
  auto rx = std::make_shared<FrameBufferPool>(2);
  struct Series {
    const char* name;
    FrameBufferPool* pool;
    std::shared_ptr<FrameBufferPool> rx;
    const FrameTagger* tags;
    std::vector<double> enc, dec;
    size_t bytes = 0;
  };
  std::vector<Series> series = {{"", nullptr, nullptr, nullptr, {}, {}},
                                {"_warm", &pool, rx, nullptr, {}, {}},
                                {"_tagged", &pool, rx, &tagger, {}, {}}};
  for (Series& x : series)
    for (int r = 0; r < repeat + 1; ++r) {  // run 0 warms up
      auto got = run(x.pool, x.rx, x.tags);
      if (!got.is_ok()) return std::fprintf(stderr, "%s\n", got.status().to_string().c_str()), 1;
      if (r == 0) continue;
      x.enc.push_back(got->encode_ms), x.dec.push_back(got->receive_ms), x.bytes = got->bytes;
    }
  std::printf(
      "{\"bench\":\"wire_segment\",\"rev\":\"%s\",\"wire\":%d,\"threads\":%d,\"layers\":%lld,"
      "\"kv_heads\":%lld,\"head_dim\":%lld,\"tokens\":%lld,\"bytes\":%zu,\"piece\":%lld,"
      "\"repeat\":%d,\"machine\":%s,\"cpus\":%u,\"gpu\":\"none (host work only)\","
      "\"command\":%s",
      rev.c_str(), kWireVersion, frame_threads(), static_cast<long long>(layers),
      static_cast<long long>(kv_heads), static_cast<long long>(head_dim),
      static_cast<long long>(tokens), series[0].bytes, static_cast<long long>(piece), repeat,
      json_quote(host).c_str(), std::thread::hardware_concurrency(), json_quote(command).c_str());
  for (Series& x : series) {
    std::printf(",\"encode%s_ms_runs\":%s,\"receive%s_ms_runs\":%s", x.name,
                json_list(x.enc).c_str(), x.name, json_list(x.dec).c_str());
    for (auto* v : {&x.enc, &x.dec}) std::sort(v->begin(), v->end());
    const double e = median_of_sorted(x.enc), d = median_of_sorted(x.dec);
    std::printf(
        ",\"encode%s_ms_median\":%.1f,\"encode%s_ms_min\":%.1f,\"encode%s_ms_max\":%.1f,"
        "\"receive%s_ms_median\":%.1f,\"receive%s_ms_min\":%.1f,\"receive%s_ms_max\":%.1f,"
        "\"encode%s_gb_s\":%.2f,\"receive%s_gb_s\":%.2f",
        x.name, e, x.name, x.enc.front(), x.name, x.enc.back(), x.name, d, x.name, x.dec.front(),
        x.name, x.dec.back(), x.name, x.bytes / e / 1e6, x.name, x.bytes / d / 1e6);
  }
  std::printf("}\n");
  return 0;
}
