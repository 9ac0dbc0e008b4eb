// Checkpoints of a sequence on the DeepSeek-V4 CUDA engine: its layers' state (the local window's
// rows, each compressor's pending and pooled rows) copied to the host after n tokens, and
// restored into a reserved engine to resume from there (the prefill host's checkpoints and turns,
// the layer pipeline's stages). See dsv4_cuda.h.
#include <cstdio>
#include <memory>
#include <vector>

#include "common/sysmem.h"
#include "engine/cuda/dsv4_cuda_impl.h"

namespace hetero {

using namespace dsv4_cuda;

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

}  // namespace hetero
