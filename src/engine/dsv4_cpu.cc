// The DeepSeek-V4 forward on CPU. See dsv4_cpu.h for the contract and
// docs/design/prefill-dsv4.md for what is computed and where it leaves the decoder's arithmetic.
// This file must be compiled without FMA contraction and without fast-math (the decoder's
// float32 order of operations is the contract).
#include "engine/dsv4_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "common/bf16.h"
#include "common/sysmem.h"
#include "engine/dsv4_cpu_rows.h"
#include "kernels/cpu_ops.h"
#include "kernels/dsv4_ops.h"
#include "kernels/mlx_math.h"

namespace hetero {
namespace {

using dsv4_cpu_rows::hc_collapse;
using dsv4_cpu_rows::hc_expand;
using dsv4_cpu_rows::HcMix;
using dsv4_cpu_rows::hisa_select;
using dsv4_cpu_rows::HisaQuery;
using dsv4_cpu_rows::sdpa_row;
using dsv4_cpu_rows::sigmoid_f32;
using dsv4_cpu_rows::sparse_row;
using dsv4_cpu_rows::top_k_indices;

using Bf16 = std::vector<uint16_t>;

// A default Tensor has no shape (and numel 1): "absent" for the optional parts of a layer.
bool present(const Tensor& t) { return !t.shape.empty() && t.numel() > 0; }

std::vector<float> transposed_of(const Tensor& t) {
  if (!present(t)) return {};
  return hetero::transposed_f32(t.data<uint16_t>(), t.shape[0], t.shape[1]);
}

// A [k -> n] projection: float32 transposed weights for linear_decoder_order, or, in the
// mlx-cpu profile for a matrix the checkpoint quantizes, its MX form (element values [n, k] and
// per-group scales [n, k/group], pointing into the engine's weights) for linear_quantized_mx.
struct Mat {
  std::vector<float> wt;
  int64_t k = 0, n = 0;
  const float* mx_values = nullptr;
  const float* mx_scales = nullptr;
  int64_t mx_group = 0;
  explicit operator bool() const { return !wt.empty() || mx_values; }
};
Mat prepare(const Tensor& t) {
  if (!present(t)) return {};
  return {transposed_of(t), t.shape[1], t.shape[0]};
}
// Rows [row0, row0 + rows) of a matrix, quantized when mx is given (and present).
Mat prepare(const Tensor& t, const Dsv4MxMatrix* mx, int64_t row0 = 0, int64_t rows = -1) {
  if (!present(t)) return {};
  const int64_t k = t.shape[1];
  if (rows < 0) rows = t.shape[0] - row0;
  if (mx && mx->present()) {
    Mat m;
    m.k = k, m.n = rows, m.mx_group = mx->group;
    m.mx_values = mx->values.data() + row0 * k;
    m.mx_scales = mx->scales.data() + row0 * (k / mx->group);
    return m;
  }
  return {transposed_f32(t.data<uint16_t>() + row0 * k, rows, k), k, rows};
}
// The decoder's projection of `rows` rows. Dense: an addmm (a bias joins the float32 sum).
// Quantized: MLX's CPU quantized matmul, then QuantizedLinear's separate bf16 bias add.
Bf16 apply(const Mat& m, const uint16_t* x, int64_t rows, const uint16_t* bias = nullptr) {
  Bf16 out(static_cast<size_t>(rows * m.n));
  if (rows == 0) return out;
  if (m.mx_values) {
    linear_quantized_mx(x, rows, m.k, m.mx_values, m.mx_scales, m.n, m.mx_group, out.data());
    if (bias)
      for (int64_t i = 0; i < rows; ++i)
        add_bf16(&out[static_cast<size_t>(i * m.n)], bias, m.n, &out[static_cast<size_t>(i * m.n)]);
  } else {
    linear_decoder_order(x, rows, m.k, m.wt.data(), m.n, bias, out.data());
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// State: the decoder's caches, row for row.

// RotatingKVCache(max_size, keep=0) as the decoder updates it; rows are rope'd kv [head_dim].
struct LocalWindow {
  Bf16 keys;
  int64_t rows = 0, idx = 0, offset = 0;

  void drop_front(int64_t n, int64_t d) {
    keys.erase(keys.begin(), keys.begin() + n * d);
    rows -= n;
  }
  // Multi-token update: temporal order, keep at most max-1 old rows, append.
  void update_concat(const uint16_t* kv, int64_t m, int64_t d, int64_t max) {
    if (rows > 0) {
      if (idx != rows) {
        if (idx < offset) {
          std::rotate(keys.begin(), keys.begin() + idx * d, keys.end());
        } else {
          keys.resize(static_cast<size_t>(idx * d));
          rows = idx;
        }
      }
      idx = rows;
      const int64_t trim = idx - max + 1;
      if (trim > 0) drop_front(trim, d);
    }
    keys.insert(keys.end(), kv, kv + m * d);
    rows += m;
    offset += m;
    idx = rows;
  }
  // One-token update: grow to max, then rotate; returns how many leading rows are visible.
  int64_t update_in_place(const uint16_t* kv, int64_t d, int64_t max) {
    const int64_t prev = offset;
    if (rows == 0 || (prev >= rows && rows < max)) {
      const int64_t grow = std::min<int64_t>(256, max - prev);
      keys.resize(static_cast<size_t>((rows + grow) * d), 0);
      rows += grow;
      idx = prev;
    }
    if (rows > max) {
      drop_front(rows - max, d);
      idx = max;
    }
    if (idx == max) idx = 0;
    std::memcpy(&keys[static_cast<size_t>(idx * d)], kv, static_cast<size_t>(d) * 2);
    offset += 1;
    idx += 1;
    return offset < max ? offset : rows;
  }
};

// PoolingCache(ratio): raw compressor rows waiting for a full window, and the pooled rows.
struct Pool {
  int64_t ratio = 0, width = 0, head_dim = 0;
  Bf16 buf_kv, buf_gate;  // [ratio][width]
  int64_t remainder = 0;
  Bf16 pooled;  // [rows()][head_dim], normed and rope'd
  int64_t rows() const { return head_dim ? static_cast<int64_t>(pooled.size()) / head_dim : 0; }

  // accumulate_windows: the complete windows this call makes (kv/gate rows, window-aligned)
  // and the position of their first row.
  int64_t accumulate(const uint16_t* kv, const uint16_t* gate, int64_t m, int64_t offset,
                     Bf16* ready_kv, Bf16* ready_gate) {
    const size_t w = static_cast<size_t>(width);
    if (buf_kv.empty()) buf_kv.assign(ratio * w, 0), buf_gate.assign(ratio * w, 0);
    ready_kv->clear(), ready_gate->clear();
    int64_t base = 0;
    if (m > 1) {
      const int64_t total = m + remainder, usable = total / ratio * ratio;
      const int64_t new_rem = total % ratio;
      if (usable > 0) {
        ready_kv->assign(buf_kv.begin(), buf_kv.begin() + remainder * w);
        ready_gate->assign(buf_gate.begin(), buf_gate.begin() + remainder * w);
        ready_kv->insert(ready_kv->end(), kv, kv + (usable - remainder) * w);
        ready_gate->insert(ready_gate->end(), gate, gate + (usable - remainder) * w);
        base = offset - remainder;
        remainder = 0;
      }
      if (new_rem > 0) {
        const int64_t n_new = new_rem - remainder;  // rows written after the kept remainder
        std::memcpy(&buf_kv[remainder * w], kv + (m - n_new) * w, n_new * w * 2);
        std::memcpy(&buf_gate[remainder * w], gate + (m - n_new) * w, n_new * w * 2);
      }
      remainder = new_rem;
    } else {
      std::memcpy(&buf_kv[remainder * w], kv, w * 2);
      std::memcpy(&buf_gate[remainder * w], gate, w * 2);
      remainder = (remainder + 1) % ratio;
      if (remainder == 0) {
        *ready_kv = buf_kv;
        *ready_gate = buf_gate;
        base = offset - ratio + 1;
      }
    }
    return base;
  }
};

struct Dsv4CpuEngine::LayerState {
  LocalWindow window;
  Pool pool, index_pool;
};

struct Dsv4CpuEngine::Prepared {
  struct Layer {
    Mat wq_a, wq_b, wkv, wo_b, comp_wkv, comp_wgate, idx_wkv, idx_wgate, idx_wq_b, idx_wproj;
    std::vector<Mat> wo_a;  // per output group
    Mat gate, shared_w1, shared_w2, shared_w3;
    std::vector<Mat> w1, w2, w3;
    std::vector<float> freqs;  // the attention's rope (and the indexer query's)
  };
  std::vector<Layer> layers;
  std::vector<float> compress_freqs;  // compressor rows (theta = compress_rope_theta + yarn)
};

// ---------------------------------------------------------------------------------------------

Result<Dsv4QuantArith> parse_dsv4_quant_arith(const std::string& name) {
  if (name == "mlx-cpu") return Dsv4QuantArith::kMlxCpu;
  if (name == "dequant") return Dsv4QuantArith::kDequant;
  return invalid_argument("unknown quantized arithmetic '" + name +
                          "' (expected 'mlx-cpu' or 'dequant')");
}

const char* dsv4_quant_arith_name(Dsv4QuantArith arith) {
  return arith == Dsv4QuantArith::kMlxCpu ? "mlx-cpu" : "dequant";
}

Result<std::unique_ptr<Dsv4CpuEngine>> Dsv4CpuEngine::load(const std::string& model_dir,
                                                           const Dsv4EngineOptions& options) {
  HETERO_ASSIGN_OR_RETURN(Dsv4Weights w, load_dsv4_weights(model_dir));
  if (options.quant_arith == Dsv4QuantArith::kMlxCpu) HETERO_RETURN_IF_ERROR(check_mx_forms(w));
  return std::make_unique<Dsv4CpuEngine>(std::move(w), options);
}

Dsv4CpuEngine::~Dsv4CpuEngine() = default;

Dsv4CpuEngine::Dsv4CpuEngine(Dsv4Weights weights, const Dsv4EngineOptions& options)
    : w_(std::move(weights)), options_(options) {
  const Dsv4Config& c = w_.config;
  const bool mlx_cpu = options_.quant_arith == Dsv4QuantArith::kMlxCpu;
  for (Dsv4LayerWeights& L : w_.layers) {
    if (mlx_cpu) {
      // The converter casts ape to bf16 (mlx-vlm's cast predicate does not keep it in float32),
      // and the decoder's compressors add those values.
      for (Dsv4Compressor* cm : {&L.compressor, &L.index_compressor})
        for (float& v : cm->ape) v = round_bf16(v);
    } else {
      L.mx = Dsv4LayerMx{};  // unused in this profile
    }
  }
  // In the dequant profile no MX form is used: every projection is a dense bf16 matmul.
  auto q = [mlx_cpu](const Dsv4MxMatrix& m) { return mlx_cpu ? &m : nullptr; };
  p_ = std::make_unique<Prepared>();
  const YarnScaling no_yarn;
  p_->compress_freqs =
      dsv4_rope_freqs(static_cast<int>(c.rope_head_dim), c.compress_rope_theta, c.yarn);
  const std::vector<float> local_freqs =
      dsv4_rope_freqs(static_cast<int>(c.rope_head_dim), c.rope_theta, no_yarn);
  p_->layers.resize(w_.layers.size());
  for (size_t i = 0; i < w_.layers.size(); ++i) {
    const Dsv4LayerWeights& L = w_.layers[i];
    Prepared::Layer& P = p_->layers[i];
    P.freqs = L.ratio == 0 ? local_freqs : p_->compress_freqs;
    const Dsv4LayerMx& M = L.mx;
    P.wq_a = prepare(L.wq_a, q(M.wq_a)), P.wq_b = prepare(L.wq_b, q(M.wq_b));
    P.wkv = prepare(L.wkv, q(M.wkv)), P.wo_b = prepare(L.wo_b, q(M.wo_b));
    for (int64_t g = 0; g < c.o_groups; ++g)  // QuantizedMultiLinear: one matmul per group
      P.wo_a.push_back(prepare(L.wo_a, q(M.wo_a), g * c.o_lora_rank, c.o_lora_rank));
    P.comp_wkv = prepare(L.compressor.wkv), P.comp_wgate = prepare(L.compressor.wgate);
    P.idx_wkv = prepare(L.index_compressor.wkv), P.idx_wgate = prepare(L.index_compressor.wgate);
    P.idx_wq_b = prepare(L.index_wq_b, q(M.index_wq_b)),
    P.idx_wproj = prepare(L.index_weights_proj);
    P.gate = prepare(L.gate);
    P.shared_w1 = prepare(L.shared_w1, q(M.shared_w1));
    P.shared_w2 = prepare(L.shared_w2, q(M.shared_w2));
    P.shared_w3 = prepare(L.shared_w3, q(M.shared_w3));
    // Routed experts: gather_qmm on the CPU is the same recipe per selected row. A checkpoint
    // that stores them dense has no MX forms for them at all.
    auto qe = [&](const std::vector<Dsv4MxMatrix>& forms, size_t e) {
      return e < forms.size() ? q(forms[e]) : nullptr;
    };
    for (size_t e = 0; e < L.w1.size(); ++e) {
      P.w1.push_back(prepare(L.w1[e], qe(M.w1, e)));
      P.w2.push_back(prepare(L.w2[e], qe(M.w2, e)));
      P.w3.push_back(prepare(L.w3[e], qe(M.w3, e)));
    }
  }
  reset();
}

void Dsv4CpuEngine::reset() {
  const Dsv4Config& c = w_.config;
  state_.assign(w_.layers.size(), LayerState{});
  calls_.clear();
  for (size_t i = 0; i < w_.layers.size(); ++i) {
    const Dsv4LayerWeights& L = w_.layers[i];
    if (L.ratio > 0)
      state_[i].pool = Pool{L.ratio, L.compressor.out_dim, c.head_dim, {}, {}, 0, {}};
    if (L.ratio == 4)
      state_[i].index_pool = Pool{4, L.index_compressor.out_dim, c.index_head_dim, {}, {}, 0, {}};
  }
  n_cached_ = 0;
  resumed_at_ = 0;
}

int64_t Dsv4CpuEngine::reserve_bytes(int64_t tokens, int64_t max_chunk_tokens) const {
  const Dsv4Config& c = w_.config;
  const int64_t n = std::max<int64_t>(max_chunk_tokens, 1), hd = c.head_dim, H = c.hidden;
  // The state after `tokens` tokens: pooled rows, the compressors' raw rows, and the window,
  // which holds up to window - 1 old rows beside a call's new ones.
  int64_t state = 0;
  for (const Dsv4LayerWeights& L : w_.layers) {
    state += (c.sliding_window + n) * hd * 2;
    if (L.ratio > 0) state += (tokens / L.ratio * hd + 2 * L.ratio * L.compressor.out_dim) * 2;
    if (L.ratio == 4)
      state += (tokens / 4 * c.index_head_dim + 2 * 4 * L.index_compressor.out_dim) * 2;
  }
  // A chunk's largest buffers, per token: the residual stream (hc_mult copies) and its mixes,
  // the attention's projections and output, a call's visibility mask against the window, the
  // indexer's queries and selection, the router's scores and the experts' hidden rows.
  const int64_t per_token = (c.hc_mult + 2) * H * 2 + 2 * c.hc_mix() * 4 + c.q_lora_rank * 2 +
                            2 * c.heads * hd * 2 + 6 * hd * 2 + c.o_groups * c.o_lora_rank * 2 +
                            (c.sliding_window + n) + c.index_n_heads * (c.index_head_dim * 2 + 2) +
                            c.index_topk * 4 + c.n_routed_experts * 4 * 2 +
                            (c.experts_per_tok + c.n_shared_experts) * c.moe_inter * 3 * 2;
  return state + n * per_token;
}

Status Dsv4CpuEngine::reserve(int64_t tokens, int64_t max_chunk_tokens) {
  const Dsv4Config& c = w_.config;
  const int64_t n = std::max<int64_t>(max_chunk_tokens, 1), hd = c.head_dim;
  const int64_t whole = reserve_bytes(tokens, n);
  int64_t held = 0;
  for (const LayerState& s : state_)
    held += static_cast<int64_t>(s.pool.pooled.capacity() + s.index_pool.pooled.capacity()) * 2;
  HETERO_RETURN_IF_ERROR(check_host_memory(
      whole, held, budget_,
      "the state of " + std::to_string(tokens) + " tokens and a chunk of " + std::to_string(n)));
  try {
    for (size_t i = 0; i < state_.size(); ++i) {
      const int64_t r = w_.layers[i].ratio;
      if (r > 0) state_[i].pool.pooled.reserve(static_cast<size_t>(tokens / r * hd));
      if (r == 4)
        state_[i].index_pool.pooled.reserve(static_cast<size_t>(tokens / 4 * c.index_head_dim));
    }
  } catch (const std::bad_alloc&) {
    return resource_exhausted("out of host memory: could not allocate the pooled rows of " +
                              std::to_string(tokens) + " tokens");
  }
  return Status::ok();
}

Status Dsv4CpuEngine::set_full_forward(bool on) {
  if (n_cached_ != 0) return failed_precondition("full_forward changes only between sequences");
  full_forward_ = on;
  return Status::ok();
}

Status Dsv4CpuEngine::set_decoder_calls(const std::vector<int64_t>& calls) {
  if (n_cached_ != resumed_at_)
    return failed_precondition("decoder calls change only between sequences");
  calls_.set(calls, n_cached_);
  return Status::ok();
}

namespace {

struct Dsv4EngineCheckpoint : Checkpoint {
  std::vector<Dsv4CpuEngine::LayerState> state;
  int64_t n = 0, held = 0;
  bool full_forward = false;
  int64_t tokens() const override { return n; }
  int64_t bytes() const override { return held; }
};

int64_t pool_bytes(const Pool& p) {
  return static_cast<int64_t>(p.buf_kv.size() + p.buf_gate.size() + p.pooled.size()) * 2;
}

}  // namespace

int64_t Dsv4CpuEngine::checkpoint_bytes() const {
  int64_t held = 0;
  for (const LayerState& s : state_)
    held += static_cast<int64_t>(s.window.keys.size()) * 2 + pool_bytes(s.pool) +
            pool_bytes(s.index_pool);
  return held;
}

std::shared_ptr<const Checkpoint> Dsv4CpuEngine::checkpoint() const {
  auto c = std::make_shared<Dsv4EngineCheckpoint>();
  c->state = state_;
  c->n = n_cached_;
  c->full_forward = full_forward_;
  c->held = checkpoint_bytes();
  return c;
}

Status Dsv4CpuEngine::restore(const Checkpoint& c) {
  const auto* mine = dynamic_cast<const Dsv4EngineCheckpoint*>(&c);
  if (!mine) return invalid_argument("not a checkpoint of this engine");
  if (mine->state.size() != state_.size() || mine->full_forward != full_forward_)
    return failed_precondition("the checkpoint was made by an engine of another shape");
  state_ = mine->state;
  n_cached_ = resumed_at_ = mine->n;
  calls_.clear();
  return Status::ok();
}

// ---------------------------------------------------------------------------------------------
// Attention.

namespace {

// Compresses this call's rows into `pool` (norm + rope included) and returns how many pooled
// rows it added.
int64_t compress(Pool& pool, const Dsv4Compressor& cm, const std::vector<float>& freqs,
                 const uint16_t* kv, const uint16_t* gate, int64_t m, int64_t offset, float eps) {
  Bf16 rkv, rgate;
  const int64_t base = pool.accumulate(kv, gate, m, offset, &rkv, &rgate);
  const int64_t windows = static_cast<int64_t>(rkv.size()) / (pool.ratio * pool.width);
  if (windows == 0) return 0;
  Bf16 pooled(static_cast<size_t>(windows * pool.head_dim));
  if (pool.ratio == 4) {
    // Only windows completed within one call see their predecessor (the overlap lane).
    std::vector<uint8_t> has_prev(static_cast<size_t>(windows), 1);
    has_prev[0] = 0;
    dsv4_pool_overlap(rkv.data(), rgate.data(), cm.ape.data(), has_prev.data(), windows, pool.ratio,
                      pool.head_dim, pooled.data());
  } else {
    dsv4_pool_simple(rkv.data(), rgate.data(), cm.ape.data(), windows, pool.ratio, pool.head_dim,
                     pooled.data());
  }
  rms_norm(pooled.data(), windows, pool.head_dim, cm.norm.data<uint16_t>(), eps, pooled.data());
  dsv4_rope(pooled.data(), windows, 1, pool.head_dim, base / pool.ratio, freqs,
            static_cast<int>(pool.ratio), false);
  pool.pooled.insert(pool.pooled.end(), pooled.begin(), pooled.end());
  return windows;
}

}  // namespace

void Dsv4CpuEngine::attention(int64_t layer, const uint16_t* x, int64_t n, int64_t pos0,
                              uint16_t* out) {
  const Dsv4Config& c = w_.config;
  const Dsv4LayerWeights& L = w_.layers[static_cast<size_t>(layer)];
  const Prepared::Layer& P = p_->layers[static_cast<size_t>(layer)];
  LayerState& st = state_[static_cast<size_t>(layer)];
  const int64_t Hh = c.heads, hd = c.head_dim, H = c.hidden, win = c.sliding_window;
  const float eps = static_cast<float>(c.rms_norm_eps);

  Bf16 qr = apply(P.wq_a, x, n);
  rms_norm(qr.data(), n, c.q_lora_rank, L.q_norm.data<uint16_t>(), eps, qr.data());
  Bf16 q = apply(P.wq_b, qr.data(), n);
  rms_norm_noweight(q.data(), n * Hh, hd, eps, q.data());
  dsv4_rope(q.data(), n, Hh, hd, pos0, P.freqs, 1, false);
  Bf16 kv = apply(P.wkv, x, n);
  rms_norm(kv.data(), n, hd, L.kv_norm.data<uint16_t>(), eps, kv.data());
  dsv4_rope(kv.data(), n, 1, hd, pos0, P.freqs, 1, false);

  // Per-token projections of the compressors and the indexer (row-wise: any call split agrees).
  Bf16 ckv, cgate, ikv, igate, iq, iw;
  if (L.ratio > 0) ckv = apply(P.comp_wkv, x, n), cgate = apply(P.comp_wgate, x, n);
  const int64_t ih = c.index_n_heads, ihd = c.index_head_dim;
  if (L.ratio == 4) {
    ikv = apply(P.idx_wkv, x, n), igate = apply(P.idx_wgate, x, n);
    iq = apply(P.idx_wq_b, qr.data(), n);
    dsv4_rope(iq.data(), n, ih, ihd, pos0, P.freqs, 1, false);
    iw = apply(P.idx_wproj, x, n);
  }

  Bf16 attn(static_cast<size_t>(n * Hh * hd));
  const float scale_b = round_bf16(1.0f / std::sqrt(static_cast<float>(hd)));
  std::vector<float> sinks(static_cast<size_t>(Hh));
  for (int64_t h = 0; h < Hh; ++h) sinks[static_cast<size_t>(h)] = round_bf16(L.attn_sink[h]);

  // The decoder's calls inside this chunk (model/dsv4_calls.h).
  for (const auto& [s0, m] : calls_.within(pos0, n)) {
    const int64_t off = pos0 + s0;
    // Local window: keys in the decoder's row order, and which rows each query sees.
    int64_t S, mask_shift = 0, off_clamped = std::min(win - 1, off);
    if (m > 1) {
      st.window.update_concat(&kv[static_cast<size_t>(s0 * hd)], m, hd, win);
      S = st.window.rows;
      mask_shift = S - (off_clamped + m);  // the decoder's _align_local_mask
    } else {
      S = st.window.update_in_place(&kv[static_cast<size_t>(s0 * hd)], hd, win);
    }
    std::vector<const uint16_t*> local(static_cast<size_t>(S));
    for (int64_t j = 0; j < S; ++j) local[static_cast<size_t>(j)] = &st.window.keys[j * hd];
    std::vector<uint8_t> local_vis;  // [m][S], empty when everything is visible
    if (m > 1) {
      local_vis.assign(static_cast<size_t>(m * S), 1);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < S; ++j) {
          const int64_t jm = j - mask_shift;  // the column in the decoder's [m, off'+m] mask
          if (jm >= 0)
            local_vis[static_cast<size_t>(i * S + j)] =
                jm <= off_clamped + i && off_clamped + i < jm + win;
        }
    }

    int64_t Pn = 0;
    std::vector<uint32_t> topk;  // [m][k] for the sparse path
    int64_t k_sel = 0;
    if (L.ratio > 0) {
      compress(st.pool, L.compressor, p_->compress_freqs,
               &ckv[static_cast<size_t>(s0 * ckv.size() / n)],
               &cgate[static_cast<size_t>(s0 * cgate.size() / n)], m, off, eps);
      Pn = st.pool.rows();
    }
    if (L.ratio == 4) {
      compress(st.index_pool, L.index_compressor, p_->compress_freqs,
               &ikv[static_cast<size_t>(s0 * ikv.size() / n)],
               &igate[static_cast<size_t>(s0 * igate.size() / n)], m, off, eps);
      if (Pn > c.index_topk) {
        // The indexer: relu(q . pooled) * ihd^-0.5, weighted per head, summed over heads.
        k_sel = std::min(c.index_topk, Pn);
        topk.resize(static_cast<size_t>(m * k_sel));
        const float scale = static_cast<float>(std::pow(static_cast<double>(ihd), -0.5));
        const float wscale = static_cast<float>(std::pow(static_cast<double>(ih), -0.5));
        const uint16_t* ip = st.index_pool.pooled.data();
        const int64_t Np = st.index_pool.rows();
        if (c.index_block > 0 && Np >= c.index_block * c.index_keep &&
            c.index_keep * c.index_block >= k_sel) {
          std::vector<float> w(static_cast<size_t>(m * ih));
          std::vector<HisaQuery> queries(static_cast<size_t>(m));
          for (int64_t i = 0; i < m; ++i) {
            for (int64_t h = 0; h < ih; ++h)
              w[static_cast<size_t>(i * ih + h)] =
                  bf16_to_f32(iw[static_cast<size_t>((s0 + i) * ih + h)]) * wscale;
            queries[static_cast<size_t>(i)] = {&iq[static_cast<size_t>((s0 + i) * ih * ihd)],
                                               &w[static_cast<size_t>(i * ih)],
                                               std::min(Np, (off + i + 1) / L.ratio)};
          }
          hisa_select(queries, m == 1, ip, Np, ih, ihd, c.index_block, c.index_keep, k_sel, scale,
                      topk.data());
        } else {
#pragma omp parallel for schedule(dynamic)
          for (int64_t i = 0; i < m; ++i) {
            std::vector<float> score(static_cast<size_t>(Pn), 0.0f), hs(static_cast<size_t>(Pn));
            std::vector<uint32_t> scratch;
            for (int64_t h = 0; h < ih; ++h) {
              const uint16_t* qh = &iq[static_cast<size_t>(((s0 + i) * ih + h) * ihd)];
              const float wh = bf16_to_f32(iw[static_cast<size_t>((s0 + i) * ih + h)]) * wscale;
              for (int64_t r = 0; r < Pn; ++r) {
                float acc = 0.0f;
                for (int64_t dd = 0; dd < ihd; ++dd)
                  acc = acc + bf16_to_f32(qh[dd]) * bf16_to_f32(ip[r * ihd + dd]);
                const float relu = acc > 0.0f ? acc : 0.0f;
                score[static_cast<size_t>(r)] = score[static_cast<size_t>(r)] + relu * scale * wh;
              }
            }
            if (m > 1)
              for (int64_t r = 0; r < Pn; ++r)
                if (!(r < (off + i + 1) / 4))
                  score[static_cast<size_t>(r)] = -std::numeric_limits<float>::max();
            top_k_indices(score.data(), Pn, k_sel, &topk[static_cast<size_t>(i * k_sel)], scratch);
          }
        }
      }
    }
    const bool sparse = L.ratio == 4 && Pn > c.index_topk;
    const uint16_t* pooled = L.ratio > 0 ? st.pool.pooled.data() : nullptr;

#pragma omp parallel for collapse(2) schedule(dynamic)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t h = 0; h < Hh; ++h) {
        const uint16_t* qrow = &q[static_cast<size_t>(((s0 + i) * Hh + h) * hd)];
        uint16_t* orow = &attn[static_cast<size_t>(((s0 + i) * Hh + h) * hd)];
        const uint8_t* lv = m > 1 ? &local_vis[static_cast<size_t>(i * S)] : nullptr;
        const float sink = sinks[static_cast<size_t>(h)];
        if (sparse) {
          std::vector<const uint16_t*> rows(static_cast<size_t>(k_sel));
          std::vector<uint8_t> pv(static_cast<size_t>(k_sel), 1);
          for (int64_t t = 0; t < k_sel; ++t) {
            const uint32_t r = topk[static_cast<size_t>(i * k_sel + t)];
            rows[static_cast<size_t>(t)] = pooled + r * hd;
            if (m > 1) pv[static_cast<size_t>(t)] = static_cast<int64_t>(r) < (off + i + 1) / 4;
          }
          sparse_row(qrow, local, lv, rows, m > 1 ? pv.data() : nullptr, hd, scale_b, sink, orow);
        } else {
          std::vector<const uint16_t*> keys = local;
          std::vector<uint8_t> vis;
          for (int64_t r = 0; r < Pn; ++r) keys.push_back(pooled + r * hd);
          if (m > 1) {
            vis.assign(lv, lv + S);
            for (int64_t r = 0; r < Pn; ++r) vis.push_back(r < (off + i + 1) / L.ratio);
          }
          std::vector<float> scratch(keys.size());
          sdpa_row(qrow, keys, m > 1 ? vis.data() : nullptr, hd, scale_b, sink, scratch.data(),
                   orow);
        }
      }
  }

  // De-rotate the output's rope dims by the query's angle, then the grouped low-rank output.
  dsv4_rope(attn.data(), n, Hh, hd, pos0, P.freqs, 1, true);
  const int64_t G = c.o_groups, feat = Hh * hd / G, R = c.o_lora_rank;
  Bf16 mid(static_cast<size_t>(n * G * R)), part(static_cast<size_t>(n * feat));
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t t = 0; t < n; ++t)
      std::memcpy(&part[static_cast<size_t>(t * feat)],
                  &attn[static_cast<size_t>((t * G + g) * feat)], static_cast<size_t>(feat) * 2);
    Bf16 og = apply(P.wo_a[static_cast<size_t>(g)], part.data(), n);
    for (int64_t t = 0; t < n; ++t)
      std::memcpy(&mid[static_cast<size_t>((t * G + g) * R)], &og[static_cast<size_t>(t * R)],
                  static_cast<size_t>(R) * 2);
  }
  const uint16_t* bias = present(L.wo_b_bias) ? L.wo_b_bias.data<uint16_t>() : nullptr;
  const Bf16 o = apply(P.wo_b, mid.data(), n, bias);
  std::memcpy(out, o.data(), static_cast<size_t>(n * H) * 2);
}

