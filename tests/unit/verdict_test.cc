// Verdicts are confirmed by the decoder's own accounting (decode/verdict.h), streams give the
// confirming usage event to the front (front/sse_relay.h), and routing is a pure decision
// (front/routing.h).
#include "decode/verdict.h"

#include <gtest/gtest.h>

#include "front/rates.h"
#include "front/routing.h"
#include "front/sse_relay.h"

namespace hetero {
namespace {

Verdict predicted_complete(int64_t b) {
  Verdict v;
  v.kind = VerdictKind::kComplete;
  v.b = b, v.t = b + 1, v.bytes = 1000;
  v.timings_ms["prefill"] = 5;
  return v;
}

DecoderUsage usage(int64_t cached) { return {true, cached, ""}; }

TEST(ConfirmVerdict, ExactReuseConfirmsTheBridge) {
  Verdict v = confirm_verdict(predicted_complete(99), usage(99));
  EXPECT_EQ(v.kind, VerdictKind::kComplete);
  EXPECT_TRUE(v.confirmed);
  EXPECT_EQ(v.reused, 99);
  EXPECT_EQ(v.to_json()["reused"], 99);
}

TEST(ConfirmVerdict, ADecoderThatReprefilledIsNeverCountedAsBridged) {
  Verdict v = confirm_verdict(predicted_complete(99), usage(0));
  EXPECT_EQ(v.kind, VerdictKind::kDeclined);
  EXPECT_FALSE(v.bridged());
  EXPECT_EQ(v.b, 0);
  EXPECT_EQ(v.label(), "declined: the decoder re-prefilled: it reused 0 of the 99 mounted tokens");
  EXPECT_EQ(v.bytes, 1000);  // what was measured stays
  EXPECT_EQ(v.timings_ms.at("prefill"), 5);
}

TEST(ConfirmVerdict, APartialBeatenByTheDecodersOwnPrefixSaysWhatWasReused) {
  Verdict p = predicted_complete(40);
  p.kind = VerdictKind::kPartial;
  p.t = 100;
  Verdict v = confirm_verdict(p, usage(70));
  EXPECT_EQ(v.kind, VerdictKind::kDeclined);
  EXPECT_EQ(v.reused, 70);
  EXPECT_NE(v.label().find("its own 70-token prefix"), std::string::npos) << v.label();
}

TEST(ConfirmVerdict, NoUsageLeavesABridgeUnconfirmed) {
  Verdict v = confirm_verdict(predicted_complete(99), {false, -1, "the decoder answered HTTP 500"});
  EXPECT_EQ(v.kind, VerdictKind::kUnconfirmed);
  EXPECT_FALSE(v.confirmed);
  EXPECT_NE(v.label().find("HTTP 500"), std::string::npos) << v.label();
  EXPECT_FALSE(v.to_json().contains("reused"));
  // Nothing was claimed for a native request: it stays what it was, unconfirmed.
  Verdict s = confirm_verdict(Verdict::skipped("short"), {false, -1, "x"});
  EXPECT_EQ(s.label(), "skipped: short");
  EXPECT_FALSE(s.confirmed);
}

TEST(ConfirmVerdict, NativeRequestsRecordWhatTheDecoderReused) {
  Verdict v = confirm_verdict(Verdict::skipped("warm (300 of 310 cached)"), usage(300));
  EXPECT_EQ(v.kind, VerdictKind::kSkipped);
  EXPECT_TRUE(v.confirmed);
  EXPECT_EQ(v.reused, 300);
}

TEST(UsageFromReply, ReadsCachedTokensAndSaysWhatIsMissing) {
  auto u = usage_from_reply(nlohmann::json::parse(
      R"({"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 8}}})"));
  EXPECT_TRUE(u.present);
  EXPECT_EQ(u.cached_tokens, 8);
  EXPECT_FALSE(usage_from_reply(nlohmann::json::parse(R"({"error": "boom"})")).present);
  EXPECT_FALSE(
      usage_from_reply(nlohmann::json::parse(R"({"usage": {"prompt_tokens": 9}})")).present);
  EXPECT_FALSE(usage_from_reply(nlohmann::json::parse("[1]")).present);
}

