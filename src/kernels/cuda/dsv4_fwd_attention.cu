// The DeepSeek-V4 forward's attention over the local window and the (selected) compressed rows,
// and the indexer's selection of those rows. See dsv4_fwd_ops.h.
#include <cuda_bf16.h>
#include <mma.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <string>

#include "kernels/cuda/dsv4_fwd_common.cuh"
#include "kernels/cuda/dsv4_fwd_ops.h"
#include "kernels/cuda/mlx_math.cuh"
#include "kernels/cuda/mma_sm80.cuh"

namespace hetero::cuda {
namespace {

using namespace dsv4_fwd;

// ---- attention -----------------------------------------------------------------------------

namespace wmma = nvcuda::wmma;
constexpr int kAttnHeads = 16, kAttnKeys = 32, kAttnThreads = 128;
constexpr int kPsLd = kAttnKeys + 16;

struct AttnSmem {
  int64_t ldb, ldo;
  size_t q_off, k_off, o_off, s_off, p_off, row_off, ptr_off, bytes;
};
__host__ __device__ inline AttnSmem attn_smem(int64_t D) {
  AttnSmem s;
  s.ldb = D + 16;
  s.ldo = D + 8;
  s.q_off = 0;
  s.k_off = s.q_off + size_t(kAttnHeads * s.ldb) * 2;
  s.o_off = s.k_off + size_t(kAttnKeys * s.ldb) * 2;
  s.s_off = s.o_off + size_t(kAttnHeads * s.ldo) * 4;
  s.p_off = s.s_off + size_t(2 * kAttnHeads * kAttnKeys) * 4;
  s.row_off = s.p_off + size_t(kAttnHeads * kPsLd) * 2;
  s.ptr_off = s.row_off + size_t(3 * kAttnHeads) * 4;
  s.bytes = s.ptr_off + size_t(kAttnKeys) * 8;
  return s;
}

// One block per (query, group of 16 heads): keys in tiles of 32 through shared memory, scores
// and P.V on tensor cores, an online softmax whose running max starts at the sink.
__global__ void __launch_bounds__(kAttnThreads) online_attention_kernel(SparseAttnParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int64_t D = p.head_dim;
  const AttnSmem L = attn_smem(D);
  __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(smem + L.q_off);
  __nv_bfloat16* Ks = reinterpret_cast<__nv_bfloat16*>(smem + L.k_off);
  float* Os = reinterpret_cast<float*>(smem + L.o_off);
  float* Sp = reinterpret_cast<float*>(smem + L.s_off);
  __nv_bfloat16* Ps = reinterpret_cast<__nv_bfloat16*>(smem + L.p_off);
  float* row_m = reinterpret_cast<float*>(smem + L.row_off);
  float* row_l = row_m + kAttnHeads;
  float* row_a = row_l + kAttnHeads;
  const uint16_t** kptr = reinterpret_cast<const uint16_t**>(smem + L.ptr_off);

  const int64_t i = blockIdx.x, h0 = int64_t(blockIdx.y) * kAttnHeads;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t pos = p.off + i;
  const int64_t lo = pos - p.window + 1 > 0 ? pos - p.window + 1 : 0;
  const int64_t nloc = pos - lo + 1;
  int64_t vis = p.ratio > 0 ? (pos + 1) / p.ratio : 0;
  if (vis > p.pooled_rows) vis = p.pooled_rows;
  const int64_t ncomp = p.ratio > 0 ? (p.topk ? p.k : vis) : 0;
  const int64_t nk = nloc + ncomp;

  for (int64_t e = tid; e < kAttnHeads * D; e += blockDim.x) {
    const int64_t r = e / D, c = e % D, h = h0 + r;
    const float v = h < p.heads ? rb(b2f(p.q[(i * p.heads + h) * D + c]) * p.scale) : 0.0f;
    Qs[r * L.ldb + c] = __float2bfloat16_rn(v);
    Os[r * L.ldo + c] = 0.0f;
  }
  if (tid < kAttnHeads) {
    row_m[tid] = h0 + tid < p.heads ? p.sinks[h0 + tid] : 0.0f;
    row_l[tid] = 1.0f;  // the sink's own weight, exp(sink - sink)
  }
  for (int64_t t0 = 0; t0 < nk; t0 += kAttnKeys) {
    if (tid < kAttnKeys) {
      const int64_t j = t0 + tid;
      const uint16_t* ptr = nullptr;
      if (j < nloc) {
        ptr = p.lk + (lo - p.lk_pos0 + j) * D;
      } else if (j < nk) {
        const int64_t c = j - nloc;
        const int64_t r = p.topk ? int64_t(p.topk[i * p.k + c]) : c;
        if (r < vis) ptr = p.pooled + r * D;
      }
      kptr[tid] = ptr;
    }
    __syncthreads();
    for (int64_t e = tid; e < kAttnKeys * D / 8; e += blockDim.x) {
      const int64_t r = e / (D / 8), c = (e % (D / 8)) * 8;
      const uint16_t* src = kptr[r];
      uint4 v = make_uint4(0, 0, 0, 0);
      if (src) v = *reinterpret_cast<const uint4*>(src + c);
      *reinterpret_cast<uint4*>(Ks + r * L.ldb + c) = v;
    }
    __syncthreads();
    {  // S = Q K^T: warp w computes key tile (w & 1) over half (w >> 1) of the head dim.
      const int nt = warp & 1, kh = warp >> 1;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
      const int64_t steps = D / 32;
      for (int64_t s = kh * steps; s < (kh + 1) * steps; ++s) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b;
        wmma::load_matrix_sync(a, Qs + s * 16, L.ldb);
        wmma::load_matrix_sync(b, Ks + nt * 16 * L.ldb + s * 16, L.ldb);
        wmma::mma_sync(acc, a, b, acc);
      }
      wmma::store_matrix_sync(Sp + kh * kAttnHeads * kAttnKeys + nt * 16, acc, kAttnKeys,
                              wmma::mem_row_major);
    }
    __syncthreads();
    // Online softmax: warp w owns rows 4w..4w+3, lane = key.
    for (int rr = 0; rr < kAttnHeads / 4; ++rr) {
      const int r = warp * (kAttnHeads / 4) + rr;
      const bool valid = kptr[lane] != nullptr;
      const float s = valid ? rb(Sp[r * kAttnKeys + lane] + Sp[(kAttnHeads + r) * kAttnKeys + lane])
                            : -INFINITY;
      const float m_old = row_m[r];
      const float m_new = fmaxf(m_old, warp_max(s));
      const float e = valid ? mlx_exp(s - m_new) : 0.0f;
      const float tot = warp_sum(e);
      Ps[r * kPsLd + lane] = __float2bfloat16_rn(e);
      __syncwarp();
      if (lane == 0) {
        const float a = mlx_exp(m_old - m_new);
        row_a[r] = a;
        row_l[r] = row_l[r] * a + tot;
        row_m[r] = m_new;
      }
    }
    __syncthreads();
    for (int64_t e = tid; e < kAttnHeads * D; e += blockDim.x) {
      const int64_t r = e / D, c = e % D;
      Os[r * L.ldo + c] *= row_a[r];
    }
    __syncthreads();
    for (int64_t nt = warp; nt < D / 16; nt += kAttnThreads / 32) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::load_matrix_sync(acc, Os + nt * 16, L.ldo, wmma::mem_row_major);
      for (int ks = 0; ks < kAttnKeys / 16; ++ks) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> b;
        wmma::load_matrix_sync(a, Ps + ks * 16, kPsLd);
        wmma::load_matrix_sync(b, Ks + ks * 16 * L.ldb + nt * 16, L.ldb);
        wmma::mma_sync(acc, a, b, acc);
      }
      wmma::store_matrix_sync(Os + nt * 16, acc, L.ldo, wmma::mem_row_major);
    }
    __syncthreads();
  }
  for (int64_t e = tid; e < kAttnHeads * D; e += blockDim.x) {
    const int64_t r = e / D, c = e % D, h = h0 + r;
    if (h < p.heads) p.out[(i * p.heads + h) * D + c] = f2b(Os[r * L.ldo + c] / row_l[r]);
  }
}

