// libFuzzer target: POST /v1/prefill bodies as the prefill host parses them
// (parse_prefill_request): any body is a request or a clear refusal.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "bridge/prefill_request.h"
#include "fuzz_layouts.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string body(reinterpret_cast<const char*>(data), size);
  auto r = hetero::parse_prefill_request(body, /*vocab=*/512, hetero::fuzz::llama_layout(),
                                         /*max_tokens=*/4096);
  if (r.is_ok()) (void)hetero::prefill_request_json(r.value()).dump();
  return 0;
}
