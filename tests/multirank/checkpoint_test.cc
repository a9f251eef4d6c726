// Checkpoints across real ranks under mpirun (MPI backend): the commit
// agreement on the checkpoint's own communicator, writing spread over the
// data-parallel replicas, the resharding matrix (tp=2,dp=2 saved, tp=4,dp=1
// and tp=1,dp=4 loaded; per-layer tensors under another pipeline split),
// global strictness, and errors that reach every rank. Every value is
// compared with a reference computed here (checkpoint_util.h).
#include <gmock/gmock.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "checkpoint_util.h"
#include "harness.h"
#include "strata/checkpoint/checkpointer.h"
#include "strata/checkpoint/loader.h"

namespace strata::testing {
namespace {

using ::testing::HasSubstr;

class CheckpointMpiTest : public MultiRankTest {
 protected:
  // Saves `shards` (filled from GlobalBytes) as `step` on every rank through
  // a checkpointer on a communicator split off the world; returns this
  // rank's Wait() status.
  static absl::Status SaveShards(const std::string& dir, int64_t step,
                                 const std::vector<ShardedTensor>& shards,
                                 const CheckpointOptions* tweak = nullptr) {
    CheckpointOptions o = tweak != nullptr ? *tweak : CheckpointOptions{};
    o.directory = dir;
    o.split_from = GroupHandle::Fixed(&world());
    o.chunk_bytes = 4096;
    o.commit_timeout = absl::Seconds(120);
    absl::StatusOr<std::unique_ptr<Checkpointer>> ckpt = Checkpointer::Create(o);
    if (!ckpt.ok()) return ckpt.status();
    std::vector<std::vector<uint8_t>> data;
    SaveRequest req;
    req.step = step;
    req.state.rng_states["cpu"] = absl::StrCat("rng of rank ", rank());
    req.state.data_loader = absl::StrCat("{\"position\": ", 100 * rank(), "}");
    req.state.optimizer_step = step;
    for (const ShardedTensor& s : shards) data.push_back(BoxBytes(s));
    for (size_t i = 0; i < shards.size(); ++i) req.tensors.push_back({shards[i], data[i].data()});
    absl::Status saved = (*ckpt)->Save(req);
    absl::Status waited = (*ckpt)->Wait(Deadline());
    return saved.ok() ? waited : saved;
  }

  struct Loaded {
    absl::Status status;
    LoadReport report;
    std::vector<std::vector<uint8_t>> data;
  };

  // Collective load of `want` (this rank's boxes) from `dir`.
  static Loaded LoadShards(const std::string& dir, const std::vector<ShardedTensor>& want,
                           LoadOptions o = {}) {
    o.directory = dir;
    o.group = GroupHandle::Fixed(&world());
    o.timeout = absl::Seconds(120);
    Loaded out;
    absl::StatusOr<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(o);
    if (!reader.ok()) {
      out.status = reader.status();
      return out;
    }
    std::vector<TensorTarget> targets;
    for (const ShardedTensor& s : want) out.data.emplace_back(s.local_bytes(), 0xEE);
    for (size_t i = 0; i < want.size(); ++i) targets.push_back({want[i], out.data[i].data()});
    absl::StatusOr<LoadReport> r = (*reader)->Load(targets);
    out.status = r.status();
    if (r.ok()) out.report = *r;
    return out;
  }

  static void ExpectValues(const std::vector<ShardedTensor>& want, const Loaded& got) {
    ASSERT_TRUE(got.status.ok()) << got.status;
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_TRUE(got.data[i] == BoxBytes(want[i]))
          << "tensor " << want[i].key << " on rank " << rank();
    }
  }

