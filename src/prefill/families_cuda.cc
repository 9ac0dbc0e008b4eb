// The CUDA backend's prefill stacks: see families.h.
#include <cstdio>
#include <memory>
#include <string>
#include <utility>

#include "bridge/cuda/gpu_programs.h"
#include "bridge/cuda/staged_bridge.h"
#include "engine/cuda/dsv4_cuda.h"
#include "engine/cuda/dsv4_pipeline.h"
#include "engine/cuda/llama_cuda.h"
#include "model/dsv4_calls.h"
#include "prefill/families.h"

namespace hetero {

namespace {

// Before anything is loaded: a machine without a GPU hears so first.
Status check_device(int device) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) cudaGetLastError();  // reported here, not again by a later check
  if (e != cudaSuccess || n == 0)
    return unavailable(std::string("the cuda backend needs a CUDA device; none is usable here (") +
                       cudaGetErrorString(e) + ")");
  if (device < 0 || device >= n)
    return invalid_argument("CUDA device " + std::to_string(device) + " does not exist (" +
                            std::to_string(n) + " present)");
  return Status::ok();
}

// A device's entry in a memory report (added, with what the driver says is free, on first use).
GpuMemory& gpu_entry(std::vector<GpuMemory>& out, int device) {
  for (GpuMemory& g : out)
    if (g.device == device) return g;
  GpuMemory g;
  g.device = device;
  size_t free = 0, total = 0;
  cuda::DeviceGuard guard(device);
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) cudaGetLastError();
  g.free = static_cast<int64_t>(free), g.total = static_cast<int64_t>(total);
  return out.emplace_back(g);
}

// f() with the cache program's GPU current (its weights, its stream and scratch live there).
template <class F>
auto on_program_device(const PrefillBackend& backend, F&& f) {
  cuda::DeviceGuard on_program(backend.program_device);
  return f();
}

// What a GPU stack owns: the engine, the decoder's export (host and device copies) and the
// capture its producer uses.
template <class Engine, class Weights, class GpuWeights>
struct GpuOwned {
  std::unique_ptr<Engine> engine;
  Weights weights;
  std::unique_ptr<GpuWeights> gpu_weights;
  std::unique_ptr<cuda::GpuCaptureStore> capture;
};

// The stack's parts every family shares; the family adds its programs and chunk plan.
template <class Engine, class Weights, class GpuWeights>
Result<std::pair<PrefillStack, std::shared_ptr<GpuOwned<Engine, Weights, GpuWeights>>>> gpu_stack(
    std::string family, std::string arith, std::unique_ptr<Engine> engine, Weights weights,
    std::unique_ptr<GpuWeights> gpu_weights, const PrefillBackend& backend) {
  auto owned = std::make_shared<GpuOwned<Engine, Weights, GpuWeights>>();
  {
    cuda::DeviceGuard on_engine(backend.device);
    HETERO_ASSIGN_OR_RETURN(owned->capture,
                            cuda::GpuCaptureStore::create(4, backend.program_device));
  }
  owned->engine = std::move(engine);
  owned->weights = std::move(weights);
  owned->gpu_weights = std::move(gpu_weights);
  PrefillStack s;
  s.family = std::move(family);
  s.arith = std::move(arith);
  s.engine = std::make_unique<EngineAdapter<Engine>>(owned->engine.get());
  s.layout = owned->weights.layout;
  s.capture = owned->capture.get();
  const int engine_device = backend.device;
  const int capture_device = backend.program_device >= 0 ? backend.program_device : backend.device;
  std::weak_ptr<GpuOwned<Engine, Weights, GpuWeights>> weak = owned;
  s.gpu_memory = [weak, engine_device, capture_device]() {
    std::vector<GpuMemory> out;
    auto o = weak.lock();
    if (!o) return out;
    const int64_t weights = static_cast<int64_t>(o->engine->weight_bytes());
    gpu_entry(out, engine_device).weights = weights;
    gpu_entry(out, engine_device).state_and_activations =
        static_cast<int64_t>(o->engine->device_bytes()) - weights;
    gpu_entry(out, capture_device).capture = static_cast<int64_t>(o->capture->device_bytes());
    return out;
  };
  s.owned = owned;
  return std::pair{std::move(s), owned};
}

}  // namespace

