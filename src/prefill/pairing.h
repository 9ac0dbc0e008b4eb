// Whether a prefill host's checkpoint holds the weights its decoder computes with. The forward
// that makes each layer's attention input runs on the checkpoint's weights, the cache program on
// the decoder's export: a bridge is exact only if both are the decoder's weights. What can be
// checked from the prefill side alone: every tensor the export carries against the checkpoint's
// tensor of the same name, value for value, each after its own side's dequantization. The
// export carries only the cache program's weights, so this is a necessary condition, not a
// proof (docs/design/decoder-seam.md, "Pairing"). load_prefill_stack (families.cc) runs it once
// per start for every backend; a refusal is kFailedPrecondition naming both sides.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "common/safetensors.h"
#include "common/status.h"
#include "common/tensor.h"
#include "model/dsv4.h"

namespace hetero {

// The two sides of a pairing, for messages.
struct PairingSides {
  std::string decoder_model;            // the decoder's checkpoint as its export recorded it
  nlohmann::json decoder_quantization;  // as in DecoderCacheLayout (null: unquantized)
  std::string prefill_model;            // the prefill host's checkpoint directory
};

// Where a decoder weight and the prefill checkpoint's differ.
struct WeightDifference {
  std::string name;  // the checkpoint's tensor name
  int64_t differing = 0, total = 0;
  int64_t first = -1;  // flat index of the first differing value
  std::vector<int64_t> shape;
  float decoder_value = 0, prefill_value = 0;
  // Set instead of the counts when the values cannot be compared: "has shape [a, b] in the
  // decoder and [c, d] in the prefill checkpoint", "is in the decoder's export but not ...".
  std::string detail;
};

// The decoder's tensor against the prefill checkpoint's, both of any float dtype, value for
// value: equal floats or both NaN. +0 and -0 count as equal (formats disagree on the sign of a
// zero code, and it changes no sum with a nonzero term). nullopt when equal.
std::optional<WeightDifference> compare_weight(const std::string& name, const Tensor& decoder,
                                               const Tensor& prefill);

// The refusal for a difference, naming both sides: "the prefill checkpoint P does not hold the
// decoder's weights: NAME differs in 97.3% of its values (...) (decoder: Q, from M; prefill: S).
// <why>".
Status refuse_weights_differ(const WeightDifference& d, const PairingSides& sides,
                             const std::string& prefill_storage, const std::string& why);

// llama. `exported`: the export's weights.safetensors (layers.N.{k,v}_proj as `weight` or a
// quantized module's `qvalues`/`scales`/`biases`, their biases, layers.N.k_norm.weight);
// `checkpoint`: the checkpoint's tensors as stored, at least model.layers.N.self_attn.* of
// those names (dense, or mlx-lm-quantized: U32 `weight` + `scales` + `biases`), compared as the
// engine loads them. Every value is compared: k/v projections are a few percent of a llama
// checkpoint (GQA), reading them costs far less than the engine's own load. A quantized decoder
// against a dense prefill checkpoint, or the reverse, is refused naming both.
Status check_llama_pairing(const TensorMap& exported, const TensorMap& checkpoint, int64_t layers,
                           const PairingSides& sides);

// deepseek_v4. `exported`: the export's weights.safetensors (python/hetero_mlx/dsv4.py
// `cache_weights`: a projection as `weight`, or as element values `qvalues` times `scales`
// (+ `biases` for affine)); `checkpoint`: load_dsv4_cache_tensors. Compared, every value, per
// layer: attn.wkv and kv_norm; per compressor wkv, wgate, norm and ape. Projections compare as
// the values they stand for (FP8 codes times block scales against mxfp8 codes times group
// scales: exact on both sides). ape compares at the decoder's precision: mlx-vlm's converter
// casts the checkpoint's float32 ape to bf16, so an exported bf16 ape is compared with the
// checkpoint's rounded to bf16. Not covered: everything the export does not carry (q, o,
// experts, router, embeddings, hyper-connections), and the arithmetic (a dense bf16 decoder
// holds the FP8 checkpoint's values exactly but computes with them differently).
Status check_dsv4_pairing(const TensorMap& exported, const Dsv4CacheTensors& checkpoint,
                          const std::vector<int64_t>& ratios, const PairingSides& sides);

// Reads what the family's check needs (the export's decoder.json and weights; of the
// checkpoint only the tensors the export also carries) and runs it.
Status check_checkpoint_holds_decoder_weights(const std::string& family,
                                              const std::string& model_dir,
                                              const std::string& weights_dir);

}  // namespace hetero
