// Writes a DeepSeek-V4 checkpoint in the official layout and precision, with random weights:
// config.json (the official quantization_config and expert_dtype), one shard of the embedding,
// head, final norm and hc_head, then one shard per layer (as the released checkpoint shards it),
// and model.safetensors.index.json. FP8 e4m3 projections with UE8M0 128x128 scales, FP4 routed
// experts with UE8M0 per-32 scales, FP8 shared experts; bf16 norms, compressors, router and
// indexer weights_proj; f32 hyper-connections, sinks, ape and router bias; I64 tid2eid
// (docs/design/dsv4-flash-full-size-brief.md §1.3).
//
// The weights are cheap to draw, not trained: codes uniform over a band of magnitudes, scales
// sized so that a matrix's entries have RMS about 1/sqrt(in), group exponents jittered by one
// (well inside FP4 -> FP8 widening's exact range). For load tests at Flash's widths (a few GB
// per layer) and for comparing engines on the same official-layout inputs. Host memory: one
// shard at a time.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "model/dsv4.h"

namespace hetero {

// config.json as parse_dsv4_config reads it back (every field of c).
std::string dsv4_config_json(const Dsv4Config& c);

// Writes the checkpoint into dir (created; existing files of the same names are replaced).
// Refuses configurations the official formats cannot hold (widths not multiples of 128 where a
// block or group needs them, attention_bias).
Status write_dsv4_official_checkpoint(const std::string& dir, const Dsv4Config& c, uint64_t seed);

}  // namespace hetero
