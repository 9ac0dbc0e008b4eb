// w4a8_grouped_gemm.h: the kernel (cp.async stages, FP4 widened into swizzled shared memory,
// wgmma with both operands in shared memory, per-128-K promotion), the block exponents, and the
// launch (argument staging, the tile list). Built for sm_90a (wgmma).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "kernels/cuda/fp4_widen.cuh"
#include "kernels/cuda/fp8_gemm.h"
#include "kernels/cuda/w4a8_grouped_gemm.h"

namespace hetero::cuda {
namespace {

constexpr int kBK = 128;  // k per stage: one promotion interval
// cp.async stages of raw operands; the widened tiles are double-buffered, so the producer runs
// one k tile ahead of the consumers. Three buffers and five stages (with the codes' rows swizzled
// against bank conflicts) measured slower: 4.33 against 4.05 ms for the 128x128 tile at Flash's
// w1|w3 and 8K tokens (RESULTS §43).
constexpr int kStages = 4;
constexpr int kMaxKBlocks = 64;
// Tiles whose block exponents a block holds at once: the copies run up to kStages - 1 items (so
// tiles) ahead of the widening.
constexpr int kTileRing = kStages;
static_assert(kTileRing >= kStages, "a ring slot is rewritten kTileRing tiles on");
// A block of BM weight rows by BN rows of a group. Each consumer warp group takes 64 weight rows
// (one wgmma's M) by up to 128 of the group's rows (its N): BM / 64 of them along the weight rows
// and, past 128 group rows, BN / 128 along those. The 64x256 tile's two consumer warp groups so
// share one widened weight tile: the producers widen 64 weight rows a k tile for as many MMAs as
// the 128x128 tile's 128 rows feed, and an expert of up to 256 rows widens its weights once.
template <int BM, int BN>
struct Tile {
  static constexpr int kWgM = BM / 64;                  // consumer warp groups along weight rows
  static constexpr int kWgN = BN > 128 ? BN / 128 : 1;  // and along the group's rows
  static constexpr int kWN = BN / kWgN;                 // a consumer warp group's group rows
  static constexpr int kConsumerGroups = kWgM * kWgN;
  static constexpr int kConsumers = 128 * kConsumerGroups;
  // Two producer warp groups: with one, the 128x128 tile took 4.45 ms for 8K tokens' w1|w3 at
  // Flash's shapes, with two 4.05 (the producers' latency, not the tensor cores, set the pace).
  static constexpr int kProducers = 256;
  static constexpr int kThreads = kConsumers + kProducers;
  // Past 384 threads the launch's registers (65,536 / threads) are too few for a consumer's two
  // accumulators: the producers give some back (setmaxnreg), the consumers take them.
  static constexpr bool kShiftRegs = kThreads > 384;
  static constexpr int kProducerRegs = 88;
  static constexpr int kConsumerRegs = (65536 - kProducers * kProducerRegs) / kConsumers / 8 * 8;
  static constexpr int kRawBytes = BM * kBK / 2;        // FP4 codes of a stage
  static constexpr int kRawScaleBytes = BM * kBK / 32;  // their group exponents
  static constexpr int kWideBytes = BM * kBK;           // the widened e4m3 tile
  static constexpr int kOutPitch = BM + 8;              // epilogue staging row, in bf16
  static constexpr int kSmem = 1024 /* alignment slack */ + 2 * kWideBytes +
                               kStages * (BN * kBK + kRawBytes + kRawScaleBytes + BN * 4) +
                               2 * BN * 4 + BN * kOutPitch * 2 + kTileRing * (kMaxKBlocks + 1);
  static_assert(kWN == 64 || kWN == 128, "a consumer warp group's wgmma N");
  // The named barriers below: a FULL and an EMPTY per buffer and consumer warp group, ids 3-10,
  // an epilogue's per consumer warp group, 11-12.
  static_assert(kConsumerGroups <= 2, "named barriers for two consumer warp groups");
  static_assert(BN <= kProducers && BM <= kProducers, "a producer thread per column and row");
  static_assert(kSmem < 227 * 1024, "sm_90's shared memory a block");
};

struct DevGroup {  // W4a8Group as the kernel reads it
  const uint8_t* act_q;
  const float* act_scale;
  uint16_t* out;
  int32_t rows, expert;
};

struct Params {
  const DevGroup* groups;
  const int32_t* cta_start;  // [count + 1]: each group's first tile
  int32_t count, n, k;
  int32_t tiles;  // cta_start[count]
  const uint8_t* codes;
  const uint8_t* scales;
  const uint8_t* block_max;
  unsigned long long* lossy;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// Shared memory written by ordinary stores and cp.async, read next by the tensor cores (the
// async proxy), needs this in each writing thread before the barrier.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// A K-major operand tile in shared memory, rows of 128 bytes with the 128-byte swizzle (the
// 16-byte chunk c of row r stored at chunk c ^ (r % 8)), 8-row groups 1024 bytes apart. The
// address field is the shared address / 16 in 14 bits; shared memory is under 256 KiB, so the
// descriptor of address + offset is this one plus offset / 16 (no carry into the bits above).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3ffff) >> 4) | (uint64_t{1} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}
__device__ __forceinline__ int sw128(int r, int chunk) {
  return r * 128 + ((chunk ^ (r & 7)) << 4);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait_all() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d (64 x N float32, wgmma's accumulator fragment) = or += A (64 x 32, e4m3, K-major) · B^T
// (N x 32, e4m3, K-major), both from shared memory through their descriptors.
__device__ __forceinline__ void wgmma_m64n64k32(float (&d)[32], uint64_t a, uint64_t b,
                                                int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31"
      "}, %32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_m64n128k32(float (&d)[64], uint64_t a, uint64_t b,
                                                 int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, "
      "%40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(a), "l"(b), "r"(accumulate));
}

template <int N>
__device__ __forceinline__ void wgmma_k32(float (&d)[N / 2], uint64_t a, uint64_t b, int acc) {
  if constexpr (N == 64)
    wgmma_m64n64k32(d, a, b, acc);
  else
    wgmma_m64n128k32(d, a, b, acc);
}

// Named barriers (bar.sync / bar.arrive with a thread count; 0 is __syncthreads): the
// producers' own, and per widened buffer b and consumer warp group c a FULL (the producers
// arrive, the warp group waits) and an EMPTY (the other way round), and per consumer warp group
// its epilogue's. One pair per warp group, not per block, so that the two warp groups need not
// run in step: one's promotion can overlap the other's wgmma, one's epilogue the other's loop.
constexpr int kBarProducer = 1;
__device__ __forceinline__ int bar_full(int b, int c) { return 3 + 2 * b + c; }
__device__ __forceinline__ int bar_empty(int b, int c) { return 7 + 2 * b + c; }
__device__ __forceinline__ int bar_epilogue(int c) { return 11 + c; }
__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Which tile a launch's tile number is: the group by binary search over the groups' first tiles,
// then the weight rows (slower) and the group's rows (faster: a group's row tiles of one weight
// tile run side by side and share it through L2).
struct TileAt {
  int group, nt, m0, n0;
};
template <int BM, int BN>
__device__ __forceinline__ TileAt tile_at(const Params& p, int tile) {
  int lo = 0, hi = p.count;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (__ldg(p.cta_start + mid) <= tile)
      lo = mid;
    else
      hi = mid;
  }
  const int rows = __ldg(&p.groups[lo].rows);
  const int row_tiles = (rows + BN - 1) / BN, local = tile - __ldg(p.cta_start + lo);
  const int nt = local % row_tiles;
  return {lo, nt, (local / row_tiles) * BM, nt * BN};
}

// Warp-specialized: the consumer warp groups (each 64 weight rows by kWN group rows: wgmma and the
// promotion) and two producer warp groups last (the cp.async copies, the widening and the
// promotion factors), handing widened tiles over through two buffers and named barriers. In one
// loop that did both (all warps copying and widening around a block-wide barrier), two warps a
// scheduler left the loop latency-bound on shared memory and the tensor cores idle through every
// widening and promotion (RESULTS §42).
//
// A block takes tiles blockIdx.x, + gridDim.x, ... (one where the launch has a block a tile;
// persistent where it has fewer). Its tiles' k tiles make one sequence of items, numbered across
// tiles: the stages, the widened buffers and the barriers' phases follow the item, so the
// producers copy and widen the next tile's first k tiles while the consumers finish this one's
// (no pipeline to fill again, no launch a tile). The bookkeeping costs the producers' loop 18-28
// instructions a k tile (`make sass`). A second instantiation without it (a block a tile only)
// was leaner for the 64-row tiles, but ptxas spilled the 128x128 one's producers into local
// memory inside the loop.
template <int BM, int BN>
__global__ void __launch_bounds__(Tile<BM, BN>::kThreads, 1) w4a8_grouped_kernel(const Params p) {
  using T = Tile<BM, BN>;
  constexpr int kConsumers = T::kConsumers, kRawBytes = T::kRawBytes;
  constexpr int kProducers = T::kProducers;
  constexpr int kConsumerGroups = T::kConsumerGroups, kWgM = T::kWgM, kWN = T::kWN;
  constexpr int kPair = kProducers + 128;  // a FULL's or EMPTY's threads
  constexpr int kRawScaleBytes = T::kRawScaleBytes, kWideBytes = T::kWideBytes;
  constexpr int kOutPitch = T::kOutPitch;
  extern __shared__ uint8_t smem_raw[];
  // Aligned to 1024 bytes (the 128-byte swizzle's period) by an offset into the shared array, not
  // by rounding a generic pointer: the compiler then knows every pointer below is shared memory
  // and emits 32-bit shared loads and stores instead of generic ones with 64-bit addresses.
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint8_t* wide = smem;                         // [2][BM][128], swizzled
  uint8_t* b_tile = wide + 2 * kWideBytes;      // [stages][BN][128], swizzled
  uint8_t* raw = b_tile + kStages * BN * kBK;   // [stages][BM][64]
  uint8_t* raw_sc = raw + kStages * kRawBytes;  // [stages][BM][4]
  float* act_sc = reinterpret_cast<float*>(raw_sc + kStages * kRawScaleBytes);  // [stages][BN]
  float* scale = act_sc + kStages * BN;  // [2][BN]: activation scale x weight block's scale
  // The epilogue's [BN][kOutPitch] bf16: its own, so that the producers go on copying the next
  // tile's rows into the stages meanwhile.
  uint16_t* out_stage = reinterpret_cast<uint16_t*>(scale + 2 * BN);
  // [kTileRing][kMaxKBlocks + 1]: a tile's block exponents (and whether it is its weight tile's
  // first row tile), written as the copies enter the tile, read by the widening.
  uint8_t* ring = reinterpret_cast<uint8_t*>(out_stage + BN * kOutPitch);

  const int tid = static_cast<int>(threadIdx.x);
  const int n = p.n, k = p.k, kt_count = k / kBK;
  const int my_tiles = (p.tiles - static_cast<int>(blockIdx.x) + static_cast<int>(gridDim.x) - 1) /
                       static_cast<int>(gridDim.x);
  const int items = my_tiles * kt_count;
  auto tile_of = [&](int j) {
    return tile_at<BM, BN>(p, static_cast<int>(blockIdx.x) + j * static_cast<int>(gridDim.x));
  };

  if (tid >= kConsumers) {
    // The producers. Per item it: wait for its copies, widen it into wide[it % 2] with its
    // promotion factors into scale[it % 2], hand it over (FULL), then wait until the consumers
    // are done with item it - 1 (EMPTY) and refill that item's stage with item it + stages - 1.
    // So they widen one k tile ahead of the tensor cores, and a buffer they write was released by
    // the consumers the item before.
    if constexpr (T::kShiftRegs)
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(T::kProducerRegs));
    const int pt = tid - kConsumers;  // 0 .. kProducers - 1
    // Each thread copies the same rows and 16-byte chunks of every stage, so the sources and
    // shared offsets are set once a tile (enter), and a k tile only adds its column offset.
    constexpr int kActCopies = BN * 8 / kProducers;   // 16-byte chunks of activation rows a
    constexpr int kActRowStep = kProducers / 8;       // thread, rows apart: a multiple of 8, so
    constexpr int kCodeCopies = BM * 4 / kProducers;  // one swizzle phase; 16-byte chunks of
    constexpr int kCodeRowStep = kProducers / 4;      // codes
    static_assert(kActCopies * kProducers == BN * 8 && kActRowStep % 8 == 0, "act copy layout");
    static_assert(kCodeCopies * kProducers == BM * 4, "code copy layout");
    const int a_row = pt >> 3, a_chunk = pt & 7;
    const uint32_t a_dst = smem_u32(b_tile) + sw128(a_row, a_chunk);  // + i * kActRowStep rows
    const uint32_t c_dst = smem_u32(raw) + pt * 16;  // row pt / 4 of 64 bytes, chunk pt % 4
    const uint8_t* a_src[kActCopies];  // a row past the padded rows copies nothing (size 0) from
    unsigned a_ok = 0;                 // the tile's first row, which exists; bit i: chunk i copies
    const uint8_t *c_src = nullptr, *sc_src = nullptr;
    const float* as_src = nullptr;
    int padded = 0;
    bool as_ok = false;
    // The copies enter tile j: its sources, and its block exponents into the ring (read by the
    // widening at least one producer barrier later; the slot's previous tile, kTileRing back,
    // was widened by every producer before: each tile has at least one item, and the copies run
    // kStages - 1 items ahead).
    auto enter = [&](int j) {
      const TileAt t = tile_of(j);
      const DevGroup G = p.groups[t.group];
      padded = (G.rows + 15) / 16 * 16;
      const size_t wrow = static_cast<size_t>(G.expert) * n + t.m0;
      const uint8_t* aq = G.act_q + static_cast<size_t>(t.n0) * k;
      a_ok = 0;
#pragma unroll
      for (int i = 0; i < kActCopies; ++i) {
        const int r = a_row + i * kActRowStep;
        const bool ok = t.n0 + r < padded;
        a_src[i] = aq + static_cast<size_t>(ok ? r : 0) * k + a_chunk * 16;
        a_ok |= unsigned(ok) << i;
      }
      c_src = p.codes + wrow * (k / 2) + static_cast<size_t>(pt >> 2) * (k / 2) + (pt & 3) * 16;
      sc_src = p.scales + (wrow + (pt < BM ? pt : 0)) * (k / 32);  // pt < BM
      as_ok = pt < BN / 4 && t.n0 + pt * 4 < padded;
      as_src = G.act_scale + t.n0 + (as_ok ? pt * 4 : 0);
      uint8_t* slot = ring + (j % kTileRing) * (kMaxKBlocks + 1);
      if (pt < kt_count)
        slot[pt] = p.block_max[(static_cast<size_t>(G.expert) * ((n + 127) / 128) + t.m0 / 128) *
                                   kt_count +
                               pt];
      if (pt == kProducers - 1) slot[kMaxKBlocks] = t.nt == 0;
    };
    int load_j = 0, load_kt = 0;  // the tile and k tile the next copies are for
    enter(0);
    auto load = [&](int it) {  // item `it`; one commit group per call, empty past the last item
      const int s = it % kStages;
      if (it < items) {
        if (load_kt == kt_count) enter(++load_j), load_kt = 0;
        const int kt = load_kt++;
#pragma unroll
        for (int i = 0; i < kActCopies; ++i)
          cp_async16(a_dst + s * (BN * kBK) + i * (kActRowStep * kBK), a_src[i] + kt * kBK,
                     (a_ok >> i) & 1u);
#pragma unroll
        for (int i = 0; i < kCodeCopies; ++i)
          cp_async16(c_dst + s * kRawBytes + i * (kCodeRowStep * 64),
                     c_src + static_cast<size_t>(i * kCodeRowStep) * (k / 2) + kt * (kBK / 2),
                     true);
        if (pt < BM) cp_async4(smem_u32(raw_sc + s * kRawScaleBytes + pt * 4), sc_src + kt * 4);
        if (pt < BN / 4)
          cp_async16(smem_u32(act_sc + s * BN + pt * 4), as_src + static_cast<size_t>(kt) * padded,
                     as_ok);
      }
      cp_async_commit();
    };
    // Widening: kProducers / BM threads a row, each its groups g0 .. g0 + kGroups - 1 (of 4).
    constexpr int kPerRow = kProducers / BM, kGroups = 4 / kPerRow;
    static_assert(kGroups * kPerRow == 4, "widening layout");
    const int w_row = pt / kPerRow, g0 = (pt % kPerRow) * kGroups;
    const uint8_t* w_codes = raw + w_row * 64 + g0 * 16;  // + the stage's offset
    // A group's two 16-byte chunks 2 g and 2 g + 1 of the row: sw128(row, c) is sw128(row, 0) ^
    // 16 c (the swizzle XORs chunk numbers), so one offset and an XOR each.
    const int w_dst = sw128(w_row, 0);
    auto widen = [&](int it, int mx) {  // returns the groups whose widening was not exact
      const int s = it % kStages;
      uint8_t* dst = wide + (it & 1) * kWideBytes;
      // The row's four exponents in one load; this thread's are bytes g0 ...
      const uint32_t exps =
          *reinterpret_cast<const uint32_t*>(raw_sc + s * kRawScaleBytes + w_row * 4) >> (8 * g0);
      uint32_t w[kGroups][4], o[kGroups][8];
      int d[kGroups];
      bool normal = true;
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        const uint4 v = *reinterpret_cast<const uint4*>(w_codes + s * kRawBytes + g * 16);
        w[g][0] = v.x, w[g][1] = v.y, w[g][2] = v.z, w[g][3] = v.w;
        d[g] = int((exps >> (8 * g)) & 0xffu) - mx + 6;
        normal = normal && d[g] >= -5;
      }
      unsigned lost = 0;
      // One branch for all of the thread's groups, so that the common path is one straight run
      // the compiler can interleave (a branch per group kept each group's dependent chain apart,
      // with one producer warp a scheduler to hide it).
      if (normal) {
#pragma unroll
        for (int g = 0; g < kGroups; ++g) widen_fp4_group_normal(w[g], d[g], o[g]);
      } else {
#pragma unroll
        for (int g = 0; g < kGroups; ++g) lost += widen_fp4_group(w[g], d[g], o[g]);
      }
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        const int c = 2 * (g0 + g);
        *reinterpret_cast<uint4*>(dst + (w_dst ^ (16 * c))) =
            make_uint4(o[g][0], o[g][1], o[g][2], o[g][3]);
        *reinterpret_cast<uint4*>(dst + (w_dst ^ (16 * c + 16))) =
            make_uint4(o[g][4], o[g][5], o[g][6], o[g][7]);
      }
      return lost;
    };
    // scale[it % 2] <- item it's promotion factors, one per column (group row). The weight's
    // factor is 2^(max - 133), built from its bits (exactly ldexpf(1, max - 133): a normal from
    // 2^-126 up, a subnormal below).
    auto scales = [&](int it, int mx) {
      if (pt < BN) {
        const int e = mx - 133;
        const float w_scale = __int_as_float(e >= -126 ? (e + 127) << 23 : 1 << (e + 149));
        scale[(it & 1) * BN + pt] = act_sc[(it % kStages) * BN + pt] * w_scale;
      }
    };
    for (int s = 0; s < kStages - 1; ++s) load(s);
    unsigned lost = 0;
    int it = 0;
    for (int j = 0; j < my_tiles; ++j) {
      const uint8_t* slot = ring + (j % kTileRing) * (kMaxKBlocks + 1);
      unsigned tile_lost = 0;
      for (int kt = 0; kt < kt_count; ++kt, ++it) {
        cp_async_wait<kStages - 2>();        // item it is here (this thread's copies)
        bar_sync(kBarProducer, kProducers);  // and every producer thread's (and the ring's entry)
        const int mx = slot[kt];
        tile_lost += widen(it, mx);  // wide[it % 2] was released at item it - 1's EMPTY
        scales(it, mx);
        fence_proxy_async();  // the widened tile and the copied rows, read next by the tensor cores
#pragma unroll
        for (int c = 0; c < kConsumerGroups; ++c) bar_arrive(bar_full(it & 1, c), kPair);
        if (it + 1 < items) {
          if (it > 0)  // item it - 1 is done
#pragma unroll
            for (int c = 0; c < kConsumerGroups; ++c) bar_sync(bar_empty((it - 1) & 1, c), kPair);
          load(it + kStages - 1);  // into item it - 1's stage
        }
      }
      // The tile's lossy groups, once per expert and weight tile. (The slot is not rewritten
      // before this thread reaches the next item's producer barrier.)
      if (slot[kMaxKBlocks]) lost += tile_lost;
    }
    if (p.lossy && lost) atomicAdd(p.lossy, static_cast<unsigned long long>(lost));
    return;
  }

