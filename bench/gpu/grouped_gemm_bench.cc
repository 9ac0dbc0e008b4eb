// The routed experts' FP8 GEMMs at DeepSeek-V4-Flash's shapes (256 experts, top 6, hidden 4096,
// expert width 2048: w1|w3 is n 4096 x k 4096, w2 n 4096 x k 2048), rows per expert drawn as a
// router spreads T tokens: the grouped kernel (kernels/cuda/fp8_grouped_gemm.h) against cuBLASLt's
// block-scaled GEMM called once per expert, on one stream and over 8 streams as the engine did (the
// library reference, in the same run on the same GPU). Useful TFLOP/s (2 * rows * n * k), median of
// --repeat timed runs after 2 warm-ups (CUDA events around the whole launch sequence), spread as
// max/min - 1. Operands are random e4m3 bytes (no NaN codes) and scales in [0.5, 2); correctness is
// hetero_gpu_tests' (Fp8GroupedGemmTest). JSON lines to stdout.
#include <cuda_runtime.h>

#include <cstdio>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "expert_gemm_bench.h"
#include "kernels/cuda/fp8_gemm.h"
#include "kernels/cuda/fp8_grouped_gemm.h"

namespace {

namespace hb = hetero::bench;
namespace hc = hetero::cuda;
#define CHECK EXPERT_BENCH_CHECK
#define CHECK_CUDA EXPERT_BENCH_CHECK_CUDA

void* dev_alloc(size_t bytes) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(bytes, 16)));
  return p;
}

// Random e4m3 bytes without the NaN codes (0x7f, 0xff), and scales in [0.5, 2).
void fill(uint8_t* q, size_t n, float* scale, size_t ns, uint32_t seed) {
  std::vector<uint8_t> hq(n);
  std::mt19937 rng(seed);
  for (auto& b : hq) {
    b = static_cast<uint8_t>(rng() & 0xff);
    if ((b & 0x7f) == 0x7f) b ^= 1;
  }
  std::vector<float> hs(ns);
  std::uniform_real_distribution<float> u(0.5f, 2.f);
  for (auto& v : hs) v = u(rng);
  CHECK_CUDA(cudaMemcpy(q, hq.data(), n, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(scale, hs.data(), ns * 4, cudaMemcpyHostToDevice));
}

}  // namespace

