// Loading: the errors a user can cause or a damaged checkpoint produces,
// each naming what is wrong; partial reads; full verification.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "checkpoint/internal/file_util.h"
#include "nlohmann/json.hpp"
#include "strata/checkpoint/checkpointer.h"
#include "strata/checkpoint/loader.h"
#include "strata/checkpoint/safetensors.h"
#include "test_util.h"

namespace strata {
namespace {

using ::testing::HasSubstr;
using testing_util::RandomBytes;
using testing_util::ScratchDir;
using testing_util::Soon;

// A committed checkpoint of step 5 with tensors "a" [64, 1024] fp32 and
// "b" [10] int64, chunked in 4 KiB, in `dir`.
class LoadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    a_ = RandomBytes(64 * 1024 * 4, 1);
    b_ = RandomBytes(10 * 8, 2);
    CheckpointOptions o;
    o.directory = dir_.path();
    o.chunk_bytes = 4096;
    auto ckpt = Checkpointer::Create(o);
    ASSERT_TRUE(ckpt.ok());
    SaveRequest r;
    r.step = 5;
    r.tensors.push_back({A(), a_.data()});
    r.tensors.push_back({B(), b_.data()});
    ASSERT_TRUE((*ckpt)->Save(r).ok());
    ASSERT_TRUE((*ckpt)->Wait(Soon()).ok());
  }

  static ShardedTensor A() { return ShardedTensor::Whole("a", DataType::kFloat32, {64, 1024}); }
  static ShardedTensor B() { return ShardedTensor::Whole("b", DataType::kInt64, {10}); }

  std::string File() const { return dir_ / "step-5/rank00000-000.safetensors"; }
  std::string ManifestPath() const { return dir_ / "step-5/manifest.json"; }

  LoadOptions Options() const {
    LoadOptions lo;
    lo.directory = dir_.path();
    return lo;
  }

  // Opens and loads both tensors whole.
  absl::Status LoadBoth(const LoadOptions& lo) {
    absl::StatusOr<std::unique_ptr<CheckpointReader>> r = CheckpointReader::Open(lo);
    if (!r.ok()) return r.status();
    std::vector<uint8_t> a(a_.size()), b(b_.size());
    absl::StatusOr<LoadReport> rep =
        (*r)->Load({TensorTarget{A(), a.data()}, TensorTarget{B(), b.data()}});
    if (!rep.ok()) return rep.status();
    EXPECT_EQ(b, b_);
    if (lo.verify == ChecksumVerification::kVerify) EXPECT_EQ(a, a_);
    return absl::OkStatus();
  }

  ScratchDir dir_;
  std::vector<uint8_t> a_, b_;
};

TEST_F(LoadTest, LoadsAndReportsWhatItRead) {
  absl::StatusOr<std::unique_ptr<CheckpointReader>> r = CheckpointReader::Open(Options());
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<uint8_t> a(a_.size()), b(b_.size());
  absl::StatusOr<LoadReport> rep =
      (*r)->Load({TensorTarget{A(), a.data()}, TensorTarget{B(), b.data()}});
  ASSERT_TRUE(rep.ok()) << rep.status();
  EXPECT_EQ(a, a_);
  EXPECT_EQ(b, b_);
  EXPECT_EQ(rep->step, 5);
  EXPECT_EQ(rep->bytes_read, a_.size() + b_.size());
  EXPECT_EQ(rep->bytes_verified, rep->bytes_read);
  EXPECT_EQ(rep->files_opened, 1);
}

// A rank that needs rows 16..31 reads those bytes and no others.
TEST_F(LoadTest, ReadsOnlyTheBytesItNeeds) {
  for (ChecksumVerification v : {ChecksumVerification::kVerify, ChecksumVerification::kSkip}) {
    LoadOptions lo = Options();
    lo.verify = v;
    lo.matching = KeyMatching::kLenient;
    auto r = CheckpointReader::Open(lo);
    ASSERT_TRUE(r.ok());
    ShardedTensor want = A();
    want.global_offset = {16, 0};
    want.local_shape = {16, 1024};
    std::vector<uint8_t> got(16 * 4096);
    auto rep = (*r)->Load({TensorTarget{want, got.data()}});
    ASSERT_TRUE(rep.ok()) << rep.status();
    EXPECT_EQ(rep->bytes_read, 16u * 4096);
    EXPECT_TRUE(std::equal(got.begin(), got.end(), a_.begin() + 16 * 4096));
    EXPECT_THAT(rep->unexpected, ::testing::ElementsAre("b"));
  }
  // Columns 0..255 of every row: without verification only the rows'
  // pieces and the gaps between them that are cheaper to read than to skip.
  LoadOptions lo = Options();
  lo.verify = ChecksumVerification::kSkip;
  lo.matching = KeyMatching::kLenient;
  lo.merge_gap_bytes = 0;
  auto r = CheckpointReader::Open(lo);
  ShardedTensor cols = A();
  cols.local_shape = {64, 256};
  std::vector<uint8_t> got(64 * 256 * 4);
  auto rep = (*r)->Load({TensorTarget{cols, got.data()}});
  ASSERT_TRUE(rep.ok()) << rep.status();
  EXPECT_EQ(rep->bytes_read, got.size());
  for (int row = 0; row < 64; ++row) {
    ASSERT_TRUE(std::equal(got.begin() + row * 1024, got.begin() + (row + 1) * 1024,
                           a_.begin() + row * 4096));
  }
}

