// PipelineRunner: executes a validated schedule on one rank of a pipeline
// group, calling the user's stage functions and moving activations and
// gradients over the communicator of a group handle (group_handle.h).
//
// Every rank of the pp group builds a runner over the same schedule and a
// handle on its pipeline group, then calls Step() once per training step:
//
//   strata::pipeline::StageFunctions fns;
//   fns.forward = [&](const strata::pipeline::ForwardCall& call)
//       -> absl::StatusOr<strata::pipeline::ForwardResult> {
//     ...   // stage call.stage on microbatch call.microbatch; inputs empty on stage 0
//   };
//   fns.backward = [&](const strata::pipeline::BackwardCall& call)
//       -> absl::StatusOr<strata::pipeline::TensorList> {
//     ...   // accumulate parameter gradients; return the inputs' gradients
//   };
//   absl::StatusOr<strata::GroupHandle> pp = world->Handle("pp");
//   absl::StatusOr<std::unique_ptr<strata::pipeline::PipelineRunner>> runner =
//       strata::pipeline::PipelineRunner::Create(schedule, *pp, {});
//   absl::StatusOr<strata::pipeline::StepResult> step = (*runner)->Step(fns);
//   step->losses;   // per microbatch on the rank that holds the last stage
//
// What the runner does with each action of its rank's list:
//   F       calls forward with the stage's inputs (the previous stage's
//           outputs: received, or handed over on this rank) and keeps inputs,
//           outputs and the returned context until the backward is done.
//   B, I    calls backward (backward_input) with the outputs' gradients
//           (received, handed over, or none on the last stage, where
//           loss_scale seeds the loss gradient); B frees the activation
//           (before the next compute action, once the sends after the B
//           are posted).
//   W       calls backward_weight and frees the activation (as B).
//   SEND_*  posts asynchronous sends and moves on; the data stays alive
//           until they complete.
//   RECV_*  allocates the tensors and posts asynchronous receives; the
//           compute that needs them waits for them. A forward transfer first
//           carries a small header with the tensors' dtypes and shapes
//           (ShapeExchange::kPerTransfer, so shapes may change at every
//           microbatch, e.g. variable sequence lengths). While a stage's
//           input shapes repeat, the receiver posts the payload's receives
//           with the header's, for the last shapes; when they change, the
//           sender first fills those receives with a filler of the last
//           shapes, and the receiver posts new ones once the header is in
//           (so a change costs one round trip and a filler, a repeat
//           nothing). A gradient has the shape of the activation it belongs
//           to, so it needs no header.
// The schedule's order is deadlock-free under the strictest transport
// (validated with CommModel::kRendezvous), and the runner issues operations
// in that order, so it cannot hang on its own. On a communicator whose
// operations progress independently (Communicator::progresses_independently:
// MPI, Gloo), a header is read only when its data is needed or before the
// next receive from the same peer, so sends listed after a receive are not
// held up by it; on one that runs operations in issue order (NCCL), the
// header is read at its RECV, keeping the payload's receives right behind
// it. On the former the receives listed between a compute action and the
// next are also posted before the compute (when that cannot reorder what
// the compute waits for), so a gradient or activation can land while this
// rank computes; this holds one receive buffer a compute action earlier.
//
// Gradients accumulate across microbatches in the stage functions (as
// autograd does); with GradScaling::kMean the last stage's loss gradient is
// seeded with 1/m, so the accumulated gradients are the mean over
// microbatches (torch.distributed.pipelining's scale_grads=True).
//
// Failure: any error (a stage function's status, a deadline, a peer's
// failure) ends the step with that error's code and a message naming this
// rank, the action's index and token, its stage and microbatch. Before
// returning, the runner revokes the communicator (OnFailure::kRevoke), so
// the other ranks' pending operations fail at once and they return too,
// naming their own action; the communicator is then unusable (rebuild or
// shrink it). Every wait ends by the step's deadline. A stage function that
// never returns cannot be interrupted.
//
// Rebuilds: the runner resolves its handle at the start of every step, so it
// follows a World rebuild that keeps this rank's rank and the group's size
// (other data-parallel replicas left). Its schedule is for one pipeline
// layout, so it pins the handle (GroupHandle::Pin): after a rebuild that
// changed the layout, Step fails with FailedPrecondition naming both
// generations and layouts, and a new runner must be built.
//
// Thread-safety: not thread-safe; one Step at a time. The stage functions
// run on the calling thread.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "strata/base/dtype.h"
#include "strata/base/export.h"
#include "strata/comm/communicator.h"
#include "strata/parallel/group_handle.h"
#include "strata/parallel/pipeline/schedule.h"

