// DeepSeek-V4 as a layer pipeline (engine/cuda/dsv4_pipeline.h) at Flash shapes, random weights
// drawn on each stage's GPU: whole-prompt prefill time through the pipeline, and, where the
// layers fit one GPU, through one engine in the same run.
//
//   --devices 0,1 (one per stage; all different: NCCL links; all the same: device copies)
//   --layers 8 --weights checkpoint|fp8|bf16 --t 8192,32768 --decoder-step 2048 --chunk 8192
//   --repeats 3 --rev REV
//   (--decoder-step: the decoder's call length; its calls, the last token alone, are the
//   program's schedule, as served. --chunk: the engine's chunks, those calls grouped up to that
//   many tokens as the served host groups them; default: the decoder step, one call a chunk)
//   [--bridge off,on] (on: the bridge behind the pipeline as served: each stage's taps captured
//   and its layers' cache program run on its own GPU, one producer framing the segments; the
//   decoder's program weights drawn at Flash widths)
//   [--no-single] (skip the one-engine reference, e.g. when the layers do not fit one GPU)
//
// One JSON line per T and bridge mode: the pipeline's wall time (median, min, max of --repeats
// after one warmup) and tok/s for these layers (not scaled to 43 unless --layers 43: the first
// layers' mix of ratios is not the model's; dsv4_layer_bench weighs per ratio), the bridge's cost
// against off and its wire bytes per token, the stages' devices and weight bytes, the bytes each
// chunk sends per link; with bridge off, the single engine's time and the ratio.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_common.h"
#include "bridge/cuda/staged_bridge.h"
#include "bridge/producer.h"
#include "dsv4_flash_decoder.h"
#include "engine/cuda/dsv4_pipeline.h"
#include "model/dsv4_calls.h"

namespace hetero {
namespace {

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream in(s);
  for (std::string x; std::getline(in, x, ',');) v.push_back(std::atoll(x.c_str()));
  return v;
}

struct Times {
  double median = 0, min = 0, max = 0;
  std::vector<double> runs;  // each timed run's seconds, in order
};

template <class F>
Result<Times> time_runs(int repeats, F&& run) {
  std::vector<double> t;
  for (int r = 0; r <= repeats; ++r) {  // the first is the warmup
    const auto t0 = std::chrono::steady_clock::now();
    HETERO_RETURN_IF_ERROR(run());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) t.push_back(s);
  }
  const bench::Spread s = bench::spread(t);  // an even count: the mean of the middle two
  return Times{s.median, s.min, s.max, t};
}

