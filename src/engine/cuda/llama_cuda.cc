// The llama-family forward on the GPU. See llama_cuda.h for the contract.
#include "engine/cuda/llama_cuda.h"

#include <cublas_v2.h>

#include <cmath>
#include <cstring>

#include "common/bf16.h"
#include "kernels/cpu_ops.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/ops.h"

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
  std::vector<std::vector<KvPageRef>> host;  // [layer][page]
  std::vector<KvPageRef*> table;             // [layer] device copies of host[layer]
  int64_t table_capacity = 0;
};

// The exact path's state: float32 transposed weights ([in, out], as gemm_ordered takes them),
// the cache as the CPU engine keeps it (token-major bf16 rows per layer), and scratch.
struct LlamaCudaEngine::Exact {
  struct Layer {
    float *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr, *gate = nullptr,
          *up = nullptr, *down = nullptr;
  };
  std::vector<Layer> layers;
  std::vector<void*> kv;  // [layer][2]: k then v, each [capacity][kv_heads * head_dim] bf16
  int64_t capacity = 0;
  void *xf = nullptr, *acc = nullptr, *scratch = nullptr, *k = nullptr, *v = nullptr,
       *gate = nullptr, *up = nullptr;
  int64_t rows = 0;
  size_t scratch_bytes = 0;
  std::vector<void*> owned;
  ~Exact() {
    for (void* p : owned) cudaFree(p);
    for (void* p : kv) cudaFree(p);
    for (void* p : {xf, acc, scratch, k, v, gate, up}) cudaFree(p);
  }
};

namespace {

cublasHandle_t as_handle(void* p) { return static_cast<cublasHandle_t>(p); }

Status cuda_error(const char* what, cudaError_t e) {
  if (e == cudaErrorMemoryAllocation)
    return unavailable(std::string(what) + ": out of device memory");
  return internal_error(std::string(what) + ": " + cudaGetErrorString(e));
}

}  // namespace

Result<KvDtype> parse_kv_dtype(const std::string& name) {
  if (name == "fp8") return KvDtype::kFp8;
  if (name == "bf16") return KvDtype::kBf16;
  return invalid_argument("kv cache dtype must be fp8 or bf16, not '" + name + "'");
}
const char* kv_dtype_name(KvDtype dtype) { return dtype == KvDtype::kFp8 ? "fp8" : "bf16"; }

Result<LlamaCudaArith> parse_llama_cuda_arith(const std::string& name) {
  if (name == "fast") return LlamaCudaArith::kFast;
  if (name == "exact") return LlamaCudaArith::kExact;
  return invalid_argument("the cuda arithmetic must be fast or exact, not '" + name + "'");
}

LlamaCudaEngine::LlamaCudaEngine(LlamaConfig config, LlamaCudaOptions options)
    : config_(std::move(config)), options_(options), pages_(std::make_unique<Pages>()) {}

