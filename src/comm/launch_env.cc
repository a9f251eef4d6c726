#include "strata/comm/launch_env.h"

#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "strata/base/settings.h"
#include "strata/base/status.h"

namespace strata {
namespace {

// Reads variables and records the ones it used, so every message can quote
// the exact values it was given.
class VarReader {
 public:
  explicit VarReader(const LaunchEnv::EnvLookup& getenv) : getenv_(getenv) {}

  bool Has(absl::string_view name) const { return getenv_(name).has_value(); }

  std::optional<std::string> Get(absl::string_view name) {
    std::optional<std::string> value = getenv_(name);
    if (value) used_.push_back(absl::StrCat(name, "=", *value));
    return value;
  }

  // An integer variable; `required` makes absence an error.
  absl::StatusOr<std::optional<int>> Int(absl::string_view name, bool required,
                                         absl::string_view launcher) {
    std::optional<std::string> value = Get(name);
    if (!value) {
      if (!required) return std::optional<int>();
      return absl::InvalidArgumentError(
          absl::StrCat(launcher, " launch detected (", Used(), ") but ", name, " is not set"));
    }
    int parsed = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(*value), &parsed)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, "='", *value, "' is not an integer (", launcher, " launch)"));
    }
    return std::optional<int>(parsed);
  }

  absl::StatusOr<int> RequiredInt(absl::string_view name, absl::string_view launcher) {
    STRATA_ASSIGN_OR_RETURN(std::optional<int> v, Int(name, true, launcher));
    return *v;
  }

  std::string Used() const { return absl::StrJoin(used_, " "); }

 private:
  const LaunchEnv::EnvLookup& getenv_;
  std::vector<std::string> used_;
};

// Checks the ranges every launcher guarantees, and nothing more: a local
// rank is unique on its node and below the local world size, but no launcher
// promises an order between local and global ranks (Open MPI 5 numbers the
// ranks of a node by the objects it maps them to, so under plain
// `mpirun -np 4` rank 1 can be local rank 2; torchrun's docs warn against
// assuming any correlation between RANK and LOCAL_RANK).
absl::Status Validate(const LaunchEnv& env, const VarReader& vars) {
  auto fail = [&](std::string what) {
    return absl::InvalidArgumentError(absl::StrCat("inconsistent ", LauncherName(env.launcher),
                                                   " environment: ", what, " (", vars.Used(), ")"));
  };
  if (env.world_size < 1) return fail(absl::StrCat("world size ", env.world_size, " < 1"));
  if (env.rank < 0 || env.rank >= env.world_size)
    return fail(absl::StrCat("rank ", env.rank, " is not in [0, world size ", env.world_size, ")"));
  if (env.local_world_size < 1 || env.local_world_size > env.world_size)
    return fail(absl::StrCat("local world size ", env.local_world_size,
                             " is not in [1, world size ", env.world_size, "]"));
  if (env.local_rank < 0 || env.local_rank >= env.local_world_size)
    return fail(absl::StrCat("local rank ", env.local_rank, " is not in [0, local world size ",
                             env.local_world_size, ")"));
  if (env.num_nodes < 1 || env.node_index < 0 || env.node_index >= env.num_nodes)
    return fail(
        absl::StrCat("node index ", env.node_index, " is not in [0, nodes ", env.num_nodes, ")"));
  if (env.master_port < 0 || env.master_port > 65535)
    return fail(absl::StrCat("port ", env.master_port, " is not in [1, 65535]"));
  return absl::OkStatus();
}

// For launchers that give no node index (mpirun; torch-style variables
// without GROUP_RANK). When this node holds every rank, node 0 of 1 is exact.
// Otherwise the index assumes the ranks fill the nodes in blocks of
// local_world_size consecutive ranks (mpirun's default by-slot placement on
// equal nodes): rank / local_world_size. It does not use the local rank,
// whose order within a node is the launcher's own.
void DeriveNodes(LaunchEnv& env) {
  if (env.local_world_size == env.world_size) {
    env.node_index = 0;
    env.num_nodes = 1;
    env.node_index_exact = true;
    return;
  }
  env.node_index = env.rank / env.local_world_size;
  env.num_nodes = (env.world_size + env.local_world_size - 1) / env.local_world_size;
  env.node_index_exact = false;
}

absl::StatusOr<int> ParsePort(VarReader& vars, absl::string_view name, absl::string_view launcher) {
  STRATA_ASSIGN_OR_RETURN(int port, vars.RequiredInt(name, launcher));
  if (port < 1 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, "=", port, " is not a TCP port in [1, 65535] (", launcher, " launch)"));
  }
  return port;
}

// Each reader returns nullopt when its launcher's variables are absent.
using Claim = absl::StatusOr<std::optional<LaunchEnv>>;

