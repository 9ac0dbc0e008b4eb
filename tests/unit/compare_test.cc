// The comparison helper: exact by default, tolerances honoured, the worst element named.
#include "common/compare.h"

#include <gtest/gtest.h>

#include <cmath>

#include "common/bf16.h"

namespace hetero {
namespace {

Tensor bf16_of(std::vector<float> v) {
  Tensor t(DType::kBF16, {static_cast<int64_t>(v.size())});
  for (size_t i = 0; i < v.size(); ++i) t.data<uint16_t>()[i] = f32_to_bf16(v[i]);
  return t;
}

}  // namespace

TEST(Compare, IdenticalIsExact) {
  auto a = bf16_of({1, 2, 3});
  auto r = compare_tensors(a, a, CompareSpec{});
  EXPECT_TRUE(r.pass);
  EXPECT_EQ(r.max_ulp, 0);
  EXPECT_EQ(r.equal_fraction, 1.0);
}

TEST(Compare, OneUlpFailsExactAndPassesOneUlp) {
  auto a = bf16_of({1, 2, 3});
  auto b = a;
  b.data<uint16_t>()[1] += 1;
  auto exact = compare_tensors(b, a, CompareSpec{});
  EXPECT_FALSE(exact.pass);
  EXPECT_EQ(exact.max_ulp, 1);
  EXPECT_EQ(exact.worst_index, 1);
  EXPECT_NE(exact.message.find("index 1"), std::string::npos);
  EXPECT_TRUE(compare_tensors(b, a, CompareSpec{1, 0, -2, "test"}).pass);
}

TEST(Compare, UlpDistanceCrossesZero) {
  EXPECT_EQ(ulp_distance(bf16_to_f32(0x0001), bf16_to_f32(0x8001), DType::kBF16), 2);
}

TEST(Compare, ShapeDtypeAndNanMismatchesFail) {
  auto a = bf16_of({1, 2});
  auto b = bf16_of({1, 2, 3});
  EXPECT_FALSE(compare_tensors(a, b, CompareSpec{}).pass);
  auto n = bf16_of({1, std::nanf("")});
  EXPECT_FALSE(compare_tensors(n, a, CompareSpec{100, 100, -2, "t"}).pass);
  Tensor f(DType::kF32, {2});
  EXPECT_FALSE(compare_tensors(f, a, CompareSpec{}).pass);
}

TEST(Compare, CosineFloor) {
  auto a = bf16_of({1, 0});
  auto b = bf16_of({0, 1});
  EXPECT_FALSE(compare_tensors(a, b, CompareSpec{1 << 20, 10, 0.5, "t"}).pass);
}

}  // namespace hetero