  // The consumers: per item, wait for it (FULL), four wgmma k32 steps on this warp group's 64
  // weight rows, the promotion, and the release (EMPTY) the producer waits for before reusing the
  // stage and the buffer (none after the last item but one: the producer stops waiting there);
  // after a tile's last k tile, the epilogue.
  if constexpr (T::kShiftRegs)
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(T::kConsumerRegs));
  const int lane = tid & 31, warp = tid >> 5, cg = warp / 4;
  // This warp group's 64 weight rows and kWN group rows; a zero known at compile time keeps the
  // descriptors' arithmetic in uniform registers (142 instructions a loop trip against 167 at
  // 128x128, `make sass`).
  const int wm = T::kWgN == 1 ? cg : 0, wn = T::kWgN == 1 ? 0 : cg;
  static_assert(T::kWgN == 1 || kWgM == 1, "warp groups along one of the two");
  float acc[kWN / 2], tot[kWN / 2];
  // The operands' descriptors at buffer and stage 0; each warp group its own 64 weight rows and
  // kWN group rows of the tile (row offsets of 64 x 128 bytes: whole swizzle periods). A
  // buffer's or stage's offset / 16 adds to them (sw128_desc).
  const uint64_t a_desc0 = sw128_desc(smem_u32(wide) + wm * 64 * kBK);
  const uint64_t b_desc0 = sw128_desc(smem_u32(b_tile) + wn * kWN * kBK);
  // Weight row wm 64 + 16 (warp % 4) + lane / 4, which is 16 warp + lane / 4 where the warp
  // groups lie along the weight rows (written so: the other form cost the 128x128 loop 11
  // instructions a trip, the compiler keeping fewer addresses across it).
  const int r0 = (T::kWgN == 1 ? 16 * warp : 16 * (warp % 4)) + (lane >> 2);
  int it = 0;
  for (int j = 0; j < my_tiles; ++j) {
    const TileAt t = tile_of(j);
    const int rows = p.groups[t.group].rows;
#pragma unroll
    for (int i = 0; i < kWN / 2; ++i) tot[i] = 0.f, acc[i] = 0.f;
    // A warp group whose group rows all lie past the group's (an expert's last row tile of 256
    // with at most 128 rows) skips its wgmma and promotion, leaving the tensor cores to the
    // other; it still takes part in every handover. (Without a second warp group along the
    // group's rows the tile has rows, and the branch is left out at compile time.)
    const bool busy = T::kWgN == 1 || t.n0 + wn * kWN < rows;
    for (int kt = 0; kt < kt_count; ++kt, ++it) {
      bar_sync(bar_full(it & 1, cg), kPair);
      const uint64_t a_desc = a_desc0 + (((it & 1) * kWideBytes) >> 4);
      const uint64_t b_desc = b_desc0 + (((it % kStages) * BN * kBK) >> 4);
      if (busy) {
        fence_operands(acc);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBK / 32; ++kk)  // k32 steps: 32 bytes into each 128-byte row
          wgmma_k32<kWN>(acc, a_desc + kk * (32 >> 4), b_desc + kk * (32 >> 4), kk > 0);
        wgmma_commit();
        wgmma_wait_all();
        fence_operands(acc);
        // Promotion: acc holds weight rows 16 (warp % 4) + lane / 4 (+ 8) of the warp group's
        // 64, group rows 8 j + 2 (lane % 4) (+ 1) of its kWN; each group row's factor is its
        // activation scale times the weight block's (the product fp8_grouped_gemm.h's kernel
        // forms, in the same order).
        const float2* f = reinterpret_cast<const float2*>(scale + (it & 1) * BN + wn * kWN);
#pragma unroll
        for (int q = 0; q < kWN / 8; ++q) {
          const float2 s2 = f[4 * q + (lane & 3)];
          tot[4 * q] = fmaf(acc[4 * q], s2.x, tot[4 * q]);
          tot[4 * q + 1] = fmaf(acc[4 * q + 1], s2.y, tot[4 * q + 1]);
          tot[4 * q + 2] = fmaf(acc[4 * q + 2], s2.x, tot[4 * q + 2]);
          tot[4 * q + 3] = fmaf(acc[4 * q + 3], s2.y, tot[4 * q + 3]);
        }
      }
      if (it + 2 < items) bar_arrive(bar_empty(it & 1, cg), kPair);
    }

