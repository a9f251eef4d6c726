// ColumnParallelLinear / RowParallelLinear: creation, option and shape
// validation, and the public wrappers. The steps are in column_linear.cc
// and row_linear.cc.
#include "strata/parallel/tensor_parallel/linear.h"

#include <climits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "parallel/tensor_parallel/internal/convert.h"
#include "parallel/tensor_parallel/internal/linear_engine.h"
#include "strata/base/status.h"

namespace strata {

std::string DescribeShape(int64_t rows, int64_t cols, DataType dtype) {
  return absl::StrCat("[", rows, ", ", cols, "] ", DataTypeName(dtype));
}

namespace tp_internal {
namespace {

absl::Status CheckMatrix(const char* layer, const char* which, const ConstMatrixRef& m,
                         int64_t rows, int64_t cols, DataType dtype) {
  if (m.rows != rows || m.cols != cols || m.dtype != dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat(layer, ": ", which, " is ", DescribeShape(m.rows, m.cols, m.dtype),
                     ", expected ", DescribeShape(rows, cols, dtype)));
  }
  if (m.data == nullptr && rows * cols > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(layer, ": ", which, " ", DescribeShape(rows, cols, dtype), " has no data"));
  }
  return absl::OkStatus();
}

const char* MemoryName(MemoryKind m) { return m == MemoryKind::kCuda ? "CUDA" : "host"; }

}  // namespace

LinearEngine::LinearEngine(LinearKind kind, const LinearOptions& options, GroupHandle group,
                           const Communicator& comm, std::unique_ptr<Kernels> kernels)
    : kind_(kind),
      options_(options),
      group_(std::move(group)),
      size_(comm.size()),
      rank_(comm.rank()),
      local_((kind == LinearKind::kColumn ? options.out_features : options.in_features) /
             comm.size()),
      kernels_(std::move(kernels)) {
  ctx_.kernels = kernels_.get();
  ctx_.timeout = options_.timeout;
  ctx_.layer = name();
}

const char* LinearEngine::name() const {
  return kind_ == LinearKind::kColumn ? "column-parallel linear" : "row-parallel linear";
}

absl::StatusOr<std::unique_ptr<LinearEngine>> LinearEngine::Create(LinearKind kind,
                                                                   const LinearOptions& o,
                                                                   const GroupHandle& handle) {
  const bool column = kind == LinearKind::kColumn;
  const char* layer = column ? "ColumnParallelLinear" : "RowParallelLinear";
  // The weights are sharded for this rank and size: the layer refuses a
  // world rebuild that changes them.
  absl::StatusOr<GroupHandle> pinned =
      handle.Pin(column ? "column-parallel linear layer" : "row-parallel linear layer");
  if (!pinned.ok()) return internal::Annotate(pinned.status(), layer);
  absl::StatusOr<Communicator*> resolved = pinned->Resolve();
  if (!resolved.ok()) return internal::Annotate(resolved.status(), layer);
  const Communicator& group = **resolved;
  const int size = group.size();
  if (o.in_features <= 0 || o.out_features <= 0 || o.in_features > INT_MAX ||
      o.out_features > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(layer, ": in_features ", o.in_features,
                                                   " and out_features ", o.out_features,
                                                   " must be in [1, ", INT_MAX, "]"));
  }
  if (!IsKernelDataType(o.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(layer, ": dtype ", DataTypeName(o.dtype),
                                                   " is not supported (fp32, fp16 or bf16)"));
  }
  if (o.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat(layer, ": timeout ", absl::FormatDuration(o.timeout), " must be positive"));
  }
  if (column) {
    if (o.input_is_parallel) {
      return absl::InvalidArgumentError(
          "ColumnParallelLinear: input_is_parallel is a RowParallelLinear option");
    }
    if (o.gather_output && o.sequence_parallel) {
      return absl::InvalidArgumentError(
          "ColumnParallelLinear: gather_output cannot be combined with sequence_parallel (the "
          "output would be gathered along both the sequence and the features)");
    }
    if (o.out_features % size != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("ColumnParallelLinear: out_features ", o.out_features,
                       " is not divisible by the size ", size, " of group ", group.name()));
    }
  } else {
    if (o.gather_output) {
      return absl::InvalidArgumentError(
          "RowParallelLinear: gather_output is a ColumnParallelLinear option");
    }
    if (o.sequence_parallel && !o.input_is_parallel) {
      return absl::InvalidArgumentError(
          "RowParallelLinear: sequence_parallel needs input_is_parallel (the input must already "
          "be split by features)");
    }
    if (o.in_features % size != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("RowParallelLinear: in_features ", o.in_features,
                       " is not divisible by the size ", size, " of group ", group.name()));
    }
  }
  if (size > 1 && group.memory() != o.memory) {
    return absl::InvalidArgumentError(absl::StrCat(
        layer, ": the tensors are in ", MemoryName(o.memory), " memory but group ", group.name(),
        " (", group.backend(), ") communicates ", MemoryName(group.memory()), " memory"));
  }
  absl::StatusOr<std::unique_ptr<Kernels>> kernels = MakeKernels(o.memory);
  if (!kernels.ok()) return internal::Annotate(kernels.status(), layer);
  return std::unique_ptr<LinearEngine>(
      new LinearEngine(kind, o, *std::move(pinned), group, std::move(kernels).value()));
}

