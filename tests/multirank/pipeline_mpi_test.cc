// PipelineRunner on the MPI backend, one process per pipeline rank (4
// ranks): losses and gradients equal a plain loop for GPipe, 1F1B and
// interleaved 1F1B; 20 steps of training follow the plain loop's loss
// curve; the peak number of activations is the simulator's. It also checks
// what the runner assumes of a transport: messages between a pair of ranks
// arrive in order without tags (pairs of ranks with many transfers in
// flight), zero-element tensors travel, and a stage that fails on one rank
// ends every rank's step (at once under ULFM, else at the deadline).
#include <gmock/gmock.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/mpi/mpi_runtime.h"
#include "harness.h"
#include "pipeline_test_model.h"
#include "strata/parallel/pipeline/generate.h"
#include "strata/parallel/pipeline/runner.h"
#include "strata/parallel/pipeline/simulate.h"

namespace strata::testing {
namespace {

using pipeline::GenerateSchedule;
using pipeline::PipelineRunner;
using pipeline::RunnerOptions;
using pipeline::Schedule;
using pipeline::ScheduleKind;
using pipeline::ScheduleOptions;
using pipeline::ShapeExchange;
using pipeline::StageFunctions;
using pipeline::StepResult;
using pipeline::testing::Reference;
using pipeline::testing::TestFunctions;
using pipeline::testing::TestModel;
using ::testing::HasSubstr;

class PipelineMpiTest : public MultiRankTest {
 protected:
  // A communicator of its own for each test (a failed step revokes it):
  // the ranks with the same `color`, named "pp".
  static std::unique_ptr<Communicator> Group(int color) {
    CommOptions options;
    options.name = "pp";
    options.timeout = absl::Seconds(120);
    absl::StatusOr<std::unique_ptr<Communicator>> c = world().Split(color, rank(), options);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(c).value() : nullptr;
  }

  static Schedule Generate(ScheduleKind kind, int p, int m, int v = 1) {
    ScheduleOptions o;
    o.kind = kind;
    o.num_ranks = p;
    o.num_microbatches = m;
    o.virtual_stages = v;
    absl::StatusOr<Schedule> s = GenerateSchedule(o);
    EXPECT_TRUE(s.ok()) << s.status();
    return *s;
  }

