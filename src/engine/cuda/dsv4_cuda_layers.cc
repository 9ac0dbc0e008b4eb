// One DeepSeek-V4 layer on CUDA: the attention (projections, the local window, the compressors and
// the indexer, the sparse attention kernel, the grouped output projection) and the MoE (router,
// grouping, the experts' GEMMs in bf16 or FP8, over side streams). The CPU engine
// (engine/dsv4_cpu.cc) is the reference for every step; comments say where this one computes the
// same thing differently. Every function enqueues on the engine's streams and returns the Status
// of the calls it made.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/bf16.h"
#include "engine/cuda/dsv4_cuda_impl.h"
#include "kernels/cuda/dsv4_fwd_ops.h"
#include "kernels/cuda/dsv4_ops.h"

namespace hetero::dsv4_cuda {
namespace {

Status copy_d2d(void* dst, const void* src, size_t bytes, cudaStream_t st) {
  if (bytes)
    HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, st));
  return Status::ok();
}

struct CompressScratch {
  cuda::DeviceBuffer* stage_kv;
  cuda::DeviceBuffer* stage_gate;
  const uint8_t* has_prev;  // [0, 1, 1, ...]
  const float* freqs;
  int64_t rope_pairs;
  float eps;
};

// The CPU engine's Pool::accumulate + compress on the device: m rows of kv and gate at `offset`.
Status compress(Impl& mi, DPool& pool, const DComp& cm, const CompressScratch& s,
                const uint16_t* kv, const uint16_t* gate, int64_t m, int64_t offset,
                cudaStream_t st) {
  const int64_t w = pool.width, r = pool.ratio;
  const size_t row = static_cast<size_t>(w) * 2;
  const uint16_t *rkv = nullptr, *rgate = nullptr;
  int64_t ready = 0, base = 0;
  uint8_t* pkv = pool.buf_kv.get<uint8_t>();
  uint8_t* pgate = pool.buf_gate.get<uint8_t>();
  if (m > 1) {
    const int64_t total = m + pool.remainder, usable = total / r * r, new_rem = total % r;
    if (usable > 0) {
      if (pool.remainder > 0) {
        HETERO_RETURN_IF_ERROR(
            mi.ensure(*s.stage_kv, static_cast<size_t>(usable) * row, "compressor staging"));
        HETERO_RETURN_IF_ERROR(
            mi.ensure(*s.stage_gate, static_cast<size_t>(usable) * row, "compressor staging"));
        const size_t kept = static_cast<size_t>(pool.remainder) * row;
        const size_t fresh = static_cast<size_t>(usable - pool.remainder) * row;
        uint8_t* skv = s.stage_kv->get<uint8_t>();
        uint8_t* sgate = s.stage_gate->get<uint8_t>();
        HETERO_RETURN_IF_ERROR(copy_d2d(skv, pkv, kept, st));
        HETERO_RETURN_IF_ERROR(copy_d2d(sgate, pgate, kept, st));
        HETERO_RETURN_IF_ERROR(copy_d2d(skv + kept, kv, fresh, st));
        HETERO_RETURN_IF_ERROR(copy_d2d(sgate + kept, gate, fresh, st));
        rkv = bf(*s.stage_kv), rgate = bf(*s.stage_gate);
      } else {
        rkv = kv, rgate = gate;
      }
      ready = usable, base = offset - pool.remainder;
      pool.remainder = 0;
    }
    if (new_rem > 0) {
      const int64_t n_new = new_rem - pool.remainder;
      HETERO_RETURN_IF_ERROR(copy_d2d(pkv + pool.remainder * row, kv + (m - n_new) * w,
                                      static_cast<size_t>(n_new) * row, st));
      HETERO_RETURN_IF_ERROR(copy_d2d(pgate + pool.remainder * row, gate + (m - n_new) * w,
                                      static_cast<size_t>(n_new) * row, st));
    }
    pool.remainder = new_rem;
  } else {
    HETERO_RETURN_IF_ERROR(copy_d2d(pkv + pool.remainder * row, kv, row, st));
    HETERO_RETURN_IF_ERROR(copy_d2d(pgate + pool.remainder * row, gate, row, st));
    pool.remainder = (pool.remainder + 1) % r;
    if (pool.remainder == 0)
      rkv = bf(pool.buf_kv), rgate = bf(pool.buf_gate), ready = r, base = offset - r + 1;
  }
  const int64_t windows = ready / r;
  if (windows == 0) return Status::ok();
  HETERO_RETURN_IF_ERROR(reserve_rows(mi, pool, pool.rows + windows, st));
  uint16_t* out = bf(pool.pooled) + pool.rows * pool.head_dim;
  if (r == 4)  // only windows completed within one call see their predecessor (the overlap lane)
    cuda::dsv4_pool_overlap(rkv, rgate, f32(cm.ape), s.has_prev, windows, r, pool.head_dim, out,
                            st);
  else
    cuda::dsv4_pool_simple(rkv, rgate, f32(cm.ape), windows, r, pool.head_dim, out, st);
  cuda::fast_rms_norm_rope(out, windows, 1, pool.head_dim, bf(cm.norm), s.eps, out, base / r,
                           s.freqs, s.rope_pairs, static_cast<int>(r), st);
  pool.rows += windows;
  return Status::ok();
}

