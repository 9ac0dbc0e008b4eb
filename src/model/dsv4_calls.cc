#include "model/dsv4_calls.h"

#include <algorithm>

namespace hetero {

void Dsv4Calls::set(const std::vector<int64_t>& calls, int64_t start) {
  ends_.clear();
  int64_t at = start;
  for (int64_t len : calls)
    if (len > 0) ends_.push_back(at += len);
}

std::vector<std::pair<int64_t, int64_t>> Dsv4Calls::within(int64_t pos0, int64_t n) const {
  std::vector<std::pair<int64_t, int64_t>> out;
  auto add = [&](int64_t first, int64_t len) {  // one decoder call's rows inside the chunk
    if (len > 1 && len <= kDsv4DecodeBlock) {
      for (int64_t t = 0; t < len; ++t) out.emplace_back(first + t, 1);
    } else if (len > 0) {
      out.emplace_back(first, len);
    }
  };
  int64_t at = pos0;
  const int64_t end = pos0 + n;
  for (auto e = std::upper_bound(ends_.begin(), ends_.end(), pos0); at < end; ++e) {
    const int64_t stop = e == ends_.end() ? end : std::min(*e, end);
    add(at - pos0, stop - at);
    at = stop;
  }
  return out;
}

std::vector<int64_t> dsv4_group_calls(const std::vector<int64_t>& calls, int64_t max_tokens) {
  std::vector<int64_t> chunks;
  int64_t open = 0;
  for (int64_t len : calls) {
    if (len <= 0) continue;
    if (open > 0 && open + len > max_tokens) chunks.push_back(open), open = 0;
    open += len;
  }
  if (open > 0) chunks.push_back(open);
  return chunks;
}

}  // namespace hetero
