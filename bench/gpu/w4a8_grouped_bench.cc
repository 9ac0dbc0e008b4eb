// The routed experts' GEMMs with FP4 weights (DeepSeek-V4's checkpoint form) at
// DeepSeek-V4-Flash's shapes (256 experts, top 6, hidden 4096, expert width 2048: w1|w3 is
// n 4096 x k 4096, w2 n 4096 x k 2048), rows per expert drawn as a router spreads T tokens: the
// W4A8 kernel that widens inside its main loop (kernels/cuda/w4a8_grouped_gemm.h) against the
// path the engine runs per chunk today, in the same run on the same GPU: every active expert
// widened into device memory, then the grouped CUTLASS kernel (with its scale transpose) or
// cuBLASLt per expert over 8 streams. Useful TFLOP/s (2 * rows * n * k), median of --repeat
// timed runs after 2 warm-ups (CUDA events around the whole sequence), spread as max/min - 1.
// Random codes and exponents; correctness is hetero_gpu_tests' (W4a8GroupedGemmTest). JSON lines.
#include <cuda_runtime.h>

#include <cstdio>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "expert_gemm_bench.h"
#include "kernels/cuda/checkpoint_formats.h"
#include "kernels/cuda/fp8_gemm.h"
#include "kernels/cuda/fp8_grouped_gemm.h"
#include "kernels/cuda/w4a8_grouped_gemm.h"

namespace {

namespace hb = hetero::bench;
namespace hc = hetero::cuda;
#define CHECK EXPERT_BENCH_CHECK
#define CHECK_CUDA EXPERT_BENCH_CHECK_CUDA

template <class T = uint8_t>
T* dev_alloc(size_t bytes) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(bytes, 16)));
  return static_cast<T*>(p);
}

// bytes of random content: a 64 MB host pattern copied over the device buffer (the experts
// repeat every 64 MB; the timing does not depend on the values).
void fill_random(uint8_t* d, size_t bytes, uint32_t seed, uint8_t lo = 0, uint8_t span = 0) {
  const size_t chunk = std::min<size_t>(bytes, size_t{64} << 20);
  std::vector<uint8_t> h(chunk);
  std::mt19937 rng(seed);
  for (auto& b : h) {
    b = static_cast<uint8_t>(rng());
    if (span) b = static_cast<uint8_t>(lo + b % span);
  }
  for (size_t o = 0; o < bytes; o += chunk)
    CHECK_CUDA(cudaMemcpy(d + o, h.data(), std::min(chunk, bytes - o), cudaMemcpyHostToDevice));
}

}  // namespace

