// strata::torch checkpoints: save a torch::nn::Module (and its Adam or
// AdamW optimizer) with the strata checkpoint layer, and load it back in
// place, resharded to the module's current tensor-parallel layout.
//
// A module's parameters and buffers are saved under "<module_prefix><name>"
// (torch's dotted names). Parameters of the tensor-parallel layers of
// strata::nn (ShardedParameters) are saved as their box of the global
// tensor; every other tensor is whole, the same on each rank that holds it,
// and written once (the writing spread over its replicas). The optimizer's
// per-parameter state is keyed by the parameter's NAME, not its index:
// "<optimizer_prefix><name>.exp_avg", ".exp_avg_sq", ".step" (a 0-d int64)
// and ".max_exp_avg_sq" (amsgrad); exp_avg* of a sharded parameter are
// sharded like it.
//
//   strata::nn::ModuleState st;
//   st.module = model.get();                 // any torch::nn::Module
//   st.optimizer = &adam;                    // optional: Adam or AdamW
//   st.shard_replica = {dp_rank, dp_size};   // copies of a tp shard
//   st.whole_replica = {tp_dp_rank, tp_dp_size};  // copies of a whole tensor
//   // Async: returns once the tensors are staged; ckpt writes and commits.
//   STRATA_RETURN_IF_ERROR(strata::nn::SaveModuleState(*ckpt, step, st));
//   ...
//   strata::LoadOptions lo;
//   lo.directory = "/ckpt/run1";
//   lo.group = world->Handle("world").value();   // collective; empty: one process
//   auto report = strata::nn::LoadModuleState(lo, st);
//
// Loading is strict by default (every tensor of the module and optimizer
// must be saved and every saved tensor loaded: NotFound / InvalidArgument
// naming the key), verifies checksums (LoadOptions::verify), and refuses a
// global shape or dtype that differs from the saved one (InvalidArgument
// naming the key and both). The tensors are read into host staging first
// and copied into the module and optimizer only when every read succeeded,
// so a failed load changes nothing.
//
// Multi-rank: a rank whose module or optimizer cannot be loaded (an
// unsupported dtype or optimizer, ...) returns its own error and still
// takes part in the collective load, which then fails promptly on every
// other rank with "rank <k> could not match its targets ..." and the
// reason; likewise a rank that cannot build its save abandons the step
// (Checkpointer::Abandon), so the others' save fails promptly.
//
// CUDA tensors are saved through the Checkpointer's page-locked staging
// (ordered on the current CUDA stream of the first CUDA tensor) and loaded
// through host staging.
//
// Thread-safety: the functions are not thread-safe with respect to the
// module and optimizer (they read or write their tensors); call them
// between training steps.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "strata/base/export.h"
#include "strata/checkpoint/checkpointer.h"
#include "strata/checkpoint/loader.h"
#include "strata/checkpoint/sharded_tensor.h"
#include "strata/checkpoint/state.h"
#include "strata/torch/tensor_parallel.h"

namespace strata::nn {

// What to save or load and how its tensors are laid out across ranks.
struct ModuleState {
  static constexpr int kVersion = 1;
  int version = kVersion;
  // Borrowed; required.
  ::torch::nn::Module* module = nullptr;
  // Borrowed; optional. torch::optim::Adam or torch::optim::AdamW, whose
  // parameters are parameters of `module`.
  ::torch::optim::Optimizer* optimizer = nullptr;
  std::string module_prefix = "model.";
  std::string optimizer_prefix = "optimizer.";
  // The copies of each tensor-parallel shard: e.g. {dp rank, dp size}.
  ReplicaInfo shard_replica;
  // The copies of each whole tensor: e.g. the rank in and size of the
  // tp-dp group (one pipeline stage).
  ReplicaInfo whole_replica;
};

// A SaveRequest over the module's tensors, with the tensors its pointers
// refer to (contiguous copies of non-contiguous ones): keep it alive until
// Checkpointer::Save returns.
struct ModuleSaveRequest {
  SaveRequest request;
  std::vector<::torch::Tensor> keep_alive;
};

// The shards of `state` as a SaveRequest for `step` (request.state left
// default). InvalidArgument naming the key for a dtype strata cannot store,
// an optimizer other than Adam/AdamW, an optimizer parameter that is not a
// parameter of the module, an optimizer state shaped unlike its parameter,
// a null module or bad replica counts.
STRATA_EXPORT absl::StatusOr<ModuleSaveRequest> BuildModuleSaveRequest(const ModuleState& state,
                                                                       int64_t step);

// Asynchronous save: stages the tensors of `state` into `checkpointer`
// (Checkpointer::Save) and returns; the checkpointer writes and commits in
// the background. `plain` is saved beside the tensors (its step is set to
// `step`).
STRATA_EXPORT absl::Status SaveModuleState(Checkpointer& checkpointer, int64_t step,
                                           const ModuleState& state,
                                           const TrainingState& plain = {});

// Synchronous save: a Checkpointer of `options` (collective when options
// has a communicator) saves `state` and is closed; returns once the
// checkpoint is committed, or with the save's error (DeadlineExceeded after
// options.commit_timeout).
STRATA_EXPORT absl::Status SaveModuleStateSync(const CheckpointOptions& options, int64_t step,
                                               const ModuleState& state,
                                               const TrainingState& plain = {});

// Loads the checkpoint of `options` (latest or options.step) into the
// module and optimizer of `state`, in place, each rank reading the boxes of
// its current layout. Optimizer states a parameter does not have yet (no
// step taken) are created when the checkpoint has them. Collective over
// options.group when set. Errors: those of CheckpointReader::Open and Load,
// and those of BuildModuleSaveRequest.
STRATA_EXPORT absl::StatusOr<LoadReport> LoadModuleState(const LoadOptions& options,
                                                         const ModuleState& state);

}  // namespace strata::nn
