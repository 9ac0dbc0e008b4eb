// GPU GEMM throughput: the decoder-order GEMM (bit-exact, kernels/cuda/ops.h) against cuBLAS
// SGEMM (float32, its own order) and cuBLAS bf16 GEMM (tensor cores), on the shapes a llama
// prefill runs. Median of --repeat timed runs after warm-up, CUDA events; JSON lines to stdout.
// Exactness of the ordered GEMM is tested by hetero_gpu_tests, not here.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

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
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < 2; ++i) f();  // warm-up
  std::vector<float> ms;
  for (int i = 0; i < repeat; ++i) {
    cudaEventRecord(a);
    f();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float t;
    cudaEventElapsedTime(&t, a, b);
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
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
  // (M, K, N): a 2048-token chunk through SmolLM2-135M's projections, a ~1B llama's, and a square.
  const int shapes[][3] = {{2048, 576, 576},   {2048, 576, 1536},  {2048, 1536, 576},
                           {2048, 2048, 8192}, {2048, 8192, 2048}, {4096, 4096, 4096}};
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
        "\"ordered_ms\":%.4f,\"ordered_tflops\":%.2f,\"cublas_sgemm_ms\":%.4f,"
        "\"cublas_sgemm_tflops\":%.2f,\"cublas_bf16_ms\":%.4f,\"cublas_bf16_tflops\":%.2f}\n",
        p.name, m, k, n, repeat, t_ordered, flop / t_ordered / 1e9, t_sgemm, flop / t_sgemm / 1e9,
        t_bf16, flop / t_bf16 / 1e9);
    for (void* x : {(void*)a, (void*)b, (void*)c, (void*)a16, (void*)b16, (void*)c16}) cudaFree(x);
  }
  cublasDestroy(h);
  return 0;
}
