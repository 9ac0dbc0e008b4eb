// Bridge producer: see producer.h.
#include "bridge/producer.h"

#include <omp.h>

#include <cstring>
#include <new>

namespace hetero {

void append_kv_arrays(int64_t layer, KvRows r, std::vector<WireArray>* arrays) {
  arrays->push_back({"layers." + std::to_string(layer) + ".keys", std::move(r.keys)});
  arrays->push_back({"layers." + std::to_string(layer) + ".values", std::move(r.values)});
}

std::vector<ArraySpec> llama_segment_specs(const DecoderCacheLayout& layout, int64_t n) {
  std::vector<ArraySpec> specs;
  for (int64_t l = 0; l < layout.layers; ++l)
    for (const char* kind : {".keys", ".values"})
      specs.push_back({"layers." + std::to_string(l) + kind,
                       DType::kBF16,
                       {layout.kv_heads, n, layout.head_dim}});
  return specs;
}

Status LlamaSegmentProgram::run(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x,
                                std::vector<WireArray>* arrays) {
  append_kv_arrays(layer, program_->run(layer, pos0, n, x, rope_ ? &*rope_ : nullptr), arrays);
  return Status::ok();
}

BridgeProducer::BridgeProducer(SegmentProgram* program, FrameSink sink, size_t max_queued_inputs,
                               CaptureStore* capture, FrameBufferPool* buffers,
                               const FrameTagger* tags)
    : program_(program),
      capture_(capture),
      buffers_(buffers),
      tags_(tags),
      sink_(std::move(sink)),
      queue_(max_queued_inputs),
      // A layer's arrays at a time, up to two segments' worth: the memory they hold is the
      // program's (views), bounded by the program.
      segments_(static_cast<size_t>(2 * program->layout().layers + 4)) {
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

void BridgeProducer::set_tail(int64_t start, int64_t computed_from) {
  HETERO_CHECK(computed_from >= 0 && computed_from <= start && next_seq_ == 0);
  start_ = start, computed_from_ = computed_from;
  covered_ = start;  // the encoder's, before it has any segment to deliver
}

AttentionInputTap BridgeProducer::tap() {
  return [this](const TapEvent& e) {
    if (e.pos0 + e.n_tokens <= start_) return;  // the decoder holds these rows already
    if (e.pos0 < start_)
      return fail_capture(failed_precondition(
          "a chunk straddles the tail's start " + std::to_string(start_) + ": rows [" +
          std::to_string(e.pos0) + ", " + std::to_string(e.pos0 + e.n_tokens) + ")"));
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
    try {
      program_one(*w, layout, stream);
    } catch (const std::bad_alloc&) {  // ends the stream with the reason, never the process
      fail_program(resource_exhausted("out of host memory in the cache program at token " +
                                      std::to_string(w->pos0)));
    }
  }
  segments_.close();
}

void BridgeProducer::program_one(Work& w, const DecoderCacheLayout& layout, void* stream) {
  Pending& p = pending_[w.pos0];
  if (p.arrays.empty()) {  // the segment's first layer
    p.arrays.resize(static_cast<size_t>(layout.layers)), p.n = w.n;
    if (auto specs = program_->planned_arrays(w.pos0, w.n)) {
      p.by_layer = true;
      EncodeItem open{EncodeItem::Kind::kOpen, {}, -1, std::move(*specs)};
      open.segment.seq = next_seq_++;
      open.segment.family = layout.family;
      open.segment.fingerprint = layout.fingerprint;
      open.segment.pos0 = w.pos0;
      open.segment.n_tokens = w.n;
      segments_.push(std::move(open));
    }
  }
  if (stream) stream = program_->layer_stream(w.layer);
  Result<const uint16_t*> x =
      w.slot >= 0 ? capture_->ready(w.slot, stream) : Result<const uint16_t*>(w.x.data());
  auto& layer_arrays = p.arrays[static_cast<size_t>(w.layer)];
  Status st = x.is_ok() ? program_->run(w.layer, w.pos0, w.n, *x, &layer_arrays) : x.status();
  if (w.slot >= 0) capture_->release(w.slot, stream);
  if (st.is_ok() && p.by_layer) {
    EncodeItem layer{EncodeItem::Kind::kLayer, {}, w.layer, {}};
    layer.segment.pos0 = w.pos0, layer.segment.n_tokens = p.n;
    layer.segment.arrays = std::move(layer_arrays);
    segments_.push(std::move(layer));
  }
  if (st.is_ok() && ++p.layers_done < layout.layers) return;
  // Every layer has passed this boundary: the segment can leave now.
  Segment s;
  s.family = layout.family;
  s.fingerprint = layout.fingerprint;
  s.pos0 = w.pos0;
  s.n_tokens = p.n;
  const bool by_layer = p.by_layer;
  if (!by_layer) {
    s.seq = next_seq_++;
    for (auto& arrays : p.arrays)
      for (auto& a : arrays) s.arrays.push_back(std::move(a));
  }
  const size_t before = s.arrays.size();
  if (st.is_ok()) st = program_->close_segment(s.pos0, s.n_tokens, &s.arrays);
  if (st.is_ok() && by_layer && s.arrays.size() != before)
    st = internal_error("the program planned its segment's arrays, then added more at close");
  pending_.erase(w.pos0);
  if (!st.is_ok()) {
    // A program error ends the stream without this segment; the manifest says why.
    fail_program(st);
    return;
  }
  // Framed layer by layer, the segment only needs closing (it carries no arrays here).
  segments_.push(EncodeItem{
      by_layer ? EncodeItem::Kind::kClose : EncodeItem::Kind::kWhole, std::move(s), -1, {}});
}

void BridgeProducer::encode() {
  omp_set_num_threads(1);
  std::map<int64_t, SegmentFrameWriter> open;  // by pos0: segments framed layer by layer
  auto deliver = [this](std::string frame, int64_t pos0, int64_t n) {
    if (!sink_(std::move(frame))) {
      cancelled_ = true;
      return;
    }
    if (pos0 == covered_) covered_ += n;
  };
  while (auto item = segments_.pop()) {
    if (cancelled_.load()) {  // drain: the arrays' memory goes back as they go
      open.clear();
      continue;
    }
    const Segment& s = item->segment;
    Status st;
    try {  // a frame the host cannot allocate ends the stream, never the process
      switch (item->kind) {
        case EncodeItem::Kind::kWhole:
          st = program_->segment_ready(s.pos0, s.n_tokens);
          if (st.is_ok()) deliver(encode_segment(s, buffers_, tags_), s.pos0, s.n_tokens);
          break;
        case EncodeItem::Kind::kOpen:
          open.emplace(std::piecewise_construct, std::forward_as_tuple(s.pos0),
                       std::forward_as_tuple(s, std::move(item->specs), buffers_, tags_));
          break;
        case EncodeItem::Kind::kLayer: {
          auto it = open.find(s.pos0);
          HETERO_CHECK(it != open.end());
          st = program_->layer_ready(item->layer, s.pos0, s.n_tokens);
          for (size_t i = 0; st.is_ok() && i < s.arrays.size(); ++i)
            st = it->second.append(s.arrays[i]);
          break;
        }
        case EncodeItem::Kind::kClose: {
          auto it = open.find(s.pos0);
          HETERO_CHECK(it != open.end());
          st = program_->segment_ready(s.pos0, s.n_tokens);
          Result<std::string> frame = st.is_ok() ? it->second.finish() : Result<std::string>(st);
          open.erase(it);
          if (!frame.is_ok()) st = frame.status();
          if (st.is_ok()) deliver(std::move(frame.value()), s.pos0, s.n_tokens);
          break;
        }
      }
    } catch (const std::bad_alloc&) {
      st = resource_exhausted("out of host memory framing the segment at token " +
                              std::to_string(s.pos0));
    }
    if (!st.is_ok()) {
      fail_program(st);
      open.clear();
    }
  }
}

Manifest BridgeProducer::finish(int64_t requested_tokens, const Status& engine_status,
                                const std::string& sealed) {
  HETERO_CHECK(!finished_);
  finished_ = true;
  queue_.close();
  worker_.join();  // closes segments_ when it is done
  encoder_.join();
  Manifest m;
  m.fingerprint = program_->layout().fingerprint;
  m.requested_tokens = requested_tokens;
  m.covered_tokens = covered_;
  m.start = start_;
  m.computed_from = computed_from_;
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
    m.reason = sealed.empty() ? "rows sent do not cover the request" : sealed;
  if (!cancelled_ || !program_status_.is_ok() || !capture_status_.is_ok())
    sink_(encode_manifest(m, tags_));
  return m;
}

}  // namespace hetero
