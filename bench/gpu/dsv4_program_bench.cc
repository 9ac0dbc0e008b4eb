// What the exact DeepSeek-V4 cache program costs on the GPU, per layer and token, at
// DeepSeek-V4-Flash's layer shapes (hidden 4096, head_dim 512, window 128, rope 64; a ratio-4
// layer with its 128-wide indexer, a ratio-128 layer, a ratio-0 layer) with random bf16 weights.
// One request: the decoder server's schedule (2048-token calls, the last token alone), fed in
// 2048-row prefill chunks from device memory (a GPU prefill's tap) or host memory (a CPU one),
// then finish_layer. Wall time from the first feed to the finished arrays on the host, median and
// spread of --runs timed runs after one warm-up. JSON lines on stdout. Exactness is
// hetero_gpu_tests' job, not this one's.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_common.h"
#include "bridge/cuda/dsv4_program_gpu.h"
#include "bridge/dsv4_program.h"
#include "common/bf16.h"
#include "dsv4_flash_decoder.h"

namespace hetero {
namespace {

using bench::Draw;

// Multiply-adds of the projections the program runs for one layer at T (window rows: the ring's).
double layer_gflop(const Dsv4DecoderWeights& w, const Dsv4ProgramLayer& L, int64_t T,
                   int64_t window_rows) {
  const double H = double(w.layout.hidden);
  double flop = 2.0 * H * double(L.wkv.n) * double(window_rows);
  for (const Dsv4ProgramCompressor* c : {&L.pool, &L.index})
    if (c->ratio > 0 && (c != &L.index || L.has_index))
      flop += 2.0 * 2.0 * H * double(c->out_dim) * double(T);
  return flop / 1e9;
}

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  std::exit(1);
}

void check(const Status& s, const char* what) {
  if (s.is_ok()) return;
  std::fprintf(stderr, "%s: %s\n", what, s.to_string().c_str());
  std::exit(1);
}

}  // namespace
}  // namespace hetero

int main(int argc, char** argv) {
  using namespace hetero;
  int runs = 3;
  int64_t chunk = 2048;
  std::vector<int64_t> lengths = {8192, 32768};
  std::string rev = "unknown";
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--runs") && i + 1 < argc) runs = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--chunk") && i + 1 < argc) chunk = std::atoll(argv[++i]);
    if (!std::strcmp(argv[i], "--rev") && i + 1 < argc) rev = argv[++i];
    if (!std::strcmp(argv[i], "--T") && i + 1 < argc) lengths = {std::atoll(argv[++i])};
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "device");
  const Dsv4DecoderWeights w = bench::flash_decoder_weights({4, 128, 0});
  auto uploaded = cuda::upload_dsv4_weights(w);
  check(uploaded.status(), "upload");
  const cuda::Dsv4GpuWeights& gw = **uploaded;
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  const int64_t H = w.layout.hidden, Tmax = *std::max_element(lengths.begin(), lengths.end());
  std::vector<uint16_t> x(static_cast<size_t>(Tmax * H));
  Draw d{12345};
  for (auto& v : x) v = f32_to_bf16(d.next(2.0f));
  uint16_t* x_dev = nullptr;
  check(cudaMalloc(&x_dev, x.size() * 2), "x");
  check(cudaMemcpy(x_dev, x.data(), x.size() * 2, cudaMemcpyHostToDevice), "x");

  for (int64_t T : lengths) {
    const auto calls = dsv4_server_calls(T, 2048);
    int64_t window_first = T;
    for (int64_t p : dsv4_window_layout(dsv4_effective_calls(calls), w.window).slot_pos)
      if (p >= 0) window_first = std::min(window_first, p);
    const int64_t window_rows = T - window_first;
    for (int64_t l = 0; l < w.layout.layers; ++l) {
      const Dsv4ProgramLayer& L = w.layers[static_cast<size_t>(l)];
      for (bool device_x : {true, false}) {
        std::vector<double> ms;
        for (int run = 0; run <= runs; ++run) {  // run 0 warms up
          cuda::Dsv4GpuCacheProgram program(&gw, calls, stream);
          const auto t0 = std::chrono::steady_clock::now();
          for (int64_t p = 0; p < T; p += chunk) {
            const int64_t n = std::min(chunk, T - p);
            Dsv4NewRows rows;
            check(device_x ? program.feed_device(l, p, n, x_dev + p * H, &rows)
                           : program.feed(l, p, n, x.data() + p * H, &rows),
                  "feed");
          }
          auto arrays = program.finish_layer(l);
          check(arrays.status(), "finish");
          const auto t1 = std::chrono::steady_clock::now();
          if (run > 0) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        }
        std::sort(ms.begin(), ms.end());
        const double med = ms[ms.size() / 2];
        const double gflop = layer_gflop(w, L, T, window_rows);
        std::printf(
            "{\"bench\":\"dsv4_program_gpu\",\"gpu\":\"%s\",\"rev\":\"%s\",\"T\":%lld,"
            "\"ratio\":%lld,\"x\":\"%s\",\"chunk\":%lld,\"runs\":%d,\"median_ms\":%.3f,"
            "\"min_ms\":%.3f,\"max_ms\":%.3f,\"us_per_token\":%.4f,\"gflop\":%.1f,"
            "\"tflops\":%.2f}\n",
            prop.name, rev.c_str(), static_cast<long long>(T), static_cast<long long>(L.ratio),
            device_x ? "device" : "host", static_cast<long long>(chunk), runs, med, ms.front(),
            ms.back(), med * 1e3 / double(T), gflop, gflop / med);
        std::fflush(stdout);
      }
    }
  }
  cudaFree(x_dev);
  cudaStreamDestroy(stream);
  return 0;
}
