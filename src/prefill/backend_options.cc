// The prefill backend's option spec: see backend_options.h.
#include "prefill/backend_options.h"

#include <algorithm>
#include <cstdlib>

namespace hetero {

std::vector<OptionSpec> prefill_backend_specs() {
  return {
      {"backend",
       "HETERO_PREFILL_BACKEND",
       "cpu",
       "where the forward runs (cuda: the GPU engine, the cache program on a side stream)",
       false,
       {"cpu", "cuda"}},
      {"arith",
       "HETERO_PREFILL_ARITH",
       "exact",
       "cuda: exact (llama: the decoder's arithmetic on CUDA cores: bit-exact caches, the "
       "decoder's own answers) or fast (tensor cores, the engine's own cache: caches within a "
       "tolerance, answers not guaranteed; deepseek_v4 and mlx-lm-quantized llama checkpoints "
       "need fast; docs/design/prefill-cuda.md)",
       false,
       {"exact", "fast"}},
      {"kv-dtype",
       "HETERO_PREFILL_KV_DTYPE",
       "bf16",
       "cuda, fast: the engine's own cache dtype (bf16: cuDNN's attention can read it, the "
       "faster; fp8: half the bytes, the engine's own attention)",
       false,
       {"fp8", "bf16"}},
      {"attention",
       "HETERO_PREFILL_ATTENTION",
       "auto",
       "cuda, fast, llama: the attention kernel (cudnn: cuDNN's fused SDPA over a bf16 cache, "
       "refused where the build or machine has no cuDNN or the cache is fp8; own: the engine's "
       "flash kernel, any cache; auto: cudnn where it can run, else own, named in the log)",
       false,
       {"auto", "own", "cudnn"}},
      {"weight-dtype",
       "HETERO_PREFILL_WEIGHT_DTYPE",
       "bf16",
       "cuda, fast: the large weights on the GPU (fp8: e4m3, a scale per 128x128 block, "
       "quantized at load; llama: every projection, deepseek_v4: the experts; checkpoint, "
       "deepseek_v4: the official FP8 projections and FP4 experts as stored, streamed from the "
       "shards)",
       false,
       {"bf16", "fp8", "checkpoint"}},
      {"expert-widening",
       "HETERO_PREFILL_EXPERT_WIDENING",
       "per-chunk",
       "cuda, deepseek_v4, --weight-dtype checkpoint: when the FP4 routed experts are widened to "
       "the FP8 their GEMMs read (per-chunk: each layer's before its GEMMs, so only the FP4 bytes "
       "stay on the GPU; at-load: once, kept as FP8: twice the experts' bytes, no widening in "
       "any chunk; the same codes and scales, so the same results, either way)",
       false,
       {"per-chunk", "at-load"}},
      {"expert-gemm",
       "HETERO_PREFILL_EXPERT_GEMM",
       "auto",
       "cuda, deepseek_v4, --weight-dtype fp8 or checkpoint: the routed experts' GEMMs "
       "(grouped: every active expert in one launch, CUTLASS's Hopper kernel, refused where the "
       "build has none; per-expert: one cuBLASLt GEMM per expert over 8 streams; w4a8: "
       "checkpoint experts widened per chunk are widened inside one launch of our own kernel "
       "instead, with no widening scratch (4.3 GB less at Flash shapes); auto: per chunk, "
       "checkpoint experts on w4a8 where the active experts average <= 256 rows, else widened; "
       "then grouped where they average <= 384 rows and the build has it, else per-expert; named "
       "in the log)",
       false,
       {"auto", "grouped", "per-expert", "w4a8"}},
      {"gemm",
       "HETERO_PREFILL_GEMM",
       "ordered",
       "cpu, llama: the decoder's GEMM order (ordered: bit-exact attention inputs) or OpenBLAS's "
       "(blas)",
       false,
       {"ordered", "blas"}},
      {"device", "HETERO_PREFILL_DEVICE", "0", "cuda: the GPU the forward runs on"},
      {"gpus", "HETERO_PREFILL_GPUS", "",
       "cuda, deepseek_v4: the GPUs of a layer pipeline, one stage each in order, e.g. 0,1 (the "
       "layers split evenly; NCCL between GPUs; every stage on its own GPU, or all on one, as "
       "0,0); each stage's cache program runs on its own GPU. Empty: one stage on --device"},
      {"program-device", "HETERO_PREFILL_PROGRAM_DEVICE", "-1",
       "cuda: the GPU the cache program runs on (-1: the forward's); another GPU keeps its work "
       "off the forward's"},
      {"device-memory-budget-mb", "HETERO_PREFILL_DEVICE_MEMORY_BUDGET_MB", "0",
       "cuda: device memory the engine may hold (weights, cache, scratch) in MiB (0: the whole "
       "device; with --gpus, each stage's engine); a request that would pass it is sealed or "
       "refused as --memory-floor says"},
      {"host-memory-budget-mb", "HETERO_PREFILL_HOST_MEMORY_BUDGET_MB", "0",
       "cpu: host memory the engine's state may take in MiB (llama: its cache; deepseek_v4: its "
       "pooled rows, window and a chunk's working buffers; 0: half of what the host has free "
       "when a request is admitted)"},
      {"memory-floor",
       "HETERO_PREFILL_MEMORY_FLOOR",
       "seal",
       "what a request that does not fit gets: seal (the longest prefix of whole chunks that "
       "fits is prefilled and its stream sealed there; the decode side mounts it and the "
       "decoder goes on natively) or refuse (HTTP 507 before its response starts)",
       false,
       {"seal", "refuse"}},
      {"prefix-cache-mb", "HETERO_PREFILL_PREFIX_CACHE_MB", "2048",
       "the prefill host keeps its engine's state of finished requests in a prefix cache of "
       "this many MiB (least recently used out first), so a warm turn's tail is computed from "
       "where the conversation's earlier request left off, not from position 0 (llama: in "
       "blocks, cpu and cuda exact; deepseek_v4, cpu: whole checkpoints of each request's "
       "prompt, with the cache program's state; 0: off)"},
      {"prefix-cache-block", "HETERO_PREFILL_PREFIX_CACHE_BLOCK", "256",
       "the prefix cache's block in tokens: state is kept and found in whole blocks"},
      {"queue", "HETERO_PREFILL_QUEUE", "16",
       "requests that may wait while one prefills (they are served in the order they came; "
       "more are answered 503 with Retry-After, and a waiting request whose sender hangs up "
       "leaves)"},
      {"turn-ms", "HETERO_PREFILL_TURN_MS", "5000",
       "a prefill that has held the engine this long while another request waits gives it up "
       "at its next chunk and waits at the back of the queue to resume from the prefix cache "
       "(keep-alive frames meanwhile), so a short request is not stuck behind a long one "
       "(engines that hand out their state: llama cpu, cuda exact, deepseek_v4 cpu and cuda; 0: "
       "never)"},
      {"chunk", "HETERO_PREFILL_CHUNK", "0",
       "prefill chunk size in tokens (0: the family's default: llama 512; deepseek_v4 2048 on "
       "cpu, 32768 on cuda). deepseek_v4 runs the decoder's own calls, grouped into chunks of up "
       "to this many tokens (a longer call is a chunk of its own)"},
  };
}

Result<PrefillBackendOptions> prefill_backend_from(const Options& opts) {
  PrefillBackendOptions o;
  PrefillBackend& b = o.backend;
  b.name = opts.get("backend");
  b.arith = opts.get("arith");
  b.kv_dtype = opts.get("kv-dtype");
  b.attention = opts.get("attention");
  b.weights = opts.get("weight-dtype");
  b.gemm = opts.get("gemm");
  b.expert_widening = opts.get("expert-widening");
  b.expert_gemm = opts.get("expert-gemm");
  HETERO_ASSIGN_OR_RETURN(int64_t device, opts.get_int("device"));
  HETERO_ASSIGN_OR_RETURN(int64_t program_device, opts.get_int("program-device"));
  HETERO_ASSIGN_OR_RETURN(o.chunk_tokens, opts.get_int("chunk"));
  HETERO_ASSIGN_OR_RETURN(int64_t budget_mb, opts.get_int("device-memory-budget-mb"));
  if (budget_mb < 0 || budget_mb > (int64_t{1} << 40))
    return invalid_argument("--device-memory-budget-mb must be >= 0");
  b.device_memory_budget_bytes = budget_mb << 20;
  HETERO_ASSIGN_OR_RETURN(int64_t host_mb, opts.get_int("host-memory-budget-mb"));
  if (host_mb < 0 || host_mb > (int64_t{1} << 40))
    return invalid_argument("--host-memory-budget-mb must be >= 0");
  b.host_memory_budget_bytes = host_mb << 20;
  b.memory_floor = opts.get("memory-floor");
  HETERO_ASSIGN_OR_RETURN(int64_t prefix_mb, opts.get_int("prefix-cache-mb"));
  HETERO_ASSIGN_OR_RETURN(b.prefix_cache_block, opts.get_int("prefix-cache-block"));
  if (prefix_mb < 0 || prefix_mb > (int64_t{1} << 40))
    return invalid_argument("--prefix-cache-mb must be >= 0");
  if (b.prefix_cache_block < 1 || b.prefix_cache_block > (int64_t{1} << 20))
    return invalid_argument("--prefix-cache-block must be in [1, 1048576]");
  b.prefix_cache_bytes = prefix_mb << 20;
  HETERO_ASSIGN_OR_RETURN(b.queue, opts.get_int("queue"));
  HETERO_ASSIGN_OR_RETURN(b.turn_ms, opts.get_int("turn-ms"));
  if (b.turn_ms < 0) return invalid_argument("--turn-ms must be >= 0");
  if (b.queue < 0 || b.queue > 4096) return invalid_argument("--queue must be in [0, 4096]");
  if (device < 0 || device > 1024) return invalid_argument("--device must be a GPU index");
  if (program_device < -1 || program_device > 1024)
    return invalid_argument("--program-device must be a GPU index or -1");
  if (o.chunk_tokens < 0) return invalid_argument("--chunk must be a positive integer, or 0");
  b.device = static_cast<int>(device);
  b.program_device = static_cast<int>(program_device);
  const std::string gpus = opts.get("gpus");
  for (size_t at = 0; !gpus.empty() && at <= gpus.size();) {
    const size_t comma = std::min(gpus.find(',', at), gpus.size());
    const std::string one = gpus.substr(at, comma - at);
    char* end = nullptr;
    const long g = std::strtol(one.c_str(), &end, 10);
    if (one.empty() || *end != '\0' || g < 0 || g > 1024)
      return invalid_argument("--gpus must be GPU indices separated by commas (e.g. 0,1), not '" +
                              gpus + "'");
    b.gpus.push_back(static_cast<int>(g));
    at = comma + 1;
  }
  if (!b.gpus.empty() && b.name != "cuda") return invalid_argument("--gpus is for --backend cuda");
  if (b.expert_widening == "at-load" && (b.name != "cuda" || b.weights != "checkpoint"))
    return invalid_argument(
        "--expert-widening at-load widens deepseek_v4's FP4 experts: it needs --backend cuda and "
        "--weight-dtype checkpoint");
  if (b.expert_gemm != "auto" && (b.name != "cuda" || b.weights == "bf16"))
    return invalid_argument(
        "--expert-gemm chooses deepseek_v4's FP8 expert kernel: it needs --backend cuda and "
        "--weight-dtype fp8 or checkpoint");
  if (b.expert_gemm == "w4a8" && (b.weights != "checkpoint" || b.expert_widening != "per-chunk"))
    return invalid_argument(
        "--expert-gemm w4a8 runs deepseek_v4's FP4 experts: it needs --weight-dtype checkpoint "
        "and --expert-widening per-chunk");
  if (!b.gpus.empty() && device != 0) return invalid_argument("pass --gpus or --device, not both");
  return o;
}

std::vector<std::string> prefill_backend_flags(const Options& opts) {
  std::vector<std::string> flags;
  for (const OptionSpec& s : prefill_backend_specs())
    flags.insert(flags.end(), {"--" + s.name, opts.get(s.name)});
  return flags;
}

}  // namespace hetero
