// The DeepSeek-V4 forward on CUDA: the engine's creation (options checked, streams, handles, the
// expert kernels chosen, the weights' buffers) and what it reports of itself. See dsv4_cuda.h for
// the contract; dsv4_cuda_weights.cc fills the weights, dsv4_cuda_forward.cc runs a sequence's
// chunks, dsv4_cuda_layers.cc a layer's attention and MoE, dsv4_cuda_checkpoint.cc saves and
// restores a sequence's state. The CPU engine (engine/dsv4_cpu.cc) is the reference for every step.
#include "engine/cuda/dsv4_cuda.h"

#include <algorithm>

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

}  // namespace hetero
