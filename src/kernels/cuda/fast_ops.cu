// The GPU prefill engine's kernels. See fast_ops.h.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <type_traits>

#include "kernels/cuda/fast_ops.h"
#include "kernels/cuda/mma_sm80.cuh"

namespace hetero::cuda {
namespace {

using namespace mma;

__device__ __forceinline__ float bf(uint16_t v) { return __uint_as_float(uint32_t(v) << 16); }
__device__ __forceinline__ uint16_t to_bf(float f) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}
__device__ __forceinline__ float round_bf(float f) { return bf(to_bf(f)); }

// Sum (or max) over the block; blockDim.x a multiple of 32, at most 1024.
template <bool kMax>
__device__ float block_reduce(float v, float* shared32) {
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = kMax ? fmaxf(v, w) : v + w;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();  // shared32 may still be read by a previous call
  if (lane == 0) shared32[warp] = v;
  __syncthreads();
  float r = 0.f;  // a neutral start for both: the maxima taken here are of absolute values
  for (int i = 0; i < warps; ++i) r = kMax ? fmaxf(r, shared32[i]) : r + shared32[i];
  return r;
}

__global__ void embed_kernel(const uint16_t* table, const int32_t* ids, int64_t hidden,
                             uint16_t* out) {
  const int64_t t = blockIdx.x;
  const uint16_t* src = table + static_cast<int64_t>(ids[t]) * hidden;
  for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) out[t * hidden + j] = src[j];
}

// One block per row.
__global__ void add_rms_norm_kernel(uint16_t* h, const uint16_t* delta, const uint16_t* x_in,
                                    int64_t d, const uint16_t* w, float eps, uint16_t* out) {
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  const uint16_t* x = x_in ? x_in + row * d : h + row * d;
  float ss = 0.f;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    float v = bf(x[j]);
    if (delta) {
      v = round_bf(v + bf(delta[row * d + j]));
      h[row * d + j] = to_bf(v);
    }
    ss += v * v;
  }
  if (!w) return;
  const float r = rsqrtf(block_reduce<false>(ss, red) / static_cast<float>(d) + eps);
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    const float v = delta ? bf(h[row * d + j]) : bf(x[j]);
    out[row * d + j] = to_bf(round_bf(v * r) * bf(w[j]));
  }
}

// One block per (token, head) of q, k and v; d/2 threads, thread i owns elements i and i+d/2.
__global__ void qkv_rope_store_kernel(const uint16_t* qkv, int heads, int kv_heads, int d,
                                      int64_t pos0, RopeTable rope, QkvBiasNorm extra,
                                      uint16_t* q_out, const KvPageRef* pages, bool fp8,
                                      bool token_major) {
  __shared__ float red[32];
  const int64_t t = blockIdx.x;
  const int hh = blockIdx.y;  // [0, heads): q; [heads, heads+kv_heads): k and v
  const int half = d / 2, i = threadIdx.x;
  const int64_t width = static_cast<int64_t>(heads + 2 * kv_heads) * d;
  const bool is_q = hh < heads;
  const int head = is_q ? hh : hh - heads;
  const uint16_t* src = qkv + t * width + (is_q ? int64_t(head) * d : int64_t(heads + head) * d);
  const uint16_t* bias = is_q ? extra.bq : extra.bk;
  const uint16_t* norm = is_q ? extra.q_norm : extra.k_norm;
  // This thread's rotated pair: (i, i + half), or (2i, 2i + 1) for a traditional rope.
  const int a = rope.traditional ? 2 * i : i, b = rope.traditional ? 2 * i + 1 : i + half;
  float x1 = bf(src[a]), x2 = bf(src[b]);
  if (bias) x1 = round_bf(x1 + bf(bias[head * d + a])), x2 = round_bf(x2 + bf(bias[head * d + b]));
  if (norm) {
    const float r = rsqrtf(block_reduce<false>(x1 * x1 + x2 * x2, red) / d + extra.eps);
    x1 = round_bf(round_bf(x1 * r) * bf(norm[a]));
    x2 = round_bf(round_bf(x2 * r) * bf(norm[b]));
  }
  if (rope.scales_input) x1 = round_bf(x1 * rope.input_scale), x2 = round_bf(x2 * rope.input_scale);
  const float pos = static_cast<float>(pos0 + t) * rope.scale;
  float sn, cs;
  sincosf(pos * rope.inv[i], &sn, &cs);
  const float y1 = x1 * cs - x2 * sn, y2 = x1 * sn + x2 * cs;
  if (is_q) {
    uint16_t* dst = q_out + (t * heads + head) * d;
    dst[a] = to_bf(y1), dst[b] = to_bf(y2);
    return;
  }
  const int64_t p = pos0 + t;
  const KvPageRef pg = pages[p / kKvPageTokens];
  const int64_t row = p % kKvPageTokens;
  const int64_t slot = token_major ? row * kv_heads + head : int64_t(head) * kKvPageTokens + row;
  const uint16_t* vsrc = qkv + t * width + int64_t(heads + kv_heads + head) * d;
  float v1 = bf(vsrc[i]), v2 = bf(vsrc[i + half]);
  if (extra.bv)
    v1 = round_bf(v1 + bf(extra.bv[head * d + i])),
    v2 = round_bf(v2 + bf(extra.bv[head * d + i + half]));
  const float k1 = round_bf(y1), k2 = round_bf(y2);
  if (!fp8) {
    uint16_t* kd = static_cast<uint16_t*>(pg.k) + slot * d;
    uint16_t* vd = static_cast<uint16_t*>(pg.v) + slot * d;
    kd[a] = to_bf(k1), kd[b] = to_bf(k2), vd[i] = to_bf(v1), vd[i + half] = to_bf(v2);
    return;
  }
  const float ka = block_reduce<true>(fmaxf(fabsf(k1), fabsf(k2)), red);
  const float va = block_reduce<true>(fmaxf(fabsf(v1), fabsf(v2)), red);
  const float ks = ka > 0.f ? ka / 448.f : 1.f, vs = va > 0.f ? va / 448.f : 1.f;
  __nv_fp8_e4m3* kd = static_cast<__nv_fp8_e4m3*>(pg.k) + slot * d;
  __nv_fp8_e4m3* vd = static_cast<__nv_fp8_e4m3*>(pg.v) + slot * d;
  kd[a] = __nv_fp8_e4m3(k1 / ks), kd[b] = __nv_fp8_e4m3(k2 / ks);
  vd[i] = __nv_fp8_e4m3(v1 / vs), vd[i + half] = __nv_fp8_e4m3(v2 / vs);
  if (i == 0) pg.k_scale[slot] = ks, pg.v_scale[slot] = vs;
}

