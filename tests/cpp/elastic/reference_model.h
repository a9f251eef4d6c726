// The training the elastic loop tests run with ranks as threads (loop_test,
// join_test): kParams parameters, a global batch of kGlobalBatch samples
// whose gradients are exact in double, plain SGD. The global batch is kept
// through every change of dp, so Reference(steps) is what every survivor
// must end on whatever the membership did. And the loop options those tests
// use (short heartbeats; ranks are threads, so no process probe, and a
// leaving rank returns).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/time/time.h"
#include "strata/elastic/options.h"

namespace strata::elastic::testing {

constexpr int kParams = 4;
constexpr int kGlobalBatch = 12;
constexpr double kLr = 0.01;

// The gradient of sample i: deterministic, exact in double.
inline double Grad(int64_t sample, int p) {
  return static_cast<double>((sample * 7 + p * 3) % 11) - 5.0;
}

inline std::vector<double> Reference(int64_t steps) {
  std::vector<double> params(kParams, 1.0);
  for (int64_t s = 0; s < steps; ++s) {
    for (int p = 0; p < kParams; ++p) {
      double g = 0;
      for (int i = 0; i < kGlobalBatch; ++i) g += Grad(s * kGlobalBatch + i, p);
      params[p] -= kLr * g / kGlobalBatch;
    }
  }
  return params;
}

inline ElasticOptions ThreadRankOptions() {
  ElasticOptions o;
  o.heartbeat_interval = absl::Milliseconds(50);
  o.heartbeat_timeout = absl::Milliseconds(600);
  o.settle_timeout = absl::Seconds(3);
  o.decision_timeout = absl::Seconds(10);
  o.rebuild_timeout = absl::Seconds(20);
  o.commit_timeout = absl::Seconds(30);
  o.probe_processes = false;       // ranks are threads of this process
  o.leave = LeavePolicy::kReturn;  // kExit would end the whole test process
  return o;
}

}  // namespace strata::elastic::testing
