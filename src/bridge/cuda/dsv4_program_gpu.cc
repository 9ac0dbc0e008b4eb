// DeepSeek-V4 cache program on the GPU: see dsv4_program_gpu.h. Host code only (hence .cc): it
// enqueues the kernels/cuda twins in the CPU program's order of steps, with the CPU program's
// schedule replay. Per block of rows: x to f32 once (dense weights), the window rows
// (wkv, kv_norm, rope), then each compressor (carry + projections, pooling of the completed
// windows, norm, rope, copy-back, new carry).
#include "bridge/cuda/dsv4_program_gpu.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>

#include "kernels/cuda/dsv4_ops.h"
#include "kernels/cuda/ops.h"

namespace hetero::cuda {

// ----------------------------------------------------------------------------- weights

namespace {

template <typename T>
Status upload(const T* host, size_t count, DeviceBuffer* out, size_t* total) {
  return upload_weights(host, count * sizeof(T), out, total);
}

template <typename T>
Status upload(const std::vector<T>& host, DeviceBuffer* out, size_t* total) {
  return upload(host.data(), host.size(), out, total);
}

Status upload_bf16(const Tensor& t, DeviceBuffer* out, size_t* total) {
  HETERO_CHECK(t.dtype == DType::kBF16);
  return upload(t.data<uint16_t>(), static_cast<size_t>(t.numel()), out, total);
}

Status upload_compressor(const Dsv4ProgramCompressor& c, Dsv4GpuCompressor* g, size_t* total) {
  g->ratio = c.ratio;
  g->head_dim = c.head_dim;
  g->out_dim = c.out_dim;
  HETERO_RETURN_IF_ERROR(upload_decoder_linear(c.wkv, &g->wkv, total));
  HETERO_RETURN_IF_ERROR(upload_decoder_linear(c.wgate, &g->wgate, total));
  HETERO_CHECK(c.ape.size() == static_cast<size_t>(c.ratio * c.out_dim));
  HETERO_RETURN_IF_ERROR(upload(c.ape, &g->ape, total));
  return upload_bf16(c.norm, &g->norm, total);
}

bool is_dense(const GpuDecoderLinear& l) { return l.dense(); }

bool layer_has_dense(const Dsv4GpuLayer& L) {
  bool any = is_dense(L.wkv);
  if (L.ratio > 0) any = any || is_dense(L.pool.wkv) || is_dense(L.pool.wgate);
  if (L.has_index) any = any || is_dense(L.index.wkv) || is_dense(L.index.wgate);
  return any;
}

}  // namespace

Result<std::unique_ptr<Dsv4GpuWeights>> upload_dsv4_weights(const Dsv4DecoderWeights& w,
                                                            int64_t first_layer,
                                                            int64_t end_layer) {
  const int64_t layers = static_cast<int64_t>(w.layers.size());
  if (end_layer < 0) end_layer = layers;
  if (first_layer < 0 || first_layer >= end_layer || end_layer > layers)
    return invalid_argument("decoder layers [" + std::to_string(first_layer) + ", " +
                            std::to_string(end_layer) + ") of " + std::to_string(layers));
  auto g = std::make_unique<Dsv4GpuWeights>();
  g->first_layer = first_layer, g->end_layer = end_layer;
  g->layout = w.layout;
  g->eps = static_cast<float>(w.rms_norm_eps);
  g->window = w.window;
  g->rope_pairs_local = static_cast<int64_t>(w.freqs_local.size());
  g->rope_pairs_compressed = static_cast<int64_t>(w.freqs_compressed.size());
  size_t total = 0;
  HETERO_RETURN_IF_ERROR(upload(w.freqs_local, &g->freqs_local, &total));
  HETERO_RETURN_IF_ERROR(upload(w.freqs_compressed, &g->freqs_compressed, &total));
  g->layers.resize(w.layers.size());
  for (auto i = static_cast<size_t>(first_layer); i < static_cast<size_t>(end_layer); ++i) {
    const Dsv4ProgramLayer& L = w.layers[i];
    Dsv4GpuLayer& G = g->layers[i];
    G.ratio = L.ratio;
    G.has_index = L.has_index;
    HETERO_RETURN_IF_ERROR(upload_decoder_linear(L.wkv, &G.wkv, &total));
    HETERO_RETURN_IF_ERROR(upload_bf16(L.kv_norm, &G.kv_norm, &total));
    if (L.ratio > 0) HETERO_RETURN_IF_ERROR(upload_compressor(L.pool, &G.pool, &total));
    if (L.has_index) HETERO_RETURN_IF_ERROR(upload_compressor(L.index, &G.index, &total));
  }
  g->device_bytes = total;
  return g;
}

// ----------------------------------------------------------------------------- program

Dsv4GpuCacheProgram::Dsv4GpuCacheProgram(const Dsv4GpuWeights* weights,
                                         const std::vector<int64_t>& decoder_calls,
                                         cudaStream_t stream, int64_t block_rows, int64_t start)
    : w_(weights), stream_(stream), block_rows_(std::max<int64_t>(1, block_rows)), start_(start) {
  state_.resize(static_cast<size_t>(w_->layout.layers));
  kept_.resize(state_.size());
  if (start > 0) {  // scheduled by resume()
    tail_calls_ = decoder_calls;
    sched_ = dsv4_pending_tail(start, decoder_calls);
    return;
  }
  sched_ = dsv4_schedule(decoder_calls, w_->window);
}

Status Dsv4GpuCacheProgram::checkpoint_into(Dsv4ProgramCheckpoint* c) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (start_ > 0 && !resumed_) return failed_precondition("the tail program never resumed");
  c->window = sched_.window;
  c->window_first = sched_.window_first;
  c->n = sched_.tokens;
  HETERO_CHECK(c->layers.size() == state_.size());
  for (int64_t l = w_->first_layer; l < w_->end_layer; ++l) {
    if (!state_[static_cast<size_t>(l)].finished)
      return failed_precondition("layer " + std::to_string(l) + " is not finished");
    c->layers[static_cast<size_t>(l)] = kept_[static_cast<size_t>(l)];
    c->count(kept_[static_cast<size_t>(l)]);
  }
  return Status::ok();
}

