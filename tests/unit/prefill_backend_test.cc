// The prefill host's backend choice: a clear refusal for a backend that does not exist, and for
// the cuda backend where no GPU is usable (as on CI), before anything is loaded. --gpus, the
// layer pipeline's GPUs: parsed as a list, refused with a message where it cannot apply.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

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
