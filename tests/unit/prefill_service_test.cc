// The prefill service's admission and failure handling, over HTTP on a free port, with a fake
// engine that injects the errors a GPU engine reports: a reservation refused for memory is
// HTTP 507 with a JSON error body before any byte of a stream, a chunk that fails mid-stream ends
// the stream with a manifest naming the error, and in both cases the next request is served.
// Regression guard for the CUDA engines' old behaviour (any CUDA error aborted the host). The
// stream ends with its manifest, before the state kept for later requests is copied.
#include <gtest/gtest.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bridge/assembler.h"
#include "bridge/wire.h"
#include "common/auth.h"
#include "common/secret.h"
#include "decode/prefill_client.h"
#include "echo_program.h"
#include "prefill/service.h"

namespace hetero {
namespace {

constexpr int64_t kLayers = kEchoLayers, kHidden = kEchoHidden, kVocab = 100;
DecoderCacheLayout test_layout() { return echo_layout("fp-test"); }

// An engine whose reserve or whose n-th chunk (from 1, counted per request) fails once with the
// injected Status; otherwise it taps rows that encode (layer, position).
class FaultyEngine : public PrefillEngine {
 public:
  Status reset() override {
    ++resets;
    cached_ = 0, chunk_ = 0;
    return Status::ok();
  }
  Status reserve(int64_t tokens, int64_t max_chunk_tokens) override {
    std::lock_guard<std::mutex> lock(mu_);
    reserved_.emplace_back(tokens, max_chunk_tokens);
    if (capacity_ > 0 && tokens > capacity_)
      return resource_exhausted("the cache of " + std::to_string(tokens) +
                                " tokens needs more than the budget");
    return take(&reserve_fault_);
  }
  Status prefill_chunk(const std::vector<int32_t>& ids, const AttentionInputTap& tap) override {
    {
      std::unique_lock<std::mutex> lock(mu_);
      gate_open_.wait(lock, [this] { return !held_; });
    }
    ++chunk_;
    if (fail_chunk_ == chunk_) {
      std::lock_guard<std::mutex> lock(mu_);
      HETERO_RETURN_IF_ERROR(take(&chunk_fault_));
    }
    const auto n = static_cast<int64_t>(ids.size());
    std::vector<uint16_t> x(static_cast<size_t>(n * kHidden));
    for (int32_t l = 0; l < kLayers; ++l) {
      std::this_thread::sleep_for(std::chrono::milliseconds(layer_ms.load()));
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < kHidden; ++j)
          x[static_cast<size_t>(i * kHidden + j)] = static_cast<uint16_t>(l * 1000 + cached_ + i);
      tap(TapEvent{l, cached_, n, kHidden, x.data()});
    }
    cached_ += n;
    return Status::ok();
  }
  int64_t vocab() const override { return kVocab; }

  void fail_next_reserve(Status st) {
    std::lock_guard<std::mutex> lock(mu_);
    reserve_fault_ = std::move(st);
  }
  // Every reservation of more than `tokens` tokens refused for memory (0: none).
  void set_capacity(int64_t tokens) {
    std::lock_guard<std::mutex> lock(mu_);
    capacity_ = tokens;
  }
  void fail_next_chunk(int64_t n, Status st) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_chunk_ = n, chunk_fault_ = std::move(st);
  }

  // While held, every chunk waits (a request then keeps its turn).
  void hold(bool on) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      held_ = on;
    }
    gate_open_.notify_all();
  }

  // Every reserve() call's (tokens, max_chunk_tokens).
  std::vector<std::pair<int64_t, int64_t>> reservations() {
    std::lock_guard<std::mutex> lock(mu_);
    return reserved_;
  }
  std::atomic<int> resets{0};
  std::atomic<int> layer_ms{0};  // each layer's time: a slow host deep in a long context

 private:
  Status take(std::optional<Status>* fault) {
    if (!fault->has_value()) return Status::ok();
    Status st = std::move(**fault);
    fault->reset();
    return st;
  }
  std::mutex mu_;
  std::condition_variable gate_open_;
  bool held_ = false;
  std::optional<Status> reserve_fault_, chunk_fault_;
  std::vector<std::pair<int64_t, int64_t>> reserved_;
  std::atomic<int64_t> fail_chunk_{0};
  int64_t capacity_ = 0;
  int64_t cached_ = 0, chunk_ = 0;  // the prefill's thread's
};

