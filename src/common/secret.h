// The shared secret of a stack. `hetero up` makes one per run (<work-dir>/secret, mode 0600)
// and hands every process the file's path (--secret-file), never the secret on a command line.
// The secret never crosses a socket: callers sign their requests with a key derived from it
// (common/auth.h, docs/design/auth.md), and the seam and the prefill host refuse a request
// without a valid signature (HTTP 401). With no secret file everything stays open, as tools
// and tests that start single processes expect.
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
// The secret a file holds, surrounding whitespace dropped: one token of 32 to 4096 printable
// ASCII characters, in a file that neither group nor others may read or write (mode 0600 or
// stricter). "" for an empty path (no secret: open).
Result<std::string> read_secret_file(const std::string& path);

}  // namespace hetero
