// The DeepSeek-V4 forward's indexer: its scores of the compressed rows (HISA's block means
// first where it runs) and each query's top-k selection. See dsv4_fwd_ops.h.
#include <cuda_bf16.h>

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

constexpr int kIdxDim = 128, kIdxThreads = 256, kIdxMaxSort = 8192;

__device__ __forceinline__ uint64_t order_key(float score, uint32_t idx) {
  uint32_t u = __float_as_uint(score);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (uint64_t(u) << 32) | uint64_t(0xffffffffu - idx);
}
__device__ __forceinline__ uint32_t key_index(uint64_t k) {
  return 0xffffffffu - uint32_t(k & 0xffffffffu);
}

// One step (size, stride) of a descending bitonic sort of keys[0, n) in shared memory, by the
// whole block: a thread per compare-exchange pair (i, i + stride), i the p-th index whose stride
// bit is clear, so every thread has work in every step. The caller puts the barriers around it.
__device__ __forceinline__ void bitonic_step_smem(uint64_t* keys, int n, int size, int stride) {
  for (int p = threadIdx.x; p < n / 2; p += blockDim.x) {
    const int i = ((p & ~(stride - 1)) << 1) | (p & (stride - 1)), j = i + stride;
    const bool desc = (i & size) == 0;
    const uint64_t a = keys[i], b = keys[j];
    if (desc ? a < b : a > b) keys[i] = b, keys[j] = a;
  }
}

// Descending bitonic sort of keys[0, n2) (n2 a power of two, at most kIdxMaxSort) by the whole
// block, in shared memory, 32-bit indices: the sort for more keys than sort_desc holds in
// registers.
__device__ void bitonic_desc(uint64_t* keys, int64_t n2_) {
  const int n2 = static_cast<int>(n2_);
  for (int size = 2; size <= n2; size <<= 1)
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      __syncthreads();
      bitonic_step_smem(keys, n2, size, stride);
    }
  __syncthreads();
}

__device__ __forceinline__ uint64_t shfl_xor_u64(uint64_t v, int m) {
  const uint32_t lo = __shfl_xor_sync(0xffffffffu, uint32_t(v), m);
  const uint32_t hi = __shfl_xor_sync(0xffffffffu, uint32_t(v >> 32), m);
  return (uint64_t(hi) << 32) | lo;
}

// The same sort (the same network, so the same order) with E keys a thread in registers, thread t
// holding keys tE .. tE + E - 1: the steps of stride below E inside a thread, below 32E across a
// warp's lanes by shuffles, and only the rest through shared memory, a thread a pair. For 1,024
// keys that is 6 of the 55 steps behind a barrier, where every step was (the profile of
// index_select had it waiting on fixed-latency chains). Fewer keys than a warp holds (n2 < 32E)
// are padded with zeros, below every key order_key makes, which sort to the end.
template <int E>
__device__ void bitonic_desc_regs(uint64_t* keys, int n2) {
  const int tid = threadIdx.x, base = tid * E, span = 32 * E;
  const int n = n2 > span ? n2 : span;
  const bool holds = base < n2;
  uint64_t v[E];
  __syncthreads();  // the keys are written
#pragma unroll
  for (int r = 0; r < E; ++r) v[r] = holds ? keys[base + r] : 0;
  for (int size = 2; size <= n; size <<= 1) {
    int stride = size >> 1;
    if (stride >= span) {
      if (holds)
#pragma unroll
        for (int r = 0; r < E; ++r) keys[base + r] = v[r];
      for (; stride >= span; stride >>= 1) {
        __syncthreads();
        bitonic_step_smem(keys, n, size, stride);
      }
      __syncthreads();
#pragma unroll
      for (int r = 0; r < E; ++r) v[r] = holds ? keys[base + r] : 0;
    }
    for (; stride >= E; stride >>= 1) {
#pragma unroll
      for (int r = 0; r < E; ++r) {
        const int i = base + r;
        const uint64_t o = shfl_xor_u64(v[r], stride / E);
        // The lower index of a descending run keeps the larger key, as does the upper of an
        // ascending one.
        const bool keep_max = ((i & stride) == 0) == ((i & size) == 0);
        v[r] = keep_max ? (v[r] > o ? v[r] : o) : (v[r] < o ? v[r] : o);
      }
    }
#pragma unroll
    for (int s = E / 2; s > 0; s >>= 1) {
      if (s < size) {
#pragma unroll
        for (int r = 0; r < E; ++r) {
          if ((r & s) == 0) {
            const bool desc = ((base + r) & size) == 0;
            const uint64_t a = v[r], b = v[r + s];
            if (desc ? a < b : a > b) v[r] = b, v[r + s] = a;
          }
        }
      }
    }
  }
  __syncthreads();  // every read of the shared keys above is done
  if (holds)
#pragma unroll
    for (int r = 0; r < E; ++r) keys[base + r] = v[r];
  __syncthreads();
}