const char kOom[] =
    "out of device memory on GPU 0: asked 12.3 GiB for the KV cache; 4.1 GiB free of 139.8 GiB";

class PrefillServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    service_ = std::make_unique<PrefillService>(
        &engine_, test_layout(),
        [](const PrefillRequest&) -> Result<std::unique_ptr<SegmentProgram>> {
          return std::unique_ptr<SegmentProgram>(std::make_unique<EchoProgram>(test_layout()));
        },
        /*default_chunk_tokens=*/4, /*max_tokens=*/1000);
    ASSERT_TRUE(service_->start("127.0.0.1", 0).is_ok());
  }
  void TearDown() override { service_->stop(); }

  // POST /v1/prefill for T tokens; a stuck service fails the test instead of hanging it.
  httplib::Result post(int64_t T) {
    httplib::Client cli("127.0.0.1", service_->bound_port());
    cli.set_read_timeout(20, 0);
    std::vector<int32_t> ids(static_cast<size_t>(T));
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i % kVocab);
    const nlohmann::json body = {{"ids", ids}, {"fingerprint", "fp-test"}};
    return cli.Post("/v1/prefill", body.dump(), "application/json");
  }

  FaultyEngine engine_;
  std::unique_ptr<PrefillService> service_;
};

// The frames of a stream: the segments' ranges and the closing manifest.
struct Stream {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  std::optional<Manifest> manifest;
};

Stream parse_stream(const std::string& body, const FrameTagger* tags = nullptr) {
  Stream s;
  FrameParser parser(int64_t{1} << 20, tags);
  parser.feed(body.data(), body.size());
  for (;;) {
    auto f = parser.next();
    EXPECT_TRUE(f.is_ok()) << f.status().to_string();
    if (!f.is_ok() || !f->has_value()) break;
    if ((**f).header.value("kind", "") == "manifest") {
      auto m = decode_manifest(**f);
      EXPECT_TRUE(m.is_ok()) << m.status().to_string();
      if (m.is_ok()) s.manifest = m.value();
      continue;
    }
    auto seg = decode_segment(**f);
    EXPECT_TRUE(seg.is_ok()) << seg.status().to_string();
    if (seg.is_ok()) s.ranges.emplace_back(seg->pos0, seg->n_tokens);
  }
  return s;
}

void expect_complete(const httplib::Result& res, int64_t T) {
  ASSERT_TRUE(res) << "no response";
  EXPECT_EQ(res->status, 200);
  const Stream s = parse_stream(res->body);
  ASSERT_TRUE(s.manifest.has_value());
  EXPECT_TRUE(s.manifest->complete) << s.manifest->reason;
  EXPECT_EQ(s.manifest->requested_tokens, T);
  EXPECT_EQ(s.manifest->covered_tokens, T);
  EXPECT_EQ(static_cast<int64_t>(s.ranges.size()), (T + 3) / 4);  // chunks of 4
}

// An engine that hands out its state (2 bytes a row), each save waiting for the test's word.
class SlowSaveEngine : public FaultyEngine {
 public:
  int64_t state_row_bytes() const override { return 2; }
  Status save_state(int64_t, int64_t n, uint8_t* out) override {
    std::unique_lock<std::mutex> lock(mu_);
    ++saves;
    // Bounded: a service that waited for this copy before ending its stream shows as a timeout.
    if (!released_.wait_for(lock, std::chrono::seconds(20), [this] { return go_; }))
      timed_out = true;
    std::fill(out, out + 2 * n, uint8_t{7});
    return Status::ok();
  }
  Status load_state(int64_t, int64_t, const uint8_t*) override { return Status::ok(); }
  void release() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      go_ = true;
    }
    released_.notify_all();
  }
  int saves = 0;
  bool timed_out = false;
  std::mutex mu_;

 private:
  std::condition_variable released_;
  bool go_ = false;
};

