// The prefill stream's receiving end: see prefill_client.h.
#include "decode/prefill_client.h"

#include <httplib.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/auth.h"
#include "common/json_text.h"

namespace hetero {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// scheme: the prefill host's X-Hetero-Frame-Tags ("" where it sent none).
Status unauthenticated_stream(const std::string& scheme) {
  if (!scheme.empty())
    return data_loss(std::string("the prefill host tags its frames as '") + scheme +
                     "' and this side checks '" + kFrameTagsScheme +
                     "': the two run releases that speak different wire versions");
  return data_loss(std::string("the prefill host does not tag its frames with the stack's ") +
                   "secret (" + kFrameTagsHeader + " missing): not the stack's prefill host, " +
                   "or one started without --secret-file");
}

Code code_for_http(int status) {
  if (status == 409) return Code::kFailedPrecondition;
  if (status == 507) return Code::kResourceExhausted;
  if (status == 503) return Code::kUnavailable;  // its queue is full, or it is stopping
  if (status >= 500) return Code::kInternal;
  return Code::kInvalidArgument;
}

}  // namespace

// A frame is refused beyond what one segment of this request can hold, before it is buffered.
StreamReceiver::StreamReceiver(Assembler* assembler, std::optional<FrameTagger> tags)
    : assembler_(assembler),
      tags_(std::move(tags)),
      parser_(std::max<int64_t>(1, assembler->max_segment_bytes()), tags_ ? &*tags_ : nullptr) {}

bool StreamReceiver::feed(const char* data, size_t n) {
  if (!status_.is_ok() || have_manifest_) return false;
  const auto t = Clock::now();
  bool go_on = false;
  try {
    parser_.feed(data, n);
    go_on = consume_frames();
  } catch (const std::exception& e) {  // a frame no check foresaw: nothing of it is trusted
    status_ = data_loss(std::string("malformed stream: ") + e.what());
    salvageable_ = false;
  }
  verify_ms_ += ms_since(t);
  return go_on;
}

bool StreamReceiver::consume_frames() {
  while (true) {
    auto f = parser_.next();
    if (!f.is_ok()) return (status_ = f.status()), false;
    if (!f.value().has_value()) return true;
    Frame& frame = *f.value();
    if (frame.header.value("kind", "") == "keepalive")
      continue;  // a stream between turns, or in a long chunk
    if (frame.header.value("kind", "") == "manifest") {
      auto m = decode_manifest(frame);
      status_ = m.is_ok() ? assembler_->finish(m.value()) : m.status();
      have_manifest_ = m.is_ok();
      if (m.is_ok()) arith_ = m->arith, computed_from_ = m->computed_from;
      // An honest "ended early" keeps the prefix; a manifest that disagrees voids it all.
      if (m.is_ok() && !status_.is_ok() && status_.code() != Code::kUnavailable)
        salvageable_ = false;
      return false;
    }
    auto s = decode_segment(std::move(frame));  // views into the frame: no second copy
    if (!s.is_ok()) return (status_ = s.status()), false;
    Status a = assembler_->accept(s.value());
    if (!a.is_ok()) {
      if (a.code() == Code::kFailedPrecondition) salvageable_ = false;  // another model's
      return (status_ = a), false;
    }
    if (first_segment_ms_ < 0) first_segment_ms_ = ms_since(t0_);
    last_segment_ms_ = ms_since(t0_);
  }
}