// Sorts keys[0, n2) descending: in registers up to 8 keys a thread, else in shared memory.
__device__ void sort_desc(uint64_t* keys, int64_t n2) {
  static_assert(kIdxThreads == 256, "a thread's share of the keys is n2 / 256");
  switch (n2 <= kIdxThreads ? 1 : static_cast<int>(n2 / kIdxThreads)) {
    case 1:
      return bitonic_desc_regs<1>(keys, static_cast<int>(n2));
    case 2:
      return bitonic_desc_regs<2>(keys, static_cast<int>(n2));
    case 4:
      return bitonic_desc_regs<4>(keys, static_cast<int>(n2));
    case 8:
      return bitonic_desc_regs<8>(keys, static_cast<int>(n2));
    default:
      return bitonic_desc(keys, n2);
  }
}

__host__ __device__ inline int64_t pow2_at_least(int64_t n) {
  int64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

// The query's heads in shared memory as bf16 (its values are bf16, so nothing is lost), a head a
// row: a pitch of 132 elements (66 words) puts a half-warp's 8-byte reads of 16 heads in distinct
// banks.
constexpr int kQtLd = kIdxDim + 4;

// Stage one's scores of block-mean rows j0 .. j0 + 3 (float32, nb of them) by one warp, each lane
// its heads lane and lane + 32: every (row, head) sum runs in d order in float32, the CPU engine's
// order, as one row at a time did; four rows at once share each read of the query and keep four
// independent chains per head. A row's four values arrive by one 16-byte read all lanes share.
__device__ void score_means4(const float* rep, int64_t nb, int64_t j0, const uint16_t* qT,
                             const float* wk, int64_t heads, int lane, float (&s)[4]) {
  const float4* row[4];
#pragma unroll
  for (int r = 0; r < 4; ++r)
    row[r] = reinterpret_cast<const float4*>(rep + (j0 + r < nb ? j0 + r : nb - 1) * kIdxDim);
  const uint16_t* q0 = qT + lane * kQtLd;
  const uint16_t* q1 = q0 + 32 * kQtLd;
  float a0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, a1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 2
  for (int d4 = 0; d4 < kIdxDim / 4; ++d4) {
    const uint2 u0 = *reinterpret_cast<const uint2*>(q0 + d4 * 4);
    const uint2 u1 = *reinterpret_cast<const uint2*>(q1 + d4 * 4);
    const float qlo[4] = {__uint_as_float(u0.x << 16), __uint_as_float(u0.x & 0xffff0000u),
                          __uint_as_float(u0.y << 16), __uint_as_float(u0.y & 0xffff0000u)};
    const float qhi[4] = {__uint_as_float(u1.x << 16), __uint_as_float(u1.x & 0xffff0000u),
                          __uint_as_float(u1.y << 16), __uint_as_float(u1.y & 0xffff0000u)};
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float4 x4 = __ldg(row[r] + d4);
      const float x[4] = {x4.x, x4.y, x4.z, x4.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        a0[r] += qlo[k] * x[k];
        a1[r] += qhi[k] * x[k];
      }
    }
  }
  const bool h1 = lane + 32 < heads;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    float t = lane < heads ? fmaxf(a0[r], 0.0f) * wk[lane] : 0.0f;
    if (h1) t += fmaxf(a1[r], 0.0f) * wk[lane + 32];
    s[r] = warp_sum(t);
  }
}

// The keys the selection sorts: every row, or with HISA the block means and the kept blocks' rows.
__host__ __device__ inline int64_t index_sort_keys(int64_t rows, int64_t block, int64_t keep) {
  if (block <= 0) return rows;
  const int64_t nb = rows / block, kb = keep < nb ? keep : nb;
  return nb > kb * block ? nb : kb * block;
}