Status Dsv4GpuCacheProgram::resume(const Dsv4ProgramCheckpoint& c) {
  std::lock_guard<std::mutex> lock(mu_);
  if (start_ == 0 || resumed_) return failed_precondition("only a tail program resumes, once");
  if (c.n != start_)
    return failed_precondition("the checkpoint holds " + std::to_string(c.n) +
                               " tokens; the tail starts at " + std::to_string(start_));
  if (c.layers.size() != state_.size())
    return invalid_argument("the checkpoint is of a model of another depth");
  sched_ = dsv4_schedule(tail_calls_, w_->window, start_, &c.window);
  if (sched_.window_first < c.window_first)
    return failed_precondition("the tail's window reaches position " +
                               std::to_string(sched_.window_first) + ", before the checkpoint's " +
                               std::to_string(c.window_first));
  const int64_t hd = w_->layout.head_dim, W = w_->window;
  const auto up = [&](void* dst, const uint16_t* src, int64_t elems) -> Status {
    if (elems > 0)
      HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, static_cast<size_t>(elems) * 2,
                                                  cudaMemcpyHostToDevice, stream_));
    return Status::ok();
  };
  for (int64_t l = w_->first_layer; l < w_->end_layer; ++l) {
    LayerState& s = state_[static_cast<size_t>(l)];
    const Dsv4ProgramCheckpoint::Layer& L = c.layers[static_cast<size_t>(l)];
    const Dsv4GpuLayer& G = w_->layers[static_cast<size_t>(l)];
    const auto rows = static_cast<int64_t>(L.window_rows.size()) / hd;
    if (rows != c.n - c.window_first)
      return invalid_argument("the checkpoint's layer " + std::to_string(l) + " holds " +
                              std::to_string(rows) + " window rows, not " +
                              std::to_string(c.n - c.window_first));
    const auto take = [&](const Dsv4GpuCompressor& g, const Dsv4ProgramCheckpoint::Raw& raw,
                          PoolState* p) -> Status {
      const auto n = static_cast<int64_t>(raw.kv.size()) / g.out_dim;
      if (n != start_ - raw.base || n > 2 * g.ratio || raw.gate.size() != raw.kv.size())
        return invalid_argument("the checkpoint's compressor rows of layer " + std::to_string(l) +
                                " are not the last windows before its end");
      p->pooled_first = p->pooled_rows = start_ / g.ratio;
      p->carry_base = raw.base;
      return Status::ok();
    };
    if (G.ratio > 0) HETERO_RETURN_IF_ERROR(take(G.pool, L.pool, &s.pool));
    if (G.has_index) HETERO_RETURN_IF_ERROR(take(G.index, L.index, &s.index));
    HETERO_RETURN_IF_ERROR(prepare(G, s));
    // The prefix's rows that still hold a slot come first in the window rows.
    const int64_t kept = start_ - sched_.window_first;
    HETERO_RETURN_IF_ERROR(
        up(s.window_rows.get(), L.window_rows.data() + (rows - kept) * hd, kept * hd));
    if (G.ratio > 0) {
      HETERO_RETURN_IF_ERROR(up(s.pool.carry_kv.get(), L.pool.kv.data(), L.pool.kv.size()));
      HETERO_RETURN_IF_ERROR(up(s.pool.carry_gate.get(), L.pool.gate.data(), L.pool.gate.size()));
    }
    if (G.has_index) {
      HETERO_RETURN_IF_ERROR(up(s.index.carry_kv.get(), L.index.kv.data(), L.index.kv.size()));
      HETERO_RETURN_IF_ERROR(
          up(s.index.carry_gate.get(), L.index.gate.data(), L.index.gate.size()));
    }
    if (boundaries_) {  // keep_recent goes on from the prefix's last window rows
      const auto bytes = static_cast<size_t>(W * hd) * 2;
      HETERO_RETURN_IF_ERROR(s.recent.allocate_async(bytes, stream_, "the boundary window"));
      HETERO_RETURN_IF_ERROR(s.recent_next.allocate_async(bytes, stream_, "the boundary window"));
      s.recent_rows = std::min(rows, W);
      HETERO_RETURN_IF_ERROR(up(s.recent.get(), L.window_rows.data() + (rows - s.recent_rows) * hd,
                                s.recent_rows * hd));
    }
    s.fed = start_;
  }
  // The checkpoint's host vectors may go once the copies are done.
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  resumed_ = true;
  return Status::ok();
}

