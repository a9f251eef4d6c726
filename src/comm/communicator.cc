// The rules every backend obeys, once: the public operations of
// Communicator validate, resolve their options, number and record the
// operation, and call the backend's hook (see communicator.h).
#include "strata/comm/communicator.h"

#include <algorithm>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "comm/validate.h"
#include "strata/base/status.h"

namespace strata {

using comm_internal::DescribeOp;
using observe::OpKind;

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kProd:
      return "prod";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kAvg:
      return "avg";
  }
  return "invalid";
}

absl::StatusOr<ReduceOp> ParseReduceOp(absl::string_view name) {
  const std::string n = absl::AsciiStrToLower(name);
  for (ReduceOp op :
       {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kAvg}) {
    if (n == ReduceOpName(op)) return op;
  }
  if (n == "product") return ReduceOp::kProd;
  if (n == "mean" || n == "average") return ReduceOp::kAvg;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown reduce op '", name, "' (known: sum, prod, min, max, avg)"));
}

// What a public operation tells Resolve: its description without the group
// ("allreduce(sum, 4 x fp32)") and what its record holds.
struct Communicator::OpCall {
  OpKind kind;
  std::string what;
  size_t input_count = 0;
  size_t output_count = 0;
  DataType dtype = DataType::kFloat32;
  const char* reduce_op = nullptr;
  int root = -1;
  int peer = -1;
  // Split and Shrink: the new communicator's timeout (OpOptions is empty).
  absl::Duration structure_timeout = absl::ZeroDuration();
};

Communicator::Communicator(const CommOptions& options, const Membership& membership,
                           const CommCapabilities& capabilities)
    : name_(options.name),
      rank_(membership.rank),
      size_(membership.size),
      world_rank_(membership.world_rank),
      timeout_(options.timeout),
      capabilities_(capabilities),
      sink_(options.sink),
      where_(comm_internal::DescribeGroup(comm_internal::GroupInfo{
          options.name, membership.rank, membership.size, membership.world_rank})) {
  STRATA_CHECK(comm_internal::CheckCommOptions(options).ok(),
               "a communicator was built from unchecked options: ",
               comm_internal::CheckCommOptions(options).ToString());
  STRATA_CHECK(capabilities.can_move != nullptr && capabilities.can_reduce != nullptr,
               "a backend must declare what it can move and reduce");
  STRATA_CHECK(membership.size >= 1 && membership.rank >= 0 && membership.rank < membership.size,
               "rank ", membership.rank, " of ", membership.size);
}

Communicator::~Communicator() = default;

const std::shared_ptr<const observe::CommRecord>& Communicator::comm_record() {
  std::call_once(comm_record_once_, [this] {
    auto record = std::make_shared<observe::CommRecord>();
    record->backend = std::string(backend());
    record->name = name_;
    record->rank = rank_;
    record->size = size_;
    record->world_rank = world_rank_;
    comm_record_ = std::move(record);
  });
  return comm_record_;
}

absl::StatusOr<Communicator::ResolvedOptions> Communicator::Resolve(const OpCall& call,
                                                                    const OpOptions& options) {
  ResolvedOptions r;
  const bool structure = call.kind == OpKind::kSplit || call.kind == OpKind::kShrink;
  if (structure) {
    r.timeout = call.structure_timeout;
  } else {
    if (options.timeout < absl::ZeroDuration()) {
      return absl::InvalidArgumentError(absl::StrCat(call.what, " on ", where_, ": timeout ",
                                                     absl::FormatDuration(options.timeout),
                                                     " is negative"));
    }
    r.timeout = options.timeout > absl::ZeroDuration() ? options.timeout : timeout_;
    r.stream = options.stream;
  }
  const absl::Time now = absl::Now();
  r.deadline = now + r.timeout;
  r.description = absl::StrCat(call.what, " on ", where_);
  // Numbered whether or not anything records, so the numbers of a
  // communicator do not depend on who watches it.
  const uint64_t op_id = op_seq_.fetch_add(1, std::memory_order_relaxed) + 1;
  uint64_t collective = 0, p2p = 0;
  if (observe::IsPointToPoint(call.kind)) {
    p2p = p2p_seq_.fetch_add(1, std::memory_order_relaxed) + 1;
    collective = collective_seq_.load(std::memory_order_relaxed);
  } else if (call.kind == OpKind::kShrink) {
    // Only the survivors call it: not an operation of the whole group.
    collective = collective_seq_.load(std::memory_order_relaxed);
    p2p = p2p_seq_.load(std::memory_order_relaxed);
  } else {
    collective = collective_seq_.fetch_add(1, std::memory_order_relaxed) + 1;
    p2p = p2p_seq_.load(std::memory_order_relaxed);
  }
  if (sink_ == nullptr) return r;
  observe::OpRecord record;
  record.comm = comm_record();
  record.kind = call.kind;
  record.op_id = op_id;
  record.collective_seq_id = collective;
  record.p2p_seq_id = p2p;
  record.input_count = call.input_count;
  record.output_count = call.output_count;
  record.dtype = call.dtype;
  record.reduce_op = call.reduce_op;
  record.root = call.root;
  record.peer = call.peer;
  record.timeout_ms = absl::ToInt64Milliseconds(r.timeout);
  record.time_created_ns = absl::ToUnixNanos(now);
  r.trace = std::make_shared<observe::OpTrace>(sink_, std::move(record));
  return r;
}

