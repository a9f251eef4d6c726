// PipelineRunner: one rank's execution of a schedule (see runner.h).
#include "strata/parallel/pipeline/runner.h"

#include <algorithm>
#include <deque>
#include <optional>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "parallel/pipeline/internal/wire.h"
#include "strata/base/status.h"
#include "strata/parallel/pipeline/validate.h"

namespace strata::pipeline {
namespace {

// Posted receives of one transfer, and the tensors they fill. A forward
// transfer whose shapes travel first starts with its shape header posted
// (`header_work`) and, when the channel's shapes are expected to repeat,
// the payload's receives for the expected shapes (`speculated`); otherwise
// the payload's receives follow once the header is in
// (PipelineRunner::ResolveHeader).
struct PendingRecv {
  std::vector<std::unique_ptr<Work>> works;
  TensorList tensors;
  int index = -1;  // the RECV action
  int peer = -1;
  int stage = -1;  // the receiving stage
  std::unique_ptr<Work> header_work;
  std::shared_ptr<std::vector<int64_t>> header;
  std::optional<std::vector<TensorSpec>> speculated;
};

// The forward transfers into one stage, as both ends see them in the same
// order: the last shapes, and whether they differed from those before.
// Both ends expect the next transfer to repeat the last shapes unless the
// last one was a change; then the receiver posts the payload's receives at
// once, with the header's, and the sender, if the shapes did change after
// all, first sends a filler of the expected shapes into those receives.
struct Channel {
  std::optional<std::vector<TensorSpec>> last;
  bool changed = false;

  bool ExpectsRepeat() const { return last.has_value() && !changed; }
  void Update(const std::vector<TensorSpec>& specs) {
    changed = last.has_value() && *last != specs;
    last = specs;
  }
};

// A posted send and what must stay alive until it completes (its shape
// header, or its tensor).
struct PendingOp {
  std::unique_ptr<Work> work;
  std::shared_ptr<std::vector<int64_t>> header;
  StageTensor tensor;
  int index = -1;  // the SEND action
};

// One activation held on this rank: from F until B (or W).
struct Slot {
  TensorList inputs;
  TensorList outputs;
  TensorList output_grads;
  std::shared_ptr<void> context;
};

// How long a failed step waits for its cancelled operations to finish.
constexpr absl::Duration kDrainTime = absl::Seconds(10);

double Seconds(absl::Time from, absl::Time to) { return absl::ToDoubleSeconds(to - from); }

bool IsReceive(ActionType t) {
  return t == ActionType::kRecvForward || t == ActionType::kRecvBackward;
}

}  // namespace

struct PipelineRunner::StepState {
  absl::Time start;
  absl::Time deadline;
  int m = 0;
  int num_stages = 0;
  std::unordered_map<int64_t, Slot> slots;
  // Keyed by the consuming (stage, microbatch).
  std::unordered_map<int64_t, PendingRecv> forward_recvs;
  std::unordered_map<int64_t, PendingRecv> grad_recvs;
  // Input gradients of (stage, microbatch) waiting for their SEND_B.
  std::unordered_map<int64_t, TensorList> grads_out;
  // Peer -> the forward receive (by cell) whose shape header from that peer
  // is posted but not yet read. At most one per peer: a later receive from
  // the same peer reads it first, so receives match messages in order.
  std::unordered_map<int, int64_t> unread_headers;
  // Forward transfers by receiving stage: sent from this rank (`out`) and
  // received by it (`in`).
  std::unordered_map<int, Channel> out_channels;
  std::unordered_map<int, Channel> in_channels;
  // Every receive action before this index has been posted (see PostAhead).
  int posted_upto = 0;
  std::deque<PendingOp> sends;  // in issue order
  // Activations whose backward is done, released before the next compute
  // action: after the sends that follow the backward are posted, so that
  // freeing the stage's tensors (a call into Python, from the bindings)
  // does not delay the gradient on its way to the previous stage.
  std::vector<Slot> retired;
  int in_flight = 0;
  int failed_send = -1;
  StepResult result;

