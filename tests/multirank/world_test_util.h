// Helpers of the World tests (world_test.cc, world_rebuild_test.cc).
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "harness.h"
#include "strata/parallel/world.h"

namespace strata::testing {

inline WorldOptions WorldTestOptions() {
  WorldOptions options;
  options.root = HarnessRootOptions();
  return options;
}

inline Mesh MakeMesh(const MeshSpec& spec) {
  absl::StatusOr<Mesh> mesh = Mesh::Create(spec);
  EXPECT_TRUE(mesh.ok()) << mesh.status();
  return *mesh;
}

// This rank's members of `comm`, in group order, as gathered world ranks
// of `world` (its current generation).
inline std::vector<int> GatherMembers(World& world, Communicator& comm) {
  std::vector<int32_t> gathered(comm.size(), -1);
  int32_t me = world.rank();
  absl::StatusOr<std::unique_ptr<Work>> gather = comm.AllGather(
      ConstBuffer(&me, 1, DataType::kInt32), Buffer::Of(gathered.data(), gathered.size()));
  EXPECT_TRUE(gather.ok()) << gather.status();
  if (gather.ok()) {
    absl::Status s = (*gather)->Wait(absl::Now() + absl::Seconds(120));
    EXPECT_TRUE(s.ok()) << s;
  }
  return std::vector<int>(gathered.begin(), gathered.end());
}

// The members the mesh gives `rank` for group `name` (canonical).
inline std::vector<int> MeshMembers(const Mesh& mesh, int rank, const std::string& name) {
  if (name == "world") {
    std::vector<int> all(mesh.world_size());
    for (int r = 0; r < mesh.world_size(); ++r) all[r] = r;
    return all;
  }
  bool expert = false;
  std::string axes;
  for (absl::string_view t : absl::StrSplit(name, '-')) {
    std::string a(t);
    if (a == "ep" || a == "etp" || a == "edp") expert = true;
    if (a == "etp") a = "tp";
    if (a == "edp") a = "dp";
    absl::StrAppend(&axes, axes.empty() ? "" : "-", a);
  }
  absl::StatusOr<std::vector<int>> members =
      expert ? mesh.ExpertGroupOf(rank, axes) : mesh.GroupOf(rank, axes);
  EXPECT_TRUE(members.ok()) << name << ": " << members.status();
  return members.ok() ? *members : std::vector<int>{};
}

// For each name: the group (created on request where new) has this rank's
// mesh group in order, is named by its canonical name, and sums correctly.
// Every rank must pass the same names.
inline void CheckGroup(World& world, Communicator& comm, const std::string& name) {
  SCOPED_TRACE("group " + name);
  const Mesh mesh = world.mesh();
  const std::vector<int> members = MeshMembers(mesh, world.rank(), name);
  EXPECT_EQ(comm.name(), name);
  ASSERT_EQ(comm.size(), static_cast<int>(members.size()));
  EXPECT_EQ(GatherMembers(world, comm), members);
  int64_t value = 1 + world.rank(), sum = 0, want = 0;
  for (int r : members) want += 1 + r;
  absl::StatusOr<std::unique_ptr<Work>> reduce =
      comm.AllReduce(ConstBuffer(&value, 1, DataType::kInt64), Buffer::Of(&sum, 1), ReduceOp::kSum);
  ASSERT_TRUE(reduce.ok()) << reduce.status();
  absl::Status s = (*reduce)->Wait(absl::Now() + absl::Seconds(120));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(sum, want);
}

inline void CheckGroups(World& world, const std::vector<std::string>& names) {
  for (const std::string& asked : names) {
    absl::StatusOr<std::string> name = World::CanonicalGroupName(asked);
    ASSERT_TRUE(name.ok()) << name.status();
    absl::StatusOr<Communicator*> comm = world.Group(asked);
    ASSERT_TRUE(comm.ok()) << comm.status();
    CheckGroup(world, **comm, *name);
  }
}

}  // namespace strata::testing
