// The conformance suite with ranks as threads of this process: the fake
// communicator (tests/cpp/parallel) on 1, 2, 4 and 8 ranks, and the Gloo
// backend through a memory store on 2 and 4 (CTest runs the binary again
// with STRATA_GLOO_CMA=0 for Gloo's transport).
#include "conformance.h"
#include "fake_communicator.h"
#include "strata/comm/backend.h"

namespace strata::testing {
namespace {

// In-process ranks share two cores: the large cases stay small.
constexpr size_t kLarge = size_t{1} << 16;

EnvFactory Fake(int n) {
  return EnvFactory{absl::StrCat("fake", n), [n]() -> std::unique_ptr<Env> {
                      auto group =
                          std::make_shared<FakeGroup>(n, FakeOrdering::kMatchPosted, "world");
                      return std::make_unique<ThreadEnv>(
                          n,
                          [group](int rank) {
                            CommOptions options;
                            options.timeout = absl::Seconds(60);
                            return group->Comm(rank, options);
                          },
                          HostMemory(), kLarge);
                    }};
}

INSTANTIATE_TEST_SUITE_P(Fake, Conformance, ::testing::Values(Fake(1), Fake(2), Fake(4), Fake(8)),
                         EnvName);

#ifdef STRATA_HAVE_GLOO
EnvFactory Gloo(int n) {
  return EnvFactory{absl::StrCat("gloo", n), [n]() -> std::unique_ptr<Env> {
                      std::shared_ptr<Store> store = MakeMemoryStore();
                      return std::make_unique<ThreadEnv>(
                          n,
                          [n, store](int rank) -> std::unique_ptr<Communicator> {
                            LaunchEnv env;
                            env.rank = rank;
                            env.world_size = n;
                            env.local_rank = rank;
                            env.local_world_size = n;
                            env.launcher = Launcher::kTorchrun;
                            RootOptions options;
                            options.backend = "gloo";
                            options.store = store;
                            options.comm.timeout = absl::Seconds(60);
                            absl::StatusOr<std::unique_ptr<Communicator>> root =
                                CreateRootCommunicator(env, options);
                            EXPECT_TRUE(root.ok()) << root.status();
                            return root.ok() ? std::move(root).value() : nullptr;
                          },
                          HostMemory(), kLarge);
                    }};
}

INSTANTIATE_TEST_SUITE_P(Gloo, Conformance, ::testing::Values(Gloo(2), Gloo(4)), EnvName);
#endif

}  // namespace
}  // namespace strata::testing
