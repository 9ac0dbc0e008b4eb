// The CUDA backend's prefill stacks: see families.h.
#include <memory>
#include <string>
#include <utility>

#include "bridge/cuda/gpu_programs.h"
#include "engine/cuda/dsv4_cuda.h"
#include "engine/cuda/llama_cuda.h"
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
    auto on = [&](int device) -> GpuMemory& {
      for (GpuMemory& g : out)
        if (g.device == device) return g;
      GpuMemory g;
      g.device = device;
      size_t free = 0, total = 0;
      cuda::DeviceGuard guard(device);
      if (cudaMemGetInfo(&free, &total) != cudaSuccess) cudaGetLastError();
      g.free = static_cast<int64_t>(free), g.total = static_cast<int64_t>(total);
      return out.emplace_back(g);
    };
    const int64_t weights = static_cast<int64_t>(o->engine->weight_bytes());
    on(engine_device).weights = weights;
    on(engine_device).state_and_activations =
        static_cast<int64_t>(o->engine->device_bytes()) - weights;
    on(capture_device).capture = static_cast<int64_t>(o->capture->device_bytes());
    return out;
  };
  s.owned = owned;
  return std::pair{std::move(s), owned};
}

}  // namespace

Result<PrefillStack> load_llama_cuda(const std::string& model_dir, const std::string& weights_dir,
                                     const PrefillBackend& backend) {
  HETERO_RETURN_IF_ERROR(check_device(backend.device));
  if (backend.program_device >= 0) HETERO_RETURN_IF_ERROR(check_device(backend.program_device));
  HETERO_ASSIGN_OR_RETURN(cuda::KvDtype kv, cuda::parse_kv_dtype(backend.kv_dtype));
  HETERO_ASSIGN_OR_RETURN(cuda::LlamaCudaArith arith, cuda::parse_llama_cuda_arith(backend.arith));
  HETERO_ASSIGN_OR_RETURN(cuda::WeightDtype wdt, cuda::parse_weight_dtype(backend.weights));
  HETERO_ASSIGN_OR_RETURN(LlamaDecoderWeights weights, load_llama_decoder_weights(weights_dir));
  HETERO_ASSIGN_OR_RETURN(LlamaConfig config, load_llama_config(model_dir));
  HETERO_RETURN_IF_ERROR(check_export_matches_model(config, weights.layout));
  cuda::LlamaCudaOptions options{kv, /*host_tap=*/false, backend.device, arith, wdt};
  options.device_memory_budget_bytes = backend.device_memory_budget_bytes;
  HETERO_ASSIGN_OR_RETURN(auto engine, cuda::LlamaCudaEngine::load(model_dir, options));
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
  s.programs = [gw, pool,
                backend](const PrefillRequest&) -> Result<std::unique_ptr<SegmentProgram>> {
    return on_program_device(backend, [&]() -> Result<std::unique_ptr<SegmentProgram>> {
      HETERO_ASSIGN_OR_RETURN(auto program, cuda::LlamaGpuSegmentProgram::create(gw, pool));
      return std::unique_ptr<SegmentProgram>(std::move(program));
    });
  };
  return std::move(s);
}

Result<PrefillStack> load_dsv4_cuda(const std::string& model_dir, const std::string& weights_dir,
                                    const PrefillBackend& backend) {
  HETERO_RETURN_IF_ERROR(check_device(backend.device));
  if (backend.program_device >= 0) HETERO_RETURN_IF_ERROR(check_device(backend.program_device));
  if (backend.arith != "fast")
    return failed_precondition(
        "deepseek_v4 on the cuda backend has only fast arithmetic (its caches agree with the "
        "decoder's within a tolerance, not bit for bit); pass --arith fast to accept that, or "
        "use --backend cpu for bit-exact caches");
  if (backend.device != 0)
    return invalid_argument(
        "deepseek_v4 on the cuda backend runs its forward on device 0 only, not " +
        std::to_string(backend.device) + " (--program-device can put the cache program elsewhere)");
  Dsv4CudaOptions options;
  HETERO_ASSIGN_OR_RETURN(options.weight_dtype, cuda::parse_weight_dtype(backend.weights));
  options.device_memory_budget_bytes = backend.device_memory_budget_bytes;
  HETERO_ASSIGN_OR_RETURN(Dsv4DecoderWeights weights, load_dsv4_decoder_weights(weights_dir));
  HETERO_ASSIGN_OR_RETURN(auto engine, Dsv4CudaEngine::load(model_dir, options));
  HETERO_RETURN_IF_ERROR(check_dsv4_export_matches_model(engine->config(), weights));
  HETERO_ASSIGN_OR_RETURN(auto gpu_weights, on_program_device(backend, [&] {
                            return cuda::upload_dsv4_weights(weights);
                          }));
  HETERO_ASSIGN_OR_RETURN(
      auto stack, gpu_stack(std::string("deepseek_v4"), std::string("fast"), std::move(engine),
                            std::move(weights), std::move(gpu_weights), backend));
  auto& [s, owned] = stack;
  const Dsv4DecoderWeights* w = &owned->weights;
  const cuda::Dsv4GpuWeights* gw = owned->gpu_weights.get();
  s.programs = [w, gw,
                backend](const PrefillRequest& req) -> Result<std::unique_ptr<SegmentProgram>> {
    HETERO_RETURN_IF_ERROR(require_decoder_calls(req));
    return on_program_device(backend, [&]() -> Result<std::unique_ptr<SegmentProgram>> {
      HETERO_ASSIGN_OR_RETURN(auto program,
                              cuda::Dsv4GpuSegmentProgram::create(w, gw, req.decoder_calls));
      return std::unique_ptr<SegmentProgram>(std::move(program));
    });
  };
  s.chunk_plan = [](const PrefillRequest& req, int64_t) { return req.decoder_calls; };
  return std::move(s);
}

}  // namespace hetero