Status Dsv4GpuCacheProgram::check_held(int64_t layer) const {
  HETERO_RETURN_IF_ERROR(check_dsv4_layer(layer, w_->layout.layers));
  if (layer < w_->first_layer || layer >= w_->end_layer)
    return invalid_argument("layer " + std::to_string(layer) +
                            "'s decoder weights are not on this program's GPU (it holds [" +
                            std::to_string(w_->first_layer) + ", " + std::to_string(w_->end_layer) +
                            "))");
  return Status::ok();
}

// Frees are stream-ordered: they run after every op this program enqueued.
Dsv4GpuCacheProgram::~Dsv4GpuCacheProgram() = default;

size_t Dsv4GpuCacheProgram::device_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t total = 0;
  for (const DeviceBuffer* b : {&flags4_dev_, &flags128_dev_, &x_dev_, &xf_, &acc_, &work_kv_,
                                &work_gate_, &pooled_, &fma_})
    total += b->bytes();
  for (const LayerState& s : state_)
    for (const DeviceBuffer* b :
         {&s.window_rows, &s.pool.carry_kv, &s.pool.carry_gate, &s.index.carry_kv,
          &s.index.carry_gate, &s.recent, &s.recent_next})
      total += b->bytes();
  return total;
}

Status Dsv4GpuCacheProgram::prepare(const Dsv4GpuLayer& L, LayerState& s) {
  const int64_t hd = w_->layout.head_dim, H = w_->layout.hidden;
  if (!scratch_ready_) {
    const int64_t rows = scratch_rows();
    int64_t max_n = hd, work = 0, max_hd = 0;
    bool dense = false;
    for (const Dsv4GpuLayer& G : w_->layers) {
      dense = dense || layer_has_dense(G);
      for (const Dsv4GpuCompressor* c : {&G.pool, &G.index}) {
        if (c->ratio == 0 || (c == &G.index && !G.has_index)) continue;
        max_n = std::max(max_n, c->out_dim);
        work = std::max(work, (2 * c->ratio + rows) * c->out_dim);
        max_hd = std::max(max_hd, c->head_dim);
      }
    }
    const auto u = [](int64_t v) { return static_cast<size_t>(v); };
    const char* scratch = "the cache program's scratch";
    if (dense) {
      HETERO_RETURN_IF_ERROR(xf_.allocate_async(u(rows * H) * 4, stream_, scratch));
      HETERO_RETURN_IF_ERROR(acc_.allocate_async(u(rows * max_n) * 4, stream_, scratch));
      HETERO_RETURN_IF_ERROR(fma_.allocate_async(4 * sizeof(int), stream_, scratch));
    }
    HETERO_RETURN_IF_ERROR(work_kv_.allocate_async(u(work) * 2, stream_, scratch));
    HETERO_RETURN_IF_ERROR(work_gate_.allocate_async(u(work) * 2, stream_, scratch));
    // A block of m rows completes at most m/4 + 2 windows (the carry holds < 2r rows).
    HETERO_RETURN_IF_ERROR(
        pooled_.allocate_async(u((rows / 4 + 2) * max_hd) * 2, stream_, scratch));
    const auto upload_flags = [&](const std::vector<uint8_t>& host, DeviceBuffer* dev) -> Status {
      HETERO_RETURN_IF_ERROR(dev->allocate_async(host.size(), stream_, "the call schedule"));
      if (!host.empty())
        HETERO_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(dev->get(), host.data(), host.size(), cudaMemcpyHostToDevice, stream_));
      return Status::ok();
    };
    HETERO_RETURN_IF_ERROR(upload_flags(sched_.flags4, &flags4_dev_));
    HETERO_RETURN_IF_ERROR(upload_flags(sched_.flags128, &flags128_dev_));
    scratch_ready_ = true;
  }
  HETERO_RETURN_IF_ERROR(s.window_rows.allocate_async(
      static_cast<size_t>((sched_.tokens - sched_.window_first) * hd) * 2, stream_,
      "the window rows"));
  const auto carry = [&](const Dsv4GpuCompressor& c, PoolState* p) -> Status {
    const auto bytes = static_cast<size_t>(2 * c.ratio * c.out_dim) * 2;
    HETERO_RETURN_IF_ERROR(p->carry_kv.allocate_async(bytes, stream_, "a compressor's carry"));
    HETERO_RETURN_IF_ERROR(p->carry_gate.allocate_async(bytes, stream_, "a compressor's carry"));
    // Pooled rows are appended while copies into them are in flight: never reallocate.
    p->pooled.reserve(
        static_cast<size_t>((sched_.tokens / c.ratio - p->pooled_first) * c.head_dim));
    return Status::ok();
  };
  if (L.ratio > 0) HETERO_RETURN_IF_ERROR(carry(L.pool, &s.pool));
  if (L.has_index) HETERO_RETURN_IF_ERROR(carry(L.index, &s.index));
  s.allocated = true;
  HETERO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::ok();
}