    // Epilogue: this warp group's part of the tile, transposed through its own rows of
    // out_stage (its weight rows, or its group rows), then written a 16-byte chunk at a time,
    // rows of the group only. Only the warp group waits for itself: the other may be a k tile
    // into the next tile.
    const int me = tid & 127;
    bar_sync(bar_epilogue(cg), 128);  // its last tile's chunks are read out
#pragma unroll
    for (int q = 0; q < kWN / 8; ++q) {
      const int c = wn * kWN + q * 8 + 2 * (lane & 3);
      uint16_t* o = out_stage + c * kOutPitch + r0;
      o[0] = __bfloat16_as_ushort(__float2bfloat16_rn(tot[4 * q]));
      o[kOutPitch] = __bfloat16_as_ushort(__float2bfloat16_rn(tot[4 * q + 1]));
      o[8] = __bfloat16_as_ushort(__float2bfloat16_rn(tot[4 * q + 2]));
      o[kOutPitch + 8] = __bfloat16_as_ushort(__float2bfloat16_rn(tot[4 * q + 3]));
    }
    bar_sync(bar_epilogue(cg), 128);
    uint16_t* out = p.groups[t.group].out;
    for (int i = me; i < kWN * 8; i += 128) {
      const int c = wn * kWN + i / 8, ch = wm * 8 + i % 8;
      if (t.n0 + c < rows)
        *reinterpret_cast<uint4*>(out + static_cast<size_t>(t.n0 + c) * n + t.m0 + ch * 8) =
            *reinterpret_cast<const uint4*>(out_stage + c * kOutPitch + ch * 8);
    }
  }
}

