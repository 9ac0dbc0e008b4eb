// Host memory and byte counts for messages (common/sysmem.h).
#include "common/sysmem.h"

#include <gtest/gtest.h>

namespace hetero {
namespace {

TEST(Sysmem, BytesReadAsBinaryUnits) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1024), "1.0 KiB");
  EXPECT_EQ(format_bytes(int64_t{3} << 20), "3.0 MiB");
  EXPECT_EQ(format_bytes(static_cast<int64_t>(12.3 * (int64_t{1} << 30))), "12.3 GiB");
  EXPECT_EQ(format_bytes(int64_t{1} << 60), "1.0 EiB");
}

TEST(Sysmem, TheHostHasSomeMemoryLeftAndNotMoreThanItHas) {
  const int64_t available = host_available_bytes();
  EXPECT_GT(available, int64_t{64} << 20);
  EXPECT_LT(available, int64_t{1} << 50);
}

}  // namespace
}  // namespace hetero
