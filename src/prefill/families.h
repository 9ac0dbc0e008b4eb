// The per-family assembly of a prefill host: load the model's engine and the decoder's export,
// check that they describe the same model (before any cache is written), and say how to build
// each request's cache program. Used by `hetero prefill` and `hetero verify`.
#pragma once

#include <memory>
#include <string>

#include "bridge/dsv4_program.h"
#include "model/dsv4.h"
#include "prefill/service.h"

namespace hetero {

struct PrefillStack {
  std::string family;
  std::unique_ptr<PrefillEngine> engine;
  DecoderCacheLayout layout;
  ProgramFactory programs;
  ChunkPlan chunk_plan;         // empty: equal chunks
  std::shared_ptr<void> owned;  // the engine and the decoder weights behind the pointers above
};

// gemm: "ordered" or "blas" (llama only).
Result<PrefillStack> load_prefill_stack(const std::string& model_dir,
                                        const std::string& weights_dir,
                                        const std::string& gemm = "ordered");

// deepseek_v4: every parameter the cache program's arithmetic depends on must agree between the
// prefill host's checkpoint and the decoder's export; the message names both values.
Status check_dsv4_export_matches_model(const Dsv4Config& model, const Dsv4DecoderWeights& export_);

}  // namespace hetero
