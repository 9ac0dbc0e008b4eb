// The llama CUDA prefill engine at a ~1B model's shapes (Llama-3.2-1B: hidden 2048, 16 layers,
// 32 heads / 8 kv heads of 64, ffn 8192, vocab 128256; 1.24B parameters) with random weights:
// prefill throughput at each T, the fraction of the GPU's measured bf16 matmul peak it reaches,
// and what the bridge costs on top — the tap and the exact cache program on a side stream
// ("on"), against the forward alone ("off") — with the bytes the segments carry per token and the
// device memory the capture holds. Two more modes split that cost: "tap" (the capture and the
// producer with a program that does nothing) and "program" (the program's work on the device and
// its copies to the host, but segments sent without their arrays: no encoding). "tagged" is
// "on" with each frame tagged as the prefill host tags it with the stack's secret (its pieces'
// MACs as it is framed, then sealed on a sender thread behind a queue of 4, as the service's
// HTTP thread does: frame_tag.h).
//
// One run = reset, then T tokens in --chunk sized chunks, timed from the first enqueue until the
// engine's stream is idle and (on) the producer's manifest is out. Median and spread of --repeat
// runs after --warmup. FLOPs counted: every projection GEMM and the causal attention's useful
// work (QK^T and PV over the visible keys), not the masked half of diagonal tiles.
// --refcheck first compares the engine with the CPU engine on a small model (per-layer attention
// inputs, relative RMS error against the stated bound) and refuses to report if that fails.
//
// --weights fp8 runs the projections with FP8 block-scaled weights (cuBLASLt), --kv the cache,
// --attention the attention kernel (auto, own, cudnn: LlamaCudaOptions::attention).
// --program-device N runs the cache program on GPU N (the engine stays on GPU 0): the tap's rows
// cross peer to peer and the program takes none of the engine's SMs. A bridged mode with
// "-engine" or "-own" appended ("tap-engine", "on-own", ...) runs the capture's copies on the
// engine's stream or on the capture's own (the engine's next write of the rows waiting for
// them: TapEvent::x_read); without, where the served stack runs them (CaptureCopies::kAuto).
// --drift: no timing; the fast forward (--kv, --attention, --weights) against the exact one over
// the same first --tokens T tokens, the exact one being the CPU engine's (and the decoder's)
// arithmetic bit for bit (tests/gpu/llama_cuda_test.cc): every layer's attention inputs in
// windows of --window positions starting at --at (default 0, T/4, T/2, 3T/4, T - window), each
// window's cosine and normalized squared error and its rows' lowest cosine (common/compare.h).
// Output: one JSON line per (T, mode) on stdout (--drift: per layer and window); a table on
// stderr.
#include <cuda_runtime.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "bench_common.h"
#include "bridge/cuda/gpu_programs.h"
#include "bridge/llama_program.h"
#include "bridge/producer.h"
#include "common/compare.h"
#include "engine/cuda/llama_cuda.h"
#include "engine/llama_cpu.h"

