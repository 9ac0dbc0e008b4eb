// The grouped FP8 GEMM (kernels/cuda/fp8_grouped_gemm.h) against host references, as an MoE calls
// it: experts' rows quantized by quantize_act_fp8_segments with tight scales (checked byte for
// byte against each segment quantized alone), weights in fp8_gemm.h's format with their scales
// transposed on the device (checked exactly), then one launch over every expert with rows.
// Each output against the float64 product of the dequantized operands, with fp8_gemm_test's
// tight bound (float32 accumulation, the bf16 output's rounding), and against cuBLASLt's
// per-expert GEMM of the same operands. Shapes cover 1..300 rows, partial 128-blocks in n and k,
// k below one block. Skips (and says so) where the build has no grouped kernel.
#include "kernels/cuda/fp8_grouped_gemm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

#include "cuda_test_base.h"
#include "fp8_test_util.h"
#include "kernels/cuda/fp8_gemm.h"

namespace hetero {
namespace {

using namespace fp8_test;

class Fp8GroupedGemmTest : public CudaDeviceTest {
 protected:
  void SetUp() override {
    CudaDeviceTest::SetUp();
    if (IsSkipped()) return;
    const Status built = cuda::fp8_grouped_gemm_available();
    if (!built.is_ok()) GTEST_SKIP() << built.message();
  }
};

// The bound (fp8_gemm_test's): |got - ref| <= 2^-8 |ref| + 2^-10 sum|a b| for ref, the float64
// product of the dequantized operands; 1 passes.
// Every expert within the bound of the float64 product, and within float32 rounding of
// cuBLASLt's per-expert GEMM of the same operands.
TEST_F(Fp8GroupedGemmTest, EveryExpertMatchesFloat64AndCublasLt) {
  auto gemm = cuda::Fp8GroupedGemm::create(16);
  ASSERT_TRUE(gemm.is_ok()) << gemm.status().to_string();
  auto lt = cuda::Fp8Gemm::create();
  ASSERT_TRUE(lt.is_ok()) << lt.status().to_string();
  const std::vector<int32_t> rows = {3, 0, 1, 16, 17, 0, 200, 130, 15, 300};
  for (auto [n, k] : {std::pair<int64_t, int64_t>{512, 256},
                      {384, 1024},
                      {272, 144},    // partial blocks in n and in k
                      {160, 64}}) {  // k below one block
    const int64_t E = static_cast<int64_t>(rows.size()), groups = fp8_blocks(k);
    std::vector<int32_t> off = {0}, pad = {0};
    for (int32_t r : rows) {
      off.push_back(off.back() + r);
      pad.push_back(pad.back() + static_cast<int32_t>(fp8_act_rows(r)));
    }
    const int64_t m = off.back(), total = pad.back();
    const std::vector<uint16_t> x = blocky_bf16(m, k, 1, static_cast<uint32_t>(n + k));
    // The experts' weights, quantized on the host in fp8_gemm.h's layout, back to back.
    const int64_t per_q = n * k, per_s = fp8_blocks(n) * fp8_weight_scale_ld(k);
    std::vector<HostFp8> wq;
    std::vector<uint8_t> all_q;
    std::vector<float> all_s;
    for (int64_t e = 0; e < E; ++e) {
      wq.push_back(
          host_quantize_weight(blocky_bf16(n, k, 128, static_cast<uint32_t>(100 + e)), n, k));
      all_q.insert(all_q.end(), wq.back().q.begin(), wq.back().q.end());
      all_s.insert(all_s.end(), wq.back().scale.begin(), wq.back().scale.end());
    }
    Dev dx(x.size() * 2), doff(off.size() * 4), dpad(pad.size() * 4), dq(total * k),
        ds(total * groups * 4), dwq(all_q.size()), dws(all_s.size() * 4),
        dwt(static_cast<size_t>(E * groups * fp8_blocks(n)) * 4), dout((m + 16) * n * 2),
        dref(fp8_act_rows(300) * n * 2);
    put(dx, x), put(doff, off), put(dpad, pad), put(dwq, all_q), put(dws, all_s);
    cuda::quantize_act_fp8_segments(dx.as<uint16_t>(), doff.as<int32_t>(), dpad.as<int32_t>(), E,
                                    total, k, dq.as<uint8_t>(), ds.as<float>(), nullptr, nullptr, 1,
                                    /*tight_scales=*/true);
    cuda::transpose_fp8_weight_scales(dws.as<float>(), E, n, k, dwt.as<float>(), nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto q = get<uint8_t>(dq, static_cast<size_t>(total * k));
    const auto s = get<float>(ds, static_cast<size_t>(total * groups));
    const auto wt = get<float>(dwt, static_cast<size_t>(E * groups * fp8_blocks(n)));
    // Per expert: the quantized rows checked, then the float64 reference and cuBLASLt's output.
    std::vector<std::vector<double>> ref(static_cast<size_t>(E)), mag(static_cast<size_t>(E));
    std::vector<std::vector<uint16_t>> lt_out(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t b = 0; b < groups; ++b)  // the transposed scales, exactly
        for (int64_t a = 0; a < fp8_blocks(n); ++a)
          ASSERT_EQ(wt[static_cast<size_t>((e * groups + b) * fp8_blocks(n) + a)],
                    wq[e].scale[static_cast<size_t>(a * fp8_weight_scale_ld(k) + b)])
              << "expert " << e;
      const int64_t r = rows[e];
      if (r == 0) continue;
      // The tight segment: each row's codes, and its scales strided by the real rows.
      const std::vector<uint16_t> part(x.begin() + off[e] * k, x.begin() + off[e + 1] * k);
      const HostFp8 alone = host_quantize_act(part, r, k);
      const int64_t alone_rows = fp8_act_rows(r);
      EXPECT_EQ(0, std::memcmp(q.data() + pad[e] * k, alone.q.data(), alone.q.size()))
          << "expert " << e;
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t i = 0; i < r; ++i)
          ASSERT_EQ(s[static_cast<size_t>(pad[e] * groups + g * r + i)],
                    alone.scale[static_cast<size_t>(g * alone_rows + i)])
              << "expert " << e << " group " << g << " row " << i;
      for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double sum = 0, abs_sum = 0;
          for (int64_t t = 0; t < k; ++t) {
            const double a = e4m3_value(alone.q[static_cast<size_t>(i * k + t)]) *
                             alone.scale[static_cast<size_t>((t / 128) * alone_rows + i)];
            const double b =
                e4m3_value(wq[e].q[static_cast<size_t>(j * k + t)]) *
                wq[e].scale[static_cast<size_t>((j / 128) * fp8_weight_scale_ld(k) + t / 128)];
            sum += a * b, abs_sum += std::fabs(a * b);
          }
          ref[e].push_back(sum), mag[e].push_back(abs_sum);
        }
      Dev aq(alone.q.size()), as(alone.scale.size() * 4);
      put(aq, alone.q), put(as, alone.scale);
      const cuda::Fp8BlockWeight w{dwq.as<uint8_t>() + e * per_q, dws.as<float>() + e * per_s, n,
                                   k};
      const Status lst =
          (*lt)->run(aq.as<uint8_t>(), as.as<float>(), r, w, dref.as<uint16_t>(), nullptr);
      ASSERT_TRUE(lst.is_ok()) << lst.to_string();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      lt_out[e] = get<uint16_t>(dref, static_cast<size_t>(r * n));
    }
    {
      ASSERT_EQ(cudaMemset(dout.p, 0xff, static_cast<size_t>((m + 16) * n) * 2), cudaSuccess);
      std::vector<cuda::Fp8GemmGroup> gs;
      for (int64_t e = 0; e < E; ++e)
        if (rows[e] > 0)
          gs.push_back({dq.as<uint8_t>() + pad[e] * k, ds.as<float>() + pad[e] * groups, rows[e],
                        dwq.as<uint8_t>() + e * per_q, dwt.as<float>() + e * groups * fp8_blocks(n),
                        dout.as<uint16_t>() + off[e] * n});
      const Status st = (*gemm)->run(gs.data(), static_cast<int64_t>(gs.size()), n, k, nullptr);
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto out = get<uint16_t>(dout, static_cast<size_t>((m + 16) * n));
      EXPECT_TRUE(std::all_of(out.begin() + m * n, out.end(), [](uint16_t v) {
        return v == 0xffff;
      })) << "a write past the last expert's rows";
      for (int64_t e = 0; e < E; ++e)
        if (rows[e] > 0)
          expect_expert_agrees(
              out.data() + off[e] * n, ref[e].data(), mag[e].data(), lt_out[e].data(), rows[e] * n,
              "grouped fp8 n " + std::to_string(n) + " k " + std::to_string(k) + " expert " +
                  std::to_string(e) + " rows " + std::to_string(rows[e]));
    }
  }
}

