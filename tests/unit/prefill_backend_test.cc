// The prefill host's backend choice: a clear refusal for a backend that does not exist, and for
// the cuda backend where no GPU is usable (as on CI), before anything is loaded. --gpus, the
// layer pipeline's GPUs: parsed as a list, refused with a message where it cannot apply.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "engine/cuda/llama_cuda.h"
#include "kernels/cuda/cudnn_attention.h"
#include "prefill/backend_options.h"
#include "prefill/families.h"

namespace hetero {
namespace {

TEST(PrefillBackend, UnknownBackendIsRefusedByName) {
  PrefillBackend b;
  b.name = "tpu";
  auto s = load_prefill_stack("/nonexistent", "/nonexistent", b);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.status().code(), Code::kInvalidArgument);
  EXPECT_NE(s.status().message().find("'tpu'"), std::string::npos) << s.status().message();
}

TEST(PrefillBackend, CudaWithoutAGpuSaysSoFirst) {
  int n = 0;
  const bool gpu = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  PrefillBackend b;
  b.name = "cuda";
  auto s = load_prefill_stack("/nonexistent", "/nonexistent", b);
  ASSERT_FALSE(s.is_ok());
  if (gpu) {  // then the missing model is what it says
    EXPECT_EQ(s.status().message().find("CUDA device"), std::string::npos) << s.status().message();
  } else {
    EXPECT_EQ(s.status().code(), Code::kUnavailable);
    EXPECT_NE(s.status().message().find("CUDA device"), std::string::npos) << s.status().message();
  }
}

Result<PrefillBackendOptions> parse_backend(std::vector<std::string> args) {
  Options opts("prefill", "test", prefill_backend_specs());
  std::vector<char*> argv = {const_cast<char*>("prefill")};
  for (std::string& a : args) argv.push_back(a.data());
  HETERO_RETURN_IF_ERROR(opts.parse(static_cast<int>(argv.size()), argv.data()));
  return prefill_backend_from(opts);
}

// The fast llama engine's attention: bf16 cache and auto by default (cuDNN's where it can run),
// each choice by name, anything else refused; and where no GPU is usable (CI), cuDNN's attention
// refuses to start with a Status, never a crash.
TEST(PrefillBackend, AttentionKernelAndCacheDtype) {
  auto d = parse_backend({"--backend", "cuda", "--arith", "fast"});
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_EQ(d->backend.kv_dtype, "bf16");
  EXPECT_EQ(d->backend.attention, "auto");
  auto own = parse_backend({"--attention", "own", "--kv-dtype", "fp8"});
  ASSERT_TRUE(own.is_ok());
  EXPECT_EQ(own->backend.attention, "own");
  EXPECT_EQ(own->backend.kv_dtype, "fp8");
  EXPECT_FALSE(parse_backend({"--attention", "flash3"}).is_ok());
  EXPECT_EQ(*cuda::parse_attention_kernel("auto"), cuda::AttentionKernel::kAuto);
  EXPECT_EQ(*cuda::parse_attention_kernel("own"), cuda::AttentionKernel::kOwn);
  EXPECT_EQ(*cuda::parse_attention_kernel("cudnn"), cuda::AttentionKernel::kCudnn);
  EXPECT_EQ(cuda::parse_attention_kernel("sdpa").status().code(), Code::kInvalidArgument);

  auto runtime = cuda::cudnn_attention_runtime();
  if (cuda::cudnn_attention_built())
    EXPECT_TRUE(runtime.is_ok()) << "built with cuDNN, whose library loads here: "
                                 << runtime.status().to_string();
  else
    EXPECT_EQ(runtime.status().code(), Code::kUnavailable);
  std::printf("[ cuDNN attention: %s ]\n",
              runtime.is_ok() ? runtime->c_str() : runtime.status().message().c_str());
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    auto a = cuda::CudnnAttention::create(32, 8, 64, 0.125f, 0);
    EXPECT_FALSE(a.is_ok()) << "no GPU here";
  }
}

TEST(PrefillBackend, GpusNameThePipelinesStagesInOrder) {
  auto none = parse_backend({"--backend", "cuda"});
  ASSERT_TRUE(none.is_ok()) << none.status().to_string();
  EXPECT_TRUE(none->backend.gpus.empty());
  auto two = parse_backend({"--backend", "cuda", "--gpus", "1,0,0"});
  ASSERT_TRUE(two.is_ok()) << two.status().to_string();
  EXPECT_EQ(two->backend.gpus, (std::vector<int>{1, 0, 0}));
  for (const char* bad : {"0,", ",1", "0,,1", "a", "-1", "0;1", "1 "}) {
    auto r = parse_backend({"--backend", "cuda", "--gpus", bad});
    ASSERT_FALSE(r.is_ok()) << bad;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
    EXPECT_NE(r.status().message().find("--gpus"), std::string::npos) << r.status().message();
  }
  auto cpu = parse_backend({"--gpus", "0,1"});
  ASSERT_FALSE(cpu.is_ok());
  EXPECT_NE(cpu.status().message().find("--backend cuda"), std::string::npos);
  auto both = parse_backend({"--backend", "cuda", "--gpus", "0,1", "--device", "1"});
  ASSERT_FALSE(both.is_ok());
  EXPECT_NE(both.status().message().find("not both"), std::string::npos);
}