namespace strata::pipeline {

// The most tensors one transfer carries and the most dims one tensor has.
inline constexpr int kMaxTransferTensors = 8;
inline constexpr int kMaxTensorDims = 8;

struct STRATA_EXPORT TensorSpec {
  DataType dtype = DataType::kFloat32;
  std::vector<int64_t> shape;

  int64_t num_elements() const;
  size_t num_bytes() const;
  // "fp32[4, 16]".
  std::string ToString() const;
  friend bool operator==(const TensorSpec& a, const TensorSpec& b) {
    return a.dtype == b.dtype && a.shape == b.shape;
  }
  friend bool operator!=(const TensorSpec& a, const TensorSpec& b) { return !(a == b); }
};

// A tensor passed between the runner and the stage functions: its spec, its
// data in the communicator's memory, and an owner that keeps the storage
// alive (a torch tensor, a std::vector, ...). The runner never reads or
// writes the data itself: it sends it, receives into it, and drops its
// references when the tensor is no longer needed.
struct STRATA_EXPORT StageTensor {
  TensorSpec spec;
  void* data = nullptr;
  std::shared_ptr<void> owner;

  // A zero-filled host tensor that owns its storage.
  static StageTensor Host(TensorSpec spec);
};
using TensorList = std::vector<StageTensor>;

struct STRATA_EXPORT ForwardCall {
  int stage = 0;
  int microbatch = 0;
  // The previous stage's outputs; empty on stage 0 (it reads its own data).
  const TensorList* inputs = nullptr;
};

struct STRATA_EXPORT ForwardResult {
  // Sent to (or handed to) the next stage; at least one, except on the last
  // stage, where they are ignored.
  TensorList outputs;
  // The last stage's loss for this microbatch (required there).
  std::optional<double> loss;
  // Anything the stage wants back in its backward (an autograd graph, saved
  // tensors); released with the activation.
  std::shared_ptr<void> context;
};

struct STRATA_EXPORT BackwardCall {
  int stage = 0;
  int microbatch = 0;
  const TensorList* inputs = nullptr;   // as given to forward
  const TensorList* outputs = nullptr;  // as returned by forward
  // The gradient of each output (same specs); empty on the last stage.
  const TensorList* output_grads = nullptr;
  const std::shared_ptr<void>* context = nullptr;
  // On the last stage: what to seed the loss gradient with (1/m under
  // GradScaling::kMean, 1 under kSum). 1 elsewhere.
  double loss_scale = 1.0;
};

// The user's stage code. backward returns the gradient of each input, with
// the inputs' specs (none on stage 0). A schedule with split backwards (I,
// W) needs backward_input (returning the input gradients) and
// backward_weight instead of backward.
struct STRATA_EXPORT StageFunctions {
  std::function<absl::StatusOr<ForwardResult>(const ForwardCall&)> forward;
  std::function<absl::StatusOr<TensorList>(const BackwardCall&)> backward;
  std::function<absl::StatusOr<TensorList>(const BackwardCall&)> backward_input;
  std::function<absl::Status(const BackwardCall&)> backward_weight;
};

enum class ShapeExchange : uint8_t {
  // Each forward transfer is preceded by a header with the tensors' dtypes
  // and shapes: shapes may change at any microbatch.
  kPerTransfer,
  // No headers: RunnerOptions::input_specs tells the receiving rank the
  // shapes (both ends call it; the sender checks its outputs against it).
  kDeclared,
};

enum class GradScaling : uint8_t { kMean, kSum };

enum class OnFailure : uint8_t {
  // Revoke the communicator: every rank's pending operations fail at once.
  kRevoke,
  // Abort it locally: the other ranks find out at their deadline.
  kAbort,
};

struct STRATA_EXPORT RunnerOptions {
  static constexpr int kVersion = 1;
  int version = kVersion;
  // The whole step's deadline: every wait ends by Step's start + timeout.
  absl::Duration timeout = absl::Minutes(5);
  ShapeExchange shapes = ShapeExchange::kPerTransfer;
  // kDeclared: the specs of `stage`'s inputs for `microbatch`.
  std::function<absl::StatusOr<std::vector<TensorSpec>>(int stage, int microbatch)> input_specs;
  // Allocates a tensor to receive into; unset means StageTensor::Host (only
  // for host-memory communicators).
  std::function<absl::StatusOr<StageTensor>(const TensorSpec&)> allocate;
  GradScaling grad_scaling = GradScaling::kMean;
  OnFailure on_failure = OnFailure::kRevoke;
  // Device communicators: the cudaStream_t the stage functions compute on
  // (cudaStreamLegacy or cudaStreamPerThread for the default stream). Every
  // send and receive is ordered on it, so a send starts after the forward
  // (or backward) that produced its tensors, and a stage function's work
  // on it starts after the receives it reads. Null: the communicator's own
  // stream, which is not ordered with the stage functions' work, so they
  // must synchronize before they return. Host communicators ignore it.
  void* stream = nullptr;
};

// When one compute action ran, in seconds from the step's start.
struct STRATA_EXPORT ComputeTiming {
  Action action;
  double start = 0;
  double end = 0;
};

struct STRATA_EXPORT StepResult {
  // Per microbatch, on the rank that holds the last stage; empty elsewhere.
  std::vector<double> losses;
  // The most activations this rank held at once (compare PeakInFlight).
  int peak_in_flight = 0;
  std::vector<ComputeTiming> timings;
  // When the step started (the wall clock: the same on every rank of a
  // host, so that the ranks' timings can be laid on one timeline).
  absl::Time start;
  double step_seconds = 0;
  // Time spent in stage functions.
  double busy_seconds = 0;
};

class STRATA_EXPORT PipelineRunner {
 public:
  // Validates the schedule (communication required, rendezvous deadlock
  // check) and that `group`'s communicator (resolved now; for a fixed
  // handle, the caller keeps it alive) has one rank per schedule rank.
  // InvalidArgument says what does not fit; the handle's error when it does
  // not resolve.
  static absl::StatusOr<std::unique_ptr<PipelineRunner>> Create(Schedule schedule,
                                                                GroupHandle group,
                                                                RunnerOptions options);
  ~PipelineRunner();
  PipelineRunner(const PipelineRunner&) = delete;
  PipelineRunner& operator=(const PipelineRunner&) = delete;

