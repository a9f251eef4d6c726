// Which libnccl a process uses and why (comm/nccl_locate.h): the rule with
// the loader's inputs faked (what is mapped, who links it, the search path),
// then the real loader where this machine has a libnccl. Each TEST runs in
// a process of its own (gtest_discover_tests), so what one maps does not
// leak into another.
#include "comm/nccl_locate.h"

#include <dlfcn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <link.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>

#include "strata/comm/nccl.h"
#include "strata/comm/nccl_settings.h"
#include "strata/comm/topology_report.h"

namespace strata::nccl {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

namespace fs = std::filesystem;

// The fake file system: links and the files they resolve to.
std::string FakeRealPath(const std::string& path) {
  if (path == "/opt/a/libnccl.so.2" || path == "/opt/a/libnccl.so.2.30.7") {
    return "/opt/a/libnccl.so.2.30.7";
  }
  if (path == "/usr/lib/libnccl.so.2" || path == "/usr/local/cuda/lib/libnccl.so.2" ||
      path == "/usr/local/cuda-13.0/lib/libnccl.so.2") {
    return "/usr/local/cuda-13.0/lib/libnccl.so.2";
  }
  if (path == "/home/me/nccl/lib/libnccl.so.2") return "/home/me/nccl/lib/libnccl.so.2.29.1";
  return "";
}

LibraryRequest Built() {
  LibraryRequest request;
  request.built = "/usr/local/cuda-13.0/lib/libnccl.so.2";
  request.built_origin = "the CUDA toolkit's";
  return request;
}

TEST(NcclLibraryName, NcclItselfButNotItsPlugins) {
  EXPECT_TRUE(IsNcclLibraryName("libnccl.so"));
  EXPECT_TRUE(IsNcclLibraryName("libnccl.so.2"));
  EXPECT_TRUE(IsNcclLibraryName("/site-packages/nvidia/nccl/lib/libnccl.so.2"));
  EXPECT_TRUE(IsNcclLibraryName("/usr/lib/libnccl.so.2.28.9"));
  EXPECT_FALSE(IsNcclLibraryName("/usr/lib/libnccl-net.so"));
  EXPECT_FALSE(IsNcclLibraryName("/usr/lib/libnccl-tuner.so"));
  EXPECT_FALSE(IsNcclLibraryName("/usr/lib/libnccl_static.a"));
  EXPECT_FALSE(IsNcclLibraryName("libnccl.sox"));
  EXPECT_FALSE(IsNcclLibraryName("/libnccl.so.2/libfoo.so"));
  EXPECT_FALSE(IsNcclLibraryName(""));
}

TEST(ChooseNcclLibrary, NothingLoadedTriesTheSearchPathThenTheBuiltOne) {
  absl::StatusOr<LibraryChoice> c = ChooseNcclLibrary({}, Built(), &FakeRealPath);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->already_mapped);
  ASSERT_EQ(c->candidates.size(), 2u);
  EXPECT_EQ(c->candidates[0].path, "libnccl.so.2");
  EXPECT_EQ(c->candidates[0].source, NcclLibrarySource::kSearchPath);
  EXPECT_THAT(c->candidates[0].reason, HasSubstr("dynamic loader's search path"));
  EXPECT_EQ(c->candidates[1].path, "/usr/local/cuda-13.0/lib/libnccl.so.2");
  EXPECT_EQ(c->candidates[1].source, NcclLibrarySource::kBuiltAgainst);
  EXPECT_THAT(c->candidates[1].reason,
              HasSubstr("the library strata was built against (the CUDA toolkit's)"));
  // A build that knows no library tries the search path only.
  c = ChooseNcclLibrary({}, LibraryRequest{}, &FakeRealPath);
  ASSERT_TRUE(c.ok());
  ASSERT_EQ(c->candidates.size(), 1u);
}

TEST(ChooseNcclLibrary, OptionWinsOverEnvironmentWhenNothingIsLoaded) {
  LibraryRequest request = Built();
  request.option = "/opt/a/libnccl.so.2";
  request.env = "/home/me/nccl/lib/libnccl.so.2";
  absl::StatusOr<LibraryChoice> c = ChooseNcclLibrary({}, request, &FakeRealPath);
  ASSERT_TRUE(c.ok());
  ASSERT_EQ(c->candidates.size(), 1u);
  EXPECT_EQ(c->candidates[0].path, "/opt/a/libnccl.so.2");
  EXPECT_EQ(c->candidates[0].source, NcclLibrarySource::kOption);
  EXPECT_THAT(c->candidates[0].reason, HasSubstr("NcclOptions::library"));
  request.option.clear();
  c = ChooseNcclLibrary({}, request, &FakeRealPath);
  ASSERT_TRUE(c.ok());
  ASSERT_EQ(c->candidates.size(), 1u);
  EXPECT_EQ(c->candidates[0].path, "/home/me/nccl/lib/libnccl.so.2");
  EXPECT_EQ(c->candidates[0].source, NcclLibrarySource::kEnvironment);
  EXPECT_EQ(c->candidates[0].reason, "STRATA_NCCL_LIBRARY=/home/me/nccl/lib/libnccl.so.2");
}

