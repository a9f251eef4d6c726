#include "strata/comm/launch_env.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace strata {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using Env = std::map<std::string, std::string>;

Env Mpirun(int rank, int size, int local_rank, int local_size) {
  return {{"OMPI_COMM_WORLD_RANK", std::to_string(rank)},
          {"OMPI_COMM_WORLD_SIZE", std::to_string(size)},
          {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(local_rank)},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", std::to_string(local_size)}};
}

Env Torchrun(int rank, int size, int local_rank, int local_size) {
  return {{"RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(size)},
          {"LOCAL_RANK", std::to_string(local_rank)},
          {"LOCAL_WORLD_SIZE", std::to_string(local_size)},
          {"GROUP_RANK", std::to_string(rank / local_size)},
          {"GROUP_WORLD_SIZE", std::to_string(size / local_size)},
          {"MASTER_ADDR", "10.0.0.1"},
          {"MASTER_PORT", "29500"}};
}

Env Slurm(int rank, int size, int local_rank, int node) {
  return {{"SLURM_PROCID", std::to_string(rank)},
          {"SLURM_NTASKS", std::to_string(size)},
          {"SLURM_LOCALID", std::to_string(local_rank)},
          {"SLURM_NODEID", std::to_string(node)},
          {"SLURM_NNODES", "2"},
          {"SLURM_TASKS_PER_NODE", "4(x2)"},
          {"SLURM_JOB_NODELIST", "gpu[007-008]"}};
}

Env Merge(Env a, const Env& b) {
  a.insert(b.begin(), b.end());
  return a;
}

std::string ErrorOf(const Env& env) {
  absl::StatusOr<LaunchEnv> e = LaunchEnv::Detect(env);
  EXPECT_FALSE(e.ok()) << e->ToString();
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(e.status().message());
}

TEST(LaunchEnvTest, NoLauncherIsOneProcess) {
  LaunchEnv e = LaunchEnv::Detect(Env{}).value();
  EXPECT_EQ(e.launcher, Launcher::kNone);
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.local_world_size, 1);
  EXPECT_EQ(e.num_nodes, 1);
}

TEST(LaunchEnvTest, Mpirun) {
  LaunchEnv e = LaunchEnv::Detect(Mpirun(5, 8, 1, 4)).value();
  EXPECT_EQ(e.launcher, Launcher::kMpirun);
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.node_index, 1);
  EXPECT_EQ(e.num_nodes, 2);
  EXPECT_FALSE(e.node_index_exact);
  EXPECT_TRUE(e.master_addr.empty());
}

TEST(LaunchEnvTest, Torchrun) {
  LaunchEnv e = LaunchEnv::Detect(Torchrun(6, 8, 2, 4)).value();
  EXPECT_EQ(e.launcher, Launcher::kTorchrun);
  EXPECT_EQ(e.rank, 6);
  EXPECT_EQ(e.local_rank, 2);
  EXPECT_EQ(e.node_index, 1);
  EXPECT_EQ(e.num_nodes, 2);
  EXPECT_TRUE(e.node_index_exact);
  EXPECT_EQ(e.master_addr, "10.0.0.1");
  EXPECT_EQ(e.master_port, 29500);
}

TEST(LaunchEnvTest, HandMadeTorchStyleLaunchIsOneNode) {
  Env env = {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1234"}};
  LaunchEnv e = LaunchEnv::Detect(env).value();
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.num_nodes, 1);
}

TEST(LaunchEnvTest, Slurm) {
  LaunchEnv e = LaunchEnv::Detect(Slurm(6, 8, 2, 1)).value();
  EXPECT_EQ(e.launcher, Launcher::kSlurm);
  EXPECT_EQ(e.rank, 6);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.node_index, 1);
  EXPECT_EQ(e.num_nodes, 2);
  EXPECT_EQ(e.master_addr, "gpu007");
  EXPECT_EQ(e.master_port, 0);
  Env with_port = Merge(Slurm(0, 8, 0, 0), {{"MASTER_PORT", "6000"}, {"MASTER_ADDR", "head"}});
  e = LaunchEnv::Detect(with_port).value();
  EXPECT_EQ(e.master_addr, "head");
  EXPECT_EQ(e.master_port, 6000);
}