namespace hetero {
namespace {

using bench::Draw;

struct Args {
  std::vector<int64_t> tokens = {8192, 32768, 131072};
  int64_t chunk = 8192;
  int repeat = 3, warmup = 1;
  std::vector<std::string> modes = {"off", "on"};
  std::string kv = "fp8", weights = "bf16", shape = "1b", rev = "unknown", attention = "auto";
  int64_t layers = 0;       // 0: the shape's
  int program_device = -1;  // the cache program's GPU (-1: the engine's)
  bool refcheck = false;
  bool drift = false;
  int64_t window = 1024;    // --drift: positions per window
  std::vector<int64_t> at;  // --drift: window starts (empty: spread over T)
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t p = 0;
  while (p <= s.size()) {
    const size_t q = s.find(',', p);
    out.push_back(s.substr(p, q == std::string::npos ? std::string::npos : q - p));
    if (q == std::string::npos) break;
    p = q + 1;
  }
  return out;
}

LlamaConfig shape_config(const std::string& shape) {
  LlamaConfig c;
  c.model_type = "llama";
  c.rms_norm_eps = 1e-5, c.rope_theta = 500000.0, c.tie_embeddings = true;
  if (shape == "1b") {
    c.hidden = 2048, c.layers = 16, c.heads = 32, c.kv_heads = 8, c.head_dim = 64;
    c.intermediate = 8192, c.vocab = 128256;
  } else {  // smollm2-135m, the default model's shapes
    c.hidden = 576, c.layers = 30, c.heads = 9, c.kv_heads = 3, c.head_dim = 64;
    c.intermediate = 1536, c.vocab = 49152;
  }
  c.rope_config.base = c.rope_theta, c.rope_config.dims = c.head_dim;
  c.rope = llama_rope(c.rope_config).value();
  return c;
}

Tensor random_bf16(std::vector<int64_t> shape, float scale, float mean, uint64_t seed) {
  Tensor t(DType::kBF16, std::move(shape));
  uint16_t* p = t.data<uint16_t>();
  const int64_t n = t.numel();
#pragma omp parallel
  {
    const int64_t per = (n + omp_get_num_threads() - 1) / omp_get_num_threads();
    const int64_t b = per * omp_get_thread_num(), e = std::min(n, b + per);
    Draw d{seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(omp_get_thread_num()) + 1};
    for (int64_t i = b; i < e; ++i) p[i] = f32_to_bf16(mean + d.next(scale));
  }
  return t;
}

LlamaWeights random_weights(const LlamaConfig& c) {
  LlamaWeights w;
  w.config = c;
  const int64_t H = c.hidden, qd = c.heads * c.head_dim, kvd = c.kv_heads * c.head_dim;
  const float ws = std::sqrt(3.f / static_cast<float>(H));  // unit-variance outputs
  uint64_t seed = 1;
  w.embed = random_bf16({c.vocab, H}, 1.7f, 0.f, seed++);
  w.final_norm = random_bf16({H}, 0.1f, 1.f, seed++);
  for (int64_t l = 0; l < c.layers; ++l) {
    LlamaLayerWeights L;
    L.input_norm = random_bf16({H}, 0.1f, 1.f, seed++);
    L.post_norm = random_bf16({H}, 0.1f, 1.f, seed++);
    L.wq = random_bf16({qd, H}, ws, 0.f, seed++);
    L.wk = random_bf16({kvd, H}, ws, 0.f, seed++);
    L.wv = random_bf16({kvd, H}, ws, 0.f, seed++);
    L.wo = random_bf16({H, qd}, std::sqrt(3.f / static_cast<float>(qd)), 0.f, seed++);
    L.w_gate = random_bf16({c.intermediate, H}, ws, 0.f, seed++);
    L.w_up = random_bf16({c.intermediate, H}, ws, 0.f, seed++);
    L.w_down = random_bf16({H, c.intermediate}, std::sqrt(3.f / static_cast<float>(c.intermediate)),
                           0.f, seed++);
    w.layers.push_back(std::move(L));
  }
  return w;
}

// Useful FLOPs of prefilling T tokens (projections + causal attention; no lm_head).
double prefill_flops(const LlamaConfig& c, int64_t T) {
  const double H = c.hidden, qd = c.heads * c.head_dim, kvd = c.kv_heads * c.head_dim;
  const double I = c.intermediate;
  const double gemm = 2.0 * (H * (qd + 2 * kvd) + qd * H + H * 2 * I + I * H);
  const double attn = 4.0 * qd * (static_cast<double>(T) + 1) / 2.0;  // per token, average
  return static_cast<double>(c.layers) * (gemm + attn) * static_cast<double>(T);
}

// "tap": the capture's copies and the producer's hand-offs, no program work.
class NullGpuProgram : public SegmentProgram {
 public:
  NullGpuProgram(const DecoderCacheLayout& layout, cuda::Stream stream)
      : layout_(layout), stream_(std::move(stream)) {}
  const DecoderCacheLayout& layout() const override { return layout_; }
  Status run(int64_t, int64_t, int64_t, const uint16_t*, std::vector<WireArray>*) override {
    return Status::ok();
  }
  void* device_stream() const override { return stream_.get(); }

