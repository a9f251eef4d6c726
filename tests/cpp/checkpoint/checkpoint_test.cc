// Single-process saves: exact round trips, async semantics (staging,
// busy policies, background failures), retention and request validation.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"
#include "checkpoint/internal/file_util.h"
#include "checkpoint/internal/staging.h"
#include "strata/checkpoint/checkpointer.h"
#include "strata/checkpoint/loader.h"
#include "strata/version.h"
#include "test_util.h"

namespace strata {
namespace {

using ::testing::HasSubstr;
using testing_util::RandomBytes;
using testing_util::ScratchDir;
using testing_util::Soon;

// A tensor with its bytes, kept alive for the save.
struct Owned {
  ShardedTensor shard;
  std::vector<uint8_t> bytes;
};

Owned MakeTensor(const std::string& key, DataType dtype, std::vector<int64_t> shape,
                 uint32_t seed) {
  Owned t{ShardedTensor::Whole(key, dtype, std::move(shape)), {}};
  t.bytes = RandomBytes(t.shard.local_bytes(), seed);
  if (dtype == DataType::kBool) {
    for (auto& b : t.bytes) b &= 1;
  }
  return t;
}

SaveRequest Request(int64_t step, const std::vector<Owned>& tensors) {
  SaveRequest r;
  r.step = step;
  for (const Owned& t : tensors) r.tensors.push_back({t.shard, t.bytes.data()});
  return r;
}

std::unique_ptr<Checkpointer> MakeCheckpointer(const CheckpointOptions& o) {
  absl::StatusOr<std::unique_ptr<Checkpointer>> c = Checkpointer::Create(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return std::move(*c);
}

// Loads every tensor of `want` whole and compares the bytes.
void ExpectLoads(const std::string& dir, int64_t step, const std::vector<Owned>& want) {
  LoadOptions lo;
  lo.directory = dir;
  lo.step = step;
  absl::StatusOr<std::unique_ptr<CheckpointReader>> r = CheckpointReader::Open(lo);
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<std::vector<uint8_t>> got(want.size());
  std::vector<TensorTarget> targets;
  for (size_t i = 0; i < want.size(); ++i) {
    got[i].assign(want[i].bytes.size(), 0xEE);
    targets.push_back({want[i].shard, got[i].data()});
  }
  absl::StatusOr<LoadReport> rep = (*r)->Load(targets);
  ASSERT_TRUE(rep.ok()) << rep.status();
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i], want[i].bytes) << want[i].shard.key;
  }
  EXPECT_TRUE(VerifyCheckpoint((*r)->step_directory(), (*r)->manifest()).ok());
}

std::vector<Owned> EveryDtype(uint32_t seed) {
  std::vector<Owned> v;
  int i = 0;
  for (DataType t : kAllDataTypes) {
    v.push_back(MakeTensor(absl::StrCat("t.", DataTypeName(t)), t, {3, 5 + i, 7}, seed + i));
    v.push_back(MakeTensor(absl::StrCat("scalar.", DataTypeName(t)), t, {}, seed + 100 + i));
    v.push_back(MakeTensor(absl::StrCat("empty.", DataTypeName(t)), t, {0, 4}, seed + 200 + i));
    ++i;
  }
  return v;
}

