// A sequence on the DeepSeek-V4 CUDA engine: its start (reset), admission (reserve: the
// request's pooled rows, staging and chunk scratch, or none of them), the scratch sized for the
// largest chunk, and the chunk loop over the engine's layers (prefill_stage: hyper-connections,
// norms and the tap here; attention and MoE in dsv4_cuda_layers.cc). See dsv4_cuda.h.
#include <algorithm>
#include <vector>

#include "engine/cuda/dsv4_cuda_impl.h"
#include "kernels/cuda/dsv4_fwd_ops.h"

namespace hetero {

using namespace dsv4_cuda;

namespace {

// A ratio-r compressor's rows in a sequence of `tokens` tokens (every complete window).
int64_t pooled_rows_for(int64_t tokens, int64_t ratio) { return ratio > 0 ? tokens / ratio : 0; }

}  // namespace

Status Dsv4CudaEngine::synchronize() {
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(impl_->stream.get()));
  return Status::ok();
}

Status Dsv4CudaEngine::reset() {
  const Dsv4Config& c = config_;
  Impl& m = *impl_;
  n_cached_ = resumed_at_ = 0;
  m.calls.clear();
  // The previous sequence's work (a failed chunk's lanes too) is done before its state is reused.
  for (Impl::Lane& l : m.lanes) HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(l.stream.get()));
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.stream.get()));
  m.state.resize(m.layers.size());
  for (size_t i = static_cast<size_t>(m.first); i < static_cast<size_t>(m.end); ++i) {
    DState& s = m.state[i];
    const DLayer& L = m.layers[i];
    s.tail_rows = 0;
    if (!s.tail)
      HETERO_RETURN_IF_ERROR(m.alloc(
          s.tail, static_cast<size_t>(std::max<int64_t>(1, c.sliding_window) * c.head_dim) * 2,
          "the local window"));
    auto init = [&](DPool& p, const DComp& cm) -> Status {
      p.ratio = cm.ratio, p.width = cm.out_dim, p.head_dim = cm.head_dim;
      p.remainder = 0, p.rows = 0;
      if (p.buf_kv) return Status::ok();
      const size_t bytes = static_cast<size_t>(p.ratio * p.width) * 2;
      HETERO_RETURN_IF_ERROR(m.alloc(p.buf_kv, bytes, "a compressor's pending rows"));
      return m.alloc(p.buf_gate, bytes, "a compressor's pending rows");
    };
    if (L.ratio > 0) HETERO_RETURN_IF_ERROR(init(s.pool, L.comp));
    if (L.ratio == 4) HETERO_RETURN_IF_ERROR(init(s.ipool, L.icomp));
  }
  return Status::ok();
}

void Dsv4CudaEngine::release_sequence_memory() {
  Impl& m = *impl_;
  // After a failed reservation, which began with reset(): no queued work reads these.
  for (cuda::DeviceBuffer* b :
       {&m.ids,      &m.h,      &m.x,        &m.y,        &m.mix,        &m.qr,      &m.q,
        &m.attn,     &m.kv,     &m.mid,      &m.ckv,      &m.cgate,      &m.ikv,     &m.igate,
        &m.iq,       &m.iw,     &m.lk,       &m.stage_kv, &m.stage_gate, &m.topk,    &m.rep,
        &m.has_prev, &m.logits, &m.inds,     &m.weights,  &m.counts,     &m.offsets, &m.perm,
        &m.slot_row, &m.xe,     &m.gu,       &m.act,      &m.ye,         &m.sgu,     &m.sact,
        &m.sh,       &m.act_q,  &m.act_scale})
    b->reset();
  for (Impl::Lane& l : m.lanes) l.spill.reset();
  for (DState& s : m.state) s.pool.pooled.reset(), s.ipool.pooled.reset();
  m.cap = 0;
}