// The experts [0, E) cut into `lanes` runs of consecutive experts with about equal rows:
// run i is [cut[i], cut[i + 1]).
std::vector<int64_t> split_by_rows(const int32_t* off, int64_t E, size_t lanes) {
  std::vector<int64_t> cut = {0};
  const double total = off[E];
  for (int64_t e = 0; e < E && cut.size() < lanes; ++e)
    if (off[e + 1] >= total * static_cast<double>(cut.size()) / static_cast<double>(lanes))
      cut.push_back(e + 1);
  while (cut.size() <= lanes) cut.push_back(E);
  return cut;
}

// run(lane, e) for every expert with rows: on the compute stream in expert order (lane -1), or
// over the lanes, each taking a run of consecutive experts in order (lane i), forked from the
// compute stream's work so far and joined back into it.
template <class F>
Status over_lanes(Impl& m, int64_t E, const int32_t* off, F&& run) {
  if (m.lanes.empty()) {
    for (int64_t e = 0; e < E; ++e)
      if (off[e + 1] > off[e]) HETERO_RETURN_IF_ERROR(run(-1, e));
    return Status::ok();
  }
  HETERO_CUDA_RETURN_IF_ERROR(cudaEventRecord(m.fork.get(), m.stream.get()));
  const std::vector<int64_t> cut = split_by_rows(off, E, m.lanes.size());
  for (size_t i = 0; i < m.lanes.size(); ++i) {
    Impl::Lane& lane = m.lanes[i];
    HETERO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(lane.stream.get(), m.fork.get()));
    for (int64_t e = cut[i]; e < cut[i + 1]; ++e)
      if (off[e + 1] > off[e]) HETERO_RETURN_IF_ERROR(run(static_cast<int>(i), e));
    HETERO_CUDA_RETURN_IF_ERROR(cudaEventRecord(lane.done.get(), lane.stream.get()));
    HETERO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(m.stream.get(), lane.done.get()));
  }
  return Status::ok();
}

// Per expert e with rows: y[off[e]..] = x[off[e]..] @ w_e^T, w_e [n, k] at w + e * n * k. One
// grouped cuBLAS call (pointer arrays through pinned memory), or a GEMM per expert (over the
// lanes, if any).
Status expert_gemms(Impl& m, int64_t E, const int32_t* off, const uint16_t* x, int64_t k,
                    const uint16_t* w, int64_t n, uint16_t* y) {
  if (!m.grouped) {
    return over_lanes(m, E, off, [&](int lane, int64_t e) {
      const int64_t rows = off[e + 1] - off[e];
      return gemm(lane < 0 ? m.blas.get() : m.lanes[static_cast<size_t>(lane)].blas.get(),
                  x + off[e] * k, rows, k, w + e * n * k, n, y + off[e] * n);
    });
  }
  std::vector<int> ms, ns, ks, ldas, ldbs, ldcs, sizes;
  std::vector<cublasOperation_t> ta, tb;
  std::vector<float> alpha, beta;
  int g = 0;
  const int slot = m.grouped_slot;  // alternate halves: the previous call may still read its half
  m.grouped_slot ^= 1;
  const void** ptrs = m.host_ptrs.get<const void*>() + slot * 3 * E;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = off[e + 1] - off[e];
    if (rows == 0) continue;
    ptrs[g] = w + e * n * k;
    ptrs[E + g] = x + off[e] * k;
    ptrs[2 * E + g] = y + off[e] * n;
    ms.push_back(static_cast<int>(n)), ns.push_back(static_cast<int>(rows));
    ks.push_back(static_cast<int>(k)), ldas.push_back(static_cast<int>(k));
    ldbs.push_back(static_cast<int>(k)), ldcs.push_back(static_cast<int>(n));
    ta.push_back(CUBLAS_OP_T), tb.push_back(CUBLAS_OP_N), alpha.push_back(1.0f);
    beta.push_back(0.0f), sizes.push_back(1);
    ++g;
  }
  if (g == 0) return Status::ok();
  void** dev = m.dev_ptrs.get<void*>() + slot * 3 * E;
  HETERO_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dev, ptrs, sizeof(void*) * 3 * E, cudaMemcpyHostToDevice, m.stream.get()));
  HETERO_CUDA_RETURN_IF_ERROR(cublasGemmGroupedBatchedEx(
      m.blas.get(), ta.data(), tb.data(), ms.data(), ns.data(), ks.data(), alpha.data(), dev,
      CUDA_R_16BF, ldas.data(), dev + E, CUDA_R_16BF, ldbs.data(), beta.data(), dev + 2 * E,
      CUDA_R_16BF, ldcs.data(), g, sizes.data(), CUBLAS_COMPUTE_32F));
  return Status::ok();
}