  int64_t Cell(int stage, int microbatch) const { return int64_t{stage} * m + microbatch; }
};

PipelineRunner::PipelineRunner(Schedule schedule, GroupHandle group, int rank,
                               RunnerOptions options)
    : schedule_(std::move(schedule)),
      group_(std::move(group)),
      options_(std::move(options)),
      rank_(rank) {
  op_options_.stream = options_.stream;
}

PipelineRunner::~PipelineRunner() = default;

absl::StatusOr<std::unique_ptr<PipelineRunner>> PipelineRunner::Create(Schedule schedule,
                                                                       GroupHandle group,
                                                                       RunnerOptions options) {
  if (options.version != RunnerOptions::kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("RunnerOptions version ", options.version,
                                                   " is not supported (this build reads version ",
                                                   RunnerOptions::kVersion, ")"));
  }
  // The schedule is for this layout of the group: pinned (see runner.h).
  STRATA_ASSIGN_OR_RETURN(GroupHandle pinned, group.Pin("pipeline runner"));
  STRATA_ASSIGN_OR_RETURN(Communicator * comm, pinned.Resolve());
  if (comm->size() != schedule.num_ranks()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the schedule", schedule.name().empty() ? "" : " '" + schedule.name() + "'", " has ",
        schedule.num_ranks(), " ranks but communicator '", comm->name(), "' has ", comm->size()));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RunnerOptions::timeout is ", absl::FormatDuration(options.timeout), "; want > 0"));
  }
  if (options.shapes == ShapeExchange::kDeclared && !options.input_specs) {
    return absl::InvalidArgumentError("ShapeExchange::kDeclared needs RunnerOptions::input_specs");
  }
  if (comm->memory() != MemoryKind::kHost && !options.allocate) {
    return absl::InvalidArgumentError(absl::StrCat(
        "communicator '", comm->name(),
        "' works on device memory; set RunnerOptions::allocate to allocate device tensors"));
  }
  if (comm->memory() != MemoryKind::kHost && options.shapes == ShapeExchange::kPerTransfer) {
    return absl::InvalidArgumentError(absl::StrCat(
        "communicator '", comm->name(),
        "' works on device memory, but ShapeExchange::kPerTransfer sends each transfer's shapes "
        "from host memory; use ShapeExchange::kDeclared with RunnerOptions::input_specs"));
  }
  ValidateOptions validate;
  validate.communication = CommActions::kRequired;
  validate.comm_model = CommModel::kRendezvous;
  STRATA_RETURN_IF_ERROR(ValidateSchedule(schedule, validate));
  const int rank = comm->rank();
  return std::unique_ptr<PipelineRunner>(
      new PipelineRunner(std::move(schedule), std::move(pinned), rank, std::move(options)));
}

std::string PipelineRunner::Context(int index) const {
  std::string s = absl::StrCat("pipeline rank ", rank_, " (world rank ", comm_->world_rank(),
                               ", group '", comm_->name(), "')");
  if (index < 0) return absl::StrCat(s, " before its first action");
  const Action& a = schedule_.actions(rank_)[index];
  return absl::StrCat(s, " at action #", index, " ", a.ToString(), " (stage ", a.stage,
                      ", microbatch ", a.microbatch, ")");
}

absl::StatusOr<StepResult> PipelineRunner::Step(const StageFunctions& fns) {
  StepState st;
  st.start = absl::Now();
  st.deadline = st.start + options_.timeout;
  st.m = schedule_.num_microbatches();
  st.num_stages = schedule_.num_stages();
  const std::vector<Action>& list = schedule_.actions(rank_);
  // The group's communicator of the World's current generation (the same
  // one until a rebuild); nothing was posted yet if it fails.
  absl::StatusOr<Communicator*> comm = group_.Resolve();
  if (!comm.ok()) {
    return ::strata::internal::Annotate(comm.status(),
                                        absl::StrCat("pipeline rank ", rank_, " starting a step"));
  }
  comm_ = *comm;

  // Missing functions are found before any transfer is posted.
  bool full = false, split = false;
  for (const Action& a : list) {
    full |= a.type == ActionType::kBackward;
    split |= a.type == ActionType::kBackwardInput;
  }
  if (!fns.forward || (full && !fns.backward) ||
      (split && (!fns.backward_input || !fns.backward_weight))) {
    return Fail(
        st, -1,
        absl::InvalidArgumentError(absl::StrCat(
            "StageFunctions needs forward", full ? ", backward" : "",
            split ? ", backward_input and backward_weight" : "", " for this rank's actions")));
  }
  const bool ahead = comm_->progresses_independently();
  for (int k = 0; k < static_cast<int>(list.size()); ++k) {
    if (IsReceive(list[k].type) && k < st.posted_upto) continue;  // posted ahead
    if (list[k].is_compute()) st.retired.clear();
    if (ahead && list[k].is_compute()) {
      int failed = -1;
      if (absl::Status s = PostAhead(st, k, &failed); !s.ok()) {
        return Fail(st, failed, std::move(s));
      }
    }
    if (absl::Status s = Execute(st, fns, k); !s.ok()) return Fail(st, k, std::move(s));
    if (absl::Status s = ReapSends(st, /*wait=*/false); !s.ok()) {
      return Fail(st, st.failed_send, std::move(s));
    }
  }
  st.retired.clear();
  if (absl::Status s = ReapSends(st, /*wait=*/true); !s.ok()) {
    return Fail(st, st.failed_send, std::move(s));
  }
  // A validated schedule releases everything it takes.
  STRATA_CHECK(
      st.slots.empty() && st.forward_recvs.empty() && st.grad_recvs.empty() && st.grads_out.empty(),
      "pipeline step ended with state left on rank ", rank_);
  st.result.start = st.start;
  st.result.step_seconds = Seconds(st.start, absl::Now());
  return std::move(st.result);
}