// Tensor-core scoring of bf16 rows: a block of 8 warps scores n rows (row_of(j): the row's 128
// values, never null; `any`: 128 readable values that rows past n copy zero bytes from) in tiles
// of 64 arriving by cp.async, kIdxStages buffers deep (a tile's copy is an L2 round trip, longer
// than a tile's 32 mma a warp; the other blocks on the multiprocessor issue meanwhile). Warp w
// holds heads 16 (w % 4) .. of the query as A fragments (qa) and scores rows 32 (w / 4) .. of each
// tile; relu(dot) * wk per head, summed over its 16 heads across the lanes, then over the four head
// groups in order. keys[j] = key_of(j, score) for j < n, 0 up to n2 (the sort's padding).
// Two buffers: the block's shared memory (61 KB at Flash's shapes) then lets three blocks share a
// multiprocessor, where four buffers (96 KB) allowed two (and a block alone waited on its copies);
// the kernel is held to 80 registers for the same reason.
constexpr int kIdxTile = 64, kIdxLd = kIdxDim + 8, kIdxStages = 2, kIdxBlocksPerSm = 3;
struct IdxScratch {
  uint16_t* tiles;  // [kIdxStages][kIdxTile][kIdxLd]
  float* part;      // [4][kIdxTile]
};
// Shared memory: qT [64][kQtLd] bf16, wk [64] f32, the sort's keys (a power of two), HISA's kept
// blocks, the row tiles, the partial sums.
struct IdxSmem {
  size_t keys_off, blocks_off, tiles_off, part_off, bytes;
};
__host__ __device__ inline IdxSmem idx_smem(const IndexSelectParams& p) {
  IdxSmem s;
  s.keys_off = size_t(kIdxMaxHeads * kQtLd) * 2 + size_t(kIdxMaxHeads) * 4;
  s.blocks_off = s.keys_off + size_t(pow2_at_least(index_sort_keys(p.rows, p.block, p.keep))) * 8;
  const int64_t nb = p.block > 0 ? p.rows / p.block : 0;
  s.tiles_off = s.blocks_off + (size_t(p.keep < nb ? p.keep : nb) * 4 + 15) / 16 * 16;
  s.part_off = s.tiles_off + size_t(kIdxStages * kIdxTile * kIdxLd) * 2;
  s.bytes = s.part_off + size_t(4 * kIdxTile) * 4;
  return s;
}
template <typename RowOf, typename KeyOf>
__device__ void score_rows_mma(int64_t n, int64_t n2, const RowOf& row_of, const KeyOf& key_of,
                               const uint16_t* qT, float w_lo, float w_hi, const IdxScratch& sc,
                               const uint16_t* any, uint64_t* keys) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, ht = warp % 4, half = warp / 4;
  const int mi = lane / 8, mr = lane % 8, g = lane / 4, c2 = (lane % 4) * 2;
  // This warp's 16 heads as A fragments (rows g and g + 8, columns 2c.. and 2c + 8..), from the
  // query in shared memory: loaded here, not held through stage one and its sort.
  uint32_t qa[kIdxDim / 16][4];
  {
    const uint16_t* q_lo = qT + (ht * 16 + g) * kQtLd + c2;
    const uint16_t* q_hi = q_lo + 8 * kQtLd;
#pragma unroll
    for (int ks = 0; ks < kIdxDim / 16; ++ks) {
      qa[ks][0] = *reinterpret_cast<const uint32_t*>(q_lo + ks * 16);
      qa[ks][1] = *reinterpret_cast<const uint32_t*>(q_hi + ks * 16);
      qa[ks][2] = *reinterpret_cast<const uint32_t*>(q_lo + ks * 16 + 8);
      qa[ks][3] = *reinterpret_cast<const uint32_t*>(q_hi + ks * 16 + 8);
    }
  }
  const int64_t ntiles = (n + kIdxTile - 1) / kIdxTile;
  // Every call commits a group, empty past the last tile, so that waiting for all but the
  // newest kIdxStages - 2 groups always means tile t is in.
  auto issue = [&](int64_t t) {
    if (t >= ntiles) return mma::cp_async_commit();
    uint16_t* dst = sc.tiles + (t % kIdxStages) * kIdxTile * kIdxLd;
    static_assert(kIdxTile * kIdxDim / 8 % kIdxThreads == 0, "whole 16-byte pieces a thread");
#pragma unroll
    for (int u = 0; u < kIdxTile * kIdxDim / 8 / kIdxThreads; ++u) {
      const int e = tid + u * kIdxThreads;
      const int r = e / (kIdxDim / 8), c = (e % (kIdxDim / 8)) * 8;
      const int64_t j = t * kIdxTile + r;
      // Past the n rows: nothing copied (zero fill) from `any`, which holds kIdxDim elements.
      const uint16_t* src = j < n ? row_of(j) : any;
      mma::cp_async16(dst + r * kIdxLd + c, src + c, j < n ? 16 : 0);
    }
    mma::cp_async_commit();
  };
  for (int64_t t = 0; t < kIdxStages - 1; ++t) issue(t);
  for (int64_t t = 0; t < ntiles; ++t) {
    mma::cp_async_wait<kIdxStages - 2>();
    __syncthreads();            // tile t is in; tile t - 1's buffer and partial sums are read
    issue(t + kIdxStages - 1);  // into tile t - 1's buffer
    const uint16_t* kb = sc.tiles + (t % kIdxStages) * kIdxTile * kIdxLd +
                         (half * 32 + (mi / 2) * 8 + mr) * kIdxLd + (mi % 2) * 8;
    float acc[4][4] = {};
#pragma unroll
    for (int ks = 0; ks < kIdxDim / 16; ++ks)
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t b[4];
        mma::ldsm_x4(b, kb + np * 16 * kIdxLd + ks * 16);
        mma::mma16816(acc[2 * np], qa[ks], b[0], b[1]);
        mma::mma16816(acc[2 * np + 1], qa[ks], b[2], b[3]);
      }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float v0 = fmaxf(acc[j][0], 0.0f) * w_lo + fmaxf(acc[j][2], 0.0f) * w_hi;
      float v1 = fmaxf(acc[j][1], 0.0f) * w_lo + fmaxf(acc[j][3], 0.0f) * w_hi;
      for (int o = 4; o < 32; o <<= 1) {
        v0 += __shfl_xor_sync(0xffffffffu, v0, o);
        v1 += __shfl_xor_sync(0xffffffffu, v1, o);
      }
      if (g == 0) {
        float* out = sc.part + ht * kIdxTile + half * 32 + j * 8 + c2;
        out[0] = v0, out[1] = v1;
      }
    }
    __syncthreads();
    if (tid < kIdxTile) {
      const int64_t j = t * kIdxTile + tid;
      if (j < n2) {
        const float* pt = sc.part + tid;
        keys[j] =
            j < n ? key_of(j, ((pt[0] + pt[kIdxTile]) + pt[2 * kIdxTile]) + pt[3 * kIdxTile]) : 0;
      }
    }
  }
  mma::cp_async_wait_all();  // the empty groups, before the buffers are reused
  for (int64_t j = ntiles * kIdxTile + tid; j < n2; j += kIdxThreads) keys[j] = 0;
  __syncthreads();
}

