// The DeepSeek-V4 layer pipeline (dsv4_pipeline.h): stage engines, their links, and the
// per-stage threads that run chunks through them.
#include "engine/cuda/dsv4_pipeline.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <mutex>
#include <set>
#include <system_error>
#include <thread>

#include "common/queue.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/resource.h"

#ifdef HETERO_HAVE_NCCL
#include <nccl.h>
#endif

namespace hetero {

// One stage boundary. The host threads go in lockstep through two queues.
// - Device copy: `ready` says chunk i's residual is on its way (the sender has enqueued the copy);
//   `writable` says the receiver has taken the last one, so the buffer may be written again.
// - NCCL: `ready` says the sender will send chunk i; `writable` says the receiver has posted its
//   receive. Only then is the send enqueued, so a send never waits on the device for a receive
//   whose host thread is still busy with the chunk before: everything the sender enqueues after
//   the send (its next chunk, the bridge's captures of it) would wait behind it, and a producer
//   waiting for those captures could hold up the receiver's taps: a deadlock.
struct Dsv4Pipeline::Link {
  std::unique_ptr<BoundedQueue<int64_t>> ready, writable;  // new for each prompt
  cuda::DeviceBuffer buf;                                  // the residual on the receiver's device
  cuda::Event sent, consumed;  // device copy: written / read on the device
  void* send_comm = nullptr;   // NCCL: the sender's and the receiver's communicators
  void* recv_comm = nullptr;
  int send_peer = 0, recv_peer = 0;  // NCCL ranks of the other side
  void open(bool nccl) {
    ready = std::make_unique<BoundedQueue<int64_t>>(1);
    writable = std::make_unique<BoundedQueue<int64_t>>(1);
    if (!nccl) writable->push(0);  // the buffer starts free
  }
  void close() { ready->close(), writable->close(); }
};

namespace {

#ifdef HETERO_HAVE_NCCL
Status nccl_status(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return Status::ok();
  return internal_error(std::string(what) + ": " + ncclGetErrorString(r));
}
#endif

}  // namespace

std::vector<int64_t> Dsv4Pipeline::even_split(int64_t layers, int64_t stages) {
  std::vector<int64_t> first;
  const int64_t base = layers / stages, extra = layers % stages;
  int64_t at = 0;
  for (int64_t s = 0; s < stages; ++s) {
    first.push_back(at);
    // The stages after the first take the remainder: the first also embeds the ids.
    at += base + (s > 0 && s <= extra ? 1 : 0);
  }
  return first;
}

Dsv4Pipeline::~Dsv4Pipeline() {
  for (auto& e : engines_)
    if (e) e->synchronize();
#ifdef HETERO_HAVE_NCCL
  if (comms_) {
    auto* comms = static_cast<ncclComm_t*>(comms_);
    for (size_t i = 0; i < engines_.size(); ++i)
      if (comms[i]) ncclCommDestroy(comms[i]);
    delete[] comms;
  }
#endif
}

Result<std::unique_ptr<Dsv4Pipeline>> Dsv4Pipeline::make(
    const Dsv4Config& config, const Dsv4PipelineOptions& options,
    const std::function<Result<std::unique_ptr<Dsv4CudaEngine>>(const Dsv4CudaOptions&)>& one) {
  const int64_t S = static_cast<int64_t>(options.devices.size());
  if (S < 1) return invalid_argument("a pipeline needs at least one stage (one device)");
  if (S > config.layers)
    return invalid_argument("more stages (" + std::to_string(S) + ") than layers (" +
                            std::to_string(config.layers) + ")");
  std::vector<int64_t> first =
      options.first_layer.empty() ? even_split(config.layers, S) : options.first_layer;
  if (static_cast<int64_t>(first.size()) != S || first[0] != 0 ||
      !std::is_sorted(first.begin(), first.end()) ||
      std::adjacent_find(first.begin(), first.end()) != first.end() ||
      first.back() >= config.layers)
    return invalid_argument("stage first layers must start at 0, rise, and stay below " +
                            std::to_string(config.layers));
  const std::set<int> distinct(options.devices.begin(), options.devices.end());
  const bool one_gpu = distinct.size() == 1;
  if (!one_gpu && static_cast<int64_t>(distinct.size()) != S)
    return invalid_argument(
        "a pipeline's stages are each on their own GPU (linked by NCCL) or all on one GPU");
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) cudaGetLastError(), count = 0;
  for (int d : options.devices)
    if (d < 0 || d >= count)
      return invalid_argument("CUDA device " + std::to_string(d) + " of " + std::to_string(count));
  std::unique_ptr<Dsv4Pipeline> p(new Dsv4Pipeline());
  p->config_ = config;
  p->devices_ = options.devices;
  for (int64_t s = 0; s < S; ++s) {
    Dsv4CudaOptions o = options.engine;
    o.first_layer = first[static_cast<size_t>(s)];
    o.end_layer = s + 1 < S ? first[static_cast<size_t>(s + 1)] : config.layers;
    cuda::DeviceGuard on(options.devices[static_cast<size_t>(s)]);
    HETERO_ASSIGN_OR_RETURN(auto e, one(o));
    p->engines_.push_back(std::move(e));
  }
  p->nccl_ = !one_gpu;
  if (p->nccl_) {
#ifdef HETERO_HAVE_NCCL
    auto* comms = new ncclComm_t[static_cast<size_t>(S)]();
    p->comms_ = comms;
    HETERO_RETURN_IF_ERROR(nccl_status(
        ncclCommInitAll(comms, static_cast<int>(S), options.devices.data()), "ncclCommInitAll"));
#else
    return failed_precondition(
        "stages on several GPUs are linked by NCCL, which this build does not have");
#endif
  }
  for (int64_t s = 0; s + 1 < S; ++s) {
    auto link = std::make_unique<Link>();
    cuda::DeviceGuard on(options.devices[static_cast<size_t>(s + 1)]);
    if (p->nccl_) {
      link->send_comm = static_cast<void**>(p->comms_)[s];
      link->recv_comm = static_cast<void**>(p->comms_)[s + 1];
      link->send_peer = static_cast<int>(s + 1), link->recv_peer = static_cast<int>(s);
    } else {
      HETERO_ASSIGN_OR_RETURN(link->sent, cuda::Event::create());
      HETERO_ASSIGN_OR_RETURN(link->consumed, cuda::Event::create());
    }
    p->links_.push_back(std::move(link));
  }
  return p;
}

