// What the routed-expert GEMM benches (grouped_gemm_bench.cc, w4a8_grouped_bench.cc) share:
// their flags, the timing of a launch sequence, DeepSeek-V4-Flash's expert shapes with rows per
// expert drawn as a uniform router spreads T tokens, and cuBLASLt's block-scaled GEMM once per
// expert over 8 streams as the engine runs it (the reference both report against).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_common.h"
#include "kernels/cuda/fp8_gemm.h"

namespace hetero::bench {

#define EXPERT_BENCH_CHECK(x)                                                          \
  do {                                                                                 \
    const hetero::Status s_ = (x);                                                     \
    if (!s_.is_ok()) {                                                                 \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, s_.to_string().c_str()); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)
#define EXPERT_BENCH_CHECK_CUDA(x) \
  EXPERT_BENCH_CHECK(hetero::cuda::call_status((x), #x, __FILE__, __LINE__))

// Flash's routed experts: 256, top 6, hidden 4,096, expert width 2,048.
constexpr int64_t kFlashExperts = 256, kFlashTop = 6, kFlashHidden = 4096, kFlashInter = 2048;

struct ExpertBenchArgs {
  std::vector<int64_t> tokens = {8192, 32768};
  int repeat = 5;
  std::string rev = "unknown";
};

// --tokens 8192,32768 --repeat 5 --rev REV; anything else prints the usage and exits with 2.
inline ExpertBenchArgs parse_expert_bench_args(int argc, char** argv) {
  ExpertBenchArgs r;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? argv[++i] : (std::exit(2), argv[0]); };
    if (a == "--tokens") {
      r.tokens.clear();
      for (char* t = std::strtok(next(), ","); t; t = std::strtok(nullptr, ","))
        r.tokens.push_back(std::atoll(t));
    } else if (a == "--repeat") {
      r.repeat = std::atoi(next());
    } else if (a == "--rev") {
      r.rev = next();
    } else {
      std::fprintf(stderr, "usage: %s [--tokens 8192,32768] [--repeat 5] [--rev REV]\n", argv[0]);
      std::exit(2);
    }
  }
  return r;
}

struct Timing {
  double median = 0, spread = 0;  // ms; max / min - 1
};

// f's device time: the median of `repeat` runs after 2 warm-ups.
template <class F>
Timing time_ms(F&& f, int repeat) {
  const Spread s = spread(event_times_ms(f, 2, repeat));
  return {s.median, s.max / s.min - 1.0};
}

// Rows per expert when each of T tokens picks `top` distinct experts of E uniformly (seeded by T).
inline std::vector<int64_t> uniform_router_rows(int64_t T, int64_t E, int64_t top) {
  std::vector<int64_t> rows(static_cast<size_t>(E), 0);
  std::mt19937 rng(static_cast<uint32_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int> picked;
    while (static_cast<int64_t>(picked.size()) < top) {
      const int e = static_cast<int>(rng() % E);
      if (std::find(picked.begin(), picked.end(), e) == picked.end()) picked.push_back(e);
    }
    for (int e : picked) ++rows[static_cast<size_t>(e)];
  }
  return rows;
}

// cuBLASLt's per-expert GEMMs over 8 streams forked from and joined into the default stream:
// runs of consecutive experts with about equal rows, one per stream, as the engine ran them.
class CublasLtLanes {
 public:
  static constexpr int kLanes = 8;
  CublasLtLanes() {
    EXPERT_BENCH_CHECK_CUDA(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
    for (int i = 0; i < kLanes; ++i) {
      auto g = cuda::Fp8Gemm::create();
      EXPERT_BENCH_CHECK(g.status());
      gemms_.push_back(std::move(*g));
      EXPERT_BENCH_CHECK_CUDA(cudaStreamCreateWithFlags(&streams_[i], cudaStreamNonBlocking));
      EXPERT_BENCH_CHECK_CUDA(cudaEventCreateWithFlags(&done_[i], cudaEventDisableTiming));
    }
  }
  // gemm(g, stream, e) for every expert e with rows (off: row offsets, [E + 1]).
  template <class F>
  void run(const std::vector<int64_t>& off, F&& gemm) {
    const int64_t E = static_cast<int64_t>(off.size()) - 1;
    EXPERT_BENCH_CHECK_CUDA(cudaEventRecord(fork_, nullptr));
    int64_t e = 0;
    for (int lane = 0; lane < kLanes; ++lane) {
      EXPERT_BENCH_CHECK_CUDA(cudaStreamWaitEvent(streams_[lane], fork_));
      const double until = static_cast<double>(off.back()) * (lane + 1) / kLanes;
      for (; e < E && (lane == kLanes - 1 || off[e + 1] <= until); ++e)
        if (off[e + 1] > off[e]) gemm(*gemms_[static_cast<size_t>(lane)], streams_[lane], e);
      EXPERT_BENCH_CHECK_CUDA(cudaEventRecord(done_[lane], streams_[lane]));
      EXPERT_BENCH_CHECK_CUDA(cudaStreamWaitEvent(nullptr, done_[lane]));
    }
  }
  cuda::Fp8Gemm& first() { return *gemms_.front(); }

 private:
  std::vector<std::unique_ptr<cuda::Fp8Gemm>> gemms_;
  cudaStream_t streams_[kLanes] = {};
  cudaEvent_t done_[kLanes] = {}, fork_ = nullptr;
};

}  // namespace hetero::bench