// One thread per 128x128 block: the largest of its (up to) 128 rows x 4 group exponents.
__global__ void block_max_kernel(const uint8_t* __restrict__ sc, int64_t mats, int64_t n, int64_t k,
                                 uint8_t* __restrict__ out) {
  const int64_t nb = (n + 127) / 128, kb = k / 128;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= mats * nb * kb) return;
  const int64_t m = i / (nb * kb), b = (i / kb) % nb, c = i % kb;
  const int64_t r1 = min(n, (b + 1) * 128);
  unsigned mx = 0;
  for (int64_t r = b * 128; r < r1; ++r) {
    const uint32_t v =
        *reinterpret_cast<const uint32_t*>(sc + (m * n + r) * (k / kFp4Group) + c * 4);
    mx = max(max(max(mx, v & 0xffu), max((v >> 8) & 0xffu, (v >> 16) & 0xffu)), v >> 24);
  }
  out[i] = static_cast<uint8_t>(mx);
}

template <int M, int N>
struct TileId {
  static constexpr int kM = M, kN = N;
};
// f(TileId<M, N>{}) for every tile the kernel is built for, stopping at the first error.
template <class F>
Status each_tile(F&& f) {
  HETERO_RETURN_IF_ERROR(f(TileId<64, 64>{}));
  HETERO_RETURN_IF_ERROR(f(TileId<64, 128>{}));
  HETERO_RETURN_IF_ERROR(f(TileId<128, 64>{}));
  HETERO_RETURN_IF_ERROR(f(TileId<128, 128>{}));
  return f(TileId<64, 256>{});
}

}  // namespace