__global__ void __launch_bounds__(kIdxThreads, kIdxBlocksPerSm)
    index_select_kernel(IndexSelectParams p, uint32_t* topk) {
  extern __shared__ __align__(16) unsigned char smem[];
  const IdxSmem L = idx_smem(p);
  uint16_t* qT = reinterpret_cast<uint16_t*>(smem);
  float* wk = reinterpret_cast<float*>(smem + size_t(kIdxMaxHeads * kQtLd) * 2);
  uint64_t* keys = reinterpret_cast<uint64_t*>(smem + L.keys_off);
  uint32_t* blocks = reinterpret_cast<uint32_t*>(smem + L.blocks_off);
  const IdxScratch sc{reinterpret_cast<uint16_t*>(smem + L.tiles_off),
                      reinterpret_cast<float*>(smem + L.part_off)};
  const int64_t i = blockIdx.x;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = kIdxThreads / 32;
  // qT[h][d]: eight of a head's values a thread, a warp's lanes on consecutive heads (16 bytes a
  // lane from global; two 8-byte stores, conflict-free at this pitch); heads past p.heads zero.
  for (int e = threadIdx.x; e < kIdxMaxHeads * (kIdxDim / 8); e += blockDim.x) {
    const int h = e % kIdxMaxHeads, d0 = (e / kIdxMaxHeads) * 8;
    const uint4 v = h < p.heads
                        ? *reinterpret_cast<const uint4*>(p.q + (i * p.heads + h) * kIdxDim + d0)
                        : make_uint4(0, 0, 0, 0);
    uint2* dst = reinterpret_cast<uint2*>(qT + h * kQtLd + d0);
    dst[0] = make_uint2(v.x, v.y), dst[1] = make_uint2(v.z, v.w);
  }
  for (int64_t h = threadIdx.x; h < kIdxMaxHeads; h += blockDim.x)
    wk[h] = h < p.heads ? b2f(p.w[i * p.heads + h]) * p.wscale * p.scale : 0.0f;
  __syncthreads();
  const float w_lo = wk[(warp % 4) * 16 + lane / 4], w_hi = wk[(warp % 4) * 16 + lane / 4 + 8];
  int64_t vis = (p.off + i + 1) / 4;
  if (vis > p.rows) vis = p.rows;
  const bool masked = !p.one_token;
  if (p.block > 0) {
    // Stage one, the block means (float32 rows: CUDA cores, in the CPU engine's order).
    const int64_t nb = p.rows / p.block, kb = p.keep < nb ? p.keep : nb, cand = kb * p.block;
    const int64_t n2 = pow2_at_least(nb);
    for (int64_t j0 = 4 * warp; j0 < n2; j0 += 4 * nw) {
      float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (j0 < nb) score_means4(p.rep, nb, j0, qT, wk, p.heads, lane, s);
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int64_t j = j0 + r;
        if (lane == r && j < n2)
          keys[j] =
              j < nb ? order_key(masked && !(j * p.block < vis) ? -1e30f : s[r], uint32_t(j)) : 0;
      }
    }
    sort_desc(keys, n2);
    // Stage two, the rows of the kept blocks (their order does not matter for the set).
    for (int64_t b = threadIdx.x; b < kb; b += blockDim.x) blocks[b] = key_index(keys[b]);
    __syncthreads();
    // Candidate c is row c % block of kept block c / block; c < kIdxMaxSort, so a 32-bit division
    // (a 64-bit one by the run-time block size was a call a row).
    const uint32_t block = static_cast<uint32_t>(p.block);
    auto pos_of = [&](int64_t c) {
      const uint32_t cc = static_cast<uint32_t>(c);
      return int64_t(blocks[cc / block]) * block + cc % block;
    };
    score_rows_mma(
        cand, pow2_at_least(cand), [&](int64_t c) { return p.pooled + pos_of(c) * kIdxDim; },
        [&](int64_t c, float s) {
          const int64_t pos = pos_of(c);
          return order_key(masked && !(pos < vis) ? -1e30f : s, uint32_t(pos));
        },
        qT, w_lo, w_hi, sc, p.q, keys);
    sort_desc(keys, pow2_at_least(cand));
  } else {
    score_rows_mma(
        p.rows, pow2_at_least(p.rows), [&](int64_t r) { return p.pooled + r * kIdxDim; },
        [&](int64_t r, float s) {
          return order_key(masked && !(r < vis) ? -FLT_MAX : s, uint32_t(r));
        },
        qT, w_lo, w_hi, sc, p.q, keys);
    sort_desc(keys, pow2_at_least(p.rows));
  }
  for (int64_t t = threadIdx.x; t < p.k; t += blockDim.x) topk[i * p.k + t] = key_index(keys[t]);
}