// ---------------------------------------------------------------------------------------------
// MoE.

void Dsv4CpuEngine::moe(int64_t layer, const uint16_t* x, int64_t n, const int32_t* ids,
                        uint16_t* out) const {
  const Dsv4Config& c = w_.config;
  const Dsv4LayerWeights& L = w_.layers[static_cast<size_t>(layer)];
  const Prepared::Layer& P = p_->layers[static_cast<size_t>(layer)];
  const int64_t E = c.n_routed_experts, K = c.experts_per_tok, H = c.hidden;

  // Router: bf16 logits, float32 scores, top-k (hash table or biased scores), normalised weights.
  Bf16 logits = apply(P.gate, x, n);
  std::vector<int32_t> inds(static_cast<size_t>(n * K));
  std::vector<float> weights(static_cast<size_t>(n * K));
  std::vector<uint32_t> scratch, sel(static_cast<size_t>(K));
  const bool hash = layer < c.num_hash_layers;
  for (int64_t t = 0; t < n; ++t) {
    std::vector<float> score(static_cast<size_t>(E));
    const float* lg = nullptr;
    std::vector<float> lf(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e)
      lf[static_cast<size_t>(e)] = bf16_to_f32(logits[static_cast<size_t>(t * E + e)]);
    lg = lf.data();
    if (c.scoring_func == "softmax") {
      float mx = -INFINITY;
      for (int64_t e = 0; e < E; ++e) mx = std::max(mx, lg[e]);
      float tot = 0.0f;
      for (int64_t e = 0; e < E; ++e)
        tot = tot + (score[static_cast<size_t>(e)] = mlx_exp(lg[e] - mx));
      const float inv = 1.0f / tot;
      for (int64_t e = 0; e < E; ++e)
        score[static_cast<size_t>(e)] = score[static_cast<size_t>(e)] * inv;
    } else if (c.scoring_func == "sigmoid") {
      for (int64_t e = 0; e < E; ++e) score[static_cast<size_t>(e)] = sigmoid_f32(lg[e]);
    } else {  // sqrtsoftplus: sqrt(logaddexp(x, 0))
      for (int64_t e = 0; e < E; ++e) {
        const float hi = lg[e] > 0.0f ? lg[e] : 0.0f, lo = lg[e] < 0.0f ? lg[e] : 0.0f;
        const float sp =
            (lo == -INFINITY || hi == INFINITY) ? hi : hi + std::log1p(mlx_exp(lo - hi));
        score[static_cast<size_t>(e)] = std::sqrt(sp);
      }
    }
    int32_t* ti = &inds[static_cast<size_t>(t * K)];
    if (hash) {
      for (int64_t k = 0; k < K; ++k) ti[k] = L.tid2eid[static_cast<size_t>(ids[t] * K + k)];
    } else {
      std::vector<float> biased(static_cast<size_t>(E));
      for (int64_t e = 0; e < E; ++e)
        biased[static_cast<size_t>(e)] =
            score[static_cast<size_t>(e)] + L.gate_bias[static_cast<size_t>(e)];
      top_k_indices(biased.data(), E, K, sel.data(), scratch);
      for (int64_t k = 0; k < K; ++k) ti[k] = static_cast<int32_t>(sel[static_cast<size_t>(k)]);
    }
    float* tw = &weights[static_cast<size_t>(t * K)];
    for (int64_t k = 0; k < K; ++k) tw[k] = score[static_cast<size_t>(ti[k])];
    if (c.scoring_func != "softmax" && c.norm_topk_prob) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s = s + tw[k];
      const float d = s + 1e-20f;
      for (int64_t k = 0; k < K; ++k) tw[k] = tw[k] / d;
    }
    const float rsf = static_cast<float>(c.routed_scaling_factor);
    for (int64_t k = 0; k < K; ++k) tw[k] = tw[k] * rsf;
  }

  // SwiGLU with the decoder's clamp: silu(min(gate, l)) * clip(up, -l, l).
  const float limit = static_cast<float>(c.swiglu_limit);
  auto swiglu = [limit](Bf16& g, const Bf16& u) {
    Bf16 uc = u;
    if (limit > 0.0f) {
      const float lb = round_bf16(limit);
      for (auto& v : g) v = f32_to_bf16(std::min(bf16_to_f32(v), lb));
      for (auto& v : uc) v = f32_to_bf16(std::min(std::max(bf16_to_f32(v), -lb), lb));
    }
    silu_mul(g.data(), uc.data(), static_cast<int64_t>(g.size()), g.data());
  };

  // Routed experts, token rows grouped per expert (each row's arithmetic is independent).
  Bf16 routed(static_cast<size_t>(n * K * H));
  for (int64_t e = 0; e < E; ++e) {
    std::vector<int64_t> slots;
    for (int64_t s = 0; s < n * K; ++s)
      if (inds[static_cast<size_t>(s)] == e) slots.push_back(s);
    if (slots.empty()) continue;
    const int64_t m = static_cast<int64_t>(slots.size());
    Bf16 xe(static_cast<size_t>(m * H));
    for (int64_t r = 0; r < m; ++r)
      std::memcpy(&xe[static_cast<size_t>(r * H)], x + (slots[static_cast<size_t>(r)] / K) * H,
                  static_cast<size_t>(H) * 2);
    Bf16 g = apply(P.w1[static_cast<size_t>(e)], xe.data(), m);
    Bf16 u = apply(P.w3[static_cast<size_t>(e)], xe.data(), m);
    swiglu(g, u);
    Bf16 y = apply(P.w2[static_cast<size_t>(e)], g.data(), m);
    for (int64_t r = 0; r < m; ++r)
      std::memcpy(&routed[static_cast<size_t>(slots[static_cast<size_t>(r)] * H)],
                  &y[static_cast<size_t>(r * H)], static_cast<size_t>(H) * 2);
  }

  Bf16 shared;
  if (P.shared_w1) {
    Bf16 g = apply(P.shared_w1, x, n), u = apply(P.shared_w3, x, n);
    swiglu(g, u);
    shared = apply(P.shared_w2, g.data(), n);
  }
  // sum_k bf16(routed_k * bf16(w_k)) accumulated in float32, rounded once; + shared in bf16.
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n; ++t)
    for (int64_t d = 0; d < H; ++d) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k)
        acc = acc + round_bf16(bf16_to_f32(routed[static_cast<size_t>((t * K + k) * H + d)]) *
                               round_bf16(weights[static_cast<size_t>(t * K + k)]));
      float y = round_bf16(acc);
      if (!shared.empty()) y = y + bf16_to_f32(shared[static_cast<size_t>(t * H + d)]);
      out[t * H + d] = f32_to_bf16(y);
    }
}