__global__ void silu_mul_kernel(const uint16_t* gate_up, int64_t n, int64_t inter, uint16_t* out) {
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= n * inter) return;
  const int64_t t = idx / inter, j = idx % inter;
  const float g = bf(gate_up[t * 2 * inter + j]), u = bf(gate_up[t * 2 * inter + inter + j]);
  const float silu = round_bf(g / (1.f + expf(-g)));
  out[idx] = to_bf(silu * u);
}

// ---- attention: flash loop on mma.sync m16n8k16 (bf16 in, f32 accumulate) ----
// Block: 8 warps, 128 query rows of one head (16 per warp); key tiles of 64 = one cache page,
// staged into shared memory as bf16 rows (FP8 dequantized on the way), two buffers deep: the next
// page's loads are in flight while the current one is multiplied. Fragment layouts: mma_sm80.cuh.
// K and V fragments come from shared memory through ldmatrix (V transposed by ldmatrix.trans).
constexpr int kWarps = 8, kRows = 16 * kWarps, kKeys = kKvPageTokens;

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ uint32_t ld32(const uint16_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// One thread's share of a page: kChunks chunks of 8 elements of K and of V, raw.
template <int D, bool kFp8>
struct Staged {
  static constexpr int kChunks = kKeys * D / 8 / (kWarps * 32);
  using Raw = typename std::conditional<kFp8, uint2, uint4>::type;
  Raw k[kChunks], v[kChunks];
  float ks[kChunks], vs[kChunks];
  bool valid[kChunks];

  __device__ void load(const KvPageRef& pg, int kvh, int64_t key0, int64_t total) {
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int e = threadIdx.x + i * kWarps * 32, r = e / (D / 8), c8 = (e % (D / 8)) * 8;
      const int64_t row = int64_t(kvh) * kKeys + r;
      valid[i] = key0 + r < total;
      if (!valid[i]) continue;
      if constexpr (kFp8) {
        k[i] = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(pg.k) + row * D + c8);
        v[i] = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(pg.v) + row * D + c8);
        ks[i] = pg.k_scale[row], vs[i] = pg.v_scale[row];
      } else {
        k[i] = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(pg.k) + row * D + c8);
        v[i] = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(pg.v) + row * D + c8);
      }
    }
  }
  __device__ static uint4 widen(const uint2& raw, float scale) {
    const __nv_fp8_e4m3* b = reinterpret_cast<const __nv_fp8_e4m3*>(&raw);
    uint4 o;
    o.x = pack_bf2(float(b[0]) * scale, float(b[1]) * scale);
    o.y = pack_bf2(float(b[2]) * scale, float(b[3]) * scale);
    o.z = pack_bf2(float(b[4]) * scale, float(b[5]) * scale);
    o.w = pack_bf2(float(b[6]) * scale, float(b[7]) * scale);
    return o;
  }
  __device__ void store(uint16_t* sk, uint16_t* sv, int pitch) const {
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int e = threadIdx.x + i * kWarps * 32, r = e / (D / 8), c8 = (e % (D / 8)) * 8;
      uint4 kk = make_uint4(0, 0, 0, 0), vv = kk;
      if (valid[i]) {
        if constexpr (kFp8) {
          kk = widen(k[i], ks[i]), vv = widen(v[i], vs[i]);
        } else {
          kk = k[i], vv = v[i];
        }
      }
      *reinterpret_cast<uint4*>(sk + r * pitch + c8) = kk;
      *reinterpret_cast<uint4*>(sv + r * pitch + c8) = vv;
    }
  }
};

