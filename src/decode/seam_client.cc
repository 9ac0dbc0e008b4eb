// The decoder seam client: see seam_client.h.
#include "decode/seam_client.h"

namespace hetero {

Result<HttpJsonReply> SeamClient::tokenize(const nlohmann::json& request) const {
  return http_json(host_, port_, "/hetero/tokenize", request, timeout_ms_, secret_);
}

Result<int64_t> SeamClient::cached_prefix(const std::vector<int32_t>& ids) const {
  nlohmann::json body = {{"ids", ids}};
  if (!salt_.empty()) body["hetero_cache_salt"] = salt_;
  HETERO_ASSIGN_OR_RETURN(nlohmann::json r, call("/hetero/cached_prefix", body));
  if (!r.contains("cached_tokens") || !r["cached_tokens"].is_number_integer())
    return data_loss("/hetero/cached_prefix answered without an integer cached_tokens");
  return r["cached_tokens"].get<int64_t>();
}

Result<nlohmann::json> SeamClient::mount(const std::string& entry,
                                         const std::vector<int32_t>& ids) const {
  nlohmann::json body = {{"entry", entry}, {"ids", ids}};
  if (!salt_.empty()) body["hetero_cache_salt"] = salt_;
  return call("/hetero/mount", body);
}

void SeamClient::unpin(const std::string& pin, bool evict) const {
  if (!pin.empty()) (void)call("/hetero/unpin", {{"pin", pin}, {"evict", evict}});
}

}  // namespace hetero