const char* kChunk = "data: {\"choices\": [{\"delta\": {\"content\": \"hi\"}}]}\n\n";
const char* kUsage =
    "data: {\"choices\": [], \"usage\": {\"prompt_tokens\": 100, \"completion_tokens\": 2, "
    "\"prompt_tokens_details\": {\"cached_tokens\": 99}}}\n\n";
const char* kDone = "data: [DONE]\n\n";

TEST(SseUsageRelay, StripsTheUsageEventTheClientDidNotAskFor) {
  SseUsageRelay relay(predicted_complete(99), /*client_wants_usage=*/false);
  std::string all = std::string(kChunk) + kUsage + kDone, out;
  for (char c : all) relay.feed(std::string_view(&c, 1), &out);  // byte by byte
  EXPECT_EQ(out, std::string(kChunk) + kDone);
  EXPECT_TRUE(relay.flush().empty());
  Verdict v = relay.confirmed("none");
  EXPECT_EQ(v.kind, VerdictKind::kComplete);
  EXPECT_TRUE(v.confirmed);
}

TEST(SseUsageRelay, KnowsWhetherTheStreamWasTerminated) {
  // A decoder that dies mid-stream can leave a reply that looks whole to the HTTP client; the
  // missing [DONE] is what tells the front door to end the stream with an error event.
  SseUsageRelay cut(predicted_complete(99), false), whole(predicted_complete(99), false);
  std::string out;
  cut.feed(kChunk, &out);
  whole.feed(std::string(kChunk) + kUsage + kDone, &out);
  EXPECT_FALSE(cut.saw_done());
  EXPECT_TRUE(whole.saw_done());
}

TEST(SseUsageRelay, GivesTheConfirmedVerdictInTheUsageEventWhenAskedFor) {
  SseUsageRelay relay(predicted_complete(120), /*client_wants_usage=*/true);
  std::string out;
  relay.feed(std::string(kChunk) + kUsage, &out);
  relay.feed(kDone, &out);
  const size_t at = out.find("\"x_pd_bridge\"");
  ASSERT_NE(at, std::string::npos) << out;
  const std::string line = out.substr(out.find("data: {\"choices\":[]"));
  auto j = nlohmann::json::parse(line.substr(6, line.find('\n') - 6));
  EXPECT_EQ(j["x_pd_bridge"]["verdict"],
            "declined: the decoder re-prefilled: it reused 99 of "
            "the 120 mounted tokens");
  EXPECT_EQ(j["usage"]["prompt_tokens_details"]["cached_tokens"], 99);
  EXPECT_TRUE(out.ends_with(kDone));
}

TEST(SseUsageRelay, EventsPassAsTheyCompleteAndAStreamWithoutUsageIsUnconfirmed) {
  SseUsageRelay relay(predicted_complete(9), false);
  std::string out;
  relay.feed(": keep-alive\r\n\r\ndata: {\"choices\": [", &out);
  EXPECT_EQ(out, ": keep-alive\r\n\r\n");
  out.clear();
  relay.feed("]}\n\n", &out);
  EXPECT_EQ(out, "data: {\"choices\": []}\n\n");  // no usage in it: passed on as is
  relay.feed("data: {\"cut", &out);
  EXPECT_EQ(relay.flush(), "data: {\"cut");
  Verdict v = relay.confirmed("the decoder's stream broke before its usage");
  EXPECT_EQ(v.kind, VerdictKind::kUnconfirmed);
  EXPECT_NE(v.label().find("broke"), std::string::npos);
}

