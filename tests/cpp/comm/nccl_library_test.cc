// The NCCL backend's CPU-testable logic: loading the process's libnccl (and
// the refusal to mix two; the rule itself is tested in nccl_locate_test),
// the version gates, ncclConfig_t from the topology profile, and the
// dtype/op mapping. Each TEST runs in a process of
// its own (gtest_discover_tests), so loading NCCL in one does not leak into
// another.
#include "comm/nccl/nccl_library.h"

#include <dlfcn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "comm/nccl/nccl_config.h"
#include "comm/nccl_tuning/nccl_setup_internal.h"
#include "strata/base/dtype.h"
#include "strata/comm/nccl.h"
#include "strata/comm/nccl_profile.h"

namespace strata::nccl {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

namespace fs = std::filesystem;

// The real loader on this machine: no NCCL is linked into the test, so the
// first Load maps one, reports its version, and it is the only copy.
TEST(NcclApiLoad, LoadsOneNcclAndReportsItsVersion) {
  EXPECT_THAT(MappedNcclLibraries(), IsEmpty());
  absl::StatusOr<const NcclApi*> api = NcclApi::Load("");
  ASSERT_TRUE(api.ok()) << api.status();
  std::vector<MappedLibrary> mapped = MappedNcclLibraries();
  ASSERT_EQ(mapped.size(), 1u);
  EXPECT_EQ(mapped[0].real_path, (*api)->path);
  // The reference: ncclGetVersion called directly on the mapped library.
  void* handle = dlopen(mapped[0].path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(handle, nullptr);
  auto get = reinterpret_cast<int (*)(int*)>(dlsym(handle, "ncclGetVersion"));
  int code = 0;
  ASSERT_EQ(get(&code), 0);
  EXPECT_EQ((*api)->version, NcclVersion::FromCode(code));
  // The gated calls are found where the version has them.
  if ((*api)->version >= kShrinkSince) EXPECT_NE((*api)->CommShrink, nullptr);
  if ((*api)->version >= kRevokeSince) EXPECT_NE((*api)->CommRevoke, nullptr);
  // A second Load gives the same table.
  absl::StatusOr<const NcclApi*> again = NcclApi::Load("");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *api);
  // Nothing was loaded before, so the file came from the search path (or
  // the build's fallback), and the reports give the backend's answer.
  EXPECT_TRUE((*api)->source == NcclLibrarySource::kSearchPath ||
              (*api)->source == NcclLibrarySource::kBuiltAgainst);
  EXPECT_FALSE((*api)->reason.empty());
  absl::StatusOr<NcclLibraryInfo> found = FindNcclLibrary();
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->path, (*api)->path);
  EXPECT_EQ(found->reason, (*api)->reason);
  EXPECT_EQ(found->source, (*api)->source);
}

