// The DeepSeek-V4 forward on CUDA. See dsv4_cuda.h for the contract; the CPU engine
// (engine/dsv4_cpu.cc) is the reference for every step, and the comments here say where this
// one computes the same thing differently.
#include "engine/cuda/dsv4_cuda.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/bf16.h"
#include "kernels/cuda/dsv4_fwd_ops.h"
#include "kernels/cuda/dsv4_ops.h"

namespace hetero {
namespace {

#define HETERO_CUDA_OK(expr)                                                                      \
  do {                                                                                            \
    const cudaError_t e_ = (expr);                                                                \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::abort();                                                                               \
    }                                                                                             \
  } while (0)
#define HETERO_CUBLAS_OK(expr)                                                         \
  do {                                                                                 \
    const cublasStatus_t s_ = (expr);                                                  \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                 \
      std::fprintf(stderr, "%s:%d: %s: cuBLAS status %d\n", __FILE__, __LINE__, #expr, \
                   static_cast<int>(s_));                                              \
      std::abort();                                                                    \
    }                                                                                  \
  } while (0)

constexpr int64_t kDecodeBlock = 8;  // the decoder runs calls of 2..8 tokens token by token

// A device allocation; contents are not kept when it grows.
struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  DevBuf() = default;
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  DevBuf(DevBuf&& o) noexcept : p(o.p), bytes(o.bytes) { o.p = nullptr, o.bytes = 0; }
  DevBuf& operator=(DevBuf&& o) noexcept {
    std::swap(p, o.p), std::swap(bytes, o.bytes);
    return *this;
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  void alloc(size_t b) {
    if (p) {
      // Work still queued may read the old allocation.
      HETERO_CUDA_OK(cudaDeviceSynchronize());
      HETERO_CUDA_OK(cudaFree(p));
    }
    p = nullptr, bytes = 0;
    if (b == 0) return;
    HETERO_CUDA_OK(cudaMalloc(&p, b));
    bytes = b;
  }
  // Grows (by half again at least) without keeping the contents.
  void ensure(size_t b) {
    if (b > bytes) alloc(std::max(b, bytes + bytes / 2));
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
  uint16_t* bf() const { return as<uint16_t>(); }
  float* f32() const { return as<float>(); }
  explicit operator bool() const { return p != nullptr; }
};

// y [m, n] (row stride ldo) = x [m, k] (row stride ldx) @ w^T, w [n, k] row-major; bf16 in and
// out, float32 accumulation. beta = 1 adds the bf16 values already in y inside the float32 sum.
void gemm(cublasHandle_t h, const uint16_t* x, int64_t m, int64_t k, const uint16_t* w, int64_t n,
          uint16_t* y, int64_t ldx = -1, int64_t ldo = -1, float beta = 0.0f) {
  if (m == 0 || n == 0) return;
  const float alpha = 1.0f;
  HETERO_CUBLAS_OK(
      cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                   static_cast<int>(k), &alpha, w, CUDA_R_16BF, static_cast<int>(k), x, CUDA_R_16BF,
                   static_cast<int>(ldx < 0 ? k : ldx), &beta, y, CUDA_R_16BF,
                   static_cast<int>(ldo < 0 ? n : ldo), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

struct DHc {
  DevBuf fn, base, scale;
};
// `mats` block-scaled FP8 weights [n, k] back to back (kernels/cuda/fp8_gemm.h): e4m3 bytes, then
// each matrix's scales.
struct DFp8 {
  DevBuf q, scale;
  int64_t mats = 0, n = 0, k = 0;
  int64_t scale_floats() const { return cuda::fp8_blocks(n) * cuda::fp8_weight_scale_ld(k); }
  void alloc(int64_t count, int64_t rows, int64_t cols) {
    n = rows, k = cols, mats = count / (rows * cols);
    q.alloc(static_cast<size_t>(count));
    scale.alloc(static_cast<size_t>(mats * scale_floats()) * 4);
  }
  cuda::Fp8BlockWeight at(int64_t i) const {
    return {q.as<uint8_t>() + i * n * k, scale.f32() + i * scale_floats(), n, k};
  }
  // Quantizes bf16 w [n, k] (device) into matrix i.
  void quantize_one(const uint16_t* w, int64_t i, cudaStream_t st) const {
    cuda::quantize_weight_fp8_block(w, n, k, q.as<uint8_t>() + i * n * k,
                                    scale.f32() + i * scale_floats(), st);
  }
  // Quantizes bf16 w [mats, n, k] (device) into place.
  void quantize(const uint16_t* w, cudaStream_t st) const {
    for (int64_t i = 0; i < mats; ++i) quantize_one(w + i * n * k, i, st);
  }
};
struct DComp {
  int64_t ratio = 0, head_dim = 0, out_dim = 0;
  DevBuf wkv, wgate, ape, norm;
};
struct DLayer {
  int32_t ratio = 0;
  DevBuf attn_norm, ffn_norm;
  DHc hc_attn, hc_ffn;
  DevBuf wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, wo_b_bias, sinks;
  DComp comp, icomp;
  DevBuf idx_wq_b, idx_wproj;
  DevBuf gate, gate_bias, tid2eid;
  DevBuf w13, w2;        // routed experts: [E][2I][H] (gate rows, then up rows), [E][H][I]
  DevBuf sh_w13, sh_w2;  // the shared expert, same layout
  DFp8 w13_8, w2_8, sh_w13_8, sh_w2_8;  // the same as FP8 (WeightDtype::kFp8; then no bf16)
};

// How a buffer is drawn for random weights.
enum class Init { kMatrix, kNorm, kSmall, kHcScale, kSink, kExpertId };
struct Spec {
  DevBuf* buf;
  int64_t count;
  int elem_bytes;
  Init init;
  int64_t fan_in;
  DFp8* fp8 = nullptr;  // an expert weight: its FP8 form, matrices of [rows, cols]
  int64_t rows = 0, cols = 0;
  Spec(DevBuf* b, int64_t n, int eb, Init i, int64_t fi, DFp8* f = nullptr, int64_t r = 0,
       int64_t c = 0)
      : buf(b), count(n), elem_bytes(eb), init(i), fan_in(fi), fp8(f), rows(r), cols(c) {}
};

std::vector<Spec> layer_specs(DLayer& L, const Dsv4Config& c, int64_t layer) {
  const int64_t H = c.hidden, hd = c.head_dim, W = c.hc_mult * H, mix = c.hc_mix();
  const int64_t E = c.n_routed_experts, I = c.moe_inter, S = c.moe_inter * c.n_shared_experts;
  const int64_t ih = c.index_n_heads, ihd = c.index_head_dim, G = c.o_groups, R = c.o_lora_rank;
  std::vector<Spec> s = {
      {&L.attn_norm, H, 2, Init::kNorm, 0},
      {&L.ffn_norm, H, 2, Init::kNorm, 0},
      {&L.hc_attn.fn, mix * W, 4, Init::kMatrix, W},
      {&L.hc_attn.base, mix, 4, Init::kSmall, 0},
      {&L.hc_attn.scale, 3, 4, Init::kHcScale, 0},
      {&L.hc_ffn.fn, mix * W, 4, Init::kMatrix, W},
      {&L.hc_ffn.base, mix, 4, Init::kSmall, 0},
      {&L.hc_ffn.scale, 3, 4, Init::kHcScale, 0},
      {&L.wq_a, c.q_lora_rank * H, 2, Init::kMatrix, H},
      {&L.q_norm, c.q_lora_rank, 2, Init::kNorm, 0},
      {&L.wq_b, c.heads * hd * c.q_lora_rank, 2, Init::kMatrix, c.q_lora_rank},
      {&L.wkv, hd * H, 2, Init::kMatrix, H},
      {&L.kv_norm, hd, 2, Init::kNorm, 0},
      {&L.wo_a, G * R * (c.heads * hd / G), 2, Init::kMatrix, c.heads * hd / G},
      {&L.wo_b, H * G * R, 2, Init::kMatrix, G * R},
      {&L.sinks, c.heads, 4, Init::kSink, 0},
      {&L.gate, E * H, 2, Init::kMatrix, H},
      {&L.w13, E * 2 * I * H, 2, Init::kMatrix, H, &L.w13_8, 2 * I, H},
      {&L.w2, E * H * I, 2, Init::kMatrix, I, &L.w2_8, H, I},
  };
  if (c.attention_bias) s.push_back({&L.wo_b_bias, H, 2, Init::kSmall, 0});
  if (layer < c.num_hash_layers)
    s.push_back({&L.tid2eid, c.vocab * c.experts_per_tok, 4, Init::kExpertId, 0});
  else
    s.push_back({&L.gate_bias, E, 4, Init::kSmall, 0});
  if (S > 0) {
    s.push_back({&L.sh_w13, 2 * S * H, 2, Init::kMatrix, H, &L.sh_w13_8, 2 * S, H});
    s.push_back({&L.sh_w2, H * S, 2, Init::kMatrix, S, &L.sh_w2_8, H, S});
  }
  auto comp = [&](DComp& cm, int64_t ratio, int64_t d) {
    cm.ratio = ratio, cm.head_dim = d, cm.out_dim = ratio == 4 ? 2 * d : d;
    s.push_back({&cm.wkv, cm.out_dim * H, 2, Init::kMatrix, H});
    s.push_back({&cm.wgate, cm.out_dim * H, 2, Init::kMatrix, H});
    s.push_back({&cm.ape, ratio * cm.out_dim, 4, Init::kSmall, 0});
    s.push_back({&cm.norm, d, 2, Init::kNorm, 0});
  };
  if (L.ratio > 0) comp(L.comp, L.ratio, hd);
  if (L.ratio == 4) {
    comp(L.icomp, 4, ihd);
    s.push_back({&L.idx_wq_b, ih * ihd * c.q_lora_rank, 2, Init::kMatrix, c.q_lora_rank});
    s.push_back({&L.idx_wproj, ih * H, 2, Init::kMatrix, H});
  }
  return s;
}

void put(DevBuf& b, const void* src, size_t bytes) {
  if (bytes != b.bytes) {
    std::fprintf(stderr, "%s:%d: weight of %zu bytes for a buffer of %zu\n", __FILE__, __LINE__,
                 bytes, b.bytes);
    std::abort();
  }
  HETERO_CUDA_OK(cudaMemcpy(b.p, src, bytes, cudaMemcpyHostToDevice));
}
void put(DevBuf& b, const Tensor& t) { put(b, t.bytes.data(), t.bytes.size()); }
void put(DevBuf& b, const std::vector<float>& v) { put(b, v.data(), v.size() * sizeof(float)); }
void put_hc(DHc& d, const Dsv4HyperConnection& hc) {
  put(d.fn, hc.fn), put(d.base, hc.base), put(d.scale, hc.scale);
}
void put_comp(DComp& d, const Dsv4Compressor& cm) {
  put(d.wkv, cm.wkv), put(d.wgate, cm.wgate), put(d.ape, cm.ape), put(d.norm, cm.norm);
}

// PoolingCache(ratio) on the device.
struct DPool {
  int64_t ratio = 0, width = 0, head_dim = 0;
  DevBuf buf_kv, buf_gate;  // [ratio][width]
  int64_t remainder = 0;
  DevBuf pooled;  // [rows][head_dim], normed and rope'd
  int64_t rows = 0;
};

struct DState {
  DevBuf tail;  // the last min(window - 1, seen) rope'd kv rows, in position order
  int64_t tail_rows = 0;
  DPool pool, ipool;
};

// Optional breakdown of device time by phase: an event at each phase start, read back at the end
// of a chunk (which then waits for the device).
struct PhaseTimer {
  bool on = false;
  std::vector<std::string> names;
  std::vector<double> ms;
  std::vector<cudaEvent_t> events;
  std::vector<int> tags;
  size_t used = 0;

  void mark(cudaStream_t st, const char* phase) {
    if (!on) return;
    int tag = 0;
    while (tag < static_cast<int>(names.size()) && names[static_cast<size_t>(tag)] != phase) ++tag;
    if (tag == static_cast<int>(names.size())) names.emplace_back(phase), ms.push_back(0);
    if (used == events.size()) {
      cudaEvent_t e;
      HETERO_CUDA_OK(cudaEventCreate(&e));
      events.push_back(e), tags.push_back(0);
    }
    HETERO_CUDA_OK(cudaEventRecord(events[used], st));
    tags[used++] = tag;
  }
  void collect(cudaStream_t st) {
    if (!on || used == 0) return;
    HETERO_CUDA_OK(cudaStreamSynchronize(st));
    for (size_t i = 0; i + 1 < used; ++i) {
      float t = 0;
      HETERO_CUDA_OK(cudaEventElapsedTime(&t, events[i], events[i + 1]));
      ms[static_cast<size_t>(tags[i])] += t;
    }
    used = 0;
  }
  ~PhaseTimer() {
    for (cudaEvent_t e : events) cudaEventDestroy(e);
  }
};

}  // namespace

struct Dsv4CudaEngine::Impl {
  PhaseTimer timer;
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  DevBuf embed, local_freqs, compress_freqs;
  int64_t rope_pairs = 0;
  std::vector<DLayer> layers;
  std::vector<DState> state;
  // Scratch, sized by the largest chunk.
  int64_t cap = 0;
  DevBuf ids, h, x, y, mix, qr, q, attn, kv, mid, ckv, cgate, ikv, igate, iq, iw, lk, stage_kv,
      stage_gate, topk, rep, has_prev;
  DevBuf logits, inds, weights, counts, offsets, perm, slot_row, xe, gu, act, ye, sgu, sact, sh;
  int32_t* host_offsets = nullptr;   // pinned [E + 1]
  bool grouped = false;              // routed experts through one grouped GEMM call
  const void** host_ptrs = nullptr;  // pinned [2][3][E]: weight, input, output per group
  DevBuf dev_ptrs;                   // its device copy
  int grouped_slot = 0;
  bool online_only = false;  // Dsv4CudaOptions::online_softmax_attention
  std::vector<uint16_t> host_x;
  // FP8 experts (Dsv4CudaOptions::weight_dtype): the GEMM plans and the quantized inputs.
  bool fp8 = false;
  std::unique_ptr<cuda::Fp8Gemm> fp8_gemm;
  DevBuf act_q, act_scale;
  int32_t* host_pad = nullptr;  // pinned [E + 1]: each expert's first row in act_q, padded
  DevBuf pad;                   // its device copy
  // Routed experts over side streams (Dsv4CudaOptions::expert_streams), forked from and joined
  // back into the compute stream by events: each lane its own cuBLAS handle and FP8 plans, and
  // (FP8) a buffer for its last expert's output, whose padding rows would otherwise land on the
  // next lane's first expert.
  struct Lane {
    cudaStream_t stream = nullptr;
    cublasHandle_t blas = nullptr;
    std::unique_ptr<cuda::Fp8Gemm> fp8;
    cudaEvent_t done = nullptr;
    DevBuf spill;
  };
  std::vector<Lane> lanes;
  cudaEvent_t fork = nullptr;
  Status init;  // why the engine cannot run, if it cannot

  ~Impl() {
    if (host_offsets) cudaFreeHost(host_offsets);
    if (host_ptrs) cudaFreeHost(host_ptrs);
    if (host_pad) cudaFreeHost(host_pad);
    for (Lane& l : lanes) {
      if (l.stream) cudaStreamSynchronize(l.stream);
      if (l.blas) cublasDestroy(l.blas);
      if (l.done) cudaEventDestroy(l.done);
      if (l.stream) cudaStreamDestroy(l.stream);
    }
    if (fork) cudaEventDestroy(fork);
    if (blas) cublasDestroy(blas);
    if (stream) cudaStreamDestroy(stream);
  }
};

// A cuBLAS handle on `stream`, with no bf16 reductions inside split-k: every sum stays float32.
static cublasHandle_t blas_on(cudaStream_t stream) {
  cublasHandle_t h = nullptr;
  HETERO_CUBLAS_OK(cublasCreate(&h));
  HETERO_CUBLAS_OK(cublasSetStream(h, stream));
  HETERO_CUBLAS_OK(cublasSetMathMode(
      h, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                   CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  return h;
}

Dsv4CudaEngine::Dsv4CudaEngine(const Dsv4Config& config, const Dsv4CudaOptions& options)
    : config_(config), options_(options), impl_(std::make_unique<Impl>()) {
  const Dsv4Config& c = config_;
  Impl& m = *impl_;
  HETERO_CUDA_OK(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking));
  m.blas = blas_on(m.stream);
  HETERO_CUDA_OK(cudaMallocHost(&m.host_offsets, sizeof(int32_t) * (c.n_routed_experts + 1)));
  HETERO_CUDA_OK(cudaMallocHost(&m.host_ptrs, sizeof(void*) * 6 * c.n_routed_experts));
  m.dev_ptrs.alloc(sizeof(void*) * 6 * c.n_routed_experts);
  m.grouped = options_.grouped_experts;
  m.timer.on = options_.phase_timing;
  m.online_only = options_.online_softmax_attention;
  m.fp8 = options_.weight_dtype == cuda::WeightDtype::kFp8;
  if (options_.expert_streams > 1) {
    HETERO_CUDA_OK(cudaEventCreateWithFlags(&m.fork, cudaEventDisableTiming));
    m.lanes.resize(static_cast<size_t>(options_.expert_streams));
    for (Impl::Lane& lane : m.lanes) {
      HETERO_CUDA_OK(cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking));
      HETERO_CUDA_OK(cudaEventCreateWithFlags(&lane.done, cudaEventDisableTiming));
      lane.blas = blas_on(lane.stream);
    }
  }
  if (m.fp8) {
    HETERO_CUDA_OK(cudaMallocHost(&m.host_pad, sizeof(int32_t) * (c.n_routed_experts + 1)));
    m.pad.alloc(sizeof(int32_t) * (c.n_routed_experts + 1));
  }
  m.init = check_options(c, options_);
  if (m.fp8 && m.init.is_ok()) {
    auto g = cuda::Fp8Gemm::create();
    if (g.is_ok())
      m.fp8_gemm = std::move(g.value());
    else
      m.init = g.status();
    for (Impl::Lane& lane : m.lanes) {
      if (!m.init.is_ok()) break;
      auto lg = cuda::Fp8Gemm::create();
      if (lg.is_ok())
        lane.fp8 = std::move(lg.value());
      else
        m.init = lg.status();
    }
    // Ask cuBLASLt for every expert shape now: one it refuses fails the engine, not a chunk.
    const int64_t I = c.moe_inter, S = c.moe_inter * c.n_shared_experts, H = c.hidden;
    for (auto [n, k] : {std::pair{2 * I, H}, std::pair{H, I}, std::pair{2 * S, H}, std::pair{H, S}})
      if (m.init.is_ok() && n > 0 && k > 0) m.init = m.fp8_gemm->prepare(16, n, k);
  }

  const std::vector<float> lf =
      dsv4_rope_freqs(static_cast<int>(c.rope_head_dim), c.rope_theta, YarnScaling{});
  const std::vector<float> cf =
      dsv4_rope_freqs(static_cast<int>(c.rope_head_dim), c.compress_rope_theta, c.yarn);
  m.rope_pairs = static_cast<int64_t>(lf.size());
  m.local_freqs.alloc(lf.size() * 4), put(m.local_freqs, lf);
  m.compress_freqs.alloc(cf.size() * 4), put(m.compress_freqs, cf);
  m.embed.alloc(static_cast<size_t>(c.vocab * c.hidden) * 2);
  weight_bytes_ = static_cast<int64_t>(m.embed.bytes);
  m.layers.resize(static_cast<size_t>(c.layers));
  for (int64_t l = 0; l < c.layers; ++l) {
    DLayer& L = m.layers[static_cast<size_t>(l)];
    L.ratio = c.compress_ratios[static_cast<size_t>(l)];
    for (const Spec& s : layer_specs(L, c, l)) {
      if (s.fp8 && m.fp8) {
        s.fp8->alloc(s.count, s.rows, s.cols);
        weight_bytes_ += static_cast<int64_t>(s.fp8->q.bytes + s.fp8->scale.bytes);
        continue;
      }
      s.buf->alloc(static_cast<size_t>(s.count) * s.elem_bytes);
      weight_bytes_ += static_cast<int64_t>(s.buf->bytes);
    }
  }
  reset();
}

Dsv4CudaEngine::Dsv4CudaEngine(const Dsv4Weights& w, const Dsv4CudaOptions& options)
    : Dsv4CudaEngine(w.config, options) {
  const Dsv4Config& c = config_;
  Impl& m = *impl_;
  put(m.embed, w.embed);
  const int64_t E = c.n_routed_experts, I = c.moe_inter, H = c.hidden;
  for (int64_t l = 0; l < c.layers; ++l) {
    DLayer& D = m.layers[static_cast<size_t>(l)];
    const Dsv4LayerWeights& L = w.layers[static_cast<size_t>(l)];
    put(D.attn_norm, L.attn_norm), put(D.ffn_norm, L.ffn_norm);
    put_hc(D.hc_attn, L.hc_attn), put_hc(D.hc_ffn, L.hc_ffn);
    put(D.wq_a, L.wq_a), put(D.q_norm, L.q_norm), put(D.wq_b, L.wq_b);
    put(D.wkv, L.wkv), put(D.kv_norm, L.kv_norm), put(D.wo_a, L.wo_a), put(D.wo_b, L.wo_b);
    if (D.wo_b_bias) put(D.wo_b_bias, L.wo_b_bias);
    std::vector<float> sinks(L.attn_sink.size());  // the decoder adds them as bf16
    for (size_t i = 0; i < sinks.size(); ++i) sinks[i] = round_bf16(L.attn_sink[i]);
    put(D.sinks, sinks);
    if (D.ratio > 0) put_comp(D.comp, L.compressor);
    if (D.ratio == 4) {
      put_comp(D.icomp, L.index_compressor);
      put(D.idx_wq_b, L.index_wq_b), put(D.idx_wproj, L.index_weights_proj);
    }
    put(D.gate, L.gate);
    if (D.tid2eid) put(D.tid2eid, L.tid2eid.data(), L.tid2eid.size() * 4);
    if (D.gate_bias) put(D.gate_bias, L.gate_bias);
    const size_t mat = static_cast<size_t>(I * H) * 2;
    if (m.fp8) {
      // Each expert's bf16 weights through one scratch buffer into their FP8 form, in the
      // stream's order (the scratch is refilled only once the quantizer has read it).
      DevBuf tmp;
      tmp.alloc(2 * std::max(mat, L.shared_w1.bytes.size()));
      auto up = [&](const Tensor& t, size_t at) {
        HETERO_CUDA_OK(cudaMemcpyAsync(tmp.as<uint8_t>() + at, t.bytes.data(), t.bytes.size(),
                                       cudaMemcpyHostToDevice, m.stream));
      };
      for (int64_t e = 0; e < E; ++e) {
        const size_t i = static_cast<size_t>(e);
        up(L.w1[i], 0), up(L.w3[i], mat);
        D.w13_8.quantize_one(tmp.bf(), e, m.stream);
        up(L.w2[i], 0);
        D.w2_8.quantize_one(tmp.bf(), e, m.stream);
      }
      if (D.sh_w13_8.mats > 0) {
        up(L.shared_w1, 0), up(L.shared_w3, L.shared_w1.bytes.size());
        D.sh_w13_8.quantize(tmp.bf(), m.stream);
        up(L.shared_w2, 0);
        D.sh_w2_8.quantize(tmp.bf(), m.stream);
      }
      HETERO_CUDA_OK(cudaStreamSynchronize(m.stream));
      continue;
    }
    for (int64_t e = 0; e < E; ++e) {
      const size_t at = static_cast<size_t>(e) * 2 * mat;
      HETERO_CUDA_OK(cudaMemcpy(D.w13.as<uint8_t>() + at, L.w1[static_cast<size_t>(e)].bytes.data(),
                                mat, cudaMemcpyHostToDevice));
      HETERO_CUDA_OK(cudaMemcpy(D.w13.as<uint8_t>() + at + mat,
                                L.w3[static_cast<size_t>(e)].bytes.data(), mat,
                                cudaMemcpyHostToDevice));
      HETERO_CUDA_OK(cudaMemcpy(D.w2.as<uint8_t>() + static_cast<size_t>(e) * mat,
                                L.w2[static_cast<size_t>(e)].bytes.data(), mat,
                                cudaMemcpyHostToDevice));
    }
    if (D.sh_w13) {
      const size_t half = L.shared_w1.bytes.size();
      HETERO_CUDA_OK(
          cudaMemcpy(D.sh_w13.p, L.shared_w1.bytes.data(), half, cudaMemcpyHostToDevice));
      HETERO_CUDA_OK(cudaMemcpy(D.sh_w13.as<uint8_t>() + half, L.shared_w3.bytes.data(), half,
                                cudaMemcpyHostToDevice));
      put(D.sh_w2, L.shared_w2);
    }
  }
}

std::unique_ptr<Dsv4CudaEngine> Dsv4CudaEngine::random(const Dsv4Config& config, uint64_t seed,
                                                       const Dsv4CudaOptions& options) {
  std::unique_ptr<Dsv4CudaEngine> e(new Dsv4CudaEngine(config, options));
  Impl& m = *e->impl_;
  const Dsv4Config& c = e->config_;
  cudaStream_t st = m.stream;
  cuda::fill_random_bf16(m.embed.bf(), c.vocab * c.hidden, 1.0f, seed, st);
  uint64_t k = seed * 1000;
  DevBuf scratch;  // FP8 experts: one layer's bf16 draw at a time
  for (int64_t l = 0; l < c.layers; ++l) {
    for (const Spec& s : layer_specs(m.layers[static_cast<size_t>(l)], c, l)) {
      ++k;
      switch (s.init) {
        case Init::kMatrix: {
          const float sc = 1.0f / std::sqrt(static_cast<float>(s.fan_in));
          if (s.fp8 && m.fp8) {  // drawn in bf16 into scratch, then quantized
            scratch.ensure(static_cast<size_t>(s.count) * 2);
            cuda::fill_random_bf16(scratch.bf(), s.count, sc, k, st);
            s.fp8->quantize(scratch.bf(), st);
          } else if (s.elem_bytes == 2)
            cuda::fill_random_bf16(s.buf->bf(), s.count, sc, k, st);
          else
            cuda::fill_random_f32(s.buf->f32(), s.count, sc, 0.0f, k, st);
          break;
        }
        case Init::kNorm:
          cuda::fill_random_bf16(s.buf->bf(), s.count, 0.1f, k, st);  // then + 1 below
          break;
        case Init::kSmall:
          if (s.elem_bytes == 2)
            cuda::fill_random_bf16(s.buf->bf(), s.count, 0.1f, k, st);
          else
            cuda::fill_random_f32(s.buf->f32(), s.count, 0.1f, 0.0f, k, st);
          break;
        case Init::kHcScale:
          cuda::fill_random_f32(s.buf->f32(), s.count, 0.1f, 1.0f, k, st);
          break;
        case Init::kSink:
          cuda::fill_random_f32(s.buf->f32(), s.count, 1.0f, 0.0f, k, st);
          break;
        case Init::kExpertId:
          cuda::fill_random_i32(s.buf->as<int32_t>(), s.count,
                                static_cast<int32_t>(c.n_routed_experts), k, st);
          break;
      }
    }
  }
  // Norm weights near one: fill 1 + N(0, 0.1) by adding one on the host side of a small copy.
  for (int64_t l = 0; l < c.layers; ++l)
    for (const Spec& s : layer_specs(m.layers[static_cast<size_t>(l)], c, l)) {
      if (s.init != Init::kNorm) continue;
      std::vector<uint16_t> v(static_cast<size_t>(s.count));
      HETERO_CUDA_OK(cudaStreamSynchronize(st));
      HETERO_CUDA_OK(cudaMemcpy(v.data(), s.buf->p, v.size() * 2, cudaMemcpyDeviceToHost));
      for (auto& x : v) x = f32_to_bf16(1.0f + bf16_to_f32(x));
      put(*s.buf, v.data(), v.size() * 2);
    }
  HETERO_CUDA_OK(cudaStreamSynchronize(st));
  return e;
}

Result<std::unique_ptr<Dsv4CudaEngine>> Dsv4CudaEngine::load(const std::string& model_dir,
                                                             const Dsv4CudaOptions& options) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0)
    return failed_precondition("no CUDA device for the DeepSeek-V4 CUDA engine");
  HETERO_ASSIGN_OR_RETURN(Dsv4Weights w, load_dsv4_weights(model_dir));
  HETERO_RETURN_IF_ERROR(check_options(w.config, options));
  auto e = std::make_unique<Dsv4CudaEngine>(w, options);
  HETERO_RETURN_IF_ERROR(e->impl_->init);
  return e;
}

