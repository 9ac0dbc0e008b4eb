// The per-family assembly of a prefill host: load the model's engine and the decoder's export,
// check that they describe the same model (before any cache is written), and say how to build
// each request's cache program. Used by `hetero prefill` and `hetero verify`.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "bridge/decoder_weights.h"
#include "bridge/dsv4_program.h"
#include "model/dsv4.h"
#include "prefill/service.h"

namespace hetero {

struct PrefillStack {
  std::string family;
  std::unique_ptr<PrefillEngine> engine;
  DecoderCacheLayout layout;
  ProgramFactory programs;
  ChunkPlan chunk_plan;  // empty: equal chunks
  // The chunk a request gets when neither it nor --chunk names one: where the family's engine
  // is fastest without holding much more memory (docs/log/RESULTS-1-50.md §18 for deepseek_v4
  // on cuda).
  int64_t default_chunk = 512;
  CaptureStore* capture = nullptr;  // GPU programs: where the tap's device rows wait
  // "exact": the engine and program reproduce the decoder's arithmetic (the CPU backend, and the
  // cuda backend's exact llama engine); "fast": the rows are within a tolerance of the decoder's.
  std::string arith = "exact";
  GpuMemoryReport gpu_memory;   // GPU stacks: each device's bytes (GET /health)
  std::shared_ptr<void> owned;  // the engine and the decoder weights behind the pointers above
};

// Where and how the prefill runs.
struct PrefillBackend {
  std::string name = "cpu";        // "cpu" or "cuda"
  std::string gemm = "ordered";    // cpu, llama: "ordered" (the decoder's order) or "blas"
  std::string kv_dtype = "bf16";   // cuda: the engine's own cache, "bf16" or "fp8"
  std::string attention = "auto";  // cuda, fast, llama: "auto", "own" or "cudnn"
  std::string arith = "exact";     // cuda, llama: "exact" (the decoder's) or "fast" (tensor cores)
  int device = 0;                  // cuda: which GPU
  // cuda, deepseek_v4: the GPUs of a layer pipeline, one stage per entry in order (the layers
  // split evenly; every stage on its own GPU, or all on one). Empty: one stage on `device`.
  std::vector<int> gpus;
  // cuda, fast: the large weights on the GPU, "bf16", "fp8" (e4m3 with a float32 scale per
  // 128x128 block, quantized at load; cuBLASLt block-scaled GEMMs: llama's projections,
  // deepseek_v4's experts) or "checkpoint" (deepseek_v4: the official FP8 projections and FP4
  // experts as stored, streamed from the shards).
  std::string weights = "bf16";
  // cuda, deepseek_v4, weights "checkpoint": "per-chunk" (the FP4 experts widened before each
  // layer's GEMMs) or "at-load" (widened once and kept as FP8; Dsv4CudaOptions::
  // widen_experts_at_load).
  std::string expert_widening = "per-chunk";
  // deepseek_v4 on cuda with FP8 experts: auto, grouped or per-expert (Dsv4CudaOptions::
  // expert_gemm).
  std::string expert_gemm = "auto";
  // cuda: the GPU the cache program runs on (-1: the engine's). Another GPU than the engine's
  // keeps the program's work off the engine's SMs; the tap's rows cross peer to peer.
  int program_device = -1;
  // cuda: device memory the engine may hold (weights, cache, scratch), in bytes; 0: no budget
  // beyond the device. A request that would pass it is refused before its response starts
  // (PrefillEngine::reserve), as one that does not fit on the device is.
  int64_t device_memory_budget_bytes = 0;
  // cpu: host memory the engine's state may take (llama: its cache; deepseek_v4: its pooled
  // rows, window and a chunk's buffers), in bytes; 0: half of what the host has free (the rest
  // is left to the decoder and the machine).
  int64_t host_memory_budget_bytes = 0;
  // What a request that does not fit gets: "seal" (the longest prefix of whole chunks that fits
  // is prefilled and its stream sealed there, PrefillService::set_memory_floor) or
  // "refuse" (HTTP 507 before its response starts).
  std::string memory_floor = "seal";
  // The prefill host's prefix cache of engine state (PrefillService::set_state_cache): bytes
  // (0: none) and its block in tokens.
  int64_t prefix_cache_bytes = 0;
  int64_t prefix_cache_block = 256;
  int64_t queue = 16;      // requests that may wait for the running one (PrefillService::set_queue)
  int64_t turn_ms = 5000;  // PrefillService::set_turn_ms
};

// The longest prompt a prefill host takes when --max-tokens is 0 (its default): 2,097,152
// tokens, or, for a CPU llama engine that refuses what does not fit, what half the host's
// available memory holds of its cache.
int64_t machine_max_tokens(const PrefillStack& stack, const PrefillBackend& backend);

// The stack's ways on a service built for it: its chunk plan, capture, arithmetic, GPU memory
// report and memory floor (`hetero prefill` and `hetero verify` alike).
void configure_service(PrefillService* service, const PrefillStack& stack,
                       const PrefillBackend& backend);

// Whether this build has the CUDA backend.
bool cuda_backend_built();

// The family's stack on the backend, then, for every backend, the check that model_dir holds the
// decoder's weights (prefill/pairing.h): refused with kFailedPrecondition naming both sides.
Result<PrefillStack> load_prefill_stack(const std::string& model_dir,
                                        const std::string& weights_dir,
                                        const PrefillBackend& backend = {});

#ifdef HETERO_WITH_CUDA
// The CUDA backend's stacks (families_cuda.cc): the GPU engine, and the cache program on the GPU
// behind a device capture. Reached through load_prefill_stack, which adds the pairing check.
Result<PrefillStack> load_llama_cuda(const std::string& model_dir, const std::string& weights_dir,
                                     const PrefillBackend& backend);
Result<PrefillStack> load_dsv4_cuda(const std::string& model_dir, const std::string& weights_dir,
                                    const PrefillBackend& backend);
#endif

// deepseek_v4: a request must carry the decoder's own call schedule, on which its cache depends
// (every later layer's input depends on where the decoder's calls were cut); none is guessed.
Status require_decoder_calls(const PrefillRequest& req);

// The whole prompt a request's rows are the prefix of: the bridged rows never include the
// prompt's last token, which the decoder keeps to process (run_bridge), and its call may take
// those rows with it.
int64_t prompt_tokens(const PrefillRequest& req);

// llama, both backends: the rope a request's rows take in the cache program, or why they are
// not computed (a sliding window's calls, check_sliding_calls; past a rope's reach without the
// decoder's calls). Past a dynamic rope's reach every call's rows have their own base: the rows
// are the decoder's only with its calls, all of them (a tail there the engine refuses).
Result<RopeByCall> llama_program_rope(const LlamaDecoderWeights& w, const PrefillRequest& req);

// deepseek_v4: every parameter the cache program's arithmetic depends on must agree between the
// prefill host's checkpoint and the decoder's export; the message names both values.
Status check_dsv4_export_matches_model(const Dsv4Config& model, const Dsv4DecoderWeights& export_);

}  // namespace hetero
