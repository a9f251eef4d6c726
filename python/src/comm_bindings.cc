// Bindings for communicators, their work, and the World (see
// include/strata/comm/communicator.h, include/strata/parallel/world.h).
//
// The raw layer: buffers arrive as (address, element count, dtype name)
// tuples that python/strata/comm.py builds from torch tensors and numpy
// arrays, so the extension needs neither torch's nor numpy's C API. Every
// operation keeps a reference to the Python objects whose memory it uses
// until it has completed (its group's owner keeps those of failed or
// dropped operations as long as the backend may use them: see Owner); the
// GIL is released while operations start,
// while waiting, and while worlds are built, rebuilt and destroyed.
//
// A _Group is a group handle (strata/parallel/group_handle.h): a world's
// group of some axes, resolved at each call (the communicator is cached per
// world generation, so a call costs a generation check), or a communicator
// made by split/shrink that the _Group's owner holds. Every use of a
// communicator happens with the GIL released and the owner's lock shared,
// so a world cannot be destroyed or rebuilt under an operation being
// started; rebuild and destroy take the lock exclusively.
#include <pybind11/stl.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "comm_access.h"
#include "comm_keep.h"
#include "group_handle.h"
#include "registry.h"
#include "status_map.h"
#include "store_handle.h"
#include "strata/base/status.h"
#include "strata/comm/backend.h"
#include "strata/comm/communicator.h"
#include "strata/comm/launch_env.h"
#include "strata/observe/flight_recorder.h"
#include "strata/parallel/world.h"

namespace py = pybind11;

namespace strata::bindings {
namespace {

using comm_keep::Owner;
using comm_keep::PyKeep;
using comm_keep::PyWork;

// A buffer tuple read with the GIL held: (address, count, dtype) for host
// memory; (address, count, dtype, stream) for a CUDA tensor, with the
// current torch stream (cudaStream_t as an int).
struct BufferArg {
  Buffer buffer;
  bool cuda = false;
  void* stream = nullptr;
};

BufferArg ToBuffer(const py::tuple& t) {
  if (t.size() != 3 && t.size() != 4) {
    RaiseStatus(absl::InvalidArgumentError("buffer must be (address, count, dtype[, stream])"),
                ErrorArea::kComm);
  }
  BufferArg out;
  const uintptr_t address = t[0].cast<uintptr_t>();
  const size_t count = t[1].cast<size_t>();
  DataType dtype = Unwrap(ParseDataType(t[2].cast<std::string>()), ErrorArea::kComm);
  out.buffer = Buffer{reinterpret_cast<void*>(address), count, dtype};
  out.cuda = t.size() == 4;
  if (out.cuda) out.stream = reinterpret_cast<void*>(t[3].cast<uintptr_t>());
  return out;
}

// The operation's options: its timeout, and for a device backend the
// stream of `buffer` (a CUDA tensor's current torch stream). The buffers'
// memory must be the communicator's. No Python objects: runs without the
// GIL.
absl::StatusOr<OpOptions> Opts(Communicator& c, std::optional<double> timeout,
                               const BufferArg& buffer, const BufferArg* other = nullptr) {
  OpOptions o;
  if (timeout) o.timeout = absl::Seconds(*timeout);
  if (other != nullptr && other->cuda != buffer.cuda) {
    return absl::InvalidArgumentError(
        absl::StrCat("group ", c.name(),
                     ": the input and output must both be CUDA tensors or both be on the CPU"));
  }
  if (buffer.cuda != (c.memory() == MemoryKind::kCuda)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the ", c.backend(), " backend of group ", c.name(), " works on ",
                     c.memory() == MemoryKind::kCuda ? "CUDA" : "CPU", " tensors; got a ",
                     buffer.cuda ? "CUDA tensor" : "CPU tensor or array",
                     buffer.cuda ? " (strata.init(backend='nccl') for CUDA tensors)" : ""));
  }
  if (buffer.cuda) o.stream = buffer.stream;
  return o;
}

absl::Duration Seconds(std::optional<double> s, absl::Duration fallback) {
  return s ? absl::Seconds(*s) : fallback;
}