  static uint64_t Bytes(const std::vector<ShardedTensor>& shards) {
    uint64_t n = 0;
    for (const ShardedTensor& s : shards) n += s.local_bytes();
    return n;
  }
};

// Every dtype, cut unevenly over the ranks, plus a tensor every rank holds
// and a scalar: the bytes come back exactly, into this rank's box and into
// the next rank's (every box is read by some rank, so strict mode holds).
TEST_F(CheckpointMpiTest, RoundTripOfEveryDtypeIsExact) {
  SharedDir dir(world());
  const int n = size(), r = rank();
  const DataType dtypes[] = {DataType::kFloat32,  DataType::kFloat64, DataType::kFloat16,
                             DataType::kBFloat16, DataType::kInt8,    DataType::kUInt8,
                             DataType::kInt32,    DataType::kInt64,   DataType::kInt16,
                             DataType::kBool};
  // Rows of rank k: k + 1 (uneven), so the global tensor has n(n+1)/2 rows.
  auto box = [&](const std::string& key, DataType t, int k) {
    ShardedTensor s = ShardedTensor::Whole(key, t, {n * (n + 1) / 2, 5});
    s.local_shape[0] = k + 1;
    s.global_offset[0] = k * (k + 1) / 2;
    return s;
  };
  std::vector<ShardedTensor> mine, next;
  for (DataType t : dtypes) {
    const std::string key = absl::StrCat("t.", DataTypeName(t));
    mine.push_back(box(key, t, r));
    next.push_back(box(key, t, (r + 1) % n));
    ShardedTensor everywhere = ShardedTensor::Whole(key + ".replicated", t, {7, 3});
    everywhere.replica = {r, n};
    mine.push_back(everywhere);
    next.push_back(everywhere);
  }
  ShardedTensor scalar = ShardedTensor::Whole("scalar", DataType::kFloat64, {});
  scalar.replica = {r, n};
  mine.push_back(scalar);
  next.push_back(scalar);
  STRATA_EXPECT_OK(SaveShards(dir.path(), 7, mine));

  ExpectValues(mine, LoadShards(dir.path(), mine));
  ExpectValues(next, LoadShards(dir.path(), next));

  LoadOptions lo;
  lo.directory = dir.path();
  STRATA_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(lo));
  const Manifest& m = reader->manifest();
  EXPECT_EQ(m.world_size, n);
  EXPECT_TRUE(VerifyCheckpoint(reader->step_directory(), m).ok());
  // A replicated box is stored once, by one of its holders; the writing is
  // spread over the ranks.
  EXPECT_EQ(m.FindTensor("t.fp32.replicated")->shards.size(), 1u);
  std::set<int> writers;
  for (const ManifestFile& f : m.files) writers.insert(f.rank);
  EXPECT_EQ(static_cast<int>(writers.size()), n);
  EXPECT_EQ(reader->state(n - 1).rng_states.at("cpu"), absl::StrCat("rng of rank ", n - 1));
  EXPECT_EQ(reader->state(1 % n).data_loader, absl::StrCat("{\"position\":", 100 * (1 % n), "}"));
}

// The resharding matrix. 4 ranks: saved as tp=2,dp=2; loaded as tp=4,dp=1,
// tp=1,dp=4, tp=2,dp=2, and tp=1,pp=2,dp=2 (per-layer tensors on pipeline
// stages). 8 ranks: saved as tp=2,dp=2,pp=2; loaded as tp=4,pp=2,dp=1,
// tp=1,pp=2,dp=4, the same layout, tp=1 with pp=4 and pp=8, and pp=1 with
// tp=2,dp=4 and tp=8,dp=1.
TEST_F(CheckpointMpiTest, ReshardingMatrix) {
  const int n = size();
  if (n != 4 && n != 8) GTEST_SKIP() << "needs 4 or 8 ranks";
  const int pp = n / 4;
  SharedDir dir(world());
  ModelLayout model;
  model.layers = 8;
  const Mesh saved = MakeMesh(n, 2, pp);  // tp=2, dp=2, pp=n/4
  const std::vector<ShardedTensor> mine = model.Shards(saved, rank());
  STRATA_EXPECT_OK(SaveShards(dir.path(), 100, mine));

  // Data-parallel replicas wrote each box once, and shared the writing.
  LoadOptions lo;
  lo.directory = dir.path();
  STRATA_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(lo));
  std::map<int, uint64_t> bytes_by_rank;
  for (const ManifestFile& f : reader->manifest().files) bytes_by_rank[f.rank] += f.size;
  for (const ManifestTensor& t : reader->manifest().tensors) {
    uint64_t shard_bytes = 0;
    for (const ManifestShard& s : t.shards) shard_bytes += s.end - s.begin;
    EXPECT_EQ(shard_bytes, static_cast<uint64_t>(
                               ShardedTensor::Whole(t.key, t.dtype, t.shape).global_elements()) *
                               DataTypeSize(t.dtype))
        << t.key << " is not stored exactly once";
  }
  EXPECT_EQ(static_cast<int>(bytes_by_rank.size()), n) << "some rank wrote nothing";

  struct Layout {
    int tp, pp;
  };
  std::vector<Layout> layouts = {{4, pp}, {1, pp}, {2, pp}, {1, 2 * pp}};
  if (n == 8) {
    // Per-layer tensors saved on two pipeline stages, loaded with one stage
    // (every rank holds all 8 layers) and with eight.
    layouts.push_back({1, 8});
    layouts.push_back({2, 1});
    layouts.push_back({8, 1});
  }
  for (const Layout& l : layouts) {
    SCOPED_TRACE(absl::StrCat("loaded as tp=", l.tp, " pp=", l.pp, " dp=", n / (l.tp * l.pp)));
    const Mesh now = MakeMesh(n, l.tp, l.pp);
    const std::vector<ShardedTensor> want = model.Shards(now, rank());
    // Without verification and with no merging of nearby ranges, a rank
    // reads exactly the bytes of its boxes.
    LoadOptions exact;
    exact.verify = ChecksumVerification::kSkip;
    exact.merge_gap_bytes = 0;
    Loaded got = LoadShards(dir.path(), want, exact);
    ExpectValues(want, got);
    EXPECT_EQ(got.report.bytes_read, Bytes(want));
    EXPECT_TRUE(got.report.unexpected.empty());
    // With verification (the default) too.
    ExpectValues(want, LoadShards(dir.path(), want));
  }
}

