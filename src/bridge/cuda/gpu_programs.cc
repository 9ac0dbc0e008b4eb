// The cache programs on the GPU as segment programs, and the device capture. See gpu_programs.h.
#include "bridge/cuda/gpu_programs.h"

#include <cstring>

#include "bridge/dsv4_stream.h"
#include "kernels/cuda/ops.h"

namespace hetero::cuda {
namespace {

Status cuda_status(const char* what, cudaError_t e) {
  if (e == cudaSuccess) return Status::ok();
  return e == cudaErrorMemoryAllocation
             ? unavailable(std::string(what) + ": out of device memory")
             : internal_error(std::string(what) + ": " + cudaGetErrorString(e));
}

Status upload(const void* src, size_t bytes, DeviceBuffer* dst, size_t* total) {
  if (bytes == 0) return Status::ok();
  HETERO_RETURN_IF_ERROR(dst->allocate(bytes, nullptr, false));
  *total += bytes;
  return cuda_status("uploading the decoder's weights",
                     cudaMemcpy(dst->get(), src, bytes, cudaMemcpyHostToDevice));
}

Status upload_tensor(const Tensor& t, DeviceBuffer* dst, size_t* total) {
  if (t.numel() == 0 || t.shape.empty()) return Status::ok();
  return upload(t.bytes.data(), static_cast<size_t>(t.nbytes()), dst, total);
}

const uint16_t* or_null(const DeviceBuffer& b) { return b.bytes() ? b.get<uint16_t>() : nullptr; }

}  // namespace

// ---- capture ----

GpuCaptureStore::GpuCaptureStore(int slots, int program_device)
    : slots_(static_cast<size_t>(slots)),
      engine_device_(current_device()),
      program_device_(program_device < 0 ? current_device() : program_device) {
  if (program_device_ != engine_device_) {
    // The tap's copies write into the program's GPU from the engine's: peer access where the
    // GPUs have it (else the driver stages the copy through the host, slower but correct).
    int can = 0;
    cudaDeviceCanAccessPeer(&can, engine_device_, program_device_);
    if (can && cudaDeviceEnablePeerAccess(program_device_, 0) != cudaSuccess)
      cudaGetLastError();  // already enabled: not an error for the copies
  }
  for (Slot& s : slots_) {
    cudaEventCreateWithFlags(&s.copied, cudaEventDisableTiming);  // on the engine's stream
    DeviceGuard on_program(program_device_);
    cudaEventCreateWithFlags(&s.read, cudaEventDisableTiming);  // on the program's
  }
}

GpuCaptureStore::~GpuCaptureStore() {
  for (Slot& s : slots_) {
    for (cudaEvent_t e : {s.copied, s.read}) {
      if (!e) continue;
      cudaEventSynchronize(e);
      cudaEventDestroy(e);
    }
  }
}

Result<int> GpuCaptureStore::capture(const TapEvent& e) {
  const size_t bytes = static_cast<size_t>(e.n_tokens * e.hidden) * 2;
  int slot = -1;
  {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      for (size_t i = 0; i < slots_.size() && slot < 0; ++i)
        if (!slots_[i].busy) slot = static_cast<int>(i);
      if (slot >= 0) break;
      freed_.wait(lock);  // back-pressure: the program is a whole ring behind
    }
    slots_[static_cast<size_t>(slot)].busy = true;
  }
  Slot& s = slots_[static_cast<size_t>(slot)];
  if (s.rows.bytes() < bytes) {
    // Growing frees the old rows: their reader must be done with them first.
    if (s.read_pending) cudaEventSynchronize(s.read);
    s.read_pending = false;
    DeviceGuard on_program(program_device_);
    const Status st = s.rows.allocate(bytes, nullptr, false);
    if (!st.is_ok()) {
      release(slot, nullptr);
      return st;
    }
  }
  const auto stream = static_cast<cudaStream_t>(e.stream);
  cudaError_t ce = cudaSuccess;
  if (s.read_pending) ce = cudaStreamWaitEvent(stream, s.read, 0);  // the previous rows' reader
  if (ce == cudaSuccess)
    ce = program_device_ == engine_device_
             ? cudaMemcpyAsync(s.rows.get(), e.x_device, bytes, cudaMemcpyDeviceToDevice, stream)
             : cudaMemcpyPeerAsync(s.rows.get(), program_device_, e.x_device, engine_device_, bytes,
                                   stream);
  if (ce == cudaSuccess) ce = cudaEventRecord(s.copied, stream);
  if (ce != cudaSuccess) {
    release(slot, nullptr);
    return cuda_status("capturing the attention input", ce);
  }
  return slot;
}

