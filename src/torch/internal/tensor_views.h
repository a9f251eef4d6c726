// Views of torch tensors for the strata kernels, and the glue every module
// of the adapter shares. Private to strata::torch.
#pragma once

#include <torch/torch.h>

#include <string>

#include "absl/status/status.h"
#include "strata/base/dtype.h"
#include "strata/comm/communicator.h"
#include "strata/parallel/tensor_parallel/matrix.h"

namespace strata::nn::internal {

// The strata dtype of a floating tensor; throws for other dtypes.
DataType KernelDataType(const ::torch::Tensor& t);
::torch::ScalarType TorchType(DataType t);
// A contiguous tensor as [numel / size(-1), size(-1)].
ConstMatrixRef ConstView(const ::torch::Tensor& t);
MatrixRef View(const ::torch::Tensor& t);
// Throws c10::Error with the status message when it is not OK.
void Check(const absl::Status& status);
// The current CUDA stream for a CUDA tensor (null for host tensors).
void* StreamOf(const ::torch::Tensor& t);
MemoryKind MemoryOf(const ::torch::Device& d);
::torch::Device DeviceOf(MemoryKind memory);
// A CPU generator seeded with `seed`, as torch.Generator().manual_seed(seed).
::at::Generator SeededGenerator(uint64_t seed);
// `full` with leading-dimension count scaled from `from_rows` to `to_rows`
// rows and the last dimension set to `cols`.
std::vector<int64_t> OutputSizes(const ::torch::Tensor& input, int64_t from_rows, int64_t to_rows,
                                 int64_t cols);

}  // namespace strata::nn::internal