absl::Status PipelineRunner::Execute(StepState& st, const StageFunctions& fns, int index) {
  const Action& a = schedule_.actions(rank_)[index];
  switch (a.type) {
    case ActionType::kForward:
      return Forward(st, fns, a);
    case ActionType::kBackward:
    case ActionType::kBackwardInput:
    case ActionType::kBackwardWeight:
      return Backward(st, fns, a);
    case ActionType::kSendForward:
      return SendForward(st, index, a);
    case ActionType::kRecvForward:
      return RecvForward(st, index, a);
    case ActionType::kSendBackward:
      return SendBackward(st, index, a);
    case ActionType::kRecvBackward:
      return RecvBackward(st, index, a);
  }
  return absl::InternalError("unknown action type");
}

namespace {

// Waits for a transfer's receives; names the RECV action on failure.
absl::Status WaitRecv(PendingRecv& p, const Schedule& s, int rank, absl::Time deadline) {
  for (std::unique_ptr<Work>& w : p.works) {
    absl::Status st = w->Wait(deadline);
    if (!st.ok()) {
      return ::strata::internal::Annotate(
          st, absl::StrCat("waiting for the data of action #", p.index, " ",
                           s.actions(rank)[p.index].ToString()));
    }
  }
  p.works.clear();
  return absl::OkStatus();
}

}  // namespace

absl::Status PipelineRunner::Forward(StepState& st, const StageFunctions& fns, const Action& a) {
  const int s = a.stage, i = a.microbatch;
  TensorList inputs;
  if (s > 0 && schedule_.rank_of_stage(s - 1) == rank_) {
    inputs = st.slots.at(st.Cell(s - 1, i)).outputs;  // handed over on this rank
  } else if (s > 0) {
    auto it = st.forward_recvs.find(st.Cell(s, i));
    STRATA_CHECK(it != st.forward_recvs.end(), "no receive posted for ", a.ToString());
    if (it->second.header_work) STRATA_RETURN_IF_ERROR(ResolveHeader(st, it->second.peer));
    STRATA_RETURN_IF_ERROR(WaitRecv(it->second, schedule_, rank_, st.deadline));
    inputs = std::move(it->second.tensors);
    st.forward_recvs.erase(it);
  }
  ForwardCall call;
  call.stage = s;
  call.microbatch = i;
  call.inputs = &inputs;
  const absl::Time begin = absl::Now();
  absl::StatusOr<ForwardResult> out = fns.forward(call);
  const absl::Time end = absl::Now();
  st.result.timings.push_back({a, Seconds(st.start, begin), Seconds(st.start, end)});
  st.result.busy_seconds += Seconds(begin, end);
  if (!out.ok()) return ::strata::internal::Annotate(out.status(), "forward failed");
  const bool last = s == st.num_stages - 1;
  if (last && !out->loss.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stage ", s, " is the last stage: its forward must return a loss (ForwardResult::loss)"));
  }
  if (!last && out->outputs.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "forward of stage ", s, " returned no outputs; stage ", s + 1, " needs at least one"));
  }
  for (size_t k = 0; k < out->outputs.size() && !last; ++k) {
    const StageTensor& t = out->outputs[k];
    STRATA_RETURN_IF_ERROR_CTX(internal::CheckSpec(t.spec), "forward output ", k);
    if (t.data == nullptr && t.spec.num_bytes() > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("forward output ", k, " (", t.spec.ToString(), ") has no data"));
    }
  }
  if (last) {
    if (st.result.losses.empty()) st.result.losses.assign(st.m, 0.0);
    st.result.losses[i] = *out->loss;
  }
  Slot& slot = st.slots[st.Cell(s, i)];
  slot.inputs = std::move(inputs);
  slot.outputs = std::move(out->outputs);
  slot.context = std::move(out->context);
  st.result.peak_in_flight = std::max(st.result.peak_in_flight, ++st.in_flight);
  return absl::OkStatus();
}

