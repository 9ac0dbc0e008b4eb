// The FP8 block-scaled weight path (kernels/cuda/fp8_gemm.h) against host references:
//  - both quantizers byte for byte (e4m3 codes and float32 scales, in their stored layouts);
//  - the cuBLASLt GEMM against a float64 GEMM of the same dequantized operands (tight: float32
//    accumulation and the bf16 output's rounding), and against cuBLAS's bf16 GEMM of the
//    unquantized operands (loose: e4m3 rounds each operand by up to 2^-4 relative);
//  - that the tight bound catches a scale grid stored in the wrong order;
//  - the routed experts' SwiGLU quantized in the same pass against the two passes it replaces.
// Block magnitudes vary over 2^-4..2^4 so that a scale applied to the wrong block is visible.
#include "kernels/cuda/fp8_gemm.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "cuda_test_base.h"
#include "fp8_test_util.h"
#include "kernels/cuda/dsv4_fwd_ops.h"

namespace hetero {
namespace {

using namespace fp8_test;

class Fp8Test : public CudaDeviceTest {};

TEST_F(Fp8Test, WeightQuantizerMatchesHostBytes) {
  for (auto [n, k] : {std::pair<int64_t, int64_t>{256, 384}, {200, 144}, {64, 16}, {384, 1024}}) {
    const std::vector<uint16_t> w = blocky_bf16(n, k, 128, static_cast<uint32_t>(n + k));
    const HostFp8 want = host_quantize_weight(w, n, k);
    Dev dw(w.size() * 2), dq(want.q.size()), ds(want.scale.size() * 4);
    put(dw, w);
    cuda::quantize_weight_fp8_block(dw.as<uint16_t>(), n, k, dq.as<uint8_t>(), ds.as<float>(),
                                    nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto q = get<uint8_t>(dq, want.q.size());
    const auto s = get<float>(ds, want.scale.size());
    size_t bad = 0;
    for (size_t i = 0; i < q.size(); ++i)
      if (q[i] != want.q[i] && bad++ < 5)
        ADD_FAILURE() << "n " << n << " k " << k << " q[" << i << "] " << int(q[i]) << " want "
                      << int(want.q[i]);
    EXPECT_EQ(bad, 0u);
    EXPECT_EQ(0, std::memcmp(s.data(), want.scale.data(), s.size() * 4)) << "n " << n << " k " << k;
  }
}

TEST_F(Fp8Test, ActivationQuantizerMatchesHostBytes) {
  for (int64_t m : {1, 37, 128, 129}) {
    for (int64_t k : {256, 144, 2048}) {
      const std::vector<uint16_t> x = blocky_bf16(m, k, 1, static_cast<uint32_t>(m * 7 + k));
      const HostFp8 want = host_quantize_act(x, m, k);
      Dev dx(x.size() * 2), dq(want.q.size()), ds(want.scale.size() * 4);
      put(dx, x);
      cudaMemset(dq.p, 0xAB, want.q.size());  // padding rows must be written, not left over
      cuda::quantize_act_fp8_group(dx.as<uint16_t>(), m, k, dq.as<uint8_t>(), ds.as<float>(),
                                   nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto q = get<uint8_t>(dq, want.q.size());
      const auto s = get<float>(ds, want.scale.size());
      EXPECT_EQ(0, std::memcmp(q.data(), want.q.data(), q.size())) << "m " << m << " k " << k;
      EXPECT_EQ(0, std::memcmp(s.data(), want.scale.data(), s.size() * 4))
          << "m " << m << " k " << k;
    }
  }
}

// Segments (an MoE's rows by expert, empty ones among them) quantized in one pass: each exactly
// the bytes quantize_act_fp8_group gives it alone (the host reference), at its padded place.
TEST_F(Fp8Test, SegmentedActivationQuantizerPacksEachSegmentAsAlone) {
  const int64_t k = 384, groups = fp8_blocks(k);
  const std::vector<int32_t> rows = {3, 0, 16, 17, 0, 0, 1, 40};
  std::vector<int32_t> off = {0}, pad = {0};
  for (int32_t r : rows) {
    off.push_back(off.back() + r);
    pad.push_back(pad.back() + static_cast<int32_t>(fp8_act_rows(r)));
  }
  const int64_t m = off.back(), total = pad.back();
  const std::vector<uint16_t> x = blocky_bf16(m, k, 1, 5);
  Dev dx(x.size() * 2), doff(off.size() * 4), dpad(pad.size() * 4), dq(total * k),
      ds(total * groups * 4);
  put(dx, x), put(doff, off), put(dpad, pad);
  cudaMemset(dq.p, 0xAB, total * k);  // padding rows must be written, not left over
  cuda::quantize_act_fp8_segments(dx.as<uint16_t>(), doff.as<int32_t>(), dpad.as<int32_t>(),
                                  static_cast<int64_t>(rows.size()), total, k, dq.as<uint8_t>(),
                                  ds.as<float>(), nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto q = get<uint8_t>(dq, static_cast<size_t>(total * k));
  const auto s = get<float>(ds, static_cast<size_t>(total * groups));
  for (size_t e = 0; e < rows.size(); ++e) {
    if (rows[e] == 0) continue;
    const std::vector<uint16_t> part(x.begin() + off[e] * k, x.begin() + off[e + 1] * k);
    const HostFp8 want = host_quantize_act(part, rows[e], k);
    ASSERT_EQ(want.q.size(), static_cast<size_t>((pad[e + 1] - pad[e]) * k));
    EXPECT_EQ(0, std::memcmp(q.data() + pad[e] * k, want.q.data(), want.q.size()))
        << "segment " << e;
    EXPECT_EQ(0, std::memcmp(s.data() + pad[e] * groups, want.scale.data(), want.scale.size() * 4))
        << "segment " << e;
  }
}

// The routed experts' w2 input made and quantized in one pass (swiglu_quantize_fp8_segments):
// the same bytes and scales as swiglu's act quantized by quantize_act_fp8_segments, with and
// without the clamp and with and without tight scales, nothing else written (both sets of
// buffers start with the same filler, so a byte only one pass writes shows).
TEST_F(Fp8Test, SwigluQuantizedInOnePassMatchesTheTwoPasses) {
  const int64_t inter = 384, groups = fp8_blocks(inter);
  const std::vector<int32_t> rows = {3, 0, 16, 17, 0, 1, 40};
  std::vector<int32_t> off = {0}, pad = {0};
  for (int32_t r : rows) {
    off.push_back(off.back() + r);
    pad.push_back(pad.back() + static_cast<int32_t>(fp8_act_rows(r)));
  }
  const int64_t m = off.back(), total = pad.back(), E = static_cast<int64_t>(rows.size());
  // Gate and up per 128-column group scaled by 2^-4..2^4: the clamp at 2.5 cuts many of them.
  const std::vector<uint16_t> gu = blocky_bf16(m, 2 * inter, 1, 21);
  Dev dgu(gu.size() * 2), dact(m * inter * 2), doff(off.size() * 4), dpad(pad.size() * 4),
      dq1(total * inter), ds1(total * groups * 4), dq2(total * inter), ds2(total * groups * 4);
  put(dgu, gu), put(doff, off), put(dpad, pad);
  for (float limit : {0.f, 2.5f})
    for (bool tight : {false, true}) {
      for (const Dev* d : {&dq1, &dq2}) cudaMemset(d->p, 0xAB, total * inter);
      for (const Dev* d : {&ds1, &ds2}) cudaMemset(d->p, 0xCD, total * groups * 4);
      cuda::swiglu(dgu.as<uint16_t>(), m, inter, limit, dact.as<uint16_t>(), nullptr);
      cuda::quantize_act_fp8_segments(dact.as<uint16_t>(), doff.as<int32_t>(), dpad.as<int32_t>(),
                                      E, total, inter, dq1.as<uint8_t>(), ds1.as<float>(), nullptr,
                                      nullptr, 1, tight);
      cuda::swiglu_quantize_fp8_segments(dgu.as<uint16_t>(), inter, limit, doff.as<int32_t>(),
                                         dpad.as<int32_t>(), E, total, dq2.as<uint8_t>(),
                                         ds2.as<float>(), nullptr, tight);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::string what =
          "limit " + std::to_string(limit) + (tight ? ", tight scales" : ", padded scales");
      const auto q1 = get<uint8_t>(dq1, static_cast<size_t>(total * inter));
      const auto q2 = get<uint8_t>(dq2, static_cast<size_t>(total * inter));
      EXPECT_EQ(0, std::memcmp(q1.data(), q2.data(), q1.size())) << what;
      const auto s1 = get<float>(ds1, static_cast<size_t>(total * groups));
      const auto s2 = get<float>(ds2, static_cast<size_t>(total * groups));
      EXPECT_EQ(0, std::memcmp(s1.data(), s2.data(), s1.size() * 4)) << what;
      // Not a test of zeros against zeros: most codes are written and nonzero.
      EXPECT_GT(std::count_if(q2.begin(), q2.end(), [](uint8_t b) { return b != 0 && b != 0xAB; }),
                static_cast<std::ptrdiff_t>(q2.size() / 2))
          << what;
    }
}

// out [rows, n] (bf16 bits) of the FP8 GEMM on device operands quantized on the device.
struct GemmCase {
  int64_t m, n, k;
  std::vector<uint16_t> x, w;  // bf16 [m, k], [n, k]
  HostFp8 xq, wq;              // host quantization (equal to the device's, tested above)
};

GemmCase make_case(int64_t m, int64_t n, int64_t k, uint32_t seed) {
  GemmCase c{m, n, k, blocky_bf16(m, k, 1, seed), blocky_bf16(n, k, 128, seed + 1), {}, {}};
  c.xq = host_quantize_act(c.x, m, k);
  c.wq = host_quantize_weight(c.w, n, k);
  return c;
}

// The worst |got - ref| / (2^-8 |ref| + 2^-10 sum|x w|) over the m valid rows, and the relative
// RMS error: ref is the float64 product of the dequantized operands. The first term covers the
// bf16 output's rounding (half an ulp is 2^-9 relative), the second the accumulation: float32
// across 128-column blocks, the FP8 tensor cores' narrower adder (about 13 bits after alignment)
// within one; 1 is the bound. A scale on the wrong block is off by up to 2^8.
struct Err {
  double worst = 0, rel_rms = 0;
};
Err fp8_vs_dequant(const GemmCase& c, const std::vector<uint16_t>& out,
                   const std::vector<float>& w_scale, int64_t w_scale_ld) {
  const int64_t rows = fp8_act_rows(c.m);
  Err e;
  double num = 0, den = 0;
  for (int64_t i = 0; i < c.m; ++i)
    for (int64_t j = 0; j < c.n; ++j) {
      double ref = 0, mag = 0;
      for (int64_t t = 0; t < c.k; ++t) {
        const double a = e4m3_value(c.xq.q[static_cast<size_t>(i * c.k + t)]) *
                         c.xq.scale[static_cast<size_t>((t / 128) * rows + i)];
        const double b = e4m3_value(c.wq.q[static_cast<size_t>(j * c.k + t)]) *
                         w_scale[static_cast<size_t>((j / 128) * w_scale_ld + t / 128)];
        ref += a * b, mag += std::fabs(a * b);
      }
      const double got = bf16_to_f32(out[static_cast<size_t>(i * c.n + j)]);
      const double bound = std::ldexp(std::fabs(ref), -8) + std::ldexp(mag, -10) + 1e-30;
      e.worst = std::max(e.worst, std::fabs(got - ref) / bound);
      num += (got - ref) * (got - ref), den += ref * ref;
    }
  e.rel_rms = std::sqrt(num / std::max(den, 1e-300));
  return e;
}

std::vector<uint16_t> run_fp8(cuda::Fp8Gemm& g, const GemmCase& c,
                              const std::vector<float>& w_scale, Status* st) {
  const int64_t rows = fp8_act_rows(c.m);
  Dev dx(c.x.size() * 2), dxq(static_cast<size_t>(rows * c.k)),
      dxs(static_cast<size_t>(fp8_blocks(c.k) * rows) * 4), dw(c.w.size() * 2), dwq(c.wq.q.size()),
      dws(w_scale.size() * 4), dout(static_cast<size_t>(rows * c.n) * 2);
  put(dx, c.x);
  put(dw, c.w);
  cuda::quantize_act_fp8_group(dx.as<uint16_t>(), c.m, c.k, dxq.as<uint8_t>(), dxs.as<float>(),
                               nullptr);
  put(dwq, c.wq.q);
  put(dws, w_scale);  // the host's grid, so a test can hand over a wrong one
  const cuda::Fp8BlockWeight w{dwq.as<uint8_t>(), dws.as<float>(), c.n, c.k};
  *st = g.run(dxq.as<uint8_t>(), dxs.as<float>(), c.m, w, dout.as<uint16_t>(), nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return get<uint16_t>(dout, static_cast<size_t>(c.m * c.n));
}

TEST_F(Fp8Test, GemmMatchesFloat64OfDequantizedOperands) {
  auto g = cuda::Fp8Gemm::create();
  ASSERT_TRUE(g.is_ok()) << g.status().to_string();
  std::printf("[ cuBLASLt %zu ]\n", cublasLtGetVersion());
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 256, 256},
                         {37, 512, 256},
                         {200, 192, 512},
                         {129, 384, 1024},
                         {300, 1024, 256}}) {
    const GemmCase c = make_case(m, n, k, static_cast<uint32_t>(m + n + k));
    Status st;
    const auto out = run_fp8(**g, c, c.wq.scale, &st);
    if (!st.is_ok()) {  // go on: which shapes cuBLASLt refuses is worth seeing at once
      ADD_FAILURE() << st.to_string();
      continue;
    }
    const Err e = fp8_vs_dequant(c, out, c.wq.scale, fp8_weight_scale_ld(k));
    std::printf("[ fp8 gemm m %lld n %lld k %lld ] worst/bound %.3f, rel rms vs float64 %.2e\n",
                static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k),
                e.worst, e.rel_rms);
    EXPECT_LE(e.worst, 1.0) << "m " << m << " n " << n << " k " << k;
    EXPECT_LT(e.rel_rms, 3e-3) << "bf16 output rounding alone is about 1.1e-3";
  }
}

// The tight bound is what makes the layout test mean something: the same GEMM with the weight's
// scale grid transposed (blocks [j][i] for [i][j], a square 4x4 grid) must fail it by far.
TEST_F(Fp8Test, TransposedWeightScaleGridFailsTheBound) {
  auto g = cuda::Fp8Gemm::create();
  ASSERT_TRUE(g.is_ok());
  const int64_t m = 64, n = 512, k = 512, ld = fp8_weight_scale_ld(k);
  const GemmCase c = make_case(m, n, k, 99);
  std::vector<float> t(c.wq.scale.size());
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t j = 0; j < 4; ++j)
      t[static_cast<size_t>(i * ld + j)] = c.wq.scale[static_cast<size_t>(j * ld + i)];
  ASSERT_NE(t, c.wq.scale);
  Status st;
  const auto out = run_fp8(**g, c, t, &st);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  const Err e = fp8_vs_dequant(c, out, c.wq.scale, ld);
  std::printf("[ transposed scale grid ] worst/bound %.1f, rel rms %.2e\n", e.worst, e.rel_rms);
  EXPECT_GT(e.worst, 10.0);
  EXPECT_GT(e.rel_rms, 0.1);
}

// Against cuBLAS's bf16 GEMM of the unquantized operands: e4m3 keeps 3 mantissa bits, so every
// product carries up to about 2 * 2^-4 relative rounding (RMS about 3e-2 for normal data, the
// errors of a sum adding in quadrature like its terms). Bound: relative RMS 6e-2.
TEST_F(Fp8Test, GemmWithinQuantizationErrorOfBf16Gemm) {
  auto g = cuda::Fp8Gemm::create();
  ASSERT_TRUE(g.is_ok());
  cublasHandle_t h = nullptr;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{100, 768, 2048}, {256, 2048, 512}}) {
    // Plain normal data here (one magnitude): the error measured is the format's, not a
    // worst case of tiny blocks.
    const std::vector<uint16_t> x = random_bf16(static_cast<size_t>(m * k), 1.f, 5);
    const std::vector<uint16_t> w = random_bf16(static_cast<size_t>(n * k), 0.02f, 6);
    GemmCase c{m, n, k, x, w, host_quantize_act(x, m, k), host_quantize_weight(w, n, k)};
    Status st;
    const auto out = run_fp8(**g, c, c.wq.scale, &st);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    Dev dx(x.size() * 2), dw(w.size() * 2), dout(static_cast<size_t>(m * n) * 2);
    put(dx, x);
    put(dw, w);
    const float one = 1.f, zero = 0.f;
    ASSERT_EQ(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                           static_cast<int>(k), &one, dw.p, CUDA_R_16BF, static_cast<int>(k), dx.p,
                           CUDA_R_16BF, static_cast<int>(k), &zero, dout.p, CUDA_R_16BF,
                           static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
              CUBLAS_STATUS_SUCCESS);
    const auto ref = get<uint16_t>(dout, static_cast<size_t>(m * n));
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      const double a = bf16_to_f32(out[i]), b = bf16_to_f32(ref[i]);
      num += (a - b) * (a - b), den += b * b;
    }
    const double rel = std::sqrt(num / den);
    std::printf("[ fp8 vs bf16 gemm m %lld n %lld k %lld ] rel rms %.2e\n",
                static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k),
                rel);
    EXPECT_LT(rel, 6e-2);
    EXPECT_GT(rel, 1e-3) << "suspiciously exact: is the FP8 path really quantizing?";
  }
  cublasDestroy(h);
}