TEST(CheckpointTest, RoundTripIsExactForEveryDtype) {
  ScratchDir dir;
  for (ChecksumAlgorithm alg : {ChecksumAlgorithm::kXxh3_128, ChecksumAlgorithm::kSha256}) {
    for (uint64_t max_file : {uint64_t{0}, uint64_t{1000}}) {
      SCOPED_TRACE(absl::StrCat(ChecksumAlgorithmName(alg), " max_file_bytes ", max_file));
      CheckpointOptions o;
      o.directory = dir / absl::StrCat(ChecksumAlgorithmName(alg), "-", max_file);
      o.checksum = alg;
      o.max_file_bytes = max_file;
      o.chunk_bytes = 4096;
      auto ckpt = MakeCheckpointer(o);
      const std::vector<Owned> tensors = EveryDtype(7);
      SaveRequest req = Request(12, tensors);
      req.state.optimizer_step = 11;
      req.state.lr_schedule = R"({"last_epoch": 11, "base_lrs": [0.001, 0.5]})";
      req.state.data_loader = R"({"epoch": 2, "index": 977})";
      req.state.extra = R"({"b": [1, 2, {"c": null}], "a": "x"})";
      req.state.rng_states["cpu"] = std::string("\x00\x01\xff rng", 7);
      req.state.mesh.world_size = 1;
      ASSERT_TRUE(ckpt->Save(req).ok());
      ASSERT_TRUE(ckpt->Wait(Soon()).ok());
      EXPECT_EQ(ckpt->status().last_committed_step, 12);
      ExpectLoads(o.directory, -1, tensors);

      LoadOptions lo;
      lo.directory = o.directory;
      auto reader = CheckpointReader::Open(lo);
      ASSERT_TRUE(reader.ok()) << reader.status();
      const TrainingState st = (*reader)->state(0);
      EXPECT_EQ(st.step, 12);
      EXPECT_EQ(st.optimizer_step, 11);
      EXPECT_EQ(st.lr_schedule, R"({"last_epoch":11,"base_lrs":[0.001,0.5]})");
      EXPECT_EQ(st.data_loader, R"({"epoch":2,"index":977})");
      EXPECT_EQ(st.extra, R"({"b":[1,2,{"c":null}],"a":"x"})");  // key order kept
      EXPECT_EQ(st.rng_states.at("cpu"), std::string("\x00\x01\xff rng", 7));
      EXPECT_EQ(st.library_version, STRATA_VERSION_STRING);
      EXPECT_EQ((*reader)->manifest().checksum, alg);
      if (max_file > 0) EXPECT_GT((*reader)->manifest().files.size(), 1u);
      // A rank absent from the checkpoint gets no per-rank state.
      EXPECT_TRUE((*reader)->state(3).rng_states.empty());
    }
  }
}

TEST(CheckpointTest, SavesTheValuesAtSaveTime) {
  ScratchDir dir;
  testing_util::Event changed;
  CheckpointOptions o;
  o.directory = dir.path();
  // The writer may not start before the test has changed the tensor.
  o.test_hook = [&](absl::string_view point) {
    if (point == "prepared") changed.WaitFor(absl::Seconds(60));
    return absl::OkStatus();
  };
  auto ckpt = MakeCheckpointer(o);
  std::vector<Owned> tensors = {MakeTensor("w", DataType::kFloat32, {1000}, 3)};
  const std::vector<Owned> at_save = tensors;
  ASSERT_TRUE(ckpt->Save(Request(1, tensors)).ok());
  std::fill(tensors[0].bytes.begin(), tensors[0].bytes.end(), 0x11);  // training moves on
  changed.Notify();
  ASSERT_TRUE(ckpt->Wait(Soon()).ok());
  ExpectLoads(dir.path(), 1, at_save);
}

// Blocks the writer at "prepared" until released.
struct Gate {
  testing_util::Event entered;
  testing_util::Event release;
  std::function<absl::Status(absl::string_view)> Hook() {
    return [this](absl::string_view point) {
      if (point == "prepared" && !release.IsSet()) {
        entered.Notify();
        release.WaitFor(absl::Seconds(60));
      }
      return absl::OkStatus();
    };
  }
};

TEST(CheckpointTest, BusyRefuseRejectsASecondSave) {
  ScratchDir dir;
  Gate gate;
  CheckpointOptions o;
  o.directory = dir.path();
  o.on_busy = BusyPolicy::kRefuse;
  o.test_hook = gate.Hook();
  auto ckpt = MakeCheckpointer(o);
  std::vector<Owned> t = {MakeTensor("w", DataType::kInt32, {10}, 1)};
  ASSERT_TRUE(ckpt->Save(Request(1, t)).ok());
  ASSERT_TRUE(gate.entered.WaitFor(absl::Seconds(60)));
  EXPECT_EQ(ckpt->status().state, SaveStatus::State::kWriting);
  EXPECT_EQ(ckpt->status().step_in_flight, 1);
  absl::Status s = ckpt->Save(Request(2, t));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("step 1 is still in flight"));
  gate.release.Notify();
  ASSERT_TRUE(ckpt->Wait(Soon()).ok());
  EXPECT_EQ(ckpt->status().last_committed_step, 1);
}

TEST(CheckpointTest, BusyWaitTimesOutThenSucceeds) {
  ScratchDir dir;
  Gate gate;
  CheckpointOptions o;
  o.directory = dir.path();
  o.busy_timeout = absl::Milliseconds(20);
  o.test_hook = gate.Hook();
  auto ckpt = MakeCheckpointer(o);
  std::vector<Owned> t = {MakeTensor("w", DataType::kInt32, {10}, 1)};
  ASSERT_TRUE(ckpt->Save(Request(1, t)).ok());
  ASSERT_TRUE(gate.entered.WaitFor(absl::Seconds(60)));
  absl::Status s = ckpt->Save(Request(2, t));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(ckpt->Wait(absl::Now()).code(), absl::StatusCode::kDeadlineExceeded);
  gate.release.Notify();
  ASSERT_TRUE(ckpt->Wait(Soon()).ok());
  ASSERT_TRUE(ckpt->Save(Request(2, t)).ok());
  ASSERT_TRUE(ckpt->Wait(Soon()).ok());
  EXPECT_EQ(*LatestCheckpointStep(dir.path()), 2);
}