// ---------------------------------------------------------------------------------------------

Status Dsv4CpuEngine::prefill_chunk(const std::vector<int32_t>& ids, const AttentionInputTap& tap) {
  const Dsv4Config& c = w_.config;
  HETERO_RETURN_IF_ERROR(check_token_ids(ids, c.vocab));
  if (ids.empty()) return Status::ok();
  const int64_t n = static_cast<int64_t>(ids.size()), pos0 = n_cached_, H = c.hidden;
  const int64_t K = c.hc_mult;
  const float eps = static_cast<float>(c.rms_norm_eps);

  // The residual stream: hc_mult copies of each token's embedding.
  Bf16 h(static_cast<size_t>(n * K * H)), x(static_cast<size_t>(n * H)), y(x.size());
  const uint16_t* emb = w_.embed.data<uint16_t>();
  for (int64_t t = 0; t < n; ++t)
    for (int64_t k = 0; k < K; ++k)
      std::memcpy(&h[static_cast<size_t>((t * K + k) * H)], emb + static_cast<int64_t>(ids[t]) * H,
                  static_cast<size_t>(H) * 2);

  for (int64_t l = 0; l < c.layers; ++l) {
    const Dsv4LayerWeights& L = w_.layers[static_cast<size_t>(l)];
    HcMix mix = hc_collapse(L.hc_attn, c, h.data(), n, x.data());
    rms_norm(x.data(), n, H, L.attn_norm.data<uint16_t>(), eps, x.data());
    if (tap) tap(TapEvent{static_cast<int32_t>(l), pos0, n, H, x.data()});
    if (l == c.layers - 1 && !full_forward_) break;
    attention(l, x.data(), n, pos0, y.data());
    hc_expand(mix, c, y.data(), n, h.data());
    mix = hc_collapse(L.hc_ffn, c, h.data(), n, x.data());
    rms_norm(x.data(), n, H, L.ffn_norm.data<uint16_t>(), eps, x.data());
    moe(l, x.data(), n, ids.data(), y.data());
    hc_expand(mix, c, y.data(), n, h.data());
  }
  n_cached_ += n;
  return Status::ok();
}

}  // namespace hetero