Status Dsv4CudaEngine::reserve(int64_t tokens, int64_t max_chunk_tokens) {
  const Dsv4Config& c = config_;
  Impl& m = *impl_;
  HETERO_RETURN_IF_ERROR(reset());
  if (tokens <= 0) return Status::ok();
  const int64_t chunk = std::clamp<int64_t>(max_chunk_tokens, 1, tokens);
  // The indexer's selection over the longest prompt's compressed rows (the last call's).
  const int64_t Np = pooled_rows_for(tokens, 4);
  if (c.index_topk > 0 && Np > c.index_topk &&
      std::find(c.compress_ratios.begin(), c.compress_ratios.end(), 4) != c.compress_ratios.end()) {
    const bool hisa = c.index_block > 0 && Np >= c.index_block * c.index_keep &&
                      c.index_keep * c.index_block >= c.index_topk;
    HETERO_RETURN_IF_ERROR(
        cuda::check_index_select(Np, hisa ? c.index_block : 0, hisa ? c.index_keep : 0));
  }
  auto take = [&]() -> Status {
    HETERO_RETURN_IF_ERROR(size_scratch(chunk));
    int64_t stage = 0;  // a compressor's staged rows: the chunk plus a window's pending rows
    for (size_t i = static_cast<size_t>(m.first); i < static_cast<size_t>(m.end); ++i) {
      DState& s = m.state[i];
      for (DPool* p : {&s.pool, &s.ipool}) {
        if (p->ratio == 0) continue;
        HETERO_RETURN_IF_ERROR(
            reserve_rows(m, *p, pooled_rows_for(tokens, p->ratio), m.stream.get()));
        stage = std::max(stage, (chunk + p->ratio) * p->width * 2);
      }
    }
    HETERO_RETURN_IF_ERROR(m.ensure(m.stage_kv, static_cast<size_t>(stage), "compressor staging"));
    HETERO_RETURN_IF_ERROR(
        m.ensure(m.stage_gate, static_cast<size_t>(stage), "compressor staging"));
    if (c.index_block > 0)
      HETERO_RETURN_IF_ERROR(
          m.ensure(m.rep, static_cast<size_t>(Np / c.index_block * c.index_head_dim) * 4,
                   "HISA block means"));
    return Status::ok();
  };
  const Status st = take();
  // Refused: hold no more than after reset(), so the refusal leaves the next request its room.
  if (!st.is_ok()) release_sequence_memory();
  return st;
}

Status Dsv4CudaEngine::set_full_forward(bool on) {
  if (n_cached_ != 0) return failed_precondition("full_forward changes only between sequences");
  full_forward_ = on;
  return Status::ok();
}

Status Dsv4CudaEngine::set_decoder_calls(const std::vector<int64_t>& calls) {
  if (n_cached_ != resumed_at_)
    return failed_precondition("decoder calls change only between sequences");
  impl_->calls.set(calls, n_cached_);
  return Status::ok();
}