OpOptions Timeout(std::optional<double> timeout) {
  OpOptions o;
  if (timeout) o.timeout = absl::Seconds(*timeout);
  return o;
}

ReduceOp Op(const std::string& name) { return Unwrap(ParseReduceOp(name), ErrorArea::kComm); }

template <typename T>
struct IsStatusOr : std::false_type {};
template <typename T>
struct IsStatusOr<absl::StatusOr<T>> : std::true_type {};

class PyGroup {
 public:
  PyGroup(std::shared_ptr<Owner> owner, GroupHandle handle)
      : owner_(std::move(owner)), handle_(std::move(handle)) {}

  // The name the group was asked by ("dp-cp" for "cp-dp"), or the name of
  // a split/shrunk communicator.
  const std::string& name() const { return handle_.name(); }
  const GroupHandle& handle() const { return handle_; }
  std::shared_ptr<Owner> owner() const { return owner_; }

  // The communicator of the world's current generation. Owner's lock held
  // (shared), GIL released.
  absl::StatusOr<Communicator*> ResolveLocked() {
    if (!owner_->alive()) return owner_->Gone(name());
    const uint64_t generation = owner_->generation();
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (cached_ != nullptr && cached_generation_ == generation) return cached_;
    absl::StatusOr<Communicator*> comm = handle_.Resolve();
    if (!comm.ok()) {
      if (cached_generation_ != 0 && cached_generation_ != generation) {
        return internal::Annotate(
            comm.status(),
            absl::StrCat("group '", name(), "' (last used at world generation ", cached_generation_,
                         ") cannot follow the world to "
                         "generation ",
                         generation));
      }
      return comm.status();
    }
    cached_ = *comm;
    cached_generation_ = generation;
    return cached_;
  }

  // Calls fn(Communicator&) with the GIL released and the owner locked;
  // fn returns a Status or a StatusOr, whose error is raised (in `area`)
  // once the GIL is back.
  template <typename F>
  auto With(F&& fn, ErrorArea area = ErrorArea::kComm) {
    using R = std::invoke_result_t<F, Communicator&>;
    R result = [&]() -> R {
      py::gil_scoped_release release;
      std::shared_lock<std::shared_mutex> lock(owner_->mu());
      absl::StatusOr<Communicator*> comm = ResolveLocked();
      if (!comm.ok()) return comm.status();
      return fn(**comm);
    }();
    if constexpr (IsStatusOr<R>::value) {
      return Unwrap(std::move(result), area);
    } else {
      ThrowIfError(result, area);
    }
  }

  // Starts an operation with the GIL released and the owner kept alive.
  template <typename F>
  std::unique_ptr<PyWork> Start(F&& start, py::object keep) {
    owner_->Purge();
    std::unique_ptr<Work> work = With(std::forward<F>(start));
    return std::make_unique<PyWork>(owner_, std::shared_ptr<Work>(std::move(work)),
                                    std::move(keep));
  }

  std::unique_ptr<PyGroup> Derived(std::unique_ptr<Communicator> made) {
    if (made == nullptr) return nullptr;
    GroupHandle handle = GroupHandle::Fixed(made.get());
    return std::make_unique<PyGroup>(std::make_shared<Owner>(std::move(made)), std::move(handle));
  }

  // A _Group whose handle refuses layout changes (GroupHandle::Pin).
  std::unique_ptr<PyGroup> Pinned(const std::string& holder) {
    GroupHandle pinned = With([&](Communicator&) { return handle_.Pin(holder); });
    return std::make_unique<PyGroup>(owner_, std::move(pinned));
  }

 private:
  std::shared_ptr<Owner> owner_;
  const GroupHandle handle_;
  std::mutex cache_mu_;
  Communicator* cached_ = nullptr;
  uint64_t cached_generation_ = 0;
};

