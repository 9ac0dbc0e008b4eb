// libFuzzer target: a prefill stream as the decode side receives it. The first byte picks the
// family (llama or deepseek_v4, tiny layouts), whether frames must carry tags (a receiver that
// holds the stack's secret) and the length of the pieces the rest arrives in; the rest goes
// through StreamReceiver: the tag check, the frame parser, segment and manifest decoding, the
// family's assembler (accept, finish) and, when something verified, its arrays. Nothing a
// prefill host sends may crash the front door, read out of bounds or throw past the receiver.
#include <cstddef>
#include <cstdint>
#include <optional>

#include "bridge/assembler.h"
#include "decode/prefill_client.h"
#include "fuzz_layouts.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const hetero::DecoderCacheLayout layout =
      (data[0] & 1) ? hetero::fuzz::dsv4_layout() : hetero::fuzz::llama_layout();
  const bool tagged = (data[0] & 2) != 0;
  const size_t piece = 1 + (data[0] >> 2);  // 1..64 bytes per read, as a socket delivers them
  auto assembler = hetero::make_assembler(layout, hetero::fuzz::kRequestedTokens);
  std::optional<hetero::FrameTagger> tags;
  if (tagged) tags.emplace(hetero::fuzz::kSecret, hetero::fuzz::kNonce);
  hetero::StreamReceiver receiver(assembler.get(), std::move(tags));
  for (size_t at = 1; at < size; at += piece) {
    const size_t n = at + piece <= size ? piece : size - at;
    if (!receiver.feed(reinterpret_cast<const char*>(data + at), n)) break;
  }
  const int64_t covered = assembler->covered_tokens();
  if (covered > 0 && assembler->can_mount(covered)) (void)assembler->arrays(covered);
  return 0;
}
