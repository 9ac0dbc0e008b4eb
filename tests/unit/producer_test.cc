// The bridge producer's hand-off from the program's thread to the encoding thread: a segment is
// encoded only after its program says its arrays are ready (a GPU program's copies land
// asynchronously), arrays that view a program's memory go out with that memory's bytes, and a
// program that fails to make a segment ready ends the stream with an incomplete manifest that
// says why. A program that plans its arrays gets its segments framed layer by layer, each layer
// only once that layer is ready, into the same frames.
#include "bridge/producer.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>

#include "bridge/wire.h"

namespace hetero {
namespace {

// A program whose arrays view a buffer that is written only in segment_ready(), the way a GPU
// program's page-locked staging is filled by device copies the encoder has to wait for.
class LateProgram : public SegmentProgram {
 public:
  LateProgram() {
    layout_.family = "llama", layout_.fingerprint = "fp";
    layout_.layers = 2, layout_.hidden = 4, layout_.kv_heads = 1, layout_.head_dim = 2;
  }
  const DecoderCacheLayout& layout() const override { return layout_; }
  Status run(int64_t layer, int64_t pos0, int64_t n, const uint16_t*,
             std::vector<WireArray>* arrays) override {
    auto buf = std::make_shared<std::vector<uint16_t>>(static_cast<size_t>(n * 2), 0);
    {
      std::lock_guard<std::mutex> lock(mu_);  // segment_ready runs on the encoding thread
      buffers_[pos0 * 10 + layer] = buf;
    }
    WireArray a;
    a.name = "layers." + std::to_string(layer) + ".keys";
    a.tensor.dtype = DType::kBF16;
    a.tensor.shape = {1, n, 2};
    a.view = reinterpret_cast<const uint8_t*>(buf->data());
    a.keep = buf;
    arrays->push_back(std::move(a));
    return Status::ok();
  }
  Status segment_ready(int64_t pos0, int64_t n) override {
    ++ready_calls;
    if (pos0 == fail_at) return internal_error("device copy failed");
    if (!plan)
      for (int64_t l = 0; l < layout_.layers; ++l) fill(l, pos0, n);
    return Status::ok();
  }
  std::optional<std::vector<ArraySpec>> planned_arrays(int64_t, int64_t n) const override {
    if (!plan) return std::nullopt;
    std::vector<ArraySpec> specs;
    for (int64_t l = 0; l < layout_.layers; ++l)
      specs.push_back({"layers." + std::to_string(l) + ".keys", DType::kBF16, {1, n, plan_width}});
    return specs;
  }
  Status layer_ready(int64_t layer, int64_t pos0, int64_t n) override {
    ++layer_calls;
    fill(layer, pos0, n);
    return Status::ok();
  }
  Status close_segment(int64_t, int64_t n, std::vector<WireArray>* arrays) override {
    if (add_at_close) arrays->push_back({"extra", Tensor(DType::kBF16, {n})});
    return Status::ok();
  }
  void fill(int64_t layer, int64_t pos0, int64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& b = *buffers_.at(pos0 * 10 + layer);
    for (int64_t i = 0; i < n * 2; ++i) b[static_cast<size_t>(i)] = value(layer, pos0 + i / 2);
  }
  static uint16_t value(int64_t layer, int64_t pos) {
    return static_cast<uint16_t>(100 * layer + pos + 1);
  }
  std::atomic<int> ready_calls{0}, layer_calls{0};
  int64_t fail_at = -1;
  bool plan = false, add_at_close = false;
  int64_t plan_width = 2;  // the planned arrays' last dim (2: what run() makes)