// k not a multiple of 128 (a partial last group and block): a correct result or a clear refusal
// naming the shape, never a silent wrong answer.
TEST_F(Fp8Test, PartialKBlockIsCorrectOrRefused) {
  auto g = cuda::Fp8Gemm::create();
  ASSERT_TRUE(g.is_ok());
  const GemmCase c = make_case(37, 256, 144, 3);
  Status st;
  const auto out = run_fp8(**g, c, c.wq.scale, &st);
  if (!st.is_ok()) {
    std::printf("[ k 144 ] refused: %s\n", st.to_string().c_str());
    EXPECT_EQ(st.code(), Code::kFailedPrecondition);
    EXPECT_NE(st.message().find("k=144"), std::string::npos);
    return;
  }
  const Err e = fp8_vs_dequant(c, out, c.wq.scale, fp8_weight_scale_ld(144));
  std::printf("[ k 144 ] worst/bound %.3f, rel rms %.2e\n", e.worst, e.rel_rms);
  EXPECT_LE(e.worst, 1.0);
}

TEST_F(Fp8Test, RefusesUnalignedShapes) {
  auto g = cuda::Fp8Gemm::create();
  ASSERT_TRUE(g.is_ok());
  EXPECT_EQ((*g)->prepare(16, 256, 100).code(), Code::kInvalidArgument);
  EXPECT_EQ((*g)->prepare(16, 200, 256).code(), Code::kInvalidArgument);
  EXPECT_TRUE((*g)->prepare(16, 256, 256).is_ok());
}

}  // namespace
}  // namespace hetero
