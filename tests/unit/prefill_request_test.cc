// The prefill request contract (bridge/prefill_request.h): what the prefill host refuses, with a
// clear message and never an overflow or an exception.
#include "bridge/prefill_request.h"

#include <gtest/gtest.h>

#include <string>

#include "bridge/decoder_weights.h"

namespace hetero {
namespace {

DecoderCacheLayout layout() {
  DecoderCacheLayout l;
  l.family = "llama", l.fingerprint = "fp", l.layers = 1, l.kv_heads = 1, l.head_dim = 4;
  return l;
}

Status parse(const std::string& body) {
  return parse_prefill_request(body, /*vocab=*/100, layout(), /*max_tokens=*/16).status();
}

TEST(PrefillRequest, RoundTripsThroughItsJson) {
  PrefillRequest r{{1, 2, 3}, "fp", 2, {2, 1}, "00112233445566778899aabbccddeeff"};
  auto back = parse_prefill_request(prefill_request_json(r).dump(), 100, layout(), 16);
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(back->ids, r.ids);
  EXPECT_EQ(back->decoder_calls, r.decoder_calls);
  EXPECT_EQ(back->chunk_tokens, 2);
  EXPECT_EQ(back->stream_nonce, r.stream_nonce);
  EXPECT_TRUE(back->decoder_batched);  // the default, not written
  r.decoder_batched = false;
  back = parse_prefill_request(prefill_request_json(r).dump(), 100, layout(), 16);
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_FALSE(back->decoder_batched);
  EXPECT_EQ(prefill_request_json(r)["decoder_path"], "single");
}

TEST(PrefillRequest, RefusesWhatCannotBeServed) {
  EXPECT_EQ(parse(R"({"ids": [1, 2], "fingerprint": "other"})").code(), Code::kFailedPrecondition);
  EXPECT_EQ(parse(R"({"ids": [1, 200], "fingerprint": "fp"})").code(), Code::kInvalidArgument);
  EXPECT_EQ(parse(R"({"ids": [], "fingerprint": "fp"})").code(), Code::kInvalidArgument);
  for (const char* nonce : {R"("short")", R"("not hex, not hex, not hex!")", "7", "null"})
    EXPECT_EQ(
        parse(std::string(R"({"ids": [1], "fingerprint": "fp", "stream_nonce": )") + nonce + "}")
            .code(),
        Code::kInvalidArgument)
        << nonce;
  EXPECT_EQ(parse(std::string(1000, '[') + std::string(1000, ']')).code(), Code::kInvalidArgument);
  // Regression (hardening issue): a schedule whose sum overflows was accepted.
  const Status wraps =
      parse(R"({"ids": [1, 2], "fingerprint": "fp", "decoder_calls": [9223372036854775807, 3]})");
  EXPECT_EQ(wraps.code(), Code::kInvalidArgument);
  EXPECT_NE(wraps.message().find("cover more than"), std::string::npos) << wraps.message();
  EXPECT_EQ(parse(R"({"ids": [1, 2], "fingerprint": "fp", "decoder_calls": [1]})").code(),
            Code::kInvalidArgument);
  for (const char* path : {R"("batched")", "true", "null"})
    EXPECT_EQ(
        parse(std::string(R"({"ids": [1], "fingerprint": "fp", "decoder_path": )") + path + "}")
            .code(),
        Code::kInvalidArgument)
        << path;
}

}  // namespace
}  // namespace hetero

namespace hetero {
namespace {

// The decoder's calls as its /hetero/info describes them (mlx-vlm's APC): steps counted from
// where the prefill starts, cut at its interval checkpoints, of which it keeps only the latest
// checkpoint_entries - 1 (none when it keeps one entry).
TEST(DecoderCalls, StepsFromTheStartCutAtTheIntervalCheckpoints) {
  nlohmann::json info = {
      {"prefill", {{"step", 32}, {"checkpoint_interval", 64}, {"last_alone", false}}}};
  using V = std::vector<int64_t>;
  EXPECT_EQ(decoder_calls_from_info(info, 200), (V{32, 32, 32, 32, 32, 32, 8}));
  EXPECT_EQ(decoder_calls_from_info(info, 200, 50), (V{14, 32, 32, 32, 32, 8}));
  info["prefill"]["checkpoint_entries"] = 2;  // only the checkpoint at 192 before 200
  EXPECT_EQ(decoder_calls_from_info(info, 200, 50), (V{32, 32, 32, 32, 14, 8}));
  info["prefill"]["checkpoint_entries"] = 0;  // one entry: the prompt's own, no interval cuts
  EXPECT_EQ(decoder_calls_from_info(info, 200, 50), (V{32, 32, 32, 32, 22}));
  info["prefill"]["last_alone"] = true;
  EXPECT_EQ(decoder_calls_from_info(info, 40), (V{32, 7, 1}));
  info["prefill"]["min_tokens"] = 100;
  info["prefill"]["step"] = 50;
  info["prefill"].erase("checkpoint_entries");  // every multiple of 64 from 100 on: 128, 192
  EXPECT_EQ(decoder_calls_from_info(info, 200, 0), (V{50, 50, 28, 50, 14, 7, 1}));
  EXPECT_EQ(decoder_calls_from_info(info, 200, 200), V{});  // nothing to run
  EXPECT_EQ(decoder_calls_from_info(nlohmann::json::object(), 200), V{});
}

}  // namespace
}  // namespace hetero
