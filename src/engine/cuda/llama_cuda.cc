// The llama-family forward on the GPU: weights, the fast path's chunk (tensor-core GEMMs, the
// paged cache, flash attention), the tap and the logits. See llama_cuda.h for the contract,
// llama_cuda_memory.cc for admission and the cache's pages, llama_cuda_exact.cc for the exact
// path.
#include "engine/cuda/llama_cuda.h"

#include <cublas_v2.h>

#include <algorithm>
#include <cmath>

#include "common/bf16.h"
#include "engine/cuda/llama_cuda_impl.h"
#include "kernels/cuda/device.h"
#include "model/mlx_quant.h"

namespace hetero::cuda {

Result<KvDtype> parse_kv_dtype(const std::string& name) {
  if (name == "fp8") return KvDtype::kFp8;
  if (name == "bf16") return KvDtype::kBf16;
  return invalid_argument("kv cache dtype must be fp8 or bf16, not '" + name + "'");
}
const char* kv_dtype_name(KvDtype dtype) { return dtype == KvDtype::kFp8 ? "fp8" : "bf16"; }

Result<AttentionKernel> parse_attention_kernel(const std::string& name) {
  if (name == "auto") return AttentionKernel::kAuto;
  if (name == "own") return AttentionKernel::kOwn;
  if (name == "cudnn") return AttentionKernel::kCudnn;
  return invalid_argument("attention must be auto, own or cudnn, not '" + name + "'");
}

std::string LlamaCudaEngine::attention_name() const {
  if (options_.arith != LlamaCudaArith::kFast) return "-";
  if (cudnn_) return cudnn_->name();
  return "own flash kernel (mma.sync)" + (attention_note_.empty() ? "" : "; " + attention_note_);
}

Status LlamaCudaEngine::choose_attention() {
  const AttentionKernel want = options_.attention;
  if (options_.arith != LlamaCudaArith::kFast || want == AttentionKernel::kOwn) return Status::ok();
  if (options_.kv_dtype != KvDtype::kBf16) {
    if (want == AttentionKernel::kCudnn)
      return invalid_argument("cuDNN attention reads a bf16 cache: --kv-dtype bf16, not fp8");
    attention_note_ = "cuDNN's reads a bf16 cache, this one is fp8";
    return Status::ok();
  }
  const LlamaConfig& c = config_;
  if (c.sliding_window > 0) {  // the graph here is causal over the whole past, one per engine
    if (want == AttentionKernel::kCudnn)
      return invalid_argument(
          "cuDNN attention here attends over the whole past; this model's "
          "sliding-window layers need --attention own or auto");
    attention_note_ = "cuDNN's here has no sliding window";
    return Status::ok();
  }
  auto a = CudnnAttention::create(
      static_cast<int>(c.heads), static_cast<int>(c.kv_heads), static_cast<int>(c.head_dim),
      1.0f / std::sqrt(static_cast<float>(c.head_dim)), options_.device);
  if (!a.is_ok()) {
    if (want == AttentionKernel::kCudnn) return a.status();
    attention_note_ = "not cuDNN's: " + a.status().message();
    return Status::ok();
  }
  cudnn_ = std::move(a.value());
  return Status::ok();
}

Result<LlamaCudaArith> parse_llama_cuda_arith(const std::string& name) {
  if (name == "fast") return LlamaCudaArith::kFast;
  if (name == "exact") return LlamaCudaArith::kExact;
  return invalid_argument("the cuda arithmetic must be fast or exact, not '" + name + "'");
}

LlamaCudaEngine::LlamaCudaEngine(LlamaConfig config, LlamaCudaOptions options)
    : config_(std::move(config)),
      options_(options),
      budget_(options.device_memory_budget_bytes),
      pages_(std::make_unique<Pages>()) {}

LlamaCudaEngine::~LlamaCudaEngine() {
  DeviceGuard on_engine(options_.device);
  if (stream_.get()) cudaStreamSynchronize(stream_.get());
  // Everything the engine holds is freed here, on its device, before the guard restores the
  // caller's.
  for (DeviceBuffer* b : {&h_, &xn_, &qkv_, &q_, &attn_, &tmp_, &gate_up_, &act_, &ids_, &act_q_,
                          &act_scale_, &logits_, &staging_})
    b->reset();
  pinned_x_.reset();
  pages_.reset();
  exact_.reset();
  cudnn_.reset();
  weights_.clear();
  fp8_.reset();
  cublas_ = BlasHandle();
  stream_ = Stream();
}

Result<std::unique_ptr<LlamaCudaEngine>> LlamaCudaEngine::load(const std::string& model_dir,
                                                               const LlamaCudaOptions& options) {
  HETERO_ASSIGN_OR_RETURN(LlamaWeights w, load_llama_weights(model_dir));
  return create(w, options);
}

Result<std::unique_ptr<LlamaCudaEngine>> LlamaCudaEngine::create(const LlamaWeights& weights,
                                                                 const LlamaCudaOptions& options) {
  const LlamaConfig& c = weights.config;
  int devices = 0;
  const cudaError_t de = cudaGetDeviceCount(&devices);
  if (de != cudaSuccess || devices == 0) {
    cudaGetLastError();
    return unavailable(std::string("no CUDA device for the cuda backend (") +
                       cudaGetErrorString(de) + ")");
  }
  if (options.device < 0 || options.device >= devices)
    return invalid_argument("CUDA device " + std::to_string(options.device) + " of " +
                            std::to_string(devices));
  if (options.device_memory_budget_bytes < 0)
    return invalid_argument("the device-memory budget must be >= 0 bytes");
  if (!attention_paged_supports(static_cast<int>(c.head_dim)))
    return failed_precondition("the cuda backend's attention supports head_dim 64 and 128, not " +
                               std::to_string(c.head_dim));
  if (c.heads % c.kv_heads != 0) return invalid_argument("heads must be a multiple of kv_heads");
  if (options.weight_dtype == WeightDtype::kCheckpoint)
    return invalid_argument(
        "llama-family checkpoints store no FP8/FP4 forms to keep: weight dtype bf16 or fp8");
  const bool fp8 = options.weight_dtype == WeightDtype::kFp8;
  if (fp8 && options.arith != LlamaCudaArith::kFast)
    return invalid_argument(
        "fp8 weights need the fast arithmetic: the exact path reproduces the decoder's bf16 "
        "weights bit for bit");
  if (fp8) HETERO_RETURN_IF_ERROR(check_fp8_device(options.device));
  // The engine's memory, stream and handles live on its device; the caller's current device is
  // left as it was.
  DeviceGuard on_engine(options.device);
  std::unique_ptr<LlamaCudaEngine> e(new LlamaCudaEngine(c, options));
  HETERO_ASSIGN_OR_RETURN(e->stream_, Stream::create());
  HETERO_ASSIGN_OR_RETURN(e->cublas_, BlasHandle::create(e->stream_.get()));
  HETERO_RETURN_IF_ERROR(e->choose_attention());
  if (fp8) {
    HETERO_ASSIGN_OR_RETURN(e->fp8_, Fp8Gemm::create(&e->budget_));
  }
  HETERO_RETURN_IF_ERROR(e->upload(weights));
  if (fp8 && !e->layers_.empty()) {
    // Ask cuBLASLt now for every projection shape, so an unsupported one fails the load, not a
    // chunk.
    const Layer& L = e->layers_[0];
    for (const Proj* p : {&L.wqkv, &L.wo, &L.gate_up, &L.down})
      HETERO_RETURN_IF_ERROR(e->fp8_->prepare(16, p->n, p->k));
  }
  return e;
}

Status LlamaCudaEngine::upload(const LlamaWeights& w) {
  const LlamaConfig& c = config_;
  // A quantized checkpoint runs in fast arithmetic on its own values, dequantized here as the
  // decoder dequantizes them (model/mlx_quant.h); the exact engine reproduces MLX's dense matmul,
  // not its quantized one, so it refuses.
  if (!w.quantization.empty() && options_.arith == LlamaCudaArith::kExact)
    return invalid_argument("the checkpoint is quantized (" + w.quantization +
                            "); the exact CUDA engine reproduces dense matmuls only (use --arith "
                            "fast, or --backend cpu for the decoder's bits)");
  if (c.rope.dims != c.head_dim)
    return failed_precondition("the config's rope was not built (llama_rope) for head_dim " +
                               std::to_string(c.head_dim));
  HETERO_RETURN_IF_ERROR(rope_.upload(c.rope));
  call_rope_.clear(&rope_);
  // Concatenated row blocks (each a bf16 [rows, cols] tensor) copied into one device array.
  auto put = [&](std::initializer_list<const Tensor*> parts, const uint16_t** out) -> Status {
    size_t bytes = 0;
    for (const Tensor* t : parts) bytes += static_cast<size_t>(t->numel()) * 2;
    if (bytes == 0) return Status::ok();
    DeviceBuffer& b = weights_.emplace_back();
    HETERO_RETURN_IF_ERROR(b.allocate(bytes, "the weights", &budget_));
    size_t off = 0;
    for (const Tensor* t : parts) {
      const Tensor h = as_bf16(*t);
      const size_t nb = static_cast<size_t>(h.numel()) * 2;
      HETERO_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(b.get<char>() + off, h.data<uint16_t>(), nb, cudaMemcpyHostToDevice));
      off += nb;
    }
    weight_bytes_ += bytes;
    *out = b.get<const uint16_t>();
    return Status::ok();
  };
  auto opt = [](const Tensor& t) { return t.numel() > 0 && !t.shape.empty(); };
  layers_.resize(static_cast<size_t>(c.layers));
  for (int64_t l = 0; l < c.layers; ++l) {
    const LlamaLayerWeights& L = w.layers[static_cast<size_t>(l)];
    Layer& D = layers_[static_cast<size_t>(l)];
    HETERO_RETURN_IF_ERROR(put({&L.input_norm}, &D.in_norm));
    HETERO_RETURN_IF_ERROR(put({&L.post_norm}, &D.post_norm));
    if (options_.arith == LlamaCudaArith::kFast) {  // the exact path has its own (below)
      // Dense, or the quantized projection's dequantized values (bf16, as the decoder's).
      auto d = [](const Tensor& t, const QuantizedWeight& q) {
        return q.empty() ? t : dequantize(q);
      };
      const Tensor wq = d(L.wq, L.qwq), wk = d(L.wk, L.qwk), wv = d(L.wv, L.qwv),
                   wo = d(L.wo, L.qwo);
      const Tensor gate = d(L.w_gate, L.qw_gate), up = d(L.w_up, L.qw_up);
      const Tensor down = d(L.w_down, L.qw_down);
      HETERO_RETURN_IF_ERROR(upload_projection({&wq, &wk, &wv}, &D.wqkv));
      HETERO_RETURN_IF_ERROR(upload_projection({&wo}, &D.wo));
      HETERO_RETURN_IF_ERROR(upload_projection({&gate, &up}, &D.gate_up));
      HETERO_RETURN_IF_ERROR(upload_projection({&down}, &D.down));
    }
    if (c.qkv_bias && opt(L.bq)) {
      HETERO_RETURN_IF_ERROR(put({&L.bq}, &D.extra.bq));
      HETERO_RETURN_IF_ERROR(put({&L.bk}, &D.extra.bk));
      HETERO_RETURN_IF_ERROR(put({&L.bv}, &D.extra.bv));
    }
    if (c.qk_norm) {
      HETERO_RETURN_IF_ERROR(put({&L.q_norm}, &D.extra.q_norm));
      HETERO_RETURN_IF_ERROR(put({&L.k_norm}, &D.extra.k_norm));
    }
    D.extra.eps = static_cast<float>(c.rms_norm_eps);
  }
  if (options_.arith == LlamaCudaArith::kExact) HETERO_RETURN_IF_ERROR(upload_exact(w));
  HETERO_RETURN_IF_ERROR(put({&w.embed}, &embed_));
  HETERO_RETURN_IF_ERROR(put({&w.final_norm}, &final_norm_));
  if (c.tie_embeddings)
    lm_head_ = embed_;
  else
    HETERO_RETURN_IF_ERROR(put({&w.lm_head}, &lm_head_));
  if (staging_) {  // the FP8 quantizers have read it
    HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_.get()));
    staging_.reset();
  }
  HETERO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::ok();
}