Result<std::unique_ptr<Dsv4Pipeline>> Dsv4Pipeline::load(const std::string& model_dir,
                                                         const Dsv4PipelineOptions& options) {
  HETERO_ASSIGN_OR_RETURN(Dsv4Config c, load_dsv4_config(model_dir));
  if (options.engine.weight_dtype != cuda::WeightDtype::kCheckpoint) {
    HETERO_ASSIGN_OR_RETURN(Dsv4Weights w, load_dsv4_weights(model_dir));
    return create(w, options);
  }
  return make(c, options,
              [&](const Dsv4CudaOptions& o) { return Dsv4CudaEngine::load(model_dir, o); });
}

Result<std::unique_ptr<Dsv4Pipeline>> Dsv4Pipeline::create(const Dsv4Weights& weights,
                                                           const Dsv4PipelineOptions& options) {
  return make(weights.config, options,
              [&](const Dsv4CudaOptions& o) { return Dsv4CudaEngine::create(weights, o); });
}

Result<std::unique_ptr<Dsv4Pipeline>> Dsv4Pipeline::random(const Dsv4Config& config, uint64_t seed,
                                                           const Dsv4PipelineOptions& options) {
  return make(config, options,
              [&](const Dsv4CudaOptions& o) { return Dsv4CudaEngine::random(config, seed, o); });
}

const Dsv4Config& Dsv4Pipeline::config() const { return config_; }
int64_t Dsv4Pipeline::stages() const { return static_cast<int64_t>(engines_.size()); }
Dsv4CudaEngine& Dsv4Pipeline::stage(int64_t s) { return *engines_[static_cast<size_t>(s)]; }
const char* Dsv4Pipeline::transport() const { return nccl_ ? "nccl" : "device copy"; }
int64_t Dsv4Pipeline::cached_tokens() const { return engines_.front()->cached_tokens(); }

Status Dsv4Pipeline::reset() {
  if (broken_)
    return failed_precondition(
        "a failed prompt aborted this pipeline's NCCL links: load the pipeline again");
  for (size_t s = 0; s < engines_.size(); ++s) {
    cuda::DeviceGuard on(devices_[s]);
    HETERO_RETURN_IF_ERROR(engines_[s]->reset());
  }
  return Status::ok();
}

Status Dsv4Pipeline::reserve(int64_t tokens, int64_t max_chunk_tokens) {
  for (size_t s = 0; s < engines_.size(); ++s) {
    cuda::DeviceGuard on(devices_[s]);
    HETERO_RETURN_IF_ERROR(engines_[s]->reserve(tokens, max_chunk_tokens));
  }
  return size_links(std::max<int64_t>(1, std::min(tokens, max_chunk_tokens)));
}