// The same launch twice gives the same bits (no split-K, no atomics), and launches queued while
// the stream is held (a host callback sleeps on it) each read their own arguments: the third
// reuses the first's staging slot with other arguments, so a slot written too early would send
// the first launch's output elsewhere. Rows past the group's stay untouched.
TEST_F(Fp8GroupedGemmTest, DeterministicAndQueuedLaunchesReadTheirOwnArguments) {
  auto gemm = cuda::Fp8GroupedGemm::create(4);
  ASSERT_TRUE(gemm.is_ok()) << gemm.status().to_string();
  const int64_t n = 256, k = 256, r = 77, groups = fp8_blocks(k);
  const HostFp8 a = host_quantize_act(blocky_bf16(r, k, 1, 7), r, k);
  const HostFp8 w1 = host_quantize_weight(blocky_bf16(n, k, 128, 8), n, k);
  const HostFp8 w2 = host_quantize_weight(blocky_bf16(n, k, 128, 9), n, k);
  // Tight scales of one segment of r rows: [groups][r].
  std::vector<float> tight(static_cast<size_t>(groups * r));
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t i = 0; i < r; ++i)
      tight[static_cast<size_t>(g * r + i)] = a.scale[static_cast<size_t>(g * fp8_act_rows(r) + i)];
  const size_t out_bytes = static_cast<size_t>((r + 16) * n) * 2;  // 16 guard rows
  Dev aq(a.q.size()), as(tight.size() * 4), wq1(w1.q.size()), wq2(w2.q.size()),
      ws(w1.scale.size() * 8), wt(static_cast<size_t>(2 * groups * fp8_blocks(n)) * 4);
  put(aq, a.q), put(as, tight), put(wq1, w1.q), put(wq2, w2.q);
  std::vector<float> both = w1.scale;
  both.insert(both.end(), w2.scale.begin(), w2.scale.end());
  put(ws, both);
  cuda::transpose_fp8_weight_scales(ws.as<float>(), 2, n, k, wt.as<float>(), nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const float* t1 = wt.as<float>();
  const float* t2 = t1 + groups * fp8_blocks(n);
  auto launch = [&](const uint8_t* w, const float* t, uint16_t* o) {
    const cuda::Fp8GemmGroup g{aq.as<uint8_t>(), as.as<float>(), r, w, t, o};
    return (*gemm)->run(&g, 1, n, k, nullptr);
  };
  check_queued_launches(
      [&](int set, uint16_t* o) {
        return set == 0 ? launch(wq1.as<uint8_t>(), t1, o) : launch(wq2.as<uint8_t>(), t2, o);
      },
      out_bytes, static_cast<size_t>(r * n));
}

