// LaunchEnv: who this process is in the job, read from the launcher's
// environment variables.
//
// strata runs under mpirun (Open MPI), torchrun, Slurm's srun, or as a single
// process with no launcher. Each launcher describes the job with its own
// variables; LaunchEnv reads them and returns one answer:
//
//   absl::StatusOr<strata::LaunchEnv> env = strata::LaunchEnv::Detect();
//   if (!env.ok()) { /* the message names the variables and values */ }
//   std::printf("rank %d of %d (%s)\n", env->rank, env->world_size,
//               strata::LauncherName(env->launcher));
//
// Launchers nest (torchrun started by srun, mpirun inside an sbatch job), so
// several sets of variables may be present. The innermost launcher describes
// this process: torchrun, then mpirun, then Slurm. STRATA_LAUNCHER
// (none|mpirun|torchrun|slurm) forces one. Two launchers that describe the
// same world size but give this process different ranks are an error (a
// stale RANK exported in the shell, say); launchers with different world sizes
// are nested and the outer one is ignored.
//
// Thread-safety: LaunchEnv is a plain value. Detect() reads the environment
// and is safe to call concurrently with other readers of it.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "strata/base/export.h"

namespace strata {

enum class Launcher { kNone, kMpirun, kTorchrun, kSlurm };

// "none", "mpirun", "torchrun" or "slurm".
STRATA_EXPORT const char* LauncherName(Launcher launcher);

struct STRATA_EXPORT LaunchEnv {
  Launcher launcher = Launcher::kNone;
  int rank = 0;
  int world_size = 1;
  // This process's index among the ranks of its node, in
  // [0, local_world_size), unique on the node. Launchers promise no order
  // between local and global ranks: under Open MPI 5, rank 1 may be local
  // rank 2 (it numbers a node's ranks by the objects it maps them to).
  int local_rank = 0;
  int local_world_size = 1;
  // Index of this process's node in [0, num_nodes). torchrun (GROUP_RANK,
  // GROUP_WORLD_SIZE) and Slurm (SLURM_NODEID, SLURM_STEP_NUM_NODES) give it.
  // mpirun does not: when the node holds every rank it is node 0 of 1
  // (exact); otherwise it is rank / local_world_size, which assumes the ranks
  // fill the nodes in blocks of equal size (mpirun's default by-slot
  // placement), and node_index_exact is false. Nothing in strata relies on
  // an inexact value.
  int node_index = 0;
  int num_nodes = 1;
  bool node_index_exact = true;
  // Rendezvous address for store-based bootstrap (torchrun's MASTER_ADDR and
  // MASTER_PORT; under Slurm, MASTER_ADDR or the first host of the node list
  // and MASTER_PORT if set). Empty host / port 0 when the launcher provides
  // none (mpirun bootstraps through MPI).
  std::string master_addr;
  int master_port = 0;
  // Where each field came from, for messages: e.g. "rank from OMPI_COMM_WORLD_RANK".
  std::string source;

  // Reads the process environment.
  static absl::StatusOr<LaunchEnv> Detect();

  // Reads variables through `getenv` (returns nullopt for unset ones), so
  // tests and embedders can supply an environment of their own.
  using EnvLookup = std::function<std::optional<std::string>(absl::string_view)>;
  static absl::StatusOr<LaunchEnv> Detect(const EnvLookup& getenv);
  static absl::StatusOr<LaunchEnv> Detect(const std::map<std::string, std::string>& env);

  // One line, e.g. "rank 3/8 local 3/8 node 0/1 via mpirun".
  std::string ToString() const;
};

// Returns the first host name of a Slurm node list such as
// "gpu[003-005,010],cpu1" ("gpu003"). InvalidArgument on malformed input.
STRATA_EXPORT absl::StatusOr<std::string> FirstHostOfSlurmNodeList(absl::string_view nodelist);

// Returns the number of tasks on node `node_index` from SLURM_TASKS_PER_NODE
// syntax such as "2(x3),1" (nodes 0-2 run 2 tasks, node 3 runs 1).
STRATA_EXPORT absl::StatusOr<int> SlurmTasksOnNode(absl::string_view tasks_per_node,
                                                   int node_index);

}  // namespace strata
