// The linear modules of strata::torch: autograd functions over the strata
// kernels, and the modules that own the parameters.
#include "strata/torch/tensor_parallel.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

#include "internal/tensor_views.h"

#if STRATA_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace strata::nn {

namespace internal {

DataType KernelDataType(const ::torch::Tensor& t) {
  switch (t.scalar_type()) {
    case ::torch::kFloat32:
      return DataType::kFloat32;
    case ::torch::kBFloat16:
      return DataType::kBFloat16;
    case ::torch::kFloat16:
      return DataType::kFloat16;
    default:
      TORCH_CHECK(false, "strata::nn: tensors must be float32, bfloat16 or float16, got ",
                  t.scalar_type());
  }
}

::torch::ScalarType TorchType(DataType t) {
  switch (t) {
    case DataType::kBFloat16:
      return ::torch::kBFloat16;
    case DataType::kFloat16:
      return ::torch::kFloat16;
    default:
      return ::torch::kFloat32;
  }
}

ConstMatrixRef ConstView(const ::torch::Tensor& t) {
  const int64_t cols = t.dim() == 0 ? 1 : t.size(-1);
  return ConstMatrixRef(t.data_ptr(), cols == 0 ? 0 : t.numel() / cols, cols, KernelDataType(t));
}

MatrixRef View(const ::torch::Tensor& t) {
  ConstMatrixRef c = ConstView(t);
  return MatrixRef{t.data_ptr(), c.rows, c.cols, c.dtype};
}

void Check(const absl::Status& status) { TORCH_CHECK(status.ok(), std::string(status.message())); }

void* StreamOf(const ::torch::Tensor& t) {
#if STRATA_TORCH_CUDA
  if (t.is_cuda()) return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
#endif
  return nullptr;
}

MemoryKind MemoryOf(const ::torch::Device& d) {
  return d.is_cuda() ? MemoryKind::kCuda : MemoryKind::kHost;
}

::torch::Device DeviceOf(MemoryKind memory) {
  return memory == MemoryKind::kCuda ? ::torch::Device(::torch::kCUDA)
                                     : ::torch::Device(::torch::kCPU);
}

::at::Generator SeededGenerator(uint64_t seed) {
  return ::at::make_generator<::at::CPUGeneratorImpl>(seed);
}

std::vector<int64_t> OutputSizes(const ::torch::Tensor& input, int64_t from_rows, int64_t to_rows,
                                 int64_t cols) {
  std::vector<int64_t> sizes(input.sizes().begin(), input.sizes().end());
  if (sizes.empty()) sizes.push_back(1);
  if (from_rows != to_rows) {
    TORCH_CHECK(sizes.size() >= 2 && from_rows > 0,
                "strata::nn: sequence parallelism needs an input with a leading (sequence) "
                "dimension, got shape ",
                input.sizes());
    sizes[0] = sizes[0] * to_rows / from_rows;
  }
  sizes.back() = cols;
  return sizes;
}

}  // namespace internal

