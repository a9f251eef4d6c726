// VocabParallelEmbedding on host memory.
#include "strata/parallel/tensor_parallel/embedding.h"

#include <climits>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "parallel/tensor_parallel/internal/collectives.h"
#include "parallel/tensor_parallel/internal/convert.h"
#include "parallel/tensor_parallel/internal/kernels.h"
#include "strata/base/status.h"

namespace strata {
namespace {

constexpr char kLayer[] = "vocab-parallel embedding";

absl::Status CheckView(const char* which, const ConstMatrixRef& m, int64_t rows, int64_t cols,
                       DataType dtype) {
  if (m.rows != rows || m.cols != cols || m.dtype != dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat(kLayer, ": ", which, " is ", DescribeShape(m.rows, m.cols, m.dtype),
                     ", expected ", DescribeShape(rows, cols, dtype)));
  }
  if (m.data == nullptr && rows * cols > 0) {
    return absl::InvalidArgumentError(absl::StrCat(kLayer, ": ", which, " has no data"));
  }
  return absl::OkStatus();
}

}  // namespace

VocabParallelEmbedding::VocabParallelEmbedding(const EmbeddingOptions& options, GroupHandle group,
                                               const Communicator& comm)
    : options_(options),
      group_(std::move(group)),
      size_(comm.size()),
      local_(options.num_embeddings / comm.size()),
      start_(local_ * comm.rank()),
      kernels_(tp_internal::MakeCpuKernels()) {}

VocabParallelEmbedding::~VocabParallelEmbedding() = default;

absl::StatusOr<std::unique_ptr<VocabParallelEmbedding>> VocabParallelEmbedding::Create(
    const EmbeddingOptions& o, const GroupHandle& handle) {
  // The table is sharded for this rank and size: refuse a rebuild that
  // changes them.
  absl::StatusOr<GroupHandle> pinned = handle.Pin("vocab-parallel embedding");
  if (!pinned.ok()) return internal::Annotate(pinned.status(), kLayer);
  absl::StatusOr<Communicator*> resolved = pinned->Resolve();
  if (!resolved.ok()) return internal::Annotate(resolved.status(), kLayer);
  const Communicator& group = **resolved;
  if (o.num_embeddings <= 0 || o.embedding_dim <= 0 || o.embedding_dim > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("VocabParallelEmbedding: num_embeddings ",
                                                   o.num_embeddings, " and embedding_dim ",
                                                   o.embedding_dim, " must be positive"));
  }
  if (o.num_embeddings % group.size() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("VocabParallelEmbedding: num_embeddings ", o.num_embeddings,
                     " is not divisible by the size ", group.size(), " of group ", group.name(),
                     " (pad the vocabulary to a multiple of it)"));
  }
  if (!tp_internal::IsKernelDataType(o.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("VocabParallelEmbedding: dtype ",
                                                   DataTypeName(o.dtype),
                                                   " is not supported (fp32, fp16 or bf16)"));
  }
  if (o.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("VocabParallelEmbedding: timeout must be positive");
  }
  if (o.memory != MemoryKind::kHost) {
    return absl::UnimplementedError(
        "VocabParallelEmbedding: the C++ kernel computes on host memory only");
  }
  if (group.size() > 1 && group.memory() != MemoryKind::kHost) {
    return absl::InvalidArgumentError(absl::StrCat("VocabParallelEmbedding: group ", group.name(),
                                                   " does not communicate host memory"));
  }
  return std::unique_ptr<VocabParallelEmbedding>(
      new VocabParallelEmbedding(o, *std::move(pinned), group));
}