Claim ReadMpirun(const LaunchEnv::EnvLookup& getenv) {
  VarReader vars(getenv);
  if (!vars.Has("OMPI_COMM_WORLD_RANK") && !vars.Has("OMPI_COMM_WORLD_SIZE")) {
    return std::optional<LaunchEnv>();
  }
  LaunchEnv env;
  env.launcher = Launcher::kMpirun;
  STRATA_ASSIGN_OR_RETURN(env.rank, vars.RequiredInt("OMPI_COMM_WORLD_RANK", "mpirun"));
  STRATA_ASSIGN_OR_RETURN(env.world_size, vars.RequiredInt("OMPI_COMM_WORLD_SIZE", "mpirun"));
  STRATA_ASSIGN_OR_RETURN(env.local_rank, vars.RequiredInt("OMPI_COMM_WORLD_LOCAL_RANK", "mpirun"));
  STRATA_ASSIGN_OR_RETURN(env.local_world_size,
                          vars.RequiredInt("OMPI_COMM_WORLD_LOCAL_SIZE", "mpirun"));
  if (env.local_world_size >= 1 && env.world_size >= 1) DeriveNodes(env);
  env.source = vars.Used();
  STRATA_RETURN_IF_ERROR(Validate(env, vars));
  return std::optional<LaunchEnv>(env);
}

Claim ReadTorchrun(const LaunchEnv::EnvLookup& getenv) {
  VarReader vars(getenv);
  if (!vars.Has("RANK") && !vars.Has("WORLD_SIZE")) return std::optional<LaunchEnv>();
  LaunchEnv env;
  env.launcher = Launcher::kTorchrun;
  STRATA_ASSIGN_OR_RETURN(env.rank, vars.RequiredInt("RANK", "torchrun"));
  STRATA_ASSIGN_OR_RETURN(env.world_size, vars.RequiredInt("WORLD_SIZE", "torchrun"));
  STRATA_ASSIGN_OR_RETURN(std::optional<int> local_rank, vars.Int("LOCAL_RANK", false, "torchrun"));
  STRATA_ASSIGN_OR_RETURN(std::optional<int> local_world,
                          vars.Int("LOCAL_WORLD_SIZE", false, "torchrun"));
  if (local_rank.has_value() != local_world.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("torchrun launch: LOCAL_RANK and LOCAL_WORLD_SIZE must be set together (",
                     vars.Used(), ")"));
  }
  // A hand-made launch (RANK/WORLD_SIZE/MASTER_* only) is taken as one node.
  env.local_rank = local_rank.value_or(env.rank);
  env.local_world_size = local_world.value_or(env.world_size);
  STRATA_ASSIGN_OR_RETURN(std::optional<int> group_rank, vars.Int("GROUP_RANK", false, "torchrun"));
  STRATA_ASSIGN_OR_RETURN(std::optional<int> group_world,
                          vars.Int("GROUP_WORLD_SIZE", false, "torchrun"));
  if (env.local_world_size >= 1 && env.world_size >= 1) DeriveNodes(env);
  if (!local_rank) env.node_index_exact = false;  // an assumption, not the launcher's word
  // torchrun's GROUP_RANK is the rank of this node's agent (one worker group
  // per node), GROUP_WORLD_SIZE the number of agents: exact.
  if (group_rank && group_world) {
    env.node_index = *group_rank;
    env.num_nodes = *group_world;
    env.node_index_exact = true;
  }
  std::optional<std::string> addr = vars.Get("MASTER_ADDR");
  if (!addr || addr->empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("torchrun launch detected (", vars.Used(), ") but MASTER_ADDR is not set"));
  }
  env.master_addr = *addr;
  if (!vars.Has("MASTER_PORT")) {
    return absl::InvalidArgumentError(
        absl::StrCat("torchrun launch detected (", vars.Used(), ") but MASTER_PORT is not set"));
  }
  STRATA_ASSIGN_OR_RETURN(env.master_port, ParsePort(vars, "MASTER_PORT", "torchrun"));
  env.source = vars.Used();
  STRATA_RETURN_IF_ERROR(Validate(env, vars));
  return std::optional<LaunchEnv>(env);
}

