#include "comm/nccl_locate.h"

#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <stdlib.h>

#include <climits>
#include <cstdlib>
#include <fstream>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "strata/base/settings.h"
#include "strata/base/status.h"

namespace strata::nccl {
namespace {

constexpr char kSoname[] = "libnccl.so.2";

std::string Dirname(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

std::string Paths(absl::Span<const MappedLibrary> mapped) {
  return absl::StrJoin(mapped, ", ", [](std::string* out, const MappedLibrary& m) {
    absl::StrAppend(out, m.real_path);
  });
}

// Every object mapped into the process, by the name the loader recorded (the
// program itself as /proc/self/exe).
int CollectObjects(struct dl_phdr_info* info, size_t, void* data) {
  auto* out = static_cast<std::vector<std::string>*>(data);
  if (info->dlpi_name == nullptr || *info->dlpi_name == '\0') {
    if (out->empty()) out->push_back("/proc/self/exe");  // the program comes first
    return 0;
  }
  out->push_back(info->dlpi_name);
  return 0;
}

std::string AlreadyLoadedReason(const MappedLibrary& m) {
  if (m.needed_by.empty()) {
    return "already loaded in this process (opened with dlopen before strata looked)";
  }
  const bool torch = absl::StrContains(m.needed_by, "/torch/lib/");
  return absl::StrCat("already loaded in this process", torch ? " by torch" : "", " (", m.needed_by,
                      " links it)");
}

#ifdef STRATA_NCCL_BUILT_LIBRARY
constexpr char kBuiltLibrary[] = STRATA_NCCL_BUILT_LIBRARY;
#else
constexpr char kBuiltLibrary[] = "";
#endif
#ifdef STRATA_NCCL_BUILT_ORIGIN
constexpr char kBuiltOrigin[] = STRATA_NCCL_BUILT_ORIGIN;
#else
constexpr char kBuiltOrigin[] = "";
#endif

// "/a/b/" -> "/a/b", "" -> "." (the loader's reading of an empty entry).
std::string NormalizeDir(absl::string_view dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.remove_suffix(1);
  return dir.empty() ? "." : std::string(dir);
}

// The directories the loader searches for a bare name asked for by the
// object that holds this code (libstrata.so, or a program linking
// strata_testing), in order, each labelled; `requester` gets that object.
std::vector<SearchDir> LoaderSearchDirs(std::string* requester) {
  Dl_info self;
  void* handle = nullptr;
  if (dladdr(reinterpret_cast<void*>(&LoaderSearchDirs), &self) != 0 && self.dli_fname != nullptr) {
    handle = dlopen(self.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (handle != nullptr) *requester = RealPath(self.dli_fname);
  }
  if (handle == nullptr) {  // the program itself
    handle = dlopen(nullptr, RTLD_LAZY);
    *requester = RealPath("/proc/self/exe");
  }
  if (handle == nullptr) return {};
  std::vector<std::string> serinfo;
  Dl_serinfo size;
  if (dlinfo(handle, RTLD_DI_SERINFOSIZE, &size) == 0 && size.dls_size >= sizeof(Dl_serinfo)) {
    std::vector<Dl_serinfo> buf(size.dls_size / sizeof(Dl_serinfo) + 1);
    Dl_serinfo* info = buf.data();
    *info = size;  // dls_size and dls_cnt tell dlinfo the buffer's layout
    if (dlinfo(handle, RTLD_DI_SERINFO, info) == 0) {
      for (unsigned i = 0; i < info->dls_cnt; ++i) serinfo.push_back(info->dls_serpath[i].dls_name);
    }
  }
  dlclose(handle);
  std::vector<std::string> runpath;
  for (const std::string& entry : ReadElfDynamic(*requester).runpath) {
    runpath.push_back(absl::StrReplaceAll(
        entry, {{"${ORIGIN}", Dirname(*requester)}, {"$ORIGIN", Dirname(*requester)}}));
  }
  const char* env = std::getenv("LD_LIBRARY_PATH");
  return ClassifySearchDirs(serinfo, env ? env : "", runpath);
}

}  // namespace

std::string RealPath(const std::string& path) {
  char buf[PATH_MAX];
  if (path.empty() || realpath(path.c_str(), buf) == nullptr) return "";
  return buf;
}

bool IsNcclLibraryName(absl::string_view path) {
  const size_t slash = path.rfind('/');
  absl::string_view base = slash == absl::string_view::npos ? path : path.substr(slash + 1);
  if (!absl::ConsumePrefix(&base, "libnccl.so")) return false;
  // "libnccl.so", or "libnccl.so." followed by a version.
  return base.empty() || base[0] == '.';
}

ElfDynamic ReadElfDynamic(const std::string& path) {
  ElfDynamic out;
  std::ifstream f(path, std::ios::binary);
  Elf64_Ehdr eh;
  if (!f.read(reinterpret_cast<char*>(&eh), sizeof(eh)) ||
      std::string(reinterpret_cast<const char*>(eh.e_ident), SELFMAG) != ELFMAG ||
      eh.e_ident[EI_CLASS] != ELFCLASS64 || eh.e_phentsize != sizeof(Elf64_Phdr)) {
    return out;
  }
  std::vector<Elf64_Phdr> ph(eh.e_phnum);
  f.seekg(static_cast<std::streamoff>(eh.e_phoff));
  if (!f.read(reinterpret_cast<char*>(ph.data()),
              static_cast<std::streamsize>(ph.size() * sizeof(Elf64_Phdr)))) {
    return out;
  }
  const Elf64_Phdr* dynamic = nullptr;
  for (const Elf64_Phdr& p : ph) {
    if (p.p_type == PT_DYNAMIC) dynamic = &p;
  }
  if (dynamic == nullptr) return out;
  std::vector<Elf64_Dyn> dyn(dynamic->p_filesz / sizeof(Elf64_Dyn));
  f.seekg(static_cast<std::streamoff>(dynamic->p_offset));
  if (!f.read(reinterpret_cast<char*>(dyn.data()),
              static_cast<std::streamsize>(dyn.size() * sizeof(Elf64_Dyn)))) {
    return out;
  }
  uint64_t strtab = 0, strsz = 0;
  for (const Elf64_Dyn& d : dyn) {
    if (d.d_tag == DT_STRTAB) strtab = d.d_un.d_ptr;
    if (d.d_tag == DT_STRSZ) strsz = d.d_un.d_val;
  }
  // DT_STRTAB is an address: find the loadable segment that holds it.
  int64_t strtab_offset = -1;
  for (const Elf64_Phdr& p : ph) {
    if (p.p_type == PT_LOAD && strtab >= p.p_vaddr && strtab < p.p_vaddr + p.p_filesz) {
      strtab_offset = static_cast<int64_t>(strtab - p.p_vaddr + p.p_offset);
    }
  }
  if (strtab_offset < 0 || strsz == 0 || strsz > (64u << 20)) return out;
  std::string strings(strsz, '\0');
  f.seekg(strtab_offset);
  if (!f.read(strings.data(), static_cast<std::streamsize>(strsz))) return out;
  std::string runpath, rpath;
  bool has_runpath = false;
  for (const Elf64_Dyn& d : dyn) {
    if (d.d_tag == DT_NULL) break;
    if (d.d_un.d_val >= strsz) continue;
    const char* str = strings.c_str() + d.d_un.d_val;
    if (d.d_tag == DT_NEEDED) out.needed.push_back(str);
    if (d.d_tag == DT_RUNPATH) {
      runpath = str;
      has_runpath = true;
    }
    if (d.d_tag == DT_RPATH) rpath = str;
  }
  // The loader ignores DT_RPATH where DT_RUNPATH is present.
  const std::string& path_list = has_runpath ? runpath : rpath;
  if (has_runpath || !rpath.empty()) out.runpath = absl::StrSplit(path_list, ':');
  return out;
}

std::vector<SearchDir> ClassifySearchDirs(absl::Span<const std::string> serinfo,
                                          const std::string& ld_library_path,
                                          absl::Span<const std::string> runpath) {
  std::set<std::string> env_dirs, run_dirs;
  if (!ld_library_path.empty()) {
    for (absl::string_view d : absl::StrSplit(ld_library_path, absl::ByAnyChar(":;"))) {
      env_dirs.insert(NormalizeDir(d));
    }
  }
  for (const std::string& d : runpath) run_dirs.insert(NormalizeDir(d));
  std::vector<SearchDir> out;
  for (const std::string& dir : serinfo) {
    SearchDir d{dir, SearchDir::Kind::kSystem};
    const std::string key = NormalizeDir(dir);
    if (env_dirs.count(key)) {
      d.kind = SearchDir::Kind::kLdLibraryPath;
    } else if (run_dirs.count(key)) {
      d.kind = SearchDir::Kind::kRunpath;
    }
    out.push_back(std::move(d));
  }
  return out;
}

std::vector<MappedLibrary> MappedNcclLibraries(bool with_linkers) {
  std::vector<std::string> objects;
  dl_iterate_phdr(&CollectObjects, &objects);
  std::vector<MappedLibrary> out;
  for (const std::string& name : objects) {
    if (!IsNcclLibraryName(name)) continue;
    MappedLibrary lib{name, RealPath(name), ""};
    if (lib.real_path.empty()) lib.real_path = lib.path;
    bool seen = false;
    for (const MappedLibrary& m : out) seen = seen || m.real_path == lib.real_path;
    if (!seen) out.push_back(std::move(lib));
  }
  if (out.empty() || !with_linkers) return out;
  // Who links it: the first mapped object that names NCCL in DT_NEEDED (with
  // one copy mapped, that is the copy it got; with two, the choice refuses
  // anyway). Only read when a libnccl is mapped, which is rare off GPUs.
  for (const std::string& name : objects) {
    if (IsNcclLibraryName(name)) continue;
    for (const std::string& needed : ReadElfDynamic(name).needed) {
      if (!IsNcclLibraryName(needed)) continue;
      for (MappedLibrary& m : out) {
        if (m.needed_by.empty()) m.needed_by = name == "/proc/self/exe" ? RealPath(name) : name;
      }
    }
  }
  return out;
}

absl::StatusOr<LibraryRequest> RequestFromEnvironment(const std::string& option) {
  STRATA_ASSIGN_OR_RETURN(const Settings settings, Settings::FromEnvironment());
  LibraryRequest request;
  request.option = option;
  request.env = settings.nccl_library;
  request.built = kBuiltLibrary;
  request.built_origin = kBuiltOrigin;
  return request;
}

absl::StatusOr<LibraryChoice> ChooseNcclLibrary(
    absl::Span<const MappedLibrary> mapped, const LibraryRequest& request,
    std::string (*real_path_of)(const std::string& path)) {
  if (mapped.size() > 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "two copies of NCCL are loaded in this process (", Paths(mapped),
        "); NCCL keeps process-wide state, so strata refuses to run with both. Load only one: "
        "in Python import torch first and do not preload another libnccl (LD_PRELOAD, "
        "LD_LIBRARY_PATH pointing at a second NCCL)"));
  }
  const std::string& explicit_request = !request.option.empty() ? request.option : request.env;
  const char* explicit_origin =
      !request.option.empty() ? "NcclOptions::library" : "STRATA_NCCL_LIBRARY";
  LibraryChoice choice;
  choice.request = request;
  if (mapped.size() == 1) {
    if (!explicit_request.empty()) {
      const std::string wanted = real_path_of(explicit_request);
      if (wanted != mapped[0].real_path) {
        return absl::FailedPreconditionError(absl::StrCat(
            explicit_origin, " asks for ", explicit_request,
            wanted.empty() ? " (not found)" : absl::StrCat(" (", wanted, ")"),
            ", but this process already loaded NCCL from ", mapped[0].real_path,
            "; one NCCL per process: unset ", explicit_origin, " to use the loaded one"));
      }
    }
    choice.already_mapped = true;
    choice.candidates.push_back(
        {mapped[0].path, NcclLibrarySource::kAlreadyLoaded, AlreadyLoadedReason(mapped[0])});
    return choice;
  }
  if (!request.option.empty()) {
    choice.candidates.push_back({request.option, NcclLibrarySource::kOption,
                                 "asked for by NcclOptions::library (strata.nccl.library(path))"});
    return choice;
  }
  if (!request.env.empty()) {
    choice.candidates.push_back({request.env, NcclLibrarySource::kEnvironment,
                                 absl::StrCat("STRATA_NCCL_LIBRARY=", request.env)});
    return choice;
  }
  // SearchPathReason makes this precise once the loader has found a file.
  choice.candidates.push_back({kSoname, NcclLibrarySource::kSearchPath,
                               "libnccl.so.2 found via the dynamic loader's search path"});
  if (!request.built.empty()) {
    choice.candidates.push_back(
        {request.built, NcclLibrarySource::kBuiltAgainst,
         absl::StrCat(
             "the library strata was built against",
             request.built_origin.empty() ? "" : absl::StrCat(" (", request.built_origin, ")"),
             "; libnccl.so.2 is not on the dynamic loader's search path")});
  }
  return choice;
}

std::string SearchPathReason(const std::string& found, absl::Span<const SearchDir> dirs,
                             const std::string& requester, const LibraryRequest& request,
                             std::string (*real_path_of)(const std::string& path)) {
  // The loader tries LD_LIBRARY_PATH, then the requester's RUNPATH, then
  // /etc/ld.so.cache, then the system directories: the first entry of the
  // first two that holds libnccl.so.2 is where it was found, if any.
  std::string how;
  for (const SearchDir& d : dirs) {
    if (d.kind == SearchDir::Kind::kSystem) continue;
    const std::string here = real_path_of(absl::StrCat(d.dir, "/", kSoname));
    if (here.empty()) continue;
    if (here != found) break;  // the loader would have taken this one; say nothing false
    how = d.kind == SearchDir::Kind::kLdLibraryPath
              ? absl::StrCat("LD_LIBRARY_PATH entry ", d.dir)
              : absl::StrCat("RUNPATH entry ", d.dir, " of ", requester);
    break;
  }
  if (how.empty()) {
    for (const SearchDir& d : dirs) {
      if (d.kind == SearchDir::Kind::kSystem &&
          real_path_of(absl::StrCat(d.dir, "/", kSoname)) == found) {
        how = absl::StrCat("the ldconfig cache or the system directory ", d.dir);
        break;
      }
    }
  }
  if (how.empty()) {
    how = absl::StrCat("the ldconfig cache (/etc/ld.so.cache lists ", Dirname(found), ")");
  }
  std::string reason =
      absl::StrCat("libnccl.so.2 found via the dynamic loader's search path: ", how);
  if (!request.built.empty() && real_path_of(request.built) == found) {
    absl::StrAppend(
        &reason, "; it is the library strata was built against",
        request.built_origin.empty() ? "" : absl::StrCat(" (", request.built_origin, ")"));
  }
  return reason;
}

absl::StatusOr<OpenedLibrary> OpenNcclLibrary(
    const LibraryChoice& choice, const std::function<absl::Status(void* handle)>& check) {
  std::vector<std::string> failures;
  for (const Candidate& c : choice.candidates) {
    const int flags = RTLD_NOW | RTLD_LOCAL | (choice.already_mapped ? RTLD_NOLOAD : 0);
    void* handle = dlopen(c.path.c_str(), flags);
    if (handle == nullptr) {
      const char* err = dlerror();
      failures.push_back(absl::StrCat(c.path, " (", c.reason, "): ", err ? err : "cannot open"));
      continue;
    }
    // The file the loader found (a bare "libnccl.so.2" names no file).
    struct link_map* map = nullptr;
    std::string file = c.path;
    if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr &&
        *map->l_name != '\0') {
      file = map->l_name;
    }
    const std::string real = RealPath(file).empty() ? file : RealPath(file);
    auto get = reinterpret_cast<int (*)(int*)>(dlsym(handle, "ncclGetVersion"));
    int code = 0;
    if (get == nullptr || get(&code) != 0 || code <= 0) {
      failures.push_back(absl::StrCat(real, " (", c.reason, "): no working ncclGetVersion"));
      dlclose(handle);
      continue;
    }
    if (check) {
      if (absl::Status s = check(handle); !s.ok()) {
        failures.push_back(absl::StrCat(real, " (", c.reason, "): ", s.message()));
        dlclose(handle);
        continue;
      }
    }
    OpenedLibrary out;
    out.handle = handle;
    out.info.path = real;
    out.info.version = NcclVersion::FromCode(code);
    out.info.source = c.source;
    out.info.reason = c.reason;
    if (c.source == NcclLibrarySource::kSearchPath) {
      std::string requester;
      const std::vector<SearchDir> dirs = LoaderSearchDirs(&requester);
      out.info.reason = SearchPathReason(real, dirs, requester, choice.request, &RealPath);
    }
    return out;
  }
  return absl::NotFoundError(
      absl::StrCat("cannot load NCCL; tried: ", absl::StrJoin(failures, "; ")));
}

absl::StatusOr<NcclLibraryInfo> ProbeNcclLibrary(const std::string& option) {
  STRATA_ASSIGN_OR_RETURN(const LibraryRequest request, RequestFromEnvironment(option));
  STRATA_ASSIGN_OR_RETURN(
      LibraryChoice choice,
      ChooseNcclLibrary(MappedNcclLibraries(/*with_linkers=*/true), request, &RealPath));
  STRATA_ASSIGN_OR_RETURN(OpenedLibrary opened, OpenNcclLibrary(choice, nullptr));
  // A report leaves the process as it found it: a copy it had to open is
  // closed again, so that torch, imported later, does not meet a second NCCL.
  dlclose(opened.handle);
  return opened.info;
}

}  // namespace strata::nccl
