// Causal GQA attention of the fast llama engine through cuDNN's fused flash attention (SDPA, its
// graph frontend), over the engine's own bf16 KV cache, read in place: the engine keeps it
// token-major in one slab per layer (cuDNN's dense layout), or cuDNN reads it as pages (paged K
// and V containers with a page table; half the speed: docs/findings/cudnn-attention-layout.md,
// kept for the benchmark that prices it).
//
// Optional: built where cuDNN's headers, its library and the frontend's headers were found
// (HETERO_HAVE_CUDNN; `make` fetches the frontend's headers from PyPI); elsewhere every entry
// point says so (kUnavailable) and the engine keeps its own kernel (fast_ops.h). What cuDNN
// computes is the same function in another summation order: the fast path's tolerance against
// the CPU engine holds (tests/gpu/llama_cuda_test.cc checks both kernels against it).
//
// One object serves one engine (one device, one stream at a time). Graphs are built per (query
// rows, cache pages) on first use and kept: a chunk size and a cache size seen once cost one build.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"

namespace hetero::cuda {

// Whether this build has cuDNN attention (it then needs cuDNN on the machine to run it).
bool cudnn_attention_built();
// Whether this build has cuDNN attention, and the runtime's version ("cuDNN 9.19.0"), or why not.
Result<std::string> cudnn_attention_runtime();

// One layer's cache as cuDNN sees it: `pages` pages, page i's K block at k + i * page_stride and
// its V block at v + i * page_stride (elements), each block [kv_heads][64][head_dim] bf16.
// token_major: no pages but rows, k and v each [pages * 64][kv_heads][head_dim] (page_stride
// unused), cuDNN's dense layout; the benchmark measures what paging costs with it.
struct CudnnPagedKv {
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t page_stride = 0;  // elements
  int64_t pages = 0;
  bool token_major = false;
};

class CudnnAttention {
 public:
  // kUnavailable where the build or the machine has no cuDNN (the message says which);
  // kFailedPrecondition where cuDNN refuses the shape.
  static Result<std::unique_ptr<CudnnAttention>> create(int heads, int kv_heads, int head_dim,
                                                        float scale, int device);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // Sets the chunk's lengths once for all its layers: n query rows at positions pos0.., over the
  // cache's rows [0, pos0 + n). Enqueued on `stream`.
  Status begin_chunk(int64_t n, int64_t pos0, int64_t pages, cudaStream_t stream);
  // out [n][heads][d] = causal attention of q [n][heads][d] over one layer's cache, on `stream`.
  Status run(const uint16_t* q, const CudnnPagedKv& kv, uint16_t* out, cudaStream_t stream);

  // "cuDNN 9.19.0 SDPA (bf16 cache)": for logs, benches and the engine's description.
  const std::string& name() const;

 private:
  struct Impl;
  explicit CudnnAttention(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace hetero::cuda
