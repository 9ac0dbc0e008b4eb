// Bridge producer: see producer.h.
#include "bridge/producer.h"

#include <omp.h>

#include <cstring>

namespace hetero {

void append_kv_arrays(int64_t layer, KvRows r, std::vector<WireArray>* arrays) {
  arrays->push_back({"layers." + std::to_string(layer) + ".keys", std::move(r.keys)});
  arrays->push_back({"layers." + std::to_string(layer) + ".values", std::move(r.values)});
}

Status LlamaSegmentProgram::run(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x,
                                std::vector<WireArray>* arrays) {
  append_kv_arrays(layer, program_->run(layer, pos0, n, x), arrays);
  return Status::ok();
}

BridgeProducer::BridgeProducer(SegmentProgram* program, FrameSink sink, size_t max_queued_inputs,
                               CaptureStore* capture)
    : program_(program), capture_(capture), sink_(std::move(sink)), queue_(max_queued_inputs) {
  HETERO_CHECK((program_->device_stream() != nullptr) == (capture_ != nullptr));
  worker_ = std::thread([this] { run(); });
  encoder_ = std::thread([this] { encode(); });
}

BridgeProducer::~BridgeProducer() {
  queue_.close();
  if (worker_.joinable()) worker_.join();
  segments_.close();
  if (encoder_.joinable()) encoder_.join();
}

AttentionInputTap BridgeProducer::tap() {
  return [this](const TapEvent& e) {
    // The service checked the export against the model; a mismatch here is a bug.
    HETERO_CHECK(e.hidden == program_->layout().hidden);
    HETERO_CHECK(e.layer >= 0 && e.layer < program_->layout().layers);
    if (cancelled_.load()) return;
    Work w{e.layer, e.pos0, e.n_tokens, {}};
    if (capture_) {
      if (!e.x_device)
        return fail_capture(
            failed_precondition("a GPU cache program needs the engine's device rows"));
      Result<int> slot = capture_->capture(e);
      if (!slot.is_ok()) return fail_capture(slot.status());
      w.slot = *slot;
    } else {
      if (!e.x_bf16)
        return fail_capture(
            failed_precondition("a host cache program needs the engine's host tap"));
      w.x.assign(e.x_bf16, e.x_bf16 + e.n_tokens * e.hidden);
    }
    queue_.push(std::move(w));
  };
}

void BridgeProducer::fail_capture(Status st) {
  std::lock_guard<std::mutex> lock(status_mu_);
  if (capture_status_.is_ok()) capture_status_ = std::move(st);
  cancelled_ = true;
}

void BridgeProducer::fail_program(Status st) {
  std::lock_guard<std::mutex> lock(status_mu_);
  if (program_status_.is_ok()) program_status_ = std::move(st);
  cancelled_ = true;
}

void BridgeProducer::run() {
  // The program runs beside the forward on a machine with few cores: one thread here, so the
  // engine's GEMMs keep the others.
  omp_set_num_threads(1);
  const DecoderCacheLayout& layout = program_->layout();
  void* stream = program_->device_stream();
  while (auto w = queue_.pop()) {
    if (cancelled_.load()) {  // drain without work
      if (w->slot >= 0) capture_->release(w->slot, nullptr);
      continue;
    }
    Pending& p = pending_[w->pos0];
    if (p.arrays.empty()) p.arrays.resize(static_cast<size_t>(layout.layers)), p.n = w->n;
    const uint16_t* x = w->slot >= 0 ? capture_->ready(w->slot, stream) : w->x.data();
    Status st = program_->run(w->layer, w->pos0, w->n, x, &p.arrays[static_cast<size_t>(w->layer)]);
    if (w->slot >= 0) capture_->release(w->slot, stream);
    if (st.is_ok() && ++p.layers_done < layout.layers) continue;
    // Every layer has passed this boundary: the segment can leave now.
    Segment s;
    s.seq = next_seq_++;
    s.family = layout.family;
    s.fingerprint = layout.fingerprint;
    s.pos0 = w->pos0;
    s.n_tokens = p.n;
    for (auto& layer_arrays : p.arrays)
      for (auto& a : layer_arrays) s.arrays.push_back(std::move(a));
    if (st.is_ok()) st = program_->close_segment(s.pos0, s.n_tokens, &s.arrays);
    pending_.erase(w->pos0);
    if (!st.is_ok()) {
      // A program error ends the stream without this segment; the manifest says why.
      fail_program(st);
      continue;
    }
    segments_.push(std::move(s));
  }
  segments_.close();
}

void BridgeProducer::encode() {
  omp_set_num_threads(1);
  while (auto s = segments_.pop()) {
    if (cancelled_.load()) continue;  // drain: the arrays' memory goes back as they go
    const Status st = program_->segment_ready(s->pos0, s->n_tokens);
    if (!st.is_ok()) {
      fail_program(st);
      continue;
    }
    if (!sink_(encode_segment(*s))) {
      cancelled_ = true;
      continue;
    }
    if (s->pos0 == covered_) covered_ += s->n_tokens;
  }
}

Manifest BridgeProducer::finish(int64_t requested_tokens, const Status& engine_status) {
  HETERO_CHECK(!finished_);
  finished_ = true;
  queue_.close();
  worker_.join();  // closes segments_ when it is done
  encoder_.join();
  Manifest m;
  m.fingerprint = program_->layout().fingerprint;
  m.requested_tokens = requested_tokens;
  m.covered_tokens = covered_;
  m.segments = next_seq_;
  m.complete = engine_status.is_ok() && !cancelled_ && covered_ == requested_tokens;
  m.arith = arith_;
  if (!engine_status.is_ok())
    m.reason = "prefill failed: " + engine_status.to_string();
  else if (!program_status_.is_ok())
    m.reason = "cache program failed: " + program_status_.to_string();
  else if (!capture_status_.is_ok())
    m.reason = "capture failed: " + capture_status_.to_string();
  else if (cancelled_)
    m.reason = "cancelled by the receiver";
  else if (covered_ != requested_tokens)
    m.reason = "rows sent do not cover the request";
  if (!cancelled_ || !program_status_.is_ok() || !capture_status_.is_ok())
    sink_(encode_manifest(m));
  return m;
}

}  // namespace hetero
