// The conformance suite on the NCCL backend: ranks are threads of this
// process, one per visible GPU, bootstrapped through a memory store; the
// buffers are device memory. Each size skips (with the reason) where fewer
// GPUs are visible; the device machine runs them (tools/dev/gpu_checks.sh).
#include <cuda_runtime_api.h>

#include "conformance.h"
#include "strata/comm/backend.h"

namespace strata::testing {
namespace {

int VisibleGpus() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

// The calling thread's device (ThreadEnv::on_thread sets it).
class DeviceMemory final : public Memory {
 public:
  bool host() const override { return false; }
  void* Allocate(size_t bytes) override {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
    return p;
  }
  void Free(void* data) override { cudaFree(data); }
  void Upload(void* device, const void* host, size_t bytes) override {
    EXPECT_EQ(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  }
  void Download(void* host, const void* device, size_t bytes) override {
    EXPECT_EQ(cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }
};

EnvFactory Nccl(int n) {
  EnvFactory f;
  f.name = absl::StrCat("nccl", n);
  f.unavailable = [n]() -> std::string {
    const int gpus = VisibleGpus();
    if (gpus >= n) return "";
    return absl::StrCat("needs ", n, " CUDA device(s), one per rank; ", gpus, " visible");
  };
  f.make = [n]() -> std::unique_ptr<Env> {
    static DeviceMemory* memory = new DeviceMemory();  // stateless
    std::shared_ptr<Store> store = MakeMemoryStore();
    auto env = std::make_unique<ThreadEnv>(
        n,
        [n, store](int rank) -> std::unique_ptr<Communicator> {
          LaunchEnv launch;
          launch.rank = rank;
          launch.world_size = n;
          launch.local_rank = rank;
          launch.local_world_size = n;
          RootOptions options;
          options.backend = "nccl";
          options.store = store;
          options.comm.timeout = absl::Seconds(60);
          options.nccl.device = rank;
          absl::StatusOr<std::unique_ptr<Communicator>> root =
              CreateRootCommunicator(launch, options);
          EXPECT_TRUE(root.ok()) << "rank " << rank << ": " << root.status();
          return root.ok() ? std::move(root).value() : nullptr;
        },
        *memory, size_t{1} << 20);
    env->on_thread = [](int rank) { cudaSetDevice(rank); };
    return env;
  };
  return f;
}

INSTANTIATE_TEST_SUITE_P(Nccl, Conformance, ::testing::Values(Nccl(1), Nccl(2), Nccl(4), Nccl(8)),
                         EnvName);

}  // namespace
}  // namespace strata::testing
