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

TEST(Options, ChoicesAreCheckedAtParseTimeFromFlagsAndEnv) {
  auto make = [] {
    return Options("t", "test",
                   {{"backend", "HETERO_TEST_BACKEND", "cpu", "b", false, {"cpu", "cuda"}}});
  };
  Options ok = make();
  const char* cuda[] = {"--backend", "cuda"};
  ASSERT_TRUE(ok.parse(2, const_cast<char**>(cuda)).is_ok());
  EXPECT_EQ(ok.get("backend"), "cuda");
  Options bad = make();
  const char* gpu[] = {"--backend=gpu"};
  Status st = bad.parse(1, const_cast<char**>(gpu));
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("must be cpu or cuda, got 'gpu'"), std::string::npos) << st.message();
  setenv("HETERO_TEST_BACKEND", "tpu", 1);
  Options env = make();
  EXPECT_FALSE(env.parse(0, nullptr).is_ok());
  unsetenv("HETERO_TEST_BACKEND");
  EXPECT_NE(make().help_text().find("{cpu or cuda}"), std::string::npos);
}

}  // namespace hetero
