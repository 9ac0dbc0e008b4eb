// safetensors: round trip, and every malformed file refused with a message (never a crash).
#include "common/safetensors.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace hetero {
namespace fs = std::filesystem;

namespace {
std::string tmp_path(const std::string& name) {
  return (fs::temp_directory_path() / ("hetero_st_" + std::to_string(::getpid()) + name)).string();
}
void write_raw(const std::string& path, const std::string& header, const std::string& data) {
  std::ofstream o(path, std::ios::binary);
  uint64_t n = header.size();
  o.write(reinterpret_cast<const char*>(&n), 8);
  o << header << data;
}
}  // namespace

TEST(Safetensors, RoundTrip) {
  TensorMap m;
  Tensor a(DType::kBF16, {2, 3});
  for (int i = 0; i < 6; ++i) a.data<uint16_t>()[i] = static_cast<uint16_t>(0x3f80 + i);
  Tensor b(DType::kF32, {4});
  for (int i = 0; i < 4; ++i) b.data<float>()[i] = 0.5f * i;
  m["a"] = a;
  m["b.c"] = b;
  const auto p = tmp_path("rt.safetensors");
  ASSERT_TRUE(write_safetensors(p, m, {{"k", "v"}}).is_ok());
  auto r = read_safetensors(p);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->metadata.at("k"), "v");
  EXPECT_EQ(r->tensors.at("a").bytes, a.bytes);
  EXPECT_EQ(r->tensors.at("a").shape, a.shape);
  EXPECT_EQ(r->tensors.at("b.c").bytes, b.bytes);
  fs::remove(p);
}

TEST(Safetensors, MalformedFilesAreRefused) {
  const auto p = tmp_path("bad.safetensors");
  write_raw(p, "not json", "");
  EXPECT_FALSE(read_safetensors(p).is_ok());
  write_raw(p, R"({"x":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]}})", "abc");
  auto r = read_safetensors(p);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("'x'"), std::string::npos);
  write_raw(p, R"({"x":{"dtype":"Q9","shape":[1],"data_offsets":[0,1]}})", "a");
  EXPECT_FALSE(read_safetensors(p).is_ok());
  write_raw(p, R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "abcd");
  EXPECT_FALSE(read_safetensors(p).is_ok());  // size does not match the shape
  EXPECT_EQ(read_safetensors(p + ".missing").status().code(), Code::kNotFound);
  fs::remove(p);
}

TEST(Safetensors, HostileHeadersAreRefusedNotTrusted) {
  // Regression (hardening issue): negative dims and element counts that overflow were accepted
  // (-2 x -4 bf16 elements "fit" 16 bytes); a dtype that is no string threw.
  const auto p = tmp_path("hostile.safetensors");
  const std::vector<std::string> headers = {
      R"({"x":{"dtype":"BF16","shape":[-2,-4],"data_offsets":[0,16]}})",
      R"({"x":{"dtype":"BF16","shape":[4611686018427387904,4],"data_offsets":[0,0]}})",
      R"({"x":{"dtype":7,"shape":[1],"data_offsets":[0,2]}})",
      R"({"x":{"dtype":"BF16","shape":["a"],"data_offsets":[0,2]}})",
      R"({"x":{"dtype":"BF16","shape":[1],"data_offsets":[0]}})",
      R"({"x":{"dtype":"BF16","shape":[1],"data_offsets":["0","2"]}})",
      std::string(200, '[') + std::string(200, ']'),
  };
  for (const std::string& h : headers) {
    write_raw(p, h, std::string(16, 'a'));
    auto r = read_safetensors(p);
    EXPECT_FALSE(r.is_ok()) << h;
    EXPECT_EQ(r.status().code(), Code::kDataLoss) << h << ": " << r.status().to_string();
  }
  fs::remove(p);
}

}  // namespace hetero
