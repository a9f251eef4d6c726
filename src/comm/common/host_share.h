// How many of this job's ranks share this host, and how many cores they
// have: whether the ranks outnumber the cores (then a waiting rank must give
// its core to one that computes instead of polling).
//
//   HostShare share = DetectHostShare();
//   if (share.oversubscribed()) ...   // share.Describe() says why
//
// The cores are the fewest of: the online CPUs, the CPUs this process may
// run on (sched_getaffinity), and the CPU quota of its cgroup (v2 cpu.max
// or v1 cpu.cfs_quota_us / cpu.cfs_period_us, along the cgroup's ancestors,
// rounded up). The local ranks come from the launcher: Open MPI's
// OMPI_COMM_WORLD_LOCAL_SIZE, else Slurm's SLURM_STEP_TASKS_PER_NODE (for
// this node, SLURM_NODEID, read by strata::SlurmTasksOnNode), else torchrun's
// LOCAL_WORLD_SIZE. (STRATA_OVERSUBSCRIBED, which overrides the answer, is a
// setting: CreateRootCommunicator puts it into MpiOptions::oversubscribed.)
//
// Thread-safety: the functions are thread-safe (they read files and the
// environment).
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace strata::comm_internal {

struct HostShare {
  int local_ranks = 0;  // 0: unknown
  int cores = 0;
  std::string cores_from;  // "online CPUs", "CPU affinity", "cgroup quota ..."
  // Why the launcher's description of this host could not be read (a
  // malformed SLURM_STEP_TASKS_PER_NODE, say); empty when it could.
  std::string invalid_env;
  bool oversubscribed() const;
  // "4 ranks on this host, 2 cores (cgroup quota 2.0 CPUs): oversubscribed".
  std::string Describe() const;
};

// The CPU quota in CPUs of the cgroup that /proc/self/cgroup's text
// `self_cgroup` names under the hierarchy mounted at `cgroup_root` (usually
// /sys/fs/cgroup), the tightest along its ancestors; nullopt without one.
std::optional<double> CgroupCpuQuota(absl::string_view self_cgroup, const std::string& cgroup_root);

// From the given environment lookup (nullptr when unset), the online and
// allowed CPU counts, and the cgroup quota.
HostShare ComputeHostShare(const std::function<const char*(const char*)>& getenv, int online_cpus,
                           int allowed_cpus, std::optional<double> quota);

// This process's share, from its environment, /proc and /sys.
HostShare DetectHostShare();

}  // namespace strata::comm_internal