template <typename T>
absl::StatusOr<T> Communicator::Finish(absl::StatusOr<T> result, const ResolvedOptions& resolved) {
  if (!result.ok() && resolved.trace != nullptr) resolved.trace->Completed(result.status());
  if constexpr (std::is_same_v<T, std::unique_ptr<Work>>) {
    if (result.ok() && *result != nullptr) (*result)->AttachTrace(resolved.trace);
  }
  return result;
}

absl::Status Work::Wait(absl::Time deadline) {
  if (trace_ == nullptr) return DoWait(deadline);
  const int64_t start = absl::GetCurrentTimeNanos();
  absl::Status status = DoWait(deadline);
  trace_->Waited(absl::GetCurrentTimeNanos() - start);
  return status;
}

// ---- collectives --------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Work>> Communicator::AllReduce(ConstBuffer send, Buffer recv,
                                                              ReduceOp op,
                                                              const OpOptions& options) {
  const comm_internal::GroupInfo g{name_, rank_, size_, world_rank_};
  STRATA_RETURN_IF_ERROR(comm_internal::ValidateAllReduce(g, send, recv, op, capabilities_));
  OpCall call{OpKind::kAllReduce, DescribeOp("allreduce", ReduceOpName(op), recv)};
  call.input_count = send.count;
  call.output_count = recv.count;
  call.dtype = recv.dtype;
  call.reduce_op = ReduceOpName(op);
  STRATA_ASSIGN_OR_RETURN(ResolvedOptions r, Resolve(call, options));
  return Finish(DoAllReduce(send, recv, op, r), r);
}

absl::StatusOr<std::unique_ptr<Work>> Communicator::Broadcast(Buffer buffer, int root,
                                                              const OpOptions& options) {
  const comm_internal::GroupInfo g{name_, rank_, size_, world_rank_};
  STRATA_RETURN_IF_ERROR(comm_internal::ValidateBroadcast(g, buffer, root, capabilities_));
  OpCall call{OpKind::kBroadcast, DescribeOp("broadcast", absl::StrCat("root ", root), buffer)};
  call.input_count = call.output_count = buffer.count;
  call.dtype = buffer.dtype;
  call.root = root;
  STRATA_ASSIGN_OR_RETURN(ResolvedOptions r, Resolve(call, options));
  return Finish(DoBroadcast(buffer, root, r), r);
}

absl::StatusOr<std::unique_ptr<Work>> Communicator::Reduce(ConstBuffer send, Buffer recv,
                                                           ReduceOp op, int root,
                                                           const OpOptions& options) {
  const comm_internal::GroupInfo g{name_, rank_, size_, world_rank_};
  STRATA_RETURN_IF_ERROR(comm_internal::ValidateReduce(g, send, recv, op, root, capabilities_));
  OpCall call{OpKind::kReduce,
              DescribeOp("reduce", absl::StrCat(ReduceOpName(op), ", root ", root), send)};
  call.input_count = send.count;
  call.output_count = rank_ == root ? recv.count : 0;
  call.dtype = send.dtype;
  call.reduce_op = ReduceOpName(op);
  call.root = root;
  STRATA_ASSIGN_OR_RETURN(ResolvedOptions r, Resolve(call, options));
  return Finish(DoReduce(send, recv, op, root, r), r);
}

