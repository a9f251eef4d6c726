// strata::nn::DataParallel: data parallelism for C++ trainers on LibTorch,
// the C++ side of strata.nn.DataParallel (docs/data-parallel.md).
//
// A helper the training loop keeps beside its model: the gradients of the
// given parameters are averaged (or summed) over a data-parallel group,
// bucket by bucket, while backward still runs.
//
//   strata::GroupHandle dp = world->Handle("dp").value();
//   auto ddp = strata::nn::DataParallel::Create(model->named_parameters(), dp).value();
//   torch::optim::AdamW opt(model->parameters(), 1e-3);
//   for (auto& [x, y] : batches) {          // this dp rank's part of each batch
//     ddp->ZeroGrad();                      // zeroes the flat gradient buffers
//     auto loss = torch::mse_loss(model->forward(x), y);
//     loss.backward();                      // buckets all-reduce as gradients appear
//     opt.step();                           // the gradients are reduced here
//   }
//
// - Gradients live in one flat buffer per dtype; each parameter's grad() is
//   a view of it, so a bucket (a contiguous range of about bucket_bytes)
//   reduces in place.
// - A post-accumulate-grad hook on each parameter marks it ready; a bucket
//   whose gradients are all ready starts its all-reduce at once, buckets in
//   index order on every rank. A callback queued on autograd's engine starts
//   what is left when backward ends and waits for every bucket, so after
//   backward() the gradients are reduced.
// - The buckets follow the order gradients became ready in the first
//   backward (before it: reverse order of the parameters), checked to be the
//   same on every rank.
// - NoSync() accumulates without reducing (gradient accumulation).
// - On CUDA tensors (a nccl communicator) each bucket's collective runs on a
//   stream of DataParallel's own, after an event recorded on the current
//   stream (the gradients' producer); the current stream waits for it before
//   backward returns.
//
// Errors: Create returns InvalidArgument when the ranks hold parameters of
// different shapes, dtypes or counts (collectively, naming the parameter
// and the ranks). Errors during backward (unused parameters, buckets that
// differ across ranks, a failed collective) are thrown from backward() as
// c10::Error carrying the message ("DataParallel: unused parameters ...",
// "DataParallel: bucket mismatch ...", or the communicator's), as torch's
// own modules report errors. A failed collective is thrown only after every
// bucket of the step was waited for: parameters and optimizer state are
// untouched (do not call step()), the gradient buffers hold reduced and
// local values; ZeroGrad() or Rebuild() abandons the step.
//
// The group is a handle (strata/parallel/group_handle.h), resolved at the
// start of every backward pass (and FinishGradSync): after a World rebuild
// (a replica left), the next backward reduces over the new generation's
// group, averaging over its size; the buckets do not depend on the group's
// size, so nothing else changes. A step whose reduction failed in the old
// generation is abandoned with ZeroGrad() first. A handle that cannot be
// followed (its World destroyed, a pinned layout that changed) makes
// backward() throw the handle's error. A communicator without a World:
// GroupHandle::Fixed(&comm), which must then outlive the DataParallel.
//
// ZeRO-1 (sharded optimizer state) is Python's strata.optim.
//
// Thread-safety: not thread-safe; backward passes of the parameters run one
// at a time. The parameters must outlive it; it must outlive the backward
// passes that use its hooks (the destructor removes them).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "strata/base/export.h"
#include "strata/comm/communicator.h"
#include "strata/parallel/group_handle.h"

namespace strata::nn {

struct DataParallelOptions {
  static constexpr int kVersion = 1;
  int version = kVersion;
  // A bucket closes once it holds this many bytes of gradients (torch DDP's
  // 25 MiB).
  int64_t bucket_bytes = int64_t{25} << 20;
  // kAvg (the mean over the group) or kSum.
  ReduceOp reduce_op = ReduceOp::kAvg;
  // Parameters without a gradient in a backward pass are reduced as their
  // buffers hold them instead of failing, and the bucket order is rank 0's.
  bool find_unused_parameters = false;
  // Parameters start as rank 0's (broadcast in Create), as DDP.
  bool broadcast_parameters = true;
  // Time each collective may take; zero: the communicator's default.
  absl::Duration timeout = absl::ZeroDuration();
  // Keep events(), the order of what happened (tests, debugging).
  bool record_events = false;
};

// What events() records.
struct DataParallelEvent {
  enum class Kind { kReady, kLaunch, kBackwardEnd, kDone, kLayout };
  Kind kind;
  int64_t index = -1;  // the bucket (kLaunch, kDone), the bucket count (kLayout)
  std::string name;    // the parameter (kReady)
};

class STRATA_EXPORT DataParallel {
 public:
  // Collective over `group` (every rank calls it with the same model):
  // registers the hooks and makes each parameter's grad() a view of the
  // flat buffers. Parameters that do not require grad are skipped.
  static absl::StatusOr<std::unique_ptr<DataParallel>> Create(
      const std::vector<std::pair<std::string, ::torch::Tensor>>& named_parameters,
      const GroupHandle& group, const DataParallelOptions& options = {});
  // From a module's named_parameters().
  static absl::StatusOr<std::unique_ptr<DataParallel>> Create(
      const ::torch::OrderedDict<std::string, ::torch::Tensor>& named_parameters,
      const GroupHandle& group, const DataParallelOptions& options = {});

  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // While alive, backward passes accumulate without reducing; the first
  // backward after it reduces the sum.
  class STRATA_EXPORT NoSync {
   public:
    explicit NoSync(DataParallel& dp);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DataParallel& dp_;
    bool before_;
  };

  // Zeroes the gradient buffers in place (grad() stays a view) and
  // abandons a step whose reduction failed.
  void ZeroGrad();
  // Starts every bucket not started yet and waits for all of them (what the
  // end of backward does by itself).
  absl::Status FinishGradSync();
  // Moves to another data-parallel group (in-process recovery without a
  // World: a communicator shrunk without a lost replica; a World's handle
  // follows its rebuilds without this). Abandons the step under way; keeps
  // the bucket order. Collective over the new group.
  absl::Status Rebuild(const GroupHandle& group);

  const GroupHandle& group() const;
  int num_buckets() const;
  // The parameters of bucket `b`, in their order in the buffer.
  std::vector<std::string> bucket_parameters(int b) const;
  const std::vector<DataParallelEvent>& events() const;

  struct State;  // shared with the hooks

 private:
  explicit DataParallel(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace strata::nn