// The key list of query i (position pos): local rows first, then the compressed ones.
struct KeyList {
  int64_t lo, nloc, vis, nk;
};
__device__ inline KeyList key_list(const SparseAttnParams& p, int64_t i) {
  KeyList k;
  const int64_t pos = p.off + i;
  k.lo = pos - p.window + 1 > 0 ? pos - p.window + 1 : 0;
  k.nloc = pos - k.lo + 1;
  k.vis = p.ratio > 0 ? (pos + 1) / p.ratio : 0;
  if (k.vis > p.pooled_rows) k.vis = p.pooled_rows;
  k.nk = k.nloc + (p.ratio > 0 ? (p.topk ? p.k : k.vis) : 0);
  return k;
}
// All heads of one query in one block (64 rows: DeepSeek-V4-Flash's head count), two passes over
// the keys with the decoder's rounding points: every score into shared memory as the bf16 value
// the decoder rounds it to, an exact softmax with the sink as an extra logit (P = exp(s - max) in
// bf16), then P.V. The kv head is shared, so each 32-key tile is read once per pass for all 64
// heads (arithmetic per byte loaded is what bounds this kernel; 32 heads per block halved it).
// Tiles arrive by cp.async, 2 to 4 buffers deep (as many as shared memory holds beside the
// scores), so the next tiles load while this one is multiplied; where each key's row lies is
// worked out once per query (kidx). mma.sync m16n8k16 throughout. Warp w owns query rows
// 16 (w % 4) ..; in pass 1 it keeps those rows' Q fragments in registers (D / 4 of them) and
// scores keys 16 (w / 4) .. of each tile; in pass 2 it accumulates output columns (w / 4) D/2 ..
// in registers (D / 4 floats).
constexpr int kWideRows = 64, kWideKeys = 32, kWideThreads = 256, kWideMaxStages = 4;
constexpr size_t kWideSmemMax = 227 * 1024;  // sm_90's opt-in shared memory per block
constexpr int32_t kMaskedKey = -1;           // kidx: -1 masked, >= 0 pooled row, <= -2 local row

