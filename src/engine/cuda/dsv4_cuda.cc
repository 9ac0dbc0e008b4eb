// The DeepSeek-V4 forward on CUDA: the engine's weights, per-layer state, admission (reserve) and
// the chunk loop. See dsv4_cuda.h for the contract and dsv4_cuda_layers.cc for a layer's
// attention and MoE; the CPU engine (engine/dsv4_cpu.cc) is the reference for every step.
#include "engine/cuda/dsv4_cuda.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/bf16.h"
#include "engine/cuda/dsv4_cuda_impl.h"
#include "kernels/cuda/dsv4_fwd_ops.h"

namespace hetero {

using namespace dsv4_cuda;

namespace {

// How a buffer is drawn for random weights.
enum class Init { kMatrix, kNorm, kSmall, kHcScale, kSink, kExpertId };
struct Spec {
  cuda::DeviceBuffer* buf;
  int64_t count;
  int elem_bytes;
  Init init;
  int64_t fan_in;
  DFp8* fp8 = nullptr;  // an expert weight: its FP8 form, matrices of [rows, cols]
  int64_t rows = 0, cols = 0;
  Spec(cuda::DeviceBuffer* b, int64_t n, int eb, Init i, int64_t fi, DFp8* f = nullptr,
       int64_t r = 0, int64_t c = 0)
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

// Host bytes into a weight's buffer, which layer_specs sized from the config: a checkpoint whose
// tensor disagrees with its own config is refused.
Status put(cuda::DeviceBuffer& b, const void* src, size_t bytes) {
  if (bytes != b.bytes())
    return failed_precondition("a weight of " + std::to_string(bytes) +
                               " bytes where the config says " + std::to_string(b.bytes()));
  HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.get(), src, bytes, cudaMemcpyHostToDevice));
  return Status::ok();
}
Status put(cuda::DeviceBuffer& b, const Tensor& t) {
  return put(b, t.bytes.data(), t.bytes.size());
}
Status put(cuda::DeviceBuffer& b, const std::vector<float>& v) {
  return put(b, v.data(), v.size() * sizeof(float));
}
Status put_hc(DHc& d, const Dsv4HyperConnection& hc) {
  HETERO_RETURN_IF_ERROR(put(d.fn, hc.fn));
  HETERO_RETURN_IF_ERROR(put(d.base, hc.base));
  return put(d.scale, hc.scale);
}
Status put_comp(DComp& d, const Dsv4Compressor& cm) {
  HETERO_RETURN_IF_ERROR(put(d.wkv, cm.wkv));
  HETERO_RETURN_IF_ERROR(put(d.wgate, cm.wgate));
  HETERO_RETURN_IF_ERROR(put(d.ape, cm.ape));
  return put(d.norm, cm.norm);
}

// A cuBLAS handle on `stream`, with no bf16 reductions inside split-k: every sum stays float32.
Result<cuda::BlasHandle> blas_on(cudaStream_t stream) {
  HETERO_ASSIGN_OR_RETURN(cuda::BlasHandle h, cuda::BlasHandle::create(stream));
  HETERO_CUDA_RETURN_IF_ERROR(cublasSetMathMode(
      h.get(), static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                         CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  return h;
}

// A ratio-r compressor's rows in a sequence of `tokens` tokens (every complete window).
int64_t pooled_rows_for(int64_t tokens, int64_t ratio) { return ratio > 0 ? tokens / ratio : 0; }

}  // namespace

// ---------------------------------------------------------------------------------- internals

namespace dsv4_cuda {

Status PhaseTimer::mark(cudaStream_t st, const char* phase) {
  if (!on) return Status::ok();
  int tag = 0;
  while (tag < static_cast<int>(names.size()) && names[static_cast<size_t>(tag)] != phase) ++tag;
  if (tag == static_cast<int>(names.size())) names.emplace_back(phase), ms.push_back(0);
  if (used == events.size()) {
    HETERO_ASSIGN_OR_RETURN(cuda::Event e, cuda::Event::create(/*timing=*/true));
    events.push_back(std::move(e)), tags.push_back(0);
  }
  HETERO_CUDA_RETURN_IF_ERROR(cudaEventRecord(events[used].get(), st));
  tags[used++] = tag;
  return Status::ok();
}

Status PhaseTimer::collect(cudaStream_t st) {
  if (!on || used == 0) return Status::ok();
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
  for (size_t i = 0; i + 1 < used; ++i) {
    float t = 0;
    HETERO_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&t, events[i].get(), events[i + 1].get()));
    ms[static_cast<size_t>(tags[i])] += t;
  }
  used = 0;
  return Status::ok();
}

}  // namespace dsv4_cuda

