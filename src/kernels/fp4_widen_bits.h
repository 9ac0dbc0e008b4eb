// The integer half of the FP4 -> e4m3 widening (kernels/cuda/fp4_widen.cuh), compiled for the
// device by nvcc and for the host by the C++ compiler, so that the unit tests check the very
// expression the kernels run, on a machine without a GPU, against the CPU's own decoding.
//
// On the device `prmt` is the PTX instruction; on the host it is that instruction's documented
// default mode, written out (PTX ISA, "prmt"): result byte n is byte (c >> 4n) & 7 of the eight
// bytes {b, a} (a's bytes are 0-3), or, where bit 3 of that selector nibble is set, that byte's
// sign bit replicated over all eight bits.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define HETERO_FP4_HD __host__ __device__ __forceinline__
#else
#define HETERO_FP4_HD inline
#endif

namespace hetero {

HETERO_FP4_HD uint32_t prmt(uint32_t a, uint32_t b, uint32_t c) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
#else
  const uint64_t bytes = (uint64_t{b} << 32) | a;
  uint32_t r = 0;
  for (int n = 0; n < 4; ++n) {
    const uint32_t s = (c >> (4 * n)) & 0xfu;
    uint32_t v = static_cast<uint32_t>(bytes >> (8 * (s & 7u))) & 0xffu;
    if (s & 8u) v = (v & 0x80u) ? 0xffu : 0u;
    r |= v << (8 * n);
  }
  return r;
#endif
}

// One 32-element FP4 group whose values times 2^d are all e4m3 normals or zeros (-5 <= d <= 6):
// w its 16 bytes as words (element 2j in the low nibble of byte j), out its 32 e4m3 codes
// (byte i = element i). Exact.
//
// An e2m1 magnitude code m (1..7) is 2^((m >> 1) - 1) * (1 + (m odd and m > 1) / 2), so its
// e4m3 code has the exponent field (m >> 1) + d + 6 and the e2m1 mantissa bit as its top
// mantissa bit: at d = 0 the codes 0x30 0x38 0x3c 0x40 0x44 0x48 0x4c, and 8d more for any d
// (no byte carries or borrows for -5 <= d <= 6). The eight magnitude codes are a byte table of
// two words (magnitude 0 stays 0), and the magnitudes select from it four at a time. The signs
// come from a second permute in the sign-replicate mode, over w's own bytes (an odd element's
// sign is bit 7 of its byte) and w << 4's (an even element's bit 3 moved to bit 7), with a
// constant selector: 0xff where an element is negative. Three instructions for four elements,
// beside three for each input word: the W4A8 GEMM widens in its main loop, where issue slots are
// what it runs short of (RESULTS §40).
HETERO_FP4_HD void widen_fp4_group_normal(const uint32_t (&w)[4], int d, uint32_t (&out)[8]) {
  const uint32_t step = 8u * static_cast<uint32_t>(d);
  const uint32_t lut_lo = 0x3c383000u + step * 0x01010100u;
  const uint32_t lut_hi = 0x4c484440u + step * 0x01010101u;
  // Sign selectors, result byte t (element 4h + t of the word): an even t reads byte 4 + j of
  // {w << 4, w}, an odd t byte j, with j = 2h + t / 2; bit 3 set: replicate the sign.
  constexpr uint32_t kSignsLow = 0x9d8cu, kSignsHigh = 0xbfaeu;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < 4; ++i) {
    const uint32_t mags = w[i] & 0x77777777u, shifted = w[i] << 4;
    out[2 * i] = prmt(lut_lo, lut_hi, mags) | (prmt(w[i], shifted, kSignsLow) & 0x80808080u);
    out[2 * i + 1] =
        prmt(lut_lo, lut_hi, mags >> 16) | (prmt(w[i], shifted, kSignsHigh) & 0x80808080u);
  }
}

}  // namespace hetero