TEST(CheckpointTest, BusyWaitBlocksUntilThePreviousSaveCommits) {
  ScratchDir dir;
  Gate gate;
  CheckpointOptions o;
  o.directory = dir.path();
  o.test_hook = gate.Hook();
  auto ckpt = MakeCheckpointer(o);
  std::vector<Owned> t = {MakeTensor("w", DataType::kInt32, {10}, 1)};
  ASSERT_TRUE(ckpt->Save(Request(1, t)).ok());
  ASSERT_TRUE(gate.entered.WaitFor(absl::Seconds(60)));
  absl::Status second;
  std::thread other([&] { second = ckpt->Save(Request(2, t)); });
  gate.release.Notify();
  other.join();
  EXPECT_TRUE(second.ok()) << second;
  ASSERT_TRUE(ckpt->Wait(Soon()).ok());
  EXPECT_THAT(*ListCheckpointSteps(dir.path()), ::testing::ElementsAre(1, 2));
}

TEST(CheckpointTest, BackgroundFailureIsReturnedByTheNextSaveAndLosesNothing) {
  ScratchDir dir;
  std::atomic<bool> fail{false};  // changed only while no save is in flight
  CheckpointOptions o;
  o.directory = dir.path();
  o.test_hook = [&](absl::string_view point) {
    if (fail.load() && point == "files_written") return absl::InternalError("disk on fire");
    return absl::OkStatus();
  };
  auto ckpt = MakeCheckpointer(o);
  std::vector<Owned> t = {MakeTensor("w", DataType::kFloat64, {100}, 5)};
  ASSERT_TRUE(ckpt->Save(Request(1, t)).ok());
  ASSERT_TRUE(ckpt->Wait(Soon()).ok());
  ASSERT_TRUE(ckpt->Save(Request(2, t)).ok());
  ASSERT_TRUE(ckpt->Wait(Soon()).ok());
  fail = true;
  ASSERT_TRUE(ckpt->Save(Request(3, t)).ok());  // fails in the background
  // The next save waits for it (on_busy = wait) and reports its failure.
  absl::Status s = ckpt->Save(Request(4, t));
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(s.message(), HasSubstr("background save of step 3"));
  EXPECT_THAT(s.message(), HasSubstr("disk on fire"));
  EXPECT_TRUE(ckpt->status().pending_error.ok());  // reported once
  // Step 3 left nothing behind; latest still names step 2.
  EXPECT_EQ(*LatestCheckpointStep(dir.path()), 2);
  EXPECT_FALSE(checkpoint_internal::PathExists(dir / "step-3.tmp"));
  EXPECT_FALSE(checkpoint_internal::PathExists(dir / "step-3"));
  fail = false;
  ASSERT_TRUE(ckpt->Save(Request(4, t)).ok());
  ASSERT_TRUE(ckpt->Wait(Soon()).ok());
  EXPECT_EQ(*LatestCheckpointStep(dir.path()), 4);
}

TEST(CheckpointTest, BackgroundFailureUnderWarnGoesToTheCallback) {
  ScratchDir dir;
  std::vector<absl::Status> warnings;  // written by Save(), on this thread
  std::atomic<int> renames{0};
  CheckpointOptions o;
  o.directory = dir.path();
  o.on_failure = FailurePolicy::kWarn;
  o.warn = [&](const absl::Status& s) { warnings.push_back(s); };
  o.test_hook = [&](absl::string_view point) {
    // The first save fails after its rename, before `latest` names it.
    if (point == "renamed" && renames.fetch_add(1) == 0) return absl::UnavailableError("injected");
    return absl::OkStatus();
  };
  auto ckpt = MakeCheckpointer(o);
  std::vector<Owned> t = {MakeTensor("w", DataType::kUInt8, {100}, 5)};
  ASSERT_TRUE(ckpt->Save(Request(1, t)).ok());
  ASSERT_TRUE(ckpt->Save(Request(2, t)).ok());
  ASSERT_TRUE(ckpt->Wait(Soon()).ok());
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_THAT(warnings[0].message(), HasSubstr("step 1"));
  EXPECT_EQ(*LatestCheckpointStep(dir.path()), 2);
  // Step 1 was renamed into place before it failed: complete, but never
  // named by `latest`.
  EXPECT_THAT(*ListCheckpointSteps(dir.path()), ::testing::ElementsAre(1, 2));
}

