// The state behind a World (include/strata/parallel/world.h): the current
// generation's root, mesh and group communicators, shared with the
// GroupHandles that resolve through it (they hold it weakly, so a handle
// outliving its World fails instead of dangling).
//
// Locks: `create_mu_` serialises what creates or destroys communicators
// (a group's creation, Rebuild, Destroy), which may wait on other ranks;
// `mu_` guards the fields and is held only briefly, never across a
// collective, so lookups and AbortAll never wait for one.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "strata/comm/communicator.h"
#include "strata/parallel/mesh.h"

namespace strata::internal {

// A group name resolved against the axes.
struct GroupName {
  std::string canonical;  // "dp-cp", "world"
  bool expert = false;
  std::string mesh_axes;  // what Mesh::Groups / ExpertGroups takes: "dp-cp", "tp-ep"
  bool world() const { return canonical == "world"; }
};

// Parses "cp-dp", "etp-ep", "world"; InvalidArgument says what is wrong.
absl::StatusOr<GroupName> ParseGroupName(absl::string_view axes);
// Every canonical name, "world" first.
std::vector<std::string> AllGroupNames();

// Whether a lazily created group first checks that every rank asks for it.
enum class Agreement : uint8_t { kNone, kCheck };

// Checks that every rank of `root` asks to create `name` now (see world.h
// for how), within `timeout`. InvalidArgument when they disagree,
// DeadlineExceeded when some rank does not ask in time.
absl::Status AgreeOnGroup(Communicator& root, const std::string& name, uint64_t generation,
                          absl::Duration timeout);

struct ResolvedGroup {
  Communicator* comm = nullptr;
  uint64_t generation = 0;
};

class WorldState {
 public:
  struct Timeouts {
    absl::Duration op;        // default operation timeout of every group
    absl::Duration creation;  // agreement on a group created on request
  };

  // `job`: every process of the job; the first mesh.world_size() of its
  // ranks are the mesh, the others hot spares (world.h).
  WorldState(std::unique_ptr<Communicator> job, Mesh mesh, Timeouts timeouts);
  ~WorldState();

  // Splits the mesh's root off the job communicator (when it has spares:
  // collective over the job, spares included) and creates the standard
  // groups (at World creation).
  absl::Status CreateStandardGroups();

  // The group of `canonical` (a canonical name, see ParseGroupName) in the
  // current generation, created if needed.
  absl::StatusOr<ResolvedGroup> Get(const std::string& canonical);

  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }
  absl::Status status() const;
  Mesh mesh() const;
  // The root communicator (never null): the mesh's ranks; on a spare, the
  // job communicator.
  Communicator* root() const;
  // Every process of the job, spares included (the root when none).
  Communicator* job() const;
  // Whether this rank stands by outside the mesh, and how many do.
  bool spare() const;
  int spares() const;
  std::vector<std::string> GroupNames() const;

  absl::Status Rebuild(std::unique_ptr<Communicator> new_root, const Mesh& new_mesh);
  void AbortAll();
  // Destroys every communicator; later calls fail. Called by ~World.
  void Destroy();

 private:
  struct Entry {
    std::string name;
    std::shared_ptr<Communicator> comm;  // what Group(name) returns
    std::shared_ptr<Communicator> base;  // the communicator it shares, or comm
  };
  using Groups = std::vector<Entry>;

  // Adds `name` to `groups`: an alias of an entry with the same members, or
  // a split of `root` (after an agreement when `agreement` is kCheck).
  absl::Status CreateInto(Communicator& root, const Mesh& mesh, uint64_t generation,
                          const GroupName& name, Agreement agreement, Groups* groups) const;
  // OK, or why the world cannot be used (destroyed, failed rebuild); `what`
  // names the group asked for. Lock held.
  absl::Status Usable(absl::string_view what) const;
  static const Entry* Find(const Groups& groups, const std::string& name);
  // The root, under the name "world".
  static std::shared_ptr<Communicator> WorldAlias(const std::shared_ptr<Communicator>& root);
  // The mesh's root out of `job`: `job` itself without spares, else a split
  // (nullptr on a spare).
  absl::StatusOr<std::shared_ptr<Communicator>> SplitRoot(const std::shared_ptr<Communicator>& job,
                                                          const Mesh& mesh,
                                                          uint64_t generation) const;

  const Timeouts timeouts_;
  std::mutex create_mu_;
  mutable std::shared_mutex mu_;
  std::shared_ptr<Communicator> job_;
  std::shared_ptr<Communicator> root_;   // null on a spare
  std::shared_ptr<Communicator> world_;  // root_, named "world"
  Mesh mesh_;
  Groups groups_;
  // Why the current generation is unusable (a failed Rebuild), or OK.
  absl::Status broken_;
  bool destroyed_ = false;
  bool rebuilding_ = false;
  std::atomic<uint64_t> generation_{1};
};

}  // namespace strata::internal
