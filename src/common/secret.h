// The shared secret of a stack. `hetero up` makes one per run (<work-dir>/secret, mode 0600)
// and hands every process the file's path (--secret-file), never the secret on a command line.
// Callers send it as `Authorization: Bearer <secret>` (http_json, the decode side's clients);
// the seam's /hetero/* endpoints and the prefill host's POST /v1/prefill refuse a request
// without it (HTTP 401). With no secret file everything stays open, as tools and tests that
// start single processes expect.
#pragma once

#include <string>
#include <string_view>

#include "common/options.h"
#include "common/status.h"

namespace hetero {

// The option every component reads the file's path from (one flag, one env alias
// HETERO_SECRET_FILE, one meaning); help says what this component does with it.
OptionSpec secret_file_option(std::string help);

// 32 random bytes from the kernel as 64 hex digits, written to a new file at path with mode
// 0600 (written aside and renamed over anything there).
Status write_new_secret_file(const std::string& path);
// The secret a file holds, surrounding whitespace dropped: one token of 1 to 4096 printable
// ASCII characters. "" for an empty path (no secret: open).
Result<std::string> read_secret_file(const std::string& path);

// The header that carries it, and the header's value for secret.
inline constexpr char kAuthHeader[] = "Authorization";
std::string bearer_value(const std::string& secret);
// Whether an Authorization header's value carries secret, compared in time independent of
// where they differ. Always true for an empty secret (open).
bool bearer_matches(std::string_view header_value, std::string_view secret);

}  // namespace hetero
