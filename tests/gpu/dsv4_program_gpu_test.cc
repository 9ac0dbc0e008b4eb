// The DeepSeek-V4 cache program on the GPU against the CPU program, array for array and bit for
// bit (memcmp): dense bf16, mxfp4 and affine weights; layers of ratio 0, 4 and 128; T in
// {1, 5, 130, 301, 1031}; decoder call schedules with tokenwise calls, multi-token calls and one
// call; feed chunkings whole, fixed and random, from host and device memory, with the program's
// internal blocks cutting windows elsewhere. Every feed's new pooled rows and every finished array
// are compared, and (where the feeding keeps them) each layer's state at every feed's end, the
// state a broken or sealed stream mounts. The CPU program is proven against the decoder
// (tests/py/test_dsv4_exactness.py), so this chains the GPU program to the decoder's own cache.
// Skips itself without a GPU.
#include "bridge/cuda/dsv4_program_gpu.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../common/dsv4_test_weights.h"
#include "bridge/dsv4_program.h"
#include "cuda_test_base.h"

namespace hetero {
namespace {

using cuda::Dsv4GpuCacheProgram;
using cuda::Dsv4GpuWeights;

class Dsv4GpuProgram : public CudaDeviceTest {};

// A non-blocking stream, destroyed with the object: the program's side stream.
cuda::Stream new_stream() {
  auto s = cuda::Stream::create();
  EXPECT_TRUE(s.is_ok()) << s.status().to_string();
  return s.is_ok() ? std::move(s.value()) : cuda::Stream();
}

// Each layer's attention input, on the host and (for feed_device) on the device.
struct Inputs {
  std::vector<std::vector<uint16_t>> host;
  std::vector<cuda::DeviceBuffer> device;
};

Inputs make_inputs(const Dsv4DecoderWeights& w, int64_t T, uint32_t seed) {
  Inputs in;
  for (int64_t l = 0; l < w.layout.layers; ++l) {
    in.host.push_back(random_dsv4_x(T, w.layout.hidden, seed + static_cast<uint32_t>(l)));
    cuda::DeviceBuffer d;
    EXPECT_TRUE(d.allocate(in.host.back().size() * 2, "a test input").is_ok());
    EXPECT_EQ(cudaMemcpy(d.get(), in.host.back().data(), in.host.back().size() * 2,
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    in.device.push_back(std::move(d));
  }
  return in;
}

// Bit-exact (the contract): same dtype and shape, memcmp of the bytes; on failure the first
// differing bf16 value.
void expect_same(const Tensor& gpu, const Tensor& cpu, const std::string& what) {
  EXPECT_EQ(gpu.dtype, cpu.dtype) << what;
  ASSERT_EQ(gpu.shape, cpu.shape) << what;
  ASSERT_EQ(gpu.bytes.size(), cpu.bytes.size()) << what;
  if (cpu.bytes.empty() || std::memcmp(gpu.bytes.data(), cpu.bytes.data(), cpu.bytes.size()) == 0)
    return;
  const auto* g = gpu.data<uint16_t>();
  const auto* c = cpu.data<uint16_t>();
  size_t first = 0, count = 0;
  for (size_t i = cpu.bytes.size() / 2; i-- > 0;)
    if (g[i] != c[i]) first = i, ++count;
  ADD_FAILURE() << what << ": " << count << " bf16 values differ; first at " << first << ": gpu 0x"
                << std::hex << g[first] << " cpu 0x" << c[first];
}

void expect_same_rows(const Dsv4NewRows& gpu, const Dsv4NewRows& cpu, const std::string& what) {
  EXPECT_EQ(gpu.first, cpu.first) << what;
  EXPECT_EQ(gpu.count, cpu.count) << what;
  EXPECT_TRUE(gpu.pool == cpu.pool) << what << ": pooled rows differ";
  EXPECT_TRUE(gpu.index == cpu.index) << what << ": indexer rows differ";
}

struct Feeding {
  std::vector<int64_t> chunks;  // the prefill's chunk lengths, sum T
  bool device_x = false;
  int64_t block_rows = Dsv4GpuCacheProgram::kDefaultBlockRows;
  bool boundaries = false;  // keep_boundary_state, and compare boundary_layer at every feed's end
};

void expect_same_layer(const Dsv4LayerArrays& got, const Dsv4LayerArrays& want,
                       const std::string& at) {
  EXPECT_EQ(got.ratio, want.ratio) << at;
  expect_same(got.window, want.window, at + "window");
  for (auto [g, c, name] :
       {std::tuple{&got.pool, &want.pool, "pool"}, std::tuple{&got.index, &want.index, "index"}}) {
    expect_same(g->pooled, c->pooled, at + name + ".pooled");
    expect_same(g->buf_kv, c->buf_kv, at + name + ".buf_kv");
    expect_same(g->buf_gate, c->buf_gate, at + name + ".buf_gate");
  }
}

// Feeds both programs chunk by chunk (every layer per chunk, as the prefill taps them) and
// compares each feed's rows, then every layer's finished arrays.
void run_both(const Dsv4DecoderWeights& w, const Dsv4GpuWeights& gw,
              const std::vector<int64_t>& calls, const Inputs& in, const Feeding& f,
              cudaStream_t stream, const std::string& what) {
  Dsv4CacheProgram cpu(&w, calls);
  Dsv4GpuCacheProgram gpu(&gw, calls, stream, f.block_rows);
  if (f.boundaries) {
    ASSERT_TRUE(gpu.keep_boundary_state().is_ok()) << what;
  }
  ASSERT_EQ(gpu.tokens(), cpu.tokens()) << what;
  EXPECT_EQ(gpu.window_idx(), cpu.window_idx()) << what;
  const int64_t H = w.layout.hidden;
  int64_t p = 0;
  for (int64_t n : f.chunks) {
    for (int64_t l = 0; l < w.layout.layers; ++l) {
      const auto li = static_cast<size_t>(l);
      Dsv4NewRows want, got;
      ASSERT_TRUE(cpu.feed(l, p, n, in.host[li].data() + p * H, &want).is_ok()) << what;
      const Status s = f.device_x
                           ? gpu.feed_device(l, p, n, in.device[li].get<uint16_t>() + p * H, &got)
                           : gpu.feed(l, p, n, in.host[li].data() + p * H, &got);
      ASSERT_TRUE(s.is_ok()) << what << ": " << s.to_string();
      const std::string at = what + " layer " + std::to_string(l) + " feed at " + std::to_string(p);
      expect_same_rows(got, want, at);
      if (f.boundaries && p + n < cpu.tokens()) {
        auto cpu_state = cpu.boundary_layer(l);
        auto gpu_state = gpu.boundary_layer(l);
        ASSERT_TRUE(cpu_state.is_ok()) << at << ": " << cpu_state.status().to_string();
        ASSERT_TRUE(gpu_state.is_ok()) << at << ": " << gpu_state.status().to_string();
        expect_same_layer(*gpu_state, *cpu_state, at + " state at its end: ");
      }
      if (::testing::Test::HasFailure()) return;
    }
    p += n;
  }
  for (int64_t l = 0; l < w.layout.layers; ++l) {
    auto want = cpu.finish_layer(l);
    auto got = gpu.finish_layer(l);
    ASSERT_TRUE(want.is_ok()) << what;
    ASSERT_TRUE(got.is_ok()) << what << ": " << got.status().to_string();
    expect_same_layer(*got, *want, what + " layer " + std::to_string(l) + " ");
  }
}

std::vector<int64_t> fixed_chunks(int64_t T, int64_t size) {
  std::vector<int64_t> c;
  for (int64_t p = 0; p < T; p += size) c.push_back(std::min(size, T - p));
  return c;
}

std::vector<int64_t> random_chunks(int64_t T, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int64_t> c;
  for (int64_t p = 0; p < T;) {
    const int64_t n = std::min<int64_t>(1 + static_cast<int64_t>(rng() % 200), T - p);
    c.push_back(n);
    p += n;
  }
  return c;
}

// Decoder calls mixing tokenwise calls (1..8 tokens) with multi-token ones, cut to T.
std::vector<int64_t> mixed_calls(int64_t T) {
  static const int64_t kLens[] = {3, 1, 17, 8, 130, 2, 5, 64, 9, 1, 257};
  std::vector<int64_t> c;
  for (int64_t p = 0, i = 0; p < T; ++i) {
    const int64_t n = std::min(kLens[i % 11], T - p);
    c.push_back(n);
    p += n;
  }
  return c;
}

struct WeightsCase {
  const char* name;
  Dsv4TestShape shape;
};

std::vector<WeightsCase> weight_cases() {
  Dsv4TestShape dense;  // head_dim 64 and the real window: the GEMM tiles and a 128-row ring
  dense.hidden = 96, dense.head_dim = 64, dense.index_head_dim = 32, dense.window = 128;
  dense.rope_dims = 16;
  Dsv4TestShape mx;  // a small window: the ring wraps at every T
  mx.hidden = 64, mx.head_dim = 32, mx.index_head_dim = 16, mx.window = 8, mx.rope_dims = 8;
  mx.mode = DecoderLinear::Mode::kMx, mx.seed = 11;
  Dsv4TestShape affine = mx;
  affine.mode = DecoderLinear::Mode::kAffine, affine.seed = 13;
  return {{"dense", dense}, {"mxfp4", mx}, {"affine", affine}};
}

TEST_F(Dsv4GpuProgram, SameArraysAsTheCpuProgram) {
  cuda::Stream stream = new_stream();
  for (const WeightsCase& wc : weight_cases()) {
    const Dsv4DecoderWeights w = random_dsv4_weights(wc.shape);
    auto gw = cuda::upload_dsv4_weights(w);
    ASSERT_TRUE(gw.is_ok()) << gw.status().to_string();
    for (int64_t T : {1, 5, 130, 301, 1031}) {
      const Inputs in = make_inputs(w, T, static_cast<uint32_t>(T));
      const std::pair<const char*, std::vector<int64_t>> schedules[] = {
          {"server-2048", dsv4_server_calls(T, 2048)},
          {"server-64", dsv4_server_calls(T, 64)},
          {"one-call", {T}},
          {"mixed", mixed_calls(T)},
      };
      // Host and device inputs; the default block, and small blocks that cut windows inside
      // a feed (37 and 50 are neither multiples of 4 nor of the window); the state at every
      // feed's end from host and device inputs, with a block smaller than the window.
      const std::pair<const char*, Feeding> feedings[] = {
          {"whole/host", {{T}, false}},
          {"7s/device/states", {fixed_chunks(T, 7), true, Feeding{}.block_rows, true}},
          {"128s/host/block37/states", {fixed_chunks(T, 128), false, 37, true}},
          {"random/device/block50", {random_chunks(T, static_cast<uint32_t>(T) + 5), true, 50}},
      };
      for (const auto& [sname, calls] : schedules)
        for (const auto& [fname, feeding] : feedings) {
          run_both(w, **gw, calls, in, feeding, stream.get(),
                   std::string(wc.name) + " T=" + std::to_string(T) + " " + sname + " " + fname);
          if (HasFailure()) return;  // one failing case says enough
        }
    }
  }
}

// At the target's context (issue 16): a prompt one token short of Flash's 1,048,576 positions,
// fed from the device in the CUDA prefill's 32,768-token chunks under the decoder server's
// 2,048-token calls; every feed's rows, the state at every chunk's end and every finished array
// bit-identical to the CPU program's on the same inputs.
TEST_F(Dsv4GpuProgram, SameArraysAsTheCpuProgramAtAMillionTokens) {
  const WeightsCase wc = weight_cases()[0];
  const Dsv4DecoderWeights w = random_dsv4_weights(wc.shape);
  auto gw = cuda::upload_dsv4_weights(w);
  ASSERT_TRUE(gw.is_ok()) << gw.status().to_string();
  const int64_t T = (int64_t{1} << 20) - 1;
  const Inputs in = make_inputs(w, T, 7);
  cuda::Stream stream = new_stream();
  run_both(w, **gw, dsv4_server_calls(T, 2048), in,
           {fixed_chunks(T, 32768), true, Feeding{}.block_rows, true}, stream.get(),
           "dense T=" + std::to_string(T));
}

// Two requests on two streams from two threads share one upload of the weights.
// A later turn's tail: the GPU program's checkpoint after a first turn is the CPU program's, field
// for field, and a tail program resumed from either checkpoint, on either side, gives the CPU
// tail's rows and arrays (which tests/unit/dsv4_tail_test.cc proves equal to the whole request's).
TEST_F(Dsv4GpuProgram, TailsResumeFromEitherProgramsCheckpoint) {
  cuda::Stream stream = new_stream();
  for (const WeightsCase& wc : weight_cases()) {
    const Dsv4DecoderWeights w = random_dsv4_weights(wc.shape);
    auto gw = cuda::upload_dsv4_weights(w);
    ASSERT_TRUE(gw.is_ok()) << gw.status().to_string();
    const std::vector<int64_t> turn1 = {64, 64, 3}, turn2 = {1, 100, 41, 7, 1};
    int64_t C = 0, T = 0;
    for (int64_t n : turn1) C += n;
    T = C;
    for (int64_t n : turn2) T += n;
    const Inputs in = make_inputs(w, T, 41);
    const int64_t H = w.layout.hidden;
    // The first turn on both sides, whole, then their checkpoints.
    Dsv4CacheProgram cpu1(&w, turn1);
    Dsv4GpuCacheProgram gpu1(gw->get(), turn1, stream.get());
    for (int64_t l = 0; l < w.layout.layers; ++l) {
      const auto li = static_cast<size_t>(l);
      ASSERT_TRUE(cpu1.feed(l, 0, C, in.host[li].data(), nullptr).is_ok());
      ASSERT_TRUE(gpu1.feed(l, 0, C, in.host[li].data(), nullptr).is_ok());
      ASSERT_TRUE(cpu1.finish_layer(l).is_ok());
      ASSERT_TRUE(gpu1.finish_layer(l).is_ok());
    }
    auto from_cpu = cpu1.checkpoint();
    ASSERT_TRUE(from_cpu.is_ok()) << from_cpu.status().to_string();
    auto from_gpu = std::make_shared<Dsv4ProgramCheckpoint>();
    from_gpu->weights = &w;
    from_gpu->layers.resize(static_cast<size_t>(w.layout.layers));
    ASSERT_TRUE(gpu1.checkpoint_into(from_gpu.get()).is_ok());
    const auto& want = dynamic_cast<const Dsv4ProgramCheckpoint&>(*from_cpu.value());
    EXPECT_EQ(from_gpu->n, want.n);
    EXPECT_EQ(from_gpu->window_first, want.window_first);
    EXPECT_EQ(from_gpu->window.slot_pos, want.window.slot_pos);
    EXPECT_EQ(from_gpu->bytes(), want.bytes());
    for (size_t l = 0; l < want.layers.size(); ++l) {
      const auto &g = from_gpu->layers[l], &c = want.layers[l];
      EXPECT_TRUE(g.window_rows == c.window_rows) << wc.name << " layer " << l << " window";
      for (auto [gr, cr] : {std::pair{&g.pool, &c.pool}, std::pair{&g.index, &c.index}}) {
        EXPECT_EQ(gr->base, cr->base) << wc.name << " layer " << l;
        EXPECT_TRUE(gr->kv == cr->kv && gr->gate == cr->gate) << wc.name << " layer " << l;
      }
    }
    // The tails: the CPU one from its own checkpoint is the reference.
    Dsv4CacheProgram ref(&w, turn2, C);
    ASSERT_TRUE(ref.resume(want).is_ok());
    Dsv4CacheProgram cpu_from_gpu(&w, turn2, C);
    ASSERT_TRUE(cpu_from_gpu.resume(*from_gpu).is_ok());
    Dsv4GpuCacheProgram gpu_from_cpu(gw->get(), turn2, stream.get(),
                                     Dsv4GpuCacheProgram::kDefaultBlockRows, C);
    Dsv4GpuCacheProgram gpu_from_gpu(gw->get(), turn2, stream.get(), 37, C);
    ASSERT_TRUE(gpu_from_gpu.keep_boundary_state().is_ok());
    EXPECT_FALSE(gpu_from_cpu.feed(0, C, 1, in.host[0].data() + C * H, nullptr).is_ok());
    ASSERT_TRUE(gpu_from_cpu.resume(want).is_ok());
    ASSERT_TRUE(gpu_from_gpu.resume(*from_gpu).is_ok());
    EXPECT_EQ(gpu_from_cpu.window_idx(), ref.window_idx());
    for (int64_t l = 0; l < w.layout.layers; ++l) {
      const auto li = static_cast<size_t>(l);
      const std::string at = std::string(wc.name) + " tail layer " + std::to_string(l) + " ";
      for (int64_t p = C, n = 0; p < T; p += n) {
        n = std::min<int64_t>(60, T - p);
        const uint16_t* x = in.host[li].data() + p * H;
        Dsv4NewRows r0, r1, r2, r3;
        ASSERT_TRUE(ref.feed(l, p, n, x, &r0).is_ok());
        ASSERT_TRUE(cpu_from_gpu.feed(l, p, n, x, &r1).is_ok());
        ASSERT_TRUE(gpu_from_cpu.feed(l, p, n, x, &r2).is_ok());
        ASSERT_TRUE(
            gpu_from_gpu.feed_device(l, p, n, in.device[li].get<uint16_t>() + p * H, &r3).is_ok());
        expect_same_rows(r1, r0, at + "cpu from gpu");
        expect_same_rows(r2, r0, at + "gpu from cpu");
        expect_same_rows(r3, r0, at + "gpu from gpu");
        if (p + n < T) {
          auto want_state = ref.boundary_layer(l);
          auto got_state = gpu_from_gpu.boundary_layer(l);
          ASSERT_TRUE(want_state.is_ok() && got_state.is_ok()) << at;
          expect_same_layer(*got_state, *want_state, at + "state at " + std::to_string(p + n));
        }
      }
      auto a0 = ref.finish_layer(l);
      ASSERT_TRUE(a0.is_ok()) << at;
      for (auto* other : {&gpu_from_cpu, &gpu_from_gpu}) {
        auto a = other->finish_layer(l);
        ASSERT_TRUE(a.is_ok()) << at << a.status().to_string();
        expect_same_layer(*a, *a0, at);
      }
      auto a1 = cpu_from_gpu.finish_layer(l);
      ASSERT_TRUE(a1.is_ok()) << at;
      expect_same_layer(*a1, *a0, at + "cpu from gpu ");
    }
    // A checkpoint of another length is refused.
    Dsv4GpuCacheProgram wrong(gw->get(), turn2, stream.get(), 64, C + 1);
    EXPECT_FALSE(wrong.resume(want).is_ok());
  }
}

TEST_F(Dsv4GpuProgram, TwoRequestsShareTheWeights) {
  const WeightsCase wc = weight_cases()[0];
  const Dsv4DecoderWeights w = random_dsv4_weights(wc.shape);
  auto gw = cuda::upload_dsv4_weights(w);
  ASSERT_TRUE(gw.is_ok()) << gw.status().to_string();
  const int64_t T = 777;
  const Inputs a = make_inputs(w, T, 100), b = make_inputs(w, T, 200);
  cuda::Stream sa = new_stream(), sb = new_stream();
  std::thread ta([&] {
    run_both(w, **gw, dsv4_server_calls(T, 256), a, {fixed_chunks(T, 100), true}, sa.get(), "a");
  });
  std::thread tb([&] {
    run_both(w, **gw, mixed_calls(T), b, {random_chunks(T, 3), false, 64}, sb.get(), "b");
  });
  ta.join();
  tb.join();
}

// The GPU program refuses what the CPU program refuses, with the same codes.
TEST_F(Dsv4GpuProgram, RefusesOutOfOrderRowsAndEarlyFinish) {
  const Dsv4DecoderWeights w = random_dsv4_weights();
  auto gw = cuda::upload_dsv4_weights(w);
  ASSERT_TRUE(gw.is_ok()) << gw.status().to_string();
  cuda::Stream stream = new_stream();
  const int64_t T = 40;
  const auto x = random_dsv4_x(T, w.layout.hidden, 1);
  Dsv4GpuCacheProgram gpu(gw->get(), {T}, stream.get());
  Dsv4CacheProgram cpu(&w, {T});
  for (auto [layer, pos0, n] : {std::tuple{int64_t{0}, int64_t{1}, int64_t{4}},
                                {int64_t{3}, int64_t{0}, int64_t{4}},
                                {int64_t{0}, int64_t{0}, int64_t{41}},
                                {int64_t{0}, int64_t{0}, int64_t{0}}}) {
    const Status g = gpu.feed(layer, pos0, n, x.data(), nullptr);
    const Status c = cpu.feed(layer, pos0, n, x.data(), nullptr);
    EXPECT_FALSE(g.is_ok());
    EXPECT_EQ(g.code(), c.code()) << g.to_string();
  }
  ASSERT_TRUE(gpu.feed(1, 0, 20, x.data(), nullptr).is_ok());
  EXPECT_EQ(gpu.finish_layer(1).status().code(), Code::kFailedPrecondition);
  ASSERT_TRUE(gpu.feed(1, 20, 20, x.data() + 20 * w.layout.hidden, nullptr).is_ok());
  EXPECT_TRUE(gpu.finish_layer(1).is_ok());
  // The layer's device state is gone after finishing: a second finish is refused.
  EXPECT_EQ(gpu.finish_layer(1).status().code(), Code::kFailedPrecondition);
}

}  // namespace
}  // namespace hetero
