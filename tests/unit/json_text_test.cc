// Untrusted JSON (common/json_text.h): the nesting limit is checked before parsing.
#include "common/json_text.h"

#include <gtest/gtest.h>

#include <string>

namespace hetero {
namespace {

TEST(JsonText, DepthCountsArraysAndObjectsNotStrings) {
  EXPECT_EQ(json_depth("1"), 0);
  EXPECT_EQ(json_depth(R"({"a": [1, {"b": []}]})"), 4);
  EXPECT_EQ(json_depth(R"({"a": "[[[[{{{{\"]]"})"), 1);  // brackets in strings do not count
}

TEST(JsonText, DeepNestingIsRefusedBeforeParsing) {
  // Regression (hardening issue): 100k levels in 200 KB crashed the front door.
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  auto r = parse_untrusted_json(deep);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_NE(r.status().message().find("deeper than 64"), std::string::npos);
  const std::string ok = std::string(64, '[') + std::string(64, ']');
  EXPECT_TRUE(parse_untrusted_json(ok).is_ok());
  EXPECT_FALSE(parse_untrusted_json("{not json").is_ok());
}

}  // namespace
}  // namespace hetero
