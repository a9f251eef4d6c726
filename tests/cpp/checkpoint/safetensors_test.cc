// The safetensors header writer and the hardened parser.
#include "strata/checkpoint/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace strata {
namespace {

using ::testing::HasSubstr;

std::string Prefix(uint64_t n) {
  std::string p(8, '\0');
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return p;
}

// A file made of a JSON header and `data_bytes` zero bytes of data.
std::string FileWith(const std::string& json, uint64_t data_bytes) {
  return Prefix(json.size()) + json + std::string(data_bytes, '\0');
}

absl::Status Parse(const std::string& file) { return ParseSafetensors(file, file.size()).status(); }

TEST(SafetensorsTest, BuildsAndParsesBack) {
  std::vector<SafetensorsEntry> entries = {{"b.int8", DataType::kInt8, {3}, 0, 0},
                                           {"a.f64", DataType::kFloat64, {2, 2}, 0, 0},
                                           {"c.bf16", DataType::kBFloat16, {5}, 0, 0},
                                           {"s", DataType::kFloat32, {}, 0, 0},
                                           {"z", DataType::kInt32, {0, 7}, 0, 0}};
  absl::StatusOr<SafetensorsLayout> l = BuildSafetensorsHeader(entries, {{"format", "pt"}});
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->header.data_start % 4096, 0u);
  EXPECT_EQ(l->bytes.size(), l->header.data_start);
  EXPECT_EQ(l->header.data_bytes, 32u + 4 + 0 + 10 + 3);
  // Larger elements first, so every tensor is aligned to its element size.
  for (const SafetensorsEntry& e : l->header.entries) {
    EXPECT_EQ(e.begin % DataTypeSize(e.dtype), 0u) << e.name;
  }
  EXPECT_EQ(l->header.entries[0].name, "a.f64");
  EXPECT_EQ(l->header.entries.back().name, "b.int8");
  const std::string file = l->bytes + std::string(l->header.data_bytes, '\0');
  absl::StatusOr<SafetensorsHeader> h = ParseSafetensors(file, file.size());
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_EQ(h->entries.size(), 5u);
  EXPECT_EQ(h->data_start, l->header.data_start);
  ASSERT_NE(h->Find("c.bf16"), nullptr);
  EXPECT_EQ(h->Find("c.bf16")->dtype, DataType::kBFloat16);
  EXPECT_EQ(h->Find("z")->shape, (std::vector<int64_t>{0, 7}));
  EXPECT_EQ(h->Find("s")->end - h->Find("s")->begin, 4u);
  EXPECT_THAT(h->metadata,
              ::testing::ElementsAre(std::make_pair(std::string("format"), std::string("pt"))));
}

TEST(SafetensorsTest, AcceptsHeadersOfOtherWriters) {
  // Unpadded, metadata absent, keys in any order, exponent-free integers.
  const std::string json =
      R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[2,10]},"b":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})";
  absl::StatusOr<SafetensorsHeader> h = ParseSafetensors(FileWith(json, 10), json.size() + 18);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->entries[0].name, "b");
  EXPECT_TRUE(Parse(FileWith(R"({})", 0)).ok());
}

TEST(SafetensorsTest, RejectsBuildMistakes) {
  EXPECT_THAT(BuildSafetensorsHeader(
                  {{"x", DataType::kInt8, {1}, 0, 0}, {"x", DataType::kInt8, {1}, 0, 0}}, {})
                  .status()
                  .message(),
              HasSubstr("appears twice"));
  EXPECT_THAT(
      BuildSafetensorsHeader({{"__metadata__", DataType::kInt8, {1}, 0, 0}}, {}).status().message(),
      HasSubstr("reserved"));
  EXPECT_THAT(BuildSafetensorsHeader({{"x", DataType::kInt8, {-1}, 0, 0}}, {}).status().message(),
              HasSubstr("negative"));
  EXPECT_THAT(BuildSafetensorsHeader({}, {}, SafetensorsWriteOptions{12}).status().message(),
              HasSubstr("power of two"));
}

// Each hostile input gets a DataLoss error that says what is wrong.
TEST(SafetensorsTest, RejectsHostileFiles) {
  const std::string ok_json = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  struct Case {
    std::string file;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"", "shorter than the 8-byte"},
      {"\x01\x02", "shorter than the 8-byte"},
      {Prefix(uint64_t{1} << 40) + "{}", "exceeds the limit"},
      {Prefix(1000) + "{}", "runs past the end"},
      {Prefix(~uint64_t{0}) + "{}", "exceeds the limit"},
      {FileWith("[1,2]", 0), "does not start with '{'"},
      {FileWith("{", 0), "too short"},
      {FileWith("{\"a\":", 0), "not valid JSON"},
      {FileWith("{\"w\":[[[[[[1]]]]]]}", 0), "deeper than 3"},
      {FileWith(R"({"w":1})", 0), "is not an object"},
      {FileWith(R"({"w":{"dtype":"F32","shape":[2]}})", 8), "data_offsets is missing"},
      {FileWith(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", 8),
       "unknown field 'x'"},
      {FileWith(R"({"w":{"dtype":"U16","shape":[2],"data_offsets":[0,4]}})", 4),
       "'U16' is not one strata reads"},
      {FileWith(R"({"w":{"dtype":3,"shape":[2],"data_offsets":[0,8]}})", 8), "not a string"},
      {FileWith(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8), "negative"},
      {FileWith(R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8),
       "not an integer"},
      {FileWith(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8), "not 2"},
      {FileWith(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8), "begin after end"},
      {FileWith(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,-8]}})", 8), "non-negative"},
      {FileWith(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", 8), "past the end"},
      {FileWith(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "= 12 bytes"},
      {FileWith(R"({"w":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8),
       "overflows"},
      {FileWith(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12), "hole"},
      {FileWith(
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
           12),
       "overlap"},
      {FileWith(ok_json, 9), "trailing bytes"},
      {FileWith(R"({"__metadata__":{"k":1}})", 0), "not a string"},
      {FileWith(R"({"__metadata__":[]})", 0), "not an object"},
      {FileWith("{\"w\xff\":{}}", 0), "not valid JSON"},
  };
  for (const Case& c : cases) {
    absl::Status s = Parse(c.file);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << c.message << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(c.message));
  }
  EXPECT_TRUE(Parse(FileWith(ok_json, 8)).ok());
  // A header over the configured limit is refused before it is read.
  SafetensorsLimits small;
  small.max_header_bytes = 16;
  EXPECT_THAT(ParseSafetensors(FileWith(ok_json, 8), ok_json.size() + 16, small).status().message(),
              HasSubstr("exceeds the limit of 16"));
}

TEST(SafetensorsTest, DataTypeNames) {
  for (DataType t : kAllDataTypes)
    EXPECT_EQ(*ParseSafetensorsDataType(DataTypeSafetensorsName(t)), t);
  EXPECT_FALSE(ParseSafetensorsDataType("F8_E4M3").ok());
  EXPECT_FALSE(ParseSafetensorsDataType("f32").ok());
}

}  // namespace
}  // namespace strata