// The manifest is the stream's last frame: the stream ends there, and the state kept for later
// requests is copied after it, so the receiver does not wait for that copy.
TEST_F(PrefillServiceTest, TheStreamEndsBeforeTheStateIsKept) {
  SlowSaveEngine engine;
  PrefillService service(
      &engine, test_layout(),
      [](const PrefillRequest&) -> Result<std::unique_ptr<SegmentProgram>> {
        return std::unique_ptr<SegmentProgram>(std::make_unique<EchoProgram>(test_layout()));
      },
      /*default_chunk_tokens=*/4, /*max_tokens=*/1000);
  service.set_state_cache(/*block_tokens=*/4, /*max_bytes=*/1 << 20);
  ASSERT_TRUE(service.start("127.0.0.1", 0).is_ok());
  httplib::Client cli("127.0.0.1", service.bound_port());
  cli.set_read_timeout(60, 0);
  std::vector<int32_t> ids(12);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
  const nlohmann::json body = {{"ids", ids}, {"fingerprint", "fp-test"}};
  const httplib::Result res = cli.Post("/v1/prefill", body.dump(), "application/json");
  engine.release();  // only now may the state be copied
  expect_complete(res, 12);
  service.stop();  // waits for the request's thread
  std::lock_guard<std::mutex> lock(engine.mu_);
  EXPECT_GT(engine.saves, 0);  // the state was kept, after the stream
  EXPECT_FALSE(engine.timed_out) << "the stream waited for the state's copy";
}

TEST_F(PrefillServiceTest, RefusedReservationIs507AndTheNextRequestIsServed) {
  engine_.fail_next_reserve(resource_exhausted(kOom));
  const auto refused = post(10);
  ASSERT_TRUE(refused) << "no response";
  EXPECT_EQ(refused->status, 507);
  const auto j = nlohmann::json::parse(refused->body, nullptr, false);
  ASSERT_TRUE(j.is_object()) << refused->body;
  EXPECT_EQ(j["error"]["code"], "resource_exhausted");
  EXPECT_EQ(j["error"]["message"], kOom);
  // The same request, the fault gone: served whole on the same engine.
  expect_complete(post(10), 10);
  const auto reserved = engine_.reservations();
  ASSERT_EQ(reserved.size(), 2u);
  // The whole prompt and its longest chunk, as the service plans it (chunks of 4).
  EXPECT_EQ(reserved[0], (std::pair<int64_t, int64_t>{10, 4}));
  EXPECT_EQ(engine_.resets.load(), 2);
}