 private:
  DecoderCacheLayout layout_;
  cuda::Stream stream_;
};

// "program": the llama program's work and device-to-host copies, its arrays dropped before the
// encoder (which still waits for them).
class ArraysDropped : public SegmentProgram {
 public:
  explicit ArraysDropped(SegmentProgram* p) : p_(p) {}
  const DecoderCacheLayout& layout() const override { return p_->layout(); }
  Status run(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x,
             std::vector<WireArray>*) override {
    std::vector<WireArray> dropped;
    return p_->run(layer, pos0, n, x, &dropped);
  }
  Status segment_ready(int64_t pos0, int64_t n) override { return p_->segment_ready(pos0, n); }
  void* device_stream() const override { return p_->device_stream(); }

 private:
  SegmentProgram* p_;
};

int refcheck() {
  LlamaConfig c = shape_config("smollm2");
  c.layers = 4, c.vocab = 1024;
  const LlamaWeights w = random_weights(c);
  std::vector<int32_t> ids(600);
  Draw d{77};
  for (auto& id : ids) id = static_cast<int32_t>((d.next(1.f) + 1.f) * 511.f) % 1024;
  std::vector<std::vector<uint16_t>> want(static_cast<size_t>(c.layers)), got(want.size());
  auto collect = [&](std::vector<std::vector<uint16_t>>& into) {
    return [&into](const TapEvent& e) {
      auto& v = into[static_cast<size_t>(e.layer)];
      v.insert(v.end(), e.x_bf16, e.x_bf16 + e.n_tokens * e.hidden);
    };
  };
  LlamaCpuEngine cpu(w, LlamaCpuEngine::Gemm::kOrdered);
  if (!cpu.prefill_chunk(ids, collect(want)).is_ok()) return 1;
  auto gpu = cuda::LlamaCudaEngine::create(w, {cuda::KvDtype::kFp8, true, 0});
  if (!gpu.is_ok())
    return std::fprintf(stderr, "refcheck: %s\n", gpu.status().to_string().c_str()), 1;
  for (int64_t p = 0; p < 600; p += 256) {
    std::vector<int32_t> part(ids.begin() + p, ids.begin() + std::min<int64_t>(600, p + 256));
    if (!(*gpu)->prefill_chunk(part, collect(got)).is_ok()) return 1;
  }
  const double bound = 6e-2;  // tests/gpu/llama_cuda_test.cc, FP8 cache
  for (int64_t l = 0; l < c.layers; ++l) {
    double num = 0, den = 0;
    for (size_t i = 0; i < want[static_cast<size_t>(l)].size(); ++i) {
      const double a = bf16_to_f32(got[static_cast<size_t>(l)][i]);
      const double b = bf16_to_f32(want[static_cast<size_t>(l)][i]);
      num += (a - b) * (a - b), den += b * b;
    }
    const double e = std::sqrt(num / den);
    std::fprintf(stderr, "refcheck layer %lld: relative RMS %.2e (bound %.0e)\n",
                 static_cast<long long>(l), e, bound);
    if (!(e < bound)) return std::fprintf(stderr, "refcheck FAILED\n"), 1;
  }
  return 0;
}

// --drift (see the header): per layer and window, the fast rows against the exact ones.
int drift(const Args& a, const LlamaWeights& w, const cuda::LlamaCudaOptions& fast) {
  const LlamaConfig& c = w.config;
  const int64_t T = a.tokens.front(), win = std::min(a.window, T), H = c.hidden;
  std::vector<int64_t> at = a.at;
  if (at.empty()) at = {0, T / 4, T / 2, 3 * T / 4, T - win};
  for (int64_t& p : at) p = std::clamp<int64_t>(p, 0, T - win);
  std::vector<int32_t> ids(static_cast<size_t>(T));
  Draw d{static_cast<uint64_t>(T)};
  for (auto& id : ids)
    id = static_cast<int32_t>((d.next(1.f) + 1.f) * 0.5f * static_cast<float>(c.vocab - 1));
  using Rows = std::vector<std::vector<Tensor>>;  // [layer][window] bf16 [win, hidden]
  auto run = [&](cuda::LlamaCudaOptions o, Rows* rows, double* secs) -> Status {
    o.host_tap = true;
    HETERO_ASSIGN_OR_RETURN(auto engine, cuda::LlamaCudaEngine::create(w, o));
    rows->assign(static_cast<size_t>(c.layers), std::vector<Tensor>());
    for (auto& l : *rows)
      for (size_t k = 0; k < at.size(); ++k) l.emplace_back(DType::kBF16, std::vector{win, H});
    const AttentionInputTap tap = [&](const TapEvent& e) {
      for (size_t k = 0; k < at.size(); ++k) {
        const int64_t lo = std::max(e.pos0, at[k]), hi = std::min(e.pos0 + e.n_tokens, at[k] + win);
        if (lo >= hi) continue;
        std::memcpy((*rows)[static_cast<size_t>(e.layer)][k].data<uint16_t>() + (lo - at[k]) * H,
                    e.x_bf16 + (lo - e.pos0) * H, static_cast<size_t>((hi - lo) * H) * 2);
      }
    };
    const double t0 = bench::now_s();
    for (int64_t p = 0; p < T; p += a.chunk) {
      const std::vector<int32_t> part(ids.begin() + p, ids.begin() + std::min(T, p + a.chunk));
      HETERO_RETURN_IF_ERROR(engine->prefill_chunk(part, tap));
    }
    HETERO_RETURN_IF_ERROR(engine->synchronize());
    *secs = bench::now_s() - t0;
    return Status::ok();
  };
  Rows exact, got;
  double exact_s = 0, fast_s = 0;
  cuda::LlamaCudaOptions o = fast;
  o.arith = cuda::LlamaCudaArith::kExact;
  for (auto [opt, rows, secs] : {std::tuple{o, &exact, &exact_s}, std::tuple{fast, &got, &fast_s}})
    if (Status st = run(opt, rows, secs); !st.is_ok())
      return std::fprintf(stderr, "drift: %s\n", st.to_string().c_str()), 1;
  std::fprintf(stderr, "T %lld: exact %.1f s, fast %.1f s\n%5s %9s %10s %10s %12s\n",
               static_cast<long long>(T), exact_s, fast_s, "layer", "from", "cosine", "nmse",
               "min row cos");
  for (int64_t l = 0; l < c.layers; ++l)
    for (size_t k = 0; k < at.size(); ++k) {
      const Tensor& g = got[static_cast<size_t>(l)][k];
      const Tensor& e = exact[static_cast<size_t>(l)][k];
      const CompareReport r = compare_tensors(g, e, CompareSpec{});
      double min_row = 1.0;
      for (int64_t i = 0; i < win; ++i) {
        Tensor gr(DType::kBF16, {H}), er(DType::kBF16, {H});
        std::memcpy(gr.bytes.data(), g.bytes.data() + i * H * 2, static_cast<size_t>(H) * 2);
        std::memcpy(er.bytes.data(), e.bytes.data() + i * H * 2, static_cast<size_t>(H) * 2);
        min_row = std::min(min_row, compare_tensors(gr, er, CompareSpec{}).cosine);
      }
      nlohmann::json j = {{"bench", "llama_drift"},
                          {"T", T},
                          {"layer", l},
                          {"from", at[k]},
                          {"window", win},
                          {"cosine", r.cosine},
                          {"nmse", r.nmse},
                          {"max_abs", r.max_abs},
                          {"equal_fraction", r.equal_fraction},
                          {"min_row_cosine", min_row},
                          {"exact_s", exact_s},
                          {"fast_s", fast_s},
                          {"kv", a.kv},
                          {"attention", a.attention},
                          {"weights", a.weights},
                          {"shape", a.shape},
                          {"layers", c.layers},
                          {"gpu", bench::gpu_name()},
                          {"rev", a.rev}};
      std::printf("%s\n", j.dump().c_str());
      std::fprintf(stderr, "%5lld %9lld %10.6f %10.2e %12.6f\n", static_cast<long long>(l),
                   static_cast<long long>(at[k]), r.cosine, r.nmse, min_row);
    }
  return 0;
}

}  // namespace
}  // namespace hetero

