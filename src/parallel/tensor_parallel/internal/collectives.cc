#include "parallel/tensor_parallel/internal/collectives.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "strata/base/status.h"

namespace strata::tp_internal {
namespace {

Buffer AsBuffer(const MatrixRef& m) {
  return Buffer{m.data, static_cast<size_t>(m.numel()), m.dtype};
}
ConstBuffer AsBuffer(const ConstMatrixRef& m) {
  return ConstBuffer(m.data, static_cast<size_t>(m.numel()), m.dtype);
}

absl::StatusOr<OpOptions> Options(const CommContext& ctx) {
  OpOptions o;
  o.timeout = ctx.timeout;
  STRATA_ASSIGN_OR_RETURN(o.stream, ctx.kernels->BeginComm());
  return o;
}

absl::StatusOr<Pending> Started(const CommContext& ctx, absl::StatusOr<std::unique_ptr<Work>> work,
                                const char* what) {
  if (!work.ok()) {
    return internal::Annotate(work.status(), absl::StrCat(ctx.layer, " ", what));
  }
  return Pending(ctx, std::move(work).value(), what);
}

}  // namespace

Pending::Pending(const CommContext& ctx, std::unique_ptr<Work> work, std::string what)
    : ctx_(ctx),
      work_(std::move(work)),
      deadline_(absl::Now() + ctx.timeout),
      what_(std::move(what)) {}

absl::Status Pending::Wait() {
  if (work_ == nullptr) return absl::OkStatus();
  std::unique_ptr<Work> work = std::move(work_);
  STRATA_RETURN_IF_ERROR_CTX(ctx_.kernels->EndComm(), ctx_.layer, " ", what_);
  STRATA_RETURN_IF_ERROR_CTX(work->Wait(deadline_), ctx_.layer, " ", what_);
  return absl::OkStatus();
}

absl::StatusOr<Pending> AllReduceSum(const CommContext& ctx, const MatrixRef& m, const char* what) {
  return AllReduce(ctx, m, ReduceOp::kSum, what);
}

absl::StatusOr<Pending> AllReduce(const CommContext& ctx, const MatrixRef& m, ReduceOp op,
                                  const char* what) {
  if (ctx.comm->size() == 1) return Pending();
  STRATA_ASSIGN_OR_RETURN(OpOptions o, Options(ctx));
  return Started(ctx, ctx.comm->AllReduce(AsBuffer(m), AsBuffer(m), op, o), what);
}

absl::StatusOr<Pending> AllGatherRows(const CommContext& ctx, const ConstMatrixRef& local,
                                      const MatrixRef& full, const char* what) {
  STRATA_CHECK(full.rows == local.rows * ctx.comm->size() && full.cols == local.cols,
               "AllGatherRows shapes");
  if (ctx.comm->size() == 1) {
    if (full.data != local.data) {
      const size_t bytes = local.numel() * DataTypeSize(local.dtype);
      STRATA_RETURN_IF_ERROR(ctx.kernels->Copy2D(full.data, bytes, local.data, bytes, bytes, 1));
    }
    return Pending();
  }
  STRATA_ASSIGN_OR_RETURN(OpOptions o, Options(ctx));
  return Started(ctx, ctx.comm->AllGather(AsBuffer(local), AsBuffer(full), o), what);
}

absl::StatusOr<Pending> ReduceScatterRows(const CommContext& ctx, const ConstMatrixRef& full,
                                          const MatrixRef& local, const char* what) {
  STRATA_CHECK(full.rows == local.rows * ctx.comm->size() && full.cols == local.cols,
               "ReduceScatterRows shapes");
  if (ctx.comm->size() == 1) {
    if (full.data != local.data) {
      const size_t bytes = local.numel() * DataTypeSize(local.dtype);
      STRATA_RETURN_IF_ERROR(ctx.kernels->Copy2D(local.data, bytes, full.data, bytes, bytes, 1));
    }
    return Pending();
  }
  STRATA_ASSIGN_OR_RETURN(OpOptions o, Options(ctx));
  return Started(ctx, ctx.comm->ReduceScatter(AsBuffer(full), AsBuffer(local), ReduceOp::kSum, o),
                 what);
}

absl::Status InterleaveColumns(Kernels& k, const ConstMatrixRef& src, int size,
                               const MatrixRef& dst) {
  STRATA_CHECK(src.rows == dst.rows * size && dst.cols == src.cols * size, "InterleaveColumns");
  const size_t e = DataTypeSize(src.dtype);
  const size_t block_width = src.cols * e;
  for (int r = 0; r < size; ++r) {
    const auto* from = static_cast<const uint8_t*>(src.data) + r * dst.rows * block_width;
    auto* to = static_cast<uint8_t*>(dst.data) + r * block_width;
    STRATA_RETURN_IF_ERROR(k.Copy2D(to, dst.cols * e, from, block_width, block_width, dst.rows));
  }
  return absl::OkStatus();
}

absl::Status SliceColumns(Kernels& k, const ConstMatrixRef& src, int index, const MatrixRef& dst) {
  STRATA_CHECK(src.rows == dst.rows && src.cols >= (index + 1) * dst.cols, "SliceColumns");
  const size_t e = DataTypeSize(src.dtype);
  const auto* from = static_cast<const uint8_t*>(src.data) + index * dst.cols * e;
  return k.Copy2D(dst.data, dst.cols * e, from, src.cols * e, dst.cols * e, dst.rows);
}

}  // namespace strata::tp_internal