PyGroup& RawGroup(py::handle group) {
  py::handle raw = group;
  if (py::hasattr(group, "_raw")) raw = group.attr("_raw");
  if (raw.is_none() || !py::isinstance<PyGroup>(raw)) {
    RaiseStatus(absl::InvalidArgumentError(absl::StrCat(
                    "expected a strata.Group (world.group(...)), got ",
                    py::str(py::type::of(group).attr("__name__")).cast<std::string>())),
                ErrorArea::kComm);
  }
  return raw.cast<PyGroup&>();
}

class PyWorld {
 public:
  explicit PyWorld(std::unique_ptr<World> world)
      : mesh_(world->mesh()), owner_(std::make_shared<Owner>(std::move(world))) {}
  ~PyWorld() { Destroy(); }

  // Calls fn(World&) with the GIL released and the world locked (shared);
  // raises CommError once the world was destroyed.
  template <typename F>
  auto With(F&& fn) const {
    using R = std::invoke_result_t<F, World&>;
    std::optional<R> result;
    {
      py::gil_scoped_release release;
      std::shared_lock<std::shared_mutex> lock(owner_->mu());
      if (owner_->alive()) result.emplace(fn(*owner_->world()));
    }
    if (!result.has_value()) ThrowIfError(owner_->Gone("world"), ErrorArea::kComm);
    return std::move(*result);
  }

  // The handle of `axes`; creates the group (collectively) if it is new.
  std::unique_ptr<PyGroup> Group(const std::string& axes) const {
    GroupHandle handle = Unwrap(With([&](World& w) { return w.Handle(axes); }), ErrorArea::kComm);
    return std::make_unique<PyGroup>(owner_, std::move(handle));
  }

  // Takes over `root` (a group made by shrink or split) as the new root and
  // rebuilds the world over `mesh` (World::Rebuild).
  void Rebuild(py::handle root, const Mesh& mesh) {
    PyGroup& group = RawGroup(root);
    std::shared_ptr<Owner> from = group.owner();
    if (from->owns_world()) {
      RaiseStatus(absl::InvalidArgumentError(absl::StrCat(
                      "the new root must be a group made by shrink or split, which the world "
                      "takes over; group '",
                      group.name(), "' belongs to a world")),
                  ErrorArea::kComm);
    }
    if (!owner_->alive()) ThrowIfError(owner_->Gone("world"), ErrorArea::kComm);
    absl::Status s;
    uint64_t generation = 0;
    {
      py::gil_scoped_release release;
      std::unique_lock<std::shared_mutex> lock(owner_->mu());
      if (!owner_->alive()) {
        s = absl::FailedPreconditionError("the world was destroyed");
      } else {
        generation = owner_->world()->generation();
        std::unique_ptr<Communicator> comm =
            from->Release(absl::StrCat("it became the root of world generation ", generation + 1,
                                       "; use world.group() instead"));
        if (comm == nullptr) {
          s = absl::FailedPreconditionError(
              absl::StrCat("group '", group.name(), "' was destroyed; it cannot become the root"));
        } else {
          s = owner_->world()->Rebuild(std::move(comm), mesh);
          if (owner_->world()->generation() != generation) mesh_ = mesh;
        }
      }
    }
    ThrowIfError(s, ErrorArea::kComm);
  }

  void AbortAll() {
    py::gil_scoped_release release;
    owner_->AbortAll();
  }

  void Destroy() {
    py::gil_scoped_release release;
    {
      std::shared_lock<std::shared_mutex> lock(owner_->mu());
      if (owner_->alive()) mesh_ = owner_->world()->mesh();  // for repr afterwards
    }
    owner_->Destroy();
  }
  size_t kept() const { return owner_->kept(); }
  bool alive() const { return owner_->alive(); }
  // The current generation's mesh (the elastic layer rebuilds the World
  // from C++, past Rebuild above); the last one once destroyed.
  Mesh mesh() const {
    py::gil_scoped_release release;
    std::shared_lock<std::shared_mutex> lock(owner_->mu());
    return owner_->alive() ? owner_->world()->mesh() : mesh_;
  }
  std::shared_ptr<Owner> owner() const { return owner_; }

 private:
  Mesh mesh_;  // kept for repr after destroy; updated by Rebuild
  std::shared_ptr<Owner> owner_;
};

}  // namespace

