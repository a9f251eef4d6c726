#include "comm/common/host_share.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "strata/comm/launch_env.h"

namespace strata::comm_internal {
namespace {

std::optional<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

int PositiveInt(const char* s) {
  int v = 0;
  return s != nullptr && absl::SimpleAtoi(s, &v) && v > 0 ? v : 0;
}

// "/a/b/c" -> "/a/b/c", "/a/b", "/a", "".
std::vector<std::string> SelfAndAncestors(absl::string_view path) {
  std::string p(absl::StripSuffix(path, "/"));
  std::vector<std::string> out;
  while (true) {
    out.push_back(p);
    if (p.empty()) break;
    p.resize(p.rfind('/'));
  }
  return out;
}

// cgroup v2: "max 100000" (no limit) or "<quota> <period>".
std::optional<double> QuotaV2(const std::string& dir) {
  auto text = ReadFile(dir + "/cpu.max");
  if (!text) return std::nullopt;
  std::vector<absl::string_view> f =
      absl::StrSplit(absl::StripAsciiWhitespace(*text), ' ', absl::SkipEmpty());
  double quota = 0, period = 0;
  if (f.size() != 2 || !absl::SimpleAtod(f[0], &quota) || !absl::SimpleAtod(f[1], &period) ||
      quota <= 0 || period <= 0) {
    return std::nullopt;
  }
  return quota / period;
}

// cgroup v1: cpu.cfs_quota_us (-1: no limit) over cpu.cfs_period_us.
std::optional<double> QuotaV1(const std::string& dir) {
  auto quota_text = ReadFile(dir + "/cpu.cfs_quota_us");
  auto period_text = ReadFile(dir + "/cpu.cfs_period_us");
  double quota = 0, period = 0;
  if (!quota_text || !period_text ||
      !absl::SimpleAtod(absl::StripAsciiWhitespace(*quota_text), &quota) ||
      !absl::SimpleAtod(absl::StripAsciiWhitespace(*period_text), &period) || quota <= 0 ||
      period <= 0) {
    return std::nullopt;
  }
  return quota / period;
}

void KeepTightest(std::optional<double>& best, std::optional<double> q) {
  if (q && (!best || *q < *best)) best = q;
}

}  // namespace

bool HostShare::oversubscribed() const {
  return local_ranks > 0 && cores > 0 && local_ranks > cores;
}

std::string HostShare::Describe() const {
  std::string ranks =
      local_ranks > 0 ? absl::StrCat(local_ranks, " ranks on this host") : "ranks per host unknown";
  std::string verdict = oversubscribed() ? "oversubscribed" : "not oversubscribed";
  return absl::StrCat(ranks, ", ", cores, " cores (", cores_from, "): ", verdict);
}

std::optional<double> CgroupCpuQuota(absl::string_view self_cgroup,
                                     const std::string& cgroup_root) {
  std::optional<double> best;
  for (absl::string_view line : absl::StrSplit(self_cgroup, '\n', absl::SkipEmpty())) {
    // "hierarchy-id:controllers:path"
    std::vector<absl::string_view> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    if (f[0] == "0" && f[1].empty()) {  // cgroup v2
      for (const std::string& dir : SelfAndAncestors(f[2])) {
        KeepTightest(best, QuotaV2(cgroup_root + dir));
      }
      continue;
    }
    std::vector<absl::string_view> controllers = absl::StrSplit(f[1], ',');
    if (std::find(controllers.begin(), controllers.end(), "cpu") == controllers.end()) continue;
    for (const std::string& mount : {absl::StrCat(cgroup_root, "/", f[1]), cgroup_root + "/cpu"}) {
      for (const std::string& dir : SelfAndAncestors(f[2])) {
        KeepTightest(best, QuotaV1(mount + dir));
      }
    }
  }
  return best;
}

HostShare ComputeHostShare(const std::function<const char*(const char*)>& getenv, int online_cpus,
                           int allowed_cpus, std::optional<double> quota) {
  HostShare share;
  share.cores = std::max(online_cpus, 1);
  share.cores_from = "online CPUs";
  if (allowed_cpus > 0 && allowed_cpus < share.cores) {
    share.cores = allowed_cpus;
    share.cores_from = "CPU affinity";
  }
  if (quota) {
    const int q = std::max(1, static_cast<int>(std::ceil(*quota - 1e-9)));
    if (q < share.cores) {
      share.cores = q;
      share.cores_from = absl::StrCat("cgroup quota ", *quota, " CPUs");
    }
  }
  share.local_ranks = PositiveInt(getenv("OMPI_COMM_WORLD_LOCAL_SIZE"));
  if (share.local_ranks == 0) {
    const char* spec = getenv("SLURM_STEP_TASKS_PER_NODE");
    const char* node = getenv("SLURM_NODEID");
    int node_id = -1;
    if (spec != nullptr && node != nullptr) {
      if (!absl::SimpleAtoi(node, &node_id)) {
        share.invalid_env = absl::StrCat("SLURM_NODEID='", node, "' is not an integer");
      } else if (absl::StatusOr<int> tasks = SlurmTasksOnNode(spec, node_id); tasks.ok()) {
        share.local_ranks = *tasks;
      } else {
        share.invalid_env = absl::StrCat("SLURM_STEP_TASKS_PER_NODE: ", tasks.status().message());
      }
    }
  }
  if (share.local_ranks == 0) share.local_ranks = PositiveInt(getenv("LOCAL_WORLD_SIZE"));
  return share;
}

HostShare DetectHostShare() {
  cpu_set_t set;
  CPU_ZERO(&set);
  const int allowed = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 0;
  std::optional<double> quota;
  if (auto self = ReadFile("/proc/self/cgroup")) quota = CgroupCpuQuota(*self, "/sys/fs/cgroup");
  return ComputeHostShare([](const char* name) { return std::getenv(name); },
                          static_cast<int>(std::thread::hardware_concurrency()), allowed, quota);
}

}  // namespace strata::comm_internal