struct WideSmem {
  int64_t ldk, lds;  // row pitches (elements): 16-byte rows fall in distinct banks for ldmatrix
  int stages;
  size_t s_off, k_off, l_off, trig_off, bytes;
};
constexpr int kWideMaxDeropePairs = 64;  // the epilogue's de-rope: cos and sin of these many pairs
__host__ __device__ inline WideSmem wide_smem(int64_t D, int64_t nk_max, int stages) {
  WideSmem s;
  s.ldk = D + 8;
  s.lds = (nk_max + kWideKeys - 1) / kWideKeys * kWideKeys + 8;
  s.stages = stages;
  // The key tiles first; before pass 1 the first two hold the 64 staged query rows.
  s.s_off = size_t(stages * kWideKeys * s.ldk) * 2;
  s.k_off = s.s_off + size_t(kWideRows * s.lds) * 2;
  s.l_off = s.k_off + size_t(s.lds) * 4;
  s.trig_off = s.l_off + size_t(kWideRows) * 4;
  s.bytes = s.trig_off + size_t(kWideMaxDeropePairs) * 8;
  return s;
}
static_assert(2 * kWideKeys == kWideRows, "the staged query rows fill two key tiles");
static_assert(kWideRows * 64 / 8 % kWideThreads == 0, "whole 16-byte loads of Q per thread");

__device__ __forceinline__ void cp_async_wait_stages(int stages) {
  // Leaves stages - 2 groups in flight: the oldest (this tile's) has landed.
  if (stages >= 4)
    asm volatile("cp.async.wait_group 2;\n" ::: "memory");
  else if (stages == 3)
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
  else
    mma::cp_async_wait_all();
}

