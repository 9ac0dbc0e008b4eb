// The cache programs on the GPU as segment programs, and the device capture. See gpu_programs.h.
#include "bridge/cuda/gpu_programs.h"

#include <cstring>

#include "bridge/dsv4_stream.h"
#include "kernels/cuda/ops.h"

namespace hetero::cuda {
namespace {

Status upload_tensor(const Tensor& t, DeviceBuffer* dst, size_t* total) {
  if (t.numel() == 0 || t.shape.empty()) return Status::ok();
  return upload_weights(t.bytes.data(), static_cast<size_t>(t.nbytes()), dst, total);
}

const uint16_t* or_null(const DeviceBuffer& b) { return b.bytes() ? b.get<uint16_t>() : nullptr; }

}  // namespace

// ---- capture ----

GpuCaptureStore::GpuCaptureStore(int slots, int program_device, CaptureCopies copies)
    : slots_(static_cast<size_t>(slots)),
      engine_device_(current_device()),
      program_device_(program_device < 0 ? current_device() : program_device),
      own_stream_(copies == CaptureCopies::kOwn ||
                  (copies == CaptureCopies::kAuto && program_device_ != engine_device_)) {}

Result<std::unique_ptr<GpuCaptureStore>> GpuCaptureStore::create(int slots, int program_device,
                                                                 CaptureCopies copies) {
  std::unique_ptr<GpuCaptureStore> g(new GpuCaptureStore(slots, program_device, copies));
  if (g->program_device_ != g->engine_device_) {
    // The tap's copies write into the program's GPU from the engine's: peer access where the
    // GPUs have it (else the driver stages the copy through the host, slower but correct).
    int can = 0;
    HETERO_CUDA_RETURN_IF_ERROR(
        cudaDeviceCanAccessPeer(&can, g->engine_device_, g->program_device_));
    const cudaError_t e = can ? cudaDeviceEnablePeerAccess(g->program_device_, 0) : cudaSuccess;
    // Already enabled (by another store) is not an error for the copies.
    if (e != cudaErrorPeerAccessAlreadyEnabled)
      HETERO_CUDA_RETURN_IF_ERROR(e);
    else
      cudaGetLastError();
  }
  HETERO_ASSIGN_OR_RETURN(g->copy_, Stream::create());
  for (Slot& s : g->slots_) {
    HETERO_ASSIGN_OR_RETURN(s.tapped, Event::create());  // on the engine's stream
    HETERO_ASSIGN_OR_RETURN(s.copied, Event::create());  // on the engine's stream or copy_
    DeviceGuard on_program(g->program_device_);
    HETERO_ASSIGN_OR_RETURN(s.read, Event::create());  // on the program's
  }
  return g;
}

GpuCaptureStore::~GpuCaptureStore() {
  for (Slot& s : slots_)
    for (const Event* e : {&s.copied, &s.read})
      if (*e) cudaEventSynchronize(e->get());
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
  const Status st = fill(slots_[static_cast<size_t>(slot)], e, bytes);
  if (!st.is_ok()) {
    release(slot, nullptr);
    return st;
  }
  return slot;
}

// Copies e's rows into the slot after the slot's previous reader: on the copy stream where the
// store copies there (CaptureCopies) and the engine takes the copy's event back
// (TapEvent::x_read), so the engine's next kernels need not wait behind it; else on the engine's
// stream.
Status GpuCaptureStore::fill(Slot& s, const TapEvent& e, size_t bytes) {
  if (s.rows.bytes() < bytes) {
    // Growing frees the old rows: their reader must be done with them first.
    if (s.read_pending) HETERO_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(s.read.get()));
    s.read_pending = false;
    DeviceGuard on_program(program_device_);
    HETERO_RETURN_IF_ERROR(s.rows.allocate(bytes, "the attention input's capture slot"));
  }
  const auto engine = static_cast<cudaStream_t>(e.stream);
  const bool own = e.x_read != nullptr && own_stream_;
  const cudaStream_t stream = own ? copy_.get() : engine;
  if (own) {
    HETERO_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.tapped.get(), engine));
    HETERO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, s.tapped.get(), 0));
    if (*e.x_read)  // another consumer's reads: the event left below follows them
      HETERO_CUDA_RETURN_IF_ERROR(
          cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(*e.x_read), 0));
  }
  if (s.read_pending)  // the previous rows' reader
    HETERO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, s.read.get(), 0));
  if (program_device_ == engine_device_)
    HETERO_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(s.rows.get(), e.x_device, bytes, cudaMemcpyDeviceToDevice, stream));
  else
    HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyPeerAsync(s.rows.get(), program_device_, e.x_device,
                                                    engine_device_, bytes, stream));
  HETERO_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.copied.get(), stream));
  if (own) *e.x_read = s.copied.get();
  return Status::ok();
}