int main(int argc, char** argv) {
  const hb::ExpertBenchArgs args = hb::parse_expert_bench_args(argc, argv);
  const int repeat = args.repeat;
  CHECK(hc::check_fp8_device(0));
  CHECK(hc::fp8_grouped_gemm_available());
  const std::string gpu = hb::gpu_name();
  const int64_t E = hb::kFlashExperts, top = hb::kFlashTop, H = hb::kFlashHidden,
                I = hb::kFlashInter;
  auto grouped = hc::Fp8GroupedGemm::create(E);
  CHECK(grouped.status());
  hb::CublasLtLanes lanes;
  for (const int64_t T : args.tokens) {
    const std::vector<int64_t> rows = hb::uniform_router_rows(T, E, top);
    std::vector<int64_t> off = {0}, pad = {0};
    for (int64_t r : rows)
      off.push_back(off.back() + r), pad.push_back(pad.back() + hc::fp8_act_rows(r));
    for (auto [n, k, what] :
         {std::tuple<int64_t, int64_t, const char*>{2 * I, H, "w1|w3"}, {H, I, "w2"}}) {
      const int64_t groups = hc::fp8_blocks(k), total = pad.back();
      auto* aq = static_cast<uint8_t*>(dev_alloc(static_cast<size_t>(total * k)));
      auto* as_pad = static_cast<float*>(dev_alloc(static_cast<size_t>(total * groups) * 4));
      auto* as_tight = static_cast<float*>(dev_alloc(static_cast<size_t>(total * groups) * 4));
      auto* wq = static_cast<uint8_t*>(dev_alloc(static_cast<size_t>(E * n * k)));
      const int64_t ws = hc::fp8_blocks(n) * hc::fp8_weight_scale_ld(k);
      auto* wsc = static_cast<float*>(dev_alloc(static_cast<size_t>(E * ws) * 4));
      auto* wst = static_cast<float*>(dev_alloc(static_cast<size_t>(E * ws) * 4));
      auto* out = static_cast<uint16_t*>(dev_alloc(static_cast<size_t>((total + 16) * n) * 2));
      fill(aq, static_cast<size_t>(total * k), as_pad, static_cast<size_t>(total * groups), 1);
      CHECK_CUDA(cudaMemcpy(as_tight, as_pad, static_cast<size_t>(total * groups) * 4,
                            cudaMemcpyDeviceToDevice));
      fill(wq, static_cast<size_t>(E * n * k), wsc, static_cast<size_t>(E * ws), 2);
      hc::transpose_fp8_weight_scales(wsc, E, n, k, wst, nullptr);
      std::vector<hc::Fp8GemmGroup> gs;
      for (int64_t e = 0; e < E; ++e)
        if (rows[static_cast<size_t>(e)] > 0)
          gs.push_back({aq + pad[e] * k, as_tight + pad[e] * groups, rows[static_cast<size_t>(e)],
                        wq + e * n * k, wst + e * groups * hc::fp8_blocks(n), out + off[e] * n});
      const double flops = 2.0 * static_cast<double>(off.back()) * static_cast<double>(n * k);
      auto one = [&](hc::Fp8Gemm& g, cudaStream_t st, int64_t e) {
        const hc::Fp8BlockWeight w{wq + e * n * k, wsc + e * ws, n, k};
        CHECK(g.run(aq + pad[e] * k, as_pad + pad[e] * groups, rows[static_cast<size_t>(e)], w,
                    out + off[e] * n, st));
      };
      auto report = [&](const char* kernel, const hb::Timing& t, double ref_ms) {
        std::printf(
            "{\"bench\":\"grouped_fp8_gemm\",\"gpu\":\"%s\",\"rev\":\"%s\",\"T\":%lld,"
            "\"experts\":%lld,\"top_k\":%lld,\"gemm\":\"%s\",\"n\":%lld,\"k\":%lld,"
            "\"rows\":%lld,\"kernel\":\"%s\",\"ms_median\":%.4f,\"spread\":%.4f,\"repeat\":%d,"
            "\"tflops\":%.1f,\"vs_cublaslt_8_streams\":%.3f}\n",
            gpu.c_str(), args.rev.c_str(), static_cast<long long>(T), static_cast<long long>(E),
            static_cast<long long>(top), what, static_cast<long long>(n), static_cast<long long>(k),
            static_cast<long long>(off.back()), kernel, t.median, t.spread, repeat,
            flops / (t.median * 1e-3) / 1e12, ref_ms / t.median);
        std::fflush(stdout);
      };
      const hb::Timing loop = hb::time_ms(
          [&] {
            for (int64_t e = 0; e < E; ++e)
              if (rows[static_cast<size_t>(e)] > 0) one(lanes.first(), nullptr, e);
          },
          repeat);
      const hb::Timing streams = hb::time_ms([&] { lanes.run(off, one); }, repeat);
      report("cuBLASLt per expert, 1 stream", loop, streams.median);
      report("cuBLASLt per expert, 8 streams", streams, streams.median);
      const hb::Timing g = hb::time_ms(
          [&] {
            CHECK((*grouped)->run(gs.data(), static_cast<int64_t>(gs.size()), n, k, nullptr));
          },
          repeat);
      report("grouped (CUTLASS)", g, streams.median);
      CHECK_CUDA(cudaDeviceSynchronize());
      for (void* p : {static_cast<void*>(aq), static_cast<void*>(as_pad),
                      static_cast<void*>(as_tight), static_cast<void*>(wq), static_cast<void*>(wsc),
                      static_cast<void*>(wst), static_cast<void*>(out)})
        cudaFree(p);
    }
  }
  return 0;
}
