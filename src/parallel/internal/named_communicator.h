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

  int rank() const override { return base_->rank(); }
  int size() const override { return base_->size(); }
  const std::string& name() const override { return name_; }
  int world_rank() const override { return base_->world_rank(); }
  absl::string_view backend() const override { return base_->backend(); }
  std::string transport() const override { return base_->transport(); }
  MemoryKind memory() const override { return base_->memory(); }
  bool progresses_independently() const override { return base_->progresses_independently(); }

  absl::StatusOr<std::unique_ptr<Work>> AllReduce(ConstBuffer send, Buffer recv, ReduceOp op,
                                                  const OpOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> Broadcast(Buffer buffer, int root,
                                                  const OpOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> Reduce(ConstBuffer send, Buffer recv, ReduceOp op, int root,
                                               const OpOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> AllGather(ConstBuffer send, Buffer recv,
                                                  const OpOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> ReduceScatter(ConstBuffer send, Buffer recv, ReduceOp op,
                                                      const OpOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> AllToAll(ConstBuffer send, Buffer recv,
                                                 const OpOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> AllToAllV(ConstBuffer send, Buffer recv,
                                                  const AllToAllCounts& counts,
                                                  const OpOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> Barrier(const OpOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> Send(ConstBuffer buffer, int peer,
                                             const OpOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> Recv(Buffer buffer, int peer,
                                             const OpOptions& options) override;
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key,
                                                      const CommOptions& options) override;
  absl::Status Abort() override;
  absl::Status Revoke() override;
  absl::StatusOr<std::unique_ptr<Communicator>> Shrink(absl::Span<const int> excluded,
                                                       const CommOptions& options) override;
  absl::Status AsyncError() override;

 private:
  absl::StatusOr<std::unique_ptr<Work>> Wrap(absl::StatusOr<std::unique_ptr<Work>> work) const;

  const std::shared_ptr<Communicator> base_;
  const std::string name_;
  // "group dp (rank " and "group dp-cp (rank ": what messages say, and
  // what they should say.
  const std::string from_;
  const std::string to_;
};

}  // namespace strata::internal