  // Runs this rank's list once. See the header comment for what it does and
  // how it fails.
  absl::StatusOr<StepResult> Step(const StageFunctions& functions);

  const Schedule& schedule() const { return schedule_; }
  int rank() const { return rank_; }
  // The pinned handle the runner resolves at each step.
  const GroupHandle& group() const { return group_; }

 private:
  struct StepState;
  PipelineRunner(Schedule schedule, GroupHandle group, int rank, RunnerOptions options);

  absl::Status Execute(StepState& st, const StageFunctions& fns, int index);
  absl::Status Forward(StepState& st, const StageFunctions& fns, const Action& a);
  absl::Status Backward(StepState& st, const StageFunctions& fns, const Action& a);
  absl::Status SendForward(StepState& st, int index, const Action& a);
  absl::Status SendBackward(StepState& st, int index, const Action& a);
  absl::Status RecvForward(StepState& st, int index, const Action& a);
  absl::Status RecvBackward(StepState& st, int index, const Action& a);
  // Allocates `specs` and posts their receives from `peer`.
  absl::Status PostRecvs(const std::vector<TensorSpec>& specs, int peer, TensorList* tensors,
                         std::vector<std::unique_ptr<Work>>* works);
  // Reads the unread shape header from `peer` (if any) and posts the
  // receives of its payload.
  absl::Status ResolveHeader(StepState& st, int peer);
  // Before compute action `compute`: posts the receives listed between it
  // and the next compute action, in order, while they can be posted without
  // waiting, so their data can arrive during the compute (only where
  // operations progress independently, and not while the compute would
  // itself still issue a receive). On failure `*failed` is the index of the
  // receive action concerned.
  absl::Status PostAhead(StepState& st, int compute, int* failed);
  absl::StatusOr<TensorList> Allocate(const std::vector<TensorSpec>& specs);
  absl::Status ReapSends(StepState& st, bool wait);
  absl::Status Fail(StepState& st, int index, absl::Status cause);
  std::string Context(int index) const;

  Schedule schedule_;
  GroupHandle group_;
  // The step's communicator, resolved from group_ when the step starts.
  Communicator* comm_ = nullptr;
  RunnerOptions options_;
  OpOptions op_options_;  // every send and receive (RunnerOptions::stream)
  int rank_;
  // Operations (and the buffers they use) still pending after a failed step
  // could not be drained; kept until the runner is destroyed.
  std::vector<std::shared_ptr<void>> orphans_;
};

}  // namespace strata::pipeline
