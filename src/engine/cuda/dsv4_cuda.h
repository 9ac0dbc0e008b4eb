// CUDA backend of the prefill engine for DeepSeek-V4: the same forward and the same chunk
// semantics as Dsv4CpuEngine (engine/dsv4_cpu.h) — the decoder-shaped per-layer state (local
// window, compressor pools with their pending rows, the indexer's pool, the ratio-4 overlap lane
// that is empty for the first window a call completes, HISA once a layer holds index_block *
// index_keep pooled rows, chunks of 2..8 tokens run token by token) — in fast arithmetic: bf16
// tensor-core GEMMs through cuBLAS with float32 accumulation, the checkpoint's FP8/FP4 weights
// dequantized to bf16 at load (the experts' optionally requantized to block-scaled FP8,
// weight_dtype), tensor-core attention over the window and the (selected) compressed rows,
// routed experts grouped per expert over a few side streams. It is not bit-identical to the CPU
// engine; tests/gpu/dsv4_cuda_test.cc states how close it is (it compares with the CPU engine's
// `dequant` arithmetic, the dense decoder this engine computes).
//
// Memory: the weights are uploaded once; activations are sized by the largest chunk seen; the
// per-layer state lives on the device. reserve() takes a request's memory up front (admission);
// every allocation counts against device_memory_budget_bytes when one is set. Work is enqueued on
// one compute stream owned by the engine; the host waits only for the per-expert row counts of
// each MoE layer (cuBLAS needs them) and, with host_tap, for the tap's copy.
// Errors: every CUDA failure is a Status (out of device memory, or past the budget:
// kResourceExhausted with the bytes asked and free); nothing aborts. After a failed chunk the
// sequence is lost; reset() makes the engine usable again. Thread-safety: one engine serves one
// sequence at a time, from one host thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/checkpoint.h"
#include "common/status.h"
#include "engine/tap.h"
#include "kernels/cuda/fp8_gemm.h"
#include "model/dsv4.h"

