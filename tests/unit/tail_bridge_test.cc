// Tail-only bridges on the prefill side and the decode side's assembler: a request with a start
// streams rows [start, T) only; the prefill host's prefix cache of engine state lets a later
// request resume where an earlier one left off, and the rows it sends are the ones a forward from
// position 0 would send (the fake engine's rows depend on every token before them, so a wrong
// restored state shows); the assembler takes a tail and writes it as a store entry with its start.
#include <gtest/gtest.h>
#include <httplib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "bridge/assembler.h"
#include "bridge/prefill_request.h"
#include "bridge/wire.h"
#include "decode/prefill_client.h"
#include "echo_program.h"
#include "prefill/service.h"
#include "prefill/state_cache.h"

namespace hetero {
namespace {

constexpr int64_t kLayers = kEchoLayers, kHidden = kEchoHidden, kVocab = 100;
DecoderCacheLayout test_layout() { return echo_layout("fp-tail"); }

// An engine whose state per token is a running hash of every id so far (per layer), and whose
// tap rows are that hash: a row is right only if the state before it was.
class ChainEngine : public PrefillEngine {
 public:
  Status reset() override {
    state_.clear();
    return Status::ok();
  }
  Status prefill_chunk(const std::vector<int32_t>& ids, const AttentionInputTap& tap) override {
    if (chunk_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(chunk_ms));
    const int64_t pos0 = static_cast<int64_t>(state_.size()) / kLayers;
    const auto n = static_cast<int64_t>(ids.size());
    computed += n;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t l = 0; l < kLayers; ++l) {
        const uint16_t prev = pos0 + i > 0
                                  ? state_[static_cast<size_t>((pos0 + i - 1) * kLayers + l)]
                                  : static_cast<uint16_t>(l + 1);
        state_.push_back(static_cast<uint16_t>(prev * 31u + static_cast<uint16_t>(ids[i]) + 7u));
      }
    std::vector<uint16_t> x(static_cast<size_t>(n * kHidden));
    for (int32_t l = 0; l < kLayers; ++l) {
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < kHidden; ++j)
          x[static_cast<size_t>(i * kHidden + j)] =
              static_cast<uint16_t>(state_[static_cast<size_t>((pos0 + i) * kLayers + l)] + j);
      if (tap) tap(TapEvent{l, pos0, n, kHidden, x.data()});
    }
    return Status::ok();
  }
  int64_t vocab() const override { return kVocab; }
  int64_t state_row_bytes() const override { return state_rows ? kLayers * 2 : 0; }
  Status save_state(int64_t pos0, int64_t n, uint8_t* out) override {
    if ((pos0 + n) * kLayers > static_cast<int64_t>(state_.size()))
      return invalid_argument("past the state");
    std::memcpy(out, state_.data() + pos0 * kLayers, static_cast<size_t>(n * kLayers * 2));
    return Status::ok();
  }
  Status load_state(int64_t pos0, int64_t n, const uint8_t* in) override {
    if (pos0 * kLayers != static_cast<int64_t>(state_.size()))
      return invalid_argument("not at the end");
    const auto* rows = reinterpret_cast<const uint16_t*>(in);
    state_.insert(state_.end(), rows, rows + n * kLayers);
    return Status::ok();
  }
  bool state_rows = true;            // false: an engine that hands out no state
  std::atomic<int64_t> computed{0};  // tokens run through prefill_chunk
  int chunk_ms = 0;                  // how long each chunk takes

 private:
  std::vector<uint16_t> state_;  // [tokens][layers]
};

std::vector<int32_t> conversation(int64_t n, int32_t salt = 0) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 7 + salt) % kVocab);
  return ids;
}

class TailBridgeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    service_ = std::make_unique<PrefillService>(
        &engine_, test_layout(),
        [](const PrefillRequest&) -> Result<std::unique_ptr<SegmentProgram>> {
          return std::unique_ptr<SegmentProgram>(std::make_unique<EchoProgram>(test_layout()));
        },
        /*default_chunk_tokens=*/8, /*max_tokens=*/10000);
    service_->set_state_cache(/*block_tokens=*/16, /*max_bytes=*/1 << 20);
  }

  // Runs a request through the service (no HTTP): the segments' rows by (layer, position) and
  // the manifest.
  struct Rows {
    std::map<std::pair<int64_t, int64_t>, uint16_t> key0;  // (layer, pos) -> keys[0]
    std::vector<std::pair<int64_t, int64_t>> ranges;
    Manifest manifest;
    int keepalives = 0;
  };
  Rows run(const std::vector<int32_t>& ids, int64_t start) {
    PrefillRequest req;
    req.ids = ids;
    req.fingerprint = "fp-tail";
    req.start = start;
    Rows out;
    out.manifest = service_->run(req, [&](std::string frame) {
      collect(frame, &out);
      return true;
    });
    return out;
  }

  // The frames in `bytes` (whole ones) into out: segments' rows, the manifest; keep-alives
  // counted.
  static void collect(const std::string& bytes, Rows* out) {
    FrameParser p(int64_t{1} << 20);
    p.feed(bytes.data(), bytes.size());
    for (;;) {
      auto f = p.next();
      ASSERT_TRUE(f.is_ok()) << f.status().to_string();
      if (!f->has_value()) return;
      const std::string kind = (**f).header.value("kind", "");
      if (kind == "keepalive") {
        ++out->keepalives;
        continue;
      }
      if (kind == "manifest") {
        auto m = decode_manifest(**f);
        ASSERT_TRUE(m.is_ok());
        out->manifest = m.value();
        continue;
      }
      auto s = decode_segment(std::move(**f));
      ASSERT_TRUE(s.is_ok());
      out->ranges.emplace_back(s->pos0, s->n_tokens);
      for (int64_t l = 0; l < kLayers; ++l) {
        const auto* k =
            reinterpret_cast<const uint16_t*>(s->arrays[static_cast<size_t>(2 * l)].data());
        for (int64_t i = 0; i < s->n_tokens; ++i) out->key0[{l, s->pos0 + i}] = k[i * 2];
      }
    }
  }

  // The same over HTTP (the service started), with the time its answer ended.
  Rows post(const std::vector<int32_t>& ids, std::chrono::steady_clock::time_point* done) {
    httplib::Client cli("127.0.0.1", service_->bound_port());
    cli.set_read_timeout(30, 0);
    const nlohmann::json body = {{"ids", ids}, {"fingerprint", "fp-tail"}};
    auto res = cli.Post("/v1/prefill", body.dump(), "application/json");
    *done = std::chrono::steady_clock::now();
    Rows out;
    EXPECT_TRUE(res && res->status == 200) << (res ? res->body : "no response");
    if (res) collect(res->body, &out);
    return out;
  }

  ChainEngine engine_;
  std::unique_ptr<PrefillService> service_;
};

TEST_F(TailBridgeTest, ATailStreamsOnlyItsRowsAndTheyAreTheWholeForwardsRows) {
  const std::vector<int32_t> ids = conversation(100);
  const Rows whole = run(ids, 0);
  ASSERT_TRUE(whole.manifest.complete) << whole.manifest.reason;

  service_->set_state_cache(16, 0);  // no prefix cache: the tail's prefix is computed again
  engine_.computed = 0;
  const Rows tail = run(ids, 37);
  ASSERT_TRUE(tail.manifest.complete) << tail.manifest.reason;
  EXPECT_EQ(tail.manifest.start, 37);
  EXPECT_EQ(tail.manifest.computed_from, 0);
  EXPECT_EQ(tail.manifest.covered_tokens, 100);
  EXPECT_EQ(engine_.computed, 100);
  // Rows from 37 only, the first chunk starting there.
  ASSERT_FALSE(tail.ranges.empty());
  EXPECT_EQ(tail.ranges.front(), (std::pair<int64_t, int64_t>{37, 8}));
  EXPECT_EQ(static_cast<int64_t>(tail.key0.size()), kLayers * 63);
  for (const auto& [at, v] : tail.key0)
    EXPECT_EQ(whole.key0.at(at), v) << at.first << "," << at.second;
}

