// Host kernels: OpenBLAS sgemm on fp32; fp16/bf16 operands are widened to
// fp32 scratch copies, multiplied in fp32, and the result is narrowed once.
#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <vector>

#include "parallel/tensor_parallel/internal/convert.h"
#include "parallel/tensor_parallel/internal/kernels.h"
#include "strata/base/status.h"

namespace strata::tp_internal {
namespace {

blasint Int(int64_t v) {
  STRATA_CHECK(v >= 0 && v <= INT_MAX, "GEMM dimension ", v, " outside the BLAS int range");
  return static_cast<blasint>(v);
}

class CpuKernels : public Kernels {
 public:
  MemoryKind memory() const override { return MemoryKind::kHost; }
  void SetStream(void*) override {}

  absl::Status Forward(const ConstMatrixRef& x, const ConstMatrixRef& w, const void* bias,
                       const MatrixRef& out) override {
    STRATA_CHECK(x.cols == w.cols && out.rows == x.rows && out.cols == w.rows, "Forward shapes");
    const float* xf = Widen(x, kWideX);
    const float* wf = Widen(w, kWideW);
    float* of = out.dtype == DataType::kFloat32 ? static_cast<float*>(out.data)
                                                : Buffer(kWideOut, out.numel());
    float beta = 0.0f;
    if (bias != nullptr) {
      // The bias is written first and the GEMM accumulates onto it (beta 1),
      // which saves a pass over the output.
      float* b = Buffer(kWideBias, out.cols);
      ToFloat(bias, out.dtype, b, out.cols);
      for (int64_t r = 0; r < out.rows; ++r) std::memcpy(of + r * out.cols, b, out.cols * 4);
      beta = 1.0f;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Int(x.rows), Int(w.rows), Int(x.cols),
                1.0f, xf, Int(x.cols), wf, Int(w.cols), beta, of, Int(out.cols));
    if (out.dtype != DataType::kFloat32) FromFloat(of, out.data, out.dtype, out.numel());
    return absl::OkStatus();
  }

  absl::Status GradInput(const ConstMatrixRef& dy, const ConstMatrixRef& w,
                         const MatrixRef& out) override {
    STRATA_CHECK(dy.cols == w.rows && out.rows == dy.rows && out.cols == w.cols, "GradInput");
    const float* dyf = Widen(dy, kWideX);
    const float* wf = Widen(w, kWideW);
    float* of = out.dtype == DataType::kFloat32 ? static_cast<float*>(out.data)
                                                : Buffer(kWideOut, out.numel());
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, Int(dy.rows), Int(w.cols), Int(dy.cols),
                1.0f, dyf, Int(dy.cols), wf, Int(w.cols), 0.0f, of, Int(out.cols));
    if (out.dtype != DataType::kFloat32) FromFloat(of, out.data, out.dtype, out.numel());
    return absl::OkStatus();
  }

  absl::Status GradWeight(const ConstMatrixRef& dy, const ConstMatrixRef& x, float* acc) override {
    STRATA_CHECK(dy.rows == x.rows, "GradWeight rows");
    const float* dyf = Widen(dy, kWideX);
    const float* xf = Widen(x, kWideW);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, Int(dy.cols), Int(x.cols), Int(dy.rows),
                1.0f, dyf, Int(dy.cols), xf, Int(x.cols), 1.0f, acc, Int(x.cols));
    return absl::OkStatus();
  }

  absl::Status ColumnSums(const ConstMatrixRef& dy, float* acc) override {
    const int64_t n = dy.cols;
    if (dy.dtype == DataType::kFloat32) {
      // acc += dy^T 1: BLAS's vectorised GEMV reads dy once (6-8x faster
      // than the plain loop here, which the compiler leaves scalar).
      if (dy.rows == 0) return absl::OkStatus();
      cblas_sgemv(CblasRowMajor, CblasTrans, Int(dy.rows), Int(n), 1.0f,
                  static_cast<const float*>(dy.data), Int(n), Ones(dy.rows), 1, 1.0f, acc, 1);
      return absl::OkStatus();
    }
    float* row = Buffer(kWideBias, n);
    const auto* p = static_cast<const uint8_t*>(dy.data);
    for (int64_t r = 0; r < dy.rows; ++r) {
      ToFloat(p + r * n * 2, dy.dtype, row, n);
      for (int64_t c = 0; c < n; ++c) acc[c] += row[c];
    }
    return absl::OkStatus();
  }

  absl::Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                      size_t height) override {
    auto* d = static_cast<uint8_t*>(dst);
    const auto* s = static_cast<const uint8_t*>(src);
    for (size_t r = 0; r < height; ++r) std::memcpy(d + r * dst_pitch, s + r * src_pitch, width);
    return absl::OkStatus();
  }

  absl::StatusOr<void*> Scratch(int slot, size_t bytes) override {
    STRATA_CHECK(slot >= 0 && slot < kCallerSlots, "scratch slot ", slot);
    return static_cast<void*>(Buffer(slot, (bytes + 3) / 4));
  }

  absl::StatusOr<void*> BeginComm() override { return nullptr; }
  absl::Status EndComm() override { return absl::OkStatus(); }

 private:
  // Slots below kCallerSlots are the caller's; the rest widen operands.
  static constexpr int kCallerSlots = 16;
  enum : int { kWideX = kCallerSlots, kWideW, kWideOut, kWideBias, kOnes, kNumSlots };

  float* Buffer(int slot, int64_t floats) {
    std::vector<float>& b = buffers_[slot];
    if (b.size() < static_cast<size_t>(floats)) b.resize(floats);
    return b.data();
  }

  // `n` ones (kept between calls).
  const float* Ones(int64_t n) {
    std::vector<float>& b = buffers_[kOnes];
    if (b.size() < static_cast<size_t>(n)) b.assign(n, 1.0f);
    return b.data();
  }

  // The matrix as fp32: itself, or a widened copy in `slot`.
  const float* Widen(const ConstMatrixRef& m, int slot) {
    if (m.dtype == DataType::kFloat32) return static_cast<const float*>(m.data);
    float* f = Buffer(slot, m.numel());
    ToFloat(m.data, m.dtype, f, m.numel());
    return f;
  }

  std::vector<float> buffers_[kNumSlots];
};

}  // namespace

std::unique_ptr<Kernels> MakeCpuKernels() { return std::make_unique<CpuKernels>(); }

absl::StatusOr<std::unique_ptr<Kernels>> MakeKernels(MemoryKind memory) {
  if (memory == MemoryKind::kHost) return MakeCpuKernels();
  return MakeCudaKernels();
}

}  // namespace strata::tp_internal
