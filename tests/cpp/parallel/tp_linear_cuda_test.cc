// The CUDA path of the linear kernels (cuBLASLt, bias epilogue, fp32
// weight-gradient accumulation) against the host path, on a group of one
// rank. Skips when strata was built without CUDA or no device is visible.
#include <gtest/gtest.h>

#include "strata/parallel/tensor_parallel/linear.h"
#include "tp_test_util.h"

#if STRATA_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace strata {
namespace {

using testing::HostMatrix;

#if STRATA_HAVE_CUDA

bool HaveDevice() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  cudaGetLastError();
  return ok;
}

// A device copy of a host buffer, freed at scope exit.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) { EXPECT_EQ(cudaMalloc(&ptr, n), cudaSuccess); }
  DeviceBuffer(const void* host, size_t n) : DeviceBuffer(n) {
    EXPECT_EQ(cudaMemcpy(ptr, host, n, cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  void CopyTo(void* host) const {
    EXPECT_EQ(cudaMemcpy(host, ptr, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }
};

class LinearCudaTest : public ::testing::TestWithParam<std::tuple<bool, DataType>> {};

TEST_P(LinearCudaTest, MatchesHostKernels) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  const auto [column, dtype] = GetParam();
  const int64_t rows = 64, in = 96, out = 80;
  const double tol = dtype == DataType::kFloat32 ? 1e-4 : 2e-2;
  HostMatrix x = HostMatrix::Random(rows, in, dtype, 1), w = HostMatrix::Random(out, in, dtype, 2);
  HostMatrix b = HostMatrix::Random(1, out, dtype, 3), dy = HostMatrix::Random(rows, out, dtype, 4);
  testing::FakeGroup group(1, testing::FakeOrdering::kMatchPosted, "tp", MemoryKind::kCuda);
  auto comm = group.Comm(0);
  LinearOptions o;
  o.in_features = in;
  o.out_features = out;
  o.dtype = dtype;
  o.input_is_parallel = !column;
  // Host results.
  HostMatrix y_h(rows, out, dtype), dx_h(rows, in, dtype);
  std::vector<float> dw_h(out * in, 0.0f), db_h(out, 0.0f);
  {
    auto layer =
        column ? ColumnParallelLinear::Create(o, GroupHandle::Fixed(comm.get())).value() : nullptr;
    auto row =
        column ? nullptr : RowParallelLinear::Create(o, GroupHandle::Fixed(comm.get())).value();
    LinearForward f{x.cref(), w.cref(), b.bytes.data(), y_h.ref()};
    LinearBackward bw{dy.cref(), x.cref(), w.cref(), dx_h.ref(), dw_h.data(), db_h.data()};
    ASSERT_TRUE((column ? layer->Forward(f) : row->Forward(f)).ok());
    ASSERT_TRUE((column ? layer->Backward(bw) : row->Backward(bw)).ok());
  }
  // Device results.
  o.memory = MemoryKind::kCuda;
  DeviceBuffer xd(x.bytes.data(), x.bytes.size()), wd(w.bytes.data(), w.bytes.size()),
      bd(b.bytes.data(), b.bytes.size()), dyd(dy.bytes.data(), dy.bytes.size()),
      yd(y_h.bytes.size()), dxd(dx_h.bytes.size()), dwd(dw_h.size() * 4), dbd(db_h.size() * 4);
  cudaMemset(dwd.ptr, 0, dwd.bytes);
  cudaMemset(dbd.ptr, 0, dbd.bytes);
  {
    auto made_c =
        column ? ColumnParallelLinear::Create(o, GroupHandle::Fixed(comm.get())) : nullptr;
    auto made_r = column ? nullptr : RowParallelLinear::Create(o, GroupHandle::Fixed(comm.get()));
    LinearForward f{ConstMatrixRef(xd.ptr, rows, in, dtype), ConstMatrixRef(wd.ptr, out, in, dtype),
                    bd.ptr, MatrixRef{yd.ptr, rows, out, dtype}};
    LinearBackward bw{ConstMatrixRef(dyd.ptr, rows, out, dtype),
                      f.input,
                      f.weight,
                      MatrixRef{dxd.ptr, rows, in, dtype},
                      static_cast<float*>(dwd.ptr),
                      static_cast<float*>(dbd.ptr)};
    absl::Status s = column ? (*made_c)->Forward(f) : (*made_r)->Forward(f);
    ASSERT_TRUE(s.ok()) << s;
    s = column ? (*made_c)->Backward(bw) : (*made_r)->Backward(bw);
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  HostMatrix y_d(rows, out, dtype), dx_d(rows, in, dtype);
  std::vector<float> dw_d(dw_h.size()), db_d(db_h.size());
  yd.CopyTo(y_d.bytes.data());
  dxd.CopyTo(dx_d.bytes.data());
  dwd.CopyTo(dw_d.data());
  dbd.CopyTo(db_d.data());
  EXPECT_LE(testing::RelErr(y_d.ToDense(), y_h.ToDense()), tol);
  EXPECT_LE(testing::RelErr(dx_d.ToDense(), dx_h.ToDense()), tol);
  EXPECT_LE(testing::RelErr(testing::FromFloats(dw_d, out, in), testing::FromFloats(dw_h, out, in)),
            tol);
  EXPECT_LE(testing::RelErr(testing::FromFloats(db_d, 1, out), testing::FromFloats(db_h, 1, out)),
            tol);
}

INSTANTIATE_TEST_SUITE_P(
    All, LinearCudaTest,
    ::testing::Combine(::testing::Bool(), ::testing::Values(DataType::kFloat32, DataType::kBFloat16,
                                                            DataType::kFloat16)));

#else  // !STRATA_HAVE_CUDA

TEST(LinearCudaTest, MatchesHostKernels) { GTEST_SKIP() << "strata was built without CUDA"; }

#endif

}  // namespace
}  // namespace strata