TEST(ChooseNcclLibrary, TheLoadedCopyIsUsedAndTheReasonNamesWhoLoadedIt) {
  const std::string libtorch = "/venv/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so";
  MappedLibrary torch{"/opt/a/libnccl.so.2", "/opt/a/libnccl.so.2.30.7", libtorch};
  absl::StatusOr<LibraryChoice> c = ChooseNcclLibrary({torch}, Built(), &FakeRealPath);
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->already_mapped);
  ASSERT_EQ(c->candidates.size(), 1u);
  EXPECT_EQ(c->candidates[0].path, "/opt/a/libnccl.so.2");
  EXPECT_EQ(c->candidates[0].source, NcclLibrarySource::kAlreadyLoaded);
  EXPECT_EQ(c->candidates[0].reason,
            "already loaded in this process by torch (" + libtorch + " links it)");
  // Another framework's library.
  MappedLibrary other{"/opt/a/libnccl.so.2", "/opt/a/libnccl.so.2.30.7", "/opt/jax/libxla.so"};
  c = ChooseNcclLibrary({other}, Built(), &FakeRealPath);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->candidates[0].reason,
            "already loaded in this process (/opt/jax/libxla.so links it)");
  // Nobody links it: somebody opened it with dlopen.
  MappedLibrary opened{"/opt/a/libnccl.so.2", "/opt/a/libnccl.so.2.30.7", ""};
  c = ChooseNcclLibrary({opened}, Built(), &FakeRealPath);
  ASSERT_TRUE(c.ok());
  EXPECT_THAT(c->candidates[0].reason, HasSubstr("opened with dlopen before strata looked"));
  // Naming the same file (through another link) is fine.
  LibraryRequest request = Built();
  request.option = "/opt/a/libnccl.so.2.30.7";
  c = ChooseNcclLibrary({torch}, request, &FakeRealPath);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->already_mapped);
}

TEST(ChooseNcclLibrary, AskingForAnotherCopyThanTheLoadedOneIsRefused) {
  const MappedLibrary torch{"/opt/a/libnccl.so.2", "/opt/a/libnccl.so.2.30.7", ""};
  LibraryRequest request;
  request.env = "/usr/lib/libnccl.so.2";
  absl::StatusOr<LibraryChoice> c = ChooseNcclLibrary({torch}, request, &FakeRealPath);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(c.status().message(),
              HasSubstr("STRATA_NCCL_LIBRARY asks for /usr/lib/libnccl.so.2"));
  EXPECT_THAT(c.status().message(), HasSubstr("/usr/local/cuda-13.0/lib/libnccl.so.2"));
  EXPECT_THAT(c.status().message(), HasSubstr("already loaded NCCL from /opt/a/libnccl.so.2.30.7"));
}

TEST(ChooseNcclLibrary, TwoLoadedCopiesAreRefused) {
  const MappedLibrary a{"/opt/a/libnccl.so.2", "/opt/a/libnccl.so.2.30.7", ""};
  const MappedLibrary b{"/usr/lib/libnccl.so.2", "/usr/local/cuda-13.0/lib/libnccl.so.2", ""};
  absl::StatusOr<LibraryChoice> c = ChooseNcclLibrary({a, b}, LibraryRequest{}, &FakeRealPath);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(c.status().message(), HasSubstr("two copies of NCCL"));
  EXPECT_THAT(c.status().message(), HasSubstr("/opt/a/libnccl.so.2.30.7"));
  EXPECT_THAT(c.status().message(), HasSubstr("/usr/local/cuda-13.0/lib/libnccl.so.2"));
}

using Kind = SearchDir::Kind;

TEST(SearchPathReason, NamesTheLdLibraryPathEntryThatHeldIt) {
  const std::vector<SearchDir> dirs = {{"/nowhere", Kind::kLdLibraryPath},
                                       {"/home/me/nccl/lib", Kind::kLdLibraryPath},
                                       {"/usr/local/cuda/lib", Kind::kRunpath},
                                       {"/usr/lib", Kind::kSystem}};
  EXPECT_EQ(SearchPathReason("/home/me/nccl/lib/libnccl.so.2.29.1", dirs, "/x/libstrata.so.0",
                             Built(), &FakeRealPath),
            "libnccl.so.2 found via the dynamic loader's search path: LD_LIBRARY_PATH entry "
            "/home/me/nccl/lib");
}

