// Device kernels: cuBLASLt GEMMs (fp32, fp16 and bf16 operands, fp32
// compute; the bias added in the epilogue of the forward GEMM; the weight
// gradient accumulated into an fp32 buffer by the GEMM itself, beta = 1),
// a column-sum kernel for the bias gradient (cuda_reduce.cu), and a
// communication stream ordered against the compute stream with events.
//
// cuBLASLt is column-major; a row-major [r, c] matrix is the column-major
// [c, r] matrix, so each row-major product is computed as its transpose:
//   Forward     out^T = w   . x^T     (A = w, op T; B = x, op N)
//   GradInput   out^T = w^T . dy^T    (A = w, op N; B = dy, op N)
//   GradWeight  acc^T += x^T . dy     (A = x, op N; B = dy, op T)
#include "parallel/tensor_parallel/internal/kernels.h"

#if STRATA_HAVE_CUDA

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "parallel/tensor_parallel/internal/cuda_reduce.h"
#include "strata/base/status.h"

namespace strata::tp_internal {
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;

absl::Status CudaError(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

absl::Status LtError(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": cuBLASLt status ", static_cast<int>(s)));
}

cudaDataType_t CudaType(DataType t) {
  switch (t) {
    case DataType::kFloat16:
      return CUDA_R_16F;
    case DataType::kBFloat16:
      return CUDA_R_16BF;
    default:
      return CUDA_R_32F;
  }
}

// The descriptors of one GEMM, destroyed with it.
struct LtGemm {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtGemm() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// One column-major GEMM: D[m, n] = alpha op(A) op(B) + beta C, C == D.
struct GemmSpec {
  bool trans_a = false, trans_b = false;
  uint64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* d = nullptr;
  int64_t ldd = 0;
  DataType ab_type = DataType::kFloat32;
  DataType d_type = DataType::kFloat32;
  float beta = 0.0f;
  const void* bias = nullptr;  // length m, d_type
};

class CudaKernels : public Kernels {
 public:
  CudaKernels() = default;
  ~CudaKernels() override {
    if (comm_stream_) cudaStreamSynchronize(comm_stream_);
    if (compute_done_) cudaEventDestroy(compute_done_);
    if (comm_done_) cudaEventDestroy(comm_done_);
    if (comm_stream_) cudaStreamDestroy(comm_stream_);
    for (Slot& s : slots_) {
      if (s.ptr) cudaFree(s.ptr);
    }
    if (workspace_) cudaFree(workspace_);
    if (lt_) cublasLtDestroy(lt_);
  }

  absl::Status Init() {
    STRATA_RETURN_IF_ERROR(LtError(cublasLtCreate(&lt_), "cublasLtCreate"));
    STRATA_RETURN_IF_ERROR(CudaError(cudaMalloc(&workspace_, kWorkspaceBytes), "cudaMalloc"));
    STRATA_RETURN_IF_ERROR(CudaError(
        cudaEventCreateWithFlags(&compute_done_, cudaEventDisableTiming), "cudaEventCreate"));
    STRATA_RETURN_IF_ERROR(CudaError(cudaEventCreateWithFlags(&comm_done_, cudaEventDisableTiming),
                                     "cudaEventCreate"));
    return CudaError(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking),
                     "cudaStreamCreate");
  }

  MemoryKind memory() const override { return MemoryKind::kCuda; }
  void SetStream(void* stream) override { stream_ = static_cast<cudaStream_t>(stream); }

  absl::Status Forward(const ConstMatrixRef& x, const ConstMatrixRef& w, const void* bias,
                       const MatrixRef& out) override {
    GemmSpec g;
    g.trans_a = true;
    g.m = w.rows;
    g.n = x.rows;
    g.k = x.cols;
    g.a = w.data;
    g.lda = w.cols;
    g.b = x.data;
    g.ldb = x.cols;
    g.d = out.data;
    g.ldd = out.cols;
    g.ab_type = g.d_type = out.dtype;
    g.bias = bias;
    return Gemm(g);
  }

  absl::Status GradInput(const ConstMatrixRef& dy, const ConstMatrixRef& w,
                         const MatrixRef& out) override {
    GemmSpec g;
    g.m = w.cols;
    g.n = dy.rows;
    g.k = dy.cols;
    g.a = w.data;
    g.lda = w.cols;
    g.b = dy.data;
    g.ldb = dy.cols;
    g.d = out.data;
    g.ldd = out.cols;
    g.ab_type = g.d_type = out.dtype;
    return Gemm(g);
  }

  absl::Status GradWeight(const ConstMatrixRef& dy, const ConstMatrixRef& x, float* acc) override {
    GemmSpec g;
    g.trans_b = true;
    g.m = x.cols;
    g.n = dy.cols;
    g.k = dy.rows;
    g.a = x.data;
    g.lda = x.cols;
    g.b = dy.data;
    g.ldb = dy.cols;
    g.d = acc;
    g.ldd = x.cols;
    g.ab_type = dy.dtype;
    g.d_type = DataType::kFloat32;
    g.beta = 1.0f;
    return Gemm(g);
  }

  absl::Status ColumnSums(const ConstMatrixRef& dy, float* acc) override {
    return CudaError(static_cast<cudaError_t>(
                         LaunchColumnSums(dy.data, dy.dtype, dy.rows, dy.cols, acc, stream_)),
                     "column sums kernel");
  }