const uint16_t* GpuCaptureStore::ready(int slot, void* stream) {
  Slot& s = slots_[static_cast<size_t>(slot)];
  cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), s.copied, 0);
  return s.rows.get<uint16_t>();
}

void GpuCaptureStore::release(int slot, void* stream) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Slot& s = slots_[static_cast<size_t>(slot)];
    s.read_pending = false;
    if (stream != nullptr) {
      const auto st = static_cast<cudaStream_t>(stream);
      s.read_pending = cudaEventRecord(s.read, st) == cudaSuccess;
      if (!s.read_pending) cudaStreamSynchronize(st);  // no event: wait for the reads here
    }
    s.busy = false;
  }
  freed_.notify_one();
}

size_t GpuCaptureStore::device_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t b = 0;
  for (const Slot& s : slots_) b += s.rows.bytes();
  return b;
}

// ---- llama ----

Result<std::unique_ptr<LlamaGpuWeights>> upload_llama_weights(const LlamaDecoderWeights& w) {
  auto g = std::make_unique<LlamaGpuWeights>();
  g->layout = w.layout;
  g->eps = static_cast<float>(w.rms_norm_eps);
  g->rope_base = static_cast<float>(w.rope_base);
  g->layers.resize(w.layers.size());
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LlamaProgramLayer& L = w.layers[l];
    LlamaGpuWeights::Layer& D = g->layers[l];
    HETERO_RETURN_IF_ERROR(upload(L.wk_t.data(), L.wk_t.size() * 4, &D.wk_t, &g->device_bytes));
    HETERO_RETURN_IF_ERROR(upload(L.wv_t.data(), L.wv_t.size() * 4, &D.wv_t, &g->device_bytes));
    HETERO_RETURN_IF_ERROR(upload_tensor(L.bk, &D.bk, &g->device_bytes));
    HETERO_RETURN_IF_ERROR(upload_tensor(L.bv, &D.bv, &g->device_bytes));
    HETERO_RETURN_IF_ERROR(upload_tensor(L.k_norm, &D.k_norm, &g->device_bytes));
    D.wk_range = weight_range(L.wk_t.data(), static_cast<int64_t>(L.wk_t.size()));
    D.wv_range = weight_range(L.wv_t.data(), static_cast<int64_t>(L.wv_t.size()));
  }
  return g;
}

LlamaGpuCacheProgram::LlamaGpuCacheProgram(const LlamaGpuWeights* weights, cudaStream_t stream)
    : w_(weights), stream_(stream) {}

LlamaGpuCacheProgram::~LlamaGpuCacheProgram() {
  cudaStreamSynchronize(stream_);
  if (pinned_) cudaFreeHost(pinned_);
}

size_t LlamaGpuCacheProgram::device_bytes() const {
  return xf_.bytes() + acc_.bytes() + k_.bytes() + v_.bytes() + kt_.bytes() + vt_.bytes() +
         flags_.bytes();
}

Status LlamaGpuCacheProgram::enqueue(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x,
                                     uint16_t* keys_host, uint16_t* values_host) {
  std::lock_guard<std::mutex> lock(mu_);
  const LlamaGpuWeights::Layer& L = w_->layers[static_cast<size_t>(layer)];
  const int64_t H = w_->layout.hidden, kvh = w_->layout.kv_heads, hd = w_->layout.head_dim;
  const int64_t kvd = kvh * hd;
  const size_t rows_bytes = static_cast<size_t>(n * kvd) * 2;
  if (n > rows_) {
    // The buffers are reused layer after layer in the stream's order; growing frees them.
    cudaStreamSynchronize(stream_);
    HETERO_RETURN_IF_ERROR(xf_.allocate(static_cast<size_t>(n * H) * 4, nullptr, false));
    HETERO_RETURN_IF_ERROR(acc_.allocate(static_cast<size_t>(n * kvd) * 4, nullptr, false));
    for (DeviceBuffer* b : {&k_, &v_, &kt_, &vt_})
      HETERO_RETURN_IF_ERROR(b->allocate(rows_bytes, nullptr, false));
    if (!flags_.bytes()) HETERO_RETURN_IF_ERROR(flags_.allocate(5 * sizeof(int), nullptr, false));
    rows_ = n;
  }
  int* stats = flags_.get<int>();
  int* fma_k = stats + 3;
  int* fma_v = stats + 4;
  // Whether the products are exact (then the ordered sums may use FMA: same bits), from x as
  // bf16; then x is not read again.
  exact_products_flag(x, n * H, L.wk_range, stats, fma_k, stream_);
  exact_products_flag(x, n * H, L.wv_range, stats, fma_v, stream_);
  bf16_to_f32(x, n * H, xf_.get<float>(), stream_);
  auto project = [&](const DeviceBuffer& wt, const DeviceBuffer& bias, const int* fma,
                     DeviceBuffer& out) {
    cudaMemsetAsync(acc_.get(), 0, static_cast<size_t>(n * kvd) * 4, stream_);
    gemm_ordered(xf_.get<float>(), n, H, wt.get<float>(), kvd, acc_.get<float>(), stream_, fma);
    round_linear_output(acc_.get<float>(), n, kvd, or_null(bias), out.get<uint16_t>(), stream_);
  };
  project(L.wk_t, L.bk, fma_k, k_);
  project(L.wv_t, L.bv, fma_v, v_);
  if (L.k_norm.bytes())
    rms_norm(k_.get<uint16_t>(), n * kvh, hd, L.k_norm.get<uint16_t>(), w_->eps, k_.get<uint16_t>(),
             stream_);
  rope_rotate_half(k_.get<uint16_t>(), n, kvh, hd, pos0, w_->rope_base, stream_);
  // The decoder's layout on the device, then straight into the caller's page-locked memory.
  heads_major(k_.get<uint16_t>(), n, kvh, hd, kt_.get<uint16_t>(), stream_);
  heads_major(v_.get<uint16_t>(), n, kvh, hd, vt_.get<uint16_t>(), stream_);
  cudaMemcpyAsync(keys_host, kt_.get(), rows_bytes, cudaMemcpyDeviceToHost, stream_);
  cudaMemcpyAsync(values_host, vt_.get(), rows_bytes, cudaMemcpyDeviceToHost, stream_);
  return cuda_status("the llama cache program", cudaGetLastError());
}