TEST(LaunchEnvTest, TorchrunUnderSrunTakesTorchrun) {
  // srun starts one torchrun agent per node (2 tasks); torchrun starts 8.
  Env outer = Slurm(1, 2, 0, 1);
  outer["SLURM_TASKS_PER_NODE"] = "1(x2)";
  LaunchEnv e = LaunchEnv::Detect(Merge(Torchrun(5, 8, 1, 4), outer)).value();
  EXPECT_EQ(e.launcher, Launcher::kTorchrun);
  EXPECT_EQ(e.rank, 5);
}

TEST(LaunchEnvTest, SrunWithOpenMpiAgrees) {
  LaunchEnv e = LaunchEnv::Detect(Merge(Mpirun(6, 8, 2, 4), Slurm(6, 8, 2, 1))).value();
  EXPECT_EQ(e.launcher, Launcher::kMpirun);
  EXPECT_EQ(e.rank, 6);
}

TEST(LaunchEnvTest, ForcedLauncher) {
  Env env = Merge(Merge(Mpirun(6, 8, 2, 4), Slurm(6, 8, 2, 1)), {{"STRATA_LAUNCHER", "slurm"}});
  EXPECT_EQ(LaunchEnv::Detect(env).value().launcher, Launcher::kSlurm);
  env["STRATA_LAUNCHER"] = "none";
  EXPECT_EQ(LaunchEnv::Detect(env).value().world_size, 1);
  env["STRATA_LAUNCHER"] = "torchrun";
  EXPECT_THAT(ErrorOf(env), HasSubstr("STRATA_LAUNCHER=torchrun but none"));
  env["STRATA_LAUNCHER"] = "pbs";
  EXPECT_THAT(ErrorOf(env), HasSubstr("'pbs' is not one of"));
}

TEST(LaunchEnvTest, LocalRanksInAnyOrderWithinTheNode) {
  // Plain `mpirun -np 4` under Open MPI 5 numbers the ranks of a node by the
  // objects it maps them to: ranks 0..3 get local ranks 0, 2, 1, 3.
  const int local_of[4] = {0, 2, 1, 3};
  for (int rank = 0; rank < 4; ++rank) {
    absl::StatusOr<LaunchEnv> e = LaunchEnv::Detect(Mpirun(rank, 4, local_of[rank], 4));
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ(e->local_rank, local_of[rank]);
    EXPECT_EQ(e->node_index, 0);
    EXPECT_EQ(e->num_nodes, 1);
    EXPECT_TRUE(e->node_index_exact);  // every rank is on this node
  }
  // Two nodes of 4: the node comes from the rank, not from rank - local rank
  // (which gave node 0 for rank 5 with local rank 2).
  LaunchEnv two = LaunchEnv::Detect(Mpirun(5, 8, 2, 4)).value();
  EXPECT_EQ(two.node_index, 1);
  EXPECT_EQ(two.num_nodes, 2);
  EXPECT_FALSE(two.node_index_exact);  // mpirun gives no node index
  // torchrun and Slurm promise no order either.
  Env torchrun = Torchrun(4, 8, 3, 4);
  torchrun["GROUP_RANK"] = "1";
  torchrun["RANK"] = "1";
  LaunchEnv t = LaunchEnv::Detect(torchrun).value();
  EXPECT_EQ(t.rank, 1);
  EXPECT_EQ(t.local_rank, 3);
  EXPECT_EQ(t.node_index, 1);
  EXPECT_TRUE(t.node_index_exact);
  LaunchEnv s = LaunchEnv::Detect(Slurm(1, 8, 3, 0)).value();
  EXPECT_EQ(s.local_rank, 3);
  EXPECT_EQ(s.node_index, 0);
}

