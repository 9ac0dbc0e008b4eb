// libFuzzer target: client bodies as the front door reads them: parsed with the nesting limit,
// checked as a chat and as a completions request, dumped again (what the front forwards).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/json_text.h"
#include "front/routing.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto body =
      hetero::parse_untrusted_json(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!body.is_ok()) return 0;
  for (bool chat : {true, false})
    if (hetero::completion_request_error(body.value(), chat).empty()) (void)body->dump();
  return 0;
}
