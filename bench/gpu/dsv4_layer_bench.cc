// DeepSeek-V4 prefill on the GPU at full layer shapes (DeepSeek-V4-Flash: hidden 4096, 64 heads
// of 512, 256 experts of 2048 with 6 active + 1 shared, indexer 64 x 128 with top-512 and HISA
// 64/16, window 128, hc 4), random weights drawn on the device: the first --layers layers of the
// Flash layout (ratios 0, 0, 4, 128, 4, 128, ...), prefilled in chunks of --chunk tokens up to
// each T. Per layer: the time from its tap to the next layer's tap (its attention and MoE), summed
// over the chunks, median and spread over --repeats runs after --warmup; the implied 43-layer
// time (2 ratio-0, 21 ratio-4, 20 ratio-128 layers) and tok/s; the TFLOP/s of the FLOPs the
// forward does (projections, active experts, attention over the keys each query sees, indexer
// scoring) against the bf16 cuBLAS peak measured in this binary.
//
// --bridge off,on: "on" runs the same prefill with the bridge behind it — the tap's device capture,
// the exact DeepSeek-V4 cache program on its side stream (random decoder weights of the same
// layers' shapes, the decoder server's 2048-token calls) and the producer encoding every segment
// — and reports its wall time against "off" (the target: at most 3% more). The wall time splits
// into the forward (until the engine's last chunk is done) and the tail (the program's last
// layers, their framing and the manifest, after it). Over --layers L of the model's 43 the tail
// weighs 43/L times what it would in the whole model, so "on" also reports an implied 43-layer
// cost: the forward's measured slowdown plus the tail once against 43/L times the forward "off"
// (an extrapolation, named as one; the measured L-layer cost stays the figure of record).
//
// --program-device N runs the cache program on GPU N (the engine stays on GPU 0). --bridge
// on-engine and on-own are "on" with the capture's copies on the engine's stream or on the
// capture's own (the engine's next write of the rows waiting for them: TapEvent::x_read); "on"
// runs them where the served stack does (CaptureCopies::kAuto).
//
// --weights fp8 keeps the experts' weights as FP8 block-scaled e4m3 (Dsv4CudaOptions::
// weight_dtype): about half the bytes per layer, so about twice the layers fit one GPU; the
// fraction of peak is still against the bf16 peak. --weights checkpoint draws the official
// precision (FP8 projections with UE8M0 block scales, FP4 routed experts widened per expert
// before their GEMMs): about a quarter of bf16's bytes. --widen-experts at-load widens those
// experts to FP8 once, after drawing them (Dsv4CudaOptions::widen_experts_at_load: half of bf16's
// bytes, no widening in the chunks; the same FP8 codes the per-chunk path feeds its GEMMs).
//
// --checkpoint: after the "off" runs at each T, what the prefill host pays to keep the engine's
// state for a later turn (Dsv4CudaEngine::checkpoint: the window's rows and the compressors'
// pending and pooled rows copied to the host) and to put it back (restore, after reserve), wall
// time over --repeats copies, against the prefill's own wall time; beside it, one copy of as many
// bytes into fresh, touched and page-locked host memory: one more JSON line per T.
//
// JSON lines to stdout (one per T and bridge mode), a table to stderr. --refcheck first compares
// the engine with the CPU engine on the small test model (tests/common/dsv4_model_weights.h) and
// refuses to report if it fails.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../../tests/common/dsv4_model_weights.h"
#include "bench_common.h"
#include "bridge/cuda/gpu_programs.h"
#include "bridge/producer.h"
#include "common/sysmem.h"
#include "dsv4_flash_decoder.h"
#include "engine/cuda/dsv4_cuda.h"
#include "engine/dsv4_cpu.h"