Dsv4CudaEngine::Impl::~Impl() {
  // Buffers are freed below while lanes may still run the last chunk's experts.
  for (Lane& l : lanes)
    if (l.stream.get()) cudaStreamSynchronize(l.stream.get());
  if (stream.get()) cudaStreamSynchronize(stream.get());
}

Status Dsv4CudaEngine::Impl::alloc(cuda::DeviceBuffer& b, size_t bytes, const char* what) {
  if (b) {
    // Work still queued on the engine's streams may read the old allocation.
    for (Lane& l : lanes) HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(l.stream.get()));
    HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream.get()));
  }
  return b.allocate(bytes, what, &budget);
}

Status Dsv4CudaEngine::Impl::ensure(cuda::DeviceBuffer& b, size_t bytes, const char* what) {
  if (bytes <= b.bytes()) return Status::ok();
  const Status grown = alloc(b, std::max(bytes, b.bytes() + b.bytes() / 2), what);
  if (grown.code() != Code::kResourceExhausted) return grown;
  return alloc(b, bytes, what);
}

// ---------------------------------------------------------------------------------- creation

Dsv4CudaEngine::Dsv4CudaEngine(const Dsv4Config& config, const Dsv4CudaOptions& options)
    : config_(config),
      options_(options),
      impl_(std::make_unique<Impl>(options.device_memory_budget_bytes)) {}

Dsv4CudaEngine::~Dsv4CudaEngine() = default;

Status Dsv4CudaEngine::init() {
  const Dsv4Config& c = config_;
  Impl& m = *impl_;
  const size_t E = static_cast<size_t>(c.n_routed_experts);
  HETERO_ASSIGN_OR_RETURN(m.stream, cuda::Stream::create());
  HETERO_ASSIGN_OR_RETURN(m.blas, blas_on(m.stream.get()));
  HETERO_RETURN_IF_ERROR(m.host_offsets.allocate(sizeof(int32_t) * (E + 1), "expert row offsets"));
  HETERO_RETURN_IF_ERROR(m.host_ptrs.allocate(sizeof(void*) * 6 * E, "grouped GEMM pointers"));
  HETERO_RETURN_IF_ERROR(m.alloc(m.dev_ptrs, sizeof(void*) * 6 * E, "grouped GEMM pointers"));
  m.grouped = options_.grouped_experts;
  m.timer.on = options_.phase_timing;
  m.online_only = options_.online_softmax_attention;
  m.fp8 = options_.weight_dtype == cuda::WeightDtype::kFp8;
  if (options_.expert_streams > 1) {
    HETERO_ASSIGN_OR_RETURN(m.fork, cuda::Event::create());
    m.lanes.resize(static_cast<size_t>(options_.expert_streams));
    for (Impl::Lane& lane : m.lanes) {
      HETERO_ASSIGN_OR_RETURN(lane.stream, cuda::Stream::create());
      HETERO_ASSIGN_OR_RETURN(lane.done, cuda::Event::create());
      HETERO_ASSIGN_OR_RETURN(lane.blas, blas_on(lane.stream.get()));
    }
  }
  if (m.fp8) {
    HETERO_RETURN_IF_ERROR(m.host_pad.allocate(sizeof(int32_t) * (E + 1), "expert row padding"));
    HETERO_RETURN_IF_ERROR(m.alloc(m.pad, sizeof(int32_t) * (E + 1), "expert row padding"));
    HETERO_ASSIGN_OR_RETURN(m.fp8_gemm, cuda::Fp8Gemm::create(&m.budget));
    for (Impl::Lane& lane : m.lanes) {
      HETERO_ASSIGN_OR_RETURN(lane.fp8, cuda::Fp8Gemm::create(&m.budget));
    }
    // Ask cuBLASLt for every expert shape now: one it refuses fails the engine, not a chunk.
    const int64_t I = c.moe_inter, S = c.moe_inter * c.n_shared_experts, H = c.hidden;
    for (auto [n, k] : {std::pair{2 * I, H}, std::pair{H, I}, std::pair{2 * S, H}, std::pair{H, S}})
      if (n > 0 && k > 0) HETERO_RETURN_IF_ERROR(m.fp8_gemm->prepare(16, n, k));
  }

  const std::vector<float> lf =
      dsv4_rope_freqs(static_cast<int>(c.rope_head_dim), c.rope_theta, YarnScaling{});
  const std::vector<float> cf =
      dsv4_rope_freqs(static_cast<int>(c.rope_head_dim), c.compress_rope_theta, c.yarn);
  m.rope_pairs = static_cast<int64_t>(lf.size());
  HETERO_RETURN_IF_ERROR(m.alloc(m.local_freqs, lf.size() * 4, "rope frequencies"));
  HETERO_RETURN_IF_ERROR(put(m.local_freqs, lf));
  HETERO_RETURN_IF_ERROR(m.alloc(m.compress_freqs, cf.size() * 4, "rope frequencies"));
  HETERO_RETURN_IF_ERROR(put(m.compress_freqs, cf));
  HETERO_RETURN_IF_ERROR(
      m.alloc(m.embed, static_cast<size_t>(c.vocab * c.hidden) * 2, "the embedding"));
  weight_bytes_ = static_cast<int64_t>(m.embed.bytes());
  m.layers.resize(static_cast<size_t>(c.layers));
  for (int64_t l = 0; l < c.layers; ++l) {
    DLayer& L = m.layers[static_cast<size_t>(l)];
    L.ratio = c.compress_ratios[static_cast<size_t>(l)];
    for (const Spec& s : layer_specs(L, c, l)) {
      if (s.fp8 && m.fp8) {
        DFp8& f = *s.fp8;
        f.n = s.rows, f.k = s.cols, f.mats = s.count / (s.rows * s.cols);
        HETERO_RETURN_IF_ERROR(m.alloc(f.q, static_cast<size_t>(s.count), "FP8 expert weights"));
        HETERO_RETURN_IF_ERROR(m.alloc(f.scale, static_cast<size_t>(f.mats * f.scale_floats()) * 4,
                                       "FP8 expert weight scales"));
        weight_bytes_ += static_cast<int64_t>(f.q.bytes() + f.scale.bytes());
        continue;
      }
      HETERO_RETURN_IF_ERROR(
          m.alloc(*s.buf, static_cast<size_t>(s.count) * s.elem_bytes, "the weights"));
      weight_bytes_ += static_cast<int64_t>(s.buf->bytes());
    }
  }
  return reset();
}