Result<const uint16_t*> GpuCaptureStore::ready(int slot, void* stream) {
  Slot& s = slots_[static_cast<size_t>(slot)];
  HETERO_CUDA_RETURN_IF_ERROR(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), s.copied.get(), 0));
  return s.rows.get<const uint16_t>();
}

void GpuCaptureStore::release(int slot, void* stream) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Slot& s = slots_[static_cast<size_t>(slot)];
    s.read_pending = false;
    if (stream != nullptr) {
      const auto st = static_cast<cudaStream_t>(stream);
      s.read_pending = cudaEventRecord(s.read.get(), st) == cudaSuccess;
      // No event: wait for the reads here. If that fails too the device is lost, and the next
      // capture's copy into the slot reports it.
      if (!s.read_pending) cudaGetLastError(), cudaStreamSynchronize(st);
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
  HETERO_RETURN_IF_ERROR(g->rope.upload(w.rope));
  g->device_bytes += g->rope.bytes();
  g->layers.resize(w.layers.size());
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LlamaProgramLayer& L = w.layers[l];
    LlamaGpuWeights::Layer& D = g->layers[l];
    HETERO_RETURN_IF_ERROR(upload_decoder_linear(L.wk, &D.wk, &g->device_bytes));
    HETERO_RETURN_IF_ERROR(upload_decoder_linear(L.wv, &D.wv, &g->device_bytes));
    HETERO_RETURN_IF_ERROR(upload_tensor(L.bk, &D.bk, &g->device_bytes));
    HETERO_RETURN_IF_ERROR(upload_tensor(L.bv, &D.bv, &g->device_bytes));
    HETERO_RETURN_IF_ERROR(upload_tensor(L.k_norm, &D.k_norm, &g->device_bytes));
  }
  return g;
}

LlamaGpuCacheProgram::LlamaGpuCacheProgram(const LlamaGpuWeights* weights, cudaStream_t stream,
                                           const DeviceRopeByCall* rope)
    : w_(weights), stream_(stream), rope_(rope) {}

LlamaGpuCacheProgram::~LlamaGpuCacheProgram() { cudaStreamSynchronize(stream_); }

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
    HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    const char* scratch = "the llama cache program's scratch";
    rows_ = 0;  // until every buffer holds n rows
    HETERO_RETURN_IF_ERROR(xf_.allocate(static_cast<size_t>(n * H) * 4, scratch));
    HETERO_RETURN_IF_ERROR(acc_.allocate(static_cast<size_t>(n * kvd) * 4, scratch));
    for (DeviceBuffer* b : {&k_, &v_, &kt_, &vt_})
      HETERO_RETURN_IF_ERROR(b->allocate(rows_bytes, scratch));
    if (!flags_.bytes()) HETERO_RETURN_IF_ERROR(flags_.allocate(4 * sizeof(int), scratch));
    rows_ = n;
  }
  // The decoder's k/v projections, dense or quantized, in its arithmetic (x is read as f32 by
  // dense weights only).
  if (L.wk.dense() || L.wv.dense()) bf16_to_f32(x, n * H, xf_.get<float>(), stream_);
  HETERO_RETURN_IF_ERROR(apply_decoder_linear(L.wk, x, xf_.get<float>(), n, acc_.get<float>(),
                                              flags_.get<int>(), or_null(L.bk), k_.get<uint16_t>(),
                                              stream_));
  HETERO_RETURN_IF_ERROR(apply_decoder_linear(L.wv, x, xf_.get<float>(), n, acc_.get<float>(),
                                              flags_.get<int>(), or_null(L.bv), v_.get<uint16_t>(),
                                              stream_));
  if (L.k_norm.bytes())
    rms_norm(k_.get<uint16_t>(), n * kvh, hd, L.k_norm.get<uint16_t>(), w_->eps, k_.get<uint16_t>(),
             stream_);
  if (rope_)
    rope_->apply(k_.get<uint16_t>(), n, kvh, hd, pos0, stream_);
  else
    rope_apply(k_.get<uint16_t>(), n, kvh, hd, pos0, w_->rope.table(), stream_);
  // The decoder's layout on the device, then straight into the caller's page-locked memory.
  heads_major(k_.get<uint16_t>(), n, kvh, hd, kt_.get<uint16_t>(), stream_);
  heads_major(v_.get<uint16_t>(), n, kvh, hd, vt_.get<uint16_t>(), stream_);
  HETERO_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(keys_host, kt_.get(), rows_bytes, cudaMemcpyDeviceToHost, stream_));
  HETERO_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(values_host, vt_.get(), rows_bytes, cudaMemcpyDeviceToHost, stream_));
  HETERO_CUDA_RETURN_IF_ERROR(cudaGetLastError());  // the kernels' launches
  return Status::ok();
}

