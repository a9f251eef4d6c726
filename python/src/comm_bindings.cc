// Bindings for communicators, their work, and the World (see
// include/strata/comm/communicator.h, include/strata/parallel/world.h).
//
// The raw layer: buffers arrive as (address, element count, dtype name)
// tuples that python/strata/comm.py builds from torch tensors and numpy
// arrays, so the extension needs neither torch's nor numpy's C API. Every
// operation keeps a reference to the Python objects whose memory it uses
// until it has completed; the GIL is released while operations start,
// while waiting, and while worlds are built and destroyed.
#include <pybind11/stl.h>

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "comm_access.h"
#include "group_handle.h"
#include "registry.h"
#include "status_map.h"
#include "store_handle.h"
#include "strata/comm/backend.h"
#include "strata/comm/communicator.h"
#include "strata/comm/launch_env.h"
#include "strata/parallel/world.h"

namespace py = pybind11;

namespace strata::bindings {
namespace {

// Owns what a group's communicator lives in: a World, or a communicator
// made by Split/Shrink. Groups and works hold it; destroy() ends it. The
// lock keeps destroy() from running while an operation is being started.
class Owner {
 public:
  explicit Owner(std::unique_ptr<World> world) : world_(std::move(world)) {}
  explicit Owner(std::unique_ptr<Communicator> comm) : comm_(std::move(comm)) {}

  World* world() { return world_.get(); }
  Communicator* comm() { return comm_.get(); }
  std::shared_mutex& mu() { return mu_; }
  bool alive() const { return alive_.load(); }

  // Called with the GIL released.
  void Destroy() {
    std::unique_lock<std::shared_mutex> lock(mu_);
    alive_.store(false);
    world_.reset();
    comm_.reset();
  }

  // Python objects whose memory an unfinished (or failed) operation may
  // still use, kept until it completes successfully (or forever when it
  // failed: MPI may still write into them).
  void KeepUntilDone(std::shared_ptr<Work> work, py::object keep) {
    Purge();
    inflight_.emplace_back(std::move(work), std::move(keep));
  }
  void Purge() {
    std::vector<std::pair<std::shared_ptr<Work>, py::object>> still;
    for (auto& [work, keep] : inflight_) {
      absl::StatusOr<bool> done = work->Test();
      if (done.ok() && *done) continue;
      if (!done.ok()) {
        Graveyard().append(keep);
        continue;
      }
      still.emplace_back(std::move(work), std::move(keep));
    }
    inflight_.swap(still);
  }
  void ReleaseAllToGraveyard() {
    for (auto& [work, keep] : inflight_) Graveyard().append(keep);
    inflight_.clear();
  }

  static py::list& Graveyard() {
    static py::list* graveyard = new py::list();  // lives until exit
    return *graveyard;
  }

 private:
  std::shared_mutex mu_;
  std::atomic<bool> alive_{true};
  std::unique_ptr<World> world_;
  std::unique_ptr<Communicator> comm_;
  std::vector<std::pair<std::shared_ptr<Work>, py::object>> inflight_;
};

class PyWork {
 public:
  PyWork(std::shared_ptr<Owner> owner, std::shared_ptr<Work> work, py::object keep)
      : owner_(std::move(owner)), work_(std::move(work)), keep_(std::move(keep)) {}
  ~PyWork() {
    // Never block here: hand the buffers to the owner until MPI is done.
    if (work_ != nullptr && keep_ && !keep_.is_none()) {
      absl::StatusOr<bool> done = work_->Test();
      if (!(done.ok() && *done)) owner_->KeepUntilDone(work_, std::move(keep_));
    }
  }