Status Dsv4Pipeline::set_decoder_calls(const std::vector<int64_t>& calls) {
  for (auto& e : engines_) HETERO_RETURN_IF_ERROR(e->set_decoder_calls(calls));
  return Status::ok();
}

namespace {

struct Dsv4PipelineCheckpoint final : Checkpoint {
  std::vector<std::shared_ptr<const Checkpoint>> stages;
  int64_t n = 0, held = 0;
  int64_t tokens() const override { return n; }
  int64_t bytes() const override { return held; }
};

}  // namespace

std::shared_ptr<const Checkpoint> Dsv4Pipeline::checkpoint() const {
  auto c = std::make_shared<Dsv4PipelineCheckpoint>();
  c->n = cached_tokens();
  for (size_t s = 0; s < engines_.size(); ++s) {
    cuda::DeviceGuard on(devices_[s]);
    auto one = engines_[s]->checkpoint();
    if (!one) return nullptr;
    c->held += one->bytes();
    c->stages.push_back(std::move(one));
  }
  return c;
}

int64_t Dsv4Pipeline::checkpoint_bytes() const {
  int64_t total = 0;
  for (const auto& e : engines_) total += e->checkpoint_bytes();
  return total;
}

Status Dsv4Pipeline::restore(const Checkpoint& checkpoint) {
  const auto* c = dynamic_cast<const Dsv4PipelineCheckpoint*>(&checkpoint);
  if (!c || c->stages.size() != engines_.size())
    return invalid_argument("not a checkpoint of a pipeline of these stages");
  for (size_t s = 0; s < engines_.size(); ++s) {
    cuda::DeviceGuard on(devices_[s]);
    HETERO_RETURN_IF_ERROR(engines_[s]->restore(*c->stages[s]));
  }
  return Status::ok();
}

Status Dsv4Pipeline::size_links(int64_t chunk_tokens) {
  const size_t bytes = static_cast<size_t>(chunk_tokens * config_.hc_mult * config_.hidden) * 2;
  for (size_t s = 0; s < links_.size(); ++s) {
    cuda::DeviceGuard on(devices_[s + 1]);
    if (links_[s]->buf.bytes() < bytes)
      HETERO_RETURN_IF_ERROR(links_[s]->buf.allocate(bytes, "a pipeline link"));
  }
  return Status::ok();
}

int64_t Dsv4Pipeline::first_layer(int64_t s) const {
  return engines_[static_cast<size_t>(s)]->options().first_layer;
}

int64_t Dsv4Pipeline::end_layer(int64_t s) const {
  return engines_[static_cast<size_t>(s)]->options().end_layer;
}

