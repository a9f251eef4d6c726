// Views of the 2-D tensors the tensor-parallel kernels read and write.
//
// The kernels see every activation as a row-major matrix [rows, features],
// rows being the flattened leading dimensions in sequence-first order
// ([sequence, batch, hidden] -> [sequence * batch, hidden]), so splitting
// the rows into equal contiguous blocks splits the sequence, as sequence
// parallelism does. Views do not own memory; the memory is host or CUDA
// device memory as the layer's options say.
//
//   std::vector<float> x(rows * in);
//   strata::ConstMatrixRef input = strata::ConstMatrixRef::Of(x.data(), rows, in);
//   uint16_t* bf16_data = ...;
//   strata::MatrixRef out{bf16_data, rows, out_features, strata::DataType::kBFloat16};
//
// Thread-safety: plain values.
#pragma once

#include <cstdint>
#include <string>

#include "strata/base/dtype.h"
#include "strata/base/export.h"

namespace strata {

// A writable row-major matrix: rows x cols elements of dtype, contiguous.
struct STRATA_EXPORT MatrixRef {
  void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  DataType dtype = DataType::kFloat32;

  static MatrixRef Of(float* data, int64_t rows, int64_t cols) {
    return MatrixRef{data, rows, cols, DataType::kFloat32};
  }
  int64_t numel() const { return rows * cols; }
};

// A read-only row-major matrix; every MatrixRef converts to one.
struct STRATA_EXPORT ConstMatrixRef {
  const void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  DataType dtype = DataType::kFloat32;

  ConstMatrixRef() = default;
  ConstMatrixRef(const void* d, int64_t r, int64_t c, DataType t)
      : data(d), rows(r), cols(c), dtype(t) {}
  ConstMatrixRef(const MatrixRef& m)  // NOLINT(google-explicit-constructor)
      : data(m.data), rows(m.rows), cols(m.cols), dtype(m.dtype) {}

  static ConstMatrixRef Of(const float* data, int64_t rows, int64_t cols) {
    return ConstMatrixRef(data, rows, cols, DataType::kFloat32);
  }
  int64_t numel() const { return rows * cols; }
};

// "[rows, cols] bf16", for messages.
STRATA_EXPORT std::string DescribeShape(int64_t rows, int64_t cols, DataType dtype);

}  // namespace strata