absl::StatusOr<LinearShapes> LinearEngine::Shapes(int64_t rows) const {
  const LinearOptions& o = options_;
  if (rows < 0 || rows > INT_MAX / size_) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": ", rows, " input rows is out of range"));
  }
  LinearShapes s;
  s.input_rows = rows;
  if (kind_ == LinearKind::kColumn) {
    const int64_t full = o.sequence_parallel ? rows * size_ : rows;
    s.input_cols = o.in_features;
    s.weight_rows = local_;
    s.weight_cols = o.in_features;
    s.bias = o.bias ? local_ : 0;
    s.output_rows = full;
    s.output_cols = o.gather_output ? o.out_features : local_;
  } else {
    if (o.sequence_parallel && rows % size_ != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name(), ": ", rows, " input rows (tokens) are not divisible by the size ",
                       size_, " of group ", group_.name(), ", as sequence parallelism needs"));
    }
    s.input_cols = o.input_is_parallel ? local_ : o.in_features;
    s.weight_rows = o.out_features;
    s.weight_cols = local_;
    s.bias = o.bias ? o.out_features : 0;
    s.output_rows = o.sequence_parallel ? rows / size_ : rows;
    s.output_cols = o.out_features;
  }
  return s;
}

absl::Status LinearEngine::CheckForward(const LinearForward& a, LinearShapes* s) const {
  STRATA_ASSIGN_OR_RETURN(*s, Shapes(a.input.rows));
  const DataType t = options_.dtype;
  STRATA_RETURN_IF_ERROR(CheckMatrix(name(), "input", a.input, s->input_rows, s->input_cols, t));
  STRATA_RETURN_IF_ERROR(
      CheckMatrix(name(), "weight", a.weight, s->weight_rows, s->weight_cols, t));
  STRATA_RETURN_IF_ERROR(
      CheckMatrix(name(), "output", a.output, s->output_rows, s->output_cols, t));
  if (options_.bias && !options_.skip_bias_add && a.bias == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": the layer has a bias of ", s->bias, " but none was given"));
  }
  if (!options_.bias && a.bias != nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": a bias was given to a layer created with bias = false"));
  }
  return absl::OkStatus();
}

absl::Status LinearEngine::CheckBackward(const LinearBackward& a, LinearShapes* s) const {
  STRATA_ASSIGN_OR_RETURN(*s, Shapes(a.input.rows));
  const DataType t = options_.dtype;
  STRATA_RETURN_IF_ERROR(CheckMatrix(name(), "input", a.input, s->input_rows, s->input_cols, t));
  STRATA_RETURN_IF_ERROR(
      CheckMatrix(name(), "weight", a.weight, s->weight_rows, s->weight_cols, t));
  STRATA_RETURN_IF_ERROR(
      CheckMatrix(name(), "grad_output", a.grad_output, s->output_rows, s->output_cols, t));
  if (a.grad_input.data != nullptr) {
    STRATA_RETURN_IF_ERROR(
        CheckMatrix(name(), "grad_input", a.grad_input, s->input_rows, s->input_cols, t));
  }
  if (a.bias_grad != nullptr && (!options_.bias || options_.skip_bias_add)) {
    return absl::InvalidArgumentError(absl::StrCat(
        name(), ": bias_grad was given but the layer ",
        options_.bias ? "skips the bias add (the caller owns the bias gradient)" : "has no bias"));
  }
  return absl::OkStatus();
}