int run(int argc, char** argv) {
  std::vector<int64_t> devices = {0, 0}, Ts = {8192, 32768};
  int64_t layers = 8, step = 2048, chunk = 0;
  int repeats = 3;
  bool single = true;
  std::string weights = "checkpoint", rev = "unknown";
  std::vector<std::string> bridge_modes = {"off"};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--devices")
      devices = parse_list(next());
    else if (a == "--layers")
      layers = std::atoll(next().c_str());
    else if (a == "--weights")
      weights = next();
    else if (a == "--t")
      Ts = parse_list(next());
    else if (a == "--chunk")
      chunk = std::atoll(next().c_str());
    else if (a == "--decoder-step")
      step = std::atoll(next().c_str());
    else if (a == "--repeats")
      repeats = std::atoi(next().c_str());
    else if (a == "--rev")
      rev = next();
    else if (a == "--no-single")
      single = false;
    else if (a == "--bridge") {
      bridge_modes.clear();
      std::stringstream in(next());
      for (std::string m; std::getline(in, m, ',');) {
        if (m != "off" && m != "on") return std::fprintf(stderr, "--bridge takes off,on\n"), 2;
        bridge_modes.push_back(m);
      }
    } else
      return std::fprintf(stderr, "see the header of bench/gpu/dsv4_pipeline_bench.cc\n"), 2;
  }
  if (chunk <= 0) chunk = step;
  const Dsv4Config c = bench::flash_config(layers);
  Dsv4PipelineOptions po;
  for (int64_t d : devices) po.devices.push_back(static_cast<int>(d));
  auto wdt = cuda::parse_weight_dtype(weights);
  if (!wdt.is_ok()) return std::fprintf(stderr, "%s\n", wdt.status().to_string().c_str()), 2;
  po.engine.weight_dtype = *wdt;
  auto p = Dsv4Pipeline::random(c, 7, po);
  if (!p.is_ok()) return std::fprintf(stderr, "pipeline: %s\n", p.status().to_string().c_str()), 1;
  std::string stages = "[";
  for (int64_t s = 0; s < (*p)->stages(); ++s) {
    char buf[160];
    std::snprintf(buf, sizeof(buf), "%s{\"device\":%d,\"weight_gb\":%.2f}", s ? "," : "",
                  po.devices[static_cast<size_t>(s)], (*p)->stage(s).weight_bytes() / 1e9);
    stages += buf;
  }
  stages += "]";
  std::fprintf(stderr, "%s, %lld layers, %lld stages (%s), weights %s\n", bench::gpu_name().c_str(),
               static_cast<long long>(layers), static_cast<long long>((*p)->stages()),
               (*p)->transport(), weights.c_str());
  // The bridge as served (prefill/families_cuda.cc): each stage's layers on its own GPU.
  std::unique_ptr<cuda::Dsv4StagedBridge> bridge;
  std::unique_ptr<Dsv4DecoderWeights> decoder;
  if (std::find(bridge_modes.begin(), bridge_modes.end(), "on") != bridge_modes.end()) {
    decoder = std::make_unique<Dsv4DecoderWeights>(bench::flash_decoder_weights(
        std::vector<int64_t>(c.compress_ratios.begin(), c.compress_ratios.end())));
    std::vector<cuda::BridgeStage> bs;
    for (int64_t s = 0; s < (*p)->stages(); ++s)
      bs.push_back({(*p)->device(s), (*p)->device(s), (*p)->first_layer(s), (*p)->end_layer(s)});
    auto made = cuda::Dsv4StagedBridge::create(decoder.get(), bs);
    if (!made.is_ok())
      return std::fprintf(stderr, "bridge: %s\n", made.status().to_string().c_str()), 1;
    bridge = std::move(made.value());
  }
  FrameBufferPool frame_buffers(3);
  for (int64_t T : Ts) {
    std::mt19937 rng(static_cast<uint32_t>(T));
    std::vector<int32_t> ids(static_cast<size_t>(T));
    for (auto& v : ids) v = static_cast<int32_t>(rng() % static_cast<uint32_t>(c.vocab));
    // As the served host runs a prompt: the decoder's own calls (--decoder-step tokens each, the
    // last token alone) are the program's schedule and, grouped, the engine's chunks.
    const std::vector<int64_t> calls = dsv4_server_calls(T, step);
    const std::vector<int64_t> chunks = dsv4_group_calls(calls, chunk);
    const int64_t widest = *std::max_element(chunks.begin(), chunks.end());
    Status st = (*p)->reserve(T, widest);
    if (!st.is_ok()) return std::fprintf(stderr, "reserve: %s\n", st.to_string().c_str()), 1;
    double off_median = 0;
    for (const std::string& mode : bridge_modes) {
      const bool on = mode == "on";
      double wire_bytes = 0;
      bool complete = true;
      auto tp = time_runs(repeats, [&]() -> Status {
        HETERO_RETURN_IF_ERROR((*p)->reset());
        HETERO_RETURN_IF_ERROR((*p)->set_decoder_calls(calls));
        if (!on) return (*p)->prefill(ids, chunks, {});
        HETERO_ASSIGN_OR_RETURN(auto program, bridge->program(calls));
        double bytes = 0;
        BridgeProducer producer(program.get(), bench::counting_sink(&bytes, &frame_buffers), 4,
                                bridge->capture(), &frame_buffers);
        const Status ran = (*p)->prefill(ids, chunks, producer.tap());
        complete = producer.finish(T, ran).complete && complete;
        wire_bytes = bytes;
        return ran;
      });
      if (!tp.is_ok())
        return std::fprintf(stderr, "pipeline: %s\n", tp.status().to_string().c_str()), 1;
      if (!on) off_median = tp->median;
      Times ts;
      const bool with_single = single && !on;
      if (with_single) {  // one engine on the first stage's GPU, the pipeline's memory given back
        cudaSetDevice(po.devices[0]);
        Dsv4CudaOptions o = po.engine;
        p.value().reset();
        auto one = Dsv4CudaEngine::random(c, 7, o);
        if (!one.is_ok())
          return std::fprintf(stderr, "single: %s\n", one.status().to_string().c_str()), 1;
        if (!(st = (*one)->reserve(T, widest)).is_ok())
          return std::fprintf(stderr, "single reserve: %s\n", st.to_string().c_str()), 1;
        auto r = time_runs(repeats, [&]() -> Status {
          HETERO_RETURN_IF_ERROR((*one)->reset());
          HETERO_RETURN_IF_ERROR((*one)->set_decoder_calls(calls));
          for (int64_t at = 0; const int64_t n : chunks) {
            HETERO_RETURN_IF_ERROR(
                (*one)->prefill_chunk({ids.begin() + at, ids.begin() + at + n}, {}));
            at += n;
          }
          return (*one)->synchronize();
        });
        if (!r.is_ok())
          return std::fprintf(stderr, "single: %s\n", r.status().to_string().c_str()), 1;
        ts = *r;
        one.value().reset();
        p = Dsv4Pipeline::random(c, 7, po);  // back for the next mode and T
        if (!p.is_ok())
          return std::fprintf(stderr, "pipeline: %s\n", p.status().to_string().c_str()), 1;
        if (!(st = (*p)->reserve(T, widest)).is_ok())
          return std::fprintf(stderr, "reserve: %s\n", st.to_string().c_str()), 1;
      }
      const double tok_p = T / tp->median, tok_s = with_single ? T / ts.median : 0;
      auto num = [](bool have, double v) { return have ? std::to_string(v) : std::string("null"); };
      std::fprintf(stderr, "  T %7lld  bridge %-3s  pipeline %.3f s (%.0f tok/s)  one engine %s\n",
                   static_cast<long long>(T), mode.c_str(), tp->median, tok_p,
                   num(with_single, ts.median).c_str());
      std::printf(
          "{\"bench\":\"dsv4_pipeline\",\"gpu\":\"%s\",\"rev\":\"%s\",\"weights\":\"%s\","
          "\"layers\":%lld,\"stages\":%s,\"transport\":\"%s\",\"T\":%lld,\"decoder_step\":%lld,"
          "\"chunk\":%lld,"
          "\"repeats\":%d,\"bridge\":\"%s\",\"manifest_complete\":%s,\"pipeline_s_median\":%.4f,"
          "\"pipeline_s_min\":%.4f,\"pipeline_s_max\":%.4f,\"tok_s\":%.1f,"
          "\"bridge_cost_vs_off\":%s,\"wire_bytes_per_token\":%s,\"single_s_median\":%s,"
          "\"single_tok_s\":%s,\"pipeline_vs_single\":%s,\"link_bytes_per_chunk\":%lld",
          bench::gpu_name().c_str(), rev.c_str(), weights.c_str(), static_cast<long long>(layers),
          stages.c_str(), (*p)->transport(), static_cast<long long>(T),
          static_cast<long long>(step), static_cast<long long>(chunk), repeats, mode.c_str(),
          on ? (complete ? "true" : "false") : "null", tp->median, tp->min, tp->max, tok_p,
          num(on && off_median > 0, tp->median / off_median - 1).c_str(),
          num(on, wire_bytes / static_cast<double>(T)).c_str(), num(with_single, ts.median).c_str(),
          num(with_single, tok_s).c_str(), num(with_single, tp->median / ts.median).c_str(),
          static_cast<long long>(widest * c.hc_mult * c.hidden * 2));
      // What the line needs to stand alone (issue 53): the arithmetic, each run, the spread,
      // that tok/s is for the layers run (not scaled to 43), the command.
      std::printf(
          ",\"forward_arith\":\"fast\",\"program_arith\":%s,\"n\":%d,\"runs_s\":%s,"
          "\"spread\":%.4f,\"tok_s_basis\":\"the %lld layers run, measured (not scaled)\","
          "\"command\":%s}\n",
          on ? "\"exact (the decoder's)\"" : "null", repeats, bench::json_list(tp->runs).c_str(),
          tp->median > 0 ? (tp->max - tp->min) / tp->median : 0.0, static_cast<long long>(layers),
          bench::command_json(argc, argv).c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace
}  // namespace hetero

int main(int argc, char** argv) { return hetero::run(argc, argv); }
