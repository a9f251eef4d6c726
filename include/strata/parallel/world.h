// World: the root communicator of a job and one communicator per mesh
// group this rank belongs to, created once, reachable by axis name.
//
// The communication layer knows nothing of meshes; the World is where the
// two meet. It creates the root communicator through the backend factory
// (strata/comm/backend.h) and builds each group by splitting the root
// (color = group index, key = position in the group), so that a group's
// ranks are numbered in the mesh's group order.
//
//   absl::StatusOr<strata::LaunchEnv> env = strata::LaunchEnv::Detect();
//   strata::MeshSpec spec;
//   spec.world_size = env->world_size; spec.tp = 2; spec.pp = 2;
//   absl::StatusOr<strata::Mesh> mesh = strata::Mesh::Create(spec);
//   absl::StatusOr<std::unique_ptr<strata::World>> world =
//       strata::World::Create(*env, *mesh, strata::WorldOptions{});
//   absl::StatusOr<strata::Communicator*> tp = (*world)->Group("tp");
//   (*tp)->AllReduce(buf, buf, strata::ReduceOp::kSum);
//   world->reset();   // tears everything down; Create may run again
//
// Groups created (names as Group() takes them):
//   dense mesh   "tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-dp-cp"
//   expert mesh  "ep", "etp" (expert tensor-parallel), "edp" (expert
//                data-parallel), "etp-ep"
//   plus WorldOptions::extra_groups (dense combinations such as "tp-cp").
// A combination may be written in any order ("cp-dp" is "dp-cp"). Groups
// with the same members on every rank (e.g. "dp" and "dp-cp" when cp = 1)
// share one communicator.
//
// Thread-safety: a World is immutable after Create; Group() may be called
// from any thread. The communicators follow Communicator's rules.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "strata/base/export.h"
#include "strata/comm/backend.h"
#include "strata/comm/communicator.h"
#include "strata/comm/launch_env.h"
#include "strata/parallel/mesh.h"

namespace strata {

struct STRATA_EXPORT WorldOptions {
  static constexpr int kVersion = 1;
  int version = kVersion;
  // Root communicator: backend ("auto", "mpi"), default operation timeout
  // (which also bounds the creation of every group), backend settings.
  RootOptions root;
  // Dense axis combinations to create besides the standard ones, e.g.
  // {"tp-cp"}. Creation is collective, so every rank must pass the same.
  std::vector<std::string> extra_groups;
};

class STRATA_EXPORT World {
 public:
  // Creates the root communicator from `env` and every group of `mesh`.
  // Collective over the job. InvalidArgument when the mesh's world size is
  // not the job's.
  static absl::StatusOr<std::unique_ptr<World>> Create(const LaunchEnv& env, const Mesh& mesh,
                                                       const WorldOptions& options);
  // The same over an existing root communicator (any backend), which the
  // World takes over.
  static absl::StatusOr<std::unique_ptr<World>> FromRoot(std::unique_ptr<Communicator> root,
                                                         const Mesh& mesh,
                                                         const WorldOptions& options);

  // Destroys the group communicators, then the root (joining the backend's
  // threads). Operations still in flight fail with Aborted.
  ~World();
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  int rank() const { return root_->rank(); }
  int size() const { return root_->size(); }
  const Mesh& mesh() const { return mesh_; }
  Communicator& root() const { return *root_; }

  // The communicator of this rank's group of `axes` ("tp", "dp-cp", "ep",
  // "world" for the root). NotFound lists the groups that exist.
  absl::StatusOr<Communicator*> Group(absl::string_view axes) const;
  // The names Group() accepts, in creation order (canonical spellings).
  std::vector<std::string> GroupNames() const;

 private:
  World(std::unique_ptr<Communicator> root, Mesh mesh);

  std::unique_ptr<Communicator> root_;
  Mesh mesh_;
  // Canonical name -> communicator (shared where two names have the same
  // members).
  std::map<std::string, std::shared_ptr<Communicator>> groups_;
  std::vector<std::string> order_;
};

}  // namespace strata
