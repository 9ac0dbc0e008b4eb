// libFuzzer target: the signed-request checks (common/auth.h) on any Authorization value,
// method, target and body (layout in fuzz_inputs.h): check_head and check_whole at a fixed
// time, bearer_token, same_secret and valid_cache_salt, each held to what it promises. Half the
// inputs also sign their own method, target and body with the verifier's secret at a time in
// its window: that request must pass once and then be refused as `replayed`; changed, or signed
// under another secret, it must be refused as `bad_signature` before, without spending its
// nonce; a time past the window is `clock_skew` before the body. A failed property aborts.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "common/auth.h"
#include "fuzz_inputs.h"

namespace {

using hetero::AuthRefusal;
using hetero::fuzz::kAuthNowS;
using hetero::fuzz::kAuthSecret;

void expect(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "auth_fuzz: %s\n", what);
  std::abort();
}

bool refused_as(const std::optional<AuthRefusal>& r, int status, std::string_view code) {
  return r && r->status == status && r->code == code;
}

bool is_hex_salt(std::string_view s) {
  if (s.empty() || s.size() > 64) return false;
  for (char c : s)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

// A nonce never used before in this process: a counter as 32 hex digits.
std::string fresh_nonce() {
  static uint64_t count = 0;
  uint8_t b[16] = {0xf0, 0x22};
  ++count;
  std::memcpy(b + 8, &count, sizeof count);
  return hetero::to_hex(b, sizeof b);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const hetero::fuzz::AuthInput in = hetero::fuzz::split_auth_input(data, size);
  // The fuzzed headers go to one verifier across inputs, as a server keeps it (its nonce memory
  // grows only by a header that checks: a seed's, once).
  static hetero::RequestVerifier* const server = new hetero::RequestVerifier(kAuthSecret);

  // Any header: the check before the body and the whole check agree on a refusal, and every
  // refusal's message can go into a JSON error body.
  const auto head = server->check_head(in.authorization, kAuthNowS);
  const auto whole =
      server->check_whole(in.authorization, in.method, in.target, in.body, kAuthNowS);
  if (head)
    expect(whole && whole->status == head->status && whole->code == head->code,
           "check_whole passed, or refused otherwise, a header check_head refused");
  if (whole) (void)nlohmann::json(whole->message).dump();

  const std::string_view token = hetero::bearer_token(in.authorization);
  expect(token.empty() ||
             (in.authorization.size() == token.size() + 7 && in.authorization.substr(7) == token),
         "bearer_token is not the header's tail");
  for (auto [a, b] :
       {std::pair{token, in.target}, std::pair{in.method, in.body}, std::pair{in.target, in.body}})
    expect(hetero::same_secret(a, b) == (a == b), "same_secret differs from ==");
  for (std::string_view s : {in.target, in.body, token})
    expect(hetero::valid_cache_salt(s) == is_hex_salt(s), "valid_cache_salt is not 1-64 hex");

  if (!in.sign) return 0;
  // The signed request's own verifier, gone with the input: what one input allocates it frees,
  // so libFuzzer's leak check after each input stays on (a verifier kept across inputs holds
  // every nonce, which libFuzzer takes for a leak a thousand times before it stops checking).
  hetero::RequestVerifier verifier(kAuthSecret);
  const std::string nonce = fresh_nonce();
  const std::string signed_header = hetero::signed_authorization_at(
      kAuthSecret, in.method, in.target, in.body, kAuthNowS + in.skew_s, nonce);
  expect(!verifier.check_head(signed_header, kAuthNowS),
         "a signed header inside the window was refused before its body");
  // Refused without the key: the nonce is not spent by them.
  const std::string changed_body = std::string(in.body) + "x";
  expect(
      refused_as(verifier.check_whole(signed_header, in.method, in.target, changed_body, kAuthNowS),
                 401, "bad_signature"),
      "a signed request with a changed body was not refused as bad_signature");
  const std::string changed_target = std::string(in.target) + "x";
  expect(
      refused_as(verifier.check_whole(signed_header, in.method, changed_target, in.body, kAuthNowS),
                 401, "bad_signature"),
      "a signed request with a changed target was not refused as bad_signature");
  const std::string foreign = hetero::signed_authorization_at(
      "another secret", in.method, in.target, in.body, kAuthNowS + in.skew_s, nonce);
  expect(refused_as(verifier.check_whole(foreign, in.method, in.target, in.body, kAuthNowS), 401,
                    "bad_signature"),
         "a request signed under another secret was not refused as bad_signature");
  // Once, then never again.
  expect(!verifier.check_whole(signed_header, in.method, in.target, in.body, kAuthNowS),
         "a signed request was refused");
  expect(refused_as(verifier.check_whole(signed_header, in.method, in.target, in.body, kAuthNowS),
                    401, "replayed"),
         "a signed request was accepted twice");
  // Past the window, either side: refused before the body.
  const int64_t past = hetero::kAuthMaxSkewS + 1 + (in.skew_s < 0 ? -in.skew_s : in.skew_s);
  const std::string late =
      hetero::signed_authorization_at(kAuthSecret, in.method, in.target, in.body,
                                      kAuthNowS + (in.skew_s < 0 ? -past : past), fresh_nonce());
  expect(refused_as(verifier.check_head(late, kAuthNowS), 401, "clock_skew"),
         "a signed header outside the window was not refused as clock_skew");
  return 0;
}
