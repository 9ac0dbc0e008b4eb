// The decode side of one bridged request: see bridge.h.
#include "decode/bridge.h"

#include <chrono>
#include <filesystem>

#include "bridge/assembler.h"

namespace hetero {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// The lengths of the decoder's calls over rows [start, want), when its reported calls tile them
// and end with the last token's (want, 1); else none (the prefill host then needs none, or
// refuses a prompt whose rows depend on them).
std::vector<int64_t> call_lengths(const std::vector<std::pair<int64_t, int64_t>>& calls,
                                  int64_t start, int64_t want) {
  if (calls.size() < 2 || calls.front().first != start || calls.back() != std::pair{want, 1L})
    return {};
  std::vector<int64_t> lengths;
  int64_t pos = start;
  for (size_t i = 0; i + 1 < calls.size(); ++i) {
    if (calls[i].first != pos || calls[i].second <= 0) return {};
    lengths.push_back(calls[i].second);
    pos += calls[i].second;
  }
  return pos == want ? lengths : std::vector<int64_t>{};
}

}  // namespace

void take_decoder_calls(const nlohmann::json& reply, BridgeParams* p) {
  p->decoder_calls.clear();
  if (!reply.is_object() || !reply.contains("calls") || !reply["calls"].is_array()) return;
  for (const nlohmann::json& c : reply["calls"]) {
    if (!c.is_array() || c.size() != 2 || !c[0].is_number_integer() || !c[1].is_number_integer())
      return p->decoder_calls.clear();
    p->decoder_calls.emplace_back(c[0].get<int64_t>(), c[1].get<int64_t>());
  }
  p->decoder_batched = reply.value("path", std::string("batch")) != "single";
}

BridgeOutcome run_bridge(const SeamClient& seam, const nlohmann::json& info,
                         const std::vector<int32_t>& ids, int64_t decoder_cached,
                         const BridgeParams& p) {
  BridgeOutcome out;
  Verdict& v = out.verdict;
  v.t = static_cast<int64_t>(ids.size());
  auto layout_or = layout_from_json(info);
  if (!layout_or.is_ok())
    return (v = v.declined_from("decoder info incomplete: " + layout_or.status().message())), out;
  if (v.t < 2) return (v = v.declined_from("a bridge needs at least 2 prompt tokens")), out;
  const DecoderCacheLayout& layout = layout_or.value();
  const int64_t want = v.t - 1;  // the decoder keeps at least one token to process

  // A warm prompt: the decoder's own cache of ids[:start] stays, and only the tail is asked for.
  const int64_t start = p.tails && decoder_cached > 0 && decoder_cached < want ? decoder_cached : 0;
  // The rows go into the store's file as they verify: no whole cache in this process's memory.
  auto assembler = make_assembler(layout, want, p.store_dir, start);
  PrefillRequest req;
  req.ids.assign(ids.begin(), ids.begin() + want);
  req.fingerprint = layout.fingerprint;
  req.chunk_tokens = p.chunk_tokens;
  req.decoder_calls = decoder_calls_from_info(info, want, start);
  if (req.decoder_calls.empty()) req.decoder_calls = call_lengths(p.decoder_calls, start, want);
  req.decoder_batched = p.decoder_batched;
  req.start = start;
  req.cache_salt = seam.salt();  // the prefill host's prefix caches keep tenants apart too
  v.start = start;
  out.fetch = fetch_prefill(p.prefill_host, p.prefill_port, req, assembler.get(), p.stall_ms,
                            p.deadline_ms, p.secret, p.client_gone);
  const FetchResult& f = out.fetch;
  if (start > 0 && f.error_code == "prefix_state_missing") {
    // A deepseek_v4 tail resumes only from the prefill host's checkpoint of exactly ids[:start]
    // (a prefix it did not bridge, or one it evicted): the whole prefix then, which the decoder
    // takes in place of its own.
    BridgeParams whole = p;
    whole.tails = false;
    BridgeOutcome again = run_bridge(seam, info, ids, decoder_cached, whole);
    again.verdict.timings_ms["tail_refused"] = f.total_ms;
    if (again.verdict.reason.empty() && again.verdict.bridged())
      again.verdict.reason = "whole prefix: " + f.status.message();
    return again;
  }
  v.bytes = f.bytes;
  // From the request's turn at the prefill host: the wait for it is the verdict's bridge_queue.
  v.timings_ms["prefill"] = f.total_ms - f.queued_ms;
  if (f.first_segment_ms >= 0) v.timings_ms["first_segment"] = f.first_segment_ms - f.queued_ms;
  if (f.last_segment_ms >= 0) v.timings_ms["last_segment"] = f.last_segment_ms - f.queued_ms;
  v.timings_ms["verify"] = f.verify_ms;
  v.arith = f.arith;
  if (f.computed_from >= 0) v.computed = assembler->covered_tokens() - f.computed_from;

  const int64_t covered = assembler->covered_tokens();
  if (f.status.is_ok()) {
    if (!assembler->can_mount(want))
      return (v = v.declined_from("the verified rows cannot be mounted as a " +
                                  std::to_string(want) + "-token prefix")),
             out;
    v.kind = VerdictKind::kComplete;
    v.b = want;
  } else if (f.salvageable && assembler->can_mount(covered) &&
             covered >= p.partial_min_fraction * static_cast<double>(want) &&
             covered > decoder_cached) {
    v.kind = VerdictKind::kPartial;  // the longest verified contiguous prefix
    v.b = covered;
    v.reason = f.status.message();
  } else {
    std::string why = f.status.message() + " (verified " + std::to_string(covered) + "/" +
                      std::to_string(want) + " rows";
    if (covered >= 1 && !assembler->can_mount(covered))
      why += "; a " + layout.family + " prefix cannot be mounted partially";
    else if (f.salvageable && covered >= 1 && covered <= decoder_cached)
      why += "; the decoder already holds " + std::to_string(decoder_cached);
    return (v = v.declined_from(why + ")")), out;
  }

  const auto t_store = Clock::now();
  auto entry = assembler->store(p.store_dir, layout, ids, v.b, want);
  v.timings_ms["store"] = ms_since(t_store);
  if (!entry.is_ok())
    return (v = v.declined_from("store failed: " + entry.status().message())), out;
  out.entry_path = entry->path;

  const auto t_mount = Clock::now();
  auto m = seam.mount(entry->path, ids);
  v.timings_ms["mount"] = ms_since(t_mount);
  if (!p.keep_entry) {
    std::error_code ec;
    std::filesystem::remove_all(entry->path, ec);  // the decoder holds its own copy now
    out.entry_path.clear();
  }
  if (!m.is_ok()) return (v = v.declined_from("mount failed: " + m.status().message())), out;
  if (m->contains("pin") && (*m)["pin"].is_string()) out.pin = (*m)["pin"].get<std::string>();

  // Trust, but check: the decoder must now see the mounted prefix. If not, what was mounted
  // leaves its cache too: an entry the bridge could not confirm is never served later.
  auto now = seam.cached_prefix(ids);
  if (!now.is_ok() || now.value() < v.b) {
    seam.unpin(out.pin, /*evict=*/true);
    out.pin.clear();
    return (v = v.declined_from(
                "mounted " + std::to_string(v.b) + " rows but the decoder would reuse " +
                (now.is_ok() ? std::to_string(now.value()) : now.status().message()))),
           out;
  }
  return out;
}

}  // namespace hetero