// Scratch for chunks of up to n tokens.
Status Dsv4CudaEngine::size_scratch(int64_t n) {
  const Dsv4Config& c = config_;
  Impl& m = *impl_;
  if (n <= m.cap) return Status::ok();
  const size_t N = static_cast<size_t>(n);
  const int64_t H = c.hidden, hd = c.head_dim, K = c.experts_per_tok, I = c.moe_inter;
  const int64_t S = c.moe_inter * c.n_shared_experts, E = c.n_routed_experts;
  const int64_t ih = c.index_n_heads, ihd = c.index_head_dim;
  // FP8 GEMM outputs run up to 15 rows past their inputs (fp8_linear): slack for them (under
  // kCheckpoint the attention's projections' outputs too).
  const size_t P = m.fp8 ? 16 : 0, PA = m.ckpt ? 16 : 0;
  const size_t window = static_cast<size_t>(c.sliding_window);
  std::vector<uint8_t> hp(N / 4 + 2, 1);
  hp[0] = 0;
  const struct {
    cuda::DeviceBuffer* b;
    size_t bytes;
  } want[] = {{&m.ids, N * 4},
              {&m.h, N * c.hc_mult * H * 2},
              {&m.x, N * H * 2},
              {&m.y, (N + PA) * H * 2},
              {&m.mix, N * cuda::hc_mix_floats(c.hc_mult) * 4},
              {&m.qr, (N + PA) * c.q_lora_rank * 2},
              {&m.q, (N + PA) * c.heads * hd * 2},
              {&m.attn, N * c.heads * hd * 2},
              {&m.kv, (N + PA) * hd * 2},
              {&m.mid, N * c.o_groups * c.o_lora_rank * 2},
              {&m.ckv, N * 2 * hd * 2},
              {&m.cgate, N * 2 * hd * 2},
              {&m.ikv, N * 2 * ihd * 2},
              {&m.igate, N * 2 * ihd * 2},
              {&m.iq, (N + PA) * ih * ihd * 2},
              {&m.iw, N * ih * 2},
              {&m.lk, (N + window) * hd * 2},
              {&m.topk, N * std::max<int64_t>(1, c.index_topk) * 4},
              {&m.has_prev, hp.size()},
              {&m.logits, N * E * 2},
              {&m.inds, N * K * 4},
              {&m.weights, N * K * 4},
              {&m.counts, static_cast<size_t>(E) * 4},
              {&m.offsets, static_cast<size_t>(E + 1) * 4},
              {&m.perm, N * K * 4},
              {&m.slot_row, N * K * 4},
              {&m.xe, m.fp8 ? 0 : N * K * H * 2},  // FP8 experts read x's rows in place
              {&m.ye, (N * K + P) * H * 2},
              {&m.gu, (N * K + P) * 2 * I * 2},
              {&m.act, m.fp8 ? 0 : N * K * I * 2},  // FP8 experts make w2's input quantized
              {&m.sgu, S > 0 ? (N + P) * 2 * S * 2 : 0},
              {&m.sact, S > 0 ? N * S * 2 : 0},
              {&m.sh, S > 0 ? (N + P) * H * 2 : 0}};
  m.cap = 0;  // until every buffer below holds n rows
  for (const auto& w : want) HETERO_RETURN_IF_ERROR(m.alloc(*w.b, w.bytes, "chunk scratch"));
  HETERO_RETURN_IF_ERROR(put(m.has_prev, hp.data(), hp.size()));
  if (m.fp8) {  // every expert's rows, each padded to 16 (or the shared expert's n rows)
    const int64_t widest = m.ckpt ? std::max({H, I, S, c.q_lora_rank, c.o_groups * c.o_lora_rank})
                                  : std::max({H, I, S});
    const size_t R = static_cast<size_t>(cuda::fp8_act_rows(n * K) + 16 * E);
    HETERO_RETURN_IF_ERROR(m.alloc(m.act_q, R * static_cast<size_t>(widest), "FP8 expert inputs"));
    HETERO_RETURN_IF_ERROR(m.alloc(
        m.act_scale, R * static_cast<size_t>(cuda::fp8_blocks(widest)) * 4, "FP8 expert inputs"));
    for (auto& lane : m.lanes)
      HETERO_RETURN_IF_ERROR(
          m.alloc(lane.spill, static_cast<size_t>(cuda::fp8_act_rows(n) * std::max(2 * I, H)) * 2,
                  "expert stream output"));
  }
  m.cap = n;
  return Status::ok();
}

Status Dsv4CudaEngine::prefill_chunk(const std::vector<int32_t>& ids,
                                     const AttentionInputTap& tap) {
  if (impl_->first != 0)
    return failed_precondition(
        "a stage that does not hold layer 0 starts from a residual "
        "(prefill_stage)");
  return prefill_stage(ids, nullptr, tap);
}

const uint16_t* Dsv4CudaEngine::residual() const { return bf(impl_->h); }

