// Causal GQA attention over the fast llama engine's paged bf16 cache: the engine's own flash
// kernel (fast_ops.h, mma.sync) against cuDNN's fused SDPA reading the same pages in place
// (cudnn_attention.h), in the same run on the same GPU, at the shapes a long prefill runs.
//
// One run = a T-token prompt's attention in --chunk sized chunks, as the engine calls it (chunk i
// attends over rows [0, (i+1)*chunk)); --chunk 0 is one chunk of T rows (the shape libraries
// quote). cuDNN runs twice: over the pages (as the engine calls it) and over the same bytes as
// its dense token-major layout, which prices the paging. FLOPs counted: the
// useful work, 4 * heads * head_dim per (query, visible key) pair. Median and spread of --repeat
// runs after one warm-up (CUDA events). Each row also carries the relative RMS difference
// between the two kernels' outputs on the last chunk, a sanity check (the GPU tests hold the
// bounds). JSON lines on stdout, a table on stderr.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_common.h"
#include "kernels/cuda/cudnn_attention.h"
#include "kernels/cuda/fast_ops.h"
#include "kernels/cuda/resource.h"

namespace hetero {
namespace {

using bench::Draw;

#define CHECK_OK(expr)                                                                \
  do {                                                                                \
    const Status st_ = (expr);                                                        \
    if (!st_.is_ok()) {                                                               \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, st_.message().c_str()); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

struct Args {
  std::vector<int64_t> tokens = {8192, 32768, 131072};
  std::vector<int> dims = {64, 128};
  int heads = 32, kv_heads = 8, repeat = 5;
  std::vector<int64_t> chunks = {8192, 0};  // 0: the whole prompt in one call
  std::string rev = "unknown";
};

std::vector<int64_t> ints(const char* s) {
  std::vector<int64_t> out;
  for (const char* p = s; *p;) {
    char* end = nullptr;
    out.push_back(std::strtoll(p, &end, 10));
    p = *end == ',' ? end + 1 : end;
    if (end == p && *p) break;
  }
  return out;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const char* v = argv[i + 1];
    if (k == "--t")
      a.tokens = ints(v);
    else if (k == "--d") {
      a.dims.clear();
      for (int64_t d : ints(v)) a.dims.push_back(int(d));
    } else if (k == "--heads")
      a.heads = std::atoi(v);
    else if (k == "--kv-heads")
      a.kv_heads = std::atoi(v);
    else if (k == "--chunk")
      a.chunks = ints(v);
    else if (k == "--repeat")
      a.repeat = std::atoi(v);
    else if (k == "--rev")
      a.rev = v;
    else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      std::exit(2);
    }
  }
  return a;
}

// Useful FLOPs of T rows of causal attention in chunks: every query sees its own position and
// the ones before it.
double attention_flops(int64_t T, int heads, int d) {
  return 4.0 * heads * d * (static_cast<double>(T) * (T + 1) / 2);
}

void run_shape(const Args& a, int64_t T, int64_t chunk_arg, int d, cudaStream_t st) {
  const int H = a.heads, Hk = a.kv_heads;
  const int64_t chunk = chunk_arg > 0 ? std::min(chunk_arg, T) : T;
  const int64_t pages = (T + cuda::kKvPageTokens - 1) / cuda::kKvPageTokens;
  const size_t block =
      static_cast<size_t>(Hk) * cuda::kKvPageTokens * d;  // elements per K or V block
  // One slab: page i = [K block | V block], as the engine lays out a bf16 cache for cuDNN.
  cuda::DeviceBuffer slab, table, q, out_own, out_cudnn;
  CHECK_OK(slab.allocate(static_cast<size_t>(pages) * 2 * block * 2, "cache"));
  CHECK_OK(q.allocate(static_cast<size_t>(chunk) * H * d * 2, "q"));
  CHECK_OK(out_own.allocate(static_cast<size_t>(chunk) * H * d * 2, "out"));
  CHECK_OK(out_cudnn.allocate(static_cast<size_t>(chunk) * H * d * 2, "out"));
  {
    Draw g{0x9e3779b97f4a7c15ull + static_cast<uint64_t>(T * 131 + d)};
    std::vector<uint16_t> host(static_cast<size_t>(pages) * 2 * block);
    for (auto& x : host) x = f32_to_bf16(g.next(1.f));
    CHECK_OK(cuda::call_status(
        cudaMemcpy(slab.get(), host.data(), host.size() * 2, cudaMemcpyHostToDevice), "copy",
        __FILE__, __LINE__));
    std::vector<uint16_t> hq(static_cast<size_t>(chunk) * H * d);
    for (auto& x : hq) x = f32_to_bf16(g.next(1.f));
    CHECK_OK(
        cuda::call_status(cudaMemcpy(q.get(), hq.data(), hq.size() * 2, cudaMemcpyHostToDevice),
                          "copy", __FILE__, __LINE__));
  }
  std::vector<cuda::KvPageRef> refs(static_cast<size_t>(pages));
  for (int64_t i = 0; i < pages; ++i) {
    uint16_t* pg = slab.get<uint16_t>() + static_cast<size_t>(i) * 2 * block;
    refs[static_cast<size_t>(i)].k = pg;
    refs[static_cast<size_t>(i)].v = pg + block;
  }
  CHECK_OK(table.allocate(refs.size() * sizeof(cuda::KvPageRef), "table"));
  CHECK_OK(cuda::call_status(
      cudaMemcpy(table.get(), refs.data(), refs.size() * sizeof(refs[0]), cudaMemcpyHostToDevice),
      "copy", __FILE__, __LINE__));
  const cuda::PagedKvView view{table.get<cuda::KvPageRef>(), cuda::KvDtype::kBf16, Hk, d};
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  auto cudnn = cuda::CudnnAttention::create(H, Hk, d, scale, 0);
  const cuda::CudnnPagedKv ckv{slab.get(), slab.get<uint16_t>() + block,
                               static_cast<int64_t>(2 * block), pages};

  // The same memory read as cuDNN's dense layout (K rows then V rows, token-major): what paging
  // costs cuDNN. Its values differ from the paged view's, so only its time is reported.
  const cuda::CudnnPagedKv dense{
      slab.get(), slab.get<uint16_t>() + static_cast<size_t>(pages) * block, 0, pages, true};
  enum Kernel { kOwn, kPaged, kDense };
  auto time_runs = [&](Kernel kernel) {
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    std::vector<double> ms;
    for (int r = 0; r < a.repeat + 1; ++r) {
      cudaEventRecord(e0, st);
      for (int64_t pos0 = 0; pos0 < T; pos0 += chunk) {
        const int64_t n = std::min(chunk, T - pos0);
        if (kernel != kOwn) {
          CHECK_OK(cudnn.value()->begin_chunk(n, pos0, pages, st));
          CHECK_OK(cudnn.value()->run(
              q.get<uint16_t>(), kernel == kPaged ? ckv : dense,
              kernel == kPaged ? out_cudnn.get<uint16_t>() : out_own.get<uint16_t>(), st));
        } else {
          cuda::attention_paged(q.get<uint16_t>(), n, H, pos0, scale, view, out_own.get<uint16_t>(),
                                st);
        }
      }
      cudaEventRecord(e1, st);
      CHECK_OK(cuda::call_status(cudaEventSynchronize(e1), "sync", __FILE__, __LINE__));
      float t = 0;
      cudaEventElapsedTime(&t, e0, e1);
      if (r > 0) ms.push_back(t);  // the first builds cuDNN's graphs
    }
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    return bench::spread(ms);
  };
  const double flops = attention_flops(T, H, d);
  bench::Spread lib{}, lib_dense{};
  double rel_rms = -1;
  std::string lib_name = cudnn.is_ok() ? cudnn.value()->name() : cudnn.status().message();
  if (cudnn.is_ok()) lib_dense = time_runs(kDense);
  const bench::Spread own = time_runs(kOwn);
  if (cudnn.is_ok()) {
    lib = time_runs(kPaged);
    // Both kernels last ran the same final chunk: compare their outputs.
    const int64_t n_last = T - ((T - 1) / chunk) * chunk;
    std::vector<uint16_t> x(static_cast<size_t>(n_last) * H * d), y(x.size());
    cudaMemcpy(x.data(), out_own.get(), x.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(y.data(), out_cudnn.get(), y.size() * 2, cudaMemcpyDeviceToHost);
    double num = 0, den = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      const double u = bf16_to_f32(x[i]), v = bf16_to_f32(y[i]);
      num += (u - v) * (u - v), den += u * u;
    }
    rel_rms = std::sqrt(num / std::max(den, 1e-30));
  }
  const double own_tf = flops / (own.median * 1e-3) / 1e12;
  const double lib_tf = cudnn.is_ok() ? flops / (lib.median * 1e-3) / 1e12 : 0;
  const double dense_tf = cudnn.is_ok() ? flops / (lib_dense.median * 1e-3) / 1e12 : 0;
  std::printf(
      "{\"bench\":\"attention\",\"gpu\":\"%s\",\"rev\":\"%s\",\"T\":%lld,\"chunk\":%lld,"
      "\"head_dim\":%d,\"heads\":%d,\"kv_heads\":%d,\"repeat\":%d,"
      "\"own_ms\":%.3f,\"own_ms_min\":%.3f,\"own_ms_max\":%.3f,\"own_tflops\":%.1f,"
      "\"cudnn_ms\":%.3f,\"cudnn_ms_min\":%.3f,\"cudnn_ms_max\":%.3f,\"cudnn_tflops\":%.1f,"
      "\"cudnn_dense_ms\":%.3f,\"cudnn_dense_tflops\":%.1f,"
      "\"own_over_cudnn\":%.3f,\"rel_rms\":%.2e,\"cudnn\":\"%s\"}\n",
      bench::gpu_name().c_str(), a.rev.c_str(), static_cast<long long>(T),
      static_cast<long long>(chunk), d, H, Hk, a.repeat, own.median, own.min, own.max, own_tf,
      lib.median, lib.min, lib.max, lib_tf, lib_dense.median, dense_tf,
      lib_tf > 0 ? own_tf / lib_tf : 0.0, rel_rms, lib_name.c_str());
  std::fprintf(stderr,
               "%8lld %6lld %4d | own %9.2f ms %6.1f TF/s | cuDNN paged %9.2f ms %6.1f TF/s"
               " | dense %6.1f TF/s | own/cuDNN %.2f | rel rms %.1e\n",
               static_cast<long long>(T), static_cast<long long>(chunk), d, own.median, own_tf,
               lib.median, lib_tf, dense_tf, lib_tf > 0 ? own_tf / lib_tf : 0.0, rel_rms);
  std::fflush(stdout);
}

}  // namespace
}  // namespace hetero

int main(int argc, char** argv) {
  using namespace hetero;
  const Args a = parse(argc, argv);
  auto rt = cuda::cudnn_attention_runtime();
  std::fprintf(stderr, "%s; cuDNN: %s\n", bench::gpu_name().c_str(),
               rt.is_ok() ? rt.value().c_str() : rt.status().message().c_str());
  cudaStream_t st;
  cudaStreamCreate(&st);
  std::fprintf(stderr, "       T  chunk    d |\n");
  for (int d : a.dims)
    for (int64_t chunk : a.chunks)
      for (int64_t T : a.tokens) run_shape(a, T, chunk, d, st);
  cudaStreamDestroy(st);
  return 0;
}