TEST_F(PrefillServiceTest, TurnsComeInOrderAndBeyondTheQueueIs503WithRetryAfter) {
  service_->set_queue(2);
  engine_.hold(true);  // the first request keeps its turn until released
  auto waiting = [this] {
    httplib::Client cli("127.0.0.1", service_->bound_port());
    auto h = cli.Get("/health");
    EXPECT_TRUE(h && h->status == 200);
    const auto j = nlohmann::json::parse(h ? h->body : "{}", nullptr, false);
    return j.contains("queue") ? j["queue"]["waiting"].get<int64_t>() : -1;
  };
  // Three requests of different lengths (the engine's reservations say who ran when), each
  // sent once the one before is in.
  std::vector<std::optional<httplib::Result>> got(3);
  std::vector<std::thread> clients;
  for (int i = 0; i < 3; ++i) {
    clients.emplace_back([this, i, &got] { got[static_cast<size_t>(i)] = post(5 + i); });
    for (int tries = 0; tries < 2000 && (engine_.reservations().empty() || waiting() < i); ++tries)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(waiting(), 2);
  const auto full = post(9);
  ASSERT_TRUE(full) << "no response";
  EXPECT_EQ(full->status, 503);
  EXPECT_GE(std::stoi(full->get_header_value("Retry-After")), 1);
  const auto j = nlohmann::json::parse(full->body, nullptr, false);
  ASSERT_TRUE(j.is_object()) << full->body;
  EXPECT_EQ(j["error"]["code"], "queue_full");
  engine_.hold(false);
  for (auto& c : clients) c.join();
  for (int i = 0; i < 3; ++i) expect_complete(*got[static_cast<size_t>(i)], 5 + i);
  // First come, first served; the ones that waited say how long.
  const auto reserved = engine_.reservations();
  ASSERT_EQ(reserved.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(reserved[static_cast<size_t>(i)].first, 5 + i);
  EXPECT_GT(std::stod((*got[2])->get_header_value(kQueuedMsHeader)), 0.0);
  EXPECT_EQ(waiting(), 0);
}

TEST_F(PrefillServiceTest, OtherReservationErrorsKeepTheirStatus) {
  engine_.fail_next_reserve(internal_error("cudaStreamSynchronize: an illegal memory access"));
  const auto refused = post(6);
  ASSERT_TRUE(refused) << "no response";
  EXPECT_EQ(refused->status, 500);
  const auto j = nlohmann::json::parse(refused->body, nullptr, false);
  ASSERT_TRUE(j.is_object()) << refused->body;
  EXPECT_EQ(j["error"]["code"], "internal");
  expect_complete(post(6), 6);
}

TEST_F(PrefillServiceTest, ChunkFailureEndsTheStreamWithItsReasonAndTheNextRequestIsServed) {
  engine_.fail_next_chunk(2, resource_exhausted(kOom));
  const auto failed = post(12);
  ASSERT_TRUE(failed) << "no response";
  EXPECT_EQ(failed->status, 200);  // admitted: the stream had started
  const Stream s = parse_stream(failed->body);
  ASSERT_TRUE(s.manifest.has_value());
  EXPECT_FALSE(s.manifest->complete);
  EXPECT_NE(s.manifest->reason.find("resource_exhausted"), std::string::npos) << s.manifest->reason;
  EXPECT_NE(s.manifest->reason.find(kOom), std::string::npos) << s.manifest->reason;
  // The first chunk's rows went out before the failure, and nothing after it.
  EXPECT_EQ(s.manifest->covered_tokens, 4);
  EXPECT_EQ(s.ranges, (std::vector<std::pair<int64_t, int64_t>>{{0, 4}}));
  expect_complete(post(12), 12);
}

// The memory floor: a request that does not fit is admitted for the longest prefix of whole
// chunks that does, and its stream sealed there with a manifest that says so; the decode side
// keeps that prefix (salvageable), and the host serves on.
TEST_F(PrefillServiceTest, AtTheMemoryFloorTheStreamIsSealedAtTheLongestPrefixThatFits) {
  service_->set_memory_floor(true);
  engine_.set_capacity(9);  // chunks of 4: two fit, a third would not
  const auto sealed = post(20);
  ASSERT_TRUE(sealed) << "no response";
  EXPECT_EQ(sealed->status, 200);
  const Stream s = parse_stream(sealed->body);
  ASSERT_TRUE(s.manifest.has_value());
  EXPECT_FALSE(s.manifest->complete);
  EXPECT_EQ(s.manifest->requested_tokens, 20);
  EXPECT_EQ(s.manifest->covered_tokens, 8);
  EXPECT_EQ(s.ranges, (std::vector<std::pair<int64_t, int64_t>>{{0, 4}, {4, 4}}));
  EXPECT_EQ(s.manifest->reason.rfind("sealed at the memory floor: 8 of 20 tokens fit (", 0), 0u)
      << s.manifest->reason;
  EXPECT_NE(s.manifest->reason.find("the cache of 20 tokens needs more than the budget"),
            std::string::npos)
      << s.manifest->reason;
  // The whole request first, then prefixes on chunk boundaries; the prefix run is reserved last.
  const auto reserved = engine_.reservations();
  ASSERT_GE(reserved.size(), 3u);
  EXPECT_EQ(reserved.front(), (std::pair<int64_t, int64_t>{20, 4}));
  EXPECT_EQ(reserved.back(), (std::pair<int64_t, int64_t>{8, 4}));

  // The decode side: the sealed prefix verifies and is kept, the stream's end says why.
  PrefillRequest req;
  req.ids.resize(20);
  for (size_t i = 0; i < req.ids.size(); ++i) req.ids[i] = static_cast<int32_t>(i);
  req.fingerprint = "fp-test";
  const DecoderCacheLayout layout = test_layout();
  auto assembler = make_assembler(layout, 20);
  const FetchResult f = fetch_prefill("127.0.0.1", service_->bound_port(), req, assembler.get(),
                                      20000, 20000, /*secret=*/"");
  EXPECT_EQ(f.status.code(), Code::kUnavailable) << f.status.to_string();
  EXPECT_NE(f.status.message().find("sealed at the memory floor"), std::string::npos)
      << f.status.message();
  EXPECT_TRUE(f.salvageable);
  EXPECT_EQ(assembler->covered_tokens(), 8);
  EXPECT_TRUE(assembler->can_mount(8));

  // What fits is served whole.
  engine_.set_capacity(0);
  expect_complete(post(20), 20);
}

// A chunk that takes longer than the receiver's stall limit is no stall while its layers go by:
// the stream has a keep-alive frame when it has been quiet, and the receiver takes it whole.
// Without them the same stream reads as stalled (what a long context on a CPU host hit).
TEST_F(PrefillServiceTest, AChunkLongerThanTheStallLimitIsNoStall) {
  engine_.layer_ms = 600;  // a chunk of its 2 layers: 1.2 s, each layer 0.6 s
  PrefillRequest req;
  req.ids = {1, 2, 3, 4};
  req.fingerprint = "fp-test";
  const DecoderCacheLayout layout = test_layout();
  const auto fetch = [&](Assembler* assembler) {
    return fetch_prefill("127.0.0.1", service_->bound_port(), req, assembler,
                         /*stall_ms=*/1000, /*deadline_ms=*/20000, /*secret=*/"");
  };
  service_->set_keepalive_ms(50);
  auto assembler = make_assembler(layout, 4);
  const FetchResult alive = fetch(assembler.get());
  EXPECT_TRUE(alive.status.is_ok()) << alive.status.to_string();
  EXPECT_EQ(assembler->covered_tokens(), 4);

  service_->set_keepalive_ms(0);
  assembler = make_assembler(layout, 4);
  const FetchResult quiet = fetch(assembler.get());
  EXPECT_NE(quiet.status.message().find("stalled"), std::string::npos) << quiet.status.to_string();
}

TEST_F(PrefillServiceTest, AtTheMemoryFloorARequestWhoseFirstChunkDoesNotFitIsRefused) {
  service_->set_memory_floor(true);
  engine_.set_capacity(3);
  const auto refused = post(20);
  ASSERT_TRUE(refused) << "no response";
  EXPECT_EQ(refused->status, 507);
  const auto j = nlohmann::json::parse(refused->body, nullptr, false);
  ASSERT_TRUE(j.is_object()) << refused->body;
  EXPECT_EQ(j["error"]["message"], "the cache of 20 tokens needs more than the budget");
  // Without the floor (the default here, and --memory-floor refuse), no prefix is tried.
  service_->set_memory_floor(false);
  engine_.set_capacity(9);
  const size_t before = engine_.reservations().size();
  const auto whole = post(20);
  ASSERT_TRUE(whole) << "no response";
  EXPECT_EQ(whole->status, 507);
  EXPECT_EQ(engine_.reservations().size(), before + 1);
}

// The offline path (hetero prefill --ids-file, and tests): the same admission, a refusal as the
// stream's only frame.
TEST_F(PrefillServiceTest, RunReservesFirstAndEndsWithTheRefusal) {
  PrefillRequest req;
  req.ids = {1, 2, 3, 4, 5};
  req.fingerprint = "fp-test";
  engine_.fail_next_reserve(resource_exhausted(kOom));
  std::vector<std::string> frames;
  const Manifest refused = service_->run(req, [&](std::string f) {
    frames.push_back(std::move(f));
    return true;
  });
  EXPECT_FALSE(refused.complete);
  EXPECT_NE(refused.reason.find(kOom), std::string::npos) << refused.reason;
  ASSERT_EQ(frames.size(), 1u);
  const Stream s = parse_stream(frames[0]);
  ASSERT_TRUE(s.manifest.has_value());
  EXPECT_EQ(s.manifest->reason, refused.reason);
  frames.clear();
  const Manifest served = service_->run(req, [&](std::string f) {
    frames.push_back(std::move(f));
    return true;
  });
  EXPECT_TRUE(served.complete) << served.reason;
  EXPECT_EQ(served.covered_tokens, 5);
}

// With the stack's secret, POST /v1/prefill runs only for a request signed with it: a refusal is
// HTTP 401 with a JSON body, before the engine is touched; /health stays open.
TEST_F(PrefillServiceTest, WithASecretOnlyAuthenticatedPrefillsRun) {
  const std::string secret = "0123456789abcdef0123456789abcdef";
  PrefillService guarded(
      &engine_, test_layout(),
      [](const PrefillRequest&) -> Result<std::unique_ptr<SegmentProgram>> {
        return std::unique_ptr<SegmentProgram>(std::make_unique<EchoProgram>(test_layout()));
      },
      /*default_chunk_tokens=*/4, /*max_tokens=*/1000);
  guarded.set_secret(secret);
  ASSERT_TRUE(guarded.start("127.0.0.1", 0).is_ok());
  httplib::Client cli("127.0.0.1", guarded.bound_port());
  cli.set_read_timeout(20, 0);
  const std::string nonce = new_stream_nonce();
  const std::string body = nlohmann::json{
      {"ids", {1, 2, 3, 4, 5}},
      {"fingerprint", "fp-test"},
      {"stream_nonce", nonce}}.dump();
  // The secret itself is no credential any more (issue 50, finding 2): only a signature is.
  const std::string other = std::string(64, 'e');
  for (const httplib::Headers& headers :
       {httplib::Headers{}, httplib::Headers{{"Authorization", "Bearer wrong"}},
        httplib::Headers{{"Authorization", "Bearer " + secret}},
        httplib::Headers{{"Authorization", secret}},
        httplib::Headers{
            {"Authorization", signed_authorization(other, "POST", "/v1/prefill", body)}},
        httplib::Headers{
            {"Authorization", signed_authorization(secret, "POST", "/v1/prefill", body + " ")}}}) {
    const auto res = cli.Post("/v1/prefill", headers, body, "application/json");
    ASSERT_TRUE(res) << "no response";
    EXPECT_EQ(res->status, 401);
    const auto j = nlohmann::json::parse(res->body, nullptr, false);
    ASSERT_TRUE(j.is_object()) << res->body;
    const std::string code = j["error"]["code"];
    EXPECT_TRUE(code == "unauthorized" || code == "bad_signature") << code;
  }
  EXPECT_EQ(engine_.resets.load(), 0);  // no refused request reached the engine
  const auto health = cli.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  const auto served = cli.Post(
      "/v1/prefill", {{"Authorization", signed_authorization(secret, "POST", "/v1/prefill", body)}},
      body, "application/json");
  ASSERT_TRUE(served) << "no response";
  EXPECT_EQ(served->status, 200);
  // Its frames carry tags keyed by the secret and this request's nonce.
  EXPECT_EQ(served->get_header_value(kFrameTagsHeader), kFrameTagsScheme);
  const FrameTagger tags(secret, nonce);
  const Stream s = parse_stream(served->body, &tags);
  ASSERT_TRUE(s.manifest.has_value());
  EXPECT_TRUE(s.manifest->complete) << s.manifest->reason;
  EXPECT_EQ(engine_.resets.load(), 1);
  // Without a nonce there is nothing to key the tags with: refused before the engine.
  const std::string no_nonce = R"({"ids": [1, 2, 3, 4, 5], "fingerprint": "fp-test"})";
  const auto untagged =
      cli.Post("/v1/prefill",
               {{"Authorization", signed_authorization(secret, "POST", "/v1/prefill", no_nonce)}},
               no_nonce, "application/json");
  ASSERT_TRUE(untagged) << "no response";
  EXPECT_EQ(untagged->status, 400);
  EXPECT_EQ(engine_.resets.load(), 1);

  // The decode side's client sends it: refused without, admitted with it.
  PrefillRequest req;
  req.ids = {1, 2, 3, 4, 5};
  req.fingerprint = "fp-test";
  DecoderCacheLayout layout = test_layout();
  auto assembler = make_assembler(layout, 5);
  const FetchResult open = fetch_prefill("127.0.0.1", guarded.bound_port(), req, assembler.get(),
                                         20000, 20000, /*secret=*/"");
  EXPECT_NE(open.status.message().find("HTTP 401"), std::string::npos) << open.status.message();
  assembler = make_assembler(layout, 5);
  const FetchResult authed =
      fetch_prefill("127.0.0.1", guarded.bound_port(), req, assembler.get(), 20000, 20000, secret);
  EXPECT_TRUE(authed.status.is_ok()) << authed.status.message();  // tagged and verified
  EXPECT_EQ(assembler->covered_tokens(), 5);
  EXPECT_EQ(engine_.resets.load(), 2);  // the authenticated fetch ran a prefill
  guarded.stop();
}

}  // namespace
}  // namespace hetero

