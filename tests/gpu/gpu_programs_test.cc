// The cache programs on the GPU behind the bridge producer: the llama program bit-identical to
// the CPU program given the same rows, and the whole GPU path (engine's device tap -> capture
// slots -> program on its side stream -> segments) giving, segment by segment, the arrays the
// CPU program gives for the same rows, with the capture's memory bounded by its slots.
#include "bridge/cuda/gpu_programs.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <map>
#include <thread>
#include <tuple>

#include "bridge/llama_program.h"
#include "bridge/producer.h"
#include "bridge/wire.h"
#include "cuda_test_base.h"
#include "engine/cuda/llama_cuda.h"
#include "engine/cuda/tap_readers.h"
#include "kernels/cpu_ops.h"
#include "llama_test_weights.h"

namespace hetero {
namespace {

LlamaDecoderWeights export_of(const LlamaWeights& w) { return llama_decoder_weights_of(w, "test"); }

class GpuProgramsTest : public CudaDeviceTest {};

// Every layer's K/V rows from the GPU program equal the CPU program's, byte for byte (with
// `calls`: each row roped by its decoder call's own rope on both).
void expect_program_matches_cpu(const LlamaWeights& w, const std::string& label,
                                const RopeByCall* calls = nullptr) {
  const LlamaDecoderWeights d = export_of(w);
  auto gw = cuda::upload_llama_weights(d);
  ASSERT_TRUE(gw.is_ok()) << gw.status().to_string();
  auto stream = cuda::Stream::create();
  ASSERT_TRUE(stream.is_ok()) << stream.status().to_string();
  cuda::DeviceRopeByCall device_calls;
  if (calls) {
    ASSERT_TRUE(device_calls.upload(*calls, &(*gw)->rope).is_ok());
  }
  cuda::LlamaGpuCacheProgram gpu(gw->get(), stream->get(), calls ? &device_calls : nullptr);
  LlamaCacheProgram cpu(&d);
  const int64_t n = 77, pos0 = 1000, H = w.config.hidden;
  const std::vector<uint16_t> x = random_bf16(static_cast<size_t>(n * H), 1.f, 5);
  cuda::DeviceBuffer xd;
  ASSERT_TRUE(xd.allocate(x.size() * 2, "a test input").is_ok());
  cudaMemcpy(xd.get(), x.data(), x.size() * 2, cudaMemcpyHostToDevice);
  for (int64_t l = 0; l < w.config.layers; ++l) {
    auto got = gpu.run_device(l, pos0, n, xd.get<uint16_t>());
    ASSERT_TRUE(got.is_ok()) << got.status().to_string();
    const KvRows want = cpu.run(l, pos0, n, x.data(), calls);
    ASSERT_EQ(got->keys.shape, want.keys.shape);
    EXPECT_EQ(got->keys.bytes, want.keys.bytes) << label << " layer " << l << " keys";
    EXPECT_EQ(got->values.bytes, want.values.bytes) << label << " layer " << l << " values";
  }
}

TEST_F(GpuProgramsTest, LlamaProgramBitIdenticalToCpu) {
  for (const VariantCase& v : variant_cases())
    expect_program_matches_cpu(tiny_llama(v.type, 64, 21, v.scaling, v.traditional), v.type);
}

// A dynamic rope past max_position_embeddings: the rows of each of the decoder's calls (here one
// ending inside the program's 77 rows, at 1,030, and one after it) roped with that call's base,
// on both of mlx-lm's paths; and those bases do change the rows.
TEST_F(GpuProgramsTest, DynamicRopeByTheDecodersCallsBitIdenticalToCpu) {
  LlamaWeights w = tiny_llama("llama", 64, 21, {{"type", "dynamic"}, {"factor", 3.0}});
  w.config.rope_config.max_position_embeddings = 500;
  w.config.rope = llama_rope(w.config.rope_config).value();
  for (const bool batched : {true, false}) {
    auto calls = RopeByCall::make(w.config.rope_config, w.config.rope, 0, {1030, 47}, batched);
    ASSERT_TRUE(calls.is_ok()) << calls.status().to_string();
    ASSERT_TRUE(calls->per_call());
    expect_program_matches_cpu(w, batched ? "dynamic, batch path" : "dynamic, single path",
                               &calls.value());
    const LlamaDecoderWeights d = export_of(w);
    const std::vector<uint16_t> x = random_bf16(static_cast<size_t>(77 * w.config.hidden), 1.f, 5);
    LlamaCacheProgram cpu(&d);
    EXPECT_NE(cpu.run(0, 1000, 77, x.data(), &calls.value()).keys.bytes,
              cpu.run(0, 1000, 77, x.data()).keys.bytes);
  }
}

// An mlx-lm-quantized decoder's k/v (affine, 4 and 8 bits; mxfp4 and mxfp8; qwen2's biases added
// after the quantized matmul) through MLX's quantized-matmul recipes on the device.
TEST_F(GpuProgramsTest, QuantizedLlamaProgramBitIdenticalToCpu) {
  for (const auto& [type, bits, group, mode] : {std::tuple{"llama", 4, 32, "affine"},
                                                {"qwen2", 8, 64, "affine"},
                                                {"qwen3", 4, 64, "affine"},
                                                {"llama", 4, 32, "mxfp4"},
                                                {"qwen2", 8, 32, "mxfp8"}}) {
    LlamaWeights w = tiny_llama(type, 64, 21);
    quantize_projections(w, bits, group, mode);
    expect_program_matches_cpu(w, std::string(type) + " " + w.quantization);
  }
}

// Segments as the receiver sees them: arrays by name, per segment.
struct Received {
  std::vector<std::map<std::string, Tensor>> segments;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  bool manifest_complete = false;
};

BridgeProducer::FrameSink collect(Received* r) {
  return [r](std::string frame) {
    FrameParser parser(int64_t{1} << 30);
    parser.feed(frame.data(), frame.size());
    auto f = parser.next();
    EXPECT_TRUE(f.is_ok() && f->has_value());
    if (!f.is_ok() || !f->has_value()) return false;
    if ((**f).header.value("kind", "") == "manifest") {
      auto m = decode_manifest(**f);
      EXPECT_TRUE(m.is_ok());
      r->manifest_complete = m.is_ok() && m->complete;
      return true;
    }
    auto s = decode_segment(**f);
    EXPECT_TRUE(s.is_ok()) << s.status().to_string();
    if (!s.is_ok()) return false;
    std::map<std::string, Tensor> arrays;
    for (auto& a : s->arrays) arrays[a.name] = a.tensor;
    r->segments.push_back(std::move(arrays));
    r->ranges.push_back({s->pos0, s->n_tokens});
    return true;
  };
}

// The engine on GPU 0 with its device tap feeding the GPU program on program_device (-1: the
// same GPU) through the capture; the CPU program gets the same rows from the host tap.
void expect_cpu_programs_segments(int program_device) {
  const LlamaWeights w = tiny_llama("qwen3", 128, 9);
  const LlamaDecoderWeights d = export_of(w);
  auto gw = [&] {
    cuda::DeviceGuard on_program(program_device);
    return cuda::upload_llama_weights(d);
  }();
  ASSERT_TRUE(gw.is_ok());
  // Host tap on, so the same rows also reach the CPU program for the reference.
  auto engine = cuda::LlamaCudaEngine::create(w, {cuda::KvDtype::kFp8, /*host_tap=*/true, 0});
  ASSERT_TRUE(engine.is_ok());
  constexpr int kSlots = 2;
  auto made = cuda::GpuCaptureStore::create(kSlots, program_device);
  ASSERT_TRUE(made.is_ok()) << made.status().to_string();
  cuda::GpuCaptureStore& capture = **made;
  auto on_program = [&] {
    cuda::DeviceGuard guard(program_device);
    return cuda::LlamaGpuSegmentProgram::create(gw->get());
  }();
  ASSERT_TRUE(on_program.is_ok()) << on_program.status().to_string();
  cuda::LlamaGpuSegmentProgram& gpu_program = **on_program;
  // The program's rows and stream are on its GPU.
  cudaPointerAttributes where{};
  ASSERT_EQ(cudaPointerGetAttributes(&where, (*gw)->layers[0].wk.wt.get<float>()), cudaSuccess);
  EXPECT_EQ(where.device, program_device < 0 ? 0 : program_device);
  LlamaCacheProgram cpu_cache(&d);
  LlamaSegmentProgram cpu_program(&cpu_cache);
  Received got, want;
  BridgeProducer gpu(&gpu_program, collect(&got), 4, &capture);
  BridgeProducer cpu(&cpu_program, collect(&want));
  const AttentionInputTap gpu_tap = gpu.tap(), cpu_tap = cpu.tap();
  auto both = [&](const TapEvent& e) {
    gpu_tap(e);
    TapEvent host = e;
    host.x_device = nullptr;
    cpu_tap(host);
  };
  const std::vector<int32_t> ids = random_ids(500, w.config.vocab, 4);
  const int64_t chunk = 128;
  for (int64_t pos = 0; pos < 500; pos += chunk) {
    const int64_t n = std::min<int64_t>(chunk, 500 - pos);
    ASSERT_TRUE((*engine)->prefill_chunk({ids.begin() + pos, ids.begin() + pos + n}, both).is_ok());
  }
  ASSERT_TRUE((*engine)->synchronize().is_ok());
  const Manifest mg = gpu.finish(500, Status::ok());
  cpu.finish(500, Status::ok());
  EXPECT_TRUE(mg.complete) << mg.reason;
  EXPECT_TRUE(got.manifest_complete);
  ASSERT_EQ(got.segments.size(), 4u);
  ASSERT_EQ(got.ranges, want.ranges);
  for (size_t s = 0; s < got.segments.size(); ++s) {
    ASSERT_EQ(got.segments[s].size(), want.segments[s].size());
    for (const auto& [name, t] : want.segments[s]) {
      ASSERT_TRUE(got.segments[s].count(name)) << name;
      const Tensor& g = got.segments[s].at(name);
      EXPECT_EQ(g.shape, t.shape) << name;
      EXPECT_TRUE(g.bytes == t.bytes) << "segment " << s << " " << name;
    }
  }
  // The capture held at most its slots' worth of one chunk's rows.
  EXPECT_LE(capture.device_bytes(), static_cast<size_t>(kSlots * chunk * w.config.hidden * 2));
  EXPECT_GT(capture.device_bytes(), 0u);
}

TEST_F(GpuProgramsTest, DeviceCaptureStreamsTheCpuProgramsSegments) {
  expect_cpu_programs_segments(-1);
}

// The program on a second GPU: the rows cross peer to peer, the segments are the same.
TEST_F(GpuProgramsTest, ProgramOnASecondGpuStreamsTheSameSegments) {
  int devices = 0;
  cudaGetDeviceCount(&devices);
  if (devices < 2) GTEST_SKIP() << "one GPU: no second GPU for the program";
  expect_cpu_programs_segments(1);
}

// A producer with a GPU program refuses a tap without device rows (a CPU engine's) in its
// manifest instead of reading a null pointer.
TEST_F(GpuProgramsTest, GpuProgramWithoutDeviceRowsFailsTheManifest) {
  const LlamaWeights w = tiny_llama("llama", 64, 1);
  const LlamaDecoderWeights d = export_of(w);
  auto gw = cuda::upload_llama_weights(d);
  ASSERT_TRUE(gw.is_ok());
  auto capture = cuda::GpuCaptureStore::create(2);
  ASSERT_TRUE(capture.is_ok());
  auto program = cuda::LlamaGpuSegmentProgram::create(gw->get());
  ASSERT_TRUE(program.is_ok());
  Received got;
  BridgeProducer producer(program->get(), collect(&got), 4, capture->get());
  std::vector<uint16_t> x(static_cast<size_t>(4 * w.config.hidden));
  producer.tap()(TapEvent{0, 0, 4, w.config.hidden, x.data()});
  const Manifest m = producer.finish(4, Status::ok());
  EXPECT_FALSE(m.complete);
  EXPECT_NE(m.reason.find("device rows"), std::string::npos) << m.reason;
}

// A capture on its own stream (TapEvent::x_read): the engine's stream does not wait behind the
// copy, but its next write of x waits for it, so the slot holds the tapped rows. The copy is held
// back by another consumer's reads (a host function blocked until released), so without the
// engine's wait its overwrite of x would land first and the slot would hold the overwrite.
TEST_F(GpuProgramsTest, CaptureOnItsOwnStreamTakesTheRowsBeforeTheEngineWritesThemAgain) {
  const int64_t n = 64, H = 256;
  const size_t bytes = static_cast<size_t>(n * H) * 2;
  const std::vector<uint16_t> tapped = random_bf16(static_cast<size_t>(n * H), 1.f, 9);
  cuda::DeviceBuffer x;
  ASSERT_TRUE(x.allocate(bytes, "the tapped rows").is_ok());
  ASSERT_EQ(cudaMemcpy(x.get(), tapped.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  auto engine = cuda::Stream::create(), other = cuda::Stream::create(),
       program = cuda::Stream::create();
  auto other_read = cuda::Event::create();
  auto capture = cuda::GpuCaptureStore::create(2, -1, cuda::CaptureCopies::kOwn);
  ASSERT_TRUE(engine.is_ok() && other.is_ok() && program.is_ok() && other_read.is_ok());
  ASSERT_TRUE(capture.is_ok()) << capture.status().to_string();
  // The other consumer: its reads end when the host lets its host function return (at the
  // latest when the test ends, failed or not).
  std::atomic<bool> release{false};
  struct LetGo {
    std::atomic<bool>* flag;
    cudaStream_t stream;
    ~LetGo() { flag->store(true), cudaStreamSynchronize(stream); }
  } let_go{&release, other->get()};
  ASSERT_EQ(cudaLaunchHostFunc(
                other->get(),
                [](void* flag) {
                  while (!static_cast<std::atomic<bool>*>(flag)->load()) std::this_thread::yield();
                },
                &release),
            cudaSuccess);
  ASSERT_EQ(cudaEventRecord(other_read->get(), other->get()), cudaSuccess);
  cuda::TapReaders readers;
  *readers.slot() = other_read->get();
  TapEvent e{0, 0, n, H, nullptr, x.get<uint16_t>(), engine->get()};
  e.x_read = readers.slot();
  auto slot = (*capture)->capture(e);
  ASSERT_TRUE(slot.is_ok()) << slot.status().to_string();
  ASSERT_NE(*readers.slot(), static_cast<void*>(other_read->get()));  // the capture's own event
  // The engine's next write of x, behind the copy; the engine's stream itself never waited.
  ASSERT_TRUE(readers.before_write(engine->get()).is_ok());
  EXPECT_EQ(*readers.slot(), nullptr);
  ASSERT_EQ(cudaMemsetAsync(x.get(), 0xff, bytes, engine->get()), cudaSuccess);
  EXPECT_EQ(cudaStreamQuery(engine->get()), cudaErrorNotReady);  // held by the copy
  release = true;
  ASSERT_EQ(cudaStreamSynchronize(engine->get()), cudaSuccess);
  auto rows = (*capture)->ready(*slot, program->get());
  ASSERT_TRUE(rows.is_ok()) << rows.status().to_string();
  std::vector<uint16_t> got(tapped.size());
  ASSERT_EQ(cudaMemcpyAsync(got.data(), *rows, bytes, cudaMemcpyDeviceToHost, program->get()),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(program->get()), cudaSuccess);
  (*capture)->release(*slot, program->get());
  EXPECT_TRUE(got == tapped) << "the slot holds the engine's overwrite, not the tapped rows";
  std::vector<uint16_t> now(tapped.size());
  ASSERT_EQ(cudaMemcpy(now.data(), x.get(), bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(now.front(), 0xffff);
}

}  // namespace
}  // namespace hetero