// A copy of the library file at another path is a second NCCL (a hard
// link would not be: the loader identifies files by inode). Removed at the
// end of the test; a mapped file stays readable after removal.
struct CopyRemover {
  std::string path;
  ~CopyRemover() { fs::remove_all(fs::path(path).parent_path()); }
};
std::string CopyOfLoadedNccl(const std::string& loaded) {
  const fs::path dir = fs::temp_directory_path() / ("strata_nccl_copy_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const fs::path copy = dir / "libnccl.so.2";
  fs::copy_file(loaded, copy, fs::copy_options::overwrite_existing);
  return copy.string();
}

TEST(NcclApiLoad, AnotherLibraryAfterTheFirstIsRefused) {
  absl::StatusOr<const NcclApi*> api = NcclApi::Load("");
  ASSERT_TRUE(api.ok()) << api.status();
  const std::string copy = CopyOfLoadedNccl((*api)->path);
  CopyRemover remover{copy};
  absl::StatusOr<const NcclApi*> other = NcclApi::Load(copy);
  ASSERT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(other.status().message(), HasSubstr(copy));
  EXPECT_THAT(other.status().message(), HasSubstr((*api)->path));
  EXPECT_THAT(other.status().message(), HasSubstr("one NCCL per process"));
}

TEST(NcclApiLoad, TwoCopiesInTheProcessAreRefused) {
  absl::StatusOr<const NcclApi*> api = NcclApi::Load("");
  ASSERT_TRUE(api.ok()) << api.status();
  const std::string copy = CopyOfLoadedNccl((*api)->path);
  CopyRemover remover{copy};
  // Somebody else (a second framework) maps its own NCCL.
  void* second = dlopen(copy.c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(second, nullptr) << dlerror();
  ASSERT_EQ(MappedNcclLibraries().size(), 2u);
  absl::StatusOr<const NcclApi*> again = NcclApi::Load("");
  ASSERT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.status().message(), HasSubstr("second NCCL"));
  EXPECT_THAT(again.status().message(), HasSubstr(copy));
}

TEST(NcclApiLoad, AMissingExplicitLibraryNamesWhatWasTried) {
  setenv("STRATA_NCCL_LIBRARY", "/nonexistent/libnccl.so.2", 1);
  absl::StatusOr<const NcclApi*> api = NcclApi::Load("");
  unsetenv("STRATA_NCCL_LIBRARY");
  ASSERT_EQ(api.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(api.status().message(), HasSubstr("/nonexistent/libnccl.so.2"));
  EXPECT_THAT(api.status().message(), HasSubstr("STRATA_NCCL_LIBRARY"));
}

TEST(NcclFeatures, ShrinkAndRevokeAreGatedOnTheRuntimeVersion) {
  EXPECT_TRUE(CheckFeature("ncclCommShrink", kShrinkSince, {2, 27, 3}, true, "/x").ok());
  EXPECT_TRUE(CheckFeature("ncclCommRevoke", kRevokeSince, {2, 28, 7}, true, "/x").ok());
  absl::Status s = CheckFeature("ncclCommShrink", kShrinkSince, {2, 26, 5}, false, "/x");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("needs NCCL 2.27.0 or newer; the NCCL in use is 2.26.5 (/x)"));
  s = CheckFeature("ncclCommRevoke", kRevokeSince, {2, 28, 3}, true, "/x");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("2.28.7"));
  EXPECT_THAT(s.message(), HasSubstr("2.28.3"));
  // New enough by number but without the symbol (a trimmed build).
  s = CheckFeature("ncclCommRevoke", kRevokeSince, {2, 30, 7}, false, "/x");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), HasSubstr("does not export ncclCommRevoke"));
}

TEST(NcclConfig, EveryProfileFieldReachesTheStruct) {
  NcclConfigFields f;
  f.cga_cluster_size = 2;
  f.min_ctas = 4;
  f.max_ctas = 16;
  f.net_name = "IB";
  f.split_share = 1;
  f.traffic_class = 106;
  f.comm_name = "profile-name";
  f.collnet_enable = 0;
  f.cta_policy = 1;
  f.shrink_share = 1;
  f.nvls_ctas = 8;
  f.n_channels_per_net_peer = 2;
  f.nvlink_centric_sched = 1;
  f.blocking = 1;  // strata's own choice wins
  ConfigOptions o;
  o.runtime = {2, 28, 9};
  NcclConfig config = BuildNcclConfig(f, o);
  const ncclConfig_t& c = config.config();
  EXPECT_EQ(c.magic, 0xcafebeefu);
  EXPECT_EQ(c.size, sizeof(ncclConfig_t));
  EXPECT_EQ(c.blocking, 0);
  EXPECT_EQ(c.cgaClusterSize, 2);
  EXPECT_EQ(c.minCTAs, 4);
  EXPECT_EQ(c.maxCTAs, 16);
  EXPECT_STREQ(c.netName, "IB");
  EXPECT_EQ(c.splitShare, 1);
  EXPECT_EQ(c.trafficClass, 106);
  EXPECT_STREQ(c.commName, "profile-name");
  EXPECT_EQ(c.collnetEnable, 0);
  EXPECT_EQ(c.CTAPolicy, 1);
  EXPECT_EQ(c.shrinkShare, 1);
  EXPECT_EQ(c.nvlsCTAs, 8);
  EXPECT_EQ(c.nChannelsPerNetPeer, 2);
  EXPECT_EQ(c.nvlinkCentricSched, 1);
  EXPECT_THAT(config.ignored_by_runtime(), IsEmpty());
}

