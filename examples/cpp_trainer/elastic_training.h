// The elastic part of cpp_trainer (no LibTorch needed): a linear model
// trained data-parallel with strata::elastic::ElasticLoop, so that a rank
// killed from outside is survived in the same processes.
//
// Each global step n takes the samples [n*B, (n+1)*B) (modulo the data
// set) and hands them to the data-parallel replicas there are now in
// near-equal contiguous slices; each replica's gradient of the squared
// error is divided by B and summed over dp, so the update is the mean over
// the global batch whatever dp is, and a run that loses a replica trains
// the same sequence of updates as one that does not. Ranks of one replica
// (tp > 1) compute the same thing: the model is not split over tp here; the
// mesh's tp only decides which live ranks leave with a dropped replica.
//
// --kill-rank R --kill-step S: before anything else, rank R forks a small
// watcher process, which waits until rank 0 has recorded step S in the run
// directory and then sends SIGKILL to rank R. The kill comes from another
// process at a moment rank R does not choose (it may be inside the dp
// all-reduce, or between steps); the survivors detect it, agree, shrink and
// redo the failed step. Run it under `mpirun --with-ft ulfm`.
//
// --spares N: the last N ranks of the job are hot spares (WorldOptions::
// spares): they stand by in ElasticLoop::StandBy until a failure, when one
// takes the failed rank's mesh position and receives the parameters of its
// position from its dp group (the restore callback), so dp stays.
//
// --check 1: at the end, every survivor compares its parameters (bitwise)
// with the other survivors', and rank 0 compares them with a reference it
// computes itself: the same global batches in one process, no failure.
#pragma once

#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "strata/base/status.h"
#include "strata/comm/launch_env.h"
#include "strata/comm/store.h"
#include "strata/elastic/elastic_loop.h"
#include "strata/parallel/mesh.h"
#include "strata/parallel/world.h"

struct ElasticDemoOptions {
  int steps = 40;
  int kill_rank = -1;
  int kill_step = 10;
  int step_sleep_ms = 20;
  int spares = 0;
  bool check = false;
  // How the survivors agree: "store" (the default) or "ulfm"
  // (MPIX_Comm_iagree, under mpirun --with-ft ulfm).
  std::string agreement = "store";
  std::string run_dir;  // default: the temporary directory
};

// The synthetic regression task: x ~ N(0, 1)^kDim, y = x . w_true + noise.
class LinearTask {
 public:
  static constexpr int kDim = 16;
  static constexpr int kSamples = 4096;
  static constexpr int kBatch = 48;
  static constexpr double kLr = 0.1;

  LinearTask() : x_(kSamples * kDim), y_(kSamples) {
    std::mt19937_64 rng(7);
    std::normal_distribution<double> normal;
    std::vector<double> w(kDim);
    for (double& v : w) v = normal(rng);
    for (int i = 0; i < kSamples; ++i) {
      double dot = 0;
      for (int k = 0; k < kDim; ++k) {
        x_[i * kDim + k] = normal(rng);
        dot += x_[i * kDim + k] * w[k];
      }
      y_[i] = dot + 0.1 * normal(rng);
    }
  }

  // Adds the gradient of sum_i (x_i . w - y_i)^2 / 2 over the samples
  // [begin, end) of global step `step`, divided by the global batch.
  void AddGradient(int64_t step, int begin, int end, const std::vector<double>& w,
                   std::vector<double>& grad) const {
    for (int j = begin; j < end; ++j) {
      const int i = static_cast<int>((step * kBatch + j) % kSamples);
      double err = -y_[i];
      for (int k = 0; k < kDim; ++k) err += x_[i * kDim + k] * w[k];
      for (int k = 0; k < kDim; ++k) grad[k] += err * x_[i * kDim + k] / kBatch;
    }
  }

  double Loss(const std::vector<double>& w) const {
    double sum = 0;
    for (int i = 0; i < kSamples; ++i) {
      double err = -y_[i];
      for (int k = 0; k < kDim; ++k) err += x_[i * kDim + k] * w[k];
      sum += err * err / 2;
    }
    return sum / kSamples;
  }

