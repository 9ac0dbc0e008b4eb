// Signed requests between the stack's processes (common/auth.h, docs/design/auth.md): a
// signature checks only for the request it was made for, under the stack's secret, within the
// clock skew and once; the check before the body refuses what is malformed or out of time; the
// HTTP check protects the paths it is given, before the body is read.
#include "common/auth.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <string>

namespace hetero {
namespace {

const std::string kSecret = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

// The fixed vector both signers must give (python/hetero_mlx/access.py holds the same).
TEST(Auth, TheFixedVectorHolds) {
  const std::string h =
      signed_authorization_at(kSecret, "POST", "/hetero/tokenize", R"({"ids":[1,2,3]})", 1700000000,
                              "0123456789abcdef0123456789abcdef");
  EXPECT_EQ(h,
            "Hetero-HMAC-SHA256 t=1700000000, n=0123456789abcdef0123456789abcdef, "
            "s=086f761d1b634dd0cdead66edfc75caf08f9faf8e54736c85d6d0036b10ba4af");
}

TEST(Auth, ASignatureChecksOnlyForItsRequestOnce) {
  RequestVerifier v(kSecret);
  const int64_t now = unix_now_s();
  const std::string body = R"({"ids":[1,2]})";
  const std::string h = signed_authorization(kSecret, "POST", "/v1/prefill", body);
  EXPECT_FALSE(v.check_head(h, now));
  EXPECT_FALSE(v.check_whole(h, "POST", "/v1/prefill", body, now));
  // The same request again: a replay.
  auto again = v.check_whole(h, "POST", "/v1/prefill", body, now);
  ASSERT_TRUE(again);
  EXPECT_EQ(again->code, "replayed");
  // Anything changed: another body, target, method, or the key of another secret.
  RequestVerifier fresh(kSecret);
  for (auto [method, target, b] :
       {std::tuple{"POST", "/v1/prefill", std::string("{}")},
        std::tuple{"POST", "/v1/prefill?x", body}, std::tuple{"GET", "/v1/prefill", body}}) {
    auto r = fresh.check_whole(h, method, target, b, now);
    ASSERT_TRUE(r) << method << target;
    EXPECT_EQ(r->code, "bad_signature");
  }
  RequestVerifier other(std::string(64, 'f'));
  auto r = other.check_whole(h, "POST", "/v1/prefill", body, now);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->code, "bad_signature");
  // The failed tries remembered nothing: the request itself still checks once.
  EXPECT_FALSE(fresh.check_whole(h, "POST", "/v1/prefill", body, now));
}

TEST(Auth, MalformedOrUntimelyHeadersAreRefusedBeforeTheBody) {
  RequestVerifier v(kSecret);
  const int64_t now = 1700000000;
  const std::string good =
      signed_authorization_at(kSecret, "GET", "/x", "", now, "0123456789abcdef0123456789abcdef");
  EXPECT_FALSE(v.check_head(good, now));
  EXPECT_FALSE(v.check_head(good, now + kAuthMaxSkewS));
  for (const std::string& bad :
       {std::string(), std::string("Bearer ") + kSecret, good.substr(0, good.size() - 1),
        good + "0", good + ",", "hetero-hmac-sha256" + good.substr(18),
        std::string(kAuthScheme) + " t=1, n=0123456789abcdef0123456789abcdef", kSecret,
        std::string(kAuthScheme) +
            " t=1700000000, n=0123456789ABCDEF0123456789abcdef, s=" + std::string(64, 'a'),
        std::string(kAuthScheme) +
            " t=-5, n=0123456789abcdef0123456789abcdef, s=" + std::string(64, 'a')}) {
    auto r = v.check_head(bad, now);
    ASSERT_TRUE(r) << bad;
    EXPECT_EQ(r->code, "unauthorized") << bad;
  }
  for (int64_t off : {kAuthMaxSkewS + 1, -kAuthMaxSkewS - 1, int64_t{86400}}) {
    auto r = v.check_head(good, now + off);
    ASSERT_TRUE(r) << off;
    EXPECT_EQ(r->code, "clock_skew");
  }
}

TEST(Auth, WithoutASecretEverythingIsOpenAndNothingIsSigned) {
  RequestVerifier open("");
  EXPECT_TRUE(open.open());
  EXPECT_FALSE(open.check_whole("", "POST", "/v1/prefill", "{}", unix_now_s()));
  EXPECT_EQ(signed_authorization("", "GET", "/", ""), "");
}

TEST(Auth, KeysArePerPurposeAndNeverTheSecret) {
  const Key32 req = derive_key(kSecret, kRequestKeyPurpose);
  const Key32 frame = derive_key(kSecret, kFrameKeyPurpose);
  EXPECT_NE(req, frame);
  EXPECT_NE(to_hex(req.data(), req.size()), kSecret);
  const std::string h = signed_authorization(kSecret, "GET", "/", "");
  EXPECT_EQ(h.find(kSecret), std::string::npos);
  EXPECT_EQ(h.find(to_hex(req.data(), req.size())), std::string::npos);
}

TEST(Auth, BearerTokens) {
  EXPECT_EQ(bearer_token("Bearer abc"), "abc");
  EXPECT_EQ(bearer_token("bearer abc"), "abc");
  EXPECT_EQ(bearer_token("Bearer "), "");
  EXPECT_EQ(bearer_token("Basic abc"), "");
  EXPECT_TRUE(same_secret("abc", "abc"));
  EXPECT_FALSE(same_secret("abd", "abc"));
  EXPECT_FALSE(same_secret("abcd", "abc"));
  EXPECT_FALSE(same_secret("", "abc"));
}

// The check on a real server: a protected path needs a signed request, refused before its body
// is read; other paths stay open.
TEST(Auth, TheServerCheckProtectsItsPaths) {
  HttpServer server("test", ConnectionLimits{},
                    [](int, const std::string& m) { return R"({"m":")" + m + "\"}"; });
  server.post(
      "/v1/prefill",
      [](const HttpRequest&, HttpResponse& res) { res.set_content("{}", "application/json"); },
      1 << 20);
  server.get("/health", [](const HttpRequest&, HttpResponse& res) {
    res.set_content("{}", "application/json");
  });
  server.set_check(signed_request_check(
      std::make_shared<RequestVerifier>(kSecret),
      [](std::string_view path) { return path == "/v1/prefill"; },
      [](int, const std::string& code, const std::string& m) {
        return R"({"code":")" + code + "\"}";
      }));
  ASSERT_TRUE(server.start("127.0.0.1", 0).is_ok());
  httplib::Client cli("127.0.0.1", server.port());
  auto health = cli.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  auto unsigned_post = cli.Post("/v1/prefill", "{}", "application/json");
  ASSERT_TRUE(unsigned_post);
  EXPECT_EQ(unsigned_post->status, 401);
  EXPECT_NE(unsigned_post->body.find("unauthorized"), std::string::npos);
  const std::string body = R"({"ids":[1]})";
  const httplib::Headers signed_headers = {
      {"Authorization", signed_authorization(kSecret, "POST", "/v1/prefill", body)}};
  auto ok = cli.Post("/v1/prefill", signed_headers, body, "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
  auto replay = cli.Post("/v1/prefill", signed_headers, body, "application/json");
  ASSERT_TRUE(replay);
  EXPECT_EQ(replay->status, 401);
  EXPECT_NE(replay->body.find("replayed"), std::string::npos);
  server.stop();
}

}  // namespace
}  // namespace hetero