absl::StatusOr<MatrixRef> LinearEngine::ScratchMatrix(Slot slot, int64_t rows, int64_t cols) {
  STRATA_ASSIGN_OR_RETURN(void* p,
                          kernels_->Scratch(slot, rows * cols * DataTypeSize(options_.dtype)));
  return MatrixRef{p, rows, cols, options_.dtype};
}

absl::Status LinearEngine::ResolveGroup() {
  absl::StatusOr<Communicator*> comm = group_.Resolve();
  if (!comm.ok()) return internal::Annotate(comm.status(), name());
  ctx_.comm = *comm;
  return absl::OkStatus();
}

absl::Status LinearEngine::Forward(const LinearForward& args) {
  LinearShapes s;
  STRATA_RETURN_IF_ERROR(CheckForward(args, &s));
  STRATA_RETURN_IF_ERROR(ResolveGroup());
  kernels_->SetStream(args.stream);
  return kind_ == LinearKind::kColumn ? ColumnForward(args, s) : RowForward(args, s);
}

absl::Status LinearEngine::Backward(const LinearBackward& args) {
  LinearShapes s;
  STRATA_RETURN_IF_ERROR(CheckBackward(args, &s));
  STRATA_RETURN_IF_ERROR(ResolveGroup());
  kernels_->SetStream(args.stream);
  return kind_ == LinearKind::kColumn ? ColumnBackward(args, s) : RowBackward(args, s);
}

}  // namespace tp_internal

// ---- public wrappers --------------------------------------------------------

ColumnParallelLinear::ColumnParallelLinear(std::unique_ptr<tp_internal::LinearEngine> engine)
    : engine_(std::move(engine)) {}
ColumnParallelLinear::~ColumnParallelLinear() = default;

absl::StatusOr<std::unique_ptr<ColumnParallelLinear>> ColumnParallelLinear::Create(
    const LinearOptions& options, const GroupHandle& group) {
  STRATA_ASSIGN_OR_RETURN(auto engine, tp_internal::LinearEngine::Create(
                                           tp_internal::LinearKind::kColumn, options, group));
  return std::unique_ptr<ColumnParallelLinear>(new ColumnParallelLinear(std::move(engine)));
}
absl::StatusOr<LinearShapes> ColumnParallelLinear::Shapes(int64_t rows) const {
  return engine_->Shapes(rows);
}
absl::Status ColumnParallelLinear::Forward(const LinearForward& a) { return engine_->Forward(a); }
absl::Status ColumnParallelLinear::Backward(const LinearBackward& a) {
  return engine_->Backward(a);
}
const LinearOptions& ColumnParallelLinear::options() const { return engine_->options(); }
int64_t ColumnParallelLinear::local_out_features() const { return engine_->local_features(); }

RowParallelLinear::RowParallelLinear(std::unique_ptr<tp_internal::LinearEngine> engine)
    : engine_(std::move(engine)) {}
RowParallelLinear::~RowParallelLinear() = default;

absl::StatusOr<std::unique_ptr<RowParallelLinear>> RowParallelLinear::Create(
    const LinearOptions& options, const GroupHandle& group) {
  STRATA_ASSIGN_OR_RETURN(auto engine, tp_internal::LinearEngine::Create(
                                           tp_internal::LinearKind::kRow, options, group));
  return std::unique_ptr<RowParallelLinear>(new RowParallelLinear(std::move(engine)));
}
absl::StatusOr<LinearShapes> RowParallelLinear::Shapes(int64_t rows) const {
  return engine_->Shapes(rows);
}
absl::Status RowParallelLinear::Forward(const LinearForward& a) { return engine_->Forward(a); }
absl::Status RowParallelLinear::Backward(const LinearBackward& a) { return engine_->Backward(a); }
const LinearOptions& RowParallelLinear::options() const { return engine_->options(); }
int64_t RowParallelLinear::local_in_features() const { return engine_->local_features(); }

}  // namespace strata