Status Dsv4CudaEngine::upload(const Dsv4Weights& w) {
  const Dsv4Config& c = config_;
  Impl& m = *impl_;
  cudaStream_t st = m.stream.get();
  HETERO_RETURN_IF_ERROR(put(m.embed, w.embed));
  const int64_t E = c.n_routed_experts, I = c.moe_inter, H = c.hidden;
  for (int64_t l = 0; l < c.layers; ++l) {
    DLayer& D = m.layers[static_cast<size_t>(l)];
    const Dsv4LayerWeights& L = w.layers[static_cast<size_t>(l)];
    const std::pair<cuda::DeviceBuffer*, const Tensor*> plain[] = {
        {&D.attn_norm, &L.attn_norm}, {&D.ffn_norm, &L.ffn_norm},
        {&D.wq_a, &L.wq_a},           {&D.q_norm, &L.q_norm},
        {&D.wq_b, &L.wq_b},           {&D.wkv, &L.wkv},
        {&D.kv_norm, &L.kv_norm},     {&D.wo_a, &L.wo_a},
        {&D.wo_b, &L.wo_b},           {&D.gate, &L.gate}};
    for (auto [dst, src] : plain) HETERO_RETURN_IF_ERROR(put(*dst, *src));
    HETERO_RETURN_IF_ERROR(put_hc(D.hc_attn, L.hc_attn));
    HETERO_RETURN_IF_ERROR(put_hc(D.hc_ffn, L.hc_ffn));
    if (D.wo_b_bias) HETERO_RETURN_IF_ERROR(put(D.wo_b_bias, L.wo_b_bias));
    std::vector<float> sinks(L.attn_sink.size());  // the decoder adds them as bf16
    for (size_t i = 0; i < sinks.size(); ++i) sinks[i] = round_bf16(L.attn_sink[i]);
    HETERO_RETURN_IF_ERROR(put(D.sinks, sinks));
    if (D.ratio > 0) HETERO_RETURN_IF_ERROR(put_comp(D.comp, L.compressor));
    if (D.ratio == 4) {
      HETERO_RETURN_IF_ERROR(put_comp(D.icomp, L.index_compressor));
      HETERO_RETURN_IF_ERROR(put(D.idx_wq_b, L.index_wq_b));
      HETERO_RETURN_IF_ERROR(put(D.idx_wproj, L.index_weights_proj));
    }
    if (D.tid2eid) HETERO_RETURN_IF_ERROR(put(D.tid2eid, L.tid2eid.data(), L.tid2eid.size() * 4));
    if (D.gate_bias) HETERO_RETURN_IF_ERROR(put(D.gate_bias, L.gate_bias));
    const size_t mat = static_cast<size_t>(I * H) * 2;
    if (m.fp8) {
      // Each expert's bf16 weights through one scratch buffer into their FP8 form, in the
      // stream's order (the scratch is refilled only once the quantizer has read it).
      cuda::DeviceBuffer tmp;
      HETERO_RETURN_IF_ERROR(tmp.allocate(2 * std::max(mat, L.shared_w1.bytes.size()),
                                          "expert weights before quantization", &m.budget));
      auto up = [&](const Tensor& t, size_t at) -> Status {
        HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(tmp.get<uint8_t>() + at, t.bytes.data(),
                                                    t.bytes.size(), cudaMemcpyHostToDevice, st));
        return Status::ok();
      };
      for (int64_t e = 0; e < E; ++e) {
        const size_t i = static_cast<size_t>(e);
        HETERO_RETURN_IF_ERROR(up(L.w1[i], 0));
        HETERO_RETURN_IF_ERROR(up(L.w3[i], mat));
        D.w13_8.quantize_one(bf(tmp), e, st);
        HETERO_RETURN_IF_ERROR(up(L.w2[i], 0));
        D.w2_8.quantize_one(bf(tmp), e, st);
      }
      if (D.sh_w13_8.mats > 0) {
        HETERO_RETURN_IF_ERROR(up(L.shared_w1, 0));
        HETERO_RETURN_IF_ERROR(up(L.shared_w3, L.shared_w1.bytes.size()));
        D.sh_w13_8.quantize(bf(tmp), st);
        HETERO_RETURN_IF_ERROR(up(L.shared_w2, 0));
        D.sh_w2_8.quantize(bf(tmp), st);
      }
      HETERO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
      HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
      continue;
    }
    for (int64_t e = 0; e < E; ++e) {
      const size_t i = static_cast<size_t>(e), at = i * 2 * mat;
      uint8_t* w13 = D.w13.get<uint8_t>();
      HETERO_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(w13 + at, L.w1[i].bytes.data(), mat, cudaMemcpyHostToDevice));
      HETERO_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(w13 + at + mat, L.w3[i].bytes.data(), mat, cudaMemcpyHostToDevice));
      HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpy(D.w2.get<uint8_t>() + i * mat, L.w2[i].bytes.data(),
                                             mat, cudaMemcpyHostToDevice));
    }
    if (D.sh_w13) {
      const size_t half = L.shared_w1.bytes.size();
      HETERO_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(D.sh_w13.get(), L.shared_w1.bytes.data(), half, cudaMemcpyHostToDevice));
      HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpy(
          D.sh_w13.get<uint8_t>() + half, L.shared_w3.bytes.data(), half, cudaMemcpyHostToDevice));
      HETERO_RETURN_IF_ERROR(put(D.sh_w2, L.shared_w2));
    }
  }
  return Status::ok();
}

