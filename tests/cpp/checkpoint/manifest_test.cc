// Manifest serialization, parsing and validation: every schema or meaning
// violation of an edited manifest is caught and named.
#include "strata/checkpoint/manifest.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>

#include "nlohmann/json.hpp"

namespace strata {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::ordered_json;

std::string Hex(char c, size_t n = 32) { return std::string(n, c); }

// Tensor "w" [4, 6] fp32 in two row shards in one file, and scalar "s".
Manifest Valid() {
  Manifest m;
  m.step = 42;
  m.created = "2025-01-01T00:00:00Z";
  m.library_version = "0.1.0";
  m.chunk_bytes = 4096;
  m.world_size = 2;
  m.mesh.world_size = 2;
  m.mesh.dp = 2;
  m.state.optimizer_step = 41;
  m.state.lr_schedule = R"({"last_epoch":41})";
  m.ranks = {RankState{0, {{"cpu", "abc"}}, R"({"i":1})"}, RankState{1, {}, ""}};
  m.files = {ManifestFile{"rank00000-000.safetensors", 0, 4096 + 96 + 4, Hex('a')}};
  ManifestTensor w;
  w.key = "w";
  w.shape = {4, 6};
  w.shards = {ManifestShard{{0, 0}, {2, 6}, 0, 4096, 4096 + 48, {Hex('1')}},
              ManifestShard{{2, 0}, {2, 6}, 0, 4096 + 48, 4096 + 96, {Hex('2')}}};
  ManifestTensor s;
  s.key = "s";
  s.dtype = DataType::kInt32;
  s.shards = {ManifestShard{{}, {}, 0, 4096 + 96, 4096 + 100, {Hex('3')}}};
  m.tensors = {s, w};  // sorted by key
  return m;
}

Json ValidJson() {
  absl::StatusOr<std::string> text = SerializeManifest(Valid());
  EXPECT_TRUE(text.ok()) << text.status();
  return Json::parse(*text);
}

TEST(ManifestTest, RoundTrips) {
  const Manifest m = Valid();
  absl::StatusOr<std::string> text = SerializeManifest(m);
  ASSERT_TRUE(text.ok()) << text.status();
  absl::StatusOr<Manifest> back = ParseManifest(*text);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->step, 42);
  EXPECT_EQ(back->world_size, 2);
  EXPECT_EQ(back->mesh.dp, 2);
  EXPECT_EQ(back->state.optimizer_step, 41);
  EXPECT_EQ(back->state.lr_schedule, m.state.lr_schedule);
  ASSERT_EQ(back->tensors.size(), 2u);
  EXPECT_EQ(back->FindTensor("w")->shards[1].begin, 4096u + 48);
  EXPECT_EQ(back->FindTensor("nope"), nullptr);
  EXPECT_EQ(back->StateForRank(0).rng_states.at("cpu"), "abc");
  EXPECT_EQ(back->StateForRank(0).data_loader, R"({"i":1})");
  EXPECT_EQ(back->StateForRank(1).step, 42);
  EXPECT_EQ(*SerializeManifest(*back), *text);  // deterministic
}

struct Edit {
  std::string what;
  std::function<void(Json&)> edit;
  std::string message;
  absl::StatusCode code = absl::StatusCode::kDataLoss;
};

