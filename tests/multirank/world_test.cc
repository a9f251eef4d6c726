// strata::World on 8 ranks: every group of a dp2 x tp2 x pp2 mesh and of a
// mesh with expert parallelism holds exactly the ranks the Mesh says, in
// the Mesh's order, and works; worlds are rebuilt in one process.
#include "strata/parallel/world.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"
#include "harness.h"

namespace strata::testing {
namespace {

class WorldTest : public MultiRankTest {
 protected:
  static WorldOptions Options() {
    WorldOptions options;
    options.root = HarnessRootOptions();
    return options;
  }

  static Mesh MakeMesh(const MeshSpec& spec) {
    absl::StatusOr<Mesh> mesh = Mesh::Create(spec);
    EXPECT_TRUE(mesh.ok()) << mesh.status();
    return *mesh;
  }

  // For every group name: the communicator has this rank's mesh group, in
  // order (checked by gathering world ranks), and sums correctly.
  void CheckEveryGroup(const World& world) {
    const Mesh& mesh = world.mesh();
    for (const std::string& name : world.GroupNames()) {
      SCOPED_TRACE("group " + name);
      absl::StatusOr<Communicator*> comm = world.Group(name);
      ASSERT_TRUE(comm.ok()) << comm.status();
      const bool expert = absl::StartsWith(name, "e") || absl::StrContains(name, "-ep");
      std::string axes = name;
      if (expert) {
        absl::StrReplaceAll({{"etp", "tp"}, {"edp", "dp"}}, &axes);
      }
      absl::StatusOr<std::vector<int>> members =
          expert ? mesh.ExpertGroupOf(rank(), axes) : mesh.GroupOf(rank(), axes);
      ASSERT_TRUE(members.ok()) << members.status();
      ASSERT_EQ((*comm)->size(), static_cast<int>(members->size()));
      std::vector<int32_t> gathered(members->size(), -1);
      int32_t me = rank();
      STRATA_ASSERT_OK_AND_ASSIGN(auto gather,
                                  (*comm)->AllGather(ConstBuffer(&me, 1, DataType::kInt32),
                                                     Buffer::Of(gathered.data(), gathered.size())));
      STRATA_ASSERT_OK(Wait(*gather));
      EXPECT_EQ(std::vector<int>(gathered.begin(), gathered.end()), *members);
      int64_t value = 1 + rank(), sum = 0, want = 0;
      for (int r : *members) want += 1 + r;
      STRATA_ASSERT_OK_AND_ASSIGN(auto reduce,
                                  (*comm)->AllReduce(ConstBuffer(&value, 1, DataType::kInt64),
                                                     Buffer::Of(&sum, 1), ReduceOp::kSum));
      STRATA_ASSERT_OK(Wait(*reduce));
      EXPECT_EQ(sum, want);
    }
  }
};

TEST_F(WorldTest, DenseMeshDp2Tp2Pp2) {
  if (size() != 8) GTEST_SKIP() << "needs 8 ranks";
  MeshSpec spec;
  spec.world_size = 8;
  spec.tp = 2;
  spec.pp = 2;
  absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
  ASSERT_TRUE(env.ok());
  STRATA_ASSERT_OK_AND_ASSIGN(auto world, World::Create(*env, MakeMesh(spec), Options()));
  EXPECT_EQ(world->rank(), rank());
  EXPECT_EQ(world->size(), 8);
  const std::vector<std::string> want = {"tp",       "cp", "dp",  "pp",  "dp-cp", "tp-pp",
                                         "tp-dp-cp", "ep", "etp", "edp", "etp-ep"};
  EXPECT_EQ(world->GroupNames(), want);
  CheckEveryGroup(*world);
  // Any spelling of a combination; "world" is the root.
  STRATA_ASSERT_OK_AND_ASSIGN(Communicator * a, world->Group("cp-dp"));
  STRATA_ASSERT_OK_AND_ASSIGN(Communicator * b, world->Group("dp-cp"));
  EXPECT_EQ(a, b);
  STRATA_ASSERT_OK_AND_ASSIGN(Communicator * root, world->Group("world"));
  EXPECT_EQ(root, &world->root());
  absl::StatusOr<Communicator*> missing = world->Group("tp-cp");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(missing.status().message(), "extra_groups")) << missing.status();
  EXPECT_EQ(world->Group("tp-ep").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(world->Group("xp").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(WorldTest, ExpertMesh) {
  if (size() != 8) GTEST_SKIP() << "needs 8 ranks";
  // tp 2, cp 2 (dp 2), ep 4 carved out of dp*cp, expert-TP 1.
  MeshSpec spec;
  spec.world_size = 8;
  spec.tp = 2;
  spec.cp = 2;
  spec.ep = 4;
  spec.etp = 1;
  WorldOptions options = Options();
  options.extra_groups = {"tp-cp"};
  absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
  ASSERT_TRUE(env.ok());
  STRATA_ASSERT_OK_AND_ASSIGN(auto world, World::Create(*env, MakeMesh(spec), options));
  CheckEveryGroup(*world);
  STRATA_ASSERT_OK_AND_ASSIGN(Communicator * ep, world->Group("ep"));
  EXPECT_EQ(ep->size(), 4);
  STRATA_ASSERT_OK_AND_ASSIGN(Communicator * tp_cp, world->Group("cp-tp"));
  EXPECT_EQ(tp_cp->size(), 4);
}

TEST_F(WorldTest, RebuiltInOneProcessAndMisuseIsNamed) {
  MeshSpec spec;
  spec.world_size = size();
  absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
  ASSERT_TRUE(env.ok());
  for (int round = 0; round < 3; ++round) {
    STRATA_ASSERT_OK_AND_ASSIGN(auto world, World::Create(*env, MakeMesh(spec), Options()));
    CheckEveryGroup(*world);
  }
  MeshSpec other;
  other.world_size = size() * 2;
  auto wrong = World::Create(*env, MakeMesh(other), Options());
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(wrong.status().message(), "the mesh is for")) << wrong.status();
  WorldOptions bad = Options();
  bad.extra_groups = {"tp-zz"};
  EXPECT_EQ(World::Create(*env, MakeMesh(spec), bad).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::testing