// A saved tensor is unexpected only if no rank asks for it, and a target
// missing on one rank fails the load on every rank.
TEST_F(CheckpointMpiTest, StrictnessIsGlobal) {
  SharedDir dir(world());
  const int n = size(), r = rank();
  std::vector<ShardedTensor> mine;
  for (int k = 0; k < n; ++k) {
    ShardedTensor s = ShardedTensor::Whole(absl::StrCat("only.", k), DataType::kFloat32, {4});
    s.replica = {r, n};
    mine.push_back(s);
  }
  STRATA_EXPECT_OK(SaveShards(dir.path(), 1, mine));
  // Rank k asks for "only.k" alone: strict, and fine.
  ExpectValues({mine[r]}, LoadShards(dir.path(), {mine[r]}));

  // Nobody asks for "only.<n-1>": every rank fails, naming it.
  std::vector<ShardedTensor> most;
  if (r < n - 1) most.push_back(mine[r]);
  Loaded got = LoadShards(dir.path(), most);
  EXPECT_EQ(got.status.code(), absl::StatusCode::kInvalidArgument) << got.status;
  EXPECT_THAT(got.status.message(), HasSubstr(absl::StrCat("'only.", n - 1, "'")));
  EXPECT_THAT(got.status.message(), HasSubstr("no rank asked for"));
  // Leniently, every rank learns the same list.
  LoadOptions lenient;
  lenient.matching = KeyMatching::kLenient;
  got = LoadShards(dir.path(), most, lenient);
  STRATA_EXPECT_OK(got.status);
  EXPECT_EQ(got.report.unexpected, std::vector<std::string>{absl::StrCat("only.", n - 1)});

  // The last rank asks for a tensor that was never saved: every rank fails.
  std::vector<ShardedTensor> extra = {mine[r]};
  if (r == n - 1) extra.push_back(ShardedTensor::Whole("never.saved", DataType::kFloat32, {4}));
  got = LoadShards(dir.path(), extra);
  EXPECT_EQ(got.status.code(), absl::StatusCode::kNotFound) << got.status;
  EXPECT_THAT(got.status.message(), HasSubstr("'never.saved'"));
  if (r != n - 1) {
    EXPECT_THAT(got.status.message(), HasSubstr(absl::StrCat("rank ", n - 1, " could not match")));
  }
  got = LoadShards(dir.path(), extra, lenient);
  STRATA_EXPECT_OK(got.status);
  EXPECT_EQ(got.report.missing.size(), r == n - 1 ? 1u : 0u);
}

// Errors met by one rank (a corrupt chunk only it reads) or by rank 0 (no
// checkpoint) end the load on every rank with the same code.
TEST_F(CheckpointMpiTest, ErrorsReachEveryRank) {
  SharedDir dir(world());
  const int n = size(), r = rank();
  Loaded got = LoadShards(dir.path(), {});
  EXPECT_EQ(got.status.code(), absl::StatusCode::kNotFound) << got.status;
  EXPECT_THAT(got.status.message(), HasSubstr("no committed checkpoint"));

  ShardedTensor w = ShardedTensor::Whole("w", DataType::kFloat32, {n, 2048});
  w.local_shape[0] = 1;
  w.global_offset[0] = r;
  STRATA_EXPECT_OK(SaveShards(dir.path(), 3, {w}));
  if (r == 0) {
    LoadOptions lo;
    lo.directory = dir.path();
    auto reader = CheckpointReader::Open(lo);
    EXPECT_TRUE(reader.ok()) << reader.status();
    if (reader.ok()) {
      // The file of the last rank's row; only the last rank reads it.
      const ManifestTensor* t = (*reader)->manifest().FindTensor("w");
      const ManifestShard& s = t->shards.back();
      const std::string path = dir / ("step-3/" + (*reader)->manifest().files[s.file].name);
      {
        std::FILE* f = std::fopen(path.c_str(), "r+b");
        std::fseek(f, static_cast<long>(s.begin + 100), SEEK_SET);
        const int c = std::fgetc(f);
        std::fseek(f, static_cast<long>(s.begin + 100), SEEK_SET);
        std::fputc(c ^ 0x5a, f);
        std::fclose(f);
      }
    }
  }
  (void)WaitFor(world().Barrier());
  got = LoadShards(dir.path(), {w});
  EXPECT_EQ(got.status.code(), absl::StatusCode::kDataLoss) << got.status;
  EXPECT_THAT(got.status.message(), HasSubstr("checksum mismatch"));
  if (r != n - 1) {
    EXPECT_THAT(got.status.message(), HasSubstr(absl::StrCat("rank ", n - 1, " failed to load")));
  }
}