int main(int argc, char** argv) {
  using namespace hetero;
  const std::string command = bench::command_json(argc, argv);
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : "";
    if (k == "--refcheck" || k == "--drift") {
      (k == "--drift" ? a.drift : a.refcheck) = true;
      continue;
    }
    ++i;
    if (k == "--tokens") {
      a.tokens.clear();
      for (const auto& t : split(v)) a.tokens.push_back(std::atoll(t.c_str()));
    } else if (k == "--chunk")
      a.chunk = std::atoll(v);
    else if (k == "--repeat")
      a.repeat = std::atoi(v);
    else if (k == "--warmup")
      a.warmup = std::atoi(v);
    else if (k == "--modes")
      a.modes = split(v);
    else if (k == "--kv")
      a.kv = v;
    else if (k == "--attention")
      a.attention = v;
    else if (k == "--weights")
      a.weights = v;
    else if (k == "--shape")
      a.shape = v;
    else if (k == "--layers")
      a.layers = std::atoll(v);
    else if (k == "--program-device")
      a.program_device = std::atoi(v);
    else if (k == "--rev")
      a.rev = v;
    else if (k == "--window")
      a.window = std::atoll(v);
    else if (k == "--at")
      for (const auto& t : split(v)) a.at.push_back(std::atoll(t.c_str()));
    else
      return std::fprintf(stderr, "unknown option %s\n", k.c_str()), 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0)
    return std::fprintf(stderr, "no CUDA device\n"), 1;
  if (a.refcheck && refcheck() != 0) return 1;
  const std::string gpu = bench::gpu_name();
  const double peak = bench::measured_bf16_peak_tflops();
  std::fprintf(stderr, "%s: measured bf16 GEMM peak %.0f TFLOP/s\n", gpu.c_str(), peak);

  LlamaConfig c = shape_config(a.shape);
  if (a.layers > 0) c.layers = a.layers;
  const double t0 = bench::now_s();
  const LlamaWeights w = random_weights(c);
  auto kv = cuda::parse_kv_dtype(a.kv);
  if (!kv.is_ok()) return std::fprintf(stderr, "%s\n", kv.status().to_string().c_str()), 2;
  auto wdt = cuda::parse_weight_dtype(a.weights);
  if (!wdt.is_ok()) return std::fprintf(stderr, "%s\n", wdt.status().to_string().c_str()), 2;
  auto attention = cuda::parse_attention_kernel(a.attention);
  if (!attention.is_ok())
    return std::fprintf(stderr, "%s\n", attention.status().to_string().c_str()), 2;
  cuda::LlamaCudaOptions options{*kv, false, 0, cuda::LlamaCudaArith::kFast, *wdt};
  options.attention = *attention;
  if (a.drift) return drift(a, w, options);
  auto engine = cuda::LlamaCudaEngine::create(w, options);
  if (!engine.is_ok()) return std::fprintf(stderr, "%s\n", engine.status().to_string().c_str()), 1;
  const std::string attention_name = (*engine)->attention_name();
  std::fprintf(stderr, "attention: %s\n", attention_name.c_str());
  const LlamaDecoderWeights dw = llama_decoder_weights_of(w, "bench");
  if (a.program_device >= devices)
    return std::fprintf(stderr, "--program-device %d: %d GPU(s)\n", a.program_device, devices), 2;
  auto gw = [&] {
    cuda::DeviceGuard on_program(a.program_device);
    return cuda::upload_llama_weights(dw);
  }();
  if (!gw.is_ok()) return std::fprintf(stderr, "%s\n", gw.status().to_string().c_str()), 1;
  std::fprintf(stderr, "weights ready in %.1f s (%.2f GB on the device)\n", bench::now_s() - t0,
               static_cast<double>((*engine)->weight_bytes()) / 1e9);
  // Parameters of the shape (the FP8 engine's weight bytes are not 2 per parameter).
  const double params =
      static_cast<double>(c.vocab * c.hidden) +
      static_cast<double>(c.layers) *
          (static_cast<double>(c.hidden) * (c.heads * c.head_dim + 2 * c.kv_heads * c.head_dim) +
           static_cast<double>(c.heads * c.head_dim) * c.hidden + 3.0 * c.hidden * c.intermediate);
  // The decoder's own cache per token: K and V rows, bf16, every layer.
  const double decoder_bytes_per_token = 2.0 * c.layers * c.kv_heads * c.head_dim * 2;

  std::fprintf(stderr, "%8s %4s %10s %10s %8s %7s %9s %10s %12s\n", "T", "mode", "median_s",
               "tok/s", "TFLOP/s", "peak%", "overhead", "wireB/tok", "capture_MB");
  for (int64_t T : a.tokens) {
    std::vector<int32_t> ids(static_cast<size_t>(T));
    Draw d{static_cast<uint64_t>(T)};
    for (auto& id : ids)
      id = static_cast<int32_t>((d.next(1.f) + 1.f) * 0.5f * static_cast<float>(c.vocab - 1));
    double off_median = 0;
    for (const std::string& named : a.modes) {
      const auto [mode, copies] = bench::capture_copies_of(named);
      if (mode != "off" && mode != "tap" && mode != "program" && mode != "on" && mode != "tagged")
        return std::fprintf(stderr,
                            "unknown mode %s (off, tap, program, on, tagged; a bridged one "
                            "with -engine or -own: where the capture's copies run)\n",
                            named.c_str()),
               2;
      const bool on = mode != "off";
      std::vector<double> secs;
      double wire_bytes = 0, capture_bytes = 0, staging_bytes = 0;
      bool complete = true;
      // As the served stack holds them: one capture and one page-locked pool for every request.
      auto made_capture = cuda::GpuCaptureStore::create(4, a.program_device, copies);
      if (!made_capture.is_ok())
        return std::fprintf(stderr, "%s\n", made_capture.status().to_string().c_str()), 1;
      cuda::GpuCaptureStore& capture = **made_capture;
      auto pool = cuda::make_pinned_pool();
      // Frames reuse buffers given back once "sent" (here: counted), as the service's do.
      FrameBufferPool frame_buffers(3);
      for (int r = 0; r < a.warmup + a.repeat; ++r) {
        if (!(*engine)->reset().is_ok()) return 1;
        Result<std::unique_ptr<cuda::LlamaGpuSegmentProgram>> program_on = not_found("none yet");
        std::optional<NullGpuProgram> null_on;
        {  // on the program's GPU (its stream, its scratch)
          cuda::DeviceGuard on_program(a.program_device);
          program_on = cuda::LlamaGpuSegmentProgram::create(gw->get(), pool);
          auto null_stream = cuda::Stream::create();
          if (!null_stream.is_ok())
            return std::fprintf(stderr, "%s\n", null_stream.status().to_string().c_str()), 1;
          null_on.emplace(dw.layout, std::move(null_stream.value()));
        }
        if (!program_on.is_ok())
          return std::fprintf(stderr, "%s\n", program_on.status().to_string().c_str()), 1;
        cuda::LlamaGpuSegmentProgram& program = **program_on;
        NullGpuProgram& null_program = *null_on;
        ArraysDropped dropped(&program);
        SegmentProgram* run_program = mode == "tap" ? static_cast<SegmentProgram*>(&null_program)
                                      : mode == "program" ? static_cast<SegmentProgram*>(&dropped)
                                                          : &program;
        double bytes = 0;
        std::unique_ptr<BridgeProducer> producer;
        std::optional<bench::TaggingSender> sender;
        if (mode == "tagged") sender.emplace(&bytes, &frame_buffers);
        if (on)
          producer = std::make_unique<BridgeProducer>(
              run_program, sender ? sender->sink() : bench::counting_sink(&bytes, &frame_buffers),
              4, &capture, &frame_buffers, sender ? sender->tagger() : nullptr);
        const AttentionInputTap tap = on ? producer->tap() : AttentionInputTap();
        cudaDeviceSynchronize();
        const double s0 = bench::now_s();
        Status st;
        for (int64_t p = 0; p < T && st.is_ok(); p += a.chunk) {
          std::vector<int32_t> part(ids.begin() + p, ids.begin() + std::min(T, p + a.chunk));
          st = (*engine)->prefill_chunk(part, tap);
        }
        if (st.is_ok()) st = (*engine)->synchronize();
        if (on) complete = producer->finish(T, st).complete && complete;
        if (sender) sender->finish();  // the last frame tagged and "sent"
        const double s = bench::now_s() - s0;
        if (!st.is_ok()) return std::fprintf(stderr, "prefill: %s\n", st.to_string().c_str()), 1;
        if (r >= a.warmup) secs.push_back(s);
        wire_bytes = bytes, capture_bytes = static_cast<double>(capture.device_bytes());
        staging_bytes = static_cast<double>(program.host_staging_bytes());
      }
      const bench::Spread sp = bench::spread(secs);
      if (mode == "off") off_median = sp.median;
      const double flops = prefill_flops(c, T);
      const double tflops = flops / sp.median / 1e12;
      const double overhead = on && off_median > 0 ? sp.median / off_median - 1.0 : 0.0;
      std::printf(
          "{\"bench\":\"gpu_llama_prefill\",\"rev\":\"%s\",\"gpu\":\"%s\",\"shape\":\"%s\","
          "\"layers\":%lld,\"params\":%.3e,\"weights\":\"%s\",\"kv\":\"%s\",\"attention\":\"%s\","
          "\"T\":%lld,\"chunk\":%"
          "lld,\"mode\":\"%s\",\"program_device\":%d,"
          "\"repeat\":%d,\"median_s\":%.4f,\"min_s\":%.4f,\"max_s\":%.4f,\"tok_per_s\":%.0f,"
          "\"tflops\":%.1f,\"peak_tflops\":%.0f,\"peak_fraction\":%.3f,\"overhead_vs_off\":%s,"
          "\"wire_bytes_per_token\":%s,\"decoder_cache_bytes_per_token\":%.0f,"
          "\"capture_device_bytes\":%.0f,\"host_staging_bytes\":%.0f,\"engine_cache_bytes\":%zu,"
          "\"activation_bytes\":%zu,\"manifest_complete\":%s",
          a.rev.c_str(), gpu.c_str(), a.shape.c_str(), static_cast<long long>(c.layers), params,
          a.weights.c_str(), a.kv.c_str(), attention_name.c_str(), static_cast<long long>(T),
          static_cast<long long>(a.chunk), named.c_str(), a.program_device, a.repeat, sp.median,
          sp.min, sp.max, static_cast<double>(T) / sp.median, tflops, peak, tflops / peak,
          on ? std::to_string(overhead).c_str() : "null",
          on ? std::to_string(wire_bytes / static_cast<double>(T)).c_str() : "null",
          decoder_bytes_per_token, capture_bytes, staging_bytes, (*engine)->cache_bytes(),
          (*engine)->activation_bytes(), on ? (complete ? "true" : "false") : "null");
      // What the line needs to stand alone (issue 53): the arithmetic of the forward and of the
      // program, each run's seconds, the spread, the command.
      std::printf(
          ",\"forward_arith\":\"fast\",\"program_arith\":%s,\"n\":%d,\"runs_s\":%s,"
          "\"spread\":%.4f,\"command\":%s}\n",
          mode == "tap" ? "\"none (a program that does nothing)\""
          : on          ? "\"exact (the decoder's)\""
                        : "null",
          a.repeat, bench::json_list(secs, 5).c_str(), bench::relative_spread(sp), command.c_str());
      std::fflush(stdout);
      std::fprintf(stderr, "%8lld %4s %10.4f %10.0f %8.1f %6.1f%% %8.1f%% %10.0f %12.1f\n",
                   static_cast<long long>(T), named.c_str(), sp.median,
                   static_cast<double>(T) / sp.median, tflops, 100 * tflops / peak, 100 * overhead,
                   on ? wire_bytes / static_cast<double>(T) : 0.0, capture_bytes / 1e6);
    }
  }
  return 0;
}
