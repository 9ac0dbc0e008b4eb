// GPU GEMM throughput: the decoder-order GEMM (bit-exact, kernels/cuda/ops.h) against cuBLAS
// SGEMM (float32, its own order) and cuBLAS bf16 GEMM (tensor cores), on the shapes a llama
// prefill runs; then the FP8 block-scaled weight GEMM (kernels/cuda/fp8_gemm.h) against the
// engine's bf16 GEMM on a 1B llama's projections for an 8192-token chunk, with the activation
// quantization timed alone and together with the GEMM. Median of --repeat timed runs after
// warm-up, CUDA events; JSON lines to stdout. Exactness is tested by hetero_gpu_tests, not here;
// the FP8 rows carry a relative RMS against the bf16 output only as a sanity check.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "bench_common.h"
#include "kernels/cuda/fp8_gemm.h"
#include "kernels/cuda/ops.h"

namespace {

#define CHECK_CUDA(x)                                                                  \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

template <typename F>
float median_ms(F&& f, int repeat) {
  return static_cast<float>(
      hetero::bench::spread(hetero::bench::event_times_ms(f, 2, repeat)).median);
}

// The FP8 rows: m = 8192 tokens through q|k|v, o, gate|up and down of a ~1B llama (hidden 2048,
// intermediate 8192, 32 heads of 64 and 8 kv heads).
void fp8_rows(int repeat, cublasHandle_t h, const char* gpu) {
  namespace hc = hetero::cuda;
  auto g = hc::Fp8Gemm::create();
  if (!g.is_ok()) {
    std::printf("{\"bench\":\"gpu_gemm_fp8\",\"gpu\":\"%s\",\"error\":\"%s\"}\n", gpu,
                g.status().to_string().c_str());
    return;
  }
  const int64_t m = 8192, rows = hc::fp8_act_rows(m);
  const int64_t shapes[][2] = {{3072, 2048}, {2048, 2048}, {16384, 2048}, {2048, 8192}};
  hetero::bench::Draw draw{0x9e3779b97f4a7c15ull};
  for (auto& s : shapes) {
    const int64_t n = s[0], k = s[1];
    std::vector<uint16_t> hx(size_t(m * k)), hw(size_t(n * k));
    for (auto& v : hx) v = hetero::f32_to_bf16(draw.next(2.f));
    for (auto& v : hw) v = hetero::f32_to_bf16(draw.next(0.04f));
    void *x, *w, *out, *ref, *xq, *xs, *wq, *ws;
    const size_t ws_bytes = size_t(hc::fp8_blocks(n) * hc::fp8_weight_scale_ld(k)) * 4;
    CHECK_CUDA(cudaMalloc(&x, hx.size() * 2));
    CHECK_CUDA(cudaMalloc(&w, hw.size() * 2));
    CHECK_CUDA(cudaMalloc(&out, size_t(rows * n) * 2));
    CHECK_CUDA(cudaMalloc(&ref, size_t(m * n) * 2));
    CHECK_CUDA(cudaMalloc(&xq, size_t(rows * k)));
    CHECK_CUDA(cudaMalloc(&xs, size_t(hc::fp8_blocks(k) * rows) * 4));
    CHECK_CUDA(cudaMalloc(&wq, size_t(n * k)));
    CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
    cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(w, hw.data(), hw.size() * 2, cudaMemcpyHostToDevice);
    const auto* x16 = static_cast<const uint16_t*>(x);
    const float t_wquant = median_ms(
        [&] {
          hc::quantize_weight_fp8_block(static_cast<const uint16_t*>(w), n, k,
                                        static_cast<uint8_t*>(wq), static_cast<float*>(ws),
                                        nullptr);
        },
        1);
    const hc::Fp8BlockWeight wt{static_cast<const uint8_t*>(wq), static_cast<const float*>(ws), n,
                                k};
    const float one = 1.f, zero = 0.f;
    // Ten calls back to back per timed sample: launch latency (the host's cuBLASLt set-up runs
    // while the previous call computes) stays out of the per-call time, as in the engine.
    auto timed = [&](auto&& f) {
      return median_ms(
                 [&] {
                   for (int i = 0; i < 10; ++i) f();
                 },
                 repeat) /
             10.f;
    };
    // The engine's bf16 GEMM: out [m, n] = x [m, k] · w^T.
    const float t_bf16 = timed([&] {
      cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(m), int(k), &one, w, CUDA_R_16BF,
                   int(k), x, CUDA_R_16BF, int(k), &zero, ref, CUDA_R_16BF, int(n),
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    });
    auto quant = [&] {
      hc::quantize_act_fp8_group(x16, m, k, static_cast<uint8_t*>(xq), static_cast<float*>(xs),
                                 nullptr);
    };
    auto gemm = [&] {
      return g.value()->run(static_cast<const uint8_t*>(xq), static_cast<const float*>(xs), m, wt,
                            static_cast<uint16_t*>(out), nullptr);
    };
    quant();
    const hetero::Status st = gemm();
    if (!st.is_ok()) {
      std::printf(
          "{\"bench\":\"gpu_gemm_fp8\",\"gpu\":\"%s\",\"m\":%lld,\"n\":%lld,\"k\":%lld,"
          "\"error\":\"%s\"}\n",
          gpu, (long long)m, (long long)n, (long long)k, st.to_string().c_str());
    } else {
      const float t_quant = timed(quant);
      const float t_gemm = timed([&] { (void)gemm(); });
      const float t_total = timed([&] {
        quant();
        (void)gemm();
      });
      // Sanity: the first 64 rows against bf16.
      std::vector<uint16_t> a(size_t(64 * n)), b(size_t(64 * n));
      cudaMemcpy(a.data(), out, a.size() * 2, cudaMemcpyDeviceToHost);
      cudaMemcpy(b.data(), ref, b.size() * 2, cudaMemcpyDeviceToHost);
      double num = 0, den = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        const double d = hetero::bf16_to_f32(a[i]) - hetero::bf16_to_f32(b[i]);
        num += d * d, den += double(hetero::bf16_to_f32(b[i])) * hetero::bf16_to_f32(b[i]);
      }
      const double flop = 2.0 * double(m) * double(n) * double(k);
      std::printf(
          "{\"bench\":\"gpu_gemm_fp8\",\"gpu\":\"%s\",\"m\":%lld,\"n\":%lld,\"k\":%lld,"
          "\"repeat\":%d,\"bf16_ms\":%.4f,\"bf16_tflops\":%.1f,\"fp8_gemm_ms\":%.4f,"
          "\"fp8_gemm_tflops\":%.1f,\"act_quant_ms\":%.4f,\"fp8_total_ms\":%.4f,"
          "\"fp8_total_tflops\":%.1f,\"speedup_gemm\":%.2f,\"speedup_total\":%.2f,"
          "\"weight_quant_ms\":%.3f,\"rel_rms_vs_bf16\":%.2e,\"cublaslt\":%zu}\n",
          gpu, (long long)m, (long long)n, (long long)k, repeat, t_bf16, flop / t_bf16 / 1e9,
          t_gemm, flop / t_gemm / 1e9, t_quant, t_total, flop / t_total / 1e9, t_bf16 / t_gemm,
          t_bf16 / t_total, t_wquant, std::sqrt(num / den), cublasLtGetVersion());
    }
    for (void* p : {x, w, out, ref, xq, xs, wq, ws}) cudaFree(p);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int repeat = 5;
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--repeat") && i + 1 < argc) repeat = std::atoi(argv[++i]);
  cudaDeviceProp p{};
  CHECK_CUDA(cudaGetDeviceProperties(&p, 0));
  cublasHandle_t h;
  cublasCreate(&h);
  // (M, K, N): a 2048-token chunk through SmolLM2-135M's projections, a ~1B llama's, a square,
  // and an 8192-token chunk through a DeepSeek-V4-Flash ratio-4 layer's compressors (the cache
  // program's kv and gate projections: 1,024 columns for the pooled rows, 256 for the indexer's).
  const int shapes[][3] = {{2048, 576, 576},   {2048, 576, 1536},  {2048, 1536, 576},
                           {2048, 2048, 8192}, {2048, 8192, 2048}, {4096, 4096, 4096},
                           {8192, 4096, 1024}, {8192, 4096, 256}};
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& s : shapes) {
    const int m = s[0], k = s[1], n = s[2];
    std::vector<float> ha(size_t(m) * k), hb(size_t(k) * n);
    for (auto& x : ha) x = nd(rng);
    for (auto& x : hb) x = nd(rng) * 0.05f;
    float *a, *b, *c;
    __nv_bfloat16 *a16, *b16, *c16;
    CHECK_CUDA(cudaMalloc(&a, ha.size() * 4));
    CHECK_CUDA(cudaMalloc(&b, hb.size() * 4));
    CHECK_CUDA(cudaMalloc(&c, size_t(m) * n * 4));
    CHECK_CUDA(cudaMalloc(&a16, ha.size() * 2));
    CHECK_CUDA(cudaMalloc(&b16, hb.size() * 2));
    CHECK_CUDA(cudaMalloc(&c16, size_t(m) * n * 2));
    cudaMemcpy(a, ha.data(), ha.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(b, hb.data(), hb.size() * 4, cudaMemcpyHostToDevice);
    const double flop = 2.0 * m * n * k;
    const float t_ordered = median_ms(
        [&] {
          cudaMemsetAsync(c, 0, size_t(m) * n * 4);
          hetero::cuda::gemm_ordered(a, m, k, b, n, c, nullptr);
        },
        repeat);
    // The FMA path (every product exact, as exact_products_flag finds for bf16 values in range):
    // the flag read on the device is 1.
    int* fma_ok = nullptr;
    CHECK_CUDA(cudaMalloc(&fma_ok, sizeof(int)));
    const int on = 1;
    cudaMemcpy(fma_ok, &on, sizeof(int), cudaMemcpyHostToDevice);
    const float t_ordered_fma = median_ms(
        [&] {
          cudaMemsetAsync(c, 0, size_t(m) * n * 4);
          hetero::cuda::gemm_ordered(a, m, k, b, n, c, nullptr, fma_ok);
        },
        repeat);
    cudaFree(fma_ok);
    const float one = 1.f, zero = 0.f;
    // Row-major C = A B is column-major C^T = B^T A^T.
    const float t_sgemm = median_ms(
        [&] { cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, &one, b, n, a, k, &zero, c, n); },
        repeat);
    const float t_bf16 = median_ms(
        [&] {
          cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, &one, b16, CUDA_R_16BF, n, a16,
                       CUDA_R_16BF, k, &zero, c16, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT);
        },
        repeat);
    std::printf(
        "{\"bench\":\"gpu_gemm\",\"gpu\":\"%s\",\"m\":%d,\"k\":%d,\"n\":%d,\"repeat\":%d,"
        "\"ordered_ms\":%.4f,\"ordered_tflops\":%.2f,\"ordered_fma_ms\":%.4f,"
        "\"ordered_fma_tflops\":%.2f,\"cublas_sgemm_ms\":%.4f,"
        "\"cublas_sgemm_tflops\":%.2f,\"cublas_bf16_ms\":%.4f,\"cublas_bf16_tflops\":%.2f}\n",
        p.name, m, k, n, repeat, t_ordered, flop / t_ordered / 1e9, t_ordered_fma,
        flop / t_ordered_fma / 1e9, t_sgemm, flop / t_sgemm / 1e9, t_bf16, flop / t_bf16 / 1e9);
    for (void* x : {(void*)a, (void*)b, (void*)c, (void*)a16, (void*)b16, (void*)c16}) cudaFree(x);
  }
  fp8_rows(repeat, h, p.name);
  cublasDestroy(h);
  return 0;
}