  absl::Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                      size_t height) override {
    if (width == 0 || height == 0) return absl::OkStatus();
    return CudaError(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height,
                                       cudaMemcpyDeviceToDevice, stream_),
                     "cudaMemcpy2DAsync");
  }

  absl::StatusOr<void*> Scratch(int slot, size_t bytes) override {
    if (slots_.size() <= static_cast<size_t>(slot)) slots_.resize(slot + 1);
    Slot& s = slots_[slot];
    if (s.bytes < bytes) {
      // cudaFree waits for the work that may still use the old buffer.
      if (s.ptr) STRATA_RETURN_IF_ERROR(CudaError(cudaFree(s.ptr), "cudaFree"));
      s.ptr = nullptr;
      s.bytes = 0;
      STRATA_RETURN_IF_ERROR(CudaError(cudaMalloc(&s.ptr, bytes), "cudaMalloc of scratch"));
      s.bytes = bytes;
    }
    return s.ptr;
  }

  absl::StatusOr<void*> BeginComm() override {
    STRATA_RETURN_IF_ERROR(CudaError(cudaEventRecord(compute_done_, stream_), "cudaEventRecord"));
    STRATA_RETURN_IF_ERROR(
        CudaError(cudaStreamWaitEvent(comm_stream_, compute_done_, 0), "cudaStreamWaitEvent"));
    return static_cast<void*>(comm_stream_);
  }

  absl::Status EndComm() override {
    STRATA_RETURN_IF_ERROR(CudaError(cudaEventRecord(comm_done_, comm_stream_), "cudaEventRecord"));
    return CudaError(cudaStreamWaitEvent(stream_, comm_done_, 0), "cudaStreamWaitEvent");
  }

 private:
  struct Slot {
    void* ptr = nullptr;
    size_t bytes = 0;
  };

  absl::Status Gemm(const GemmSpec& g) {
    if (g.m == 0 || g.n == 0) return absl::OkStatus();
    LtGemm d;
    STRATA_RETURN_IF_ERROR(LtError(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                                   "cublasLtMatmulDescCreate"));
    const cublasOperation_t ta = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t tb = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    STRATA_RETURN_IF_ERROR(
        LtError(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
                "TRANSA"));
    STRATA_RETURN_IF_ERROR(
        LtError(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
                "TRANSB"));
    if (g.bias != nullptr) {
      const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
      STRATA_RETURN_IF_ERROR(
          LtError(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                                 sizeof(epilogue)),
                  "EPILOGUE"));
      STRATA_RETURN_IF_ERROR(
          LtError(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias,
                                                 sizeof(g.bias)),
                  "BIAS_POINTER"));
      const cudaDataType_t bias_type = CudaType(g.d_type);
      STRATA_RETURN_IF_ERROR(
          LtError(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                 &bias_type, sizeof(bias_type)),
                  "BIAS_DATA_TYPE"));
    }
    const uint64_t a_rows = g.trans_a ? g.k : g.m, a_cols = g.trans_a ? g.m : g.k;
    const uint64_t b_rows = g.trans_b ? g.n : g.k, b_cols = g.trans_b ? g.k : g.n;
    STRATA_RETURN_IF_ERROR(LtError(
        cublasLtMatrixLayoutCreate(&d.a, CudaType(g.ab_type), a_rows, a_cols, g.lda), "layout A"));
    STRATA_RETURN_IF_ERROR(LtError(
        cublasLtMatrixLayoutCreate(&d.b, CudaType(g.ab_type), b_rows, b_cols, g.ldb), "layout B"));
    STRATA_RETURN_IF_ERROR(
        LtError(cublasLtMatrixLayoutCreate(&d.c, CudaType(g.d_type), g.m, g.n, g.ldd), "layout C"));
    STRATA_RETURN_IF_ERROR(
        LtError(cublasLtMatmulPreferenceCreate(&d.pref), "cublasLtMatmulPreferenceCreate"));
    const size_t ws = kWorkspaceBytes;
    STRATA_RETURN_IF_ERROR(
        LtError(cublasLtMatmulPreferenceSetAttribute(
                    d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)),
                "MAX_WORKSPACE_BYTES"));
    cublasLtMatmulHeuristicResult_t heuristic{};
    int found = 0;
    STRATA_RETURN_IF_ERROR(LtError(cublasLtMatmulAlgoGetHeuristic(lt_, d.op, d.a, d.b, d.c, d.c,
                                                                  d.pref, 1, &heuristic, &found),
                                   "cublasLtMatmulAlgoGetHeuristic"));
    if (found == 0) {
      return absl::UnimplementedError(absl::StrCat("cuBLASLt has no algorithm for a ", g.m, "x",
                                                   g.n, "x", g.k, " GEMM of ",
                                                   DataTypeName(g.ab_type)));
    }
    const float alpha = 1.0f;
    return LtError(cublasLtMatmul(lt_, d.op, &alpha, g.a, d.a, g.b, d.b, &g.beta, g.d, d.c, g.d,
                                  d.c, &heuristic.algo, workspace_, kWorkspaceBytes, stream_),
                   "cublasLtMatmul");
  }

  cublasLtHandle_t lt_ = nullptr;
  void* workspace_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaStream_t comm_stream_ = nullptr;
  cudaEvent_t compute_done_ = nullptr;
  cudaEvent_t comm_done_ = nullptr;
  std::vector<Slot> slots_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Kernels>> MakeCudaKernels() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();  // clear the sticky "no device" error
    return absl::UnimplementedError("CUDA memory was asked for but no CUDA device is visible");
  }
  auto k = std::make_unique<CudaKernels>();
  STRATA_RETURN_IF_ERROR(k->Init());
  return std::unique_ptr<Kernels>(std::move(k));
}

}  // namespace strata::tp_internal

#else  // !STRATA_HAVE_CUDA

namespace strata::tp_internal {

absl::StatusOr<std::unique_ptr<Kernels>> MakeCudaKernels() {
  return absl::UnimplementedError("CUDA memory was asked for but strata was built without CUDA");
}

}  // namespace strata::tp_internal

#endif  // STRATA_HAVE_CUDA