void fp4_block_max(const Fp4GroupWeight& w0, int64_t mats, uint8_t* out, cudaStream_t stream) {
  const int64_t total = mats * ((w0.n + 127) / 128) * (w0.k / 128);
  if (total <= 0) return;
  block_max_kernel<<<static_cast<unsigned>((total + 255) / 256), 256, 0, stream>>>(w0.scale, mats,
                                                                                   w0.n, w0.k, out);
}

Status w4a8_grouped_gemm_available(int device) { return check_fp8_device(device); }

Status W4a8GroupedGemm::supports(int64_t n, int64_t k) {
  if (n <= 0 || k <= 0 || n % 64 != 0 || k % kBK != 0 || k / kBK > kMaxKBlocks ||
      n > (int64_t{1} << 24))
    return failed_precondition(
        "the W4A8 grouped GEMM takes n a multiple of 64 and k a multiple "
        "of 128 up to 8192, not n=" +
        std::to_string(n) + " k=" + std::to_string(k));
  return Status::ok();
}

struct W4a8GroupedGemm::Impl {
  int64_t max_groups = 0;
  int tile_m = 0, tile_n = 0;  // 0: chosen per launch
  int64_t max_blocks = 0;      // 0: a block per tile
  ArgumentSlots args;          // each launch's groups, then each group's first tile
};