  // Runs `steps` steps of `schedule` on `comm` and checks every step's
  // losses, the gradients of this rank's stages and the peak number of
  // activations against the plain loop. With lr > 0, each step ends with
  // a plain SGD update (on this rank's stages; on all in the reference).
  static void ExpectPlainLoop(const Schedule& schedule, Communicator* comm,
                              const RunnerOptions& options, bool variable, int steps = 1,
                              double lr = 0.0) {
    SCOPED_TRACE(schedule.name());
    ASSERT_NE(comm, nullptr);
    const int me = comm->rank(), m = schedule.num_microbatches();
    const int last_rank = schedule.rank_of_stage(schedule.num_stages() - 1);
    absl::StatusOr<std::unique_ptr<PipelineRunner>> runner =
        PipelineRunner::Create(schedule, GroupHandle::Fixed(comm), options);
    ASSERT_TRUE(runner.ok()) << runner.status();
    TestModel model(schedule.num_stages()), reference(schedule.num_stages());
    const StageFunctions fns = TestFunctions(&model, variable, false);
    const int peak = pipeline::PeakInFlight(schedule)[me];
    for (int step = 0; step < steps; ++step) {
      SCOPED_TRACE(absl::StrCat("step ", step));
      absl::StatusOr<StepResult> result = (*runner)->Step(fns);
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_EQ(result->peak_in_flight, peak);
      ASSERT_EQ(result->losses.size(), me == last_rank ? static_cast<size_t>(m) : 0u);
      for (int i = 0; i < m; ++i) {
        const double loss = Reference(reference, i, variable, 1.0 / m);
        if (me == last_rank) EXPECT_NEAR(result->losses[i], loss, 1e-12) << "microbatch " << i;
      }
      for (int s : schedule.stages_of_rank(me)) {
        EXPECT_NEAR(model.da[s], reference.da[s], 1e-12) << "stage " << s;
        EXPECT_NEAR(model.db[s], reference.db[s], 1e-12) << "stage " << s;
      }
      for (TestModel* t : {&model, &reference}) {
        for (int s = 0; s < schedule.num_stages(); ++s) {
          t->a[s] -= lr * t->da[s];
          t->b[s] -= lr * t->db[s];
          t->da[s] = t->db[s] = 0;
        }
      }
    }
  }
};

TEST_F(PipelineMpiTest, EverySchedulePipelinedEqualsThePlainLoop) {
  const int p = size();
  std::unique_ptr<Communicator> pp = Group(0);
  RunnerOptions options;
  options.timeout = absl::Seconds(60);
  ExpectPlainLoop(Generate(ScheduleKind::kGPipe, p, 6), pp.get(), options, true);
  ExpectPlainLoop(Generate(ScheduleKind::k1F1B, p, 8), pp.get(), options, true);
  ExpectPlainLoop(Generate(ScheduleKind::k1F1B, p, p - 1), pp.get(), options, true);
  ExpectPlainLoop(Generate(ScheduleKind::kInterleaved1F1B, p, 2 * p, 2), pp.get(), options, true);
  // Fixed shapes, declared instead of sent.
  options.shapes = ShapeExchange::kDeclared;
  options.input_specs = [](int, int) -> absl::StatusOr<std::vector<pipeline::TensorSpec>> {
    return std::vector<pipeline::TensorSpec>{{DataType::kFloat64, {4}},
                                             {DataType::kFloat64, {1, 4}}};
  };
  ExpectPlainLoop(Generate(ScheduleKind::k1F1B, p, 8), pp.get(), options, false);
}

TEST_F(PipelineMpiTest, TwentyStepsFollowThePlainLoopsLossCurve) {
  std::unique_ptr<Communicator> pp = Group(0);
  RunnerOptions options;
  options.timeout = absl::Seconds(60);
  ExpectPlainLoop(Generate(ScheduleKind::k1F1B, size(), 8), pp.get(), options, true,
                  /*steps=*/20, /*lr=*/0.05);
}

// Two ranks with many transfers between them in flight at once, in both
// directions and with shapes changing at every microbatch: the runner
// matches them by order alone, so any reordering would show as a wrong
// shape or a wrong gradient.
TEST_F(PipelineMpiTest, MessagesBetweenAPairArriveInOrder) {
  if (size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  std::unique_ptr<Communicator> pair = Group(rank() / 2);
  RunnerOptions options;
  options.timeout = absl::Seconds(60);
  ExpectPlainLoop(Generate(ScheduleKind::kInterleaved1F1B, 2, 4, 4), pair.get(), options, true);
  ExpectPlainLoop(Generate(ScheduleKind::kGPipe, 2, 16), pair.get(), options, true);
}

// Every stage also passes on an empty fp32[0, 5] tensor (and gets its
// empty gradient back).
TEST_F(PipelineMpiTest, ZeroElementTensorsTravel) {
  std::unique_ptr<Communicator> pp = Group(0);
  const Schedule schedule = Generate(ScheduleKind::k1F1B, size(), 4);
  const pipeline::TensorSpec empty{DataType::kFloat32, {0, 5}};
  TestModel model(schedule.num_stages()), reference(schedule.num_stages());
  const StageFunctions plain = TestFunctions(&model, true, false);
  int received = 0;
  StageFunctions fns;
  fns.forward = [&](const pipeline::ForwardCall& call) -> absl::StatusOr<pipeline::ForwardResult> {
    pipeline::TensorList in = *call.inputs;
    if (call.stage > 0) {
      if (in.size() != 3 || in[2].spec != empty) {
        return absl::InternalError(absl::StrCat("stage ", call.stage, " got ", in.size(),
                                                " inputs, the last ", in.back().spec.ToString()));
      }
      ++received;
      in.pop_back();
    }
    pipeline::ForwardCall inner = call;
    inner.inputs = &in;
    absl::StatusOr<pipeline::ForwardResult> out = plain.forward(inner);
    if (out.ok()) out->outputs.push_back(pipeline::StageTensor::Host(empty));
    return out;
  };
  fns.backward = [&](const pipeline::BackwardCall& call) -> absl::StatusOr<pipeline::TensorList> {
    pipeline::TensorList in = *call.inputs, out = *call.outputs, grads = *call.output_grads;
    if (call.stage > 0) in.pop_back();
    out.pop_back();
    if (!grads.empty()) {
      if (grads.back().spec != empty) return absl::InternalError("wrong empty gradient");
      grads.pop_back();
    }
    pipeline::BackwardCall inner = call;
    inner.inputs = &in;
    inner.outputs = &out;
    inner.output_grads = &grads;
    absl::StatusOr<pipeline::TensorList> g = plain.backward(inner);
    if (g.ok() && call.stage > 0) g->push_back(pipeline::StageTensor::Host(empty));
    return g;
  };
  RunnerOptions options;
  options.timeout = absl::Seconds(60);
  STRATA_ASSERT_OK_AND_ASSIGN(
      auto runner, PipelineRunner::Create(schedule, GroupHandle::Fixed(pp.get()), options));
  absl::StatusOr<StepResult> result = runner->Step(fns);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(received, rank() == 0 ? 0 : 4);
  for (int i = 0; i < 4; ++i) Reference(reference, i, true, 1.0 / 4);
  const int s = rank();
  EXPECT_NEAR(model.da[s], reference.da[s], 1e-12);
  EXPECT_NEAR(model.db[s], reference.db[s], 1e-12);
}

// A forward that fails on one rank ends the step on every rank. The failing
// rank names its action and revokes the communicator. Under mpirun
// --with-ft ulfm the revocation reaches the others, which stop at once
// (Aborted); without it Open MPI does not tell them (MPIX_Comm_revoke then
// only acts locally), and they stop at their deadline (DeadlineExceeded),
// each naming what it waited for.
TEST_F(PipelineMpiTest, AStageFailureEndsEveryRanksStep) {
  if (size() < 3) GTEST_SKIP() << "needs 3 ranks";
  absl::StatusOr<const mpi::RuntimeInfo*> info = mpi::EnsureInitialized();
  ASSERT_TRUE(info.ok()) << info.status();
  const bool revocation_reaches_peers = (*info)->fault_tolerant;
  std::unique_ptr<Communicator> pp = Group(0);
  const Schedule schedule = Generate(ScheduleKind::k1F1B, size(), 6);
  TestModel model(schedule.num_stages());
  StageFunctions fns = TestFunctions(&model, true, false);
  fns.forward = [forward = fns.forward](
                    const pipeline::ForwardCall& call) -> absl::StatusOr<pipeline::ForwardResult> {
    if (call.stage == 2 && call.microbatch == 3) return absl::InternalError("boom");
    return forward(call);
  };
  RunnerOptions options;
  // With revocation: far beyond the harness's patience, so only the
  // revocation can end the others' steps in time.
  options.timeout = revocation_reaches_peers ? absl::Seconds(100) : absl::Seconds(3);
  STRATA_ASSERT_OK_AND_ASSIGN(
      auto runner, PipelineRunner::Create(schedule, GroupHandle::Fixed(pp.get()), options));
  absl::StatusOr<StepResult> result = runner->Step(fns);
  ASSERT_FALSE(result.ok());
  const std::string message(result.status().message());
  EXPECT_THAT(message, HasSubstr(absl::StrCat("pipeline rank ", rank(), " (world rank ", rank(),
                                              ", group 'pp') at action #")));
  if (rank() == 2) {
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInternal) << message;
    EXPECT_THAT(message, HasSubstr(" 2F3 (stage 2, microbatch 3): forward failed: boom"));
    return;
  }
  EXPECT_THAT(message, HasSubstr(absl::StrCat("(stage ", rank(), ", microbatch ")));
  if (revocation_reaches_peers) {
    EXPECT_EQ(result.status().code(), absl::StatusCode::kAborted) << message;
    EXPECT_THAT(message, HasSubstr("revoked"));
  } else {
    EXPECT_EQ(result.status().code(), absl::StatusCode::kDeadlineExceeded) << message;
    EXPECT_THAT(message, HasSubstr("deadline"));
  }
}

}  // namespace
}  // namespace strata::testing
