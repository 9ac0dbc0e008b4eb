// CUDA kernels of the GPU prefill engine (engine/cuda/llama_cuda.h): the fast path, not the
// decoder's arithmetic. Activations are bf16 with the reference implementation's rounding points
// (every op's output rounded to bf16), but sums run in the order that is fastest here (tensor-core
// GEMMs through cuBLAS, warp reductions, a flash-attention loop). The engine's results therefore
// agree with the CPU engine within a tolerance, not bit for bit; the cache programs
// (kernels/cuda/ops.h) are the exact part.
// All pointers are device pointers; every op is enqueued on `stream` and returns at once.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/ops.h"

namespace hetero::cuda {

// The engine's KV cache: pages of kKvPageTokens rows, each page one block per kind holding
// [kv_heads][kKvPageTokens][head_dim] elements, bf16 or FP8 e4m3. FP8 rows carry one float32
// scale per (token, kv head): value = e4m3 * scale, scale = amax(row) / 448.
constexpr int kKvPageTokens = 64;
enum class KvDtype { kBf16, kFp8 };

// Where one logical page of one layer lives.
struct KvPageRef {
  void* k = nullptr;
  void* v = nullptr;
  float* k_scale = nullptr;  // [kv_heads][kKvPageTokens], FP8 only
  float* v_scale = nullptr;
};

// One layer's view of a sequence's cache: pages[i] holds positions [i*64, i*64+64).
// token_major (bf16 only): a page's blocks hold [kKvPageTokens][kv_heads][head_dim] instead, so
// that consecutive pages form cuDNN's dense [rows][kv_heads][head_dim] layout; qkv_rope_store
// writes it, attention_paged does not read it (cudnn_attention.h does).
struct PagedKvView {
  const KvPageRef* pages = nullptr;  // device array
  KvDtype dtype = KvDtype::kFp8;
  int kv_heads = 0, head_dim = 0;
  bool token_major = false;
};

// out[t] = table[ids[t]] rows of width hidden.
void embed_rows(const uint16_t* table, const int32_t* ids, int64_t n, int64_t hidden, uint16_t* out,
                cudaStream_t stream);

// out = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * w) per row of x [m, d].
void rms_norm_rows(const uint16_t* x, int64_t m, int64_t d, const uint16_t* w, float eps,
                   uint16_t* out, cudaStream_t stream);
// h = bf16(h + delta), then out = rms_norm_rows(h) — the residual add and the next norm in one
// pass. w may be null: then only the add.
void add_rms_norm_rows(uint16_t* h, const uint16_t* delta, int64_t m, int64_t d, const uint16_t* w,
                       float eps, uint16_t* out, cudaStream_t stream);

// From the fused projection qkv [n][heads*d + 2*kv_heads*d] (q | k | v): adds the biases (when
// given), applies the per-head q/k RMSNorm (when given), rotates q and k (rotate-half RoPE,
// the RopeTable, rows at positions pos0..), writes q [n][heads][d] and stores k and v into the
// paged cache at their positions (quantizing to FP8 where the cache is FP8).
struct QkvBiasNorm {
  const uint16_t* bq = nullptr;
  const uint16_t* bk = nullptr;
  const uint16_t* bv = nullptr;
  const uint16_t* q_norm = nullptr;
  const uint16_t* k_norm = nullptr;
  float eps = 1e-6f;
};
void qkv_rope_store(const uint16_t* qkv, int64_t n, int heads, int64_t pos0, const RopeTable& rope,
                    const QkvBiasNorm& extra, uint16_t* q, const PagedKvView& kv,
                    cudaStream_t stream);

// out [n][inter] = silu(gate) * up with gate_up [n][2*inter] (gate | up), bf16 rounding after
// silu as the reference does.
void silu_mul_halves(const uint16_t* gate_up, int64_t n, int64_t inter, uint16_t* out,
                     cudaStream_t stream);

// Causal GQA attention of the chunk's queries q [n][heads][d] (positions pos0..pos0+n-1) over
// the cache's rows [0, pos0+n), or with window > 0 over the rows (p - window, p] of each query p;
// out [n][heads][d]. head_dim 64 or 128. Tensor cores (mma.sync bf16, f32 accumulation), online
// softmax in f32.
void attention_paged(const uint16_t* q, int64_t n, int heads, int64_t pos0, float scale,
                     const PagedKvView& kv, uint16_t* out, cudaStream_t stream, int64_t window = 0);

// Whether attention_paged supports this head dim.
bool attention_paged_supports(int head_dim);

// dst[i] = i for i < n; dst[0] = a, dst[1] = b (lengths and page tables for library kernels,
// enqueued so that the host may reuse its values at once).
void iota_i32(int32_t* dst, int64_t n, cudaStream_t stream);
void set_i32_pair(int32_t* dst, int32_t a, int32_t b, cudaStream_t stream);

}  // namespace hetero::cuda