// One rank failing to write makes the save fail on every rank (that rank
// with its error, the others Aborted with it) and leaves nothing; the next
// save commits.
TEST_F(CheckpointMpiTest, OneRankFailingAbandonsTheSaveEverywhere) {
  SharedDir dir(world());
  const int n = size(), r = rank();
  ShardedTensor w = ShardedTensor::Whole("w", DataType::kFloat32, {n, 64});
  w.local_shape[0] = 1;
  w.global_offset[0] = r;
  STRATA_EXPECT_OK(SaveShards(dir.path(), 1, {w}));
  CheckpointOptions failing;
  const int bad = n - 1;
  if (r == bad) {
    failing.test_hook = [](absl::string_view p) {
      return p == "files_written" ? absl::ResourceExhaustedError("disk full") : absl::OkStatus();
    };
  }
  absl::Status s = SaveShards(dir.path(), 2, {w}, &failing);
  if (r == bad) {
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  } else {
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
    EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("rank ", bad,
                                                    " failed to write its shards of "
                                                    "step 2 (RESOURCE_EXHAUSTED: disk full)")));
  }
  (void)WaitFor(world().Barrier());
  EXPECT_FALSE(checkpoint_internal::PathExists(dir / "step-2"));
  EXPECT_FALSE(checkpoint_internal::PathExists(dir / "step-2.tmp"));
  EXPECT_EQ(*LatestCheckpointStep(dir.path()), 1);
  STRATA_EXPECT_OK(SaveShards(dir.path(), 3, {w}));
  EXPECT_EQ(*LatestCheckpointStep(dir.path()), 3);
}

// Training's collectives on the world run while the writer's agreements run
// on the checkpoint's own communicator: both complete, with the right
// results, save after save.
TEST_F(CheckpointMpiTest, CheckpointTrafficDoesNotInterleaveWithTraining) {
  SharedDir dir(world());
  const int n = size(), r = rank();
  CheckpointOptions o;
  o.directory = dir.path();
  o.split_from = GroupHandle::Fixed(&world());
  o.keep_last = 2;
  o.commit_timeout = absl::Seconds(120);
  // Give the writer time to overlap with the allreduces below.
  o.test_hook = [](absl::string_view p) {
    if (p == "prepared") absl::SleepFor(absl::Milliseconds(20));
    return absl::OkStatus();
  };
  STRATA_ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpointer::Create(o));
  std::vector<float> w(1024, static_cast<float>(r));
  ShardedTensor s = ShardedTensor::Whole("w", DataType::kFloat32, {n, 1024});
  s.local_shape[0] = 1;
  s.global_offset[0] = r;
  for (int step = 1; step <= 4; ++step) {
    SaveRequest req;
    req.step = step;
    req.tensors.push_back({s, w.data()});
    STRATA_EXPECT_OK(ckpt->Save(req));
    for (int i = 0; i < 20; ++i) {  // "training" while the save runs
      int64_t v = r + i, sum = 0;
      STRATA_EXPECT_OK(WaitFor(world().AllReduce(ConstBuffer(&v, 1, DataType::kInt64),
                                                 Buffer::Of(&sum, 1), ReduceOp::kSum)));
      EXPECT_EQ(sum, int64_t{n} * (n - 1) / 2 + int64_t{n} * i);
    }
  }
  STRATA_EXPECT_OK(ckpt->Wait(Deadline()));
  EXPECT_EQ(ckpt->status().last_committed_step, 4);
  (void)WaitFor(world().Barrier());
  EXPECT_EQ(*ListCheckpointSteps(dir.path()), (std::vector<int64_t>{3, 4}));
}

}  // namespace
}  // namespace strata::testing
