// The FP4 -> e4m3 widening's integer path (kernels/fp4_widen_bits.h), the expression the GPU
// kernels run, checked on the host: every e2m1 code in every place of a group, at every scale
// offset the path takes, decodes to the e2m1 value times 2^d exactly, with its sign (negative
// zero included). The GPU tests compare the kernels' codes with the float conversion on the
// device (checkpoint_precision_test.cc); this one runs everywhere.
#include "kernels/fp4_widen_bits.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "common/tensor.h"

namespace hetero {
namespace {

TEST(Fp4WidenBits, PrmtFollowsPtxDefaultMode) {
  // Bytes 0-3 of a, then 4-7 of b; selector bit 3 replicates the selected byte's sign.
  const uint32_t a = 0x83828180u, b = 0x07060504u;
  EXPECT_EQ(prmt(a, b, 0x3210u), a);
  EXPECT_EQ(prmt(a, b, 0x7654u), b);
  EXPECT_EQ(prmt(a, b, 0x0415u), 0x80048105u);
  EXPECT_EQ(prmt(a, b, 0x9dc8u), 0xff0000ffu);              // a's bytes are negative, b's positive
  EXPECT_EQ(prmt(a, b, 0xffff3210u), prmt(a, b, 0x3210u));  // only the low 16 bits select
}

// Element e of the group (low nibble first) as widen_fp4_group_normal's input words.
void put(uint32_t (&w)[4], int e, uint32_t nibble) {
  w[e / 8] = (w[e / 8] & ~(0xfu << (4 * (e % 8)))) | (nibble << (4 * (e % 8)));
}

TEST(Fp4WidenBits, EveryCodeInEveryPlaceAtEveryOffsetIsExact) {
  std::mt19937 rng(7);
  auto random_word = [&] { return static_cast<uint32_t>(rng()); };
  int64_t checked = 0;
  for (int d = -5; d <= 6; ++d) {
    // Each pattern of four codes (all 65,536) in each aligned run of four elements of the group,
    // the other elements random.
    for (int run = 0; run < 8; ++run) {
      for (uint32_t pattern = 0; pattern < 65536; ++pattern) {
        uint32_t w[4] = {random_word(), random_word(), random_word(), random_word()};
        for (int t = 0; t < 4; ++t) put(w, 4 * run + t, (pattern >> (4 * t)) & 0xfu);
        uint32_t out[8];
        widen_fp4_group_normal(w, d, out);
        for (int e = 0; e < 32; ++e) {
          const uint32_t nibble = (w[e / 8] >> (4 * (e % 8))) & 0xfu;
          const uint8_t code = static_cast<uint8_t>(out[e / 4] >> (8 * (e % 4)));
          const float want = std::ldexp(fp4_e2m1_to_f32(static_cast<uint8_t>(nibble)), d);
          const float got = fp8_e4m3_to_f32(code);
          if (got != want || (code >> 7) != (nibble >> 3) || (code & 0x7fu) == 0x7fu) {
            ADD_FAILURE() << "d=" << d << " element " << e << " code 0x" << std::hex << nibble
                          << " -> e4m3 0x" << int(code) << std::dec << " (" << got << ", want "
                          << want << ")";
            return;
          }
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, int64_t{12} * 8 * 65536 * 32);
}

}  // namespace
}  // namespace hetero
