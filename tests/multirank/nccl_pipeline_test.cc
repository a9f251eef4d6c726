// PipelineRunner over the NCCL backend, one process per pipeline rank, the
// stage functions computing on the GPU: losses and gradients equal a plain
// loop on the host for GPipe, 1F1B and interleaved 1F1B, over two steps of
// one runner.
//
// The stage functions enqueue their kernels on RunnerOptions::stream and
// never synchronize (except the last stage, which reads its loss), so the
// results are right only if the runner orders every send after the compute
// that produced it and every compute after the receives it reads, on that
// stream. Tensors are large (512 KiB) so that a missing order shows.
// Shapes are declared (ShapeExchange::kDeclared: device communicators take
// no shape headers) and vary by microbatch.
//
//   STRATA_TEST_BACKEND=nccl tests/tools/run_torchrun.sh --np 4 -- \
//       --no-python build/tests/multirank/nccl_pipeline_test
//
// Run alone (ctest) it skips: it needs 2 ranks or more, which
// tools/dev/gpu_checks.sh starts, several on one GPU where NCCL allows it.
// With STRATA_TEST_BACKEND=gloo (run_torchrun.sh's default) the same test
// runs on CPU ranks, the stage functions on the host: a rehearsal that
// `make test` runs where there is no GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nccl_pipeline_kernels.h"
#include "strata/comm/backend.h"
#include "strata/comm/launch_env.h"
#include "strata/parallel/pipeline/generate.h"
#include "strata/parallel/pipeline/runner.h"