TEST_F(LoadTest, NoCommittedCheckpoint) {
  ScratchDir empty;
  LoadOptions lo;
  lo.directory = empty.path();
  absl::Status s = CheckpointReader::Open(lo).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("no committed checkpoint"));
  lo.directory = empty / "nope";
  s = CheckpointReader::Open(lo).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("does not exist"));
  LoadOptions missing = Options();
  missing.step = 99;
  s = CheckpointReader::Open(missing).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("step 99 does not exist"));
  EXPECT_THAT(s.message(), HasSubstr("complete steps: 5"));
}

TEST_F(LoadTest, ShapeAndDtypeMismatchesNameTheKey) {
  auto r = CheckpointReader::Open(Options());
  ASSERT_TRUE(r.ok());
  std::vector<uint8_t> buf(a_.size() * 2);
  ShardedTensor wrong_shape = ShardedTensor::Whole("a", DataType::kFloat32, {32, 2048});
  absl::Status s =
      (*r)->Load({TensorTarget{wrong_shape, buf.data()}, TensorTarget{B(), buf.data()}}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tensor 'a': shape mismatch"));
  EXPECT_THAT(s.message(), HasSubstr("[64, 1024]"));
  EXPECT_THAT(s.message(), HasSubstr("[32, 2048]"));
  ShardedTensor wrong_dtype = ShardedTensor::Whole("a", DataType::kBFloat16, {64, 1024});
  s = (*r)->Load({TensorTarget{wrong_dtype, buf.data()}, TensorTarget{B(), buf.data()}}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tensor 'a': dtype mismatch"));
  EXPECT_THAT(s.message(), HasSubstr("fp32"));
  EXPECT_THAT(s.message(), HasSubstr("bf16"));
}

TEST_F(LoadTest, MissingAndUnexpectedTensors) {
  std::vector<uint8_t> a(a_.size()), c(16);
  const TensorTarget ta{A(), a.data()};
  const TensorTarget tc{ShardedTensor::Whole("c", DataType::kInt32, {4}), c.data()};
  auto strict = CheckpointReader::Open(Options());
  absl::Status s = (*strict)->Load({ta, tc}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("missing from checkpoint step 5"));
  EXPECT_THAT(s.message(), HasSubstr("'c'"));
  s = (*strict)->Load({ta}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("nothing asked for: 'b'"));

  LoadOptions lo = Options();
  lo.matching = KeyMatching::kLenient;
  auto lenient = CheckpointReader::Open(lo);
  auto rep = (*lenient)->Load({ta, tc});
  ASSERT_TRUE(rep.ok()) << rep.status();
  EXPECT_THAT(rep->missing, ::testing::ElementsAre("c"));
  EXPECT_THAT(rep->unexpected, ::testing::ElementsAre("b"));
  EXPECT_EQ(a, a_);
}

TEST_F(LoadTest, BadTargets) {
  auto r = CheckpointReader::Open(Options());
  std::vector<uint8_t> a(a_.size()), b(b_.size());
  absl::Status s = (*r)->Load({TensorTarget{A(), nullptr}, TensorTarget{B(), b.data()}}).status();
  EXPECT_THAT(s.message(), HasSubstr("'a' has no destination buffer"));
  s = (*r)->Load({TensorTarget{A(), a.data()}, TensorTarget{A(), a.data()}}).status();
  EXPECT_THAT(s.message(), HasSubstr("'a' is asked for twice"));
  LoadOptions lo = Options();
  lo.read_buffer_bytes = 10;
  EXPECT_THAT(CheckpointReader::Open(lo).status().message(), HasSubstr("read_buffer_bytes 10"));
}

TEST_F(LoadTest, FlippedByteIsDetectedAndNamed) {
  testing_util::FlipByte(File(), 4096 + 100000);  // inside tensor "a"
  absl::Status s = LoadBoth(Options());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("checksum mismatch in '" + File() + "'"));
  EXPECT_THAT(s.message(), HasSubstr("tensor 'a'"));
  // Verification off: the load succeeds (and the bytes are wrong).
  LoadOptions lo = Options();
  lo.verify = ChecksumVerification::kSkip;
  EXPECT_TRUE(LoadBoth(lo).ok());
  auto r = CheckpointReader::Open(Options());
  VerifyReport v = VerifyCheckpoint((*r)->step_directory(), (*r)->manifest());
  ASSERT_EQ(v.problems.size(), 2u);  // the chunk and the whole file
  EXPECT_THAT(v.problems[0].message(), HasSubstr("tensor 'a'"));
  EXPECT_THAT(v.problems[1].message(), HasSubstr("checksum mismatch in file"));
}

TEST_F(LoadTest, TruncatedFileIsDetected) {
  testing_util::Truncate(File(), 5000);
  absl::Status s = LoadBoth(Options());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("(truncated)"));
  EXPECT_THAT(s.message(), HasSubstr("'a'"));
  auto r = CheckpointReader::Open(Options());
  VerifyReport v = VerifyCheckpoint((*r)->step_directory(), (*r)->manifest());
  ASSERT_EQ(v.problems.size(), 1u);
  EXPECT_THAT(v.problems[0].message(), HasSubstr("truncated"));
}

