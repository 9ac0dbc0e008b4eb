// Internals of the DeepSeek-V4 CUDA engine, shared by its source files: dsv4_cuda.cc (creation,
// options, what it reports), dsv4_cuda_weights.cc (the weights' forms and how they get there),
// dsv4_cuda_forward.cc (a sequence: reset, admission, scratch, the chunk loop),
// dsv4_cuda_layers.cc (a layer's attention and MoE) and dsv4_cuda_checkpoint.cc (a sequence's
// state saved and restored). Not part of the engine's interface (dsv4_cuda.h).
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
#include "engine/cuda/tap_readers.h"
#include "kernels/cuda/checkpoint_formats.h"
#include "kernels/cuda/fp8_gemm.h"
#include "kernels/cuda/fp8_grouped_gemm.h"
#include "kernels/cuda/resource.h"
#include "kernels/cuda/w4a8_grouped_gemm.h"
#include "model/dsv4_calls.h"

namespace hetero {
namespace dsv4_cuda {

inline uint16_t* bf(const cuda::DeviceBuffer& b) { return b.get<uint16_t>(); }
inline float* f32(const cuda::DeviceBuffer& b) { return b.get<float>(); }

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
// `mats` FP4 weights [n, k] back to back as the official checkpoint stores routed experts
// (kernels/cuda/checkpoint_formats.h): packed e2m1 codes, then each matrix's UE8M0 scales.
struct DFp4 {
  cuda::DeviceBuffer codes, scale;
  cuda::DeviceBuffer block_max;  // where the W4A8 kernel may run them (cuda::fp4_block_max)
  int64_t mats = 0, n = 0, k = 0;
  cuda::Fp4Experts experts() const { return {at(0), block_max.get<uint8_t>(), mats}; }
  cuda::Fp4GroupWeight at(int64_t i) const {
    return {codes.get<uint8_t>() + i * cuda::Fp4GroupWeight::code_bytes(n, k),
            scale.get<uint8_t>() + i * cuda::Fp4GroupWeight::scale_bytes(n, k), n, k};
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
  // WeightDtype::kCheckpoint: the projections the official checkpoint stores as FP8 (then no
  // bf16 copy; wo_a is dequantized to bf16, the grouped einsum's operand) and the routed experts
  // as FP4.
  DFp8 wq_a_8, wq_b_8, wkv_8, wo_b_8, idx_wq_b_8;
  DFp4 w13_4, w2_4;
};

// How a weight is drawn for random weights.
enum class Init { kMatrix, kNorm, kSmall, kHcScale, kSink, kExpertId };
// What a weight lives on the device as.
enum class Form { kBf16OrF32, kFp8, kFp4 };

// One weight buffer of a layer: its size and draw, where the checkpoint keeps it (names: the
// official tensors, without ".weight", laid back to back in this order), and its quantized forms
// (a matrix of rows x cols, `count` / (rows * cols) of them).
struct Spec {
  cuda::DeviceBuffer* buf = nullptr;
  int64_t count = 0;
  int elem_bytes = 2;
  Init init = Init::kMatrix;
  int64_t fan_in = 0;
  std::vector<std::string> names;
  DFp8* fp8 =
      nullptr;  // FP8 form: the experts' under kFp8, the official FP8 ones' under kCheckpoint
  DFp4* fp4 = nullptr;  // FP4 form under kCheckpoint (routed experts)
  int64_t rows = 0, cols = 0;
  bool expert = false;      // requantized to FP8 under kFp8
  bool fp8_stored = false;  // the official checkpoint stores it as FP8 (wo_a: then dequantized)
};
std::vector<Spec> layer_specs(DLayer& L, const Dsv4Config& c, int64_t layer);
Form form_of(const Spec& s, cuda::WeightDtype dtype);

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
  std::vector<dsv4_cuda::DLayer> layers;  // all the model's; weights only in [first, end)
  int64_t first = 0, end = 0;             // the layers this engine holds (a pipeline stage)
  std::vector<dsv4_cuda::DState> state;
  Dsv4Calls calls;  // the decoder's schedule for this sequence (set_decoder_calls)
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
  cuda::TapReaders x_readers;  // the tap's readers of x on their own streams
  // FP8 experts (Dsv4CudaOptions::weight_dtype): the GEMM plans and the quantized inputs.
  bool fp8 = false;
  std::unique_ptr<cuda::Fp8Gemm> fp8_gemm;
  // The grouped kernel (Dsv4CudaOptions::expert_gemm) where made, the transposed weight scales it
  // reads (one projection's experts) and the groups of a launch; grouped_max_rows: the largest
  // mean rows per active expert it takes (larger chunks run per expert; INT64_MAX: always).
  std::unique_ptr<cuda::Fp8GroupedGemm> grouped_fp8;
  int64_t grouped_max_rows = 0;
  int64_t grouped_launches = 0;  // since the engine was made
  cuda::DeviceBuffer scale_t;
  std::vector<cuda::Fp8GemmGroup> fp8_groups;
  // FP4 experts per chunk through the W4A8 kernel (ExpertGemm::kW4a8: every chunk; kAuto: chunks
  // of at most w4a8_max_rows rows an expert), where made.
  std::unique_ptr<cuda::W4a8GroupedGemm> w4a8;
  int64_t w4a8_max_rows = 0;  // chunks whose active experts average at most this many rows
  int64_t w4a8_launches = 0;
  std::vector<cuda::W4a8Group> w4a8_groups;
  bool ckpt = false;  // WeightDtype::kCheckpoint: FP8 projections, FP4 experts widened per expert
  // The layer's active FP4 experts widened to FP8 (one projection at a time: [E] matrices of the
  // larger shape), the active experts' ids (host and device), and the count of groups whose
  // widening was not exact (device, unsigned long long). With widen_experts_at_load only the
  // counter: each layer holds its experts widened (DLayer::w13_8, w2_8).
  cuda::DeviceBuffer wide_q, wide_scale, active, lossy;
  cuda::PinnedBuffer host_active;  // int32 [E]
  int64_t active_count = 0;
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
  // Recorded after the MoE's row counts are copied to the host: the host waits for it, not for
  // the stream, so the shared expert queued behind it keeps the GPU busy while the host sets up
  // the routed experts' launches.
  cuda::Event counts_ready;

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
// Host bytes into a buffer sized for exactly them (from the config): a weight of another size,
// a checkpoint disagreeing with its own config, is refused.
Status put(cuda::DeviceBuffer& b, const void* src, size_t bytes);
Status put(cuda::DeviceBuffer& b, const std::vector<float>& v);
// y = x [m, k] @ W^T with W [n, k]: the FP8 form's GEMM when w8 holds one (y then holds
// fp8_act_rows(m) rows), else the bf16 buffer's.
Status proj(Impl& m, const uint16_t* x, int64_t rows, int64_t k, const cuda::DeviceBuffer& w,
            const DFp8& w8, int64_t n, uint16_t* y);
// Room for `rows` pooled rows in p, keeping the ones there.
Status reserve_rows(Impl& m, DPool& p, int64_t rows, cudaStream_t st);
// The attention of layer l for n rows of m.x at pos0 into m.y [n, hidden].
Status attention(Impl& m, const Dsv4Config& c, int64_t l, int64_t n, int64_t pos0);
// The MoE of layer l on m.x [n, hidden] into m.y.
Status moe(Impl& m, const Dsv4Config& c, int64_t l, int64_t n);

}  // namespace dsv4_cuda
}  // namespace hetero