Status Dsv4CudaEngine::check_options(const Dsv4Config& c, const Dsv4CudaOptions& options) {
  if (options.expert_streams < 1 || options.expert_streams > 16)
    return invalid_argument("expert_streams must be 1..16, not " +
                            std::to_string(options.expert_streams));
  if (options.expert_streams > 1 && options.grouped_experts)
    return invalid_argument("grouped_experts runs every expert in one call: expert_streams 1");
  if (options.weight_dtype != cuda::WeightDtype::kFp8) return Status::ok();
  if (options.grouped_experts)
    return invalid_argument(
        "fp8 expert weights run one cuBLASLt GEMM per expert; grouped_experts is for bf16 "
        "weights");
  const int64_t S = c.moe_inter * c.n_shared_experts;
  if (c.hidden % 16 != 0 || c.moe_inter % 16 != 0 || S % 16 != 0)
    return invalid_argument(
        "fp8 expert weights need hidden and moe_intermediate_size multiples "
        "of 16, not " +
        std::to_string(c.hidden) + " and " + std::to_string(c.moe_inter));
  int device = 0;
  cudaGetDevice(&device);
  return cuda::check_fp8_device(device);
}

Dsv4CudaEngine::~Dsv4CudaEngine() {
  if (impl_ && impl_->stream) cudaStreamSynchronize(impl_->stream);
}