Claim ReadSlurm(const LaunchEnv::EnvLookup& getenv) {
  VarReader vars(getenv);
  if (!vars.Has("SLURM_PROCID")) return std::optional<LaunchEnv>();
  LaunchEnv env;
  env.launcher = Launcher::kSlurm;
  // srun describes the job step (the processes it started) with SLURM_STEP_*
  // and, unless --preserve-env, also with SLURM_NTASKS / SLURM_NNODES; the
  // step's own variables win. SLURM_NODEID and SLURM_LOCALID are relative
  // to the step, as is SLURM_STEP_TASKS_PER_NODE.
  auto first_set = [&vars](std::initializer_list<const char*> names) {
    for (const char* name : names) {
      if (vars.Has(name)) return name;
    }
    return *names.begin();
  };
  STRATA_ASSIGN_OR_RETURN(env.rank, vars.RequiredInt("SLURM_PROCID", "slurm"));
  const char* ntasks = first_set({"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"});
  STRATA_ASSIGN_OR_RETURN(env.world_size, vars.RequiredInt(ntasks, "slurm"));
  STRATA_ASSIGN_OR_RETURN(env.local_rank, vars.RequiredInt("SLURM_LOCALID", "slurm"));
  STRATA_ASSIGN_OR_RETURN(env.node_index, vars.RequiredInt("SLURM_NODEID", "slurm"));
  const char* nnodes = first_set({"SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"});
  STRATA_ASSIGN_OR_RETURN(std::optional<int> num_nodes, vars.Int(nnodes, false, "slurm"));
  env.num_nodes = num_nodes.value_or(env.node_index + 1);
  const char* per_node =
      vars.Has("SLURM_STEP_TASKS_PER_NODE") ? "SLURM_STEP_TASKS_PER_NODE" : "SLURM_TASKS_PER_NODE";
  if (std::optional<std::string> tpn = vars.Get(per_node)) {
    absl::StatusOr<int> local = SlurmTasksOnNode(*tpn, env.node_index);
    if (!local.ok()) return internal::Annotate(local.status(), per_node);
    env.local_world_size = *local;
  } else {
    // Without the step's layout: an even spread, rounded up, and at least
    // enough for this task's local id.
    env.local_world_size = std::max(
        env.local_rank + 1, (env.world_size + env.num_nodes - 1) / std::max(env.num_nodes, 1));
  }
  if (std::optional<std::string> addr = vars.Get("MASTER_ADDR")) {
    env.master_addr = *addr;
  } else {
    const char* list_var =
        vars.Has("SLURM_STEP_NODELIST") ? "SLURM_STEP_NODELIST" : "SLURM_JOB_NODELIST";
    if (std::optional<std::string> list = vars.Get(list_var)) {
      absl::StatusOr<std::string> host = FirstHostOfSlurmNodeList(*list);
      if (!host.ok()) return internal::Annotate(host.status(), list_var);
      env.master_addr = *host;
    }
  }
  if (vars.Has("MASTER_PORT")) {
    STRATA_ASSIGN_OR_RETURN(env.master_port, ParsePort(vars, "MASTER_PORT", "slurm"));
  }
  env.source = vars.Used();
  STRATA_RETURN_IF_ERROR(Validate(env, vars));
  return std::optional<LaunchEnv>(env);
}

}  // namespace

const char* LauncherName(Launcher launcher) {
  switch (launcher) {
    case Launcher::kNone:
      return "none";
    case Launcher::kMpirun:
      return "mpirun";
    case Launcher::kTorchrun:
      return "torchrun";
    case Launcher::kSlurm:
      return "slurm";
  }
  return "unknown";
}

