// The DeepSeek-V4 forward on CUDA: the engine's weights, per-layer state, admission (reserve) and
// the chunk loop. See dsv4_cuda.h for the contract and dsv4_cuda_layers.cc for a layer's
// attention and MoE; the CPU engine (engine/dsv4_cpu.cc) is the reference for every step.
#include "engine/cuda/dsv4_cuda.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "common/bf16.h"
#include "common/sysmem.h"
#include "engine/cuda/dsv4_cuda_impl.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/dsv4_fwd_ops.h"

namespace hetero {

using namespace dsv4_cuda;

namespace {

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

// Whether the W4A8 kernel takes the routed experts' two projections (w1|w3, w2).
Status w4a8_shapes(const Dsv4Config& c) {
  for (auto [n, k] : {std::pair{2 * c.moe_inter, c.hidden}, std::pair{c.hidden, c.moe_inter}})
    HETERO_RETURN_IF_ERROR(cuda::W4a8GroupedGemm::supports(n, k));
  return Status::ok();
}

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
  HETERO_ASSIGN_OR_RETURN(m.counts_ready, cuda::Event::create());
  HETERO_ASSIGN_OR_RETURN(m.blas, blas_on(m.stream.get()));
  HETERO_RETURN_IF_ERROR(m.host_offsets.allocate(sizeof(int32_t) * (E + 1), "expert row offsets"));
  HETERO_RETURN_IF_ERROR(m.host_ptrs.allocate(sizeof(void*) * 6 * E, "grouped GEMM pointers"));
  HETERO_RETURN_IF_ERROR(m.alloc(m.dev_ptrs, sizeof(void*) * 6 * E, "grouped GEMM pointers"));
  m.grouped = options_.grouped_experts;
  m.timer.on = options_.phase_timing;
  m.online_only = options_.online_softmax_attention;
  m.fp8 = options_.weight_dtype != cuda::WeightDtype::kBf16;
  m.ckpt = options_.weight_dtype == cuda::WeightDtype::kCheckpoint;
  using ExpertGemm = Dsv4CudaOptions::ExpertGemm;
  const ExpertGemm eg = options_.expert_gemm;
  const int64_t I = c.moe_inter, H = c.hidden;
  if (m.fp8 && eg != ExpertGemm::kPerExpert && eg != ExpertGemm::kW4a8 &&
      (eg == ExpertGemm::kGrouped || cuda::fp8_grouped_gemm_available().is_ok())) {
    HETERO_ASSIGN_OR_RETURN(m.grouped_fp8,
                            cuda::Fp8GroupedGemm::create(c.n_routed_experts, &m.budget));
    m.grouped_max_rows = options_.expert_gemm == ExpertGemm::kGrouped
                             ? INT64_MAX
                             : Dsv4CudaOptions::kGroupedMaxMeanRows;
    const int64_t per = std::max(cuda::fp8_blocks(2 * I) * cuda::fp8_blocks(H),
                                 cuda::fp8_blocks(H) * cuda::fp8_blocks(I));
    HETERO_RETURN_IF_ERROR(
        m.alloc(m.scale_t, static_cast<size_t>(c.n_routed_experts * per) * 4, "expert scales"));
  }
  // FP4 experts per chunk through the W4A8 kernel: every chunk where asked (check_options: per
  // chunk only), under kAuto the chunks whose active experts average few rows, where the kernel
  // supports the shapes and the device.
  const bool fp4_per_chunk = m.ckpt && !options_.widen_experts_at_load;
  if (eg == ExpertGemm::kW4a8 ||
      (eg == ExpertGemm::kAuto && fp4_per_chunk && w4a8_shapes(c).is_ok() &&
       cuda::w4a8_grouped_gemm_available(cuda::current_device()).is_ok())) {
    HETERO_ASSIGN_OR_RETURN(m.w4a8, cuda::W4a8GroupedGemm::create(c.n_routed_experts, &m.budget));
    m.w4a8_max_rows = eg == ExpertGemm::kW4a8 ? INT64_MAX : Dsv4CudaOptions::kW4a8MaxMeanRows;
    if (options_.w4a8_tile_m > 0) m.w4a8->set_tile(options_.w4a8_tile_m, options_.w4a8_tile_n);
    m.w4a8->set_max_blocks(options_.w4a8_max_blocks);
  }
  // The lanes serve the per-expert GEMMs only.
  if (options_.expert_streams > 1 && eg != ExpertGemm::kGrouped && eg != ExpertGemm::kW4a8) {
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
    // Ask cuBLASLt for every FP8 shape now: one it refuses fails the engine, not a chunk.
    const int64_t S = c.moe_inter * c.n_shared_experts;
    std::vector<std::pair<int64_t, int64_t>> shapes = {{2 * I, H}, {H, I}, {2 * S, H}, {H, S}};
    if (m.ckpt)
      shapes.insert(shapes.end(), {{c.q_lora_rank, H},
                                   {c.heads * c.head_dim, c.q_lora_rank},
                                   {c.head_dim, H},
                                   {H, c.o_groups * c.o_lora_rank},
                                   {c.index_n_heads * c.index_head_dim, c.q_lora_rank}});
    for (auto [n, k] : shapes)
      if (n > 0 && k > 0) HETERO_RETURN_IF_ERROR(m.fp8_gemm->prepare(16, n, k));
  }
  if (m.ckpt) {  // the loss counter; per chunk: one projection's widened experts, the active list
    HETERO_RETURN_IF_ERROR(m.alloc(m.lossy, sizeof(unsigned long long), "a counter"));
    HETERO_CUDA_RETURN_IF_ERROR(cudaMemset(m.lossy.get(), 0, sizeof(unsigned long long)));
  }
  // The widening scratch, unless every chunk runs the W4A8 kernel.
  if (fp4_per_chunk && m.w4a8_max_rows != INT64_MAX) {
    const size_t q = static_cast<size_t>(c.n_routed_experts * std::max(2 * I * H, H * I));
    const size_t sc =
        static_cast<size_t>(c.n_routed_experts *
                            std::max(cuda::fp8_blocks(2 * I) * cuda::fp8_weight_scale_ld(H),
                                     cuda::fp8_blocks(H) * cuda::fp8_weight_scale_ld(I)) *
                            4);
    HETERO_RETURN_IF_ERROR(m.alloc(m.wide_q, q, "widened FP4 experts"));
    HETERO_RETURN_IF_ERROR(m.alloc(m.wide_scale, sc, "widened FP4 experts"));
    // Defined from the start: the grouped kernel's scale transpose reads every expert's scales,
    // inactive ones (never widened, never used) too.
    HETERO_CUDA_RETURN_IF_ERROR(cudaMemset(m.wide_scale.get(), 0, sc));
  }
  if (m.ckpt && !options_.widen_experts_at_load) {
    HETERO_RETURN_IF_ERROR(m.alloc(m.active, E * 4, "active experts"));
    HETERO_RETURN_IF_ERROR(m.host_active.allocate(E * 4, "active experts"));
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
  m.first = options_.first_layer;
  m.end = options_.end_layer < 0 ? c.layers : options_.end_layer;
  weight_bytes_ = 0;
  if (m.first == 0) {  // the first stage embeds the ids
    HETERO_RETURN_IF_ERROR(
        m.alloc(m.embed, static_cast<size_t>(c.vocab * c.hidden) * 2, "the embedding"));
    weight_bytes_ = static_cast<int64_t>(m.embed.bytes());
  }
  m.layers.resize(static_cast<size_t>(c.layers));
  for (int64_t l = 0; l < c.layers; ++l)
    m.layers[static_cast<size_t>(l)].ratio = c.compress_ratios[static_cast<size_t>(l)];
  for (int64_t l = m.first; l < m.end; ++l) {
    DLayer& L = m.layers[static_cast<size_t>(l)];
    for (const Spec& s : layer_specs(L, c, l)) {
      const Form form = form_of(s, options_.weight_dtype);
      if (form == Form::kFp8) {
        DFp8& f = *s.fp8;
        f.n = s.rows, f.k = s.cols, f.mats = s.count / (s.rows * s.cols);
        HETERO_RETURN_IF_ERROR(m.alloc(f.q, static_cast<size_t>(s.count), "FP8 weights"));
        HETERO_RETURN_IF_ERROR(m.alloc(f.scale, static_cast<size_t>(f.mats * f.scale_floats()) * 4,
                                       "FP8 weight scales"));
        weight_bytes_ += static_cast<int64_t>(f.q.bytes() + f.scale.bytes());
        continue;
      }
      if (form == Form::kFp4) {
        DFp4& f = *s.fp4;
        f.n = s.rows, f.k = s.cols, f.mats = s.count / (s.rows * s.cols);
        HETERO_RETURN_IF_ERROR(m.alloc(
            f.codes, cuda::Fp4GroupWeight::code_bytes(s.rows, s.cols) * f.mats, "FP4 experts"));
        HETERO_RETURN_IF_ERROR(m.alloc(
            f.scale, cuda::Fp4GroupWeight::scale_bytes(s.rows, s.cols) * f.mats, "FP4 experts"));
        weight_bytes_ += static_cast<int64_t>(f.codes.bytes() + f.scale.bytes());
        continue;
      }
      HETERO_RETURN_IF_ERROR(
          m.alloc(*s.buf, static_cast<size_t>(s.count) * s.elem_bytes, "the weights"));
      weight_bytes_ += static_cast<int64_t>(s.buf->bytes());
    }
  }
  return reset();
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
  HETERO_RETURN_IF_ERROR(e->finish_experts());
  return e;
}

Result<std::unique_ptr<Dsv4CudaEngine>> Dsv4CudaEngine::load(const std::string& model_dir,
                                                             const Dsv4CudaOptions& options) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return failed_precondition("no CUDA device for the DeepSeek-V4 CUDA engine");
  }
  if (options.weight_dtype == cuda::WeightDtype::kCheckpoint) {
    HETERO_ASSIGN_OR_RETURN(Dsv4Config config, load_dsv4_config(model_dir));
    HETERO_RETURN_IF_ERROR(check_options(config, options));
    std::unique_ptr<Dsv4CudaEngine> e(new Dsv4CudaEngine(config, options));
    HETERO_RETURN_IF_ERROR(e->init());
    HETERO_RETURN_IF_ERROR(e->stream_checkpoint(model_dir));
    HETERO_RETURN_IF_ERROR(e->finish_experts());
    return e;
  }
  HETERO_ASSIGN_OR_RETURN(Dsv4Weights w, load_dsv4_weights(model_dir));
  return create(w, options);
}

