// The W4A8 grouped GEMM (kernels/cuda/w4a8_grouped_gemm.h) against the path it replaces: the same
// FP4 experts widened to FP8 in device memory (widen_fp4_experts_to_fp8, checked against the
// checkpoint formats elsewhere) and multiplied by cuBLASLt's block-scaled GEMM per expert. Each
// output against the float64 product of the widened operands with fp8_gemm_test's bound, and
// against cuBLASLt's. Group exponents spread so that groups take the byte-permute widening, the
// exact float one and the lossy one; the lossy counts must equal the widening kernel's. Rows from
// 1 to 513 under every tile (the 64x256 tile's second consumer warp group idle, partly busy and
// busy), a block a tile and a few blocks taking every tile in turn, n with a partial 128-row
// block, k from one k tile to 16 (the pipeline's stages reused).
#include "kernels/cuda/w4a8_grouped_gemm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "cuda_test_base.h"
#include "fp8_test_util.h"
#include "kernels/cuda/checkpoint_formats.h"
#include "kernels/cuda/fp8_gemm.h"

namespace hetero {
namespace {

using namespace fp8_test;

class W4a8GroupedGemmTest : public CudaDeviceTest {};

// FP4 experts [E][n, k] in the checkpoint's layout: random codes; each 128x128 block a base
// exponent, each group below it by 0 (most), 3, 7, 12 (the float widening, exact) or 16 (lossy).
struct HostFp4 {
  std::vector<uint8_t> codes, scales;
};
HostFp4 random_fp4(int64_t E, int64_t n, int64_t k, uint32_t seed) {
  std::mt19937 rng(seed);
  HostFp4 h{std::vector<uint8_t>(static_cast<size_t>(E * n * k / 2)),
            std::vector<uint8_t>(static_cast<size_t>(E * n * k / 32))};
  for (auto& b : h.codes) b = static_cast<uint8_t>(rng());
  const int64_t gpr = k / 32;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < n; ++r)
      for (int64_t g = 0; g < gpr; ++g) {
        std::mt19937 block(static_cast<uint32_t>(seed + e * 1000003 + (r / 128) * 1009 + g / 4));
        const int base = 118 + static_cast<int>(block() % 16);
        const uint32_t u = rng() % 100;
        const int below = u < 80 ? 0 : u < 88 ? 3 : u < 94 ? 7 : u < 97 ? 12 : 16;
        h.scales[static_cast<size_t>((e * n + r) * gpr + g)] = static_cast<uint8_t>(base - below);
      }
  return h;
}

struct Case {
  int64_t n, k;
  std::vector<int32_t> rows;  // per expert; 0: not in the launch
};

TEST_F(W4a8GroupedGemmTest, MatchesTheWidenedPathAndFloat64) {
  auto gemm = cuda::W4a8GroupedGemm::create(16);
  ASSERT_TRUE(gemm.is_ok()) << gemm.status().to_string();
  auto lt = cuda::Fp8Gemm::create();
  ASSERT_TRUE(lt.is_ok()) << lt.status().to_string();
  const std::vector<Case> cases = {
      {256, 512, {3, 0, 1, 16, 17, 0, 200, 130, 15, 300}},
      {192, 384, {64, 65, 63, 127, 128, 129}},  // n: a partial 128-row block
      {128, 128, {1, 40, 0, 256}},
      // Two k tiles; groups over two and three 256-row tiles (the 64x256 tile's second consumer
      // warp group partly busy, idle and busy past the first tile).
      {128, 256, {129, 256, 257, 513}},
      // 16 k tiles: every cp.async stage and both widened buffers are reused several times.
      {256, 2048, {5, 130, 0, 64, 200}},
  };
  for (const Case& cs : cases) {
    const int64_t n = cs.n, k = cs.k, E = static_cast<int64_t>(cs.rows.size());
    const int64_t groups = fp8_blocks(k);
    std::vector<int32_t> off = {0}, pad = {0}, active;
    for (int64_t e = 0; e < E; ++e) {
      off.push_back(off.back() + cs.rows[e]);
      pad.push_back(pad.back() + static_cast<int32_t>(fp8_act_rows(cs.rows[e])));
      if (cs.rows[e] > 0) active.push_back(static_cast<int32_t>(e));
    }
    const int64_t m = off.back(), total = pad.back();
    const HostFp4 w4 = random_fp4(E, n, k, static_cast<uint32_t>(n * 7 + k));
    const std::vector<uint16_t> x = blocky_bf16(m, k, 1, static_cast<uint32_t>(n + k));
    const int64_t per_q = n * k, per_s = fp8_blocks(n) * fp8_weight_scale_ld(k);
    Dev dx(x.size() * 2), doff(off.size() * 4), dpad(pad.size() * 4), dq(total * k),
        ds(total * groups * 4), dc(w4.codes.size()), dsc(w4.scales.size()),
        dbm(cuda::Fp4Experts::block_max_bytes(E, n, k)), dact(active.size() * 4), dwq(E * per_q),
        dws(E * per_s * 4), dlw(8), dlf(8),
        dref(fp8_act_rows(*std::max_element(cs.rows.begin(), cs.rows.end())) * n * 2);
    put(dx, x), put(doff, off), put(dpad, pad), put(dc, w4.codes), put(dsc, w4.scales);
    put(dact, active);
    ASSERT_EQ(cudaMemset(dlw.p, 0, 8), cudaSuccess);
    cuda::quantize_act_fp8_segments(dx.as<uint16_t>(), doff.as<int32_t>(), dpad.as<int32_t>(), E,
                                    total, k, dq.as<uint8_t>(), ds.as<float>(), nullptr);
    const cuda::Fp4GroupWeight w0{dc.as<uint8_t>(), dsc.as<uint8_t>(), n, k};
    cuda::fp4_block_max(w0, E, dbm.as<uint8_t>(), nullptr);
    cuda::widen_fp4_experts_to_fp8(w0, dact.as<int32_t>(), static_cast<int64_t>(active.size()),
                                   dwq.as<uint8_t>(), dws.as<float>(), dlw.as<unsigned long long>(),
                                   nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto q = get<uint8_t>(dq, static_cast<size_t>(total * k));
    const auto s = get<float>(ds, static_cast<size_t>(total * groups));
    const auto wq = get<uint8_t>(dwq, static_cast<size_t>(E * per_q));
    const auto wsc = get<float>(dws, static_cast<size_t>(E * per_s));
    const auto lossy_widen = get<unsigned long long>(dlw, 1)[0];
    // Per expert: the float64 reference of the widened operands, and cuBLASLt's output.
    std::vector<std::vector<double>> ref(static_cast<size_t>(E)), mag(static_cast<size_t>(E));
    std::vector<std::vector<uint16_t>> lt_out(static_cast<size_t>(E));
    for (int64_t e : active) {
      const int64_t r = cs.rows[e], R = fp8_act_rows(r);
      for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double sum = 0, abs_sum = 0;
          for (int64_t t = 0; t < k; ++t) {
            const double a = e4m3_value(q[static_cast<size_t>((pad[e] + i) * k + t)]) *
                             s[static_cast<size_t>(pad[e] * groups + (t / 128) * R + i)];
            const double b =
                e4m3_value(wq[static_cast<size_t>(e * per_q + j * k + t)]) *
                wsc[static_cast<size_t>(e * per_s + (j / 128) * fp8_weight_scale_ld(k) + t / 128)];
            sum += a * b, abs_sum += std::fabs(a * b);
          }
          ref[e].push_back(sum), mag[e].push_back(abs_sum);
        }
      const cuda::Fp8BlockWeight w{dwq.as<uint8_t>() + e * per_q, dws.as<float>() + e * per_s, n,
                                   k};
      const Status lst = (*lt)->run(dq.as<uint8_t>() + pad[e] * k, ds.as<float>() + pad[e] * groups,
                                    r, w, dref.as<uint16_t>(), nullptr);
      ASSERT_TRUE(lst.is_ok()) << lst.to_string();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      lt_out[e] = get<uint16_t>(dref, static_cast<size_t>(r * n));
    }
    // Every tile, with a block a tile and with one or three blocks taking every tile in turn (the
    // pipeline running on across tiles, groups and, at one k tile, several tiles ahead), and
    // with more blocks allowed than there are tiles; each against the same tile's block-a-tile
    // bits too.
    std::map<std::pair<int, int>, std::vector<uint16_t>> one_each;
    for (auto [tile_m, tile, blocks] :
         {std::tuple{64, 64, 0}, std::tuple{64, 128, 0}, std::tuple{128, 64, 0},
          std::tuple{128, 128, 0}, std::tuple{64, 256, 0}, std::tuple{128, 128, 1},
          std::tuple{128, 128, 3}, std::tuple{64, 256, 1}, std::tuple{64, 256, 3},
          std::tuple{64, 64, 3}, std::tuple{128, 64, 2}, std::tuple{64, 128, 1},
          std::tuple{128, 128, 100000}}) {
      (*gemm)->set_tile(tile_m, tile);  // n 192: 64 weight rows whatever is asked
      (*gemm)->set_max_blocks(blocks);
      Dev dout((m + 16) * n * 2);
      ASSERT_EQ(cudaMemset(dout.p, 0xff, static_cast<size_t>((m + 16) * n) * 2), cudaSuccess);
      ASSERT_EQ(cudaMemset(dlf.p, 0, 8), cudaSuccess);
      std::vector<cuda::W4a8Group> gs;
      for (int64_t e : active)
        gs.push_back({dq.as<uint8_t>() + pad[e] * k, ds.as<float>() + pad[e] * groups, cs.rows[e],
                      e, dout.as<uint16_t>() + off[e] * n});
      const cuda::Fp4Experts experts{w0, dbm.as<uint8_t>(), E};
      const Status st = (*gemm)->run(gs.data(), static_cast<int64_t>(gs.size()), experts,
                                     dlf.as<unsigned long long>(), nullptr);
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto out = get<uint16_t>(dout, static_cast<size_t>((m + 16) * n));
      const std::pair<int, int> key{tile_m, tile};
      if (blocks == 0)
        one_each[key] = out;
      else
        EXPECT_TRUE(out == one_each[key])
            << "n " << n << " k " << k << " tile " << tile_m << "x" << tile << ": " << blocks
            << " blocks gave other bits than a block a tile";
      EXPECT_EQ(get<unsigned long long>(dlf, 1)[0], lossy_widen)
          << "the lossy groups, counted as the widening kernel counts them";
      EXPECT_TRUE(std::all_of(out.begin() + m * n, out.end(), [](uint16_t v) {
        return v == 0xffff;
      })) << "a write past the last expert's rows";
      for (int64_t e : active)
        expect_expert_agrees(out.data() + off[e] * n, ref[e].data(), mag[e].data(),
                             lt_out[e].data(), cs.rows[e] * n,
                             "w4a8 n " + std::to_string(n) + " k " + std::to_string(k) + " tile " +
                                 std::to_string(tile_m) + "x" + std::to_string(tile) + " blocks " +
                                 std::to_string(blocks) + " expert " + std::to_string(e) +
                                 " rows " + std::to_string(cs.rows[e]));
    }
    std::printf("[ w4a8 n %lld k %lld ] lossy groups %llu\n", static_cast<long long>(n),
                static_cast<long long>(k), lossy_widen);
  }
}

// Launches queued while the stream is held each read their own arguments (the third reuses the
// first's staging slot with another expert), and the same launch gives the same bits.
TEST_F(W4a8GroupedGemmTest, DeterministicAndQueuedLaunchesReadTheirOwnArguments) {
  auto gemm = cuda::W4a8GroupedGemm::create(2);
  ASSERT_TRUE(gemm.is_ok()) << gemm.status().to_string();
  const int64_t n = 128, k = 256, r = 77, groups = fp8_blocks(k), R = fp8_act_rows(r);
  const HostFp4 w4 = random_fp4(2, n, k, 5);
  const HostFp8 a = host_quantize_act(blocky_bf16(r, k, 1, 7), r, k);
  const size_t out_bytes = static_cast<size_t>((r + 16) * n) * 2;
  Dev aq(a.q.size()), as(a.scale.size() * 4), dc(w4.codes.size()), dsc(w4.scales.size()),
      dbm(cuda::Fp4Experts::block_max_bytes(2, n, k));
  put(aq, a.q), put(as, a.scale), put(dc, w4.codes), put(dsc, w4.scales);
  const cuda::Fp4GroupWeight w0{dc.as<uint8_t>(), dsc.as<uint8_t>(), n, k};
  cuda::fp4_block_max(w0, 2, dbm.as<uint8_t>(), nullptr);
  const cuda::Fp4Experts experts{w0, dbm.as<uint8_t>(), 2};
  ASSERT_EQ(groups * R, static_cast<int64_t>(a.scale.size()));
  auto launch = [&](int64_t e, uint16_t* o) {
    const cuda::W4a8Group g{aq.as<uint8_t>(), as.as<float>(), r, e, o};
    return (*gemm)->run(&g, 1, experts, nullptr, nullptr);
  };
  check_queued_launches(launch, out_bytes, static_cast<size_t>(r * n));
}

TEST_F(W4a8GroupedGemmTest, RefusesWhatItCannotRun) {
  auto gemm = cuda::W4a8GroupedGemm::create(2);
  ASSERT_TRUE(gemm.is_ok()) << gemm.status().to_string();
  Dev buf(1 << 20);
  uint8_t* b = buf.as<uint8_t>();
  const float* f = buf.as<float>();
  const cuda::W4a8Group ok{b, f, 16, 0, buf.as<uint16_t>()};
  const cuda::Fp4Experts w{{b, b, 128, 256}, b, 2};
  std::vector<cuda::W4a8Group> three(3, ok);
  EXPECT_EQ((*gemm)->run(three.data(), 3, w, nullptr, nullptr).code(), Code::kInvalidArgument);
  cuda::Fp4Experts odd = w;
  odd.w0.n = 96;
  EXPECT_EQ((*gemm)->run(&ok, 1, odd, nullptr, nullptr).code(), Code::kInvalidArgument);
  odd = w;
  odd.w0.k = 192;
  EXPECT_EQ((*gemm)->run(&ok, 1, odd, nullptr, nullptr).code(), Code::kInvalidArgument);
  odd = w;
  odd.w0.codes = b + 8;  // cp.async copies the codes 16 bytes at a time
  EXPECT_EQ((*gemm)->run(&ok, 1, odd, nullptr, nullptr).code(), Code::kInvalidArgument);
  EXPECT_FALSE(cuda::W4a8GroupedGemm::supports(128, 16384).is_ok());
  cuda::W4a8Group bad = ok;
  bad.expert = 2;
  EXPECT_EQ((*gemm)->run(&bad, 1, w, nullptr, nullptr).code(), Code::kInvalidArgument);
  bad = ok;
  bad.rows = 0;
  EXPECT_EQ((*gemm)->run(&bad, 1, w, nullptr, nullptr).code(), Code::kInvalidArgument);
  bad = ok;
  bad.act_q = b + 8;
  const Status st = (*gemm)->run(&bad, 1, w, nullptr, nullptr);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("16-byte"), std::string::npos) << st.to_string();
  EXPECT_EQ(cuda::W4a8GroupedGemm::create(0).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace hetero