absl::Status PipelineRunner::Backward(StepState& st, const StageFunctions& fns, const Action& a) {
  const int s = a.stage, i = a.microbatch;
  auto it = st.slots.find(st.Cell(s, i));
  STRATA_CHECK(it != st.slots.end(), "no activation for ", a.ToString());
  Slot& slot = it->second;
  const bool last = s == st.num_stages - 1;
  if (a.type != ActionType::kBackwardWeight && !last && schedule_.rank_of_stage(s + 1) != rank_) {
    auto r = st.grad_recvs.find(st.Cell(s, i));
    STRATA_CHECK(r != st.grad_recvs.end(), "no receive posted for ", a.ToString());
    STRATA_RETURN_IF_ERROR(WaitRecv(r->second, schedule_, rank_, st.deadline));
    slot.output_grads = std::move(r->second.tensors);
    st.grad_recvs.erase(r);
  }
  BackwardCall call;
  call.stage = s;
  call.microbatch = i;
  call.inputs = &slot.inputs;
  call.outputs = &slot.outputs;
  call.output_grads = &slot.output_grads;
  call.context = &slot.context;
  call.loss_scale = last && options_.grad_scaling == GradScaling::kMean ? 1.0 / st.m : 1.0;

  const absl::Time begin = absl::Now();
  absl::StatusOr<TensorList> grads = TensorList{};
  if (a.type == ActionType::kBackward) grads = fns.backward(call);
  if (a.type == ActionType::kBackwardInput) grads = fns.backward_input(call);
  if (a.type == ActionType::kBackwardWeight) {
    if (absl::Status w = fns.backward_weight(call); !w.ok()) grads = w;
  }
  const absl::Time end = absl::Now();
  st.result.timings.push_back({a, Seconds(st.start, begin), Seconds(st.start, end)});
  st.result.busy_seconds += Seconds(begin, end);
  if (!grads.ok()) {
    const char* what = a.type == ActionType::kBackward        ? "backward failed"
                       : a.type == ActionType::kBackwardInput ? "input-gradient backward failed"
                                                              : "weight-gradient backward failed";
    return ::strata::internal::Annotate(grads.status(), what);
  }
  if (a.type != ActionType::kBackwardWeight) {
    const std::vector<TensorSpec> want = internal::SpecsOf(slot.inputs);
    const std::vector<TensorSpec> got = internal::SpecsOf(*grads);
    if (got != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          "backward of stage ", s, " returned gradients ", internal::SpecList(got), " for inputs ",
          internal::SpecList(want), "; each input needs a gradient of its spec (none on stage 0)"));
    }
    if (s > 0 && schedule_.rank_of_stage(s - 1) == rank_) {
      st.slots.at(st.Cell(s - 1, i)).output_grads = std::move(*grads);  // handed over
    } else if (s > 0) {
      st.grads_out[st.Cell(s, i)] = std::move(*grads);
    }
  }
  if (a.type != ActionType::kBackwardInput) {
    st.retired.push_back(std::move(it->second));  // no longer needed
    st.slots.erase(it);
    --st.in_flight;
  }
  return absl::OkStatus();
}

