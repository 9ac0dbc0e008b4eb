// `hetero doctor`: checks every link of a running stack — processes and ports, versions, the
// seam, fingerprints on both sides, and one small bridged request that must come back
// `complete`. Prints one line per check; exit 0 only when all are green.
#include <httplib.h>

#include <chrono>
#include <cstdio>
#include <random>

#include "commands.h"
#include "common/auth.h"
#include "common/http_json.h"
#include "common/secret.h"
#include "common/sysmem.h"
#include "front/front.h"

namespace hetero {
using nlohmann::json;

Options doctor_options() {
  const Options front = front_options();  // the stack's addresses: the front door's own rows
  std::vector<OptionSpec> rows;
  for (const char* name :
       {"port", "decoder-host", "decoder-port", "prefill-host", "prefill-port", "api-key-file"})
    rows.push_back(front.spec(name));
  rows.push_back({"bridge-words", "", "400", "words in the bridged probe prompt"});
  rows.push_back(
      secret_file_option("the stack's shared secret (hetero up: <work-dir>/secret), "
                         "for the decoder seam; none: the seam must be open"));
  return Options("doctor", "Check every link of a running stack (hetero up).", std::move(rows));
}

namespace {

struct Checks {
  int failed = 0;
  void report(bool ok, const std::string& what, const std::string& detail) {
    std::printf("%s %-34s %s\n", ok ? "[ ok ]" : "[FAIL]", what.c_str(), detail.c_str());
    std::fflush(stdout);
    failed += ok ? 0 : 1;
  }
};

// A prompt the decoder cannot have seen: random words from a fixed list, fresh seed.
std::string fresh_prompt(int words) {
  static const char* kWords[] = {"river",  "copper", "lantern", "orbit",  "meadow", "cipher",
                                 "harbor", "velvet", "glacier", "summit", "ember",  "quartz",
                                 "tundra", "falcon", "prism",   "willow", "canyon", "beacon"};
  std::mt19937_64 rng(std::random_device{}());
  std::string s = "Repeat the last word of this list: ";
  for (int i = 0; i < words; ++i) s += std::string(kWords[rng() % 18]) + " ";
  return s;
}

}  // namespace

int cmd_doctor(int argc, char** argv) {
  Options opts = doctor_options();
  if (int rc = parse_options(opts, argc, argv); rc >= 0) return rc;
  auto port_r = opts.get_int("port"), dport_r = opts.get_int("decoder-port"),
       pport_r = opts.get_int("prefill-port"), words_r = opts.get_int("bridge-words");
  for (const Status& st : {port_r.status(), dport_r.status(), pport_r.status(), words_r.status()})
    if (!st.is_ok()) return std::fprintf(stderr, "doctor: %s\n", st.message().c_str()), 2;
  const int port = static_cast<int>(port_r.value()), dport = static_cast<int>(dport_r.value());
  const std::string dhost = opts.get("decoder-host"), phost = opts.get("prefill-host");
  const int pport = static_cast<int>(pport_r.value()), words = static_cast<int>(words_r.value());
  auto secret = read_secret_file(opts.get("secret-file"));
  if (!secret.is_ok())
    return std::fprintf(stderr, "doctor: %s\n", secret.status().message().c_str()), 2;
  // With API keys, the front door's /v1/ paths need one: the file's first.
  auto tenants = Tenants::load(opts.get("api-key-file"), secret.value());
  if (!tenants.is_ok())
    return std::fprintf(stderr, "doctor: %s\n", tenants.status().message().c_str()), 2;
  httplib::Headers front_headers;
  if (!tenants->open()) front_headers.emplace("Authorization", "Bearer " + tenants->keys()[0]);
  Checks c;

  auto front = http_json("127.0.0.1", port, "/health", json(), 5000);
  c.report(front.is_ok() && front->status == 200, "front door :" + std::to_string(port),
           front.is_ok() ? front->body.dump() : front.status().message());
  auto info = http_json_ok(dhost, dport, "/hetero/info", json(), 5000, secret.value());
  c.report(info.is_ok(), "decoder seam :" + std::to_string(dport),
           info.is_ok() ? "model " + info->value("model", "?") : info.status().message());
  if (info.is_ok())
    c.report(info->contains("versions"), "decoder versions",
             info->value("versions", json()).dump());
  auto prefill = http_json_ok(phost, pport, "/health", json(), 5000);
  c.report(prefill.is_ok(), "prefill host :" + std::to_string(pport),
           prefill.is_ok() ? prefill->dump() : prefill.status().message());
  if (prefill.is_ok() && prefill->contains("gpu_memory"))
    for (const json& g : (*prefill)["gpu_memory"]) {
      auto bytes = [&](const char* k) { return format_bytes(g.value(k, int64_t{0})); };
      c.report(true, "prefill GPU " + std::to_string(g.value("device", -1)) + " memory",
               "weights " + bytes("weights_bytes") + ", state and activations " +
                   bytes("state_and_activations_bytes") + ", capture " + bytes("capture_bytes") +
                   "; " + bytes("free_bytes") + " free of " + bytes("total_bytes"));
    }
  if (info.is_ok() && prefill.is_ok()) {
    const std::string a = info->value("fingerprint", ""), b = prefill->value("fingerprint", "");
    c.report(!a.empty() && a == b, "fingerprints agree", "decoder " + a + ", prefill " + b);
  }
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(std::chrono::minutes(10));
  auto models = cli.Get("/v1/models", front_headers);
  c.report(models && models->status == 200, "front /v1/models",
           !models ? httplib::to_string(models.error())
                   : "HTTP " + std::to_string(models->status) + " " + models->body);

  // One small bridged request, forced through the bridge, must come back complete. Forcing a
  // bridge takes the stack's signature (front.h).
  json body = {{"messages", json::array({{{"role", "user"}, {"content", fresh_prompt(words)}}})},
               {"max_tokens", 4},
               {"temperature", 0.0}};
  const std::string text = body.dump();
  httplib::Headers headers = front_headers;
  headers.emplace("X-PD-Bridge-Mode", "bridge");
  if (!secret->empty())
    headers.emplace("X-Hetero-Signature",
                    signed_authorization(secret.value(), "POST", "/v1/chat/completions", text));
  auto r = cli.Post("/v1/chat/completions", headers, text, "application/json");
  if (!r) {
    c.report(false, "bridged request", httplib::to_string(r.error()));
  } else {
    const std::string header = r->get_header_value("X-PD-Bridge");
    json v = json::parse(header, nullptr, false);
    const bool ok = r->status == 200 && !v.is_discarded() && v.value("verdict", "") == "complete";
    c.report(ok, "bridged request verdict", "HTTP " + std::to_string(r->status) + " " + header);
  }
  std::printf("%s\n", c.failed == 0 ? "all green"
                                    : (std::to_string(c.failed) + " check(s) failed").c_str());
  return c.failed == 0 ? 0 : 1;
}

}  // namespace hetero
