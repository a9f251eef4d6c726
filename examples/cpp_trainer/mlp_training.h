// The training part of cpp_trainer, built when strata::torch is available:
// a tensor-parallel MLP (strata::nn::ParallelMLP) learns a fixed random
// teacher MLP on the World's tp groups; gradients are averaged over dp with
// one all-reduce per parameter. Rank 0 prints the loss every few steps.
#pragma once

#include <torch/torch.h>

#include <cstdio>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "strata/base/status.h"
#include "strata/comm/launch_env.h"
#include "strata/parallel/mesh.h"
#include "strata/parallel/world.h"
#include "strata/torch/tensor_parallel.h"

inline absl::Status AverageOverDp(const strata::GroupHandle& dp, const torch::Tensor& grad) {
  strata::Buffer b{grad.data_ptr(), static_cast<size_t>(grad.numel()), strata::DataType::kFloat32};
  STRATA_ASSIGN_OR_RETURN(strata::Communicator * comm, dp.Resolve());  // at each use
  STRATA_ASSIGN_OR_RETURN(auto work, comm->AllReduce(b, b, strata::ReduceOp::kAvg));
  return work->Wait(absl::Now() + absl::Minutes(1));
}

inline absl::Status TrainParallelMLP(const strata::LaunchEnv& env, const strata::Mesh& mesh,
                                     int steps) {
  if (mesh.pp() != 1 || mesh.cp() != 1) {
    if (env.rank == 0) std::printf("training needs pp = cp = 1 (run with --pp 1); skipped\n");
    return absl::OkStatus();
  }
  torch::set_num_threads(1);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<strata::World> world,
                          strata::World::Create(env, mesh, strata::WorldOptions{}));
  // Handles, not communicators: what holds a group across steps follows
  // the World (strata/parallel/group_handle.h).
  STRATA_ASSIGN_OR_RETURN(strata::GroupHandle tp, world->Handle("tp"));
  STRATA_ASSIGN_OR_RETURN(strata::GroupHandle dp, world->Handle("dp"));
  const int64_t hidden = 32, ffn = 64 * mesh.tp(), batch = 64;
  strata::nn::ParallelMLP model(strata::nn::ParallelMLPOptions{hidden, ffn}, tp,
                                strata::nn::InitOptions{42});
  // The teacher, the same on every rank.
  torch::manual_seed(7);
  const torch::Tensor teacher1 = torch::randn({hidden, hidden}) / 4,
                      teacher2 = torch::randn({hidden, hidden}) / 4;
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  float first = 0, last = 0;
  for (int step = 1; step <= steps; ++step) {
    // Every tp rank of a dp replica sees the same batch; replicas differ.
    torch::manual_seed(1000 * step + mesh.Coords(env.rank).value().at("dp"));
    torch::Tensor x = torch::randn({batch, hidden});
    torch::Tensor y = torch::tanh(x.matmul(teacher1)).matmul(teacher2);
    torch::Tensor loss = torch::mse_loss(model->forward(x), y);
    opt.zero_grad();
    loss.backward();
    for (const torch::Tensor& p : model->parameters()) {
      STRATA_RETURN_IF_ERROR(AverageOverDp(dp, p.mutable_grad()));
    }
    opt.step();
    torch::Tensor shown = loss.detach().clone();
    STRATA_RETURN_IF_ERROR(AverageOverDp(dp, shown));
    last = shown.item<float>();
    if (step == 1) first = last;
    if (env.rank == 0 && (step == 1 || step % 10 == 0 || step == steps)) {
      std::printf("mlp step %3d loss %.5f\n", step, last);
      std::fflush(stdout);
    }
  }
  if (env.rank == 0) {
    std::printf("trained a tensor-parallel MLP (tp %d, dp %d): loss %.5f -> %.5f\n", mesh.tp(),
                mesh.dp(), first, last);
  }
  return absl::OkStatus();
}