// Row blocks (bf16 [rows, k] each) concatenated into one projection weight [n, k] on the device:
// kept as bf16, or staged and quantized to FP8 (the bf16 copy is not kept).
Status LlamaCudaEngine::upload_projection(std::initializer_list<const Tensor*> parts, Proj* out) {
  out->n = 0;
  out->k = (*parts.begin())->shape[1];
  for (const Tensor* t : parts) out->n += t->shape[0];
  const size_t bf16_bytes = static_cast<size_t>(out->n * out->k) * 2;
  const bool fp8 = options_.weight_dtype == WeightDtype::kFp8;
  void* dst = nullptr;
  if (!fp8) {
    DeviceBuffer& b = weights_.emplace_back();
    HETERO_RETURN_IF_ERROR(b.allocate(bf16_bytes, "the weights", &budget_));
    weight_bytes_ += bf16_bytes;
    out->bf16 = b.get<const uint16_t>();
    dst = b.get();
  } else {
    if (staging_.bytes() < bf16_bytes) {
      // The quantizer may still read the old one.
      HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_.get()));
      HETERO_RETURN_IF_ERROR(staging_.allocate(bf16_bytes, "staging the weights", &budget_));
    }
    dst = staging_.get();
  }
  // On the compute stream: ordered before the quantizer below (pageable sources are copied out
  // before the call returns).
  size_t off = 0;
  for (const Tensor* t : parts) {
    const Tensor b = as_bf16(*t);
    const size_t nb = static_cast<size_t>(b.numel()) * 2;
    HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<char*>(dst) + off, b.data<uint16_t>(),
                                                nb, cudaMemcpyHostToDevice, stream_.get()));
    off += nb;
  }
  if (!fp8) return Status::ok();
  Fp8BlockWeight& w = out->fp8;
  w.n = out->n, w.k = out->k;
  const size_t q_bytes = (static_cast<size_t>(w.n * w.k) + 255) / 256 * 256;
  DeviceBuffer& q = weights_.emplace_back();
  HETERO_RETURN_IF_ERROR(q.allocate(q_bytes + (w.bytes() - static_cast<size_t>(w.n * w.k)),
                                    "the FP8 weights", &budget_));
  w.q = q.get<const uint8_t>();
  w.scale = reinterpret_cast<const float*>(q.get<char>() + q_bytes);
  quantize_weight_fp8_block(static_cast<const uint16_t*>(dst), w.n, w.k, q.get<uint8_t>(),
                            const_cast<float*>(w.scale), stream_.get());
  weight_bytes_ += w.bytes();
  return Status::ok();
}

