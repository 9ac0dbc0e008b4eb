// The llama CUDA engine's memory: admission (reserve: a request's cache pages, activations and
// the exact path's buffers taken before its first chunk, or none of them), the activations
// sized for the largest chunk, and the fast path's paged KV cache, grown by whole pages on every
// layer. See llama_cuda.h for the budget and the errors.
#include <algorithm>
#include <vector>

#include "engine/cuda/llama_cuda_impl.h"
#include "kernels/cuda/device.h"

namespace hetero::cuda {

Status LlamaCudaEngine::reserve(int64_t tokens, int64_t max_chunk_tokens) {
  DeviceGuard on_engine(options_.device);
  HETERO_RETURN_IF_ERROR(reset());
  if (tokens <= 0) return Status::ok();
  const int64_t chunk = std::clamp<int64_t>(max_chunk_tokens, 1, tokens);
  auto take = [&]() -> Status {
    HETERO_RETURN_IF_ERROR(ensure_activations(chunk));
    const size_t tap_bytes = static_cast<size_t>(chunk * config_.hidden) * 2;
    if (options_.host_tap && pinned_x_.bytes() < tap_bytes)
      HETERO_RETURN_IF_ERROR(pinned_x_.allocate(tap_bytes, "the host tap"));
    if (exact_)  // the scores of the last chunk against every position: at most chunk x tokens
      return ensure_exact(chunk, tokens, static_cast<size_t>(config_.heads * chunk * tokens) * 4);
    return ensure_pages(tokens);
  };
  const Status st = take();
  // Refused: hold no more than the weights, so that the refusal leaves the next request its room.
  if (!st.is_ok()) release_sequence_memory();
  return st;
}

void LlamaCudaEngine::release_sequence_memory() {
  // After a failed reservation, which began with reset(): no queued work reads these.
  for (DeviceBuffer* b :
       {&h_, &xn_, &qkv_, &q_, &attn_, &tmp_, &gate_up_, &act_, &ids_, &act_q_, &act_scale_})
    b->reset();
  act_rows_ = 0, act_bytes_ = 0;
  *pages_ = Pages();
  if (exact_) {
    Exact& X = *exact_;
    X.kv.clear(), X.capacity = 0;
    for (DeviceBuffer* b : {&X.xf, &X.acc, &X.scratch, &X.k, &X.v, &X.gate, &X.up}) b->reset();
    X.rows = 0;
  }
}

Status LlamaCudaEngine::ensure_activations(int64_t n) {
  if (n <= act_rows_) return Status::ok();
  const LlamaConfig& c = config_;
  // The old buffers may still be in use.
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_.get()));
  const int64_t qd = c.heads * c.head_dim, kvd = c.kv_heads * c.head_dim;
  // FP8 GEMMs read and write whole groups of 16 rows (fp8_gemm.h): every buffer gets the padded
  // row count, and the FP8 input buffer fits the widest input (k = hidden, qd or inter).
  const bool fp8 = options_.weight_dtype == WeightDtype::kFp8;
  const int64_t rows = fp8 ? fp8_act_rows(n) : n;
  const int64_t widest = std::max({c.hidden, qd, c.intermediate});
  const size_t H = static_cast<size_t>(c.hidden), N = static_cast<size_t>(rows);
  const struct {
    DeviceBuffer* b;
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
  // All freed first, so that the new ones may take their room.
  for (const auto& w : want) w.b->reset();
  act_bytes_ = 0;
  act_rows_ = 0;
  for (const auto& w : want) {
    HETERO_RETURN_IF_ERROR(w.b->allocate(w.bytes, "activations", &budget_));
    act_bytes_ += w.bytes;
  }
  act_rows_ = n;
  return Status::ok();
}

Status LlamaCudaEngine::ensure_pages(int64_t tokens) {
  Pages& P = *pages_;
  const int64_t need = (tokens + kKvPageTokens - 1) / kKvPageTokens;
  if (need <= P.pages) return Status::ok();
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_.get()));  // page tables are replaced
  // Grow by at least the pages held (geometric), at least 16; where the device or the budget
  // cannot hold that, by what is needed.
  const int64_t add = std::max<int64_t>({need - P.pages, P.pages, 16});
  const Status st = grow_pages(add);
  if (st.code() != Code::kResourceExhausted || add == need - P.pages) return st;
  return grow_pages(need - P.pages);
}