Status Dsv4Pipeline::prefill(const std::vector<int32_t>& ids, const std::vector<int64_t>& chunks,
                             const AttentionInputTap& tap, const std::function<bool()>& stop) {
  if (broken_) return reset();
  const int64_t T = static_cast<int64_t>(ids.size()), S = stages();
  std::vector<std::pair<int64_t, int64_t>> plan;  // [at, len)
  for (int64_t at = 0, i = 0; at < T; ++i) {
    const int64_t len =
        i < static_cast<int64_t>(chunks.size()) && chunks[static_cast<size_t>(i)] > 0
            ? std::min(chunks[static_cast<size_t>(i)], T - at)
            : T - at;
    plan.emplace_back(at, len);
    at += len;
  }
  int64_t widest = 0;
  for (auto [at, len] : plan) widest = std::max(widest, len);
  HETERO_RETURN_IF_ERROR(size_links(widest));
  for (auto& l : links_) l->open(nccl_);
  std::mutex mu;
  Status first_error;
  std::atomic<bool> failed{false};
  auto fail = [&](const Status& st) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!failed.exchange(true)) first_error = st;
    }
    for (auto& l : links_) l->close();
  };
  auto run_stage = [&](int64_t s) {
    cuda::DeviceGuard on(devices_[static_cast<size_t>(s)]);
    Dsv4CudaEngine& e = *engines_[static_cast<size_t>(s)];
    auto st_of = [&](cudaError_t r, const char* what) {
      return r == cudaSuccess ? Status::ok() : cuda::call_status(r, what, __FILE__, __LINE__);
    };
    cudaStream_t stream = static_cast<cudaStream_t>(e.stream());
    Link* in = s > 0 ? links_[static_cast<size_t>(s - 1)].get() : nullptr;
    Link* out = s + 1 < S ? links_[static_cast<size_t>(s)].get() : nullptr;
    // A stage that ends (its chunks done, or stopped) closes its output: the next stage takes
    // what was sent and ends too.
    struct CloseOut {
      Link* out;
      ~CloseOut() {
        if (out) out->ready->close();
      }
    } close_out{out};
    for (size_t i = 0; i < plan.size() && !failed.load(); ++i) {
      if (!in && stop && stop()) return;  // the first stage lets no more chunks in
      const auto [at, len] = plan[i];
      const std::vector<int32_t> chunk(ids.begin() + at, ids.begin() + at + len);
      const size_t bytes = static_cast<size_t>(len * config_.hc_mult * config_.hidden) * 2;
      const uint16_t* h = nullptr;
      if (in) {
        if (!in->ready->pop()) return;  // the sender stopped
        h = in->buf.get<uint16_t>();
        if (nccl_) {
#ifdef HETERO_HAVE_NCCL
          const Status st =
              nccl_status(ncclRecv(in->buf.get(), bytes / 2, ncclBfloat16, in->recv_peer,
                                   static_cast<ncclComm_t>(in->recv_comm), stream),
                          "ncclRecv");
          if (!st.is_ok()) return fail(st);
          if (!in->writable->push(0)) return;  // posted: the sender may send
#endif
        } else {
          const Status st =
              st_of(cudaStreamWaitEvent(stream, in->sent.get()), "wait for a residual");
          if (!st.is_ok()) return fail(st);
        }
      }
      Status st = e.prefill_stage(chunk, h, tap);
      if (!st.is_ok()) return fail(st);
      if (in && !nccl_) {  // the buffer is free once this stream has read it
        st = st_of(cudaEventRecord(in->consumed.get(), stream), "record a read");
        if (!st.is_ok()) return fail(st);
        if (!in->writable->push(0)) return;
      }
      if (!out) continue;
      if (nccl_) {
#ifdef HETERO_HAVE_NCCL
        if (!out->ready->push(static_cast<int64_t>(i))) return;
        if (!out->writable->pop()) return;  // the receiver stopped before posting its receive
        st = nccl_status(ncclSend(e.residual(), bytes / 2, ncclBfloat16, out->send_peer,
                                  static_cast<ncclComm_t>(out->send_comm), stream),
                         "ncclSend");
        if (!st.is_ok()) return fail(st);
#endif
        continue;
      } else {
        if (!out->writable->pop()) return;  // the receiver stopped
        st = st_of(cudaStreamWaitEvent(stream, out->consumed.get()), "wait for a read");
        if (st.is_ok())
          st = st_of(cudaMemcpyAsync(out->buf.get(), e.residual(), bytes, cudaMemcpyDeviceToDevice,
                                     stream),
                     "copy a residual");
        if (st.is_ok()) st = st_of(cudaEventRecord(out->sent.get(), stream), "record a residual");
      }
      if (!st.is_ok()) return fail(st);
      if (!out->ready->push(static_cast<int64_t>(i))) return;
    }
  };
  // A stage thread ends the prompt with a Status, never the process: out of host memory there
  // (the tap's copies among it) fails the prompt as any stage failure does.
  auto guarded = [&](int64_t s) {
    try {
      run_stage(s);
    } catch (const std::bad_alloc&) {
      fail(resource_exhausted("out of host memory in pipeline stage " + std::to_string(s)));
    } catch (const std::exception& ex) {
      fail(internal_error("pipeline stage " + std::to_string(s) + ": " + ex.what()));
    }
  };
  std::vector<std::thread> threads;
  for (int64_t s = 0; s < S; ++s) {
    try {
      threads.emplace_back(guarded, s);
    } catch (const std::system_error& ex) {  // the started stages see the links close and end
      fail(resource_exhausted(std::string("cannot start a pipeline stage's thread: ") + ex.what()));
      break;
    }
  }
  for (auto& t : threads) t.join();
#ifdef HETERO_HAVE_NCCL
  // After a failure an operation may be left unmatched (a send whose enqueue failed after its
  // receive was posted) and would hold a stream forever: abort the links.
  if (failed.load() && nccl_ && comms_) {
    auto* comms = static_cast<ncclComm_t*>(comms_);
    for (int64_t s = 0; s < S; ++s)
      if (comms[s]) ncclCommAbort(comms[s]), comms[s] = nullptr;
    broken_ = true;
  }
#endif
  for (size_t s = 0; s < engines_.size(); ++s) {
    cuda::DeviceGuard on(devices_[s]);
    const Status st = engines_[s]->synchronize();
    if (!st.is_ok() && !failed.load()) failed = true, first_error = st;
  }
  return failed.load() ? first_error : Status::ok();
}

}  // namespace hetero