Result<KvRows> LlamaGpuCacheProgram::run_device(int64_t layer, int64_t pos0, int64_t n,
                                                const uint16_t* x) {
  const int64_t kvh = w_->layout.kv_heads, hd = w_->layout.head_dim;
  const size_t rows_bytes = static_cast<size_t>(n * kvh * hd) * 2;
  if (n > pinned_rows_) {
    cudaStreamSynchronize(stream_);
    if (pinned_) cudaFreeHost(pinned_);
    pinned_ = nullptr;
    HETERO_RETURN_IF_ERROR(cuda_status(
        "page-locked staging", cudaMallocHost(reinterpret_cast<void**>(&pinned_), 2 * rows_bytes)));
    pinned_rows_ = n;
  }
  uint16_t* values = pinned_ + rows_bytes / 2;
  HETERO_RETURN_IF_ERROR(enqueue(layer, pos0, n, x, pinned_, values));
  HETERO_RETURN_IF_ERROR(cuda_status("the llama cache program", cudaStreamSynchronize(stream_)));
  KvRows r{Tensor(DType::kBF16, {kvh, n, hd}), Tensor(DType::kBF16, {kvh, n, hd})};
  std::memcpy(r.keys.bytes.data(), pinned_, rows_bytes);
  std::memcpy(r.values.bytes.data(), values, rows_bytes);
  return r;
}

// ---- page-locked blocks ----

std::shared_ptr<PinnedPool> make_pinned_pool() {
  auto p = std::make_shared<PinnedPool>();
  p->self_ = p;
  return p;
}

PinnedPool::~PinnedPool() {
  for (Block* b : free_) {
    cudaEventSynchronize(b->landed);
    cudaEventDestroy(b->landed);
    for (cudaEvent_t e : b->layer_landed)
      if (e) cudaEventDestroy(e);
    cudaFreeHost(b->data);
    delete b;
  }
}

Result<std::shared_ptr<PinnedPool::Block>> PinnedPool::take(size_t bytes) {
  Block* b = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty()) b = free_.back(), free_.pop_back();
  }
  if (!b) {
    b = new Block;
    if (cudaEventCreateWithFlags(&b->landed, cudaEventDisableTiming) != cudaSuccess) {
      delete b;
      return internal_error("creating an event for page-locked staging");
    }
  }
  if (b->bytes < bytes) {
    if (b->data) cudaEventSynchronize(b->landed), cudaFreeHost(b->data);
    std::lock_guard<std::mutex> lock(mu_);
    held_ -= b->bytes;
    b->data = nullptr, b->bytes = 0;
    if (cudaMallocHost(reinterpret_cast<void**>(&b->data), bytes) != cudaSuccess) {
      cudaEventDestroy(b->landed);
      delete b;
      return unavailable("out of page-locked host memory for a segment of " +
                         std::to_string(bytes) + " bytes");
    }
    b->bytes = bytes;
    held_ += bytes;
  }
  // The deleter keeps the pool alive until the block is back.
  std::shared_ptr<PinnedPool> self = self_.lock();
  return std::shared_ptr<Block>(b, [self](Block* x) { self->give_back(x); });
}