absl::StatusOr<std::unique_ptr<Work>> Communicator::AllGather(ConstBuffer send, Buffer recv,
                                                              const OpOptions& options) {
  const comm_internal::GroupInfo g{name_, rank_, size_, world_rank_};
  STRATA_RETURN_IF_ERROR(comm_internal::ValidateAllGather(g, send, recv, capabilities_));
  OpCall call{OpKind::kAllGather, DescribeOp("allgather", "", send)};
  call.input_count = send.count;
  call.output_count = recv.count;
  call.dtype = send.dtype;
  STRATA_ASSIGN_OR_RETURN(ResolvedOptions r, Resolve(call, options));
  return Finish(DoAllGather(send, recv, r), r);
}

absl::StatusOr<std::unique_ptr<Work>> Communicator::ReduceScatter(ConstBuffer send, Buffer recv,
                                                                  ReduceOp op,
                                                                  const OpOptions& options) {
  const comm_internal::GroupInfo g{name_, rank_, size_, world_rank_};
  STRATA_RETURN_IF_ERROR(comm_internal::ValidateReduceScatter(g, send, recv, op, capabilities_));
  OpCall call{OpKind::kReduceScatter, DescribeOp("reduce_scatter", ReduceOpName(op), recv)};
  call.input_count = send.count;
  call.output_count = recv.count;
  call.dtype = recv.dtype;
  call.reduce_op = ReduceOpName(op);
  STRATA_ASSIGN_OR_RETURN(ResolvedOptions r, Resolve(call, options));
  return Finish(DoReduceScatter(send, recv, op, r), r);
}

absl::StatusOr<std::unique_ptr<Work>> Communicator::AllToAll(ConstBuffer send, Buffer recv,
                                                             const OpOptions& options) {
  const comm_internal::GroupInfo g{name_, rank_, size_, world_rank_};
  STRATA_RETURN_IF_ERROR(comm_internal::ValidateAllToAll(g, send, recv, capabilities_));
  OpCall call{OpKind::kAllToAll, DescribeOp("all_to_all", "", send)};
  call.input_count = send.count;
  call.output_count = recv.count;
  call.dtype = send.dtype;
  STRATA_ASSIGN_OR_RETURN(ResolvedOptions r, Resolve(call, options));
  return Finish(DoAllToAll(send, recv, r), r);
}

absl::StatusOr<std::unique_ptr<Work>> Communicator::AllToAllV(ConstBuffer send, Buffer recv,
                                                              const AllToAllCounts& counts,
                                                              const OpOptions& options) {
  const comm_internal::GroupInfo g{name_, rank_, size_, world_rank_};
  STRATA_RETURN_IF_ERROR(comm_internal::ValidateAllToAllV(g, send, recv, counts, capabilities_));
  OpCall call{OpKind::kAllToAllV, DescribeOp("all_to_all_v", "", send)};
  call.input_count = send.count;
  call.output_count = recv.count;
  call.dtype = send.dtype;
  STRATA_ASSIGN_OR_RETURN(ResolvedOptions r, Resolve(call, options));
  return Finish(DoAllToAllV(send, recv, counts, r), r);
}

absl::StatusOr<std::unique_ptr<Work>> Communicator::Barrier(const OpOptions& options) {
  OpCall call{OpKind::kBarrier, DescribeOp("barrier", "")};
  STRATA_ASSIGN_OR_RETURN(ResolvedOptions r, Resolve(call, options));
  return Finish(DoBarrier(r), r);
}

// ---- point to point -----------------------------------------------------------

absl::StatusOr<std::unique_ptr<Work>> Communicator::Send(ConstBuffer buffer, int peer,
                                                         const OpOptions& options) {
  const comm_internal::GroupInfo g{name_, rank_, size_, world_rank_};
  STRATA_RETURN_IF_ERROR(comm_internal::ValidatePeer(g, "send", buffer, peer, capabilities_));
  OpCall call{OpKind::kSend, DescribeOp("send", absl::StrCat("peer ", peer), buffer)};
  call.input_count = buffer.count;
  call.dtype = buffer.dtype;
  call.peer = peer;
  STRATA_ASSIGN_OR_RETURN(ResolvedOptions r, Resolve(call, options));
  return Finish(DoSend(buffer, peer, r), r);
}

