// JSON over HTTP: see http_json.h.
#include "common/http_json.h"

#include <httplib.h>

#include "common/auth.h"
#include "common/json_text.h"

namespace hetero {

Result<HttpJsonReply> http_json(const std::string& host, int port, const std::string& path,
                                const nlohmann::json& body, int64_t timeout_ms,
                                const std::string& secret) {
  httplib::Client cli(host, port);
  cli.set_connection_timeout(std::chrono::milliseconds(std::min<int64_t>(timeout_ms, 5000)));
  cli.set_read_timeout(std::chrono::milliseconds(timeout_ms));
  cli.set_write_timeout(std::chrono::milliseconds(timeout_ms));
  httplib::Headers headers;
  const std::string text = body.is_null() ? std::string() : body.dump();
  if (!secret.empty())
    headers.emplace("Authorization",
                    signed_authorization(secret, body.is_null() ? "GET" : "POST", path, text));
  auto res = body.is_null() ? cli.Get(path.c_str(), headers)
                            : cli.Post(path.c_str(), headers, text, "application/json");
  const std::string where = host + ":" + std::to_string(port) + path;
  if (!res) {
    const auto e = res.error();
    return unavailable(where + ": " +
                       (e == httplib::Error::Connection
                            ? std::string("cannot connect (not running?)")
                        : e == httplib::Error::Read ? std::string("no reply within the deadline")
                                                    : "HTTP error " + httplib::to_string(e)));
  }
  HttpJsonReply r;
  r.status = res->status;
  auto parsed = parse_untrusted_json(res->body);
  if (!parsed.is_ok())
    return data_loss(where + " answered HTTP " + std::to_string(res->status) + " with " +
                     parsed.status().message() + ": " + res->body.substr(0, 200));
  r.body = std::move(parsed.value());
  return r;
}

Result<nlohmann::json> http_json_ok(const std::string& host, int port, const std::string& path,
                                    const nlohmann::json& body, int64_t timeout_ms,
                                    const std::string& secret) {
  HETERO_ASSIGN_OR_RETURN(HttpJsonReply r, http_json(host, port, path, body, timeout_ms, secret));
  if (r.status / 100 == 2) return r.body;
  std::string msg = r.body.dump();
  if (r.body.is_object() && r.body.contains("error")) {
    const auto& e = r.body["error"];
    msg = e.is_object() ? e.value("message", e.dump()) : e.dump();
  }
  const Code code = r.status == 404       ? Code::kNotFound
                    : r.status == 409     ? Code::kFailedPrecondition
                    : r.status / 100 == 4 ? Code::kInvalidArgument
                                          : Code::kUnavailable;
  return Status(code, host + ":" + std::to_string(port) + path + " HTTP " +
                          std::to_string(r.status) + ": " + msg);
}

}  // namespace hetero