Status Dsv4GpuCacheProgram::apply(const GpuDecoderLinear& l, const uint16_t* x, const float* xf,
                                  int64_t m, uint16_t* out) {
  return apply_decoder_linear(l, x, xf, m, acc_.get<float>(), fma_.get<int>(), nullptr, out,
                              stream_);
}

Status Dsv4GpuCacheProgram::feed_pool(const Dsv4GpuCompressor& c, PoolState& s, int64_t pos0,
                                      int64_t m, const uint16_t* x, const float* xf) {
  const int64_t D = c.out_dim, hd = c.head_dim, r = c.ratio;
  const auto row_bytes = static_cast<size_t>(D) * 2;
  uint16_t* kv = work_kv_.get<uint16_t>();
  uint16_t* gate = work_gate_.get<uint16_t>();
  // The work rows start at carry_base: the carry, then this block's projections.
  const int64_t carried = pos0 - s.carry_base;
  if (carried > 0) {
    const auto bytes = static_cast<size_t>(carried) * row_bytes;
    HETERO_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(kv, s.carry_kv.get(), bytes, cudaMemcpyDeviceToDevice, stream_));
    HETERO_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(gate, s.carry_gate.get(), bytes, cudaMemcpyDeviceToDevice, stream_));
  }
  HETERO_RETURN_IF_ERROR(apply(c.wkv, x, xf, m, kv + carried * D));
  HETERO_RETURN_IF_ERROR(apply(c.wgate, x, xf, m, gate + carried * D));
  const int64_t fed = pos0 + m, done = fed / r, j0 = s.pooled_rows, windows = done - j0;
  if (windows > 0) {
    const uint16_t* kw = kv + (j0 * r - s.carry_base) * D;
    const uint16_t* gw = gate + (j0 * r - s.carry_base) * D;
    uint16_t* out = pooled_.get<uint16_t>();
    if (r == 4) {
      // Window j0's overlap lane reads the window before it, which the carry kept.
      HETERO_CHECK(!sched_.flags4[static_cast<size_t>(j0)] || j0 * r - r >= s.carry_base);
      dsv4_pool_overlap(kw, gw, c.ape.get<float>(), flags4_dev_.get<uint8_t>() + j0, windows, r, hd,
                        out, stream_);
    } else {
      dsv4_pool_simple(kw, gw, c.ape.get<float>(), windows, r, hd, out, stream_);
    }
    rms_norm(out, windows, hd, c.norm.get<uint16_t>(), w_->eps, out, stream_);
    dsv4_rope(out, windows, 1, hd, j0, w_->freqs_compressed.get<float>(), w_->rope_pairs_compressed,
              static_cast<int>(r), false, stream_);
    // Within the reserved capacity.
    s.pooled.resize(static_cast<size_t>((done - s.pooled_first) * hd));
    HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.pooled.data() + (j0 - s.pooled_first) * hd, out,
                                                static_cast<size_t>(windows * hd) * 2,
                                                cudaMemcpyDeviceToHost, stream_));
    s.pooled_rows = done;
  }
  // The new carry: the last complete window (the next one's overlap lane) and the incomplete one.
  const int64_t keep_from = std::max<int64_t>(s.carry_base, (done - 1) * r);
  const int64_t keep = fed - keep_from;
  HETERO_CHECK(keep >= 0 && keep <= 2 * r);
  if (keep > 0) {
    const int64_t at = keep_from - s.carry_base;
    const auto bytes = static_cast<size_t>(keep) * row_bytes;
    HETERO_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(s.carry_kv.get(), kv + at * D, bytes, cudaMemcpyDeviceToDevice, stream_));
    HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.carry_gate.get(), gate + at * D, bytes,
                                                cudaMemcpyDeviceToDevice, stream_));
  }
  s.carry_base = keep_from;
  return Status::ok();
}