  // The reference: every global batch in this process, no communication.
  std::vector<double> Train(int steps) const {
    std::vector<double> w(kDim, 0.0), g(kDim);
    for (int s = 0; s < steps; ++s) {
      std::fill(g.begin(), g.end(), 0.0);
      AddGradient(s, 0, kBatch, w, g);
      for (int k = 0; k < kDim; ++k) w[k] -= kLr * g[k];
    }
    return w;
  }

 private:
  std::vector<double> x_, y_;
};

// A job-unique name (mpirun's PMIx namespace, torchrun's run id).
inline std::string ElasticJobName() {
  for (const char* key : {"PMIX_NAMESPACE", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"}) {
    if (const char* v = std::getenv(key); v != nullptr && *v != '\0') {
      std::string s = v;
      for (char& c : s) {
        if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '.') c = '_';
      }
      return s;
    }
  }
  return absl::StrCat("pid", getpid());  // one process: its own name
}

// This job's directory: the store, and the last committed step.
inline std::string RunDir(const ElasticDemoOptions& o) {
  const std::string base =
      o.run_dir.empty() ? std::filesystem::temp_directory_path().string() : o.run_dir;
  return absl::StrCat(base, "/strata-cpp-trainer-", ElasticJobName(), "-", getuid());
}

// Rank 0 records the last committed step; the watcher reads it.
inline void WriteStep(const std::string& dir, int64_t step) {
  const std::string path = dir + "/step", tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << step;
  }
  std::rename(tmp.c_str(), path.c_str());
}

inline int64_t ReadStep(const std::string& dir) {
  std::ifstream f(dir + "/step");
  int64_t step = -1;
  f >> step;
  return f ? step : -1;
}

// Forks the watcher that kills this process once rank 0 has committed step
// `kill_step`. Called before MPI starts (a fork afterwards is unsafe with
// some MPI transports) and before any thread. The watcher dies with its
// parent if that ends first.
inline void StartKillWatcher(const std::string& dir, int rank, int kill_step) {
  const pid_t target = getpid();
  const pid_t child = fork();
  if (child != 0) return;  // the rank goes on (fork failed: no kill; --check then fails)
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != target) _exit(0);
  while (ReadStep(dir) < kill_step) usleep(2000);
  // Some way into the next step, so that the kill may land in a collective.
  usleep(static_cast<useconds_t>(5000 + (rank * 7919) % 15000));
  std::fprintf(stderr,
               "{\"event\": \"kill\", \"rank\": %d, \"pid\": %d, \"after_step\": %d, "
               "\"by\": \"watcher %d\"}\n",
               rank, static_cast<int>(target), kill_step, static_cast<int>(getpid()));
  std::fflush(stderr);
  kill(target, SIGKILL);
  _exit(0);
}

inline uint64_t HashParams(const std::vector<double>& w) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the bytes
  for (double v : w) {
    unsigned char b[sizeof(double)];
    std::memcpy(b, &v, sizeof(v));
    for (unsigned char c : b) h = (h ^ c) * 1099511628211ull;
  }
  return h;
}

inline absl::Status CheckFailed(const std::string& why) {
  return absl::InternalError(absl::StrCat("check failed: ", why));
}

inline absl::Status CheckRun(const ElasticDemoOptions& o, const strata::LaunchEnv& env,
                             strata::World& w_world, const strata::elastic::LoopResult& result,
                             const LinearTask& task, const std::vector<double>& w);