Result<PrefillStack> load_llama_cuda(const std::string& model_dir, const std::string& weights_dir,
                                     const PrefillBackend& requested) {
  if (requested.gpus.size() > 1)
    return invalid_argument(
        "llama runs on one GPU (--device); --gpus with several is for "
        "deepseek_v4's layer pipeline");
  PrefillBackend backend = requested;
  if (!requested.gpus.empty()) backend.device = requested.gpus.front();
  HETERO_RETURN_IF_ERROR(check_device(backend.device));
  if (backend.program_device >= 0) HETERO_RETURN_IF_ERROR(check_device(backend.program_device));
  HETERO_ASSIGN_OR_RETURN(cuda::KvDtype kv, cuda::parse_kv_dtype(backend.kv_dtype));
  HETERO_ASSIGN_OR_RETURN(cuda::LlamaCudaArith arith, cuda::parse_llama_cuda_arith(backend.arith));
  HETERO_ASSIGN_OR_RETURN(cuda::WeightDtype wdt, cuda::parse_weight_dtype(backend.weights));
  if (backend.expert_gemm != "auto")
    return invalid_argument(
        "--expert-gemm chooses deepseek_v4's routed-expert kernel; llama has "
        "no experts");
  HETERO_ASSIGN_OR_RETURN(LlamaDecoderWeights weights, load_llama_decoder_weights(weights_dir));
  HETERO_ASSIGN_OR_RETURN(LlamaConfig config, load_llama_config(model_dir));
  HETERO_RETURN_IF_ERROR(check_export_matches_model(config, weights));
  HETERO_ASSIGN_OR_RETURN(cuda::AttentionKernel attention,
                          cuda::parse_attention_kernel(backend.attention));
  cuda::LlamaCudaOptions options{kv, /*host_tap=*/false, backend.device, arith, wdt};
  options.device_memory_budget_bytes = backend.device_memory_budget_bytes;
  options.attention = attention;
  HETERO_ASSIGN_OR_RETURN(auto engine, cuda::LlamaCudaEngine::load(model_dir, options));
  if (arith == cuda::LlamaCudaArith::kFast)
    std::fprintf(stderr, "prefill: cuda llama engine on GPU %d, attention: %s\n", backend.device,
                 engine->attention_name().c_str());
  HETERO_ASSIGN_OR_RETURN(auto gpu_weights, on_program_device(backend, [&] {
                            return cuda::upload_llama_weights(weights);
                          }));
  HETERO_ASSIGN_OR_RETURN(
      auto stack,
      gpu_stack(std::string("llama"),
                std::string(arith == cuda::LlamaCudaArith::kExact ? "exact" : "fast"),
                std::move(engine), std::move(weights), std::move(gpu_weights), backend));
  auto& [s, owned] = stack;
  const cuda::LlamaGpuWeights* gw = owned->gpu_weights.get();
  // One set of page-locked blocks for every request: pinning hundreds of MB per request would
  // cost more than the segment's copies.
  auto pool = cuda::make_pinned_pool();
  const LlamaDecoderWeights* exported = &owned->weights;
  s.programs = [gw, pool, backend,
                exported](const PrefillRequest& req) -> Result<std::unique_ptr<SegmentProgram>> {
    HETERO_ASSIGN_OR_RETURN(RopeByCall rope, llama_program_rope(*exported, req));
    return on_program_device(backend, [&]() -> Result<std::unique_ptr<SegmentProgram>> {
      HETERO_ASSIGN_OR_RETURN(auto program, cuda::LlamaGpuSegmentProgram::create(gw, pool, &rope));
      return std::unique_ptr<SegmentProgram>(std::move(program));
    });
  };
  return std::move(s);
}

// What a deepseek_v4 GPU stack owns: the pipeline, the decoder's export, and the bridge built
// on it (which reads the export: it goes first).
struct Dsv4Owned {
  std::unique_ptr<Dsv4Pipeline> pipeline;
  Dsv4DecoderWeights weights;
  std::unique_ptr<cuda::Dsv4StagedBridge> bridge;
};