LlamaCudaEngine::~LlamaCudaEngine() {
  DeviceGuard on_engine(options_.device);
  if (stream_) cudaStreamSynchronize(stream_);
  for (void* p : allocations_) cudaFree(p);
  for (KvPageRef* t : pages_->table) cudaFree(t);
  for (void* p : {h_, xn_, qkv_, q_, attn_, tmp_, gate_up_, act_, ids_, logits_, act_q_, act_scale_,
                  staging_})
    cudaFree(p);
  fp8_.reset();
  if (pinned_x_) cudaFreeHost(pinned_x_);
  if (cublas_) cublasDestroy(as_handle(cublas_));
  if (stream_) cudaStreamDestroy(stream_);
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
  if (de != cudaSuccess || devices == 0)
    return unavailable(std::string("no CUDA device for the cuda backend (") +
                       cudaGetErrorString(de) + ")");
  if (options.device < 0 || options.device >= devices)
    return invalid_argument("CUDA device " + std::to_string(options.device) + " of " +
                            std::to_string(devices));
  if (!attention_paged_supports(static_cast<int>(c.head_dim)))
    return failed_precondition("the cuda backend's attention supports head_dim 64 and 128, not " +
                               std::to_string(c.head_dim));
  if (c.heads % c.kv_heads != 0) return invalid_argument("heads must be a multiple of kv_heads");
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
  cudaError_t ce = cudaStreamCreateWithFlags(&e->stream_, cudaStreamNonBlocking);
  if (ce != cudaSuccess) return cuda_error("creating the compute stream", ce);
  cublasHandle_t h = nullptr;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) return internal_error("cublasCreate failed");
  e->cublas_ = h;
  cublasSetStream(h, e->stream_);
  if (fp8) {
    HETERO_ASSIGN_OR_RETURN(e->fp8_, Fp8Gemm::create());
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
  // Concatenated row blocks (each a bf16 [rows, cols] tensor) copied into one device array.
  auto put = [&](std::initializer_list<const Tensor*> parts, const uint16_t** out) -> Status {
    size_t bytes = 0;
    for (const Tensor* t : parts) bytes += static_cast<size_t>(t->numel()) * 2;
    if (bytes == 0) return Status::ok();
    void* p = nullptr;
    const cudaError_t ce = cudaMalloc(&p, bytes);
    if (ce != cudaSuccess) return cuda_error("uploading the weights", ce);
    allocations_.push_back(p);
    size_t off = 0;
    for (const Tensor* t : parts) {
      const Tensor b = as_bf16(*t);
      const size_t nb = static_cast<size_t>(b.numel()) * 2;
      cudaMemcpy(static_cast<char*>(p) + off, b.data<uint16_t>(), nb, cudaMemcpyHostToDevice);
      off += nb;
    }
    weight_bytes_ += bytes;
    *out = static_cast<const uint16_t*>(p);
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
      HETERO_RETURN_IF_ERROR(upload_projection({&L.wq, &L.wk, &L.wv}, &D.wqkv));
      HETERO_RETURN_IF_ERROR(upload_projection({&L.wo}, &D.wo));
      HETERO_RETURN_IF_ERROR(upload_projection({&L.w_gate, &L.w_up}, &D.gate_up));
      HETERO_RETURN_IF_ERROR(upload_projection({&L.w_down}, &D.down));
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
  if (options_.arith == LlamaCudaArith::kExact) {
    exact_ = std::make_unique<Exact>();
    auto put_t = [&](const Tensor& t, float** out) -> Status {
      const Tensor b = as_bf16(t);
      const std::vector<float> f = transposed_f32(b.data<uint16_t>(), t.shape[0], t.shape[1]);
      void* p = nullptr;
      const cudaError_t ce = cudaMalloc(&p, f.size() * 4);
      if (ce != cudaSuccess) return cuda_error("uploading the weights", ce);
      exact_->owned.push_back(p);
      cudaMemcpy(p, f.data(), f.size() * 4, cudaMemcpyHostToDevice);
      weight_bytes_ += f.size() * 4;
      *out = static_cast<float*>(p);
      return Status::ok();
    };
    exact_->layers.resize(static_cast<size_t>(c.layers));
    for (int64_t l = 0; l < c.layers; ++l) {
      const LlamaLayerWeights& L = w.layers[static_cast<size_t>(l)];
      Exact::Layer& E = exact_->layers[static_cast<size_t>(l)];
      HETERO_RETURN_IF_ERROR(put_t(L.wq, &E.wq));
      HETERO_RETURN_IF_ERROR(put_t(L.wk, &E.wk));
      HETERO_RETURN_IF_ERROR(put_t(L.wv, &E.wv));
      HETERO_RETURN_IF_ERROR(put_t(L.wo, &E.wo));
      HETERO_RETURN_IF_ERROR(put_t(L.w_gate, &E.gate));
      HETERO_RETURN_IF_ERROR(put_t(L.w_up, &E.up));
      HETERO_RETURN_IF_ERROR(put_t(L.w_down, &E.down));
    }
  }
  HETERO_RETURN_IF_ERROR(put({&w.embed}, &embed_));
  HETERO_RETURN_IF_ERROR(put({&w.final_norm}, &final_norm_));
  if (c.tie_embeddings)
    lm_head_ = embed_;
  else
    HETERO_RETURN_IF_ERROR(put({&w.lm_head}, &lm_head_));
  if (staging_) {  // the FP8 quantizers have read it
    const cudaError_t ce = cudaStreamSynchronize(stream_);
    if (ce != cudaSuccess) return cuda_error("quantizing the weights", ce);
    cudaFree(staging_);
    staging_ = nullptr;
    staging_bytes_ = 0;
  }
  return device_status("uploading the weights");
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
    const cudaError_t ce = cudaMalloc(&dst, bf16_bytes);
    if (ce != cudaSuccess) return cuda_error("uploading the weights", ce);
    allocations_.push_back(dst);
    weight_bytes_ += bf16_bytes;
    out->bf16 = static_cast<const uint16_t*>(dst);
  } else {
    if (staging_bytes_ < bf16_bytes) {
      cudaStreamSynchronize(stream_);  // the quantizer may still read the old one
      cudaFree(staging_);
      staging_ = nullptr;
      const cudaError_t ce = cudaMalloc(&staging_, bf16_bytes);
      if (ce != cudaSuccess) return cuda_error("staging the weights", ce);
      staging_bytes_ = bf16_bytes;
    }
    dst = staging_;
  }
  // On the compute stream: ordered before the quantizer below (pageable sources are copied out
  // before the call returns).
  size_t off = 0;
  for (const Tensor* t : parts) {
    const Tensor b = as_bf16(*t);
    const size_t nb = static_cast<size_t>(b.numel()) * 2;
    cudaMemcpyAsync(static_cast<char*>(dst) + off, b.data<uint16_t>(), nb, cudaMemcpyHostToDevice,
                    stream_);
    off += nb;
  }
  if (!fp8) return Status::ok();
  Fp8BlockWeight& w = out->fp8;
  w.n = out->n, w.k = out->k;
  const size_t q_bytes = (static_cast<size_t>(w.n * w.k) + 255) / 256 * 256;
  void* p = nullptr;
  const cudaError_t ce = cudaMalloc(&p, q_bytes + (w.bytes() - static_cast<size_t>(w.n * w.k)));
  if (ce != cudaSuccess) return cuda_error("uploading the weights", ce);
  allocations_.push_back(p);
  w.q = static_cast<const uint8_t*>(p);
  w.scale = reinterpret_cast<const float*>(static_cast<char*>(p) + q_bytes);
  quantize_weight_fp8_block(static_cast<const uint16_t*>(dst), w.n, w.k, static_cast<uint8_t*>(p),
                            const_cast<float*>(w.scale), stream_);
  weight_bytes_ += w.bytes();
  return Status::ok();
}

