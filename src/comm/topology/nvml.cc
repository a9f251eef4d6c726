#include "comm/topology/nvml.h"

#include <dlfcn.h>

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "comm/topology/text_util.h"

namespace strata {
namespace topology_internal {
namespace {

// The few NVML declarations used, from NVML's stable C ABI (nvml.h is not
// needed at build time).
using nvmlReturn_t = int;
using nvmlDevice_t = struct nvmlDevice_st*;
constexpr nvmlReturn_t kNvmlSuccess = 0;
constexpr int kNvmlNameBuffer = 96;

struct NvmlPciInfo {  // nvmlPciInfo_t as filled by the _v3 / _v2 entry points
  char bus_id_legacy[16];
  unsigned int domain;
  unsigned int bus;
  unsigned int device;
  unsigned int pci_device_id;
  unsigned int pci_subsystem_id;
  char bus_id[32];
};

// nvmlGpuTopologyLevel_t values.
PathType FromNvmlLevel(int level) {
  switch (level) {
    case 0:
      return PathType::kSelf;
    case 10:
      return PathType::kPix;
    case 20:
      return PathType::kPxb;
    case 30:
      return PathType::kPhb;
    case 40:
      return PathType::kNode;
    case 50:
      return PathType::kSys;
    default:
      return PathType::kUnknown;
  }
}

constexpr int kNvLinkDeviceTypeSwitch = 2;  // nvmlIntNvLinkDeviceType_t
constexpr int kMaxNvLinks = 64;             // loop bound; NVML reports the real count by error

class Library {
 public:
  explicit Library(void* handle) : handle_(handle) {}
  ~Library() {
    if (shutdown_) shutdown_();
    if (handle_) dlclose(handle_);
  }
  Library(const Library&) = delete;
  Library& operator=(const Library&) = delete;

  template <typename Fn>
  Fn Sym(const char* name) const {
    return reinterpret_cast<Fn>(dlsym(handle_, name));
  }
  void set_shutdown(nvmlReturn_t (*fn)()) { shutdown_ = fn; }

 private:
  void* handle_;
  nvmlReturn_t (*shutdown_)() = nullptr;
};

}  // namespace

absl::StatusOr<NvmlView> ReadNvml(const std::string& library) {
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* err = dlerror();
    return absl::UnavailableError(
        absl::StrCat("cannot load NVML (", library, "): ", err ? err : "unknown error"));
  }
  Library lib(handle);
  auto init = lib.Sym<nvmlReturn_t (*)()>("nvmlInit_v2");
  auto shutdown = lib.Sym<nvmlReturn_t (*)()>("nvmlShutdown");
  auto error_string = lib.Sym<const char* (*)(nvmlReturn_t)>("nvmlErrorString");
  auto count_fn = lib.Sym<nvmlReturn_t (*)(unsigned int*)>("nvmlDeviceGetCount_v2");
  auto by_index =
      lib.Sym<nvmlReturn_t (*)(unsigned int, nvmlDevice_t*)>("nvmlDeviceGetHandleByIndex_v2");
  auto name_fn = lib.Sym<nvmlReturn_t (*)(nvmlDevice_t, char*, unsigned int)>("nvmlDeviceGetName");
  auto pci_fn = lib.Sym<nvmlReturn_t (*)(nvmlDevice_t, NvmlPciInfo*)>("nvmlDeviceGetPciInfo_v3");
  auto ancestor = lib.Sym<nvmlReturn_t (*)(nvmlDevice_t, nvmlDevice_t, int*)>(
      "nvmlDeviceGetTopologyCommonAncestor");
  auto link_state =
      lib.Sym<nvmlReturn_t (*)(nvmlDevice_t, unsigned int, int*)>("nvmlDeviceGetNvLinkState");
  auto remote_pci = lib.Sym<nvmlReturn_t (*)(nvmlDevice_t, unsigned int, NvmlPciInfo*)>(
      "nvmlDeviceGetNvLinkRemotePciInfo_v2");
  auto remote_type = lib.Sym<nvmlReturn_t (*)(nvmlDevice_t, unsigned int, int*)>(
      "nvmlDeviceGetNvLinkRemoteDeviceType");  // absent before R460: then bus ids decide
  if (!init || !shutdown || !count_fn || !by_index || !pci_fn) {
    return absl::UnavailableError(
        absl::StrCat(library, " lacks nvmlInit_v2 / nvmlDeviceGetPciInfo_v3 (driver too old)"));
  }
  auto describe = [&](nvmlReturn_t r) {
    return error_string ? std::string(error_string(r)) : absl::StrCat("error ", r);
  };
  if (nvmlReturn_t r = init(); r != kNvmlSuccess) {
    return absl::UnavailableError(absl::StrCat("NVML did not initialize: ", describe(r)));
  }
  lib.set_shutdown(shutdown);