 private:
  DecoderCacheLayout layout_;
  std::mutex mu_;
  std::map<int64_t, std::shared_ptr<std::vector<uint16_t>>> buffers_;
};

struct Stream {
  std::vector<Segment> segments;
  std::vector<Frame> frames;
};

// tags: frames framed with the stream's tagger, sealed with their place as the prefill host's
// sender does, and verified by one receiver's parser.
Manifest run_producer(LateProgram* program, Stream* out, int64_t T, int64_t chunk,
                      const FrameTagger* tags = nullptr) {
  FrameParser parser(1 << 20, tags);
  uint64_t sent = 0;
  auto sink = [out, tags, &parser, &sent](std::string bytes) {
    if (tags) tags->seal(sent++, &bytes);
    parser.feed(bytes.data(), bytes.size());
    auto f = parser.next();
    EXPECT_TRUE(f.is_ok() && f->has_value());
    out->frames.push_back(**f);
    if ((**f).header.value("kind", "") == "segment") {
      auto s = decode_segment(**f);
      EXPECT_TRUE(s.is_ok()) << s.status().to_string();
      out->segments.push_back(*s);
    }
    return true;
  };
  BridgeProducer producer(program, sink, 4, nullptr, nullptr, tags);
  auto tap = producer.tap();
  std::vector<uint16_t> x(static_cast<size_t>(chunk * 4));
  for (int64_t p = 0; p < T; p += chunk)
    for (int32_t l = 0; l < 2; ++l) tap(TapEvent{l, p, std::min(chunk, T - p), 4, x.data()});
  return producer.finish(T, Status::ok());
}

TEST(Producer, EncodesASegmentOnlyOnceItsArraysAreReady) {
  LateProgram program;
  Stream out;
  const Manifest m = run_producer(&program, &out, 10, 4);
  EXPECT_TRUE(m.complete) << m.reason;
  EXPECT_EQ(program.ready_calls.load(), 3);
  ASSERT_EQ(out.segments.size(), 3u);
  for (const Segment& s : out.segments) {
    ASSERT_EQ(s.arrays.size(), 2u);
    for (int64_t l = 0; l < 2; ++l) {
      const Tensor& t = s.arrays[static_cast<size_t>(l)].tensor;
      ASSERT_EQ(t.numel(), s.n_tokens * 2);
      for (int64_t i = 0; i < t.numel(); ++i)
        ASSERT_EQ(t.data<uint16_t>()[i], LateProgram::value(l, s.pos0 + i / 2))
            << "segment at " << s.pos0 << " layer " << l << " element " << i;
    }
  }
}

TEST(Producer, PlannedArraysAreFramedLayerByLayerIntoTheSameFrames) {
  LateProgram whole, by_layer;
  by_layer.plan = true;
  Stream a, b;
  EXPECT_TRUE(run_producer(&whole, &a, 10, 4).complete);
  const Manifest m = run_producer(&by_layer, &b, 10, 4);
  EXPECT_TRUE(m.complete) << m.reason;
  EXPECT_EQ(by_layer.layer_calls.load(), 3 * 2);  // every layer of every segment, before reading
  EXPECT_EQ(by_layer.ready_calls.load(), 3);
  ASSERT_EQ(a.frames.size(), b.frames.size());
  for (size_t i = 0; i < a.frames.size(); ++i) {
    EXPECT_EQ(a.frames[i].header, b.frames[i].header) << "frame " << i;
    EXPECT_EQ(a.frames[i].payload(), b.frames[i].payload()) << "frame " << i;
  }
  // Tagged, as a prefill host with the stack's secret sends them: the same frames, each passing
  // the receiver's tag check.
  const FrameTagger tags("s3cret", new_stream_nonce());
  for (bool plan : {false, true}) {
    LateProgram tagged;
    tagged.plan = plan;
    Stream c;
    const Manifest t = run_producer(&tagged, &c, 10, 4, &tags);
    EXPECT_TRUE(t.complete) << t.reason;
    ASSERT_EQ(c.frames.size(), a.frames.size()) << "planned " << plan;
    for (size_t i = 0; i < a.frames.size(); ++i) {
      EXPECT_EQ(a.frames[i].header, c.frames[i].header) << "frame " << i;
      EXPECT_EQ(a.frames[i].payload(), c.frames[i].payload()) << "frame " << i;
    }
  }
}

TEST(Producer, APlanTheProgramBreaksEndsTheStream) {
  LateProgram more, wrong;
  more.plan = true, more.add_at_close = true;  // arrays beyond the plan
  wrong.plan = true, wrong.plan_width = 3;     // arrays of another shape than planned
  for (LateProgram* p : {&more, &wrong}) {
    Stream out;
    const Manifest m = run_producer(p, &out, 10, 4);
    EXPECT_FALSE(m.complete);
    EXPECT_EQ(m.covered_tokens, 0);
    EXPECT_NE(m.reason.find("cache program failed"), std::string::npos) << m.reason;
    EXPECT_TRUE(out.segments.empty());
  }
}

TEST(Producer, ASegmentThatCannotBeReadyEndsTheStream) {
  LateProgram program;
  program.fail_at = 4;
  Stream out;
  const Manifest m = run_producer(&program, &out, 10, 4);
  EXPECT_FALSE(m.complete);
  EXPECT_EQ(m.covered_tokens, 4);
  EXPECT_NE(m.reason.find("device copy failed"), std::string::npos) << m.reason;
  ASSERT_EQ(out.segments.size(), 1u);  // the first; none after the failed one
  EXPECT_EQ(out.frames.back().header.value("kind", ""), "manifest");
}

}  // namespace
}  // namespace hetero