Status Dsv4GpuCacheProgram::feed_block(const Dsv4GpuLayer& L, LayerState& s, int64_t pos0,
                                       int64_t m, const uint16_t* x) {
  const int64_t H = w_->layout.hidden, hd = w_->layout.head_dim;
  // Window rows: only positions that end up in a slot are computed (as on the CPU).
  const int64_t from = std::max(pos0, sched_.window_first);
  const bool window = from < pos0 + m;
  // x in f32, once for every dense projection of the block: the rows they read.
  const int64_t xf_first = L.ratio > 0 ? pos0 : from;
  float* xf = xf_.get<float>();
  if (layer_has_dense(L) && xf_first < pos0 + m)
    bf16_to_f32(x + (xf_first - pos0) * H, (pos0 + m - xf_first) * H, xf, stream_);
  if (window) {
    const int64_t mw = pos0 + m - from;
    uint16_t* dst = s.window_rows.get<uint16_t>() + (from - sched_.window_first) * hd;
    HETERO_RETURN_IF_ERROR(
        apply(L.wkv, x + (from - pos0) * H, xf ? xf + (from - xf_first) * H : nullptr, mw, dst));
    rms_norm(dst, mw, hd, L.kv_norm.get<uint16_t>(), w_->eps, dst, stream_);
    const bool local = L.ratio == 0;
    dsv4_rope(dst, mw, 1, hd, from, (local ? w_->freqs_local : w_->freqs_compressed).get<float>(),
              local ? w_->rope_pairs_local : w_->rope_pairs_compressed, 1, false, stream_);
  }
  if (L.ratio > 0) HETERO_RETURN_IF_ERROR(feed_pool(L.pool, s.pool, pos0, m, x, xf));
  if (L.has_index) HETERO_RETURN_IF_ERROR(feed_pool(L.index, s.index, pos0, m, x, xf));
  HETERO_CUDA_RETURN_IF_ERROR(cudaGetLastError());  // the kernels' launches
  return Status::ok();
}

