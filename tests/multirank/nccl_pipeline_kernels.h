// The stage functions' arithmetic for nccl_pipeline_test (fp64): the model
// of pipeline_test_model.h, stage s mapping (h, g) to (a_s h + b_s, g + h)
// elementwise. On the GPU (nccl_pipeline_kernels.cu) each is one launch on
// `stream`; with a null stream and host pointers, the same on the host
// (nccl_pipeline_host.cc), for the rehearsal over Gloo.
#pragma once

#include <cuda_runtime_api.h>

namespace strata::pipeline::testing {

// h[j] = sin(7 microbatch + j), g[j] = 0.
void LaunchInput(int microbatch, double* h, double* g, int n, cudaStream_t stream);
// ho = a h + b, go = g + h.
void LaunchForward(double a, double b, const double* h, const double* g, double* ho, double* go,
                   int n, cudaStream_t stream);
// dh = scale ho / n, dg = scale go / n (the gradient of 0.5 sum(ho^2 + go^2) / n).
void LaunchSeed(double scale, const double* ho, const double* go, double* dh, double* dg, int n,
                cudaStream_t stream);
// dhi = a dh + dg, dgi = dg.
void LaunchInputGrad(double a, const double* dh, const double* dg, double* dhi, double* dgi, int n,
                     cudaStream_t stream);
// da += sum(dh * h), db += sum(dh) (one block).
void LaunchWeightGrad(const double* dh, const double* h, int n, double* da, double* db,
                      cudaStream_t stream);
// loss = 0.5 sum(h^2 + g^2) / n (one block).
void LaunchLoss(const double* h, const double* g, int n, double* loss, cudaStream_t stream);

// The same on host memory (plain loops, no stream).
struct HostKernels {
  static void Input(int microbatch, double* h, double* g, int n);
  static void Forward(double a, double b, const double* h, const double* g, double* ho, double* go,
                      int n);
  static void Seed(double scale, const double* ho, const double* go, double* dh, double* dg, int n);
  static void InputGrad(double a, const double* dh, const double* dg, double* dhi, double* dgi,
                        int n);
  static void WeightGrad(const double* dh, const double* h, int n, double* da, double* db);
  static void Loss(const double* h, const double* g, int n, double* loss);
};

}  // namespace strata::pipeline::testing