namespace hetero {
namespace {

// FLOPs of one layer (attention + MoE, as the engine computes them) over positions [0, T).
double layer_flops(const Dsv4Config& c, int32_t ratio, int64_t T) {
  const double H = c.hidden, QL = c.q_lora_rank, hd = c.head_dim, Hh = c.heads;
  const double ih = c.index_n_heads, ihd = c.index_head_dim, E = c.n_routed_experts;
  const double I = c.moe_inter, S = c.moe_inter * c.n_shared_experts, K = c.experts_per_tok;
  const double W = c.hc_mult * H, mix = static_cast<double>(c.hc_mix());
  double per_tok = H * QL + QL * Hh * hd + H * hd + Hh * hd * c.o_lora_rank +
                   c.o_groups * c.o_lora_rank * H;  // q, kv, grouped output
  if (ratio > 0) per_tok += 2 * H * hd * (ratio == 4 ? 2 : 1);
  if (ratio == 4) per_tok += 2 * H * 2 * ihd + QL * ih * ihd + H * ih;
  per_tok += H * E + K * 3 * I * H + 3 * S * H;  // router, active experts, shared expert
  per_tok += 2 * W * mix;                        // two hyper-connection mixes
  double total = 2.0 * per_tok * static_cast<double>(T);
  for (int64_t p = 0; p < T; ++p) {  // attention and the indexer: the keys each query scores
    double keys = static_cast<double>(std::min<int64_t>(c.sliding_window, p + 1));
    const int64_t vis = ratio > 0 ? (p + 1) / ratio : 0;
    if (ratio == 128) keys += static_cast<double>(vis);
    if (ratio == 4) {
      keys += static_cast<double>(std::min<int64_t>(vis, c.index_topk));
      if (vis > c.index_topk) {
        const bool hisa = vis >= c.index_block * c.index_keep;
        const double scored =
            hisa ? static_cast<double>(vis / c.index_block + c.index_keep * c.index_block)
                 : static_cast<double>(vis);
        total += 2.0 * ih * ihd * scored;
      }
    }
    total += 2.0 * 2.0 * Hh * hd * keys;  // q.k and p.v
  }
  return total;
}

// The test's comparison (tests/gpu/dsv4_cuda_test.cc) on its hash-routed model, two schedules.
bool refcheck() {
  const Dsv4Config c = tiny_dsv4_config(/*hash_routed=*/true);
  const Dsv4Weights w = random_dsv4_model(c, 11);
  Dsv4EngineOptions cpu_opts;
  cpu_opts.quant_arith = Dsv4QuantArith::kDequant;
  Dsv4CpuEngine cpu(w, cpu_opts);
  Dsv4CudaOptions gpu_opts;
  gpu_opts.host_tap = true;
  auto made = Dsv4CudaEngine::create(w, gpu_opts);
  if (!made.is_ok()) return std::fprintf(stderr, "%s\n", made.status().to_string().c_str()), false;
  Dsv4CudaEngine& gpu = **made;
  std::mt19937 rng(3);
  std::vector<int32_t> ids(300);
  for (auto& v : ids) v = static_cast<int32_t>(rng() % static_cast<uint32_t>(c.vocab));
  CompareSpec spec;
  spec.max_ulp = 1 << 20, spec.max_abs = 1e9, spec.min_cosine = -2;
  bool ok = true;
  for (const std::vector<int64_t>& schedule :
       {std::vector<int64_t>{300}, std::vector<int64_t>{5, 3, 120, 1, 1, 2, 8, 9, 31, 4, 1}}) {
    Status st;
    const auto want = dsv4_taps(cpu, ids, schedule, &st);
    if (!st.is_ok()) return false;
    const auto got = dsv4_taps(gpu, ids, schedule, &st);
    if (!st.is_ok()) return false;
    const auto reports = dsv4_compare_taps(got, want, c.hidden, spec);
    for (size_t l = 0; l < reports.size(); ++l) {
      const Dsv4TokenStats ts = dsv4_token_stats(got[l], want[l], c.hidden);
      const bool pass = dsv4_within(kDsv4HashRoutedTolerance, reports[l].cosine, ts);
      std::fprintf(
          stderr, "refcheck layer %zu: max|diff| %.4g cosine %.7f tokens below 0.999 %.1f%% %s\n",
          l, reports[l].max_abs, reports[l].cosine, 100.0 * ts.frac_below_3, pass ? "ok" : "FAIL");
      ok = ok && pass;
    }
  }
  return ok;
}

std::vector<int64_t> parse_list(const char* s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::atoll(item.c_str()));
  return v;
}

// The engine holds T tokens (the last "off" run): times checkpoint() and, on a fresh sequence of
// the same length, restore(); prints one JSON line. False when either fails.
bool report_checkpoint(Dsv4CudaEngine& engine, const std::vector<int32_t>& ids, int64_t chunk,
                       int repeats, double prefill_s, const std::string& gpu,
                       const std::string& rev, int64_t layers) {
  const auto T = static_cast<int64_t>(ids.size());
  if (engine.cached_tokens() != T)
    return std::fprintf(stderr, "no sequence to checkpoint\n"), false;
  const int64_t priced = engine.checkpoint_bytes();
  std::vector<double> take_s, put_s;
  std::shared_ptr<const Checkpoint> cp;
  for (int r = 0; r < repeats; ++r) {
    const double t0 = bench::now_s();
    cp = engine.checkpoint();
    take_s.push_back(bench::now_s() - t0);
    if (!cp || cp->bytes() != priced)
      return std::fprintf(stderr, "checkpoint failed or holds other bytes than priced\n"), false;
  }
  for (int r = 0; r < repeats; ++r) {
    if (!engine.reserve(T, chunk).is_ok()) return false;
    const double t0 = bench::now_s();
    const Status ok = engine.restore(*cp);
    const Status synced = engine.synchronize();
    put_s.push_back(bench::now_s() - t0);
    if (!ok.is_ok() || !synced.is_ok() || engine.cached_tokens() != T)
      return std::fprintf(stderr, "restore failed: %s\n", ok.to_string().c_str()), false;
  }
  // The same bytes in one device-to-host copy: into fresh memory (as a checkpoint's), into memory
  // already touched, and into page-locked memory: what bounds the checkpoint's copy.
  std::vector<double> fresh_s, warm_s, pinned_s;
  {
    const auto bytes = static_cast<size_t>(priced);
    cuda::DeviceBuffer src;
    cuda::PinnedBuffer pinned;
    if (!src.allocate(bytes, "the bench's source").is_ok() ||
        !pinned.allocate(bytes, "the bench's page-locked copy").is_ok())
      return std::fprintf(stderr, "no memory for the copy references\n"), false;
    std::memset(pinned.get(), 1, bytes);
    auto timed = [&](void* dst) {
      const double t0 = bench::now_s();
      const cudaError_t e = cudaMemcpy(dst, src.get(), bytes, cudaMemcpyDeviceToHost);
      return e == cudaSuccess ? bench::now_s() - t0 : -1.0;
    };
    for (int r = 0; r < repeats; ++r) {
      auto fresh = uninitialized_host_array<uint16_t>(bytes / 2);
      fresh_s.push_back(timed(fresh.get()));
      warm_s.push_back(timed(fresh.get()));  // now touched
      pinned_s.push_back(timed(pinned.get()));
    }
  }
  const bench::Spread fresh = bench::spread(fresh_s), warm = bench::spread(warm_s),
                      pin = bench::spread(pinned_s);
  const bench::Spread take = bench::spread(take_s), put = bench::spread(put_s);
  std::printf(
      "{\"bench\":\"gpu_dsv4_checkpoint\",\"gpu\":\"%s\",\"rev\":\"%s\",\"T\":%lld,"
      "\"layers\":%lld,\"bytes\":%lld,\"checkpoint_s_median\":%.5f,\"checkpoint_s_min\":%.5f,"
      "\"checkpoint_s_max\":%.5f,\"restore_s_median\":%.5f,\"restore_s_min\":%.5f,"
      "\"restore_s_max\":%.5f,\"repeats\":%d,\"prefill_wall_s\":%.4f,"
      "\"checkpoint_over_prefill\":%.5f,\"copy_fresh_s_median\":%.5f,\"copy_warm_s_median\":%.5f,"
      "\"copy_pinned_s_median\":%.5f}\n",
      gpu.c_str(), rev.c_str(), static_cast<long long>(T), static_cast<long long>(layers),
      static_cast<long long>(priced), take.median, take.min, take.max, put.median, put.min, put.max,
      repeats, prefill_s, prefill_s > 0 ? take.median / prefill_s : 0.0, fresh.median, warm.median,
      pin.median);
  std::fflush(stdout);
  std::fprintf(stderr,
               "%8lld checkpoint %.1f MB: %.1f ms (restore %.1f ms), %.2f%% of the prefill; one "
               "copy into fresh / touched / page-locked memory %.1f / %.1f / %.1f ms\n",
               static_cast<long long>(T), priced / 1e6, take.median * 1e3, put.median * 1e3,
               prefill_s > 0 ? 100 * take.median / prefill_s : 0.0, fresh.median * 1e3,
               warm.median * 1e3, pin.median * 1e3);
  return true;
}

}  // namespace
}  // namespace hetero

