// Crash consistency: a child process saving a checkpoint is killed with
// SIGKILL at each point of the save; afterwards `latest` names the previous
// checkpoint (or, past the commit point, the new one), which loads and
// verifies, and the next save succeeds.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>

#include "checkpoint/internal/file_util.h"
#include "strata/checkpoint/checkpointer.h"
#include "strata/checkpoint/loader.h"
#include "test_util.h"

namespace strata {
namespace {

using testing_util::ScratchDir;
using testing_util::Soon;

// Runs the helper until it reports reaching `point`, then kills it.
void RunAndKillAt(const std::string& dir, int64_t step, const std::string& point) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const std::string step_s = std::to_string(step);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::dup2(fds[1], STDOUT_FILENO);
    ::close(fds[0]);
    ::close(fds[1]);
    ::execl(STRATA_CRASH_HELPER, STRATA_CRASH_HELPER, dir.c_str(), step_s.c_str(), point.c_str(),
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(fds[1]);
  FILE* out = ::fdopen(fds[0], "r");
  char line[256] = {};
  const bool got = std::fgets(line, sizeof(line), out) != nullptr;
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  std::fclose(out);
  ASSERT_TRUE(got) << "helper exited before reaching " << point;
  EXPECT_EQ(std::string(line), "at " + point + "\n");
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
}

// Loads step `step` (or latest when -1) and checks its values and checksums.
void ExpectIntact(const std::string& dir, int64_t step, int64_t expect_step) {
  LoadOptions lo;
  lo.directory = dir;
  lo.step = step;
  auto r = CheckpointReader::Open(lo);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->step(), expect_step);
  EXPECT_TRUE(VerifyCheckpoint((*r)->step_directory(), (*r)->manifest()).ok());
  std::vector<std::vector<float>> got(6, std::vector<float>(300000));
  std::vector<TensorTarget> t;
  for (int i = 0; i < 6; ++i) {
    t.push_back({ShardedTensor::Whole("t" + std::to_string(i), DataType::kFloat32, {300000}),
                 got[i].data()});
  }
  ASSERT_TRUE((*r)->Load(t).ok());
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(got[i], std::vector<float>(300000, static_cast<float>(expect_step * 10 + i)));
  }
}

void SaveInProcess(const std::string& dir, int64_t step) {
  CheckpointOptions o;
  o.directory = dir;
  o.chunk_bytes = 4096;
  auto ckpt = Checkpointer::Create(o);
  ASSERT_TRUE(ckpt.ok());
  std::vector<std::vector<float>> data;
  SaveRequest req;
  req.step = step;
  for (int i = 0; i < 6; ++i) {
    data.emplace_back(300000, static_cast<float>(step * 10 + i));
    req.tensors.push_back(
        {ShardedTensor::Whole("t" + std::to_string(i), DataType::kFloat32, {300000}),
         data.back().data()});
  }
  ASSERT_TRUE((*ckpt)->Save(req).ok());
  ASSERT_TRUE((*ckpt)->Wait(Soon()).ok());
}

class CrashTest : public ::testing::TestWithParam<const char*> {};

TEST_P(CrashTest, KilledSaveIsInvisibleOrWhole) {
  const std::string point = GetParam();
  ScratchDir dir;
  SaveInProcess(dir.path(), 1);
  RunAndKillAt(dir.path(), 2, point);
  if (point == "latest_written") {
    // Past the commit point: the new checkpoint is the latest, whole.
    ExpectIntact(dir.path(), -1, 2);
  } else {
    ExpectIntact(dir.path(), -1, 1);
    if (point == "renamed") {
      // Renamed but not yet named by `latest`: whole, loadable by step.
      ExpectIntact(dir.path(), 2, 2);
    } else {
      EXPECT_FALSE(checkpoint_internal::PathExists(dir / "step-2"));
    }
  }
  // The next run saves again and cleans up what the crash left.
  SaveInProcess(dir.path(), 3);
  ExpectIntact(dir.path(), -1, 3);
  EXPECT_FALSE(checkpoint_internal::PathExists(dir / "step-2.tmp"));
}

INSTANTIATE_TEST_SUITE_P(Points, CrashTest,
                         ::testing::Values("prepared", "file_partial", "files_written", "agreed",
                                           "manifest_written", "renamed", "latest_written"));

}  // namespace
}  // namespace strata
