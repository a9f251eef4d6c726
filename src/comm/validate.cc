#include "comm/validate.h"

#include <cstdint>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "strata/base/status.h"

namespace strata::comm_internal {
namespace {

std::string Elements(size_t count, DataType dtype) {
  return absl::StrCat(count, " x ", DataTypeName(dtype));
}

absl::Status Invalid(const GroupInfo& g, absl::string_view op, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat(op, " on ", DescribeGroup(g), ": ", problem));
}

// Dtype in range, supported by the backend for the kind of use, buffer
// sane. `reduce` selects the reduction capability.
absl::Status CheckOne(const GroupInfo& g, absl::string_view op, absl::string_view which,
                      const void* data, size_t count, DataType dtype, bool reduce,
                      const Capabilities& caps) {
  STRATA_RETURN_IF_ERROR_CTX(CheckDataType(dtype), op, " on ", DescribeGroup(g), ": ", which);
  const bool ok = reduce ? caps.can_reduce(dtype) : caps.can_move(dtype);
  if (!ok) {
    return Invalid(g, op,
                   absl::StrCat(which, " dtype ", DataTypeName(dtype), " cannot be ",
                                reduce ? "reduced" : "communicated", " by this backend"));
  }
  STRATA_RETURN_IF_ERROR_CTX(CheckBuffer(which, data, count, dtype), op, " on ", DescribeGroup(g));
  return absl::OkStatus();
}

absl::Status SameShape(const GroupInfo& g, absl::string_view op, const ConstBuffer& send,
                       const ConstBuffer& recv) {
  if (send.dtype != recv.dtype) {
    return Invalid(g, op,
                   absl::StrCat("send dtype ", DataTypeName(send.dtype), " != recv dtype ",
                                DataTypeName(recv.dtype)));
  }
  if (send.count != recv.count) {
    return Invalid(g, op,
                   absl::StrCat("send has ", Elements(send.count, send.dtype), " but recv has ",
                                Elements(recv.count, recv.dtype)));
  }
  return absl::OkStatus();
}

size_t Bytes(const ConstBuffer& b) { return b.count * DataTypeSize(b.dtype); }

// Send and recv either are the same buffer (`in_place_at` is where send must
// start for the in-place form) or do not overlap.
absl::Status CheckAliasing(const GroupInfo& g, absl::string_view op, const ConstBuffer& send,
                           const ConstBuffer& recv, const void* in_place_at,
                           absl::string_view in_place_rule) {
  if (send.data == in_place_at) return absl::OkStatus();
  if (Overlaps(send.data, Bytes(send), recv.data, Bytes(recv))) {
    return Invalid(g, op,
                   absl::StrCat("send and recv buffers overlap without being in place (", op,
                                " is in place when ", in_place_rule, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckRank(const GroupInfo& g, absl::string_view op, absl::string_view role, int rank) {
  if (rank < 0 || rank >= g.size) {
    return Invalid(g, op,
                   absl::StrCat(role, " ", rank, " is out of range for a group of size ", g.size,
                                " (valid: 0..", g.size - 1, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string DescribeGroup(const GroupInfo& group) {
  return absl::StrCat("group ", group.name, " (rank ", group.rank, " of ", group.size,
                      ", world rank ", group.world_rank, ")");
}

std::string DescribeOp(absl::string_view op, absl::string_view detail, const ConstBuffer& buffer) {
  const std::string dtype = CheckDataType(buffer.dtype).ok()
                                ? std::string(DataTypeName(buffer.dtype))
                                : absl::StrCat("dtype#", static_cast<int>(buffer.dtype));
  if (detail.empty()) return absl::StrCat(op, "(", buffer.count, " x ", dtype, ")");
  return absl::StrCat(op, "(", detail, ", ", buffer.count, " x ", dtype, ")");
}

std::string DescribeOp(absl::string_view op, absl::string_view detail) {
  return absl::StrCat(op, "(", detail, ")");
}

absl::Status CheckDataType(DataType dtype) {
  if (!DataTypeFromInt(static_cast<int>(dtype)).ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown dtype value ", static_cast<int>(dtype)));
  }
  return absl::OkStatus();
}

absl::Status CheckBuffer(absl::string_view which, const void* data, size_t count, DataType dtype) {
  STRATA_RETURN_IF_ERROR_CTX(CheckDataType(dtype), which);
  const size_t size = DataTypeSize(dtype);
  if (count > std::numeric_limits<size_t>::max() / size ||
      count * size > static_cast<size_t>(std::numeric_limits<std::ptrdiff_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat(which, " of ", count, " x ", DataTypeName(dtype), " overflows the byte size"));
  }
  if (data == nullptr && count != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(which, " is null with count ", count, " x ", DataTypeName(dtype)));
  }
  return absl::OkStatus();
}

absl::Status CheckReduceOp(ReduceOp op, DataType dtype) {
  const int value = static_cast<int>(op);
  if (value < static_cast<int>(ReduceOp::kSum) || value > static_cast<int>(ReduceOp::kAvg)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown reduce op value ", value));
  }
  if (op == ReduceOp::kAvg && !IsFloatingPoint(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("reduce op avg is not defined for integer dtype ", DataTypeName(dtype),
                     " (use sum and divide, or a floating-point dtype)"));
  }
  return absl::OkStatus();
}

absl::Status CheckedMultiply(size_t count, size_t factor, absl::string_view what, size_t* out) {
  if (factor != 0 && count > std::numeric_limits<size_t>::max() / factor) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", count, " x ", factor, " elements overflows"));
  }
  *out = count * factor;
  return absl::OkStatus();
}

bool Overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  if (a == nullptr || b == nullptr || a_bytes == 0 || b_bytes == 0) return false;
  const uintptr_t a0 = reinterpret_cast<uintptr_t>(a);
  const uintptr_t b0 = reinterpret_cast<uintptr_t>(b);
  return a0 < b0 + b_bytes && b0 < a0 + a_bytes;
}

absl::Status ValidateAllReduce(const GroupInfo& g, const ConstBuffer& send, const Buffer& recv,
                               ReduceOp op, const Capabilities& caps) {
  const std::string what = DescribeOp("allreduce", ReduceOpName(op), recv);
  STRATA_RETURN_IF_ERROR(
      CheckOne(g, what, "send buffer", send.data, send.count, send.dtype, true, caps));
  STRATA_RETURN_IF_ERROR(
      CheckOne(g, what, "recv buffer", recv.data, recv.count, recv.dtype, true, caps));
  STRATA_RETURN_IF_ERROR_CTX(CheckReduceOp(op, recv.dtype), what, " on ", DescribeGroup(g));
  STRATA_RETURN_IF_ERROR(SameShape(g, what, send, recv));
  return CheckAliasing(g, what, send, recv, recv.data, "send.data == recv.data");
}

absl::Status ValidateBroadcast(const GroupInfo& g, const Buffer& buffer, int root,
                               const Capabilities& caps) {
  const std::string what = DescribeOp("broadcast", absl::StrCat("root ", root), buffer);
  STRATA_RETURN_IF_ERROR(
      CheckOne(g, what, "buffer", buffer.data, buffer.count, buffer.dtype, false, caps));
  return CheckRank(g, what, "root", root);
}

absl::Status ValidateReduce(const GroupInfo& g, const ConstBuffer& send, const Buffer& recv,
                            ReduceOp op, int root, const Capabilities& caps) {
  const std::string what =
      DescribeOp("reduce", absl::StrCat(ReduceOpName(op), ", root ", root), send);
  STRATA_RETURN_IF_ERROR(CheckRank(g, what, "root", root));
  STRATA_RETURN_IF_ERROR(
      CheckOne(g, what, "send buffer", send.data, send.count, send.dtype, true, caps));
  STRATA_RETURN_IF_ERROR_CTX(CheckReduceOp(op, send.dtype), what, " on ", DescribeGroup(g));
  // recv matters only on the root.
  if (g.rank != root) return absl::OkStatus();
  STRATA_RETURN_IF_ERROR(
      CheckOne(g, what, "recv buffer", recv.data, recv.count, recv.dtype, true, caps));
  STRATA_RETURN_IF_ERROR(SameShape(g, what, send, recv));
  return CheckAliasing(g, what, send, recv, recv.data, "send.data == recv.data");
}

absl::Status ValidateAllGather(const GroupInfo& g, const ConstBuffer& send, const Buffer& recv,
                               const Capabilities& caps) {
  const std::string what = DescribeOp("allgather", "", send);
  STRATA_RETURN_IF_ERROR(
      CheckOne(g, what, "send buffer", send.data, send.count, send.dtype, false, caps));
  STRATA_RETURN_IF_ERROR(
      CheckOne(g, what, "recv buffer", recv.data, recv.count, recv.dtype, false, caps));
  if (send.dtype != recv.dtype) return SameShape(g, what, send, recv);
  size_t want = 0;
  STRATA_RETURN_IF_ERROR_CTX(CheckedMultiply(send.count, g.size, "recv count", &want), what, " on ",
                             DescribeGroup(g));
  if (recv.count != want) {
    return Invalid(g, what,
                   absl::StrCat("recv has ", Elements(recv.count, recv.dtype), " but must hold ",
                                g.size, " x ", send.count, " = ", want, " elements"));
  }
  const char* at = static_cast<const char*>(recv.data);
  const void* own_block =
      at == nullptr ? nullptr
                    : at + static_cast<size_t>(g.rank) * send.count * DataTypeSize(send.dtype);
  return CheckAliasing(g, what, send, recv, own_block,
                       "send.data is this rank's block of recv, recv.data + rank * send.count");
}

absl::Status ValidateReduceScatter(const GroupInfo& g, const ConstBuffer& send, const Buffer& recv,
                                   ReduceOp op, const Capabilities& caps) {
  const std::string what = DescribeOp("reduce_scatter", ReduceOpName(op), recv);
  STRATA_RETURN_IF_ERROR(
      CheckOne(g, what, "send buffer", send.data, send.count, send.dtype, true, caps));
  STRATA_RETURN_IF_ERROR(
      CheckOne(g, what, "recv buffer", recv.data, recv.count, recv.dtype, true, caps));
  STRATA_RETURN_IF_ERROR_CTX(CheckReduceOp(op, recv.dtype), what, " on ", DescribeGroup(g));
  if (send.dtype != recv.dtype) return SameShape(g, what, send, recv);
  size_t want = 0;
  STRATA_RETURN_IF_ERROR_CTX(CheckedMultiply(recv.count, g.size, "send count", &want), what, " on ",
                             DescribeGroup(g));
  if (send.count != want) {
    return Invalid(g, what,
                   absl::StrCat("send has ", Elements(send.count, send.dtype), " but must hold ",
                                g.size, " x ", recv.count, " = ", want, " elements"));
  }
  return CheckAliasing(g, what, send, recv, recv.data,
                       "send.data == recv.data (the result lands in the first block)");
}

absl::Status ValidateAllToAll(const GroupInfo& g, const ConstBuffer& send, const Buffer& recv,
                              const Capabilities& caps) {
  const std::string what = DescribeOp("all_to_all", "", send);
  STRATA_RETURN_IF_ERROR(
      CheckOne(g, what, "send buffer", send.data, send.count, send.dtype, false, caps));
  STRATA_RETURN_IF_ERROR(
      CheckOne(g, what, "recv buffer", recv.data, recv.count, recv.dtype, false, caps));
  STRATA_RETURN_IF_ERROR(SameShape(g, what, send, recv));
  if (send.count % static_cast<size_t>(g.size) != 0) {
    return Invalid(g, what,
                   absl::StrCat("count ", send.count, " is not divisible by the group size ",
                                g.size, " (equal splits; use AllToAllV for unequal ones)"));
  }
  return CheckAliasing(g, what, send, recv, recv.data, "send.data == recv.data");
}

absl::Status ValidateAllToAllV(const GroupInfo& g, const ConstBuffer& send, const Buffer& recv,
                               const AllToAllCounts& counts, const Capabilities& caps) {
  const std::string what = DescribeOp("all_to_all_v", "", send);
  STRATA_RETURN_IF_ERROR(
      CheckOne(g, what, "send buffer", send.data, send.count, send.dtype, false, caps));
  STRATA_RETURN_IF_ERROR(
      CheckOne(g, what, "recv buffer", recv.data, recv.count, recv.dtype, false, caps));
  if (send.dtype != recv.dtype) return SameShape(g, what, send, recv);
  const size_t n = static_cast<size_t>(g.size);
  if (counts.send_counts.size() != n || counts.recv_counts.size() != n) {
    return Invalid(
        g, what,
        absl::StrCat("send_counts has ", counts.send_counts.size(), " entries and recv_counts ",
                     counts.recv_counts.size(), "; both need one per rank (", n, ")"));
  }
  auto sum = [](const std::vector<size_t>& v, size_t* out) {
    size_t total = 0;
    for (size_t c : v) {
      if (c > std::numeric_limits<size_t>::max() - total) return false;
      total += c;
    }
    *out = total;
    return true;
  };
  size_t send_total = 0, recv_total = 0;
  if (!sum(counts.send_counts, &send_total) || !sum(counts.recv_counts, &recv_total)) {
    return Invalid(g, what, "the split counts overflow when summed");
  }
  if (send_total != send.count) {
    return Invalid(
        g, what,
        absl::StrCat("send_counts [", absl::StrJoin(counts.send_counts, ", "), "] sum to ",
                     send_total, " but send has ", send.count, " elements"));
  }
  if (recv_total != recv.count) {
    return Invalid(
        g, what,
        absl::StrCat("recv_counts [", absl::StrJoin(counts.recv_counts, ", "), "] sum to ",
                     recv_total, " but recv has ", recv.count, " elements"));
  }
  if (send.data == recv.data && send.count != 0 && counts.send_counts != counts.recv_counts) {
    return Invalid(g, what, "in place (send.data == recv.data) needs send_counts == recv_counts");
  }
  return CheckAliasing(g, what, send, recv, recv.data, "send.data == recv.data");
}

absl::Status ValidatePeer(const GroupInfo& g, absl::string_view op, const ConstBuffer& buffer,
                          int peer, const Capabilities& caps) {
  const std::string what = DescribeOp(op, absl::StrCat("peer ", peer), buffer);
  STRATA_RETURN_IF_ERROR(
      CheckOne(g, what, "buffer", buffer.data, buffer.count, buffer.dtype, false, caps));
  return CheckRank(g, what, "peer", peer);
}

absl::Status ValidateExcluded(const GroupInfo& g, absl::Span<const int> excluded) {
  std::vector<bool> seen(static_cast<size_t>(g.size), false);
  for (int r : excluded) {
    if (r < 0 || r >= g.size) {
      return Invalid(
          g, "shrink",
          absl::StrCat("excluded rank ", r, " is out of range for a group of size ", g.size));
    }
    if (seen[static_cast<size_t>(r)]) {
      return Invalid(g, "shrink", absl::StrCat("excluded rank ", r, " is listed twice"));
    }
    seen[static_cast<size_t>(r)] = true;
  }
  if (excluded.size() == static_cast<size_t>(g.size)) {
    return Invalid(g, "shrink", absl::StrCat("every rank (", g.size, ") is excluded"));
  }
  return absl::OkStatus();
}

absl::Status CheckCommOptions(const CommOptions& options) {
  if (options.version != CommOptions::kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("CommOptions version ", options.version,
                     " is not supported (this build: ", CommOptions::kVersion, ")"));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("communicator '", options.name, "': timeout ",
                                                   absl::FormatDuration(options.timeout),
                                                   " must be positive"));
  }
  if (options.name.empty()) return absl::InvalidArgumentError("communicator name is empty");
  if (options.excluded_exit_wait < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("communicator '", options.name, "': excluded_exit_wait ",
                     absl::FormatDuration(options.excluded_exit_wait), " must not be negative"));
  }
  return absl::OkStatus();
}

}  // namespace strata::comm_internal