int main(int argc, char** argv) {
  using namespace hetero;
  const std::string command = bench::command_json(argc, argv);
  std::vector<int64_t> Ts = {8192, 32768, 131072};
  int64_t chunk = 8192, layers = 4;
  int warmup = 1, repeats = 3;
  bool check = false, time_checkpoint = false;
  Dsv4CudaOptions opts;
  std::string rev = "unknown";
  std::vector<std::string> bridge_modes = {"off", "on"};
  int program_device = -1;  // the cache program's GPU (-1: the engine's)
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--t")
      Ts = parse_list(next());
    else if (a == "--chunk")
      chunk = std::atoll(next());
    else if (a == "--layers")
      layers = std::atoll(next());
    else if (a == "--warmup")
      warmup = std::atoi(next());
    else if (a == "--repeats")
      repeats = std::atoi(next());
    else if (a == "--refcheck")
      check = true;
    else if (a == "--checkpoint")
      time_checkpoint = true;
    else if (a == "--rev")
      rev = next();
    else if (a == "--phases")
      opts.phase_timing = true;
    else if (a == "--moe") {
      opts.grouped_experts = std::string(next()) != "loop";
      if (opts.grouped_experts) opts.expert_streams = 1;  // one call for every expert
    } else if (a == "--program-device")
      program_device = std::atoi(next());
    else if (a == "--expert-streams")
      opts.expert_streams = std::atoi(next());
    else if (a == "--weights") {
      auto w = cuda::parse_weight_dtype(next());
      if (!w.is_ok()) return std::fprintf(stderr, "%s\n", w.status().to_string().c_str()), 2;
      opts.weight_dtype = w.value();
    } else if (a == "--expert-gemm") {
      auto g = parse_expert_gemm(next());
      if (!g.is_ok()) return std::fprintf(stderr, "%s\n", g.status().to_string().c_str()), 2;
      opts.expert_gemm = g.value();
    } else if (a == "--w4a8-tile") {  // weight rows x group rows, e.g. 64x256
      const std::string t = next();
      const size_t x = t.find('x');
      opts.w4a8_tile_m = std::atoi(t.substr(0, x).c_str());
      opts.w4a8_tile_n = x == std::string::npos ? 0 : std::atoi(t.substr(x + 1).c_str());
    } else if (a == "--w4a8-persistent") {  // a block a multiprocessor, taking tiles in turn
      int sms = 0;
      if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess)
        return std::fprintf(stderr, "no CUDA device\n"), 2;
      opts.w4a8_max_blocks = sms;
    } else if (a == "--widen-experts") {
      const std::string w = next();
      if (w != "at-load" && w != "per-chunk")
        return std::fprintf(stderr, "--widen-experts takes at-load or per-chunk\n"), 2;
      opts.widen_experts_at_load = w == "at-load";
    } else if (a == "--bridge") {
      bridge_modes.clear();
      std::stringstream ss(next());
      std::string m;
      while (std::getline(ss, m, ','))
        if (m == "off" || bench::capture_copies_of(m).first == "on")
          bridge_modes.push_back(m);
        else
          return std::fprintf(stderr, "--bridge takes off, on, on-engine and/or on-own\n"), 2;
    } else {
      std::fprintf(
          stderr,
          "usage: %s [--t 8192,32768,131072] [--chunk 8192] [--layers 4] [--warmup 1] "
          "[--repeats 3] [--moe loop|grouped] [--expert-streams 1] [--weights bf16|fp8|checkpoint] "
          "[--widen-experts per-chunk|at-load] [--expert-gemm auto|grouped|per-expert|w4a8] "
          "[--w4a8-tile 128x128|64x256|...] [--w4a8-persistent] "
          "[--bridge off,on,on-engine,on-own] [--program-device N] [--phases] "
          "[--refcheck] [--checkpoint] "
          "[--rev GIT_REV]\n",
          argv[0]);
      return 2;
    }
  }
  if (check) {
    if (!refcheck()) {
      std::fprintf(stderr,
                   "refcheck FAILED: the GPU engine disagrees with the CPU engine; "
                   "no numbers reported\n");
      return 1;
    }
    std::fprintf(stderr, "refcheck passed\n");
  }
  const std::string gpu = bench::gpu_name();
  const double peak = bench::measured_bf16_peak_tflops();
  const Dsv4Config c = bench::flash_config(layers);
  if (Status ok = Dsv4CudaEngine::check_options(c, opts); !ok.is_ok())
    return std::fprintf(stderr, "%s\n", ok.to_string().c_str()), 2;
  auto made = Dsv4CudaEngine::random(c, 1234, opts);
  if (!made.is_ok()) return std::fprintf(stderr, "%s\n", made.status().to_string().c_str()), 1;
  std::unique_ptr<Dsv4CudaEngine> engine = std::move(made.value());
  if (!engine->set_full_forward(true).is_ok()) return 1;
  auto st = static_cast<cudaStream_t>(engine->stream());
  std::vector<cudaEvent_t> ev(static_cast<size_t>(layers + 1));
  for (auto& e : ev) cudaEventCreate(&e);
  // The decoder's program weights for the same layers (bridge "on").
  std::vector<int64_t> ratios(c.compress_ratios.begin(), c.compress_ratios.end());
  const Dsv4DecoderWeights decoder = bench::flash_decoder_weights(ratios);
  auto decoder_gpu = [&] {
    cuda::DeviceGuard on_program(program_device);
    return cuda::upload_dsv4_weights(decoder);
  }();
  if (!decoder_gpu.is_ok())
    return std::fprintf(stderr, "%s\n", decoder_gpu.status().to_string().c_str()), 1;
  std::mt19937 rng(7);
  std::fprintf(stderr, "%s, weights %.1f GB, bf16 peak %.0f TFLOP/s, layers %lld, chunk %lld\n",
               gpu.c_str(), engine->weight_bytes() / 1e9, peak, static_cast<long long>(layers),
               static_cast<long long>(chunk));
  std::fprintf(stderr, "%8s %10s %10s %10s %12s %10s %8s\n", "T", "r0 ms", "r4 ms", "r128 ms",
               "43L tok/s", "TFLOP/s", "of peak");
  for (int64_t T : Ts) {
    std::vector<int32_t> ids(static_cast<size_t>(T));
    for (auto& v : ids) v = static_cast<int32_t>(rng() % static_cast<uint32_t>(c.vocab));
    double off_wall = 0, off_forward = 0;
    for (const std::string& bridge : bridge_modes) {
      const bool on = bridge != "off";
      std::vector<std::vector<double>> layer_ms(static_cast<size_t>(layers));
      std::vector<double> total_ms, wall_s, forward_s;
      double wire_bytes = 0, capture_bytes = 0;
      bool manifest_complete = true;
      auto phases_before = engine->phase_ms();
      // As the served stack holds it: one for every request.
      auto made_capture =
          cuda::GpuCaptureStore::create(4, program_device, bench::capture_copies_of(bridge).second);
      if (!made_capture.is_ok())
        return std::fprintf(stderr, "%s\n", made_capture.status().to_string().c_str()), 1;
      cuda::GpuCaptureStore& capture = **made_capture;
      // Frames reuse buffers given back once "sent" (here: counted), as the service's do.
      FrameBufferPool frame_buffers(3);
      for (int run = 0; run < warmup + repeats; ++run) {
        if (run == warmup) phases_before = engine->phase_ms();  // warm-up runs not counted
        if (!engine->reset().is_ok()) return 1;
        auto program_on = [&] {  // on the program's GPU
          cuda::DeviceGuard on_program(program_device);
          return cuda::Dsv4GpuSegmentProgram::create(&decoder, decoder_gpu->get(),
                                                     dsv4_server_calls(T, 2048));
        }();
        if (!program_on.is_ok())
          return std::fprintf(stderr, "%s\n", program_on.status().to_string().c_str()), 1;
        cuda::Dsv4GpuSegmentProgram& program = **program_on;
        double bytes = 0;
        std::unique_ptr<BridgeProducer> producer;
        if (on)
          producer = std::make_unique<BridgeProducer>(
              &program, bench::counting_sink(&bytes, &frame_buffers), 4, &capture, &frame_buffers);
        const AttentionInputTap bridge_tap = on ? producer->tap() : AttentionInputTap();
        std::vector<double> ms(static_cast<size_t>(layers), 0.0);
        double total = 0;
        cudaDeviceSynchronize();
        const double w0 = bench::now_s();
        for (int64_t at = 0; at < T; at += chunk) {
          const int64_t n = std::min(chunk, T - at);
          std::vector<int32_t> part(ids.begin() + at, ids.begin() + at + n);
          auto tap = [&](const TapEvent& e) {
            cudaEventRecord(ev[static_cast<size_t>(e.layer)], static_cast<cudaStream_t>(e.stream));
            if (bridge_tap) bridge_tap(e);
          };
          if (!engine->prefill_chunk(part, tap).is_ok()) return 1;
          cudaEventRecord(ev[static_cast<size_t>(layers)], st);
          if (!engine->synchronize().is_ok()) return 1;
          for (int64_t l = 0; l < layers; ++l) {
            float t = 0;
            cudaEventElapsedTime(&t, ev[static_cast<size_t>(l)], ev[static_cast<size_t>(l + 1)]);
            ms[static_cast<size_t>(l)] += t;
          }
          float t = 0;
          cudaEventElapsedTime(&t, ev[0], ev[static_cast<size_t>(layers)]);
          total += t;
        }
        const double forward = bench::now_s() - w0;
        if (on) manifest_complete = producer->finish(T, Status::ok()).complete && manifest_complete;
        const double wall = bench::now_s() - w0;
        wire_bytes = bytes, capture_bytes = static_cast<double>(capture.device_bytes());
        if (run < warmup) continue;
        wall_s.push_back(wall);
        forward_s.push_back(forward);
        for (int64_t l = 0; l < layers; ++l)
          layer_ms[static_cast<size_t>(l)].push_back(ms[static_cast<size_t>(l)]);
        total_ms.push_back(total);
      }
      // Phase breakdown (with --phases): device ms per timed run, all layers together.
      std::string phases = "{";
      const auto phases_after = engine->phase_ms();
      for (size_t i = 0; i < phases_after.size(); ++i) {
        const double before = i < phases_before.size() ? phases_before[i].second : 0.0;
        char buf[160];
        std::snprintf(buf, sizeof(buf), "%s\"%s\":%.2f", i ? "," : "",
                      phases_after[i].first.c_str(), (phases_after[i].second - before) / repeats);
        phases += buf;
        std::fprintf(stderr, "  phase %-28s %10.2f ms/run\n", phases_after[i].first.c_str(),
                     (phases_after[i].second - before) / repeats);
      }
      phases += "}";
      // Per ratio: the mean of its layers' medians.
      double by_ratio[3] = {0, 0, 0}, flops_by_ratio[3] = {0, 0, 0};
      int count[3] = {0, 0, 0};
      std::string per_layer = "[";
      for (int64_t l = 0; l < layers; ++l) {
        const bench::Spread s = bench::spread(layer_ms[static_cast<size_t>(l)]);
        const int32_t r = c.compress_ratios[static_cast<size_t>(l)];
        const int k = r == 0 ? 0 : r == 4 ? 1 : 2;
        by_ratio[k] += s.median, ++count[k];
        flops_by_ratio[k] = layer_flops(c, r, T);
        char buf[256];
        std::snprintf(buf, sizeof(buf),
                      "%s{\"layer\":%lld,\"ratio\":%d,\"ms_median\":%.3f,\"ms_min\":%.3f,"
                      "\"ms_max\":%.3f}",
                      l ? "," : "", static_cast<long long>(l), r, s.median, s.min, s.max);
        per_layer += buf;
      }
      per_layer += "]";
      for (int k = 0; k < 3; ++k) by_ratio[k] = count[k] ? by_ratio[k] / count[k] : -1;
      // The Flash model's 43 layers: 2 of ratio 0, 21 of ratio 4, 20 of ratio 128.
      const int mult[3] = {2, 21, 20};
      double model_ms = 0, model_flops = 0;
      bool complete = true;
      for (int k = 0; k < 3; ++k) {
        if (count[k] == 0) complete = false;
        model_ms += mult[k] * by_ratio[k];
        model_flops += mult[k] * flops_by_ratio[k];
      }
      const double tok_s = complete ? static_cast<double>(T) / (model_ms * 1e-3) : 0;
      const double tflops = complete ? model_flops / (model_ms * 1e-3) / 1e12 : 0;
      const bench::Spread tot = bench::spread(total_ms);
      const bench::Spread wall = bench::spread(wall_s);
      const bench::Spread fwd = bench::spread(forward_s);
      std::vector<double> tails;
      for (size_t i = 0; i < wall_s.size(); ++i) tails.push_back(wall_s[i] - forward_s[i]);
      const bench::Spread tail = bench::spread(tails);
      if (!on) off_wall = wall.median, off_forward = fwd.median;
      const double overhead = on && off_wall > 0 ? wall.median / off_wall - 1.0 : 0.0;
      const double forward_overhead = on && off_forward > 0 ? fwd.median / off_forward - 1.0 : 0.0;
      const double implied_overhead =
          on && off_forward > 0
              ? forward_overhead + tail.median / (off_forward * 43.0 / static_cast<double>(layers))
              : 0.0;
      std::printf(
          "{\"bench\":\"gpu_dsv4_layer\",\"gpu\":\"%s\",\"rev\":\"%s\",\"config\":\"flash-shape "
          "random\",\"weights\":\"%s\",\"expert_gemm\":\"%s\",\"expert_streams\":%d,\"program_"
          "device\":%d,\"weight_gb\":%."
          "2f,\"T\":%lld,"
          "\"chunk\":%lld,\"layers\":%"
          "lld,\"moe\":\"%s\",\"warmup\":%d,"
          "\"repeats\":"
          "%d,\"bridge\":\"%s\",\"wall_s_median\":%.4f,\"wall_s_min\":%.4f,\"wall_s_max\":%.4f,"
          "\"bridge_overhead_vs_off\":%s,\"forward_s_median\":%.4f,\"tail_s_median\":%.4f,"
          "\"tail_s_max\":%.4f,\"forward_overhead_vs_off\":%s,\"implied_43_layer_overhead\":%s,"
          "\"wire_bytes_per_token\":%s,\"capture_device_bytes\":%.0f,"
          "\"manifest_complete\":%s,"
          "\"per_layer\":%s,\"ms_ratio0\":%.3f,\"ms_ratio4\":%.3f,\"ms_ratio128\":%.3f,"
          "\"run_ms_median\":%.3f,\"run_ms_min\":%.3f,\"run_ms_max\":%.3f,"
          "\"implied_43_layer_s\":%.4f,\"implied_tok_s\":%.1f,\"tflops\":%.1f,"
          "\"peak_bf16_tflops\":%.1f,\"fraction_of_peak\":%.3f,\"phase_ms\":%s,\"refcheck\":%s",
          gpu.c_str(), rev.c_str(),
          opts.weight_dtype == cuda::WeightDtype::kFp8 ? "experts fp8, rest bf16"
          : opts.weight_dtype == cuda::WeightDtype::kCheckpoint
              ? (opts.widen_experts_at_load
                     ? "checkpoint: fp8 projections, fp4 experts widened to fp8 at load"
                     : "checkpoint: fp8 projections, fp4 experts")
              : "bf16",
          engine->expert_gemm_name().c_str(), opts.expert_streams, program_device,
          engine->weight_bytes() / 1e9, static_cast<long long>(T), static_cast<long long>(chunk),
          static_cast<long long>(layers), opts.grouped_experts ? "grouped" : "loop", warmup,
          repeats, bridge.c_str(), wall.median, wall.min, wall.max,
          on ? std::to_string(overhead).c_str() : "null", fwd.median, tail.median, tail.max,
          on ? std::to_string(forward_overhead).c_str() : "null",
          on ? std::to_string(implied_overhead).c_str() : "null",
          on ? std::to_string(wire_bytes / static_cast<double>(T)).c_str() : "null", capture_bytes,
          on ? (manifest_complete ? "true" : "false") : "null", per_layer.c_str(), by_ratio[0],
          by_ratio[1], by_ratio[2], tot.median, tot.min, tot.max, model_ms * 1e-3, tok_s, tflops,
          peak, peak > 0 ? tflops / peak : 0.0, phases.c_str(),
          check ? "\"passed\"" : "\"not run\"");
      // What the line needs to stand alone (issue 53): the arithmetic of the forward and of the
      // program, each run's value, the spread, what the 43-layer figures are, the command.
      std::printf(
          ",\"forward_arith\":\"fast\",\"program_arith\":%s,\"n\":%d,\"runs_wall_s\":%s,"
          "\"runs_ms\":%s,\"spread\":%.4f,\"implied_basis\":\"extrapolated from %lld layers to "
          "Flash's 43 (2 ratio-0, 21 ratio-4, 20 ratio-128), each ratio the mean of its layers' "
          "medians\",\"command\":%s}\n",
          on ? "\"exact (the decoder's)\"" : "null", repeats, bench::json_list(wall_s).c_str(),
          bench::json_list(total_ms, 3).c_str(), bench::relative_spread(wall),
          static_cast<long long>(layers), command.c_str());
      std::fflush(stdout);
      std::fprintf(stderr,
                   "%8lld %10.2f %10.2f %10.2f %12.0f %10.1f %7.1f%%  bridge %s: %.3f s%s\n",
                   static_cast<long long>(T), by_ratio[0], by_ratio[1], by_ratio[2], tok_s, tflops,
                   peak > 0 ? 100.0 * tflops / peak : 0.0, bridge.c_str(), wall.median,
                   on ? (" (+" + std::to_string(100 * overhead) + "%; forward +" +
                         std::to_string(100 * forward_overhead) + "%, tail " +
                         std::to_string(1e3 * tail.median) + " ms; implied 43 layers +" +
                         std::to_string(100 * implied_overhead) + "%)")
                            .c_str()
                      : "");
      if (!on && time_checkpoint &&
          !report_checkpoint(*engine, ids, chunk, repeats, wall.median, gpu, rev, layers))
        return 1;
    }
  }
  for (auto& e : ev) cudaEventDestroy(e);
  return 0;
}