inline absl::Status TrainElastic(const strata::LaunchEnv& env, const strata::Mesh& mesh,
                                 const ElasticDemoOptions& o) {
  const std::string dir = RunDir(o);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  strata::WorldOptions world_options;
  world_options.spares = o.spares;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<strata::World> world,
                          strata::World::Create(env, mesh, world_options));
  strata::FileStoreOptions fso;
  fso.path = dir + "/store";
  // Every step's commit waits on the store, usually for well under a
  // millisecond: poll finely (the default, 0.5 ms doubling up to 20 ms,
  // suits a store on a network filesystem shared by many nodes).
  fso.min_poll = absl::Microseconds(50);
  fso.max_poll = absl::Milliseconds(2);
  STRATA_ASSIGN_OR_RETURN(std::shared_ptr<strata::Store> store, strata::OpenFileStore(fso));
  strata::elastic::ElasticOptions options;
  options.job = "cpp_trainer";
  if (o.agreement == "ulfm") {
    options.agreement = strata::elastic::AgreementKind::kUlfm;
  } else if (o.agreement != "store") {
    return absl::InvalidArgumentError(
        absl::StrCat("--agreement ", o.agreement, ": want store or ulfm"));
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<strata::elastic::ElasticLoop> loop,
                          strata::elastic::ElasticLoop::Create(*world, store, options));

  const LinearTask task;
  std::vector<double> w(LinearTask::kDim, 0.0), grad(LinearTask::kDim);
  strata::elastic::LoopCallbacks cb;
  cb.step = [&](const strata::elastic::StepContext& ctx) -> absl::Status {
    if (o.step_sleep_ms > 0) absl::SleepFor(absl::Milliseconds(o.step_sleep_ms));
    const strata::Mesh m = ctx.world->mesh();
    STRATA_ASSIGN_OR_RETURN(auto coords, m.Coords(ctx.world->rank()));
    const int dp = m.dp(), d = coords.at("dp");
    const int begin = LinearTask::kBatch * d / dp, end = LinearTask::kBatch * (d + 1) / dp;
    std::fill(grad.begin(), grad.end(), 0.0);
    task.AddGradient(ctx.step, begin, end, w, grad);
    STRATA_ASSIGN_OR_RETURN(strata::Communicator * dp_group, ctx.world->Group("dp"));
    strata::Buffer b{grad.data(), grad.size(), strata::DataType::kFloat64};
    STRATA_ASSIGN_OR_RETURN(auto work, dp_group->AllReduce(b, b, strata::ReduceOp::kSum));
    return work->Wait();
  };
  cb.apply = [&](const strata::elastic::StepContext& ctx) -> absl::Status {
    for (int k = 0; k < LinearTask::kDim; ++k) w[k] -= LinearTask::kLr * grad[k];
    if (ctx.world->rank() == 0) {
      std::printf("{\"event\": \"step\", \"step\": %lld, \"world\": %d, \"dp\": %d}\n",
                  static_cast<long long>(ctx.step), ctx.world->size(), ctx.world->mesh().dp());
      std::fflush(stdout);
      WriteStep(dir, ctx.step);
    }
    return absl::OkStatus();
  };
  // The failed step never reached `apply`, and its gradient is computed
  // afresh when the step is redone: nothing to restore, except on a spare
  // placed in the mesh, whose dp group sends it the parameters.
  cb.restore = [&](strata::elastic::RecoveryEvent& e) -> absl::Status {
    if (e.replaced.empty()) return absl::OkStatus();
    STRATA_ASSIGN_OR_RETURN(std::vector<int> group, world->mesh().GroupOf(world->rank(), "dp"));
    int source = -1;
    bool gains = false;
    for (int i = 0; i < static_cast<int>(group.size()); ++i) {
      const int job = e.members[static_cast<size_t>(group[static_cast<size_t>(i)])];
      bool placed = false;
      for (const auto& pair : e.replaced) placed = placed || pair.second == job;
      gains = gains || placed;
      if (!placed && source < 0) source = i;
    }
    if (!gains) return absl::OkStatus();
    STRATA_ASSIGN_OR_RETURN(strata::Communicator * dp_group, world->Group("dp"));
    STRATA_ASSIGN_OR_RETURN(auto sent,
                            dp_group->Broadcast(strata::Buffer::Of(w.data(), w.size()), source));
    return sent->Wait();
  };
  cb.on_world_changed = [&](const strata::elastic::RecoveryEvent& e) {
    if (world->rank() == 0) {
      std::printf("%s\n", e.ToJson().c_str());
      std::fflush(stdout);
    }
  };
  STRATA_ASSIGN_OR_RETURN(strata::elastic::LoopResult result, loop->Run(cb, 0, o.steps));
  // With the default LeavePolicy::kExit a rank whose replica was dropped
  // ended its process inside Run (saying why, status 0); with kReturn it
  // would arrive here and must end its process without MPI_Finalize.
  if (result.left) {
    std::fprintf(stderr, "[rank %d] leaves the job: its data-parallel replica was dropped\n",
                 env.rank);
    return absl::OkStatus();
  }
  if (result.stood_by) {
    std::printf("[rank %d] stood by as a spare until the job finished\n", env.rank);
    std::fflush(stdout);
  } else if (world->rank() == 0) {
    std::printf("trained %d steps elastically (%s agreement), ending on %s: loss %.6f\n", o.steps,
                o.agreement.c_str(), strata::elastic::DescribeMesh(world->mesh().spec()).c_str(),
                task.Loss(w));
    std::fflush(stdout);
  }
  absl::Status checked =
      o.check && !result.stood_by ? CheckRun(o, env, *world, result, task, w) : absl::OkStatus();
  // The run directory goes once every survivor (spares too) is done with
  // the store.
  loop.reset();
  STRATA_ASSIGN_OR_RETURN(auto done, world->job().Barrier());
  STRATA_RETURN_IF_ERROR(done->Wait());
  if (world->rank() == 0)
    std::filesystem::remove_all(dir, ec);  // a spare's rank is >= the mesh's size
  if (!result.events.empty()) {
    // A rank was lost: Open MPI's MPI_Finalize (at exit) can then wait
    // forever for it (docs/mpi.md). The verdict is in; end the process
    // here, as strata.elastic.shutdown does.
    world.reset();
    if (!checked.ok()) {
      std::fprintf(stderr, "[rank %d] elastic training: %s\n", env.rank,
                   std::string(checked.message()).c_str());
    }
    std::fflush(nullptr);
    std::_Exit(checked.ok() ? 0 : 1);
  }
  return checked;
}

