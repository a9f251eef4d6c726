// strata-ckpt, run as a program: output and exit status of inspect, verify
// and convert on a good checkpoint, a damaged one, and bad usage.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>

#include "fake_communicator.h"
#include "strata/checkpoint/checkpointer.h"
#include "strata/checkpoint/loader.h"
#include "strata/checkpoint/safetensors.h"
#include "test_util.h"

namespace strata {
namespace {

using ::testing::HasSubstr;
using testing_util::ScratchDir;
using testing_util::Soon;

struct ToolRun {
  int status = -1;
  std::string output;  // stdout and stderr
};

ToolRun Tool(const std::string& args) {
  ToolRun r;
  FILE* p = ::popen((std::string(STRATA_CKPT_TOOL) + " " + args + " 2>&1").c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  const int st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

// Two ranks save "w" [8, 4] fp32 split in rows and "b" [3] int64.
class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto hub = std::make_shared<testing_util::FakeHub>(2);
    std::vector<std::unique_ptr<Communicator>> comms;
    std::vector<std::unique_ptr<Checkpointer>> ckpts;
    for (int r = 0; r < 2; ++r) {
      comms.push_back(hub->Endpoint(r));
      CheckpointOptions o;
      o.directory = dir_.path();
      o.group = GroupHandle::Fixed(comms.back().get());
      ckpts.push_back(std::move(*Checkpointer::Create(o)));
    }
    for (int r = 0; r < 2; ++r) {
      ShardedTensor w = ShardedTensor::Whole("w", DataType::kFloat32, {8, 4});
      w.local_shape = {4, 4};
      w.global_offset = {4 * r, 0};
      SaveRequest req;
      req.step = 9;
      req.tensors.push_back({w, &w_[16 * r]});
      if (r == 1) req.tensors.push_back({ShardedTensor::Whole("b", DataType::kInt64, {3}), b_});
      ASSERT_TRUE(ckpts[r]->Save(req).ok());
    }
    for (auto& c : ckpts) ASSERT_TRUE(c->Wait(Soon()).ok());
  }

  ScratchDir dir_;
  float w_[32] = {};
  int64_t b_[3] = {7, -8, 9};
};

TEST_F(CliTest, InspectShowsTensorsShardsAndFiles) {
  for (const std::string& path : {dir_.path(), dir_ / "step-9"}) {
    ToolRun r = Tool("inspect " + path);
    EXPECT_EQ(r.status, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr("step 9"));
    EXPECT_THAT(r.output, HasSubstr("2 rank(s)"));
    EXPECT_THAT(r.output, ::testing::ContainsRegex("w +F32 +\\[8, 4\\] +2 +128 B"));
    EXPECT_THAT(r.output, HasSubstr("offset [4, 0] shape [4, 4] in rank00001-000.safetensors"));
    EXPECT_THAT(r.output, ::testing::ContainsRegex("b +I64 +\\[3\\] +1 +24 B"));
    EXPECT_THAT(r.output, HasSubstr("rank00000-000.safetensors"));
  }
  ToolRun r = Tool("inspect " + dir_ / "step-9/rank00001-000.safetensors");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("metadata strata.rank = 1"));
}

TEST_F(CliTest, VerifyAndConvert) {
  ToolRun r = Tool("verify " + dir_.path());
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("OK"));
  const std::string out = dir_ / "whole.safetensors";
  r = Tool("convert " + dir_.path() + " " + out);
  EXPECT_EQ(r.status, 0) << r.output;
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Open(out);
  ASSERT_TRUE(f.ok()) << f.status();
  float w[32];
  int64_t b[3];
  ASSERT_TRUE(f->Read("w", w, sizeof(w)).ok());
  ASSERT_TRUE(f->Read("b", b, sizeof(b)).ok());
  EXPECT_EQ(0, std::memcmp(w, w_, sizeof(w)));
  EXPECT_EQ(0, std::memcmp(b, b_, sizeof(b)));
}

TEST_F(CliTest, ProblemsGiveExitStatusOne) {
  const std::string file = dir_ / "step-9/rank00001-000.safetensors";
  testing_util::FlipByte(file, 4096 + 3);
  ToolRun r = Tool("verify " + dir_.path());
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr("checksum mismatch in '" + file + "'"));
  EXPECT_THAT(r.output, HasSubstr("problem(s) found"));
  r = Tool("convert " + dir_.path() + " " + dir_ / "x.safetensors");
  EXPECT_EQ(r.status, 1);
  EXPECT_FALSE(checkpoint_internal::PathExists(dir_ / "x.safetensors.tmp"));
  EXPECT_FALSE(checkpoint_internal::PathExists(dir_ / "x.safetensors"));
  r = Tool("convert " + dir_.path() + " " + dir_ / "x.safetensors --no-verify");
  EXPECT_EQ(r.status, 0) << r.output;
  r = Tool("verify " + dir_ / "nowhere");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr("no committed checkpoint"));
  r = Tool("inspect " + dir_.path() + " --step 4");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr("step 4 does not exist"));
}

TEST_F(CliTest, UsageErrorsGiveExitStatusTwo) {
  EXPECT_EQ(Tool("").status, 2);
  EXPECT_EQ(Tool("frobnicate x").status, 2);
  EXPECT_EQ(Tool("verify").status, 2);
  EXPECT_EQ(Tool("verify a b").status, 2);
  EXPECT_EQ(Tool("verify x --step").status, 2);
  EXPECT_EQ(Tool("verify x --bogus").status, 2);
  EXPECT_EQ(Tool("--help").status, 0);
}

}  // namespace
}  // namespace strata