Result<int64_t> Dsv4CudaEngine::fp4_lossy_groups() const {
  if (!impl_->lossy) return int64_t{0};
  unsigned long long n = 0;
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(impl_->stream.get()));
  HETERO_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(&n, impl_->lossy.get(), sizeof(n), cudaMemcpyDeviceToHost));
  return static_cast<int64_t>(n);
}

Result<Dsv4CudaOptions::ExpertGemm> parse_expert_gemm(const std::string& name) {
  if (name == "auto") return Dsv4CudaOptions::ExpertGemm::kAuto;
  if (name == "grouped") return Dsv4CudaOptions::ExpertGemm::kGrouped;
  if (name == "per-expert") return Dsv4CudaOptions::ExpertGemm::kPerExpert;
  if (name == "w4a8") return Dsv4CudaOptions::ExpertGemm::kW4a8;
  return invalid_argument("the expert GEMM must be auto, grouped, per-expert or w4a8, not '" +
                          name + "'");
}

Status Dsv4CudaEngine::check_options(const Dsv4Config& c, const Dsv4CudaOptions& options) {
  if (options.expert_streams < 1 || options.expert_streams > 16)
    return invalid_argument("expert_streams must be 1..16, not " +
                            std::to_string(options.expert_streams));
  if (options.expert_streams > 1 && options.grouped_experts)
    return invalid_argument("grouped_experts runs every expert in one call: expert_streams 1");
  if (options.device_memory_budget_bytes < 0)
    return invalid_argument("the device-memory budget must be >= 0 bytes");
  const int64_t end = options.end_layer < 0 ? c.layers : options.end_layer;
  if (options.first_layer < 0 || options.first_layer >= end || end > c.layers)
    return invalid_argument("the layer range [" + std::to_string(options.first_layer) + ", " +
                            std::to_string(end) + ") is not inside the model's " +
                            std::to_string(c.layers) + " layers");
  HETERO_RETURN_IF_ERROR(
      cuda::check_forward_shapes(c.hidden, c.hc_mult, c.n_routed_experts, c.experts_per_tok));
  HETERO_RETURN_IF_ERROR(cuda::check_attention_shapes(c.head_dim, c.index_n_heads));
  if (options.widen_experts_at_load && options.weight_dtype != cuda::WeightDtype::kCheckpoint)
    return invalid_argument(
        "widen_experts_at_load widens the checkpoint's FP4 experts: it needs weight dtype "
        "checkpoint");
  if (options.weight_dtype == cuda::WeightDtype::kBf16) {
    if (options.expert_gemm != Dsv4CudaOptions::ExpertGemm::kAuto)
      return invalid_argument(
          "expert_gemm chooses between FP8 expert kernels: it needs fp8 or checkpoint weights");
    return Status::ok();
  }
  if (options.expert_gemm == Dsv4CudaOptions::ExpertGemm::kGrouped)
    HETERO_RETURN_IF_ERROR(cuda::fp8_grouped_gemm_available());
  if (options.expert_gemm == Dsv4CudaOptions::ExpertGemm::kW4a8) {
    if (options.weight_dtype != cuda::WeightDtype::kCheckpoint || options.widen_experts_at_load)
      return invalid_argument(
          "the w4a8 expert GEMM runs FP4 experts: it needs weight dtype checkpoint, with the "
          "experts not widened at load");
    const Status shape = w4a8_shapes(c);
    if (!shape.is_ok()) return invalid_argument(shape.message());
  }
  if ((options.w4a8_tile_m != 0 || options.w4a8_tile_n != 0) &&
      !cuda::W4a8GroupedGemm::has_tile(options.w4a8_tile_m, options.w4a8_tile_n))
    return invalid_argument("the W4A8 kernel has no " + std::to_string(options.w4a8_tile_m) + "x" +
                            std::to_string(options.w4a8_tile_n) + " tile");
  if (options.grouped_experts)
    return invalid_argument(
        "fp8 and checkpoint-precision experts run FP8 GEMMs (expert_gemm); grouped_experts is "
        "cuBLAS's grouped GEMM for bf16 weights");
  if (options.weight_dtype == cuda::WeightDtype::kCheckpoint) {
    // FP4 experts are widened 128x128 block by block; the shared expert's w1|w3 share one FP8
    // matrix, so each must be whole blocks; the FP8 projections need K % 16.
    const int64_t S = c.moe_inter * c.n_shared_experts;
    if (c.hidden % 128 != 0 || c.moe_inter % 128 != 0 || S % 128 != 0 || c.q_lora_rank % 16 != 0 ||
        (c.o_groups * c.o_lora_rank) % 16 != 0)
      return invalid_argument(
          "checkpoint precision needs hidden, moe_intermediate_size (and the shared experts' "
          "width) multiples of 128 and q_lora_rank, o_groups * o_lora_rank multiples of 16");
    if (c.attention_bias)
      return invalid_argument(
          "checkpoint precision runs wo_b on the FP8 GEMM, which adds no bias: attention_bias "
          "needs weight dtype bf16 or fp8");
  }
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

int64_t Dsv4CudaEngine::grouped_expert_launches() const { return impl_->grouped_launches; }

int64_t Dsv4CudaEngine::w4a8_expert_launches() const { return impl_->w4a8_launches; }

std::string Dsv4CudaEngine::expert_gemm_name() const {
  const Impl& m = *impl_;
  const std::string w4a8 =
      "W4A8 (FP4 widened in the GEMM, one launch per projection" +
      (options_.w4a8_tile_m > 0 ? ", tile " + std::to_string(options_.w4a8_tile_m) + "x" +
                                      std::to_string(options_.w4a8_tile_n)
                                : std::string()) +
      (options_.w4a8_max_blocks > 0
           ? ", at most " + std::to_string(options_.w4a8_max_blocks) + " blocks"
           : std::string()) +
      ")";
  if (m.w4a8 && m.w4a8_max_rows == INT64_MAX) return w4a8;
  const std::string per = "per-expert FP8 (cuBLASLt, " +
                          std::to_string(std::max<size_t>(m.lanes.size(), 1)) + " stream(s))";
  std::string fp8 = per;
  if (m.grouped_fp8 && m.grouped_max_rows == INT64_MAX)
    fp8 = "grouped FP8 (CUTLASS, one launch per projection)";
  else if (m.grouped_fp8)
    fp8 = "grouped FP8 (CUTLASS) where a chunk's active experts average <= " +
          std::to_string(m.grouped_max_rows) + " rows, else " + per;
  if (m.w4a8)
    return w4a8 + " where a chunk's active experts average <= " + std::to_string(m.w4a8_max_rows) +
           " rows, else widened, then " + fp8;
  if (m.fp8) return fp8;
  return m.grouped ? "bf16 (cuBLAS grouped)" : "bf16 (cuBLAS, one per expert)";
}

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
  n_cached_ = resumed_at_ = 0;
  m.calls.clear();
  // The previous sequence's work (a failed chunk's lanes too) is done before its state is reused.
  for (Impl::Lane& l : m.lanes) HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(l.stream.get()));
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.stream.get()));
  m.state.resize(m.layers.size());
  for (size_t i = static_cast<size_t>(m.first); i < static_cast<size_t>(m.end); ++i) {
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
    for (size_t i = static_cast<size_t>(m.first); i < static_cast<size_t>(m.end); ++i) {
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

Status Dsv4CudaEngine::set_decoder_calls(const std::vector<int64_t>& calls) {
  if (n_cached_ != resumed_at_)
    return failed_precondition("decoder calls change only between sequences");
  impl_->calls.set(calls, n_cached_);
  return Status::ok();
}

namespace {

// Host copies of the device state of layers [first, end) after n tokens, every array a span of
// one allocation: fresh memory in one piece, huge pages asked for, not zero-filled first (each
// element is the device's copy). Small vectors faulted in page by page made the copy run at
// ~2 GB/s (RESULTS §35).
struct Dsv4CudaCheckpoint final : Checkpoint {
  struct Span {
    int64_t offset = 0, elems = 0;  // bf16 elements into `data`
  };
  struct Pool {
    int64_t remainder = 0, rows = 0;
    Span kv, gate, pooled;  // the pending rows, and every pooled row
  };
  struct Layer {
    int64_t tail_rows = 0;
    Span tail;
    Pool pool, ipool;
  };
  Dsv4Config shape;  // the config of the engine that made it
  int64_t n = 0, first = 0, end = 0, held = 0;
  bool full_forward = false;
  std::vector<Layer> layers;  // [first, end)
  std::unique_ptr<uint16_t[]> data;
  const uint16_t* at(const Span& s) const { return data.get() + s.offset; }
  int64_t tokens() const override { return n; }
  int64_t bytes() const override { return held; }
};

bool same_shape(const Dsv4Config& a, const Dsv4Config& b) {
  return a.layers == b.layers && a.head_dim == b.head_dim && a.sliding_window == b.sliding_window &&
         a.compress_ratios == b.compress_ratios && a.index_head_dim == b.index_head_dim;
}

}  // namespace

int64_t Dsv4CudaEngine::checkpoint_bytes() const {
  const Impl& m = *impl_;
  int64_t elems = 0;
  for (int64_t l = m.first; l < m.end && static_cast<size_t>(l) < m.state.size(); ++l) {
    const dsv4_cuda::DState& s = m.state[static_cast<size_t>(l)];
    elems += s.tail_rows * config_.head_dim;
    for (const dsv4_cuda::DPool* p : {&s.pool, &s.ipool})
      if (p->ratio > 0) elems += 2 * p->remainder * p->width + p->rows * p->head_dim;
  }
  return elems * 2;
}

std::shared_ptr<const Checkpoint> Dsv4CudaEngine::checkpoint() const {
  Impl& m = *impl_;
  if (m.state.size() < static_cast<size_t>(m.end)) {
    std::fprintf(stderr, "dsv4 cuda engine: no checkpoint before reserve()\n");
    return nullptr;
  }
  auto c = std::make_shared<Dsv4CudaCheckpoint>();
  c->shape = config_;
  c->n = n_cached_, c->first = m.first, c->end = m.end, c->full_forward = full_forward_;
  c->held = checkpoint_bytes();  // one count of the copied state, as the service prices it
  c->data = uninitialized_host_array<uint16_t>(static_cast<size_t>(c->held / 2));
  int64_t next = 0;  // the spans, laid out in the order they are copied
  auto down = [&](const cuda::DeviceBuffer& b, int64_t elems, Dsv4CudaCheckpoint::Span* out) {
    *out = {next, elems};
    next += elems;
    HETERO_CHECK(next * 2 <= c->held);
    if (elems == 0) return cudaSuccess;
    return cudaMemcpyAsync(c->data.get() + out->offset, b.get(), static_cast<size_t>(elems) * 2,
                           cudaMemcpyDeviceToHost, m.stream.get());
  };
  cudaError_t err = cudaSuccess;
  auto pool = [&](const dsv4_cuda::DPool& p, Dsv4CudaCheckpoint::Pool* out) {
    out->remainder = p.remainder, out->rows = p.rows;
    if (p.ratio == 0) return;
    for (cudaError_t e : {down(p.buf_kv, p.remainder * p.width, &out->kv),
                          down(p.buf_gate, p.remainder * p.width, &out->gate),
                          down(p.pooled, p.rows * p.head_dim, &out->pooled)})
      if (err == cudaSuccess) err = e;
  };
  for (int64_t l = m.first; l < m.end; ++l) {
    const dsv4_cuda::DState& s = m.state[static_cast<size_t>(l)];
    Dsv4CudaCheckpoint::Layer L;
    L.tail_rows = s.tail_rows;
    if (cudaError_t e = down(s.tail, s.tail_rows * config_.head_dim, &L.tail); err == cudaSuccess)
      err = e;
    pool(s.pool, &L.pool);
    pool(s.ipool, &L.ipool);
    c->layers.push_back(std::move(L));
  }
  HETERO_CHECK(next * 2 == c->held);
  if (err == cudaSuccess) err = cudaStreamSynchronize(m.stream.get());
  if (err != cudaSuccess) {
    std::fprintf(stderr, "dsv4 cuda engine: no checkpoint at %lld tokens: %s\n",
                 static_cast<long long>(n_cached_), cudaGetErrorString(err));
    return nullptr;
  }
  return c;
}

Status Dsv4CudaEngine::restore(const Checkpoint& checkpoint) {
  const auto* c = dynamic_cast<const Dsv4CudaCheckpoint*>(&checkpoint);
  Impl& m = *impl_;
  if (!c) return invalid_argument("not a checkpoint of this engine");
  if (!same_shape(c->shape, config_) || c->first != m.first || c->end != m.end ||
      c->full_forward != full_forward_)
    return failed_precondition("the checkpoint was made by an engine of another shape");
  if (n_cached_ != 0 || m.state.size() != m.layers.size())
    return failed_precondition("restore() comes after reserve() for the whole sequence");
  cudaStream_t st = m.stream.get();
  auto up = [&](cuda::DeviceBuffer& b, const Dsv4CudaCheckpoint::Span& v) -> Status {
    if (v.elems == 0) return Status::ok();
    const size_t bytes = static_cast<size_t>(v.elems) * 2;
    if (b.bytes() < bytes)
      return failed_precondition("the checkpoint's state does not fit the reserved buffers");
    HETERO_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(b.get(), c->at(v), bytes, cudaMemcpyHostToDevice, st));
    return Status::ok();
  };
  auto pool = [&](dsv4_cuda::DPool& p, const Dsv4CudaCheckpoint::Pool& in) -> Status {
    if (p.ratio == 0) return Status::ok();
    HETERO_RETURN_IF_ERROR(reserve_rows(m, p, in.rows, st));
    HETERO_RETURN_IF_ERROR(up(p.buf_kv, in.kv));
    HETERO_RETURN_IF_ERROR(up(p.buf_gate, in.gate));
    HETERO_RETURN_IF_ERROR(up(p.pooled, in.pooled));
    p.remainder = in.remainder, p.rows = in.rows;
    return Status::ok();
  };
  for (int64_t l = m.first; l < m.end; ++l) {
    dsv4_cuda::DState& s = m.state[static_cast<size_t>(l)];
    const Dsv4CudaCheckpoint::Layer& L = c->layers[static_cast<size_t>(l - m.first)];
    HETERO_RETURN_IF_ERROR(up(s.tail, L.tail));
    s.tail_rows = L.tail_rows;
    HETERO_RETURN_IF_ERROR(pool(s.pool, L.pool));
    HETERO_RETURN_IF_ERROR(pool(s.ipool, L.ipool));
  }
  // The host arrays are the checkpoint's: the copies finish before it may go.
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
  n_cached_ = resumed_at_ = c->n;
  m.calls.clear();
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
  // FP8 GEMM outputs run up to 15 rows past their inputs (fp8_linear): slack for them (under
  // kCheckpoint the attention's projections' outputs too).
  const size_t P = m.fp8 ? 16 : 0, PA = m.ckpt ? 16 : 0;
  const size_t window = static_cast<size_t>(c.sliding_window);
  std::vector<uint8_t> hp(N / 4 + 2, 1);
  hp[0] = 0;
  const struct {
    cuda::DeviceBuffer* b;
    size_t bytes;
  } want[] = {{&m.ids, N * 4},
              {&m.h, N * c.hc_mult * H * 2},
              {&m.x, N * H * 2},
              {&m.y, (N + PA) * H * 2},
              {&m.mix, N * cuda::hc_mix_floats(c.hc_mult) * 4},
              {&m.qr, (N + PA) * c.q_lora_rank * 2},
              {&m.q, (N + PA) * c.heads * hd * 2},
              {&m.attn, N * c.heads * hd * 2},
              {&m.kv, (N + PA) * hd * 2},
              {&m.mid, N * c.o_groups * c.o_lora_rank * 2},
              {&m.ckv, N * 2 * hd * 2},
              {&m.cgate, N * 2 * hd * 2},
              {&m.ikv, N * 2 * ihd * 2},
              {&m.igate, N * 2 * ihd * 2},
              {&m.iq, (N + PA) * ih * ihd * 2},
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
              {&m.xe, m.fp8 ? 0 : N * K * H * 2},  // FP8 experts read x's rows in place
              {&m.ye, (N * K + P) * H * 2},
              {&m.gu, (N * K + P) * 2 * I * 2},
              {&m.act, m.fp8 ? 0 : N * K * I * 2},  // FP8 experts make w2's input quantized
              {&m.sgu, S > 0 ? (N + P) * 2 * S * 2 : 0},
              {&m.sact, S > 0 ? N * S * 2 : 0},
              {&m.sh, S > 0 ? (N + P) * H * 2 : 0}};
  m.cap = 0;  // until every buffer below holds n rows
  for (const auto& w : want) HETERO_RETURN_IF_ERROR(m.alloc(*w.b, w.bytes, "chunk scratch"));
  HETERO_RETURN_IF_ERROR(put(m.has_prev, hp.data(), hp.size()));
  if (m.fp8) {  // every expert's rows, each padded to 16 (or the shared expert's n rows)
    const int64_t widest = m.ckpt ? std::max({H, I, S, c.q_lora_rank, c.o_groups * c.o_lora_rank})
                                  : std::max({H, I, S});
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
  if (impl_->first != 0)
    return failed_precondition(
        "a stage that does not hold layer 0 starts from a residual "
        "(prefill_stage)");
  return prefill_stage(ids, nullptr, tap);
}

const uint16_t* Dsv4CudaEngine::residual() const { return bf(impl_->h); }

Status Dsv4CudaEngine::prefill_stage(const std::vector<int32_t>& ids, const uint16_t* h_in,
                                     const AttentionInputTap& tap) {
  const Dsv4Config& c = config_;
  HETERO_RETURN_IF_ERROR(check_token_ids(ids, c.vocab));
  Impl& m = *impl_;
  if (ids.empty()) return Status::ok();
  if ((m.first == 0) != (h_in == nullptr))
    return invalid_argument(m.first == 0 ? "the first stage embeds its ids: no residual in"
                                         : "a later stage needs the previous stage's residual");
  cudaStream_t st = m.stream.get();
  const int64_t n = static_cast<int64_t>(ids.size()), pos0 = n_cached_, H = c.hidden;
  const float eps = static_cast<float>(c.rms_norm_eps);
  HETERO_RETURN_IF_ERROR(size_scratch(n));
  HETERO_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(m.ids.get(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice, st));
  if (h_in)
    HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        m.h.get(), h_in, static_cast<size_t>(n * c.hc_mult * H) * 2, cudaMemcpyDeviceToDevice, st));
  else
    cuda::embed_rows(bf(m.embed), m.ids.get<int32_t>(), n, c.hc_mult, H, bf(m.h), st);

  for (int64_t l = m.first; l < m.end; ++l) {
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
    HETERO_RETURN_IF_ERROR(m.x_readers.before_write(st));  // none, unless a call failed midway
    cuda::hc_collapse(ha, bf(m.h), n, f32(m.mix), bf(m.x), st);
    cuda::fast_rms_norm(bf(m.x), n, H, bf(L.attn_norm), eps, bf(m.x), st);
    if (tap) {
      TapEvent ev{static_cast<int32_t>(l), pos0, n, H, nullptr, bf(m.x), st};
      ev.x_read = m.x_readers.slot();  // the layer's next write of x waits for them
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
    HETERO_RETURN_IF_ERROR(m.x_readers.before_write(st));  // x, read by the tap's copies
    cuda::hc_collapse(hf, bf(m.h), n, f32(m.mix), bf(m.x), st);
    cuda::fast_rms_norm(bf(m.x), n, H, bf(L.ffn_norm), eps, bf(m.x), st);
    HETERO_RETURN_IF_ERROR(moe(m, c, l, n));
    HETERO_RETURN_IF_ERROR(m.timer.mark(st, "hyper-connections + norms"));
    cuda::hc_expand(hf, f32(m.mix), bf(m.y), n, bf(m.h), st);
  }
  // A stage that ends at the model's last layer taps it and stops before its attention.
  HETERO_RETURN_IF_ERROR(m.x_readers.before_write(st));
  HETERO_RETURN_IF_ERROR(m.timer.mark(st, "end"));
  HETERO_RETURN_IF_ERROR(m.timer.collect(st));
  // The kernels' launches report here (a launch error, or an earlier fault that stuck).
  HETERO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  n_cached_ += n;
  return Status::ok();
}

}  // namespace hetero