TEST(ManifestTest, EveryEditIsDetected) {
  const std::vector<Edit> edits = {
      {"format", [](Json& j) { j["format"] = "pytorch"; }, "format 'pytorch'"},
      {"newer version", [](Json& j) { j["version"] = 2; }, "newer strata",
       absl::StatusCode::kUnimplemented},
      {"version 0", [](Json& j) { j["version"] = 0; }, "manifest.version is 0"},
      {"missing step", [](Json& j) { j.erase("step"); }, "manifest.step is missing"},
      {"step type", [](Json& j) { j["step"] = "42"; }, "not an integer"},
      {"unknown field", [](Json& j) { j["extra_field"] = 1; }, "unknown field 'extra_field'"},
      {"algorithm", [](Json& j) { j["checksum"]["algorithm"] = "md5"; },
       "unknown checksum algorithm 'md5'"},
      {"chunk size", [](Json& j) { j["checksum"]["chunk_bytes"] = 10; }, "chunk_bytes 10"},
      {"world size", [](Json& j) { j["world_size"] = 0; }, "world_size 0"},
      {"mesh version", [](Json& j) { j["mesh"]["version"] = 9; }, "mesh version 9",
       absl::StatusCode::kUnimplemented},
      {"mesh size", [](Json& j) { j["mesh"]["tp"] = 0; }, "mesh has a size out of range"},
      {"state step", [](Json& j) { j["state"]["step"] = 7; }, "state.step is 7"},
      {"state version", [](Json& j) { j["state"]["version"] = 5; }, "state version 5",
       absl::StatusCode::kUnimplemented},
      {"rng base64", [](Json& j) { j["ranks"][0]["rng_states"]["cpu"] = "!!"; },
       "not a base64 string"},
      {"rank twice", [](Json& j) { j["ranks"][1]["rank"] = 0; }, "rank 0 has two rank states"},
      {"rank range", [](Json& j) { j["ranks"][1]["rank"] = 5; }, "rank state for rank 5"},
      {"path escape", [](Json& j) { j["files"][0]["name"] = "../../etc/passwd"; },
       "not a plain file name"},
      {"hidden file", [](Json& j) { j["files"][0]["name"] = ".x"; }, "not a plain file name"},
      {"manifest as data", [](Json& j) { j["files"][0]["name"] = "manifest.json"; },
       "not a plain file name"},
      {"file checksum", [](Json& j) { j["files"][0]["checksum"] = "abc"; },
       "not 32 lowercase hex digits"},
      {"file rank", [](Json& j) { j["files"][0]["rank"] = 2; }, "rank 2 outside [0, 2)"},
      {"file size", [](Json& j) { j["files"][0]["size"] = 4100; }, "outside the data of"},
      {"file twice", [](Json& j) { j["files"].push_back(j["files"][0]); }, "listed twice"},
      {"shard file", [](Json& j) { j["tensors"][1]["shards"][0]["file"] = 3; },
       "names file 3 of 1"},
      {"byte range", [](Json& j) { j["tensors"][1]["shards"][0]["byte_range"][1] = 4096 + 40; },
       "is 48 bytes"},
      {"header bytes",
       [](Json& j) {
         j["tensors"][0]["shards"][0]["byte_range"] = {0, 4};
       },
       "outside the data"},
      {"shared bytes",
       [](Json& j) {
         j["tensors"][0]["shards"][0]["byte_range"] = {4096, 4100};
       },
       "share bytes"},
      {"overlap",
       [](Json& j) {
         j["tensors"][1]["shards"][1]["offset"] = {1, 0};
       },
       "overlap"},
      {"coverage",
       [](Json& j) {
         j["tensors"][1]["shape"] = {5, 6};
       },
       "has 30 elements but its shards cover 24"},
      {"out of bounds",
       [](Json& j) {
         j["tensors"][1]["shards"][1]["offset"] = {3, 0};
       },
       "extends past the global shape"},
      {"chunk count",
       [](Json& j) { j["tensors"][1]["shards"][0]["chunk_checksums"].push_back(Hex('1')); },
       "2 chunk checksums"},
      {"chunk digest",
       [](Json& j) { j["tensors"][1]["shards"][0]["chunk_checksums"][0] = Hex('G'); },
       "lowercase hex"},
      {"unsorted", [](Json& j) { std::swap(j["tensors"][0], j["tensors"][1]); }, "not sorted"},
      {"dtype", [](Json& j) { j["tensors"][1]["dtype"] = "Q7"; }, "'Q7' is not one strata reads"},
      {"dims",
       [](Json& j) {
         j["tensors"][1]["shape"] = {4, -6};
       },
       "negative"},
      {"shard field", [](Json& j) { j["tensors"][1]["shards"][0]["crc"] = 1; },
       "unknown field 'crc'"},
      {"tensor type", [](Json& j) { j["tensors"][0] = 3; }, "tensors[0] is not an object"},
  };
  for (const Edit& e : edits) {
    Json j = ValidJson();
    e.edit(j);
    absl::StatusOr<Manifest> m = ParseManifest(j.dump(), "manifest.json");
    EXPECT_EQ(m.status().code(), e.code) << e.what << ": " << m.status();
    EXPECT_THAT(m.status().message(), HasSubstr(e.message)) << e.what;
  }
}

TEST(ManifestTest, HostileTextIsBounded) {
  EXPECT_THAT(ParseManifest("{not json").status().message(), HasSubstr("not valid JSON"));
  EXPECT_THAT(ParseManifest("[]").status().message(), HasSubstr("not a JSON object"));
  EXPECT_THAT(ParseManifest(std::string(100000, '[')).status().message(), HasSubstr("deeper than"));
  ManifestLimits small;
  small.max_bytes = 100;
  EXPECT_THAT(ParseManifest(ValidJson().dump(), "m", small).status().message(),
              HasSubstr("more than the limit of 100"));
  // JSON text in the state may nest, but not without bound.
  Json j = ValidJson();
  Json deep = Json::array();
  for (int i = 0; i < 200; ++i) deep = Json::array({deep});
  j["state"]["extra"] = deep;
  EXPECT_THAT(ParseManifest(j.dump()).status().message(), HasSubstr("deeper than"));
}

TEST(ManifestTest, SerializeRefusesAnInvalidManifest) {
  Manifest m = Valid();
  m.tensors[1].shards.pop_back();
  EXPECT_THAT(SerializeManifest(m).status().message(), HasSubstr("shards cover 12"));
  m = Valid();
  m.state.extra = "{oops";
  EXPECT_EQ(SerializeManifest(m).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ManifestTest, SafeFileNames) {
  EXPECT_TRUE(IsSafeFileName("rank00001-002.safetensors"));
  for (const char* bad : {"", ".", "..", "a/b", "/abs", ".hidden", "a b", "x\n"}) {
    EXPECT_FALSE(IsSafeFileName(bad)) << bad;
  }
  EXPECT_FALSE(IsSafeFileName(std::string(256, 'a')));
}

}  // namespace
}  // namespace strata