TEST(CheckpointTest, WaitReportsABackgroundFailureOnce) {
  ScratchDir dir;
  CheckpointOptions o;
  o.directory = dir.path();
  o.test_hook = [](absl::string_view point) {
    return point == "manifest_written" ? absl::DataLossError("injected") : absl::OkStatus();
  };
  auto ckpt = MakeCheckpointer(o);
  std::vector<Owned> t = {MakeTensor("w", DataType::kUInt8, {10}, 5)};
  ASSERT_TRUE(ckpt->Save(Request(1, t)).ok());
  EXPECT_EQ(ckpt->Wait(Soon()).code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(ckpt->Wait(Soon()).ok());
  EXPECT_EQ(LatestCheckpointStep(dir.path()).status().code(), absl::StatusCode::kNotFound);
}

TEST(CheckpointTest, RetentionKeepsTheNewestAndWhatLatestNames) {
  ScratchDir dir;
  CheckpointOptions o;
  o.directory = dir.path();
  o.keep_last = 2;
  auto ckpt = MakeCheckpointer(o);
  std::vector<Owned> t = {MakeTensor("w", DataType::kInt64, {10}, 5)};
  for (int64_t step : {1, 2, 3, 4, 5}) {
    ASSERT_TRUE(ckpt->Save(Request(step, t)).ok());
    ASSERT_TRUE(ckpt->Wait(Soon()).ok());
  }
  EXPECT_THAT(*ListCheckpointSteps(dir.path()), ::testing::ElementsAre(4, 5));
  // A restarted run saves an older step: it becomes `latest` and survives
  // although it is not among the newest two.
  ASSERT_TRUE(ckpt->Save(Request(3, t)).ok());
  ASSERT_TRUE(ckpt->Wait(Soon()).ok());
  EXPECT_EQ(*LatestCheckpointStep(dir.path()), 3);
  EXPECT_THAT(*ListCheckpointSteps(dir.path()), ::testing::ElementsAre(3, 4, 5));
  ExpectLoads(dir.path(), -1, t);
}

TEST(CheckpointTest, StaleTemporaryDirectoriesAreCleanedUp) {
  ScratchDir dir;
  ASSERT_TRUE(checkpoint_internal::MakeDirectory(dir / "step-7.tmp").ok());
  testing_util::WriteAll(dir / "step-7.tmp/junk", "junk");
  ASSERT_TRUE(checkpoint_internal::MakeDirectory(dir / "step-3.tmp").ok());
  CheckpointOptions o;
  o.directory = dir.path();
  auto ckpt = MakeCheckpointer(o);
  std::vector<Owned> t = {MakeTensor("w", DataType::kInt64, {10}, 5)};
  ASSERT_TRUE(ckpt->Save(Request(7, t)).ok());
  ASSERT_TRUE(ckpt->Wait(Soon()).ok());
  EXPECT_FALSE(checkpoint_internal::PathExists(dir / "step-7/junk"));
  EXPECT_FALSE(checkpoint_internal::PathExists(dir / "step-3.tmp"));
  EXPECT_THAT(*checkpoint_internal::ListDirectory(dir / "step-7"),
              ::testing::ElementsAre("manifest.json", "rank00000-000.safetensors"));
}

TEST(CheckpointTest, CreatesMissingParentDirectories) {
  ScratchDir dir;
  CheckpointOptions o;
  o.directory = dir / "a/b/run";
  auto ckpt = MakeCheckpointer(o);
  std::vector<Owned> t = {MakeTensor("w", DataType::kInt8, {3}, 5)};
  ASSERT_TRUE(ckpt->Save(Request(1, t)).ok());
  ASSERT_TRUE(ckpt->Wait(Soon()).ok());
  ExpectLoads(o.directory, 1, t);
  // A root that cannot be created fails the save, in the background.
  testing_util::WriteAll(dir / "file", "x");
  o.directory = dir / "file/run";
  auto bad = MakeCheckpointer(o);
  ASSERT_TRUE(bad->Save(Request(1, t)).ok());
  absl::Status s = bad->Wait(Soon());
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("cannot create directory"));
}

