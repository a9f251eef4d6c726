// VocabParallelCrossEntropy on host memory. Each token's three reductions
// over the vocabulary (max; then sum of exponentials, target logit and sum
// of logits) take two all-reduces for the whole batch.
#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "parallel/tensor_parallel/internal/collectives.h"
#include "parallel/tensor_parallel/internal/convert.h"
#include "parallel/tensor_parallel/internal/kernels.h"
#include "strata/base/status.h"
#include "strata/parallel/tensor_parallel/embedding.h"

namespace strata {
namespace {

constexpr char kLayer[] = "vocab-parallel cross-entropy";

// Row r of a logits matrix as fp32: the row itself, or widened into `buf`.
const float* RowAsFloat(const ConstMatrixRef& m, int64_t r, std::vector<float>& buf) {
  const size_t e = DataTypeSize(m.dtype);
  const auto* p = static_cast<const uint8_t*>(m.data) + r * m.cols * e;
  if (m.dtype == DataType::kFloat32) return reinterpret_cast<const float*>(p);
  buf.resize(m.cols);
  tp_internal::ToFloat(p, m.dtype, buf.data(), m.cols);
  return buf.data();
}

}  // namespace

VocabParallelCrossEntropy::VocabParallelCrossEntropy(const CrossEntropyOptions& options,
                                                     GroupHandle group, const Communicator& comm)
    : options_(options),
      group_(std::move(group)),
      size_(comm.size()),
      local_(options.vocab_size / comm.size()),
      start_(local_ * comm.rank()),
      kernels_(tp_internal::MakeCpuKernels()) {}

VocabParallelCrossEntropy::~VocabParallelCrossEntropy() = default;

absl::StatusOr<std::unique_ptr<VocabParallelCrossEntropy>> VocabParallelCrossEntropy::Create(
    const CrossEntropyOptions& o, const GroupHandle& handle) {
  // The vocabulary is split for this rank and size: refuse a rebuild that
  // changes them.
  absl::StatusOr<GroupHandle> pinned = handle.Pin("vocab-parallel cross-entropy");
  if (!pinned.ok()) return internal::Annotate(pinned.status(), kLayer);
  absl::StatusOr<Communicator*> resolved = pinned->Resolve();
  if (!resolved.ok()) return internal::Annotate(resolved.status(), kLayer);
  const Communicator& group = **resolved;
  if (o.vocab_size <= 0 || o.vocab_size % group.size() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "VocabParallelCrossEntropy: vocab_size ", o.vocab_size,
        " must be positive and divisible by the size ", group.size(), " of group ", group.name()));
  }
  if (!(o.label_smoothing >= 0.0 && o.label_smoothing < 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("VocabParallelCrossEntropy: label_smoothing ",
                                                   o.label_smoothing, " is outside [0, 1)"));
  }
  if (!tp_internal::IsKernelDataType(o.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("VocabParallelCrossEntropy: dtype ",
                                                   DataTypeName(o.dtype),
                                                   " is not supported (fp32, fp16 or bf16)"));
  }
  if (o.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("VocabParallelCrossEntropy: timeout must be positive");
  }
  if (o.memory != MemoryKind::kHost) {
    return absl::UnimplementedError(
        "VocabParallelCrossEntropy: the C++ kernel computes on host memory only");
  }
  if (group.size() > 1 && group.memory() != MemoryKind::kHost) {
    return absl::InvalidArgumentError(absl::StrCat(
        "VocabParallelCrossEntropy: group ", group.name(), " does not communicate host memory"));
  }
  return std::unique_ptr<VocabParallelCrossEntropy>(
      new VocabParallelCrossEntropy(o, *std::move(pinned), group));
}

absl::Status VocabParallelCrossEntropy::CheckLogits(const ConstMatrixRef& m,
                                                    const char* which) const {
  if (m.cols != local_ || m.dtype != options_.dtype || m.rows < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kLayer, ": ", which, " is ", DescribeShape(m.rows, m.cols, m.dtype),
                     ", expected [tokens, ", local_, "] ", DataTypeName(options_.dtype),
                     " (vocab_size ", options_.vocab_size, " / ", size_, " ranks)"));
  }
  if (m.data == nullptr && m.rows > 0) {
    return absl::InvalidArgumentError(absl::StrCat(kLayer, ": ", which, " has no data"));
  }
  return absl::OkStatus();
}

absl::Status VocabParallelCrossEntropy::CheckTargets(const int64_t* target, int64_t n) const {
  if (n > 0 && target == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kLayer, ": target is null"));
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = target[i];
    if (t != options_.ignore_index && (t < 0 || t >= options_.vocab_size)) {
      return absl::InvalidArgumentError(absl::StrCat(
          kLayer, ": target ", t, " at position ", i, " is outside the vocabulary [0, ",
          options_.vocab_size, ") and is not ignore_index ", options_.ignore_index));
    }
  }
  return absl::OkStatus();
}