namespace hetero {
namespace {

// A GPU stack's memory report reaches GET /health as numbers per device; a CPU stack has none.
TEST_F(PrefillServiceTest, HealthReportsEachGpusMemory) {
  httplib::Client cli("127.0.0.1", service_->bound_port());
  auto before = cli.Get("/health");
  ASSERT_TRUE(before);
  EXPECT_FALSE(nlohmann::json::parse(before->body).contains("gpu_memory"));
  PrefillService gpu(
      &engine_, test_layout(),
      [](const PrefillRequest&) -> Result<std::unique_ptr<SegmentProgram>> {
        return std::unique_ptr<SegmentProgram>(std::make_unique<EchoProgram>(test_layout()));
      },
      4, 1000);
  std::atomic<int64_t> state{100};
  gpu.set_gpu_memory([&state] {
    GpuMemory a;
    a.device = 0, a.weights = 11878819976, a.state_and_activations = state.load(), a.capture = 7;
    a.free = 1, a.total = 2;
    GpuMemory b;
    b.device = 1, b.capture = 268435456;
    return std::vector<GpuMemory>{a, b};
  });
  ASSERT_TRUE(gpu.start("127.0.0.1", 0).is_ok());
  httplib::Client g("127.0.0.1", gpu.bound_port());
  state = 4443645202;  // read when asked, not when set
  auto r = g.Get("/health");
  ASSERT_TRUE(r);
  const auto j = nlohmann::json::parse(r->body);
  ASSERT_EQ(j["gpu_memory"].size(), 2u);
  EXPECT_EQ(j["gpu_memory"][0]["weights_bytes"], 11878819976);
  EXPECT_EQ(j["gpu_memory"][0]["state_and_activations_bytes"], 4443645202);
  EXPECT_EQ(j["gpu_memory"][0]["total_bytes"], 2);
  EXPECT_EQ(j["gpu_memory"][1]["device"], 1);
  EXPECT_EQ(j["gpu_memory"][1]["capture_bytes"], 268435456);
  gpu.stop();
}

}  // namespace
}  // namespace hetero