TEST(SearchPathReason, NamesTheRunpathEntryAndTheCudaToolkit) {
  const std::vector<SearchDir> dirs = {{"/nowhere", Kind::kLdLibraryPath},
                                       {"/usr/local/cuda/lib", Kind::kRunpath},
                                       {"/usr/lib", Kind::kSystem}};
  EXPECT_EQ(SearchPathReason("/usr/local/cuda-13.0/lib/libnccl.so.2", dirs, "/x/libstrata.so.0",
                             Built(), &FakeRealPath),
            "libnccl.so.2 found via the dynamic loader's search path: RUNPATH entry "
            "/usr/local/cuda/lib of /x/libstrata.so.0; it is the library strata was built "
            "against (the CUDA toolkit's)");
}

TEST(SearchPathReason, FallsBackToTheCacheOrASystemDirectory) {
  // Not in LD_LIBRARY_PATH or a RUNPATH: the ldconfig cache found it.
  const std::vector<SearchDir> none = {{"/nowhere", Kind::kRunpath}, {"/lib", Kind::kSystem}};
  EXPECT_EQ(SearchPathReason("/home/me/nccl/lib/libnccl.so.2.29.1", none, "/x/libstrata.so.0",
                             Built(), &FakeRealPath),
            "libnccl.so.2 found via the dynamic loader's search path: the ldconfig cache "
            "(/etc/ld.so.cache lists /home/me/nccl/lib)");
  const std::vector<SearchDir> system = {{"/nowhere", Kind::kRunpath}, {"/usr/lib", Kind::kSystem}};
  EXPECT_EQ(SearchPathReason("/usr/local/cuda-13.0/lib/libnccl.so.2", system, "/x/libstrata.so.0",
                             LibraryRequest{}, &FakeRealPath),
            "libnccl.so.2 found via the dynamic loader's search path: the ldconfig cache or the "
            "system directory /usr/lib");
  // An earlier entry holding another libnccl is not claimed as the source.
  const std::vector<SearchDir> shadowed = {{"/opt/a", Kind::kLdLibraryPath},
                                           {"/home/me/nccl/lib", Kind::kLdLibraryPath}};
  EXPECT_THAT(SearchPathReason("/home/me/nccl/lib/libnccl.so.2.29.1", shadowed, "/x", Built(),
                               &FakeRealPath),
              Not(HasSubstr("LD_LIBRARY_PATH")));
}

TEST(ClassifySearchDirs, LabelsEachEntryOfTheLoadersList) {
  // RTLD_DI_SERINFO's order: LD_LIBRARY_PATH, the RUNPATH, the system.
  const std::vector<std::string> serinfo = {"/home/me/nccl/lib",     "/opt/x",
                                            "/usr/local/cuda/lib",   ".",
                                            "/lib/x86_64-linux-gnu", "/usr/lib"};
  const std::vector<std::string> runpath = {"/usr/local/cuda/lib/", ""};
  const std::vector<SearchDir> dirs =
      ClassifySearchDirs(serinfo, "/home/me/nccl/lib/:/opt/x", runpath);
  ASSERT_EQ(dirs.size(), serinfo.size());
  const std::vector<Kind> kinds = {Kind::kLdLibraryPath, Kind::kLdLibraryPath, Kind::kRunpath,
                                   Kind::kRunpath,       Kind::kSystem,        Kind::kSystem};
  for (size_t i = 0; i < dirs.size(); ++i) {
    EXPECT_EQ(dirs[i].dir, serinfo[i]);
    EXPECT_EQ(dirs[i].kind, kinds[i]) << serinfo[i];
  }
  // Nothing in the environment or RUNPATH: everything is the system's.
  for (const SearchDir& d : ClassifySearchDirs(serinfo, "", {})) EXPECT_EQ(d.kind, Kind::kSystem);
}