TEST(Routing, ShortAndNativeNeverLookUpTheCache) {
  int lookups = 0;
  auto lookup = [&]() -> Result<int64_t> { return ++lookups, int64_t{0}; };
  const RoutePolicy p{64, 64};
  Route r = route_request(20, BridgeMode::kAuto, p, lookup);
  EXPECT_FALSE(r.bridge);
  EXPECT_EQ(r.verdict.label(), "skipped: short (T=20 < 64)");
  EXPECT_EQ(r.verdict.t, 20);
  EXPECT_FALSE(route_request(5000, BridgeMode::kNative, p, lookup).bridge);
  EXPECT_FALSE(route_request(1, BridgeMode::kBridge, p, lookup).bridge);  // nothing to bridge
  EXPECT_EQ(lookups, 0);
}

TEST(Routing, ColdLongBridgesWarmGoesNativeForcedBridgesAnyway) {
  const RoutePolicy p{64, 64};
  auto holds = [](int64_t c) { return [c]() -> Result<int64_t> { return c; }; };
  Route cold = route_request(500, BridgeMode::kAuto, p, holds(0));
  EXPECT_TRUE(cold.bridge);
  EXPECT_EQ(cold.cached, 0);
  Route warm = route_request(500, BridgeMode::kAuto, p, holds(450));
  EXPECT_FALSE(warm.bridge);
  EXPECT_EQ(warm.verdict.label(), "skipped: warm (450 of 500 cached)");
  Route tail = route_request(500, BridgeMode::kAuto, p, holds(436));
  EXPECT_TRUE(tail.bridge);
  EXPECT_EQ(tail.cached, 436);
  EXPECT_TRUE(route_request(30, BridgeMode::kBridge, p, holds(28)).bridge);
}

TEST(Routing, AnUnknownCachedPrefixDeclinesAndBadModesAreErrors) {
  Route r = route_request(500, BridgeMode::kAuto, {64, 64},
                          []() -> Result<int64_t> { return unavailable("seam down"); });
  EXPECT_FALSE(r.bridge);
  EXPECT_EQ(r.verdict.label(), "declined: cached prefix unknown: seam down");
  EXPECT_EQ(parse_bridge_mode("").value(), BridgeMode::kAuto);
  EXPECT_EQ(parse_bridge_mode("native").value(), BridgeMode::kNative);
  EXPECT_EQ(parse_bridge_mode("bridge").value(), BridgeMode::kBridge);
  EXPECT_FALSE(parse_bridge_mode("Bridge").is_ok());
}

TEST(Routing, MeasuredCostsDecideAndTheVerdictCarriesThem) {
  const RoutePolicy p{64, 256};
  auto holds = [](int64_t c) { return [c]() -> Result<int64_t> { return c; }; };
  // The decoder takes 2 ms a token; a bridge 300 ms plus 0.5 ms a token: it pays from 200.
  auto costs = [](int64_t n, int64_t) {
    return TailCosts{300 + 0.5 * static_cast<double>(n), 2.0 * static_cast<double>(n)};
  };
  Route small = route_request(1000, BridgeMode::kAuto, p, holds(900), costs);
  EXPECT_FALSE(small.bridge);
  EXPECT_EQ(small.verdict.label(),
            "skipped: the decoder is faster (100-token tail: 200 ms native, 350 ms bridged)");
  const nlohmann::json j = small.verdict.to_json();
  EXPECT_EQ(j["route"]["by"], "rates");
  EXPECT_EQ(j["route"]["tail"], 100);
  EXPECT_EQ(j["route"]["native_ms"], 200.0);
  // Over the fixed minimum's head: a 220-token tail is bridged because it pays.
  Route pays = route_request(1000, BridgeMode::kAuto, p, holds(780), costs);
  EXPECT_TRUE(pays.bridge);
  EXPECT_EQ(pays.verdict.route_by, "rates");
  // Unmeasured: the fixed minimum, and the verdict says so.
  auto unknown = [](int64_t, int64_t) { return TailCosts{std::nullopt, 1.0}; };
  Route fixed = route_request(1000, BridgeMode::kAuto, p, holds(780), unknown);
  EXPECT_FALSE(fixed.bridge);
  EXPECT_EQ(fixed.verdict.route_by, "min_tail");
  EXPECT_FALSE(fixed.verdict.to_json()["route"].contains("bridge_ms"));
  // A forced bridge is not a routing decision.
  EXPECT_EQ(route_request(1000, BridgeMode::kBridge, p, holds(900), costs).verdict.route_by, "");
}

