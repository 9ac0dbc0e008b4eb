// The DeepSeek-V4 decoder's call schedule, as the prefill engines follow it.
//
// A DeepSeek-V4 cache, and every later layer's attention input, depend on where the decoder cut
// the prompt into calls (docs/findings/dsv4-decoder-schedule.md). The engines therefore run each
// decoder call as a call of their own: the window, the compressors, the indexer and the
// attention advance per call. Nothing else does: the projections, the experts, the norms and
// the hyper-connections are row-wise, so an engine chunk may span several decoder calls and run
// those over the whole chunk at once (docs/findings/dsv4-call-schedule-costs.md).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace hetero {

// The decoder runs a call of 2..kDsv4DecodeBlock tokens one token at a time.
constexpr int64_t kDsv4DecodeBlock = 8;

// The decoder's calls over one sequence, and the ones that fall inside an engine chunk.
class Dsv4Calls {
 public:
  // Empty: every engine chunk is one decoder call (what a caller that cuts its chunks at the
  // decoder's calls, or a test of one call, wants). start: the first call's first position (a
  // sequence resumed there from a checkpoint).
  void set(const std::vector<int64_t>& calls, int64_t start = 0);
  void clear() { ends_.clear(); }
  // The calls the decoder ran over positions [pos0, pos0 + n), as (first row in the chunk,
  // rows), with calls of 2..kDsv4DecodeBlock tokens as single tokens. A chunk edge inside a
  // decoder call cuts it there, and positions past the schedule form one call.
  std::vector<std::pair<int64_t, int64_t>> within(int64_t pos0, int64_t n) const;

 private:
  std::vector<int64_t> ends_;  // the position after each decoder call, increasing
};

// Engine chunks for a schedule: consecutive calls grouped while the group stays within
// `max_tokens` (a call longer than that is a chunk of its own). Chunk edges fall on call edges.
std::vector<int64_t> dsv4_group_calls(const std::vector<int64_t>& calls, int64_t max_tokens);

}  // namespace hetero