// The references: the objects the loader mapped for this program (each
// needed library is among them), and the directories it searches for it
// (each RUNPATH entry is among them).
TEST(ReadElfDynamic, ReadsTheProgramsNeededLibrariesAndRunpath) {
  const ElfDynamic elf = ReadElfDynamic("/proc/self/exe");
  ASSERT_THAT(elf.needed, Not(IsEmpty()));
  std::set<std::string> mapped;
  void* self = dlopen(nullptr, RTLD_LAZY);
  ASSERT_NE(self, nullptr);
  struct link_map* map = nullptr;
  ASSERT_EQ(dlinfo(self, RTLD_DI_LINKMAP, &map), 0);
  for (; map != nullptr; map = map->l_next) {
    const std::string name = map->l_name ? map->l_name : "";
    mapped.insert(fs::path(name).filename().string());
  }
  EXPECT_TRUE(std::find(elf.needed.begin(), elf.needed.end(), "libc.so.6") != elf.needed.end());
  for (const std::string& n : elf.needed) EXPECT_TRUE(mapped.count(n)) << n << " is not mapped";
  Dl_serinfo size;
  ASSERT_EQ(dlinfo(self, RTLD_DI_SERINFOSIZE, &size), 0);
  std::vector<Dl_serinfo> buf(size.dls_size / sizeof(Dl_serinfo) + 1);
  buf[0] = size;
  ASSERT_EQ(dlinfo(self, RTLD_DI_SERINFO, buf.data()), 0);
  std::set<std::string> searched;
  for (unsigned i = 0; i < buf[0].dls_cnt; ++i) searched.insert(buf[0].dls_serpath[i].dls_name);
  dlclose(self);
  for (const std::string& r : elf.runpath) {
    if (r.empty() || r.find('$') != std::string::npos) continue;
    EXPECT_TRUE(searched.count(r)) << r << " is not searched";
  }
  // Not ELF, or not there: nothing.
  const fs::path text = fs::temp_directory_path() / ("strata_not_elf_" + std::to_string(getpid()));
  std::ofstream(text) << "not an ELF file";
  EXPECT_THAT(ReadElfDynamic(text.string()).needed, IsEmpty());
  fs::remove(text);
  EXPECT_THAT(ReadElfDynamic("/nonexistent/libfoo.so").needed, IsEmpty());
}

// ---- the real loader, where this machine has a libnccl ----------------------

// The version of `path` by calling it directly (the reference).
NcclVersion VersionOf(const std::string& path) {
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  EXPECT_NE(h, nullptr) << dlerror();
  if (h == nullptr) return {};
  auto get = reinterpret_cast<int (*)(int*)>(dlsym(h, "ncclGetVersion"));
  int code = 0;
  EXPECT_NE(get, nullptr);
  if (get != nullptr) EXPECT_EQ(get(&code), 0);
  dlclose(h);
  return NcclVersion::FromCode(code);
}

#define SKIP_WITHOUT_NCCL(info)                                                  \
  if (!(info).ok() && (info).status().code() == absl::StatusCode::kNotFound) {   \
    GTEST_SKIP() << "no libnccl on this machine: " << (info).status().message(); \
  }

TEST(ProbeNcclLibrary, FindsTheLoadersFileAndLeavesNothingMapped) {
  ASSERT_THAT(MappedNcclLibraries(), IsEmpty());
  absl::StatusOr<NcclLibraryInfo> info = FindNcclLibrary();
  SKIP_WITHOUT_NCCL(info);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(fs::path(info->path).is_absolute()) << info->path;
  EXPECT_EQ(info->path, RealPath(info->path));
  EXPECT_TRUE(info->source == NcclLibrarySource::kSearchPath ||
              info->source == NcclLibrarySource::kBuiltAgainst)
      << NcclLibrarySourceName(info->source);
  if (info->source == NcclLibrarySource::kSearchPath) {
    EXPECT_THAT(info->reason, HasSubstr("libnccl.so.2 found via the dynamic loader's search path"));
    // The reference: what dlopen("libnccl.so.2") from here maps.
    void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    ASSERT_NE(h, nullptr);
    struct link_map* map = nullptr;
    ASSERT_EQ(dlinfo(h, RTLD_DI_LINKMAP, &map), 0);
    EXPECT_EQ(RealPath(map->l_name), info->path);
    dlclose(h);
  }
  // A report leaves nothing behind that torch could collide with.
  EXPECT_THAT(MappedNcclLibraries(), IsEmpty());
  EXPECT_EQ(info->version, VersionOf(info->path));
  // LoadedNcclVersion is the same answer.
  absl::StatusOr<NcclVersion> v = LoadedNcclVersion();
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, info->version);
}

