// Bridge producer: see producer.h.
#include "bridge/producer.h"

#include <omp.h>

#include <cstring>

namespace hetero {

LlamaBridgeProducer::LlamaBridgeProducer(const LlamaCacheProgram* program, FrameSink sink,
                                         size_t max_queued_inputs)
    : program_(program), sink_(std::move(sink)), queue_(max_queued_inputs) {
  worker_ = std::thread([this] { run(); });
}

LlamaBridgeProducer::~LlamaBridgeProducer() {
  queue_.close();
  if (worker_.joinable()) worker_.join();
}

AttentionInputTap LlamaBridgeProducer::tap() {
  return [this](const TapEvent& e) {
    // The service checked the export against the model; a mismatch here is a bug.
    HETERO_CHECK(e.hidden == program_->layout().hidden);
    HETERO_CHECK(e.layer >= 0 && e.layer < program_->layout().layers);
    if (cancelled_.load()) return;
    Work w{e.layer, e.pos0, e.n_tokens, {}};
    w.x.assign(e.x_bf16, e.x_bf16 + e.n_tokens * e.hidden);
    queue_.push(std::move(w));
  };
}

void LlamaBridgeProducer::run() {
  // The program runs beside the forward on a machine with few cores: one thread here, so the
  // engine's GEMMs keep the others.
  omp_set_num_threads(1);
  const DecoderCacheLayout& layout = program_->layout();
  while (auto w = queue_.pop()) {
    if (cancelled_.load()) continue;  // drain without work
    Pending& p = pending_[w->pos0];
    if (p.rows.empty()) p.rows.resize(static_cast<size_t>(layout.layers)), p.n = w->n;
    p.rows[static_cast<size_t>(w->layer)] = program_->run(w->layer, w->pos0, w->n, w->x.data());
    if (++p.layers_done < layout.layers) continue;
    // Every layer has passed this boundary: the segment can leave now.
    Segment s;
    s.seq = next_seq_++;
    s.family = layout.family;
    s.fingerprint = layout.fingerprint;
    s.pos0 = w->pos0;
    s.n_tokens = p.n;
    for (int64_t l = 0; l < layout.layers; ++l) {
      auto& r = p.rows[static_cast<size_t>(l)];
      s.arrays.push_back({"layers." + std::to_string(l) + ".keys", std::move(r.keys)});
      s.arrays.push_back({"layers." + std::to_string(l) + ".values", std::move(r.values)});
    }
    pending_.erase(w->pos0);
    if (!sink_(encode_segment(s))) {
      cancelled_ = true;
      continue;
    }
    if (s.pos0 == covered_) covered_ += s.n_tokens;
  }
}

Manifest LlamaBridgeProducer::finish(int64_t requested_tokens, const Status& engine_status) {
  HETERO_CHECK(!finished_);
  finished_ = true;
  queue_.close();
  worker_.join();
  Manifest m;
  m.fingerprint = program_->layout().fingerprint;
  m.requested_tokens = requested_tokens;
  m.covered_tokens = covered_;
  m.segments = next_seq_;
  m.complete = engine_status.is_ok() && !cancelled_ && covered_ == requested_tokens;
  if (!engine_status.is_ok())
    m.reason = "prefill failed: " + engine_status.to_string();
  else if (cancelled_)
    m.reason = "cancelled by the receiver";
  else if (covered_ != requested_tokens)
    m.reason = "rows sent do not cover the request";
  if (!cancelled_) sink_(encode_manifest(m));
  return m;
}

}  // namespace hetero