FetchResult fetch_prefill(const std::string& host, int port, const PrefillRequest& req,
                          Assembler* assembler, int64_t stall_ms, int64_t deadline_ms,
                          const std::string& secret, const std::function<bool()>& client_gone) {
  const auto t0 = Clock::now();
  FetchResult out;
  httplib::Client cli(host, port);
  cli.set_connection_timeout(std::chrono::milliseconds(std::min<int64_t>(stall_ms, 5000)));
  // The prefill host answers a request once its turn comes (it runs one at a time and queues the
  // rest), so until the response starts only the deadline bounds the wait; from then on, the
  // watcher below ends a stream that is silent for stall_ms.
  cli.set_read_timeout(std::chrono::milliseconds(std::max(stall_ms, deadline_ms)));

  PrefillRequest tagged = req;
  std::optional<FrameTagger> tags;
  if (!secret.empty()) {
    tagged.stream_nonce = new_stream_nonce();
    tags.emplace(secret, tagged.stream_nonce);
  }
  StreamReceiver receiver(assembler, std::move(tags));
  Status untagged;
  std::atomic<int64_t> last_byte_ns{Clock::now().time_since_epoch().count()};
  auto quiet_ms = [&] { return ms_since(Clock::time_point(Clock::duration(last_byte_ns.load()))); };
  std::atomic<bool> stalled{false}, late{false}, gone{false};
  std::atomic<int> http_status{0};
  std::string error_text;
  httplib::Request r;
  r.method = "POST";
  r.path = "/v1/prefill";
  r.body = prefill_request_json(tagged).dump();
  r.set_header("Content-Type", "application/json");
  // Signed, never the secret itself: a host that is not the stack's learns nothing it could
  // forge a request or a frame tag with (docs/design/auth.md).
  if (!secret.empty())
    r.set_header("Authorization", signed_authorization(secret, r.method, r.path, r.body));
  r.response_handler = [&](const httplib::Response& res) {
    last_byte_ns = Clock::now().time_since_epoch().count();
    http_status = res.status;
    out.queued_ms = std::atof(res.get_header_value(kQueuedMsHeader).c_str());
    if (res.status == 200 && !secret.empty() &&
        res.get_header_value(kFrameTagsHeader) != kFrameTagsScheme) {
      untagged = unauthenticated_stream(res.get_header_value(kFrameTagsHeader));
      return false;
    }
    return true;
  };
  r.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    out.bytes += static_cast<int64_t>(n);
    last_byte_ns = Clock::now().time_since_epoch().count();
    if (http_status != 200) {
      if (error_text.size() < (1 << 16)) error_text.append(data, n);  // an error body, bounded
      return true;
    }
    if (ms_since(t0) > static_cast<double>(deadline_ms)) return late = true, false;
    receiver.feed(data, n);
    return receiver.status().is_ok();  // after a good manifest: read on to the end
  };
  // Beside the blocking send, every 100 ms: the client's hang-up, the deadline, and silence
  // once the response has started. Shutting the socket is the one thing another thread may do
  // to a request in flight (httplib's stop()).
  std::atomic<bool> sent{false};
  std::mutex watch_mu;
  std::condition_variable watch_cv;
  std::thread watcher([&] {
    std::unique_lock<std::mutex> lock(watch_mu);
    while (!watch_cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return sent.load(); })) {
      std::atomic<bool>* why = nullptr;
      if (client_gone && client_gone())
        why = &gone;
      else if (ms_since(t0) > static_cast<double>(deadline_ms))
        why = &late;
      else if (http_status.load() != 0 && quiet_ms() >= static_cast<double>(stall_ms))
        why = &stalled;
      if (why) {
        *why = true;
        cli.stop();
        return;
      }
    }
  });
  auto res = cli.send(r);
  {
    std::lock_guard<std::mutex> lock(watch_mu);
    sent = true;
  }
  watch_cv.notify_all();
  watcher.join();
  out.total_ms = ms_since(t0);
  out.verify_ms = receiver.verify_ms();
  out.first_segment_ms = receiver.first_segment_ms();
  out.last_segment_ms = receiver.last_segment_ms();
  out.salvageable = receiver.salvageable();
  out.have_manifest = receiver.have_manifest();
  out.arith = receiver.arith();
  out.computed_from = receiver.computed_from();
  if (gone) {
    out.status = unavailable("the client went away during the prefill");
    out.salvageable = false;  // nobody is left to answer
  } else if (!untagged.is_ok()) {
    out.status = untagged;
    out.salvageable = false;
  } else if (receiver.have_manifest() || !receiver.status().is_ok()) {
    out.status = receiver.status();  // the manifest's word, or what the stream broke
  } else if (late) {
    out.status = Status(Code::kDeadlineExceeded,
                        "prefill passed its deadline of " + std::to_string(deadline_ms) + " ms");
  } else if (stalled || (!res && res.error() == httplib::Error::Read && out.bytes > 0 &&
                         quiet_ms() >= static_cast<double>(stall_ms))) {
    out.status = Status(Code::kDeadlineExceeded,
                        "prefill host stalled (no bytes for " + std::to_string(stall_ms) + " ms)");
  } else if (!res && res.error() == httplib::Error::Read && out.bytes > 0) {
    out.status = unavailable("prefill host closed the stream mid-way (process gone?)");
  } else if (!res) {
    out.status = unavailable("prefill host " + host + ":" + std::to_string(port) + ": " +
                             httplib::to_string(res.error()));
  } else if (http_status != 200) {
    auto j = parse_untrusted_json(error_text);
    std::string msg = error_text.substr(0, 1000);
    if (j.is_ok() && j->is_object() && j->contains("error") && (*j)["error"].is_object() &&
        (*j)["error"].contains("message") && (*j)["error"]["message"].is_string())
      msg = (*j)["error"]["message"].get<std::string>();
    if (j.is_ok() && j->is_object() && j->contains("error") && (*j)["error"].is_object() &&
        (*j)["error"].contains("code") && (*j)["error"]["code"].is_string())
      out.error_code = (*j)["error"]["code"].get<std::string>();
    out.status =
        Status(code_for_http(http_status),
               "prefill host refused (HTTP " + std::to_string(http_status.load()) + "): " + msg);
  } else {
    out.status = data_loss("stream ended without a manifest after " +
                           std::to_string(assembler->covered_tokens()) + " verified rows");
  }
  return out;
}

}  // namespace hetero