absl::StatusOr<std::unique_ptr<Work>> Communicator::Recv(Buffer buffer, int peer,
                                                         const OpOptions& options) {
  const comm_internal::GroupInfo g{name_, rank_, size_, world_rank_};
  STRATA_RETURN_IF_ERROR(comm_internal::ValidatePeer(g, "recv", buffer, peer, capabilities_));
  OpCall call{OpKind::kRecv, DescribeOp("recv", absl::StrCat("peer ", peer), buffer)};
  call.output_count = buffer.count;
  call.dtype = buffer.dtype;
  call.peer = peer;
  STRATA_ASSIGN_OR_RETURN(ResolvedOptions r, Resolve(call, options));
  return Finish(DoRecv(buffer, peer, r), r);
}

// ---- structure and faults -----------------------------------------------------

absl::StatusOr<CommOptions> Communicator::ChildOptions(const CommOptions& options) const {
  STRATA_RETURN_IF_ERROR(comm_internal::CheckCommOptions(options));
  CommOptions child = options;
  if (child.sink == nullptr) child.sink = sink_;
  return child;
}

absl::StatusOr<std::unique_ptr<Communicator>> Communicator::Split(int color, int key,
                                                                  const CommOptions& options) {
  STRATA_ASSIGN_OR_RETURN(CommOptions child, ChildOptions(options));
  OpCall call{OpKind::kSplit,
              absl::StrCat("split(color ", color, ", key ", key, ") into '", options.name, "'")};
  call.structure_timeout = options.timeout;
  STRATA_ASSIGN_OR_RETURN(ResolvedOptions r, Resolve(call, OpOptions()));
  absl::StatusOr<std::unique_ptr<Communicator>> made = DoSplit(color, key, child, r);
  if (r.trace != nullptr) r.trace->Completed(made.status());
  return made;
}

absl::StatusOr<std::unique_ptr<Communicator>> Communicator::Shrink(absl::Span<const int> excluded,
                                                                   const CommOptions& options) {
  STRATA_ASSIGN_OR_RETURN(CommOptions child, ChildOptions(options));
  const comm_internal::GroupInfo g{name_, rank_, size_, world_rank_};
  STRATA_RETURN_IF_ERROR(comm_internal::ValidateExcluded(g, excluded));
  ShrinkPlan plan;
  plan.excluded.assign(excluded.begin(), excluded.end());
  std::sort(plan.excluded.begin(), plan.excluded.end());
  // An excluded rank takes no part (it may have failed, or be evicted while
  // alive): NCCL and ULFM want only the survivors in the call.
  if (std::binary_search(plan.excluded.begin(), plan.excluded.end(), rank_)) {
    return std::unique_ptr<Communicator>();
  }
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the survivors' bytes
  for (int r = 0; r < size_; ++r) {
    if (std::binary_search(plan.excluded.begin(), plan.excluded.end(), r)) continue;
    if (r == rank_) plan.new_rank = static_cast<int>(plan.survivors.size());
    plan.survivors.push_back(r);
    for (int i = 0; i < 4; ++i) {
      h ^= static_cast<uint64_t>((static_cast<uint32_t>(r) >> (8 * i)) & 0xffu);
      h *= 1099511628211ull;
    }
  }
  plan.survivors_hash = h;
  {
    std::lock_guard<std::mutex> lock(shrink_mu_);
    plan.attempt = shrink_attempts_[h]++;
  }
  OpCall call{OpKind::kShrink,
              absl::StrCat("shrink excluding ranks [", absl::StrJoin(plan.excluded, ", "),
                           "] into '", options.name, "'")};
  call.structure_timeout = options.timeout;
  STRATA_ASSIGN_OR_RETURN(ResolvedOptions r, Resolve(call, OpOptions()));
  absl::StatusOr<std::unique_ptr<Communicator>> made = DoShrink(plan, child, r);
  if (r.trace != nullptr) r.trace->Completed(made.status());
  return made;
}

absl::Status Communicator::Abort() { return DoAbort(); }

absl::Status Communicator::Revoke() { return DoRevoke(); }

absl::Status Communicator::AsyncError() { return DoAsyncError(); }

}  // namespace strata