namespace hetero {

struct Dsv4CudaOptions {
  // Hand the tap a host copy of x too (copied back and waited for): for tests and the CPU
  // programs. Without it the tap gets x_device and the stream only.
  bool host_tap = false;
  // Routed experts through one cublasGemmGroupedBatchedEx call per projection instead of a loop
  // of one GEMM per active expert (the loop measured ~3% faster end to end on an H200 at Flash
  // shapes, 8K and 32K tokens; bench/gpu/dsv4_layer_bench --moe).
  bool grouped_experts = false;
  // Record an event at each phase of the forward and add up the device time per phase
  // (phase_ms()); each chunk then ends by waiting for the device. For benchmarks.
  bool phase_timing = false;
  // Run every attention call through the online-softmax kernel, which otherwise serves only key
  // lists too long for the two-pass kernel's shared memory (ratio-128 layers past ~230K tokens at
  // head_dim 512): for tests.
  bool online_softmax_attention = false;
  // How the large weights live on the device. kCheckpoint (load() from an official checkpoint,
  // or random()) keeps DeepSeek's own forms: the FP8 e4m3 projections (wq_a, wq_b, wkv, wo_b,
  // the indexer's wq_b, the shared expert) with their UE8M0 128x128 scales run on the FP8 GEMMs
  // as stored (their inputs quantized per token and 128 columns), wo_a is dequantized to bf16
  // (the grouped einsum's operand, as in the reference), the routed experts stay FP4 and a
  // layer's active ones are widened to FP8 in one launch, just before their GEMMs, into a
  // scratch of one projection's experts (fp4_lossy_groups() counts any inexact group); the rest
  // stays as stored (bf16 / f32). Loading streams the shards tensor
  // by tensor through a 64 MiB pinned buffer, refusing, by name, a tensor stored otherwise.
  // Otherwise: how the experts' weights (routed and shared: ~98% of a Flash layer's bytes) live
  // on the device. kFp8 quantizes them at upload into the 128x128 block-scaled e4m3 format
  // (kernels/cuda/fp8_gemm.h; no bf16 copy is kept, so about twice as many layers fit) and runs
  // the expert GEMMs on the FP8 tensor cores through cuBLASLt, one per active expert, quantizing
  // their inputs per token and 128 columns. The other projections stay bf16. Hopper (sm_90) only;
  // the hidden and expert widths must be multiples of 16; not with grouped_experts.
  cuda::WeightDtype weight_dtype = cuda::WeightDtype::kBf16;
  // Under kCheckpoint: widen every routed expert's FP4 weight to FP8 once, when the weights are
  // in, and keep only the FP8 form (the FP4 bytes are freed): twice the experts' bytes on the
  // device, and no widening in any chunk (at 8K tokens it was a quarter of a Flash layer's
  // time). The GEMMs read the same FP8 codes and scales either way, so the forward's bits do not
  // change; fp4_lossy_groups() counts the inexact groups at load instead. Loading peaks at the
  // widened footprint plus one projection's FP4 form (a layer's FP8 form is allocated before its
  // FP4 one is freed).
  bool widen_experts_at_load = false;
  // Routed experts' GEMMs over this many side streams (1: on the compute stream), each taking a
  // run of consecutive experts with about equal rows: one expert's GEMM (a few hundred rows at
  // 8K tokens) fills only part of the GPU. At most 16; 1 with grouped_experts. 4 measured 2%
  // faster end to end than 1 with bf16 experts and 8% with FP8 ones (H200, 4 Flash layers, 8K to
  // 128K tokens; bench/gpu/dsv4_layer_bench --expert-streams), and 8 took the routed experts of 8
  // Flash layers in the checkpoint's precision (widened at load) from 43.9 to 38.4 ms at 8K
  // tokens, the same as 4 at 32K (RESULTS §25). Each stream past the first holds a spill buffer
  // of a chunk's rows at the widest expert projection (256 MiB at Flash shapes and a
  // 32,768-token chunk) and its own cuBLAS handles.
  int expert_streams = 8;
  // How FP8 and checkpoint-precision routed experts run their GEMMs. kGrouped: every active
  // expert's GEMM in one launch per projection (CUTLASS's grouped Hopper kernel with FP8
  // blockwise scaling, kernels/cuda/fp8_grouped_gemm.h; no lane is made for the routed experts);
  // refused where the build has no CUTLASS. kPerExpert: one cuBLASLt GEMM per active expert over
  // expert_streams. kAuto: per chunk, the grouped kernel where the chunk's active experts average
  // at most kGroupedMaxMeanRows rows, else per expert (at Flash's shapes the grouped kernel was
  // 1.08-1.35x faster for w1|w3 and 1.58-2.57x for w2 at 8,192 tokens, ~192 rows an expert, and
  // cuBLASLt over 8 streams 1.03-1.22x faster at 32,768 tokens, ~768 rows; four runs, RESULTS
  // §39); without CUTLASS, per expert. expert_gemm_name()
  // says which. The two kernels gave equal bits in every test so far, but nothing promises it.
  // kW4a8 (checkpoint precision with the experts FP4, i.e. not widen_experts_at_load): the
  // active experts' FP4 weights widened inside one grouped GEMM per projection
  // (kernels/cuda/w4a8_grouped_gemm.h), never written out widened, so the engine holds no
  // widening scratch (one projection's experts in FP8: 4.3 GB at Flash shapes); the same FP8
  // operands and the same bits as the widened path's kernels gave in every test. kAuto with FP4
  // experts per chunk runs it for the chunks whose active experts average at most
  // kW4a8MaxMeanRows rows and widens the rest (keeping the scratch): at Flash's shapes it was
  // 1.01-1.03x the widened path's GEMMs at ~192 rows an expert (8K tokens) and 0.64x at ~768
  // (32K; RESULTS §43); the bound of 256 sits just above the measured win, unmeasured itself.
  // Not for bf16 weights.
  enum class ExpertGemm { kAuto, kGrouped, kPerExpert, kW4a8 };
  ExpertGemm expert_gemm = ExpertGemm::kAuto;
  static constexpr int64_t kGroupedMaxMeanRows = 384;
  static constexpr int64_t kW4a8MaxMeanRows = 256;
  // The W4A8 kernel's tile, weight rows by group rows (W4a8GroupedGemm::set_tile: 128x128,
  // 64x256, ...), for benches comparing tiles in the forward; 0 x 0: the kernel's choice per
  // launch. check_options refuses a tile the kernel is not built for.
  int w4a8_tile_m = 0, w4a8_tile_n = 0;
  // At most this many blocks a W4A8 launch, each taking tiles in turn
  // (W4a8GroupedGemm::set_max_blocks; e.g. the multiprocessor count), for benches; 0: a block a
  // tile.
  int64_t w4a8_max_blocks = 0;
  // The layers this engine holds and runs, [first_layer, end_layer) (end_layer -1: through the
  // last): a stage of a layer pipeline. Only the stage holding layer 0 holds the embedding and
  // takes prefill_chunk; a later stage runs prefill_stage from the previous stage's residual.
  // Taps carry the model's layer numbers. Random weights are the same values whichever range
  // holds a layer.
  int64_t first_layer = 0, end_layer = -1;
  // Device memory the engine's allocations (weights, state, scratch) may hold, in bytes; 0: no
  // budget beyond the device. An allocation past it fails as a cudaMalloc out of memory does.
  int64_t device_memory_budget_bytes = 0;
};

// "auto", "grouped", "per-expert" or "w4a8" (the --expert-gemm spelling) as a
// Dsv4CudaOptions::ExpertGemm.
Result<Dsv4CudaOptions::ExpertGemm> parse_expert_gemm(const std::string& name);

class Dsv4CudaEngine {
 public:
  // Each fails (a Status, nothing aborts) without a device, on options or shapes the kernels
  // cannot run (check_options), or when the weights do not fit (kResourceExhausted).
  static Result<std::unique_ptr<Dsv4CudaEngine>> load(const std::string& model_dir,
                                                      const Dsv4CudaOptions& options = {});
  static Result<std::unique_ptr<Dsv4CudaEngine>> create(const Dsv4Weights& weights,
                                                        const Dsv4CudaOptions& options = {});
  // Weights drawn on the device from a seed (for benchmarks at full layer shapes, where building
  // them on the host would take longer than the measurement): matrices ~ N(0, 1/in), norms ~ 1.
  static Result<std::unique_ptr<Dsv4CudaEngine>> random(const Dsv4Config& config, uint64_t seed,
                                                        const Dsv4CudaOptions& options = {});
  // Whether this device and model can run with these options and shapes.
  static Status check_options(const Dsv4Config& config, const Dsv4CudaOptions& options);
  ~Dsv4CudaEngine();
  Dsv4CudaEngine(const Dsv4CudaEngine&) = delete;
  Dsv4CudaEngine& operator=(const Dsv4CudaEngine&) = delete;

