// JSON over HTTP to a local service (the decoder seam, the prefill host's /health): one call,
// a deadline, the request signed with the stack's secret when there is one (common/auth.h), and
// every failure as a Status naming the endpoint.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "common/status.h"

namespace hetero {

struct HttpJsonReply {
  int status = 0;
  nlohmann::json body;
};

// POST (or GET when body is null) and parse the reply as JSON; secret: the request is signed
// with it unless empty. Transport errors are kUnavailable; a reply
// that is not JSON is kDataLoss. HTTP errors are returned as replies.
Result<HttpJsonReply> http_json(const std::string& host, int port, const std::string& path,
                                const nlohmann::json& body, int64_t timeout_ms,
                                const std::string& secret = "");
// Same, but any non-2xx reply becomes a Status carrying the server's error message.
Result<nlohmann::json> http_json_ok(const std::string& host, int port, const std::string& path,
                                    const nlohmann::json& body, int64_t timeout_ms,
                                    const std::string& secret = "");

}  // namespace hetero