template <int D, bool kFp8>
__global__ void __launch_bounds__(kWarps * 32)
    attention_kernel(const uint16_t* __restrict__ q, int64_t n, int heads, int kv_heads,
                     int64_t pos0, float scale_log2, const KvPageRef* __restrict__ pages,
                     int64_t window, uint16_t* __restrict__ out) {
  constexpr int kPitch = D + 8;  // 16-byte rows land in distinct banks for ldmatrix
  extern __shared__ __align__(16) uint16_t smem[];
  // Buffer b: K at smem + 2b * tile, V at smem + (2b + 1) * tile.
  constexpr int kTile = kKeys * kPitch;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int h = blockIdx.y, kvh = h / (heads / kv_heads);
  const int64_t row0 = int64_t(blockIdx.x) * kRows + warp * 16;  // this warp's first row
  const int64_t total = pos0 + n;                                // valid cache rows
  const int64_t block_last = min(int64_t(blockIdx.x) * kRows + kRows, n) - 1;
  const int64_t tiles = (pos0 + block_last + 1 + kKeys - 1) / kKeys;
  const bool active = row0 < n;
  const int64_t qp_lo = pos0 + row0 + g, qp_hi = qp_lo + 8;
  const int64_t warp_first_q = pos0 + row0;  // this warp's smallest and largest query positions
  const int64_t warp_last_q = pos0 + min(row0 + 15, n - 1);
  // With a window (> 0) a query at p sees keys (p - window, p]: tiles before the block's first
  // query's window are never loaded, and a warp skips those before its own.
  const int64_t kt0 =
      window > 0 ? max(int64_t(0), pos0 + int64_t(blockIdx.x) * kRows - window + 1) / kKeys : 0;
  const int64_t warp_first_key = window > 0 ? warp_first_q - window + 1 : 0;

  uint32_t qa[D / 16][4];
  {
    const int64_t r_lo = row0 + g, r_hi = row0 + g + 8;
    const uint16_t* q_lo = q + (r_lo * heads + h) * D;
    const uint16_t* q_hi = q + (r_hi * heads + h) * D;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      qa[ks][0] = r_lo < n ? ld32(q_lo + ks * 16 + 2 * c) : 0u;
      qa[ks][1] = r_hi < n ? ld32(q_hi + ks * 16 + 2 * c) : 0u;
      qa[ks][2] = r_lo < n ? ld32(q_lo + ks * 16 + 8 + 2 * c) : 0u;
      qa[ks][3] = r_hi < n ? ld32(q_hi + ks * 16 + 8 + 2 * c) : 0u;
    }
  }
  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;

  Staged<D, kFp8> st;
  st.load(pages[kt0], kvh, kt0 * kKeys, total);
  st.store(smem, smem + kTile, kPitch);
  __syncthreads();
  // ldmatrix lane roles: matrix mi = lane/8, its row lane%8.
  const int mi = lane / 8, mr = lane % 8;
  for (int64_t kt = kt0; kt < tiles; ++kt) {
    const int buf = int((kt - kt0) & 1);
    if (kt + 1 < tiles) st.load(pages[kt + 1], kvh, (kt + 1) * kKeys, total);
    const int64_t key0 = kt * kKeys;
    // warp-uniform: mma and ldmatrix need every lane
    if (active && key0 <= warp_last_q && key0 + kKeys > warp_first_key) {
      const uint16_t* K = smem + 2 * buf * kTile;
      const uint16_t* V = K + kTile;
      float s[8][4];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ks += 2) {
          uint32_t b[4];  // b0, b1 of k-step ks, then of ks + 1
          ldsm_x4(b, K + (j * 8 + mr) * kPitch + ks * 16 + mi * 8);
          mma16816(s[j], qa[ks], b[0], b[1]);
          mma16816(s[j], qa[ks + 1], b[2], b[3]);
        }
      }
      // Scale into log2 units; mask where the tile reaches the diagonal or the cache's end.
      const bool need_mask = key0 + kKeys - 1 > warp_first_q || key0 + kKeys > total ||
                             (window > 0 && key0 <= warp_last_q - window);
      float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float v = s[j][e] * scale_log2;
          if (need_mask) {
            const int64_t kp = key0 + j * 8 + 2 * c + (e & 1);
            const int64_t qp = e < 2 ? qp_lo : qp_hi;
            if (kp > qp || kp >= total || (window > 0 && kp <= qp - window)) v = -INFINITY;
          }
          s[j][e] = v;
          if (e < 2)
            mx_lo = fmaxf(mx_lo, v);
          else
            mx_hi = fmaxf(mx_hi, v);
        }
      }
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
      const float mn_lo = fmaxf(m_lo, mx_lo), mn_hi = fmaxf(m_hi, mx_hi);
      // A row with nothing visible yet keeps max -inf: base 0 makes every exp2 0.
      const float b_lo = mn_lo == -INFINITY ? 0.f : mn_lo, b_hi = mn_hi == -INFINITY ? 0.f : mn_hi;
      const float a_lo = fast_exp2(m_lo - b_lo), a_hi = fast_exp2(m_hi - b_hi);
      m_lo = mn_lo, m_hi = mn_hi;
      float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        s[j][0] = fast_exp2(s[j][0] - b_lo), s[j][1] = fast_exp2(s[j][1] - b_lo);
        s[j][2] = fast_exp2(s[j][2] - b_hi), s[j][3] = fast_exp2(s[j][3] - b_hi);
        sum_lo += s[j][0] + s[j][1], sum_hi += s[j][2] + s[j][3];
      }
      l_lo = l_lo * a_lo + sum_lo, l_hi = l_hi * a_hi + sum_hi;