// Issues tile t's rows into buffer `dst` (zeros where a key is masked or past the list); always
// commits a group, empty past the last tile, so that the groups in flight count tiles.
// Thread t copies row t / 8 of the tile, its 16-byte pieces t % 8, t % 8 + 8, ...: one key-table
// lookup and one row address per thread and tile, and each 8 threads' copies 128 contiguous
// bytes of a row.
constexpr int kWideRowThreads = kWideThreads / kWideKeys;  // 8
template <int D>
__device__ inline void issue_key_tile(const SparseAttnParams& p, const int32_t* kidx, int64_t t,
                                      int64_t tiles, uint16_t* dst, int64_t ldk) {
  static_assert(D % (8 * kWideRowThreads) == 0, "whole 16-byte pieces for every thread of a row");
  if (t < tiles) {
    const int r = threadIdx.x / kWideRowThreads, c0 = (threadIdx.x % kWideRowThreads) * 8;
    const int32_t k = kidx[t * kWideKeys + r];
    // A masked key copies nothing (zero fill) from a query row, which holds D elements too: the
    // same address arithmetic either way, no select a copy.
    const uint16_t* src = k == kMaskedKey ? p.q
                          : k >= 0        ? p.pooled + int64_t(k) * D
                                          : p.lk + int64_t(-k - 2) * D;
    const int bytes = k == kMaskedKey ? 0 : 16;
    uint16_t* row = dst + r * ldk;
#pragma unroll
    for (int j = 0; j < D / (8 * kWideRowThreads); ++j) {
      const int c = c0 + j * 8 * kWideRowThreads;
      mma::cp_async16(row + c, src + c, bytes);
    }
  }
  mma::cp_async_commit();
}

