// Internals of the llama-family CUDA engine, shared by its source files: llama_cuda.cc (weights,
// the fast forward, logits), llama_cuda_memory.cc (admission, activations, the paged cache) and
// llama_cuda_exact.cc (the exact path: the decoder's arithmetic, its cache and state). Not part of
// the engine's interface (llama_cuda.h).
#pragma once

#include <cstdint>
#include <vector>

#include "engine/cuda/llama_cuda.h"

namespace hetero::cuda {

// A projection weight [n, k]: bf16 or block-scaled FP8, as options().weight_dtype says.
struct LlamaCudaEngine::Proj {
  const uint16_t* bf16 = nullptr;
  Fp8BlockWeight fp8;
  int64_t n = 0, k = 0;
};

struct LlamaCudaEngine::Layer {
  const uint16_t* in_norm = nullptr;
  const uint16_t* post_norm = nullptr;
  Proj wqkv;     // [qd + 2 kvd, hidden]
  Proj wo;       // [hidden, qd]
  Proj gate_up;  // [2 inter, hidden]
  Proj down;     // [hidden, inter]
  QkvBiasNorm extra;
};

// The cache: for every layer a table of page references, pages carved from slabs that grow
// geometrically and are kept across sequences.
struct LlamaCudaEngine::Pages {
  size_t kv_bytes = 0, scale_bytes = 0;      // per page, per kind (k or v)
  int64_t pages = 0;                         // pages per layer
  size_t slab_bytes = 0;                     // all slabs, all layers
  std::vector<DeviceBuffer> slabs;           // every layer's, in growth order (cuDNN: [layer])
  std::vector<std::vector<KvPageRef>> host;  // [layer][page]
  std::vector<DeviceBuffer> table;           // [layer] device copies of host[layer]
  int64_t table_capacity = 0;
};

// The exact path's state: float32 transposed weights ([in, out], as gemm_ordered takes them),
// the cache as the CPU engine keeps it (token-major bf16 rows per layer), and scratch.
struct LlamaCudaEngine::Exact {
  struct Layer {
    const float *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr, *gate = nullptr,
                *up = nullptr, *down = nullptr;
  };
  std::vector<Layer> layers;
  std::vector<DeviceBuffer> owned;  // the weights above
  std::vector<DeviceBuffer> kv;     // [layer][2]: k then v, each [capacity][kv_heads * head_dim]
  int64_t capacity = 0;
  DeviceBuffer xf, acc, scratch, k, v, gate, up;
  int64_t rows = 0;
};

}  // namespace hetero::cuda
