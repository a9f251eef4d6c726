// Helpers of the tensor-parallel kernel tests: ranks as threads over a
// FakeGroup, host matrices of any kernel dtype, a plain reference GEMM in
// double, slicing, and the relative error the tests bound.
//
//   RunRanks(4, group, [&](int rank, Communicator& comm) { ... });
//   HostMatrix x = HostMatrix::Random(rows, cols, DataType::kBFloat16, seed);
//   Dense y = MatmulNT(x.ToDense(), w.ToDense());   // x . w^T in double
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "fake_communicator.h"
#include "parallel/tensor_parallel/internal/convert.h"
#include "strata/parallel/tensor_parallel/matrix.h"

namespace strata::testing {

// A row-major matrix of doubles, for references.
struct Dense {
  int64_t rows = 0, cols = 0;
  std::vector<double> v;
  Dense() = default;
  Dense(int64_t r, int64_t c) : rows(r), cols(c), v(r * c, 0.0) {}
  double& at(int64_t r, int64_t c) { return v[r * cols + c]; }
  double at(int64_t r, int64_t c) const { return v[r * cols + c]; }

  Dense Rows(int64_t begin, int64_t n) const {
    Dense out(n, cols);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < cols; ++c) out.at(r, c) = at(begin + r, c);
    return out;
  }
  Dense Cols(int64_t begin, int64_t n) const {
    Dense out(rows, n);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < n; ++c) out.at(r, c) = at(r, begin + c);
    return out;
  }
  Dense Transposed() const {
    Dense out(cols, rows);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) out.at(c, r) = at(r, c);
    return out;
  }
};

// a [m, k] . b[n, k]^T
inline Dense MatmulNT(const Dense& a, const Dense& b) {
  Dense out(a.rows, b.rows);
  for (int64_t i = 0; i < a.rows; ++i)
    for (int64_t j = 0; j < b.rows; ++j) {
      double s = 0;
      for (int64_t k = 0; k < a.cols; ++k) s += a.at(i, k) * b.at(j, k);
      out.at(i, j) = s;
    }
  return out;
}

// A host matrix in a kernel dtype (fp32, fp16, bf16).
struct HostMatrix {
  int64_t rows = 0, cols = 0;
  DataType dtype = DataType::kFloat32;
  std::vector<uint8_t> bytes;

  HostMatrix() = default;
  HostMatrix(int64_t r, int64_t c, DataType t)
      : rows(r), cols(c), dtype(t), bytes(r * c * DataTypeSize(t), 0) {}

  static HostMatrix FromDense(const Dense& d, DataType t) {
    HostMatrix m(d.rows, d.cols, t);
    std::vector<float> f(d.v.begin(), d.v.end());
    tp_internal::FromFloat(f.data(), m.bytes.data(), t, f.size());
    return m;
  }
  // Uniform in [-1, 1), rounded to the dtype.
  static HostMatrix Random(int64_t r, int64_t c, DataType t, uint32_t seed) {
    std::mt19937 gen(seed);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    Dense d(r, c);
    for (double& x : d.v) x = u(gen);
    return FromDense(d, t);
  }
  Dense ToDense() const {
    std::vector<float> f(rows * cols);
    tp_internal::ToFloat(bytes.data(), dtype, f.data(), f.size());
    Dense d(rows, cols);
    for (size_t i = 0; i < f.size(); ++i) d.v[i] = f[i];
    return d;
  }
  MatrixRef ref() { return MatrixRef{bytes.data(), rows, cols, dtype}; }
  ConstMatrixRef cref() const { return ConstMatrixRef(bytes.data(), rows, cols, dtype); }
};

// max |a - b| / max |b| (0 when both are zero).
inline double RelErr(const Dense& a, const Dense& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < b.v.size(); ++i) {
    diff = std::max(diff, std::abs(a.v[i] - b.v[i]));
    scale = std::max(scale, std::abs(b.v[i]));
  }
  return scale == 0 ? diff : diff / scale;
}

inline Dense FromFloats(const std::vector<float>& f, int64_t rows, int64_t cols) {
  Dense d(rows, cols);
  for (size_t i = 0; i < f.size(); ++i) d.v[i] = f[i];
  return d;
}

// Runs fn(rank, comm) on `size` threads, one per rank of a new FakeGroup,
// and joins them.
inline void RunRanks(int size, const std::function<void(int, Communicator&)>& fn,
                     FakeOrdering ordering = FakeOrdering::kMatchPosted) {
  FakeGroup group(size, ordering, "tp");
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < size; ++r) comms.push_back(group.Comm(r));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) threads.emplace_back([&, r] { fn(r, *comms[r]); });
  for (auto& t : threads) t.join();
}

}  // namespace strata::testing