Status Dsv4CudaEngine::fill_random(uint64_t seed) {
  Impl& m = *impl_;
  const Dsv4Config& c = config_;
  cudaStream_t st = m.stream.get();
  cuda::fill_random_bf16(bf(m.embed), c.vocab * c.hidden, 1.0f, seed, st);
  uint64_t k = seed * 1000;
  cuda::DeviceBuffer scratch;  // FP8 experts: one layer's bf16 draw at a time
  for (int64_t l = 0; l < c.layers; ++l) {
    for (const Spec& s : layer_specs(m.layers[static_cast<size_t>(l)], c, l)) {
      ++k;
      switch (s.init) {
        case Init::kMatrix: {
          const float sc = 1.0f / std::sqrt(static_cast<float>(s.fan_in));
          if (s.fp8 && m.fp8) {  // drawn in bf16 into scratch, then quantized
            HETERO_RETURN_IF_ERROR(
                m.ensure(scratch, static_cast<size_t>(s.count) * 2, "random expert weights"));
            cuda::fill_random_bf16(bf(scratch), s.count, sc, k, st);
            s.fp8->quantize(bf(scratch), st);
          } else if (s.elem_bytes == 2) {
            cuda::fill_random_bf16(bf(*s.buf), s.count, sc, k, st);
          } else {
            cuda::fill_random_f32(f32(*s.buf), s.count, sc, 0.0f, k, st);
          }
          break;
        }
        case Init::kNorm:
          cuda::fill_random_bf16(bf(*s.buf), s.count, 0.1f, k, st);  // then + 1 below
          break;
        case Init::kSmall:
          if (s.elem_bytes == 2)
            cuda::fill_random_bf16(bf(*s.buf), s.count, 0.1f, k, st);
          else
            cuda::fill_random_f32(f32(*s.buf), s.count, 0.1f, 0.0f, k, st);
          break;
        case Init::kHcScale:
          cuda::fill_random_f32(f32(*s.buf), s.count, 0.1f, 1.0f, k, st);
          break;
        case Init::kSink:
          cuda::fill_random_f32(f32(*s.buf), s.count, 1.0f, 0.0f, k, st);
          break;
        case Init::kExpertId:
          cuda::fill_random_i32(s.buf->get<int32_t>(), s.count,
                                static_cast<int32_t>(c.n_routed_experts), k, st);
          break;
      }
    }
  }
  HETERO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  // Norm weights near one: fill 1 + N(0, 0.1) by adding one on the host side of a small copy.
  for (int64_t l = 0; l < c.layers; ++l)
    for (const Spec& s : layer_specs(m.layers[static_cast<size_t>(l)], c, l)) {
      if (s.init != Init::kNorm) continue;
      std::vector<uint16_t> v(static_cast<size_t>(s.count));
      HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
      HETERO_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(v.data(), s.buf->get(), v.size() * 2, cudaMemcpyDeviceToHost));
      for (auto& x : v) x = f32_to_bf16(1.0f + bf16_to_f32(x));
      HETERO_RETURN_IF_ERROR(put(*s.buf, v.data(), v.size() * 2));
    }
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
  return Status::ok();
}