template <int D>
__global__ void __launch_bounds__(kWideThreads, 1)
    wide_attention_kernel(SparseAttnParams p, int64_t nk_max, int stages) {
  extern __shared__ __align__(128) unsigned char smem[];
  const WideSmem L = wide_smem(D, nk_max, stages);
  uint16_t* Ks = reinterpret_cast<uint16_t*>(smem);
  uint16_t* Ss = reinterpret_cast<uint16_t*>(smem + L.s_off);
  int32_t* kidx = reinterpret_cast<int32_t*>(smem + L.k_off);
  float* inv_l = reinterpret_cast<float*>(smem + L.l_off);
  float2* trig = reinterpret_cast<float2*>(smem + L.trig_off);
  const int64_t i = blockIdx.x, h0 = int64_t(blockIdx.y) * kWideRows;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int rt = warp % 4, half = warp / 4;
  const int mi = lane / 8, mr = lane % 8;  // ldmatrix: this lane addresses row mr of matrix mi
  const int g = lane / 4, c2 = (lane % 4) * 2;
  const KeyList kl = key_list(p, i);
  const int64_t tiles = (kl.nk + kWideKeys - 1) / kWideKeys;
  const int64_t ldk = L.ldk, lds = L.lds, tile_elems = kWideKeys * ldk;

  // The de-rope's cos and sin at this query's position (read in the epilogue, many barriers on).
  if (tid < p.derope_pairs) {
    float c, s;
    mlx_rope_trig(__fadd_rn(float(i), float(p.off)), p.derope_freqs[tid], 1, true, &c, &s);
    trig[tid] = make_float2(c, s);
  }
  // Where each key's row lies (the tiles' padding masked).
  for (int64_t j = tid; j < tiles * kWideKeys; j += kWideThreads) {
    int32_t k = kMaskedKey;
    if (j < kl.nloc) {
      k = int32_t(-(kl.lo - p.lk_pos0 + j) - 2);
    } else if (j < kl.nk) {
      const int64_t c = j - kl.nloc;
      const int64_t r = p.topk ? int64_t(p.topk[i * p.k + c]) : c;
      if (r < kl.vis) k = int32_t(r);
    }
    kidx[j] = k;
  }
  // Q scaled and rounded to bf16 as the decoder does, staged, then held as A fragments. Every
  // 16-byte load is issued before the first is used: q comes from device memory, and one
  // latency per load in turn was most of a short key list's time.
  constexpr int kQLoads = kWideRows * D / 8 / kWideThreads;
  uint4 qv[kQLoads];
#pragma unroll
  for (int u = 0; u < kQLoads; ++u) {
    const int e = tid + u * kWideThreads, r = e / (D / 8), c = (e % (D / 8)) * 8;
    qv[u] = h0 + r < p.heads ? *reinterpret_cast<const uint4*>(p.q + (i * p.heads + h0 + r) * D + c)
                             : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int u = 0; u < kQLoads; ++u) {
    const int e = tid + u * kWideThreads, r = e / (D / 8), c = (e % (D / 8)) * 8;
    const uint32_t w[4] = {qv[u].x, qv[u].y, qv[u].z, qv[u].w};
    uint32_t o[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      o[k] = mma::pack_bf2(rb(b2f(uint16_t(w[k] & 0xffffu)) * p.scale),
                           rb(b2f(uint16_t(w[k] >> 16)) * p.scale));
    *reinterpret_cast<uint4*>(Ks + r * ldk + c) = make_uint4(o[0], o[1], o[2], o[3]);
  }
  __syncthreads();
  uint32_t qa[D / 16][4];
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
    mma::ldsm_x4(qa[ks], Ks + (rt * 16 + (mi % 2) * 8 + mr) * ldk + ks * 16 + (mi / 2) * 8);
  __syncthreads();

  // Pass 1: S = Q K^T, each score rounded to bf16 into Ss.
  for (int s = 0; s < stages - 1; ++s)
    issue_key_tile<D>(p, kidx, s, tiles, Ks + s * tile_elems, ldk);
  // Tile t's buffer is t % stages and tile t + stages - 1 goes into the one before it, counted
  // rather than divided: a 64-bit remainder by the run-time stage count took about 30
  // instructions a tile (bench/sass_mainloop.py).
  int buf = 0;
  for (int64_t t = 0; t < tiles; ++t, buf = buf + 1 == stages ? 0 : buf + 1) {
    cp_async_wait_stages(stages);
    __syncthreads();  // tile t is in; every warp is done with tile t - 1's buffer
    issue_key_tile<D>(p, kidx, t + stages - 1, tiles,
                      Ks + (buf == 0 ? stages - 1 : buf - 1) * tile_elems, ldk);
    const uint16_t* kb =
        Ks + buf * tile_elems + (half * 16 + (mi / 2) * 8 + mr) * ldk + (mi % 2) * 8;
    // Even and odd depth steps into separate accumulators: four independent chains per warp
    // keep the tensor cores fed (two chains of D / 16 dependent mma left them waiting).
    float acc[2][2][4] = {};
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t b[4];
      mma::ldsm_x4(b, kb + ks * 16);
      mma::mma16816(acc[0][ks % 2], qa[ks], b[0], b[1]);
      mma::mma16816(acc[1][ks % 2], qa[ks], b[2], b[3]);
    }
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int64_t col = t * kWideKeys + half * 16 + n * 8 + c2;
      uint16_t* s0 = Ss + (rt * 16 + g) * lds + col;
      const float(&e)[4] = acc[n][0];
      const float(&f)[4] = acc[n][1];
      // A masked key's score is -inf: the softmax below then needs no key table.
      const bool m0 = kidx[col] == kMaskedKey, m1 = kidx[col + 1] == kMaskedKey;
      *reinterpret_cast<uint32_t*>(s0) =
          mma::pack_bf2(m0 ? -INFINITY : e[0] + f[0], m1 ? -INFINITY : e[1] + f[1]);
      *reinterpret_cast<uint32_t*>(s0 + 8 * lds) =
          mma::pack_bf2(m0 ? -INFINITY : e[2] + f[2], m1 ? -INFINITY : e[3] + f[3]);
    }
  }
  mma::cp_async_wait_all();  // the empty groups past the last tile
  __syncthreads();
  // Pass 2's first tiles load under the softmax.
  for (int s = 0; s < stages - 1; ++s)
    issue_key_tile<D>(p, kidx, s, tiles, Ks + s * tile_elems, ldk);

  // Softmax per row (warp w: rows 8w..8w+7) over the bf16 scores, the sink's mass in the sum;
  // P = exp(s - max) in bf16, in place (a masked key's -inf gives 0). Two scores a lane at a
  // time, one 32-bit word: an exp and a rounding per score are many more instructions than the
  // score's share of the mma.
  const int pairs = int(tiles * kWideKeys / 2);
  for (int rr = 0; rr < kWideRows / 8; ++rr) {
    const int r = warp * (kWideRows / 8) + rr;
    uint32_t* srow = reinterpret_cast<uint32_t*>(Ss + r * lds);
    const float sink = h0 + r < p.heads ? p.sinks[h0 + r] : 0.0f;
    float mx = sink;
    for (int j = lane; j < pairs; j += 32) {
      const uint32_t v = srow[j];
      mx = fmaxf(mx, fmaxf(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u)));
    }
    mx = warp_max(mx);
    float tot = 0.0f;
    for (int j = lane; j < pairs; j += 32) {
      const uint32_t v = srow[j];
      const float e0 = mlx_exp(__uint_as_float(v << 16) - mx);
      const float e1 = mlx_exp(__uint_as_float(v & 0xffff0000u) - mx);
      tot += e0;
      tot += e1;
      srow[j] = mma::pack_bf2(e0, e1);  // >= 0: rounds as f2b does (NaN payloads aside)
    }
    tot = warp_sum(tot) + mlx_exp(sink - mx);
    if (lane == 0) inv_l[r] = 1.0f / tot;
  }

  // Pass 2: O = P V over this warp's 16 rows and D/2 columns.
  float o[D / 16][4] = {};
  const int64_t col0 = half * (D / 2);
  buf = 0;
  for (int64_t t = 0; t < tiles; ++t, buf = buf + 1 == stages ? 0 : buf + 1) {
    cp_async_wait_stages(stages);
    __syncthreads();  // tile t (and, at t = 0, every P row) is in
    issue_key_tile<D>(p, kidx, t + stages - 1, tiles,
                      Ks + (buf == 0 ? stages - 1 : buf - 1) * tile_elems, ldk);
    const uint16_t* vt = Ks + buf * tile_elems;  // buf: t % stages, as in pass 1
#pragma unroll
    for (int ks = 0; ks < kWideKeys / 16; ++ks) {
      uint32_t a[4];
      mma::ldsm_x4(
          a, Ss + (rt * 16 + (mi % 2) * 8 + mr) * lds + t * kWideKeys + ks * 16 + (mi / 2) * 8);
      const uint16_t* vb = vt + (ks * 16 + (mi % 2) * 8 + mr) * ldk + col0 + (mi / 2) * 8;
#pragma unroll
      for (int np = 0; np < D / 32; ++np) {
        uint32_t b[4];
        mma::ldsm_x4_trans(b, vb + np * 16);
        mma::mma16816(o[2 * np], a, b[0], b[1]);
        mma::mma16816(o[2 * np + 1], a, b[2], b[3]);
      }
    }
  }
  mma::cp_async_wait_all();
  const int r0 = rt * 16 + g;
