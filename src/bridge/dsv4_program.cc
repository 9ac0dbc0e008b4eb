// DeepSeek-V4 cache program: see dsv4_program.h.
#include "bridge/dsv4_program.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/safetensors.h"
#include "kernels/cpu_ops.h"

namespace hetero {
namespace fs = std::filesystem;
using nlohmann::json;

std::vector<int64_t> dsv4_effective_calls(const std::vector<int64_t>& calls,
                                          int64_t tokenwise_max) {
  std::vector<int64_t> out;
  for (int64_t L : calls) {
    if (L > 1 && L <= tokenwise_max)
      out.insert(out.end(), static_cast<size_t>(L), 1);
    else if (L > 0)
      out.push_back(L);
  }
  return out;
}

std::vector<int64_t> dsv4_server_calls(int64_t n, int64_t step) {
  std::vector<int64_t> calls;
  for (int64_t done = 0; done < n - 1; done += step) calls.push_back(std::min(step, n - 1 - done));
  if (n > 0) calls.push_back(1);
  return calls;
}

Dsv4WindowLayout dsv4_window_layout(const std::vector<int64_t>& calls, int64_t max_size,
                                    const Dsv4WindowLayout* from) {
  // The decoder's RotatingKVCache (keep = 0, step 256), replayed on positions instead of rows.
  std::vector<int64_t> keys;  // position per slot, -1 for a zero row
  bool have = false;
  int64_t idx = 0, offset = 0;
  if (from && from->offset > 0) {  // a cache built from state arrays: keys, _idx, offset
    keys = from->slot_pos;
    have = true;
    idx = from->idx;
    offset = from->offset;
  }
  for (int64_t L : calls) {
    if (L > 1) {
      if (!have) {
        have = true;
      } else {
        const auto len = static_cast<int64_t>(keys.size());
        if (idx == len) {
        } else if (idx < offset) {
          std::rotate(keys.begin(), keys.begin() + idx, keys.end());
        } else {
          keys.resize(static_cast<size_t>(idx));
        }
        const int64_t trim = static_cast<int64_t>(keys.size()) - max_size + 1;
        if (trim > 0) keys.erase(keys.begin(), keys.begin() + trim);
      }
      for (int64_t t = 0; t < L; ++t) keys.push_back(offset + t);
      offset += L;
      idx = static_cast<int64_t>(keys.size());
    } else {
      const int64_t prev = offset;
      if (!have || (prev >= static_cast<int64_t>(keys.size()) &&
                    static_cast<int64_t>(keys.size()) < max_size)) {
        const int64_t grow = std::min<int64_t>(256, max_size - prev);
        HETERO_CHECK(grow > 0);  // the decoder itself fails on a negative size here
        keys.insert(keys.end(), static_cast<size_t>(grow), -1);
        have = true;
        idx = prev;
      }
      const int64_t trim = static_cast<int64_t>(keys.size()) - max_size;
      if (trim > 0) {
        keys.erase(keys.begin(), keys.begin() + trim);
        idx = max_size;
      }
      if (idx == max_size) idx = 0;
      keys[static_cast<size_t>(idx)] = offset;
      offset += 1;
      idx += 1;
    }
  }
  if (offset < static_cast<int64_t>(keys.size())) keys.resize(static_cast<size_t>(offset));
  return Dsv4WindowLayout{keys, idx, offset};
}

std::vector<uint8_t> dsv4_overlap_flags(const std::vector<int64_t>& calls, int64_t ratio) {
  int64_t total = 0;
  for (int64_t L : calls) total += L;
  std::vector<int64_t> call_of(static_cast<size_t>(total)), call_len(calls.size());
  int64_t pos = 0;
  for (size_t c = 0; c < calls.size(); ++c) {
    call_len[c] = calls[c];
    for (int64_t t = 0; t < calls[c]; ++t)
      call_of[static_cast<size_t>(pos++)] = static_cast<int64_t>(c);
  }
  const int64_t windows = total / ratio;
  std::vector<uint8_t> flags(static_cast<size_t>(windows), 0);
  for (int64_t j = 1; j < windows; ++j) {
    const int64_t c = call_of[static_cast<size_t>(ratio * j + ratio - 1)];
    flags[static_cast<size_t>(j)] =
        call_len[static_cast<size_t>(c)] > 1 && call_of[static_cast<size_t>(ratio * j - 1)] == c;
  }
  return flags;
}

Dsv4Schedule dsv4_schedule(const std::vector<int64_t>& decoder_calls, int64_t window, int64_t start,
                           const Dsv4WindowLayout* at_start) {
  const auto calls = dsv4_effective_calls(decoder_calls);
  Dsv4Schedule s;
  s.tokens = start;
  for (int64_t L : calls) s.tokens += L;
  s.window = dsv4_window_layout(calls, window, at_start);
  s.window_first = s.tokens;
  for (int64_t p : s.window.slot_pos)
    if (p >= 0) s.window_first = std::min(s.window_first, p);
  // The prefix as one call of its own: no window the tail completes pools with rows of a call
  // before the tail's first (the flags of the prefix's windows are never used).
  std::vector<int64_t> all = calls;
  if (start > 0) all.insert(all.begin(), start);
  s.flags4 = dsv4_overlap_flags(all, 4);
  s.flags128 = dsv4_overlap_flags(all, 128);
  return s;
}

// ----------------------------------------------------------------------------- weights

namespace {

Status take(TensorMap& all, const std::string& name, std::vector<int64_t> shape, Tensor* out) {
  return take_weight(all, name, shape, false, out);
}

Status take_bf16(TensorMap& all, const std::string& name, std::vector<int64_t> shape, Tensor* out) {
  return take_weight(all, name, shape, true, out);
}

Status load_compressor(TensorMap& all, const std::string& p, int64_t ratio, int64_t hd,
                       int64_t hidden, Dsv4ProgramCompressor* c) {
  c->ratio = ratio;
  c->head_dim = hd;
  c->out_dim = ratio == 4 ? 2 * hd : hd;
  Tensor ape;
  HETERO_RETURN_IF_ERROR(load_decoder_linear(all, p + "wkv.", c->out_dim, hidden, &c->wkv));
  HETERO_RETURN_IF_ERROR(load_decoder_linear(all, p + "wgate.", c->out_dim, hidden, &c->wgate));
  HETERO_RETURN_IF_ERROR(take(all, p + "ape", {ratio, c->out_dim}, &ape));
  HETERO_RETURN_IF_ERROR(take_bf16(all, p + "norm.weight", {hd}, &c->norm));
  c->ape = to_f32(ape);
  return Status::ok();
}

bool same_bits(const std::vector<float>& a, const Tensor& b) {
  if (b.dtype != DType::kF32 || b.numel() != static_cast<int64_t>(a.size())) return false;
  return std::memcmp(a.data(), b.bytes.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

Result<Dsv4DecoderWeights> load_dsv4_decoder_weights(const std::string& dir) {
  HETERO_ASSIGN_OR_RETURN(std::string text, read_export_json(dir, "deepseek_v4"));
  const json j = json::parse(text);
  Dsv4DecoderWeights d;
  YarnScaling yarn;
  double rope_theta = 0, compress_theta = 0;
  std::vector<int64_t> ratios;
  try {
    d.layout.family = "deepseek_v4";
    d.layout.fingerprint = j.at("fingerprint").get<std::string>();
    d.layout.layers = j.at("layers").get<int64_t>();
    d.layout.kv_heads = 1;
    d.layout.head_dim = j.at("head_dim").get<int64_t>();
    d.layout.hidden = j.at("hidden").get<int64_t>();
    d.layout.quantization = j.value("quantization", json());
    d.index_head_dim = j.at("index_head_dim").get<int64_t>();
    d.window = j.at("window").get<int64_t>();
    d.rms_norm_eps = j.at("rms_norm_eps").get<double>();
    ratios = j.at("ratios").get<std::vector<int64_t>>();
    const json& r = j.at("rope");
    d.decoder_rope_json = r.dump();
    d.rope_dims = r.at("qk_rope_head_dim").get<int64_t>();
    rope_theta = r.at("rope_theta").get<double>();
    compress_theta = r.at("compress_rope_theta").get<double>();
    const json& s = r.at("rope_scaling");
    if (!s.is_null()) {
      const std::string type = s.contains("type") ? s.at("type").get<std::string>()
                                                  : s.value("rope_type", std::string());
      if (type == "yarn" || type == "deepseek_yarn") {
        yarn.enabled = true;
        yarn.factor = s.at("factor").get<double>();
        yarn.original_max_position_embeddings =
            s.at("original_max_position_embeddings").get<double>();
        yarn.beta_fast = s.value("beta_fast", 32.0);
        yarn.beta_slow = s.value("beta_slow", 1.0);
      } else if (!type.empty() && type != "default") {
        return invalid_argument(dir + ": rope scaling type '" + type + "' is not supported");
      }
    }
  } catch (const json::exception& e) {
    return invalid_argument(dir + "/decoder.json: " + e.what());
  }
  d.layout.ratios = ratios;
  d.layout.index_head_dim = d.index_head_dim;
  d.layout.window = d.window;
  if (static_cast<int64_t>(ratios.size()) != d.layout.layers)
    return invalid_argument(dir + ": " + std::to_string(ratios.size()) + " ratios for " +
                            std::to_string(d.layout.layers) + " layers");
  if (d.rope_dims <= 0 || d.rope_dims > d.index_head_dim || d.rope_dims > d.layout.head_dim ||
      d.rope_dims % 2)
    return invalid_argument(dir + ": qk_rope_head_dim " + std::to_string(d.rope_dims) +
                            " does not fit the heads");
  d.rope_theta = rope_theta;
  d.compress_rope_theta = compress_theta;
  d.yarn = yarn;
  d.freqs_local = dsv4_rope_freqs(static_cast<int>(d.rope_dims), rope_theta, YarnScaling{});
  d.freqs_compressed = dsv4_rope_freqs(static_cast<int>(d.rope_dims), compress_theta, yarn);

  HETERO_ASSIGN_OR_RETURN(SafetensorsFile f,
                          read_safetensors((fs::path(dir) / "weights.safetensors").string()));
  Tensor fl, fc;
  HETERO_RETURN_IF_ERROR(take(f.tensors, "rope.local.freqs", {d.rope_dims / 2}, &fl));
  HETERO_RETURN_IF_ERROR(take(f.tensors, "rope.compressed.freqs", {d.rope_dims / 2}, &fc));
  if (!same_bits(d.freqs_local, fl) || !same_bits(d.freqs_compressed, fc))
    return failed_precondition(
        dir + ": the rope frequencies computed from the exported rope " + d.decoder_rope_json +
        " differ from the decoder's own; refusing to write caches with them");
  const int64_t H = d.layout.hidden, hd = d.layout.head_dim;
  d.layers.resize(static_cast<size_t>(d.layout.layers));
  for (int64_t i = 0; i < d.layout.layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".attn.";
    auto& L = d.layers[static_cast<size_t>(i)];
    L.ratio = ratios[static_cast<size_t>(i)];
    if (L.ratio != 0 && L.ratio != 4 && L.ratio != 128)
      return invalid_argument(dir + ": layer " + std::to_string(i) + " has ratio " +
                              std::to_string(L.ratio) + " (want 0, 4 or 128)");
    HETERO_RETURN_IF_ERROR(load_decoder_linear(f.tensors, p + "wkv.", hd, H, &L.wkv));
    HETERO_RETURN_IF_ERROR(take_bf16(f.tensors, p + "kv_norm.weight", {hd}, &L.kv_norm));
    if (L.ratio > 0)
      HETERO_RETURN_IF_ERROR(
          load_compressor(f.tensors, p + "compressor.", L.ratio, hd, H, &L.pool));
    if (L.ratio == 4) {
      L.has_index = true;
      HETERO_RETURN_IF_ERROR(
          load_compressor(f.tensors, p + "indexer.compressor.", 4, d.index_head_dim, H, &L.index));
    }
  }
  if (!f.tensors.empty())
    return invalid_argument(dir + ": unexpected tensor '" + f.tensors.begin()->first + "'");
  return d;
}

// ----------------------------------------------------------------------------- program

Dsv4Schedule dsv4_pending_tail(int64_t start, const std::vector<int64_t>& decoder_calls) {
  Dsv4Schedule s;
  s.tokens = start;
  for (int64_t L : decoder_calls) s.tokens += std::max<int64_t>(L, 0);
  return s;
}

Dsv4CacheProgram::Dsv4CacheProgram(const Dsv4DecoderWeights* weights,
                                   const std::vector<int64_t>& decoder_calls, int64_t start)
    : w_(weights), start_(start) {
  state_.resize(static_cast<size_t>(w_->layout.layers));
  if (start > 0) {  // scheduled by resume()
    tail_calls_ = decoder_calls;
    sched_ = dsv4_pending_tail(start, decoder_calls);
    return;
  }
  sched_ = dsv4_schedule(decoder_calls, w_->window);
  const int64_t hd = w_->layout.head_dim;
  for (auto& s : state_)
    s.window_rows.resize(static_cast<size_t>((sched_.tokens - sched_.window_first) * hd));
}

Result<std::shared_ptr<const Checkpoint>> Dsv4CacheProgram::checkpoint() const {
  if (start_ > 0 && !resumed_) return failed_precondition("the tail program never resumed");
  auto c = std::make_shared<Dsv4ProgramCheckpoint>();
  c->weights = w_;
  c->window = sched_.window;
  c->window_first = sched_.window_first;
  c->n = sched_.tokens;
  for (size_t l = 0; l < state_.size(); ++l) {
    const LayerState& s = state_[l];
    HETERO_RETURN_IF_ERROR(check_dsv4_complete(static_cast<int64_t>(l), s.fed, sched_.tokens));
    Dsv4ProgramCheckpoint::Layer L;
    L.window_rows = s.window_rows;
    L.pool = {s.pool.raw_kv, s.pool.raw_gate, s.pool.raw_base};
    L.index = {s.index.raw_kv, s.index.raw_gate, s.index.raw_base};
    c->count(L);
    c->layers.push_back(std::move(L));
  }
  return std::shared_ptr<const Checkpoint>(std::move(c));
}

Status Dsv4CacheProgram::resume(const Checkpoint& checkpoint) {
  const auto* c = dynamic_cast<const Dsv4ProgramCheckpoint*>(&checkpoint);
  if (!c || c->weights != w_) return invalid_argument("not a checkpoint of this cache program");
  if (start_ == 0 || resumed_) return failed_precondition("only a tail program resumes, once");
  if (c->n != start_)
    return failed_precondition("the checkpoint holds " + std::to_string(c->n) +
                               " tokens; the tail starts at " + std::to_string(start_));
  sched_ = dsv4_schedule(tail_calls_, w_->window, start_, &c->window);
  if (sched_.window_first < c->window_first)
    return failed_precondition("the tail's window reaches position " +
                               std::to_string(sched_.window_first) + ", before the checkpoint's " +
                               std::to_string(c->window_first));
  const int64_t hd = w_->layout.head_dim;
  for (size_t l = 0; l < state_.size(); ++l) {
    LayerState& s = state_[l];
    const Dsv4ProgramCheckpoint::Layer& L = c->layers[l];
    s.fed = start_;
    s.window_rows.assign(static_cast<size_t>((sched_.tokens - sched_.window_first) * hd), 0);
    const int64_t kept = start_ - sched_.window_first;  // rows of the prefix still in a slot
    if (kept > 0)
      std::copy(L.window_rows.end() - kept * hd, L.window_rows.end(), s.window_rows.begin());
    const auto recent = static_cast<std::ptrdiff_t>(
        std::min<size_t>(L.window_rows.size(), static_cast<size_t>(w_->window * hd)));
    s.recent.assign(L.window_rows.end() - recent, L.window_rows.end());
    const Dsv4ProgramLayer& W = w_->layers[l];
    auto take = [&](const Dsv4ProgramCheckpoint::Raw& raw, int64_t ratio, PoolState* p) {
      p->raw_kv = raw.kv;
      p->raw_gate = raw.gate;
      p->raw_base = raw.base;
      p->pooled_rows = ratio > 0 ? start_ / ratio : 0;
    };
    if (W.ratio > 0) take(L.pool, W.ratio, &s.pool);
    if (W.has_index) take(L.index, 4, &s.index);
  }
  resumed_ = true;
  return Status::ok();
}

void Dsv4CacheProgram::feed_pool(const Dsv4ProgramCompressor& c, PoolState& s, int64_t pos0,
                                 int64_t n, const uint16_t* x, std::vector<uint16_t>* new_rows) {
  const int64_t D = c.out_dim, hd = c.head_dim, r = c.ratio;
  const size_t old = s.raw_kv.size();
  s.raw_kv.resize(old + static_cast<size_t>(n * D));
  s.raw_gate.resize(s.raw_kv.size());
  c.wkv.apply(x, n, s.raw_kv.data() + old);
  c.wgate.apply(x, n, s.raw_gate.data() + old);
  const int64_t fed = pos0 + n;
  const int64_t done = fed / r;  // windows complete so far
  const auto& flags = r == 4 ? sched_.flags4 : sched_.flags128;
  std::vector<uint16_t> row(static_cast<size_t>(hd));
  for (int64_t j = s.pooled_rows; j < done; ++j) {
    const uint16_t* kv = s.raw_kv.data() + (j * r - s.raw_base) * D;
    const uint16_t* gate = s.raw_gate.data() + (j * r - s.raw_base) * D;
    if (r == 4) {
      const uint8_t has_prev = flags[static_cast<size_t>(j)];
      HETERO_CHECK(!has_prev || j * r - r >= s.raw_base);
      dsv4_pool_overlap(kv, gate, c.ape.data(), &has_prev, 1, r, hd, row.data());
    } else {
      dsv4_pool_simple(kv, gate, c.ape.data(), 1, r, hd, row.data());
    }
    rms_norm(row.data(), 1, hd, c.norm.data<uint16_t>(), static_cast<float>(w_->rms_norm_eps),
             row.data());
    dsv4_rope(row.data(), 1, 1, hd, j, w_->freqs_compressed, static_cast<int>(r), false);
    s.pooled.insert(s.pooled.end(), row.begin(), row.end());
    if (new_rows) new_rows->insert(new_rows->end(), row.begin(), row.end());
  }
  s.pooled_rows = std::max(s.pooled_rows, done);
  // Keep the last complete window (the next one's overlap lane) and the incomplete one.
  const int64_t keep_from = std::max<int64_t>(s.raw_base, (done - 1) * r);
  if (keep_from > s.raw_base) {
    const auto drop = static_cast<size_t>((keep_from - s.raw_base) * D);
    s.raw_kv.erase(s.raw_kv.begin(), s.raw_kv.begin() + static_cast<std::ptrdiff_t>(drop));
    s.raw_gate.erase(s.raw_gate.begin(), s.raw_gate.begin() + static_cast<std::ptrdiff_t>(drop));
    s.raw_base = keep_from;
  }
}

Status check_dsv4_layer(int64_t layer, int64_t layers) {
  if (layer < 0 || layer >= layers)
    return invalid_argument("layer " + std::to_string(layer) + " out of range");
  return Status::ok();
}

Status check_dsv4_rows(int64_t layer, int64_t fed, int64_t pos0, int64_t n, int64_t tokens) {
  if (pos0 != fed || n <= 0 || pos0 + n > tokens)
    return invalid_argument("layer " + std::to_string(layer) + ": rows [" + std::to_string(pos0) +
                            ", " + std::to_string(pos0 + n) + ") do not follow row " +
                            std::to_string(fed) + " within " + std::to_string(tokens));
  return Status::ok();
}

Status check_dsv4_complete(int64_t layer, int64_t fed, int64_t tokens) {
  if (fed != tokens)
    return failed_precondition("layer " + std::to_string(layer) + " has " + std::to_string(fed) +
                               " of " + std::to_string(tokens) + " rows");
  return Status::ok();
}

Status Dsv4CacheProgram::feed(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x,
                              Dsv4NewRows* out) {
  HETERO_RETURN_IF_ERROR(check_dsv4_layer(layer, w_->layout.layers));
  if (start_ > 0 && !resumed_)
    return failed_precondition("a tail program needs its prefix's checkpoint (resume) first");
  LayerState& s = state_[static_cast<size_t>(layer)];
  HETERO_RETURN_IF_ERROR(check_dsv4_rows(layer, s.fed, pos0, n, sched_.tokens));
  const Dsv4ProgramLayer& L = w_->layers[static_cast<size_t>(layer)];
  const int64_t H = w_->layout.hidden, hd = w_->layout.head_dim;
  // Window rows: only positions that end up in a slot are computed.
  const int64_t from = std::max(pos0, sched_.window_first);
  if (from < pos0 + n) {
    const int64_t m = pos0 + n - from;
    uint16_t* dst = s.window_rows.data() + (from - sched_.window_first) * hd;
    L.wkv.apply(x + (from - pos0) * H, m, dst);
    rms_norm(dst, m, hd, L.kv_norm.data<uint16_t>(), static_cast<float>(w_->rms_norm_eps), dst);
    dsv4_rope(dst, m, 1, hd, from, L.ratio == 0 ? w_->freqs_local : w_->freqs_compressed, 1, false);
  }
  // The last `window` rows of every feed, for a state at its end (boundary_layer).
  const int64_t W = w_->window, recent_from = std::max(pos0, pos0 + n - W);
  if (recent_from < pos0 + n) {
    const int64_t m = pos0 + n - recent_from;
    std::vector<uint16_t> rows(static_cast<size_t>(m * hd));
    L.wkv.apply(x + (recent_from - pos0) * H, m, rows.data());
    rms_norm(rows.data(), m, hd, L.kv_norm.data<uint16_t>(), static_cast<float>(w_->rms_norm_eps),
             rows.data());
    dsv4_rope(rows.data(), m, 1, hd, recent_from,
              L.ratio == 0 ? w_->freqs_local : w_->freqs_compressed, 1, false);
    s.recent.insert(s.recent.end(), rows.begin(), rows.end());
    const auto keep = static_cast<size_t>(W * hd);
    if (s.recent.size() > keep)
      s.recent.erase(s.recent.begin(), s.recent.end() - static_cast<std::ptrdiff_t>(keep));
  }
  Dsv4NewRows rows;
  rows.first = s.pool.pooled_rows;
  if (L.ratio > 0) feed_pool(L.pool, s.pool, pos0, n, x, &rows.pool);
  if (L.has_index) feed_pool(L.index, s.index, pos0, n, x, &rows.index);
  rows.count = s.pool.pooled_rows - rows.first;
  s.fed = pos0 + n;
  if (out) *out = std::move(rows);
  return Status::ok();
}

Dsv4PoolArrays Dsv4CacheProgram::pending_rows(const Dsv4ProgramCompressor& c, const PoolState& s,
                                              int64_t fed) const {
  const int64_t D = c.out_dim, r = c.ratio, rem = fed % r;
  Dsv4PoolArrays a;
  a.buf_kv = Tensor(DType::kBF16, {1, rem, D});
  a.buf_gate = Tensor(DType::kBF16, {1, rem, D});
  const int64_t start = (fed - rem - s.raw_base) * D;
  std::memcpy(a.buf_kv.bytes.data(), s.raw_kv.data() + start, static_cast<size_t>(rem * D * 2));
  std::memcpy(a.buf_gate.bytes.data(), s.raw_gate.data() + start, static_cast<size_t>(rem * D * 2));
  a.pooled = Tensor(DType::kBF16, {1, 0, c.head_dim});
  return a;
}

Result<Dsv4LayerArrays> Dsv4CacheProgram::boundary_layer(int64_t layer) const {
  HETERO_RETURN_IF_ERROR(check_dsv4_layer(layer, w_->layout.layers));
  const LayerState& s = state_[static_cast<size_t>(layer)];
  if (s.fed <= start_ || s.fed >= sched_.tokens)
    return failed_precondition("layer " + std::to_string(layer) + ": no boundary at row " +
                               std::to_string(s.fed));
  const Dsv4ProgramLayer& L = w_->layers[static_cast<size_t>(layer)];
  const int64_t hd = w_->layout.head_dim;
  Dsv4LayerArrays a;
  a.ratio = L.ratio;
  const auto S = static_cast<int64_t>(s.recent.size()) / hd;
  if (S != std::min(s.fed, w_->window))  // a tail's first feed must reach its window
    return failed_precondition("layer " + std::to_string(layer) + " holds " + std::to_string(S) +
                               " window rows at row " + std::to_string(s.fed));
  a.window = Tensor(DType::kBF16, {1, 1, S, hd});
  std::memcpy(a.window.bytes.data(), s.recent.data(), s.recent.size() * 2);
  if (L.ratio > 0) a.pool = pending_rows(L.pool, s.pool, s.fed);
  if (L.has_index) a.index = pending_rows(L.index, s.index, s.fed);
  return a;
}

Dsv4PoolArrays Dsv4CacheProgram::pool_arrays(const Dsv4ProgramCompressor& c,
                                             const PoolState& s) const {
  Dsv4PoolArrays a = pending_rows(c, s, sched_.tokens);
  a.pooled =
      Tensor(DType::kBF16, {1, static_cast<int64_t>(s.pooled.size()) / c.head_dim, c.head_dim});
  std::memcpy(a.pooled.bytes.data(), s.pooled.data(), s.pooled.size() * 2);
  return a;
}

Result<Dsv4LayerArrays> Dsv4CacheProgram::finish_layer(int64_t layer) {
  HETERO_RETURN_IF_ERROR(check_dsv4_layer(layer, w_->layout.layers));
  if (start_ > 0 && !resumed_) return failed_precondition("the tail program never resumed");
  const LayerState& s = state_[static_cast<size_t>(layer)];
  HETERO_RETURN_IF_ERROR(check_dsv4_complete(layer, s.fed, sched_.tokens));
  const Dsv4ProgramLayer& L = w_->layers[static_cast<size_t>(layer)];
  const int64_t hd = w_->layout.head_dim;
  Dsv4LayerArrays a;
  a.ratio = L.ratio;
  const auto S = static_cast<int64_t>(sched_.window.slot_pos.size());
  a.window = Tensor(DType::kBF16, {1, 1, S, hd});
  auto* dst = a.window.data<uint16_t>();
  for (int64_t i = 0; i < S; ++i) {
    const int64_t p = sched_.window.slot_pos[static_cast<size_t>(i)];
    if (p < 0) continue;  // a zero row the decoder grew but never wrote
    std::memcpy(dst + i * hd, s.window_rows.data() + (p - sched_.window_first) * hd,
                static_cast<size_t>(hd * 2));
  }
  if (L.ratio > 0) a.pool = pool_arrays(L.pool, s.pool);
  if (L.has_index) a.index = pool_arrays(L.index, s.index);
  return a;
}

}  // namespace hetero