Result<std::unique_ptr<Dsv4CudaEngine>> Dsv4CudaEngine::create(const Dsv4Weights& w,
                                                               const Dsv4CudaOptions& options) {
  HETERO_RETURN_IF_ERROR(check_options(w.config, options));
  std::unique_ptr<Dsv4CudaEngine> e(new Dsv4CudaEngine(w.config, options));
  HETERO_RETURN_IF_ERROR(e->init());
  HETERO_RETURN_IF_ERROR(e->upload(w));
  return e;
}

Result<std::unique_ptr<Dsv4CudaEngine>> Dsv4CudaEngine::random(const Dsv4Config& config,
                                                               uint64_t seed,
                                                               const Dsv4CudaOptions& options) {
  HETERO_RETURN_IF_ERROR(check_options(config, options));
  std::unique_ptr<Dsv4CudaEngine> e(new Dsv4CudaEngine(config, options));
  HETERO_RETURN_IF_ERROR(e->init());
  HETERO_RETURN_IF_ERROR(e->fill_random(seed));
  return e;
}

Result<std::unique_ptr<Dsv4CudaEngine>> Dsv4CudaEngine::load(const std::string& model_dir,
                                                             const Dsv4CudaOptions& options) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return failed_precondition("no CUDA device for the DeepSeek-V4 CUDA engine");
  }
  HETERO_ASSIGN_OR_RETURN(Dsv4Weights w, load_dsv4_weights(model_dir));
  return create(w, options);
}

Status Dsv4CudaEngine::check_options(const Dsv4Config& c, const Dsv4CudaOptions& options) {
  if (options.expert_streams < 1 || options.expert_streams > 16)
    return invalid_argument("expert_streams must be 1..16, not " +
                            std::to_string(options.expert_streams));
  if (options.expert_streams > 1 && options.grouped_experts)
    return invalid_argument("grouped_experts runs every expert in one call: expert_streams 1");
  if (options.device_memory_budget_bytes < 0)
    return invalid_argument("the device-memory budget must be >= 0 bytes");
  HETERO_RETURN_IF_ERROR(
      cuda::check_forward_shapes(c.hidden, c.hc_mult, c.n_routed_experts, c.experts_per_tok));
  HETERO_RETURN_IF_ERROR(cuda::check_attention_shapes(c.head_dim, c.index_n_heads));
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
  HETERO_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  return cuda::check_fp8_device(device);
}

// ---------------------------------------------------------------------------------- sequence

void* Dsv4CudaEngine::stream() const { return impl_->stream.get(); }