TEST(NcclConfig, UnsetFieldsKeepNcclDefaultsAndCopiesOwnTheirStrings) {
  NcclConfigFields f;
  f.net_name = "Socket";
  ConfigOptions o;
  o.comm_name = "tp";
  o.runtime = {2, 28, 9};
  NcclConfig copy;
  {
    NcclConfig original = BuildNcclConfig(f, o);
    copy = original;
  }  // the original's strings are gone
  EXPECT_STREQ(copy.config().netName, "Socket");
  EXPECT_STREQ(copy.config().commName, "tp");
  EXPECT_EQ(copy.config().minCTAs, NCCL_CONFIG_UNDEF_INT);
  EXPECT_EQ(copy.config().shrinkShare, NCCL_CONFIG_UNDEF_INT);
  o.nonblocking = false;
  EXPECT_EQ(BuildNcclConfig(f, o).config().blocking, 1);
}

TEST(NcclConfig, FieldsAnOlderNcclDoesNotKnowAreListed) {
  NcclConfigFields f;
  f.net_name = "IB";
  f.shrink_share = 1;
  f.nvlink_centric_sched = 1;
  ConfigOptions o;
  o.runtime = {2, 26, 5};
  NcclConfig config = BuildNcclConfig(f, o);
  EXPECT_THAT(config.ignored_by_runtime(),
              ElementsAre("shrinkShare (NCCL 2.27.0)", "nvlinkCentricSched (NCCL 2.28.0)"));
}

TEST(NcclConfig, BuiltFromTheDetectedTopologyProfile) {
  nccl_tuning_internal::ResetNcclSetupForTesting();
  NcclCommSetupOptions setup;
  setup.detect.sysfs_root = std::string(STRATA_TOPOLOGY_FIXTURES) + "/dgx_h100/sys";
  setup.detect.use_nvml = false;
  setup.apply_profile = false;  // leave this process's environment alone
  setup.nccl_version = NcclVersion{2, 28, 9};
  setup.comm_name = "world";
  setup.log = [](absl::string_view) {};
  absl::StatusOr<NcclCommSetup> prepared = PrepareNcclCommunicator(setup);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  ConfigOptions o;
  o.runtime = setup.nccl_version.value();
  NcclConfig config = BuildNcclConfig(prepared->config, o);
  // The reference: the profile's fields, one by one.
  const NcclConfigFields& f = prepared->config;
  if (f.net_name) {
    EXPECT_STREQ(config.config().netName, f.net_name->c_str());
  } else {
    EXPECT_EQ(config.config().netName, nullptr);
  }
  EXPECT_STREQ(config.config().commName, "world");
  EXPECT_EQ(config.config().blocking, 0);
  EXPECT_EQ(config.config().maxCTAs, f.max_ctas.value_or(NCCL_CONFIG_UNDEF_INT));
  EXPECT_EQ(config.config().minCTAs, f.min_ctas.value_or(NCCL_CONFIG_UNDEF_INT));
  EXPECT_EQ(config.config().splitShare, f.split_share.value_or(NCCL_CONFIG_UNDEF_INT));
}

TEST(NcclTypes, EveryDtypeMovesAndTheNumericOnesReduce) {
  for (DataType t : kAllDataTypes) {
    EXPECT_TRUE(NcclCanMove(t)) << DataTypeName(t);
    absl::StatusOr<ncclDataType_t> n = ToNcclType(t);
    if (t == DataType::kInt16) {
      EXPECT_FALSE(NcclCanReduce(t));
      EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(n.status().message(), HasSubstr("NCCL has no int16 type"));
    } else if (t == DataType::kBool) {
      EXPECT_FALSE(NcclCanReduce(t));
      EXPECT_EQ(*n, ncclUint8);
    } else {
      EXPECT_TRUE(NcclCanReduce(t)) << DataTypeName(t);
      ASSERT_TRUE(n.ok());
    }
  }
  EXPECT_EQ(*ToNcclType(DataType::kBFloat16), ncclBfloat16);
  EXPECT_EQ(*ToNcclType(DataType::kFloat16), ncclFloat16);
  EXPECT_EQ(ToNcclOp(ReduceOp::kAvg), ncclAvg);
  EXPECT_EQ(ToNcclOp(ReduceOp::kMin), ncclMin);
  EXPECT_EQ(ToNcclOp(ReduceOp::kMax), ncclMax);
  EXPECT_EQ(ToNcclOp(ReduceOp::kProd), ncclProd);
  EXPECT_EQ(ToNcclOp(ReduceOp::kSum), ncclSum);
}

}  // namespace
}  // namespace strata::nccl