int main(int argc, char** argv) {
  const hb::ExpertBenchArgs args = hb::parse_expert_bench_args(argc, argv);
  const int repeat = args.repeat;
  CHECK(hc::check_fp8_device(0));
  const bool have_cutlass = hc::fp8_grouped_gemm_available().is_ok();
  const std::string gpu = hb::gpu_name();
  const int64_t E = hb::kFlashExperts, top = hb::kFlashTop, H = hb::kFlashHidden,
                I = hb::kFlashInter;
  auto w4a8 = hc::W4a8GroupedGemm::create(E);
  CHECK(w4a8.status());
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::unique_ptr<hc::Fp8GroupedGemm> grouped;
  if (have_cutlass) {
    auto g = hc::Fp8GroupedGemm::create(E);
    CHECK(g.status());
    grouped = std::move(*g);
  }
  hb::CublasLtLanes lanes;
  auto* lossy = dev_alloc<unsigned long long>(8);
  for (auto [n, k, what] :
       {std::tuple<int64_t, int64_t, const char*>{2 * I, H, "w1|w3"}, {H, I, "w2"}}) {
    // The experts: FP4 codes, exponents 124..127 (a block's groups within 2^3 of each other, as
    // trained weights' are: every group takes the byte-permute widening), their block maxima;
    // the widened scratch.
    auto* codes = dev_alloc(static_cast<size_t>(E * n * k / 2));
    auto* exps = dev_alloc(static_cast<size_t>(E * n * k / 32));
    auto* bmax = dev_alloc(hc::Fp4Experts::block_max_bytes(E, n, k));
    fill_random(codes, static_cast<size_t>(E * n * k / 2), 3);
    fill_random(exps, static_cast<size_t>(E * n * k / 32), 4, 124, 4);
    const hc::Fp4GroupWeight w0{codes, exps, n, k};
    hc::fp4_block_max(w0, E, bmax, nullptr);
    const hc::Fp4Experts experts{w0, bmax, E};
    const int64_t ws = hc::fp8_blocks(n) * hc::fp8_weight_scale_ld(k), groups = hc::fp8_blocks(k);
    auto* wq = dev_alloc(static_cast<size_t>(E * n * k));
    auto* wsc = dev_alloc<float>(static_cast<size_t>(E * ws) * 4);
    auto* wst = dev_alloc<float>(static_cast<size_t>(E * ws) * 4);
    for (const int64_t T : args.tokens) {
      const std::vector<int64_t> rows = hb::uniform_router_rows(T, E, top);
      std::vector<int64_t> off = {0}, pad = {0};
      std::vector<int32_t> active;
      for (int64_t e = 0; e < E; ++e) {
        const int64_t r = rows[static_cast<size_t>(e)];
        off.push_back(off.back() + r), pad.push_back(pad.back() + hc::fp8_act_rows(r));
        if (r > 0) active.push_back(static_cast<int32_t>(e));
      }
      const int64_t total = pad.back();
      auto* aq = dev_alloc(static_cast<size_t>(total * k));
      auto* as = dev_alloc<float>(static_cast<size_t>(total * groups) * 4);
      auto* out = dev_alloc<uint16_t>(static_cast<size_t>((total + 16) * n) * 2);
      auto* dact = dev_alloc<int32_t>(active.size() * 4);
      fill_random(aq, static_cast<size_t>(total * k), 1, 0, 0x7e);  // e4m3 below 448, no NaN
      {
        std::vector<float> hs(static_cast<size_t>(total * groups));
        std::mt19937 r2(2);
        std::uniform_real_distribution<float> u(0.5f, 2.f);
        for (auto& v : hs) v = u(r2);
        CHECK_CUDA(cudaMemcpy(as, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
      }
      CHECK_CUDA(cudaMemcpy(dact, active.data(), active.size() * 4, cudaMemcpyHostToDevice));
      const double flops = 2.0 * static_cast<double>(off.back()) * static_cast<double>(n * k);
      auto widen = [&] {
        hc::widen_fp4_experts_to_fp8(w0, dact, static_cast<int64_t>(active.size()), wq, wsc, lossy,
                                     nullptr);
      };
      std::vector<hc::Fp8GemmGroup> gs;
      std::vector<hc::W4a8Group> g4;
      for (int64_t e : active) {
        // The same scale buffer serves both layouts: timing only.
        gs.push_back({aq + pad[e] * k, as + pad[e] * groups, rows[static_cast<size_t>(e)],
                      wq + e * n * k, wst + e * groups * hc::fp8_blocks(n), out + off[e] * n});
        g4.push_back({aq + pad[e] * k, as + pad[e] * groups, rows[static_cast<size_t>(e)], e,
                      out + off[e] * n});
      }
      auto report = [&](const char* kernel, const hb::Timing& t, double ref_ms) {
        std::printf(
            "{\"bench\":\"w4a8_grouped_gemm\",\"gpu\":\"%s\",\"rev\":\"%s\",\"T\":%lld,"
            "\"experts\":%lld,\"top_k\":%lld,\"gemm\":\"%s\",\"n\":%lld,\"k\":%lld,"
            "\"rows\":%lld,\"kernel\":\"%s\",\"ms_median\":%.4f,\"spread\":%.4f,\"repeat\":%d,"
            "\"tflops\":%.1f,\"vs_widened_best\":%.3f}\n",
            gpu.c_str(), args.rev.c_str(), static_cast<long long>(T), static_cast<long long>(E),
            static_cast<long long>(top), what, static_cast<long long>(n), static_cast<long long>(k),
            static_cast<long long>(off.back()), kernel, t.median, t.spread, repeat,
            flops / (t.median * 1e-3) / 1e12, ref_ms / t.median);
        std::fflush(stdout);
      };
      const hb::Timing wide_only = hb::time_ms(widen, repeat);
      const hb::Timing wide_lt = hb::time_ms(
          [&] {
            widen();
            lanes.run(off, [&](hc::Fp8Gemm& g, cudaStream_t st, int64_t e) {
              const hc::Fp8BlockWeight w{wq + e * n * k, wsc + e * ws, n, k};
              CHECK(g.run(aq + pad[e] * k, as + pad[e] * groups, rows[static_cast<size_t>(e)], w,
                          out + off[e] * n, st));
            });
          },
          repeat);
      hb::Timing wide_grouped{};
      if (grouped)
        wide_grouped = hb::time_ms(
            [&] {
              widen();
              hc::transpose_fp8_weight_scales(wsc, E, n, k, wst, nullptr);
              CHECK(grouped->run(gs.data(), static_cast<int64_t>(gs.size()), n, k, nullptr));
            },
            repeat);
      const double best = grouped ? std::min(wide_lt.median, wide_grouped.median) : wide_lt.median;
      report("widening alone", wide_only, best);
      report("widened + cuBLASLt per expert, 8 streams", wide_lt, best);
      if (grouped) report("widened + grouped (CUTLASS)", wide_grouped, best);
      // Each tile with a block a tile, the two largest also persistent (a block a
      // multiprocessor, each taking every sms-th tile).
      for (auto [tm, tn, blocks] :
           {std::tuple{64, 64, 0}, std::tuple{64, 128, 0}, std::tuple{128, 64, 0},
            std::tuple{128, 128, 0}, std::tuple{64, 256, 0}, std::tuple{128, 128, sms},
            std::tuple{64, 256, sms}, std::tuple{0, 0, 0}}) {
        (*w4a8)->set_tile(tm, tn);
        (*w4a8)->set_max_blocks(blocks);
        const hb::Timing f = hb::time_ms(
            [&] {
              CHECK((*w4a8)->run(g4.data(), static_cast<int64_t>(g4.size()), experts, lossy,
                                 nullptr));
            },
            repeat);
        const std::string name =
            (tm ? "W4A8, tiles " + std::to_string(tm) + "x" + std::to_string(tn)
                : std::string("W4A8, tile chosen per launch")) +
            (blocks ? ", persistent (" + std::to_string(blocks) + " blocks)" : std::string());
        report(name.c_str(), f, best);
      }
      CHECK_CUDA(cudaDeviceSynchronize());
      for (void* p : {static_cast<void*>(aq), static_cast<void*>(as), static_cast<void*>(out),
                      static_cast<void*>(dact)})
        cudaFree(p);
    }
    for (void* p : {static_cast<void*>(codes), static_cast<void*>(exps), static_cast<void*>(bmax),
                    static_cast<void*>(wq), static_cast<void*>(wsc), static_cast<void*>(wst)})
      cudaFree(p);
  }
  return 0;
}
