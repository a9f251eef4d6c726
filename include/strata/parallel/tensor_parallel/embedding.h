// Vocab-parallel embedding and cross-entropy: the vocabulary is split into
// contiguous ranges across the tp group (rank r owns ids [r * V/tp,
// (r + 1) * V/tp)), so neither the embedding table nor the logits are ever
// whole on one rank.
//
// VocabParallelEmbedding: each rank looks up the ids it owns and writes
// zero rows for the others; the rows are then summed over the group
// (all-reduce), or summed and split by tokens (reduce-scatter) under
// sequence parallelism. Backward adds each token's gradient row into the
// fp32 main gradient of the owning rank (after an all-gather of the
// gradient under sequence parallelism); no other communication.
//
// VocabParallelCrossEntropy: the per-token loss over logits split by
// vocabulary. The row maximum is all-reduced (max), then the sum of
// exponentials, the target's logit and the sum of logits in one all-reduce
// (sum) of three floats per token; backward is local. Semantics are
// torch.nn.functional.cross_entropy's with reduction "none":
//   loss = lse - (1 - e) * z[target] - e * mean_j z[j],   lse = log sum_j exp z[j]
// with e the label smoothing; tokens whose target is ignore_index get loss
// and gradient 0.
//
//   strata::EmbeddingOptions e;
//   e.num_embeddings = 50304; e.embedding_dim = 1024;
//   strata::GroupHandle tp = world->Handle("tp").value();
//   auto emb = strata::VocabParallelEmbedding::Create(e, tp);           // StatusOr
//   (*emb)->Forward({ids, n, weight, output});
//   strata::CrossEntropyOptions c;
//   c.vocab_size = 50304; c.label_smoothing = 0.1;
//   auto xent = strata::VocabParallelCrossEntropy::Create(c, tp);
//   (*xent)->Forward({logits, targets, loss, lse});
//   (*xent)->Backward({logits, targets, lse, grad_loss, grad_logits});
//
// Host memory only: MemoryKind::kCuda is Unimplemented (the PyTorch
// modules compute these layers with torch ops on GPUs). Errors: sizes not
// divisible by the group, ids or targets outside the vocabulary, wrong
// views, label smoothing outside [0, 1) are InvalidArgument naming the
// values; collective failures come back with the layer and step prepended.
//
// The group is a handle, pinned at Create and resolved at each call, as
// the linear layers' (linear.h): a World rebuild that keeps this rank's
// rank and the group's size is followed, one that changes them fails the
// call with FailedPrecondition naming both generations. Without a World:
// GroupHandle::Fixed(&comm), and the communicator must outlive the object.
//
// Thread-safety: an object is not thread-safe (scratch buffers).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "strata/base/export.h"
#include "strata/comm/communicator.h"
#include "strata/parallel/group_handle.h"
#include "strata/parallel/tensor_parallel/matrix.h"

namespace strata {

namespace tp_internal {
class Kernels;
}

struct STRATA_EXPORT EmbeddingOptions {
  // The global vocabulary size, divisible by the group size.
  int64_t num_embeddings = 0;
  int64_t embedding_dim = 0;
  // dtype of the table and the output: fp32, fp16 or bf16.
  DataType dtype = DataType::kFloat32;
  // Reduce-scatter the output by tokens instead of all-reducing it; the
  // number of tokens must then be divisible by the group size.
  bool sequence_parallel = false;
  MemoryKind memory = MemoryKind::kHost;
  absl::Duration timeout = absl::Minutes(5);
};

struct STRATA_EXPORT EmbeddingForward {
  // Token ids in [0, num_embeddings), sequence-first order, the same on
  // every rank of the group.
  const int64_t* ids = nullptr;
  int64_t num_ids = 0;
  // This rank's rows of the table: [num_embeddings / tp, embedding_dim].
  ConstMatrixRef weight;
  // [num_ids, dim], or [num_ids / tp, dim] under sequence parallelism.
  MatrixRef output;
};

struct STRATA_EXPORT EmbeddingBackward {
  const int64_t* ids = nullptr;
  int64_t num_ids = 0;
  // Shaped like the forward output.
  ConstMatrixRef grad_output;
  // fp32 [num_embeddings / tp, dim]: += the gradient of this rank's rows.
  float* weight_main_grad = nullptr;
};

class STRATA_EXPORT VocabParallelEmbedding {
 public:
  static absl::StatusOr<std::unique_ptr<VocabParallelEmbedding>> Create(
      const EmbeddingOptions& options, const GroupHandle& group);
  ~VocabParallelEmbedding();