WorldOptions InitWorldOptions(std::optional<double> timeout, std::optional<double> group_timeout,
                              std::optional<bool> trace, std::optional<std::string> trace_dir,
                              std::optional<size_t> trace_buffer,
                              std::shared_ptr<observe::OpSink> sink) {
  WorldOptions options;
  if (timeout) options.root.comm.timeout = absl::Seconds(*timeout);
  if (group_timeout) options.group_creation_timeout = absl::Seconds(*group_timeout);
  options.trace.enabled = trace;
  if (trace_dir) options.trace.dir = *trace_dir;
  if (trace_buffer) options.trace.capacity = *trace_buffer;
  // Where every communicator of the world records its operations (the
  // metrics' sink; children inherit it).
  options.root.comm.sink = std::move(sink);
  return options;
}

py::object WrapWorld(std::unique_ptr<World> world) {
  return py::cast(std::make_unique<PyWorld>(std::move(world)));
}

namespace {

std::unique_ptr<PyWorld> InitWorld(
    const Mesh& mesh, const std::string& backend, std::optional<double> timeout,
    std::optional<double> group_timeout, std::optional<std::map<std::string, std::string>> env,
    std::optional<PyStore> store, std::optional<bool> trace, std::optional<std::string> trace_dir,
    std::optional<size_t> trace_buffer, std::shared_ptr<observe::OpSink> sink, int spares) {
  LaunchEnv launch =
      Unwrap(env ? LaunchEnv::Detect(*env) : LaunchEnv::Detect(), ErrorArea::kLaunch);
  WorldOptions options =
      InitWorldOptions(timeout, group_timeout, trace, trace_dir, trace_buffer, std::move(sink));
  options.root.backend = backend;
  if (store) options.root.store = store->store;
  options.spares = spares;
  absl::StatusOr<std::unique_ptr<World>> world;
  {
    py::gil_scoped_release release;
    world = World::Create(launch, mesh, options);
  }
  if (!world.ok()) RaiseStatus(world.status(), ErrorArea::kComm);
  return std::make_unique<PyWorld>(std::move(world).value());
}

// The group operations: each reads its arguments with the GIL held, then
// starts on the resolved communicator without it.
void RegisterGroup(py::module_& m) {
  using B = py::tuple;
  using T = std::optional<double>;
  using WorkOr = absl::StatusOr<std::unique_ptr<Work>>;
  py::class_<PyGroup>(m, "_Group")
      .def_property_readonly(
          "rank",
          [](PyGroup& g) {
            return g.With([](Communicator& c) -> absl::StatusOr<int> { return c.rank(); });
          })
      .def_property_readonly(
          "size",
          [](PyGroup& g) {
            return g.With([](Communicator& c) -> absl::StatusOr<int> { return c.size(); });
          })
      .def_property_readonly("name", &PyGroup::name)
      .def_property_readonly("backend",
                             [](PyGroup& g) {
                               return g.With([](Communicator& c) -> absl::StatusOr<std::string> {
                                 return std::string(c.backend());
                               });
                             })
      .def_property_readonly("transport",
                             [](PyGroup& g) {
                               return g.With([](Communicator& c) -> absl::StatusOr<std::string> {
                                 return c.transport();
                               });
                             })
      .def_property_readonly("memory",
                             [](PyGroup& g) {
                               return g.With([](Communicator& c) -> absl::StatusOr<std::string> {
                                 return c.memory() == MemoryKind::kCuda ? "cuda" : "host";
                               });
                             })
      .def_property_readonly("follows_world",
                             [](const PyGroup& g) { return g.handle().has_world(); })
      .def("allreduce",
           [](PyGroup& g, B send, B recv, const std::string& op, T timeout, py::object keep) {
             BufferArg s = ToBuffer(send), r = ToBuffer(recv);
             ReduceOp o = Op(op);
             return g.Start(
                 [&](Communicator& c) -> WorkOr {
                   STRATA_ASSIGN_OR_RETURN(OpOptions opts, Opts(c, timeout, s, &r));
                   return c.AllReduce(s.buffer, r.buffer, o, opts);
                 },
                 keep);
           })
      .def("broadcast",
           [](PyGroup& g, B buf, int root, T timeout, py::object keep) {
             BufferArg b = ToBuffer(buf);
             return g.Start(
                 [&](Communicator& c) -> WorkOr {
                   STRATA_ASSIGN_OR_RETURN(OpOptions opts, Opts(c, timeout, b));
                   return c.Broadcast(b.buffer, root, opts);
                 },
                 keep);
           })
      .def("reduce",
           [](PyGroup& g, B send, B recv, const std::string& op, int root, T timeout,
              py::object keep) {
             BufferArg s = ToBuffer(send), r = ToBuffer(recv);
             ReduceOp o = Op(op);
             return g.Start(
                 [&](Communicator& c) -> WorkOr {
                   STRATA_ASSIGN_OR_RETURN(OpOptions opts, Opts(c, timeout, s, &r));
                   return c.Reduce(s.buffer, r.buffer, o, root, opts);
                 },
                 keep);
           })
      .def("allgather",
           [](PyGroup& g, B send, B recv, T timeout, py::object keep) {
             BufferArg s = ToBuffer(send), r = ToBuffer(recv);
             return g.Start(
                 [&](Communicator& c) -> WorkOr {
                   STRATA_ASSIGN_OR_RETURN(OpOptions opts, Opts(c, timeout, s, &r));
                   return c.AllGather(s.buffer, r.buffer, opts);
                 },
                 keep);
           })
      .def("reduce_scatter",
           [](PyGroup& g, B send, B recv, const std::string& op, T timeout, py::object keep) {
             BufferArg s = ToBuffer(send), r = ToBuffer(recv);
             ReduceOp o = Op(op);
             return g.Start(
                 [&](Communicator& c) -> WorkOr {
                   STRATA_ASSIGN_OR_RETURN(OpOptions opts, Opts(c, timeout, s, &r));
                   return c.ReduceScatter(s.buffer, r.buffer, o, opts);
                 },
                 keep);
           })
      .def("all_to_all",
           [](PyGroup& g, B send, B recv, T timeout, py::object keep) {
             BufferArg s = ToBuffer(send), r = ToBuffer(recv);
             return g.Start(
                 [&](Communicator& c) -> WorkOr {
                   STRATA_ASSIGN_OR_RETURN(OpOptions opts, Opts(c, timeout, s, &r));
                   return c.AllToAll(s.buffer, r.buffer, opts);
                 },
                 keep);
           })
      .def("all_to_all_v",
           [](PyGroup& g, B send, B recv, std::vector<size_t> send_counts,
              std::vector<size_t> recv_counts, T timeout, py::object keep) {
             BufferArg s = ToBuffer(send), r = ToBuffer(recv);
             AllToAllCounts counts{std::move(send_counts), std::move(recv_counts)};
             return g.Start(
                 [&](Communicator& c) -> WorkOr {
                   STRATA_ASSIGN_OR_RETURN(OpOptions opts, Opts(c, timeout, s, &r));
                   return c.AllToAllV(s.buffer, r.buffer, counts, opts);
                 },
                 keep);
           })
      .def("barrier",
           [](PyGroup& g, T timeout) {
             return g.Start([&](Communicator& c) -> WorkOr { return c.Barrier(Timeout(timeout)); },
                            py::none());
           })
      .def("send",
           [](PyGroup& g, B buf, int peer, T timeout, py::object keep) {
             BufferArg b = ToBuffer(buf);
             return g.Start(
                 [&](Communicator& c) -> WorkOr {
                   STRATA_ASSIGN_OR_RETURN(OpOptions opts, Opts(c, timeout, b));
                   return c.Send(b.buffer, peer, opts);
                 },
                 keep);
           })
      .def("recv",
           [](PyGroup& g, B buf, int peer, T timeout, py::object keep) {
             BufferArg b = ToBuffer(buf);
             return g.Start(
                 [&](Communicator& c) -> WorkOr {
                   STRATA_ASSIGN_OR_RETURN(OpOptions opts, Opts(c, timeout, b));
                   return c.Recv(b.buffer, peer, opts);
                 },
                 keep);
           })
      .def("split",
           [](PyGroup& g, int color, int key, const std::string& name, T timeout) {
             CommOptions o;
             o.name = name;
             o.timeout = Seconds(timeout, o.timeout);
             return g.Derived(g.With([&](Communicator& c) { return c.Split(color, key, o); }));
           })
      .def("shrink",
           [](PyGroup& g, std::vector<int> excluded, const std::string& name, T timeout) {
             CommOptions o;
             o.name = name;
             o.timeout = Seconds(timeout, o.timeout);
             return g.Derived(g.With([&](Communicator& c) { return c.Shrink(excluded, o); }));
           })
      .def("abort", [](PyGroup& g) { g.With([](Communicator& c) { return c.Abort(); }); })
      .def("revoke", [](PyGroup& g) { g.With([](Communicator& c) { return c.Revoke(); }); })
      .def("async_error",
           [](PyGroup& g) { g.With([](Communicator& c) { return c.AsyncError(); }); })
      .def("pinned", &PyGroup::Pinned, py::arg("holder"))
      .def("destroy", [](PyGroup& g) {
        // Only groups made by split/shrink own their communicator.
        if (g.owner()->owns_world()) return;
        py::gil_scoped_release release;
        g.owner()->Destroy();
      });
}

Registration reg(kOrderWorld, [](py::module_& m) {
  py::class_<PyWork>(m, "_Work")
      .def("wait", &PyWork::Wait, py::arg("timeout") = py::none())
      .def("is_completed", &PyWork::IsCompleted)
      .def("describe", &PyWork::Describe)
      .def("__repr__", [](const PyWork& w) { return "<strata.Work " + w.Describe() + ">"; });

  RegisterGroup(m);

  py::class_<PyWorld>(m, "_World")
      .def_property_readonly(
          "rank", [](const PyWorld& w) { return w.With([](World& x) { return x.rank(); }); })
      .def_property_readonly(
          "size", [](const PyWorld& w) { return w.With([](World& x) { return x.size(); }); })
      .def_property_readonly(
          "is_spare",
          [](const PyWorld& w) { return w.With([](World& x) { return x.is_spare(); }); })
      .def_property_readonly(
          "spares", [](const PyWorld& w) { return w.With([](World& x) { return x.spares(); }); })
      .def_property_readonly(
          "generation",
          [](const PyWorld& w) { return w.With([](World& x) { return x.generation(); }); })
      .def_property_readonly("mesh", &PyWorld::mesh)
      .def_property_readonly("alive", &PyWorld::alive)
      .def("status",
           [](const PyWorld& w) {
             ThrowIfError(w.With([](World& x) { return x.status(); }), ErrorArea::kComm);
           })
      .def("group", &PyWorld::Group, py::arg("axes"))
      .def("group_names",
           [](const PyWorld& w) { return w.With([](World& x) { return x.GroupNames(); }); })
      .def("rebuild", &PyWorld::Rebuild, py::arg("root"), py::arg("mesh"))
      .def("abort_all", &PyWorld::AbortAll)
      .def_property_readonly(
          "trace_dir",
          [](const PyWorld& w) { return w.With([](World& x) { return x.trace_dir(); }); })
      .def(
          "dump_trace",
          [](const PyWorld& w, const std::string& reason) {
            return Unwrap(w.With([&](World& x) { return x.DumpTrace(reason); }), ErrorArea::kComm);
          },
          py::arg("reason"))
      .def(
          "recorded_ops",
          [](const PyWorld& w, int64_t since_ns) {
            // The flight recorder's entries that ended at or after
            // `since_ns` (or have not ended), oldest first: strata.timeline
            // turns them into spans.
            const std::vector<observe::RecordedOp> ops = w.With([](World& x) {
              std::shared_ptr<observe::FlightRecorder> fr = x.flight_recorder();
              return fr != nullptr ? fr->Snapshot() : std::vector<observe::RecordedOp>{};
            });
            py::list out;
            for (const observe::RecordedOp& e : ops) {
              const observe::OpRecord& r = e.record;
              if (r.state == observe::OpState::kCompleted && r.time_completed_ns < since_ns) {
                continue;
              }
              py::dict d;
              d["group"] = r.comm != nullptr ? r.comm->name : "";
              d["backend"] = r.comm != nullptr ? r.comm->backend : "";
              d["op"] = observe::OpKindName(r.kind);
              d["state"] = observe::OpStateName(r.state);
              d["seq"] = r.collective_seq_id;
              d["created_ns"] = r.time_created_ns;
              d["started_ns"] = r.time_started_ns;
              d["completed_ns"] = r.time_completed_ns;
              d["bytes"] = (r.kind == observe::OpKind::kRecv ? r.output_count : r.input_count) *
                           DataTypeSize(r.dtype);
              d["peer"] = r.peer;
              d["ok"] = r.status.ok();
              out.append(std::move(d));
            }
            return out;
          },
          py::arg("since_ns"))
      .def(
          "request_trace_dump",
          [](const PyWorld& w, const std::string& reason) {
            return Unwrap(w.With([&](World& x) { return x.RequestTraceDump(reason); }),
                          ErrorArea::kComm);
          },
          py::arg("reason"))
      .def("destroy", &PyWorld::Destroy)
      .def("_kept", &PyWorld::kept,
           "Operations whose tensors the world keeps (failed, or dropped before they "
           "completed); for tests.");

  m.def("_init_world", &InitWorld, py::arg("mesh"), py::arg("backend"), py::arg("timeout"),
        py::arg("group_timeout") = py::none(), py::arg("env") = py::none(),
        py::arg("store") = py::none(), py::arg("trace") = py::none(),
        py::arg("trace_dir") = py::none(), py::arg("trace_buffer") = py::none(),
        py::arg("sink") = py::none(), py::arg("spares") = 0);
  m.def("_all_group_names", &World::AllGroupNames,
        "Every group name World.group accepts (canonical), 'world' first.");
  m.def(
      "_canonical_group_name",
      [](const std::string& axes) {
        return Unwrap(World::CanonicalGroupName(axes), ErrorArea::kComm);
      },
      py::arg("axes"));
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
  // Raises now if the group cannot be resolved (its world destroyed).
  g->With([](Communicator&) { return absl::OkStatus(); });
  GroupRef ref;
  std::shared_ptr<Owner> owner = g->owner();
  ref.handle = g->handle();
  ref.mu = &owner->mu();
  ref.alive = [o = owner.get()] { return o->alive(); };
  ref.owner = std::move(owner);
  return ref;
}

WorldRef WorldRefOf(py::handle world) {
  PyWorld* w = nullptr;
  try {
    w = py::cast<PyWorld*>(py::hasattr(world, "_raw") ? world.attr("_raw") : world);
  } catch (const py::cast_error&) {
    RaiseStatus(
        absl::InvalidArgumentError(absl::StrCat("expected a strata.World, got ",
                                                py::str(py::type::of(world)).cast<std::string>())),
        ErrorArea::kComm);
  }
  if (w == nullptr) {
    RaiseStatus(absl::InvalidArgumentError("expected a strata.World, got None"), ErrorArea::kComm);
  }
  std::shared_ptr<Owner> owner = w->owner();
  if (!owner->alive()) ThrowIfError(owner->Gone("world"), ErrorArea::kComm);
  WorldRef ref;
  ref.mu = &owner->mu();
  ref.alive = [o = owner.get()] { return o->alive(); };
  ref.abort_all = [o = owner.get()] { o->AbortAll(); };
  ref.world = [o = owner.get()] { return o->world(); };
  ref.owner = std::move(owner);
  return ref;
}

Communicator& GroupCommunicator(py::handle group) {
  PyGroup& g = RawGroup(group);
  Communicator* comm = g.With([](Communicator& c) -> absl::StatusOr<Communicator*> { return &c; });
  return *comm;
}

}  // namespace strata::bindings