Status Dsv4GpuCacheProgram::feed(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x,
                                 Dsv4NewRows* out) {
  return feed_any(layer, pos0, n, x, false, out);
}

Status Dsv4GpuCacheProgram::feed_device(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x,
                                        Dsv4NewRows* out) {
  return feed_any(layer, pos0, n, x, true, out);
}

Status Dsv4GpuCacheProgram::feed_any(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x,
                                     bool on_device, Dsv4NewRows* out) {
  std::lock_guard<std::mutex> lock(mu_);
  HETERO_RETURN_IF_ERROR(check_held(layer));
  if (start_ > 0 && !resumed_)
    return failed_precondition("a tail program needs its prefix's checkpoint (resume) first");
  LayerState& s = state_[static_cast<size_t>(layer)];
  HETERO_RETURN_IF_ERROR(check_dsv4_rows(layer, s.fed, pos0, n, sched_.tokens));
  const Dsv4GpuLayer& L = w_->layers[static_cast<size_t>(layer)];
  const int64_t H = w_->layout.hidden;
  if (!s.allocated) HETERO_RETURN_IF_ERROR(prepare(L, s));
  if (!on_device && x_dev_.bytes() == 0)
    HETERO_RETURN_IF_ERROR(x_dev_.allocate_async(static_cast<size_t>(scratch_rows() * H) * 2,
                                                 stream_, "the attention input's staging"));
  Dsv4NewRows rows;
  rows.first = s.pool.pooled_rows;
  for (int64_t p = pos0; p < pos0 + n; p += block_rows_) {
    const int64_t m = std::min(block_rows_, pos0 + n - p);
    const uint16_t* xb = x + (p - pos0) * H;
    if (!on_device) {
      // Stream-ordered: the copy waits for the previous block's reads of the staging buffer.
      HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(x_dev_.get(), xb, static_cast<size_t>(m * H) * 2,
                                                  cudaMemcpyHostToDevice, stream_));
      xb = x_dev_.get<uint16_t>();
    }
    HETERO_RETURN_IF_ERROR(feed_block(L, s, p, m, xb));
  }
  if (boundaries_ && pos0 + n < sched_.tokens)
    HETERO_RETURN_IF_ERROR(keep_recent(L, s, pos0, n, x, on_device));
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  rows.count = s.pool.pooled_rows - rows.first;
  const auto hd = static_cast<std::ptrdiff_t>(w_->layout.head_dim);
  if (rows.count > 0) {
    const auto at = static_cast<std::ptrdiff_t>(rows.first - s.pool.pooled_first);
    rows.pool.assign(s.pool.pooled.begin() + at * hd, s.pool.pooled.end());
    if (L.has_index) {
      const auto ihd = static_cast<std::ptrdiff_t>(L.index.head_dim);
      rows.index.assign(s.index.pooled.begin() + at * ihd, s.index.pooled.end());
    }
  }
  s.fed = pos0 + n;
  if (out) *out = std::move(rows);
  return Status::ok();
}

Status Dsv4GpuCacheProgram::pool_arrays(const Dsv4GpuCompressor& c, const PoolState& s, int64_t end,
                                        bool with_pooled, Dsv4PoolArrays* a) const {
  const int64_t D = c.out_dim, r = c.ratio, rem = end % r;
  a->buf_kv = Tensor(DType::kBF16, {1, rem, D});
  a->buf_gate = Tensor(DType::kBF16, {1, rem, D});
  if (rem > 0) {
    // The incomplete window is the end of the carry.
    const int64_t at = (end - rem - s.carry_base) * D;
    const auto bytes = static_cast<size_t>(rem * D) * 2;
    HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(a->buf_kv.bytes.data(),
                                                s.carry_kv.get<uint16_t>() + at, bytes,
                                                cudaMemcpyDeviceToHost, stream_));
    HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(a->buf_gate.bytes.data(),
                                                s.carry_gate.get<uint16_t>() + at, bytes,
                                                cudaMemcpyDeviceToHost, stream_));
  }
  a->pooled =
      Tensor(DType::kBF16, {1, with_pooled ? s.pooled_rows - s.pooled_first : 0, c.head_dim});
  if (with_pooled && !s.pooled.empty())
    std::memcpy(a->pooled.bytes.data(), s.pooled.data(), s.pooled.size() * 2);
  return Status::ok();
}