  // Waits in slices so that Ctrl-C reaches Python; `timeout` in seconds
  // (None: until the operation completes or fails, which its own timeout
  // bounds).
  bool Wait(std::optional<double> timeout) {
    const absl::Time deadline =
        timeout ? absl::Now() + absl::Seconds(*timeout) : absl::InfiniteFuture();
    while (true) {
      const absl::Time slice = std::min(deadline, absl::Now() + absl::Milliseconds(100));
      absl::Status s;
      {
        py::gil_scoped_release release;
        s = work_->Wait(slice);
      }
      if (s.ok()) {
        Done();
        return true;
      }
      if (s.code() == absl::StatusCode::kDeadlineExceeded) {
        absl::StatusOr<bool> done = work_->Test();
        if (done.ok() && !*done) {
          if (absl::Now() >= deadline) RaiseStatus(s, ErrorArea::kComm);
          if (PyErr_CheckSignals() != 0) throw py::error_already_set();
          continue;
        }
        if (done.ok()) {
          // It completed between the slice's end and the test: success, not
          // the slice's DeadlineExceeded (a race the demo hit under load).
          Done();
          return true;
        }
        s = done.status();
      }
      Failed();
      RaiseStatus(s, ErrorArea::kComm);
    }
  }

  bool IsCompleted() {
    absl::StatusOr<bool> done = work_->Test();
    if (!done.ok()) {
      Failed();
      RaiseStatus(done.status(), ErrorArea::kComm);
    }
    if (*done) Done();
    return *done;
  }

  std::string Describe() const { return work_->Describe(); }

 private:
  void Done() { keep_ = py::none(); }
  void Failed() {
    if (keep_ && !keep_.is_none()) Owner::Graveyard().append(keep_);
    keep_ = py::none();
  }

  std::shared_ptr<Owner> owner_;
  std::shared_ptr<Work> work_;
  py::object keep_;
};

// (address, count, dtype) for host memory; (address, count, dtype, stream)
// for a CUDA tensor, with the current torch stream (cudaStream_t as an int).
Buffer ToBuffer(const py::tuple& t) {
  if (t.size() != 3 && t.size() != 4) {
    RaiseStatus(absl::InvalidArgumentError("buffer must be (address, count, dtype[, stream])"),
                ErrorArea::kComm);
  }
  const uintptr_t address = t[0].cast<uintptr_t>();
  const size_t count = t[1].cast<size_t>();
  DataType dtype = Unwrap(ParseDataType(t[2].cast<std::string>()), ErrorArea::kComm);
  return Buffer{reinterpret_cast<void*>(address), count, dtype};
}

// The operation's options: its timeout, and for a device backend the
// stream of `buffer` (a CUDA tensor's current torch stream). The buffer's
// memory must be the communicator's.
OpOptions Opts(Communicator& c, std::optional<double> timeout, const py::tuple& buffer,
               const py::tuple& other = py::tuple()) {
  OpOptions o;
  if (timeout) o.timeout = absl::Seconds(*timeout);
  const bool cuda = buffer.size() == 4;
  if (other.size() > 0 && (other.size() == 4) != cuda) {
    RaiseStatus(absl::InvalidArgumentError(
                    absl::StrCat("group ", c.name(),
                                 ": the input and output must both be CUDA tensors or "
                                 "both be on the CPU")),
                ErrorArea::kComm);
  }
  if (cuda != (c.memory() == MemoryKind::kCuda)) {
    RaiseStatus(absl::InvalidArgumentError(
                    absl::StrCat("the ", c.backend(), " backend of group ", c.name(), " works on ",
                                 c.memory() == MemoryKind::kCuda ? "CUDA" : "CPU",
                                 " tensors; got a ", cuda ? "CUDA tensor" : "CPU tensor or array",
                                 cuda ? " (strata.init(backend='nccl') for CUDA tensors)" : "")),
                ErrorArea::kComm);
  }
  if (cuda) o.stream = reinterpret_cast<void*>(buffer[3].cast<uintptr_t>());
  return o;
}

absl::Duration Seconds(std::optional<double> s, absl::Duration fallback) {
  return s ? absl::Seconds(*s) : fallback;
}

class PyGroup {
 public:
  PyGroup(std::shared_ptr<Owner> owner, Communicator* comm)
      : owner_(std::move(owner)), comm_(comm) {}

  Communicator& comm() const {
    if (!owner_->alive()) {
      RaiseStatus(absl::FailedPreconditionError(
                      "this group's world (or communicator) was destroyed; create a new one"),
                  ErrorArea::kComm);
    }
    return *comm_;
  }
  int rank() const { return comm().rank(); }
  int size() const { return comm().size(); }
  std::string name() const { return comm().name(); }
  std::string backend() const { return std::string(comm().backend()); }
  std::string transport() const { return comm().transport(); }