TEST(LaunchEnvTest, NodeIndexOnlyWhereTheLauncherGivesIt) {
  // torchrun-style variables with LOCAL_* that cover the world: one node, exact.
  Env local_only = {{"RANK", "2"},        {"WORLD_SIZE", "4"},
                    {"LOCAL_RANK", "2"},  {"LOCAL_WORLD_SIZE", "4"},
                    {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}};
  LaunchEnv e = LaunchEnv::Detect(local_only).value();
  EXPECT_EQ(e.num_nodes, 1);
  EXPECT_TRUE(e.node_index_exact);
  // RANK/WORLD_SIZE alone: taken as one node, which is an assumption.
  Env hand_made = {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}};
  e = LaunchEnv::Detect(hand_made).value();
  EXPECT_EQ(e.num_nodes, 1);
  EXPECT_FALSE(e.node_index_exact);
  // A Slurm step on 2 nodes of a 4-node job (srun --preserve-env leaves the
  // job's SLURM_NNODES/SLURM_NTASKS): the step's own variables count.
  Env step = Slurm(5, 16, 1, 1);
  step["SLURM_NNODES"] = "4";
  step["SLURM_STEP_NUM_NODES"] = "2";
  step["SLURM_STEP_NUM_TASKS"] = "8";
  step["SLURM_STEP_TASKS_PER_NODE"] = "4(x2)";
  e = LaunchEnv::Detect(step).value();
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.num_nodes, 2);
  EXPECT_EQ(e.node_index, 1);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_TRUE(e.node_index_exact);
}

TEST(LaunchEnvTest, RankNotBelowWorld) {
  EXPECT_THAT(ErrorOf(Mpirun(8, 8, 0, 8)), AllOf(HasSubstr("rank 8 is not in [0, world size 8)"),
                                                 HasSubstr("OMPI_COMM_WORLD_RANK=8")));
  EXPECT_THAT(ErrorOf(Torchrun(9, 8, 1, 8)), HasSubstr("rank 9 is not in [0, world size 8)"));
  EXPECT_THAT(ErrorOf(Slurm(8, 8, 0, 1)), HasSubstr("rank 8 is not in [0, world size 8)"));
}

TEST(LaunchEnvTest, LocalRankAndNodeRanges) {
  EXPECT_THAT(ErrorOf(Mpirun(3, 8, 4, 4)), HasSubstr("local rank 4 is not in [0, local world"));
  EXPECT_THAT(ErrorOf(Mpirun(3, 8, 3, 16)), HasSubstr("local world size 16 is not in [1"));
  Env bad_node = Slurm(3, 8, 3, 2);
  EXPECT_THAT(ErrorOf(bad_node), HasSubstr("beyond the Slurm tasks-per-node list"));
  Env zero = Mpirun(0, 0, 0, 1);
  EXPECT_THAT(ErrorOf(zero), HasSubstr("world size 0 < 1"));
}

TEST(LaunchEnvTest, MissingPortUnderTorchrun) {
  Env env = Torchrun(0, 2, 0, 2);
  env.erase("MASTER_PORT");
  EXPECT_THAT(ErrorOf(env), HasSubstr("MASTER_PORT is not set"));
  env = Torchrun(0, 2, 0, 2);
  env.erase("MASTER_ADDR");
  EXPECT_THAT(ErrorOf(env), HasSubstr("MASTER_ADDR is not set"));
  env = Torchrun(0, 2, 0, 2);
  env["MASTER_PORT"] = "70000";
  EXPECT_THAT(ErrorOf(env), HasSubstr("MASTER_PORT=70000 is not a TCP port"));
}

TEST(LaunchEnvTest, NonNumericValues) {
  Env env = Mpirun(0, 2, 0, 2);
  env["OMPI_COMM_WORLD_SIZE"] = "two";
  EXPECT_THAT(ErrorOf(env), HasSubstr("OMPI_COMM_WORLD_SIZE='two' is not an integer"));
  env = Torchrun(0, 2, 0, 2);
  env["LOCAL_RANK"] = "0x";
  EXPECT_THAT(ErrorOf(env), HasSubstr("LOCAL_RANK='0x' is not an integer"));
  env = Slurm(0, 8, 0, 0);
  env["SLURM_NODEID"] = "";
  EXPECT_THAT(ErrorOf(env), HasSubstr("SLURM_NODEID='' is not an integer"));
}

