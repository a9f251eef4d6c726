// The NCCL unique-id bootstrap across real processes, without a GPU
// (ncclGetUniqueId needs none): through MPI under mpirun, and through a
// file store as under torchrun. Every rank must end with the same ids; the
// reference is rank 0's copy, gathered over the MPI world.
#include "comm/nccl/nccl_bootstrap.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "comm/nccl/nccl_library.h"
#include "harness.h"
#include "strata/comm/launch_env.h"

namespace strata::testing {
namespace {

class NcclBootstrap : public MultiRankTest {
 protected:
  static std::function<absl::StatusOr<std::string>()> MakeId() {
    return []() -> absl::StatusOr<std::string> {
      STRATA_ASSIGN_OR_RETURN(const nccl::NcclApi* api, nccl::NcclApi::Load(""));
      ncclUniqueId id;
      if (api->GetUniqueId(&id) != ncclSuccess) return absl::InternalError("ncclGetUniqueId");
      return std::string(id.internal, sizeof(id.internal));
    };
  }

  // Every rank's ids, gathered: all[r] is rank r's concatenation.
  static std::vector<std::string> Gather(const std::vector<std::string>& ids) {
    std::string mine;
    for (const std::string& id : ids) mine += id;
    std::string all(mine.size() * static_cast<size_t>(size()), '\0');
    ConstBuffer send{mine.data(), mine.size(), DataType::kUInt8};
    Buffer recv{all.data(), all.size(), DataType::kUInt8};
    absl::StatusOr<std::unique_ptr<Work>> work = world().AllGather(send, recv);
    EXPECT_TRUE(work.ok()) << work.status();
    EXPECT_TRUE(Wait(**work).ok());
    std::vector<std::string> out;
    for (int r = 0; r < size(); ++r) out.push_back(all.substr(r * mine.size(), mine.size()));
    return out;
  }

  static void ExpectSameEverywhere(const std::vector<std::string>& ids, size_t count) {
    ASSERT_EQ(ids.size(), count);
    std::set<std::string> distinct(ids.begin(), ids.end());
    EXPECT_EQ(distinct.size(), count) << "the ids of one root must differ";
    for (const std::string& id : ids) {
      EXPECT_EQ(id.size(), static_cast<size_t>(NCCL_UNIQUE_ID_BYTES));
      EXPECT_NE(id, std::string(NCCL_UNIQUE_ID_BYTES, '\0'));
    }
    const std::vector<std::string> all = Gather(ids);
    for (int r = 0; r < size(); ++r) EXPECT_EQ(all[r], all[0]) << "rank " << r << " differs";
  }
};

TEST_F(NcclBootstrap, IdsOverMpiAreTheSameOnEveryRank) {
  absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
  ASSERT_TRUE(env.ok()) << env.status();
  for (int count : {1, 2}) {
    absl::StatusOr<std::vector<std::string>> ids =
        nccl::UniqueIdsOverMpi(*env, HarnessRootOptions(), count, MakeId());
    ASSERT_TRUE(ids.ok()) << ids.status();
    ExpectSameEverywhere(*ids, static_cast<size_t>(count));
  }
}

TEST_F(NcclBootstrap, IdsThroughAFileStoreAreTheSameOnEveryRankForEachRoot) {
  // One fresh directory for the job: rank 0 names it, the world learns it.
  char name[256] = {};
  if (rank() == 0) {
    std::string dir =
        (std::filesystem::temp_directory_path() / ("strata_nccl_store_" + std::to_string(getpid())))
            .string();
    std::strncpy(name, dir.c_str(), sizeof(name) - 1);
  }
  Buffer b{name, sizeof(name), DataType::kUInt8};
  absl::StatusOr<std::unique_ptr<Work>> work = world().Broadcast(b, 0);
  ASSERT_TRUE(work.ok());
  STRATA_ASSERT_OK(Wait(**work));
  FileStoreOptions options;
  options.path = name;
  absl::StatusOr<std::shared_ptr<Store>> store = OpenFileStore(options);
  ASSERT_TRUE(store.ok()) << store.status();
  const int count = std::min(3, size());
  std::vector<std::string> first;
  for (int root = 0; root < 2; ++root) {  // two roots through one store
    absl::StatusOr<std::vector<std::string>> ids = nccl::ExchangeUniqueIds(
        **store, rank(), size(), count, MakeId(), Deadline(absl::Seconds(60)));
    ASSERT_TRUE(ids.ok()) << ids.status();
    ExpectSameEverywhere(*ids, static_cast<size_t>(count));
    if (root == 0) {
      first = *ids;
    } else {
      EXPECT_NE(*ids, first) << "the second root must not reuse the first root's ids";
    }
  }
  absl::StatusOr<std::unique_ptr<Work>> done = world().Barrier();
  ASSERT_TRUE(done.ok());
  STRATA_ASSERT_OK(Wait(**done));
  if (rank() == 0) std::filesystem::remove_all(name);
}

}  // namespace
}  // namespace strata::testing