#pragma unroll
      for (int j = 0; j < D / 8; ++j)
        o[j][0] *= a_lo, o[j][1] *= a_lo, o[j][2] *= a_hi, o[j][3] *= a_hi;
#pragma unroll
      for (int kc = 0; kc < 4; ++kc) {
        uint32_t pa[4];
        pa[0] = pack_bf2(s[2 * kc][0], s[2 * kc][1]);
        pa[1] = pack_bf2(s[2 * kc][2], s[2 * kc][3]);
        pa[2] = pack_bf2(s[2 * kc + 1][0], s[2 * kc + 1][1]);
        pa[3] = pack_bf2(s[2 * kc + 1][2], s[2 * kc + 1][3]);
#pragma unroll
        for (int j = 0; j < D / 8; j += 2) {
          uint32_t b[4];  // d-block j: keys 0-7, 8-15; then d-block j + 1
          ldsm_x4_trans(b, V + (kc * 16 + (mi % 2) * 8 + mr) * kPitch + (j + mi / 2) * 8);
          mma16816(o[j], pa, b[0], b[1]);
          mma16816(o[j + 1], pa, b[2], b[3]);
        }
      }
    }
    if (kt + 1 < tiles)
      st.store(smem + 2 * (buf ^ 1) * kTile, smem + (2 * (buf ^ 1) + 1) * kTile, kPitch);
    __syncthreads();
  }
  if (!active) return;
  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
  const float inv_lo = 1.f / l_lo, inv_hi = 1.f / l_hi;
  const int64_t r_lo = row0 + g, r_hi = row0 + g + 8;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    const int col = j * 8 + 2 * c;
    if (r_lo < n)
      *reinterpret_cast<uint32_t*>(out + (r_lo * heads + h) * D + col) =
          pack_bf2(o[j][0] * inv_lo, o[j][1] * inv_lo);
    if (r_hi < n)
      *reinterpret_cast<uint32_t*>(out + (r_hi * heads + h) * D + col) =
          pack_bf2(o[j][2] * inv_hi, o[j][3] * inv_hi);
  }
}

