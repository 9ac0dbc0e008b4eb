// The prefill host's backend choice: a clear refusal for a backend that does not exist, and for
// the cuda backend where no GPU is usable (as on CI), before anything is loaded.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace hetero