// Adds `add` pages to every layer, or nothing (a failed allocation frees what this call took).
// With cuDNN attention each layer keeps one slab, its K rows then its V rows token-major
// ([rows][kv_heads][head_dim], cuDNN's dense layout: over pages it ran at half the speed,
// RESULTS §19), regrown by copy, so while it grows the old and the new slab are held together;
// reserve() takes a request's pages at once, before its first chunk.
Status LlamaCudaEngine::grow_pages(int64_t add) {
  Pages& P = *pages_;
  const LlamaConfig& c = config_;
  const bool one_slab = cudnn_ != nullptr;
  const size_t elt = options_.kv_dtype == KvDtype::kFp8 ? 1 : 2;
  const size_t kv_bytes = static_cast<size_t>(c.kv_heads * kKvPageTokens * c.head_dim) * elt;
  const size_t scale_bytes =
      options_.kv_dtype == KvDtype::kFp8 ? static_cast<size_t>(c.kv_heads * kKvPageTokens) * 4 : 0;
  const size_t page_bytes = 2 * kv_bytes + 2 * scale_bytes;
  const size_t L = static_cast<size_t>(c.layers);
  const int64_t pages = P.pages + add;
  const int64_t slab_pages = one_slab ? pages : add;
  std::vector<DeviceBuffer> slabs(L);
  for (DeviceBuffer& slab : slabs)
    HETERO_RETURN_IF_ERROR(
        slab.allocate(page_bytes * static_cast<size_t>(slab_pages), "the KV cache", &budget_));
  std::vector<DeviceBuffer> tables;
  int64_t capacity = P.table_capacity;
  if (pages > capacity) {
    capacity = pages * 2;
    tables.resize(L);
    for (DeviceBuffer& t : tables)
      HETERO_RETURN_IF_ERROR(t.allocate(sizeof(KvPageRef) * static_cast<size_t>(capacity),
                                        "the KV cache's page tables", &budget_));
  }
  // Every allocation succeeded: the cache takes them.
  if (one_slab) {
    const size_t old_rows = kv_bytes * static_cast<size_t>(P.pages);
    for (size_t l = 0; l < L && P.pages > 0; ++l) {
      char* to = slabs[l].get<char>();
      const char* from = P.slabs[l].get<const char>();
      HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpy(to, from, old_rows, cudaMemcpyDeviceToDevice));
      HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpy(to + kv_bytes * static_cast<size_t>(pages),
                                             from + old_rows, old_rows, cudaMemcpyDeviceToDevice));
    }
    P.slabs.clear();
    P.slab_bytes = 0;
    for (auto& h : P.host) h.clear();
  }
  const int64_t first = one_slab ? 0 : P.pages;
  P.kv_bytes = kv_bytes, P.scale_bytes = scale_bytes;
  P.host.resize(L);
  for (size_t l = 0; l < L; ++l) {
    char* base = slabs[l].get<char>();
    for (int64_t i = 0; i < pages - first; ++i) {
      char* pg = base + page_bytes * static_cast<size_t>(i);
      KvPageRef r;
      r.k = pg;
      r.v = pg + kv_bytes;
      if (one_slab)  // K rows, then V rows
        r.k = base + kv_bytes * static_cast<size_t>(i),
        r.v = base + kv_bytes * static_cast<size_t>(pages + i);
      if (scale_bytes) {
        r.k_scale = reinterpret_cast<float*>(pg + 2 * kv_bytes);
        r.v_scale = reinterpret_cast<float*>(pg + 2 * kv_bytes + scale_bytes);
      }
      P.host[l].push_back(r);
    }
    P.slab_bytes += slabs[l].bytes();
    P.slabs.push_back(std::move(slabs[l]));
  }
  if (!tables.empty()) P.table = std::move(tables), P.table_capacity = capacity;
  P.pages = pages;
  for (size_t l = 0; l < L; ++l)
    HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpy(P.table[l].get(), P.host[l].data(),
                                           sizeof(KvPageRef) * static_cast<size_t>(P.pages),
                                           cudaMemcpyHostToDevice));
  return Status::ok();
}

size_t LlamaCudaEngine::cache_bytes() const { return pages_->slab_bytes; }

}  // namespace hetero::cuda
