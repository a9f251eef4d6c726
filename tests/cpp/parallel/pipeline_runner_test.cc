// PipelineRunner in one process: each rank is a thread with a FakeGroup
// communicator. A small two-tensor model runs pipelined under every
// generator and both fake transports; its losses and gradients must equal a
// plain loop over the same model, and failures must end every rank's step
// with an error naming where.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "fake_communicator.h"
#include "pipeline_test_model.h"
#include "strata/parallel/pipeline/generate.h"
#include "strata/parallel/pipeline/runner.h"
#include "strata/parallel/pipeline/simulate.h"

namespace strata::pipeline {
namespace {

using ::strata::testing::FakeGroup;
using ::strata::testing::FakeOrdering;
using testing::Data;
using ::testing::HasSubstr;
using testing::Length;
using testing::Reference;
using testing::TestFunctions;
using testing::TestModel;
using testing::Vector;

struct RankResult {
  absl::StatusOr<StepResult> step = absl::UnknownError("not run");
};

// Runs one step on every rank (one thread each) and joins them. `skip`
// names a rank that never calls Step.
std::vector<RankResult> RunAll(FakeGroup& group, const Schedule& schedule,
                               const RunnerOptions& options, const StageFunctions& fns,
                               int skip = -1, int steps = 1) {
  const int p = schedule.num_ranks();
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < p; ++r) comms.push_back(group.Comm(r));
  std::vector<RankResult> results(p);
  std::vector<std::thread> threads;
  for (int r = 0; r < p; ++r) {
    if (r == skip) continue;
    threads.emplace_back([&, r] {
      absl::StatusOr<std::unique_ptr<PipelineRunner>> runner =
          PipelineRunner::Create(schedule, GroupHandle::Fixed(comms[r].get()), options);
      if (!runner.ok()) {
        results[r].step = runner.status();
        return;
      }
      for (int k = 0; k < steps && (k == 0 || results[r].step.ok()); ++k) {
        results[r].step = (*runner)->Step(fns);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

// The same on a fresh host-memory group of the schedule's ranks.
std::vector<RankResult> RunAll(const Schedule& schedule, FakeOrdering ordering,
                               const RunnerOptions& options, const StageFunctions& fns,
                               int skip = -1, int steps = 1) {
  FakeGroup group(schedule.num_ranks(), ordering);
  return RunAll(group, schedule, options, fns, skip, steps);
}

struct Case {
  ScheduleKind kind;
  int p, m, v;
  FakeOrdering ordering;
  ShapeExchange shapes;
};

std::string Name(const Case& c) {
  const char* kind = c.kind == ScheduleKind::kGPipe  ? "gpipe"
                     : c.kind == ScheduleKind::k1F1B ? "1f1b"
                                                     : "interleaved";
  return absl::StrCat(kind, "_p", c.p, "_m", c.m, "_v", c.v,
                      c.ordering == FakeOrdering::kInOrder ? "_inorder" : "_posted",
                      c.shapes == ShapeExchange::kDeclared ? "_declared" : "_variable");
}

class RunnerTest : public ::testing::TestWithParam<Case> {};

TEST_P(RunnerTest, MatchesThePlainLoop) {
  const Case c = GetParam();
  ScheduleOptions o;
  o.kind = c.kind;
  o.num_ranks = c.p;
  o.num_microbatches = c.m;
  o.virtual_stages = c.v;
  absl::StatusOr<Schedule> schedule = GenerateSchedule(o);
  ASSERT_TRUE(schedule.ok()) << schedule.status();
  const bool variable = c.shapes == ShapeExchange::kPerTransfer;
  RunnerOptions options;
  options.timeout = absl::Seconds(60);
  options.shapes = c.shapes;
  options.input_specs = [](int, int microbatch) -> absl::StatusOr<std::vector<TensorSpec>> {
    const int n = Length(microbatch, false);
    return std::vector<TensorSpec>{{DataType::kFloat64, {n}}, {DataType::kFloat64, {1, n}}};
  };
  TestModel model(schedule->num_stages()), reference(schedule->num_stages());
  const absl::Time before = absl::Now();
  const std::vector<RankResult> results =
      RunAll(*schedule, c.ordering, options, TestFunctions(&model, variable, false));
  const absl::Time after = absl::Now();

  const std::vector<int> peak = PeakInFlight(*schedule);
  const int last_rank = schedule->rank_of_stage(schedule->num_stages() - 1);
  for (int r = 0; r < c.p; ++r) {
    ASSERT_TRUE(results[r].step.ok()) << "rank " << r << ": " << results[r].step.status();
    const StepResult& step = *results[r].step;
    EXPECT_EQ(step.peak_in_flight, peak[r]) << "rank " << r;
    size_t computes = 0;
    for (const Action& a : schedule->actions(r)) computes += a.is_compute();
    EXPECT_EQ(step.timings.size(), computes);
    // The wall-clock start puts every rank's timings on one timeline.
    EXPECT_GE(step.start, before);
    EXPECT_LE(step.start + absl::Seconds(step.step_seconds), after);
    for (const ComputeTiming& t : step.timings) {
      EXPECT_LE(0.0, t.start);
      EXPECT_LE(t.start, t.end);
      EXPECT_LE(t.end, step.step_seconds);
    }
    EXPECT_EQ(step.losses.size(), r == last_rank ? static_cast<size_t>(c.m) : 0u);
  }
  for (int i = 0; i < c.m; ++i) {
    const double loss = Reference(reference, i, variable, 1.0 / c.m);
    EXPECT_NEAR(results[last_rank].step->losses[i], loss, 1e-12) << "microbatch " << i;
  }
  for (int s = 0; s < schedule->num_stages(); ++s) {
    EXPECT_NEAR(model.da[s], reference.da[s], 1e-12) << "stage " << s;
    EXPECT_NEAR(model.db[s], reference.db[s], 1e-12) << "stage " << s;
  }
}

std::vector<Case> Cases() {
  std::vector<Case> out;
  for (FakeOrdering ordering : {FakeOrdering::kInOrder, FakeOrdering::kMatchPosted}) {
    for (ShapeExchange shapes : {ShapeExchange::kPerTransfer, ShapeExchange::kDeclared}) {
      out.push_back({ScheduleKind::kGPipe, 4, 6, 1, ordering, shapes});
      out.push_back({ScheduleKind::k1F1B, 4, 8, 1, ordering, shapes});
      out.push_back({ScheduleKind::k1F1B, 3, 2, 1, ordering, shapes});
      out.push_back({ScheduleKind::k1F1B, 1, 3, 1, ordering, shapes});
      out.push_back({ScheduleKind::kInterleaved1F1B, 2, 4, 2, ordering, shapes});
      out.push_back({ScheduleKind::kInterleaved1F1B, 4, 8, 2, ordering, shapes});
      out.push_back({ScheduleKind::kInterleaved1F1B, 1, 3, 3, ordering, shapes});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Schedules, RunnerTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return Name(info.param);
                         });

Schedule OneForwardOneBackward(int p, int m) {
  ScheduleOptions o;
  o.num_ranks = p;
  o.num_microbatches = m;
  absl::StatusOr<Schedule> s = GenerateSchedule(o);
  EXPECT_TRUE(s.ok());
  return *s;
}

TEST(RunnerTest, SplitBackwardAndSummedGradients) {
  // 1F1B with every B split into I and a later W (the zero-bubble actions).
  ScheduleOptions o;
  o.num_ranks = 3;
  o.num_microbatches = 4;
  absl::StatusOr<Schedule> order = GenerateComputeOrder(o);
  ASSERT_TRUE(order.ok());
  std::vector<std::vector<Action>> ranks(3);
  for (int r = 0; r < 3; ++r) {
    std::vector<Action> deferred;
    for (const Action& a : order->actions(r)) {
      if (a.type != ActionType::kBackward) {
        ranks[r].push_back(a);
        continue;
      }
      ranks[r].push_back(Action::BackwardInput(a.stage, a.microbatch));
      deferred.push_back(Action::BackwardWeight(a.stage, a.microbatch));
      if (deferred.size() == 2) {  // W two backwards late
        ranks[r].push_back(deferred.front());
        deferred.erase(deferred.begin());
      }
    }
    ranks[r].insert(ranks[r].end(), deferred.begin(), deferred.end());
  }
  absl::StatusOr<Schedule> split = Schedule::Create(ranks);
  ASSERT_TRUE(split.ok()) << split.status();
  absl::StatusOr<Schedule> schedule = InsertCommunication(*split);
  ASSERT_TRUE(schedule.ok()) << schedule.status();

  RunnerOptions options;
  options.grad_scaling = GradScaling::kSum;
  TestModel model(3), reference(3);
  const std::vector<RankResult> results =
      RunAll(*schedule, FakeOrdering::kInOrder, options, TestFunctions(&model, true, true));
  const std::vector<int> peak = PeakInFlight(*schedule);
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(results[r].step.ok()) << results[r].step.status();
    EXPECT_EQ(results[r].step->peak_in_flight, peak[r]);
  }
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(results[2].step->losses[i], Reference(reference, i, true, 1.0), 1e-12);
  }
  for (int s = 0; s < 3; ++s) {
    EXPECT_NEAR(model.da[s], reference.da[s], 1e-12);
    EXPECT_NEAR(model.db[s], reference.db[s], 1e-12);
  }
}

TEST(RunnerTest, StepsRepeatAndGradientsAccumulate) {
  const Schedule schedule = OneForwardOneBackward(2, 3);
  TestModel model(2), reference(2);
  const std::vector<RankResult> results =
      RunAll(schedule, FakeOrdering::kInOrder, RunnerOptions{}, TestFunctions(&model, true, false),
             -1, /*steps=*/2);
  for (const RankResult& r : results) ASSERT_TRUE(r.step.ok()) << r.step.status();
  for (int step = 0; step < 2; ++step) {
    for (int i = 0; i < 3; ++i) Reference(reference, i, true, 1.0 / 3);
  }
  for (int s = 0; s < 2; ++s) EXPECT_NEAR(model.da[s], reference.da[s], 1e-12);
}

// Each activation is freed after its backward and before the rank's next
// compute action starts: no forward or backward ever runs with more alive
// than the simulator's peak for its rank, and none is left after the step.
TEST(RunnerTest, ActivationsAreFreedBeforeTheNextCompute) {
  for (ScheduleKind kind :
       {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B}) {
    ScheduleOptions o;
    o.kind = kind;
    o.num_ranks = 3;
    o.num_microbatches = 6;
    o.virtual_stages = kind == ScheduleKind::kInterleaved1F1B ? 2 : 1;
    absl::StatusOr<Schedule> schedule = GenerateSchedule(o);
    ASSERT_TRUE(schedule.ok()) << schedule.status();
    TestModel model(schedule->num_stages());
    const StageFunctions inner = TestFunctions(&model, false, false);
    // Alive activations per rank, counted through the forward's context
    // (which the runner drops with the activation).
    std::vector<std::atomic<int>> alive(3);
    std::vector<int> worst(3, 0);
    std::mutex mu;
    auto check = [&](int rank, int before) {
      std::lock_guard<std::mutex> lock(mu);
      worst[rank] = std::max(worst[rank], alive[rank].load() + before);
    };
    StageFunctions fns = inner;
    fns.forward = [&](const ForwardCall& call) -> absl::StatusOr<ForwardResult> {
      const int rank = schedule->rank_of_stage(call.stage);
      check(rank, 1);  // this forward's activation comes on top
      absl::StatusOr<ForwardResult> out = inner.forward(call);
      if (!out.ok()) return out;
      struct Counted {
        std::shared_ptr<void> context;
        std::atomic<int>* alive = nullptr;
        ~Counted() {
          if (alive != nullptr) alive->fetch_sub(1);
        }
      };
      auto counted = std::make_shared<Counted>();
      counted->context = out->context;
      counted->alive = &alive[rank];
      alive[rank].fetch_add(1);
      void* inner_context = out->context.get();
      out->context = std::shared_ptr<void>(counted, inner_context);  // shares the count
      return out;
    };
    fns.backward = [&](const BackwardCall& call) -> absl::StatusOr<TensorList> {
      check(schedule->rank_of_stage(call.stage), 0);
      return inner.backward(call);
    };
    const std::vector<RankResult> results =
        RunAll(*schedule, FakeOrdering::kMatchPosted, RunnerOptions{}, fns);
    const std::vector<int> peak = PeakInFlight(*schedule);
    for (int r = 0; r < 3; ++r) {
      ASSERT_TRUE(results[r].step.ok()) << results[r].step.status();
      EXPECT_EQ(worst[r], peak[r]) << schedule->name() << ", rank " << r;
      EXPECT_EQ(alive[r].load(), 0) << schedule->name() << ", rank " << r;
    }
  }
}

TEST(RunnerTest, AStageFailureEndsEveryRanksStep) {
  const Schedule schedule = OneForwardOneBackward(4, 6);
  TestModel model(4);
  StageFunctions fns = TestFunctions(&model, true, false);
  auto forward = fns.forward;
  fns.forward = [forward](const ForwardCall& call) -> absl::StatusOr<ForwardResult> {
    if (call.stage == 2 && call.microbatch == 3) return absl::InternalError("boom");
    return forward(call);
  };
  RunnerOptions options;
  options.timeout = absl::Seconds(120);  // revocation, not the deadline, must end the step
  const std::vector<RankResult> results = RunAll(schedule, FakeOrdering::kInOrder, options, fns);
  ASSERT_FALSE(results[2].step.ok());
  EXPECT_EQ(results[2].step.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(results[2].step.status().message(),
              HasSubstr("pipeline rank 2 (world rank 2, group 'pp') at action #"));
  EXPECT_THAT(results[2].step.status().message(),
              HasSubstr(" 2F3 (stage 2, microbatch 3): forward failed: boom"));
  for (int r : {0, 1, 3}) {
    ASSERT_FALSE(results[r].step.ok()) << "rank " << r;
    EXPECT_EQ(results[r].step.status().code(), absl::StatusCode::kAborted) << "rank " << r;
    EXPECT_THAT(results[r].step.status().message(),
                HasSubstr(absl::StrCat("pipeline rank ", r, " (world rank ", r)));
    EXPECT_THAT(results[r].step.status().message(), HasSubstr("revoked by rank 2"));
    EXPECT_THAT(results[r].step.status().message(), HasSubstr(", microbatch "));
  }
}

TEST(RunnerTest, WithoutRevocationPeersStopAtTheirDeadline) {
  const Schedule schedule = OneForwardOneBackward(2, 2);
  TestModel model(2);
  StageFunctions fns = TestFunctions(&model, true, false);
  auto backward = fns.backward;
  fns.backward = [backward](const BackwardCall& call) -> absl::StatusOr<TensorList> {
    if (call.stage == 1) return absl::ResourceExhaustedError("out of memory");
    return backward(call);
  };
  RunnerOptions options;
  options.on_failure = OnFailure::kAbort;
  options.timeout = absl::Milliseconds(500);
  const std::vector<RankResult> results = RunAll(schedule, FakeOrdering::kInOrder, options, fns);
  EXPECT_EQ(results[1].step.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(results[1].step.status().message(),
              HasSubstr("at action #3 1B0 (stage 1, microbatch 0): backward failed: out of "
                        "memory"));
  EXPECT_EQ(results[0].step.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(results[0].step.status().message(),
              HasSubstr("pipeline rank 0 (world rank 0, group 'pp') at action #5 0B0 (stage 0, "
                        "microbatch 0): waiting for the data of action #4 0RECV_B0<1"));
}

TEST(RunnerTest, AMissingPeerIsADeadlineNotAHang) {
  const Schedule schedule = OneForwardOneBackward(2, 2);
  TestModel model(2);
  RunnerOptions options;
  options.timeout = absl::Milliseconds(300);
  const std::vector<RankResult> results = RunAll(schedule, FakeOrdering::kInOrder, options,
                                                 TestFunctions(&model, true, false), /*skip=*/1);
  EXPECT_EQ(results[0].step.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(results[0].step.status().message(), HasSubstr("pipeline rank 0"));
  EXPECT_THAT(results[0].step.status().message(), HasSubstr("(stage 0, microbatch 0)"));
}

TEST(RunnerTest, StageFunctionsAreChecked) {
  const Schedule schedule = OneForwardOneBackward(2, 2);
  TestModel model(2);
  StageFunctions fns = TestFunctions(&model, true, false);
  // A gradient of the wrong shape.
  StageFunctions bad_grad = fns;
  bad_grad.backward = [](const BackwardCall& call) -> absl::StatusOr<TensorList> {
    if (call.stage == 0) return TensorList{};
    return TensorList{Vector(3, false)};
  };
  std::vector<RankResult> results =
      RunAll(schedule, FakeOrdering::kInOrder, RunnerOptions{}, bad_grad);
  EXPECT_THAT(results[1].step.status().message(),
              HasSubstr("backward of stage 1 returned gradients [fp64[3]] for inputs [fp64[3], "
                        "fp64[1, 3]]; each input needs a gradient of its spec"));
  // A last stage that forgets its loss.
  StageFunctions no_loss = fns;
  no_loss.forward = [forward =
                         fns.forward](const ForwardCall& call) -> absl::StatusOr<ForwardResult> {
    absl::StatusOr<ForwardResult> out = forward(call);
    if (out.ok()) out->loss.reset();
    return out;
  };
  results = RunAll(schedule, FakeOrdering::kInOrder, RunnerOptions{}, no_loss);
  EXPECT_THAT(results[1].step.status().message(),
              HasSubstr("stage 1 is the last stage: its forward must return a loss"));
  // A middle stage with nothing to pass on.
  StageFunctions empty = fns;
  empty.forward = [](const ForwardCall&) -> absl::StatusOr<ForwardResult> {
    return ForwardResult{};
  };
  results = RunAll(schedule, FakeOrdering::kInOrder, RunnerOptions{}, empty);
  EXPECT_THAT(results[0].step.status().message(),
              HasSubstr("forward of stage 0 returned no outputs; stage 1 needs at least one"));
  // Missing functions, before anything is sent.
  StageFunctions partial;
  partial.forward = fns.forward;
  results = RunAll(schedule, FakeOrdering::kInOrder, RunnerOptions{}, partial);
  for (const RankResult& r : results) {
    EXPECT_THAT(r.step.status().message(),
                HasSubstr("before its first action: StageFunctions needs forward, backward"));
  }
}

TEST(RunnerTest, DeclaredShapesAreCheckedBySender) {
  const Schedule schedule = OneForwardOneBackward(2, 2);
  TestModel model(2);
  RunnerOptions options;
  options.shapes = ShapeExchange::kDeclared;
  options.input_specs = [](int, int) -> absl::StatusOr<std::vector<TensorSpec>> {
    return std::vector<TensorSpec>{{DataType::kFloat32, {5}}};
  };
  const std::vector<RankResult> results =
      RunAll(schedule, FakeOrdering::kInOrder, options, TestFunctions(&model, true, false));
  EXPECT_THAT(results[0].step.status().message(),
              HasSubstr("stage 0's outputs for microbatch 0 are [fp64[3], fp64[1, 3]] but "
                        "input_specs(1, 0) declares [fp32[5]]"));
}

TEST(RunnerTest, CreateChecksItsArguments) {
  FakeGroup group(2, FakeOrdering::kInOrder);
  std::unique_ptr<Communicator> comm = group.Comm(0);
  const Schedule three = OneForwardOneBackward(3, 2);
  EXPECT_THAT(PipelineRunner::Create(three, GroupHandle::Fixed(comm.get()), {}).status().message(),
              HasSubstr("the schedule '1F1B p=3 m=2' has 3 ranks but communicator 'pp' has 2"));
  const Schedule two = OneForwardOneBackward(2, 2);
  EXPECT_THAT(PipelineRunner::Create(two, GroupHandle(), {}).status().message(),
              HasSubstr("the group handle is empty"));
  EXPECT_THAT(PipelineRunner::Create(two, GroupHandle::Fixed(nullptr), {}).status().message(),
              HasSubstr("the group handle is empty"));
  RunnerOptions o;
  o.timeout = absl::ZeroDuration();
  EXPECT_THAT(PipelineRunner::Create(two, GroupHandle::Fixed(comm.get()), o).status().message(),
              HasSubstr("RunnerOptions::timeout is 0; want > 0"));
  o = {};
  o.shapes = ShapeExchange::kDeclared;
  EXPECT_THAT(PipelineRunner::Create(two, GroupHandle::Fixed(comm.get()), o).status().message(),
              HasSubstr("ShapeExchange::kDeclared needs RunnerOptions::input_specs"));
  o = {};
  o.version = 0;
  EXPECT_THAT(PipelineRunner::Create(two, GroupHandle::Fixed(comm.get()), o).status().message(),
              HasSubstr("RunnerOptions version 0 is not supported"));
  // A compute order has no transfers to execute; a naive order deadlocks.
  ScheduleOptions so;
  so.num_ranks = 2;
  so.num_microbatches = 2;
  absl::StatusOr<Schedule> order = GenerateComputeOrder(so);
  ASSERT_TRUE(order.ok());
  EXPECT_THAT(PipelineRunner::Create(*order, GroupHandle::Fixed(comm.get()), {}).status().message(),
              HasSubstr("but rank 1 has no 1RECV_F0<0 before it"));
  FakeGroup device(2, FakeOrdering::kInOrder, "pp", MemoryKind::kCuda);
  std::unique_ptr<Communicator> device_comm = device.Comm(0);
  EXPECT_THAT(
      PipelineRunner::Create(two, GroupHandle::Fixed(device_comm.get()), {}).status().message(),
      HasSubstr("communicator 'pp' works on device memory; set RunnerOptions::allocate"));
  RunnerOptions on_device;
  on_device.allocate = [](const TensorSpec& spec) -> absl::StatusOr<StageTensor> {
    return StageTensor::Host(spec);
  };
  EXPECT_THAT(PipelineRunner::Create(two, GroupHandle::Fixed(device_comm.get()), on_device)
                  .status()
                  .message(),
              HasSubstr("communicator 'pp' works on device memory, but ShapeExchange::kPerTransfer "
                        "sends each transfer's shapes from host memory; use "
                        "ShapeExchange::kDeclared"));
  absl::StatusOr<Schedule> crossed = Schedule::Parse(
      "0F0 0RECV_B0<1 0SEND_F0>1 0B0\n"
      "1RECV_F0<0 1F0 1B0 1SEND_B0>0\n");
  ASSERT_TRUE(crossed.ok());
  EXPECT_THAT(
      PipelineRunner::Create(*crossed, GroupHandle::Fixed(comm.get()), {}).status().message(),
      HasSubstr("deadlock"));
}

// On a device communicator (declared shapes, tensors from `allocate`)
// every send and receive is ordered on RunnerOptions::stream, the stream
// the stage functions compute on; the step equals the plain loop.
TEST(RunnerTest, DeviceTransfersAreOrderedOnTheStagesStream) {
  const Schedule schedule = OneForwardOneBackward(2, 3);
  FakeGroup group(2, FakeOrdering::kInOrder, "pp", MemoryKind::kCuda);
  RunnerOptions options;
  options.shapes = ShapeExchange::kDeclared;
  options.input_specs = [](int, int microbatch) -> absl::StatusOr<std::vector<TensorSpec>> {
    const int n = Length(microbatch, false);
    return std::vector<TensorSpec>{{DataType::kFloat64, {n}}, {DataType::kFloat64, {1, n}}};
  };
  options.allocate = [](const TensorSpec& spec) -> absl::StatusOr<StageTensor> {
    return StageTensor::Host(spec);  // stands in for device memory
  };
  int compute_stream = 0;
  options.stream = &compute_stream;
  TestModel model(2), reference(2);
  const StageFunctions fns = TestFunctions(&model, false, false);
  const std::vector<RankResult> results = RunAll(group, schedule, options, fns);
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(results[r].step.ok()) << results[r].step.status();
  const std::map<void*, int64_t> streams = group.p2p_by_stream();
  ASSERT_EQ(streams.size(), 1u);
  EXPECT_EQ(streams.begin()->first, &compute_stream);
  // 3 microbatches x (F, B) x 2 tensors x (send, receive).
  EXPECT_EQ(streams.begin()->second, 3 * 2 * 2 * 2);
  for (int i = 0; i < 3; ++i) {
    EXPECT_NEAR(results[1].step->losses[i], Reference(reference, i, false, 1.0 / 3), 1e-12);
  }
  for (int s = 0; s < 2; ++s) EXPECT_NEAR(model.da[s], reference.da[s], 1e-12);
}

// Runs p=2, m=1 1F1B where stage 0 returns `outputs`, and returns rank 0's
// error message.
std::string StageZeroError(TensorList outputs, const RunnerOptions& options = {}) {
  TestModel model(2);
  StageFunctions fns = TestFunctions(&model, false, false);
  auto forward = fns.forward;
  fns.forward = [forward, outputs](const ForwardCall& call) -> absl::StatusOr<ForwardResult> {
    absl::StatusOr<ForwardResult> out = forward(call);
    if (out.ok() && call.stage == 0) out->outputs = outputs;
    return out;
  };
  const std::vector<RankResult> results =
      RunAll(OneForwardOneBackward(2, 1), FakeOrdering::kInOrder, options, fns);
  EXPECT_FALSE(results[0].step.ok());
  EXPECT_FALSE(results[1].step.ok());  // revoked
  return std::string(results[0].step.status().message());
}

TEST(RunnerTest, StageOutputsAreChecked) {
  StageTensor no_data = Vector(4, false);
  no_data.data = nullptr;
  EXPECT_THAT(StageZeroError({no_data}), HasSubstr("forward output 0 (fp64[4]) has no data"));
  StageTensor negative = Vector(4, false);
  negative.spec.shape = {-4};
  EXPECT_THAT(StageZeroError({negative}),
              HasSubstr("forward output 0: tensor fp64[-4] has a negative dim"));
  StageTensor deep = Vector(1, false);
  deep.spec.shape = std::vector<int64_t>(9, 1);
  EXPECT_THAT(StageZeroError({deep}), HasSubstr("has 9 dims; at most 8 are supported"));
  EXPECT_THAT(StageZeroError(TensorList(9, Vector(4, false))),
              HasSubstr("forward of stage 0 returned 9 outputs; a transfer carries at most 8"));
}

TEST(RunnerTest, AllocationAndDeclaredShapesAreChecked) {
  const Schedule schedule = OneForwardOneBackward(2, 1);
  TestModel model(2);
  const StageFunctions fns = TestFunctions(&model, false, false);
  RunnerOptions failing;
  failing.allocate = [](const TensorSpec&) -> absl::StatusOr<StageTensor> {
    return absl::ResourceExhaustedError("device full");
  };
  // Both ranks allocate (rank 1 for the activation, rank 0 for its
  // gradient); whichever fails first revokes the other.
  auto any_message = [](const std::vector<RankResult>& results) {
    std::string all;
    for (const RankResult& r : results) absl::StrAppend(&all, r.step.status().message(), "\n");
    return all;
  };
  std::vector<RankResult> results = RunAll(schedule, FakeOrdering::kInOrder, failing, fns);
  EXPECT_THAT(any_message(results),
              ::testing::AnyOf(HasSubstr("at action #0 1RECV_F0<0 (stage 1, microbatch 0): "
                                         "allocating fp64[4]: device full"),
                               HasSubstr("at action #2 0RECV_B0<1 (stage 0, microbatch 0): "
                                         "allocating fp64[4]: device full")));
  RunnerOptions wrong;
  wrong.allocate = [](const TensorSpec&) -> absl::StatusOr<StageTensor> {
    return StageTensor::Host({DataType::kFloat32, {2}});
  };
  results = RunAll(schedule, FakeOrdering::kInOrder, wrong, fns);
  EXPECT_THAT(any_message(results),
              HasSubstr("RunnerOptions::allocate returned fp32[2] for fp64[4]"));
  RunnerOptions declared;
  declared.shapes = ShapeExchange::kDeclared;
  declared.input_specs = [](int, int) -> absl::StatusOr<std::vector<TensorSpec>> {
    return absl::NotFoundError("no such microbatch");
  };
  results = RunAll(schedule, FakeOrdering::kInOrder, declared, fns);
  EXPECT_EQ(results[0].step.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(results[0].step.status().message(),
              HasSubstr("input_specs failed: no such microbatch"));
  declared.input_specs = [](int, int) -> absl::StatusOr<std::vector<TensorSpec>> {
    return std::vector<TensorSpec>{};
  };
  results = RunAll(schedule, FakeOrdering::kInOrder, declared, fns);
  EXPECT_THAT(results[1].step.status().message(),
              HasSubstr("input_specs(1, 0) declares 0 tensors; want 1..8"));
}

}  // namespace
}  // namespace strata::pipeline
