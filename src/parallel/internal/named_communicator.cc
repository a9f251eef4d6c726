#include "parallel/internal/named_communicator.h"

#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace strata::internal {
namespace {

std::string Where(const Communicator& c, absl::string_view name) {
  // comm_internal::DescribeGroup's "group tp (rank 1 of 2, world rank 3)",
  // which every backend's messages use.
  return absl::StrCat("group ", name, " (rank ", c.rank(), " of ", c.size(), ", world rank ",
                      c.world_rank(), ")");
}

absl::Status Replace(const absl::Status& s, absl::string_view from, absl::string_view to) {
  if (s.ok() || from == to) return s;
  absl::Status out(s.code(), absl::StrReplaceAll(s.message(), {{from, to}}));
  s.ForEachPayload(
      [&out](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

// Holds copies of the names, not the communicator: a Work stays safe to
// wait on after its communicator is destroyed (it then fails with Aborted).
class NamedWork final : public Work {
 public:
  NamedWork(std::unique_ptr<Work> work, std::string from, std::string to)
      : work_(std::move(work)), from_(std::move(from)), to_(std::move(to)) {}
  absl::Status DoWait(absl::Time deadline) override {
    return Replace(work_->Wait(deadline), from_, to_);
  }
  absl::StatusOr<bool> Test() override {
    absl::StatusOr<bool> done = work_->Test();
    if (!done.ok()) return Replace(done.status(), from_, to_);
    return done;
  }
  std::string Describe() const override {
    return absl::StrReplaceAll(work_->Describe(), {{from_, to_}});
  }

 private:
  std::unique_ptr<Work> work_;
  const std::string from_;
  const std::string to_;
};

CommOptions AliasOptions(const Communicator& base, std::string name) {
  CommOptions options;
  options.name = std::move(name);
  options.timeout = base.timeout();
  return options;  // no sink: the shared communicator records
}

}  // namespace

NamedCommunicator::NamedCommunicator(std::shared_ptr<Communicator> base, std::string name)
    : Communicator(AliasOptions(*base, std::move(name)),
                   Membership{base->rank(), base->size(), base->world_rank()},
                   base->capabilities()),
      base_(std::move(base)),
      from_(Where(*base_, base_->name())),
      to_(Where(*base_, this->name())) {}

absl::Status NamedCommunicator::Rename(const absl::Status& status) const {
  return Replace(status, from_, to_);
}

std::string NamedCommunicator::Rename(const std::string& text) const {
  return absl::StrReplaceAll(text, {{from_, to_}});
}

OpOptions NamedCommunicator::Forward(const ResolvedOptions& resolved) {
  OpOptions options;
  options.timeout = resolved.timeout;
  options.stream = resolved.stream;
  return options;
}

absl::StatusOr<std::unique_ptr<Work>> NamedCommunicator::Wrap(
    absl::StatusOr<std::unique_ptr<Work>> work) const {
  if (!work.ok()) return Rename(work.status());
  return std::unique_ptr<Work>(std::make_unique<NamedWork>(std::move(work).value(), from_, to_));
}

absl::StatusOr<std::unique_ptr<Work>> NamedCommunicator::DoAllReduce(
    ConstBuffer send, Buffer recv, ReduceOp op, const ResolvedOptions& options) {
  return Wrap(base_->AllReduce(send, recv, op, Forward(options)));
}

absl::StatusOr<std::unique_ptr<Work>> NamedCommunicator::DoBroadcast(
    Buffer buffer, int root, const ResolvedOptions& options) {
  return Wrap(base_->Broadcast(buffer, root, Forward(options)));
}

absl::StatusOr<std::unique_ptr<Work>> NamedCommunicator::DoReduce(ConstBuffer send, Buffer recv,
                                                                  ReduceOp op, int root,
                                                                  const ResolvedOptions& options) {
  return Wrap(base_->Reduce(send, recv, op, root, Forward(options)));
}

absl::StatusOr<std::unique_ptr<Work>> NamedCommunicator::DoAllGather(
    ConstBuffer send, Buffer recv, const ResolvedOptions& options) {
  return Wrap(base_->AllGather(send, recv, Forward(options)));
}

absl::StatusOr<std::unique_ptr<Work>> NamedCommunicator::DoReduceScatter(
    ConstBuffer send, Buffer recv, ReduceOp op, const ResolvedOptions& options) {
  return Wrap(base_->ReduceScatter(send, recv, op, Forward(options)));
}

absl::StatusOr<std::unique_ptr<Work>> NamedCommunicator::DoAllToAll(
    ConstBuffer send, Buffer recv, const ResolvedOptions& options) {
  return Wrap(base_->AllToAll(send, recv, Forward(options)));
}

absl::StatusOr<std::unique_ptr<Work>> NamedCommunicator::DoAllToAllV(
    ConstBuffer send, Buffer recv, const AllToAllCounts& counts, const ResolvedOptions& options) {
  return Wrap(base_->AllToAllV(send, recv, counts, Forward(options)));
}

absl::StatusOr<std::unique_ptr<Work>> NamedCommunicator::DoBarrier(const ResolvedOptions& options) {
  return Wrap(base_->Barrier(Forward(options)));
}

absl::StatusOr<std::unique_ptr<Work>> NamedCommunicator::DoSend(ConstBuffer buffer, int peer,
                                                                const ResolvedOptions& options) {
  return Wrap(base_->Send(buffer, peer, Forward(options)));
}

absl::StatusOr<std::unique_ptr<Work>> NamedCommunicator::DoRecv(Buffer buffer, int peer,
                                                                const ResolvedOptions& options) {
  return Wrap(base_->Recv(buffer, peer, Forward(options)));
}

absl::StatusOr<std::unique_ptr<Communicator>> NamedCommunicator::DoSplit(
    int color, int key, const CommOptions& options, const ResolvedOptions& /*resolved*/) {
  absl::StatusOr<std::unique_ptr<Communicator>> made = base_->Split(color, key, options);
  if (!made.ok()) return Rename(made.status());
  return made;
}

absl::StatusOr<std::unique_ptr<Communicator>> NamedCommunicator::DoShrink(
    const ShrinkPlan& plan, const CommOptions& options, const ResolvedOptions& /*resolved*/) {
  absl::StatusOr<std::unique_ptr<Communicator>> made = base_->Shrink(plan.excluded, options);
  if (!made.ok()) return Rename(made.status());
  return made;
}

absl::Status NamedCommunicator::DoAbort() { return Rename(base_->Abort()); }

absl::Status NamedCommunicator::DoRevoke() { return Rename(base_->Revoke()); }

absl::Status NamedCommunicator::DoAsyncError() { return Rename(base_->AsyncError()); }

}  // namespace strata::internal
