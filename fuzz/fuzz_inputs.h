// The input layouts of the auth and http_server fuzz targets, shared with their seeds
// (make_seeds.cc), so a seed and the target read the same bytes the same way.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace hetero::fuzz {

// The auth target's verifier: the stack's secret, and its clock, fixed so that the seeds'
// signed headers stay inside its window.
constexpr char kAuthSecret[] = "fuzz-secret";
constexpr int64_t kAuthNowS = 1700000000;

// auth: byte 0 is flags; the rest is  Authorization "\n" method "\n" target "\n" body  (a
// missing field is empty; the body may hold anything). Byte 0, bit 0: also check a request
// signed for the fuzzed method, target and body; bits 1-7 (0..127): its time, kAuthNowS - 300 s
// to + 300 s (both ends of the window).
struct AuthInput {
  bool sign = false;
  int64_t skew_s = 0;
  std::string_view authorization, method, target, body;
};

inline int64_t auth_skew_s(uint8_t step) { return step * int64_t{600} / 127 - 300; }

inline AuthInput split_auth_input(const uint8_t* data, size_t size) {
  AuthInput in;
  if (size == 0) return in;
  in.sign = data[0] & 1;
  in.skew_s = auth_skew_s(data[0] >> 1);
  std::string_view rest(reinterpret_cast<const char*>(data + 1), size - 1);
  for (std::string_view* field : {&in.authorization, &in.method, &in.target}) {
    const size_t end = rest.find('\n');
    *field = rest.substr(0, end);
    rest = end == std::string_view::npos ? std::string_view() : rest.substr(end + 1);
  }
  in.body = rest;
  return in;
}

// A seed: step is bits 1-7 of byte 0 (63 or 64: about kAuthNowS itself).
inline std::string auth_input(bool sign, uint8_t step, std::string_view authorization,
                              std::string_view method, std::string_view target,
                              std::string_view body) {
  std::string s(1, static_cast<char>((step << 1) | (sign ? 1 : 0)));
  s.append(authorization).append("\n").append(method).append("\n").append(target).append("\n");
  return s.append(body);
}

// http_server: byte 0, bits 0-1: the rest goes out in 1 to 4 pieces of about equal length;
// bit 2: 100 us between them (so the server reads them apart). The rest: the bytes sent.
struct HttpPlan {
  int pieces = 1;
  bool pause = false;
};

inline HttpPlan http_plan(uint8_t b) { return {1 + (b & 3), (b & 4) != 0}; }

inline std::string http_input(int pieces, bool pause, std::string_view bytes) {
  std::string s(1, static_cast<char>(((pieces - 1) & 3) | (pause ? 4 : 0)));
  return s.append(bytes);
}

}  // namespace hetero::fuzz