Status LlamaCudaEngine::device_status(const char* what) const {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status::ok() : cuda_error(what, e);
}

void LlamaCudaEngine::reset() { n_cached_ = 0; }

size_t LlamaCudaEngine::cache_bytes() const { return pages_->slab_bytes; }

Status LlamaCudaEngine::ensure_activations(int64_t n) {
  if (n <= act_rows_) return Status::ok();
  const LlamaConfig& c = config_;
  cudaStreamSynchronize(stream_);  // the old buffers may still be in use
  for (void** p :
       {&h_, &xn_, &qkv_, &q_, &attn_, &tmp_, &gate_up_, &act_, &ids_, &act_q_, &act_scale_}) {
    cudaFree(*p);
    *p = nullptr;
  }
  const int64_t qd = c.heads * c.head_dim, kvd = c.kv_heads * c.head_dim;
  // FP8 GEMMs read and write whole groups of 16 rows (fp8_gemm.h): every buffer gets the padded
  // row count, and the FP8 input buffer fits the widest input (k = hidden, qd or inter).
  const bool fp8 = options_.weight_dtype == WeightDtype::kFp8;
  const int64_t rows = fp8 ? fp8_act_rows(n) : n;
  const int64_t widest = std::max({c.hidden, qd, c.intermediate});
  const size_t H = static_cast<size_t>(c.hidden), N = static_cast<size_t>(rows);
  const struct {
    void** p;
    size_t bytes;
  } want[] = {{&h_, N * H * 2},
              {&xn_, N * H * 2},
              {&qkv_, N * static_cast<size_t>(qd + 2 * kvd) * 2},
              {&q_, N * static_cast<size_t>(qd) * 2},
              {&attn_, N * static_cast<size_t>(qd) * 2},
              {&tmp_, N * H * 2},
              {&gate_up_, N * static_cast<size_t>(2 * c.intermediate) * 2},
              {&act_, N * static_cast<size_t>(c.intermediate) * 2},
              {&ids_, N * 4},
              {&act_q_, fp8 ? N * static_cast<size_t>(widest) : 0},
              {&act_scale_, fp8 ? N * static_cast<size_t>(fp8_blocks(widest)) * 4 : 0}};
  act_bytes_ = 0;
  act_rows_ = 0;
  for (const auto& b : want) {
    if (b.bytes == 0) continue;
    const cudaError_t ce = cudaMalloc(b.p, b.bytes);
    if (ce != cudaSuccess) return cuda_error("allocating activations", ce);
    act_bytes_ += b.bytes;
  }
  act_rows_ = n;
  return Status::ok();
}