int64_t Dsv4GpuCacheProgram::scratch_rows() const {
  const int64_t tokens = std::max<int64_t>(sched_.tokens, 1);
  const int64_t block = std::min(block_rows_, tokens);
  return boundaries_ ? std::max(block, std::min(w_->window, tokens)) : block;
}

Status Dsv4GpuCacheProgram::keep_boundary_state() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const LayerState& s : state_)
    if (s.fed > 0) return failed_precondition("keep_boundary_state comes before the first feed");
  boundaries_ = true;
  return Status::ok();
}

Status Dsv4GpuCacheProgram::keep_recent(const Dsv4GpuLayer& L, LayerState& s, int64_t pos0,
                                        int64_t n, const uint16_t* x, bool on_device) {
  const int64_t W = w_->window, H = w_->layout.hidden, hd = w_->layout.head_dim;
  const auto bytes = static_cast<size_t>(W * hd) * 2;
  if (s.recent.bytes() == 0) {
    HETERO_RETURN_IF_ERROR(s.recent.allocate_async(bytes, stream_, "the boundary window"));
    HETERO_RETURN_IF_ERROR(s.recent_next.allocate_async(bytes, stream_, "the boundary window"));
  }
  // The new window: the last rows of the one before, then this feed's last (at most W) rows,
  // computed as feed_block computes window rows.
  const int64_t fresh = std::min(n, W), kept = std::min(s.recent_rows, W - fresh);
  const int64_t from = pos0 + n - fresh;
  uint16_t* dst = s.recent_next.get<uint16_t>();
  if (kept > 0)
    HETERO_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, s.recent.get<uint16_t>() + (s.recent_rows - kept) * hd,
                        static_cast<size_t>(kept * hd) * 2, cudaMemcpyDeviceToDevice, stream_));
  const uint16_t* xr = x + (from - pos0) * H;
  if (!on_device) {
    HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        x_dev_.get(), xr, static_cast<size_t>(fresh * H) * 2, cudaMemcpyHostToDevice, stream_));
    xr = x_dev_.get<uint16_t>();
  }
  float* xf = xf_.get<float>();
  if (layer_has_dense(L)) bf16_to_f32(xr, fresh * H, xf, stream_);
  uint16_t* rows = dst + kept * hd;
  HETERO_RETURN_IF_ERROR(apply(L.wkv, xr, xf, fresh, rows));
  rms_norm(rows, fresh, hd, L.kv_norm.get<uint16_t>(), w_->eps, rows, stream_);
  const bool local = L.ratio == 0;
  dsv4_rope(rows, fresh, 1, hd, from, (local ? w_->freqs_local : w_->freqs_compressed).get<float>(),
            local ? w_->rope_pairs_local : w_->rope_pairs_compressed, 1, false, stream_);
  std::swap(s.recent, s.recent_next);
  s.recent_rows = kept + fresh;
  HETERO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::ok();
}

Result<Dsv4LayerArrays> Dsv4GpuCacheProgram::boundary_layer(int64_t layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  HETERO_RETURN_IF_ERROR(check_held(layer));
  const LayerState& s = state_[static_cast<size_t>(layer)];
  if (!boundaries_ || s.fed <= 0 || s.fed >= sched_.tokens || s.finished)
    return failed_precondition("layer " + std::to_string(layer) + ": no boundary at row " +
                               std::to_string(s.fed) +
                               (boundaries_ ? "" : " (the program keeps no boundary state)"));
  const Dsv4GpuLayer& L = w_->layers[static_cast<size_t>(layer)];
  const int64_t hd = w_->layout.head_dim;
  Dsv4LayerArrays a;
  a.ratio = L.ratio;
  a.window = Tensor(DType::kBF16, {1, 1, s.recent_rows, hd});
  HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(a.window.bytes.data(), s.recent.get(),
                                              a.window.bytes.size(), cudaMemcpyDeviceToHost,
                                              stream_));
  if (L.ratio > 0) HETERO_RETURN_IF_ERROR(pool_arrays(L.pool, s.pool, s.fed, false, &a.pool));
  if (L.has_index) HETERO_RETURN_IF_ERROR(pool_arrays(L.index, s.index, s.fed, false, &a.index));
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return a;
}

