// Host versions of nccl_pipeline_kernels.h, for the rehearsal over Gloo.
#include <cmath>

#include "nccl_pipeline_kernels.h"

namespace strata::pipeline::testing {

void HostKernels::Input(int microbatch, double* h, double* g, int n) {
  for (int j = 0; j < n; ++j) {
    h[j] = std::sin(7.0 * microbatch + j);
    g[j] = 0.0;
  }
}

void HostKernels::Forward(double a, double b, const double* h, const double* g, double* ho,
                          double* go, int n) {
  for (int j = 0; j < n; ++j) {
    ho[j] = a * h[j] + b;
    go[j] = g[j] + h[j];
  }
}

void HostKernels::Seed(double scale, const double* ho, const double* go, double* dh, double* dg,
                       int n) {
  for (int j = 0; j < n; ++j) {
    dh[j] = scale * ho[j] / n;
    dg[j] = scale * go[j] / n;
  }
}

void HostKernels::InputGrad(double a, const double* dh, const double* dg, double* dhi, double* dgi,
                            int n) {
  for (int j = 0; j < n; ++j) {
    dhi[j] = a * dh[j] + dg[j];
    dgi[j] = dg[j];
  }
}

void HostKernels::WeightGrad(const double* dh, const double* h, int n, double* da, double* db) {
  double a = 0, b = 0;
  for (int j = 0; j < n; ++j) {
    a += dh[j] * h[j];
    b += dh[j];
  }
  *da += a;
  *db += b;
}

void HostKernels::Loss(const double* h, const double* g, int n, double* loss) {
  double sum = 0;
  for (int j = 0; j < n; ++j) sum += h[j] * h[j] + g[j] * g[j];
  *loss = 0.5 * sum / n;
}

}  // namespace strata::pipeline::testing