#pragma unroll
  for (int half_row = 0; half_row < 2; ++half_row) {
    const int r = r0 + 8 * half_row;
    const int64_t h = h0 + r;
    if (h >= p.heads) continue;
    const float inv = inv_l[r];
    uint16_t* out = p.out + (i * p.heads + h) * D + col0 + c2;
    // Pair (col0 + c2 + 8 nt) / 2 of the head; the last derope_pairs of D / 2 rotate back.
    const int64_t first = D / 2 - p.derope_pairs - (col0 + c2) / 2;
#pragma unroll
    for (int nt = 0; nt < D / 16; ++nt) {
      uint32_t v = mma::pack_bf2(o[nt][2 * half_row] * inv, o[nt][2 * half_row + 1] * inv);
      if (4 * nt >= first) {
        const float2 cs = trig[4 * nt - first];
        v = rope_pair(v, cs.x, cs.y);
      }
      *reinterpret_cast<uint32_t*>(out + nt * 8) = v;
    }
  }
}

template <int D>
bool launch_wide(const SparseAttnParams& p, int64_t nk_max, cudaStream_t stream) {
  int stages = kWideMaxStages;
  while (stages >= 2 && wide_smem(D, nk_max, stages).bytes > kWideSmemMax) --stages;
  if (stages < 2) return false;
  static bool configured = false;
  if (!configured) {
    cudaFuncSetAttribute(wide_attention_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(kWideSmemMax));
    configured = true;
  }
  const dim3 grid(static_cast<unsigned>(p.m),
                  static_cast<unsigned>((p.heads + kWideRows - 1) / kWideRows));
  wide_attention_kernel<D>
      <<<grid, kWideThreads, wide_smem(D, nk_max, stages).bytes, stream>>>(p, nk_max, stages);
  return true;
}

