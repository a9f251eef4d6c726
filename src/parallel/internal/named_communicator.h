// NamedCommunicator: another name for a communicator the World shares
// between groups with the same members ("dp" and "dp-cp" when cp = 1).
//
// Every call goes to the shared communicator; name() is this group's name,
// and every message that names the shared group ("... on group dp (rank 1
// of 4, world rank 2)") names this one instead: in the statuses the calls
// return, in Work::Describe, and in the statuses Work::Wait and Test
// return. Payloads (kRankFailurePayload) are kept.
//
// Thread-safety: as the shared communicator.
#pragma once

#include <memory>
#include <string>

#include "strata/comm/communicator.h"

namespace strata::internal {

class NamedCommunicator final : public Communicator {
 public:
  NamedCommunicator(std::shared_ptr<Communicator> base, std::string name);

  // `status` with the shared communicator's group description replaced by
  // this one's.
  absl::Status Rename(const absl::Status& status) const;
  std::string Rename(const std::string& text) const;

  absl::string_view backend() const override { return base_->backend(); }
  std::string transport() const override { return base_->transport(); }
  MemoryKind memory() const override { return base_->memory(); }
  bool progresses_independently() const override { return base_->progresses_independently(); }

 protected:
  // Each hook calls the shared communicator's public operation with the
  // resolved time limit and stream (the shared communicator checks and
  // records it again; this one records nothing: its options name no sink,
  // so an operation is recorded once, under the shared group's name).
  absl::StatusOr<std::unique_ptr<Work>> DoAllReduce(ConstBuffer send, Buffer recv, ReduceOp op,
                                                    const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoBroadcast(Buffer buffer, int root,
                                                    const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoReduce(ConstBuffer send, Buffer recv, ReduceOp op,
                                                 int root, const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoAllGather(ConstBuffer send, Buffer recv,
                                                    const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoReduceScatter(ConstBuffer send, Buffer recv, ReduceOp op,
                                                        const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoAllToAll(ConstBuffer send, Buffer recv,
                                                   const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoAllToAllV(ConstBuffer send, Buffer recv,
                                                    const AllToAllCounts& counts,
                                                    const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoBarrier(const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoSend(ConstBuffer buffer, int peer,
                                               const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoRecv(Buffer buffer, int peer,
                                               const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Communicator>> DoSplit(int color, int key,
                                                        const CommOptions& options,
                                                        const ResolvedOptions& resolved) override;
  absl::StatusOr<std::unique_ptr<Communicator>> DoShrink(const ShrinkPlan& plan,
                                                         const CommOptions& options,
                                                         const ResolvedOptions& resolved) override;
  absl::Status DoAbort() override;
  absl::Status DoRevoke() override;
  absl::Status DoAsyncError() override;

 private:
  static OpOptions Forward(const ResolvedOptions& resolved);
  absl::StatusOr<std::unique_ptr<Work>> Wrap(absl::StatusOr<std::unique_ptr<Work>> work) const;

  const std::shared_ptr<Communicator> base_;
  // "group dp (rank " and "group dp-cp (rank ": what messages say, and
  // what they should say.
  const std::string from_;
  const std::string to_;
};

}  // namespace strata::internal