namespace {

using ::torch::Tensor;
using ::torch::autograd::AutogradContext;
using ::torch::autograd::variable_list;

// Forward and backward of either linear kernel; Kernel is
// ColumnParallelLinear or RowParallelLinear. The kernel pointer travels in
// saved_data; the module that owns it must outlive the backward pass.
template <typename Kernel>
struct LinearFunction : public ::torch::autograd::Function<LinearFunction<Kernel>> {
  static Tensor forward(AutogradContext* ctx, const Tensor& input, const Tensor& weight,
                        const Tensor& bias, int64_t kernel_handle) {
    auto* kernel = reinterpret_cast<Kernel*>(kernel_handle);
    Tensor x = input.contiguous();
    ConstMatrixRef xv = internal::ConstView(x);
    absl::StatusOr<LinearShapes> s = kernel->Shapes(xv.rows);
    internal::Check(s.status());
    Tensor out = ::torch::empty(
        internal::OutputSizes(x, s->input_rows, s->output_rows, s->output_cols), x.options());
    const LinearOptions& o = kernel->options();
    const bool add_bias = o.bias && !o.skip_bias_add;
    LinearForward f{xv, internal::ConstView(weight), add_bias ? bias.data_ptr() : nullptr,
                    internal::View(out), internal::StreamOf(x)};
    internal::Check(kernel->Forward(f));
    ctx->save_for_backward({x, weight});
    ctx->saved_data["kernel"] = kernel_handle;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* kernel = reinterpret_cast<Kernel*>(ctx->saved_data["kernel"].toInt());
    const variable_list saved = ctx->get_saved_variables();
    const Tensor& x = saved[0];
    const Tensor& w = saved[1];
    Tensor dy = grads[0].contiguous();
    const LinearOptions& o = kernel->options();
    const bool bias_grad = o.bias && !o.skip_bias_add && ctx->needs_input_grad(2);
    Tensor dx = ctx->needs_input_grad(0) ? ::torch::empty_like(x) : Tensor();
    Tensor dw = ctx->needs_input_grad(1)
                    ? ::torch::zeros(w.sizes(), w.options().dtype(::torch::kFloat32))
                    : Tensor();
    Tensor db;
    if (bias_grad) {
      // The bias has the output features of this rank: out/tp (column) or out (row).
      absl::StatusOr<LinearShapes> s = kernel->Shapes(internal::ConstView(x).rows);
      internal::Check(s.status());
      db = ::torch::zeros({s->bias}, w.options().dtype(::torch::kFloat32));
    }
    LinearBackward b{internal::ConstView(dy),
                     internal::ConstView(x),
                     internal::ConstView(w),
                     dx.defined() ? internal::View(dx) : MatrixRef{},
                     dw.defined() ? dw.data_ptr<float>() : nullptr,
                     db.defined() ? db.data_ptr<float>() : nullptr,
                     internal::StreamOf(dy)};
    internal::Check(kernel->Backward(b));
    return {dx, dw.defined() ? dw.to(w.scalar_type()) : Tensor(),
            db.defined() ? db.to(w.scalar_type()) : Tensor(), Tensor()};
  }
};

// The unsharded weight [out, in] and bias [out] drawn as torch.nn.Linear
// draws them after torch.manual_seed(seed): U(-1/sqrt(in), 1/sqrt(in)),
// weight first.
std::pair<Tensor, Tensor> FullLinearInit(int64_t out, int64_t in, bool bias, uint64_t seed) {
  ::at::Generator gen = internal::SeededGenerator(seed);
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  Tensor w = ::torch::empty({out, in}).uniform_(-bound, bound, gen);
  Tensor b = bias ? ::torch::empty({out}).uniform_(-bound, bound, gen) : Tensor();
  return {w, b};
}

Tensor Place(const Tensor& t, const LinearOptions& o) {
  return t.to(internal::DeviceOf(o.memory), internal::TorchType(o.dtype)).contiguous();
}

// This rank's rank in `group` now (the kernel pinned it at its creation).
int RankIn(const GroupHandle& group) {
  absl::StatusOr<Communicator*> comm = group.Resolve();
  internal::Check(comm.status());
  return (*comm)->rank();
}

}  // namespace

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const LinearOptions& options,
                                                   const GroupHandle& group,
                                                   const InitOptions& init) {
  auto made = strata::ColumnParallelLinear::Create(options, group);
  internal::Check(made.status());
  kernel_ = std::move(made).value();
  const int64_t local = kernel_->local_out_features();
  auto [w, b] = FullLinearInit(options.out_features, options.in_features, options.bias, init.seed);
  const int64_t start = local * RankIn(group);
  weight = register_parameter("weight", Place(w.narrow(0, start, local), options));
  if (options.bias) bias = register_parameter("bias", Place(b.narrow(0, start, local), options));
  shards_["weight"] = {{options.out_features, options.in_features}, {start, 0}};
  if (options.bias) shards_["bias"] = {{options.out_features}, {start}};
}

Tensor ColumnParallelLinearImpl::forward(const Tensor& input) {
  return LinearFunction<strata::ColumnParallelLinear>::apply(
      input, weight, bias, reinterpret_cast<int64_t>(kernel_.get()));
}

RowParallelLinearImpl::RowParallelLinearImpl(const LinearOptions& options, const GroupHandle& group,
                                             const InitOptions& init) {
  auto made = strata::RowParallelLinear::Create(options, group);
  internal::Check(made.status());
  kernel_ = std::move(made).value();
  const int64_t local = kernel_->local_in_features();
  const int64_t start = local * RankIn(group);
  auto [w, b] = FullLinearInit(options.out_features, options.in_features, options.bias, init.seed);
  weight = register_parameter("weight", Place(w.narrow(1, start, local), options));
  if (options.bias) bias = register_parameter("bias", Place(b, options));
  // The bias is whole on every rank: not a shard.
  shards_["weight"] = {{options.out_features, options.in_features}, {0, start}};
}

Tensor RowParallelLinearImpl::forward(const Tensor& input) {
  return LinearFunction<strata::RowParallelLinear>::apply(input, weight, bias,
                                                          reinterpret_cast<int64_t>(kernel_.get()));
}

ParallelMLPImpl::ParallelMLPImpl(const ParallelMLPOptions& options, const GroupHandle& group,
                                 const InitOptions& init) {
  LinearOptions o1;
  o1.in_features = options.hidden;
  o1.out_features = options.ffn_hidden;
  o1.dtype = options.dtype;
  o1.sequence_parallel = options.sequence_parallel;
  LinearOptions o2 = o1;
  o2.in_features = options.ffn_hidden;
  o2.out_features = options.hidden;
  o2.input_is_parallel = true;
  fc1 = register_module("fc1", ColumnParallelLinear(o1, group, InitOptions{init.seed}));
  fc2 = register_module("fc2", RowParallelLinear(o2, group, InitOptions{init.seed + 1}));
}

Tensor ParallelMLPImpl::forward(const Tensor& input) {
  return fc2->forward(::torch::gelu(fc1->forward(input)));
}

}  // namespace strata::nn