Status LlamaCudaEngine::ensure_pages(int64_t tokens) {
  Pages& P = *pages_;
  const LlamaConfig& c = config_;
  const int64_t need = (tokens + kKvPageTokens - 1) / kKvPageTokens;
  if (need <= P.pages) return Status::ok();
  const size_t elt = options_.kv_dtype == KvDtype::kFp8 ? 1 : 2;
  P.kv_bytes = static_cast<size_t>(c.kv_heads * kKvPageTokens * c.head_dim) * elt;
  P.scale_bytes =
      options_.kv_dtype == KvDtype::kFp8 ? static_cast<size_t>(c.kv_heads * kKvPageTokens) * 4 : 0;
  const size_t page_bytes = 2 * P.kv_bytes + 2 * P.scale_bytes;
  // Grow by at least the pages held (geometric), at least 16.
  const int64_t add = std::max<int64_t>({need - P.pages, P.pages, 16});
  cudaStreamSynchronize(stream_);  // page tables are replaced below
  P.host.resize(static_cast<size_t>(c.layers));
  for (int64_t l = 0; l < c.layers; ++l) {
    void* slab = nullptr;
    const cudaError_t ce = cudaMalloc(&slab, page_bytes * static_cast<size_t>(add));
    if (ce != cudaSuccess) return cuda_error("growing the KV cache", ce);
    allocations_.push_back(slab);
    P.slab_bytes += page_bytes * static_cast<size_t>(add);
    char* base = static_cast<char*>(slab);
    for (int64_t i = 0; i < add; ++i) {
      char* pg = base + page_bytes * static_cast<size_t>(i);
      KvPageRef r;
      r.k = pg;
      r.v = pg + P.kv_bytes;
      if (P.scale_bytes) {
        r.k_scale = reinterpret_cast<float*>(pg + 2 * P.kv_bytes);
        r.v_scale = reinterpret_cast<float*>(pg + 2 * P.kv_bytes + P.scale_bytes);
      }
      P.host[static_cast<size_t>(l)].push_back(r);
    }
  }
  P.pages += add;
  if (P.pages > P.table_capacity) {
    for (KvPageRef* t : P.table) cudaFree(t);
    P.table.assign(static_cast<size_t>(c.layers), nullptr);
    P.table_capacity = P.pages * 2;
    for (auto& t : P.table) {
      const cudaError_t ce =
          cudaMalloc(&t, sizeof(KvPageRef) * static_cast<size_t>(P.table_capacity));
      if (ce != cudaSuccess) return cuda_error("growing the page tables", ce);
    }
  }
  for (int64_t l = 0; l < c.layers; ++l)
    cudaMemcpy(P.table[static_cast<size_t>(l)], P.host[static_cast<size_t>(l)].data(),
               sizeof(KvPageRef) * static_cast<size_t>(P.pages), cudaMemcpyHostToDevice);
  return device_status("growing the KV cache");
}

