// Whether the ranks on a host outnumber its cores: the launcher's local
// rank counts, the CPU limits (affinity, cgroup v1 and v2 quotas along the
// cgroup's ancestors) and the STRATA_OVERSUBSCRIBED override.
#include "comm/common/host_share.h"

#include <sched.h>

#include <array>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "comm/root_settings.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::comm_internal {
namespace {

using ::testing::HasSubstr;

namespace fs = std::filesystem;

class FakeCgroups : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("strata_cgroup_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
             "_" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  void Write(const std::string& relative, const std::string& text) {
    const fs::path p = root_ / relative;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  std::string root() const { return root_.string(); }

 private:
  fs::path root_;
};

TEST_F(FakeCgroups, V2QuotaIsTheTightestAlongTheAncestors) {
  const std::string self = "0::/kubepods/pod1/ctr\n";
  EXPECT_FALSE(CgroupCpuQuota(self, root()).has_value());  // no files: no limit
  Write("kubepods/pod1/ctr/cpu.max", "max 100000\n");
  EXPECT_FALSE(CgroupCpuQuota(self, root()).has_value());  // "max": no limit
  Write("kubepods/pod1/cpu.max", "250000 100000\n");
  EXPECT_DOUBLE_EQ(*CgroupCpuQuota(self, root()), 2.5);  // the parent's limit applies
  Write("kubepods/cpu.max", "150000 100000\n");
  EXPECT_DOUBLE_EQ(*CgroupCpuQuota(self, root()), 1.5);
  Write("kubepods/pod1/ctr/cpu.max", "50000 100000\n");
  EXPECT_DOUBLE_EQ(*CgroupCpuQuota(self, root()), 0.5);
  // A container with its own cgroup namespace sees itself at the root.
  Write("cpu.max", "400000 100000\n");
  EXPECT_DOUBLE_EQ(*CgroupCpuQuota("0::/\n", root()), 4.0);
}

TEST_F(FakeCgroups, V1QuotaOverPeriod) {
  const std::string self = "12:memory:/job\n4:cpu,cpuacct:/job/step\n";
  Write("cpu,cpuacct/job/step/cpu.cfs_quota_us", "-1\n");
  Write("cpu,cpuacct/job/step/cpu.cfs_period_us", "100000\n");
  EXPECT_FALSE(CgroupCpuQuota(self, root()).has_value());  // -1: no limit
  Write("cpu,cpuacct/job/cpu.cfs_quota_us", "300000\n");
  Write("cpu,cpuacct/job/cpu.cfs_period_us", "100000\n");
  EXPECT_DOUBLE_EQ(*CgroupCpuQuota(self, root()), 3.0);
  // Only the "cpu" controller's hierarchy counts.
  EXPECT_FALSE(CgroupCpuQuota("12:memory:/job/step\n", root()).has_value());
  // Garbage is no limit, not a crash.
  Write("cpu,cpuacct/job/cpu.cfs_quota_us", "lots\n");
  EXPECT_FALSE(CgroupCpuQuota(self, root()).has_value());
  EXPECT_FALSE(CgroupCpuQuota("not a cgroup line\n", root()).has_value());
}

HostShare Share(const std::map<std::string, std::string>& env, int online, int allowed,
                std::optional<double> quota) {
  return ComputeHostShare(
      [&](const char* name) -> const char* {
        auto it = env.find(name);
        return it == env.end() ? nullptr : it->second.c_str();
      },
      online, allowed, quota);
}

TEST(HostShareTest, RanksAgainstTheFewestCores) {
  // 4 Open MPI ranks on a 64-CPU host: fine, unless a limit leaves fewer.
  const std::map<std::string, std::string> ompi = {{"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}};
  EXPECT_FALSE(Share(ompi, 64, 64, std::nullopt).oversubscribed());
  HostShare pinned = Share(ompi, 64, 2, std::nullopt);
  EXPECT_TRUE(pinned.oversubscribed());
  EXPECT_EQ(pinned.cores, 2);
  EXPECT_EQ(pinned.cores_from, "CPU affinity");
  HostShare quota = Share(ompi, 64, 64, 2.5);  // rounds up: 3 cores
  EXPECT_EQ(quota.cores, 3);
  EXPECT_TRUE(quota.oversubscribed());
  EXPECT_TRUE(
      absl::StrContains(quota.Describe(), "4 ranks on this host, 3 cores (cgroup quota 2.5"))
      << quota.Describe();
  EXPECT_EQ(Share(ompi, 64, 64, 0.2).cores, 1);             // at least one core
  EXPECT_FALSE(Share(ompi, 64, 64, 4.0).oversubscribed());  // 4 ranks on 4: not over
  // Slurm, then torchrun, when Open MPI does not say.
  EXPECT_EQ(
      Share({{"SLURM_STEP_TASKS_PER_NODE", "8(x2)"}, {"SLURM_NODEID", "1"}}, 4, 4, std::nullopt)
          .local_ranks,
      8);
  EXPECT_EQ(Share({{"LOCAL_WORLD_SIZE", "3"}}, 2, 2, std::nullopt).local_ranks, 3);
  EXPECT_EQ(
      Share({{"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "3"}}, 2, 2, std::nullopt)
          .local_ranks,
      2);
  // Unknown ranks per host: never oversubscribed by detection.
  HostShare unknown = Share({}, 1, 1, std::nullopt);
  EXPECT_FALSE(unknown.oversubscribed());
  EXPECT_TRUE(absl::StrContains(unknown.Describe(), "ranks per host unknown"));
}

TEST(HostShareTest, SlurmTasksPerNodeIsReadAsLaunchEnvReadsIt) {
  // The same parser as LaunchEnv (strata::SlurmTasksOnNode), with its errors:
  // a list that does not describe this node is reported, not taken as
  // "unknown".
  auto slurm = [](const char* spec, const char* node) {
    return Share({{"SLURM_STEP_TASKS_PER_NODE", spec}, {"SLURM_NODEID", node}}, 64, 64,
                 std::nullopt);
  };
  EXPECT_EQ(slurm("8,4(x2)", "2").local_ranks, 4);
  EXPECT_TRUE(slurm("8,4(x2)", "2").invalid_env.empty());
  for (const auto& [spec, node, expected] : std::vector<std::array<const char*, 3>>{
           {"2(x3),1", "4", "node 4 is beyond the Slurm tasks-per-node list '2(x3),1'"},
           {"2(x0)", "0", "malformed Slurm tasks-per-node entry '2(x0)'"},
           {"2(x3", "0", "malformed Slurm tasks-per-node entry '2(x3'"},
           {"", "0", "malformed Slurm tasks-per-node entry ''"},
           {"4", "-1", "node -1 is not a node of the Slurm tasks-per-node list '4'"},
           {"4", "one", "SLURM_NODEID='one' is not an integer"}}) {
    HostShare s = slurm(spec, node);
    EXPECT_EQ(s.local_ranks, 0) << spec << " " << node;
    EXPECT_THAT(s.invalid_env, HasSubstr(expected)) << spec << " " << node;
  }
  // Open MPI's count comes first; Slurm's is not read then.
  HostShare both = Share({{"OMPI_COMM_WORLD_LOCAL_SIZE", "8"},
                          {"SLURM_STEP_TASKS_PER_NODE", "x"},
                          {"SLURM_NODEID", "0"}},
                         2, 2, std::nullopt);
  EXPECT_EQ(both.local_ranks, 8);
  EXPECT_TRUE(both.invalid_env.empty());
}

// STRATA_OVERSUBSCRIBED is a setting: detection ignores it, and root
// creation puts it into MpiOptions::oversubscribed unless the caller set
// that, which the MPI backend then takes instead of detecting.
TEST(HostShareTest, TheEnvironmentOverridesDetectionThroughTheRootOptions) {
  EXPECT_FALSE(Share({{"STRATA_OVERSUBSCRIBED", "1"}}, 64, 64, std::nullopt).oversubscribed());
  auto resolved = [](std::map<std::string, std::string> env, RootOptions options) {
    absl::StatusOr<Settings> settings = Settings::FromMap(env);
    EXPECT_TRUE(settings.ok()) << settings.status();
    return ResolveRootOptions(options, *settings).mpi.oversubscribed;
  };
  EXPECT_EQ(resolved({{"STRATA_OVERSUBSCRIBED", "1"}}, {}), std::optional<bool>(true));
  EXPECT_EQ(resolved({{"STRATA_OVERSUBSCRIBED", "false"}}, {}), std::optional<bool>(false));
  EXPECT_EQ(resolved({}, {}), std::nullopt);  // detected by the backend
  RootOptions told;
  told.mpi.oversubscribed = false;
  EXPECT_EQ(resolved({{"STRATA_OVERSUBSCRIBED", "1"}}, told), std::optional<bool>(false));
  absl::StatusOr<Settings> bad = Settings::FromMap({{"STRATA_OVERSUBSCRIBED", "yes"}});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.status().message(),
                                "STRATA_OVERSUBSCRIBED='yes' is not a boolean (0/1/true/false)"))
      << bad.status();
}

// The real detection: pinned to one CPU, this process has one core.
TEST(HostShareTest, ThisProcessPinnedToOneCpuHasOneCore) {
  cpu_set_t saved;
  ASSERT_EQ(sched_getaffinity(0, sizeof(saved), &saved), 0);
  const HostShare before = DetectHostShare();
  EXPECT_GE(before.cores, 1);
  EXPECT_LE(before.cores, CPU_COUNT(&saved));
  if (CPU_COUNT(&saved) < 2) GTEST_SKIP() << "one CPU only: pinning changes nothing";
  int first = 0;
  while (!CPU_ISSET(first, &saved)) ++first;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
  const HostShare pinned = DetectHostShare();
  ASSERT_EQ(sched_setaffinity(0, sizeof(saved), &saved), 0);
  EXPECT_EQ(pinned.cores, 1);
  EXPECT_EQ(pinned.cores_from, "CPU affinity");
}

}  // namespace
}  // namespace strata::comm_internal
