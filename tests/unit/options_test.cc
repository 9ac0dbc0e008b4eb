// Option tables: flags override env, env overrides defaults, unknown flags are errors.
#include "common/options.h"

#include <gtest/gtest.h>

#include <cstdlib>

namespace hetero {

TEST(Options, PrecedenceFlagEnvDefault) {
  setenv("HETERO_TEST_CHUNK", "77", 1);
  Options o("t", "test",
            {{"chunk", "HETERO_TEST_CHUNK", "512", "chunk"},
             {"port", "", "8010", "port"},
             {"quiet", "", "", "quiet", true}});
  const char* argv[] = {"--port=9", "--quiet"};
  ASSERT_TRUE(o.parse(2, const_cast<char**>(argv)).is_ok());
  EXPECT_EQ(o.get_int("chunk").value(), 77);
  EXPECT_EQ(o.get_int("port").value(), 9);
  EXPECT_TRUE(o.get_bool("quiet"));
  unsetenv("HETERO_TEST_CHUNK");
}

TEST(Options, UnknownAndMissingValuesAreErrors) {
  Options o("t", "test", {{"chunk", "", "512", "chunk"}});
  const char* bad[] = {"--nope"};
  EXPECT_FALSE(o.parse(1, const_cast<char**>(bad)).is_ok());
  const char* missing[] = {"--chunk"};
  Options o2("t", "test", {{"chunk", "", "512", "chunk"}});
  EXPECT_FALSE(o2.parse(1, const_cast<char**>(missing)).is_ok());
  const char* notint[] = {"--chunk", "x"};
  Options o3("t", "test", {{"chunk", "", "512", "chunk"}});
  ASSERT_TRUE(o3.parse(2, const_cast<char**>(notint)).is_ok());
  EXPECT_FALSE(o3.get_int("chunk").is_ok());
}

}  // namespace hetero