// --expert-widening: per-chunk by default; at-load only where there are FP4 experts to widen.
TEST(PrefillBackend, ExpertWideningAtLoadNeedsCheckpointWeightsOnCuda) {
  auto d = parse_backend({"--backend", "cuda", "--weight-dtype", "checkpoint"});
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_EQ(d->backend.expert_widening, "per-chunk");
  auto at = parse_backend(
      {"--backend", "cuda", "--weight-dtype", "checkpoint", "--expert-widening", "at-load"});
  ASSERT_TRUE(at.is_ok()) << at.status().to_string();
  EXPECT_EQ(at->backend.expert_widening, "at-load");
  for (const std::vector<std::string>& bad : std::vector<std::vector<std::string>>{
           {"--expert-widening", "at-load"},
           {"--backend", "cuda", "--expert-widening", "at-load"},
           {"--backend", "cuda", "--weight-dtype", "fp8", "--expert-widening", "at-load"},
           {"--backend", "cpu", "--weight-dtype", "checkpoint", "--expert-widening", "at-load"}}) {
    auto r = parse_backend(bad);
    ASSERT_FALSE(r.is_ok());
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
    EXPECT_NE(r.status().message().find("--weight-dtype checkpoint"), std::string::npos)
        << r.status().message();
  }
  EXPECT_FALSE(parse_backend({"--expert-widening", "never"}).is_ok());
}

// --expert-gemm: auto by default; a choice only where FP8 experts run on cuda.
TEST(PrefillBackend, ExpertGemmNeedsFp8ExpertsOnCuda) {
  auto d = parse_backend({"--backend", "cuda", "--weight-dtype", "checkpoint"});
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_EQ(d->backend.expert_gemm, "auto");
  for (const char* kind : {"grouped", "per-expert"}) {
    auto r = parse_backend({"--backend", "cuda", "--weight-dtype", "fp8", "--expert-gemm", kind});
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    EXPECT_EQ(r->backend.expert_gemm, kind);
  }
  auto w =
      parse_backend({"--backend", "cuda", "--weight-dtype", "checkpoint", "--expert-gemm", "w4a8"});
  ASSERT_TRUE(w.is_ok()) << w.status().to_string();
  EXPECT_EQ(w->backend.expert_gemm, "w4a8");
  for (const std::vector<std::string>& bad : std::vector<std::vector<std::string>>{
           {"--expert-gemm", "grouped"},
           {"--backend", "cuda", "--expert-gemm", "per-expert"},
           {"--backend", "cpu", "--weight-dtype", "checkpoint", "--expert-gemm", "grouped"},
           // w4a8 runs FP4 experts per chunk only
           {"--backend", "cuda", "--weight-dtype", "fp8", "--expert-gemm", "w4a8"},
           {"--backend", "cuda", "--weight-dtype", "checkpoint", "--expert-widening", "at-load",
            "--expert-gemm", "w4a8"}}) {
    auto r = parse_backend(bad);
    ASSERT_FALSE(r.is_ok());
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
    EXPECT_NE(r.status().message().find("--expert-gemm"), std::string::npos)
        << r.status().message();
  }
  EXPECT_FALSE(parse_backend({"--expert-gemm", "fastest"}).is_ok());
}

// Every flag a child prefill host gets carries --gpus as parsed, so `hetero up` passes it on.
TEST(PrefillBackend, GpusPassToTheChildHost) {
  Options opts("prefill", "test", prefill_backend_specs());
  std::vector<std::string> args = {"prefill", "--backend", "cuda", "--gpus", "0,1"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  ASSERT_TRUE(opts.parse(static_cast<int>(argv.size()), argv.data()).is_ok());
  const std::vector<std::string> flags = prefill_backend_flags(opts);
  auto at = std::find(flags.begin(), flags.end(), "--gpus");
  ASSERT_NE(at, flags.end());
  ASSERT_NE(at + 1, flags.end());
  EXPECT_EQ(*(at + 1), "0,1");
}

}  // namespace
}  // namespace hetero