  unsigned int count = 0;
  if (nvmlReturn_t r = count_fn(&count); r != kNvmlSuccess) {
    return absl::UnavailableError(absl::StrCat("nvmlDeviceGetCount: ", describe(r)));
  }
  NvmlView view;
  std::vector<nvmlDevice_t> devices(count);
  std::map<std::string, int> by_bus;
  for (unsigned int i = 0; i < count; ++i) {
    if (nvmlReturn_t r = by_index(i, &devices[i]); r != kNvmlSuccess) {
      return absl::UnavailableError(
          absl::StrCat("nvmlDeviceGetHandleByIndex(", i, "): ", describe(r)));
    }
    Gpu g;
    g.index = static_cast<int>(i);
    char name[kNvmlNameBuffer] = {0};
    if (name_fn && name_fn(devices[i], name, sizeof(name)) == kNvmlSuccess) g.name = name;
    NvmlPciInfo pci{};
    if (pci_fn(devices[i], &pci) == kNvmlSuccess) g.pci_bus_id = NormalizeBusId(pci.bus_id);
    by_bus[g.pci_bus_id] = static_cast<int>(i);
    view.gpus.push_back(std::move(g));
  }

  // NVLinks: direct GPU-GPU links, and links into NVSwitches.
  std::vector<std::vector<int>> direct(count, std::vector<int>(count, 0));
  std::vector<int> to_switch(count, 0);
  std::set<std::string> switches;
  for (unsigned int i = 0; i < count && link_state && remote_pci; ++i) {
    for (unsigned int l = 0; l < kMaxNvLinks; ++l) {
      int active = 0;
      if (link_state(devices[i], l, &active) != kNvmlSuccess) break;  // past the last link
      if (!active) continue;
      NvmlPciInfo remote{};
      if (remote_pci(devices[i], l, &remote) != kNvmlSuccess) continue;
      std::string bus = NormalizeBusId(remote.bus_id);
      int type = -1;
      if (remote_type) remote_type(devices[i], l, &type);
      auto peer = by_bus.find(bus);
      if (type != kNvLinkDeviceTypeSwitch && peer != by_bus.end()) {
        ++direct[i][peer->second];
      } else {
        ++to_switch[i];
        switches.insert(bus);
      }
    }
  }
  view.nvswitches = static_cast<int>(switches.size());
  view.gpu_links.assign(count, std::vector<Link>(count));
  for (unsigned int i = 0; i < count; ++i) {
    for (unsigned int j = 0; j < count; ++j) {
      Link& link = view.gpu_links[i][j];
      if (i == j) {
        link.type = PathType::kSelf;
        continue;
      }
      int nv = std::max(direct[i][j], std::min(to_switch[i], to_switch[j]));
      if (nv > 0) {
        link = {PathType::kNvLink, nv};
        continue;
      }
      int level = -1;
      if (ancestor && ancestor(devices[i], devices[j], &level) == kNvmlSuccess) {
        link.type = FromNvmlLevel(level);
      }
    }
  }
  return view;
}

}  // namespace topology_internal
}  // namespace strata
