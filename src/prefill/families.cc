// Per-family prefill hosts: see families.h.
#include "prefill/families.h"

#include <algorithm>
#include <sstream>

#include "bridge/dsv4_stream.h"
#include "common/sysmem.h"
#include "engine/dsv4_cpu.h"
#include "engine/llama_cpu.h"
#include "model/dsv4_calls.h"
#include "prefill/pairing.h"

namespace hetero {
namespace {

std::string show(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

Result<PrefillStack> load_llama(const std::string& model_dir, const std::string& weights_dir,
                                const std::string& gemm, int64_t memory_budget) {
  if (gemm != "ordered" && gemm != "blas")
    return invalid_argument("--gemm must be 'ordered' or 'blas'");
  HETERO_ASSIGN_OR_RETURN(
      auto engine,
      LlamaCpuEngine::load(model_dir, gemm == "blas" ? LlamaCpuEngine::Gemm::kBlas
                                                     : LlamaCpuEngine::Gemm::kOrdered));
  engine->set_memory_budget(memory_budget);
  HETERO_ASSIGN_OR_RETURN(LlamaDecoderWeights weights, load_llama_decoder_weights(weights_dir));
  HETERO_RETURN_IF_ERROR(check_export_matches_model(engine->config(), weights));
  struct Owned {
    std::unique_ptr<LlamaCpuEngine> engine;
    LlamaDecoderWeights weights;
    std::unique_ptr<LlamaCacheProgram> program;
  };
  auto owned = std::make_shared<Owned>();
  owned->engine = std::move(engine);
  owned->weights = std::move(weights);
  owned->program = std::make_unique<LlamaCacheProgram>(&owned->weights);
  PrefillStack s;
  s.family = "llama";
  s.engine = std::make_unique<EngineAdapter<LlamaCpuEngine>>(owned->engine.get());
  s.layout = owned->weights.layout;
  const LlamaCacheProgram* program = owned->program.get();
  const LlamaDecoderWeights* exported = &owned->weights;
  s.programs = [program,
                exported](const PrefillRequest& req) -> Result<std::unique_ptr<SegmentProgram>> {
    HETERO_ASSIGN_OR_RETURN(RopeByCall rope, llama_program_rope(*exported, req));
    if (!rope.per_call())
      return std::unique_ptr<SegmentProgram>(std::make_unique<LlamaSegmentProgram>(program));
    return std::unique_ptr<SegmentProgram>(
        std::make_unique<LlamaSegmentProgram>(program, std::move(rope)));
  };
  s.owned = owned;
  return s;
}

Result<PrefillStack> load_dsv4(const std::string& model_dir, const std::string& weights_dir,
                               int64_t memory_budget) {
  HETERO_ASSIGN_OR_RETURN(auto engine, Dsv4CpuEngine::load(model_dir));
  engine->set_memory_budget(memory_budget);
  HETERO_ASSIGN_OR_RETURN(Dsv4DecoderWeights weights, load_dsv4_decoder_weights(weights_dir));
  HETERO_RETURN_IF_ERROR(check_dsv4_export_matches_model(engine->config(), weights));
  struct Owned {
    std::unique_ptr<Dsv4CpuEngine> engine;
    Dsv4DecoderWeights weights;
  };
  auto owned = std::make_shared<Owned>();
  owned->engine = std::move(engine);
  owned->weights = std::move(weights);
  PrefillStack s;
  s.family = "deepseek_v4";
  s.engine = std::make_unique<EngineAdapter<Dsv4CpuEngine>>(owned->engine.get());
  s.layout = owned->weights.layout;
  const Dsv4DecoderWeights* w = &owned->weights;
  // The decoder's cache depends on its own call schedule, which only the decoder side knows
  // (its seam reports it; the front door and verify send it): without it, no cache is made.
  s.programs = [w](const PrefillRequest& req) -> Result<std::unique_ptr<SegmentProgram>> {
    HETERO_RETURN_IF_ERROR(require_decoder_calls(req));
    return std::unique_ptr<SegmentProgram>(
        std::make_unique<Dsv4SegmentProgram>(w, req.decoder_calls, req.start));
  };
  // Every later layer's attention input depends on where the decoder's calls were cut (the
  // ratio-4 overlap lane): the engine runs the decoder's own calls, grouped into chunks of up to
  // --chunk tokens (set_decoder_calls keeps their edges inside a chunk).
  s.chunk_plan = [](const PrefillRequest& req, int64_t chunk) {
    return dsv4_group_calls(req.decoder_calls, chunk);
  };
  s.default_chunk = 2048;  // the decoder server's own call length
  s.owned = owned;
  return s;
}

}  // namespace

int64_t machine_max_tokens(const PrefillStack& stack, const PrefillBackend& backend) {
  constexpr int64_t kLongest = int64_t{1} << 21;  // the longest context this project serves
  if (backend.name != "cpu" || stack.family != "llama" || backend.memory_floor == "seal")
    return kLongest;
  const DecoderCacheLayout& l = stack.layout;
  const int64_t per_token = 2 * l.layers * l.kv_heads * l.head_dim * 2;  // K and V, bf16
  const int64_t available = host_available_bytes();
  if (available <= 0 || per_token <= 0) return kLongest;
  return std::clamp<int64_t>(available / 2 / per_token, 1, kLongest);
}

void configure_service(PrefillService* service, const PrefillStack& stack,
                       const PrefillBackend& backend) {
  if (stack.chunk_plan) service->set_chunk_plan(stack.chunk_plan);
  service->set_capture(stack.capture);
  service->set_arith(stack.arith);
  if (stack.gpu_memory) service->set_gpu_memory(stack.gpu_memory);
  // The floor seals at a chunk the engine's reserve() refuses. Every family's stream carries what
  // the decode side needs at each segment's end (llama: its rows; deepseek_v4: the state at that
  // end, from the CPU and GPU programs alike), so a sealed one mounts at its last chunk.
  service->set_memory_floor(backend.memory_floor == "seal");
  service->set_state_cache(backend.prefix_cache_block, backend.prefix_cache_bytes);
  service->set_queue(backend.queue);
  service->set_turn_ms(backend.turn_ms);
}

int64_t prompt_tokens(const PrefillRequest& req) {
  return static_cast<int64_t>(req.ids.size()) + 1;
}

Result<RopeByCall> llama_program_rope(const LlamaDecoderWeights& w, const PrefillRequest& req) {
  HETERO_RETURN_IF_ERROR(check_sliding_calls(w, req.start, prompt_tokens(req), req.decoder_calls));
  HETERO_ASSIGN_OR_RETURN(
      RopeByCall rope,
      RopeByCall::make(w.rope_config, w.rope, req.start, req.decoder_calls, req.decoder_batched));
  if (!rope.per_call()) HETERO_RETURN_IF_ERROR(check_rope_reach(w.rope_config, prompt_tokens(req)));
  return rope;
}

Status require_decoder_calls(const PrefillRequest& req) {
  if (!req.decoder_calls.empty()) return Status::ok();
  return invalid_argument(
      "a deepseek_v4 request needs 'decoder_calls', the decoder's own call schedule for these "
      "ids (its seam reports it in /hetero/info 'prefill')");
}

Status check_dsv4_export_matches_model(const Dsv4Config& m, const Dsv4DecoderWeights& e) {
  auto mismatch = [](const std::string& what, const std::string& model, const std::string& exp) {
    return failed_precondition("the decoder's export does not match this prefill host's model: " +
                               what + " is " + exp + " in the decoder's export and " + model +
                               " in the prefill model; refusing before any cache is written");
  };
  auto num = [&](const std::string& what, double model, double exp) -> Status {
    if (model != exp) return mismatch(what, show(model), show(exp));
    return Status::ok();
  };
  const auto& l = e.layout;
  HETERO_RETURN_IF_ERROR(
      num("layers", static_cast<double>(m.layers), static_cast<double>(l.layers)));
  HETERO_RETURN_IF_ERROR(
      num("hidden_size", static_cast<double>(m.hidden), static_cast<double>(l.hidden)));
  HETERO_RETURN_IF_ERROR(
      num("head_dim", static_cast<double>(m.head_dim), static_cast<double>(l.head_dim)));
  HETERO_RETURN_IF_ERROR(num("index_head_dim", static_cast<double>(m.index_head_dim),
                             static_cast<double>(e.index_head_dim)));
  HETERO_RETURN_IF_ERROR(
      num("sliding_window", static_cast<double>(m.sliding_window), static_cast<double>(e.window)));
  HETERO_RETURN_IF_ERROR(num("qk_rope_head_dim", static_cast<double>(m.rope_head_dim),
                             static_cast<double>(e.rope_dims)));
  HETERO_RETURN_IF_ERROR(num("rms_norm_eps", m.rms_norm_eps, e.rms_norm_eps));
  HETERO_RETURN_IF_ERROR(num("rope_theta", m.rope_theta, e.rope_theta));
  HETERO_RETURN_IF_ERROR(num("compress_rope_theta", m.compress_rope_theta, e.compress_rope_theta));
  if (m.yarn.enabled != e.yarn.enabled)
    return mismatch("rope_scaling (YaRN)", m.yarn.enabled ? "on" : "off",
                    e.yarn.enabled ? "on" : "off");
  if (m.yarn.enabled) {
    HETERO_RETURN_IF_ERROR(num("rope_scaling.factor", m.yarn.factor, e.yarn.factor));
    HETERO_RETURN_IF_ERROR(num("rope_scaling.original_max_position_embeddings",
                               m.yarn.original_max_position_embeddings,
                               e.yarn.original_max_position_embeddings));
    HETERO_RETURN_IF_ERROR(num("rope_scaling.beta_fast", m.yarn.beta_fast, e.yarn.beta_fast));
    HETERO_RETURN_IF_ERROR(num("rope_scaling.beta_slow", m.yarn.beta_slow, e.yarn.beta_slow));
  }
  for (int64_t i = 0; i < l.layers; ++i) {
    const int64_t mr = m.compress_ratios[static_cast<size_t>(i)];
    const int64_t er = l.ratios[static_cast<size_t>(i)];
    if (mr != er)
      return mismatch("compress_ratios[" + std::to_string(i) + "]", std::to_string(mr),
                      std::to_string(er));
  }
  return Status::ok();
}

bool cuda_backend_built() {
#ifdef HETERO_WITH_CUDA
  return true;
#else
  return false;
#endif
}

Result<PrefillStack> load_prefill_stack(const std::string& model_dir,
                                        const std::string& weights_dir,
                                        const PrefillBackend& backend) {
  if (backend.name != "cpu" && backend.name != "cuda")
    return invalid_argument("the prefill backend must be 'cpu' or 'cuda', not '" + backend.name +
                            "'");
  if (backend.name == "cuda" && !cuda_backend_built())
    return failed_precondition(
        "this build has no CUDA backend (nvcc was not found when it was configured)");
  const bool dsv4 = is_dsv4_checkpoint(model_dir);
  if (dsv4 && decoder_family(weights_dir) != "deepseek_v4")
    return failed_precondition("the model is deepseek_v4 but the decoder export in " + weights_dir +
                               " is family '" + decoder_family(weights_dir) + "'");
  auto load = [&]() -> Result<PrefillStack> {
#ifdef HETERO_WITH_CUDA
    if (backend.name == "cuda")
      return dsv4 ? load_dsv4_cuda(model_dir, weights_dir, backend)
                  : load_llama_cuda(model_dir, weights_dir, backend);
#endif
    if (dsv4) return load_dsv4(model_dir, weights_dir, backend.host_memory_budget_bytes);
    return load_llama(model_dir, weights_dir, backend.gemm, backend.host_memory_budget_bytes);
  };
  HETERO_ASSIGN_OR_RETURN(PrefillStack stack, load());
  // Every backend's stack, once its own checks passed (layout, rope): the checkpoint must hold
  // the decoder's weights, or no cache it makes is the decoder's (pairing.h).
  HETERO_RETURN_IF_ERROR(
      check_checkpoint_holds_decoder_weights(stack.family, model_dir, weights_dir));
  return stack;
}

}  // namespace hetero
