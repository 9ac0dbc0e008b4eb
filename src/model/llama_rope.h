// The llama family's rope as mlx-lm 0.32.2 builds it (`models/rope_utils.py`, initialize_rope):
// every variant it implements reduced to the one RopeSpec mx.fast.rope is called with, computed
// in the same float32 steps, so the engine's and the cache program's keys are the decoder's bits.
// The formulas and their rounding points: docs/findings/rope-variants-in-mlx.md.
#pragma once

#include <algorithm>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/status.h"
#include "kernels/cpu_ops.h"

namespace hetero {

// What a llama-family rope depends on, as the model's config (or the decoder's export) gives it.
struct LlamaRopeConfig {
  nlohmann::json scaling;  // the rope_scaling object, or null
  double base = 10000.0;   // rope_theta
  int64_t dims = 0;        // head_dim
  bool traditional = false;
  int64_t max_position_embeddings = 0;  // 0: absent from the config
};

// The scaling's type as mlx-lm reads it: "type", else "rope_type", else "default".
std::string rope_type_of(const nlohmann::json& scaling);

// The RopeSpec the decoder's rope module calls mx.fast.rope with. Refuses, naming it, a type
// mlx-lm does not implement and a scaling missing a key the decoder requires. For "dynamic" it
// is the spec of every call that ends within max_position_embeddings (see rope_reach).
Result<RopeSpec> llama_rope(const LlamaRopeConfig& c);

// The longest prompt whose keys llama_rope's spec gives as the decoder computes them whatever
// its call schedule; 0: any length. "dynamic" recomputes its base per call once a call ends past
// max_position_embeddings, so its keys there depend on where the decoder cut the prompt
// (docs/findings/dynamic-rope-needs-the-decoders-calls.md): such prompts are not bridged.
int64_t rope_reach(const LlamaRopeConfig& c);

// OK, or why a prompt of `tokens` tokens is past rope_reach (a per-request refusal: the decoder
// answers it natively).
Status check_rope_reach(const LlamaRopeConfig& c, int64_t tokens);

// "default", "llama3 (factor 8)", ... for messages.
std::string describe_rope(const LlamaRopeConfig& c);

// The RopeSpec of one of the decoder's calls, `length` tokens from `offset`, on the server's
// batch path (batched) or its single path: llama_rope(c) for every rope but a "dynamic" one past
// max_position_embeddings, whose base that call recomputes (in MLX float32 on the batch path,
// Python doubles on the single one: docs/findings/dynamic-rope-needs-the-decoders-calls.md).
Result<RopeSpec> llama_rope_for_call(const LlamaRopeConfig& c, int64_t offset, int64_t length,
                                     bool batched);

// Each row's rope by the decoder's call that computes it: rows in a call whose spec differs from
// the plain one take the call's, every other row the plain one (for a request past rope_reach,
// only right where the calls cover every row past it).
class RopeByCall {
 public:
  explicit RopeByCall(RopeSpec plain);
  // The calls' lengths, the first from row `start`, on the batch or the single path.
  static Result<RopeByCall> make(const LlamaRopeConfig& c, RopeSpec plain, int64_t start,
                                 const std::vector<int64_t>& calls, bool batched);
  // Whether such a request's rows depend on its calls (some call has its own spec).
  static bool follows_calls(const LlamaRopeConfig& c, const RopeSpec& plain, int64_t start,
                            const std::vector<int64_t>& calls, bool batched) {
    auto r = make(c, plain, start, calls, batched);
    return r.is_ok() && r->per_call();
  }
  // make, for an engine that computes the rows from `start` on top of rows it already holds:
  // a tail whose calls have their own specs is refused (its earlier rows' ropes came from calls
  // no request names).
  static Result<RopeByCall> for_engine(const LlamaRopeConfig& c, RopeSpec plain, int64_t start,
                                       const std::vector<int64_t>& calls, bool batched);
  // rope_apply over [tokens, heads, head_dim] rows from position pos0, each with its call's spec.
  void apply(uint16_t* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t pos0) const;
  const RopeSpec& plain() const { return plain_; }
  bool per_call() const { return !calls_.empty(); }
  // The specs rows take: 0 the plain one, i > 0 the i-th call's with its own.
  size_t specs() const { return calls_.size() + 1; }
  const RopeSpec& spec(size_t i) const { return i == 0 ? plain_ : calls_[i - 1].spec; }
  // f(offset, rows, spec index) for each run of the rows [pos0, pos0 + tokens) under one spec,
  // in order (offset from pos0).
  template <class F>
  void for_each_span(int64_t tokens, int64_t pos0, F&& f) const {
    const int64_t end = pos0 + tokens;
    int64_t p = pos0;
    for (size_t i = 0; i < calls_.size(); ++i) {
      const Call& k = calls_[i];
      if (k.end <= p) continue;
      if (k.begin >= end) break;
      if (k.begin > p) f(p - pos0, k.begin - p, size_t{0});
      const int64_t a = std::max(p, k.begin), b = std::min(end, k.end);
      f(a - pos0, b - a, i + 1);
      p = b;
    }
    if (p < end) f(p - pos0, end - p, size_t{0});
  }

 private:
  struct Call {
    int64_t begin, end;
    RopeSpec spec;
  };
  RopeSpec plain_;
  std::vector<Call> calls_;  // the calls whose spec is not the plain one
};

}  // namespace hetero