int64_t Dsv4CudaEngine::device_bytes() const { return impl_->budget.used_bytes(); }

std::vector<std::pair<std::string, double>> Dsv4CudaEngine::phase_ms() const {
  std::vector<std::pair<std::string, double>> out;
  const PhaseTimer& t = impl_->timer;
  for (size_t i = 0; i < t.names.size(); ++i)
    if (t.names[i] != "end") out.emplace_back(t.names[i], t.ms[i]);
  return out;
}

Status Dsv4CudaEngine::synchronize() {
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(impl_->stream.get()));
  return Status::ok();
}

Status Dsv4CudaEngine::reset() {
  const Dsv4Config& c = config_;
  Impl& m = *impl_;
  n_cached_ = 0;
  // The previous sequence's work (a failed chunk's lanes too) is done before its state is reused.
  for (Impl::Lane& l : m.lanes) HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(l.stream.get()));
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.stream.get()));
  m.state.resize(m.layers.size());
  for (size_t i = 0; i < m.layers.size(); ++i) {
    DState& s = m.state[i];
    const DLayer& L = m.layers[i];
    s.tail_rows = 0;
    if (!s.tail)
      HETERO_RETURN_IF_ERROR(m.alloc(
          s.tail, static_cast<size_t>(std::max<int64_t>(1, c.sliding_window) * c.head_dim) * 2,
          "the local window"));
    auto init = [&](DPool& p, const DComp& cm) -> Status {
      p.ratio = cm.ratio, p.width = cm.out_dim, p.head_dim = cm.head_dim;
      p.remainder = 0, p.rows = 0;
      if (p.buf_kv) return Status::ok();
      const size_t bytes = static_cast<size_t>(p.ratio * p.width) * 2;
      HETERO_RETURN_IF_ERROR(m.alloc(p.buf_kv, bytes, "a compressor's pending rows"));
      return m.alloc(p.buf_gate, bytes, "a compressor's pending rows");
    };
    if (L.ratio > 0) HETERO_RETURN_IF_ERROR(init(s.pool, L.comp));
    if (L.ratio == 4) HETERO_RETURN_IF_ERROR(init(s.ipool, L.icomp));
  }
  return Status::ok();
}

void Dsv4CudaEngine::release_sequence_memory() {
  Impl& m = *impl_;
  // After a failed reservation, which began with reset(): no queued work reads these.
  for (cuda::DeviceBuffer* b :
       {&m.ids,      &m.h,      &m.x,        &m.y,        &m.mix,        &m.qr,      &m.q,
        &m.attn,     &m.kv,     &m.mid,      &m.ckv,      &m.cgate,      &m.ikv,     &m.igate,
        &m.iq,       &m.iw,     &m.lk,       &m.stage_kv, &m.stage_gate, &m.topk,    &m.rep,
        &m.has_prev, &m.logits, &m.inds,     &m.weights,  &m.counts,     &m.offsets, &m.perm,
        &m.slot_row, &m.xe,     &m.gu,       &m.act,      &m.ye,         &m.sgu,     &m.sact,
        &m.sh,       &m.act_q,  &m.act_scale})
    b->reset();
  for (Impl::Lane& l : m.lanes) l.spill.reset();
  for (DState& s : m.state) s.pool.pooled.reset(), s.ipool.pooled.reset();
  m.cap = 0;
}

