// Kernels of nccl_pipeline_kernels.h.
#include "nccl_pipeline_kernels.h"

namespace strata::pipeline::testing {
namespace {

constexpr int kThreads = 256;

int Blocks(int n) { return n == 0 ? 1 : (n + kThreads - 1) / kThreads; }

__global__ void InputKernel(int microbatch, double* h, double* g, int n) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j < n) {
    h[j] = sin(7.0 * microbatch + j);
    g[j] = 0.0;
  }
}

__global__ void ForwardKernel(double a, double b, const double* h, const double* g, double* ho,
                              double* go, int n) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j < n) {
    ho[j] = a * h[j] + b;
    go[j] = g[j] + h[j];
  }
}

__global__ void SeedKernel(double scale, const double* ho, const double* go, double* dh, double* dg,
                           int n) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j < n) {
    dh[j] = scale * ho[j] / n;
    dg[j] = scale * go[j] / n;
  }
}

__global__ void InputGradKernel(double a, const double* dh, const double* dg, double* dhi,
                                double* dgi, int n) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j < n) {
    dhi[j] = a * dh[j] + dg[j];
    dgi[j] = dg[j];
  }
}

// One block: sums x[j] * y[j] (y null: 1) and z[j] * w[j] into out[0], out[1].
__global__ void SumKernel(const double* x, const double* y, const double* z, const double* w, int n,
                          double* out0, double* out1, double scale) {
  __shared__ double s0[kThreads], s1[kThreads];
  double a = 0, b = 0;
  for (int j = threadIdx.x; j < n; j += kThreads) {
    a += x[j] * (y ? y[j] : 1.0);
    b += z[j] * (w ? w[j] : 1.0);
  }
  s0[threadIdx.x] = a;
  s1[threadIdx.x] = b;
  __syncthreads();
  for (int k = kThreads / 2; k > 0; k /= 2) {
    if (threadIdx.x < k) {
      s0[threadIdx.x] += s0[threadIdx.x + k];
      s1[threadIdx.x] += s1[threadIdx.x + k];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    if (out1 != nullptr) {
      *out0 += scale * s0[0];
      *out1 += scale * s1[0];
    } else {
      *out0 = scale * (s0[0] + s1[0]);
    }
  }
}

}  // namespace

void LaunchInput(int microbatch, double* h, double* g, int n, cudaStream_t stream) {
  InputKernel<<<Blocks(n), kThreads, 0, stream>>>(microbatch, h, g, n);
}

void LaunchForward(double a, double b, const double* h, const double* g, double* ho, double* go,
                   int n, cudaStream_t stream) {
  ForwardKernel<<<Blocks(n), kThreads, 0, stream>>>(a, b, h, g, ho, go, n);
}

void LaunchSeed(double scale, const double* ho, const double* go, double* dh, double* dg, int n,
                cudaStream_t stream) {
  SeedKernel<<<Blocks(n), kThreads, 0, stream>>>(scale, ho, go, dh, dg, n);
}

void LaunchInputGrad(double a, const double* dh, const double* dg, double* dhi, double* dgi, int n,
                     cudaStream_t stream) {
  InputGradKernel<<<Blocks(n), kThreads, 0, stream>>>(a, dh, dg, dhi, dgi, n);
}

void LaunchWeightGrad(const double* dh, const double* h, int n, double* da, double* db,
                      cudaStream_t stream) {
  SumKernel<<<1, kThreads, 0, stream>>>(dh, h, dh, nullptr, n, da, db, 1.0);
}

void LaunchLoss(const double* h, const double* g, int n, double* loss, cudaStream_t stream) {
  SumKernel<<<1, kThreads, 0, stream>>>(h, h, g, g, n, loss, nullptr, 0.5 / n);
}

}  // namespace strata::pipeline::testing
