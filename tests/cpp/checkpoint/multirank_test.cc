// The commit protocol across ranks, in one process: each "rank" has its own
// Checkpointer on an in-process communicator (fake_communicator.h), and its
// writer thread takes part in the agreements. Saves under one layout,
// loads under others; a rank that fails makes the whole save invisible.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "checkpoint/internal/file_util.h"
#include "fake_communicator.h"
#include "strata/checkpoint/checkpointer.h"
#include "strata/checkpoint/loader.h"
#include "strata/checkpoint/reshard.h"
#include "test_util.h"

namespace strata {
namespace {

using ::testing::HasSubstr;
using testing_util::FakeHub;
using testing_util::ScratchDir;
using testing_util::Soon;

// The global value of element `i` of tensor `key`, as float.
float GlobalValue(const std::string& key, int64_t i) {
  return static_cast<float>(std::hash<std::string>{}(key) % 1000) + 0.5f * static_cast<float>(i);
}

// A box of a global tensor, filled from GlobalValue.
std::vector<float> BoxValues(const ShardedTensor& s) {
  std::vector<float> out(static_cast<size_t>(s.local_elements()));
  std::vector<int64_t> idx(s.local_shape.size(), 0);
  for (size_t k = 0; k < out.size(); ++k) {
    int64_t g = 0;
    for (size_t d = 0; d < s.global_shape.size(); ++d)
      g = g * s.global_shape[d] + s.global_offset[d] + idx[d];
    out[k] = GlobalValue(s.key, g);
    for (size_t d = idx.size(); d-- > 0;) {
      if (++idx[d] < s.local_shape[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

// Shard of `key` [shape] cut into `parts` along `dim`, piece `index`.
ShardedTensor Cut(const std::string& key, std::vector<int64_t> shape, int dim, int parts, int index,
                  ReplicaInfo replica = {}) {
  ShardedTensor s = ShardedTensor::Whole(key, DataType::kFloat32, shape);
  if (dim >= 0) {
    s.local_shape[dim] = shape[dim] / parts;
    s.global_offset[dim] = s.local_shape[dim] * index;
  }
  s.replica = replica;
  return s;
}

struct Rank {
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<Checkpointer> ckpt;
  std::vector<ShardedTensor> shards;
  std::vector<std::vector<float>> data;
};

// Ranks of a job, each with its checkpointer on `dir`.
std::vector<Rank> MakeRanks(int n, const std::string& dir,
                            const std::function<void(int, CheckpointOptions&)>& tweak = nullptr) {
  auto hub = std::make_shared<FakeHub>(n);
  std::vector<Rank> ranks(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    ranks[r].comm = hub->Endpoint(r);
    CheckpointOptions o;
    o.directory = dir;
    o.group = GroupHandle::Fixed(ranks[r].comm.get());
    o.chunk_bytes = 4096;
    o.commit_timeout = absl::Seconds(60);
    if (tweak) tweak(r, o);
    auto c = Checkpointer::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    ranks[r].ckpt = std::move(*c);
  }
  return ranks;
}

// Every rank saves its shards at `step` (filled from GlobalValue); returns
// each rank's Wait() status.
std::vector<absl::Status> SaveAll(std::vector<Rank>& ranks, int64_t step) {
  for (Rank& r : ranks) {
    r.data.clear();
    SaveRequest req;
    req.step = step;
    req.state.mesh.world_size = static_cast<int>(ranks.size());
    req.state.rng_states["cpu"] = absl::StrCat("rng of ", &r - ranks.data());
    for (const ShardedTensor& s : r.shards) r.data.push_back(BoxValues(s));
    for (size_t i = 0; i < r.shards.size(); ++i)
      req.tensors.push_back({r.shards[i], r.data[i].data()});
    EXPECT_TRUE(r.ckpt->Save(req).ok());
  }
  std::vector<absl::Status> out;
  for (Rank& r : ranks) out.push_back(r.ckpt->Wait(Soon()));
  return out;
}

// Loads `want` boxes and compares with GlobalValue.
LoadReport LoadAndCheck(const std::string& dir, const std::vector<ShardedTensor>& want,
                        ChecksumVerification verify = ChecksumVerification::kVerify) {
  LoadOptions lo;
  lo.directory = dir;
  lo.matching = KeyMatching::kLenient;
  lo.verify = verify;
  auto reader = CheckpointReader::Open(lo);
  EXPECT_TRUE(reader.ok()) << reader.status();
  std::vector<std::vector<float>> got;
  std::vector<TensorTarget> targets;
  for (const ShardedTensor& s : want)
    got.emplace_back(static_cast<size_t>(s.local_elements()), NAN);
  for (size_t i = 0; i < want.size(); ++i) targets.push_back({want[i], got[i].data()});
  absl::StatusOr<LoadReport> rep = (*reader)->Load(targets);
  EXPECT_TRUE(rep.ok()) << rep.status();
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], BoxValues(want[i])) << want[i].key;
  EXPECT_TRUE(rep->missing.empty());
  return *rep;
}

// tp=2, dp=2 (rank = tp + 2*dp): column- and row-parallel weights split by
// tp and replicated by dp, a norm replicated on all four ranks.
TEST(MultiRankCheckpointTest, SavedUnderTp2Dp2LoadsUnderTp4AndTp1) {
  ScratchDir dir;
  std::vector<Rank> ranks = MakeRanks(4, dir.path());
  for (int r = 0; r < 4; ++r) {
    const int tp = r % 2, dp = r / 2;
    ranks[r].shards = {Cut("col.weight", {16, 8}, 0, 2, tp, {dp, 2}),
                       Cut("row.weight", {8, 16}, 1, 2, tp, {dp, 2}),
                       Cut("fc.weight", {32, 64}, 0, 2, tp, {dp, 2}),
                       Cut("norm.weight", {8}, -1, 1, 0, {r, 4}),
                       Cut("norm.bias", {8}, -1, 1, 0, {r, 4})};
  }
  for (const absl::Status& s : SaveAll(ranks, 10)) ASSERT_TRUE(s.ok()) << s;

  LoadOptions lo;
  lo.directory = dir.path();
  auto reader = CheckpointReader::Open(lo);
  ASSERT_TRUE(reader.ok()) << reader.status();
  const Manifest& m = (*reader)->manifest();
  EXPECT_EQ(m.world_size, 4);
  EXPECT_TRUE(VerifyCheckpoint((*reader)->step_directory(), m).ok());
  // Each box is stored once, and the writing is spread over the replicas.
  EXPECT_EQ(m.FindTensor("col.weight")->shards.size(), 2u);
  EXPECT_EQ(m.FindTensor("norm.weight")->shards.size(), 1u);
  std::map<int, uint64_t> bytes_by_rank;
  for (const ManifestFile& f : m.files) bytes_by_rank[f.rank] += f.size;
  EXPECT_GE(bytes_by_rank.size(), 3u) << "the replicas of dp did not share the writing";
  EXPECT_EQ((*reader)->state(2).rng_states.at("cpu"), "rng of 2");

  for (int tp4 = 0; tp4 < 4; ++tp4) {  // tp=4, dp=1
    LoadAndCheck(dir.path(),
                 {Cut("col.weight", {16, 8}, 0, 4, tp4), Cut("row.weight", {8, 16}, 1, 4, tp4),
                  Cut("fc.weight", {32, 64}, 0, 4, tp4), Cut("norm.weight", {8}, -1, 1, 0)});
  }
  LoadAndCheck(dir.path(),
               {Cut("col.weight", {16, 8}, -1, 1, 0), Cut("row.weight", {8, 16}, -1, 1, 0)});
}

// Eight per-layer tensors saved by a pp=2 job (4 layers per stage), loaded
// by a pp=4 job: each stage reads exactly its layers' bytes.
TEST(MultiRankCheckpointTest, PerLayerTensorsUnderAnotherPipelineSplit) {
  ScratchDir dir;
  std::vector<Rank> ranks = MakeRanks(2, dir.path());
  for (int stage = 0; stage < 2; ++stage) {
    for (int l = 4 * stage; l < 4 * stage + 4; ++l) {
      ranks[stage].shards.push_back(Cut(absl::StrCat("layers.", l, ".w"), {8, 16}, -1, 1, 0));
    }
  }
  for (const absl::Status& s : SaveAll(ranks, 3)) ASSERT_TRUE(s.ok()) << s;
  for (int stage = 0; stage < 4; ++stage) {
    std::vector<ShardedTensor> mine;
    for (int l = 2 * stage; l < 2 * stage + 2; ++l)
      mine.push_back(Cut(absl::StrCat("layers.", l, ".w"), {8, 16}, -1, 1, 0));
    const LoadReport rep = LoadAndCheck(dir.path(), mine, ChecksumVerification::kSkip);
    EXPECT_EQ(rep.bytes_read, 2u * 8 * 16 * 4) << "stage " << stage;
    EXPECT_EQ(rep.files_opened, 1);
    EXPECT_EQ(rep.unexpected.size(), 6u);
  }
}

TEST(MultiRankCheckpointTest, OneRankFailingLeavesNothingBehind) {
  ScratchDir dir;
  std::vector<Rank> ranks = MakeRanks(4, dir.path(), [](int r, CheckpointOptions& o) {
    if (r == 2) {
      o.test_hook = [](absl::string_view p) {
        return p == "files_written" ? absl::ResourceExhaustedError("disk full on rank 2")
                                    : absl::OkStatus();
      };
    }
  });
  for (int r = 0; r < 4; ++r) ranks[r].shards = {Cut("w", {8, 8}, 0, 4, r)};
  std::vector<absl::Status> st = SaveAll(ranks, 1);
  EXPECT_EQ(st[2].code(), absl::StatusCode::kResourceExhausted);
  for (int r : {0, 1, 3}) {
    EXPECT_EQ(st[r].code(), absl::StatusCode::kAborted) << st[r];
    EXPECT_THAT(st[r].message(), HasSubstr("rank 2 failed to write"));
    EXPECT_THAT(st[r].message(), HasSubstr("RESOURCE_EXHAUSTED: disk full on rank 2"));
  }
  EXPECT_FALSE(checkpoint_internal::PathExists(dir / "step-1"));
  EXPECT_FALSE(checkpoint_internal::PathExists(dir / "step-1.tmp"));
  EXPECT_EQ(LatestCheckpointStep(dir.path()).status().code(), absl::StatusCode::kNotFound);
}

TEST(MultiRankCheckpointTest, RanksThatDisagreeOnATensorAreRefused) {
  ScratchDir dir;
  std::vector<Rank> ranks = MakeRanks(2, dir.path());
  ranks[0].shards = {Cut("w", {8, 8}, 0, 2, 0)};
  ranks[1].shards = {Cut("w", {8, 6}, 0, 2, 1)};
  std::vector<absl::Status> st = SaveAll(ranks, 1);
  EXPECT_EQ(st[0].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st[0].message(),
              HasSubstr("tensor 'w': rank 0 saved F32 [8, 8] but rank 1 saved F32 [8, 6]"));
  EXPECT_EQ(st[1].code(), absl::StatusCode::kAborted);
  // Two ranks that claim the same box.
  ranks[1].shards = {Cut("w", {8, 8}, 0, 2, 0)};
  st = SaveAll(ranks, 2);
  EXPECT_EQ(st[0].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st[0].message(), HasSubstr("overlap"));
  // A box nobody saved.
  ranks[1].shards = {};
  st = SaveAll(ranks, 3);
  EXPECT_THAT(st[0].message(), HasSubstr("shards cover 32"));
  EXPECT_FALSE(LatestCheckpointStep(dir.path()).ok());
}

// A rank whose Save() fails at once (here: a bad request) still votes, so
// the others abandon the save with its reason instead of waiting for the
// agreement deadline (an hour here: the test's own 60 s deadline would
// fail first).
TEST(MultiRankCheckpointTest, ARankThatCannotStartMakesTheOthersGiveUpAtOnce) {
  ScratchDir dir;
  std::vector<Rank> ranks = MakeRanks(
      3, dir.path(), [](int, CheckpointOptions& o) { o.commit_timeout = absl::Hours(1); });
  std::vector<std::vector<float>> data(3, std::vector<float>(16, 1.0f));
  for (int r = 0; r < 3; ++r) {
    SaveRequest req;
    req.step = 1;
    ShardedTensor s = Cut("w", {48}, 0, 3, r);
    if (r == 1) s.local_shape = {40};  // does not fit: InvalidArgument from Save()
    req.tensors.push_back({s, data[r].data()});
    absl::Status saved = ranks[r].ckpt->Save(req);
    EXPECT_EQ(saved.code(), r == 1 ? absl::StatusCode::kInvalidArgument : absl::StatusCode::kOk)
        << saved;
  }
  for (int r : {0, 2}) {
    absl::Status s = ranks[r].ckpt->Wait(Soon());
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
    EXPECT_THAT(s.message(), HasSubstr("rank 1 could not start the save of step 1 "
                                       "(INVALID_ARGUMENT: "));
  }
  EXPECT_TRUE(ranks[1].ckpt->Wait(Soon()).ok());  // its failure was reported by Save()
  EXPECT_FALSE(checkpoint_internal::PathExists(dir / "step-1.tmp"));
  // Abandon() does the same for a rank that could not even build a request;
  // the ranks stay in step, and the next save commits.
  for (int r = 0; r < 3; ++r) {
    SaveRequest req;
    req.step = 2;
    req.tensors.push_back({Cut("w", {48}, 0, 3, r), data[r].data()});
    absl::Status s = r == 2 ? ranks[r].ckpt->Abandon(2, absl::InternalError("no state on rank 2"))
                            : ranks[r].ckpt->Save(req);
    EXPECT_EQ(s.ok(), r != 2) << s;
  }
  for (int r : {0, 1}) {
    EXPECT_THAT(ranks[r].ckpt->Wait(Soon()).message(), HasSubstr("no state on rank 2"));
  }
  EXPECT_TRUE(ranks[2].ckpt->Wait(Soon()).ok());
  for (Rank& r : ranks) r.shards = {Cut("w", {48}, 0, 3, &r - ranks.data())};
  for (const absl::Status& s : SaveAll(ranks, 3)) EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(*LatestCheckpointStep(dir.path()), 3);
}

TEST(MultiRankCheckpointTest, AMissingRankEndsInADeadlineNotAHang) {
  ScratchDir dir;
  std::vector<Rank> ranks = MakeRanks(
      2, dir.path(), [](int, CheckpointOptions& o) { o.commit_timeout = absl::Milliseconds(200); });
  std::vector<float> w(16, 1.0f);
  SaveRequest req;
  req.step = 1;
  req.tensors.push_back({Cut("w", {16}, 0, 2, 0), w.data()});
  ASSERT_TRUE(ranks[0].ckpt->Save(req).ok());  // rank 1 never saves
  absl::Status s = ranks[0].ckpt->Wait(Soon());
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.message(), HasSubstr("checkpoint agreement (prepare)"));
  // The communicator may now be out of step: later saves are refused.
  req.step = 2;
  s = ranks[0].ckpt->Save(req);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("create a new Checkpointer with a new communicator"));
  // Rank 1's checkpointer is destroyed idle; rank 0's after its failure.
}

}  // namespace
}  // namespace strata