absl::Status PipelineRunner::SendForward(StepState& st, int index, const Action& a) {
  const Slot& slot = st.slots.at(st.Cell(a.stage, a.microbatch));
  const std::vector<TensorSpec> specs = internal::SpecsOf(slot.outputs);
  if (specs.size() > static_cast<size_t>(kMaxTransferTensors)) {
    return absl::InvalidArgumentError(absl::StrCat("forward of stage ", a.stage, " returned ",
                                                   specs.size(),
                                                   " outputs; a transfer carries "
                                                   "at most ",
                                                   kMaxTransferTensors));
  }
  if (options_.shapes == ShapeExchange::kDeclared) {
    absl::StatusOr<std::vector<TensorSpec>> declared =
        options_.input_specs(a.stage + 1, a.microbatch);
    if (!declared.ok()) {
      return ::strata::internal::Annotate(declared.status(), "input_specs failed");
    }
    if (*declared != specs) {
      return absl::InvalidArgumentError(
          absl::StrCat("stage ", a.stage, "'s outputs for microbatch ", a.microbatch, " are ",
                       internal::SpecList(specs), " but input_specs(", a.stage + 1, ", ",
                       a.microbatch, ") declares ", internal::SpecList(*declared)));
    }
  } else {
    auto header = std::make_shared<std::vector<int64_t>>(internal::EncodeHeader(specs));
    STRATA_ASSIGN_OR_RETURN(
        std::unique_ptr<Work> w,
        comm_->Send(ConstBuffer(header->data(), header->size(), DataType::kInt64), a.peer,
                    op_options_));
    st.sends.push_back({std::move(w), std::move(header), {}, index});
    Channel& channel = st.out_channels[a.stage + 1];
    if (channel.ExpectsRepeat() && *channel.last != specs) {
      // The receiver posted receives for the last shapes: fill them.
      STRATA_ASSIGN_OR_RETURN(TensorList filler, Allocate(*channel.last));
      for (const StageTensor& t : filler) {
        STRATA_ASSIGN_OR_RETURN(
            std::unique_ptr<Work> f,
            comm_->Send(
                ConstBuffer(t.data, static_cast<size_t>(t.spec.num_elements()), t.spec.dtype),
                a.peer, op_options_));
        st.sends.push_back({std::move(f), nullptr, t, index});
      }
    }
    channel.Update(specs);
  }
  for (const StageTensor& t : slot.outputs) {
    STRATA_ASSIGN_OR_RETURN(
        std::unique_ptr<Work> w,
        comm_->Send(ConstBuffer(t.data, static_cast<size_t>(t.spec.num_elements()), t.spec.dtype),
                    a.peer, op_options_));
    st.sends.push_back({std::move(w), nullptr, t, index});
  }
  return absl::OkStatus();
}

