// The vocab-parallel modules of strata::torch: embedding and cross-entropy.
#include <cmath>

#include "internal/tensor_views.h"
#include "strata/torch/tensor_parallel.h"

namespace strata::nn {
namespace {

using ::torch::Tensor;
using ::torch::autograd::AutogradContext;
using ::torch::autograd::variable_list;

void CheckIds(const Tensor& ids, const char* what) {
  TORCH_CHECK(ids.scalar_type() == ::torch::kInt64 && ids.device().is_cpu(), "strata::nn: ", what,
              " must be an int64 CPU tensor, got ", ids.scalar_type(), " on ", ids.device());
}

struct EmbeddingFunction : public ::torch::autograd::Function<EmbeddingFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& ids, const Tensor& weight,
                        int64_t kernel_handle) {
    auto* kernel = reinterpret_cast<strata::VocabParallelEmbedding*>(kernel_handle);
    Tensor i = ids.contiguous();
    const EmbeddingOptions& o = kernel->options();
    std::vector<int64_t> sizes(i.sizes().begin(), i.sizes().end());
    if (sizes.empty()) sizes.push_back(1);
    const int64_t n = i.numel();
    // Under sequence parallelism the leading (sequence) dimension of the
    // output is split across the group.
    const int64_t tp = o.num_embeddings / (kernel->vocab_end() - kernel->vocab_start());
    std::vector<int64_t> out_sizes = sizes;
    if (o.sequence_parallel) {
      TORCH_CHECK(sizes[0] % tp == 0, "strata::nn: sequence length ", sizes[0],
                  " is not divisible by the tensor-parallel size ", tp);
      out_sizes[0] /= tp;
    }
    out_sizes.push_back(o.embedding_dim);
    Tensor out = ::torch::empty(out_sizes, weight.options());
    MatrixRef ov = internal::View(out);
    internal::Check(kernel->Forward({i.data_ptr<int64_t>(), n, internal::ConstView(weight), ov}));
    ctx->save_for_backward({i});
    ctx->saved_data["kernel"] = kernel_handle;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* kernel =
        reinterpret_cast<strata::VocabParallelEmbedding*>(ctx->saved_data["kernel"].toInt());
    const Tensor ids = ctx->get_saved_variables()[0];
    Tensor dy = grads[0].contiguous();
    const EmbeddingOptions& o = kernel->options();
    Tensor dw = ::torch::zeros({kernel->vocab_end() - kernel->vocab_start(), o.embedding_dim},
                               dy.options().dtype(::torch::kFloat32));
    internal::Check(kernel->Backward(
        {ids.data_ptr<int64_t>(), ids.numel(), internal::ConstView(dy), dw.data_ptr<float>()}));
    return {Tensor(), dw.to(dy.scalar_type()), Tensor()};
  }
};

struct CrossEntropyFunction : public ::torch::autograd::Function<CrossEntropyFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& logits, const Tensor& target,
                        int64_t kernel_handle) {
    auto* kernel = reinterpret_cast<strata::VocabParallelCrossEntropy*>(kernel_handle);
    CheckIds(target, "target");
    Tensor z = logits.contiguous(), t = target.contiguous();
    ConstMatrixRef zv = internal::ConstView(z);
    TORCH_CHECK(t.numel() == zv.rows, "strata::nn: ", t.numel(), " targets for ", zv.rows,
                " rows of logits");
    Tensor loss = ::torch::empty(t.sizes(), z.options().dtype(::torch::kFloat32));
    Tensor lse = ::torch::empty({zv.rows}, z.options().dtype(::torch::kFloat32));
    internal::Check(kernel->Forward(
        {zv, t.data_ptr<int64_t>(), loss.data_ptr<float>(), lse.data_ptr<float>()}));
    ctx->save_for_backward({z, t, lse});
    ctx->saved_data["kernel"] = kernel_handle;
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* kernel =
        reinterpret_cast<strata::VocabParallelCrossEntropy*>(ctx->saved_data["kernel"].toInt());
    const variable_list saved = ctx->get_saved_variables();
    const Tensor& z = saved[0];
    Tensor g = grads[0].to(::torch::kFloat32).contiguous();
    Tensor dz = ::torch::empty_like(z);
    internal::Check(
        kernel->Backward({internal::ConstView(z), saved[1].data_ptr<int64_t>(),
                          saved[2].data_ptr<float>(), g.data_ptr<float>(), internal::View(dz)}));
    return {dz, Tensor(), Tensor()};
  }
};

}  // namespace

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(const EmbeddingOptions& options,
                                                       const GroupHandle& group,
                                                       const InitOptions& init) {
  auto made = strata::VocabParallelEmbedding::Create(options, group);
  internal::Check(made.status());
  kernel_ = std::move(made).value();
  // torch.nn.Embedding draws N(0, 1) for the whole table.
  ::at::Generator gen = internal::SeededGenerator(init.seed);
  Tensor full = ::torch::empty({options.num_embeddings, options.embedding_dim}).normal_(0, 1, gen);
  Tensor mine =
      full.narrow(0, kernel_->vocab_start(), kernel_->vocab_end() - kernel_->vocab_start());
  weight = register_parameter("weight", mine.to(internal::TorchType(options.dtype)).contiguous());
  shards_["weight"] = {{options.num_embeddings, options.embedding_dim},
                       {kernel_->vocab_start(), 0}};
}

Tensor VocabParallelEmbeddingImpl::forward(const Tensor& ids) {
  CheckIds(ids, "ids");
  return EmbeddingFunction::apply(ids, weight, reinterpret_cast<int64_t>(kernel_.get()));
}

VocabParallelCrossEntropyLossImpl::VocabParallelCrossEntropyLossImpl(
    const CrossEntropyOptions& options, const GroupHandle& group) {
  auto made = strata::VocabParallelCrossEntropy::Create(options, group);
  internal::Check(made.status());
  kernel_ = std::move(made).value();
}

Tensor VocabParallelCrossEntropyLossImpl::forward(const Tensor& logits, const Tensor& target) {
  return CrossEntropyFunction::apply(logits, target, reinterpret_cast<int64_t>(kernel_.get()));
}

}  // namespace strata::nn