TEST(CheckpointTest, StagingMemoryIsReusedAcrossSaves) {
  ScratchDir dir;
  CheckpointOptions o;
  o.directory = dir.path();
  auto ckpt = MakeCheckpointer(o);
  std::vector<Owned> t = {MakeTensor("w", DataType::kFloat32, {1 << 16}, 5)};
  for (int64_t step : {1, 2, 3}) {
    ASSERT_TRUE(ckpt->Save(Request(step, t)).ok());
    ASSERT_TRUE(ckpt->Wait(Soon()).ok());
  }
  EXPECT_EQ(ckpt->status().staging_allocations, 1);
  EXPECT_GE(ckpt->status().staging_capacity, t[0].bytes.size());
  std::vector<Owned> bigger = {MakeTensor("w", DataType::kFloat32, {1 << 20}, 6)};
  ASSERT_TRUE(ckpt->Save(Request(4, bigger)).ok());
  ASSERT_TRUE(ckpt->Wait(Soon()).ok());
  EXPECT_EQ(ckpt->status().staging_allocations, 2);
  ExpectLoads(dir.path(), 4, bigger);
}

TEST(CheckpointTest, RejectsBadRequests) {
  ScratchDir dir;
  CheckpointOptions o;
  o.directory = dir.path();
  auto ckpt = MakeCheckpointer(o);
  std::vector<Owned> t = {MakeTensor("w", DataType::kFloat32, {4}, 5)};
  {
    SaveRequest r = Request(1, t);
    r.tensors.push_back(r.tensors[0]);
    absl::Status s = ckpt->Save(r);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("'w' is given twice"));
  }
  {
    SaveRequest r = Request(1, t);
    r.tensors[0].data = nullptr;
    EXPECT_THAT(ckpt->Save(r).message(), HasSubstr("'w' has no data pointer"));
  }
  {
    SaveRequest r = Request(1, t);
    r.tensors[0].shard.local_shape = {5};
    absl::Status s = ckpt->Save(r);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("extends past the global shape"));
  }
  {
    SaveRequest r = Request(1, t);
    r.state.lr_schedule = "{not json";
    absl::Status s = ckpt->Save(r);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("lr_schedule"));
  }
  {
    SaveRequest r = Request(-1, t);
    EXPECT_THAT(ckpt->Save(r).message(), HasSubstr("step -1 is negative"));
  }
  ASSERT_TRUE(ckpt->Save(Request(1, t)).ok());
  ASSERT_TRUE(ckpt->Wait(Soon()).ok());
  absl::Status again = ckpt->Save(Request(1, t));
  EXPECT_EQ(again.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(again.message(), HasSubstr("step 1 is already committed"));
  ASSERT_TRUE(ckpt->Close(Soon()).ok());
  EXPECT_EQ(ckpt->Save(Request(2, t)).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(CheckpointTest, RejectsBadOptions) {
  CheckpointOptions o;
  EXPECT_THAT(Checkpointer::Create(o).status().message(), HasSubstr("directory is empty"));
  o.directory = "/tmp/x";
  o.keep_last = -1;
  EXPECT_THAT(Checkpointer::Create(o).status().message(), HasSubstr("keep_last -1"));
  o.keep_last = 0;
  o.chunk_bytes = 10;
  EXPECT_THAT(Checkpointer::Create(o).status().message(), HasSubstr("chunk_bytes 10"));
  o.chunk_bytes = 4096;
  o.version = 1;  // Communicator pointers, not group handles
  EXPECT_THAT(Checkpointer::Create(o).status().message(), HasSubstr("version 1"));
  o.version = CheckpointOptions::kVersion + 1;
  EXPECT_THAT(Checkpointer::Create(o).status().message(),
              HasSubstr(absl::StrCat("version ", CheckpointOptions::kVersion + 1)));
}

TEST(CheckpointTest, DeviceTensorsNeedAGpu) {
  if (checkpoint_internal::CudaDeviceAvailable()) GTEST_SKIP() << "a GPU is present";
  ScratchDir dir;
  CheckpointOptions o;
  o.directory = dir.path();
  auto ckpt = MakeCheckpointer(o);
  std::vector<Owned> t = {MakeTensor("w", DataType::kFloat32, {4}, 5)};
  SaveRequest r = Request(1, t);
  r.tensors[0].memory = MemoryKind::kCuda;
  absl::Status s = ckpt->Save(r);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), ::testing::AnyOf(HasSubstr("no GPU"), HasSubstr("no CUDA support")));
  // Nothing was started: the next save works.
  ASSERT_TRUE(ckpt->Save(Request(1, t)).ok());
  ASSERT_TRUE(ckpt->Wait(Soon()).ok());
}

}  // namespace
}  // namespace strata