// The two-pass kernel where its scores fit in shared memory; false where they do not.
bool wide_attention(const SparseAttnParams& p, int64_t nk_max, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64:
      return launch_wide<64>(p, nk_max, stream);
    case 128:
      return launch_wide<128>(p, nk_max, stream);
    case 192:
      return launch_wide<192>(p, nk_max, stream);
    case 256:
      return launch_wide<256>(p, nk_max, stream);
    case 320:
      return launch_wide<320>(p, nk_max, stream);
    case 384:
      return launch_wide<384>(p, nk_max, stream);
    case 448:
      return launch_wide<448>(p, nk_max, stream);
    case 512:
      return launch_wide<512>(p, nk_max, stream);
    default:
      return false;
  }
}

}  // namespace

Status check_attention_shapes(int64_t head_dim, int64_t index_heads) {
  if (head_dim % 64 != 0 || head_dim > 512)
    return invalid_argument("the CUDA attention takes head_dim a multiple of 64 up to 512, not " +
                            std::to_string(head_dim));
  if (index_heads > kIdxMaxHeads)
    return invalid_argument("the CUDA indexer takes at most " + std::to_string(kIdxMaxHeads) +
                            " heads, not " + std::to_string(index_heads));
  return Status::ok();
}

void sparse_attention(const SparseAttnParams& p, cudaStream_t stream) {
  if (p.m == 0) return;
  HETERO_CHECK(p.head_dim % 64 == 0 && p.head_dim <= 512);
  // The most keys a query of this call has: the last one's (both counts grow with position).
  const int64_t last = p.off + p.m - 1;
  int64_t nk_max = std::min<int64_t>(p.window, last + 1);
  if (p.ratio > 0) nk_max += p.topk ? p.k : std::min<int64_t>(p.pooled_rows, (last + 1) / p.ratio);
  HETERO_CHECK(p.derope_pairs <= p.head_dim / 2);
  if (!p.online_only && p.derope_pairs <= kWideMaxDeropePairs && wide_attention(p, nk_max, stream))
    return;
  static bool configured = false;  // long key lists: the online-softmax kernel
  if (!configured) {
    cudaFuncSetAttribute(online_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         220 * 1024);
    configured = true;
  }
  const AttnSmem L = attn_smem(p.head_dim);
  const dim3 grid(static_cast<unsigned>(p.m),
                  static_cast<unsigned>((p.heads + kAttnHeads - 1) / kAttnHeads));
  online_attention_kernel<<<grid, kAttnThreads, L.bytes, stream>>>(p);
  rope_pairs_only(p.out, p.m, p.heads, p.head_dim, p.off, p.derope_freqs, p.derope_pairs, 1, true,
                  stream);
}

}  // namespace hetero::cuda