TEST(ProbeNcclLibrary, HonoursStrataNcclLibrary) {
  absl::StatusOr<NcclLibraryInfo> found = FindNcclLibrary();
  SKIP_WITHOUT_NCCL(found);
  ASSERT_TRUE(found.ok()) << found.status();
  setenv("STRATA_NCCL_LIBRARY", found->path.c_str(), 1);
  absl::StatusOr<NcclLibraryInfo> info = FindNcclLibrary();
  unsetenv("STRATA_NCCL_LIBRARY");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->source, NcclLibrarySource::kEnvironment);
  EXPECT_EQ(info->reason, "STRATA_NCCL_LIBRARY=" + found->path);
  EXPECT_EQ(info->path, found->path);
  // A name that does not load says what was tried, and why.
  setenv("STRATA_NCCL_LIBRARY", "/nonexistent/libnccl.so.2", 1);
  info = FindNcclLibrary();
  unsetenv("STRATA_NCCL_LIBRARY");
  ASSERT_EQ(info.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(
      info.status().message(),
      HasSubstr("/nonexistent/libnccl.so.2 (STRATA_NCCL_LIBRARY=/nonexistent/libnccl.so.2)"));
}

TEST(ProbeNcclLibrary, ACopySomebodyOpenedIsTheOne) {
  absl::StatusOr<NcclLibraryInfo> found = FindNcclLibrary();
  SKIP_WITHOUT_NCCL(found);
  ASSERT_TRUE(found.ok()) << found.status();
  void* h = dlopen(found->path.c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(h, nullptr);
  absl::StatusOr<NcclLibraryInfo> info = FindNcclLibrary();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->source, NcclLibrarySource::kAlreadyLoaded);
  EXPECT_THAT(info->reason, HasSubstr("opened with dlopen before strata looked"));
  EXPECT_EQ(info->path, found->path);
  // Still mapped (by us), and only once.
  EXPECT_EQ(MappedNcclLibraries().size(), 1u);
  dlclose(h);
}

#ifdef STRATA_NCCL_LINKER_FIXTURE
// A library that links libnccl (as libtorch_cuda.so does) maps it; the
// reason names that library.
TEST(ProbeNcclLibrary, ALibraryThatLinksNcclIsNamed) {
  void* h = dlopen(STRATA_NCCL_LINKER_FIXTURE, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(h, nullptr) << dlerror();
  const std::vector<MappedLibrary> mapped = MappedNcclLibraries(/*with_linkers=*/true);
  ASSERT_EQ(mapped.size(), 1u);
  EXPECT_EQ(mapped[0].needed_by, STRATA_NCCL_LINKER_FIXTURE);
  absl::StatusOr<NcclLibraryInfo> info = FindNcclLibrary();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->source, NcclLibrarySource::kAlreadyLoaded);
  EXPECT_EQ(info->reason, std::string("already loaded in this process (") +
                              STRATA_NCCL_LINKER_FIXTURE + " links it)");
  EXPECT_EQ(info->path, mapped[0].real_path);
  EXPECT_EQ(info->version, VersionOf(info->path));
  // strata-topo's report says the same, in text and JSON.
  TopoReportOptions o;
  o.detect.sysfs_root = std::string(STRATA_TOPOLOGY_FIXTURES) + "/dgx_h100/sys";
  o.detect.use_nvml = false;
  o.read_conf_files = false;
  o.environment = std::map<std::string, std::string>{};
  absl::StatusOr<TopoReport> r = BuildTopoReport(o);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->nccl_library.has_value());
  EXPECT_EQ(r->nccl_library->path, info->path);
  EXPECT_EQ(r->nccl_version, info->version);
  const std::string text = RenderTopoReportText(*r);
  EXPECT_THAT(text, HasSubstr("NCCL " + info->version.ToString() + " from " + info->path +
                              "\n  why this file: " + info->reason));
  const std::string json = RenderTopoReportJson(*r);
  EXPECT_THAT(json, HasSubstr("\"source\": \"already-loaded\""));
  EXPECT_THAT(json, HasSubstr("\"path\": \"" + info->path + "\""));
  dlclose(h);
}
#endif

TEST(TopoReport, AGivenVersionLoadsNothingAndSaysSo) {
  TopoReportOptions o;
  o.detect.sysfs_root = std::string(STRATA_TOPOLOGY_FIXTURES) + "/dgx_h100/sys";
  o.detect.use_nvml = false;
  o.read_conf_files = false;
  o.environment = std::map<std::string, std::string>{};
  o.nccl_version = NcclVersion{2, 21, 5};
  absl::StatusOr<TopoReport> r = BuildTopoReport(o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->nccl_library.has_value());
  EXPECT_THAT(RenderTopoReportText(*r),
              HasSubstr("NCCL 2.21.5 (given; no libnccl was loaded for this report)"));
  EXPECT_THAT(RenderTopoReportJson(*r), HasSubstr("\"nccl_library\": null"));
  EXPECT_THAT(MappedNcclLibraries(), IsEmpty());
}

}  // namespace
}  // namespace strata::nccl