namespace strata::pipeline::testing {
namespace {

constexpr int kBase = 1 << 16;  // elements of the smallest microbatch (fp64)

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

// Elements of microbatch i: three sizes in turn.
int Length(int microbatch) { return kBase + 257 * (microbatch % 3); }
double A(int stage) { return 0.9 + 0.05 * stage; }
double B(int stage) { return 0.1 * (stage + 1); }

// The plain loop: losses of m microbatches and the gradients of every
// stage's (a, b), seeded with 1/m (GradScaling::kMean).
struct Reference {
  std::vector<double> losses, da, db;
};

Reference PlainLoop(int stages, int m) {
  Reference r;
  r.da.assign(stages, 0.0);
  r.db.assign(stages, 0.0);
  for (int i = 0; i < m; ++i) {
    const int n = Length(i);
    std::vector<std::vector<double>> h(stages + 1, std::vector<double>(n)), g = h;
    for (int j = 0; j < n; ++j) h[0][j] = std::sin(7.0 * i + j);
    for (int s = 0; s < stages; ++s) {
      for (int j = 0; j < n; ++j) {
        h[s + 1][j] = A(s) * h[s][j] + B(s);
        g[s + 1][j] = g[s][j] + h[s][j];
      }
    }
    double loss = 0;
    std::vector<double> dh(n), dg(n);
    for (int j = 0; j < n; ++j) {
      loss += 0.5 * (h[stages][j] * h[stages][j] + g[stages][j] * g[stages][j]) / n;
      dh[j] = h[stages][j] / n / m;
      dg[j] = g[stages][j] / n / m;
    }
    r.losses.push_back(loss);
    for (int s = stages - 1; s >= 0; --s) {
      for (int j = 0; j < n; ++j) {
        r.da[s] += dh[j] * h[s][j];
        r.db[s] += dh[j];
        dh[j] = A(s) * dh[j] + dg[j];
      }
    }
  }
  return r;
}

// This process's rank of a launched job of 2 ranks or more.
std::optional<LaunchEnv> Launched() {
  absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
  if (!env.ok() || env->world_size < 2) return std::nullopt;
  return *env;
}

const double* D(const StageTensor& t) { return static_cast<const double*>(t.data); }
double* M(const StageTensor& t) { return static_cast<double*>(t.data); }

// The backend under test: $STRATA_TEST_BACKEND (nccl or gloo), default nccl.
std::string Backend() {
  const char* b = std::getenv("STRATA_TEST_BACKEND");
  return b != nullptr && *b != '\0' ? b : "nccl";
}

class NcclPipelineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    gpu_ = Backend() == "nccl";
    if (!gpu_ && Backend() != "gloo") {
      FAIL() << "STRATA_TEST_BACKEND=" << Backend() << ": want nccl or gloo";
    }
    if (gpu_ && DeviceCount() == 0) {
      GTEST_SKIP() << "no CUDA device visible (runs on the device machine: "
                      "tools/dev/gpu_checks.sh)";
    }
    env_ = Launched();
    if (!env_) {
      GTEST_SKIP() << "needs 2 ranks or more: run under tests/tools/run_torchrun.sh --np N "
                      "(tools/dev/gpu_checks.sh does)";
    }
    if (!gpu_) return;
    device_ = env_->local_rank % DeviceCount();
    ASSERT_EQ(cudaSetDevice(device_), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // A root communicator of its own for each run (through the launcher's
  // store, $STRATA_STORE).
  std::unique_ptr<Communicator> Root() {
    RootOptions options;
    options.backend = Backend();
    options.comm.name = "pp";
    options.comm.timeout = absl::Seconds(120);
    options.nccl.device = device_;
    absl::StatusOr<std::unique_ptr<Communicator>> c = CreateRootCommunicator(*env_, options);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(c).value() : nullptr;
  }

  StageTensor Alloc(const TensorSpec& spec) {
    if (!gpu_) return StageTensor::Host(spec);
    void* p = nullptr;
    const size_t bytes = std::max<size_t>(spec.num_bytes(), 8);
    EXPECT_EQ(cudaMallocAsync(&p, bytes, stream_), cudaSuccess);
    cudaStream_t s = stream_;
    // Stream-ordered free: after everything already on the stream, so after
    // every kernel and transfer that used the tensor.
    return StageTensor{spec, p, std::shared_ptr<void>(p, [s](void* q) { cudaFreeAsync(q, s); })};
  }

  static std::vector<TensorSpec> Specs(int microbatch) {
    const int64_t n = Length(microbatch);
    return {{DataType::kFloat64, {n}}, {DataType::kFloat64, {1, n}}};
  }

  // The stage functions; gradients accumulate in `grads` (the
  // communicator's memory: da of stage s at 2s, db at 2s + 1).
  StageFunctions Functions(int stages, double* grads) {
    StageFunctions f;
    f.forward = [this, stages](const ForwardCall& call) -> absl::StatusOr<ForwardResult> {
      const int s = call.stage;
      TensorList in = *call.inputs;
      const int n = Length(call.microbatch);
      if (s == 0) {
        in = {Alloc(Specs(call.microbatch)[0]), Alloc(Specs(call.microbatch)[1])};
        if (gpu_) {
          LaunchInput(call.microbatch, M(in[0]), M(in[1]), n, stream_);
        } else {
          HostKernels::Input(call.microbatch, M(in[0]), M(in[1]), n);
        }
      }
      if (in.size() != 2 || in[0].spec.num_elements() != n) {
        return absl::InternalError(
            absl::StrCat("stage ", s, " microbatch ", call.microbatch, ": unexpected inputs"));
      }
      ForwardResult out;
      out.outputs = {Alloc(in[0].spec), Alloc(in[1].spec)};
      if (gpu_) {
        LaunchForward(A(s), B(s), D(in[0]), D(in[1]), M(out.outputs[0]), M(out.outputs[1]), n,
                      stream_);
      } else {
        HostKernels::Forward(A(s), B(s), D(in[0]), D(in[1]), M(out.outputs[0]), M(out.outputs[1]),
                             n);
      }
      if (s == stages - 1) {
        double host = 0;
        if (gpu_) {
          StageTensor loss = Alloc({DataType::kFloat64, {1}});
          LaunchLoss(D(out.outputs[0]), D(out.outputs[1]), n, M(loss), stream_);
          if (cudaMemcpyAsync(&host, loss.data, 8, cudaMemcpyDeviceToHost, stream_) !=
                  cudaSuccess ||
              cudaStreamSynchronize(stream_) != cudaSuccess) {
            return absl::InternalError("reading the loss");
          }
        } else {
          HostKernels::Loss(D(out.outputs[0]), D(out.outputs[1]), n, &host);
        }
        out.loss = host;
      }
      if (s == 0) out.context = std::make_shared<TensorList>(in);
      return out;
    };
    f.backward = [this, stages, grads](const BackwardCall& call) -> absl::StatusOr<TensorList> {
      const int s = call.stage;
      const TensorList& outs = *call.outputs;
      const int n = static_cast<int>(outs[0].spec.num_elements());
      TensorList d;
      if (s == stages - 1) {
        d = {Alloc(outs[0].spec), Alloc(outs[1].spec)};
        if (gpu_) {
          LaunchSeed(call.loss_scale, D(outs[0]), D(outs[1]), M(d[0]), M(d[1]), n, stream_);
        } else {
          HostKernels::Seed(call.loss_scale, D(outs[0]), D(outs[1]), M(d[0]), M(d[1]), n);
        }
      } else {
        d = *call.output_grads;
      }
      const TensorList& in =
          s == 0 ? *std::static_pointer_cast<TensorList>(*call.context) : *call.inputs;
      if (gpu_) {
        LaunchWeightGrad(D(d[0]), D(in[0]), n, grads + 2 * s, grads + 2 * s + 1, stream_);
      } else {
        HostKernels::WeightGrad(D(d[0]), D(in[0]), n, grads + 2 * s, grads + 2 * s + 1);
      }
      if (s == 0) return TensorList{};
      TensorList gin = {Alloc(in[0].spec), Alloc(in[1].spec)};
      if (gpu_) {
        LaunchInputGrad(A(s), D(d[0]), D(d[1]), M(gin[0]), M(gin[1]), n, stream_);
      } else {
        HostKernels::InputGrad(A(s), D(d[0]), D(d[1]), M(gin[0]), M(gin[1]), n);
      }
      return gin;
    };
    return f;
  }

  void ExpectPlainLoop(ScheduleKind kind, int m, int v) {
    ScheduleOptions so;
    so.kind = kind;
    so.num_ranks = env_->world_size;
    so.num_microbatches = m;
    so.virtual_stages = v;
    absl::StatusOr<Schedule> schedule = GenerateSchedule(so);
    ASSERT_TRUE(schedule.ok()) << schedule.status();
    SCOPED_TRACE(schedule->name());
    std::unique_ptr<Communicator> comm = Root();
    ASSERT_NE(comm, nullptr);
    RunnerOptions options;
    options.timeout = absl::Seconds(120);
    options.shapes = ShapeExchange::kDeclared;
    options.input_specs = [](int, int microbatch) -> absl::StatusOr<std::vector<TensorSpec>> {
      return Specs(microbatch);
    };
    options.allocate = [this](const TensorSpec& spec) -> absl::StatusOr<StageTensor> {
      return Alloc(spec);
    };
    options.stream = stream_;  // null (ignored) on Gloo
    absl::StatusOr<std::unique_ptr<PipelineRunner>> runner =
        PipelineRunner::Create(*schedule, GroupHandle::Fixed(comm.get()), options);
    ASSERT_TRUE(runner.ok()) << runner.status();
    const int stages = schedule->num_stages(), me = comm->rank();
    const int last_rank = schedule->rank_of_stage(stages - 1);
    const Reference ref = PlainLoop(stages, m);
    std::vector<double> host(2 * stages);
    double* grads = host.data();
    if (gpu_) {
      ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&grads), host.size() * sizeof(double)),
                cudaSuccess);
    }
    const StageFunctions fns = Functions(stages, grads);
    for (int step = 0; step < 2; ++step) {
      SCOPED_TRACE(absl::StrCat("step ", step));
      if (gpu_) {
        ASSERT_EQ(cudaMemsetAsync(grads, 0, host.size() * sizeof(double), stream_), cudaSuccess);
      } else {
        std::fill(host.begin(), host.end(), 0.0);
      }
      absl::StatusOr<StepResult> result = (*runner)->Step(fns);
      ASSERT_TRUE(result.ok()) << result.status();
      if (gpu_) ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
      ASSERT_EQ(result->losses.size(), me == last_rank ? static_cast<size_t>(m) : 0u);
      for (size_t i = 0; i < result->losses.size(); ++i) {
        EXPECT_NEAR(result->losses[i], ref.losses[i], 1e-9 * std::abs(ref.losses[i]))
            << "microbatch " << i;
      }
      if (gpu_) {
        ASSERT_EQ(
            cudaMemcpy(host.data(), grads, host.size() * sizeof(double), cudaMemcpyDeviceToHost),
            cudaSuccess);
      }
      for (int s : schedule->stages_of_rank(me)) {
        EXPECT_NEAR(host[2 * s], ref.da[s], 1e-9 * std::abs(ref.da[s])) << "da, stage " << s;
        EXPECT_NEAR(host[2 * s + 1], ref.db[s], 1e-9 * std::abs(ref.db[s])) << "db, stage " << s;
      }
    }
    if (gpu_) cudaFree(grads);
  }

  bool gpu_ = true;
  std::optional<LaunchEnv> env_;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
};

TEST_F(NcclPipelineTest, GPipeEqualsThePlainLoop) { ExpectPlainLoop(ScheduleKind::kGPipe, 6, 1); }

TEST_F(NcclPipelineTest, OneFOneBEqualsThePlainLoop) { ExpectPlainLoop(ScheduleKind::k1F1B, 8, 1); }

TEST_F(NcclPipelineTest, Interleaved1F1BEqualsThePlainLoop) {
  ExpectPlainLoop(ScheduleKind::kInterleaved1F1B, 2 * env_->world_size, 2);
}

}  // namespace
}  // namespace strata::pipeline::testing