  // Starts an operation with the GIL released and the owner kept alive.
  template <typename F>
  std::unique_ptr<PyWork> Start(F&& start, py::object keep) {
    Communicator& c = comm();
    owner_->Purge();
    absl::StatusOr<std::unique_ptr<Work>> work;
    {
      py::gil_scoped_release release;
      std::shared_lock<std::shared_mutex> lock(owner_->mu());
      if (!owner_->alive()) {
        work = absl::FailedPreconditionError("the group's world was destroyed");
      } else {
        work = start(c);
      }
    }
    if (!work.ok()) RaiseStatus(work.status(), ErrorArea::kComm);
    return std::make_unique<PyWork>(owner_, std::shared_ptr<Work>(std::move(work).value()),
                                    std::move(keep));
  }

  std::unique_ptr<PyGroup> Derived(absl::StatusOr<std::unique_ptr<Communicator>> made) {
    if (!made.ok()) RaiseStatus(made.status(), ErrorArea::kComm);
    if (*made == nullptr) return nullptr;
    Communicator* raw = made->get();
    return std::make_unique<PyGroup>(std::make_shared<Owner>(std::move(made).value()), raw);
  }

  std::shared_ptr<Owner> owner() const { return owner_; }

 private:
  std::shared_ptr<Owner> owner_;
  Communicator* comm_;
};

OpOptions Timeout(std::optional<double> timeout) {
  OpOptions o;
  if (timeout) o.timeout = absl::Seconds(*timeout);
  return o;
}

ReduceOp Op(const std::string& name) { return Unwrap(ParseReduceOp(name), ErrorArea::kComm); }

class PyWorld {
 public:
  explicit PyWorld(std::unique_ptr<World> world)
      : mesh_(world->mesh()), owner_(std::make_shared<Owner>(std::move(world))) {}
  ~PyWorld() { Destroy(); }

  World& world() const {
    if (!owner_->alive()) {
      RaiseStatus(absl::FailedPreconditionError("the world was destroyed"), ErrorArea::kComm);
    }
    return *owner_->world();
  }
  std::unique_ptr<PyGroup> Group(const std::string& axes) const {
    Communicator* c = Unwrap(world().Group(axes), ErrorArea::kComm);
    return std::make_unique<PyGroup>(owner_, c);
  }
  void Destroy() {
    owner_->ReleaseAllToGraveyard();
    py::gil_scoped_release release;
    owner_->Destroy();
  }
  bool alive() const { return owner_->alive(); }
  const Mesh& mesh() const { return mesh_; }

