// strata::torch: the tensor-parallel layers as torch::nn modules for C++
// trainers that use LibTorch. Link the CMake target strata::torch (built
// when LibTorch is found; it compiles as C++20, as LibTorch requires):
//
//   find_package(strata REQUIRED COMPONENTS torch)
//   target_link_libraries(trainer PRIVATE strata::torch)
//
// The modules hold their parameters as torch tensors and run the strata
// kernels (strata/parallel/tensor_parallel/) on them through autograd
// functions, zero-copy; the communication goes through the group handle
// given at construction (strata/parallel/group_handle.h), resolved at each
// forward and backward:
//
//   strata::GroupHandle tp = world->Handle("tp").value();
//   strata::nn::ParallelMLP mlp(strata::nn::ParallelMLPOptions{512, 2048}, tp);
//   torch::optim::SGD opt(mlp->parameters(), 0.1);
//   torch::Tensor y = mlp->forward(x);       // x: [tokens, 512], replicated over tp
//   y.pow(2).mean().backward();
//   opt.step();
//
// Initialisation: with the same InitOptions::seed, every rank draws the
// whole (unsharded) weight as torch.nn.Linear / torch.nn.Embedding would
// from a CPU generator seeded with it, and keeps its shard; so a model
// built with tp = N starts exactly as the same model built with tp = 1.
//
// Errors: as torch's own modules do, these throw c10::Error (the message of
// the strata Status: invalid options, wrong shapes, a failed collective).
//
// World rebuilds: a module's parameters are shards for this rank's rank and
// the group's size, so its handle is pinned at construction. A rebuild that
// keeps them (other data-parallel replicas left) is followed: the next
// forward uses the new generation's group. One that changes them makes
// forward/backward throw the handle's error, naming both generations and
// layouts: build the model again and load its checkpoint. A communicator
// without a World: GroupHandle::Fixed(&comm), which must outlive the module.
//
// Lifetime: the autograd graph refers to the module's kernel, so a module
// must outlive the backward pass of the outputs it produced.
//
// Thread-safety: a module is not thread-safe (as torch::nn modules).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "strata/comm/communicator.h"
#include "strata/parallel/group_handle.h"
#include "strata/parallel/tensor_parallel/embedding.h"
#include "strata/parallel/tensor_parallel/linear.h"

namespace strata::nn {

// How parameters are created.
struct InitOptions {
  // Seed of the CPU generator the unsharded weights are drawn from.
  uint64_t seed = 0;
};

// Where a parameter of a tensor-parallel module sits in the unsharded
// parameter: this rank holds the box of the parameter's own shape starting
// at global_offset in a tensor of global_shape.
struct ParameterShard {
  std::vector<int64_t> global_shape;
  std::vector<int64_t> global_offset;
};

// Implemented by the modules below, whose parameters are shards of larger
// tensors; the checkpoint adapter (strata/torch/checkpoint.h) asks it so a
// checkpoint holds the global tensors and loads under another tp size.
class STRATA_EXPORT ShardedParameters {
 public:
  virtual ~ShardedParameters() = default;
  // By the parameter's name in this module (not its children); a parameter
  // absent from the map is the same on every rank of the group.
  virtual const std::map<std::string, ParameterShard>& parameter_shards() const = 0;
};

// ColumnParallelLinear (see linear.h): weight [out/tp, in], bias [out/tp].
// forward() takes [..., in] ([..., in] with the leading dimension split by
// tp under sequence parallelism) and returns [..., out/tp], or [..., out]
// with gather_output. Under skip_bias_add the bias is not added; the caller
// adds `bias` itself (autograd then computes its gradient).
class STRATA_EXPORT ColumnParallelLinearImpl : public ::torch::nn::Module,
                                               public ShardedParameters {
 public:
  ColumnParallelLinearImpl(const LinearOptions& options, const GroupHandle& group,
                           const InitOptions& init = {});
  ::torch::Tensor forward(const ::torch::Tensor& input);

  ::torch::Tensor weight;
  ::torch::Tensor bias;  // undefined without a bias

  const std::map<std::string, ParameterShard>& parameter_shards() const override { return shards_; }

 private:
  std::shared_ptr<ColumnParallelLinear> kernel_;
  std::map<std::string, ParameterShard> shards_;
};
TORCH_MODULE(ColumnParallelLinear);

// RowParallelLinear (see linear.h): weight [out, in/tp], bias [out].
class STRATA_EXPORT RowParallelLinearImpl : public ::torch::nn::Module, public ShardedParameters {
 public:
  RowParallelLinearImpl(const LinearOptions& options, const GroupHandle& group,
                        const InitOptions& init = {});
  ::torch::Tensor forward(const ::torch::Tensor& input);

  ::torch::Tensor weight;
  ::torch::Tensor bias;

  const std::map<std::string, ParameterShard>& parameter_shards() const override { return shards_; }

 private:
  std::shared_ptr<RowParallelLinear> kernel_;
  std::map<std::string, ParameterShard> shards_;
};
TORCH_MODULE(RowParallelLinear);

struct ParallelMLPOptions {
  int64_t hidden = 0;
  int64_t ffn_hidden = 0;  // divisible by the group size
  DataType dtype = DataType::kFloat32;
  bool sequence_parallel = false;
};

// fc2(gelu(fc1(x))): a column-parallel fc1 (hidden -> ffn_hidden) feeding a
// row-parallel fc2 (ffn_hidden -> hidden, input_is_parallel), so the only
// communication is fc2's all-reduce forward and fc1's all-reduce backward
// (all-gather / reduce-scatter under sequence parallelism).
class STRATA_EXPORT ParallelMLPImpl : public ::torch::nn::Module {
 public:
  ParallelMLPImpl(const ParallelMLPOptions& options, const GroupHandle& group,
                  const InitOptions& init = {});
  ::torch::Tensor forward(const ::torch::Tensor& input);

  ColumnParallelLinear fc1{nullptr};
  RowParallelLinear fc2{nullptr};
};
TORCH_MODULE(ParallelMLP);

// VocabParallelEmbedding (see embedding.h): weight [num_embeddings / tp,
// dim], this rank's vocabulary rows. forward() takes int64 ids [...] and
// returns [..., dim] (leading dimension divided by tp under sequence
// parallelism). Host tensors only.
class STRATA_EXPORT VocabParallelEmbeddingImpl : public ::torch::nn::Module,
                                                 public ShardedParameters {
 public:
  VocabParallelEmbeddingImpl(const EmbeddingOptions& options, const GroupHandle& group,
                             const InitOptions& init = {});
  ::torch::Tensor forward(const ::torch::Tensor& ids);

  ::torch::Tensor weight;

  const std::map<std::string, ParameterShard>& parameter_shards() const override { return shards_; }

 private:
  std::shared_ptr<VocabParallelEmbedding> kernel_;
  std::map<std::string, ParameterShard> shards_;
};
TORCH_MODULE(VocabParallelEmbedding);

// Vocab-parallel cross-entropy as a module without parameters: forward
// takes logits [..., vocab / tp] and int64 targets [...] and returns the
// per-token loss [...] in fp32 (reduction "none", as the kernel).
class STRATA_EXPORT VocabParallelCrossEntropyLossImpl : public ::torch::nn::Module {
 public:
  VocabParallelCrossEntropyLossImpl(const CrossEntropyOptions& options, const GroupHandle& group);
  ::torch::Tensor forward(const ::torch::Tensor& logits, const ::torch::Tensor& target);

 private:
  std::shared_ptr<VocabParallelCrossEntropy> kernel_;
};
TORCH_MODULE(VocabParallelCrossEntropyLoss);

}  // namespace strata::nn