TEST(MeasuredRates, FitsAFixedAndAPerTokenCostFromConfirmedRequests) {
  TailCost line;
  EXPECT_FALSE(line.predict(100, 0).has_value());
  // Contexts that vary, a cost that does not grow with them: the line.
  const double contexts[] = {0, 5000, 1000, 20000};
  int i = 0;
  for (double n : {100.0, 1000.0, 400.0, 2000.0}) line.add(n, contexts[i++], 300 + 0.5 * n);
  ASSERT_TRUE(line.predict(800, 0).has_value());
  EXPECT_NEAR(*line.predict(800, 0), 700, 1e-6);
  EXPECT_NEAR(*line.predict(800, 50000), 700, 1e-6);
  TailCost same;  // sizes alike: per token only
  for (int k = 0; k < 3; ++k) same.add(500, 0, 1000);
  EXPECT_NEAR(*same.predict(100, 0), 200, 1e-9);

  MeasuredRates rates;
  Verdict bridged;
  bridged.kind = VerdictKind::kComplete, bridged.confirmed = true;
  bridged.t = 1001, bridged.b = 1000, bridged.start = 600;
  bridged.timings_ms = {{"prefill", 400}, {"store", 20}, {"mount", 30}, {"decoder", 999}};
  rates.record(bridged);
  bridged.confirmed = false;  // an unconfirmed bridge is not a measurement
  bridged.timings_ms["prefill"] = 1e6;
  rates.record(bridged);
  bridged.confirmed = true, bridged.timings_ms["prefill"] = 400;
  rates.record(bridged);
  EXPECT_NEAR(*rates.bridge_ms(400, 600), 450, 1e-6);  // 400 rows bridged in 450 ms
  Verdict native = Verdict::skipped("native requested");
  native.confirmed = true, native.t = 300, native.reused = 100;
  native.timings_ms["decoder_first_token"] = 400;
  rates.record(native);
  EXPECT_FALSE(rates.native_ms(10, 0).has_value());  // one sample
  rates.record(native);
  EXPECT_NEAR(*rates.native_ms(100, 100), 200, 1e-6);  // 200 tokens processed in 400 ms
}

TEST(MeasuredRates, ATailAfterALongContextIsPredictedDearer) {
  // The decoder's time grows with how far back its tail attends: fixed 50 ms, 0.2 ms a token,
  // 1e-5 ms a token per token read back.
  auto truth = [](double n, double c) { return 50 + 0.2 * n + 1e-5 * n * (c + n / 2); };
  TailCost cost;
  const double sizes[] = {300, 2000, 800, 4000, 1200, 600};
  const double contexts[] = {0, 1000, 30000, 8000, 60000, 2000};
  for (int k = 0; k < 6; ++k) cost.add(sizes[k], contexts[k], truth(sizes[k], contexts[k]));
  for (double c : {0.0, 10000.0, 100000.0})
    EXPECT_NEAR(*cost.predict(1000, c), truth(1000, c), 1e-6 * truth(1000, c)) << c;
  EXPECT_GT(*cost.predict(1000, 100000), 2 * *cost.predict(1000, 0));
  // Cold prompts alone (no context) still show attention's growth with the tail itself.
  TailCost cold;
  for (double n : sizes) cold.add(n, 0, truth(n, 0));
  EXPECT_NEAR(*cold.predict(16000, 0), truth(16000, 0), 1e-6 * truth(16000, 0));
}

}  // namespace
}  // namespace hetero