void* Dsv4CudaEngine::stream() const { return impl_->stream; }

std::vector<std::pair<std::string, double>> Dsv4CudaEngine::phase_ms() const {
  std::vector<std::pair<std::string, double>> out;
  const PhaseTimer& t = impl_->timer;
  for (size_t i = 0; i < t.names.size(); ++i)
    if (t.names[i] != "end") out.emplace_back(t.names[i], t.ms[i]);
  return out;
}

Status Dsv4CudaEngine::synchronize() {
  const cudaError_t e = cudaStreamSynchronize(impl_->stream);
  if (e != cudaSuccess) return internal_error(std::string("CUDA: ") + cudaGetErrorString(e));
  return Status::ok();
}

void Dsv4CudaEngine::reset() {
  const Dsv4Config& c = config_;
  Impl& m = *impl_;
  HETERO_CUDA_OK(cudaStreamSynchronize(m.stream));
  m.state.resize(m.layers.size());
  for (size_t i = 0; i < m.layers.size(); ++i) {
    DState& s = m.state[i];
    const DLayer& L = m.layers[i];
    s.tail_rows = 0;
    if (!s.tail)
      s.tail.alloc(static_cast<size_t>(std::max<int64_t>(1, c.sliding_window) * c.head_dim) * 2);
    auto init = [](DPool& p, const DComp& cm) {
      p.ratio = cm.ratio, p.width = cm.out_dim, p.head_dim = cm.head_dim;
      p.remainder = 0, p.rows = 0;
      if (!p.buf_kv) {
        p.buf_kv.alloc(static_cast<size_t>(p.ratio * p.width) * 2);
        p.buf_gate.alloc(static_cast<size_t>(p.ratio * p.width) * 2);
      }
    };
    if (L.ratio > 0) init(s.pool, L.comp);
    if (L.ratio == 4) init(s.ipool, L.icomp);
  }
  n_cached_ = 0;
}