absl::Status VocabParallelEmbedding::CheckIds(const int64_t* ids, int64_t n) const {
  if (n < 0 || (n > 0 && ids == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(kLayer, ": ", n, " ids without data"));
  }
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= options_.num_embeddings) {
      return absl::InvalidArgumentError(absl::StrCat(kLayer, ": id ", ids[i], " at position ", i,
                                                     " is outside the vocabulary [0, ",
                                                     options_.num_embeddings, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status VocabParallelEmbedding::CheckRows(int64_t num_ids, int64_t* out_rows) const {
  const int size = size_;
  if (options_.sequence_parallel && num_ids % size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kLayer, ": ", num_ids, " tokens are not divisible by the size ", size,
                     " of group ", group_.name(), ", as sequence parallelism needs"));
  }
  *out_rows = options_.sequence_parallel ? num_ids / size : num_ids;
  return absl::OkStatus();
}

absl::Status VocabParallelEmbedding::Forward(const EmbeddingForward& a) {
  const int64_t dim = options_.embedding_dim;
  int64_t out_rows = 0;
  STRATA_RETURN_IF_ERROR(CheckIds(a.ids, a.num_ids));
  STRATA_RETURN_IF_ERROR(CheckRows(a.num_ids, &out_rows));
  STRATA_RETURN_IF_ERROR(CheckView("weight", a.weight, local_, dim, options_.dtype));
  STRATA_RETURN_IF_ERROR(CheckView("output", a.output, out_rows, dim, options_.dtype));

  const size_t row_bytes = dim * DataTypeSize(options_.dtype);
  MatrixRef rows = a.output;
  if (options_.sequence_parallel) {
    scratch_.resize(a.num_ids * row_bytes);
    rows = MatrixRef{scratch_.data(), a.num_ids, dim, options_.dtype};
  }
  auto* out = static_cast<uint8_t*>(rows.data);
  const auto* table = static_cast<const uint8_t*>(a.weight.data);
  for (int64_t i = 0; i < a.num_ids; ++i) {
    const int64_t local = a.ids[i] - start_;
    if (local >= 0 && local < local_) {
      std::memcpy(out + i * row_bytes, table + local * row_bytes, row_bytes);
    } else {
      std::memset(out + i * row_bytes, 0, row_bytes);
    }
  }
  absl::StatusOr<Communicator*> comm = group_.Resolve();
  if (!comm.ok()) return internal::Annotate(comm.status(), kLayer);
  tp_internal::CommContext ctx{*comm, kernels_.get(), options_.timeout, kLayer};
  if (options_.sequence_parallel) {
    STRATA_ASSIGN_OR_RETURN(
        tp_internal::Pending p,
        tp_internal::ReduceScatterRows(ctx, rows, a.output, "forward: reduce-scatter of rows"));
    return p.Wait();
  }
  STRATA_ASSIGN_OR_RETURN(tp_internal::Pending p,
                          tp_internal::AllReduceSum(ctx, rows, "forward: all-reduce of rows"));
  return p.Wait();
}

absl::Status VocabParallelEmbedding::Backward(const EmbeddingBackward& a) {
  const int64_t dim = options_.embedding_dim;
  int64_t out_rows = 0;
  STRATA_RETURN_IF_ERROR(CheckIds(a.ids, a.num_ids));
  STRATA_RETURN_IF_ERROR(CheckRows(a.num_ids, &out_rows));
  STRATA_RETURN_IF_ERROR(CheckView("grad_output", a.grad_output, out_rows, dim, options_.dtype));
  if (a.weight_main_grad == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kLayer, ": weight_main_grad is null"));
  }
  ConstMatrixRef dy = a.grad_output;
  if (options_.sequence_parallel) {
    scratch_.resize(a.num_ids * dim * DataTypeSize(options_.dtype));
    MatrixRef full{scratch_.data(), a.num_ids, dim, options_.dtype};
    absl::StatusOr<Communicator*> comm = group_.Resolve();
    if (!comm.ok()) return internal::Annotate(comm.status(), kLayer);
    tp_internal::CommContext ctx{*comm, kernels_.get(), options_.timeout, kLayer};
    STRATA_ASSIGN_OR_RETURN(tp_internal::Pending p,
                            tp_internal::AllGatherRows(ctx, a.grad_output, full,
                                                       "backward: all-gather of grad_output"));
    STRATA_RETURN_IF_ERROR(p.Wait());
    dy = full;
  }
  row_.resize(dim);
  const size_t row_bytes = dim * DataTypeSize(options_.dtype);
  const auto* g = static_cast<const uint8_t*>(dy.data);
  for (int64_t i = 0; i < a.num_ids; ++i) {
    const int64_t local = a.ids[i] - start_;
    if (local < 0 || local >= local_) continue;
    tp_internal::ToFloat(g + i * row_bytes, options_.dtype, row_.data(), dim);
    float* acc = a.weight_main_grad + local * dim;
    for (int64_t c = 0; c < dim; ++c) acc[c] += row_[c];
  }
  return absl::OkStatus();
}

}  // namespace strata