__global__ void block_means_kernel(const uint16_t* pooled, int64_t nb, int64_t block,
                                   bool one_token, float* rep) {
  const int64_t id = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (id >= nb * kIdxDim) return;
  const int64_t j = id / kIdxDim, d = id % kIdxDim;
  float acc = 0.0f;
  for (int64_t r = 0; r < block; ++r)
    acc = __fadd_rn(acc, b2f(pooled[(j * block + r) * kIdxDim + d]));
  if (one_token)
    rep[id] = rb(__fmul_rn(rb(acc), rb(__fdiv_rn(1.0f, float(block)))));
  else
    rep[id] = __fmul_rn(acc, __fdiv_rn(1.0f, float(block)));
}

}  // namespace

Status check_index_select(int64_t rows, int64_t block, int64_t keep) {
  const int64_t keys = index_sort_keys(rows, block, keep);
  if (pow2_at_least(keys) <= kIdxMaxSort) return Status::ok();
  return failed_precondition("the CUDA indexer sorts at most " + std::to_string(kIdxMaxSort) +
                             " keys per query; " + std::to_string(rows) + " compressed rows" +
                             (block > 0 ? " with HISA blocks of " + std::to_string(block) +
                                              ", keeping " + std::to_string(keep)
                                        : std::string(" without HISA")) +
                             " need " + std::to_string(keys));
}

void index_select(const IndexSelectParams& p, uint32_t* topk, cudaStream_t stream) {
  if (p.m == 0) return;
  HETERO_CHECK(p.heads <= kIdxMaxHeads);
  HETERO_CHECK(pow2_at_least(index_sort_keys(p.rows, p.block, p.keep)) <= kIdxMaxSort);
  const size_t bytes = idx_smem(p).bytes;
  static bool configured = false;
  if (!configured) {
    cudaFuncSetAttribute(index_select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         200 * 1024);
    configured = true;
  }
  index_select_kernel<<<static_cast<unsigned>(p.m), kIdxThreads, bytes, stream>>>(p, topk);
}

void hisa_block_means(const uint16_t* pooled, int64_t rows, int64_t block, bool one_token,
                      float* rep, cudaStream_t stream) {
  const int64_t nb = rows / block;
  if (nb > 0)
    block_means_kernel<<<blocks_for(nb * kIdxDim, 256), 256, 0, stream>>>(pooled, nb, block,
                                                                          one_token, rep);
}

}  // namespace hetero::cuda