Status Dsv4CudaEngine::set_full_forward(bool on) {
  if (n_cached_ != 0) return failed_precondition("full_forward changes only between sequences");
  full_forward_ = on;
  return Status::ok();
}

// ---------------------------------------------------------------------------------------------

namespace {

void copy_d2d(void* dst, const void* src, size_t bytes, cudaStream_t st) {
  if (bytes) HETERO_CUDA_OK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, st));
}

// Room for `rows` pooled rows, keeping the ones there.
void reserve_rows(DPool& p, int64_t rows, cudaStream_t st) {
  const size_t need = static_cast<size_t>(rows * p.head_dim) * 2;
  if (need <= p.pooled.bytes) return;
  DevBuf grown;
  grown.alloc(std::max(need, p.pooled.bytes * 2));
  copy_d2d(grown.p, p.pooled.p, static_cast<size_t>(p.rows * p.head_dim) * 2, st);
  HETERO_CUDA_OK(cudaStreamSynchronize(st));
  p.pooled = std::move(grown);
}

struct CompressScratch {
  DevBuf* stage_kv;
  DevBuf* stage_gate;
  const uint8_t* has_prev;  // [0, 1, 1, ...]
  const float* freqs;
  int64_t rope_pairs;
  float eps;
};

// The CPU engine's Pool::accumulate + compress on the device; returns the rows it added.
int64_t compress(DPool& pool, const DComp& cm, const CompressScratch& s, const uint16_t* kv,
                 const uint16_t* gate, int64_t m, int64_t offset, cudaStream_t st) {
  const int64_t w = pool.width, r = pool.ratio;
  const size_t row = static_cast<size_t>(w) * 2;
  const uint16_t *rkv = nullptr, *rgate = nullptr;
  int64_t ready = 0, base = 0;
  if (m > 1) {
    const int64_t total = m + pool.remainder, usable = total / r * r, new_rem = total % r;
    if (usable > 0) {
      if (pool.remainder > 0) {
        s.stage_kv->ensure(static_cast<size_t>(usable) * row);
        s.stage_gate->ensure(static_cast<size_t>(usable) * row);
        const size_t kept = static_cast<size_t>(pool.remainder) * row;
        const size_t fresh = static_cast<size_t>(usable - pool.remainder) * row;
        copy_d2d(s.stage_kv->p, pool.buf_kv.p, kept, st);
        copy_d2d(s.stage_gate->p, pool.buf_gate.p, kept, st);
        copy_d2d(s.stage_kv->as<uint8_t>() + kept, kv, fresh, st);
        copy_d2d(s.stage_gate->as<uint8_t>() + kept, gate, fresh, st);
        rkv = s.stage_kv->bf(), rgate = s.stage_gate->bf();
      } else {
        rkv = kv, rgate = gate;
      }
      ready = usable, base = offset - pool.remainder;
      pool.remainder = 0;
    }
    if (new_rem > 0) {
      const int64_t n_new = new_rem - pool.remainder;
      copy_d2d(pool.buf_kv.as<uint8_t>() + pool.remainder * row, kv + (m - n_new) * w,
               static_cast<size_t>(n_new) * row, st);
      copy_d2d(pool.buf_gate.as<uint8_t>() + pool.remainder * row, gate + (m - n_new) * w,
               static_cast<size_t>(n_new) * row, st);
    }
    pool.remainder = new_rem;
  } else {
    copy_d2d(pool.buf_kv.as<uint8_t>() + pool.remainder * row, kv, row, st);
    copy_d2d(pool.buf_gate.as<uint8_t>() + pool.remainder * row, gate, row, st);
    pool.remainder = (pool.remainder + 1) % r;
    if (pool.remainder == 0)
      rkv = pool.buf_kv.bf(), rgate = pool.buf_gate.bf(), ready = r, base = offset - r + 1;
  }
  const int64_t windows = ready / r;
  if (windows == 0) return 0;
  reserve_rows(pool, pool.rows + windows, st);
  uint16_t* out = pool.pooled.bf() + pool.rows * pool.head_dim;
  if (r == 4)  // only windows completed within one call see their predecessor (the overlap lane)
    cuda::dsv4_pool_overlap(rkv, rgate, cm.ape.f32(), s.has_prev, windows, r, pool.head_dim, out,
                            st);
  else
    cuda::dsv4_pool_simple(rkv, rgate, cm.ape.f32(), windows, r, pool.head_dim, out, st);
  cuda::fast_rms_norm(out, windows, pool.head_dim, cm.norm.bf(), s.eps, out, st);
  cuda::dsv4_rope(out, windows, 1, pool.head_dim, base / r, s.freqs, s.rope_pairs,
                  static_cast<int>(r), false, st);
  pool.rows += windows;
  return windows;
}

}  // namespace

