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

GpuCaptureStore::GpuCaptureStore(int slots) : slots_(static_cast<size_t>(slots)) {
  for (Slot& s : slots_) cudaEventCreateWithFlags(&s.copied, cudaEventDisableTiming);
}

GpuCaptureStore::~GpuCaptureStore() {
  for (Slot& s : slots_) {
    if (s.copied) {
      cudaEventSynchronize(s.copied);
      cudaEventDestroy(s.copied);
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
    const Status st = s.rows.allocate(bytes, nullptr, false);
    if (!st.is_ok()) {
      release(slot);
      return st;
    }
  }
  const auto stream = static_cast<cudaStream_t>(e.stream);
  cudaError_t ce =
      cudaMemcpyAsync(s.rows.get(), e.x_device, bytes, cudaMemcpyDeviceToDevice, stream);
  if (ce == cudaSuccess) ce = cudaEventRecord(s.copied, stream);
  if (ce != cudaSuccess) {
    release(slot);
    return cuda_status("capturing the attention input", ce);
  }
  return slot;
}

const uint16_t* GpuCaptureStore::ready(int slot, void* stream) {
  Slot& s = slots_[static_cast<size_t>(slot)];
  cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), s.copied, 0);
  return s.rows.get<uint16_t>();
}

void GpuCaptureStore::release(int slot) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    slots_[static_cast<size_t>(slot)].busy = false;
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
  }
  return g;
}

LlamaGpuCacheProgram::LlamaGpuCacheProgram(const LlamaGpuWeights* weights, cudaStream_t stream)
    : w_(weights), stream_(stream) {}

LlamaGpuCacheProgram::~LlamaGpuCacheProgram() {
  if (pinned_) {
    cudaStreamSynchronize(stream_);
    cudaFreeHost(pinned_);
  }
}

size_t LlamaGpuCacheProgram::device_bytes() const {
  return xf_.bytes() + acc_.bytes() + k_.bytes() + v_.bytes() + kt_.bytes() + vt_.bytes();
}

Result<KvRows> LlamaGpuCacheProgram::run_device(int64_t layer, int64_t pos0, int64_t n,
                                                const uint16_t* x) {
  std::lock_guard<std::mutex> lock(mu_);
  const LlamaGpuWeights::Layer& L = w_->layers[static_cast<size_t>(layer)];
  const int64_t H = w_->layout.hidden, kvh = w_->layout.kv_heads, hd = w_->layout.head_dim;
  const int64_t kvd = kvh * hd;
  const size_t rows_bytes = static_cast<size_t>(n * kvd) * 2;
  if (n > rows_) {
    cudaStreamSynchronize(stream_);
    HETERO_RETURN_IF_ERROR(xf_.allocate(static_cast<size_t>(n * H) * 4, nullptr, false));
    HETERO_RETURN_IF_ERROR(acc_.allocate(static_cast<size_t>(n * kvd) * 4, nullptr, false));
    for (DeviceBuffer* b : {&k_, &v_, &kt_, &vt_})
      HETERO_RETURN_IF_ERROR(b->allocate(rows_bytes, nullptr, false));
    if (pinned_) cudaFreeHost(pinned_);
    pinned_ = nullptr;
    HETERO_RETURN_IF_ERROR(cuda_status(
        "page-locked staging", cudaMallocHost(reinterpret_cast<void**>(&pinned_), 2 * rows_bytes)));
    rows_ = n;
  }
  bf16_to_f32(x, n * H, xf_.get<float>(), stream_);
  auto project = [&](const DeviceBuffer& wt, const DeviceBuffer& bias, DeviceBuffer& out) {
    cudaMemsetAsync(acc_.get(), 0, static_cast<size_t>(n * kvd) * 4, stream_);
    gemm_ordered(xf_.get<float>(), n, H, wt.get<float>(), kvd, acc_.get<float>(), stream_);
    round_linear_output(acc_.get<float>(), n, kvd, or_null(bias), out.get<uint16_t>(), stream_);
  };
  project(L.wk_t, L.bk, k_);
  project(L.wv_t, L.bv, v_);
  if (L.k_norm.bytes())
    rms_norm(k_.get<uint16_t>(), n * kvh, hd, L.k_norm.get<uint16_t>(), w_->eps, k_.get<uint16_t>(),
             stream_);
  rope_rotate_half(k_.get<uint16_t>(), n, kvh, hd, pos0, w_->rope_base, stream_);
  // The decoder's layout on the device, then one page-locked copy of both.
  heads_major(k_.get<uint16_t>(), n, kvh, hd, kt_.get<uint16_t>(), stream_);
  heads_major(v_.get<uint16_t>(), n, kvh, hd, vt_.get<uint16_t>(), stream_);
  cudaMemcpyAsync(pinned_, kt_.get(), rows_bytes, cudaMemcpyDeviceToHost, stream_);
  cudaMemcpyAsync(reinterpret_cast<char*>(pinned_) + rows_bytes, vt_.get(), rows_bytes,
                  cudaMemcpyDeviceToHost, stream_);
  HETERO_RETURN_IF_ERROR(cuda_status("the llama cache program", cudaStreamSynchronize(stream_)));
  HETERO_RETURN_IF_ERROR(cuda_status("the llama cache program", cudaGetLastError()));
  KvRows r{Tensor(DType::kBF16, {kvh, n, hd}), Tensor(DType::kBF16, {kvh, n, hd})};
  std::memcpy(r.keys.bytes.data(), pinned_, rows_bytes);
  std::memcpy(r.values.bytes.data(), reinterpret_cast<char*>(pinned_) + rows_bytes, rows_bytes);
  return r;
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
  HETERO_ASSIGN_OR_RETURN(KvRows r, program_.run_device(layer, pos0, n, x));
  append_kv_arrays(layer, std::move(r), arrays);
  return Status::ok();
}

// ---- deepseek_v4 ----

Status Dsv4GpuSegmentProgram::run(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x,
                                  std::vector<WireArray>* arrays) {
  Dsv4NewRows rows;
  HETERO_RETURN_IF_ERROR(program_.feed_device(layer, pos0, n, x, &rows));
  dsv4_feed_arrays(*host_, layer, std::move(rows), arrays);
  return Status::ok();
}

Status Dsv4GpuSegmentProgram::close_segment(int64_t pos0, int64_t n,
                                            std::vector<WireArray>* arrays) {
  if (pos0 + n != program_.tokens()) return Status::ok();
  return dsv4_close_arrays(
      *host_, program_.window_idx(), [this](int64_t l) { return program_.finish_layer(l); },
      arrays);
}

}  // namespace hetero::cuda