absl::StatusOr<LaunchEnv> LaunchEnv::Detect() {
  return Detect([](absl::string_view name) -> std::optional<std::string> {
    const char* v = std::getenv(std::string(name).c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  });
}

absl::StatusOr<LaunchEnv> LaunchEnv::Detect(const std::map<std::string, std::string>& env) {
  return Detect([&env](absl::string_view name) -> std::optional<std::string> {
    auto it = env.find(std::string(name));
    if (it == env.end()) return std::nullopt;
    return it->second;
  });
}

absl::StatusOr<LaunchEnv> LaunchEnv::Detect(const EnvLookup& getenv) {
  struct Reader {
    Launcher launcher;
    Claim (*read)(const EnvLookup&);
  };
  // Innermost launcher first (see the header).
  const Reader readers[] = {{Launcher::kTorchrun, &ReadTorchrun},
                            {Launcher::kMpirun, &ReadMpirun},
                            {Launcher::kSlurm, &ReadSlurm}};

  // STRATA_LAUNCHER through the settings registry, which rejects a value
  // that names no launcher.
  STRATA_ASSIGN_OR_RETURN(const Settings settings, Settings::FromLookup(getenv));
  if (!settings.launcher.empty()) {
    if (settings.launcher == "none") return LaunchEnv();
    for (const Reader& r : readers) {
      if (settings.launcher != LauncherName(r.launcher)) continue;
      STRATA_ASSIGN_OR_RETURN(std::optional<LaunchEnv> env, r.read(getenv));
      if (!env) {
        return absl::InvalidArgumentError(
            absl::StrCat("STRATA_LAUNCHER=", settings.launcher,
                         " but none of that launcher's variables are set"));
      }
      return *env;
    }
  }

  std::optional<LaunchEnv> chosen;
  for (const Reader& r : readers) {
    Claim claim = r.read(getenv);
    if (!chosen) {
      if (!claim.ok()) return claim.status();
      chosen = *claim;
      continue;
    }
    // An outer launcher: only a same-sized world with another rank is a
    // contradiction; a malformed outer launcher does not describe us.
    if (!claim.ok() || !claim->has_value()) continue;
    const LaunchEnv& other = **claim;
    if (other.world_size == chosen->world_size && other.rank != chosen->rank) {
      return absl::InvalidArgumentError(absl::StrCat(
          "launchers disagree: ", LauncherName(chosen->launcher), " says rank ", chosen->rank,
          " of ", chosen->world_size, " (", chosen->source, ") but ", LauncherName(other.launcher),
          " says rank ", other.rank, " of ", other.world_size, " (", other.source,
          "); unset the stale variables or set STRATA_LAUNCHER to the launcher in charge"));
    }
  }
  return chosen ? *chosen : LaunchEnv();
}

std::string LaunchEnv::ToString() const {
  std::string s =
      absl::StrCat("rank ", rank, "/", world_size, " local ", local_rank, "/", local_world_size,
                   " node ", node_index, "/", num_nodes, " via ", LauncherName(launcher));
  if (!master_addr.empty()) absl::StrAppend(&s, " rendezvous ", master_addr, ":", master_port);
  return s;
}

absl::StatusOr<std::string> FirstHostOfSlurmNodeList(absl::string_view nodelist) {
  nodelist = absl::StripAsciiWhitespace(nodelist);
  if (nodelist.empty()) return absl::InvalidArgumentError("empty Slurm node list");
  // The first entry ends at a comma outside brackets.
  size_t end = 0;
  int depth = 0;
  for (; end < nodelist.size(); ++end) {
    char c = nodelist[end];
    if (c == '[') ++depth;
    if (c == ']' && --depth < 0) break;
    if (c == ',' && depth == 0) break;
  }
  if (depth != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("unbalanced brackets in Slurm node list '", nodelist, "'"));
  }
  absl::string_view first = nodelist.substr(0, end);
  size_t open = first.find('[');
  if (open == absl::string_view::npos) return std::string(first);
  size_t close = first.find(']', open);
  if (close == absl::string_view::npos || open == 0) {
    return absl::InvalidArgumentError(absl::StrCat("malformed Slurm node list '", nodelist, "'"));
  }
  // "gpu[003-005,010]suffix": take the low end of the first range, keeping
  // its zero padding.
  absl::string_view range = first.substr(open + 1, close - open - 1);
  absl::string_view low = range.substr(0, range.find_first_of(",-"));
  if (low.empty() || low.find_first_not_of("0123456789") != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed range '", range, "' in Slurm node list '", nodelist, "'"));
  }
  return absl::StrCat(first.substr(0, open), low, first.substr(close + 1));
}

absl::StatusOr<int> SlurmTasksOnNode(absl::string_view tasks_per_node, int node_index) {
  if (node_index < 0) {
    return absl::InvalidArgumentError(absl::StrCat("node ", node_index,
                                                   " is not a node of the Slurm tasks-per-node "
                                                   "list '",
                                                   tasks_per_node, "'"));
  }
  // Comma-separated "count" or "count(xrepeat)" entries.
  int node = 0;
  for (absl::string_view part : absl::StrSplit(tasks_per_node, ',')) {
    part = absl::StripAsciiWhitespace(part);
    int count = 0, repeat = 1;
    size_t paren = part.find('(');
    absl::string_view count_str = part.substr(0, paren);
    bool ok = absl::SimpleAtoi(count_str, &count);
    if (ok && paren != absl::string_view::npos) {
      absl::string_view rep = part.substr(paren + 1);
      ok = rep.size() >= 3 && rep[0] == 'x' && rep.back() == ')' &&
           absl::SimpleAtoi(rep.substr(1, rep.size() - 2), &repeat);
    }
    if (!ok || count < 1 || repeat < 1) {
      return absl::InvalidArgumentError(absl::StrCat("malformed Slurm tasks-per-node entry '", part,
                                                     "' in '", tasks_per_node, "'"));
    }
    if (node_index < node + repeat) return count;
    node += repeat;
  }
  return absl::InvalidArgumentError(absl::StrCat("node ", node_index,
                                                 " is beyond the Slurm tasks-per-node list '",
                                                 tasks_per_node, "' (", node, " nodes)"));
}

}  // namespace strata