Result<PrefillStack> load_dsv4_cuda(const std::string& model_dir, const std::string& weights_dir,
                                    const PrefillBackend& backend) {
  const std::vector<int> gpus =
      backend.gpus.empty() ? std::vector<int>{backend.device} : backend.gpus;
  for (int g : gpus) HETERO_RETURN_IF_ERROR(check_device(g));
  if (backend.program_device >= 0) {
    if (gpus.size() > 1)
      return invalid_argument(
          "--program-device is for one stage; with --gpus each stage's cache program runs on "
          "its stage's GPU");
    HETERO_RETURN_IF_ERROR(check_device(backend.program_device));
  }
  if (backend.arith != "fast")
    return failed_precondition(
        "deepseek_v4 on the cuda backend has only fast arithmetic (its caches agree with the "
        "decoder's within a tolerance, not bit for bit); pass --arith fast to accept that, or "
        "use --backend cpu for bit-exact caches");
  Dsv4PipelineOptions po;
  po.devices = gpus;
  HETERO_ASSIGN_OR_RETURN(po.engine.weight_dtype, cuda::parse_weight_dtype(backend.weights));
  po.engine.widen_experts_at_load = backend.expert_widening == "at-load";
  HETERO_ASSIGN_OR_RETURN(po.engine.expert_gemm, parse_expert_gemm(backend.expert_gemm));
  po.engine.device_memory_budget_bytes = backend.device_memory_budget_bytes;
  auto owned = std::make_shared<Dsv4Owned>();
  HETERO_ASSIGN_OR_RETURN(owned->weights, load_dsv4_decoder_weights(weights_dir));
  HETERO_ASSIGN_OR_RETURN(owned->pipeline, Dsv4Pipeline::load(model_dir, po));
  const Dsv4Pipeline& p = *owned->pipeline;
  HETERO_RETURN_IF_ERROR(check_dsv4_export_matches_model(p.config(), owned->weights));
  std::fprintf(stderr, "prefill: cuda deepseek_v4 engine, %lld stage(s), routed experts: %s\n",
               static_cast<long long>(p.stages()),
               owned->pipeline->stage(0).expert_gemm_name().c_str());
  std::vector<cuda::BridgeStage> stages;
  for (int64_t st = 0; st < p.stages(); ++st)
    stages.push_back({p.device(st),
                      backend.program_device >= 0 ? backend.program_device : p.device(st),
                      p.first_layer(st), p.end_layer(st)});
  HETERO_ASSIGN_OR_RETURN(owned->bridge, cuda::Dsv4StagedBridge::create(&owned->weights, stages));
  PrefillStack s;
  s.family = "deepseek_v4";
  s.arith = "fast";
  s.engine = std::make_unique<EngineAdapter<Dsv4Pipeline>>(owned->pipeline.get());
  s.layout = owned->weights.layout;
  s.capture = owned->bridge->capture();
  std::weak_ptr<Dsv4Owned> weak = owned;
  s.gpu_memory = [weak]() {
    std::vector<GpuMemory> out;
    auto o = weak.lock();
    if (!o) return out;
    for (int64_t st = 0; st < o->pipeline->stages(); ++st) {
      Dsv4CudaEngine& e = o->pipeline->stage(st);
      GpuMemory& g = gpu_entry(out, o->pipeline->device(st));
      g.weights += e.weight_bytes();
      g.state_and_activations += e.device_bytes() - e.weight_bytes();
    }
    for (const cuda::BridgeStage& b : o->bridge->stages()) {
      GpuMemory& g = gpu_entry(out, b.program_device);
      g.capture = static_cast<int64_t>(o->bridge->capture()->device_bytes(b.program_device));
    }
    return out;
  };
  const cuda::Dsv4StagedBridge* bridge = owned->bridge.get();
  s.programs = [bridge](const PrefillRequest& req) -> Result<std::unique_ptr<SegmentProgram>> {
    HETERO_RETURN_IF_ERROR(require_decoder_calls(req));
    HETERO_ASSIGN_OR_RETURN(auto program, bridge->program(req.decoder_calls, req.start));
    return std::unique_ptr<SegmentProgram>(std::move(program));
  };
  s.chunk_plan = [](const PrefillRequest& req, int64_t chunk) {
    return dsv4_group_calls(req.decoder_calls, chunk);
  };
  s.default_chunk = 32768;
  s.owned = owned;
  return s;
}

}  // namespace hetero