TEST_F(LoadTest, DeletedFileIsDetected) {
  ASSERT_TRUE(checkpoint_internal::RemoveTree(File()).ok());
  absl::Status s = LoadBoth(Options());
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("rank00000-000.safetensors' of step 5 is missing"));
  EXPECT_THAT(s.message(), HasSubstr("'a', 'b'"));
  auto r = CheckpointReader::Open(Options());
  VerifyReport v = VerifyCheckpoint((*r)->step_directory(), (*r)->manifest());
  ASSERT_EQ(v.problems.size(), 1u);
  EXPECT_EQ(v.problems[0].code(), absl::StatusCode::kNotFound);
}

TEST_F(LoadTest, EditedManifestIsDetected) {
  const std::string original = testing_util::ReadAll(ManifestPath());
  auto edit = [&](const std::function<void(nlohmann::ordered_json&)>& fn) {
    nlohmann::ordered_json j = nlohmann::ordered_json::parse(original);
    fn(j);
    testing_util::WriteAll(ManifestPath(), j.dump(1));
  };
  // A shape changed: the shards no longer cover it.
  edit([](auto& j) { j["tensors"][0]["shape"] = {64, 1000}; });
  absl::Status s = LoadBoth(Options());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("manifest '" + ManifestPath() + "'"));
  EXPECT_THAT(s.message(), HasSubstr("tensor 'a'"));
  // A checksum changed: the data no longer matches it.
  edit([](auto& j) { j["tensors"][1]["shards"][0]["chunk_checksums"][0] = std::string(32, '0'); });
  s = LoadBoth(Options());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("checksum mismatch"));
  EXPECT_THAT(s.message(), HasSubstr("tensor 'b'"));
  // Not JSON any more.
  testing_util::WriteAll(ManifestPath(), original.substr(0, original.size() / 2));
  s = LoadBoth(Options());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("not valid JSON"));
  // From the future.
  edit([](auto& j) { j["version"] = 3; });
  EXPECT_EQ(LoadBoth(Options()).code(), absl::StatusCode::kUnimplemented);
  // Gone.
  ASSERT_TRUE(checkpoint_internal::RemoveTree(ManifestPath()).ok());
  s = LoadBoth(Options());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("has no manifest.json"));
}

TEST_F(LoadTest, CorruptLatestPointer) {
  testing_util::WriteAll(dir_ / "latest", "step-5; rm -rf /\n");
  absl::Status s = CheckpointReader::Open(Options()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("not 'step-<N>'"));
  testing_util::WriteAll(dir_ / "latest", "step-6\n");
  s = CheckpointReader::Open(Options()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("step 6 (named by 'latest') does not exist"));
}

TEST_F(LoadTest, DataFilesAreSafetensors) {
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Open(File());
  ASSERT_TRUE(f.ok()) << f.status();
  std::vector<uint8_t> b(b_.size());
  ASSERT_TRUE(f->Read("b", b.data(), b.size()).ok());
  EXPECT_EQ(b, b_);
  EXPECT_EQ(f->Read("zz", b.data(), b.size()).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(f->Read("b", b.data(), 3).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata
