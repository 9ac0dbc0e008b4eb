// Internals of the DeepSeek-V4 CUDA engine, shared by its two source files: dsv4_cuda.cc (weights,
// state, admission, the chunk loop) and dsv4_cuda_layers.cc (a layer's attention and MoE). Not
// part of the engine's interface (dsv4_cuda.h).
//
// Every device allocation is a cuda::DeviceBuffer counted against the engine's budget
// (Dsv4CudaOptions::device_memory_budget_bytes); every CUDA call that can fail returns its Status
// through HETERO_CUDA_RETURN_IF_ERROR, so a failure ends the chunk, not the process.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/cuda/dsv4_cuda.h"
#include "kernels/cuda/fp8_gemm.h"
#include "kernels/cuda/resource.h"

namespace hetero {
namespace dsv4_cuda {

inline uint16_t* bf(const cuda::DeviceBuffer& b) { return b.get<uint16_t>(); }
inline float* f32(const cuda::DeviceBuffer& b) { return b.get<float>(); }

constexpr int64_t kDecodeBlock = 8;  // the decoder runs calls of 2..8 tokens token by token

struct DHc {
  cuda::DeviceBuffer fn, base, scale;
};
// `mats` block-scaled FP8 weights [n, k] back to back (kernels/cuda/fp8_gemm.h): e4m3 bytes, then
// each matrix's scales.
struct DFp8 {
  cuda::DeviceBuffer q, scale;
  int64_t mats = 0, n = 0, k = 0;
  int64_t scale_floats() const { return cuda::fp8_blocks(n) * cuda::fp8_weight_scale_ld(k); }
  cuda::Fp8BlockWeight at(int64_t i) const {
    return {q.get<uint8_t>() + i * n * k, f32(scale) + i * scale_floats(), n, k};
  }
  // Quantizes bf16 w [n, k] (device) into matrix i.
  void quantize_one(const uint16_t* w, int64_t i, cudaStream_t st) const {
    cuda::quantize_weight_fp8_block(w, n, k, q.get<uint8_t>() + i * n * k,
                                    f32(scale) + i * scale_floats(), st);
  }
  // Quantizes bf16 w [mats, n, k] (device) into place.
  void quantize(const uint16_t* w, cudaStream_t st) const {
    for (int64_t i = 0; i < mats; ++i) quantize_one(w + i * n * k, i, st);
  }
};
struct DComp {
  int64_t ratio = 0, head_dim = 0, out_dim = 0;
  cuda::DeviceBuffer wkv, wgate, ape, norm;
};
struct DLayer {
  int32_t ratio = 0;
  cuda::DeviceBuffer attn_norm, ffn_norm;
  DHc hc_attn, hc_ffn;
  cuda::DeviceBuffer wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, wo_b_bias, sinks;
  DComp comp, icomp;
  cuda::DeviceBuffer idx_wq_b, idx_wproj;
  cuda::DeviceBuffer gate, gate_bias, tid2eid;
  cuda::DeviceBuffer w13, w2;        // routed experts: [E][2I][H] (gate rows, then up), [E][H][I]
  cuda::DeviceBuffer sh_w13, sh_w2;  // the shared expert, same layout
  DFp8 w13_8, w2_8, sh_w13_8, sh_w2_8;  // the same as FP8 (WeightDtype::kFp8; then no bf16)
};

// PoolingCache(ratio) on the device.
struct DPool {
  int64_t ratio = 0, width = 0, head_dim = 0;
  cuda::DeviceBuffer buf_kv, buf_gate;  // [ratio][width]
  int64_t remainder = 0;
  cuda::DeviceBuffer pooled;  // [rows][head_dim], normed and rope'd
  int64_t rows = 0;
};

struct DState {
  cuda::DeviceBuffer tail;  // the last min(window - 1, seen) rope'd kv rows, in position order
  int64_t tail_rows = 0;
  DPool pool, ipool;
};

// Optional breakdown of device time by phase: an event at each phase start, read back at the end
// of a chunk (which then waits for the device).
struct PhaseTimer {
  bool on = false;
  std::vector<std::string> names;
  std::vector<double> ms;
  std::vector<cuda::Event> events;
  std::vector<int> tags;
  size_t used = 0;

  Status mark(cudaStream_t st, const char* phase);
  Status collect(cudaStream_t st);
};

}  // namespace dsv4_cuda

struct Dsv4CudaEngine::Impl {
  // First: the buffers below give their bytes back to it when they are freed.
  cuda::DeviceMemoryBudget budget;
  cuda::Stream stream;
  cuda::BlasHandle blas;
  dsv4_cuda::PhaseTimer timer;
  cuda::DeviceBuffer embed, local_freqs, compress_freqs;
  int64_t rope_pairs = 0;
  std::vector<dsv4_cuda::DLayer> layers;
  std::vector<dsv4_cuda::DState> state;
  // Scratch, sized by the largest chunk (cap tokens).
  int64_t cap = 0;
  cuda::DeviceBuffer ids, h, x, y, mix, qr, q, attn, kv, mid, ckv, cgate, ikv, igate, iq, iw, lk,
      stage_kv, stage_gate, topk, rep, has_prev;
  cuda::DeviceBuffer logits, inds, weights, counts, offsets, perm, slot_row, xe, gu, act, ye, sgu,
      sact, sh;
  cuda::PinnedBuffer host_offsets;  // int32 [E + 1]
  bool grouped = false;             // routed experts through one grouped GEMM call
  cuda::PinnedBuffer host_ptrs;     // const void* [2][3][E]: weight, input, output per group
  cuda::DeviceBuffer dev_ptrs;      // its device copy
  int grouped_slot = 0;
  bool online_only = false;  // Dsv4CudaOptions::online_softmax_attention
  std::vector<uint16_t> host_x;
  // FP8 experts (Dsv4CudaOptions::weight_dtype): the GEMM plans and the quantized inputs.
  bool fp8 = false;
  std::unique_ptr<cuda::Fp8Gemm> fp8_gemm;
  cuda::DeviceBuffer act_q, act_scale;
  cuda::PinnedBuffer host_pad;  // int32 [E + 1]: each expert's first row in act_q, padded
  cuda::DeviceBuffer pad;       // its device copy
  // Routed experts over side streams (Dsv4CudaOptions::expert_streams), forked from and joined
  // back into the compute stream by events: each lane its own cuBLAS handle and FP8 plans, and
  // (FP8) a buffer for its last expert's output, whose padding rows would otherwise land on the
  // next lane's first expert.
  struct Lane {
    cuda::Stream stream;
    cuda::BlasHandle blas;
    std::unique_ptr<cuda::Fp8Gemm> fp8;
    cuda::Event done;
    cuda::DeviceBuffer spill;
  };
  std::vector<Lane> lanes;
  cuda::Event fork;

  explicit Impl(int64_t budget_bytes) : budget(budget_bytes) {}
  ~Impl();
  // Frees b (once the device has finished every queued read of it), then takes `bytes` from the
  // budget; contents are not kept.
  Status alloc(cuda::DeviceBuffer& b, size_t bytes, const char* what);
  // alloc() when b holds less than `bytes`, growing by half again at least (within the budget:
  // else exactly `bytes`).
  Status ensure(cuda::DeviceBuffer& b, size_t bytes, const char* what);
};

namespace dsv4_cuda {

using Impl = Dsv4CudaEngine::Impl;

// y [m, n] (row stride ldo) = x [m, k] (row stride ldx) @ w^T, w [n, k] row-major; bf16 in and
// out, float32 accumulation. beta = 1 adds the bf16 values already in y inside the float32 sum.
Status gemm(cublasHandle_t h, const uint16_t* x, int64_t m, int64_t k, const uint16_t* w, int64_t n,
            uint16_t* y, int64_t ldx = -1, int64_t ldo = -1, float beta = 0.0f);
// Room for `rows` pooled rows in p, keeping the ones there.
Status reserve_rows(Impl& m, DPool& p, int64_t rows, cudaStream_t st);
// The attention of layer l for n rows of m.x at pos0 into m.y [n, hidden].
Status attention(Impl& m, const Dsv4Config& c, int64_t l, int64_t n, int64_t pos0);
// The MoE of layer l on m.x [n, hidden] into m.y.
Status moe(Impl& m, const Dsv4Config& c, int64_t l, int64_t n);

}  // namespace dsv4_cuda
}  // namespace hetero