absl::Status PipelineRunner::SendBackward(StepState& st, int index, const Action& a) {
  auto it = st.grads_out.find(st.Cell(a.stage, a.microbatch));
  STRATA_CHECK(it != st.grads_out.end(), "no gradient to send for ", a.ToString());
  for (const StageTensor& t : it->second) {
    STRATA_ASSIGN_OR_RETURN(
        std::unique_ptr<Work> w,
        comm_->Send(ConstBuffer(t.data, static_cast<size_t>(t.spec.num_elements()), t.spec.dtype),
                    a.peer, op_options_));
    st.sends.push_back({std::move(w), nullptr, t, index});
  }
  st.grads_out.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<TensorList> PipelineRunner::Allocate(const std::vector<TensorSpec>& specs) {
  TensorList out;
  out.reserve(specs.size());
  for (const TensorSpec& spec : specs) {
    if (!options_.allocate) {
      out.push_back(StageTensor::Host(spec));
      continue;
    }
    absl::StatusOr<StageTensor> t = options_.allocate(spec);
    if (!t.ok()) {
      return ::strata::internal::Annotate(t.status(), absl::StrCat("allocating ", spec.ToString()));
    }
    if (t->spec != spec || (t->data == nullptr && spec.num_bytes() > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("RunnerOptions::allocate returned ", t->spec.ToString(),
                       t->data ? "" : " (no data)", " for ", spec.ToString()));
    }
    out.push_back(std::move(*t));
  }
  return out;
}

absl::Status PipelineRunner::PostRecvs(const std::vector<TensorSpec>& specs, int peer,
                                       TensorList* tensors,
                                       std::vector<std::unique_ptr<Work>>* works) {
  STRATA_ASSIGN_OR_RETURN(*tensors, Allocate(specs));
  for (StageTensor& t : *tensors) {
    STRATA_ASSIGN_OR_RETURN(
        std::unique_ptr<Work> w,
        comm_->Recv(Buffer{t.data, static_cast<size_t>(t.spec.num_elements()), t.spec.dtype}, peer,
                    op_options_));
    works->push_back(std::move(w));
  }
  return absl::OkStatus();
}

absl::Status PipelineRunner::ResolveHeader(StepState& st, int peer) {
  auto u = st.unread_headers.find(peer);
  if (u == st.unread_headers.end()) return absl::OkStatus();
  PendingRecv& p = st.forward_recvs.at(u->second);
  st.unread_headers.erase(u);
  const Action& a = schedule_.actions(rank_)[p.index];
  absl::Status s = p.header_work->Wait(st.deadline);
  if (!s.ok()) {
    return ::strata::internal::Annotate(
        s, absl::StrCat("receiving the shape header of action #", p.index, " ", a.ToString(),
                        " from rank ", peer));
  }
  p.header_work.reset();
  absl::StatusOr<std::vector<TensorSpec>> specs = internal::DecodeHeader(*p.header);
  if (!specs.ok()) {
    return ::strata::internal::Annotate(
        specs.status(), absl::StrCat("the shape header of action #", p.index, " ", a.ToString()));
  }
  p.header.reset();
  st.in_channels[p.stage].Update(*specs);
  if (p.speculated.has_value()) {
    const bool repeated = *p.speculated == *specs;
    p.speculated.reset();
    if (repeated) return absl::OkStatus();  // the payload's receives are posted
    // The shapes changed: the posted receives take the sender's filler.
    STRATA_RETURN_IF_ERROR(WaitRecv(p, schedule_, rank_, st.deadline));
  }
  return PostRecvs(*specs, peer, &p.tensors, &p.works);
}

absl::Status PipelineRunner::PostAhead(StepState& st, int compute, int* failed) {
  const std::vector<Action>& list = schedule_.actions(rank_);
  // Operations complete in issue order, so nothing may be issued ahead of
  // a receive the compute itself would still issue (the payload of a
  // forward transfer whose shapes changed): read its header first if it is
  // in, else post nothing ahead.
  const Action& c = list[compute];
  if (c.type == ActionType::kForward) {
    auto it = st.forward_recvs.find(st.Cell(c.stage, c.microbatch));
    if (it != st.forward_recvs.end() && it->second.header_work) {
      absl::StatusOr<bool> in = it->second.header_work->Test();
      if (!in.ok() || !*in) return absl::OkStatus();  // errors surface in the forward
      *failed = it->second.index;
      STRATA_RETURN_IF_ERROR(ResolveHeader(st, it->second.peer));
    }
  }
  int j = std::max(compute + 1, st.posted_upto);
  for (; j < static_cast<int>(list.size()); ++j) {
    const Action& a = list[j];
    if (a.is_compute()) break;         // the next compute action
    if (!IsReceive(a.type)) continue;  // sends stay in place
    // Not if it would wait: a header from the same peer still unread, or a
    // gradient whose activation the compute about to run produces.
    if (st.unread_headers.count(a.peer) != 0) break;
    if (a.type == ActionType::kRecvBackward &&
        st.slots.count(st.Cell(a.stage, a.microbatch)) == 0) {
      break;
    }
    absl::Status s =
        a.type == ActionType::kRecvForward ? RecvForward(st, j, a) : RecvBackward(st, j, a);
    if (!s.ok()) {
      *failed = j;
      return s;
    }
  }
  st.posted_upto = std::max(st.posted_upto, j);
  return absl::OkStatus();
}

absl::Status PipelineRunner::RecvForward(StepState& st, int index, const Action& a) {
  // Registered before posting, so a failure part-way leaves every posted
  // receive (and its buffer) where the failure path drains it.
  const int64_t cell = st.Cell(a.stage, a.microbatch);
  PendingRecv& p = st.forward_recvs[cell];
  p.index = index;
  p.peer = a.peer;
  if (options_.shapes == ShapeExchange::kDeclared) {
    absl::StatusOr<std::vector<TensorSpec>> declared = options_.input_specs(a.stage, a.microbatch);
    if (!declared.ok()) {
      return ::strata::internal::Annotate(declared.status(), "input_specs failed");
    }
    if (declared->empty() || declared->size() > static_cast<size_t>(kMaxTransferTensors)) {
      return absl::InvalidArgumentError(absl::StrCat("input_specs(", a.stage, ", ", a.microbatch,
                                                     ") declares ", declared->size(),
                                                     " tensors; want 1..", kMaxTransferTensors));
    }
    for (const TensorSpec& spec : *declared) {
      STRATA_RETURN_IF_ERROR_CTX(internal::CheckSpec(spec), "input_specs(", a.stage, ", ",
                                 a.microbatch, ")");
    }
    return PostRecvs(*declared, a.peer, &p.tensors, &p.works);
  }
  // The shapes come first. The header's receive is posted now, with the
  // payload's when the channel expects the last shapes again (see Channel).
  // Where operations progress independently, the header is read when the
  // forward needs the data or before the next receive from the same peer,
  // whichever comes first, so the sends this rank issues meanwhile do not
  // wait for the sender's forward. Where they progress in issue order, the
  // payload's receives must come right after the header's, so the header
  // is read here.
  STRATA_RETURN_IF_ERROR(ResolveHeader(st, a.peer));
  p.stage = a.stage;
  p.header = std::make_shared<std::vector<int64_t>>(internal::kHeaderWords);
  STRATA_ASSIGN_OR_RETURN(p.header_work, comm_->Recv(Buffer::Of(p.header->data(), p.header->size()),
                                                     a.peer, op_options_));
  st.unread_headers[a.peer] = cell;
  const Channel& channel = st.in_channels[a.stage];
  if (channel.ExpectsRepeat()) {
    p.speculated = channel.last;
    STRATA_RETURN_IF_ERROR(PostRecvs(*channel.last, a.peer, &p.tensors, &p.works));
  }
  if (!comm_->progresses_independently()) return ResolveHeader(st, a.peer);
  return absl::OkStatus();
}

absl::Status PipelineRunner::RecvBackward(StepState& st, int index, const Action& a) {
  // The gradient of each output has the output's spec.
  auto it = st.slots.find(st.Cell(a.stage, a.microbatch));
  STRATA_CHECK(it != st.slots.end(), "gradient received before the forward of ", a.ToString());
  STRATA_RETURN_IF_ERROR(ResolveHeader(st, a.peer));  // receives match in order
  PendingRecv& p = st.grad_recvs[st.Cell(a.stage, a.microbatch)];
  p.index = index;
  p.peer = a.peer;
  return PostRecvs(internal::SpecsOf(it->second.outputs), a.peer, &p.tensors, &p.works);
}

absl::Status PipelineRunner::ReapSends(StepState& st, bool wait) {
  while (!st.sends.empty()) {
    PendingOp& front = st.sends.front();
    if (wait) {
      absl::Status s = front.work->Wait(st.deadline);
      if (!s.ok()) {
        st.failed_send = front.index;
        return ::strata::internal::Annotate(s, "completing the send");
      }
    } else {
      absl::StatusOr<bool> done = front.work->Test();
      if (!done.ok()) {
        st.failed_send = front.index;
        return ::strata::internal::Annotate(done.status(), "completing the send");
      }
      if (!*done) break;
    }
    st.sends.pop_front();
  }
  return absl::OkStatus();
}

absl::Status PipelineRunner::Fail(StepState& st, int index, absl::Status cause) {
  absl::Status status = ::strata::internal::Annotate(cause, Context(index));
  // Stop the peers (or at least this rank), so every pending operation ends.
  const bool revoked = options_.on_failure == OnFailure::kRevoke && comm_->Revoke().ok();
  bool aborted = false;
  if (!revoked) {
    (void)comm_->Abort();
    aborted = true;
  }
  // The pending operations use buffers this step owns: wait for them to
  // finish (they fail once revoked or aborted) before releasing them.
  std::vector<std::pair<Work*, std::shared_ptr<void>>> pending;
  for (auto* recvs : {&st.forward_recvs, &st.grad_recvs}) {
    for (auto& [cell, p] : *recvs) {
      auto keep = std::make_shared<PendingRecv>(std::move(p));
      for (auto& w : keep->works) pending.emplace_back(w.get(), keep);
      if (keep->header_work) pending.emplace_back(keep->header_work.get(), keep);
    }
  }
  for (PendingOp& p : st.sends) {
    auto keep = std::make_shared<PendingOp>(std::move(p));
    pending.emplace_back(keep->work.get(), keep);
  }
  const absl::Time drain = absl::Now() + kDrainTime;
  for (auto& [work, keep] : pending) {
    (void)work->Wait(drain);
    absl::StatusOr<bool> done = work->Test();
    if (done.ok() && !*done && !aborted) {
      (void)comm_->Abort();
      aborted = true;
      (void)work->Wait(absl::Now() + kDrainTime);
      done = work->Test();
    }
    if (done.ok() && !*done) orphans_.push_back(keep);
  }
  return status;
}

}  // namespace strata::pipeline
