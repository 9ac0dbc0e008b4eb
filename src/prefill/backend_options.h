// The one option spec of the prefill backend: where and how a prefill runs (backend, arithmetic,
// dtypes, devices, chunk). `hetero prefill` reads it, `hetero verify` reads it for its
// in-process prefill host, and `hetero up` reads it and hands the same flags to the prefill
// host it starts; so every option the prefill host takes can be checked by verify. Allowed
// values are checked when the options are parsed.
#pragma once

#include <string>
#include <vector>

#include "common/options.h"
#include "prefill/families.h"

namespace hetero {

// The rows, to splice into a command's option table.
std::vector<OptionSpec> prefill_backend_specs();

struct PrefillBackendOptions {
  PrefillBackend backend;
  int64_t chunk_tokens = 0;  // the prefill host's default chunk (0: PrefillStack::default_chunk)
};

// The parsed backend of a command whose table holds prefill_backend_specs().
Result<PrefillBackendOptions> prefill_backend_from(const Options& opts);

// The same options as flags for a child `hetero prefill` (every row, as parsed).
std::vector<std::string> prefill_backend_flags(const Options& opts);

}  // namespace hetero