// The attention of layer l for n rows of x at pos0; y [n, hidden].
static void attention(Dsv4CudaEngine::Impl& m, const Dsv4Config& c, int64_t l, int64_t n,
                      int64_t pos0) {
  const DLayer& L = m.layers[static_cast<size_t>(l)];
  DState& S = m.state[static_cast<size_t>(l)];
  cudaStream_t st = m.stream;
  cublasHandle_t b = m.blas;
  const int64_t H = c.hidden, Hh = c.heads, hd = c.head_dim, win = c.sliding_window;
  const int64_t ih = c.index_n_heads, ihd = c.index_head_dim, QL = c.q_lora_rank;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float* freqs = L.ratio == 0 ? m.local_freqs.f32() : m.compress_freqs.f32();
  const uint16_t* x = m.x.bf();

  m.timer.mark(st, "attn projections");
  gemm(b, x, n, H, L.wq_a.bf(), QL, m.qr.bf());
  cuda::fast_rms_norm(m.qr.bf(), n, QL, L.q_norm.bf(), eps, m.qr.bf(), st);
  gemm(b, m.qr.bf(), n, QL, L.wq_b.bf(), Hh * hd, m.q.bf());
  cuda::fast_rms_norm(m.q.bf(), n * Hh, hd, nullptr, eps, m.q.bf(), st);
  cuda::dsv4_rope(m.q.bf(), n, Hh, hd, pos0, freqs, m.rope_pairs, 1, false, st);
  gemm(b, x, n, H, L.wkv.bf(), hd, m.kv.bf());
  cuda::fast_rms_norm(m.kv.bf(), n, hd, L.kv_norm.bf(), eps, m.kv.bf(), st);
  cuda::dsv4_rope(m.kv.bf(), n, 1, hd, pos0, freqs, m.rope_pairs, 1, false, st);
  if (L.ratio > 0) {
    gemm(b, x, n, H, L.comp.wkv.bf(), L.comp.out_dim, m.ckv.bf());
    gemm(b, x, n, H, L.comp.wgate.bf(), L.comp.out_dim, m.cgate.bf());
  }
  if (L.ratio == 4) {
    gemm(b, x, n, H, L.icomp.wkv.bf(), L.icomp.out_dim, m.ikv.bf());
    gemm(b, x, n, H, L.icomp.wgate.bf(), L.icomp.out_dim, m.igate.bf());
    gemm(b, m.qr.bf(), n, QL, L.idx_wq_b.bf(), ih * ihd, m.iq.bf());
    cuda::dsv4_rope(m.iq.bf(), n, ih, ihd, pos0, freqs, m.rope_pairs, 1, false, st);
    gemm(b, x, n, H, L.idx_wproj.bf(), ih, m.iw.bf());
  }
  const CompressScratch cs{
      &m.stage_kv, &m.stage_gate, m.has_prev.as<uint8_t>(), m.compress_freqs.f32(), m.rope_pairs,
      eps};
  const size_t kv_row = static_cast<size_t>(hd) * 2;
  const float scale_b = round_bf16(1.0f / std::sqrt(static_cast<float>(hd)));

  // The decoder's calls: the whole chunk, or one token at a time for chunks of 2..8 tokens.
  const int64_t call_len = n > kDecodeBlock ? n : 1;
  for (int64_t s0 = 0; s0 < n; s0 += call_len) {
    const int64_t cm = std::min(call_len, n - s0), off = pos0 + s0;
    // Local keys: the kept tail, then this call's rows.
    m.timer.mark(st, "window + compressors");
    copy_d2d(m.lk.p, S.tail.p, static_cast<size_t>(S.tail_rows) * kv_row, st);
    copy_d2d(m.lk.as<uint8_t>() + S.tail_rows * kv_row, m.kv.bf() + s0 * hd,
             static_cast<size_t>(cm) * kv_row, st);
    const int64_t lk_pos0 = off - S.tail_rows, lk_rows = S.tail_rows + cm;
    const int64_t keep = std::min(win - 1, lk_rows);
    copy_d2d(S.tail.p, m.lk.as<uint8_t>() + (lk_rows - keep) * kv_row,
             static_cast<size_t>(keep) * kv_row, st);
    S.tail_rows = keep;

    int64_t Pn = 0;
    if (L.ratio > 0) {
      const int64_t w = L.comp.out_dim;
      compress(S.pool, L.comp, cs, m.ckv.bf() + s0 * w, m.cgate.bf() + s0 * w, cm, off, st);
      Pn = S.pool.rows;
    }
    bool sparse = false;
    if (L.ratio == 4) {
      const int64_t w = L.icomp.out_dim;
      compress(S.ipool, L.icomp, cs, m.ikv.bf() + s0 * w, m.igate.bf() + s0 * w, cm, off, st);
      sparse = Pn > c.index_topk;
      if (sparse) {
        m.timer.mark(st, "indexer selection");
        const int64_t k = c.index_topk, Np = S.ipool.rows;
        const bool hisa = c.index_block > 0 && Np >= c.index_block * c.index_keep &&
                          c.index_keep * c.index_block >= k;
        cuda::IndexSelectParams ip{};
        ip.q = m.iq.bf() + s0 * ih * ihd;
        ip.w = m.iw.bf() + s0 * ih;
        ip.pooled = S.ipool.pooled.bf();
        ip.m = cm, ip.heads = ih, ip.rows = Np, ip.off = off;
        ip.scale = static_cast<float>(std::pow(static_cast<double>(ihd), -0.5));
        ip.wscale = static_cast<float>(std::pow(static_cast<double>(ih), -0.5));
        ip.k = k, ip.one_token = cm == 1;
        if (hisa) {
          ip.block = c.index_block, ip.keep = c.index_keep;
          m.rep.ensure(static_cast<size_t>(Np / c.index_block * ihd) * 4);
          cuda::hisa_block_means(ip.pooled, Np, c.index_block, cm == 1, m.rep.f32(), st);
          ip.rep = m.rep.f32();
        }
        cuda::index_select(ip, m.topk.as<uint32_t>(), st);
      }
    }
    m.timer.mark(st, "attention kernel");
    cuda::SparseAttnParams ap{};
    ap.q = m.q.bf() + s0 * Hh * hd;
    ap.out = m.attn.bf() + s0 * Hh * hd;
    ap.m = cm, ap.heads = Hh, ap.head_dim = hd, ap.off = off, ap.window = win;
    ap.lk = m.lk.bf(), ap.lk_pos0 = lk_pos0;
    ap.pooled = L.ratio > 0 ? S.pool.pooled.bf() : nullptr;
    ap.pooled_rows = Pn, ap.ratio = L.ratio;
    ap.topk = sparse ? m.topk.as<uint32_t>() : nullptr;
    ap.k = c.index_topk;
    ap.sinks = L.sinks.f32(), ap.scale = scale_b;
    ap.online_only = m.online_only;
    cuda::sparse_attention(ap, st);
  }

  m.timer.mark(st, "attn output projections");
  // De-rotate the output's rope dims, then the grouped low-rank output (one batched GEMM).
  cuda::dsv4_rope(m.attn.bf(), n, Hh, hd, pos0, freqs, m.rope_pairs, 1, true, st);
  const int64_t G = c.o_groups, feat = Hh * hd / G, R = c.o_lora_rank;
  const float alpha = 1.0f, beta0 = 0.0f;
  HETERO_CUBLAS_OK(cublasGemmStridedBatchedEx(
      b, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(R), static_cast<int>(n), static_cast<int>(feat),
      &alpha, L.wo_a.bf(), CUDA_R_16BF, static_cast<int>(feat), R * feat, m.attn.bf(), CUDA_R_16BF,
      static_cast<int>(G * feat), feat, &beta0, m.mid.bf(), CUDA_R_16BF, static_cast<int>(G * R), R,
      static_cast<int>(G), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  float beta = 0.0f;
  if (L.wo_b_bias) cuda::broadcast_rows(L.wo_b_bias.bf(), n, H, m.y.bf(), st), beta = 1.0f;
  gemm(b, m.mid.bf(), n, G * R, L.wo_b.bf(), H, m.y.bf(), -1, -1, beta);
}

// The experts [0, E) cut into `lanes` runs of consecutive experts with about equal rows:
// run i is [cut[i], cut[i + 1]).
static std::vector<int64_t> split_by_rows(const int32_t* off, int64_t E, size_t lanes) {
  std::vector<int64_t> cut = {0};
  const double total = off[E];
  for (int64_t e = 0; e < E && cut.size() < lanes; ++e)
    if (off[e + 1] >= total * static_cast<double>(cut.size()) / static_cast<double>(lanes))
      cut.push_back(e + 1);
  while (cut.size() <= lanes) cut.push_back(E);
  return cut;
}

// run(lane, e) for every expert with rows: on the compute stream in expert order (lane -1), or
// over the lanes, each taking a run of consecutive experts in order (lane i), forked from the
// compute stream's work so far and joined back into it.
template <class F>
static Status over_lanes(Dsv4CudaEngine::Impl& m, int64_t E, const int32_t* off, F&& run) {
  if (m.lanes.empty()) {
    for (int64_t e = 0; e < E; ++e)
      if (off[e + 1] > off[e]) HETERO_RETURN_IF_ERROR(run(-1, e));
    return Status::ok();
  }
  HETERO_CUDA_OK(cudaEventRecord(m.fork, m.stream));
  const std::vector<int64_t> cut = split_by_rows(off, E, m.lanes.size());
  Status st;
  for (size_t i = 0; i < m.lanes.size(); ++i) {
    Dsv4CudaEngine::Impl::Lane& lane = m.lanes[i];
    HETERO_CUDA_OK(cudaStreamWaitEvent(lane.stream, m.fork));
    for (int64_t e = cut[i]; e < cut[i + 1] && st.is_ok(); ++e)
      if (off[e + 1] > off[e]) st = run(static_cast<int>(i), e);
    HETERO_CUDA_OK(cudaEventRecord(lane.done, lane.stream));
    HETERO_CUDA_OK(cudaStreamWaitEvent(m.stream, lane.done));
  }
  return st;
}

// Per expert e with rows: y[off[e]..] = x[off[e]..] @ w_e^T, w_e [n, k] at w + e * n * k. One
// grouped cuBLAS call (pointer arrays through pinned memory), or a GEMM per expert (over the
// lanes, if any).
static void expert_gemms(Dsv4CudaEngine::Impl& m, int64_t E, const int32_t* off, const uint16_t* x,
                         int64_t k, const uint16_t* w, int64_t n, uint16_t* y) {
  if (!m.grouped) {
    const Status st = over_lanes(m, E, off, [&](int lane, int64_t e) {
      const int64_t rows = off[e + 1] - off[e];
      gemm(lane < 0 ? m.blas : m.lanes[static_cast<size_t>(lane)].blas, x + off[e] * k, rows, k,
           w + e * n * k, n, y + off[e] * n);
      return Status::ok();
    });
    HETERO_CHECK(st.is_ok());
    return;
  }
  std::vector<int> ms, ns, ks, ldas, ldbs, ldcs, sizes;
  std::vector<cublasOperation_t> ta, tb;
  std::vector<float> alpha, beta;
  int g = 0;
  const int slot = m.grouped_slot;  // alternate halves: the previous call may still read its half
  m.grouped_slot ^= 1;
  const void** ptrs = m.host_ptrs + slot * 3 * E;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = off[e + 1] - off[e];
    if (rows == 0) continue;
    ptrs[g] = w + e * n * k;
    ptrs[E + g] = x + off[e] * k;
    ptrs[2 * E + g] = y + off[e] * n;
    ms.push_back(static_cast<int>(n)), ns.push_back(static_cast<int>(rows));
    ks.push_back(static_cast<int>(k)), ldas.push_back(static_cast<int>(k));
    ldbs.push_back(static_cast<int>(k)), ldcs.push_back(static_cast<int>(n));
    ta.push_back(CUBLAS_OP_T), tb.push_back(CUBLAS_OP_N), alpha.push_back(1.0f);
    beta.push_back(0.0f), sizes.push_back(1);
    ++g;
  }
  if (g == 0) return;
  void** dev = m.dev_ptrs.as<void*>() + slot * 3 * E;
  HETERO_CUDA_OK(
      cudaMemcpyAsync(dev, ptrs, sizeof(void*) * 3 * E, cudaMemcpyHostToDevice, m.stream));
  HETERO_CUBLAS_OK(cublasGemmGroupedBatchedEx(
      m.blas, ta.data(), tb.data(), ms.data(), ns.data(), ks.data(), alpha.data(), dev, CUDA_R_16BF,
      ldas.data(), dev + E, CUDA_R_16BF, ldbs.data(), beta.data(), dev + 2 * E, CUDA_R_16BF,
      ldcs.data(), g, sizes.data(), CUBLAS_COMPUTE_32F));
}

// y [fp8_act_rows(rows), w.n] = x [rows, w.k] @ dequant(w)^T on the FP8 tensor cores: the rows
// quantized per token and 128 columns, then one cuBLASLt call. y's rows past `rows` get zeros
// (the GEMM's padding): its buffer must hold them, and a later write may reuse them.
static Status fp8_linear(Dsv4CudaEngine::Impl& m, const uint16_t* x, int64_t rows,
                         const cuda::Fp8BlockWeight& w, uint16_t* y) {
  if (rows == 0) return Status::ok();
  cuda::quantize_act_fp8_group(x, rows, w.k, m.act_q.as<uint8_t>(), m.act_scale.f32(), m.stream);
  return m.fp8_gemm->run(m.act_q.as<uint8_t>(), m.act_scale.f32(), rows, w, y, m.stream);
}

// expert_gemms with FP8 weights: every expert's rows quantized in one pass (each expert's rows
// padded to 16, m.host_pad / m.pad, set by the caller), then one GEMM per expert with rows, in
// expert order on its stream, so each expert's padding rows are overwritten by the next expert's
// output (the last expert's land in the buffer's slack; a lane's last expert writes into the
// lane's own buffer, and its real rows are copied into place). off: host and device copies of
// the row offsets.
static Status expert_gemms_fp8(Dsv4CudaEngine::Impl& m, int64_t E, const int32_t* off,
                               const int32_t* dev_off, const uint16_t* x, const DFp8& w,
                               uint16_t* y) {
  const int64_t groups = cuda::fp8_blocks(w.k);
  cuda::quantize_act_fp8_segments(x, dev_off, m.pad.as<int32_t>(), E, m.host_pad[E], w.k,
                                  m.act_q.as<uint8_t>(), m.act_scale.f32(), m.stream);
  std::vector<int64_t> last(m.lanes.size(), -1);  // each lane's last expert with rows
  if (!m.lanes.empty()) {
    const std::vector<int64_t> cut = split_by_rows(off, E, m.lanes.size());
    for (size_t i = 0; i + 1 < m.lanes.size(); ++i)
      for (int64_t e = cut[i]; e < cut[i + 1]; ++e)
        if (off[e + 1] > off[e]) last[i] = e;
  }
  return over_lanes(m, E, off, [&](int lane, int64_t e) {
    const int64_t rows = off[e + 1] - off[e], p = m.host_pad[e];
    cuda::Fp8Gemm& g = lane < 0 ? *m.fp8_gemm : *m.lanes[static_cast<size_t>(lane)].fp8;
    cudaStream_t st = lane < 0 ? m.stream : m.lanes[static_cast<size_t>(lane)].stream;
    const bool spills =
        lane >= 0 && last[static_cast<size_t>(lane)] == e && cuda::fp8_act_rows(rows) != rows;
    uint16_t* out = spills ? m.lanes[static_cast<size_t>(lane)].spill.bf() : y + off[e] * w.n;
    HETERO_RETURN_IF_ERROR(g.run(m.act_q.as<uint8_t>() + p * w.k, m.act_scale.f32() + p * groups,
                                 rows, w.at(e), out, st));
    if (spills)
      HETERO_CUDA_OK(cudaMemcpyAsync(y + off[e] * w.n, out, static_cast<size_t>(rows * w.n) * 2,
                                     cudaMemcpyDeviceToDevice, st));
    return Status::ok();
  });
}

// The MoE of layer l on x [n, hidden] into y.
static Status moe(Dsv4CudaEngine::Impl& m, const Dsv4Config& c, int64_t l, int64_t n) {
  const DLayer& L = m.layers[static_cast<size_t>(l)];
  cudaStream_t st = m.stream;
  cublasHandle_t b = m.blas;
  const int64_t E = c.n_routed_experts, K = c.experts_per_tok, H = c.hidden, I = c.moe_inter;
  const int64_t S = c.moe_inter * c.n_shared_experts;
  const uint16_t* x = m.x.bf();

  m.timer.mark(st, "moe router + grouping");
  gemm(b, x, n, H, L.gate.bf(), E, m.logits.bf());
  cuda::RouterParams rp{};
  rp.experts = E, rp.top_k = K;
  rp.scoring = c.scoring_func == "sigmoid" ? 1 : c.scoring_func == "softmax" ? 2 : 0;
  rp.norm_topk_prob = c.norm_topk_prob;
  rp.routed_scaling = static_cast<float>(c.routed_scaling_factor);
  rp.bias = L.tid2eid ? nullptr : L.gate_bias.f32();
  rp.tid2eid = L.tid2eid ? L.tid2eid.as<int32_t>() : nullptr;
  cuda::moe_route(rp, m.logits.bf(), m.ids.as<int32_t>(), n, m.inds.as<int32_t>(), m.weights.f32(),
                  st);
  cuda::moe_group(m.inds.as<int32_t>(), n * K, K, E, x, H, m.counts.as<int32_t>(),
                  m.offsets.as<int32_t>(), m.perm.as<int32_t>(), m.slot_row.as<int32_t>(),
                  m.xe.bf(), st);
  // cuBLAS takes the per-expert row counts from the host.
  HETERO_CUDA_OK(cudaMemcpyAsync(m.host_offsets, m.offsets.p, sizeof(int32_t) * (E + 1),
                                 cudaMemcpyDeviceToHost, st));
  // The shared expert does not depend on the routing: enqueue it before waiting.
  if (S > 0) {
    m.timer.mark(st, "moe shared expert");
    if (m.fp8)
      HETERO_RETURN_IF_ERROR(fp8_linear(m, x, n, L.sh_w13_8.at(0), m.sgu.bf()));
    else
      gemm(b, x, n, H, L.sh_w13.bf(), 2 * S, m.sgu.bf());
    cuda::swiglu(m.sgu.bf(), n, S, static_cast<float>(c.swiglu_limit), m.sact.bf(), st);
    if (m.fp8)
      HETERO_RETURN_IF_ERROR(fp8_linear(m, m.sact.bf(), n, L.sh_w2_8.at(0), m.sh.bf()));
    else
      gemm(b, m.sact.bf(), n, S, L.sh_w2.bf(), H, m.sh.bf());
  }
  HETERO_CUDA_OK(cudaStreamSynchronize(st));
  m.timer.mark(st, "moe routed experts");
  const int32_t* off = m.host_offsets;
  if (m.fp8) {
    int64_t total = 0;
    for (int64_t e = 0; e < E; ++e) {
      m.host_pad[e] = static_cast<int32_t>(total);
      total += cuda::fp8_act_rows(off[e + 1] - off[e]);
    }
    m.host_pad[E] = static_cast<int32_t>(total);
    // The previous layer's copy of host_pad is done: the stream was waited for above.
    HETERO_CUDA_OK(cudaMemcpyAsync(m.pad.p, m.host_pad, sizeof(int32_t) * (E + 1),
                                   cudaMemcpyHostToDevice, st));
  }
  if (m.fp8)
    HETERO_RETURN_IF_ERROR(
        expert_gemms_fp8(m, E, off, m.offsets.as<int32_t>(), m.xe.bf(), L.w13_8, m.gu.bf()));
  else
    expert_gemms(m, E, off, m.xe.bf(), H, L.w13.bf(), 2 * I, m.gu.bf());
  cuda::swiglu(m.gu.bf(), n * K, I, static_cast<float>(c.swiglu_limit), m.act.bf(), st);
  if (m.fp8)
    HETERO_RETURN_IF_ERROR(
        expert_gemms_fp8(m, E, off, m.offsets.as<int32_t>(), m.act.bf(), L.w2_8, m.ye.bf()));
  else
    expert_gemms(m, E, off, m.act.bf(), I, L.w2.bf(), H, m.ye.bf());
  m.timer.mark(st, "moe combine");
  cuda::moe_combine(m.ye.bf(), m.slot_row.as<int32_t>(), m.weights.f32(),
                    S > 0 ? m.sh.bf() : nullptr, n, K, H, m.y.bf(), st);
  return Status::ok();
}

// Scratch for chunks of up to n tokens.
static void size_scratch(Dsv4CudaEngine::Impl& m, const Dsv4Config& c, int64_t n) {
  if (n <= m.cap) return;
  const size_t N = static_cast<size_t>(n);
  const int64_t H = c.hidden, hd = c.head_dim, K = c.experts_per_tok, I = c.moe_inter;
  const int64_t S = c.moe_inter * c.n_shared_experts, E = c.n_routed_experts;
  const int64_t ih = c.index_n_heads, ihd = c.index_head_dim;
  m.ids.alloc(N * 4);
  m.h.alloc(N * c.hc_mult * H * 2);
  m.x.alloc(N * H * 2), m.y.alloc(N * H * 2);
  m.mix.alloc(N * cuda::hc_mix_floats(c.hc_mult) * 4);
  m.qr.alloc(N * c.q_lora_rank * 2);
  m.q.alloc(N * c.heads * hd * 2), m.attn.alloc(N * c.heads * hd * 2);
  m.kv.alloc(N * hd * 2);
  m.mid.alloc(N * c.o_groups * c.o_lora_rank * 2);
  m.ckv.alloc(N * 2 * hd * 2), m.cgate.alloc(N * 2 * hd * 2);
  m.ikv.alloc(N * 2 * ihd * 2), m.igate.alloc(N * 2 * ihd * 2);
  m.iq.alloc(N * ih * ihd * 2), m.iw.alloc(N * ih * 2);
  m.lk.alloc((N + static_cast<size_t>(c.sliding_window)) * hd * 2);
  m.topk.alloc(N * std::max<int64_t>(1, c.index_topk) * 4);
  std::vector<uint8_t> hp(N / 4 + 2, 1);
  hp[0] = 0;
  m.has_prev.alloc(hp.size()), put(m.has_prev, hp.data(), hp.size());
  m.logits.alloc(N * E * 2);
  m.inds.alloc(N * K * 4), m.weights.alloc(N * K * 4);
  m.counts.alloc(static_cast<size_t>(E) * 4), m.offsets.alloc(static_cast<size_t>(E + 1) * 4);
  m.perm.alloc(N * K * 4), m.slot_row.alloc(N * K * 4);
  // FP8 GEMM outputs run up to 15 rows past their inputs (fp8_linear): slack for them.
  const size_t P = m.fp8 ? 16 : 0;
  m.xe.alloc(N * K * H * 2), m.ye.alloc((N * K + P) * H * 2);
  m.gu.alloc((N * K + P) * 2 * I * 2), m.act.alloc(N * K * I * 2);
  if (S > 0) m.sgu.alloc((N + P) * 2 * S * 2), m.sact.alloc(N * S * 2), m.sh.alloc((N + P) * H * 2);
  if (m.fp8) {  // every expert's rows, each padded to 16 (or the shared expert's n rows)
    const int64_t widest = std::max({H, I, S});
    const size_t R = static_cast<size_t>(cuda::fp8_act_rows(n * K) + 16 * E);
    m.act_q.alloc(R * static_cast<size_t>(widest));
    m.act_scale.alloc(R * static_cast<size_t>(cuda::fp8_blocks(widest)) * 4);
    for (auto& lane : m.lanes)
      lane.spill.alloc(static_cast<size_t>(cuda::fp8_act_rows(n) * std::max(2 * I, H)) * 2);
  }
  m.cap = n;
}

Status Dsv4CudaEngine::prefill_chunk(const std::vector<int32_t>& ids,
                                     const AttentionInputTap& tap) {
  const Dsv4Config& c = config_;
  HETERO_RETURN_IF_ERROR(check_token_ids(ids, c.vocab));
  Impl& m = *impl_;
  HETERO_RETURN_IF_ERROR(m.init);
  if (ids.empty()) return Status::ok();
  cudaStream_t st = m.stream;
  const int64_t n = static_cast<int64_t>(ids.size()), pos0 = n_cached_, H = c.hidden;
  const float eps = static_cast<float>(c.rms_norm_eps);
  size_scratch(m, c, n);
  HETERO_CUDA_OK(cudaMemcpyAsync(m.ids.p, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice, st));
  cuda::embed_rows(m.embed.bf(), m.ids.as<int32_t>(), n, c.hc_mult, H, m.h.bf(), st);

  for (int64_t l = 0; l < c.layers; ++l) {
    const DLayer& L = m.layers[static_cast<size_t>(l)];
    auto hc = [&](const DHc& d) {
      return cuda::HcParams{d.fn.f32(),
                            d.base.f32(),
                            d.scale.f32(),
                            c.hc_mult,
                            H,
                            c.hc_sinkhorn_iters,
                            static_cast<float>(c.hc_eps),
                            eps};
    };
    const cuda::HcParams ha = hc(L.hc_attn), hf = hc(L.hc_ffn);
    m.timer.mark(st, "hyper-connections + norms");
    cuda::hc_collapse(ha, m.h.bf(), n, m.mix.f32(), m.x.bf(), st);
    cuda::fast_rms_norm(m.x.bf(), n, H, L.attn_norm.bf(), eps, m.x.bf(), st);
    if (tap) {
      TapEvent ev{static_cast<int32_t>(l), pos0, n, H, nullptr, m.x.bf(), st};
      if (options_.host_tap) {
        m.host_x.resize(static_cast<size_t>(n * H));
        HETERO_CUDA_OK(cudaMemcpyAsync(m.host_x.data(), m.x.p, m.host_x.size() * 2,
                                       cudaMemcpyDeviceToHost, st));
        HETERO_CUDA_OK(cudaStreamSynchronize(st));
        ev.x_bf16 = m.host_x.data();
      }
      tap(ev);
    }
    if (l == c.layers - 1 && !full_forward_) break;
    attention(m, c, l, n, pos0);
    m.timer.mark(st, "hyper-connections + norms");
    cuda::hc_expand(ha, m.mix.f32(), m.y.bf(), n, m.h.bf(), st);
    cuda::hc_collapse(hf, m.h.bf(), n, m.mix.f32(), m.x.bf(), st);
    cuda::fast_rms_norm(m.x.bf(), n, H, L.ffn_norm.bf(), eps, m.x.bf(), st);
    HETERO_RETURN_IF_ERROR(moe(m, c, l, n));
    m.timer.mark(st, "hyper-connections + norms");
    cuda::hc_expand(hf, m.mix.f32(), m.y.bf(), n, m.h.bf(), st);
  }
  m.timer.mark(st, "end");
  m.timer.collect(st);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return internal_error(std::string("CUDA: ") + cudaGetErrorString(e));
  n_cached_ += n;
  return Status::ok();
}

}  // namespace hetero