// out [m, n] = x [m, k] @ w^T, w [n, k] row-major; bf16 in and out, float32 accumulation. With
// FP8 weights x is first quantized per token and 128 columns (out then holds padded rows).
Status LlamaCudaEngine::linear(const uint16_t* x, int64_t m, const Proj& w, uint16_t* out) {
  if (w.bf16 == nullptr) {
    quantize_act_fp8_group(x, m, w.k, static_cast<uint8_t*>(act_q_),
                           static_cast<float*>(act_scale_), stream_);
    return fp8_->run(static_cast<const uint8_t*>(act_q_), static_cast<const float*>(act_scale_), m,
                     w.fp8, out, stream_);
  }
  const float one = 1.f, zero = 0.f;
  cublasGemmEx(as_handle(cublas_), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(w.n),
               static_cast<int>(m), static_cast<int>(w.k), &one, w.bf16, CUDA_R_16BF,
               static_cast<int>(w.k), x, CUDA_R_16BF, static_cast<int>(w.k), &zero, out,
               CUDA_R_16BF, static_cast<int>(w.n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
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
  if (options_.host_tap && pinned_x_bytes_ < static_cast<size_t>(n * H * 2)) {
    if (pinned_x_) cudaFreeHost(pinned_x_);
    pinned_x_bytes_ = static_cast<size_t>(n * H * 2);
    const cudaError_t ce = cudaMallocHost(&pinned_x_, pinned_x_bytes_);
    if (ce != cudaSuccess) return cuda_error("allocating the host tap buffer", ce);
  }
  if (exact_) return prefill_exact(ids, tap);
  HETERO_RETURN_IF_ERROR(ensure_pages(pos0 + n));
  auto* h = static_cast<uint16_t*>(h_);
  auto* xn = static_cast<uint16_t*>(xn_);
  auto* qkv = static_cast<uint16_t*>(qkv_);
  auto* q = static_cast<uint16_t*>(q_);
  auto* attn = static_cast<uint16_t*>(attn_);
  auto* tmp = static_cast<uint16_t*>(tmp_);
  auto* gate_up = static_cast<uint16_t*>(gate_up_);
  auto* act = static_cast<uint16_t*>(act_);
  cudaMemcpyAsync(ids_, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice, stream_);
  embed_rows(embed_, static_cast<const int32_t*>(ids_), n, H, h, stream_);
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  rms_norm_rows(h, n, H, layers_[0].in_norm, eps, xn, stream_);
  for (int64_t l = 0; l < c.layers; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    HETERO_RETURN_IF_ERROR(deliver_tap(tap, l, pos0, n, xn));
    PagedKvView kv{pages_->table[static_cast<size_t>(l)], options_.kv_dtype,
                   static_cast<int>(c.kv_heads), static_cast<int>(hd)};
    HETERO_RETURN_IF_ERROR(linear(xn, n, L.wqkv, qkv));
    qkv_rope_store(qkv, n, static_cast<int>(c.heads), pos0, static_cast<float>(c.rope_theta),
                   L.extra, q, kv, stream_);
    attention_paged(q, n, static_cast<int>(c.heads), pos0, scale, kv, attn, stream_);
    HETERO_RETURN_IF_ERROR(linear(attn, n, L.wo, tmp));
    add_rms_norm_rows(h, tmp, n, H, L.post_norm, eps, xn, stream_);
    HETERO_RETURN_IF_ERROR(linear(xn, n, L.gate_up, gate_up));
    silu_mul_halves(gate_up, n, I, act, stream_);
    HETERO_RETURN_IF_ERROR(linear(act, n, L.down, tmp));
    const uint16_t* next_norm =
        l + 1 < c.layers ? layers_[static_cast<size_t>(l + 1)].in_norm : final_norm_;
    add_rms_norm_rows(h, tmp, n, H, next_norm, eps, xn, stream_);
  }
  HETERO_RETURN_IF_ERROR(device_status("enqueueing the chunk"));
  n_cached_ += n;
  last_rows_ = n;
  return Status::ok();
}

Status LlamaCudaEngine::deliver_tap(const AttentionInputTap& tap, int64_t layer, int64_t pos0,
                                    int64_t n, const uint16_t* x) {
  if (!tap) return Status::ok();
  const int64_t H = config_.hidden;
  TapEvent e{static_cast<int32_t>(layer), pos0, n, H, nullptr, x, stream_};
  if (options_.host_tap) {
    cudaMemcpyAsync(pinned_x_, x, static_cast<size_t>(n * H * 2), cudaMemcpyDeviceToHost, stream_);
    const cudaError_t ce = cudaStreamSynchronize(stream_);
    if (ce != cudaSuccess) return cuda_error("copying the tap back", ce);
    e.x_bf16 = static_cast<const uint16_t*>(pinned_x_);
  }
  tap(e);
  return Status::ok();
}

// The CPU engine's forward (engine/llama_cpu.cc), op for op, with the ops' CUDA twins.
Status LlamaCudaEngine::prefill_exact(const std::vector<int32_t>& ids,
                                      const AttentionInputTap& tap) {
  const LlamaConfig& c = config_;
  Exact& X = *exact_;
  const int64_t n = static_cast<int64_t>(ids.size()), pos0 = n_cached_, H = c.hidden;
  const int64_t hd = c.head_dim, qd = c.heads * hd, kvd = c.kv_heads * hd, I = c.intermediate;
  const int64_t widest = std::max({H, qd, I});
  auto grow = [&](void** p, size_t bytes) -> Status {
    cudaFree(*p);
    *p = nullptr;
    const cudaError_t ce = cudaMalloc(p, bytes);
    return ce == cudaSuccess ? Status::ok() : cuda_error("allocating the exact path", ce);
  };
  const size_t scratch = static_cast<size_t>(c.heads * n * (pos0 + n)) * 4;
  // Buffers below are replaced only when they grow; the work still queued may read them.
  if (n > X.rows || scratch > X.scratch_bytes || pos0 + n > X.capacity)
    cudaStreamSynchronize(stream_);
  if (n > X.rows) {
    const size_t N = static_cast<size_t>(n);
    HETERO_RETURN_IF_ERROR(grow(&X.xf, N * static_cast<size_t>(widest) * 4));
    HETERO_RETURN_IF_ERROR(grow(&X.acc, N * static_cast<size_t>(std::max({H, qd, I})) * 4));
    HETERO_RETURN_IF_ERROR(grow(&X.k, N * static_cast<size_t>(kvd) * 2));
    HETERO_RETURN_IF_ERROR(grow(&X.v, N * static_cast<size_t>(kvd) * 2));
    HETERO_RETURN_IF_ERROR(grow(&X.gate, N * static_cast<size_t>(I) * 2));
    HETERO_RETURN_IF_ERROR(grow(&X.up, N * static_cast<size_t>(I) * 2));
    X.rows = n;
  }
  if (scratch > X.scratch_bytes) {
    HETERO_RETURN_IF_ERROR(grow(&X.scratch, scratch));
    X.scratch_bytes = scratch;
  }
  if (pos0 + n > X.capacity) {
    const int64_t cap = std::max<int64_t>(2 * X.capacity, ((pos0 + n + 255) / 256) * 256);
    X.kv.resize(static_cast<size_t>(2 * c.layers), nullptr);
    for (void*& buf : X.kv) {
      void* bigger = nullptr;
      const cudaError_t ce = cudaMalloc(&bigger, static_cast<size_t>(cap * kvd) * 2);
      if (ce != cudaSuccess) return cuda_error("growing the exact cache", ce);
      if (buf)
        cudaMemcpy(bigger, buf, static_cast<size_t>(pos0 * kvd) * 2, cudaMemcpyDeviceToDevice);
      cudaFree(buf);
      buf = bigger;
    }
    X.capacity = cap;
  }
  auto* h = static_cast<uint16_t*>(h_);
  auto* xn = static_cast<uint16_t*>(xn_);
  auto* q = static_cast<uint16_t*>(q_);
  auto* attn = static_cast<uint16_t*>(attn_);
  auto* tmp = static_cast<uint16_t*>(tmp_);
  auto* k = static_cast<uint16_t*>(X.k);
  auto* v = static_cast<uint16_t*>(X.v);
  auto* gate = static_cast<uint16_t*>(X.gate);
  auto* up = static_cast<uint16_t*>(X.up);
  auto* xf = static_cast<float*>(X.xf);
  auto* acc = static_cast<float*>(X.acc);
  // out [n, out_dim] = bf16(x [n, in_dim] @ wt (+ bias)), as linear_decoder_order.
  auto linear = [&](const uint16_t* x, int64_t in_dim, const float* wt, int64_t out_dim,
                    const uint16_t* bias, uint16_t* out) {
    bf16_to_f32(x, n * in_dim, xf, stream_);
    cudaMemsetAsync(acc, 0, static_cast<size_t>(n * out_dim) * 4, stream_);
    gemm_ordered(xf, n, in_dim, wt, out_dim, acc, stream_);
    round_linear_output(acc, n, out_dim, bias, out, stream_);
  };
  cudaMemcpyAsync(ids_, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice, stream_);
  embed_rows(embed_, static_cast<const int32_t*>(ids_), n, H, h, stream_);
  const float eps = static_cast<float>(c.rms_norm_eps), theta = static_cast<float>(c.rope_theta);
  for (int64_t l = 0; l < c.layers; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    const Exact::Layer& E = X.layers[static_cast<size_t>(l)];
    auto* kc = static_cast<uint16_t*>(X.kv[static_cast<size_t>(2 * l)]);
    auto* vc = static_cast<uint16_t*>(X.kv[static_cast<size_t>(2 * l + 1)]);
    hetero::cuda::rms_norm(h, n, H, L.in_norm, eps, xn, stream_);
    HETERO_RETURN_IF_ERROR(deliver_tap(tap, l, pos0, n, xn));
    linear(xn, H, E.wq, qd, L.extra.bq, q);
    linear(xn, H, E.wk, kvd, L.extra.bk, k);
    linear(xn, H, E.wv, kvd, L.extra.bv, v);
    if (L.extra.q_norm) {
      hetero::cuda::rms_norm(q, n * c.heads, hd, L.extra.q_norm, eps, q, stream_);
      hetero::cuda::rms_norm(k, n * c.kv_heads, hd, L.extra.k_norm, eps, k, stream_);
    }
    rope_rotate_half(q, n, c.heads, hd, pos0, theta, stream_);
    rope_rotate_half(k, n, c.kv_heads, hd, pos0, theta, stream_);
    cudaMemcpyAsync(kc + pos0 * kvd, k, static_cast<size_t>(n * kvd) * 2, cudaMemcpyDeviceToDevice,
                    stream_);
    cudaMemcpyAsync(vc + pos0 * kvd, v, static_cast<size_t>(n * kvd) * 2, cudaMemcpyDeviceToDevice,
                    stream_);
    attention_causal(q, n, c.heads, kc, vc, c.kv_heads, hd, pos0,
                     1.0f / std::sqrt(static_cast<float>(hd)), static_cast<float*>(X.scratch), attn,
                     stream_);
    linear(attn, qd, E.wo, H, nullptr, tmp);
    add_bf16(h, tmp, n * H, h, stream_);
    hetero::cuda::rms_norm(h, n, H, L.post_norm, eps, xn, stream_);
    linear(xn, H, E.gate, I, nullptr, gate);
    linear(xn, H, E.up, I, nullptr, up);
    hetero::cuda::silu_mul(gate, up, n * I, gate, stream_);
    linear(gate, I, E.down, H, nullptr, tmp);
    add_bf16(h, tmp, n * H, h, stream_);
  }
  hetero::cuda::rms_norm(h, n, H, final_norm_, eps, xn, stream_);
  HETERO_RETURN_IF_ERROR(device_status("enqueueing the chunk"));
  n_cached_ += n;
  last_rows_ = n;
  return Status::ok();
}

Status LlamaCudaEngine::synchronize() {
  const cudaError_t e = cudaStreamSynchronize(stream_);
  return e == cudaSuccess ? Status::ok() : cuda_error("running the prefill", e);
}

Result<std::vector<float>> LlamaCudaEngine::last_logits() {
  DeviceGuard on_engine(options_.device);
  const LlamaConfig& c = config_;
  std::vector<float> logits(static_cast<size_t>(c.vocab));
  if (n_cached_ == 0) return logits;
  if (!logits_) {
    const cudaError_t ce = cudaMalloc(&logits_, logits.size() * 4);
    if (ce != cudaSuccess) return cuda_error("allocating logits", ce);
  }
  // xn holds the final norm of every row of the last chunk.
  const uint16_t* last = static_cast<const uint16_t*>(xn_) + (last_rows_ - 1) * c.hidden;
  const float one = 1.f, zero = 0.f;
  cublasGemmEx(as_handle(cublas_), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(c.vocab), 1,
               static_cast<int>(c.hidden), &one, lm_head_, CUDA_R_16BF, static_cast<int>(c.hidden),
               last, CUDA_R_16BF, static_cast<int>(c.hidden), &zero, logits_, CUDA_R_32F,
               static_cast<int>(c.vocab), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  cudaMemcpyAsync(logits.data(), logits_, logits.size() * 4, cudaMemcpyDeviceToHost, stream_);
  HETERO_RETURN_IF_ERROR(synchronize());
  return logits;
}

}  // namespace hetero::cuda
