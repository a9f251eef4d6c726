#include "comm/nccl/nccl_communicator.h"
namespace strata::nccl {
int VisibleDeviceCount() { return 0; }
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclRoot(const LaunchEnv&, const RootOptions&,
                                                             std::shared_ptr<Store>) {
  return absl::UnimplementedError("nccl: not yet");
}
}  // namespace strata::nccl