void PinnedPool::give_back(Block* b) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(b);
}

size_t PinnedPool::host_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_;
}

SideStream::SideStream() { cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking); }
SideStream::~SideStream() {
  if (s_) {
    cudaStreamSynchronize(s_);
    cudaStreamDestroy(s_);
  }
}

Status LlamaGpuSegmentProgram::run(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x,
                                   std::vector<WireArray>* arrays) {
  DeviceGuard on_program(device_);
  const DecoderCacheLayout& L = program_.layout();
  const int64_t rows = n * L.kv_heads * L.head_dim;  // elements per array
  std::shared_ptr<PinnedPool::Block> block;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = filling_.find(pos0);
    if (it == filling_.end()) {
      // The segment's first layer: one block for all its layers' K and V.
      HETERO_ASSIGN_OR_RETURN(auto b, pool_->take(static_cast<size_t>(2 * L.layers * rows) * 2));
      it = filling_.emplace(pos0, std::move(b)).first;
    }
    block = it->second;
  }
  auto* keys = reinterpret_cast<uint16_t*>(block->data) + 2 * layer * rows;
  uint16_t* values = keys + rows;
  HETERO_RETURN_IF_ERROR(program_.enqueue(layer, pos0, n, x, keys, values));
  // Only this thread records into the block's events, and the encoder waits on a layer's event
  // only after this call has returned (the producer hands the layer over afterwards).
  if (block->layer_landed.size() < static_cast<size_t>(L.layers))
    block->layer_landed.resize(static_cast<size_t>(L.layers), nullptr);
  cudaEvent_t& layer_event = block->layer_landed[static_cast<size_t>(layer)];
  if (!layer_event)
    HETERO_RETURN_IF_ERROR(cuda_status(
        "the llama cache program", cudaEventCreateWithFlags(&layer_event, cudaEventDisableTiming)));
  HETERO_RETURN_IF_ERROR(
      cuda_status("the llama cache program", cudaEventRecord(layer_event, stream_.get())));
  HETERO_RETURN_IF_ERROR(
      cuda_status("the llama cache program", cudaEventRecord(block->landed, stream_.get())));
  for (int which = 0; which < 2; ++which) {
    WireArray a;
    a.name = "layers." + std::to_string(layer) + (which ? ".values" : ".keys");
    a.tensor.dtype = DType::kBF16;
    a.tensor.shape = {L.kv_heads, n, L.head_dim};
    a.view = reinterpret_cast<const uint8_t*>(which ? values : keys);
    a.keep = block;
    arrays->push_back(std::move(a));
  }
  return Status::ok();
}

std::shared_ptr<PinnedPool::Block> LlamaGpuSegmentProgram::block_of(int64_t pos0) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = filling_.find(pos0);
  return it == filling_.end() ? nullptr : it->second;
}

Status LlamaGpuSegmentProgram::layer_ready(int64_t layer, int64_t pos0, int64_t n) {
  (void)n;
  std::shared_ptr<PinnedPool::Block> block = block_of(pos0);
  if (!block || block->layer_landed.size() <= static_cast<size_t>(layer) ||
      !block->layer_landed[static_cast<size_t>(layer)])
    return internal_error("no rows in flight for layer " + std::to_string(layer) + " at " +
                          std::to_string(pos0));
  return cuda_status("the llama cache program",
                     cudaEventSynchronize(block->layer_landed[static_cast<size_t>(layer)]));
}

Status LlamaGpuSegmentProgram::segment_ready(int64_t pos0, int64_t n) {
  (void)n;
  std::shared_ptr<PinnedPool::Block> block;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = filling_.find(pos0);
    if (it == filling_.end()) return internal_error("no rows in flight at " + std::to_string(pos0));
    block = std::move(it->second);
    filling_.erase(it);
  }
  return cuda_status("the llama cache program", cudaEventSynchronize(block->landed));
}

// ---- deepseek_v4 ----

Status Dsv4GpuSegmentProgram::run(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x,
                                  std::vector<WireArray>* arrays) {
  DeviceGuard on_program(device_);
  Dsv4NewRows rows;
  HETERO_RETURN_IF_ERROR(program_.feed_device(layer, pos0, n, x, &rows));
  dsv4_feed_arrays(*host_, layer, std::move(rows), arrays);
  return Status::ok();
}

Status Dsv4GpuSegmentProgram::close_segment(int64_t pos0, int64_t n,
                                            std::vector<WireArray>* arrays) {
  if (pos0 + n != program_.tokens()) return Status::ok();
  DeviceGuard on_program(device_);
  return dsv4_close_arrays(
      *host_, program_.window_idx(), [this](int64_t l) { return program_.finish_layer(l); },
      arrays);
}

}  // namespace hetero::cuda