TEST(LaunchEnvTest, MissingCompanionVariables) {
  Env env = Mpirun(0, 2, 0, 2);
  env.erase("OMPI_COMM_WORLD_LOCAL_RANK");
  EXPECT_THAT(ErrorOf(env), HasSubstr("OMPI_COMM_WORLD_LOCAL_RANK is not set"));
  env = Torchrun(0, 2, 0, 2);
  env.erase("WORLD_SIZE");
  EXPECT_THAT(ErrorOf(env), HasSubstr("WORLD_SIZE is not set"));
  env = Torchrun(0, 2, 0, 2);
  env.erase("LOCAL_WORLD_SIZE");
  EXPECT_THAT(ErrorOf(env), HasSubstr("LOCAL_RANK and LOCAL_WORLD_SIZE must be set together"));
}

TEST(LaunchEnvTest, LaunchersDisagree) {
  // A stale RANK exported in the shell while mpirun starts 8 ranks.
  Env env = Merge(Mpirun(5, 8, 5, 8), Torchrun(3, 8, 3, 8));
  EXPECT_THAT(ErrorOf(env), AllOf(HasSubstr("launchers disagree"), HasSubstr("RANK=3"),
                                  HasSubstr("OMPI_COMM_WORLD_RANK=5")));
  env = Merge(Mpirun(5, 8, 1, 4), Slurm(6, 8, 2, 1));
  EXPECT_THAT(ErrorOf(env),
              AllOf(HasSubstr("mpirun says rank 5 of 8"), HasSubstr("slurm says rank 6 of 8")));
}

TEST(SlurmNodeListTest, FirstHost) {
  EXPECT_EQ(FirstHostOfSlurmNodeList("node1").value(), "node1");
  EXPECT_EQ(FirstHostOfSlurmNodeList("node1,node2").value(), "node1");
  EXPECT_EQ(FirstHostOfSlurmNodeList("gpu[003-005,010],cpu1").value(), "gpu003");
  EXPECT_EQ(FirstHostOfSlurmNodeList("rack[7]-gpu").value(), "rack7-gpu");
  EXPECT_EQ(FirstHostOfSlurmNodeList("a[12,3]").value(), "a12");
  EXPECT_FALSE(FirstHostOfSlurmNodeList("gpu[003-005").ok());
  EXPECT_FALSE(FirstHostOfSlurmNodeList("gpu[x-y]").ok());
  EXPECT_FALSE(FirstHostOfSlurmNodeList("").ok());
  EXPECT_FALSE(FirstHostOfSlurmNodeList("[1-2]").ok());
}

TEST(SlurmNodeListTest, TasksPerNode) {
  EXPECT_EQ(SlurmTasksOnNode("4", 0).value(), 4);
  EXPECT_EQ(SlurmTasksOnNode("2(x3),1", 2).value(), 2);
  EXPECT_EQ(SlurmTasksOnNode("2(x3),1", 3).value(), 1);
  EXPECT_FALSE(SlurmTasksOnNode("2(x3),1", 4).ok());
  EXPECT_FALSE(SlurmTasksOnNode("2(3)", 0).ok());
  EXPECT_FALSE(SlurmTasksOnNode("a", 0).ok());
  EXPECT_EQ(SlurmTasksOnNode("8,4(x2)", 2).value(), 4);
  EXPECT_EQ(SlurmTasksOnNode(" 8, 4(x2) ", 1).value(), 4);
  EXPECT_FALSE(SlurmTasksOnNode("2(x0)", 0).ok());
  EXPECT_FALSE(SlurmTasksOnNode("2(x3", 0).ok());
  EXPECT_FALSE(SlurmTasksOnNode("", 0).ok());
  // A negative node is not the first node.
  absl::StatusOr<int> negative = SlurmTasksOnNode("4", -1);
  ASSERT_FALSE(negative.ok());
  EXPECT_THAT(negative.status().message(), HasSubstr("node -1 is not a node"));
}

}  // namespace
}  // namespace strata