absl::Status VocabParallelCrossEntropy::Forward(const CrossEntropyForward& a) {
  STRATA_RETURN_IF_ERROR(CheckLogits(a.logits, "logits"));
  const int64_t n = a.logits.rows;
  STRATA_RETURN_IF_ERROR(CheckTargets(a.target, n));
  if (n > 0 && (a.loss == nullptr || a.log_sum_exp == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(kLayer, ": loss and log_sum_exp are required"));
  }
  absl::StatusOr<Communicator*> comm = group_.Resolve();
  if (!comm.ok()) return internal::Annotate(comm.status(), kLayer);
  tp_internal::CommContext ctx{*comm, kernels_.get(), options_.timeout, kLayer};
  max_.assign(n, -std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < n; ++r) {
    const float* z = RowAsFloat(a.logits, r, row_);
    max_[r] = *std::max_element(z, z + local_);
  }
  {
    STRATA_ASSIGN_OR_RETURN(tp_internal::Pending p,
                            tp_internal::AllReduce(ctx, MatrixRef{max_.data(), n, 1},
                                                   ReduceOp::kMax, "forward: all-reduce of max"));
    STRATA_RETURN_IF_ERROR(p.Wait());
  }
  // Per token: sum of exp(z - max), the target's logit (0 where another
  // rank owns it), the sum of logits.
  sums_.assign(3 * n, 0.0f);
  for (int64_t r = 0; r < n; ++r) {
    const float* z = RowAsFloat(a.logits, r, row_);
    float sum_exp = 0.0f, sum = 0.0f;
    for (int64_t j = 0; j < local_; ++j) {
      sum_exp += std::exp(z[j] - max_[r]);
      sum += z[j];
    }
    const int64_t t = a.target[r] - start_;
    sums_[3 * r] = sum_exp;
    sums_[3 * r + 1] = t >= 0 && t < local_ ? z[t] : 0.0f;
    sums_[3 * r + 2] = sum;
  }
  {
    STRATA_ASSIGN_OR_RETURN(tp_internal::Pending p,
                            tp_internal::AllReduceSum(ctx, MatrixRef{sums_.data(), n, 3},
                                                      "forward: all-reduce of sums"));
    STRATA_RETURN_IF_ERROR(p.Wait());
  }
  const double e = options_.label_smoothing;
  for (int64_t r = 0; r < n; ++r) {
    const float lse = max_[r] + std::log(sums_[3 * r]);
    a.log_sum_exp[r] = lse;
    if (a.target[r] == options_.ignore_index) {
      a.loss[r] = 0.0f;
      continue;
    }
    const double mean = sums_[3 * r + 2] / static_cast<double>(options_.vocab_size);
    a.loss[r] = static_cast<float>(lse - (1.0 - e) * sums_[3 * r + 1] - e * mean);
  }
  return absl::OkStatus();
}

absl::Status VocabParallelCrossEntropy::Backward(const CrossEntropyBackward& a) const {
  STRATA_RETURN_IF_ERROR(CheckLogits(a.logits, "logits"));
  STRATA_RETURN_IF_ERROR(CheckLogits(a.grad_logits, "grad_logits"));
  const int64_t n = a.logits.rows;
  if (a.grad_logits.rows != n) {
    return absl::InvalidArgumentError(
        absl::StrCat(kLayer, ": grad_logits has ", a.grad_logits.rows, " rows, logits ", n));
  }
  STRATA_RETURN_IF_ERROR(CheckTargets(a.target, n));
  if (n > 0 && (a.log_sum_exp == nullptr || a.grad_loss == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kLayer, ": log_sum_exp and grad_loss are required"));
  }
  const float e = static_cast<float>(options_.label_smoothing);
  const float uniform = e / static_cast<float>(options_.vocab_size);
  std::vector<float> in, out(local_);
  const size_t es = DataTypeSize(options_.dtype);
  for (int64_t r = 0; r < n; ++r) {
    const bool ignored = a.target[r] == options_.ignore_index;
    const float g = ignored ? 0.0f : a.grad_loss[r];
    const float* z = RowAsFloat(a.logits, r, in);
    for (int64_t j = 0; j < local_; ++j) {
      out[j] = g * (std::exp(z[j] - a.log_sum_exp[r]) - uniform);
    }
    const int64_t t = a.target[r] - start_;
    if (!ignored && t >= 0 && t < local_) out[t] -= g * (1.0f - e);
    tp_internal::FromFloat(out.data(), static_cast<uint8_t*>(a.grad_logits.data) + r * local_ * es,
                           options_.dtype, local_);
  }
  return absl::OkStatus();
}

}  // namespace strata