template <int D, bool kFp8>
void launch_attention(const uint16_t* q, int64_t n, int heads, int kv_heads, int64_t pos0,
                      float scale_log2, const KvPageRef* pages, int64_t window, uint16_t* out,
                      cudaStream_t stream) {
  constexpr size_t smem = 4 * kKeys * (D + 8) * sizeof(uint16_t);
  static bool configured = false;  // the attribute is per function; setting it twice is harmless
  if (!configured) {
    cudaFuncSetAttribute(attention_kernel<D, kFp8>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(smem));
    configured = true;
  }
  const dim3 grid(static_cast<unsigned>((n + kRows - 1) / kRows), static_cast<unsigned>(heads));
  attention_kernel<D, kFp8><<<grid, kWarps * 32, smem, stream>>>(q, n, heads, kv_heads, pos0,
                                                                 scale_log2, pages, window, out);
}

__global__ void iota_i32_kernel(int32_t* dst, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) dst[i] = static_cast<int32_t>(i);
}

__global__ void set_i32_pair_kernel(int32_t* dst, int32_t a, int32_t b) { dst[0] = a, dst[1] = b; }

int threads_for(int64_t d) {
  int t = 32;
  while (t < d && t < 1024) t *= 2;
  return t;
}

}  // namespace

void embed_rows(const uint16_t* table, const int32_t* ids, int64_t n, int64_t hidden, uint16_t* out,
                cudaStream_t stream) {
  if (n == 0) return;
  embed_kernel<<<static_cast<unsigned>(n), 256, 0, stream>>>(table, ids, hidden, out);
}

void rms_norm_rows(const uint16_t* x, int64_t m, int64_t d, const uint16_t* w, float eps,
                   uint16_t* out, cudaStream_t stream) {
  if (m == 0) return;
  add_rms_norm_kernel<<<static_cast<unsigned>(m), threads_for(d / 4), 0, stream>>>(
      nullptr, nullptr, x, d, w, eps, out);
}

void add_rms_norm_rows(uint16_t* h, const uint16_t* delta, int64_t m, int64_t d, const uint16_t* w,
                       float eps, uint16_t* out, cudaStream_t stream) {
  if (m == 0) return;
  add_rms_norm_kernel<<<static_cast<unsigned>(m), threads_for(d / 4), 0, stream>>>(
      h, delta, nullptr, d, w, eps, out);
}

void qkv_rope_store(const uint16_t* qkv, int64_t n, int heads, int64_t pos0, const RopeTable& rope,
                    const QkvBiasNorm& extra, uint16_t* q, const PagedKvView& kv,
                    cudaStream_t stream) {
  if (n == 0) return;
  const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(heads + kv.kv_heads));
  qkv_rope_store_kernel<<<grid, kv.head_dim / 2, 0, stream>>>(
      qkv, heads, kv.kv_heads, kv.head_dim, pos0, rope, extra, q, kv.pages,
      kv.dtype == KvDtype::kFp8, kv.token_major);
}

void silu_mul_halves(const uint16_t* gate_up, int64_t n, int64_t inter, uint16_t* out,
                     cudaStream_t stream) {
  const int64_t total = n * inter;
  if (total == 0) return;
  silu_mul_kernel<<<static_cast<unsigned>((total + 255) / 256), 256, 0, stream>>>(gate_up, n, inter,
                                                                                  out);
}

bool attention_paged_supports(int head_dim) { return head_dim == 64 || head_dim == 128; }

void attention_paged(const uint16_t* q, int64_t n, int heads, int64_t pos0, float scale,
                     const PagedKvView& kv, uint16_t* out, cudaStream_t stream, int64_t window) {
  if (n == 0) return;
  const float scale_log2 = scale * 1.4426950408889634f;
  const bool fp8 = kv.dtype == KvDtype::kFp8;
  const int kvh = kv.kv_heads;
  if (kv.head_dim == 64) {
    if (fp8)
      launch_attention<64, true>(q, n, heads, kvh, pos0, scale_log2, kv.pages, window, out, stream);
    else
      launch_attention<64, false>(q, n, heads, kvh, pos0, scale_log2, kv.pages, window, out,
                                  stream);
  } else {
    if (fp8)
      launch_attention<128, true>(q, n, heads, kvh, pos0, scale_log2, kv.pages, window, out,
                                  stream);
    else
      launch_attention<128, false>(q, n, heads, kvh, pos0, scale_log2, kv.pages, window, out,
                                   stream);
  }
}

void iota_i32(int32_t* dst, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  iota_i32_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(dst, n);
}

void set_i32_pair(int32_t* dst, int32_t a, int32_t b, cudaStream_t stream) {
  set_i32_pair_kernel<<<1, 1, 0, stream>>>(dst, a, b);
}

}  // namespace hetero::cuda
