// What the GPU benchmarks share: cheap reproducible random values, the median and spread of a
// set of timings, the GPU's name, and the measured bf16 matmul peak that each benchmark quotes
// its throughput against.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bridge/cuda/gpu_programs.h"
#include "bridge/frame_tag.h"
#include "bridge/producer.h"
#include "bridge/wire.h"
#include "common/bf16.h"
#include "common/queue.h"

namespace hetero::bench {

// xorshift64, roughly uniform in [-scale, scale), rounded to bf16; a few hundred million values a
// second on one core.
struct Draw {
  uint64_t s;
  float next(float scale) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    return round_bf16(scale * (static_cast<float>(s >> 40) / 8388608.0f - 1.0f));
  }
};

struct Spread {
  double median = 0, min = 0, max = 0;
};

// A bench's bridged mode and where its capture's copies run: "on-engine" is ("on", kEngine),
// "on-own" ("on", kOwn), "on" ("on", kAuto, as served).
inline std::pair<std::string, cuda::CaptureCopies> capture_copies_of(const std::string& mode) {
  for (const auto& [suffix, copies] :
       {std::pair{std::string("-engine"), cuda::CaptureCopies::kEngine},
        std::pair{std::string("-own"), cuda::CaptureCopies::kOwn}})
    if (mode.size() > suffix.size() && mode.ends_with(suffix))
      return {mode.substr(0, mode.size() - suffix.size()), copies};
  return {mode, cuda::CaptureCopies::kAuto};
}
// A producer's sink for a bench: counts the frames' bytes into *bytes and gives each frame's
// buffer back to `buffers` at once, as the service does once a frame is sent (a link that never
// waits).
inline BridgeProducer::FrameSink counting_sink(double* bytes, FrameBufferPool* buffers) {
  return [bytes, buffers](std::string f) {
    *bytes += static_cast<double>(f.size());
    buffers->give(std::move(f));
    return true;
  };
}

// A sink that sends as the prefill host does with the stack's secret: the producer frames with
// tagger() (each frame's pieces MACed as it is written), then frames go through a queue of 4 to
// a sender thread, which seals each with its place in the stream (frame_tag.h), counts its bytes
// into *bytes, and gives the buffer back. finish() waits for the last frame.
class TaggingSender {
 public:
  TaggingSender(double* bytes, FrameBufferPool* buffers)
      : tagger_("bench secret: any non-empty string", new_stream_nonce()) {
    thread_ = std::thread([this, bytes, buffers] {
      uint64_t i = 0;
      while (auto f = frames_.pop()) {
        tagger_.seal(i++, &*f);
        *bytes += static_cast<double>(f->size());
        buffers->give(std::move(*f));
      }
    });
  }
  ~TaggingSender() { finish(); }
  const FrameTagger* tagger() const { return &tagger_; }
  BridgeProducer::FrameSink sink() {
    return [this](std::string f) { return frames_.push(std::move(f)); };
  }
  void finish() {
    frames_.close();
    if (thread_.joinable()) thread_.join();
  }

 private:
  FrameTagger tagger_;
  BoundedQueue<std::string> frames_{4};
  std::thread thread_;
};

// An even count's median is the mean of the middle two: until issue 53 it was the upper one, so
// a two-run "median" was the slower run.
inline Spread spread(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  if (v.empty()) return {};
  const size_t n = v.size();
  const double median = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  return {median, v.front(), v.back()};
}

// What a raw line needs to stand alone (issue 53): every run's value, the spread as
// (max - min) / median, and the command that produced it.
inline double relative_spread(const Spread& s) {
  return s.median > 0 ? (s.max - s.min) / s.median : 0.0;
}

inline std::string json_list(const std::vector<double>& v, int decimals = 4) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    char buf[48];
    std::snprintf(buf, sizeof(buf), "%s%.*f", i ? "," : "", decimals, v[i]);
    out += buf;
  }
  return out + "]";
}

// A JSON string literal of s (quotes, backslashes and control bytes escaped).
inline std::string json_quote(const std::string& s) {
  std::string out = "\"";
  for (const unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\', out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// The command line as run, argv joined by spaces, as a JSON string literal.
inline std::string command_json(int argc, char** argv) {
  std::string cmd;
  for (int i = 0; i < argc; ++i) cmd += (i ? " " : "") + std::string(argv[i]);
  return json_quote(cmd);
}

// f() timed `repeat` times after `warmup` untimed calls, by CUDA events on the default stream
// around each call: each run's milliseconds.
template <class F>
std::vector<double> event_times_ms(F&& f, int warmup, int repeat) {
  cudaEvent_t a, b;
  cudaEventCreate(&a), cudaEventCreate(&b);
  for (int i = 0; i < warmup; ++i) f();
  std::vector<double> ms;
  for (int i = 0; i < repeat; ++i) {
    cudaEventRecord(a);
    f();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    ms.push_back(t);
  }
  cudaEventDestroy(a), cudaEventDestroy(b);
  return ms;
}

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline std::string gpu_name() {
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) return "none";
  return p.name;
}

// TFLOP/s of an n x n x n bf16 GEMM through cuBLAS (f32 accumulation), random data, the median
// of `reps` after two warm-ups: the ceiling the benchmarks quote against.
inline double measured_bf16_peak_tflops(int n = 8192, int reps = 10) {
  const size_t elems = static_cast<size_t>(n) * n;
  void *a = nullptr, *b = nullptr, *c = nullptr;
  if (cudaMalloc(&a, elems * 2) != cudaSuccess || cudaMalloc(&b, elems * 2) != cudaSuccess ||
      cudaMalloc(&c, elems * 2) != cudaSuccess)
    return 0;
  std::vector<uint16_t> host(elems);
  Draw d{0x1234567ull};
  for (auto& x : host) x = f32_to_bf16(d.next(1.f));
  cudaMemcpy(a, host.data(), elems * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(b, host.data(), elems * 2, cudaMemcpyHostToDevice);
  cublasHandle_t h;
  cublasCreate(&h);
  const float one = 1.f, zero = 0.f;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0), cudaEventCreate(&e1);
  std::vector<double> t;
  for (int i = 0; i < reps + 2; ++i) {
    cudaEventRecord(e0);
    cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a, CUDA_R_16BF, n, b, CUDA_R_16BF, n,
                 &zero, c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    if (i >= 2) t.push_back(2.0 * n * double(n) * n / (ms * 1e-3) / 1e12);
  }
  cublasDestroy(h);
  cudaFree(a), cudaFree(b), cudaFree(c);
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  return spread(t).median;
}

}  // namespace hetero::bench