// y [fp8_act_rows(rows), w.n] = x [rows, w.k] @ dequant(w)^T on the FP8 tensor cores: the rows
// quantized per token and 128 columns, then one cuBLASLt call. y's rows past `rows` get zeros
// (the GEMM's padding): its buffer must hold them, and a later write may reuse them.
Status fp8_linear(Impl& m, const uint16_t* x, int64_t rows, const cuda::Fp8BlockWeight& w,
                  uint16_t* y) {
  if (rows == 0) return Status::ok();
  cuda::quantize_act_fp8_group(x, rows, w.k, m.act_q.get<uint8_t>(), f32(m.act_scale),
                               m.stream.get());
  return m.fp8_gemm->run(m.act_q.get<uint8_t>(), f32(m.act_scale), rows, w, y, m.stream.get());
}

// An FP8 expert GEMM's input rows, before quantization: x's rows (with rows_from, row j is x's
// row rows_from[j] / per: the rows gathered from the tokens as they are quantized), or SwiGLU of
// gu's rows (swiglu_gu: the w2 input, made and quantized in one pass, never written as bf16).
struct ExpertRows {
  const uint16_t* x = nullptr;
  const int32_t* rows_from = nullptr;
  int64_t per = 1;
  const uint16_t* swiglu_gu = nullptr;
  float swiglu_limit = 0;
};

// Every expert's rows of `in` quantized in one pass into m.act_q / m.act_scale, segment e at its
// padded offset m.pad[e] (quantize_act_fp8_segments).
void quantize_expert_rows(Impl& m, const ExpertRows& in, int64_t E, const int32_t* dev_off,
                          int64_t total_rows, int64_t k, bool tight_scales) {
  if (in.swiglu_gu)
    cuda::swiglu_quantize_fp8_segments(in.swiglu_gu, k, in.swiglu_limit, dev_off,
                                       m.pad.get<int32_t>(), E, total_rows, m.act_q.get<uint8_t>(),
                                       f32(m.act_scale), m.stream.get(), tight_scales);
  else
    cuda::quantize_act_fp8_segments(in.x, dev_off, m.pad.get<int32_t>(), E, total_rows, k,
                                    m.act_q.get<uint8_t>(), f32(m.act_scale), m.stream.get(),
                                    in.rows_from, in.per, tight_scales);
}

