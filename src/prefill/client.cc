// Prefill client: see client.h.
#include "prefill/client.h"

#include <httplib.h>

#include <chrono>
#include <nlohmann/json.hpp>

namespace hetero {

FetchResult fetch_prefill(const std::string& host, int port, const PrefillRequest& req,
                          Assembler* assembler, int64_t stall_ms, int64_t deadline_ms) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  auto ms = [&] { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); };
  FetchResult out;
  httplib::Client cli(host, port);
  cli.set_connection_timeout(std::chrono::milliseconds(std::min<int64_t>(stall_ms, 5000)));
  cli.set_read_timeout(std::chrono::milliseconds(stall_ms));
  const nlohmann::json body = prefill_request_json(req);

  FrameParser parser(int64_t{8} << 30);
  auto last_byte = std::chrono::steady_clock::now();
  Status stream_status;
  int http_status = 0;
  std::string error_text;
  httplib::Request r;
  r.method = "POST";
  r.path = "/v1/prefill";
  r.body = body.dump();
  r.set_header("Content-Type", "application/json");
  r.response_handler = [&](const httplib::Response& res) {
    http_status = res.status;
    return true;
  };
  r.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    out.bytes += static_cast<int64_t>(n);
    last_byte = std::chrono::steady_clock::now();
    if (http_status != 200) {
      error_text.append(data, n);
      return true;
    }
    if (ms() > static_cast<double>(deadline_ms)) {
      stream_status = Status(Code::kDeadlineExceeded, "prefill passed its deadline of " +
                                                          std::to_string(deadline_ms) + " ms");
      return false;
    }
    const auto t_verify = std::chrono::steady_clock::now();
    struct AddVerify {  // accounts the parsing/verification time however the loop exits
      FetchResult* out;
      std::chrono::steady_clock::time_point t;
      ~AddVerify() {
        out->verify_ms +=
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
      }
    } add_verify{&out, t_verify};
    parser.feed(data, n);
    while (true) {
      auto f = parser.next();
      if (!f.is_ok()) return (stream_status = f.status()), false;
      if (!f.value().has_value()) return true;
      Frame& frame = *f.value();
      if (frame.header.value("kind", "") == "manifest") {
        auto m = decode_manifest(frame);
        stream_status = m.is_ok() ? assembler->finish(m.value()) : m.status();
        out.have_manifest = m.is_ok();
        if (m.is_ok()) out.arith = m->arith;
        // An honest "ended early" keeps the prefix; a manifest that disagrees voids it all.
        if (m.is_ok() && !stream_status.is_ok() && stream_status.code() != Code::kUnavailable)
          out.salvageable = false;
        return stream_status.is_ok();
      }
      auto s = decode_segment(std::move(frame));  // views into the frame: no second copy
      if (!s.is_ok()) return (stream_status = s.status()), false;
      Status a = assembler->accept(s.value());
      if (!a.is_ok()) {
        if (a.code() == Code::kFailedPrecondition) out.salvageable = false;  // wrong model
        return (stream_status = a), false;
      }
      last_byte = std::chrono::steady_clock::now();
      if (out.first_segment_ms < 0) out.first_segment_ms = ms();
      out.last_segment_ms = ms();
    }
  };
  auto res = cli.send(r);
  out.total_ms = ms();
  if (!stream_status.is_ok()) {
    out.status = stream_status;
  } else if (!res && res.error() == httplib::Error::Read && out.bytes > 0) {
    const double quiet_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - last_byte)
            .count();
    out.status = quiet_ms >= static_cast<double>(stall_ms)
                     ? Status(Code::kDeadlineExceeded, "prefill host stalled (no bytes for " +
                                                           std::to_string(stall_ms) + " ms)")
                     : unavailable("prefill host closed the stream mid-way (process gone?)");
  } else if (!res) {
    out.status = unavailable("prefill host " + host + ":" + std::to_string(port) + ": " +
                             httplib::to_string(res.error()));
  } else if (http_status != 200) {
    auto j = nlohmann::json::parse(error_text, nullptr, false);
    std::string msg =
        j.is_object() && j.contains("error") ? j["error"].value("message", error_text) : error_text;
    out.status = Status(http_status == 409 ? Code::kFailedPrecondition : Code::kInvalidArgument,
                        "prefill host refused (HTTP " + std::to_string(http_status) + "): " + msg);
  } else if (!out.have_manifest) {
    out.status = data_loss("stream ended without a manifest after " +
                           std::to_string(assembler->covered_tokens()) + " verified rows");
  }
  return out;
}

}  // namespace hetero