Status Dsv4CudaEngine::reserve(int64_t tokens, int64_t max_chunk_tokens) {
  const Dsv4Config& c = config_;
  Impl& m = *impl_;
  HETERO_RETURN_IF_ERROR(reset());
  if (tokens <= 0) return Status::ok();
  const int64_t chunk = std::clamp<int64_t>(max_chunk_tokens, 1, tokens);
  // The indexer's selection over the longest prompt's compressed rows (the last call's).
  const int64_t Np = pooled_rows_for(tokens, 4);
  if (c.index_topk > 0 && Np > c.index_topk &&
      std::find(c.compress_ratios.begin(), c.compress_ratios.end(), 4) != c.compress_ratios.end()) {
    const bool hisa = c.index_block > 0 && Np >= c.index_block * c.index_keep &&
                      c.index_keep * c.index_block >= c.index_topk;
    HETERO_RETURN_IF_ERROR(
        cuda::check_index_select(Np, hisa ? c.index_block : 0, hisa ? c.index_keep : 0));
  }
  auto take = [&]() -> Status {
    HETERO_RETURN_IF_ERROR(size_scratch(chunk));
    int64_t stage = 0;  // a compressor's staged rows: the chunk plus a window's pending rows
    for (size_t i = 0; i < m.layers.size(); ++i) {
      DState& s = m.state[i];
      for (DPool* p : {&s.pool, &s.ipool}) {
        if (p->ratio == 0) continue;
        HETERO_RETURN_IF_ERROR(
            reserve_rows(m, *p, pooled_rows_for(tokens, p->ratio), m.stream.get()));
        stage = std::max(stage, (chunk + p->ratio) * p->width * 2);
      }
    }
    HETERO_RETURN_IF_ERROR(m.ensure(m.stage_kv, static_cast<size_t>(stage), "compressor staging"));
    HETERO_RETURN_IF_ERROR(
        m.ensure(m.stage_gate, static_cast<size_t>(stage), "compressor staging"));
    if (c.index_block > 0)
      HETERO_RETURN_IF_ERROR(
          m.ensure(m.rep, static_cast<size_t>(Np / c.index_block * c.index_head_dim) * 4,
                   "HISA block means"));
    return Status::ok();
  };
  const Status st = take();
  // Refused: hold no more than after reset(), so the refusal leaves the next request its room.
  if (!st.is_ok()) release_sequence_memory();
  return st;
}

Status Dsv4CudaEngine::set_full_forward(bool on) {
  if (n_cached_ != 0) return failed_precondition("full_forward changes only between sequences");
  full_forward_ = on;
  return Status::ok();
}

// Scratch for chunks of up to n tokens.
Status Dsv4CudaEngine::size_scratch(int64_t n) {
  const Dsv4Config& c = config_;
  Impl& m = *impl_;
  if (n <= m.cap) return Status::ok();
  const size_t N = static_cast<size_t>(n);
  const int64_t H = c.hidden, hd = c.head_dim, K = c.experts_per_tok, I = c.moe_inter;
  const int64_t S = c.moe_inter * c.n_shared_experts, E = c.n_routed_experts;
  const int64_t ih = c.index_n_heads, ihd = c.index_head_dim;
  // FP8 GEMM outputs run up to 15 rows past their inputs (fp8_linear): slack for them.
  const size_t P = m.fp8 ? 16 : 0;
  const size_t window = static_cast<size_t>(c.sliding_window);
  std::vector<uint8_t> hp(N / 4 + 2, 1);
  hp[0] = 0;
  const struct {
    cuda::DeviceBuffer* b;
    size_t bytes;
  } want[] = {{&m.ids, N * 4},
              {&m.h, N * c.hc_mult * H * 2},
              {&m.x, N * H * 2},
              {&m.y, N * H * 2},
              {&m.mix, N * cuda::hc_mix_floats(c.hc_mult) * 4},
              {&m.qr, N * c.q_lora_rank * 2},
              {&m.q, N * c.heads * hd * 2},
              {&m.attn, N * c.heads * hd * 2},
              {&m.kv, N * hd * 2},
              {&m.mid, N * c.o_groups * c.o_lora_rank * 2},
              {&m.ckv, N * 2 * hd * 2},
              {&m.cgate, N * 2 * hd * 2},
              {&m.ikv, N * 2 * ihd * 2},
              {&m.igate, N * 2 * ihd * 2},
              {&m.iq, N * ih * ihd * 2},
              {&m.iw, N * ih * 2},
              {&m.lk, (N + window) * hd * 2},
              {&m.topk, N * std::max<int64_t>(1, c.index_topk) * 4},
              {&m.has_prev, hp.size()},
              {&m.logits, N * E * 2},
              {&m.inds, N * K * 4},
              {&m.weights, N * K * 4},
              {&m.counts, static_cast<size_t>(E) * 4},
              {&m.offsets, static_cast<size_t>(E + 1) * 4},
              {&m.perm, N * K * 4},
              {&m.slot_row, N * K * 4},
              {&m.xe, N * K * H * 2},
              {&m.ye, (N * K + P) * H * 2},
              {&m.gu, (N * K + P) * 2 * I * 2},
              {&m.act, N * K * I * 2},
              {&m.sgu, S > 0 ? (N + P) * 2 * S * 2 : 0},
              {&m.sact, S > 0 ? N * S * 2 : 0},
              {&m.sh, S > 0 ? (N + P) * H * 2 : 0}};
  m.cap = 0;  // until every buffer below holds n rows
  for (const auto& w : want) HETERO_RETURN_IF_ERROR(m.alloc(*w.b, w.bytes, "chunk scratch"));
  HETERO_RETURN_IF_ERROR(put(m.has_prev, hp.data(), hp.size()));
  if (m.fp8) {  // every expert's rows, each padded to 16 (or the shared expert's n rows)
    const int64_t widest = std::max({H, I, S});
    const size_t R = static_cast<size_t>(cuda::fp8_act_rows(n * K) + 16 * E);
    HETERO_RETURN_IF_ERROR(m.alloc(m.act_q, R * static_cast<size_t>(widest), "FP8 expert inputs"));
    HETERO_RETURN_IF_ERROR(m.alloc(
        m.act_scale, R * static_cast<size_t>(cuda::fp8_blocks(widest)) * 4, "FP8 expert inputs"));
    for (auto& lane : m.lanes)
      HETERO_RETURN_IF_ERROR(
          m.alloc(lane.spill, static_cast<size_t>(cuda::fp8_act_rows(n) * std::max(2 * I, H)) * 2,
                  "expert stream output"));
  }
  m.cap = n;
  return Status::ok();
}