Result<Dsv4LayerArrays> Dsv4GpuCacheProgram::finish_layer(int64_t layer) {
  std::lock_guard<std::mutex> lock(mu_);
  HETERO_RETURN_IF_ERROR(check_held(layer));
  LayerState& s = state_[static_cast<size_t>(layer)];
  HETERO_RETURN_IF_ERROR(check_dsv4_complete(layer, s.fed, sched_.tokens));
  if (s.finished)
    return failed_precondition("layer " + std::to_string(layer) + " was finished already");
  const Dsv4GpuLayer& L = w_->layers[static_cast<size_t>(layer)];
  const int64_t hd = w_->layout.head_dim;
  Dsv4LayerArrays a;
  a.ratio = L.ratio;
  const auto S = static_cast<int64_t>(sched_.window.slot_pos.size());
  a.window = Tensor(DType::kBF16, {1, 1, S, hd});
  auto* dst = a.window.data<uint16_t>();
  // One copy per run of slots holding consecutive positions (a rotation gives at most two);
  // slots the decoder grew but never wrote stay zero.
  for (int64_t i = 0; i < S;) {
    const int64_t p = sched_.window.slot_pos[static_cast<size_t>(i)];
    if (p < 0) {
      ++i;
      continue;
    }
    int64_t j = i + 1;
    while (j < S && sched_.window.slot_pos[static_cast<size_t>(j)] == p + (j - i)) ++j;
    HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        dst + i * hd, s.window_rows.get<uint16_t>() + (p - sched_.window_first) * hd,
        static_cast<size_t>((j - i) * hd) * 2, cudaMemcpyDeviceToHost, stream_));
    i = j;
  }
  if (L.ratio > 0)
    HETERO_RETURN_IF_ERROR(pool_arrays(L.pool, s.pool, sched_.tokens, true, &a.pool));
  if (L.has_index)
    HETERO_RETURN_IF_ERROR(pool_arrays(L.index, s.index, sched_.tokens, true, &a.index));
  // What a later tail resumes from (checkpoint_into): the window rows and the carries, on the
  // host before the device state goes (a few windows' rows a layer).
  Dsv4ProgramCheckpoint::Layer& k = kept_[static_cast<size_t>(layer)];
  const auto down = [&](const DeviceBuffer& b, int64_t elems, std::vector<uint16_t>* out) {
    out->resize(static_cast<size_t>(elems));
    return elems > 0 ? cudaMemcpyAsync(out->data(), b.get(), out->size() * 2,
                                       cudaMemcpyDeviceToHost, stream_)
                     : cudaSuccess;
  };
  HETERO_CUDA_RETURN_IF_ERROR(
      down(s.window_rows, (sched_.tokens - sched_.window_first) * hd, &k.window_rows));
  for (const auto& [c, p, raw] :
       {std::tuple{&L.pool, &s.pool, &k.pool}, std::tuple{&L.index, &s.index, &k.index}}) {
    if (c->ratio == 0 || (c == &L.index && !L.has_index)) continue;
    raw->base = p->carry_base;
    const int64_t elems = (sched_.tokens - p->carry_base) * c->out_dim;
    HETERO_CUDA_RETURN_IF_ERROR(down(p->carry_kv, elems, &raw->kv));
    HETERO_CUDA_RETURN_IF_ERROR(down(p->carry_gate, elems, &raw->gate));
  }
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  // The layer's device state is no longer needed; its pooled rows live on in `a`.
  s.window_rows.reset();
  s.recent.reset();
  s.recent_next.reset();
  for (PoolState* p : {&s.pool, &s.index}) {
    p->carry_kv.reset();
    p->carry_gate.reset();
    p->pooled = {};
  }
  s.finished = true;
  return a;
}

}  // namespace hetero::cuda
