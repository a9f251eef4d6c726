// PrepareNcclCommunicator: the profile is applied and logged once per
// process, user values win, the opt-out works, and every communicator gets
// its config fields.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "comm/nccl_tuning/nccl_setup_internal.h"
#include "strata/comm/nccl_profile.h"

namespace strata {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;

class NcclSetup : public testing::Test {
 protected:
  void SetUp() override {
    nccl_tuning_internal::ResetNcclSetupForTesting();
    unsetenv("NCCL_IB_HCA");
    unsetenv("STRATA_NCCL_PROFILE");
  }
  void TearDown() override { SetUp(); }

  NcclCommSetupOptions Options(const std::string& machine, const std::string& name) {
    NcclCommSetupOptions o;
    o.detect.sysfs_root = std::string(STRATA_TOPOLOGY_FIXTURES) + "/" + machine + "/sys";
    o.detect.use_nvml = false;
    o.nccl_version = NcclVersion{2, 28, 9};
    o.comm_name = name;
    o.log = [this](absl::string_view line) { log_.emplace_back(line); };
    return o;
  }
  std::vector<std::string> log_;
};

TEST_F(NcclSetup, AppliesOnceAndGivesEachCommunicatorItsFields) {
  absl::StatusOr<NcclCommSetup> first = PrepareNcclCommunicator(Options("dgx_h100", "world"));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(first->first_in_process);
  ASSERT_NE(std::getenv("NCCL_IB_HCA"), nullptr);
  EXPECT_STREQ(std::getenv("NCCL_IB_HCA"),
               "=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7");
  EXPECT_THAT(first->env_set, Contains("NCCL_IB_HCA"));
  EXPECT_EQ(*first->config.comm_name, "world");
  EXPECT_EQ(*first->config.net_name, "IB");
  EXPECT_EQ(*first->config.blocking, 0);
  EXPECT_THAT(log_, Contains(HasSubstr("topology class multi-node-infiniband")));
  EXPECT_THAT(log_, Contains(HasSubstr("set NCCL_IB_HCA==mlx5_0")));
  const size_t lines = log_.size();

  absl::StatusOr<NcclCommSetup> second = PrepareNcclCommunicator(Options("dgx_h100", "tp"));
  ASSERT_TRUE(second.ok());
  EXPECT_FALSE(second->first_in_process);
  EXPECT_EQ(*second->config.comm_name, "tp");
  EXPECT_EQ(log_.size(), lines);  // logged once per process
}

TEST_F(NcclSetup, UserValuesWin) {
  setenv("NCCL_IB_HCA", "mlx5_3", 1);
  absl::StatusOr<NcclCommSetup> s = PrepareNcclCommunicator(Options("dgx_h100", "world"));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_STREQ(std::getenv("NCCL_IB_HCA"), "mlx5_3");
  EXPECT_TRUE(s->env_set.empty());
  EXPECT_THAT(log_, Contains(HasSubstr("kept NCCL_IB_HCA=mlx5_3 (yours")));
}

TEST_F(NcclSetup, OptOut) {
  setenv("STRATA_NCCL_PROFILE", "0", 1);
  absl::StatusOr<NcclCommSetup> s = PrepareNcclCommunicator(Options("dgx_h100", "world"));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(std::getenv("NCCL_IB_HCA"), nullptr);
  EXPECT_FALSE(s->config.net_name.has_value());  // tuning fields off
  EXPECT_EQ(*s->config.comm_name, "world");      // naming stays
  EXPECT_THAT(log_, Contains(HasSubstr("profile disabled")));
}

TEST_F(NcclSetup, AMalformedOptOutIsRejected) {
  setenv("STRATA_NCCL_PROFILE", "no", 1);
  absl::StatusOr<NcclCommSetup> s = PrepareNcclCommunicator(Options("dgx_h100", "world"));
  EXPECT_TRUE(absl::IsInvalidArgument(s.status()));
  EXPECT_THAT(s.status().message(),
              HasSubstr("STRATA_NCCL_PROFILE='no' is not a boolean (0/1/true/false)"));
  EXPECT_EQ(std::getenv("NCCL_IB_HCA"), nullptr);
}

TEST_F(NcclSetup, DetectionFailureIsReturned) {
  NcclCommSetupOptions o = Options("no_such_machine", "world");
  absl::StatusOr<NcclCommSetup> s = PrepareNcclCommunicator(o);
  EXPECT_TRUE(absl::IsNotFound(s.status()));
  EXPECT_THAT(s.status().message(), HasSubstr("detecting the topology for NCCL: sysfs root"));
}

}  // namespace
}  // namespace strata