  const Dsv4Config& config() const { return config_; }
  const Dsv4CudaOptions& options() const { return options_; }
  // Forgets the sequence (once the device has finished its work; its errors are returned).
  Status reset();
  // Starts a sequence (reset()) and takes the memory one of `tokens` tokens run in chunks of at
  // most `max_chunk_tokens` needs (compressed rows, indexer and chunk scratch), so that its
  // chunks allocate nothing. kResourceExhausted (the bytes asked and free) when it does not fit
  // on the device or in the budget: the engine then holds no more than after reset(), and serves
  // the next request. failed_precondition for a prompt the indexer kernel cannot select over.
  Status reserve(int64_t tokens, int64_t max_chunk_tokens);
  int64_t cached_tokens() const { return n_cached_; }
  // As Dsv4CpuEngine::set_full_forward and set_decoder_calls (reset() and reserve() clear the
  // calls: set them after; after restore() they start at the checkpoint's end).
  Status set_full_forward(bool on);
  Status set_decoder_calls(const std::vector<int64_t>& calls);
  // The sequence's state after cached_tokens() tokens, copied to the host: the window's rows and
  // the compressors' pending and pooled rows of the layers this engine holds (what the decoder's
  // own cache holds, so the next chunk depends on nothing else). The prefill host keeps it to
  // resume a request that gave up its turn, or a later tail. Waits for the compute stream; null
  // when the copy failed (the reason goes to stderr).
  std::shared_ptr<const Checkpoint> checkpoint() const;
  int64_t checkpoint_bytes() const;  // what checkpoint() would hold now
  // After reserve() for the whole sequence: the checkpoint's state back on the device, as if
  // its tokens had run here. Refused for a checkpoint of another engine shape or layer range.
  Status restore(const Checkpoint& c);
  // Runs the next chunk (positions [cached_tokens(), +ids.size())); ids outside the vocabulary
  // are refused before anything changes. Returns once the chunk is enqueued (and, with host_tap,
  // each tap has run on its host copy); call synchronize() to wait for the device.
  Status prefill_chunk(const std::vector<int32_t>& ids, const AttentionInputTap& tap);
  // A pipeline stage's chunk: prefill_chunk for the layers this engine holds, starting from
  // h_in, the previous stage's residual() after the same chunk (bf16 [ids.size(), hc_mult,
  // hidden], on this engine's device, complete before the call (the caller orders the two
  // streams: an event or a synchronize) and left unchanged until stream() has copied it; null
  // for the stage holding layer 0). Every stage gets the chunk's ids (hash routing reads
  // them) and counts its positions itself.
  Status prefill_stage(const std::vector<int32_t>& ids, const uint16_t* h_in,
                       const AttentionInputTap& tap);
  // The residual after this engine's last layer for the last chunk (device, bf16 [n, hc_mult,
  // hidden]), valid until the next chunk; the next stage's h_in. Ordered on stream().
  const uint16_t* residual() const;
  // Waits for everything enqueued on the compute stream.
  Status synchronize();
  void* stream() const;  // the compute stream (cudaStream_t)
  // How the routed experts' GEMMs run: "W4A8 (...)", "grouped FP8 (CUTLASS)", "per-expert FP8
  // (cuBLASLt, N streams)" or "bf16 (cuBLAS...)".
  std::string expert_gemm_name() const;
  // How many routed-expert projections ran on the grouped FP8 kernel, and on the W4A8 one,
  // since the engine was made.
  int64_t grouped_expert_launches() const;
  int64_t w4a8_expert_launches() const;
  // With phase_timing: milliseconds of device time per phase since construction.
  std::vector<std::pair<std::string, double>> phase_ms() const;
  // Under WeightDtype::kCheckpoint: how many 32-element FP4 groups of the routed experts lost
  // low bits when widened to FP8 since the engine was made (their block's exponents span more
  // than 14; kernels/cuda/checkpoint_formats.h): per chunk, every widening counts again (the
  // active experts of every chunk); with widen_experts_at_load, each group once, at load. 0
  // otherwise. Waits for the compute stream.
  Result<int64_t> fp4_lossy_groups() const;
  // Bytes of device memory the weights take.
  int64_t weight_bytes() const { return weight_bytes_; }
  // Bytes of device memory the engine holds now (what counts against the budget).
  int64_t device_bytes() const;

  struct Impl;  // device weights, state and scratch (dsv4_cuda_impl.h)

 private:
  Dsv4CudaEngine(const Dsv4Config& config, const Dsv4CudaOptions& options);
  Status init();  // streams, handles and the weights' buffers
  Status upload(const Dsv4Weights& weights);
  // The official checkpoint's tensors, streamed (WeightDtype::kCheckpoint; dsv4_cuda_weights.cc).
  Status stream_checkpoint(const std::string& model_dir);
  Status fill_random(uint64_t seed);
  // Once the FP4 experts are on the device: widened (Dsv4CudaOptions::widen_experts_at_load),
  // or their block exponents computed where the W4A8 kernel may run them.
  Status finish_experts();
  Status widen_experts();
  Status size_scratch(int64_t n);
  void release_sequence_memory();

  Dsv4Config config_;
  Dsv4CudaOptions options_;
  std::unique_ptr<Impl> impl_;
  int64_t n_cached_ = 0;
  int64_t resumed_at_ = 0;  // where the sequence's first chunk (since reset/restore) begins
  int64_t weight_bytes_ = 0;
  bool full_forward_ = false;
};

}  // namespace hetero