// expert_gemms with FP8 weights: every expert's rows quantized in one pass (each expert's rows
// padded to 16, m.host_pad / m.pad, set by the caller), then one GEMM per expert with rows, in
// expert order on its stream, so each expert's padding rows are overwritten by the next expert's
// output (the last expert's land in the buffer's slack; a lane's last expert writes into the
// lane's own buffer, and its real rows are copied into place); or every active expert in one
// launch of the grouped FP8 kernel; or, for FP4 experts under ExpertGemm::kW4a8, of the W4A8
// kernel, which widens them itself. off: host and device copies of the row offsets.
Status expert_gemms_fp8(Impl& m, int64_t E, const int32_t* off, const int32_t* dev_off,
                        const ExpertRows& in, const DFp8& w8, const DFp4& w4, uint16_t* y) {
  const bool widen = w4.mats > 0;  // FP4 experts widened here (else FP8, resident)
  const int64_t wn = widen ? w4.n : w8.n, wk = widen ? w4.k : w8.k;
  const int64_t groups = cuda::fp8_blocks(wk);
  const int32_t* host_pad = m.host_pad.get<int32_t>();
  int64_t active = 0;
  for (int64_t e = 0; e < E; ++e) active += off[e + 1] > off[e];
  // The mean rows per active expert, rounded up, against the W4A8 and grouped kernels' limits.
  const int64_t mean_rows = active > 0 ? (off[E] + active - 1) / active : 0;
  if (widen && m.w4a8 && mean_rows <= m.w4a8_max_rows) {
    // FP4 experts widened inside the GEMM: no widened copy, no scale transpose.
    ++m.w4a8_launches;
    quantize_expert_rows(m, in, E, dev_off, host_pad[E], wk, /*tight_scales=*/false);
    m.w4a8_groups.clear();
    for (int64_t e = 0; e < E; ++e) {
      const int64_t rows = off[e + 1] - off[e], p = host_pad[e];
      if (rows == 0) continue;
      m.w4a8_groups.push_back({m.act_q.get<uint8_t>() + p * wk, f32(m.act_scale) + p * groups, rows,
                               e, y + off[e] * wn});
    }
    return m.w4a8->run(m.w4a8_groups.data(), static_cast<int64_t>(m.w4a8_groups.size()),
                       w4.experts(), m.lossy.get<unsigned long long>(), m.stream.get());
  }
  const bool grouped = m.grouped_fp8 && active > 0 && mean_rows <= m.grouped_max_rows;
  if (grouped) ++m.grouped_launches;
  quantize_expert_rows(m, in, E, dev_off, host_pad[E], wk, /*tight_scales=*/grouped);
  if (widen)  // every active expert's FP4 weight widened at once, ahead of the GEMMs
    cuda::widen_fp4_experts_to_fp8(w4.at(0), m.active.get<int32_t>(), m.active_count,
                                   m.wide_q.get<uint8_t>(), f32(m.wide_scale),
                                   m.lossy.get<unsigned long long>(), m.stream.get());
  const uint8_t* wq = widen ? m.wide_q.get<uint8_t>() : w8.q.get<uint8_t>();
  if (grouped) {  // one launch: every expert with rows against its own weight
    cuda::transpose_fp8_weight_scales(widen ? f32(m.wide_scale) : f32(w8.scale), E, wn, wk,
                                      f32(m.scale_t), m.stream.get());
    const int64_t per_scale = cuda::fp8_blocks(wn) * groups;
    m.fp8_groups.clear();
    for (int64_t e = 0; e < E; ++e) {
      const int64_t rows = off[e + 1] - off[e], p = host_pad[e];
      if (rows == 0) continue;
      m.fp8_groups.push_back({m.act_q.get<uint8_t>() + p * wk, f32(m.act_scale) + p * groups, rows,
                              wq + e * wn * wk, f32(m.scale_t) + e * per_scale, y + off[e] * wn});
    }
    return m.grouped_fp8->run(m.fp8_groups.data(), static_cast<int64_t>(m.fp8_groups.size()), wn,
                              wk, m.stream.get());
  }
  // A GEMM writes its rows rounded up to 16: an expert whose rounded rows reach past its lane's
  // last row would write into the next lane's first rows while that lane may already have
  // written them, so it writes into its lane's own buffer and copies its real rows out. Not
  // only a lane's last expert: one of 5 rows followed by one of 3 reaches 8 rows past the lane.
  std::vector<int64_t> lane_end(m.lanes.size(), -1);  // -1: the last lane, whose rows may run on
  if (!m.lanes.empty()) {
    const std::vector<int64_t> cut = split_by_rows(off, E, m.lanes.size());
    for (size_t i = 0; i + 1 < m.lanes.size(); ++i) lane_end[i] = off[cut[i + 1]];
  }
  return over_lanes(m, E, off, [&](int lane, int64_t e) {
    const int64_t rows = off[e + 1] - off[e], p = host_pad[e];
    cuda::Fp8Gemm& g = lane < 0 ? *m.fp8_gemm : *m.lanes[static_cast<size_t>(lane)].fp8;
    cudaStream_t st = lane < 0 ? m.stream.get() : m.lanes[static_cast<size_t>(lane)].stream.get();
    const int64_t end = lane < 0 ? -1 : lane_end[static_cast<size_t>(lane)];
    const bool spills = end >= 0 && off[e] + cuda::fp8_act_rows(rows) > end;
    uint16_t* out = spills ? bf(m.lanes[static_cast<size_t>(lane)].spill) : y + off[e] * wn;
    const cuda::Fp8BlockWeight w =
        widen ? cuda::Fp8BlockWeight{wq + e * wn * wk,
                                     f32(m.wide_scale) +
                                         e * cuda::fp8_blocks(wn) * cuda::fp8_weight_scale_ld(wk),
                                     wn, wk}
              : w8.at(e);
    HETERO_RETURN_IF_ERROR(
        g.run(m.act_q.get<uint8_t>() + p * wk, f32(m.act_scale) + p * groups, rows, w, out, st));
    if (spills)
      HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
          y + off[e] * wn, out, static_cast<size_t>(rows * wn) * 2, cudaMemcpyDeviceToDevice, st));
    return Status::ok();
  });
}

}  // namespace