  absl::Status Forward(const EmbeddingForward& args);
  absl::Status Backward(const EmbeddingBackward& args);

  const EmbeddingOptions& options() const { return options_; }
  // This rank's id range [vocab_start, vocab_end).
  int64_t vocab_start() const { return start_; }
  int64_t vocab_end() const { return start_ + local_; }

 private:
  VocabParallelEmbedding(const EmbeddingOptions& options, GroupHandle group,
                         const Communicator& comm);
  absl::Status CheckIds(const int64_t* ids, int64_t n) const;
  absl::Status CheckRows(int64_t num_ids, int64_t* out_rows) const;

  const EmbeddingOptions options_;
  const GroupHandle group_;  // pinned at Create, resolved at each call
  const int size_;
  const int64_t local_;
  const int64_t start_;
  std::unique_ptr<tp_internal::Kernels> kernels_;
  std::vector<uint8_t> scratch_;
  std::vector<float> row_;
};

struct STRATA_EXPORT CrossEntropyOptions {
  // The global vocabulary size, divisible by the group size.
  int64_t vocab_size = 0;
  // dtype of the logits and their gradient: fp32, fp16 or bf16. The loss is
  // computed in fp32.
  DataType dtype = DataType::kFloat32;
  // Tokens with this target contribute no loss and no gradient.
  int64_t ignore_index = -100;
  // In [0, 1): the target's probability mass moved uniformly to every class.
  double label_smoothing = 0.0;
  MemoryKind memory = MemoryKind::kHost;
  absl::Duration timeout = absl::Minutes(5);
};

struct STRATA_EXPORT CrossEntropyForward {
  // [tokens, vocab_size / tp]: this rank's vocabulary columns.
  ConstMatrixRef logits;
  // [tokens] targets in [0, vocab_size) or ignore_index, the same on every rank.
  const int64_t* target = nullptr;
  // Outputs, [tokens] fp32 each: the loss, and the log-sum-exp that
  // Backward needs.
  float* loss = nullptr;
  float* log_sum_exp = nullptr;
};

struct STRATA_EXPORT CrossEntropyBackward {
  ConstMatrixRef logits;
  const int64_t* target = nullptr;
  const float* log_sum_exp = nullptr;
  // [tokens] fp32: d(objective)/d(loss).
  const float* grad_loss = nullptr;
  // Shaped like logits: overwritten with the gradient.
  MatrixRef grad_logits;
};

class STRATA_EXPORT VocabParallelCrossEntropy {
 public:
  static absl::StatusOr<std::unique_ptr<VocabParallelCrossEntropy>> Create(
      const CrossEntropyOptions& options, const GroupHandle& group);
  ~VocabParallelCrossEntropy();

  absl::Status Forward(const CrossEntropyForward& args);
  absl::Status Backward(const CrossEntropyBackward& args) const;

  const CrossEntropyOptions& options() const { return options_; }
  int64_t vocab_start() const { return start_; }
  int64_t vocab_end() const { return start_ + local_; }

 private:
  VocabParallelCrossEntropy(const CrossEntropyOptions& options, GroupHandle group,
                            const Communicator& comm);
  absl::Status CheckLogits(const ConstMatrixRef& logits, const char* which) const;
  absl::Status CheckTargets(const int64_t* target, int64_t n) const;

  const CrossEntropyOptions options_;
  const GroupHandle group_;  // pinned at Create, resolved at each call
  const int size_;
  const int64_t local_;
  const int64_t start_;
  std::unique_ptr<tp_internal::Kernels> kernels_;
  std::vector<float> max_, sums_, row_;
};

}  // namespace strata