TEST_F(Fp8GroupedGemmTest, RefusesWhatItCannotRun) {
  auto gemm = cuda::Fp8GroupedGemm::create(2);
  ASSERT_TRUE(gemm.is_ok()) << gemm.status().to_string();
  Dev buf(1 << 20);
  uint8_t* b = buf.as<uint8_t>();
  const float* f = buf.as<float>();
  const cuda::Fp8GemmGroup ok{b, f, 16, b, f, buf.as<uint16_t>()};
  std::vector<cuda::Fp8GemmGroup> three(3, ok);
  EXPECT_EQ((*gemm)->run(three.data(), 3, 256, 256, nullptr).code(), Code::kInvalidArgument);
  EXPECT_EQ((*gemm)->run(&ok, 1, 200, 256, nullptr).code(), Code::kInvalidArgument);
  EXPECT_EQ((*gemm)->run(&ok, 1, 256, 100, nullptr).code(), Code::kInvalidArgument);
  cuda::Fp8GemmGroup empty = ok;
  empty.rows = 0;
  EXPECT_EQ((*gemm)->run(&empty, 1, 256, 256, nullptr).code(), Code::kInvalidArgument);
  cuda::Fp8GemmGroup skewed = ok;
  skewed.act_q = b + 8;
  const Status st = (*gemm)->run(&skewed, 1, 256, 256, nullptr);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("16-byte"), std::string::npos) << st.to_string();
  EXPECT_EQ(cuda::Fp8GroupedGemm::create(0).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace hetero