Status LlamaCudaEngine::reset() {
  DeviceGuard on_engine(options_.device);
  n_cached_ = 0;
  // A failed chunk may have left work queued: it is done before the next sequence starts.
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_.get()));
  call_rope_.clear(&rope_);
  return Status::ok();
}

Status LlamaCudaEngine::set_decoder_calls(const std::vector<int64_t>& calls, int64_t start,
                                          bool batched) {
  HETERO_ASSIGN_OR_RETURN(RopeByCall r, RopeByCall::for_engine(config_.rope_config, config_.rope,
                                                               start, calls, batched));
  DeviceGuard on_engine(options_.device);
  // Chunks still queued read the tables being replaced.
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_.get()));
  return call_rope_.upload(r, &rope_);
}

bool LlamaCudaEngine::rows_follow_calls(const std::vector<int64_t>& calls, int64_t start,
                                        bool batched) const {
  return RopeByCall::follows_calls(config_.rope_config, config_.rope, start, calls, batched);
}

// out [m, n] = x [m, k] @ w^T, w [n, k] row-major; bf16 in and out, float32 accumulation. With
// FP8 weights x is first quantized per token and 128 columns (out then holds padded rows).
Status LlamaCudaEngine::linear(const uint16_t* x, int64_t m, const Proj& w, uint16_t* out) {
  if (w.bf16 == nullptr) {
    quantize_act_fp8_group(x, m, w.k, act_q_.get<uint8_t>(), act_scale_.get<float>(),
                           stream_.get());
    return fp8_->run(act_q_.get<uint8_t>(), act_scale_.get<float>(), m, w.fp8, out, stream_.get());
  }
  const float one = 1.f, zero = 0.f;
  HETERO_CUDA_RETURN_IF_ERROR(
      cublasGemmEx(cublas_.get(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(w.n),
                   static_cast<int>(m), static_cast<int>(w.k), &one, w.bf16, CUDA_R_16BF,
                   static_cast<int>(w.k), x, CUDA_R_16BF, static_cast<int>(w.k), &zero, out,
                   CUDA_R_16BF, static_cast<int>(w.n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return Status::ok();
}

Status LlamaCudaEngine::prefill_chunk(const std::vector<int32_t>& ids,
                                      const AttentionInputTap& tap) {
  // The service calls from its own threads, which start on device 0.
  DeviceGuard on_engine(options_.device);
  const LlamaConfig& c = config_;
  HETERO_RETURN_IF_ERROR(check_token_ids(ids, c.vocab));
  if (ids.empty()) return Status::ok();
  const int64_t n = static_cast<int64_t>(ids.size()), pos0 = n_cached_, H = c.hidden;
  const int64_t hd = c.head_dim, I = c.intermediate;
  HETERO_RETURN_IF_ERROR(ensure_activations(n));
  if (options_.host_tap && pinned_x_.bytes() < static_cast<size_t>(n * H * 2))
    HETERO_RETURN_IF_ERROR(pinned_x_.allocate(static_cast<size_t>(n * H * 2), "the host tap"));
  if (exact_) return prefill_exact(ids, tap);
  HETERO_RETURN_IF_ERROR(ensure_pages(pos0 + n));
  cudaStream_t st = stream_.get();
  if (cudnn_) HETERO_RETURN_IF_ERROR(cudnn_->begin_chunk(n, pos0, pages_->pages, st));
  auto* h = h_.get<uint16_t>();
  auto* xn = xn_.get<uint16_t>();
  auto* qkv = qkv_.get<uint16_t>();
  auto* q = q_.get<uint16_t>();
  auto* attn = attn_.get<uint16_t>();
  auto* tmp = tmp_.get<uint16_t>();
  auto* gate_up = gate_up_.get<uint16_t>();
  auto* act = act_.get<uint16_t>();
  HETERO_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(ids_.get(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice, st));
  embed_rows(embed_, ids_.get<const int32_t>(), n, H, h, st);
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  HETERO_RETURN_IF_ERROR(tap_readers_.before_write(st));  // none, unless a call failed midway
  rms_norm_rows(h, n, H, layers_[0].in_norm, eps, xn, st);
  for (int64_t l = 0; l < c.layers; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    HETERO_RETURN_IF_ERROR(deliver_tap(tap, l, pos0, n, xn));
    PagedKvView kv{pages_->table[static_cast<size_t>(l)].get<KvPageRef>(), options_.kv_dtype,
                   static_cast<int>(c.kv_heads), static_cast<int>(hd), cudnn_ != nullptr};
    HETERO_RETURN_IF_ERROR(linear(xn, n, L.wqkv, qkv));
    const int64_t qkv_row = (c.heads + 2 * c.kv_heads) * hd;
    call_rope_.for_each_span(n, pos0, [&](int64_t off, int64_t rows, const RopeTable& rope) {
      qkv_rope_store(qkv + off * qkv_row, rows, static_cast<int>(c.heads), pos0 + off, rope,
                     L.extra, q + off * c.heads * hd, kv, st);
    });
    if (cudnn_) {
      // One slab per layer (grow_pages): its K rows, then its V rows.
      const Pages& P = *pages_;
      const char* slab = P.slabs[static_cast<size_t>(l)].get<const char>();
      const CudnnPagedKv rows{slab, slab + P.kv_bytes * static_cast<size_t>(P.pages), 0, P.pages,
                              /*token_major=*/true};
      HETERO_RETURN_IF_ERROR(cudnn_->run(q, rows, attn, st));
    } else {
      attention_paged(q, n, static_cast<int>(c.heads), pos0, scale, kv, attn, st, c.window_of(l));
    }
    HETERO_RETURN_IF_ERROR(linear(attn, n, L.wo, tmp));
    HETERO_RETURN_IF_ERROR(tap_readers_.before_write(st));  // xn, read by the tap's copies
    add_rms_norm_rows(h, tmp, n, H, L.post_norm, eps, xn, st);
    HETERO_RETURN_IF_ERROR(linear(xn, n, L.gate_up, gate_up));
    silu_mul_halves(gate_up, n, I, act, st);
    HETERO_RETURN_IF_ERROR(linear(act, n, L.down, tmp));
    const uint16_t* next_norm =
        l + 1 < c.layers ? layers_[static_cast<size_t>(l + 1)].in_norm : final_norm_;
    add_rms_norm_rows(h, tmp, n, H, next_norm, eps, xn, st);
  }
  // The kernels' launches report here.
  HETERO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  n_cached_ += n;
  last_rows_ = n;
  return Status::ok();
}

Status LlamaCudaEngine::deliver_tap(const AttentionInputTap& tap, int64_t layer, int64_t pos0,
                                    int64_t n, const uint16_t* x) {
  if (!tap) return Status::ok();
  const int64_t H = config_.hidden;
  TapEvent e{static_cast<int32_t>(layer), pos0, n, H, nullptr, x, stream_.get()};
  e.x_read = tap_readers_.slot();  // the layer's next write of x waits for them
  if (options_.host_tap) {
    HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(pinned_x_.get(), x, static_cast<size_t>(n * H * 2),
                                                cudaMemcpyDeviceToHost, stream_.get()));
    HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_.get()));
    e.x_bf16 = pinned_x_.get<const uint16_t>();
  }
  tap(e);
  return Status::ok();
}

Status LlamaCudaEngine::synchronize() {
  DeviceGuard on_engine(options_.device);
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_.get()));
  return Status::ok();
}

