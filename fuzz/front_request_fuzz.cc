// libFuzzer target: client bodies as the front door reads them: parsed with the nesting limit,
// checked against the request schema as a chat and as a completions request for each decoder
// family (and unknown limits), the completion length checked, and the accepted ones forwarded
// and dumped (what the decoder gets). No body may crash, and the forwarded body of an accepted
// request must itself be accepted: forwarding keeps only checked fields.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "common/json_text.h"
#include "front/request_schema.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto body =
      hetero::parse_untrusted_json(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!body.is_ok()) return 0;
  static const hetero::ServedLimits kServed[] = {
      {}, {1000, 8192, "llama"}, {129280, 1048576, "deepseek_v4"}};
  for (bool chat : {true, false}) {
    if (hetero::completion_request_error(body.value(), chat).empty()) (void)body->dump();
    for (const hetero::ServedLimits& served : kServed) {
      // The refusal goes into a JSON error body: it must dump (no cut UTF-8).
      const std::string why = hetero::completion_request_error(body.value(), chat, served);
      (void)nlohmann::json(why).dump();
      (void)hetero::completion_length_error(body.value(), static_cast<int64_t>(size), served);
      if (!why.empty()) continue;
      const nlohmann::json forwarded =
          hetero::forwarded_completion_body(body.value(), chat, served);
      (void)forwarded.dump();
      if (!hetero::completion_request_error(forwarded, chat, served).empty()) std::abort();
    }
  }
  return 0;
}