TEST_F(TailBridgeTest, ALaterTurnResumesFromTheCachedStateAndSendsTheSameRows) {
  // Turn 1: 70 tokens. Turn 2 extends them to 150, of which the decoder holds 90.
  std::vector<int32_t> turn2 = conversation(150);
  const std::vector<int32_t> turn1(turn2.begin(), turn2.begin() + 70);
  ASSERT_TRUE(run(turn1, 0).manifest.complete);
  EXPECT_EQ(service_->state_cache()->blocks(), 4);  // 70 tokens: 4 whole blocks of 16

  engine_.computed = 0;
  const Rows warm = run(turn2, 90);
  ASSERT_TRUE(warm.manifest.complete) << warm.manifest.reason;
  EXPECT_EQ(warm.manifest.computed_from, 64);  // the cached blocks, not past the start
  EXPECT_EQ(engine_.computed, 150 - 64);
  EXPECT_EQ(warm.ranges.front().first, 90);

  // The same rows as a cold forward over the whole of turn 2.
  service_->set_state_cache(16, 0);
  const Rows cold = run(turn2, 0);
  ASSERT_TRUE(cold.manifest.complete);
  EXPECT_EQ(cold.manifest.computed_from, 0);
  for (const auto& [at, v] : warm.key0) EXPECT_EQ(cold.key0.at(at), v);

  // Another conversation shares none of it: computed from 0.
  service_->set_state_cache(16, 1 << 20);
  ASSERT_TRUE(run(turn2, 0).manifest.complete);
  std::vector<int32_t> other = conversation(150, 3);
  engine_.computed = 0;
  const Rows fresh = run(other, 100);
  EXPECT_EQ(fresh.manifest.computed_from, 0);
  EXPECT_EQ(engine_.computed, 150);
}