Status gemm(cublasHandle_t h, const uint16_t* x, int64_t m, int64_t k, const uint16_t* w, int64_t n,
            uint16_t* y, int64_t ldx, int64_t ldo, float beta) {
  if (m == 0 || n == 0) return Status::ok();
  const float alpha = 1.0f;
  HETERO_CUDA_RETURN_IF_ERROR(
      cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                   static_cast<int>(k), &alpha, w, CUDA_R_16BF, static_cast<int>(k), x, CUDA_R_16BF,
                   static_cast<int>(ldx < 0 ? k : ldx), &beta, y, CUDA_R_16BF,
                   static_cast<int>(ldo < 0 ? n : ldo), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return Status::ok();
}

Status proj(Impl& m, const uint16_t* x, int64_t rows, int64_t k, const cuda::DeviceBuffer& w,
            const DFp8& w8, int64_t n, uint16_t* y) {
  if (w8.mats > 0) return fp8_linear(m, x, rows, w8.at(0), y);
  return gemm(m.blas.get(), x, rows, k, bf(w), n, y);
}

Status reserve_rows(Impl& m, DPool& p, int64_t rows, cudaStream_t st) {
  const size_t need = static_cast<size_t>(rows * p.head_dim) * 2;
  if (need <= p.pooled.bytes()) return Status::ok();
  cuda::DeviceBuffer grown;
  // Doubling where the budget allows (fewer copies as a prompt grows), else exactly what is asked.
  Status st_alloc =
      grown.allocate(std::max(need, p.pooled.bytes() * 2), "compressed rows", &m.budget);
  if (st_alloc.code() == Code::kResourceExhausted)
    st_alloc = grown.allocate(need, "compressed rows", &m.budget);
  HETERO_RETURN_IF_ERROR(st_alloc);
  HETERO_RETURN_IF_ERROR(
      copy_d2d(grown.get(), p.pooled.get(), static_cast<size_t>(p.rows * p.head_dim) * 2, st));
  HETERO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
  p.pooled = std::move(grown);
  return Status::ok();
}

Status attention(Impl& m, const Dsv4Config& c, int64_t l, int64_t n, int64_t pos0) {
  const DLayer& L = m.layers[static_cast<size_t>(l)];
  DState& S = m.state[static_cast<size_t>(l)];
  cudaStream_t st = m.stream.get();
  cublasHandle_t b = m.blas.get();
  const int64_t H = c.hidden, Hh = c.heads, hd = c.head_dim, win = c.sliding_window;
  const int64_t ih = c.index_n_heads, ihd = c.index_head_dim, QL = c.q_lora_rank;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float* freqs = L.ratio == 0 ? f32(m.local_freqs) : f32(m.compress_freqs);
  const uint16_t* x = bf(m.x);

  HETERO_RETURN_IF_ERROR(m.timer.mark(st, "attn projections"));
  HETERO_RETURN_IF_ERROR(proj(m, x, n, H, L.wq_a, L.wq_a_8, QL, bf(m.qr)));
  cuda::fast_rms_norm(bf(m.qr), n, QL, bf(L.q_norm), eps, bf(m.qr), st);
  HETERO_RETURN_IF_ERROR(proj(m, bf(m.qr), n, QL, L.wq_b, L.wq_b_8, Hh * hd, bf(m.q)));
  cuda::fast_rms_norm_rope(bf(m.q), n, Hh, hd, nullptr, eps, bf(m.q), pos0, freqs, m.rope_pairs, 1,
                           st);
  HETERO_RETURN_IF_ERROR(proj(m, x, n, H, L.wkv, L.wkv_8, hd, bf(m.kv)));
  cuda::fast_rms_norm_rope(bf(m.kv), n, 1, hd, bf(L.kv_norm), eps, bf(m.kv), pos0, freqs,
                           m.rope_pairs, 1, st);
  if (L.ratio > 0) {
    HETERO_RETURN_IF_ERROR(gemm(b, x, n, H, bf(L.comp.wkv), L.comp.out_dim, bf(m.ckv)));
    HETERO_RETURN_IF_ERROR(gemm(b, x, n, H, bf(L.comp.wgate), L.comp.out_dim, bf(m.cgate)));
  }
  if (L.ratio == 4) {
    HETERO_RETURN_IF_ERROR(gemm(b, x, n, H, bf(L.icomp.wkv), L.icomp.out_dim, bf(m.ikv)));
    HETERO_RETURN_IF_ERROR(gemm(b, x, n, H, bf(L.icomp.wgate), L.icomp.out_dim, bf(m.igate)));
    HETERO_RETURN_IF_ERROR(proj(m, bf(m.qr), n, QL, L.idx_wq_b, L.idx_wq_b_8, ih * ihd, bf(m.iq)));
    cuda::rope_pairs_only(bf(m.iq), n, ih, ihd, pos0, freqs, m.rope_pairs, 1, false, st);
    HETERO_RETURN_IF_ERROR(gemm(b, x, n, H, bf(L.idx_wproj), ih, bf(m.iw)));
  }
  const CompressScratch cs{&m.stage_kv,           &m.stage_gate, m.has_prev.get<uint8_t>(),
                           f32(m.compress_freqs), m.rope_pairs,  eps};
  const size_t kv_row = static_cast<size_t>(hd) * 2;
  const float scale_b = round_bf16(1.0f / std::sqrt(static_cast<float>(hd)));
  uint8_t* lk = m.lk.get<uint8_t>();

  // The decoder's calls inside this chunk (model/dsv4_calls.h).
  for (const auto& [s0, cm] : m.calls.within(pos0, n)) {
    const int64_t off = pos0 + s0;
    // Local keys: the kept tail, then this call's rows.
    HETERO_RETURN_IF_ERROR(m.timer.mark(st, "window + compressors"));
    HETERO_RETURN_IF_ERROR(
        copy_d2d(lk, S.tail.get(), static_cast<size_t>(S.tail_rows) * kv_row, st));
    HETERO_RETURN_IF_ERROR(copy_d2d(lk + S.tail_rows * kv_row, bf(m.kv) + s0 * hd,
                                    static_cast<size_t>(cm) * kv_row, st));
    const int64_t lk_pos0 = off - S.tail_rows, lk_rows = S.tail_rows + cm;
    const int64_t keep = std::min(win - 1, lk_rows);
    HETERO_RETURN_IF_ERROR(copy_d2d(S.tail.get(), lk + (lk_rows - keep) * kv_row,
                                    static_cast<size_t>(keep) * kv_row, st));
    S.tail_rows = keep;

    int64_t Pn = 0;
    if (L.ratio > 0) {
      const int64_t w = L.comp.out_dim;
      HETERO_RETURN_IF_ERROR(
          compress(m, S.pool, L.comp, cs, bf(m.ckv) + s0 * w, bf(m.cgate) + s0 * w, cm, off, st));
      Pn = S.pool.rows;
    }
    bool sparse = false;
    if (L.ratio == 4) {
      const int64_t w = L.icomp.out_dim;
      HETERO_RETURN_IF_ERROR(
          compress(m, S.ipool, L.icomp, cs, bf(m.ikv) + s0 * w, bf(m.igate) + s0 * w, cm, off, st));
      sparse = Pn > c.index_topk;
      if (sparse) {
        HETERO_RETURN_IF_ERROR(m.timer.mark(st, "indexer selection"));
        const int64_t k = c.index_topk, Np = S.ipool.rows;
        const bool hisa = c.index_block > 0 && Np >= c.index_block * c.index_keep &&
                          c.index_keep * c.index_block >= k;
        cuda::IndexSelectParams ip{};
        ip.q = bf(m.iq) + s0 * ih * ihd;
        ip.w = bf(m.iw) + s0 * ih;
        ip.pooled = bf(S.ipool.pooled);
        ip.m = cm, ip.heads = ih, ip.rows = Np, ip.off = off;
        ip.scale = static_cast<float>(std::pow(static_cast<double>(ihd), -0.5));
        ip.wscale = static_cast<float>(std::pow(static_cast<double>(ih), -0.5));
        ip.k = k, ip.one_token = cm == 1;
        if (hisa) {
          ip.block = c.index_block, ip.keep = c.index_keep;
          HETERO_RETURN_IF_ERROR(m.ensure(m.rep, static_cast<size_t>(Np / c.index_block * ihd) * 4,
                                          "HISA block means"));
          cuda::hisa_block_means(ip.pooled, Np, c.index_block, cm == 1, f32(m.rep), st);
          ip.rep = f32(m.rep);
        }
        // reserve() refused longer prompts; a caller that skipped it hears it here.
        HETERO_RETURN_IF_ERROR(cuda::check_index_select(Np, ip.block, ip.keep));
        cuda::index_select(ip, m.topk.get<uint32_t>(), st);
      }
    }
    HETERO_RETURN_IF_ERROR(m.timer.mark(st, "attention kernel"));
    cuda::SparseAttnParams ap{};
    ap.q = bf(m.q) + s0 * Hh * hd;
    ap.out = bf(m.attn) + s0 * Hh * hd;
    ap.m = cm, ap.heads = Hh, ap.head_dim = hd, ap.off = off, ap.window = win;
    ap.lk = bf(m.lk), ap.lk_pos0 = lk_pos0;
    ap.pooled = L.ratio > 0 ? bf(S.pool.pooled) : nullptr;
    ap.pooled_rows = Pn, ap.ratio = L.ratio;
    ap.topk = sparse ? m.topk.get<uint32_t>() : nullptr;
    ap.k = c.index_topk;
    ap.sinks = f32(L.sinks), ap.scale = scale_b;
    ap.online_only = m.online_only;
    ap.derope_freqs = freqs, ap.derope_pairs = m.rope_pairs;  // the output's rope dims back
    cuda::sparse_attention(ap, st);
  }

  HETERO_RETURN_IF_ERROR(m.timer.mark(st, "attn output projections"));
  // The grouped low-rank output (one batched GEMM) of the de-roped attention output.
  const int64_t G = c.o_groups, feat = Hh * hd / G, R = c.o_lora_rank;
  const float alpha = 1.0f, beta0 = 0.0f;
  HETERO_CUDA_RETURN_IF_ERROR(cublasGemmStridedBatchedEx(
      b, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(R), static_cast<int>(n), static_cast<int>(feat),
      &alpha, bf(L.wo_a), CUDA_R_16BF, static_cast<int>(feat), R * feat, bf(m.attn), CUDA_R_16BF,
      static_cast<int>(G * feat), feat, &beta0, bf(m.mid), CUDA_R_16BF, static_cast<int>(G * R), R,
      static_cast<int>(G), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  if (L.wo_b_8.mats > 0) return proj(m, bf(m.mid), n, G * R, L.wo_b, L.wo_b_8, H, bf(m.y));
  float beta = 0.0f;  // (check_options: no bias with an FP8 wo_b)
  if (L.wo_b_bias) cuda::broadcast_rows(bf(L.wo_b_bias), n, H, bf(m.y), st), beta = 1.0f;
  return gemm(b, bf(m.mid), n, G * R, bf(L.wo_b), H, bf(m.y), -1, -1, beta);
}

Status moe(Impl& m, const Dsv4Config& c, int64_t l, int64_t n) {
  const DLayer& L = m.layers[static_cast<size_t>(l)];
  cudaStream_t st = m.stream.get();
  cublasHandle_t b = m.blas.get();
  const int64_t E = c.n_routed_experts, K = c.experts_per_tok, H = c.hidden, I = c.moe_inter;
  const int64_t S = c.moe_inter * c.n_shared_experts;
  const uint16_t* x = bf(m.x);

  HETERO_RETURN_IF_ERROR(m.timer.mark(st, "moe router + grouping"));
  HETERO_RETURN_IF_ERROR(gemm(b, x, n, H, bf(L.gate), E, bf(m.logits)));
  cuda::RouterParams rp{};
  rp.experts = E, rp.top_k = K;
  rp.scoring = c.scoring_func == "sigmoid" ? 1 : c.scoring_func == "softmax" ? 2 : 0;
  rp.norm_topk_prob = c.norm_topk_prob;
  rp.routed_scaling = static_cast<float>(c.routed_scaling_factor);
  rp.bias = L.tid2eid ? nullptr : f32(L.gate_bias);
  rp.tid2eid = L.tid2eid ? L.tid2eid.get<int32_t>() : nullptr;
  cuda::moe_route(rp, bf(m.logits), m.ids.get<int32_t>(), n, m.inds.get<int32_t>(), f32(m.weights),
                  st);
  // FP8 experts quantize their rows straight from x (expert_gemms_fp8's rows_from): no gathered
  // copy.
  cuda::moe_group(m.inds.get<int32_t>(), n * K, K, E, x, H, m.counts.get<int32_t>(),
                  m.offsets.get<int32_t>(), m.perm.get<int32_t>(), m.slot_row.get<int32_t>(),
                  m.fp8 ? nullptr : bf(m.xe), st);
  // cuBLAS takes the per-expert row counts from the host.
  HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(m.host_offsets.get(), m.offsets.get(),
                                              sizeof(int32_t) * (E + 1), cudaMemcpyDeviceToHost,
                                              st));
  HETERO_CUDA_RETURN_IF_ERROR(cudaEventRecord(m.counts_ready.get(), st));
  // The shared expert does not depend on the routing: enqueue it before waiting, so that it
  // runs while the host sets up the routed experts.
  if (S > 0) {
    HETERO_RETURN_IF_ERROR(m.timer.mark(st, "moe shared expert"));
    if (m.fp8)
      HETERO_RETURN_IF_ERROR(fp8_linear(m, x, n, L.sh_w13_8.at(0), bf(m.sgu)));
    else
      HETERO_RETURN_IF_ERROR(gemm(b, x, n, H, bf(L.sh_w13), 2 * S, bf(m.sgu)));
    cuda::swiglu(bf(m.sgu), n, S, static_cast<float>(c.swiglu_limit), bf(m.sact), st);
    if (m.fp8)
      HETERO_RETURN_IF_ERROR(fp8_linear(m, bf(m.sact), n, L.sh_w2_8.at(0), bf(m.sh)));
    else
      HETERO_RETURN_IF_ERROR(gemm(b, bf(m.sact), n, S, bf(L.sh_w2), H, bf(m.sh)));
  }
  // Everything before the counts is done, the previous layer's host-to-device copies of the
  // pinned host_pad and host_active among it; the shared expert may still run.
  HETERO_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(m.counts_ready.get()));
  HETERO_RETURN_IF_ERROR(m.timer.mark(st, "moe routed experts"));
  const int32_t* off = m.host_offsets.get<int32_t>();
  const int32_t* dev_off = m.offsets.get<int32_t>();
  if (m.fp8) {
    int32_t* host_pad = m.host_pad.get<int32_t>();
    int64_t total = 0;
    for (int64_t e = 0; e < E; ++e) {
      host_pad[e] = static_cast<int32_t>(total);
      total += cuda::fp8_act_rows(off[e + 1] - off[e]);
    }
    host_pad[E] = static_cast<int32_t>(total);
    // The previous layer's copy of host_pad is done: counts_ready, waited for above, follows it.
    HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(m.pad.get(), host_pad, sizeof(int32_t) * (E + 1),
                                                cudaMemcpyHostToDevice, st));
    if (L.w13_4.mats > 0) {  // the experts with rows, whose FP4 weights get widened (host_active:
                             // as above)
      int32_t* active = m.host_active.get<int32_t>();
      m.active_count = 0;
      for (int64_t e = 0; e < E; ++e)
        if (off[e + 1] > off[e]) active[m.active_count++] = static_cast<int32_t>(e);
      HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
          m.active.get(), active, sizeof(int32_t) * m.active_count, cudaMemcpyHostToDevice, st));
    }
    ExpertRows tokens;
    tokens.x = x, tokens.rows_from = m.perm.get<int32_t>(), tokens.per = K;
    HETERO_RETURN_IF_ERROR(
        expert_gemms_fp8(m, E, off, dev_off, tokens, L.w13_8, L.w13_4, bf(m.gu)));
    // w2's input: SwiGLU of gu made and quantized in one pass.
    ExpertRows act;
    act.swiglu_gu = bf(m.gu), act.swiglu_limit = static_cast<float>(c.swiglu_limit);
    HETERO_RETURN_IF_ERROR(expert_gemms_fp8(m, E, off, dev_off, act, L.w2_8, L.w2_4, bf(m.ye)));
  } else {
    HETERO_RETURN_IF_ERROR(expert_gemms(m, E, off, bf(m.xe), H, bf(L.w13), 2 * I, bf(m.gu)));
    cuda::swiglu(bf(m.gu), n * K, I, static_cast<float>(c.swiglu_limit), bf(m.act), st);
    HETERO_RETURN_IF_ERROR(expert_gemms(m, E, off, bf(m.act), I, bf(L.w2), H, bf(m.ye)));
  }
  HETERO_RETURN_IF_ERROR(m.timer.mark(st, "moe combine"));
  cuda::moe_combine(bf(m.ye), m.slot_row.get<int32_t>(), f32(m.weights), S > 0 ? bf(m.sh) : nullptr,
                    n, K, H, bf(m.y), st);
  return Status::ok();
}

}  // namespace hetero::dsv4_cuda