namespace {
size_t arg_bytes(int64_t groups) {
  return static_cast<size_t>(groups) * sizeof(DevGroup) +
         static_cast<size_t>(groups + 1) * sizeof(int32_t);
}
}  // namespace

Result<std::unique_ptr<W4a8GroupedGemm>> W4a8GroupedGemm::create(int64_t max_groups,
                                                                 DeviceMemoryBudget* budget) {
  int device = 0;
  HETERO_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  HETERO_RETURN_IF_ERROR(w4a8_grouped_gemm_available(device));
  if (max_groups <= 0 || max_groups > (int64_t{1} << 20))
    return invalid_argument("the W4A8 grouped GEMM needs max_groups in [1, 2^20], not " +
                            std::to_string(max_groups));
  auto impl = std::make_unique<Impl>();
  impl->max_groups = max_groups;
  HETERO_RETURN_IF_ERROR(
      impl->args.allocate(arg_bytes(max_groups), "the W4A8 GEMM's arguments", budget));
  HETERO_RETURN_IF_ERROR(each_tile([](auto tile) -> Status {
    using T = decltype(tile);
    HETERO_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(w4a8_grouped_kernel<T::kM, T::kN>,
                                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                     Tile<T::kM, T::kN>::kSmem));
    return Status::ok();
  }));
  return std::unique_ptr<W4a8GroupedGemm>(new W4a8GroupedGemm(std::move(impl)));
}