Result<KvRows> LlamaGpuCacheProgram::run_device(int64_t layer, int64_t pos0, int64_t n,
                                                const uint16_t* x) {
  const int64_t kvh = w_->layout.kv_heads, hd = w_->layout.head_dim;
  const size_t rows_bytes = static_cast<size_t>(n * kvh * hd) * 2;
  if (n > pinned_rows_) {
    HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    pinned_rows_ = 0;
    HETERO_RETURN_IF_ERROR(pinned_.allocate(2 * rows_bytes, "the llama cache program's staging"));
    pinned_rows_ = n;
  }
  uint16_t* keys = pinned_.get<uint16_t>();
  uint16_t* values = keys + rows_bytes / 2;
  HETERO_RETURN_IF_ERROR(enqueue(layer, pos0, n, x, keys, values));
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  KvRows r{Tensor(DType::kBF16, {kvh, n, hd}), Tensor(DType::kBF16, {kvh, n, hd})};
  std::memcpy(r.keys.bytes.data(), keys, rows_bytes);
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
  for (const std::unique_ptr<Block>& b : free_)
    if (b->landed) cudaEventSynchronize(b->landed.get());  // the last copies into it
}

Result<std::shared_ptr<PinnedPool::Block>> PinnedPool::take(size_t bytes) {
  std::unique_ptr<Block> b;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty()) b = std::move(free_.back()), free_.pop_back();
  }
  if (!b) {
    b = std::make_unique<Block>();
    HETERO_ASSIGN_OR_RETURN(b->landed, Event::create());
  }
  if (b->memory.bytes() < bytes) {
    if (b->memory.bytes()) HETERO_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(b->landed.get()));
    const size_t before = b->memory.bytes();
    const Status st = b->memory.allocate(bytes, "a segment's page-locked staging");
    std::lock_guard<std::mutex> lock(mu_);
    held_ = held_ - before + b->memory.bytes();
    HETERO_RETURN_IF_ERROR(st);
  }
  // The deleter keeps the pool alive until the block is back.
  std::shared_ptr<PinnedPool> self = self_.lock();
  return std::shared_ptr<Block>(b.release(), [self](Block* x) { self->give_back(x); });
}

void PinnedPool::give_back(Block* b) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.emplace_back(b);
}

size_t PinnedPool::host_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_;
}

Result<std::unique_ptr<LlamaGpuSegmentProgram>> LlamaGpuSegmentProgram::create(
    const LlamaGpuWeights* weights, std::shared_ptr<PinnedPool> pool, const RopeByCall* rope) {
  HETERO_ASSIGN_OR_RETURN(Stream stream, Stream::create());
  std::unique_ptr<DeviceRopeByCall> calls;
  if (rope && rope->per_call()) {
    calls = std::make_unique<DeviceRopeByCall>();
    HETERO_RETURN_IF_ERROR(calls->upload(*rope, &weights->rope));
  }
  return std::unique_ptr<LlamaGpuSegmentProgram>(
      new LlamaGpuSegmentProgram(weights, std::move(stream), std::move(pool), std::move(calls)));
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
  auto* keys = reinterpret_cast<uint16_t*>(block->data()) + 2 * layer * rows;
  uint16_t* values = keys + rows;
  HETERO_RETURN_IF_ERROR(program_.enqueue(layer, pos0, n, x, keys, values));
  // Only this thread records into the block's events, and the encoder waits on a layer's event
  // only after this call has returned (the producer hands the layer over afterwards).
  if (block->layer_landed.size() < static_cast<size_t>(L.layers))
    block->layer_landed.resize(static_cast<size_t>(L.layers));
  Event& layer_event = block->layer_landed[static_cast<size_t>(layer)];
  if (!layer_event) {
    HETERO_ASSIGN_OR_RETURN(layer_event, Event::create());
  }
  HETERO_CUDA_RETURN_IF_ERROR(cudaEventRecord(layer_event.get(), stream_.get()));
  HETERO_CUDA_RETURN_IF_ERROR(cudaEventRecord(block->landed.get(), stream_.get()));
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
  HETERO_CUDA_RETURN_IF_ERROR(
      cudaEventSynchronize(block->layer_landed[static_cast<size_t>(layer)].get()));
  return Status::ok();
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
  HETERO_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(block->landed.get()));
  return Status::ok();
}

// ---- deepseek_v4 ----

struct Dsv4GpuSegmentProgram::Running {
  int device = 0;
  int64_t first_layer = 0, end_layer = 0;
  Stream stream;
  std::unique_ptr<Dsv4GpuCacheProgram> program;
};