TEST_F(TailBridgeTest, ALongPrefillGivesTheEngineToAShortOneAndResumesWithTheSameRows) {
  const std::vector<int32_t> long_ids = conversation(400), short_ids = conversation(20, 9);
  const Rows alone = run(long_ids, 0);  // no HTTP: never gives the engine up
  ASSERT_TRUE(alone.manifest.complete);
  service_->set_state_cache(16, 1 << 20);  // empty again
  service_->set_turn_ms(1);
  engine_.chunk_ms = 20;  // 50 chunks of 8: a second for the long one
  ASSERT_TRUE(service_->start("127.0.0.1", 0).is_ok());
  engine_.computed = 0;
  std::chrono::steady_clock::time_point long_done, short_done;
  Rows long_rows, short_rows;
  std::thread a([&] { long_rows = post(long_ids, &long_done); });
  for (int i = 0; i < 1000 && engine_.computed < 40; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  std::thread b([&] { short_rows = post(short_ids, &short_done); });
  a.join();
  b.join();
  service_->stop();
  ASSERT_TRUE(long_rows.manifest.complete) << long_rows.manifest.reason;
  ASSERT_TRUE(short_rows.manifest.complete) << short_rows.manifest.reason;
  EXPECT_LT(short_done, long_done);  // the short one did not wait for the whole long one
  // The long one resumed from its cached blocks and recomputed the rest of its last one
  // (silently): every row once, each the row of its forward alone.
  EXPECT_GT(engine_.computed.load(), 400 + 20);
  EXPECT_EQ(long_rows.key0, alone.key0);
  int64_t next = 0;
  for (const auto& [pos0, n] : long_rows.ranges) {
    EXPECT_EQ(pos0, next);
    next = pos0 + n;
  }
  EXPECT_EQ(next, 400);
}

TEST_F(TailBridgeTest, AnEngineWithoutStateComputesTheWholePrefix) {
  engine_.state_rows = false;
  const std::vector<int32_t> ids = conversation(80);
  ASSERT_TRUE(run(ids, 0).manifest.complete);
  EXPECT_EQ(service_->state_cache()->blocks(), 0);
  engine_.computed = 0;
  const Rows tail = run(ids, 60);
  EXPECT_TRUE(tail.manifest.complete);
  EXPECT_EQ(tail.manifest.computed_from, 0);
  EXPECT_EQ(engine_.computed, 80);
}

TEST(PrefixStateCacheTest, EvictsTheLeastRecentlyUsedChainFromItsEnd) {
  ChainEngine engine;
  PrefixStateCache cache(/*block_tokens=*/4, /*max_bytes=*/6 * 4 * kLayers * 2);  // 6 blocks
  const std::vector<int32_t> a = conversation(16), b = conversation(16, 5);
  ASSERT_TRUE(engine.prefill_chunk(a, {}).is_ok());
  ASSERT_TRUE(cache.save(a, 16, &engine).is_ok());
  EXPECT_EQ(cache.blocks(), 4);
  EXPECT_EQ(cache.lookup(a, 16), 16);
  EXPECT_EQ(cache.lookup(a, 15), 12);  // whole blocks within the limit
  ASSERT_TRUE(engine.reset().is_ok());
  ASSERT_TRUE(engine.prefill_chunk(b, {}).is_ok());
  ASSERT_TRUE(cache.save(b, 16, &engine).is_ok());  // 8 blocks > 6: a's deepest two go
  EXPECT_EQ(cache.blocks(), 6);
  EXPECT_EQ(cache.lookup(a, 16), 8);
  EXPECT_EQ(cache.lookup(b, 16), 16);
  // The restored state is the saved one.
  ChainEngine fresh;
  ASSERT_TRUE(cache.restore(b, 16, &fresh).is_ok());
  std::vector<uint8_t> want(16 * kLayers * 2), got(want.size());
  ASSERT_TRUE(engine.save_state(0, 16, want.data()).is_ok());
  ASSERT_TRUE(fresh.save_state(0, 16, got.data()).is_ok());
  EXPECT_EQ(want, got);
  // A block evicted since the lookup is an error, not a wrong state.
  cache.clear();
  ChainEngine other;
  EXPECT_EQ(cache.restore(b, 16, &other).code(), Code::kNotFound);
}

// A chain hash that sees only lengths: every block at a depth collides with every other.
uint64_t colliding_hash(const void*, size_t bytes, uint64_t seed) { return seed * 31 + bytes; }

// Issue 50, finding 7: a block replaced after a key collision left its children linked, so a
// tail could resume another prefix's state. A planted collision: b's first block replaces a's,
// and a's second block (whose key chained through it) must go with it.
TEST(PrefixStateCacheTest, ABlockReplacedAfterACollisionTakesItsChainWithIt) {
  ChainEngine engine;
  PrefixStateCache cache(/*block_tokens=*/4, /*max_bytes=*/1 << 20, colliding_hash);
  const std::vector<int32_t> a = conversation(8), b = conversation(4, 5);
  ASSERT_TRUE(engine.prefill_chunk(a, {}).is_ok());
  ASSERT_TRUE(cache.save(a, 8, &engine).is_ok());
  EXPECT_EQ(cache.lookup(a, 8), 8);
  ASSERT_TRUE(engine.reset().is_ok());
  ASSERT_TRUE(engine.prefill_chunk(b, {}).is_ok());
  ASSERT_TRUE(cache.save(b, 4, &engine).is_ok());
  EXPECT_EQ(cache.blocks(), 1);
  // b's block, then a's second block's tokens: only b's own block is held.
  std::vector<int32_t> spliced = b;
  spliced.insert(spliced.end(), a.begin() + 4, a.end());
  EXPECT_EQ(cache.lookup(spliced, 8), 4);
  EXPECT_EQ(cache.lookup(a, 8), 0);
}

// A tenant's salt is a partition of its own (docs/design/auth.md, "Tenants").
TEST(PrefixStateCacheTest, StateKeptForOneSaltIsNotFoundForAnother) {
  ChainEngine engine;
  PrefixStateCache cache(/*block_tokens=*/4, /*max_bytes=*/1 << 20);
  const std::vector<int32_t> a = conversation(8);
  ASSERT_TRUE(engine.prefill_chunk(a, {}).is_ok());
  ASSERT_TRUE(cache.save(a, 8, &engine, "a1").is_ok());
  EXPECT_EQ(cache.lookup(a, 8, "a1"), 8);
  EXPECT_EQ(cache.lookup(a, 8, "b2"), 0);
  EXPECT_EQ(cache.lookup(a, 8), 0);
  ChainEngine fresh;
  EXPECT_EQ(cache.restore(a, 8, &fresh, "b2").code(), Code::kNotFound);
  struct TinyCheckpoint : Checkpoint {
    int64_t tokens() const override { return 8; }
    int64_t bytes() const override { return 16; }
  };
  PrefixCheckpoints checkpoints(1 << 20);
  auto cp = std::make_shared<const TinyCheckpoint>();
  ASSERT_TRUE(checkpoints.put(a, cp, cp, "a1"));
  EXPECT_NE(checkpoints.find(a, 8, "a1"), nullptr);
  EXPECT_EQ(checkpoints.find(a, 8, "b2"), nullptr);
  EXPECT_EQ(checkpoints.find(a, 8), nullptr);
}

TEST(TailRequestTest, StartIsCheckedAndTheDecoderCallsCoverTheTail) {
  const DecoderCacheLayout llama = test_layout();
  auto body = [](const std::string& extra) {
    return std::string(R"({"ids":[1,2,3,4],"fingerprint":"fp-tail")") + extra + "}";
  };
  auto ok = parse_prefill_request(body(R"(,"start":3)"), kVocab, llama, 100);
  ASSERT_TRUE(ok.is_ok()) << ok.status().to_string();
  EXPECT_EQ(ok->start, 3);
  EXPECT_EQ(prefill_request_json(ok.value()).value("start", 0), 3);
  for (const char* bad : {R"(,"start":4)", R"(,"start":-1)", R"(,"start":"2")"})
    EXPECT_EQ(parse_prefill_request(body(bad), kVocab, llama, 100).status().code(),
              Code::kInvalidArgument)
        << bad;
  DecoderCacheLayout dsv4 = llama;
  dsv4.family = "deepseek_v4";
  auto tail = parse_prefill_request(body(R"(,"start":1,"decoder_calls":[2,1])"), kVocab, dsv4, 100);
  ASSERT_TRUE(tail.is_ok()) << tail.status().to_string();
  EXPECT_EQ(tail->decoder_calls, (std::vector<int64_t>{2, 1}));
  const auto whole =
      parse_prefill_request(body(R"(,"start":1,"decoder_calls":[1,1])"), kVocab, dsv4, 100);
  EXPECT_EQ(whole.status().code(), Code::kInvalidArgument);
  EXPECT_NE(whole.status().message().find("from 'start'"), std::string::npos);
}

Segment tail_segment(int64_t pos0, int64_t n, int64_t seq) {
  Segment s;
  s.seq = seq, s.family = "llama", s.fingerprint = "fp-tail", s.pos0 = pos0, s.n_tokens = n;
  for (int64_t l = 0; l < kLayers; ++l)
    for (const char* kind : {".keys", ".values"}) {
      Tensor t(DType::kBF16, {1, n, 2});
      for (int64_t i = 0; i < 2 * n; ++i)
        t.data<uint16_t>()[i] = static_cast<uint16_t>(l * 1000 + pos0 * 2 + i);
      s.arrays.emplace_back("layers." + std::to_string(l) + kind, std::move(t));
    }
  return s;
}

TEST(TailAssemblerTest, ATailVerifiesFromItsStartAndItsEntrySaysSo) {
  namespace fs = std::filesystem;
  const fs::path store = fs::temp_directory_path() / ("hetero-tail-" + std::to_string(::getpid()));
  fs::remove_all(store);
  const DecoderCacheLayout layout = test_layout();
  for (const bool on_disk : {false, true}) {
    auto a = make_assembler(layout, 20, on_disk ? store.string() : "", /*start=*/12);
    EXPECT_FALSE(a->can_mount(12));
    EXPECT_EQ(a->accept(tail_segment(0, 4, 0)).code(), Code::kDataLoss);  // not where it starts
    ASSERT_TRUE(a->accept(tail_segment(12, 5, 0)).is_ok());
    ASSERT_TRUE(a->accept(tail_segment(17, 3, 1)).is_ok());
    Manifest m{"fp-tail", 20, 20, 2, true, "", "exact"};
    EXPECT_EQ(a->finish(m).code(), Code::kDataLoss);  // a manifest without the start
    m.start = 12;
    EXPECT_TRUE(a->finish(m).is_ok());
    EXPECT_TRUE(a->can_mount(19));
    const TensorMap arrays = a->arrays(19).value();
    EXPECT_EQ(arrays.at("layers.1.values").shape, (std::vector<int64_t>{1, 7, 2}));
    EXPECT_EQ(arrays.at("layers.1.values").data<uint16_t>()[0], 1000 + 24);
    const std::vector<int32_t> ids = conversation(20);
    auto entry = a->store(store.string(), layout, ids, 19, 20);
    ASSERT_TRUE(entry.is_ok()) << entry.status().to_string();
    std::ifstream in(fs::path(entry->path) / "entry.json");
    const auto meta = nlohmann::json::parse(in);
    EXPECT_EQ(meta["start"], 12);
    EXPECT_EQ(meta["B"], 19);
    EXPECT_EQ(meta["ids"].size(), 19u);
    fs::remove_all(entry->path);
  }
  fs::remove_all(store);
}

}  // namespace
}  // namespace hetero