Status Dsv4CudaEngine::prefill_chunk(const std::vector<int32_t>& ids,
                                     const AttentionInputTap& tap) {
  const Dsv4Config& c = config_;
  HETERO_RETURN_IF_ERROR(check_token_ids(ids, c.vocab));
  Impl& m = *impl_;
  if (ids.empty()) return Status::ok();
  cudaStream_t st = m.stream.get();
  const int64_t n = static_cast<int64_t>(ids.size()), pos0 = n_cached_, H = c.hidden;
  const float eps = static_cast<float>(c.rms_norm_eps);
  HETERO_RETURN_IF_ERROR(size_scratch(n));
  HETERO_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(m.ids.get(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice, st));
  cuda::embed_rows(bf(m.embed), m.ids.get<int32_t>(), n, c.hc_mult, H, bf(m.h), st);

  for (int64_t l = 0; l < c.layers; ++l) {
    const DLayer& L = m.layers[static_cast<size_t>(l)];
    auto hc = [&](const DHc& d) {
      return cuda::HcParams{f32(d.fn),
                            f32(d.base),
                            f32(d.scale),
                            c.hc_mult,
                            H,
                            c.hc_sinkhorn_iters,
                            static_cast<float>(c.hc_eps),
                            eps};
    };
    const cuda::HcParams ha = hc(L.hc_attn), hf = hc(L.hc_ffn);
    HETERO_RETURN_IF_ERROR(m.timer.mark(st, "hyper-connections + norms"));
    cuda::hc_collapse(ha, bf(m.h), n, f32(m.mix), bf(m.x), st);
    cuda::fast_rms_norm(bf(m.x), n, H, bf(L.attn_norm), eps, bf(m.x), st);
    if (tap) {
      TapEvent ev{static_cast<int32_t>(l), pos0, n, H, nullptr, bf(m.x), st};
      if (options_.host_tap) {
        m.host_x.resize(static_cast<size_t>(n * H));
        HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(m.host_x.data(), m.x.get(), m.host_x.size() * 2,
                                                    cudaMemcpyDeviceToHost, st));
        HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
        ev.x_bf16 = m.host_x.data();
      }
      tap(ev);
    }
    if (l == c.layers - 1 && !full_forward_) break;
    HETERO_RETURN_IF_ERROR(attention(m, c, l, n, pos0));
    HETERO_RETURN_IF_ERROR(m.timer.mark(st, "hyper-connections + norms"));
    cuda::hc_expand(ha, f32(m.mix), bf(m.y), n, bf(m.h), st);
    cuda::hc_collapse(hf, bf(m.h), n, f32(m.mix), bf(m.x), st);
    cuda::fast_rms_norm(bf(m.x), n, H, bf(L.ffn_norm), eps, bf(m.x), st);
    HETERO_RETURN_IF_ERROR(moe(m, c, l, n));
    HETERO_RETURN_IF_ERROR(m.timer.mark(st, "hyper-connections + norms"));
    cuda::hc_expand(hf, f32(m.mix), bf(m.y), n, bf(m.h), st);
  }
  HETERO_RETURN_IF_ERROR(m.timer.mark(st, "end"));
  HETERO_RETURN_IF_ERROR(m.timer.collect(st));
  // The kernels' launches report here (a launch error, or an earlier fault that stuck).
  HETERO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  n_cached_ += n;
  return Status::ok();
}

}  // namespace hetero