Result<std::unique_ptr<Dsv4GpuSegmentProgram>> Dsv4GpuSegmentProgram::create(
    const Dsv4DecoderWeights* host, const std::vector<Part>& parts,
    const std::vector<int64_t>& decoder_calls, int64_t start) {
  std::unique_ptr<Dsv4GpuSegmentProgram> p(new Dsv4GpuSegmentProgram(host));
  int64_t next = 0;
  for (const Part& part : parts) {
    if (part.weights->first_layer != next)
      return invalid_argument(
          "the program's parts must hold the layers in order, each once: a "
          "part starts at layer " +
          std::to_string(part.weights->first_layer) + ", not " + std::to_string(next));
    auto r = std::make_unique<Running>();
    r->device = part.device;
    r->first_layer = part.weights->first_layer, r->end_layer = next = part.weights->end_layer;
    DeviceGuard on(part.device);
    HETERO_ASSIGN_OR_RETURN(r->stream, Stream::create());
    r->program =
        std::make_unique<Dsv4GpuCacheProgram>(part.weights, decoder_calls, r->stream.get(),
                                              Dsv4GpuCacheProgram::kDefaultBlockRows, start);
    HETERO_RETURN_IF_ERROR(r->program->keep_boundary_state());
    p->parts_.push_back(std::move(r));
  }
  if (next != host->layout.layers)
    return invalid_argument("the program's parts hold " + std::to_string(next) + " of " +
                            std::to_string(host->layout.layers) + " layers");
  return p;
}

Result<std::unique_ptr<Dsv4GpuSegmentProgram>> Dsv4GpuSegmentProgram::create(
    const Dsv4DecoderWeights* host, const Dsv4GpuWeights* weights,
    const std::vector<int64_t>& decoder_calls) {
  return create(host, {Part{weights, current_device()}}, decoder_calls);
}

Dsv4GpuSegmentProgram::Dsv4GpuSegmentProgram(const Dsv4DecoderWeights* host) : host_(host) {}

Result<std::shared_ptr<const Checkpoint>> Dsv4GpuSegmentProgram::checkpoint() const {
  auto c = std::make_shared<Dsv4ProgramCheckpoint>();
  c->weights = host_;
  c->layers.resize(static_cast<size_t>(host_->layout.layers));
  for (const auto& r : parts_) {
    DeviceGuard on(r->device);
    HETERO_RETURN_IF_ERROR(r->program->checkpoint_into(c.get()));
  }
  return std::shared_ptr<const Checkpoint>(std::move(c));
}

Status Dsv4GpuSegmentProgram::resume(const Checkpoint& checkpoint) {
  const auto* c = dynamic_cast<const Dsv4ProgramCheckpoint*>(&checkpoint);
  if (!c || c->weights != host_) return invalid_argument("not a checkpoint of this cache program");
  for (const auto& r : parts_) {
    DeviceGuard on(r->device);
    HETERO_RETURN_IF_ERROR(r->program->resume(*c));
  }
  return Status::ok();
}

// A part's program frees its state stream-ordered: on its own GPU.
Dsv4GpuSegmentProgram::~Dsv4GpuSegmentProgram() {
  for (auto& r : parts_) {
    DeviceGuard on(r->device);
    r->program.reset();
  }
}

Dsv4GpuSegmentProgram::Running& Dsv4GpuSegmentProgram::part_of(int64_t layer) const {
  for (const auto& r : parts_)
    if (layer < r->end_layer) return *r;
  return *parts_.back();  // past the last layer: its program refuses it by number
}

void* Dsv4GpuSegmentProgram::device_stream() const { return parts_.front()->stream.get(); }

void* Dsv4GpuSegmentProgram::layer_stream(int64_t layer) const {
  return part_of(layer).stream.get();
}

Status Dsv4GpuSegmentProgram::run(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x,
                                  std::vector<WireArray>* arrays) {
  Running& r = part_of(layer);
  DeviceGuard on_program(r.device);
  Dsv4NewRows rows;
  HETERO_RETURN_IF_ERROR(r.program->feed_device(layer, pos0, n, x, &rows));
  dsv4_feed_arrays(*host_, layer, std::move(rows), arrays);
  if (pos0 + n < r.program->tokens()) {
    HETERO_ASSIGN_OR_RETURN(Dsv4LayerArrays state, r.program->boundary_layer(layer));
    boundaries_.keep(host_->layout.layers, pos0 + n, layer, std::move(state));
  }
  return Status::ok();
}

Status Dsv4GpuSegmentProgram::close_segment(int64_t pos0, int64_t n,
                                            std::vector<WireArray>* arrays) {
  const Dsv4GpuCacheProgram& first = *parts_.front()->program;
  if (pos0 + n != first.tokens()) return boundaries_.close(*host_, pos0 + n, arrays);
  // Every part replays the same schedule: the first one's window index is every one's.
  return dsv4_close_arrays(
      *host_, first.window_idx(),
      [this](int64_t l) {
        Running& r = part_of(l);
        DeviceGuard on(r.device);
        return r.program->finish_layer(l);
      },
      arrays);
}

}  // namespace hetero::cuda