// --check 1: the same failure everywhere, bitwise equal survivors, and the
// one-process reference.
inline absl::Status CheckRun(const ElasticDemoOptions& o, const strata::LaunchEnv& env,
                             strata::World& w_world, const strata::elastic::LoopResult& result,
                             const LinearTask& task, const std::vector<double>& w) {
  strata::World* world = &w_world;

  // Every survivor saw the same failure and holds the same parameters.
  const size_t expected_events = o.kill_rank >= 0 ? 1 : 0;
  if (result.events.size() != expected_events) {
    return CheckFailed(absl::StrCat("rank ", env.rank, " saw ", result.events.size(),
                                    " recoveries, expected ", expected_events));
  }
  if (expected_events == 1 && result.events[0].failed != std::vector<int>{o.kill_rank}) {
    return CheckFailed(
        absl::StrCat("rank ", env.rank, ": the failed set is not [", o.kill_rank, "]"));
  }
  if (expected_events == 1 && o.spares > 0 &&
      (result.events[0].replaced.size() != 1 ||
       result.events[0].mesh_after.dp != result.events[0].mesh_before.dp)) {
    return CheckFailed(absl::StrCat("rank ", env.rank, ": with ", o.spares,
                                    " spares a spare should have taken rank ", o.kill_rank,
                                    "'s place and kept dp: ", result.events[0].ToJson()));
  }
  std::vector<double> all(static_cast<size_t>(world->size()) * LinearTask::kDim);
  strata::ConstBuffer mine{w.data(), w.size(), strata::DataType::kFloat64};
  strata::Buffer gathered{all.data(), all.size(), strata::DataType::kFloat64};
  STRATA_ASSIGN_OR_RETURN(auto work, world->root().AllGather(mine, gathered));
  STRATA_RETURN_IF_ERROR(work->Wait());
  for (int r = 0; r < world->size(); ++r) {
    const std::vector<double> other(all.begin() + r * LinearTask::kDim,
                                    all.begin() + (r + 1) * LinearTask::kDim);
    if (HashParams(other) != HashParams(w)) {
      return CheckFailed(
          absl::StrCat("rank ", world->rank(), "'s parameters differ from rank ", r, "'s"));
    }
  }
  if (world->rank() == 0) {
    const std::vector<double> ref = task.Train(o.steps);
    double worst = 0, scale = 0;
    for (int k = 0; k < LinearTask::kDim; ++k) {
      worst = std::max(worst, std::abs(ref[k] - w[k]));
      scale = std::max(scale, std::abs(ref[k]));
    }
    worst /= scale;
    std::printf(
        "check: the %d survivors agree bitwise; largest difference from the one-process "
        "reference %.3g (relative to its largest parameter); loss %.6f, reference %.6f\n",
        world->size(), worst, task.Loss(w), task.Loss(ref));
    std::fflush(stdout);
    if (!(worst < 1e-9)) return CheckFailed("the parameters differ from the reference");
  }
  return absl::OkStatus();
}