Result<std::vector<float>> LlamaCudaEngine::last_logits() {
  DeviceGuard on_engine(options_.device);
  const LlamaConfig& c = config_;
  std::vector<float> logits(static_cast<size_t>(c.vocab));
  if (n_cached_ == 0) return logits;
  if (!logits_) HETERO_RETURN_IF_ERROR(logits_.allocate(logits.size() * 4, "logits", &budget_));
  // xn holds the final norm of every row of the last chunk.
  const uint16_t* last = xn_.get<const uint16_t>() + (last_rows_ - 1) * c.hidden;
  const float one = 1.f, zero = 0.f;
  HETERO_CUDA_RETURN_IF_ERROR(cublasGemmEx(
      cublas_.get(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(c.vocab), 1,
      static_cast<int>(c.hidden), &one, lm_head_, CUDA_R_16BF, static_cast<int>(c.hidden), last,
      CUDA_R_16BF, static_cast<int>(c.hidden), &zero, logits_.get(), CUDA_R_32F,
      static_cast<int>(c.vocab), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(logits.data(), logits_.get(), logits.size() * 4,
                                              cudaMemcpyDeviceToHost, stream_.get()));
  HETERO_RETURN_IF_ERROR(synchronize());
  return logits;
}

}  // namespace hetero::cuda