 private:
  Mesh mesh_;
  std::shared_ptr<Owner> owner_;
};

std::unique_ptr<PyWorld> InitWorld(const Mesh& mesh, const std::string& backend,
                                   std::optional<double> timeout,
                                   std::optional<std::map<std::string, std::string>> env,
                                   std::optional<PyStore> store) {
  LaunchEnv launch =
      Unwrap(env ? LaunchEnv::Detect(*env) : LaunchEnv::Detect(), ErrorArea::kLaunch);
  WorldOptions options;
  options.root.backend = backend;
  if (timeout) options.root.comm.timeout = absl::Seconds(*timeout);
  if (store) options.root.store = store->store;
  absl::StatusOr<std::unique_ptr<World>> world;
  {
    py::gil_scoped_release release;
    world = World::Create(launch, mesh, options);
  }
  if (!world.ok()) RaiseStatus(world.status(), ErrorArea::kComm);
  return std::make_unique<PyWorld>(std::move(world).value());
}

Registration reg(kOrderWorld, [](py::module_& m) {
  py::class_<PyWork>(m, "_Work")
      .def("wait", &PyWork::Wait, py::arg("timeout") = py::none())
      .def("is_completed", &PyWork::IsCompleted)
      .def("describe", &PyWork::Describe)
      .def("__repr__", [](const PyWork& w) { return "<strata.Work " + w.Describe() + ">"; });

  using B = py::tuple;
  using T = std::optional<double>;
  py::class_<PyGroup>(m, "_Group")
      .def_property_readonly("rank", &PyGroup::rank)
      .def_property_readonly("size", &PyGroup::size)
      .def_property_readonly("name", &PyGroup::name)
      .def_property_readonly("backend", &PyGroup::backend)
      .def_property_readonly("transport", &PyGroup::transport)
      .def_property_readonly(
          "memory",
          [](const PyGroup& g) { return g.comm().memory() == MemoryKind::kCuda ? "cuda" : "host"; })
      .def("allreduce",
           [](PyGroup& g, B send, B recv, const std::string& op, T timeout, py::object keep) {
             Buffer s = ToBuffer(send), r = ToBuffer(recv);
             ReduceOp o = Op(op);
             const OpOptions opts = Opts(g.comm(), timeout, send, recv);
             return g.Start([&](Communicator& c) { return c.AllReduce(s, r, o, opts); }, keep);
           })
      .def("broadcast",
           [](PyGroup& g, B buf, int root, T timeout, py::object keep) {
             Buffer b = ToBuffer(buf);
             const OpOptions opts = Opts(g.comm(), timeout, buf);
             return g.Start([&](Communicator& c) { return c.Broadcast(b, root, opts); }, keep);
           })
      .def("reduce",
           [](PyGroup& g, B send, B recv, const std::string& op, int root, T timeout,
              py::object keep) {
             Buffer s = ToBuffer(send), r = ToBuffer(recv);
             ReduceOp o = Op(op);
             const OpOptions opts = Opts(g.comm(), timeout, send, recv);
             return g.Start([&](Communicator& c) { return c.Reduce(s, r, o, root, opts); }, keep);
           })
      .def("allgather",
           [](PyGroup& g, B send, B recv, T timeout, py::object keep) {
             Buffer s = ToBuffer(send), r = ToBuffer(recv);
             const OpOptions opts = Opts(g.comm(), timeout, send, recv);
             return g.Start([&](Communicator& c) { return c.AllGather(s, r, opts); }, keep);
           })
      .def("reduce_scatter",
           [](PyGroup& g, B send, B recv, const std::string& op, T timeout, py::object keep) {
             Buffer s = ToBuffer(send), r = ToBuffer(recv);
             ReduceOp o = Op(op);
             const OpOptions opts = Opts(g.comm(), timeout, send, recv);
             return g.Start([&](Communicator& c) { return c.ReduceScatter(s, r, o, opts); }, keep);
           })
      .def("all_to_all",
           [](PyGroup& g, B send, B recv, T timeout, py::object keep) {
             Buffer s = ToBuffer(send), r = ToBuffer(recv);
             const OpOptions opts = Opts(g.comm(), timeout, send, recv);
             return g.Start([&](Communicator& c) { return c.AllToAll(s, r, opts); }, keep);
           })
      .def("all_to_all_v",
           [](PyGroup& g, B send, B recv, std::vector<size_t> send_counts,
              std::vector<size_t> recv_counts, T timeout, py::object keep) {
             Buffer s = ToBuffer(send), r = ToBuffer(recv);
             AllToAllCounts counts{std::move(send_counts), std::move(recv_counts)};
             const OpOptions opts = Opts(g.comm(), timeout, send, recv);
             return g.Start([&](Communicator& c) { return c.AllToAllV(s, r, counts, opts); }, keep);
           })
      .def("barrier",
           [](PyGroup& g, T timeout) {
             return g.Start([&](Communicator& c) { return c.Barrier(Timeout(timeout)); },
                            py::none());
           })
      .def("send",
           [](PyGroup& g, B buf, int peer, T timeout, py::object keep) {
             Buffer b = ToBuffer(buf);
             const OpOptions opts = Opts(g.comm(), timeout, buf);
             return g.Start([&](Communicator& c) { return c.Send(b, peer, opts); }, keep);
           })
      .def("recv",
           [](PyGroup& g, B buf, int peer, T timeout, py::object keep) {
             Buffer b = ToBuffer(buf);
             const OpOptions opts = Opts(g.comm(), timeout, buf);
             return g.Start([&](Communicator& c) { return c.Recv(b, peer, opts); }, keep);
           })
      .def("split",
           [](PyGroup& g, int color, int key, const std::string& name, T timeout) {
             Communicator& c = g.comm();
             CommOptions o;
             o.name = name;
             o.timeout = Seconds(timeout, o.timeout);
             absl::StatusOr<std::unique_ptr<Communicator>> made;
             {
               py::gil_scoped_release release;
               made = c.Split(color, key, o);
             }
             return g.Derived(std::move(made));
           })
      .def("shrink",
           [](PyGroup& g, std::vector<int> excluded, const std::string& name, T timeout) {
             Communicator& c = g.comm();
             CommOptions o;
             o.name = name;
             o.timeout = Seconds(timeout, o.timeout);
             absl::StatusOr<std::unique_ptr<Communicator>> made;
             {
               py::gil_scoped_release release;
               made = c.Shrink(excluded, o);
             }
             return g.Derived(std::move(made));
           })
      .def("abort",
           [](PyGroup& g) {
             Communicator& c = g.comm();
             absl::Status s;
             {
               py::gil_scoped_release release;
               s = c.Abort();
             }
             ThrowIfError(s, ErrorArea::kComm);
           })
      .def("revoke",
           [](PyGroup& g) {
             Communicator& c = g.comm();
             absl::Status s;
             {
               py::gil_scoped_release release;
               s = c.Revoke();
             }
             ThrowIfError(s, ErrorArea::kComm);
           })
      .def("async_error", [](PyGroup& g) { ThrowIfError(g.comm().AsyncError(), ErrorArea::kComm); })
      .def("destroy", [](PyGroup& g) {
        // Only groups made by split/shrink own their communicator.
        if (g.owner()->comm() == nullptr) return;
        py::gil_scoped_release release;
        g.owner()->Destroy();
      });

  py::class_<PyWorld>(m, "_World")
      .def_property_readonly("rank", [](const PyWorld& w) { return w.world().rank(); })
      .def_property_readonly("size", [](const PyWorld& w) { return w.world().size(); })
      .def_property_readonly("mesh", &PyWorld::mesh)
      .def_property_readonly("alive", &PyWorld::alive)
      .def("group", &PyWorld::Group, py::arg("axes"))
      .def("group_names", [](const PyWorld& w) { return w.world().GroupNames(); })
      .def("destroy", &PyWorld::Destroy);

  m.def("_init_world", &InitWorld, py::arg("mesh"), py::arg("backend"), py::arg("timeout"),
        py::arg("env") = py::none(), py::arg("store") = py::none());
  m.def(
      "resolve_backend",
      [](const LaunchEnv& env, const std::string& backend) {
        return Unwrap(ResolveBackend(env, backend), ErrorArea::kComm);
      },
      py::arg("env"), py::arg("backend"),
      "The backend strata.init(backend=...) picks for this launch: 'mpi', 'gloo' or 'nccl'.");
  m.def("available_backends", &AvailableBackends, "The communication backends in this build.");
});

}  // namespace

GroupRef GroupRefOf(py::handle group) {
  PyGroup* g = nullptr;
  try {
    g = py::cast<PyGroup*>(py::hasattr(group, "_raw") ? group.attr("_raw") : group);
  } catch (const py::cast_error&) {
    RaiseStatus(
        absl::InvalidArgumentError(absl::StrCat("expected a strata group, got ",
                                                py::str(py::type::of(group)).cast<std::string>())),
        ErrorArea::kComm);
  }
  if (g == nullptr) {
    RaiseStatus(absl::InvalidArgumentError("expected a strata group, got None"), ErrorArea::kComm);
  }
  GroupRef ref;
  ref.comm = &g->comm();  // raises if the world was destroyed
  std::shared_ptr<Owner> owner = g->owner();
  ref.mu = &owner->mu();
  ref.alive = [o = owner.get()] { return o->alive(); };
  ref.owner = std::move(owner);
  return ref;
}

Communicator& GroupCommunicator(py::handle group) {
  py::handle raw = group;
  if (py::hasattr(group, "_raw")) raw = group.attr("_raw");
  if (!py::isinstance<PyGroup>(raw)) {
    RaiseStatus(absl::InvalidArgumentError(absl::StrCat(
                    "expected a strata.Group (world.group(...)), got ",
                    py::str(py::type::of(group).attr("__name__")).cast<std::string>())),
                ErrorArea::kGeneric);
  }
  return raw.cast<PyGroup&>().comm();
}

}  // namespace strata::bindings