bool W4a8GroupedGemm::has_tile(int weight_rows, int group_rows) {
  bool built = false;
  (void)each_tile([&](auto tile) -> Status {
    using T = decltype(tile);
    built = built || (T::kM == weight_rows && T::kN == group_rows);
    return Status::ok();
  });
  return built;
}

void W4a8GroupedGemm::set_max_blocks(int64_t blocks) {
  impl_->max_blocks = std::max<int64_t>(blocks, 0);
}

void W4a8GroupedGemm::set_tile(int weight_rows, int group_rows) {
  const bool ok = has_tile(weight_rows, group_rows);
  impl_->tile_m = ok ? weight_rows : 0;
  impl_->tile_n = ok ? group_rows : 0;
}

Status W4a8GroupedGemm::run(const W4a8Group* groups, int64_t count, const Fp4Experts& w,
                            unsigned long long* lossy_groups, cudaStream_t stream) {
  Impl& m = *impl_;
  if (count == 0) return Status::ok();
  if (count < 0 || count > m.max_groups)
    return invalid_argument("the W4A8 grouped GEMM takes up to " + std::to_string(m.max_groups) +
                            " groups, not " + std::to_string(count));
  const int64_t n = w.w0.n, k = w.w0.k;
  const Status shape = supports(n, k);
  if (!shape.is_ok()) return invalid_argument(shape.message());
  auto aligned = [](const void* p, uintptr_t to = 16) {
    return p && (reinterpret_cast<uintptr_t>(p) & (to - 1)) == 0;
  };
  // cp.async copies the codes 16 bytes and the exponents 4 bytes at a time.
  if (!aligned(w.w0.codes) || !aligned(w.w0.scale, 4) || !w.block_max)
    return invalid_argument(
        "the W4A8 grouped GEMM needs the experts' codes (16-byte aligned), exponents (4-byte "
        "aligned) and block exponents");
  for (int64_t g = 0; g < count; ++g) {
    const W4a8Group& x = groups[g];
    if (x.rows <= 0 || x.rows > (int64_t{1} << 30) || x.expert < 0 || x.expert >= w.mats)
      return invalid_argument("W4A8 grouped GEMM group " + std::to_string(g) + " has " +
                              std::to_string(x.rows) + " rows of expert " +
                              std::to_string(x.expert) + " (of " + std::to_string(w.mats) + ")");
    if (!aligned(x.act_q) || !aligned(x.act_scale) || !aligned(x.out))
      return invalid_argument("W4A8 grouped GEMM group " + std::to_string(g) +
                              ": operands must be 16-byte aligned");
  }
  // 128x128 where n allows, else 64 weight rows: at Flash's expert shapes 128x128 was the fastest
  // and 64x64 the slowest at 8K and 32K tokens (RESULTS §40.2). A set tile whose weight rows do
  // not divide n gives way to this choice.
  int bm = m.tile_m, bn = m.tile_n;
  if (bm == 0 || n % bm != 0) bm = n % 128 == 0 ? 128 : 64, bn = 128;
  HETERO_ASSIGN_OR_RETURN(const int s, m.args.next());
  auto* dg = static_cast<DevGroup*>(m.args.host(s));
  auto* start = reinterpret_cast<int32_t*>(dg + m.max_groups);
  const int64_t m_tiles = n / bm;
  int64_t tiles = 0;
  for (int64_t g = 0; g < count; ++g) {
    const W4a8Group& x = groups[g];
    dg[g] = {x.act_q, x.act_scale, x.out, static_cast<int32_t>(x.rows),
             static_cast<int32_t>(x.expert)};
    start[g] = static_cast<int32_t>(tiles);
    tiles += m_tiles * ((x.rows + bn - 1) / bn);
  }
  start[count] = static_cast<int32_t>(tiles);
  if (tiles > INT32_MAX / 2) return invalid_argument("the W4A8 grouped GEMM launch is too large");
  // A block a tile, or at most max_blocks, each taking every blocks-th tile.
  const int64_t blocks = m.max_blocks > 0 ? std::min(tiles, m.max_blocks) : tiles;
  if ((tiles + blocks - 1) / blocks * (k / 128) > INT32_MAX)  // a block's items, counted in int
    return invalid_argument("the W4A8 grouped GEMM launch has too many tiles for its blocks");
  const Status st = [&]() -> Status {
    HETERO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(m.args.device(s), dg, arg_bytes(m.max_groups),
                                                cudaMemcpyHostToDevice, stream));
    const auto* ddg = static_cast<const DevGroup*>(m.args.device(s));
    const Params prm{ddg,
                     reinterpret_cast<const int32_t*>(ddg + m.max_groups),
                     static_cast<int32_t>(count),
                     static_cast<int32_t>(n),
                     static_cast<int32_t>(k),
                     static_cast<int32_t>(tiles),
                     w.w0.codes,
                     w.w0.scale,
                     w.block_max,
                     lossy_groups};
    bool launched = false;
    HETERO_RETURN_IF_ERROR(each_tile([&](auto tile) -> Status {
      using T = decltype(tile);
      if (T::kM == bm && T::kN == bn) {
        w4a8_grouped_kernel<T::kM, T::kN>
            <<<static_cast<unsigned>(blocks), Tile<T::kM, T::kN>::kThreads,
               Tile<T::kM, T::kN>::kSmem, stream>>>(prm);
        launched = true;
      }
      return Status::ok();
    }));
    if (!launched)  // set_tile admits built tiles only
      return internal_error("the W4A8 grouped GEMM has no " + std::to_string(bm) + "x" +
                            std::to_string(bn) + " tile");
    HETERO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return Status::ok();
  }();
  HETERO_RETURN_IF_ERROR(m.args.queued(s, stream));  // whatever the launch did
  return st;
}

W4a8GroupedGemm::W4a8GroupedGemm(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
W4a8GroupedGemm::~W4a8GroupedGemm() = default;

}  // namespace hetero::cuda
