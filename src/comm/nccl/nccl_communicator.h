#pragma once
#include <memory>
#include "absl/status/statusor.h"
#include "strata/comm/backend.h"
namespace strata::nccl {
int VisibleDeviceCount();
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclRoot(const LaunchEnv& env,
                                                             const RootOptions& options,
                                                             std::shared_ptr<Store> store);
}  // namespace strata::nccl