Status Dsv4CudaEngine::prefill_stage(const std::vector<int32_t>& ids, const uint16_t* h_in,
                                     const AttentionInputTap& tap) {
  const Dsv4Config& c = config_;
  HETERO_RETURN_IF_ERROR(check_token_ids(ids, c.vocab));
  Impl& m = *impl_;
  if (ids.empty()) return Status::ok();
  if ((m.first == 0) != (h_in == nullptr))
    return invalid_argument(m.first == 0 ? "the first stage embeds its ids: no residual in"
                                         : "a later stage needs the previous stage's residual");
  cudaStream_t st = m.stream.get();
  const int64_t n = static_cast<int64_t>(ids.size()), pos0 = n_cached_, H = c.hidden;
  const float eps = static_cast<float>(c.rms_norm_eps);
  HETERO_RETURN_IF_ERROR(size_scratch(n));
  HETERO_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(m.ids.get(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice, st));
  if (h_in)
    HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        m.h.get(), h_in, static_cast<size_t>(n * c.hc_mult * H) * 2, cudaMemcpyDeviceToDevice, st));
  else
    cuda::embed_rows(bf(m.embed), m.ids.get<int32_t>(), n, c.hc_mult, H, bf(m.h), st);

  for (int64_t l = m.first; l < m.end; ++l) {
    const DLayer& L = m.layers[static_cast<size_t>(l)];
    auto hc = [&](const DHc& d) {
      return cuda::HcParams{f32(d.fn),
                            f32(d.base),
                            f32(d.scale),
                            c.hc_mult,
                            H,
                            c.hc_sinkhorn_iters,
                            static_cast<float>(c.hc_eps),
                            eps};
    };
    const cuda::HcParams ha = hc(L.hc_attn), hf = hc(L.hc_ffn);
    HETERO_RETURN_IF_ERROR(m.timer.mark(st, "hyper-connections + norms"));
    HETERO_RETURN_IF_ERROR(m.x_readers.before_write(st));  // none, unless a call failed midway
    cuda::hc_collapse(ha, bf(m.h), n, f32(m.mix), bf(m.x), st);
    cuda::fast_rms_norm(bf(m.x), n, H, bf(L.attn_norm), eps, bf(m.x), st);
    if (tap) {
      TapEvent ev{static_cast<int32_t>(l), pos0, n, H, nullptr, bf(m.x), st};
      ev.x_read = m.x_readers.slot();  // the layer's next write of x waits for them
      if (options_.host_tap) {
        m.host_x.resize(static_cast<size_t>(n * H));
        HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(m.host_x.data(), m.x.get(), m.host_x.size() * 2,
                                                    cudaMemcpyDeviceToHost, st));
        HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
        ev.x_bf16 = m.host_x.data();
      }
      tap(ev);
    }
    if (l == c.layers - 1 && !full_forward_) break;
    HETERO_RETURN_IF_ERROR(attention(m, c, l, n, pos0));
    HETERO_RETURN_IF_ERROR(m.timer.mark(st, "hyper-connections + norms"));
    cuda::hc_expand(ha, f32(m.mix), bf(m.y), n, bf(m.h), st);
    HETERO_RETURN_IF_ERROR(m.x_readers.before_write(st));  // x, read by the tap's copies
    cuda::hc_collapse(hf, bf(m.h), n, f32(m.mix), bf(m.x), st);
    cuda::fast_rms_norm(bf(m.x), n, H, bf(L.ffn_norm), eps, bf(m.x), st);
    HETERO_RETURN_IF_ERROR(moe(m, c, l, n));
    HETERO_RETURN_IF_ERROR(m.timer.mark(st, "hyper-connections + norms"));
    cuda::hc_expand(hf, f32(m.mix), bf(m.y), n, bf(m.h), st);
  }
  // A stage that ends at the model's last layer taps it and stops before its attention.
  HETERO_RETURN_IF_ERROR(m.x_readers.before_write(st));
  HETERO_RETURN_IF_ERROR(m.timer.mark(st, "end"));
  HETERO_RETURN_IF_ERROR(m.timer.collect(st));
  // The kernels' launches report here (a launch error, or an earlier fault that stuck).
  HETERO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  n_cached_ += n;
  return Status::ok();
}

}  // namespace hetero
