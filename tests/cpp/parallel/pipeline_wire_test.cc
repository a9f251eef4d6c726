// The runner's shape header and tensor specs.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "parallel/pipeline/internal/wire.h"

namespace strata::pipeline::internal {
namespace {

using ::testing::HasSubstr;

TEST(WireTest, SpecBasics) {
  const TensorSpec s{DataType::kBFloat16, {4, 16}};
  EXPECT_EQ(s.num_elements(), 64);
  EXPECT_EQ(s.num_bytes(), 128u);
  EXPECT_EQ(s.ToString(), "bf16[4, 16]");
  EXPECT_EQ((TensorSpec{DataType::kInt64, {}}).num_elements(), 1);  // a scalar
  const StageTensor t = StageTensor::Host(s);
  ASSERT_NE(t.data, nullptr);
  EXPECT_EQ(static_cast<const unsigned char*>(t.data)[127], 0);
  EXPECT_TRUE(CheckSpec({DataType::kFloat32, {0, 3}}).ok());
  EXPECT_THAT(CheckSpec({DataType::kFloat32, {1 << 30, 1 << 30}}).message(),
              HasSubstr("has more than 281474976710656 elements"));
}

TEST(WireTest, HeaderRoundTrip) {
  const std::vector<TensorSpec> specs = {{DataType::kFloat32, {2, 3}},
                                         {DataType::kInt64, {}},
                                         {DataType::kBool, {1, 2, 3, 4, 5, 6, 7, 8}}};
  absl::StatusOr<std::vector<TensorSpec>> back = DecodeHeader(EncodeHeader(specs));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, specs);
  EXPECT_EQ(SpecList(specs), "[fp32[2, 3], int64[], bool[1, 2, 3, 4, 5, 6, 7, 8]]");
}

TEST(WireTest, MalformedHeadersAreDataLoss) {
  const std::vector<int64_t> good = EncodeHeader({{DataType::kFloat32, {2}}});
  auto expect = [](std::vector<int64_t> h, const char* message) {
    absl::StatusOr<std::vector<TensorSpec>> r = DecodeHeader(h);
    ASSERT_FALSE(r.ok()) << message;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(r.status().message(), HasSubstr(message));
  };
  std::vector<int64_t> h = good;
  h[0] = 7;
  expect(h, "does not start with strata's magic number");
  expect(std::vector<int64_t>(3, kHeaderMagic), "does not start with strata's magic number");
  h = good;
  h[1] = 9;
  expect(h, "announces 9 tensors (want 1..8)");
  h = good;
  h[2] = 99;
  expect(h, "names dtype 99");
  h = good;
  h[3] = 9;
  expect(h, "announces 9 dims");
  h = good;
  h[4] = -1;
  expect(h, "has a negative dim");
}

}  // namespace
}  // namespace strata::pipeline::internal
